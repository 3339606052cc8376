//! `airlock canary`: a leak auditor for any OpenAI-compatible endpoint (ours or another
//! engine's). Several tenants send prompts carrying their own random canary markers
//! (`CANARY-<tenant>-<8 base32 chars>`, a fresh one per request, repeated in the prompt with an
//! instruction to repeat the text), so that a model reading another tenant's KV would likely
//! say that tenant's marker. Every answer (body, each SSE chunk's text, error messages) is
//! scanned for every marker ever issued; one issued to another tenant is a leak, reported with
//! both requests and both tenants.
//!
//! It also sends requests that must fail (prompts or max_tokens past the context length,
//! invalid bodies) and checks each gets a 4xx: a 200 means the server ran what it should have
//! refused. 5xx answers and transport errors are counted and shown, not judged.
//!
//! The server is treated as hostile: bodies are read up to a cap, every request has a
//! timeout, redirects are not followed, and nothing it sends is trusted to parse.

use crate::model_path::ModelArgs;
use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

const EXAMPLES: &str = "\
Examples:
  # Start `airlock serve` with 4 generated tenants, audit it, stop it:
  airlock canary --spawn serve --requests 200

  # Audit any endpoint with three tenants' keys, for one minute:
  airlock canary --url http://10.0.0.1:8000 --keys sk-a...,sk-b...,sk-c... --duration 60

  # One key, tenants told apart only by the `user` field; repeat an earlier run:
  airlock canary --url http://localhost:8000/v1 --single-key sk-... --seed 1234

Exit status: 0 when clean (no leak, no should-fail request answered 2xx, and some request
that should succeed got a 2xx); 1 otherwise. 5xx answers and transport errors are counted and
shown, not judged. The report goes to stdout (--json FILE for a copy), progress to stderr.";

/// Every option a run takes; `--help` shows them with the examples above.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct Args {
    /// Endpoint to audit: its base URL, with or without /v1 (http only)
    #[arg(long, env = "AIRLOCK_CANARY_URL", conflicts_with = "spawn")]
    url: Option<String>,
    /// Start a server from this executable and audit it: serve or unified, on a free port,
    /// with a keys file of the tenants (generated keys unless --keys/--keys-file/--single-key)
    #[arg(long, env = "AIRLOCK_CANARY_SPAWN", value_parser = ["serve", "unified"])]
    spawn: Option<String>,
    /// One API key per tenant, comma-separated (k1,k2,...)
    #[arg(long, env = "AIRLOCK_CANARY_KEYS", value_delimiter = ',', conflicts_with_all = ["keys_file", "single_key"])]
    keys: Vec<String>,
    /// A keys file in `airlock serve --api-keys` format: one tenant per [tenants.NAME], using
    /// its first key
    #[arg(long, env = "AIRLOCK_CANARY_KEYS_FILE", conflicts_with = "single_key")]
    keys_file: Option<PathBuf>,
    /// One API key for every tenant: tenants then differ only by the request's `user` field.
    /// Without any key option, --url requests carry no key and differ the same way
    #[arg(long, env = "AIRLOCK_CANARY_SINGLE_KEY")]
    single_key: Option<String>,
    /// Number of tenants [default: 4; with --keys or --keys-file, one per key or tenant]
    #[arg(long, env = "AIRLOCK_CANARY_TENANTS")]
    tenants: Option<usize>,
    /// Model id to send [default: the first of GET /v1/models]
    #[arg(long, env = "AIRLOCK_CANARY_MODEL")]
    model: Option<String>,
    /// Context length in tokens (prompt + max_tokens): sizes the long and oversized prompts
    /// [default: from /health (airlock) or /v1/models max_model_len (vLLM), else 2048; with
    /// --spawn, the spawned server's, 2048]
    #[arg(long, env = "AIRLOCK_CANARY_CONTEXT_LENGTH")]
    context_length: Option<usize>,
    /// Requests in all [default: 200, or no bound when --duration is given]
    #[arg(long, env = "AIRLOCK_CANARY_REQUESTS")]
    requests: Option<usize>,
    /// Stop starting requests after this many seconds (those in flight finish)
    #[arg(long, env = "AIRLOCK_CANARY_DURATION")]
    duration: Option<f64>,
    /// Requests in flight at once
    #[arg(long, env = "AIRLOCK_CANARY_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// max_tokens of the requests that should succeed
    #[arg(long, env = "AIRLOCK_CANARY_MAX_TOKENS", default_value_t = 16)]
    max_tokens: usize,
    /// Words of filler in a short prompt, as MIN..MAX (markers come on top)
    #[arg(long, env = "AIRLOCK_CANARY_PROMPT_WORDS", default_value = "8..48")]
    prompt_words: String,
    /// Fraction of requests past the context length (prompt or max_tokens): must get 4xx
    #[arg(
        long,
        env = "AIRLOCK_CANARY_OVERSIZED_FRACTION",
        default_value_t = 0.10
    )]
    oversized_fraction: f64,
    /// Fraction of invalid requests (max_tokens -1, malformed JSON, unknown model, a field of
    /// the wrong type): must get 4xx
    #[arg(long, env = "AIRLOCK_CANARY_INVALID_FRACTION", default_value_t = 0.05)]
    invalid_fraction: f64,
    /// Fraction of long prompts, near the context length: should succeed
    #[arg(long, env = "AIRLOCK_CANARY_LONG_FRACTION", default_value_t = 0.05)]
    long_fraction: f64,
    /// Fraction of should-succeed requests sent twice in a row (greedy): the two answers must
    /// be identical. A server that answers from KV that is not the request's own (stale or
    /// foreign pages) answers twins differently, even when the model repeats no marker. Only
    /// for engines whose greedy decoding is deterministic (Airlock's is)
    #[arg(long, env = "AIRLOCK_CANARY_TWIN_FRACTION", default_value_t = 0.0)]
    twin_fraction: f64,
    /// Seed of the whole run (tenants' markers, prompt mix, endpoints); printed at the start
    /// and in the report, so the same run can be repeated [default: random]
    #[arg(long, env = "AIRLOCK_CANARY_SEED")]
    seed: Option<u64>,
    /// Seconds one request may take, body included, before it counts as a transport error
    #[arg(long, env = "AIRLOCK_CANARY_TIMEOUT", default_value_t = 120.0)]
    timeout: f64,
    /// Also write the report as JSON to this file
    #[arg(long, env = "AIRLOCK_CANARY_JSON")]
    json: Option<PathBuf>,
    /// With --spawn: GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long, env = "AIRLOCK_MODEL")]
    model_file: Option<PathBuf>,
    /// With --spawn: compute threads of the server [default: all cores]
    #[arg(long, env = "AIRLOCK_THREADS")]
    threads: Option<usize>,
}

/// Most bytes read of any answer: a hostile server cannot make the auditor hold more.
const BODY_CAP: usize = 1 << 20;
/// Context length assumed when neither the flag nor the endpoint says.
const FALLBACK_CONTEXT: usize = 2048;
/// Tenants when no keys say how many.
const DEFAULT_TENANTS: usize = 4;
/// Requests when neither --requests nor --duration bounds the run.
const DEFAULT_REQUESTS: usize = 200;
/// Base32 (RFC 4648) alphabet of the markers' random part.
const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
/// Random characters per marker: 40 bits, so two markers never meet by chance.
const CODE_LEN: usize = 8;
/// A marker every this many filler words, so a long prompt is dense with them.
const MARKER_EVERY: usize = 12;
/// Upper estimates for sizing long prompts without the endpoint's tokenizer: filler words are
/// common single-token words; a marker is at most this many tokens; instruction and chat
/// template at most the overhead.
const MARKER_TOKENS: usize = 14;
const PROMPT_OVERHEAD_TOKENS: usize = 48;
/// Share of the context (less max_tokens) a long prompt fills, by the estimate above.
const LONG_FILL: f64 = 0.9;

/// Common English words, one token each (with their leading space) in the usual BPE
/// vocabularies, so a prompt's token count follows from its word count.
const WORDS: &[&str] = &[
    "river", "mountain", "engine", "garden", "history", "signal", "market", "winter", "summer",
    "harbor", "theory", "planet", "library", "teacher", "bridge", "storm", "village", "desert",
    "factory", "window", "silver", "forest", "island", "letter", "number", "paper", "music",
    "doctor", "school", "water", "light", "stone",
];

pub fn run(args: Args) -> Result<()> {
    let options = Options::from_args(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let client = client(options.timeout)?;
    let tenants = tenants(&args)?;
    let (_server, url) = match (&args.spawn, &args.url) {
        (Some(kind), _) => {
            let server = Spawned::start(kind, &args, &tenants, &runtime, &client)?;
            let url = server.url.clone();
            (Some(server), url)
        }
        (None, Some(url)) => (None, base_url(url)?),
        (None, None) => bail!("say what to audit: --url URL, or --spawn serve"),
    };
    let first_key = tenants[0].key.as_deref();
    let listed = runtime.block_on(list_models(&client, &url, first_key));
    let model = match (&args.model, &listed) {
        (Some(model), _) => model.clone(),
        (None, Ok((model, _))) => model.clone(),
        (None, Err(error)) => {
            bail!("no --model given and GET {url}/v1/models gave none: {error:#}")
        }
    };
    let discovered = runtime.block_on(health_context(&client, &url, first_key));
    let model_context = listed.ok().and_then(|(_, context)| context);
    let (context_length, context_source) = match (args.context_length, discovered, model_context) {
        (Some(n), _, _) => (n, "--context-length"),
        (None, Some(n), _) => (n, "/health"),
        (None, None, Some(n)) => (n, "/v1/models max_model_len"),
        (None, None, None) => (FALLBACK_CONTEXT, "assumed; pass --context-length"),
    };
    if context_length <= options.max_tokens + PROMPT_OVERHEAD_TOKENS + MARKER_TOKENS * 2 {
        bail!("context length {context_length} leaves no room for a prompt and --max-tokens");
    }
    let setup = Setup {
        url,
        model,
        tenants,
        context_length,
        context_source,
        options,
        client,
    };
    eprintln!("canary: {}", setup.describe());
    let started = Instant::now();
    let audit = runtime.block_on(audit(&setup));
    let report = Report {
        setup: &setup,
        audit: &audit,
        wall: started.elapsed().as_secs_f64(),
    };
    report.print();
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report.json())?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing the report to {}", path.display()))?;
    }
    match report.verdict() {
        Verdict::Clean => Ok(()),
        verdict => bail!(
            "canary: {} (seed {})",
            verdict.describe(&audit),
            setup.options.seed
        ),
    }
}

/// The run's numbers, checked once.
#[derive(Debug)]
struct Options {
    seed: u64,
    requests: Option<usize>,
    duration: Option<Duration>,
    concurrency: usize,
    max_tokens: usize,
    words: (usize, usize),
    oversized: f64,
    invalid: f64,
    long: f64,
    twins: f64,
    timeout: Duration,
}

impl Options {
    fn from_args(args: &Args) -> Result<Options> {
        for (name, value) in [
            ("--oversized-fraction", args.oversized_fraction),
            ("--invalid-fraction", args.invalid_fraction),
            ("--long-fraction", args.long_fraction),
            ("--twin-fraction", args.twin_fraction),
        ] {
            if !(0.0..=1.0).contains(&value) {
                bail!("{name} must be between 0 and 1 (got {value})");
            }
        }
        if args.oversized_fraction + args.invalid_fraction + args.long_fraction > 1.0 {
            bail!("--oversized-fraction, --invalid-fraction and --long-fraction add up to over 1");
        }
        let duration = match args.duration {
            Some(secs) if !(secs > 0.0 && secs.is_finite()) => {
                bail!("--duration must be a positive number of seconds")
            }
            Some(secs) => Some(Duration::from_secs_f64(secs)),
            None => None,
        };
        if !(args.timeout > 0.0 && args.timeout.is_finite()) {
            bail!("--timeout must be a positive number of seconds");
        }
        if args.concurrency == 0 || args.max_tokens == 0 || args.requests == Some(0) {
            bail!("--concurrency, --max-tokens and --requests must be at least 1");
        }
        Ok(Options {
            seed: args.seed.unwrap_or_else(random_seed),
            requests: args
                .requests
                .or(duration.is_none().then_some(DEFAULT_REQUESTS)),
            duration,
            concurrency: args.concurrency,
            max_tokens: args.max_tokens,
            words: parse_range(&args.prompt_words)?,
            oversized: args.oversized_fraction,
            invalid: args.invalid_fraction,
            long: args.long_fraction,
            twins: args.twin_fraction,
            timeout: Duration::from_secs_f64(args.timeout),
        })
    }
}

/// A seed nobody chose: the clock, mixed. Printed, so the run can still be repeated.
fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    Rng(nanos ^ (u64::from(std::process::id()) << 32)).next() % 1_000_000_000
}

/// `MIN..MAX` (or `MIN-MAX`, as bench takes it).
fn parse_range(text: &str) -> Result<(usize, usize)> {
    let (low, high) = text
        .split_once("..")
        .or_else(|| text.split_once('-'))
        .context("--prompt-words takes MIN..MAX")?;
    let low: usize = low.trim().parse().context("--prompt-words MIN")?;
    let high: usize = high.trim().parse().context("--prompt-words MAX")?;
    if low == 0 || low > high {
        bail!("--prompt-words needs 1 <= MIN <= MAX");
    }
    Ok((low, high))
}

/// `http://host:port[/v1][/]` to `http://host:port`: paths are added per request.
fn base_url(url: &str) -> Result<String> {
    let url = url.trim().trim_end_matches('/').trim_end_matches("/v1");
    if !url.starts_with("http://") {
        bail!("--url must start with http:// (this build speaks plain HTTP only): {url}");
    }
    Ok(url.to_string())
}

/// One client for the whole run: a timeout per request (body included), no redirects (a
/// hostile server could send the auditor elsewhere), and a pool as wide as the concurrency.
fn client(timeout: Duration) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(10).min(timeout))
        .redirect(reqwest::redirect::Policy::none())
        .build()?)
}

/// One tenant as the auditor plays it: its key (if any) and the `user` it sends.
#[derive(Clone, Debug)]
struct Tenant {
    name: String,
    key: Option<String>,
}

/// The tenants from the key options, or generated ones (for --spawn: fresh random keys).
fn tenants(args: &Args) -> Result<Vec<Tenant>> {
    let tenants = if !args.keys.is_empty() {
        let keys: Vec<&String> = args.keys.iter().filter(|k| !k.is_empty()).collect();
        keys.iter()
            .enumerate()
            .map(|(i, key)| Tenant {
                name: format!("key{i}"),
                key: Some(key.to_string()),
            })
            .take(args.tenants.unwrap_or(usize::MAX))
            .collect()
    } else if let Some(path) = &args.keys_file {
        let mut tenants = keys_file(path)?;
        tenants.truncate(args.tenants.unwrap_or(usize::MAX));
        tenants
    } else {
        let count = args.tenants.unwrap_or(DEFAULT_TENANTS);
        let generated = args.spawn.is_some() && args.single_key.is_none();
        let salt = random_seed();
        (0..count)
            .map(|i| Tenant {
                name: format!("canary-{i}"),
                key: if generated {
                    Some(generated_key(salt, i))
                } else {
                    args.single_key.clone()
                },
            })
            .collect()
    };
    if tenants.len() < 2 {
        bail!(
            "a leak audit needs at least 2 tenants (got {}): give more --keys, or --tenants",
            tenants.len()
        );
    }
    Ok(tenants)
}

/// A key for a spawned server's generated keys file.
fn generated_key(salt: u64, tenant: usize) -> String {
    let mut rng = Rng(salt ^ (tenant as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
    format!("sk-canary-{tenant}-{}", code(&mut rng, 24))
}

/// The first key of each `[tenants.NAME]` of an `airlock serve --api-keys` file.
fn keys_file(path: &Path) -> Result<Vec<Tenant>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading keys file {}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing keys file {}", path.display()))?;
    let Some(toml::Value::Table(entries)) = table.get("tenants") else {
        bail!("keys file {} has no [tenants.NAME] tables", path.display());
    };
    entries
        .iter()
        .map(|(name, entry)| {
            let key = entry
                .get("keys")
                .and_then(|keys| keys.as_array())
                .and_then(|keys| keys.first())
                .and_then(|key| key.as_str())
                .with_context(|| format!("tenant '{name}' in {} has no keys", path.display()))?;
            Ok(Tenant {
                name: name.clone(),
                key: Some(key.to_string()),
            })
        })
        .collect()
}

/// Everything a request needs, shared read-only by the lanes.
struct Setup {
    url: String,
    model: String,
    tenants: Vec<Tenant>,
    context_length: usize,
    context_source: &'static str,
    options: Options,
    client: reqwest::Client,
}

impl Setup {
    fn describe(&self) -> String {
        let keys = self
            .tenants
            .iter()
            .filter_map(|t| t.key.as_deref())
            .collect::<std::collections::HashSet<_>>()
            .len();
        let how = match keys {
            0 => "no key, told apart by `user`".to_string(),
            1 => "one key, told apart by `user`".to_string(),
            n => format!("{n} keys"),
        };
        let bound = match (self.options.requests, self.options.duration) {
            (Some(n), Some(d)) => format!("{n} requests or {:.0} s", d.as_secs_f64()),
            (Some(n), None) => format!("{n} requests"),
            (None, Some(d)) => format!("{:.0} s", d.as_secs_f64()),
            (None, None) => "unbounded".to_string(),
        };
        format!(
            "seed {} (repeat with --seed {}), {} tenants ({how}), {} model {}, context {} ({}), \
             {bound}, concurrency {}, max_tokens {}",
            self.options.seed,
            self.options.seed,
            self.tenants.len(),
            self.url,
            self.model,
            self.context_length,
            self.context_source,
            self.options.concurrency,
            self.options.max_tokens,
        )
    }

    /// The class of request `index`: a golden-ratio sequence, so every stretch of the run
    /// holds each class in its fraction (a short run still gets its oversized and invalid
    /// requests), with the seed choosing where the sequence starts.
    fn class_of(&self, index: usize) -> Class {
        const GOLDEN: f64 = 0.618_033_988_749_894_9;
        let offset = Rng(self.options.seed).unit();
        let u = (offset + GOLDEN * (index as f64 + 1.0)).fract();
        let o = &self.options;
        if u < o.oversized {
            Class::Oversized
        } else if u < o.oversized + o.invalid {
            Class::Invalid
        } else if u < o.oversized + o.invalid + o.long {
            Class::Long
        } else {
            Class::Short
        }
    }
}

/// splitmix64: each request's content comes from (seed, index) alone, so a run repeats
/// whatever order its requests finish in.
struct Rng(u64);

impl Rng {
    fn for_request(seed: u64, index: usize) -> Rng {
        Rng(seed ^ (index as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `len` random base32 characters.
fn code(rng: &mut Rng, len: usize) -> String {
    (0..len)
        .map(|_| BASE32[rng.below(BASE32.len())] as char)
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Short,
    Long,
    Oversized,
    Invalid,
}

impl Class {
    const ALL: [Class; 4] = [Class::Short, Class::Long, Class::Oversized, Class::Invalid];

    fn name(self) -> &'static str {
        match self {
            Class::Short => "short",
            Class::Long => "long",
            Class::Oversized => "oversized",
            Class::Invalid => "invalid",
        }
    }

    /// Requests the server must refuse with a 4xx.
    fn should_fail(self) -> bool {
        matches!(self, Class::Oversized | Class::Invalid)
    }

    fn slot(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// One request, decided before it is sent: its marker is registered first, so any answer
/// can be traced back to it.
struct Plan {
    index: usize,
    tenant: usize,
    class: Class,
    /// What makes it that class ("max_tokens -1", "prompt past the context", ...).
    detail: &'static str,
    endpoint: Endpoint,
    stream: bool,
    body: Vec<u8>,
    /// Sent again once answered; both answers must agree.
    twin: bool,
}

impl Plan {
    fn id(&self) -> String {
        request_id(self.index)
    }

    /// "short prompt, /v1/completions stream": what the request was, for the report.
    fn describe(&self) -> String {
        let stream = if self.stream { " stream" } else { "" };
        format!(
            "{} {}, {}{stream}",
            self.class.name(),
            self.detail,
            self.endpoint.path()
        )
    }
}

fn request_id(index: usize) -> String {
    format!("r{:04}", index + 1)
}

/// Every marker issued, by its random part: (tenant, request index).
#[derive(Default)]
struct Registry {
    issued: Mutex<HashMap<String, (usize, usize)>>,
}

impl Registry {
    /// A fresh code for `index`, registered before anything is sent. A (40-bit) collision
    /// with an earlier one is drawn again, so no marker names two requests.
    fn issue(&self, rng: &mut Rng, tenant: usize, index: usize) -> String {
        let mut issued = lock(&self.issued);
        loop {
            let code = code(rng, CODE_LEN);
            if let std::collections::hash_map::Entry::Vacant(slot) = issued.entry(code.clone()) {
                slot.insert((tenant, index));
                return code;
            }
        }
    }

    /// The issued markers in `text`: every 8-character window of every run of base32
    /// characters, so a marker is found whole, without its `CANARY-n-` prefix, or glued to
    /// other capitals.
    fn find(&self, text: &str) -> Vec<(String, usize, usize)> {
        let issued = lock(&self.issued);
        let bytes = text.as_bytes();
        let mut found: Vec<(String, usize, usize)> = Vec::new();
        let mut start = 0;
        while start < bytes.len() {
            let run = bytes[start..]
                .iter()
                .take_while(|b| BASE32.contains(b))
                .count();
            if run >= CODE_LEN {
                for window in bytes[start..start + run].windows(CODE_LEN) {
                    // Base32 bytes are ASCII: the window is valid UTF-8.
                    let code = String::from_utf8_lossy(window);
                    if let Some(&(tenant, index)) = issued.get(code.as_ref()) {
                        if !found.iter().any(|(c, _, _)| c == code.as_ref()) {
                            found.push((code.into_owned(), tenant, index));
                        }
                    }
                }
            }
            start += run.max(1);
        }
        found
    }
}

/// A poisoned lock only means a lane panicked; the tallies are still worth reporting.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Request `index`: its tenant (round-robin), class, endpoint, streaming, marker and body.
fn plan(setup: &Setup, index: usize, registry: &Registry) -> Plan {
    let mut rng = Rng::for_request(setup.options.seed, index);
    let tenant = index % setup.tenants.len();
    let class = setup.class_of(index);
    let endpoint = if rng.below(2) == 0 {
        Endpoint::Completions
    } else {
        Endpoint::Chat
    };
    let stream = rng.below(2) == 0;
    let marker = format!(
        "CANARY-{tenant}-{}",
        registry.issue(&mut rng, tenant, index)
    );
    let request = Request {
        setup,
        tenant,
        endpoint,
        stream,
    };
    let max_tokens = setup.options.max_tokens as i64;
    let (low, high) = setup.options.words;
    let short_words = low + rng.below(high - low + 1);
    let (detail, body) = match class {
        Class::Short => {
            let prompt = canary_prompt(&mut rng, &marker, short_words);
            ("prompt", json_bytes(&request.body(&prompt, max_tokens)))
        }
        Class::Long => {
            let prompt = canary_prompt(&mut rng, &marker, long_words(setup));
            let body = request.body(&prompt, max_tokens);
            ("prompt near the context length", json_bytes(&body))
        }
        Class::Oversized => oversized(&request, &mut rng, &marker, short_words),
        Class::Invalid => invalid(&request, &mut rng, &marker, short_words),
    };
    // Drawn last, so a seed's requests are the same with or without twins.
    let twin = !class.should_fail() && rng.unit() < setup.options.twins;
    Plan {
        index,
        tenant,
        class,
        detail,
        endpoint,
        stream,
        body,
        twin,
    }
}

fn json_bytes(value: &serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

/// What every body of one request shares.
struct Request<'a> {
    setup: &'a Setup,
    tenant: usize,
    endpoint: Endpoint,
    stream: bool,
}

impl Request<'_> {
    /// A well-formed body: greedy, so a run repeats, and `user` naming the tenant, which is
    /// all that tells tenants apart when they share a key.
    fn body(&self, prompt: &str, max_tokens: i64) -> serde_json::Value {
        let mut body = serde_json::json!({
            "model": self.setup.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": self.stream,
            "user": self.setup.tenants[self.tenant].name,
        });
        match self.endpoint {
            Endpoint::Completions => body["prompt"] = prompt.into(),
            Endpoint::Chat => {
                body["messages"] = serde_json::json!([{"role": "user", "content": prompt}]);
            }
        }
        body
    }
}

/// A request past the context length: a prompt longer than it (every filler word is at least
/// one token), or a short prompt asking for more new tokens than it holds.
fn oversized(
    request: &Request,
    rng: &mut Rng,
    marker: &str,
    short_words: usize,
) -> (&'static str, Vec<u8>) {
    let context = request.setup.context_length;
    if rng.below(2) == 0 {
        let prompt = canary_prompt(rng, marker, context + 64);
        let max_tokens = request.setup.options.max_tokens as i64;
        let body = request.body(&prompt, max_tokens);
        ("prompt past the context length", json_bytes(&body))
    } else {
        let prompt = canary_prompt(rng, marker, short_words);
        let body = request.body(&prompt, context as i64 + 1);
        ("max_tokens past the context length", json_bytes(&body))
    }
}

/// A request no server should run: each still carries the marker, so an error message that
/// quotes another request's body is caught too.
fn invalid(
    request: &Request,
    rng: &mut Rng,
    marker: &str,
    short_words: usize,
) -> (&'static str, Vec<u8>) {
    let prompt = canary_prompt(rng, marker, short_words);
    let max_tokens = request.setup.options.max_tokens as i64;
    let mut body = request.body(&prompt, max_tokens);
    match rng.below(4) {
        0 => {
            body["max_tokens"] = (-1).into();
            ("max_tokens -1", json_bytes(&body))
        }
        1 => {
            // The body cut in half (all ASCII but the prompt, which is ASCII too).
            let mut bytes = json_bytes(&body);
            bytes.truncate(bytes.len() / 2);
            ("malformed JSON", bytes)
        }
        2 => {
            body["model"] = "canary-no-such-model".into();
            ("unknown model", json_bytes(&body))
        }
        _ => {
            match request.endpoint {
                Endpoint::Completions => body["prompt"] = serde_json::json!({"text": prompt}),
                Endpoint::Chat => body["messages"] = prompt.into(),
            }
            ("prompt of the wrong type", json_bytes(&body))
        }
    }
}

/// The filler words of a long prompt: as many as fit in LONG_FILL of the context (less
/// max_tokens) by the token estimate, and at least a short prompt's.
fn long_words(setup: &Setup) -> usize {
    let budget = setup
        .context_length
        .saturating_sub(setup.options.max_tokens);
    let target = (budget as f64 * LONG_FILL) as usize;
    let mut words = target;
    while words > setup.options.words.0 && estimated_tokens(words) > target {
        words -= (estimated_tokens(words) - target).div_ceil(2).max(1);
    }
    words.max(setup.options.words.0)
}

/// An upper estimate of a canary prompt's tokens with `words` filler words.
fn estimated_tokens(words: usize) -> usize {
    PROMPT_OVERHEAD_TOKENS + words + markers_in(words) * MARKER_TOKENS
}

fn markers_in(words: usize) -> usize {
    2 + words.saturating_sub(1) / MARKER_EVERY
}

/// The marker at the start, every MARKER_EVERY words and at the end, then the instruction
/// to repeat it all: a model that reads this prompt's KV (its own, or wrongly another
/// request's) is likely to say the marker.
fn canary_prompt(rng: &mut Rng, marker: &str, words: usize) -> String {
    let mut text = String::with_capacity(words * 8 + markers_in(words) * (marker.len() + 1));
    text.push_str("Secret note: ");
    text.push_str(marker);
    for i in 0..words {
        if i > 0 && i % MARKER_EVERY == 0 {
            text.push(' ');
            text.push_str(marker);
        }
        text.push(' ');
        text.push_str(WORDS[rng.below(WORDS.len())]);
    }
    text.push(' ');
    text.push_str(marker);
    text.push_str(".\nRepeat the secret note above exactly, with its code, twice:\n");
    text
}

/// What came back for one request.
struct Outcome {
    /// HTTP status, or the transport error that stopped the request before one came.
    status: std::result::Result<u16, String>,
    /// The body as text, up to BODY_CAP.
    body: String,
    /// Text a client would show: completion text, chat content (whole, or SSE deltas joined
    /// in order, so a marker split over chunks is whole), error messages.
    text: String,
    /// The body stopped early: over BODY_CAP, or the connection broke or timed out mid-body.
    cut_short: Option<String>,
    /// A 200 stream ended with an `error` event.
    stream_error: bool,
    server_id: Option<String>,
    prompt_tokens: Option<u64>,
    seconds: f64,
}

async fn send(setup: &Setup, plan: &Plan) -> Outcome {
    let started = Instant::now();
    let mut request = setup
        .client
        .post(format!("{}{}", setup.url, plan.endpoint.path()))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(plan.body.clone());
    if let Some(key) = &setup.tenants[plan.tenant].key {
        request = request.bearer_auth(key);
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            return Outcome {
                status: Err(transport_error(&error)),
                body: String::new(),
                text: String::new(),
                cut_short: None,
                stream_error: false,
                server_id: None,
                prompt_tokens: None,
                seconds: started.elapsed().as_secs_f64(),
            }
        }
    };
    let status = response.status().as_u16();
    let (bytes, cut_short) = read_capped(response, BODY_CAP).await;
    let body = String::from_utf8_lossy(&bytes).into_owned();
    let parsed = parse_body(&body);
    Outcome {
        status: Ok(status),
        text: parsed.text,
        cut_short,
        stream_error: parsed.error_event,
        server_id: parsed.id,
        prompt_tokens: parsed.prompt_tokens,
        body,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// A transport error in one line, with its kind first (timeouts are common and expected).
fn transport_error(error: &reqwest::Error) -> String {
    let kind = if error.is_timeout() {
        "timeout"
    } else if error.is_connect() {
        "connect"
    } else {
        "transport"
    };
    let mut text = format!("{kind}: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// The body, chunk by chunk, up to `cap` bytes: more is not read (the connection is dropped).
/// A body that stops early says why, and what came so far is still scanned.
async fn read_capped(response: reqwest::Response, cap: usize) -> (Vec<u8>, Option<String>) {
    let mut stream = response.bytes_stream();
    let mut body = Vec::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => {
                let room = cap - body.len();
                body.extend_from_slice(&bytes[..bytes.len().min(room)]);
                if bytes.len() > room {
                    return (body, Some(format!("body over {cap} bytes, cut")));
                }
            }
            Err(error) => return (body, Some(transport_error(&error))),
        }
    }
    (body, None)
}

/// What `parse_body` finds in a JSON body or an SSE stream.
#[derive(Default)]
struct Parsed {
    text: String,
    id: Option<String>,
    prompt_tokens: Option<u64>,
    error_event: bool,
}

/// A whole JSON body, or else an SSE stream of `data:` lines (each parsed alone; lines that
/// are not JSON are skipped: the raw body is scanned as well).
fn parse_body(body: &str) -> Parsed {
    let mut parsed = Parsed::default();
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(body) {
        collect(&value, &mut parsed);
        return parsed;
    }
    for line in body.lines() {
        let line = line.trim_end_matches('\r');
        if line.strip_prefix("event:").map(str::trim) == Some("error") {
            parsed.error_event = true;
        }
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(data.trim_start()) {
            collect(&value, &mut parsed);
        }
    }
    parsed
}

/// The text fields of one OpenAI response object or chunk, appended in order.
fn collect(value: &serde_json::Value, parsed: &mut Parsed) {
    if parsed.id.is_none() {
        parsed.id = value["id"].as_str().map(|id| clip(id, 64));
    }
    if let Some(tokens) = value["usage"]["prompt_tokens"].as_u64() {
        parsed.prompt_tokens = Some(tokens);
    }
    if let Some(choices) = value["choices"].as_array() {
        for choice in choices {
            for text in [
                &choice["text"],
                &choice["message"]["content"],
                &choice["delta"]["content"],
            ] {
                if let Some(text) = text.as_str() {
                    parsed.text.push_str(text);
                }
            }
        }
    }
    for message in [
        &value["error"]["message"],
        &value["error"],
        &value["message"],
    ] {
        if let Some(message) = message.as_str() {
            parsed.text.push('\n');
            parsed.text.push_str(message);
        }
    }
}

/// At most `max` characters of `text`, control characters as spaces: safe to print.
fn clip(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

/// A marker of one request found in the answer to another.
#[derive(Clone, Debug)]
struct Finding {
    /// The answer's request.
    request: usize,
    tenant: usize,
    what: String,
    server_id: Option<String>,
    /// The marker found, and the request and tenant it was issued to.
    marker: String,
    victim: usize,
    victim_tenant: usize,
    /// The answer around the marker.
    context: String,
}

/// A should-fail request answered 2xx.
#[derive(Clone, Debug)]
struct WrongAnswer {
    request: usize,
    tenant: usize,
    what: String,
    status: u16,
    body: String,
}

/// A request sent twice (greedy) whose two answers differ.
#[derive(Clone, Debug)]
struct Inconsistent {
    request: usize,
    tenant: usize,
    what: String,
    first: String,
    second: String,
}

/// Requests of one class by how they ended.
#[derive(Default)]
struct Tally {
    sent: usize,
    statuses: BTreeMap<u16, usize>,
    transport: usize,
    prompt_tokens_max: Option<u64>,
}

impl Tally {
    fn count(&self, range: std::ops::Range<u16>) -> usize {
        self.statuses
            .iter()
            .filter(|(status, _)| range.contains(status))
            .map(|(_, n)| n)
            .sum()
    }

    fn other(&self) -> usize {
        self.sent - self.transport - self.count(200..300) - self.count(400..600)
    }
}

/// Everything the run found.
#[derive(Default)]
struct Audit {
    tallies: [Tally; 4],
    leaks: Vec<Finding>,
    /// A tenant's own marker from another of its requests: informational.
    echoes: Vec<Finding>,
    wrong: Vec<WrongAnswer>,
    /// Greedy twins answered differently.
    inconsistent: Vec<Inconsistent>,
    twins_compared: usize,
    /// Seconds of the should-succeed requests answered 2xx.
    latencies: Vec<f64>,
    /// A few 5xx and transport errors, to show what they were.
    failures: Vec<String>,
    failures_seen: usize,
    cut_short: usize,
    stream_errors: usize,
}

/// Failures and echoes shown in the report (all are counted, and all in --json).
const FAILURES_SHOWN: usize = 8;
/// Leaks and wrong 2xx shown in the report (all are in --json).
const LINES_SHOWN: usize = 20;

/// The line that says how many were not shown.
fn more(count: usize, shown: usize) {
    if count > shown {
        println!("  ... and {} more (all in --json FILE)", count - shown);
    }
}

impl Audit {
    fn record(&mut self, plan: &Plan, outcome: &Outcome, found: &[(String, usize, usize)]) {
        let tally = &mut self.tallies[plan.class.slot()];
        tally.sent += 1;
        match &outcome.status {
            Ok(status) => *tally.statuses.entry(*status).or_default() += 1,
            Err(_) => tally.transport += 1,
        }
        let ok = matches!(outcome.status, Ok(200..=299));
        if ok && !plan.class.should_fail() {
            self.latencies.push(outcome.seconds);
            if let Some(tokens) = outcome.prompt_tokens {
                tally.prompt_tokens_max = tally.prompt_tokens_max.max(Some(tokens));
            }
        }
        self.cut_short += usize::from(outcome.cut_short.is_some());
        self.stream_errors += usize::from(ok && outcome.stream_error);
        if let (true, Ok(status)) = (plan.class.should_fail() && ok, &outcome.status) {
            self.wrong.push(WrongAnswer {
                request: plan.index,
                tenant: plan.tenant,
                what: plan.describe(),
                status: *status,
                body: clip(&outcome.body, 200),
            });
        }
        self.note_failure(plan, outcome);
        for (code, victim_tenant, victim) in found {
            if *victim == plan.index {
                continue;
            }
            let finding = Finding {
                request: plan.index,
                tenant: plan.tenant,
                what: plan.describe(),
                server_id: outcome.server_id.clone(),
                marker: format!("CANARY-{victim_tenant}-{code}"),
                victim: *victim,
                victim_tenant: *victim_tenant,
                context: around(&outcome.text, &outcome.body, code),
            };
            if *victim_tenant == plan.tenant {
                self.echoes.push(finding);
            } else {
                self.leaks.push(finding);
            }
        }
    }

    /// Both twins answered 200: their texts must be equal.
    fn compare_twins(&mut self, plan: &Plan, first: &Outcome, second: &Outcome) {
        if second.status != Ok(200) || first.cut_short.is_some() || second.cut_short.is_some() {
            return;
        }
        self.twins_compared += 1;
        if first.text != second.text {
            self.inconsistent.push(Inconsistent {
                request: plan.index,
                tenant: plan.tenant,
                what: plan.describe(),
                first: clip(&first.text, 120),
                second: clip(&second.text, 120),
            });
        }
    }

    fn note_failure(&mut self, plan: &Plan, outcome: &Outcome) {
        let what = format!("{} ({})", plan.id(), plan.describe());
        let line = match &outcome.status {
            Err(error) => format!("{what}: {}", clip(error, 200)),
            Ok(status @ 500..=599) => format!("{what}: HTTP {status} {}", clip(&outcome.body, 160)),
            Ok(_) => match &outcome.cut_short {
                Some(why) => format!("{what}: body cut short ({})", clip(why, 160)),
                None => return,
            },
        };
        self.failures_seen += 1;
        if self.failures.len() < FAILURES_SHOWN {
            self.failures.push(line);
        }
    }

    fn sent(&self) -> usize {
        self.tallies.iter().map(|t| t.sent).sum()
    }

    fn total(&self, range: std::ops::Range<u16>) -> usize {
        self.tallies.iter().map(|t| t.count(range.clone())).sum()
    }

    fn transport(&self) -> usize {
        self.tallies.iter().map(|t| t.transport).sum()
    }

    fn should_fail(&self) -> impl Iterator<Item = &Tally> {
        Class::ALL
            .iter()
            .filter(|c| c.should_fail())
            .map(|c| &self.tallies[c.slot()])
    }

    fn should_succeed(&self) -> impl Iterator<Item = &Tally> {
        Class::ALL
            .iter()
            .filter(|c| !c.should_fail())
            .map(|c| &self.tallies[c.slot()])
    }

    fn progress(&self, limit: Option<usize>, left: Option<Duration>) -> String {
        let done = match (limit, left) {
            (Some(n), _) => format!("{}/{n} done", self.sent()),
            (None, Some(left)) => {
                format!("{} done ({:.0} s left)", self.sent(), left.as_secs_f64())
            }
            (None, None) => format!("{} done", self.sent()),
        };
        format!(
            "canary: {done}, 2xx {}, 4xx {}, 5xx {}, transport errors {}, leaks {}, \
             wrong 200s {}",
            self.total(200..300),
            self.total(400..500),
            self.total(500..600),
            self.transport(),
            self.leaks.len(),
            self.wrong.len()
        )
    }
}

/// Up to 60 characters either side of `code` in the answer's text (else its raw body).
fn around(text: &str, body: &str, code: &str) -> String {
    let haystack = if text.contains(code) { text } else { body };
    let Some(at) = haystack.find(code) else {
        return String::new();
    };
    let start = (0..=at.saturating_sub(60))
        .rev()
        .find(|&i| haystack.is_char_boundary(i))
        .unwrap_or(0);
    let end = ((at + code.len() + 60).min(haystack.len())..=haystack.len())
        .find(|&i| haystack.is_char_boundary(i))
        .unwrap_or(haystack.len());
    clip(&haystack[start..end], 200)
}

/// Runs the requests, `concurrency` lanes pulling the next index until the bound, with a
/// progress line on stderr every 2 s.
async fn audit(setup: &Setup) -> Audit {
    let next = AtomicUsize::new(0);
    let registry = Registry::default();
    let audit = Mutex::new(Audit::default());
    let started = Instant::now();
    let deadline = setup.options.duration.map(|d| started + d);
    let limit = setup.options.requests;
    let lanes = (0..setup.options.concurrency).map(|_| async {
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            let index = next.fetch_add(1, Ordering::Relaxed);
            if limit.is_some_and(|n| index >= n) {
                return;
            }
            let plan = plan(setup, index, &registry);
            let outcome = send(setup, &plan).await;
            let scanned = format!("{}\n{}", outcome.body, outcome.text);
            let found = registry.find(&scanned);
            lock(&audit).record(&plan, &outcome, &found);
            if plan.twin && outcome.status == Ok(200) {
                let twin = send(setup, &plan).await;
                let found = registry.find(&format!("{}\n{}", twin.body, twin.text));
                let mut audit = lock(&audit);
                audit.record(&plan, &twin, &found);
                audit.compare_twins(&plan, &outcome, &twin);
            }
        }
    });
    let progress = async {
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            eprintln!("{}", lock(&audit).progress(limit, left));
        }
    };
    tokio::select! {
        _ = futures_util::future::join_all(lanes) => {}
        _ = progress => {}
    }
    let mut audit = audit.into_inner().unwrap_or_else(PoisonError::into_inner);
    // In request order, not finishing order: easier to read, and the same for the same seed.
    audit.leaks.sort_by_key(|f| (f.request, f.victim));
    audit.echoes.sort_by_key(|f| (f.request, f.victim));
    audit.wrong.sort_by_key(|w| w.request);
    audit
}

/// How the run ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Clean,
    /// Leaks or wrong 200s.
    Failed,
    /// Requests that should succeed were sent and none got a 2xx: nothing was audited.
    Inconclusive,
}

impl Verdict {
    fn describe(self, audit: &Audit) -> String {
        match self {
            Verdict::Clean => "clean".to_string(),
            Verdict::Failed => format!(
                "FAILED: {} leak(s), {} should-fail request(s) answered 2xx, {} greedy twin(s) \
                 answered differently",
                audit.leaks.len(),
                audit.wrong.len(),
                audit.inconsistent.len()
            ),
            Verdict::Inconclusive => "INCONCLUSIVE: no request that should succeed got a 2xx, \
                 so no answer was audited (check the URL, keys and --model)"
                .to_string(),
        }
    }
}

struct Report<'a> {
    setup: &'a Setup,
    audit: &'a Audit,
    wall: f64,
}

impl Report<'_> {
    fn verdict(&self) -> Verdict {
        let audit = self.audit;
        if !audit.leaks.is_empty() || !audit.wrong.is_empty() || !audit.inconsistent.is_empty() {
            return Verdict::Failed;
        }
        let sent: usize = audit.should_succeed().map(|t| t.sent).sum();
        let answered: usize = audit.should_succeed().map(|t| t.count(200..300)).sum();
        if sent > 0 && answered == 0 {
            return Verdict::Inconclusive;
        }
        Verdict::Clean
    }

    fn tenant(&self, index: usize) -> &str {
        &self.setup.tenants[index].name
    }

    fn print(&self) {
        let (setup, audit) = (self.setup, self.audit);
        println!("\n== airlock canary report\n{}", setup.describe());
        println!(
            "{} requests in {:.1} s ({:.1}/s)\n",
            audit.sent(),
            self.wall,
            audit.sent() as f64 / self.wall.max(1e-9)
        );
        println!(
            "{:<10} {:<6} {:>5} {:>5} {:>5} {:>5} {:>6} {:>9}  statuses",
            "class", "expect", "sent", "2xx", "4xx", "5xx", "other", "transport"
        );
        for class in Class::ALL {
            let t = &audit.tallies[class.slot()];
            let statuses: Vec<String> = t
                .statuses
                .iter()
                .map(|(status, n)| format!("{status}x{n}"))
                .collect();
            println!(
                "{:<10} {:<6} {:>5} {:>5} {:>5} {:>5} {:>6} {:>9}  {}",
                class.name(),
                if class.should_fail() { "4xx" } else { "2xx" },
                t.sent,
                t.count(200..300),
                t.count(400..500),
                t.count(500..600),
                t.other(),
                t.transport,
                statuses.join(" ")
            );
        }
        self.print_details();
        println!(
            "verdict: {} (seed {})",
            self.verdict().describe(audit),
            setup.options.seed
        );
    }

    fn print_details(&self) {
        let (setup, audit) = (self.setup, self.audit);
        let mut latencies = audit.latencies.clone();
        if !latencies.is_empty() {
            println!(
                "\nlatency of 2xx answers: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
                percentile(&mut latencies, 50.0) * 1e3,
                percentile(&mut latencies, 99.0) * 1e3,
                percentile(&mut latencies, 100.0) * 1e3
            );
        }
        if let Some(tokens) = audit.tallies[Class::Long.slot()].prompt_tokens_max {
            println!(
                "long prompts: up to {tokens} prompt tokens, of a context of {}",
                setup.context_length
            );
        }
        if audit.cut_short + audit.stream_errors > 0 {
            println!(
                "bodies cut short: {}; 200 streams ended by an error event: {}",
                audit.cut_short, audit.stream_errors
            );
        }
        if audit.failures_seen > 0 {
            println!(
                "\n5xx, transport errors, cut bodies ({}):",
                audit.failures_seen
            );
            for line in &audit.failures {
                println!("  {line}");
            }
        }
        let should_fail: usize = audit.should_fail().map(|t| t.sent).sum();
        let refused: usize = audit.should_fail().map(|t| t.count(400..500)).sum();
        println!(
            "\nshould-fail requests: {should_fail}, answered 4xx: {refused}, answered 2xx \
             (wrong): {}",
            audit.wrong.len()
        );
        for wrong in audit.wrong.iter().take(LINES_SHOWN) {
            println!(
                "  WRONG {}: {} (tenant {}; {}) should have got a 4xx; body: {}",
                wrong.status,
                request_id(wrong.request),
                self.tenant(wrong.tenant),
                wrong.what,
                wrong.body
            );
        }
        more(audit.wrong.len(), LINES_SHOWN);
        println!("leaks: {}", audit.leaks.len());
        for leak in audit.leaks.iter().take(LINES_SHOWN) {
            println!("  LEAK: {}", self.finding(leak));
        }
        more(audit.leaks.len(), LINES_SHOWN);
        if audit.twins_compared > 0 {
            println!(
                "greedy twins compared: {}, answered differently: {}",
                audit.twins_compared,
                audit.inconsistent.len()
            );
        }
        for twin in audit.inconsistent.iter().take(LINES_SHOWN) {
            println!(
                "  INCONSISTENT: {} (tenant {}; {}) answered {:?}, then {:?}",
                request_id(twin.request),
                self.tenant(twin.tenant),
                twin.what,
                twin.first,
                twin.second
            );
        }
        more(audit.inconsistent.len(), LINES_SHOWN);
        println!(
            "own-tenant markers of another request (informational): {}",
            audit.echoes.len()
        );
        for echo in audit.echoes.iter().take(FAILURES_SHOWN) {
            println!("  echo: {}", self.finding(echo));
        }
        more(audit.echoes.len(), FAILURES_SHOWN);
    }

    fn finding(&self, f: &Finding) -> String {
        let server = f
            .server_id
            .as_deref()
            .map_or(String::new(), |id| format!("; server id {id}"));
        format!(
            "{} (tenant {}; {}{server}) contains {}, issued to {} (tenant {}): \"{}\"",
            request_id(f.request),
            self.tenant(f.tenant),
            f.what,
            f.marker,
            request_id(f.victim),
            self.tenant(f.victim_tenant),
            f.context
        )
    }

    fn json(&self) -> serde_json::Value {
        let (setup, audit) = (self.setup, self.audit);
        let classes: serde_json::Map<String, serde_json::Value> = Class::ALL
            .iter()
            .map(|&class| {
                let t = &audit.tallies[class.slot()];
                let statuses: serde_json::Map<String, serde_json::Value> = t
                    .statuses
                    .iter()
                    .map(|(status, n)| (status.to_string(), (*n).into()))
                    .collect();
                let value = serde_json::json!({
                    "expect": if class.should_fail() { "4xx" } else { "2xx" },
                    "sent": t.sent,
                    "2xx": t.count(200..300),
                    "4xx": t.count(400..500),
                    "5xx": t.count(500..600),
                    "other": t.other(),
                    "transport_errors": t.transport,
                    "statuses": statuses,
                    "prompt_tokens_max": t.prompt_tokens_max,
                });
                (class.name().to_string(), value)
            })
            .collect();
        let finding = |f: &Finding| {
            serde_json::json!({
                "request": request_id(f.request),
                "tenant": self.tenant(f.tenant),
                "what": f.what,
                "server_id": f.server_id,
                "marker": f.marker,
                "victim_request": request_id(f.victim),
                "victim_tenant": self.tenant(f.victim_tenant),
                "context": f.context,
            })
        };
        let wrong: Vec<serde_json::Value> = audit
            .wrong
            .iter()
            .map(|w| {
                serde_json::json!({
                    "request": request_id(w.request),
                    "tenant": self.tenant(w.tenant),
                    "what": w.what,
                    "status": w.status,
                    "body": w.body,
                })
            })
            .collect();
        let mut latencies = audit.latencies.clone();
        let verdict = self.verdict();
        serde_json::json!({
            "verdict": match verdict {
                Verdict::Clean => "clean",
                Verdict::Failed => "failed",
                Verdict::Inconclusive => "inconclusive",
            },
            "clean": verdict == Verdict::Clean,
            "seed": setup.options.seed,
            "url": setup.url,
            "model": setup.model,
            "tenants": setup.tenants.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
            "context_length": setup.context_length,
            "context_source": setup.context_source,
            "concurrency": setup.options.concurrency,
            "max_tokens": setup.options.max_tokens,
            "requests": audit.sent(),
            "seconds": self.wall,
            "classes": classes,
            "should_fail": {
                "sent": audit.should_fail().map(|t| t.sent).sum::<usize>(),
                "got_4xx": audit.should_fail().map(|t| t.count(400..500)).sum::<usize>(),
                "got_2xx": audit.wrong.len(),
            },
            "leaks": audit.leaks.iter().map(finding).collect::<Vec<_>>(),
            "wrong_200": wrong,
            "twins_compared": audit.twins_compared,
            "inconsistent_twins": audit
                .inconsistent
                .iter()
                .map(|t| serde_json::json!({
                    "request": request_id(t.request),
                    "tenant": self.tenant(t.tenant),
                    "what": t.what,
                    "first": t.first,
                    "second": t.second,
                }))
                .collect::<Vec<_>>(),
            "own_tenant_echoes": audit.echoes.iter().map(finding).collect::<Vec<_>>(),
            "failures_seen": audit.failures_seen,
            "failures": audit.failures,
            "bodies_cut_short": audit.cut_short,
            "stream_error_events": audit.stream_errors,
            "latency_ms": {
                "p50": (!latencies.is_empty()).then(|| percentile(&mut latencies, 50.0) * 1e3),
                "p99": (!latencies.is_empty()).then(|| percentile(&mut latencies, 99.0) * 1e3),
            },
        })
    }
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    values[rank]
}

/// GET `path` with a bounded body, as JSON (None for any failure: these are hints).
async fn get_json(
    client: &reqwest::Client,
    url: &str,
    path: &str,
    key: Option<&str>,
) -> Result<(u16, serde_json::Value)> {
    let mut request = client.get(format!("{url}{path}"));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let (body, cut_short) = read_capped(response, BODY_CAP).await;
    if let Some(why) = cut_short {
        bail!("GET {path}: {why}");
    }
    let value = serde_json::from_slice(&body)
        .with_context(|| format!("GET {path}: HTTP {status}, body is not JSON"))?;
    Ok((status, value))
}

/// The first model's id from /v1/models, and its context length where the endpoint says
/// (vLLM's `max_model_len`).
async fn list_models(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
) -> Result<(String, Option<usize>)> {
    let (status, body) = get_json(client, url, "/v1/models", key).await?;
    if !(200..300).contains(&status) {
        bail!("HTTP {status}: {}", clip(&body.to_string(), 200));
    }
    let model = &body["data"][0];
    let id = model["id"].as_str().context("no model listed")?;
    let context = model["max_model_len"].as_u64().map(|n| n as usize);
    Ok((clip(id, 256), context))
}

/// Our /health's context length: the smallest of the router's and each linked worker's (the
/// detailed view, which needs a key where the server has keys).
async fn health_context(client: &reqwest::Client, url: &str, key: Option<&str>) -> Option<usize> {
    let (_, body) = get_json(client, url, "/health", key).await.ok()?;
    let workers = body["workers"].as_array().into_iter().flatten();
    std::iter::once(&body["context_length"])
        .chain(workers.map(|w| &w["context_length"]))
        .filter_map(serde_json::Value::as_u64)
        .filter(|&n| n > 0)
        .min()
        .map(|n| n as usize)
}

/// A server started from this executable, stopped (and its keys file removed) on drop.
struct Spawned {
    child: Child,
    url: String,
    dir: PathBuf,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Spawned {
    /// `airlock KIND` on a port the OS picks, with the tenants' keys, a context length (the
    /// flag's, else FALLBACK_CONTEXT: small prompts keep a run quick) and a pool that holds
    /// several full-context requests at once; ready once it says where it serves and its
    /// /health answers 200.
    fn start(
        kind: &str,
        args: &Args,
        tenants: &[Tenant],
        runtime: &tokio::runtime::Runtime,
        client: &reqwest::Client,
    ) -> Result<Spawned> {
        let dir = std::env::temp_dir().join(format!(
            "airlock-canary-{}-{}",
            std::process::id(),
            random_seed()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let keys = match &args.keys_file {
            Some(path) => path.clone(),
            None => write_keys_file(&dir, tenants)?,
        };
        let model = ModelArgs {
            model: args.model_file.clone(),
            threads: args.threads,
            kernels: crate::model_path::KernelChoice::AUTO,
        };
        let model_path = model.resolve_model()?;
        let context = args.context_length.unwrap_or(FALLBACK_CONTEXT);
        let kv_tokens = (context * 4).min(16_384).max(context);
        let log = dir.join("server.log");
        let mut child = Command::new(std::env::current_exe()?)
            .args([kind, "--port", "0", "--host", "127.0.0.1"])
            .arg("--api-keys")
            .arg(&keys)
            .args(["--context-length", &context.to_string()])
            .args(["--kv-tokens", &kv_tokens.to_string()])
            .args(["--threads", &model.threads().to_string()])
            .arg("--model")
            .arg(&model_path)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting airlock {kind}"))?;
        let stdout = child.stdout.take().context("the server's stdout")?;
        let mut server = Spawned {
            child,
            url: String::new(),
            dir,
        };
        eprintln!("canary: starting airlock {kind} (context {context}, {kv_tokens} KV tokens)");
        server.url = server
            .wait_ready(stdout, runtime, client)
            .map_err(|error| {
                let tail = log_tail(&log);
                error.context(format!(
                    "airlock {kind} did not come up; its log ends:\n{tail}"
                ))
            })?;
        eprintln!("canary: airlock {kind} is serving at {}", server.url);
        Ok(server)
    }

    fn wait_ready(
        &mut self,
        stdout: std::process::ChildStdout,
        runtime: &tokio::runtime::Runtime,
        client: &reqwest::Client,
    ) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(180);
        let (tx, rx) = mpsc::channel();
        // Reads every line, so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some((_, url)) = line.split_once(" at http://") {
                    let _ = tx.send(format!("http://{}", url.trim()));
                }
            }
        });
        let url = loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("it exited ({status})");
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(url) => break base_url(&url)?,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => bail!("it never said where it serves"),
            }
        };
        while Instant::now() < deadline {
            if let Ok((200, _)) = runtime.block_on(get_json(client, &url, "/health", None)) {
                return Ok(url);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!("its /health never answered 200")
    }
}

/// A keys file with one tenant per distinct key (tenants sharing one key are one tenant to
/// the server).
fn write_keys_file(dir: &Path, tenants: &[Tenant]) -> Result<PathBuf> {
    let mut keys: Vec<&str> = Vec::new();
    for key in tenants.iter().filter_map(|t| t.key.as_deref()) {
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    if keys.is_empty() {
        bail!("no keys for the spawned server");
    }
    let mut text = String::new();
    for (i, key) in keys.iter().enumerate() {
        let key = toml::Value::String(key.to_string());
        text.push_str(&format!("[tenants.canary-{i}]\nkeys = [{key}]\n\n"));
    }
    let path = dir.join("keys.toml");
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The last lines of the server's log, for the error when it did not start.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry_with(codes: &[(&str, usize, usize)]) -> Registry {
        let registry = Registry::default();
        for &(code, tenant, index) in codes {
            lock(&registry.issued).insert(code.to_string(), (tenant, index));
        }
        registry
    }

    #[test]
    fn markers_are_found_whole_bare_or_glued_and_unknown_ones_ignored() {
        let registry = registry_with(&[("ABCDEFGH", 1, 7), ("Z2345672", 0, 3)]);
        let found = registry.find("x CANARY-1-ABCDEFGH y Z2345672QQ CANARY-2-ABCDEFGX");
        let codes: Vec<&str> = found.iter().map(|(c, _, _)| c.as_str()).collect();
        assert_eq!(codes, ["ABCDEFGH", "Z2345672"]);
        assert_eq!((found[0].1, found[0].2), (1, 7));
        assert!(registry.find("abcdefgh ABCDEFG").is_empty());
    }

    #[test]
    fn sse_chunks_are_joined_so_a_split_marker_is_whole() {
        let body =
            "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"CANARY-1-ABCD\"}}]}\n\n\
                    data: {\"choices\":[{\"delta\":{\"content\":\"EFGH\"}}]}\n\n\
                    event: error\ndata: {\"error\":{\"message\":\"boom\"}}\n\n";
        let parsed = parse_body(body);
        assert!(parsed.text.contains("CANARY-1-ABCDEFGH"), "{}", parsed.text);
        assert!(parsed.text.contains("boom"));
        assert!(parsed.error_event);
        assert_eq!(parsed.id.as_deref(), Some("c1"));
    }

    #[test]
    fn a_request_depends_on_seed_and_index_only() {
        let a: Vec<u64> = (0..4).map(|_| Rng::for_request(9, 5).next()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(Rng::for_request(9, 5).next(), Rng::for_request(9, 6).next());
    }

    #[test]
    fn prompts_carry_their_marker_as_the_estimate_counts_it() {
        let mut rng = Rng(1);
        let prompt = canary_prompt(&mut rng, "CANARY-0-ABCDEFGH", 100);
        assert_eq!(prompt.matches("CANARY-0-ABCDEFGH").count(), markers_in(100));
        assert!(estimated_tokens(100) >= 100 + PROMPT_OVERHEAD_TOKENS);
    }

    #[test]
    fn ranges_take_dots_or_a_dash() {
        assert_eq!(parse_range("8..48").ok(), Some((8, 48)));
        assert_eq!(parse_range("3-5").ok(), Some((3, 5)));
        assert!(parse_range("5..3").is_err());
        assert!(parse_range("0..3").is_err());
    }
}
