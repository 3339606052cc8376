//! `airlock bench`: a load generator for any OpenAI-compatible endpoint. It sends a fixed-seed
//! mix of prompts at each concurrency level, streams every answer, and reports output
//! tokens/s, TTFT and inter-token latency (p50/p99).
//!
//! It can start the servers it compares, one after the other on the same machine so they never
//! compete for cores: `airlock serve`, `airlock unified` (this binary) and llama.cpp's own
//! `llama-server` with a parallel slot per request in flight, all on the same model file and
//! thread count.
//!
//! Scaling curves (`--sweep`, see `bench_curves.rs`): tokens/s and TTFT vs concurrency, TTFT vs
//! prompt length (prompts of exact token counts), the KV transfer's time vs tokens beside
//! memcpy bandwidth, and each airlock target's pool occupancy over time from its `/metrics`.
//! `--plot DIR` draws them as PNGs (`bench_plot.rs`) and writes the raw figures as JSON.

use crate::ab::run_ab;
use crate::charts::write_charts;
use crate::machine::Machine;
use crate::machine::ModelFacts;
use crate::measure::measure_target;
use crate::measure::model_id;
use crate::prompts::parse_range;
use crate::prompts::prompt_mix;
use crate::prompts::prompt_sets;
use crate::report_json::report_json;
use crate::report_json::results_from_json;
use crate::server::Server;
use crate::tables::print_prompt_table;
use crate::tables::print_table;
use crate::tables::print_transfer_table;

mod ab;
mod charts;
mod curves;
mod machine;
mod measure;
pub mod model_speed;
mod plot;
mod prompts;
mod report_json;
mod server;
mod tables;
#[cfg(test)]
mod tests;
mod workloads;

pub use workloads::Workload;

use crate::curves::{PoolSample, PromptLength, Sweeps, TransferReport};
use crate::plot::{Axis, Chart, Legend, Scale, Series, Style};
use anyhow::{Context, Result};
use model_args::ModelArgs;
use std::path::PathBuf;

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Servers to start and measure in turn: serve, unified, llama-cpp (llama.cpp's own
    /// llama-server, one slot per request in flight; see --llama-server), serve-tcp (serve with
    /// --kv-transport tcp), serve-nocache and unified-nocache (with --no-prefix-cache),
    /// comma-separated, or none [default: serve,
    /// unified and llama-cpp, unless --url is given; with --workload chat or shared-prefix:
    /// serve, serve-nocache, unified, unified-nocache]
    #[arg(long, env = "AIRLOCK_BENCH_SPAWN", value_delimiter = ',')]
    pub(crate) spawn: Vec<String>,
    /// Measure a running endpoint, as NAME=URL (e.g. vllm=http://host:8000); repeatable
    #[arg(long, env = "AIRLOCK_BENCH_URL")]
    pub(crate) url: Vec<String>,
    /// Concurrency levels (requests in flight)
    #[arg(
        long,
        env = "AIRLOCK_BENCH_CONCURRENCY",
        value_delimiter = ',',
        default_value = "1,8"
    )]
    pub(crate) concurrency: Vec<usize>,
    /// Requests per concurrency level (raised to 2 × the level where that is more)
    #[arg(long, env = "AIRLOCK_BENCH_REQUESTS", default_value_t = 24)]
    pub(crate) requests: usize,
    /// max_tokens per request
    #[arg(long, env = "AIRLOCK_BENCH_MAX_TOKENS", default_value_t = 128)]
    pub(crate) max_tokens: usize,
    /// Prompt lengths in words, as MIN-MAX; each request draws one with the seed
    #[arg(long, env = "AIRLOCK_BENCH_PROMPT_WORDS", default_value = "16-64")]
    pub(crate) prompt_words: String,
    /// Seed of the prompt mix (same seed, same prompts for every server)
    #[arg(long, env = "AIRLOCK_BENCH_SEED", default_value_t = 1)]
    pub(crate) seed: u64,
    /// API key sent as a bearer token
    #[arg(long, env = "AIRLOCK_BENCH_KEY")]
    pub(crate) api_key: Option<String>,
    /// Port for spawned servers
    #[arg(long, env = "AIRLOCK_BENCH_PORT", default_value_t = 18500)]
    pub(crate) port: u16,
    /// Guard-overhead mode: two `airlock` binaries, GUARDED,UNGUARDED; each runs `serve` in
    /// turn (A B A B ...) at the first --concurrency level, and the report gives the
    /// throughput and p99 inter-token latency difference with a 95% confidence interval
    #[arg(long, env = "AIRLOCK_BENCH_AB", value_delimiter = ',', num_args = 1)]
    pub(crate) ab: Vec<PathBuf>,
    /// Pairs of runs in --ab mode
    #[arg(long, env = "AIRLOCK_BENCH_PAIRS", default_value_t = 10)]
    pub(crate) pairs: usize,
    /// Scaling sweep, KEY=V1,V2,... (repeatable): concurrency=1,2,4,8,16,32 (replaces
    /// --concurrency; `none` skips it); prompt-tokens=128,256,...,max (TTFT vs prompt length:
    /// --prompt-requests prompts of exactly that many tokens each, one at a time; `max` = the
    /// model's context length less --prompt-max-tokens and one); transfer-tokens=128,...,8192
    /// (KV pages sent over loopback TCP between two pools in this process, beside memcpy and
    /// xxh3 bandwidth; no server needed)
    #[arg(long, env = "AIRLOCK_BENCH_SWEEP")]
    pub(crate) sweep: Vec<String>,
    /// Requests per point of the prompt-tokens sweep (the median TTFT is reported)
    #[arg(long, env = "AIRLOCK_BENCH_PROMPT_REQUESTS", default_value_t = 3)]
    pub(crate) prompt_requests: usize,
    /// max_tokens per request of the prompt-tokens sweep
    #[arg(long, env = "AIRLOCK_BENCH_PROMPT_MAX_TOKENS", default_value_t = 16)]
    pub(crate) prompt_max_tokens: usize,
    /// Repetitions per size of the transfer-tokens sweep (the median is reported)
    #[arg(long, env = "AIRLOCK_BENCH_TRANSFER_REPS", default_value_t = 5)]
    pub(crate) transfer_reps: usize,
    /// Poll each target's /metrics every MS milliseconds for the KV pool occupancy curve
    /// (airlock routers only; 0: off)
    #[arg(
        long,
        env = "AIRLOCK_BENCH_POLL_MS",
        default_value_t = 100,
        value_name = "MS"
    )]
    pub(crate) poll_ms: u64,
    /// Write PNG charts (800x500) and bench.json (every figure) into DIR. Needs a TrueType
    /// font: $AIRLOCK_PLOT_FONT, else /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
    /// (Debian package fonts-dejavu-core)
    #[arg(long, env = "AIRLOCK_BENCH_PLOT", value_name = "DIR")]
    pub(crate) plot: Option<PathBuf>,
    /// --queue-timeout-ms for spawned serve/unified. Their time to first token may not exceed
    /// queue + transfer timeout (60 s by default), and a prompt near the context length takes
    /// longer than that to prefill on a small machine [default: 600000 with a prompt-tokens
    /// sweep, else the server's own]
    #[arg(long, env = "AIRLOCK_BENCH_QUEUE_TIMEOUT_MS", value_name = "MS")]
    pub(crate) queue_timeout_ms: Option<u64>,
    /// Measure nothing: redraw the charts of an earlier run from its bench.json into --plot DIR
    #[arg(
        long,
        env = "AIRLOCK_BENCH_REPLOT",
        value_name = "FILE",
        requires = "plot"
    )]
    pub(crate) replot: Option<PathBuf>,
    /// llama.cpp's server executable for --spawn llama-cpp [default: llama-server on PATH,
    /// else /tmp/llamacpp/build/bin/llama-server, where scripts/bench/build-llama-server.sh
    /// builds it]
    #[arg(long, env = "AIRLOCK_BENCH_LLAMA_SERVER", value_name = "PATH")]
    pub(crate) llama_server: Option<PathBuf>,
    /// What to send: mix (independent prompts), chat (--concurrency conversations of
    /// --turns questions about a --context-words document, the history resent each turn) or
    /// shared-prefix (--requests requests sharing one --context-words system prompt). The
    /// last two report TTFT of first and later turns and each server beside its -nocache twin
    #[arg(
        long,
        env = "AIRLOCK_BENCH_WORKLOAD",
        value_enum,
        default_value = "mix"
    )]
    pub(crate) workload: Workload,
    /// Questions per conversation of --workload chat
    #[arg(long, env = "AIRLOCK_BENCH_TURNS", default_value_t = 8)]
    pub(crate) turns: usize,
    /// Words of the document (chat) or system prompt (shared-prefix), about a token each
    #[arg(long, env = "AIRLOCK_BENCH_CONTEXT_WORDS", default_value_t = 1500)]
    pub(crate) context_words: usize,
    /// Times to run every --spawn target in turn (A B A B ...) with --workload chat or
    /// shared-prefix; the report gives medians over rounds
    #[arg(long, env = "AIRLOCK_BENCH_ROUNDS", default_value_t = 1)]
    pub(crate) rounds: usize,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
}

/// One measured request.
pub(crate) struct Sample {
    pub(crate) ttft: f64,
    /// Seconds from sending to the last token.
    pub(crate) end: f64,
    pub(crate) gaps: Vec<f64>,
    pub(crate) tokens: usize,
    /// `usage.prompt_tokens` of the last chunk, when the server sends usage.
    pub(crate) prompt_tokens: Option<usize>,
}

pub(crate) struct LevelReport {
    pub(crate) concurrency: usize,
    pub(crate) requests: usize,
    pub(crate) failed: usize,
    pub(crate) wall: f64,
    pub(crate) tokens: usize,
    pub(crate) ttft: Vec<f64>,
    pub(crate) itl: Vec<f64>,
}

/// The prompts of one point of the prompt-tokens sweep, the same for every target.
pub(crate) struct PromptSet {
    pub(crate) tokens: usize,
    pub(crate) prompts: Vec<String>,
}

/// One point of the prompt-tokens sweep on one target.
pub(crate) struct PromptPoint {
    /// Prompt tokens as the model's tokenizer counts them (no BOS).
    pub(crate) tokens: usize,
    /// What the server reported in `usage.prompt_tokens` (airlock does; llama.cpp's
    /// server does not stream usage).
    pub(crate) server_tokens: Option<usize>,
    pub(crate) ttft: Vec<f64>,
    /// Per request: tokens after the first / time after the first.
    pub(crate) decode_tok_s: Vec<f64>,
    /// Per request: streamed text chunks (tokens); under max_tokens when the model stopped.
    pub(crate) output_tokens: Vec<usize>,
    pub(crate) failed: usize,
}

/// Everything measured on one target.
pub(crate) struct TargetResult {
    pub(crate) name: String,
    pub(crate) levels: Vec<LevelReport>,
    pub(crate) prompts: Vec<PromptPoint>,
    pub(crate) pool: Vec<PoolSample>,
    /// Where each load level began, seconds since the target's start, for the pool chart.
    pub(crate) markers: Vec<(f64, String)>,
}

/// The untimed first request. Never one of the measured prompts: llama.cpp's server keeps the
/// previous request's KV and reuses the longest common prefix, so warming up with a measured
/// prompt would hand that prompt a free prefill.
pub(crate) const WARM_UP_PROMPT: &str = "Warm-up request: reply with one short sentence.";

/// Tokens each llama-cpp slot holds at least: the mix's prompts (under 100 tokens) and
/// --max-tokens with room to spare.
const LLAMA_SLOT_CONTEXT_MIN: usize = 2048;

/// Requests sent at one concurrency level: --requests, at least twice the level.
pub(crate) fn requests_for(args: &Args, concurrency: usize) -> usize {
    args.requests.max(2 * concurrency)
}

pub fn run(mut args: Args) -> Result<()> {
    let sweeps = Sweeps::parse(&args.sweep)?;
    if let Some(levels) = &sweeps.concurrency {
        args.concurrency = levels.clone();
    }
    if sweeps.prompt_tokens.is_some() && args.queue_timeout_ms.is_none() {
        args.queue_timeout_ms = Some(600_000);
    }
    if let Some(dir) = &args.plot {
        // Fail before minutes of measuring, not after.
        plot::register_font()?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if let Some(file) = &args.replot {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", file.display()))?;
            let (results, transfer) = results_from_json(&json)
                .with_context(|| format!("{} is not an `airlock bench` report", file.display()))?;
            let written = write_charts(dir, &results, transfer.as_ref())?;
            println!("wrote {}", written.join(", "));
            return Ok(());
        }
    }
    let (min_words, max_words) = parse_range(&args.prompt_words)?;
    let count = args
        .concurrency
        .iter()
        .map(|&c| requests_for(&args, c))
        .max()
        .unwrap_or(args.requests)
        .max(1);
    let prompts = prompt_mix(args.seed, count, min_words, max_words);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    if !args.ab.is_empty() {
        return run_ab(&args, &prompts, &runtime);
    }
    if args.workload != Workload::Mix {
        return workloads::run_workload(&args, &runtime);
    }
    let machine = Machine::read();
    eprintln!("{}", machine.describe());
    let needs_model = sweeps.prompt_tokens.is_some() || sweeps.transfer_tokens.is_some();
    let model = needs_model.then(|| ModelFacts::read(&args)).transpose()?;
    let prompt_sets = match (&sweeps.prompt_tokens, &model) {
        (Some(lengths), Some(model)) => prompt_sets(lengths, model, &args)?,
        _ => Vec::new(),
    };
    let mut results: Vec<TargetResult> = Vec::new();
    let spawned: Vec<String> = if args.spawn.is_empty() && args.url.is_empty() {
        ["serve", "unified", "llama-cpp"].map(String::from).to_vec()
    } else {
        args.spawn
            .iter()
            .filter(|name| name.as_str() != "none")
            .cloned()
            .collect()
    };
    if spawned.iter().any(|name| name == "llama-cpp") {
        // Fail before minutes of measuring the others, not after.
        server::llama_server(&args)?;
    }
    // A llama-cpp slot holds the longest prompt of the run and its answer.
    let slot_context = prompt_sets
        .iter()
        .map(|set| set.tokens + args.prompt_max_tokens + 64)
        .max()
        .unwrap_or(0)
        .max(LLAMA_SLOT_CONTEXT_MIN);
    let mut loads = vec![("start".to_string(), Machine::load_average())];
    for name in &spawned {
        let server = Server::start(name, &args, slot_context)?;
        eprintln!("== {name}: {}", server.description);
        let result = runtime.block_on(measure_target(
            name,
            &server.url,
            &server.model_id,
            &prompts,
            &prompt_sets,
            &args,
        ))?;
        results.push(result);
        drop(server);
        loads.push((format!("after {name}"), Machine::load_average()));
    }
    for target in &args.url {
        let (name, url) = target.split_once('=').context("--url takes NAME=URL")?;
        let url = url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        let model_id = runtime.block_on(model_id(&url, args.api_key.as_deref()))?;
        eprintln!("== {name}: {url} ({model_id})");
        let result = runtime.block_on(measure_target(
            name,
            &url,
            &model_id,
            &prompts,
            &prompt_sets,
            &args,
        ))?;
        results.push(result);
        loads.push((format!("after {name}"), Machine::load_average()));
    }
    let transfer = match (&sweeps.transfer_tokens, &model) {
        (Some(tokens), Some(model)) => {
            eprintln!(
                "== KV transfer over loopback TCP and through shared memory, in process ({} reps \
                 per size)",
                args.transfer_reps
            );
            let report =
                curves::transfer_sweep(model.layout, tokens, args.transfer_reps, 256 << 20)?;
            loads.push(("after transfer".to_string(), Machine::load_average()));
            Some(report)
        }
        _ => None,
    };
    println!("\n{}", machine.describe());
    println!(
        "load average (1 min): {}",
        loads
            .iter()
            .map(|(when, load)| format!("{when} {load}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if results.iter().any(|r| !r.levels.is_empty()) {
        print_table(&results, &args);
    }
    if results.iter().any(|r| !r.prompts.is_empty()) {
        print_prompt_table(&results, &args);
    }
    if let Some(report) = &transfer {
        print_transfer_table(report, &results);
    }
    if let Some(dir) = &args.plot {
        let written = write_charts(dir, &results, transfer.as_ref())?;
        let json = report_json(&args, &machine, &loads, &results, transfer.as_ref());
        let path = dir.join("bench.json");
        std::fs::write(&path, serde_json::to_string(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("\nwrote {} and {}", written.join(", "), path.display());
    }
    Ok(())
}
