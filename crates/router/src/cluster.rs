//! The router's view of its workers: one client per configured address, each holding a link
//! that it re-opens when it breaks, the worker's `Hello`, its latest pool report, and the
//! requests in flight on it.

use crate::metrics::{Counter, Metrics, PoolGauges};
use kv::RequestId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;
use transfer::transport::{spawn_link, Transport};
use transfer::{
    connect_handshake, ClusterSecret, Expectation, Failure, Frame, HandshakeError, PeerRole,
    PrefixCounters, Role, WorkerInfo,
};

/// How long to wait before re-opening a broken link.
const RECONNECT_DELAY: Duration = Duration::from_millis(250);
/// How long to wait before retrying a worker that was refused at the handshake.
const REFUSED_DELAY: Duration = Duration::from_secs(2);

pub struct WorkerClient {
    pub addr: String,
    pub role: Role,
    state: Mutex<ClientState>,
}

#[derive(Default)]
struct ClientState {
    link: Option<UnboundedSender<Frame>>,
    info: Option<WorkerInfo>,
    /// Where each request's frames go, tagged with this worker's role.
    requests: HashMap<RequestId, UnboundedSender<(Role, Frame)>>,
    stats: Option<Frame>,
    refused: Option<String>,
}

enum LinkFailure {
    Unreachable(std::io::Error),
    Refused(HandshakeError),
}

/// All workers, and the tasks that keep their links open.
pub struct Cluster {
    pub clients: Vec<Arc<WorkerClient>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Cluster {
    /// Starts a link-keeping task per worker. Every worker must prove it holds `secret` and
    /// match `expect` (model, weights, KV layout, context), or it is refused, counted in
    /// `airlock_workers_refused_total`, and never routed to (I8, I11).
    pub fn connect(
        workers: Vec<(String, Role)>,
        expect: Expectation,
        secret: ClusterSecret,
        transport: Arc<dyn Transport>,
        metrics: Arc<Metrics>,
    ) -> Cluster {
        let clients: Vec<Arc<WorkerClient>> = workers
            .into_iter()
            .map(|(addr, role)| {
                Arc::new(WorkerClient {
                    addr,
                    role,
                    state: Mutex::new(ClientState::default()),
                })
            })
            .collect();
        let tasks = clients
            .iter()
            .map(|client| {
                let client = client.clone();
                let transport = transport.clone();
                let expect = expect.clone();
                let secret = secret.clone();
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    client
                        .keep_linked(&*transport, &expect, &secret, &metrics)
                        .await
                })
            })
            .collect();
        Cluster { clients, tasks }
    }

    /// Waits until every worker has a live link, or `timeout` passes.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.clients.iter().all(|c| c.info().is_some()) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The live worker of `role` with the fewest requests in flight.
    pub fn pick(&self, role: Role) -> Option<Arc<WorkerClient>> {
        self.clients
            .iter()
            .filter(|c| c.role == role && c.is_up())
            .min_by_key(|c| c.in_flight())
            .cloned()
    }

    pub fn has_role(&self, role: Role) -> bool {
        self.clients.iter().any(|c| c.role == role)
    }

    /// The smallest (capacity in tokens, context length) over live workers of `role`.
    pub fn limits(&self, role: Role) -> Option<(u64, u32)> {
        self.clients
            .iter()
            .filter(|c| c.role == role)
            .filter_map(|c| c.info())
            .map(|info| (info.capacity_tokens, info.context_length))
            .reduce(|a, b| (a.0.min(b.0), a.1.min(b.1)))
    }

    pub fn gauges(&self) -> Vec<PoolGauges> {
        self.clients.iter().map(|c| c.gauges()).collect()
    }
}

impl WorkerClient {
    fn lock(&self) -> std::sync::MutexGuard<'_, ClientState> {
        self.state
            .lock()
            .expect("client lock is never held across a panic")
    }

    pub fn info(&self) -> Option<WorkerInfo> {
        self.lock().info.clone()
    }

    pub fn is_up(&self) -> bool {
        self.lock().link.is_some()
    }

    pub fn in_flight(&self) -> usize {
        self.lock().requests.len()
    }

    /// Routes the request's frames from this worker to `tx` and sends `frame`. Fails when the
    /// link is down (the request was not sent).
    pub fn submit(
        &self,
        request: RequestId,
        tx: UnboundedSender<(Role, Frame)>,
        frame: Frame,
    ) -> bool {
        let mut state = self.lock();
        let Some(link) = state.link.clone() else {
            return false;
        };
        state.requests.insert(request, tx);
        if link.send(frame).is_err() {
            state.requests.remove(&request);
            return false;
        }
        true
    }

    /// Sends a frame that needs no routing (an abort).
    pub fn send(&self, frame: Frame) {
        if let Some(link) = &self.lock().link {
            let _ = link.send(frame);
        }
    }

    pub fn forget(&self, request: RequestId) {
        self.lock().requests.remove(&request);
    }

    fn gauges(&self) -> PoolGauges {
        let state = self.lock();
        let name = state
            .info
            .as_ref()
            .map_or_else(|| self.addr.clone(), |info| info.name.clone());
        let mut gauges = PoolGauges {
            worker: name,
            role: role_name(self.role),
            up: state.link.is_some(),
            pages_free: 0,
            pages_total: 0,
            pages_quarantined: 0,
            queue_depth: 0,
            ownership_failures: 0,
            frames_rejected: 0,
            auth_failures: 0,
            prefix: PrefixCounters::default(),
            transfer: Default::default(),
        };
        if let Some(Frame::PoolStats {
            pages_free,
            pages_total,
            pages_quarantined,
            queue_depth,
            ownership_failures,
            frames_rejected,
            auth_failures,
            prefix,
            transfer,
        }) = &state.stats
        {
            gauges.prefix = *prefix;
            gauges.transfer = **transfer;
            gauges.auth_failures = *auth_failures;
            gauges.pages_free = *pages_free;
            gauges.pages_total = *pages_total;
            gauges.pages_quarantined = *pages_quarantined;
            gauges.queue_depth = *queue_depth;
            gauges.ownership_failures = *ownership_failures;
            gauges.frames_rejected = *frames_rejected;
        }
        gauges
    }

    async fn keep_linked(
        &self,
        transport: &dyn Transport,
        expect: &Expectation,
        secret: &ClusterSecret,
        metrics: &Metrics,
    ) {
        loop {
            match self.link_once(transport, expect, secret).await {
                Ok(()) => tracing::warn!(worker = %self.addr, "worker link closed; reconnecting"),
                Err(LinkFailure::Unreachable(error)) => {
                    tracing::debug!(worker = %self.addr, %error, "worker not reachable");
                }
                Err(LinkFailure::Refused(error)) => {
                    metrics.inc(Counter::WorkersRefused {
                        reason: error.reason(),
                    });
                    tracing::error!(worker = %self.addr, %error, "worker refused");
                    self.lock().refused = Some(error.to_string());
                    tokio::time::sleep(REFUSED_DELAY).await;
                }
            }
            tokio::time::sleep(RECONNECT_DELAY).await;
        }
    }

    /// Why a worker is refused, if it was at its last handshake.
    pub fn refused(&self) -> Option<String> {
        self.lock().refused.clone()
    }

    /// Opens the link, checks the worker, then relays frames until the link closes.
    async fn link_once(
        &self,
        transport: &dyn Transport,
        expect: &Expectation,
        secret: &ClusterSecret,
    ) -> Result<(), LinkFailure> {
        let mut stream = transport
            .connect(&self.addr)
            .await
            .map_err(LinkFailure::Unreachable)?;
        let info = connect_handshake(&mut stream, PeerRole::Router, secret, expect)
            .await
            .map_err(LinkFailure::Refused)?;
        if info.role != self.role {
            return Err(LinkFailure::Refused(HandshakeError::Mismatch {
                field: "role",
                found: role_name(info.role).into(),
                expected: role_name(self.role).into(),
            }));
        }
        let mut link = spawn_link(stream, format!("router-to-{}", self.addr));
        tracing::info!(worker = %self.addr, name = %info.name, capacity_tokens = info.capacity_tokens, "worker linked");
        {
            let mut state = self.lock();
            state.link = Some(link.tx.clone());
            state.info = Some(info);
            state.refused = None;
        }
        while let Some(frame) = link.rx.recv().await {
            let request = match &frame {
                Frame::PoolStats { .. } => {
                    self.lock().stats = Some(frame);
                    continue;
                }
                Frame::Admitted { request, .. }
                | Frame::Started { request }
                | Frame::Text { request, .. }
                | Frame::PromptLogprobs { request, .. }
                | Frame::Finished { request, .. }
                | Frame::Failed { request, .. } => *request,
                _ => continue,
            };
            let ends = matches!(frame, Frame::Finished { .. } | Frame::Failed { .. });
            let mut state = self.lock();
            let tx = if ends {
                state.requests.remove(&request)
            } else {
                state.requests.get(&request).cloned()
            };
            if let Some(tx) = tx {
                let _ = tx.send((self.role, frame));
            }
        }
        // Every request still on this worker hears that it is gone.
        let mut state = self.lock();
        state.link = None;
        state.info = None;
        for (request, tx) in state.requests.drain() {
            let _ = tx.send((
                self.role,
                Frame::Failed {
                    request,
                    failure: Failure::PeerUnavailable,
                    message: format!("lost the link to worker {}", self.addr),
                },
            ));
        }
        Ok(())
    }
}

pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Unified => "unified",
    }
}
