//! The router's view of its workers: one client per configured address, each holding a link
//! that it re-opens when it breaks, the worker's `Hello`, its latest pool report, the
//! requests in flight on it, and its circuit breaker.
//!
//! The breaker counts transport failures only (a lost link, a transfer that failed or timed
//! out, a peer that could not be reached): a client's bad request never reaches it, so a
//! burst of 400s cannot take a healthy worker out of rotation.

use crate::metrics::{Counter, Metrics, PoolGauges};
use kv::RequestId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
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
/// Consecutive transport failures that open a worker's breaker.
pub const BREAKER_FAILURES: u32 = 5;
/// How long an open breaker keeps its worker out of rotation before one more try.
pub const BREAKER_COOLDOWN: Duration = Duration::from_secs(10);

/// A transport failure laid at one worker (`airlock_worker_failures_total{kind}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportFault {
    /// The router's link to the worker broke.
    LinkLost,
    /// A transfer the worker took part in was refused or broke.
    TransferFailed,
    /// A transfer the worker took part in did not finish in time.
    TransferTimeout,
    /// The worker could not reach its peer.
    PeerUnavailable,
}

impl TransportFault {
    pub const ALL: [TransportFault; 4] = [
        TransportFault::LinkLost,
        TransportFault::TransferFailed,
        TransportFault::TransferTimeout,
        TransportFault::PeerUnavailable,
    ];

    /// The fault a worker's `Failed` reports, if it is one; `None` for everything of the
    /// client's making or of load (bad request, context too long, queue full or timed out).
    pub fn of(failure: Failure) -> Option<TransportFault> {
        match failure {
            Failure::TransferFailed => Some(TransportFault::TransferFailed),
            Failure::TransferTimeout => Some(TransportFault::TransferTimeout),
            Failure::PeerUnavailable => Some(TransportFault::PeerUnavailable),
            Failure::Aborted
            | Failure::ContextLengthExceeded
            | Failure::PoolTooSmall
            | Failure::QueueTimeout
            | Failure::Overloaded
            | Failure::BadRequest
            | Failure::Internal => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            TransportFault::LinkLost => "link_lost",
            TransportFault::TransferFailed => "transfer_failed",
            TransportFault::TransferTimeout => "transfer_timeout",
            TransportFault::PeerUnavailable => "peer_unavailable",
        }
    }
}

/// Consecutive transport failures, and while open, until when.
#[derive(Debug, Default)]
struct Breaker {
    consecutive: u32,
    open_until: Option<Instant>,
}

impl Breaker {
    fn failed(&mut self, now: Instant) -> bool {
        self.consecutive += 1;
        let opens = self.consecutive >= BREAKER_FAILURES;
        if opens {
            self.open_until = Some(now + BREAKER_COOLDOWN);
        }
        opens
    }

    fn succeeded(&mut self) {
        *self = Breaker::default();
    }

    /// Open: not picked while another worker of the role is closed. After the cooldown it is
    /// half-open: picked again, and the next outcome closes or re-opens it.
    fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|until| now < until)
    }
}

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
    breaker: Breaker,
    /// Transport failures laid at this worker, in `TransportFault::ALL` order.
    failures: [u64; 4],
    /// The epoch of the worker's last handshake: a new one on a re-link is a restart.
    epoch: Option<u64>,
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

    /// The linked worker of `role` that can best take a request: not draining, its breaker
    /// closed, not in `avoid` (the workers an earlier try of this request failed on), then
    /// the least loaded (requests in flight plus its queue) with the most free pages. When
    /// every candidate is avoided or its breaker is open, the best of those is taken rather
    /// than none: a breaker must never turn the last worker of a role away.
    pub fn pick(&self, role: Role, avoid: &[Arc<WorkerClient>]) -> Option<Arc<WorkerClient>> {
        let now = Instant::now();
        let candidates: Vec<(Arc<WorkerClient>, Load)> = self
            .clients
            .iter()
            .filter(|c| c.role == role)
            .filter_map(|c| c.load(now).map(|load| (c.clone(), load)))
            .filter(|(_, load)| !load.draining)
            .collect();
        let best = |preferred: bool| {
            candidates
                .iter()
                .filter(|(c, load)| {
                    !preferred || (!load.breaker_open && !avoid.iter().any(|a| Arc::ptr_eq(a, c)))
                })
                .min_by_key(|(_, load)| (load.busy, std::cmp::Reverse(load.pages_free)))
                .map(|(c, _)| c.clone())
        };
        best(true).or_else(|| best(false))
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

    /// What `Cluster::pick` weighs, or `None` when the link is down.
    fn load(&self, now: Instant) -> Option<Load> {
        let state = self.lock();
        state.link.as_ref()?;
        let (queue_depth, pages_free, draining) = match &state.stats {
            Some(Frame::PoolStats {
                queue_depth,
                pages_free,
                draining,
                ..
            }) => (*queue_depth as usize, *pages_free, *draining),
            _ => (0, 0, false),
        };
        Some(Load {
            busy: state.requests.len() + queue_depth,
            pages_free,
            draining,
            breaker_open: state.breaker.is_open(now),
        })
    }

    /// Lays a transport failure at this worker: counted, and toward its breaker.
    pub fn failed(&self, fault: TransportFault) {
        let mut state = self.lock();
        let index = TransportFault::ALL
            .iter()
            .position(|f| *f == fault)
            .expect("ALL lists every fault");
        state.failures[index] += 1;
        if state.breaker.failed(Instant::now()) {
            tracing::warn!(
                worker = %self.addr,
                fault = fault.label(),
                failures = state.breaker.consecutive,
                cooldown_s = BREAKER_COOLDOWN.as_secs(),
                "breaker open: worker out of rotation"
            );
        }
    }

    /// A request went through this worker: its breaker closes.
    pub fn succeeded(&self) {
        self.lock().breaker.succeeded();
    }

    /// Whether the worker reported that it is shutting down.
    pub fn is_draining(&self) -> bool {
        matches!(
            self.lock().stats,
            Some(Frame::PoolStats { draining: true, .. })
        )
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
            draining: false,
            breaker_open: state.breaker.is_open(Instant::now()),
            failures: state.failures,
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
            draining,
        }) = &state.stats
        {
            gauges.draining = *draining;
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
            if state.epoch.is_some_and(|epoch| epoch != info.epoch) {
                // Nothing of the old process can be in flight: its link's requests were all
                // failed when it broke. A fresh start gets a fresh breaker.
                tracing::info!(worker = %self.addr, "worker restarted (new epoch); re-admitted");
                state.breaker.succeeded();
            }
            state.epoch = Some(info.epoch);
            state.stats = None;
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
        self.failed(TransportFault::LinkLost);
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

/// A linked worker's load, as `Cluster::pick` weighs it.
struct Load {
    busy: usize,
    pages_free: u32,
    draining: bool,
    breaker_open: bool,
}

pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Unified => "unified",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::unbounded_channel;

    /// A linked client (its link's far end dropped: nothing is sent in these tests) with a
    /// pool report of `queue_depth`, `pages_free` and `draining`.
    fn linked(addr: &str, role: Role, queue_depth: u32, pages_free: u32) -> Arc<WorkerClient> {
        let client = Arc::new(WorkerClient {
            addr: addr.into(),
            role,
            state: Mutex::new(ClientState::default()),
        });
        let stats = Frame::PoolStats {
            pages_free,
            pages_total: 100,
            pages_quarantined: 0,
            queue_depth,
            ownership_failures: 0,
            frames_rejected: 0,
            auth_failures: 0,
            prefix: PrefixCounters::default(),
            transfer: Box::default(),
            draining: false,
        };
        let mut state = client.lock();
        state.link = Some(unbounded_channel().0);
        state.stats = Some(stats);
        drop(state);
        client
    }

    fn cluster(clients: &[&Arc<WorkerClient>]) -> Cluster {
        Cluster {
            clients: clients.iter().map(|c| Arc::clone(c)).collect(),
            tasks: Vec::new(),
        }
    }

    fn set_draining(client: &WorkerClient) {
        if let Some(Frame::PoolStats { draining, .. }) = &mut client.lock().stats {
            *draining = true;
        }
    }

    fn picked(cluster: &Cluster, role: Role, avoid: &[Arc<WorkerClient>]) -> String {
        cluster
            .pick(role, avoid)
            .map(|c| c.addr.clone())
            .unwrap_or_default()
    }

    /// Only a worker's transport counts toward its breaker: everything a client's request or
    /// the load causes is not a fault of the worker's.
    #[test]
    fn only_transport_failures_are_faults() {
        let faults: Vec<Failure> = Failure::ALL
            .iter()
            .copied()
            .filter(|f| TransportFault::of(*f).is_some())
            .collect();
        assert_eq!(
            faults,
            [
                Failure::TransferFailed,
                Failure::TransferTimeout,
                Failure::PeerUnavailable
            ]
        );
        for client_made in [
            Failure::BadRequest,
            Failure::ContextLengthExceeded,
            Failure::PoolTooSmall,
        ] {
            assert_eq!(TransportFault::of(client_made), None);
        }
    }

    /// The least loaded worker (in flight plus queue) wins, then the one with more free
    /// pages; a draining worker is never picked.
    #[test]
    fn pick_weighs_queue_and_free_pages_and_skips_draining() {
        let a = linked("a", Role::Decode, 3, 90);
        let b = linked("b", Role::Decode, 1, 10);
        let c = linked("c", Role::Decode, 1, 50);
        let p = linked("p", Role::Prefill, 0, 90);
        let cluster = cluster(&[&a, &b, &c, &p]);
        assert_eq!(picked(&cluster, Role::Decode, &[]), "c");
        set_draining(&c);
        assert_eq!(picked(&cluster, Role::Decode, &[]), "b");
        set_draining(&b);
        set_draining(&a);
        assert_eq!(
            picked(&cluster, Role::Decode, &[]),
            "",
            "every decode drains"
        );
        assert_eq!(picked(&cluster, Role::Prefill, &[]), "p");
    }

    /// `BREAKER_FAILURES` consecutive faults open a breaker: the worker is passed over while
    /// another can serve, and taken again when it is the only one; a success closes it.
    #[test]
    fn breaker_opens_after_consecutive_faults_and_never_strands_a_role() {
        let a = linked("a", Role::Decode, 0, 90);
        let b = linked("b", Role::Decode, 5, 10);
        let cluster = cluster(&[&a, &b]);
        for _ in 1..BREAKER_FAILURES {
            a.failed(TransportFault::TransferFailed);
        }
        assert_eq!(picked(&cluster, Role::Decode, &[]), "a", "not open yet");
        a.succeeded();
        for _ in 1..BREAKER_FAILURES {
            a.failed(TransportFault::LinkLost);
        }
        assert_eq!(
            picked(&cluster, Role::Decode, &[]),
            "a",
            "a success reset the count"
        );
        a.failed(TransportFault::LinkLost);
        assert!(a.gauges().breaker_open);
        assert_eq!(
            picked(&cluster, Role::Decode, &[]),
            "b",
            "open: passed over"
        );
        let (lost, transfer) = (BREAKER_FAILURES as u64, BREAKER_FAILURES as u64 - 1);
        assert_eq!(a.gauges().failures, [lost, transfer, 0, 0]);
        set_draining(&b);
        assert_eq!(
            picked(&cluster, Role::Decode, &[]),
            "a",
            "the last one is still taken"
        );
        a.succeeded();
        assert!(!a.gauges().breaker_open);
    }

    /// A retry avoids the workers its earlier tries failed on, unless none other is left.
    #[test]
    fn pick_avoids_what_a_retry_names_unless_nothing_else_is_left() {
        let a = linked("a", Role::Prefill, 0, 90);
        let b = linked("b", Role::Prefill, 4, 10);
        let cluster = cluster(&[&a, &b]);
        assert_eq!(
            picked(&cluster, Role::Prefill, std::slice::from_ref(&a)),
            "b"
        );
        assert_eq!(
            picked(&cluster, Role::Prefill, &[a.clone(), b.clone()]),
            "a"
        );
    }

    /// A worker whose link is down is never picked, breaker or not.
    #[test]
    fn an_unlinked_worker_is_never_picked() {
        let a = linked("a", Role::Unified, 0, 90);
        a.lock().link = None;
        let cluster = cluster(&[&a]);
        assert_eq!(picked(&cluster, Role::Unified, &[]), "");
    }
}
