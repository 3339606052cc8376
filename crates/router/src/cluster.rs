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
/// How often a `dns:` address is looked up again.
pub const DNS_INTERVAL: Duration = Duration::from_secs(5);
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
    /// No longer listed in DNS: given nothing new, not linked again.
    retired: bool,
    prefixes: PrefixMemory,
}

enum LinkFailure {
    Unreachable(std::io::Error),
    Refused(HandshakeError),
}

/// All workers, and the tasks that keep their links open and find workers in DNS.
pub struct Cluster {
    members: Arc<Members>,
    /// The roles configured, whether or not DNS has found any worker of them yet.
    roles: Vec<Role>,
    discovery: Vec<JoinHandle<()>>,
}

/// The workers linked or being linked, and what a new one's link needs.
pub(crate) struct Members {
    list: Mutex<Vec<Member>>,
    link: LinkParams,
}

struct Member {
    client: Arc<WorkerClient>,
    task: JoinHandle<()>,
    /// The DNS name (`dns:` address) that found it; `None` when named by a flag.
    found_by: Option<String>,
}

struct LinkParams {
    expect: Expectation,
    secret: ClusterSecret,
    transport: Arc<dyn Transport>,
    metrics: Arc<Metrics>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for task in &self.discovery {
            task.abort();
        }
        for member in self.members.lock().iter() {
            member.task.abort();
        }
    }
}

impl Members {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Member>> {
        self.list
            .lock()
            .expect("members lock is never held across a panic")
    }

    /// Starts linking a worker at `addr`.
    fn add(&self, list: &mut Vec<Member>, addr: String, role: Role, found_by: Option<String>) {
        let client = Arc::new(WorkerClient {
            addr,
            role,
            state: Mutex::new(ClientState::default()),
        });
        let task = {
            let client = client.clone();
            let transport = self.link.transport.clone();
            let expect = self.link.expect.clone();
            let secret = self.link.secret.clone();
            let metrics = self.link.metrics.clone();
            tokio::spawn(async move {
                client
                    .keep_linked(&*transport, &expect, &secret, &metrics)
                    .await
            })
        };
        list.push(Member {
            client,
            task,
            found_by,
        });
    }

    /// What a DNS lookup of `name` found: workers at new addresses are linked; those no
    /// longer listed are retired (nothing new goes to them, they are not linked again, and
    /// they leave once their link closes; one listed again before that is taken back).
    pub(crate) fn found(&self, name: &str, role: Role, addresses: &[String]) {
        let mut list = self.lock();
        list.retain(|member| !member.task.is_finished());
        for member in list.iter() {
            if member.found_by.as_deref() == Some(name) {
                let listed = addresses.contains(&member.client.addr);
                let was_retired = member.client.set_retired(!listed);
                if was_retired == listed {
                    tracing::info!(worker = %member.client.addr, dns = name, listed, "worker set changed");
                }
            }
        }
        for addr in addresses {
            let known = list
                .iter()
                .any(|m| m.found_by.as_deref() == Some(name) && m.client.addr == *addr);
            if !known {
                tracing::info!(worker = %addr, dns = name, "worker found in DNS; linking");
                self.add(&mut list, addr.clone(), role, Some(name.to_string()));
            }
        }
    }
}

impl Cluster {
    /// Starts a link-keeping task per worker. Every worker must prove it holds `secret` and
    /// match `expect` (model, weights, KV layout, context), or it is refused, counted in
    /// `airlock_workers_refused_total`, and never routed to (I8, I11). An address
    /// `dns:NAME:PORT` names every address NAME resolves to, looked up again every
    /// [`DNS_INTERVAL`] (a Kubernetes headless Service lists one per pod).
    pub fn connect(
        workers: Vec<(String, Role)>,
        expect: Expectation,
        secret: ClusterSecret,
        transport: Arc<dyn Transport>,
        metrics: Arc<Metrics>,
    ) -> Cluster {
        let dns = crate::discovery::Dns {
            resolver: Arc::new(crate::discovery::SystemResolver),
            interval: DNS_INTERVAL,
        };
        Cluster::connect_with_dns(workers, expect, secret, transport, metrics, dns)
    }

    /// [`Cluster::connect`] with `dns:` addresses resolved by `dns`.
    pub fn connect_with_dns(
        workers: Vec<(String, Role)>,
        expect: Expectation,
        secret: ClusterSecret,
        transport: Arc<dyn Transport>,
        metrics: Arc<Metrics>,
        dns: crate::discovery::Dns,
    ) -> Cluster {
        let members = Arc::new(Members {
            list: Mutex::new(Vec::new()),
            link: LinkParams {
                expect,
                secret,
                transport,
                metrics,
            },
        });
        let roles = workers.iter().map(|(_, role)| *role).collect();
        let mut discovery = Vec::new();
        {
            let mut list = members.lock();
            for (addr, role) in workers {
                match crate::discovery::dns_name(&addr) {
                    Some(name) => discovery.push(tokio::spawn(crate::discovery::discover(
                        name.to_string(),
                        role,
                        dns.clone(),
                        Arc::downgrade(&members),
                    ))),
                    None => members.add(&mut list, addr, role, None),
                }
            }
        }
        Cluster {
            members,
            roles,
            discovery,
        }
    }

    /// Every worker the router links or is linking (DNS-found ones included).
    pub fn clients(&self) -> Vec<Arc<WorkerClient>> {
        self.members
            .lock()
            .iter()
            .map(|member| member.client.clone())
            .collect()
    }

    /// Waits until every worker has a live link and every role configured has one (DNS
    /// may not have answered yet), or `timeout` passes.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let clients = self.clients();
            let every_role = self
                .roles
                .iter()
                .all(|role| clients.iter().any(|c| c.role == *role));
            if every_role && clients.iter().all(|c| c.info().is_some()) {
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
    ///
    /// With `prefix` (the chained digests of the request's full prompt pages, tenant and
    /// cache partition first), the pick is among the workers within [`AFFINITY_SLACK`] of
    /// the least loaded, the one that was sent the longest run of those pages before (so
    /// holds them in its prefix cache, most likely), and that worker remembers them. Load
    /// still spreads requests when that worker falls behind.
    pub fn pick(
        &self,
        role: Role,
        avoid: &[Arc<WorkerClient>],
        prefix: Option<&[u64]>,
    ) -> Option<Arc<WorkerClient>> {
        let picked = pick_from(&self.clients(), role, avoid, prefix)?;
        if let Some(digests) = prefix {
            picked.remember(digests);
        }
        Some(picked)
    }

    /// The page size the workers report (they all match: the handshake checks it).
    pub fn page_size(&self) -> Option<usize> {
        self.clients()
            .iter()
            .find_map(|c| c.info())
            .map(|info| info.page_size_tokens as usize)
    }

    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// The smallest (capacity in tokens, context length) over live workers of `role`.
    pub fn limits(&self, role: Role) -> Option<(u64, u32)> {
        self.clients()
            .iter()
            .filter(|c| c.role == role)
            .filter_map(|c| c.info())
            .map(|info| (info.capacity_tokens, info.context_length))
            .reduce(|a, b| (a.0.min(b.0), a.1.min(b.1)))
    }

    pub fn gauges(&self) -> Vec<PoolGauges> {
        self.clients().iter().map(|c| c.gauges()).collect()
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

    /// How many of `digests` (a prompt's chained page digests), from the first, this worker
    /// was sent before.
    fn pages_held(&self, digests: &[u64]) -> usize {
        let state = self.lock();
        digests
            .iter()
            .take_while(|d| state.prefixes.held.contains(d))
            .count()
    }

    /// Notes that this worker is sent the pages `digests` stand for.
    fn remember(&self, digests: &[u64]) {
        let mut state = self.lock();
        let memory = &mut state.prefixes;
        for &digest in digests {
            if memory.held.insert(digest) {
                memory.order.push_back(digest);
            }
        }
        while memory.order.len() > PREFIX_MEMORY_PAGES {
            if let Some(old) = memory.order.pop_front() {
                memory.held.remove(&old);
            }
        }
    }

    /// Marks the worker retired (or not); what it was before.
    fn set_retired(&self, retired: bool) -> bool {
        std::mem::replace(&mut self.lock().retired, retired)
    }

    /// What `Cluster::pick` weighs, or `None` when the link is down or the worker retired.
    fn load(&self, now: Instant) -> Option<Load> {
        let state = self.lock();
        state.link.as_ref()?;
        if state.retired {
            return None;
        }
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
        while !self.lock().retired {
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

/// [`Cluster::pick`] over `clients`.
fn pick_from(
    clients: &[Arc<WorkerClient>],
    role: Role,
    avoid: &[Arc<WorkerClient>],
    prefix: Option<&[u64]>,
) -> Option<Arc<WorkerClient>> {
    let now = Instant::now();
    let candidates: Vec<(Arc<WorkerClient>, Load)> = clients
        .iter()
        .filter(|c| c.role == role)
        .filter_map(|c| c.load(now).map(|load| (c.clone(), load)))
        .filter(|(_, load)| !load.draining)
        .collect();
    let best = |preferred: bool| {
        let eligible: Vec<&(Arc<WorkerClient>, Load)> = candidates
            .iter()
            .filter(|(c, load)| {
                !preferred || (!load.breaker_open && !avoid.iter().any(|a| Arc::ptr_eq(a, c)))
            })
            .collect();
        let least = eligible.iter().map(|(_, load)| load.busy).min()?;
        let by_load = |load: &Load| (load.busy, std::cmp::Reverse(load.pages_free));
        let chosen = match prefix {
            Some(digests) => eligible
                .iter()
                .filter(|(_, load)| load.busy <= least + AFFINITY_SLACK)
                .map(|(c, load)| (c, load, c.pages_held(digests)))
                .min_by_key(|(_, load, held)| (std::cmp::Reverse(*held), by_load(load)))
                .map(|(c, _, _)| c),
            None => eligible
                .iter()
                .min_by_key(|(_, load)| by_load(load))
                .map(|(c, _)| c),
        };
        chosen.cloned()
    };
    best(true).or_else(|| best(false))
}

/// How many more requests (in flight plus queued) than the least loaded worker a worker may
/// have and still be picked for holding a request's prefix.
pub const AFFINITY_SLACK: usize = 2;
/// Page digests each worker's prefix memory keeps (oldest forgotten first): 1M tokens of
/// 16-token pages, 512 KiB of digests.
const PREFIX_MEMORY_PAGES: usize = 65_536;

/// The pages a worker was sent, as chained digests: the router's guess of what its prefix
/// cache holds (the worker may have evicted some; a wrong guess costs only a recompute).
#[derive(Default)]
struct PrefixMemory {
    held: std::collections::HashSet<u64>,
    order: std::collections::VecDeque<u64>,
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

    fn cluster(clients: &[&Arc<WorkerClient>]) -> Vec<Arc<WorkerClient>> {
        clients.iter().map(|c| Arc::clone(c)).collect()
    }

    fn set_draining(client: &WorkerClient) {
        if let Some(Frame::PoolStats { draining, .. }) = &mut client.lock().stats {
            *draining = true;
        }
    }

    fn picked(clients: &[Arc<WorkerClient>], role: Role, avoid: &[Arc<WorkerClient>]) -> String {
        pick_from(clients, role, avoid, None)
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

    /// A prompt goes where its longest run of pages went before, while that worker is
    /// within the slack of the least loaded; past it, to the least loaded.
    #[test]
    fn a_prefix_goes_where_its_pages_went_within_the_slack() {
        let workers: Vec<Arc<WorkerClient>> = (0..3)
            .map(|i| linked(&format!("w{i}"), Role::Decode, 0, 90))
            .collect();
        let pick = |digests: &[u64]| {
            let picked = pick_from(&workers, Role::Decode, &[], Some(digests)).unwrap();
            picked.remember(digests);
            picked.addr.clone()
        };
        // w0 is picked first (ties go by load, then list order), then w1 for another prompt.
        workers[0].remember(&[1, 2, 3]);
        workers[1].remember(&[1, 9]);
        assert_eq!(pick(&[1, 2, 3, 4]), "w0", "three pages held");
        assert_eq!(pick(&[1, 9, 10]), "w1", "two pages held beat one");
        assert_eq!(pick(&[5, 6]), "w0", "nothing held: by load");
        let set_queue = |addr: &str, depth: u32| {
            let client = workers.iter().find(|c| c.addr == addr).unwrap();
            if let Some(Frame::PoolStats { queue_depth, .. }) = &mut client.lock().stats {
                *queue_depth = depth;
            }
        };
        set_queue("w0", AFFINITY_SLACK as u32);
        assert_eq!(pick(&[1, 2, 3, 4, 5]), "w0", "within the slack");
        set_queue("w0", AFFINITY_SLACK as u32 + 1);
        assert_eq!(
            pick(&[1, 2, 3, 4, 5]),
            "w1",
            "past the slack: the next best holder"
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
