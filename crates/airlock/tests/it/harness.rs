//! A serving cluster inside the test process: workers and a router over real TCP on
//! loopback (ports chosen by the OS), hosted on one shared runtime so servers outlive the
//! test function that starts them. Tests drive them with a real HTTP client.

use crate::cli::model_path;
use gguf::{ChatTemplate, GgufFile, Tokenizer};
use kv::{PagePool, PoolConfig, PoolSize};
use model::{Forward, LoadOptions, Model, OracleModel};
use router::{AppState, Cluster, Metrics, RouterConfig, Tenants};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use transfer::transport::Net;
use transfer::{ClusterSecret, Expectation, Role};
use worker::{start_worker, Listener, Worker, WorkerConfig};

pub const MODEL: &str = "SmolLM2-135M-Instruct";

pub fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("test runtime")
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Disaggregated,
    Unified,
}

/// What the workers run their steps with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// SmolLM2, as served.
    Real,
    /// `model::OracleModel`: answers with the prompt echoed when it read only its own KV, and
    /// with whatever foreign, stale or corrupt slots it read otherwise.
    Oracle,
}

#[derive(Clone, Debug)]
pub struct Options {
    pub mode: Mode,
    pub backend: Backend,
    pub kv_tokens: usize,
    /// The prefill worker's pool, when it differs from `kv_tokens` (the incident's setup).
    pub prefill_kv_tokens: Option<usize>,
    /// Faults each role's workers inject (`fault-injection` is on in test builds).
    pub faults: Vec<(Role, worker::FaultPlan)>,
    pub transfer_timeout: Duration,
    /// Scrub pages on free (with the ghost value: `ghost-fill` is on in test builds).
    pub scrub_on_free: bool,
    /// The workers' and router's context length (the model's when `None`).
    pub context_length: Option<usize>,
    /// A keys file's text; `None` runs single-tenant.
    pub keys: Option<&'static str>,
    pub queue_timeout: Duration,
    pub page_size: usize,
    pub secret: ClusterSecret,
    /// More workers for the router to link, started by the test (e.g. impostors).
    pub extra_workers: Vec<(String, Role)>,
    /// The real model's kernels (`None`: the fastest this CPU has).
    pub kernels: Option<kernels::Backend>,
    /// The HTTP edge's bounds.
    pub edge: router::EdgeConfig,
    pub body_timeout: Duration,
    pub cors_allow_origins: Vec<String>,
    /// The router's switch for prefix reuse (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
    /// How pages get from prefill to decode (disaggregated only).
    pub kv_transport: KvTransport,
    /// The GGUF the workers serve (`cli::model_path`'s unless a test picks another).
    pub model: PathBuf,
    /// The router's retries after a transport failure (0: each failure is the answer, as
    /// the fault tests expect; `serve` retries twice).
    pub retries: u32,
}

/// `serve --kv-transport`: frames over TCP, or one-sided writes into decode's pool through
/// shared memory, with control frames over a Unix socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvTransport {
    Tcp,
    Shm,
}

/// Both transports, for the tests that must hold on each.
pub const KV_TRANSPORTS: [KvTransport; 2] = [KvTransport::Tcp, KvTransport::Shm];

impl Options {
    pub fn new(mode: Mode) -> Options {
        Options {
            mode,
            backend: Backend::Real,
            kv_tokens: 2048,
            prefill_kv_tokens: None,
            faults: Vec::new(),
            transfer_timeout: Duration::from_secs(30),
            scrub_on_free: false,
            context_length: None,
            keys: None,
            queue_timeout: Duration::from_secs(30),
            page_size: 16,
            secret: ClusterSecret::random(),
            extra_workers: Vec::new(),
            kernels: None,
            edge: router::EdgeConfig {
                header_timeout: Duration::from_secs(10),
                keep_alive_timeout: Duration::from_secs(5),
                connections_max: 4096,
                connections_per_client_max: 512,
                shutdown_grace: Duration::from_secs(1),
            },
            body_timeout: Duration::from_secs(30),
            cors_allow_origins: Vec::new(),
            prefix_cache: true,
            // What `serve` uses by default.
            kv_transport: KvTransport::Shm,
            model: PathBuf::from(model_path()),
            retries: 0,
        }
    }
}

/// A running cluster; dropping it stops everything.
pub struct TestServer {
    pub url: String,
    pub worker_addresses: Vec<String>,
    server: JoinHandle<()>,
    _workers: Vec<Worker>,
    /// The decode worker's Unix socket's directory (shared-memory transport).
    _socket_dir: Option<SocketDir>,
}

/// Where tests keep files that outlive one test (secrets, keys files, schemathesis's state):
/// Cargo's scratch directory for integration tests, under `target/`, so a run leaves nothing
/// in the system's temporary directory. (Unix sockets stay there, in [`SocketDir`]s: socket
/// paths are limited to 107 bytes.)
pub fn scratch() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
}

/// A private directory for a decode worker's Unix socket, removed on drop.
pub struct SocketDir(std::path::PathBuf);

impl SocketDir {
    pub fn new() -> SocketDir {
        // A server kept for a whole test binary (a static) is never dropped: its directory is
        // removed by the next run, once the process that made it is gone.
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(remove_stale_socket_dirs);
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("airlock-it-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("socket directory");
        SocketDir(dir)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

/// Removes the socket directories of test processes that have exited.
fn remove_stale_socket_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix("airlock-it-"))
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub struct ModelFile {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub context_length: usize,
    pub weights_hash: u64,
    pub config: model::ModelConfig,
}

pub fn model_file() -> ModelFile {
    model_file_at(model_path().as_ref())
}

/// What the router needs of the GGUF at `path`.
pub fn model_file_at(path: &Path) -> ModelFile {
    let bytes = std::fs::read(path).expect("model readable");
    let file = GgufFile::parse(&bytes).expect("model parses");
    let config = model::ModelConfig::from_gguf(&file).expect("config");
    ModelFile {
        tokenizer: Tokenizer::from_gguf(&file).expect("tokenizer"),
        chat_template: Some(
            ChatTemplate::from_gguf_or_family(&file)
                .expect("chat template")
                .0,
        ),
        context_length: config.context_length,
        weights_hash: xxhash_rust::xxh3::xxh3_64(&bytes),
        config,
    }
}

/// The model's tokenizer, read once per test process.
pub fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| model_file().tokenizer)
}

/// The GGUF at `path`, loaded with one thread.
pub fn load_model_from(path: &Path, kernels: Option<kernels::Backend>) -> model::Loaded {
    let options = LoadOptions {
        threads: 1,
        backend: kernels,
    };
    Model::load(path, &options, &mut |_| {}).expect("model loads")
}

pub fn start(options: Options) -> TestServer {
    let file = model_file_at(&options.model);
    let context_length = options.context_length.unwrap_or(file.context_length);
    let roles: &[Role] = match options.mode {
        Mode::Disaggregated => &[Role::Prefill, Role::Decode],
        Mode::Unified => &[Role::Unified],
    };
    let secret = options.secret.clone();
    let oracle = OracleModel::new(file.config.vocab_size, context_length);
    let layout = match options.backend {
        Backend::Real => file.config.kv_layout(options.page_size),
        Backend::Oracle => oracle.kv_layout(options.page_size),
    };
    let expect = Expectation {
        model_id: MODEL.into(),
        weights_hash: file.weights_hash,
        kv_dtype: config::KV_DTYPE.into(),
        page_size_tokens: options.page_size as u32,
        layer_count: layout.layer_count as u32,
        kv_head_count: layout.kv_head_count as u32,
        head_dim: layout.head_dim as u32,
        context_length: Some(context_length as u32),
    };
    let socket_dir = (options.kv_transport == KvTransport::Shm
        && options.mode == Mode::Disaggregated)
        .then(SocketDir::new);
    runtime().block_on(async {
        let mut workers = Vec::new();
        let mut addresses = Vec::new();
        for &role in roles {
            let (listener, address) = match (&socket_dir, role) {
                (Some(dir), Role::Decode) => {
                    let path = dir.path().join("decode.sock");
                    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
                    (Listener::Unix(listener), format!("unix:{}", path.display()))
                }
                _ => {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                        .await
                        .expect("bind");
                    let address = listener.local_addr().expect("address").to_string();
                    (Listener::Tcp(listener), address)
                }
            };
            let shared_pool = matches!(listener, Listener::Unix(_));
            let kv_tokens = match role {
                Role::Prefill => options.prefill_kv_tokens.unwrap_or(options.kv_tokens),
                _ => options.kv_tokens,
            };
            let pool_config = PoolConfig {
                layout,
                size: PoolSize::Tokens(kv_tokens),
                scrub_on_free: options.scrub_on_free,
            };
            let pool = if shared_pool {
                PagePool::new_shared(pool_config)
            } else {
                PagePool::new(pool_config)
            }
            .expect("pool");
            let faults = options
                .faults
                .iter()
                .find(|(r, _)| *r == role)
                .map(|(_, plan)| plan.clone())
                .unwrap_or_else(worker::FaultPlan::none);
            let config = WorkerConfig {
                role,
                name: format!("{role:?}-{address}").to_lowercase(),
                model_id: MODEL.into(),
                weights_hash: file.weights_hash,
                context_length,
                queue_max: 64,
                queue_timeout: options.queue_timeout,
                transfer_timeout: options.transfer_timeout,
                step_tokens: 256,
                max_batch: 64,
                faults,
                tracer: otlp::Tracer::off(),
            };
            let worker = match options.backend {
                Backend::Real => {
                    let loaded = load_model_from(&options.model, options.kernels);
                    let (model, tokenizer) = (loaded.model, loaded.tokenizer);
                    let net = Arc::new(Net);
                    start_worker(
                        config,
                        model,
                        tokenizer,
                        pool,
                        listener,
                        net,
                        secret.clone(),
                    )
                }
                Backend::Oracle => start_worker(
                    config,
                    oracle.clone(),
                    file.tokenizer.clone(),
                    pool,
                    listener,
                    Arc::new(Net),
                    secret.clone(),
                ),
            }
            .expect("worker starts");
            workers.push(worker);
            addresses.push((address, role));
        }
        let worker_addresses = addresses.iter().map(|(a, _)| a.clone()).collect();
        addresses.extend(options.extra_workers.iter().cloned());
        let metrics = Arc::new(Metrics::new());
        let cluster = Cluster::connect(addresses, expect, secret, Arc::new(Net), metrics.clone());
        if options.extra_workers.is_empty() {
            assert!(
                cluster.wait_ready(Duration::from_secs(30)).await,
                "workers link"
            );
        }
        let tenants = match options.keys {
            Some(text) => Tenants::from_toml(text).expect("keys file"),
            None => Tenants::open(),
        };
        let config = RouterConfig {
            model_id: MODEL.into(),
            context_length,
            body_bytes_max: 1 << 20,
            default_max_tokens: 64,
            sampling_defaults: Default::default(),
            in_flight_max: 256,
            // Generous: `ggml-exact` kernels take ~30 s on a 1,211-token prompt when alone,
            // and tests share two cores (a 60 s bound once timed out under load).
            start_timeout: Duration::from_secs(180),
            body_timeout: options.body_timeout,
            cors_allow_origins: options.cors_allow_origins.clone(),
            prefix_cache: options.prefix_cache,
            retries: options.retries,
        };
        let state = Arc::new(AppState::new(
            config,
            tenants,
            cluster,
            metrics.clone(),
            file.tokenizer,
            file.chat_template,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let edge = options.edge.clone();
        let server = tokio::spawn(async move {
            let app = router::app(state);
            router::edge::serve(listener, app, edge, metrics, std::future::pending())
                .await
                .expect("server runs");
        });
        TestServer {
            url,
            worker_addresses,
            server,
            _workers: workers,
            _socket_dir: socket_dir,
        }
    })
}

/// What a test sees of one HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    /// The OpenAI error code of an error answer.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("not an OpenAI error: {}", self.body))
            .to_string()
    }

    /// The request field an error answer names (`param`), or "" when none.
    pub fn param(&self) -> String {
        self.json()["error"]["param"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn message(&self) -> String {
        self.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

pub async fn post_raw(url: &str, path: &str, body: Vec<u8>, key: Option<&str>) -> Answer {
    let mut request = client()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.expect("request sent");
    let status = response.status().as_u16();
    let body = response.text().await.expect("body read");
    Answer { status, body }
}

pub async fn post(url: &str, path: &str, body: serde_json::Value) -> Answer {
    post_raw(url, path, body.to_string().into_bytes(), None).await
}

/// A streamed answer of `path` to `body`: its `data:` chunks as JSON (without `[DONE]`), and
/// the whole body as sent.
pub async fn post_stream(
    url: &str,
    path: &str,
    body: &serde_json::Value,
) -> (Vec<serde_json::Value>, String) {
    let text = client()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("body");
    let chunks = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).expect("a chunk is JSON"))
        .collect();
    (chunks, text)
}

/// A greedy completion request for `prompt`.
pub fn completion(prompt: &str, max_tokens: usize) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// `GET {url}{path}`, its body as JSON.
pub async fn get_json(url: &str, path: &str) -> serde_json::Value {
    client()
        .get(format!("{url}{path}"))
        .send()
        .await
        .expect("answered")
        .json()
        .await
        .expect("a JSON body")
}

pub async fn metrics(url: &str) -> String {
    client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics body")
}

/// The value of every sample of `name` in a metrics page, with its labels.
pub fn samples(metrics: &str, name: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            let labels = key.strip_prefix(name)?;
            if !(labels.is_empty() || labels.starts_with('{')) {
                return None;
            }
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Waits (bounded) until every pool is back to all pages free and nothing waits: I9.
/// Returns the last metrics page either way, for the assertion to show.
pub async fn wait_idle(url: &str) -> (bool, String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = metrics(url).await;
        let used: f64 = samples(&page, "airlock_kv_pages_used")
            .iter()
            .map(|s| s.1)
            .sum();
        let queued: f64 = samples(&page, "airlock_worker_queue_depth")
            .iter()
            .map(|s| s.1)
            .sum();
        let waiting: f64 = samples(&page, "airlock_router_queue_depth")
            .iter()
            .map(|s| s.1)
            .sum();
        if used == 0.0 && queued == 0.0 && waiting == 0.0 {
            return (true, page);
        }
        if Instant::now() > deadline {
            return (false, page);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fault plan with every one of `faults` on for every occurrence.
pub fn always(faults: &[worker::Fault]) -> worker::FaultPlan {
    faults
        .iter()
        .fold(worker::FaultPlan::none(), |plan, &fault| {
            plan.with(fault, worker::When::Always)
        })
}
