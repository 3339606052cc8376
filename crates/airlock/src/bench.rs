//! `airlock bench`: a load generator for any OpenAI-compatible endpoint. It sends a fixed-seed
//! mix of prompts at each concurrency level, streams every answer, and reports output
//! tokens/s, TTFT and inter-token latency (p50/p99).
//!
//! It can start the servers it compares, one after the other on the same machine so they never
//! compete for cores: `airlock serve`, `airlock unified` (this binary) and llama.cpp's server
//! from the `llama-cpp-python` package, all on the same model file and thread count.

use crate::model_path::ModelArgs;
use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Servers to start and measure in turn: serve, unified, llama-cpp (comma-separated)
    /// [default: all three, unless --url is given]
    #[arg(long, value_delimiter = ',')]
    spawn: Vec<String>,
    /// Measure a running endpoint, as NAME=URL (e.g. vllm=http://host:8000); repeatable
    #[arg(long)]
    url: Vec<String>,
    /// Concurrency levels (requests in flight)
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
    /// Requests per concurrency level (at least 2 × the level is sensible)
    #[arg(long, default_value_t = 24)]
    requests: usize,
    /// max_tokens per request
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Prompt lengths in words, as MIN-MAX; each request draws one with the seed
    #[arg(long, default_value = "16-64")]
    prompt_words: String,
    /// Seed of the prompt mix (same seed, same prompts for every server)
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// API key sent as a bearer token
    #[arg(long, env = "AIRLOCK_BENCH_KEY")]
    api_key: Option<String>,
    /// Port for spawned servers
    #[arg(long, default_value_t = 18500)]
    port: u16,
    /// Guard-overhead mode: two `airlock` binaries, GUARDED,UNGUARDED; each runs `serve` in
    /// turn (A B A B ...) at the first --concurrency level, and the report gives the
    /// throughput and p99 inter-token latency difference with a 95% confidence interval
    #[arg(long, value_delimiter = ',', num_args = 1)]
    ab: Vec<PathBuf>,
    /// Pairs of runs in --ab mode
    #[arg(long, default_value_t = 10)]
    pairs: usize,
    #[command(flatten)]
    model: ModelArgs,
}

/// One measured request.
struct Sample {
    ttft: f64,
    gaps: Vec<f64>,
    tokens: usize,
}

struct LevelReport {
    concurrency: usize,
    requests: usize,
    failed: usize,
    wall: f64,
    tokens: usize,
    ttft: Vec<f64>,
    itl: Vec<f64>,
}

pub fn run(args: Args) -> Result<()> {
    let (min_words, max_words) = parse_range(&args.prompt_words)?;
    let prompts = prompt_mix(args.seed, args.requests, min_words, max_words);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    if !args.ab.is_empty() {
        return run_ab(&args, &prompts, &runtime);
    }
    let mut results: Vec<(String, Vec<LevelReport>)> = Vec::new();
    let spawned: Vec<String> = if args.spawn.is_empty() && args.url.is_empty() {
        ["serve", "unified", "llama-cpp"].map(String::from).to_vec()
    } else {
        args.spawn.clone()
    };
    for name in &spawned {
        let server = Server::start(name, &args)?;
        eprintln!("== {name}: {}", server.description);
        let reports = runtime.block_on(measure(&server.url, &server.model_id, &prompts, &args))?;
        results.push((name.clone(), reports));
        drop(server);
    }
    for target in &args.url {
        let (name, url) = target.split_once('=').context("--url takes NAME=URL")?;
        let url = url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        let model_id = runtime.block_on(model_id(&url, args.api_key.as_deref()))?;
        eprintln!("== {name}: {url} ({model_id})");
        let reports = runtime.block_on(measure(&url, &model_id, &prompts, &args))?;
        results.push((name.to_string(), reports));
    }
    print_table(&results, &args);
    Ok(())
}

fn parse_range(text: &str) -> Result<(usize, usize)> {
    let (low, high) = text
        .split_once('-')
        .context("--prompt-words takes MIN-MAX")?;
    let (low, high): (usize, usize) = (low.parse()?, high.parse()?);
    if low == 0 || low > high {
        bail!("--prompt-words needs 1 <= MIN <= MAX");
    }
    Ok((low, high))
}

/// Prompts of random words (fixed seed), each asking for a long answer.
fn prompt_mix(seed: u64, count: usize, min_words: usize, max_words: usize) -> Vec<String> {
    const WORDS: &[&str] = &[
        "river", "mountain", "engine", "garden", "history", "signal", "copper", "market", "winter",
        "lantern", "harbor", "theory", "orchard", "circuit", "planet", "library", "teacher",
        "bridge", "storm", "village", "algebra", "violin", "desert", "factory",
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|_| {
            let words = min_words + (next() as usize) % (max_words - min_words + 1);
            let body: Vec<&str> = (0..words)
                .map(|_| WORDS[(next() as usize) % WORDS.len()])
                .collect();
            format!(
                "Notes: {}.\nWrite a long, detailed story that uses these notes:\n",
                body.join(" ")
            )
        })
        .collect()
}

struct Server {
    child: Child,
    url: String,
    model_id: String,
    description: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `binary serve`, for the A/B guard comparison.
    fn start_serve(binary: &Path, args: &Args) -> Result<Server> {
        let model = args.model.resolve_model()?;
        let threads = args.model.threads().to_string();
        let port = args.port.to_string();
        let child = Command::new(binary)
            .args(["serve", "--port", &port, "--threads", &threads])
            .arg("--model")
            .arg(&model)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            model_id: crate::serve::DEFAULT_MODEL_NAME.to_string(),
            description: binary.display().to_string(),
        };
        server.wait_ready("serve", args.api_key.as_deref())?;
        Ok(server)
    }

    fn start(name: &str, args: &Args) -> Result<Server> {
        let model = args.model.resolve_model()?;
        let threads = args.model.threads().to_string();
        let port = args.port.to_string();
        let url = format!("http://127.0.0.1:{port}");
        let (mut command, model_id) = match name {
            "serve" | "unified" => {
                let mut command = Command::new(std::env::current_exe()?);
                command.args([name, "--port", &port, "--threads", &threads]);
                command.arg("--model").arg(&model);
                (command, crate::serve::DEFAULT_MODEL_NAME.to_string())
            }
            "llama-cpp" => {
                let mut command = Command::new("python3");
                command.args(["-m", "llama_cpp.server", "--port", &port]);
                command.args([
                    "--n_threads",
                    &threads,
                    "--n_ctx",
                    "8192",
                    "--n_batch",
                    "512",
                ]);
                command.arg("--model").arg(&model);
                command.args(["--model_alias", "llama-cpp"]);
                // By default a new request interrupts the one running; we want them served.
                command.args(["--interrupt_requests", "False"]);
                (command, "llama-cpp".to_string())
            }
            other => bail!("unknown server '{other}' (serve, unified, llama-cpp)"),
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let server = Server {
            child,
            url,
            model_id,
            description: format!("{name} on port {port}, {threads} threads"),
        };
        server.wait_ready(name, args.api_key.as_deref())?;
        Ok(server)
    }

    fn wait_ready(&self, name: &str, key: Option<&str>) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        while Instant::now() < deadline {
            if runtime.block_on(model_id(&self.url, key)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "{name} did not come up at {} (for llama-cpp: pip install \
             'llama-cpp-python[server]==0.3.36')",
            self.url
        )
    }
}

async fn model_id(url: &str, key: Option<&str>) -> Result<String> {
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

async fn measure(
    url: &str,
    model_id: &str,
    prompts: &[String],
    args: &Args,
) -> Result<Vec<LevelReport>> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    // One untimed request warms caches and lazy initialisation.
    let _ = one_request(
        &client,
        url,
        model_id,
        &prompts[0],
        8,
        args.api_key.as_deref(),
    )
    .await;
    let mut reports = Vec::new();
    for &concurrency in &args.concurrency {
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
                samples
                    .push(one_request(&client, url, model_id, prompt, args.max_tokens, key).await);
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
            percentile(&mut report.ttft.clone(), 50.0) * 1e3
        );
        reports.push(report);
    }
    Ok(reports)
}

async fn one_request(
    client: &reqwest::Client,
    url: &str,
    model_id: &str,
    prompt: &str,
    max_tokens: usize,
    key: Option<&str>,
) -> Result<Sample> {
    let body = serde_json::json!({
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
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
        gaps: times.windows(2).map(|w| w[1] - w[0]).collect(),
        tokens: times.len(),
    })
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    values[rank]
}

fn print_table(results: &[(String, Vec<LevelReport>)], args: &Args) {
    let peer = results.iter().find(|(name, _)| name == "llama-cpp");
    println!(
        "\n{} requests per level, max_tokens {}, prompts {} words, seed {}, {} threads\n",
        args.requests,
        args.max_tokens,
        args.prompt_words,
        args.seed,
        args.model.threads()
    );
    println!(
        "| server | concurrency | output tok/s | vs llama-cpp | TTFT p50 ms | TTFT p99 ms | \
         ITL p50 ms | ITL p99 ms | tokens/request | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (name, reports) in results {
        for report in reports {
            let rate = report.tokens as f64 / report.wall;
            let ratio = peer
                .and_then(|(_, levels)| levels.iter().find(|l| l.concurrency == report.concurrency))
                .map(|l| rate / (l.tokens as f64 / l.wall))
                .map_or("-".to_string(), |r| format!("{r:.2}×"));
            let mut ttft = report.ttft.clone();
            let mut itl = report.itl.clone();
            println!(
                "| {name} | {} | {rate:.1} | {ratio} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {} |",
                report.concurrency,
                percentile(&mut ttft, 50.0) * 1e3,
                percentile(&mut ttft, 99.0) * 1e3,
                percentile(&mut itl, 50.0) * 1e3,
                percentile(&mut itl, 99.0) * 1e3,
                report.tokens as f64 / (report.requests - report.failed).max(1) as f64,
                report.failed,
            );
        }
    }
}

/// Guarded vs unguarded, alternating, one concurrency level: per-pair differences and their
/// mean with a 95% confidence interval (Student's t over the pairs).
fn run_ab(args: &Args, prompts: &[String], runtime: &tokio::runtime::Runtime) -> Result<()> {
    let [guarded, unguarded] = args.ab.as_slice() else {
        bail!("--ab takes two binaries: GUARDED,UNGUARDED");
    };
    if args.pairs < 2 {
        bail!("--pairs must be at least 2 for a confidence interval");
    }
    let concurrency = args.concurrency.first().copied().unwrap_or(8);
    let level = Args {
        concurrency: vec![concurrency],
        ..args.clone()
    };
    let mut throughput_change = Vec::new();
    let mut p99_change_ms = Vec::new();
    for pair in 0..args.pairs {
        let mut measured = Vec::new();
        for binary in [guarded, unguarded] {
            let server = Server::start_serve(binary, args)?;
            let reports =
                runtime.block_on(measure(&server.url, &server.model_id, prompts, &level))?;
            drop(server);
            let report = &reports[0];
            if report.failed > 0 {
                bail!("{} failed {} requests", binary.display(), report.failed);
            }
            let mut itl = report.itl.clone();
            measured.push((
                report.tokens as f64 / report.wall,
                percentile(&mut itl, 99.0),
            ));
        }
        let (a, b) = (measured[0], measured[1]);
        // Positive = the guards cost throughput (unguarded faster) / latency (guarded slower).
        throughput_change.push((b.0 - a.0) / b.0 * 100.0);
        p99_change_ms.push((a.1 - b.1) * 1e3);
        eprintln!(
            "pair {}: guarded {:.1} tok/s p99 ITL {:.1} ms | unguarded {:.1} tok/s p99 ITL {:.1} ms",
            pair + 1,
            a.0,
            a.1 * 1e3,
            b.0,
            b.1 * 1e3
        );
    }
    let (mean, half) = mean_and_ci95(&throughput_change);
    let (p99_mean, p99_half) = mean_and_ci95(&p99_change_ms);
    println!(
        "\nguarded = {}\nunguarded = {}\n{} pairs, concurrency {concurrency}, {} requests of \
         max_tokens {} per run\nthroughput cost of the guards: {mean:+.2}% (95% CI {:+.2}% .. \
         {:+.2}%)\np99 inter-token latency cost: {p99_mean:+.2} ms (95% CI {:+.2} .. {:+.2} ms)",
        guarded.display(),
        unguarded.display(),
        args.pairs,
        args.requests,
        args.max_tokens,
        mean - half,
        mean + half,
        p99_mean - p99_half,
        p99_mean + p99_half,
    );
    Ok(())
}

/// Mean and the half-width of its 95% confidence interval (two-sided Student's t).
fn mean_and_ci95(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    // t(0.975, df) for df = 1..30; beyond, the normal 1.96.
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let df = values.len() - 1;
    let t = T.get(df.wrapping_sub(1)).copied().unwrap_or(1.96);
    (mean, t * (variance / n).sqrt())
}

#[cfg(test)]
mod tests {
    use super::mean_and_ci95;

    #[test]
    fn confidence_interval_matches_a_worked_example() {
        // Values 1..=5: mean 3, sample sd 1.5811, se 0.7071, t(4) = 2.776 -> half 1.963.
        let (mean, half) = mean_and_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!((mean - 3.0).abs() < 1e-12);
        assert!((half - 1.963).abs() < 1e-3, "{half}");
    }
}
