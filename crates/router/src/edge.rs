//! The HTTP edge: accepts connections and hands each to hyper with its time and number
//! bounded, so clients that never finish a request cannot take the port from those that do.
//!
//! - A request's headers must arrive within `header_timeout` of the server starting to wait
//!   for them (a new connection, or the end of the previous response): hyper's own timer.
//! - A keep-alive connection with no request in progress is closed after
//!   `keep_alive_timeout`.
//! - At most `connections_per_client_max` connections per client address (more are answered
//!   429 at once) and `connections_max` in all. When every slot is taken, the connection that
//!   has been idle the longest (no request in progress: half-sent headers included) is closed
//!   to make room; only when none is idle is a newcomer answered 503.
//!
//! The body's own deadline is the handler's (`RouterConfig::body_timeout`): it is read only
//! once the caller is authenticated.

use crate::error::ApiError;
use crate::metrics::{Counter, Metrics};
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

/// How the edge bounds its connections; the binary fills it from flags.
#[derive(Clone, Debug)]
pub struct EdgeConfig {
    /// Longest wait for a request's complete headers.
    pub header_timeout: Duration,
    /// Longest a kept-alive connection may sit with no request in progress.
    pub keep_alive_timeout: Duration,
    /// Open connections in all.
    pub connections_max: usize,
    /// Open connections from one client address.
    pub connections_per_client_max: usize,
    /// How long a shutdown waits for requests in progress before it drops them.
    pub shutdown_grace: Duration,
}

/// File descriptors kept for everything that is not a client connection (worker links, the
/// model file, logs, refusals being answered) when `connections_max` follows the limit.
pub const FDS_RESERVED: u64 = 256;

/// The most connections `connections_max_for` ever suggests: each may buffer up to
/// `CONNECTION_BUFFER_BYTES_MAX` of unfinished headers.
pub const CONNECTIONS_MAX_DEFAULT_CAP: u64 = 4096;

/// Most bytes hyper buffers per connection while it reads a request head. Above the URI
/// (64 KiB, 414) and header (16 KiB, 431) limits, so those keep their own answers.
pub const CONNECTION_BUFFER_BYTES_MAX: usize = 128 << 10;
// A request whose headers are under the router's own cap must never be cut off by hyper's
// buffer cap first: the caller gets the clear 431, not a dropped connection.
const _: () = assert!(crate::server::HEADER_BYTES_MAX < CONNECTION_BUFFER_BYTES_MAX);

/// Refusals answered at once beyond the cap (each holds its socket for up to
/// `REFUSAL_LINGER`); past this many, a refused connection is closed without an answer.
const REFUSALS_ANSWERING_MAX: usize = 256;
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// Raises this process's open-file soft limit to its hard limit, and returns the soft limit
/// now in force (the connection caps are sized from it).
pub fn raise_open_file_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit whose soft value does not exceed its hard one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Ok(limit.rlim_cur)
}

/// `connections_max` when not given: what the open-file limit leaves after the reserve,
/// capped so that unfinished headers cannot hold more than ~512 MiB.
pub fn connections_max_for(open_files: u64) -> usize {
    open_files
        .saturating_sub(FDS_RESERVED)
        .clamp(16, CONNECTIONS_MAX_DEFAULT_CAP) as usize
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets requests
/// in progress finish for up to `shutdown_grace`, and returns.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    config: EdgeConfig,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let table = Arc::new(Table::new(config.clone(), metrics.clone()));
    let refusals = Arc::new(Semaphore::new(REFUSALS_ANSWERING_MAX));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors or memory: wait rather than spin; the caps keep this
                    // rare.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        match table.admit(peer.ip()) {
            Ok(conn) => {
                let app = app.clone();
                let stop = stop_rx.clone();
                let table = table.clone();
                connections.spawn(serve_connection(stream, conn, table, app, stop));
            }
            Err(refusal) => {
                metrics.inc(Counter::HttpConnectionsRefused {
                    reason: refusal.reason(),
                });
                if let Ok(permit) = refusals.clone().try_acquire_owned() {
                    let response = refusal.response(&config);
                    tokio::spawn(async move {
                        answer_refusal(stream, response).await;
                        drop(permit);
                    });
                }
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(config.shutdown_grace, drained)
        .await
        .is_err()
    {
        tracing::warn!("shutdown: requests still in progress after the grace period; dropped");
        connections.shutdown().await;
    }
    Ok(())
}

/// Why a connection was refused at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// This client address already holds its share.
    PerClient,
    /// Every slot is in use by a connection with a request in progress.
    Full,
}

impl Refusal {
    fn reason(self) -> &'static str {
        match self {
            Refusal::PerClient => "per_client",
            Refusal::Full => "full",
        }
    }

    /// The whole HTTP response: OpenAI error JSON, `Connection: close`.
    fn response(self, config: &EdgeConfig) -> Vec<u8> {
        let (status, error) = match self {
            Refusal::PerClient => (
                "429 Too Many Requests",
                ApiError::RateLimited {
                    message: format!(
                        "your address has {} connections open, the most allowed; reuse or \
                         close one and retry",
                        config.connections_per_client_max
                    ),
                },
            ),
            Refusal::Full => (
                "503 Service Unavailable",
                ApiError::Overloaded {
                    message: format!(
                        "the server holds its limit of {} connections, all busy; retry shortly",
                        config.connections_max
                    ),
                },
            ),
        };
        let body = error.to_json();
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             retry-after: 1\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }
}

/// Writes the refusal, then reads (and drops) what the client sent for a moment, so closing
/// does not reset the connection before the client has read the answer.
async fn answer_refusal(mut stream: TcpStream, response: Vec<u8>) {
    let answer = async {
        stream.write_all(&response).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    };
    let _ = tokio::time::timeout(REFUSAL_LINGER, answer).await;
}

/// One open connection, as the table sees it.
struct Conn {
    id: u64,
    client: IpAddr,
    /// Requests whose response has not been sent in full.
    requests: AtomicUsize,
    /// When the last request's response ended (or the connection opened).
    idle_since: Mutex<Instant>,
    /// Whether a request has been answered on it: only such a connection is "kept alive".
    served: AtomicBool,
    /// Told to close (evicted to make room).
    close: Notify,
}

impl Conn {
    fn request_started(&self) {
        self.requests.fetch_add(1, Ordering::AcqRel);
    }

    fn request_ended(&self) {
        *self.idle_since.lock().expect("never held across a panic") = Instant::now();
        self.served.store(true, Ordering::Release);
        self.requests.fetch_sub(1, Ordering::AcqRel);
    }

    fn is_idle(&self) -> bool {
        self.requests.load(Ordering::Acquire) == 0
    }

    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().expect("never held across a panic")
    }
}

/// Every open connection, with its client's count.
struct Table {
    config: EdgeConfig,
    metrics: Arc<Metrics>,
    state: Mutex<TableState>,
}

#[derive(Default)]
struct TableState {
    open: HashMap<u64, Arc<Conn>>,
    per_client: HashMap<IpAddr, usize>,
    next_id: u64,
}

impl TableState {
    fn remove(&mut self, id: u64) -> Option<Arc<Conn>> {
        let conn = self.open.remove(&id)?;
        if let Some(count) = self.per_client.get_mut(&conn.client) {
            *count -= 1;
            if *count == 0 {
                self.per_client.remove(&conn.client);
            }
        }
        Some(conn)
    }
}

impl Table {
    fn new(config: EdgeConfig, metrics: Arc<Metrics>) -> Table {
        Table {
            config,
            metrics,
            state: Mutex::new(TableState::default()),
        }
    }

    /// A slot for a new connection from `client`, making room by closing the longest-idle
    /// connection when every slot is taken.
    fn admit(&self, client: IpAddr) -> Result<Arc<Conn>, Refusal> {
        let mut state = self.state.lock().expect("never held across a panic");
        let from_client = state.per_client.get(&client).copied().unwrap_or(0);
        if from_client >= self.config.connections_per_client_max {
            return Err(Refusal::PerClient);
        }
        if state.open.len() >= self.config.connections_max {
            let idlest = state
                .open
                .values()
                .filter(|conn| conn.is_idle())
                .min_by_key(|conn| conn.idle_since())
                .map(|conn| conn.id);
            let Some(id) = idlest else {
                return Err(Refusal::Full);
            };
            let evicted = state.remove(id).expect("found in the table above");
            evicted.close.notify_one();
            self.metrics
                .inc(Counter::HttpConnectionsClosed { reason: "evicted" });
        }
        state.next_id += 1;
        let conn = Arc::new(Conn {
            id: state.next_id,
            client,
            requests: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            served: AtomicBool::new(false),
            close: Notify::new(),
        });
        state.open.insert(conn.id, conn.clone());
        *state.per_client.entry(client).or_insert(0) += 1;
        self.metrics.set_http_connections_open(state.open.len());
        Ok(conn)
    }

    fn release(&self, conn: &Conn) {
        let mut state = self.state.lock().expect("never held across a panic");
        state.remove(conn.id);
        self.metrics.set_http_connections_open(state.open.len());
    }
}

/// How a connection ended, for the metrics.
enum Ended {
    Done,
    HeaderTimeout,
    Idle,
    Evicted,
}

async fn serve_connection(
    stream: TcpStream,
    conn: Arc<Conn>,
    table: Arc<Table>,
    app: axum::Router,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let service_conn = conn.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let tracker = RequestTracker::start(service_conn.clone());
        let app = app.clone();
        async move {
            let response = app
                .oneshot(request.map(Body::new))
                .await
                .unwrap_or_else(|never| match never {});
            Ok::<_, std::convert::Infallible>(response.map(|body| {
                Body::new(TrackedBody {
                    body,
                    _tracker: tracker,
                })
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(table.config.header_timeout)
        .max_buf_size(CONNECTION_BUFFER_BYTES_MAX);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = pin!(connection);
    let keep_alive = table.config.keep_alive_timeout;
    let mut check_at = Instant::now() + keep_alive;
    let mut stopping = false;
    let ended = loop {
        tokio::select! {
            result = connection.as_mut() => break match result {
                Err(error) if error.is_timeout() => Ended::HeaderTimeout,
                _ => Ended::Done,
            },
            () = conn.close.notified() => break Ended::Evicted,
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_ok() {
                    connection.as_mut().graceful_shutdown();
                }
            }
            () = tokio::time::sleep_until(check_at) => match next_idle_check(&conn, keep_alive) {
                Some(at) => check_at = at,
                None => break Ended::Idle,
            },
        }
    };
    let reason = match ended {
        Ended::Done | Ended::Evicted => None,
        Ended::HeaderTimeout => Some("header_timeout"),
        Ended::Idle => Some("idle"),
    };
    if let Some(reason) = reason {
        table.metrics.inc(Counter::HttpConnectionsClosed { reason });
    }
    table.release(&conn);
}

/// When to look again whether `conn` has sat idle too long, or `None` when it has: a
/// connection that answered a request and has had none in progress for `keep_alive`.
fn next_idle_check(conn: &Conn, keep_alive: Duration) -> Option<Instant> {
    let now = Instant::now();
    if !conn.is_idle() || !conn.served.load(Ordering::Acquire) {
        // Busy, or waiting for its first request's headers (hyper's header timer).
        return Some(now + keep_alive);
    }
    let idle_until = conn.idle_since() + keep_alive;
    (now < idle_until).then_some(idle_until)
}

/// Counts a request as in progress on its connection from its start until its response body
/// is done or dropped, so a streaming answer keeps its connection from looking idle.
struct RequestTracker(Arc<Conn>);

impl RequestTracker {
    fn start(conn: Arc<Conn>) -> RequestTracker {
        conn.request_started();
        RequestTracker(conn)
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

struct TrackedBody {
    body: Body,
    _tracker: RequestTracker,
}

impl http_body::Body for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests;
