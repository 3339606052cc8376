//! Prefix-heavy workloads, where a prefix cache decides the speed: `--workload chat` (many
//! conversations at once, each a long document then `--turns` short questions, the whole
//! history resent every turn) and `--workload shared-prefix` (every request one long system
//! prompt plus its own short question). Each spawned target runs them in turn, `--rounds`
//! times alternating (serve, serve-nocache, serve, ...), and the report gives medians over
//! rounds: output tokens/s, TTFT p50 of first turns and of later ones, and each target beside
//! its `-nocache` twin (the same server with `--no-prefix-cache`).

use crate::measure::client;
use crate::server::Server;
use crate::Args;
use anyhow::{bail, Result};
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::time::Instant;

/// Which requests the load generator sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Independent prompts of random words (--prompt-words), each its own prefix.
    Mix,
    /// --concurrency conversations at a time: a --context-words document, then --turns
    /// questions, each request carrying the whole history so far.
    Chat,
    /// One --context-words system prompt shared by every request, then a ~64-word question.
    SharedPrefix,
}

/// What one target did at one concurrency level in one round.
#[derive(Default, Clone)]
struct Round {
    tokens: usize,
    wall: f64,
    failed: usize,
    /// TTFT of first turns (chat) or of every request (shared-prefix).
    first_ttft: Vec<f64>,
    /// TTFT of the second turn on (chat only).
    later_ttft: Vec<f64>,
    prompt_tokens: Vec<usize>,
    cached_tokens: Vec<usize>,
}

/// One chat message.
#[derive(Clone)]
struct Message {
    role: &'static str,
    content: String,
}

/// One streamed chat answer.
struct Answer {
    ttft: f64,
    text: String,
    tokens: usize,
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
}

pub(crate) fn run_workload(args: &Args, runtime: &tokio::runtime::Runtime) -> Result<()> {
    let targets: Vec<String> = if args.spawn.is_empty() {
        ["serve", "serve-nocache", "unified", "unified-nocache"]
            .map(String::from)
            .to_vec()
    } else {
        args.spawn.clone()
    };
    // (target, concurrency) -> one Round per round.
    let mut rounds: BTreeMap<(String, usize), Vec<Round>> = BTreeMap::new();
    for round in 0..args.rounds.max(1) {
        for name in &targets {
            let server = Server::start(name, args, slot_context(args))?;
            eprintln!("== round {} {name}: {}", round + 1, server.description);
            for &concurrency in &args.concurrency {
                let measured = runtime.block_on(measure(args, &server, concurrency, round))?;
                eprintln!(
                    "  concurrency {concurrency}: {:.1} output tok/s, TTFT p50 first {:.0} ms, \
                     later {:.0} ms, {} failed",
                    measured.tokens as f64 / measured.wall,
                    stats::median(&measured.first_ttft) * 1e3,
                    stats::median(&measured.later_ttft) * 1e3,
                    measured.failed
                );
                rounds
                    .entry((name.clone(), concurrency))
                    .or_default()
                    .push(measured);
            }
        }
    }
    print_report(args, &targets, &rounds);
    Ok(())
}

/// A llama-cpp slot holds the longest conversation: the document, every turn and its answer.
fn slot_context(args: &Args) -> usize {
    let words_per_turn = 64 + args.max_tokens;
    (2 * (args.context_words + args.turns * words_per_turn)).max(2048)
}

async fn measure(args: &Args, server: &Server, concurrency: usize, round: usize) -> Result<Round> {
    let client = client()?;
    let seed = args.seed ^ (round as u64) << 40 ^ (concurrency as u64) << 20;
    // Untimed: lazy initialisation is not part of the first request.
    let warm_up = vec![Message {
        role: "user",
        content: "Warm-up request: reply with one short sentence.".into(),
    }];
    let _ = chat(&client, server, args, &warm_up).await;
    let started = Instant::now();
    let lanes: Vec<_> = (0..concurrency.max(1))
        .map(|lane| {
            let client = &client;
            async move {
                match args.workload {
                    Workload::Chat => conversation(client, server, args, seed, lane).await,
                    _ => shared_prefix(client, server, args, seed, lane, concurrency).await,
                }
            }
        })
        .collect();
    let lanes = futures_util::future::join_all(lanes).await;
    let mut total = Round {
        wall: started.elapsed().as_secs_f64(),
        ..Round::default()
    };
    for lane in lanes {
        total.tokens += lane.tokens;
        total.failed += lane.failed;
        total.first_ttft.extend(lane.first_ttft);
        total.later_ttft.extend(lane.later_ttft);
        total.prompt_tokens.extend(lane.prompt_tokens);
        total.cached_tokens.extend(lane.cached_tokens);
    }
    Ok(total)
}

/// One conversation: the document, then --turns questions, each sent with the whole history.
async fn conversation(
    client: &reqwest::Client,
    server: &Server,
    args: &Args,
    seed: u64,
    lane: usize,
) -> Round {
    let mut rng = stats::SplitMix64::new(seed ^ (lane as u64 + 1).wrapping_mul(0x9e37));
    let mut history = vec![Message {
        role: "system",
        content: format!(
            "Answer questions about this document.\n{}",
            words(&mut rng, args.context_words)
        ),
    }];
    let mut round = Round::default();
    for turn in 0..args.turns.max(1) {
        history.push(Message {
            role: "user",
            content: format!("Question {}: {}?", turn + 1, words(&mut rng, 24)),
        });
        match chat(client, server, args, &history).await {
            Ok(answer) => {
                round.record(&answer, turn == 0);
                history.push(Message {
                    role: "assistant",
                    content: answer.text,
                });
            }
            Err(error) => {
                eprintln!("  request failed: {error:#}");
                round.failed += 1;
                return round;
            }
        }
    }
    round
}

/// `requests / concurrency` requests of one lane, each the shared system prompt then a
/// question of its own.
async fn shared_prefix(
    client: &reqwest::Client,
    server: &Server,
    args: &Args,
    seed: u64,
    lane: usize,
    concurrency: usize,
) -> Round {
    // The same system prompt for every lane and request of this round.
    let mut shared_rng = stats::SplitMix64::new(seed);
    let system = format!(
        "You are a helpful assistant. Follow these house rules.\n{}",
        words(&mut shared_rng, args.context_words)
    );
    let mut rng = stats::SplitMix64::new(seed ^ (lane as u64 + 1).wrapping_mul(0x51ed));
    let mut round = Round::default();
    for _ in 0..args.requests.max(concurrency).div_ceil(concurrency.max(1)) {
        let messages = vec![
            Message {
                role: "system",
                content: system.clone(),
            },
            Message {
                role: "user",
                content: format!("{}?", words(&mut rng, 64)),
            },
        ];
        match chat(client, server, args, &messages).await {
            Ok(answer) => round.record(&answer, true),
            Err(error) => {
                eprintln!("  request failed: {error:#}");
                round.failed += 1;
            }
        }
    }
    round
}

impl Round {
    fn record(&mut self, answer: &Answer, first: bool) {
        self.tokens += answer.tokens;
        if first {
            self.first_ttft.push(answer.ttft);
        } else {
            self.later_ttft.push(answer.ttft);
        }
        self.prompt_tokens.extend(answer.prompt_tokens);
        self.cached_tokens.extend(answer.cached_tokens);
    }
}

/// `count` random words (a fixed vocabulary the tokenizer reads as about a token each).
fn words(rng: &mut stats::SplitMix64, count: usize) -> String {
    const WORDS: &[&str] = &[
        "river", "mountain", "engine", "garden", "history", "signal", "copper", "market", "winter",
        "lantern", "harbor", "theory", "orchard", "circuit", "planet", "library", "teacher",
        "bridge", "storm", "village", "algebra", "violin", "desert", "factory", "window", "forest",
        "silver", "doctor", "number", "summer", "island", "machine",
    ];
    let picked: Vec<&str> = (0..count).map(|_| WORDS[rng.below(WORDS.len())]).collect();
    picked.join(" ")
}

/// Sends `messages` to `/v1/chat/completions`, streamed, and reads the answer.
async fn chat(
    client: &reqwest::Client,
    server: &Server,
    args: &Args,
    messages: &[Message],
) -> Result<Answer> {
    let messages: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let body = serde_json::json!({
        "model": server.model_id,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let mut request = client
        .post(format!("{}/v1/chat/completions", server.url))
        .json(&body);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    if !response.status().is_success() {
        bail!("HTTP {}: {}", response.status(), response.text().await?);
    }
    let mut stream = response.bytes_stream();
    let mut buffer = Vec::new();
    let mut answer = Answer {
        ttft: 0.0,
        text: String::new(),
        tokens: 0,
        prompt_tokens: None,
        cached_tokens: None,
    };
    while let Some(bytes) = stream.next().await {
        buffer.extend_from_slice(&bytes?);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    continue;
                }
                let chunk: serde_json::Value = serde_json::from_str(data)?;
                let usage = &chunk["usage"];
                if let Some(n) = usage["prompt_tokens"].as_u64() {
                    answer.prompt_tokens = Some(n as usize);
                }
                if let Some(n) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
                    answer.cached_tokens = Some(n as usize);
                }
                let text = chunk["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap_or("");
                if !text.is_empty() {
                    if answer.tokens == 0 {
                        answer.ttft = started.elapsed().as_secs_f64();
                    }
                    answer.tokens += 1;
                    answer.text.push_str(text);
                }
            }
        }
    }
    if answer.tokens == 0 {
        bail!("no tokens streamed");
    }
    Ok(answer)
}

fn print_report(args: &Args, targets: &[String], rounds: &BTreeMap<(String, usize), Vec<Round>>) {
    let kind = match args.workload {
        Workload::Chat => format!(
            "chat: a {}-word document, then {} questions of 24 words",
            args.context_words, args.turns
        ),
        _ => format!(
            "shared-prefix: a {}-word system prompt, then a 64-word question; {} requests",
            args.context_words, args.requests
        ),
    };
    println!(
        "\n{kind}; max_tokens {}, seed {}, {} threads, {} round(s), medians over rounds\n",
        args.max_tokens,
        args.seed,
        args.model.threads(),
        args.rounds.max(1)
    );
    println!(
        "| server | concurrency | output tok/s | TTFT p50 first ms | TTFT p50 later ms | \
         prompt tokens p50 | cached tokens p50 | vs -nocache: tok/s | TTFT (later) | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let summary = |name: &str, concurrency: usize| {
        rounds.get(&(name.to_string(), concurrency)).map(|rounds| {
            let rate: Vec<f64> = rounds.iter().map(|r| r.tokens as f64 / r.wall).collect();
            let first: Vec<f64> = rounds
                .iter()
                .map(|r| stats::median(&r.first_ttft))
                .collect();
            // Shared-prefix requests are all first turns: their TTFT stands in.
            let later: Vec<f64> = rounds
                .iter()
                .map(|r| match r.later_ttft.is_empty() {
                    true => stats::median(&r.first_ttft),
                    false => stats::median(&r.later_ttft),
                })
                .collect();
            (
                stats::median(&rate),
                stats::median(&first),
                stats::median(&later),
            )
        })
    };
    for name in targets {
        for &concurrency in &args.concurrency {
            let Some(rounds_here) = rounds.get(&(name.clone(), concurrency)) else {
                continue;
            };
            let (rate, first, later) = summary(name, concurrency).expect("present");
            let twin = summary(&format!("{name}-nocache"), concurrency);
            let (vs_rate, vs_later) = twin.map_or(("-".into(), "-".into()), |(r, _, l)| {
                (
                    format!("{:.2}×", rate / r),
                    format!("{:.1}× lower", l / later),
                )
            });
            let all = |pick: fn(&Round) -> &Vec<usize>| -> f64 {
                let values: Vec<f64> = rounds_here
                    .iter()
                    .flat_map(|r| pick(r).iter().map(|&v| v as f64))
                    .collect();
                stats::median(&values)
            };
            let failed: usize = rounds_here.iter().map(|r| r.failed).sum();
            println!(
                "| {name} | {concurrency} | {rate:.1} | {:.0} | {:.0} | {:.0} | {:.0} | \
                 {vs_rate} | {vs_later} | {failed} |",
                first * 1e3,
                later * 1e3,
                all(|r| &r.prompt_tokens),
                all(|r| &r.cached_tokens),
            );
        }
    }
}
