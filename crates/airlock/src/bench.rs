//! `airlock bench`: a load generator for any OpenAI-compatible endpoint. It sends a fixed-seed
//! mix of prompts at each concurrency level, streams every answer, and reports output
//! tokens/s, TTFT and inter-token latency (p50/p99).
//!
//! It can start the servers it compares, one after the other on the same machine so they never
//! compete for cores: `airlock serve`, `airlock unified` (this binary) and llama.cpp's server
//! from the `llama-cpp-python` package, all on the same model file and thread count.
//!
//! Scaling curves (`--sweep`, see `bench_curves.rs`): tokens/s and TTFT vs concurrency, TTFT vs
//! prompt length (prompts of exact token counts), the KV transfer's time vs tokens beside
//! memcpy bandwidth, and each airlock target's pool occupancy over time from its `/metrics`.
//! `--plot DIR` draws them as PNGs (`bench_plot.rs`) and writes the raw figures as JSON.

use crate::bench_curves::{self, PoolSample, PromptLength, Sweeps, TransferReport};
use crate::bench_plot::{self, Axis, Chart, Legend, Scale, Series, Style};
use crate::model_path::ModelArgs;
use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Servers to start and measure in turn: serve, unified, llama-cpp (comma-separated), or
    /// none [default: all three, unless --url is given]
    #[arg(long, env = "AIRLOCK_BENCH_SPAWN", value_delimiter = ',')]
    spawn: Vec<String>,
    /// Measure a running endpoint, as NAME=URL (e.g. vllm=http://host:8000); repeatable
    #[arg(long, env = "AIRLOCK_BENCH_URL")]
    url: Vec<String>,
    /// Concurrency levels (requests in flight)
    #[arg(
        long,
        env = "AIRLOCK_BENCH_CONCURRENCY",
        value_delimiter = ',',
        default_value = "1,8"
    )]
    concurrency: Vec<usize>,
    /// Requests per concurrency level (raised to 2 × the level where that is more)
    #[arg(long, env = "AIRLOCK_BENCH_REQUESTS", default_value_t = 24)]
    requests: usize,
    /// max_tokens per request
    #[arg(long, env = "AIRLOCK_BENCH_MAX_TOKENS", default_value_t = 128)]
    max_tokens: usize,
    /// Prompt lengths in words, as MIN-MAX; each request draws one with the seed
    #[arg(long, env = "AIRLOCK_BENCH_PROMPT_WORDS", default_value = "16-64")]
    prompt_words: String,
    /// Seed of the prompt mix (same seed, same prompts for every server)
    #[arg(long, env = "AIRLOCK_BENCH_SEED", default_value_t = 1)]
    seed: u64,
    /// API key sent as a bearer token
    #[arg(long, env = "AIRLOCK_BENCH_KEY")]
    api_key: Option<String>,
    /// Port for spawned servers
    #[arg(long, env = "AIRLOCK_BENCH_PORT", default_value_t = 18500)]
    port: u16,
    /// Guard-overhead mode: two `airlock` binaries, GUARDED,UNGUARDED; each runs `serve` in
    /// turn (A B A B ...) at the first --concurrency level, and the report gives the
    /// throughput and p99 inter-token latency difference with a 95% confidence interval
    #[arg(long, env = "AIRLOCK_BENCH_AB", value_delimiter = ',', num_args = 1)]
    ab: Vec<PathBuf>,
    /// Pairs of runs in --ab mode
    #[arg(long, env = "AIRLOCK_BENCH_PAIRS", default_value_t = 10)]
    pairs: usize,
    /// Scaling sweep, KEY=V1,V2,... (repeatable): concurrency=1,2,4,8,16,32 (replaces
    /// --concurrency; `none` skips it); prompt-tokens=128,256,...,max (TTFT vs prompt length:
    /// --prompt-requests prompts of exactly that many tokens each, one at a time; `max` = the
    /// model's context length less --prompt-max-tokens and one); transfer-tokens=128,...,8192
    /// (KV pages sent over loopback TCP between two pools in this process, beside memcpy and
    /// xxh3 bandwidth; no server needed)
    #[arg(long, env = "AIRLOCK_BENCH_SWEEP")]
    sweep: Vec<String>,
    /// Requests per point of the prompt-tokens sweep (the median TTFT is reported)
    #[arg(long, env = "AIRLOCK_BENCH_PROMPT_REQUESTS", default_value_t = 3)]
    prompt_requests: usize,
    /// max_tokens per request of the prompt-tokens sweep
    #[arg(long, env = "AIRLOCK_BENCH_PROMPT_MAX_TOKENS", default_value_t = 16)]
    prompt_max_tokens: usize,
    /// Repetitions per size of the transfer-tokens sweep (the median is reported)
    #[arg(long, env = "AIRLOCK_BENCH_TRANSFER_REPS", default_value_t = 5)]
    transfer_reps: usize,
    /// Poll each target's /metrics every MS milliseconds for the KV pool occupancy curve
    /// (airlock routers only; 0: off)
    #[arg(
        long,
        env = "AIRLOCK_BENCH_POLL_MS",
        default_value_t = 100,
        value_name = "MS"
    )]
    poll_ms: u64,
    /// Write PNG charts (800x500) and bench.json (every figure) into DIR. Needs a TrueType
    /// font: $AIRLOCK_PLOT_FONT, else /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
    /// (Debian package fonts-dejavu-core)
    #[arg(long, env = "AIRLOCK_BENCH_PLOT", value_name = "DIR")]
    plot: Option<PathBuf>,
    /// --queue-timeout-ms for spawned serve/unified. Their time to first token may not exceed
    /// queue + transfer timeout (60 s by default), and a prompt near the context length takes
    /// longer than that to prefill on a small machine [default: 600000 with a prompt-tokens
    /// sweep, else the server's own]
    #[arg(long, env = "AIRLOCK_BENCH_QUEUE_TIMEOUT_MS", value_name = "MS")]
    queue_timeout_ms: Option<u64>,
    /// Measure nothing: redraw the charts of an earlier run from its bench.json into --plot DIR
    #[arg(
        long,
        env = "AIRLOCK_BENCH_REPLOT",
        value_name = "FILE",
        requires = "plot"
    )]
    replot: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
}

/// One measured request.
struct Sample {
    ttft: f64,
    /// Seconds from sending to the last token.
    end: f64,
    gaps: Vec<f64>,
    tokens: usize,
    /// `usage.prompt_tokens` of the last chunk, when the server sends usage.
    prompt_tokens: Option<usize>,
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

/// The prompts of one point of the prompt-tokens sweep, the same for every target.
struct PromptSet {
    tokens: usize,
    prompts: Vec<String>,
}

/// One point of the prompt-tokens sweep on one target.
struct PromptPoint {
    /// Prompt tokens as the model's tokenizer counts them (no BOS).
    tokens: usize,
    /// What the server reported in `usage.prompt_tokens` (airlock does; llama.cpp's
    /// server does not stream usage).
    server_tokens: Option<usize>,
    ttft: Vec<f64>,
    /// Per request: tokens after the first / time after the first.
    decode_tok_s: Vec<f64>,
    /// Per request: streamed text chunks (tokens); under max_tokens when the model stopped.
    output_tokens: Vec<usize>,
    failed: usize,
}

/// Everything measured on one target.
struct TargetResult {
    name: String,
    levels: Vec<LevelReport>,
    prompts: Vec<PromptPoint>,
    pool: Vec<PoolSample>,
    /// Where each load level began, seconds since the target's start, for the pool chart.
    markers: Vec<(f64, String)>,
}

/// The untimed first request. Never one of the measured prompts: llama.cpp's server keeps the
/// previous request's KV and reuses the longest common prefix, so warming up with a measured
/// prompt would hand that prompt a free prefill.
const WARM_UP_PROMPT: &str = "Warm-up request: reply with one short sentence.";

/// Requests sent at one concurrency level: --requests, at least twice the level.
fn requests_for(args: &Args, concurrency: usize) -> usize {
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
        bench_plot::register_font()?;
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
    let mut loads = vec![("start".to_string(), Machine::load_average())];
    for name in &spawned {
        let server = Server::start(name, &args)?;
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
                "== KV transfer over loopback TCP, in process ({} reps per size)",
                args.transfer_reps
            );
            let report =
                bench_curves::transfer_sweep(model.layout, tokens, args.transfer_reps, 256 << 20)?;
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

/// What this machine is, for the report.
struct Machine {
    cores: usize,
    cpu: String,
}

impl Machine {
    fn read() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("model name"))
            .and_then(|rest| rest.split_once(':'))
            .map_or_else(|| "unknown CPU".to_string(), |(_, name)| name.trim().into());
        Machine {
            cores: std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            cpu,
        }
    }

    fn describe(&self) -> String {
        format!(
            "machine: {} cores (nproc), {}; load average {}",
            self.cores,
            self.cpu,
            Machine::load_average()
        )
    }

    /// The 1-minute load average, as /proc/loadavg says it.
    fn load_average() -> String {
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|text| text.split_whitespace().next().map(str::to_string))
            .unwrap_or_else(|| "?".into())
    }
}

/// What the sweeps need from the model file: its KV layout, context length and tokenizer.
struct ModelFacts {
    layout: kv::KvLayout,
    context_length: usize,
    tokenizer: gguf::Tokenizer,
}

/// Tokens per KV page in the transfer sweep: `serve`'s default `--page-size`.
const PAGE_SIZE_TOKENS: usize = 16;

impl ModelFacts {
    fn read(args: &Args) -> Result<ModelFacts> {
        let path = args.model.resolve_model()?;
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let file =
            gguf::GgufFile::parse(&bytes).with_context(|| format!("parsing {}", path.display()))?;
        let config = model::LlamaConfig::from_gguf(&file)?;
        Ok(ModelFacts {
            layout: config.kv_layout(PAGE_SIZE_TOKENS),
            context_length: config.context_length,
            tokenizer: gguf::Tokenizer::from_gguf(&file)?,
        })
    }
}

/// The prompts of every prompt-tokens point: --prompt-requests each, of exactly that many
/// tokens, none sharing a prefix with another (no engine can reuse an earlier prompt's KV).
fn prompt_sets(
    lengths: &[PromptLength],
    model: &ModelFacts,
    args: &Args,
) -> Result<Vec<PromptSet>> {
    let limit = model
        .context_length
        .saturating_sub(args.prompt_max_tokens + 1);
    let count = |text: &str| model.tokenizer.encode(text, false).len();
    let mut sets = Vec::new();
    for (point, length) in lengths.iter().enumerate() {
        let tokens = match *length {
            PromptLength::Tokens(n) if n > limit => bail!(
                "--sweep prompt-tokens={n} leaves no room for --prompt-max-tokens {} in the \
                 model's context of {} tokens (use at most {limit}, or `max`)",
                args.prompt_max_tokens,
                model.context_length
            ),
            PromptLength::Tokens(n) => n,
            PromptLength::Max => limit,
        };
        let mut prompts = Vec::new();
        for request in 0..args.prompt_requests.max(1) {
            let seed = args.seed ^ ((point as u64) << 32 | request as u64).wrapping_add(1);
            let (text, have) = bench_curves::prompt_of_tokens(&count, tokens, seed);
            if have != tokens {
                eprintln!("  note: a prompt for {tokens} tokens has {have}");
            }
            prompts.push(text);
        }
        sets.push(PromptSet { tokens, prompts });
    }
    Ok(sets)
}

/// The concurrency sweep, then the prompt-length sweep, on one target, polling its pool.
async fn measure_target(
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
        tokio::spawn(bench_curves::poll_pool(
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
async fn measure_prompts(
    url: &str,
    model_id: &str,
    sets: &[PromptSet],
    args: &Args,
    base: Instant,
    markers: &mut Vec<(f64, String)>,
) -> Vec<PromptPoint> {
    let Ok(client) = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()
    else {
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
            bench_curves::median(&mut point.ttft.clone()) * 1e3
        );
        points.push(point);
    }
    points
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
                if let Some(ms) = args.queue_timeout_ms {
                    command.args(["--queue-timeout-ms", &ms.to_string()]);
                }
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
    base: Instant,
    markers: &mut Vec<(f64, String)>,
) -> Result<Vec<LevelReport>> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
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

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    values[rank]
}

fn print_table(results: &[TargetResult], args: &Args) {
    let peer = results.iter().find(|r| r.name == "llama-cpp");
    println!(
        "\n{} requests per level (at least 2 × the level), max_tokens {}, prompts {} words, \
         seed {}, {} threads\n",
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
    for TargetResult {
        name,
        levels: reports,
        ..
    } in results
    {
        for report in reports {
            let rate = report.tokens as f64 / report.wall;
            let ratio = peer
                .and_then(|p| {
                    p.levels
                        .iter()
                        .find(|l| l.concurrency == report.concurrency)
                })
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

fn median_ms(values: &[f64]) -> f64 {
    bench_curves::median(&mut values.to_vec()) * 1e3
}

fn print_prompt_table(results: &[TargetResult], args: &Args) {
    let peer = results.iter().find(|r| r.name == "llama-cpp");
    println!(
        "\nprompt-length sweep: {} requests per point, one at a time, max_tokens {}, greedy; \
         prompt tokens counted by the model's tokenizer\n",
        args.prompt_requests, args.prompt_max_tokens
    );
    println!(
        "| prompt tokens | server | TTFT p50 ms | prompt tok/s (tokens / TTFT) | llama-cpp TTFT / \
         this | decode tok/s p50 | tokens out (mean) | usage.prompt_tokens | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let lengths: Vec<usize> = results
        .iter()
        .flat_map(|r| r.prompts.iter().map(|p| p.tokens))
        .fold(Vec::new(), |mut seen, n| {
            if !seen.contains(&n) {
                seen.push(n);
            }
            seen
        });
    for tokens in lengths {
        for result in results {
            let Some(point) = result.prompts.iter().find(|p| p.tokens == tokens) else {
                continue;
            };
            let ttft = median_ms(&point.ttft);
            let ratio = peer
                .and_then(|p| p.prompts.iter().find(|q| q.tokens == tokens))
                .map(|q| median_ms(&q.ttft) / ttft)
                .filter(|r| r.is_finite())
                .map_or("-".to_string(), |r| format!("{r:.2}×"));
            let figure = |value: f64, digits: usize| {
                if value.is_finite() {
                    format!("{value:.digits$}")
                } else {
                    "-".to_string()
                }
            };
            let out =
                point.output_tokens.iter().sum::<usize>() as f64 / point.output_tokens.len() as f64;
            println!(
                "| {tokens} | {} | {} | {} | {ratio} | {} | {} | {} | {} |",
                result.name,
                figure(ttft, 0),
                figure(tokens as f64 / (ttft / 1e3), 0),
                figure(bench_curves::median(&mut point.decode_tok_s.clone()), 1),
                figure(out, 1),
                point
                    .server_tokens
                    .map_or("-".to_string(), |n| n.to_string()),
                point.failed,
            );
        }
    }
}

/// serve's TTFT minus unified's at each prompt length both measured: the cost of
/// disaggregation (transfer, its verification, the extra hop), as the client sees it.
fn ttft_difference(results: &[TargetResult]) -> Vec<(usize, f64)> {
    let find = |name: &str| results.iter().find(|r| r.name == name);
    let (Some(serve), Some(unified)) = (find("serve"), find("unified")) else {
        return Vec::new();
    };
    serve
        .prompts
        .iter()
        .filter_map(|s| {
            let u = unified.prompts.iter().find(|u| u.tokens == s.tokens)?;
            Some((s.tokens, (median_ms(&s.ttft) - median_ms(&u.ttft)) / 1e3))
        })
        .filter(|(_, d)| d.is_finite())
        .collect()
}

fn print_transfer_table(report: &TransferReport, results: &[TargetResult]) {
    let layout = report.layout;
    println!(
        "\nKV transfer over loopback TCP, in process: {} layers × {} kv heads × {} dims, f16, \
         {} tokens per page ({} bytes); timed from packing to the receiver's verified seal\n\
         memcpy {:.2} GB/s, xxh3 {:.2} GB/s (best of 5 over 256 MiB, same run)\n",
        layout.layer_count,
        layout.kv_head_count,
        layout.head_dim,
        layout.page_size_tokens,
        layout.page_bytes(),
        report.memcpy_gb_s,
        report.xxh3_gb_s
    );
    let difference = ttft_difference(results);
    println!(
        "| tokens | pages | MB | transfer ms | GB/s | of memcpy | sender packing ms | \
         memcpy ms (same bytes) | serve − unified TTFT ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for point in &report.points {
        let memcpy_ms = point.bytes as f64 / report.memcpy_gb_s / 1e6;
        let measured = difference
            .iter()
            .find(|(tokens, _)| *tokens == point.tokens)
            .map_or("-".to_string(), |(_, d)| format!("{:.0}", d * 1e3));
        println!(
            "| {} | {} | {:.1} | {:.2} | {:.2} | {:.0}% | {:.2} | {:.2} | {measured} |",
            point.tokens,
            point.pages,
            point.bytes as f64 / 1e6,
            point.seconds * 1e3,
            point.gb_per_s(),
            point.gb_per_s() / report.memcpy_gb_s * 100.0,
            point.pack_seconds * 1e3,
            memcpy_ms,
        );
    }
}

/// Draws every chart the measurements allow; returns the file names written.
fn write_charts(
    dir: &Path,
    results: &[TargetResult],
    transfer: Option<&TransferReport>,
) -> Result<Vec<String>> {
    let mut charts: Vec<(String, Chart)> = Vec::new();
    let per_target = |f: &dyn Fn(&TargetResult) -> Vec<(f64, f64)>| -> Vec<Series> {
        results
            .iter()
            .map(|r| Series {
                name: r.name.clone(),
                points: f(r),
                style: Style::Measured,
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    let concurrency_axis = || Axis::new("concurrency (requests in flight)", Scale::Log).at_data();
    if results.iter().any(|r| !r.levels.is_empty()) {
        charts.push((
            "throughput_vs_concurrency.png".into(),
            Chart {
                title: "Output tokens/s vs concurrency".into(),
                x: concurrency_axis(),
                y: Axis::new("output tokens/s (all requests)", Scale::Linear),
                series: per_target(&|r| {
                    r.levels
                        .iter()
                        .map(|l| (l.concurrency as f64, l.tokens as f64 / l.wall))
                        .collect()
                }),
                markers: Vec::new(),
                legend: Legend::UpperLeft,
            },
        ));
        charts.push((
            "ttft_vs_concurrency.png".into(),
            Chart {
                title: "Time to first token vs concurrency (median)".into(),
                x: concurrency_axis(),
                y: Axis::new("TTFT p50 (ms, log scale)", Scale::Log),
                series: per_target(&|r| {
                    r.levels
                        .iter()
                        .map(|l| (l.concurrency as f64, median_ms(&l.ttft)))
                        .collect()
                }),
                markers: Vec::new(),
                legend: Legend::UpperLeft,
            },
        ));
    }
    if results.iter().any(|r| !r.prompts.is_empty()) {
        charts.push((
            "ttft_vs_prompt_tokens.png".into(),
            Chart {
                title: "Time to first token vs prompt length (one request at a time)".into(),
                x: Axis::new("prompt tokens (log scale)", Scale::Log).at_data(),
                y: Axis::new("TTFT p50 (ms, log scale)", Scale::Log),
                series: per_target(&|r| {
                    r.prompts
                        .iter()
                        .map(|p| (p.tokens as f64, median_ms(&p.ttft)))
                        .collect()
                }),
                markers: Vec::new(),
                legend: Legend::UpperLeft,
            },
        ));
    }
    if let Some(report) = transfer {
        let tokens = |f: &dyn Fn(&bench_curves::TransferPoint) -> f64| -> Vec<(f64, f64)> {
            report
                .points
                .iter()
                .map(|p| (p.tokens as f64, f(p)))
                .collect()
        };
        let mut series = vec![
            Series {
                name: "KV transfer, loopback TCP (measured)".into(),
                points: tokens(&|p| p.seconds * 1e3),
                style: Style::Measured,
            },
            Series {
                name: format!("memcpy of the same bytes ({:.1} GB/s)", report.memcpy_gb_s),
                points: tokens(&|p| p.bytes as f64 / report.memcpy_gb_s / 1e6),
                style: Style::Reference,
            },
            Series {
                name: format!("xxh3 of the same bytes ({:.1} GB/s)", report.xxh3_gb_s),
                points: tokens(&|p| p.bytes as f64 / report.xxh3_gb_s / 1e6),
                style: Style::Reference,
            },
        ];
        let difference = ttft_difference(results);
        if difference.iter().any(|(_, d)| *d > 0.0) {
            series.push(Series {
                name: "serve − unified TTFT (same prompt length)".into(),
                points: difference
                    .iter()
                    .filter(|(_, d)| *d > 0.0)
                    .map(|&(t, d)| (t as f64, d * 1e3))
                    .collect(),
                style: Style::Measured,
            });
        }
        charts.push((
            "transfer_time_vs_tokens.png".into(),
            Chart {
                title: "KV transfer time vs tokens transferred".into(),
                x: Axis::new("tokens of KV (log scale)", Scale::Log).at_data(),
                y: Axis::new("time (ms, log scale)", Scale::Log),
                series,
                markers: Vec::new(),
                legend: Legend::LowerRight,
            },
        ));
        let flat = |gb_s: f64| {
            let first = report.points.first().map_or(1.0, |p| p.tokens as f64);
            let last = report.points.last().map_or(1.0, |p| p.tokens as f64);
            vec![(first, gb_s), (last, gb_s)]
        };
        charts.push((
            "transfer_bandwidth_vs_tokens.png".into(),
            Chart {
                title: "KV transfer bandwidth vs tokens, beside memory bandwidth".into(),
                x: Axis::new("tokens of KV (log scale)", Scale::Log).at_data(),
                y: Axis::new("GB/s (10^9 bytes per second)", Scale::Linear),
                series: vec![
                    Series {
                        name: "KV transfer, loopback TCP (measured)".into(),
                        points: tokens(&|p| p.gb_per_s()),
                        style: Style::Measured,
                    },
                    Series {
                        name: "memcpy (physical limit)".into(),
                        points: flat(report.memcpy_gb_s),
                        style: Style::Reference,
                    },
                    Series {
                        name: "xxh3 (checksum)".into(),
                        points: flat(report.xxh3_gb_s),
                        style: Style::Reference,
                    },
                ],
                markers: Vec::new(),
                legend: Legend::MiddleRight,
            },
        ));
    }
    for result in results.iter().filter(|r| !r.pool.is_empty()) {
        let mut workers: Vec<&str> = Vec::new();
        for sample in &result.pool {
            if !workers.contains(&sample.worker.as_str()) {
                workers.push(&sample.worker);
            }
        }
        let mut series: Vec<Series> = workers
            .iter()
            .map(|worker| Series {
                name: format!("{worker}: pages used"),
                points: result
                    .pool
                    .iter()
                    .filter(|s| s.worker == *worker)
                    .map(|s| (s.t, s.used))
                    .collect(),
                style: Style::Trace,
            })
            .collect();
        let total = result.pool.iter().map(|s| s.total).fold(0.0, f64::max);
        let end = result.pool.last().map_or(1.0, |s| s.t);
        series.push(Series {
            name: format!("pool size ({total:.0} pages per worker)"),
            points: vec![(0.0, total), (end, total)],
            style: Style::Reference,
        });
        charts.push((
            format!("pool_occupancy_{}.png", result.name),
            Chart {
                title: format!(
                    "KV pool pages used over time: {} (c = concurrency, p = prompt tokens)",
                    result.name
                ),
                x: Axis::new("time since the target started (s)", Scale::Linear),
                y: Axis::new("KV pages used", Scale::Linear),
                series,
                markers: result.markers.clone(),
                legend: Legend::MiddleLeft,
            },
        ));
    }
    let mut written = Vec::new();
    for (file, chart) in charts {
        let path = dir.join(&file);
        bench_plot::draw(&chart, &path, bench_plot::SIZE)?;
        written.push(path.display().to_string());
    }
    Ok(written)
}

/// Every figure of the run, for re-plotting or comparing runs.
fn report_json(
    args: &Args,
    machine: &Machine,
    loads: &[(String, String)],
    results: &[TargetResult],
    transfer: Option<&TransferReport>,
) -> serde_json::Value {
    use serde_json::json;
    let targets: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "concurrency": r.levels.iter().map(|l| json!({
                    "concurrency": l.concurrency,
                    "requests": l.requests,
                    "failed": l.failed,
                    "wall_s": l.wall,
                    "output_tokens": l.tokens,
                    "output_tok_s": l.tokens as f64 / l.wall,
                    "ttft_p50_ms": median_ms(&l.ttft),
                    "ttft_p99_ms": percentile(&mut l.ttft.clone(), 99.0) * 1e3,
                    "itl_p50_ms": percentile(&mut l.itl.clone(), 50.0) * 1e3,
                    "itl_p99_ms": percentile(&mut l.itl.clone(), 99.0) * 1e3,
                })).collect::<Vec<_>>(),
                "prompt_tokens": r.prompts.iter().map(|p| json!({
                    "prompt_tokens": p.tokens,
                    "server_prompt_tokens": p.server_tokens,
                    "ttft_ms": p.ttft.iter().map(|t| t * 1e3).collect::<Vec<_>>(),
                    "ttft_p50_ms": median_ms(&p.ttft),
                    "decode_tok_s_p50": bench_curves::median(&mut p.decode_tok_s.clone()),
                    "output_tokens": p.output_tokens,
                    "failed": p.failed,
                })).collect::<Vec<_>>(),
                "pool": thin_pool(&r.pool)
                    .into_iter()
                    .map(|s| json!([(s.t * 1e3).round() / 1e3, s.worker, s.used, s.total]))
                    .collect::<Vec<_>>(),
                "markers": r.markers,
            })
        })
        .collect();
    json!({
        "machine": { "cores": machine.cores, "cpu": machine.cpu },
        "load_average_1min": loads,
        "threads": args.model.threads(),
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests,
        "prompt_words": args.prompt_words,
        "prompt_requests": args.prompt_requests,
        "prompt_max_tokens": args.prompt_max_tokens,
        "seed": args.seed,
        "targets": targets,
        "transfer": transfer.map(|t| json!({
            "layout": {
                "layers": t.layout.layer_count,
                "kv_heads": t.layout.kv_head_count,
                "head_dim": t.layout.head_dim,
                "page_size_tokens": t.layout.page_size_tokens,
                "page_bytes": t.layout.page_bytes(),
            },
            "memcpy_gb_s": t.memcpy_gb_s,
            "xxh3_gb_s": t.xxh3_gb_s,
            "points": t.points.iter().map(|p| json!({
                "tokens": p.tokens,
                "pages": p.pages,
                "bytes": p.bytes,
                "seconds": p.seconds,
                "pack_seconds": p.pack_seconds,
                "gb_s": p.gb_per_s(),
            })).collect::<Vec<_>>(),
        })),
    })
}

/// The pool samples a chart needs: per worker, the first and last, and those next to a change
/// (the middle of a run of equal values draws nothing its ends do not).
fn thin_pool(samples: &[PoolSample]) -> Vec<&PoolSample> {
    let mut by_worker: Vec<(&str, Vec<usize>)> = Vec::new();
    for (index, sample) in samples.iter().enumerate() {
        match by_worker.iter_mut().find(|(w, _)| *w == sample.worker) {
            Some((_, indices)) => indices.push(index),
            None => by_worker.push((&sample.worker, vec![index])),
        }
    }
    let same = |a: usize, b: usize| {
        samples[a].used == samples[b].used && samples[a].total == samples[b].total
    };
    let mut keep = vec![false; samples.len()];
    for (_, indices) in &by_worker {
        for (k, &index) in indices.iter().enumerate() {
            keep[index] = match (k.checked_sub(1), indices.get(k + 1)) {
                (Some(p), Some(&next)) => !(same(indices[p], index) && same(index, next)),
                _ => true,
            };
        }
    }
    samples
        .iter()
        .zip(keep)
        .filter_map(|(sample, keep)| keep.then_some(sample))
        .collect()
}

/// The figures the charts need, back from `report_json`'s output (`--replot`). Concurrency
/// levels keep only their median TTFT (all a chart shows).
fn results_from_json(
    json: &serde_json::Value,
) -> Result<(Vec<TargetResult>, Option<TransferReport>)> {
    let number = |value: &serde_json::Value, key: &str| -> Result<f64> {
        value[key]
            .as_f64()
            .with_context(|| format!("missing number '{key}'"))
    };
    let list = |value: &serde_json::Value, key: &str| -> Vec<serde_json::Value> {
        value[key].as_array().cloned().unwrap_or_default()
    };
    let mut results = Vec::new();
    for target in list(json, "targets") {
        let mut levels = Vec::new();
        for level in list(&target, "concurrency") {
            levels.push(LevelReport {
                concurrency: number(&level, "concurrency")? as usize,
                requests: number(&level, "requests")? as usize,
                failed: number(&level, "failed")? as usize,
                wall: number(&level, "wall_s")?,
                tokens: number(&level, "output_tokens")? as usize,
                // null when every request of the level failed (NaN is not JSON).
                ttft: vec![level["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN) / 1e3],
                itl: Vec::new(),
            });
        }
        let mut prompts = Vec::new();
        for point in list(&target, "prompt_tokens") {
            prompts.push(PromptPoint {
                tokens: number(&point, "prompt_tokens")? as usize,
                server_tokens: point["server_prompt_tokens"].as_u64().map(|n| n as usize),
                ttft: list(&point, "ttft_ms")
                    .iter()
                    .filter_map(serde_json::Value::as_f64)
                    .map(|ms| ms / 1e3)
                    .collect(),
                decode_tok_s: Vec::new(),
                output_tokens: Vec::new(),
                failed: number(&point, "failed")? as usize,
            });
        }
        let pool = list(&target, "pool")
            .iter()
            .filter_map(|sample| {
                Some(PoolSample {
                    t: sample[0].as_f64()?,
                    worker: sample[1].as_str()?.to_string(),
                    used: sample[2].as_f64()?,
                    total: sample[3].as_f64()?,
                })
            })
            .collect();
        let markers = list(&target, "markers")
            .iter()
            .filter_map(|m| Some((m[0].as_f64()?, m[1].as_str()?.to_string())))
            .collect();
        results.push(TargetResult {
            name: target["name"]
                .as_str()
                .context("a target without a name")?
                .into(),
            levels,
            prompts,
            pool,
            markers,
        });
    }
    let transfer = match &json["transfer"] {
        serde_json::Value::Null => None,
        transfer => {
            let layout = &transfer["layout"];
            let mut points = Vec::new();
            for point in list(transfer, "points") {
                points.push(bench_curves::TransferPoint {
                    tokens: number(&point, "tokens")? as usize,
                    pages: number(&point, "pages")? as usize,
                    bytes: number(&point, "bytes")? as usize,
                    seconds: number(&point, "seconds")?,
                    pack_seconds: number(&point, "pack_seconds")?,
                });
            }
            Some(TransferReport {
                layout: kv::KvLayout {
                    layer_count: number(layout, "layers")? as usize,
                    kv_head_count: number(layout, "kv_heads")? as usize,
                    head_dim: number(layout, "head_dim")? as usize,
                    page_size_tokens: number(layout, "page_size_tokens")? as usize,
                },
                points,
                memcpy_gb_s: number(transfer, "memcpy_gb_s")?,
                xxh3_gb_s: number(transfer, "xxh3_gb_s")?,
            })
        }
    };
    Ok((results, transfer))
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
            let reports = runtime.block_on(measure(
                &server.url,
                &server.model_id,
                prompts,
                &level,
                Instant::now(),
                &mut Vec::new(),
            ))?;
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
    use super::*;

    #[test]
    fn pool_thinning_keeps_every_step() {
        let sample = |t: f64, worker: &str, used: f64| PoolSample {
            t,
            worker: worker.into(),
            used,
            total: 8.0,
        };
        let samples = [
            sample(0.0, "a", 1.0),
            sample(0.0, "b", 5.0),
            sample(0.1, "a", 1.0),
            sample(0.2, "a", 1.0),
            sample(0.2, "b", 5.0),
            sample(0.3, "a", 3.0),
            sample(0.3, "b", 5.0),
            sample(0.4, "a", 3.0),
        ];
        let kept: Vec<(f64, &str)> = thin_pool(&samples)
            .iter()
            .map(|s| (s.t, s.worker.as_str()))
            .collect();
        // a: 0.1 is inside a run (dropped), 0.2 is the run's end before the step (kept).
        assert_eq!(
            kept,
            [
                (0.0, "a"),
                (0.0, "b"),
                (0.2, "a"),
                (0.3, "a"),
                (0.3, "b"),
                (0.4, "a")
            ]
        );
    }

    #[test]
    fn a_report_replots_from_its_json() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let args = <Cli as clap::Parser>::parse_from(["bench"]).args;
        let machine = Machine {
            cores: 2,
            cpu: "test CPU".into(),
        };
        let results = vec![TargetResult {
            name: "serve".into(),
            levels: vec![LevelReport {
                concurrency: 4,
                requests: 8,
                failed: 0,
                wall: 2.0,
                tokens: 512,
                ttft: vec![0.1, 0.3, 0.2],
                itl: vec![0.01],
            }],
            prompts: vec![PromptPoint {
                tokens: 128,
                server_tokens: Some(128),
                ttft: vec![0.25, 0.35],
                decode_tok_s: vec![90.0],
                output_tokens: vec![16, 16],
                failed: 0,
            }],
            pool: vec![PoolSample {
                t: 0.5,
                worker: "decode-0".into(),
                used: 12.0,
                total: 512.0,
            }],
            markers: vec![(0.1, "c4".into())],
        }];
        let transfer = TransferReport {
            layout: kv::KvLayout {
                layer_count: 30,
                kv_head_count: 3,
                head_dim: 64,
                page_size_tokens: 16,
            },
            points: vec![bench_curves::TransferPoint {
                tokens: 128,
                pages: 8,
                bytes: 8 * 368_640,
                seconds: 0.002,
                pack_seconds: 0.001,
            }],
            memcpy_gb_s: 15.0,
            xxh3_gb_s: 13.0,
        };
        let loads = [("start".to_string(), "0.5".to_string())];
        let json = report_json(&args, &machine, &loads, &results, Some(&transfer));
        let text = serde_json::to_string(&json).unwrap();
        let (back, back_transfer) =
            results_from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back.len(), 1);
        let target = &back[0];
        assert_eq!(target.name, "serve");
        assert_eq!(target.levels[0].concurrency, 4);
        assert_eq!(target.levels[0].tokens, 512);
        assert!((median_ms(&target.levels[0].ttft) - 200.0).abs() < 1e-9);
        assert_eq!(target.prompts[0].tokens, 128);
        assert!((median_ms(&target.prompts[0].ttft) - 300.0).abs() < 1e-9);
        assert_eq!(target.pool, results[0].pool);
        assert_eq!(target.markers, results[0].markers);
        let back_transfer = back_transfer.unwrap();
        assert_eq!(back_transfer.layout, transfer.layout);
        assert_eq!(back_transfer.points[0].bytes, transfer.points[0].bytes);
        assert_eq!(back_transfer.memcpy_gb_s, 15.0);
        assert!(
            results_from_json(&serde_json::json!({"targets": [{"concurrency": [{}]}]})).is_err()
        );
    }

    #[test]
    fn confidence_interval_matches_a_worked_example() {
        // Values 1..=5: mean 3, sample sd 1.5811, se 0.7071, t(4) = 2.776 -> half 1.963.
        let (mean, half) = mean_and_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!((mean - 3.0).abs() < 1e-12);
        assert!((half - 1.963).abs() < 1e-3, "{half}");
    }
}
