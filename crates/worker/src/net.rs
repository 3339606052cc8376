//! The worker's network side: accepts links, greets each with this worker's `Hello`, opens
//! links to decode workers on a prefill's behalf, and turns all of it into engine events.
//!
//! Links come over TCP, or over a Unix socket from a process on this host. A prefill that
//! links to a decode worker over a Unix socket gets decode's pool (a memfd) and writes pages
//! into it one-sidedly (`transfer::one_sided`); over TCP it sends page frames. Either way the
//! link's writer hashes each page as it goes and computes the transfer's checksum.

use crate::engine::{Engine, Event, LinkId, LinkKind, OneSidedPeer, PageSinks};
use crate::refusals::{RefusalLog, HANDSHAKES_PENDING_MAX, REFUSAL_LOG_INTERVAL};
use crate::WorkerConfig;
use gguf::Tokenizer;
use hugemem::shared::WriteFence;
use kv::PagePool;
use model::Forward;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex as AsyncMutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use transfer::one_sided::{accept_pool, offer_pool, spawn_one_sided_link};
use transfer::transport::{connect_unix, unix_path};
use transfer::transport::{spawn_link, spawn_link_announced, BoxStream, Link, Transport};
use transfer::{
    accept_handshake, connect_handshake, ClusterSecret, Expectation, Failure, Frame,
    HandshakeError, PeerRole, Plan, Role, WorkerInfo,
};

/// Where a worker's links come from.
pub enum Listener {
    Tcp(TcpListener),
    /// Processes on this host; a decode worker's prefill links over it are one-sided.
    Unix(UnixListener),
    InProcess(tokio::sync::mpsc::Receiver<BoxStream>),
}

/// An accepted stream: Unix sockets stay typed, for the pool offer and the peer's pid.
enum Accepted {
    Stream(BoxStream),
    Unix(UnixStream),
}

impl Listener {
    async fn accept(&mut self) -> io::Result<Accepted> {
        match self {
            Listener::Tcp(listener) => {
                let (stream, _) = listener.accept().await?;
                stream.set_nodelay(true)?;
                Ok(Accepted::Stream(Box::new(stream)))
            }
            Listener::Unix(listener) => Ok(Accepted::Unix(listener.accept().await?.0)),
            Listener::InProcess(incoming) => incoming
                .recv()
                .await
                .map(Accepted::Stream)
                .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "endpoint closed")),
        }
    }
}

/// A running worker. Dropping it stops the engine and the accept loops.
pub struct Worker {
    pub info: WorkerInfo,
    events: mpsc::Sender<Event>,
    accept: Vec<JoinHandle<()>>,
    engine: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        for accept in &self.accept {
            accept.abort();
        }
        let _ = self.events.send(Event::Shutdown);
        if let Some(engine) = self.engine.take() {
            let _ = engine.join();
        }
    }
}

impl Worker {
    /// Drains the worker: it refuses new requests (a router retries them elsewhere, and stops
    /// picking this worker once its pool report says it drains), finishes the ones it holds,
    /// and returns `true` once none is left, or `false` when `deadline` passes first.
    pub async fn drain(&self, deadline: Duration) -> bool {
        let (idle, drained) = tokio::sync::oneshot::channel();
        if self.events.send(Event::Drain { idle }).is_err() {
            return true;
        }
        matches!(tokio::time::timeout(deadline, drained).await, Ok(Ok(())))
    }
}

/// How long opening a link to a decode worker may take, handshake included.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

static NEXT_LINK: AtomicU64 = AtomicU64::new(1);

/// Starts the engine thread and the accept loop. `transport` opens links to decode workers
/// (prefill role only); every link in either direction must prove it holds `secret`. Must be
/// called inside a tokio runtime.
///
/// The start-up capacity check (I8) is the caller's (`airlock` refuses to start a worker whose
/// pool cannot hold one request of its context length); tests call this directly to run such
/// a worker on purpose.
pub fn start_worker(
    config: WorkerConfig,
    model: impl Forward,
    tokenizer: Tokenizer,
    pool: PagePool,
    listener: Listener,
    transport: Arc<dyn Transport>,
    secret: ClusterSecret,
) -> io::Result<Worker> {
    let listeners = vec![listener];
    start_worker_on(config, model, tokenizer, pool, listeners, transport, secret)
}

/// [`start_worker`] accepting links from several listeners (TCP for other hosts, a Unix
/// socket for this one). A decode worker whose pool is shared ([`PagePool::new_shared`])
/// offers it to the prefills that link over a Unix socket.
pub fn start_worker_on(
    config: WorkerConfig,
    model: impl Forward,
    tokenizer: Tokenizer,
    pool: PagePool,
    listeners: Vec<Listener>,
    transport: Arc<dyn Transport>,
    secret: ClusterSecret,
) -> io::Result<Worker> {
    let shape = model.kv_layout(pool.layout().page_size_tokens);
    let info = WorkerInfo {
        role: config.role,
        name: config.name.clone(),
        model_id: config.model_id.clone(),
        weights_hash: config.weights_hash,
        kv_dtype: config::KV_DTYPE.into(),
        layer_count: shape.layer_count as u32,
        kv_head_count: shape.kv_head_count as u32,
        head_dim: shape.head_dim as u32,
        page_size_tokens: pool.layout().page_size_tokens as u32,
        // A worker with its admission guard off (fault injection only) claims its context
        // length, as the incident's misconfigured node did.
        capacity_tokens: if config.faults.admission_checked() {
            pool.capacity_tokens() as u64
        } else {
            config.context_length as u64
        },
        context_length: config.context_length as u32,
        weight_bytes: model.weight_bytes() as u64,
        kv_bytes: pool.bytes() as u64,
        epoch: random_epoch(),
    };
    let shared_pool = match pool.shared_fd() {
        Some(fd) => Some(SharedPoolOffer {
            fd: fd.try_clone_to_owned()?,
            page_count: pool.page_count() as u32,
        }),
        None => None,
    };
    let page_bytes = pool.layout().page_bytes();
    let faults = config.faults.clone();
    let (events, events_rx) = mpsc::channel();
    let engine = Engine::new(config, Box::new(model), tokenizer, pool);
    let page_sinks = engine.page_sinks();
    let thread_name = format!("engine-{}", info.name);
    let engine = std::thread::Builder::new()
        .name(thread_name)
        .spawn(move || {
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.run(events_rx)));
            if let Err(panic) = outcome {
                // A broken invariant: the worker must not go on serving with it.
                broken_invariant(panic.as_ref());
            }
        })?;
    let shared = Arc::new(Shared {
        info: info.clone(),
        events: events.clone(),
        transport,
        secret,
        peers: AsyncMutex::new(HashMap::new()),
        page_sinks,
        refusal_log: RefusalLog::new(REFUSAL_LOG_INTERVAL),
        shared_pool,
        page_bytes,
        faults,
    });
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_PENDING_MAX));
    let accept = listeners
        .into_iter()
        .map(|listener| tokio::spawn(accept_loop(listener, shared.clone(), handshakes.clone())))
        .collect();
    Ok(Worker {
        info,
        events,
        accept,
        engine: Some(engine),
    })
}

async fn accept_loop(mut listener: Listener, shared: Arc<Shared>, handshakes: Arc<Semaphore>) {
    loop {
        match listener.accept().await {
            Ok(stream) => {
                let Ok(handshake) = handshakes.clone().try_acquire_owned() else {
                    // As many peers are mid-handshake as we allow: this one is closed
                    // unanswered, and a linked peer retries.
                    shared.log_refusal("too many links in their handshake");
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    match stream {
                        Accepted::Stream(stream) => shared.serve_link(stream, handshake).await,
                        Accepted::Unix(stream) => shared.serve_unix_link(stream, handshake).await,
                    }
                });
            }
            Err(error) if error.kind() == io::ErrorKind::BrokenPipe => return,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A decode worker's shared pool, as offered to one-sided prefills.
struct SharedPoolOffer {
    fd: OwnedFd,
    page_count: u32,
}

struct Shared {
    info: WorkerInfo,
    events: mpsc::Sender<Event>,
    transport: Arc<dyn Transport>,
    secret: ClusterSecret,
    /// Open links to decode workers, by address.
    peers: AsyncMutex<HashMap<String, LinkId>>,
    /// Land the page frames of prefill workers' links straight in reserved pages.
    page_sinks: PageSinks,
    refusal_log: RefusalLog,
    /// Decode: the pool prefills on this host may write into.
    shared_pool: Option<SharedPoolOffer>,
    page_bytes: usize,
    /// Prefill: the fault plan, for what its links to decode do (test builds only).
    faults: crate::FaultPlan,
}

impl Shared {
    /// A refused link, logged at most once per `REFUSAL_LOG_INTERVAL` with the count of
    /// those left out since.
    fn log_refusal(&self, why: &str) {
        if let Some(suppressed) = self.refusal_log.admit(std::time::Instant::now()) {
            tracing::warn!(refused_links_not_logged = suppressed, "link refused: {why}");
        }
    }

    /// One incoming link, from greeting to close. `handshake` is held until the peer has
    /// proved itself (or failed to).
    async fn serve_link(self: Arc<Self>, mut stream: BoxStream, handshake: OwnedSemaphorePermit) {
        let greeted = accept_handshake(&mut stream, &self.secret, &self.info).await;
        drop(handshake);
        let Some(kind) = self.link_kind(greeted) else {
            return;
        };
        self.run_link(stream, kind, None).await;
    }

    /// [`Shared::serve_link`] for a process on this host: a prefill linking to a decode
    /// worker gets its pool and the link's write fence, and writes pages one-sidedly.
    async fn serve_unix_link(
        self: Arc<Self>,
        mut stream: UnixStream,
        handshake: OwnedSemaphorePermit,
    ) {
        let greeted = accept_handshake(&mut stream, &self.secret, &self.info).await;
        drop(handshake);
        let Some(kind) = self.link_kind(greeted) else {
            return;
        };
        let mut one_sided = None;
        if kind == LinkKind::PrefillPeer {
            match self.offer_pool(&stream).await {
                Ok(peer) => one_sided = Some(peer),
                Err(error) => {
                    self.log_refusal(&format!("cannot offer the pool: {error}"));
                    return;
                }
            }
        }
        self.run_link(Box::new(stream), kind, one_sided).await;
    }

    async fn offer_pool(&self, stream: &UnixStream) -> io::Result<OneSidedPeer> {
        let Some(pool) = &self.shared_pool else {
            return Err(io::Error::other(
                "this decode worker's pool is not shared (start it with a KV socket)",
            ));
        };
        let fence = WriteFence::create()?;
        let page_bytes = self.page_bytes as u64;
        offer_pool(stream, pool.fd.as_fd(), pool.page_count, page_bytes, &fence).await?;
        let pid = stream.peer_cred().ok().and_then(|cred| cred.pid());
        Ok(OneSidedPeer {
            fence: Arc::new(fence),
            pid,
        })
    }

    /// What a greeted peer is to this worker, or `None` (logged) if it may not link.
    fn link_kind(&self, greeted: Result<PeerRole, HandshakeError>) -> Option<LinkKind> {
        match greeted {
            Ok(PeerRole::Router) => Some(LinkKind::Router),
            Ok(PeerRole::Prefill) if self.info.role == Role::Decode => Some(LinkKind::PrefillPeer),
            Ok(PeerRole::Prefill) => {
                self.log_refusal("only decode workers take pages");
                None
            }
            Err(error) => {
                self.log_refusal(&error.to_string());
                if matches!(error, HandshakeError::Auth) {
                    let _ = self.events.send(Event::AuthFailure);
                }
                None
            }
        }
    }

    /// A greeted link, until it closes.
    async fn run_link(
        self: Arc<Self>,
        stream: BoxStream,
        kind: LinkKind,
        one_sided: Option<OneSidedPeer>,
    ) {
        let id = NEXT_LINK.fetch_add(1, Ordering::Relaxed);
        let is_one_sided = one_sided.is_some();
        let sink = (kind == LinkKind::PrefillPeer)
            .then(|| self.page_sinks.for_link(id, self.events.clone(), one_sided));
        // The engine learns of the link before its reader starts: a page the sink refuses is
        // reported on the engine's queue, and the `Nack` for it needs the link to exist.
        let mut engine_gone = false;
        let announce = |tx: &tokio::sync::mpsc::UnboundedSender<Frame>| {
            let up = Event::LinkUp {
                link: id,
                kind,
                tx: tx.clone(),
                one_sided: is_one_sided,
                sender_hashes: None,
            };
            engine_gone = self.events.send(up).is_err();
        };
        let name = format!("{}-in", self.info.name);
        let mut link = spawn_link_announced(stream, name, sink, announce);
        if engine_gone {
            return;
        }
        while let Some(frame) = link.rx.recv().await {
            let event = match frame {
                Frame::Submit(submit) if matches!(submit.plan, Plan::Prefill { .. }) => {
                    let Plan::Prefill { decode_addr, .. } = &submit.plan else {
                        unreachable!("matched above");
                    };
                    match self.peer(decode_addr).await {
                        Ok(peer) => Event::SubmitToPeer {
                            link: id,
                            submit,
                            peer,
                        },
                        Err(message) => {
                            let _ = link.tx.send(Frame::Failed {
                                request: submit.request,
                                failure: Failure::PeerUnavailable,
                                message,
                            });
                            continue;
                        }
                    }
                }
                frame => Event::Frame { link: id, frame },
            };
            if self.events.send(event).is_err() {
                return;
            }
        }
        let _ = self.events.send(Event::LinkDown { link: id });
    }

    /// The link to the decode worker at `addr`, opened (and checked) if need be.
    async fn peer(self: &Arc<Self>, addr: &str) -> Result<LinkId, String> {
        let mut peers = self.peers.lock().await;
        if let Some(&id) = peers.get(addr) {
            return Ok(id);
        }
        let (link, sender_hashes) = tokio::time::timeout(CONNECT_TIMEOUT, self.connect_peer(addr))
            .await
            .map_err(|_| format!("decode worker {addr} did not answer in time"))??;
        let id = NEXT_LINK.fetch_add(1, Ordering::Relaxed);
        let up = Event::LinkUp {
            link: id,
            kind: LinkKind::DecodePeer,
            tx: link.tx.clone(),
            one_sided: unix_path(addr).is_some(),
            sender_hashes,
        };
        self.events
            .send(up)
            .map_err(|_| "the worker is shutting down".to_string())?;
        peers.insert(addr.to_string(), id);
        let shared = self.clone();
        let addr = addr.to_string();
        tokio::spawn(async move {
            let mut link = link;
            while let Some(frame) = link.rx.recv().await {
                if shared
                    .events
                    .send(Event::Frame { link: id, frame })
                    .is_err()
                {
                    return;
                }
            }
            shared.peers.lock().await.remove(&addr);
            let _ = shared.events.send(Event::LinkDown { link: id });
        });
        Ok(id)
    }

    /// Opens, authenticates and checks a link to a decode worker: same model, weights, KV
    /// layout and context as this prefill (I8), or no pages go there. Over TCP the link's
    /// writer computes `Done`'s checksum from the hashes returned beside it, unless the
    /// fault plan reshapes transfers (then what it plants must stay a corruption of what
    /// the engine hashed).
    async fn connect_peer(
        &self,
        addr: &str,
    ) -> Result<(Link, Option<transfer::SenderHashes>), String> {
        if let Some(path) = unix_path(addr) {
            return Ok((self.connect_one_sided_peer(addr, path).await?, None));
        }
        let mut stream = self
            .transport
            .connect(addr)
            .await
            .map_err(|error| format!("cannot reach decode worker {addr}: {error}"))?;
        self.check_decode_peer(&mut stream, addr).await?;
        let name = format!("{}-to-{addr}", self.info.name);
        if self.faults.reshapes_transfers() {
            return Ok((spawn_link(stream, name), None));
        }
        let hashes = transfer::SenderHashes::default();
        let link = transfer::transport::spawn_hashing_link(stream, name, hashes.clone());
        Ok((link, Some(hashes)))
    }

    /// Authenticates the worker at the other end of `stream` and checks that it is a decode
    /// worker of the same model, weights, KV layout and context as this prefill (I8).
    async fn check_decode_peer<S: transfer::transport::ByteStream>(
        &self,
        stream: &mut S,
        addr: &str,
    ) -> Result<(), String> {
        let expect = Expectation::of(&self.info);
        let info = connect_handshake(stream, PeerRole::Prefill, &self.secret, &expect)
            .await
            .map_err(|error| format!("decode worker {addr} refused: {error}"))?;
        if info.role != Role::Decode {
            return Err(format!(
                "worker {addr} is a {:?} worker, not decode",
                info.role
            ));
        }
        Ok(())
    }

    /// [`Shared::connect_peer`] over a Unix socket: after the same checks, maps the decode
    /// worker's pool and writes pages into it one-sidedly.
    async fn connect_one_sided_peer(&self, addr: &str, path: &str) -> Result<Link, String> {
        let mut stream = connect_unix(path)
            .await
            .map_err(|error| format!("cannot reach decode worker {addr}: {error}"))?;
        self.check_decode_peer(&mut stream, addr).await?;
        let pool = accept_pool(&stream, self.page_bytes)
            .await
            .map_err(|error| format!("decode worker {addr} shared no pool: {error}"))?;
        let name = format!("{}-to-{addr}", self.info.name);
        let faults = self.faults.one_sided_writer();
        Ok(spawn_one_sided_link(
            Box::new(stream),
            name,
            Arc::new(pool),
            faults,
        ))
    }
}

/// Says which invariant broke, and exits (status 70). Written to the process's stderr itself,
/// not through `eprintln!`, which a test harness captures for the threads a test spawned (and
/// loses when the process exits).
fn broken_invariant(panic: &(dyn std::any::Any + Send)) -> ! {
    use std::io::Write;
    let message = panic
        .downcast_ref::<&str>()
        .map(|message| message.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string());
    let _ = writeln!(
        std::io::stderr(),
        "airlock: worker engine stopped on a broken invariant ({message}); exiting"
    );
    std::process::exit(70)
}

/// A per-process random number, so a restarted worker is told apart from its predecessor.
fn random_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}
