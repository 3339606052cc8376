//! Driving one target: streamed requests at each concurrency level and prompt length.

use crate::curves;
use crate::requests_for;
use crate::Args;
use crate::LevelReport;
use crate::PromptPoint;
use crate::PromptSet;
use crate::Sample;
use crate::TargetResult;
use crate::WARM_UP_PROMPT;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;
use futures_util::StreamExt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

/// The concurrency sweep, then the prompt-length sweep, on one target, polling its pool.
pub(crate) async fn measure_target(
    name: &str,
    url: &str,
    model_id: &str,
    prompts: &[String],
    prompt_sets: &[PromptSet],
    args: &Args,
) -> Result<TargetResult> {
    let base = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = (args.poll_ms > 0).then(|| {
        tokio::spawn(curves::poll_pool(
            url.to_string(),
            args.api_key.clone(),
            Duration::from_millis(args.poll_ms),
            base,
            stop.clone(),
        ))
    });
    let mut markers = Vec::new();
    let measured = async {
        let levels = measure(url, model_id, prompts, args, base, &mut markers).await?;
        let points = measure_prompts(url, model_id, prompt_sets, args, base, &mut markers).await;
        anyhow::Ok((levels, points))
    }
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pool = match poller {
        Some(poller) => poller.await.unwrap_or_default(),
        None => Vec::new(),
    };
    let (levels, prompts) = measured?;
    Ok(TargetResult {
        name: name.to_string(),
        levels,
        prompts,
        pool,
        markers,
    })
}

/// The prompt-length sweep: one request at a time, each prompt once.
pub(crate) async fn measure_prompts(
    url: &str,
    model_id: &str,
    sets: &[PromptSet],
    args: &Args,
    base: Instant,
    markers: &mut Vec<(f64, String)>,
) -> Vec<PromptPoint> {
    let Ok(client) = client() else {
        return Vec::new();
    };
    let key = args.api_key.as_deref();
    if !sets.is_empty() {
        // Untimed, as in measure(): lazy initialisation is not part of the first point.
        let _ = one_request(&client, url, model_id, WARM_UP_PROMPT, 4, key, true).await;
    }
    let mut points = Vec::new();
    for set in sets {
        markers.push((base.elapsed().as_secs_f64(), format!("p{}", set.tokens)));
        let mut point = PromptPoint {
            tokens: set.tokens,
            server_tokens: None,
            ttft: Vec::new(),
            decode_tok_s: Vec::new(),
            output_tokens: Vec::new(),
            failed: 0,
        };
        for prompt in &set.prompts {
            let max_tokens = args.prompt_max_tokens;
            match one_request(&client, url, model_id, prompt, max_tokens, key, true).await {
                Ok(sample) => {
                    point.ttft.push(sample.ttft);
                    point.output_tokens.push(sample.tokens);
                    if sample.tokens >= 2 && sample.end > sample.ttft {
                        point
                            .decode_tok_s
                            .push((sample.tokens - 1) as f64 / (sample.end - sample.ttft));
                    }
                    point.server_tokens = sample.prompt_tokens.or(point.server_tokens);
                }
                Err(error) => {
                    point.failed += 1;
                    eprintln!("  request failed: {error:#}");
                }
            }
        }
        eprintln!(
            "  prompt {} tokens: TTFT p50 {:.0} ms",
            set.tokens,
            stats::median(&point.ttft) * 1e3
        );
        points.push(point);
    }
    points
}

pub(crate) async fn model_id(url: &str, key: Option<&str>) -> Result<String> {
    let mut request = reqwest::Client::new().get(format!("{url}/v1/models"));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let body: serde_json::Value = request.send().await?.error_for_status()?.json().await?;
    body["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("no model listed")
}

pub(crate) async fn measure(
    url: &str,
    model_id: &str,
    prompts: &[String],
    args: &Args,
    base: Instant,
    markers: &mut Vec<(f64, String)>,
) -> Result<Vec<LevelReport>> {
    let client = client()?;
    // One untimed request warms caches and lazy initialisation.
    let _ = one_request(
        &client,
        url,
        model_id,
        WARM_UP_PROMPT,
        8,
        args.api_key.as_deref(),
        false,
    )
    .await;
    let mut reports = Vec::new();
    for &concurrency in &args.concurrency {
        let prompts = &prompts[..requests_for(args, concurrency).min(prompts.len())];
        markers.push((base.elapsed().as_secs_f64(), format!("c{concurrency}")));
        let started = Instant::now();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let lanes = (0..concurrency.max(1)).map(|_| async {
            let mut samples = Vec::new();
            loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(prompt) = prompts.get(index) else {
                    return samples;
                };
                let key = args.api_key.as_deref();
                let max_tokens = args.max_tokens;
                samples.push(
                    one_request(&client, url, model_id, prompt, max_tokens, key, false).await,
                );
            }
        });
        let samples: Vec<Result<Sample>> = futures_util::future::join_all(lanes)
            .await
            .into_iter()
            .flatten()
            .collect();
        let wall = started.elapsed().as_secs_f64();
        let mut report = LevelReport {
            concurrency,
            requests: samples.len(),
            failed: 0,
            wall,
            tokens: 0,
            ttft: Vec::new(),
            itl: Vec::new(),
        };
        for sample in samples {
            match sample {
                Ok(sample) => {
                    report.tokens += sample.tokens;
                    report.ttft.push(sample.ttft);
                    report.itl.extend(sample.gaps);
                }
                Err(error) => {
                    report.failed += 1;
                    eprintln!("  request failed: {error:#}");
                }
            }
        }
        eprintln!(
            "  concurrency {concurrency}: {:.1} output tok/s, TTFT p50 {:.0} ms",
            report.tokens as f64 / wall,
            stats::percentile(&report.ttft, 50.0) * 1e3
        );
        reports.push(report);
    }
    Ok(reports)
}

pub(crate) async fn one_request(
    client: &reqwest::Client,
    url: &str,
    model_id: &str,
    prompt: &str,
    max_tokens: usize,
    key: Option<&str>,
    usage: bool,
) -> Result<Sample> {
    let mut body = serde_json::json!({
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
    if usage {
        body["stream_options"] = serde_json::json!({ "include_usage": true });
    }
    let started = Instant::now();
    let mut request = client.post(format!("{url}/v1/completions")).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    if !response.status().is_success() {
        bail!("HTTP {}: {}", response.status(), response.text().await?);
    }
    let mut stream = response.bytes_stream();
    let mut buffer = Vec::new();
    let mut times = Vec::new();
    let mut prompt_tokens = None;
    while let Some(bytes) = stream.next().await {
        buffer.extend_from_slice(&bytes?);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let chunk: serde_json::Value = serde_json::from_str(data)?;
                if let Some(n) = chunk["usage"]["prompt_tokens"].as_u64() {
                    prompt_tokens = Some(n as usize);
                }
                let text = chunk["choices"][0]["text"].as_str().unwrap_or("");
                if !text.is_empty() {
                    times.push(started.elapsed().as_secs_f64());
                }
            }
        }
    }
    let Some(&ttft) = times.first() else {
        bail!("no tokens streamed");
    };
    Ok(Sample {
        ttft,
        end: times.last().copied().unwrap_or(ttft),
        gaps: times.windows(2).map(|w| w[1] - w[0]).collect(),
        tokens: times.len(),
        prompt_tokens,
    })
}

/// The load generator's client: a fresh connection per request. A kept-alive one can be closed
/// by the server just as the next request goes out (llama-server closes each after a few
/// requests), which fails that request for a reason no user of a real client would see.
pub(crate) fn client() -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(0)
        .build()?)
}
