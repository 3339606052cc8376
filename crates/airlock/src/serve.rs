//! `airlock serve | router | prefill | decode | unified`: the serving roles. Each role is a
//! process of its own; `serve` runs a router, a prefill and a decode worker in one process,
//! linked over a Unix socket with the KV pages written through shared memory (one-sided), or
//! over TCP on loopback with `--kv-transport tcp`.

use crate::Faults;
use anyhow::{bail, Context, Result};
use config::{CapacityError, ContextSetting, KvBudget, ModelShape, PoolPlan};
use gguf::{ChatTemplate, GgufFile, Tokenizer};
use kv::{PagePool, PoolConfig, PoolSize};
use model::Model;
use model_args::{ModelArgs, DEFAULT_MODEL_NAME};
use router::openai::SamplingDefaults;
use router::{AppState, Cluster, EdgeConfig, Metrics, RouterConfig, Tenants};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use transfer::transport::{Net, UNIX_PREFIX};
use transfer::{ClusterSecret, Expectation, Role};
use worker::{start_worker_on, Listener, Worker, WorkerConfig};

/// Flags every serving role takes.
#[derive(clap::Args, Clone, Debug)]
pub struct CommonArgs {
    /// Address to listen on
    #[arg(long, env = "AIRLOCK_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Log lines on stderr: text for people, or json (one object per line: timestamp, level,
    /// target, fields) for log collectors
    #[arg(long, env = "AIRLOCK_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Port to listen on [default: 8080 for serve, router and unified; 9001 prefill; 9002
    /// decode]
    #[arg(long, env = "AIRLOCK_PORT")]
    pub port: Option<u16>,
    /// TOML keys file mapping API keys to tenants ([tenants.NAME] keys = [...]); without it
    /// the server runs single-tenant, with no authentication
    #[arg(long, env = "AIRLOCK_API_KEYS")]
    pub api_keys: Option<PathBuf>,
    /// KV pool capacity per worker, in tokens [default: the context length]
    #[arg(long, env = "AIRLOCK_KV_TOKENS", conflicts_with_all = ["kv_memory", "kv_memory_fraction"])]
    pub kv_tokens: Option<u64>,
    /// KV pool memory per worker, e.g. 512MiB or 2GiB (capacity in tokens follows from the
    /// model's layers, KV heads and head size, and the page size)
    #[arg(long, env = "AIRLOCK_KV_MEMORY", value_parser = parse_size,
          conflicts_with = "kv_memory_fraction")]
    pub kv_memory: Option<u64>,
    /// KV pool memory per worker as a fraction of the machine's available memory, minus the
    /// weights and working buffers (e.g. 0.5)
    #[arg(long, env = "AIRLOCK_KV_MEMORY_FRACTION")]
    pub kv_memory_fraction: Option<f64>,
    /// Most tokens (prompt + max_tokens) per request, or "auto" for as many as the pool holds
    /// (up to the model's); a worker whose pool cannot hold one request of this length
    /// refuses to start [default: the model's, 8192 here]
    #[arg(long, env = "AIRLOCK_CONTEXT_LENGTH", value_parser = parse_context)]
    pub context_length: Option<ContextSetting>,
    /// File holding the cluster secret every router and worker shares; links authenticate
    /// with it (HMAC challenge-response). Required by router, prefill, decode and
    /// `unified --worker-only`; serve and unified make a random one when it is not given
    #[arg(long, env = "AIRLOCK_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// KV page size in tokens
    #[arg(long, env = "AIRLOCK_PAGE_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub page_size: u16,
    /// TOML file of settings: each key is a flag name with '_' for '-' (kv_tokens = 4096)
    #[arg(long, env = "AIRLOCK_CONFIG")]
    pub config: Option<PathBuf>,
    /// Model id clients send as "model"
    #[arg(long, env = "AIRLOCK_MODEL_NAME", default_value = DEFAULT_MODEL_NAME)]
    pub model_name: String,
    /// Zero each KV page when it is freed
    #[arg(long, env = "AIRLOCK_SCRUB_ON_FREE")]
    pub scrub_on_free: bool,
    /// Never reuse cached prompt pages. By default each worker keeps the full pages of every
    /// prompt and reuses them for later prompts that start the same way, only for the same
    /// tenant and cache_salt; a tenant opts out with prefix_cache = false in the keys file
    #[arg(long, env = "AIRLOCK_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Requests that may wait for KV pages per worker; more get 503
    #[arg(long, env = "AIRLOCK_QUEUE_MAX", default_value_t = 256)]
    pub queue_max: usize,
    /// Milliseconds a request may wait for KV pages before 503
    #[arg(long, env = "AIRLOCK_QUEUE_TIMEOUT_MS", default_value_t = 30_000)]
    pub queue_timeout_ms: u64,
    /// Milliseconds a KV transfer may go without progress before it fails (decode: between
    /// page frames; prefill: from `Done` to decode's answer)
    #[arg(long, env = "AIRLOCK_TRANSFER_TIMEOUT_MS", default_value_t = 30_000)]
    pub transfer_timeout_ms: u64,
    /// Tokens per forward step (one per decoding request, the rest for prompt chunks)
    #[arg(long, env = "AIRLOCK_STEP_TOKENS", default_value_t = 256)]
    pub step_tokens: usize,
    /// Most requests decoding together in one step
    #[arg(long, env = "AIRLOCK_MAX_BATCH", default_value_t = 64)]
    pub max_batch: usize,
    /// Largest request body in bytes (413 above)
    #[arg(long, env = "AIRLOCK_BODY_BYTES_MAX", default_value_t = 1 << 20)]
    pub body_bytes_max: usize,
    /// max_tokens for a request that gives none
    #[arg(long, env = "AIRLOCK_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: usize,
    /// Requests in flight in the router at once, over all tenants; more get 503
    #[arg(long, env = "AIRLOCK_IN_FLIGHT_MAX", default_value_t = 512)]
    pub in_flight_max: usize,
    /// How many more times the router tries a request on other workers when one fails on a
    /// worker's transport (lost link, failed transfer) or is refused by a worker shutting
    /// down, before anything of the answer was sent (a stream once it began is not retried)
    #[arg(long, env = "AIRLOCK_RETRIES", default_value_t = 2)]
    pub retries: u32,
    /// On SIGTERM or Ctrl-C: how long to finish the requests in progress before exiting.
    /// The router answers readiness with 503 `draining` at once and takes no new connection;
    /// a worker tells its routers it drains (they stop sending it requests) and takes none
    #[arg(long, env = "AIRLOCK_DRAIN_TIMEOUT_MS", default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
    /// Export OpenTelemetry traces to this OTLP/HTTP collector (http://HOST:PORT; spans are
    /// posted as JSON to /v1/traces): one trace per request, with the router's span and each
    /// worker's as its children. Off when not given
    #[arg(long, env = "AIRLOCK_OTLP_ENDPOINT", value_parser = otlp::Endpoint::parse)]
    pub otlp_endpoint: Option<otlp::Endpoint>,
    /// On SIGTERM or Ctrl-C, how long the router keeps taking connections while readiness
    /// already answers 503 `draining`, so a load balancer notices before the port closes
    #[arg(long, env = "AIRLOCK_DRAIN_DELAY_MS", default_value_t = 0)]
    pub drain_delay_ms: u64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// Sampling defaults for requests that leave a setting out (a request's own value wins).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature for a request that gives none (0 to 2; 0 is greedy) [OpenAI's default: 1]
    #[arg(long, env = "AIRLOCK_TEMPERATURE", default_value_t = 1.0,
          value_parser = parse_unit_range(0.0, 2.0))]
    pub temperature: f64,
    /// top_p for a request that gives none (above 0, at most 1; 1 is off)
    #[arg(long, env = "AIRLOCK_TOP_P", default_value_t = 1.0,
          value_parser = parse_top_p)]
    pub top_p: f64,
    /// top_k for a request that gives none (0 is off)
    #[arg(long, env = "AIRLOCK_TOP_K", default_value_t = 0)]
    pub top_k: u32,
    /// min_p for a request that gives none (0 to 1; 0 is off)
    #[arg(long, env = "AIRLOCK_MIN_P", default_value_t = 0.0,
          value_parser = parse_unit_range(0.0, 1.0))]
    pub min_p: f64,
}

impl SamplingArgs {
    pub fn defaults(&self) -> SamplingDefaults {
        SamplingDefaults {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
        }
    }
}

/// A parser of numbers from `low` to `high`.
fn parse_unit_range(low: f64, high: f64) -> impl Fn(&str) -> Result<f64, String> + Clone {
    move |text| match text.parse::<f64>() {
        Ok(value) if (low..=high).contains(&value) => Ok(value),
        _ => Err(format!("expected a number from {low} to {high}")),
    }
}

fn parse_top_p(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value > 0.0 && value <= 1.0 => Ok(value),
        _ => Err("expected a number above 0 and at most 1".into()),
    }
}

/// The HTTP edge's bounds (serve, router, unified): what a client that never finishes a
/// request can hold, and for how long.
#[derive(clap::Args, Clone, Debug)]
pub struct HttpArgs {
    /// Milliseconds a client has to send a request's headers, from connecting (or from the
    /// end of its previous response); then the connection is closed
    #[arg(long, env = "AIRLOCK_HEADER_TIMEOUT_MS", default_value_t = 10_000)]
    pub header_timeout_ms: u64,
    /// Milliseconds an authenticated request's body may take to arrive in full (408 past it)
    #[arg(long, env = "AIRLOCK_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// Milliseconds a kept-alive connection may sit with no request before it is closed
    #[arg(long, env = "AIRLOCK_KEEP_ALIVE_TIMEOUT_MS", default_value_t = 5_000)]
    pub keep_alive_timeout_ms: u64,
    /// Open client connections in all; when all are taken the longest-idle one is closed
    /// for a newcomer, and only if none is idle does the newcomer get 503 [default: the
    /// open-file limit (raised to its hard limit at start) minus 256, at most 4096]
    #[arg(long, env = "AIRLOCK_CONNECTIONS_MAX",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub connections_max: Option<u64>,
    /// Open connections from one client address; more get 429 (raise it behind a proxy or
    /// load balancer, where every client has the proxy's address)
    #[arg(long, env = "AIRLOCK_CONNECTIONS_PER_CLIENT_MAX", default_value_t = 512,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub connections_per_client_max: u64,
    /// Browser origin allowed to call the API (CORS), e.g. https://app.example.com, or * for
    /// any; repeatable. Without it no CORS header is sent and browsers read no answer
    #[arg(long, env = "AIRLOCK_CORS_ALLOW_ORIGIN", value_delimiter = ',')]
    pub cors_allow_origin: Vec<String>,
    /// Without --api-keys the server has no authentication and listens only on a loopback
    /// address; this flag lets it listen on any --host anyway
    #[arg(long, env = "AIRLOCK_ALLOW_UNAUTHENTICATED_REMOTE")]
    pub allow_unauthenticated_remote: bool,
}

/// Without keys, anyone who reaches the port is the tenant: refuse to listen beyond this
/// machine unless told to.
fn check_open_bind(args: &CommonArgs) -> Result<()> {
    if args.api_keys.is_some() || args.http.allow_unauthenticated_remote {
        return Ok(());
    }
    let loopback = args.host == "localhost"
        || args
            .host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "--host {} without --api-keys would serve anyone who can reach it, with no \
             authentication; pass --api-keys FILE to separate tenants, listen on 127.0.0.1, \
             or pass --allow-unauthenticated-remote if that is really meant",
            args.host
        );
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// How KV pages get from the prefill worker to the decode worker: shm writes them
    /// straight into decode's pool through shared memory (a memfd passed over a Unix socket
    /// in the abstract namespace); tcp sends them as frames over loopback TCP
    #[arg(long, env = "AIRLOCK_KV_TRANSPORT", value_enum, default_value_t = KvTransport::Shm)]
    kv_transport: KvTransport,
}

/// See `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// See `serve --kv-transport`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvTransport {
    Shm,
    Tcp,
}

#[derive(clap::Args, Debug)]
pub struct RouterArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Address of a prefill worker: host:port (the host is resolved at every connect), or
    /// dns:NAME:PORT for every address NAME resolves to, looked up again every
    /// --dns-interval-ms (a Kubernetes headless Service); repeatable
    #[arg(long, env = "AIRLOCK_PREFILL", value_delimiter = ',')]
    prefill: Vec<String>,
    /// Address of a decode worker: host:port, dns:NAME:PORT (as for --prefill), or unix:PATH
    /// for one on this host started with --kv-socket PATH (its prefill workers then write KV
    /// pages through shared memory); repeatable
    #[arg(long, env = "AIRLOCK_DECODE", value_delimiter = ',')]
    decode: Vec<String>,
    /// Address (host:port or dns:NAME:PORT) of a unified worker; repeatable (instead of
    /// prefill + decode)
    #[arg(long, env = "AIRLOCK_UNIFIED_WORKER", value_delimiter = ',')]
    unified: Vec<String>,
    /// How often dns:NAME:PORT addresses are looked up again: workers at new addresses are
    /// linked, those no longer listed get nothing new and leave once their link closes
    #[arg(long, env = "AIRLOCK_DNS_INTERVAL_MS", default_value_t = 5_000)]
    dns_interval_ms: u64,
}

#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Worker name in logs and metrics [default: ROLE@HOST:PORT]
    #[arg(long, env = "AIRLOCK_NAME")]
    name: Option<String>,
    /// Decode only: also listen on this Unix socket (a path, or @NAME for Linux's abstract
    /// namespace). Prefill workers on this host that are sent here as unix:PATH (router
    /// --decode unix:PATH) write KV pages straight into this worker's pool, which is then
    /// shared memory; TCP links work as before
    #[arg(long, env = "AIRLOCK_KV_SOCKET")]
    kv_socket: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct UnifiedArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Run only the unified worker (default port 9003), for a router started with
    /// --unified ADDR; without this flag the router runs in this process too
    #[arg(long, env = "AIRLOCK_WORKER_ONLY")]
    worker_only: bool,
}

/// Everything read from the model file once: the weights are loaded per worker.
struct ModelFile {
    path: PathBuf,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    shape: ModelShape,
    weights_hash: u64,
}

fn parse_size(text: &str) -> Result<u64, String> {
    config::parse_bytes(text)
}

fn parse_context(text: &str) -> Result<ContextSetting, String> {
    if text == "auto" {
        return Ok(ContextSetting::Auto);
    }
    match text.parse::<u64>() {
        Ok(0) | Err(_) => Err(format!("'{text}' is not a positive number or \"auto\"")),
        Ok(n) => Ok(ContextSetting::Tokens(n)),
    }
}

/// The refusal to start of a worker whose pool cannot hold one full-context request (I8);
/// `main` turns it into exit code 78 (EX_CONFIG).
#[derive(Debug, thiserror::Error)]
#[error("worker refuses to start: {0}")]
pub struct RefusedToStart(pub CapacityError);

/// Exit code of a worker that refuses to start on its configuration (sysexits EX_CONFIG).
pub const EXIT_CONFIG: i32 = 78;

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}

fn read_model_file(args: &CommonArgs) -> Result<ModelFile> {
    let path = args.model.resolve_model()?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let file = GgufFile::parse(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let (chat_template, own) = ChatTemplate::from_gguf_or_family(&file)?;
    if !own {
        tracing::warn!(
            model = %path.display(),
            "the model file has no chat template; chat requests are rendered with its \
             family's turn format (Gemma's for gemma3, ChatML otherwise)"
        );
    }
    let chat_template = Some(chat_template);
    let config = model::ModelConfig::from_gguf(&file)?;
    if let Some(ContextSetting::Tokens(n)) = args.context_length {
        if n > config.context_length as u64 {
            bail!(
                "--context-length {n} is over the model's own context length of {}",
                config.context_length
            );
        }
    }
    Ok(ModelFile {
        path,
        tokenizer,
        chat_template,
        shape: ModelShape {
            layer_count: config.layer_count as u64,
            kv_head_count: config.kv_head_count as u64,
            head_dim: config.head_dim as u64,
            context_length_max: config.context_length as u64,
        },
        weights_hash: xxhash_rust::xxh3::xxh3_64(&bytes),
    })
}

impl ModelFile {
    /// The router's view of the workers it may use (I8).
    fn expectation(&self, args: &CommonArgs, context_length: Option<u64>) -> Expectation {
        Expectation {
            model_id: args.model_name.clone(),
            weights_hash: self.weights_hash,
            kv_dtype: config::KV_DTYPE.into(),
            page_size_tokens: args.page_size.into(),
            layer_count: self.shape.layer_count as u32,
            kv_head_count: self.shape.kv_head_count as u32,
            head_dim: self.shape.head_dim as u32,
            context_length: context_length.map(|n| n as u32),
        }
    }

    /// A worker's pool and context length from its flags, or the refusal to start (I8).
    ///
    /// `preflight: false` (a fault-injection build told `no-admission`) skips the refusal and
    /// takes the context length as given, as the incident's misconfigured node did.
    fn plan(
        &self,
        args: &CommonArgs,
        weight_bytes: u64,
        preflight: bool,
    ) -> Result<(PoolPlan, u64)> {
        let page_size = u64::from(args.page_size);
        let context = args
            .context_length
            .unwrap_or(ContextSetting::Tokens(self.shape.context_length_max));
        let budget = if let Some(bytes) = args.kv_memory {
            KvBudget::Bytes(bytes)
        } else if let Some(fraction) = args.kv_memory_fraction {
            KvBudget::Fraction {
                fraction,
                available_bytes: available_memory()?,
                weight_bytes,
                working_bytes: config::WORKING_BYTES,
            }
        } else {
            let tokens = args.kv_tokens.unwrap_or(match context {
                ContextSetting::Tokens(n) => n,
                ContextSetting::Auto => self.shape.context_length_max,
            });
            KvBudget::Tokens(tokens)
        };
        let plan = config::plan_pool(&self.shape, page_size, budget)?;
        let context_length = match config::resolve_context(&plan, &self.shape, context) {
            Ok(context_length) => context_length,
            Err(_) if !preflight => {
                let ContextSetting::Tokens(tokens) = context else {
                    bail!("no-admission needs an explicit --context-length");
                };
                eprintln!("airlock: FAULT INJECTION: start-up capacity check (I8) skipped");
                tokens
            }
            Err(error) => return Err(RefusedToStart(error).into()),
        };
        if context == ContextSetting::Auto {
            tracing::info!(
                context_length,
                capacity_tokens = plan.capacity_tokens,
                "--context-length auto: the context is what the pool holds"
            );
        }
        Ok((plan, context_length))
    }
}

/// `MemAvailable` from /proc/meminfo.
fn available_memory() -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .context("reading /proc/meminfo for --kv-memory-fraction; give --kv-memory instead")?;
    let kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .context("no MemAvailable in /proc/meminfo; give --kv-memory instead")?;
    Ok(kib << 10)
}

/// The cluster secret: from the file, or (for single-process deployments only) random.
fn cluster_secret(args: &CommonArgs, single_process: bool) -> Result<ClusterSecret> {
    match &args.cluster_secret_file {
        Some(path) => {
            let bytes = std::fs::read(path)
                .with_context(|| format!("reading the cluster secret {}", path.display()))?;
            let trimmed = bytes.trim_ascii().to_vec();
            ClusterSecret::new(trimmed).map_err(anyhow::Error::msg)
        }
        None if single_process => Ok(ClusterSecret::random()),
        None => bail!(
            "give every node of the cluster the same --cluster-secret-file (create one with \
             `head -c 32 /dev/urandom | base64 > cluster.secret`); links between processes \
             authenticate with it"
        ),
    }
}

/// Loads the weights and builds a worker's pool, after the start-up check (I8).
fn load_worker(
    args: &CommonArgs,
    file: &ModelFile,
    role: Role,
    name: String,
    faults: Faults,
    shared_pool: bool,
    shared_model: Option<&SharedModel>,
) -> Result<(WorkerConfig, Arc<Model>, Tokenizer, PagePool)> {
    let started = Instant::now();
    let (model, tokenizer) = match shared_model {
        Some(shared) => (Arc::clone(&shared.model), shared.tokenizer.clone()),
        None => {
            let loaded = load_model(args, file)?;
            (Arc::new(loaded.model), loaded.tokenizer)
        }
    };
    let faults = faults.plan(role)?;
    let preflight = faults.preflight_checked();
    let (plan, context_length) = file.plan(args, model.weight_bytes() as u64, preflight)?;
    let layout = model.config().kv_layout(args.page_size as usize);
    let pool_config = PoolConfig {
        layout,
        size: PoolSize::Tokens(plan.capacity_tokens as usize),
        scrub_on_free: args.scrub_on_free,
    };
    let pool = if shared_pool {
        PagePool::new_shared(pool_config)
    } else {
        PagePool::new(pool_config)
    }
    .context("creating the KV pool")?;
    assert_eq!(
        pool.capacity_tokens() as u64,
        plan.capacity_tokens,
        "the pool has the capacity the plan computed"
    );
    if !transfer::page_fits_frame(layout.page_bytes()) {
        bail!(
            "--page-size {} makes pages too large to transfer",
            args.page_size
        );
    }
    tracing::info!(
        worker = %name,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        threads = model.thread_count(),
        kv_tokens = pool.capacity_tokens(),
        kv_pages = pool.page_count(),
        kv_mib = pool.bytes() >> 20,
        context_length,
        weights = model.weight_report().lines().join(", "),
        // `serve`: both engines on one model, the passes they hand in together run as one.
        merges_passes = model.pass_counts().is_some(),
        "worker loaded"
    );
    let service = format!("airlock-{}", router::cluster::role_name(role));
    let tracer = tracer(args, &service, &name);
    let config = WorkerConfig {
        role,
        name,
        model_id: args.model_name.clone(),
        weights_hash: file.weights_hash,
        context_length: context_length as usize,
        queue_max: args.queue_max,
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        transfer_timeout: Duration::from_millis(args.transfer_timeout_ms),
        step_tokens: args.step_tokens.max(1),
        max_batch: args.max_batch.max(1),
        faults,
        tracer,
    };
    Ok((config, model, tokenizer, pool))
}

fn load_model(args: &CommonArgs, file: &ModelFile) -> Result<model::Loaded> {
    Model::load(&file.path, &args.model.load_options(), &mut |_| {})
        .with_context(|| format!("loading {}", file.path.display()))
}

/// The one model `serve`'s prefill and decode engines run on.
struct SharedModel {
    model: Arc<Model>,
    tokenizer: Tokenizer,
}

impl SharedModel {
    /// Loads the model for both engines, merging the passes they run at the same time.
    fn load(args: &CommonArgs, file: &ModelFile) -> Result<SharedModel> {
        let mut loaded = load_model(args, file)?;
        loaded.model.merge_concurrent_passes();
        Ok(SharedModel {
            model: Arc::new(loaded.model),
            tokenizer: loaded.tokenizer,
        })
    }
}

async fn bind(host: &str, port: u16) -> Result<TcpListener> {
    TcpListener::bind((host, port))
        .await
        .with_context(|| format!("cannot listen on {host}:{port}"))
}

/// What the workers one process starts have in common.
struct WorkerEnv {
    secret: ClusterSecret,
    faults: Faults,
    /// `serve`'s prefill and decode engines run on one model, so on one set of compute
    /// threads: on their own they would run twice as many threads as the machine has cores,
    /// each engine's spinning between parallel regions taking time from the other's work,
    /// and neither could use the other's cores while that one is idle. One model also lets
    /// the passes the two hand in at the same time run as one (`Model::forward`).
    shared_model: Option<SharedModel>,
}

/// Loads and starts a worker on `listeners`; a decode worker listening on a Unix socket
/// gets a shared pool, for the prefills that write into it.
async fn spawn_worker(
    args: &CommonArgs,
    file: &ModelFile,
    role: Role,
    name: String,
    listeners: Vec<Listener>,
    env: &WorkerEnv,
) -> Result<Worker> {
    let shared_pool = role == Role::Decode
        && listeners
            .iter()
            .any(|listener| matches!(listener, Listener::Unix(_)));
    let (config, model, tokenizer, pool) = load_worker(
        args,
        file,
        role,
        name,
        env.faults,
        shared_pool,
        env.shared_model.as_ref(),
    )?;
    let worker = start_worker_on(
        config,
        model,
        tokenizer,
        pool,
        listeners,
        Arc::new(Net),
        env.secret.clone(),
    )?;
    Ok(worker)
}

/// A fresh Unix socket in the abstract namespace (it leaves no file behind, however the
/// process ends; links over it authenticate with the process's random cluster secret like
/// any other), and its `unix:@…` address.
fn private_socket(role: &str) -> Result<(tokio::net::UnixListener, String)> {
    use std::hash::{BuildHasher, Hasher};
    let nonce = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let path = format!("@airlock-{}-{nonce:016x}-{role}", std::process::id());
    let listener = transfer::transport::bind_unix(&path)
        .with_context(|| format!("cannot listen on the Unix socket {path}"))?;
    Ok((listener, format!("{UNIX_PREFIX}{path}")))
}

fn tenants(args: &CommonArgs) -> Result<Tenants> {
    match &args.api_keys {
        Some(path) => {
            let tenants = Tenants::from_file(path)?;
            tracing::info!(tenants = tenants.count(), "API keys loaded");
            Ok(tenants)
        }
        None => {
            let reach = if args.http.allow_unauthenticated_remote {
                "anyone who can reach --host"
            } else {
                "callers on this machine only (loopback)"
            };
            eprintln!(
                "\n  WARNING: no --api-keys file: running SINGLE-TENANT with NO AUTHENTICATION.\n  \
                 Every caller is the same tenant: {reach}. Pass --api-keys FILE to separate \
                 tenants.\n"
            );
            Ok(Tenants::open())
        }
    }
}

/// Runs the HTTP front. `context_length` is the workers' (known when they run in this
/// process); `None` accepts any and admits up to the smallest a linked worker reports.
async fn run_router(
    args: &CommonArgs,
    file: ModelFile,
    workers: Vec<(String, Role)>,
    port: u16,
    context_length: Option<u64>,
    secret: ClusterSecret,
    dns_interval: Duration,
) -> Result<()> {
    let tenants = tenants(args)?;
    let metrics = Arc::new(Metrics::new());
    let dns = router::discovery::Dns {
        resolver: Arc::new(router::discovery::SystemResolver),
        interval: dns_interval,
    };
    let cluster = Cluster::connect_with_dns(
        workers,
        file.expectation(args, context_length),
        secret,
        Arc::new(Net),
        metrics.clone(),
        dns,
    );
    let listener = bind(&args.host, port).await?;
    let address = listener.local_addr()?;
    let mut edge = edge_config(&args.http);
    edge.shutdown_grace = Duration::from_millis(args.drain_timeout_ms);
    let config = RouterConfig {
        model_id: args.model_name.clone(),
        context_length: context_length.unwrap_or(file.shape.context_length_max) as usize,
        body_bytes_max: args.body_bytes_max,
        default_max_tokens: args.default_max_tokens,
        sampling_defaults: args.sampling.defaults(),
        in_flight_max: args.in_flight_max,
        start_timeout: Duration::from_millis(args.queue_timeout_ms + args.transfer_timeout_ms),
        body_timeout: Duration::from_millis(args.http.body_timeout_ms),
        cors_allow_origins: args.http.cors_allow_origin.clone(),
        prefix_cache: !args.no_prefix_cache,
        retries: args.retries,
    };
    let open = tenants.is_open();
    let mut state = AppState::new(
        config,
        tenants,
        cluster,
        metrics.clone(),
        file.tokenizer,
        file.chat_template,
    );
    state.tracer = tracer(args, "airlock-router", &address.to_string());
    let state = Arc::new(state);
    if !state.cluster.wait_ready(Duration::from_secs(30)).await {
        tracing::warn!("not every worker is linked yet; serving anyway (see /health)");
    }
    print_ready(&address.to_string(), &args.model_name, open);
    let stopping = state.clone();
    let stop = async move {
        let signal = stop_signal().await;
        stopping
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            signal,
            drain_delay_ms = args.drain_delay_ms,
            drain_timeout_ms = args.drain_timeout_ms,
            "stopping: readiness answers 503 draining; finishing the requests in progress"
        );
        tokio::time::sleep(Duration::from_millis(args.drain_delay_ms)).await;
    };
    router::edge::serve(listener, router::app(state.clone()), edge, metrics, stop)
        .await
        .context("HTTP server")?;
    tracing::info!("stopped");
    Ok(())
}

/// The span exporter `--otlp-endpoint` asks for (as `service`, this process being
/// `instance`), or one that records nothing. Call inside the runtime.
fn tracer(args: &CommonArgs, service: &str, instance: &str) -> otlp::Tracer {
    match &args.otlp_endpoint {
        Some(endpoint) => {
            tracing::info!(?endpoint, service, "exporting traces over OTLP/HTTP");
            otlp::Tracer::start(endpoint.clone(), service, instance)
        }
        None => otlp::Tracer::off(),
    }
}

/// Waits for SIGTERM (how Kubernetes and systemd stop a process) or Ctrl-C, and names it.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    }
}

/// The edge's bounds from the flags, with the connection cap sized from the open-file limit
/// (raised to its hard limit first).
fn edge_config(http: &HttpArgs) -> EdgeConfig {
    let open_files = match router::edge::raise_open_file_limit() {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "cannot read the open-file limit; assuming 1024");
            1024
        }
    };
    let connections_max = http.connections_max.map_or_else(
        || router::edge::connections_max_for(open_files),
        |n| n as usize,
    );
    if connections_max as u64 + router::edge::FDS_RESERVED > open_files {
        tracing::warn!(
            connections_max,
            open_files,
            "--connections-max is over what the open-file limit leaves; raise `ulimit -n`"
        );
    }
    tracing::info!(
        connections_max,
        per_client = http.connections_per_client_max,
        open_files,
        "HTTP connection limits"
    );
    EdgeConfig {
        header_timeout: Duration::from_millis(http.header_timeout_ms),
        keep_alive_timeout: Duration::from_millis(http.keep_alive_timeout_ms),
        connections_max,
        connections_per_client_max: http.connections_per_client_max as usize,
        shutdown_grace: Duration::from_secs(10),
    }
}

fn print_ready(address: &str, model_name: &str, open: bool) {
    let auth = if open {
        ""
    } else {
        " -H \"Authorization: Bearer $KEY\""
    };
    println!("Airlock is serving {model_name} at http://{address}/v1");
    println!(
        "Try:\n  curl http://{address}/v1/chat/completions{auth} -H 'Content-Type: application/json' \
         -d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \
         \"What is the capital of France? Answer in one word.\"}}], \"temperature\": 0.2, \
         \"max_tokens\": 32}}'"
    );
}

/// `airlock serve`: router + prefill + decode in one process, the pages moved through shared
/// memory (or over TCP on loopback, `--kv-transport tcp`).
pub fn serve(args: ServeArgs, faults: Faults) -> Result<()> {
    init_logging(args.common.log_format);
    let transport = args.kv_transport;
    let args = args.common;
    check_open_bind(&args)?;
    let file = read_model_file(&args)?;
    let env = WorkerEnv {
        secret: cluster_secret(&args, true)?,
        faults,
        shared_model: Some(SharedModel::load(&args, &file)?),
    };
    runtime()?.block_on(async {
        let (decode_listener, decode_addr) = match transport {
            KvTransport::Shm => {
                let (listener, addr) = private_socket("decode")?;
                (Listener::Unix(listener), addr)
            }
            KvTransport::Tcp => {
                let listener = bind("127.0.0.1", 0).await?;
                let addr = listener.local_addr()?.to_string();
                (Listener::Tcp(listener), addr)
            }
        };
        let prefill_listener = bind("127.0.0.1", 0).await?;
        let prefill_addr = prefill_listener.local_addr()?.to_string();
        let decode = spawn_worker(
            &args,
            &file,
            Role::Decode,
            "decode-0".into(),
            vec![decode_listener],
            &env,
        )
        .await?;
        let _prefill = spawn_worker(
            &args,
            &file,
            Role::Prefill,
            "prefill-0".into(),
            vec![Listener::Tcp(prefill_listener)],
            &env,
        )
        .await?;
        let context_length = u64::from(decode.info.context_length);
        let workers = vec![(prefill_addr, Role::Prefill), (decode_addr, Role::Decode)];
        let port = args.port.unwrap_or(8080);
        let dns = router::cluster::DNS_INTERVAL;
        run_router(
            &args,
            file,
            workers,
            port,
            Some(context_length),
            env.secret.clone(),
            dns,
        )
        .await
    })
}

/// `airlock router`: the HTTP front for workers running elsewhere.
pub fn router(args: RouterArgs) -> Result<()> {
    init_logging(args.common.log_format);
    let mut workers: Vec<(String, Role)> = Vec::new();
    workers.extend(args.prefill.iter().map(|a| (a.clone(), Role::Prefill)));
    workers.extend(args.decode.iter().map(|a| (a.clone(), Role::Decode)));
    workers.extend(args.unified.iter().map(|a| (a.clone(), Role::Unified)));
    let disaggregated = !args.prefill.is_empty() && !args.decode.is_empty();
    if !disaggregated && args.unified.is_empty() {
        bail!(
            "the router needs workers: --prefill ADDR and --decode ADDR (disaggregated), or \
             --unified ADDR"
        );
    }
    if disaggregated && !args.unified.is_empty() {
        bail!("give either --prefill and --decode, or --unified, not both");
    }
    for (addr, _) in &workers {
        router::discovery::check_address(addr).map_err(anyhow::Error::msg)?;
    }
    let dns_interval = Duration::from_millis(args.dns_interval_ms.max(100));
    check_open_bind(&args.common)?;
    let secret = cluster_secret(&args.common, false)?;
    let file = read_model_file(&args.common)?;
    let port = args.common.port.unwrap_or(8080);
    // An explicit context length must match every worker's; otherwise the router admits up
    // to the smallest one a linked worker reports.
    let context_length = match args.common.context_length {
        Some(ContextSetting::Tokens(n)) => Some(n),
        Some(ContextSetting::Auto) | None => None,
    };
    runtime()?.block_on(run_router(
        &args.common,
        file,
        workers,
        port,
        context_length,
        secret,
        dns_interval,
    ))
}

fn run_worker(args: WorkerArgs, role: Role, default_port: u16, faults: Faults) -> Result<()> {
    init_logging(args.common.log_format);
    if args.kv_socket.is_some() && role != Role::Decode {
        bail!("--kv-socket is a decode worker's flag: prefill workers write into it");
    }
    let common = args.common;
    let env = WorkerEnv {
        secret: cluster_secret(&common, false)?,
        faults,
        shared_model: None,
    };
    let file = read_model_file(&common)?;
    let port = common.port.unwrap_or(default_port);
    let role_name = router::cluster::role_name(role);
    runtime()?.block_on(async {
        let listener = bind(&common.host, port).await?;
        let address = listener.local_addr()?;
        let name = args
            .name
            .unwrap_or_else(|| format!("{role_name}@{address}"));
        let mut listeners = vec![Listener::Tcp(listener)];
        if let Some(path) = &args.kv_socket {
            // A socket file left by an earlier run of this worker is replaced.
            if std::fs::symlink_metadata(path)
                .is_ok_and(|meta| std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()))
            {
                let _ = std::fs::remove_file(path);
            }
            let unix = transfer::transport::bind_unix(&path.to_string_lossy())
                .with_context(|| format!("cannot listen on {}", path.display()))?;
            listeners.push(Listener::Unix(unix));
        }
        let worker = spawn_worker(&common, &file, role, name, listeners, &env).await?;
        match &args.kv_socket {
            Some(path) => println!(
                "Airlock {role_name} worker listening on {address} and {UNIX_PREFIX}{}",
                path.display()
            ),
            None => println!("Airlock {role_name} worker listening on {address}"),
        }
        let signal = stop_signal().await;
        let deadline = Duration::from_millis(common.drain_timeout_ms);
        tracing::info!(signal, drain_timeout_ms = common.drain_timeout_ms, "stopping: draining");
        tokio::select! {
            drained = worker.drain(deadline) => match drained {
                true => tracing::info!("drained; exiting"),
                false => tracing::warn!("requests still in progress after the drain timeout; exiting"),
            },
            signal = stop_signal() => tracing::warn!(signal, "stopped again: exiting without draining"),
        }
        Ok(())
    })
}

pub fn prefill(args: WorkerArgs, faults: Faults) -> Result<()> {
    run_worker(args, Role::Prefill, 9001, faults)
}

pub fn decode(args: WorkerArgs, faults: Faults) -> Result<()> {
    run_worker(args, Role::Decode, 9002, faults)
}

/// `airlock unified`: one worker doing prefill and decode in one pool, and the router in
/// front of it: the single-node baseline, with no transfer.
pub fn unified(args: UnifiedArgs, faults: Faults) -> Result<()> {
    if args.worker_only {
        let worker_args = WorkerArgs {
            common: args.common,
            name: None,
            kv_socket: None,
        };
        return run_worker(worker_args, Role::Unified, 9003, faults);
    }
    init_logging(args.common.log_format);
    let args = args.common;
    check_open_bind(&args)?;
    let file = read_model_file(&args)?;
    let env = WorkerEnv {
        secret: cluster_secret(&args, true)?,
        faults,
        shared_model: None,
    };
    runtime()?.block_on(async {
        let listener = bind("127.0.0.1", 0).await?;
        let addr = listener.local_addr()?.to_string();
        let worker = spawn_worker(
            &args,
            &file,
            Role::Unified,
            "unified-0".into(),
            vec![Listener::Tcp(listener)],
            &env,
        )
        .await?;
        let context_length = Some(u64::from(worker.info.context_length));
        let workers = vec![(addr, Role::Unified)];
        let port = args.port.unwrap_or(8080);
        let dns = router::cluster::DNS_INTERVAL;
        run_router(&args, file, workers, port, context_length, env.secret, dns).await
    })
}
