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
//! Two more audits of a prefix cache (see `--help`): `--shared-prefix-tokens` gives every
//! tenant one long system prompt and counts the answers that reused a prefix their tenant
//! never cached ([`shared`]); `--timing-audit` asks instead whether another tenant's cached
//! prefix shows in a tenant's time to first token ([`timing`], TEST-MATRIX I07).
//!
//! The server is treated as hostile: bodies are read up to a cap, every request has a
//! timeout, redirects are not followed, and nothing it sends is trusted to parse.

use crate::audit::audit;
use crate::endpoint::health_context;
use crate::endpoint::list_models;
use crate::plan::Setup;
use crate::report::Report;
use crate::report::Verdict;
use crate::shared::SharedPrefix;
use crate::spawn::Spawned;
use crate::tenants::tenants;
use crate::tenants::Tenant;
use stats::SplitMix64;

mod audit;
mod endpoint;
mod plan;
mod report;
mod send;
mod shared;
mod spawn;
mod tenants;
#[cfg(test)]
mod tests;
mod timing;

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub(crate) const EXAMPLES: &str = "\
Examples:
  # Start `airlock serve` with 4 generated tenants, audit it, stop it:
  airlock canary --spawn serve --requests 200

  # Audit any endpoint with three tenants' keys, for one minute:
  airlock canary --url http://10.0.0.1:8000 --keys sk-a...,sk-b...,sk-c... --duration 60

  # One key, tenants told apart only by the `user` field; repeat an earlier run:
  airlock canary --url http://localhost:8000/v1 --single-key sk-... --seed 1234

  # Every tenant's prompts open with one ~1500-token system prompt; count cross-tenant
  # prefix-cache hits besides leaks:
  airlock canary --spawn serve --shared-system-prompt --requests 2000

  # Timing audit (TEST-MATRIX I07): does tenant A's cached prefix show in B's TTFT?
  airlock canary --spawn serve --timing-audit --timing-samples 100

Shared-system-prompt mode (--shared-prefix-tokens N, or --shared-system-prompt for 1500):
every prompt opens with the same system prompt, so a prefix cache holds the same tokens for
every tenant. An answer whose usage.prompt_tokens_details.cached_tokens is above 0 although
its tenant cannot have cached that prefix is a cross-tenant hit, and fails the run like a
leak. Checked are each tenant's first request (sent one at a time before the rest) and the
requests with a fresh cache_salt (--fresh-salt-fraction, a quarter), a partition nobody used
before; the report counts them, and the same-tenant hits that show the cache is on. Tenants
need keys of their own: a server scopes its cache by key.

Timing audit (--timing-audit, instead of the leak audit; one request at a time): tenant A
sends a random prefix P of --timing-prefix-tokens (1000) so it is cached. Then, in each of the
rounds (--timing-samples), four requests in a random order: B sends P + a short suffix and a
fresh random prefix of the same length + suffix, each with a cache_salt never used before (so
B's own cache helps neither sample); A sends P + suffix and a fresh prefix + suffix, with one
salt of its own (the control). Each is streamed with max_tokens 1 and timed to its first
token. The two-sample Kolmogorov-Smirnov test must find B's two samples indistinguishable
(p > 0.01) and A's control different (p < 1e-6: the cache works and the audit has power); B's
answers must all report cached_tokens 0. Prompts and salts are fresh for every run.

Exit status: 0 when clean (no leak, no should-fail request answered 2xx, no cross-tenant
cache hit, and some request that should succeed got a 2xx; for --timing-audit, both tests
pass); 1 otherwise. 5xx answers and transport errors are counted and shown, not judged. The
report goes to stdout (--json FILE for a copy), progress to stderr.";

/// Every option a run takes; `--help` shows them with the examples above.
#[derive(clap::Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct Args {
    /// Endpoint to audit: its base URL, with or without /v1 (http only)
    #[arg(long, env = "AIRLOCK_CANARY_URL", conflicts_with = "spawn")]
    pub(crate) url: Option<String>,
    /// Start a server from this executable and audit it: serve or unified, on a free port,
    /// with a keys file of the tenants (generated keys unless --keys/--keys-file/--single-key)
    #[arg(long, env = "AIRLOCK_CANARY_SPAWN", value_parser = ["serve", "unified"])]
    pub(crate) spawn: Option<String>,
    /// One API key per tenant, comma-separated (k1,k2,...)
    #[arg(long, env = "AIRLOCK_CANARY_KEYS", value_delimiter = ',', conflicts_with_all = ["keys_file", "single_key"])]
    pub(crate) keys: Vec<String>,
    /// A keys file in `airlock serve --api-keys` format: one tenant per [tenants.NAME], using
    /// its first key
    #[arg(long, env = "AIRLOCK_CANARY_KEYS_FILE", conflicts_with = "single_key")]
    pub(crate) keys_file: Option<PathBuf>,
    /// One API key for every tenant: tenants then differ only by the request's `user` field.
    /// Without any key option, --url requests carry no key and differ the same way
    #[arg(long, env = "AIRLOCK_CANARY_SINGLE_KEY")]
    pub(crate) single_key: Option<String>,
    /// Number of tenants [default: 4; with --keys or --keys-file, one per key or tenant]
    #[arg(long, env = "AIRLOCK_CANARY_TENANTS")]
    pub(crate) tenants: Option<usize>,
    /// Model id to send [default: the first of GET /v1/models]
    #[arg(long, env = "AIRLOCK_CANARY_MODEL")]
    pub(crate) model: Option<String>,
    /// Context length in tokens (prompt + max_tokens): sizes the long and oversized prompts
    /// [default: from /health (airlock) or /v1/models max_model_len (vLLM), else 2048; with
    /// --spawn, the spawned server's, 2048]
    #[arg(long, env = "AIRLOCK_CANARY_CONTEXT_LENGTH")]
    pub(crate) context_length: Option<usize>,
    /// Requests in all [default: 200, or no bound when --duration is given]
    #[arg(long, env = "AIRLOCK_CANARY_REQUESTS")]
    pub(crate) requests: Option<usize>,
    /// Stop starting requests after this many seconds (those in flight finish)
    #[arg(long, env = "AIRLOCK_CANARY_DURATION")]
    pub(crate) duration: Option<f64>,
    /// Requests in flight at once
    #[arg(long, env = "AIRLOCK_CANARY_CONCURRENCY", default_value_t = 8)]
    pub(crate) concurrency: usize,
    /// max_tokens of the requests that should succeed
    #[arg(long, env = "AIRLOCK_CANARY_MAX_TOKENS", default_value_t = 16)]
    pub(crate) max_tokens: usize,
    /// Words of filler in a short prompt, as MIN..MAX (markers come on top)
    #[arg(long, env = "AIRLOCK_CANARY_PROMPT_WORDS", default_value = "8..48")]
    pub(crate) prompt_words: String,
    /// Fraction of requests past the context length (prompt or max_tokens): must get 4xx
    #[arg(
        long,
        env = "AIRLOCK_CANARY_OVERSIZED_FRACTION",
        default_value_t = 0.10
    )]
    pub(crate) oversized_fraction: f64,
    /// Fraction of invalid requests (max_tokens -1, malformed JSON, unknown model, a field of
    /// the wrong type): must get 4xx
    #[arg(long, env = "AIRLOCK_CANARY_INVALID_FRACTION", default_value_t = 0.05)]
    pub(crate) invalid_fraction: f64,
    /// Fraction of long prompts, near the context length: should succeed
    #[arg(long, env = "AIRLOCK_CANARY_LONG_FRACTION", default_value_t = 0.05)]
    pub(crate) long_fraction: f64,
    /// Fraction of should-succeed requests sent twice in a row (greedy): the two answers must
    /// be identical. A server that answers from KV that is not the request's own (stale or
    /// foreign pages) answers twins differently, even when the model repeats no marker. Only
    /// for engines whose greedy decoding is deterministic (Airlock's is)
    #[arg(long, env = "AIRLOCK_CANARY_TWIN_FRACTION", default_value_t = 0.0)]
    pub(crate) twin_fraction: f64,
    /// Shared-system-prompt mode: every tenant's prompts open with one system prompt of
    /// about this many tokens, and answers reusing a prefix their tenant never cached are
    /// cross-tenant hits (see below) [default when given bare: 1500]
    #[arg(
        long,
        visible_alias = "shared-system-prompt",
        env = "AIRLOCK_CANARY_SHARED_PREFIX_TOKENS",
        num_args = 0..=1,
        default_missing_value = "1500",
        conflicts_with = "timing_audit"
    )]
    pub(crate) shared_prefix_tokens: Option<usize>,
    /// With --shared-prefix-tokens: fraction of requests with a cache_salt never used before,
    /// which must report cached_tokens 0 (0 for a server without cache_salt)
    #[arg(
        long,
        env = "AIRLOCK_CANARY_FRESH_SALT_FRACTION",
        default_value_t = 0.25
    )]
    pub(crate) fresh_salt_fraction: f64,
    /// Run the timing audit (TEST-MATRIX I07, see below) instead of the leak audit: the first
    /// two tenants, one request at a time
    #[arg(long, env = "AIRLOCK_CANARY_TIMING_AUDIT")]
    pub(crate) timing_audit: bool,
    /// With --timing-audit: tokens of the prefix (random common words, one token each)
    #[arg(
        long,
        env = "AIRLOCK_CANARY_TIMING_PREFIX_TOKENS",
        default_value_t = 1000
    )]
    pub(crate) timing_prefix_tokens: usize,
    /// With --timing-audit: samples of each kind (the matrix asks 250 for a full audit)
    #[arg(long, env = "AIRLOCK_CANARY_TIMING_SAMPLES", default_value_t = 100)]
    pub(crate) timing_samples: usize,
    /// Seed of the whole run (tenants' markers, prompt mix, endpoints); printed at the start
    /// and in the report, so the same run can be repeated [default: random]
    #[arg(long, env = "AIRLOCK_CANARY_SEED")]
    pub(crate) seed: Option<u64>,
    /// Seconds one request may take, body included, before it counts as a transport error
    #[arg(long, env = "AIRLOCK_CANARY_TIMEOUT", default_value_t = 120.0)]
    pub(crate) timeout: f64,
    /// Also write the report as JSON to this file
    #[arg(long, env = "AIRLOCK_CANARY_JSON")]
    pub(crate) json: Option<PathBuf>,
    /// With --spawn: GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf]
    #[arg(long, env = "AIRLOCK_MODEL")]
    pub(crate) model_file: Option<PathBuf>,
    /// With --spawn: compute threads of the server [default: all cores]
    #[arg(long, env = "AIRLOCK_THREADS")]
    pub(crate) threads: Option<usize>,
}

/// Most bytes read of any answer: a hostile server cannot make the auditor hold more.
pub(crate) const BODY_CAP: usize = 1 << 20;
/// Context length assumed when neither the flag nor the endpoint says.
pub(crate) const FALLBACK_CONTEXT: usize = 2048;
/// Tenants when no keys say how many.
pub(crate) const DEFAULT_TENANTS: usize = 4;
/// Requests when neither --requests nor --duration bounds the run.
pub(crate) const DEFAULT_REQUESTS: usize = 200;
/// Base32 (RFC 4648) alphabet of the markers' random part.
pub(crate) const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
/// Random characters per marker: 40 bits, so two markers never meet by chance.
pub(crate) const CODE_LEN: usize = 8;
/// A marker every this many filler words, so a long prompt is dense with them.
pub(crate) const MARKER_EVERY: usize = 12;
/// Upper estimates for sizing long prompts without the endpoint's tokenizer: filler words are
/// common single-token words; a marker is at most this many tokens; instruction and chat
/// template at most the overhead.
pub(crate) const MARKER_TOKENS: usize = 14;
pub(crate) const PROMPT_OVERHEAD_TOKENS: usize = 48;
/// Share of the context (less max_tokens) a long prompt fills, by the estimate above.
pub(crate) const LONG_FILL: f64 = 0.9;

/// Common English words, one token each (with their leading space) in the usual BPE
/// vocabularies, so a prompt's token count follows from its word count.
pub(crate) const WORDS: &[&str] = &[
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
    if options.shared.is_some() || options.timing.is_some() {
        own_keys(&tenants)?;
    }
    let (_server, url) = match (&args.spawn, &args.url) {
        (Some(kind), _) => {
            let server = Spawned::start(kind, &args, &tenants, &runtime, &client)?;
            let url = server.url.clone();
            (Some(server), url)
        }
        (None, Some(url)) => (None, base_url(url)?),
        (None, None) => bail!("say what to audit: --url URL, or --spawn serve"),
    };
    let setup = connect(&args, &runtime, url, tenants, options, client)?;
    if let Some(timing) = setup.options.timing {
        return timing::run(&setup, timing, &runtime, args.json.as_deref());
    }
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
        write_json(path, &report.json())?;
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

/// The endpoint's model and context length (the flags', else what it says of itself), and
/// the run's shared system prompt when asked for.
pub(crate) fn connect(
    args: &Args,
    runtime: &tokio::runtime::Runtime,
    url: String,
    tenants: Vec<Tenant>,
    options: Options,
    client: reqwest::Client,
) -> Result<Setup> {
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
    let shared = options
        .shared
        .map(|(tokens, fresh_salt)| SharedPrefix::new(tokens, random_seed(), fresh_salt));
    let prompt_tokens = match (&shared, options.timing) {
        (_, Some(timing)) => timing::prompt_tokens(timing),
        (Some(shared), None) => shared.tokens + PROMPT_OVERHEAD_TOKENS + MARKER_TOKENS * 2,
        (None, None) => PROMPT_OVERHEAD_TOKENS + MARKER_TOKENS * 2,
    };
    if context_length <= options.max_tokens + prompt_tokens {
        bail!(
            "context length {context_length} leaves no room for a prompt of about \
             {prompt_tokens} tokens and --max-tokens"
        );
    }
    Ok(Setup {
        url,
        model,
        tenants,
        context_length,
        context_source,
        options,
        client,
        shared,
    })
}

/// Both prefix-cache audits judge reuse across tenants, which a server scopes by API key:
/// tenants sharing a key (or none) are one tenant to its cache.
pub(crate) fn own_keys(tenants: &[Tenant]) -> Result<()> {
    let keys: std::collections::HashSet<Option<&str>> =
        tenants.iter().map(|t| t.key.as_deref()).collect();
    if keys.len() < tenants.len() || keys.contains(&None) {
        bail!(
            "--shared-prefix-tokens and --timing-audit need a key of its own for every tenant \
             (--keys, --keys-file, or --spawn with generated keys): a server scopes its prefix \
             cache by key, so tenants told apart only by `user` may share it"
        );
    }
    Ok(())
}

pub(crate) fn write_json(path: &std::path::Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n")
        .with_context(|| format!("writing the report to {}", path.display()))
}

/// The run's numbers, checked once.
#[derive(Debug)]
pub(crate) struct Options {
    pub(crate) seed: u64,
    pub(crate) requests: Option<usize>,
    pub(crate) duration: Option<Duration>,
    pub(crate) concurrency: usize,
    pub(crate) max_tokens: usize,
    pub(crate) words: (usize, usize),
    pub(crate) oversized: f64,
    pub(crate) invalid: f64,
    pub(crate) long: f64,
    pub(crate) twins: f64,
    pub(crate) timeout: Duration,
    /// Shared-system-prompt mode: its tokens and the fraction of fresh-salt requests.
    pub(crate) shared: Option<(usize, f64)>,
    pub(crate) timing: Option<timing::TimingOptions>,
}

impl Options {
    pub(crate) fn from_args(args: &Args) -> Result<Options> {
        for (name, value) in [
            ("--oversized-fraction", args.oversized_fraction),
            ("--invalid-fraction", args.invalid_fraction),
            ("--long-fraction", args.long_fraction),
            ("--twin-fraction", args.twin_fraction),
            ("--fresh-salt-fraction", args.fresh_salt_fraction),
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
        if args.shared_prefix_tokens == Some(0) {
            bail!("--shared-prefix-tokens must be at least 1");
        }
        if args.timing_audit && (args.timing_samples < 2 || args.timing_prefix_tokens < 32) {
            bail!("--timing-audit needs --timing-samples >= 2 and --timing-prefix-tokens >= 32");
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
            shared: args
                .shared_prefix_tokens
                .map(|tokens| (tokens, args.fresh_salt_fraction)),
            timing: args.timing_audit.then_some(timing::TimingOptions {
                prefix_tokens: args.timing_prefix_tokens,
                samples: args.timing_samples,
            }),
        })
    }
}

/// A seed nobody chose: the clock, mixed. Printed, so the run can still be repeated.
pub(crate) fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    SplitMix64::new(nanos ^ (u64::from(std::process::id()) << 32)).next_u64() % 1_000_000_000
}

/// `MIN..MAX` (or `MIN-MAX`, as bench takes it).
pub(crate) fn parse_range(text: &str) -> Result<(usize, usize)> {
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
pub(crate) fn base_url(url: &str) -> Result<String> {
    let url = url.trim().trim_end_matches('/').trim_end_matches("/v1");
    if !url.starts_with("http://") {
        bail!("--url must start with http:// (this build speaks plain HTTP only): {url}");
    }
    Ok(url.to_string())
}

/// One client for the whole run: a timeout per request (body included), no redirects (a
/// hostile server could send the auditor elsewhere), and a pool as wide as the concurrency.
pub(crate) fn client(timeout: Duration) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(10).min(timeout))
        .redirect(reqwest::redirect::Policy::none())
        .build()?)
}
