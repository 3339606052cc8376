//! The worker loop: one OS thread that owns the model and the page pool, fed a closed set of
//! [`Event`]s from the network tasks, and answering with frames on the links it was given.
//!
//! Each turn it applies every pending event, admits queued requests while pages last, expires
//! what waited too long, then runs one batched forward step: one token for every decoding
//! request plus prompt chunks for prefilling ones, up to a token budget, so a long prompt is
//! cut into chunks and never stalls the running decodes (continuous batching).
//!
//! Page life cycle per role (pages are released on every path; I5, I9):
//! - unified: allocate prompt + max_tokens -> prefill -> decode -> release.
//! - prefill: allocate the prompt's KV -> prefill -> send pages + `Done` (pages `Sending`) ->
//!   release on the receiver's `Ack`, `Nack` or `AbortAck`, or when its link is gone.
//! - decode: reserve prompt + max_tokens (pages `Receiving`) -> accept page frames only for
//!   the reservation -> verify `Done` (header, counts, checksum over our pages; I4) -> seal ->
//!   decode -> release. Bytes land only through a live reservation, so dropping one (abort,
//!   timeout, reject) makes any late frame for it harmless.
//!
//! Both roles run the prompt's last token in the decode phase: prefill moves the KV of
//! `prompt[..n-1]`, and decode's first step feeds `prompt[n-1]` and samples from its logits,
//! so all sampling happens in one place and unified and disaggregated runs take the same path.

use crate::config::WorkerConfig;
use gguf::Tokenizer;
use kv::{Owner, PagePool, PageState, PageTable, RequestId};
use model::{Forward, Sampler, SamplingParams, SeqStep, StopMatcher};
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use transfer::{
    transfer_checksum, Failure, Finish, Frame, Inbound, Plan, Reject, Role, Submit, TransferDone,
    TransferId,
};

/// Names one link for the life of the process.
pub type LinkId = u64;

/// What is on the other end of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// A router that submits requests and receives their answers.
    Router,
    /// A prefill worker that connected to this decode worker to send pages.
    PrefillPeer,
    /// A decode worker this prefill worker connected to.
    DecodePeer,
}

/// Everything the engine reacts to.
pub enum Event {
    LinkUp {
        link: LinkId,
        kind: LinkKind,
        tx: UnboundedSender<Frame>,
    },
    LinkDown {
        link: LinkId,
    },
    Frame {
        link: LinkId,
        frame: Frame,
    },
    /// A `Submit` whose plan names a decode worker, with the link to it already open.
    SubmitToPeer {
        link: LinkId,
        submit: Submit,
        peer: LinkId,
    },
    /// A peer failed cluster authentication (counted, exported).
    AuthFailure,
    Shutdown,
}

/// A request is named by the router link it came on and the router's id for it.
type Key = (LinkId, RequestId);

struct Request {
    submit: Submit,
    /// Pool owner: the tenant, and a request id local to this worker (router ids are only
    /// unique per router).
    owner: Owner,
    table: Option<PageTable>,
    phase: Phase,
    arrived: Instant,
    /// Arrival order, for FIFO prefill scheduling.
    seq: u64,
    /// The decode worker's link (prefill plans only).
    peer: Option<LinkId>,
    /// The router has been told how this request ended (exactly one end, I6).
    reported: bool,
    /// Fault injection only (`incident`): the prompt was swapped for a one-token placeholder.
    placeholder: bool,
    decode: Option<DecodeState>,
}

enum Phase {
    /// Waiting for pages.
    Queued,
    /// `done` of `target` prompt tokens are in KV.
    Prefilling {
        done: usize,
        target: usize,
    },
    /// Decode: pages reserved, waiting for the transfer.
    Receiving {
        inbound: Inbound,
        /// The link the first frame came on; later frames must come on it too.
        sender: Option<LinkId>,
        /// When the reservation was made, then when the first frame came.
        since: Instant,
    },
    /// Prefill: pages sent, held until the receiver answers.
    Sending {
        transfer: TransferId,
        since: Instant,
        abort_sent: bool,
        quarantined: bool,
    },
    Decoding,
}

struct DecodeState {
    sampler: Sampler,
    stops: StopMatcher,
    pending_bytes: Vec<u8>,
    generated: Vec<u32>,
    /// The token the next step feeds, and its position.
    next_input: u32,
    position: usize,
}

struct LinkEntry {
    kind: LinkKind,
    tx: UnboundedSender<Frame>,
}

#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct Stats {
    pages_free: usize,
    pages_quarantined: usize,
    queue_depth: usize,
    ownership_failures: u64,
    frames_rejected: u64,
    auth_failures: u64,
}

/// The worker's state; see the module docs.
pub struct Engine {
    config: WorkerConfig,
    model: Box<dyn Forward>,
    tokenizer: Tokenizer,
    pool: PagePool,
    links: HashMap<LinkId, LinkEntry>,
    requests: HashMap<Key, Request>,
    queue: VecDeque<Key>,
    inbound: HashMap<TransferId, Key>,
    outbound: HashMap<TransferId, Key>,
    next_seq: u64,
    ownership_failures: u64,
    frames_rejected: u64,
    auth_failures: u64,
    last_stats: Option<Stats>,
}

/// How long an idle engine sleeps between timeout checks.
const IDLE_TICK: Duration = Duration::from_millis(50);

impl Engine {
    pub fn new(
        config: WorkerConfig,
        model: Box<dyn Forward>,
        tokenizer: Tokenizer,
        #[allow(unused_mut)] mut pool: PagePool,
    ) -> Engine {
        #[cfg(feature = "fault-injection")]
        pool.set_owner_check_for_test(config.faults.owner_checked());
        Engine {
            config,
            model,
            tokenizer,
            pool,
            links: HashMap::new(),
            requests: HashMap::new(),
            queue: VecDeque::new(),
            inbound: HashMap::new(),
            outbound: HashMap::new(),
            next_seq: 0,
            ownership_failures: 0,
            frames_rejected: 0,
            auth_failures: 0,
            last_stats: None,
        }
    }

    /// Runs until `Shutdown` or until every event sender is gone.
    pub fn run(mut self, events: mpsc::Receiver<Event>) {
        loop {
            let first = if self.has_runnable_work() {
                match events.try_recv() {
                    Ok(event) => Some(event),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            } else {
                match events.recv_timeout(IDLE_TICK) {
                    Ok(event) => Some(event),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            };
            let mut next = first;
            while let Some(event) = next {
                if matches!(event, Event::Shutdown) {
                    return;
                }
                self.handle(event);
                next = events.try_recv().ok();
            }
            self.admit_queued();
            self.expire(Instant::now());
            self.step();
            self.publish_stats();
        }
    }

    fn has_runnable_work(&self) -> bool {
        self.requests
            .values()
            .any(|r| matches!(r.phase, Phase::Prefilling { .. } | Phase::Decoding))
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::LinkUp { link, kind, tx } => {
                self.links.insert(link, LinkEntry { kind, tx });
                self.last_stats = None;
            }
            Event::LinkDown { link } => self.link_down(link),
            Event::Frame { link, frame } => self.frame(link, frame),
            Event::SubmitToPeer { link, submit, peer } => self.submit(link, submit, Some(peer)),
            Event::AuthFailure => self.auth_failures += 1,
            Event::Shutdown => {}
        }
    }

    fn frame(&mut self, link: LinkId, frame: Frame) {
        let kind = match self.links.get(&link) {
            Some(entry) => entry.kind,
            None => return,
        };
        match (kind, frame) {
            (LinkKind::Router, Frame::Submit(submit)) => self.submit(link, submit, None),
            (LinkKind::Router, Frame::Abort { request }) => self.abort((link, request)),
            (
                LinkKind::PrefillPeer,
                Frame::Page {
                    transfer,
                    request,
                    tenant,
                    index,
                    bytes,
                },
            ) => self.page(link, transfer, request, tenant, index, &bytes),
            (LinkKind::PrefillPeer, Frame::Done(done)) => self.done(link, done),
            (LinkKind::PrefillPeer, Frame::TransferAbort { transfer, .. }) => {
                self.transfer_aborted(link, transfer)
            }
            (LinkKind::DecodePeer, Frame::Ack { transfer }) => self.sent(link, transfer, None),
            (LinkKind::DecodePeer, Frame::Nack { transfer, reject }) => {
                self.sent(link, transfer, Some(reject))
            }
            (LinkKind::DecodePeer, Frame::AbortAck { transfer }) => self.sent(link, transfer, None),
            (kind, frame) => {
                tracing::warn!(
                    ?kind,
                    frame = frame_name(&frame),
                    "unexpected frame dropped"
                );
                self.frames_rejected += 1;
            }
        }
    }

    // ---- Admission -------------------------------------------------------------------

    /// Admission (I3), re-checked here whatever the router decided: a request that can never
    /// fit is refused before any page is allocated.
    fn submit(&mut self, link: LinkId, submit: Submit, peer: Option<LinkId>) {
        let key = (link, submit.request);
        if let Err((failure, message)) = self.admissible(&submit) {
            self.send(link, failed(submit.request, failure, message));
            return;
        }
        let transfer_taken = plan_transfer(&submit.plan).is_some_and(|t| {
            self.inbound.contains_key(&t)
                || self.outbound.contains_key(&t)
                || self
                    .requests
                    .values()
                    .any(|r| plan_transfer(&r.submit.plan) == Some(t))
        });
        if self.requests.contains_key(&key) || transfer_taken {
            let message = format!(
                "request {} (or its transfer) is already running",
                submit.request.0
            );
            self.send(link, failed(submit.request, Failure::BadRequest, message));
            return;
        }
        if self.queue.len() >= self.config.queue_max {
            let message = format!(
                "worker {} has {} requests waiting for KV pages; retry later",
                self.config.name,
                self.queue.len()
            );
            self.send(link, failed(submit.request, Failure::Overloaded, message));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let owner = Owner {
            tenant: submit.tenant,
            request: RequestId(seq),
        };
        self.requests.insert(
            key,
            Request {
                submit,
                owner,
                table: None,
                phase: Phase::Queued,
                arrived: Instant::now(),
                seq,
                peer,
                reported: false,
                placeholder: false,
                decode: None,
            },
        );
        self.queue.push_back(key);
        self.admit_queued();
    }

    fn admissible(&self, submit: &Submit) -> Result<(), (Failure, String)> {
        let prompt_tokens = submit.prompt.len();
        if prompt_tokens == 0 {
            return Err((Failure::BadRequest, "the prompt is empty".into()));
        }
        let vocab = self.tokenizer.vocab_size();
        if let Some(&token) = submit.prompt.iter().find(|&&t| t as usize >= vocab) {
            let message = format!("prompt token {token} is outside the vocabulary of {vocab}");
            return Err((Failure::BadRequest, message));
        }
        if submit.max_tokens == 0 {
            return Err((Failure::BadRequest, "max_tokens must be at least 1".into()));
        }
        let plan_ok = matches!(
            (&submit.plan, self.config.role),
            (Plan::Unified, Role::Unified)
                | (Plan::Prefill { .. }, Role::Prefill)
                | (Plan::Decode { .. }, Role::Decode)
        );
        if !plan_ok {
            let message = format!("a {:?} worker cannot run this plan", self.config.role);
            return Err((Failure::BadRequest, message));
        }
        let max_tokens = submit.max_tokens as usize;
        let total = prompt_tokens + max_tokens;
        let context_length = self.config.context_length;
        if total > context_length {
            let message = format!(
                "this request needs {total} tokens ({prompt_tokens} in the prompt + \
                 {max_tokens} max_tokens), over the context length of {context_length}; \
                 shorten the prompt or lower max_tokens"
            );
            return Err((Failure::ContextLengthExceeded, message));
        }
        let needed = self.tokens_needed(submit);
        let capacity = self.pool.capacity_tokens();
        if needed > capacity && self.config.faults.admission_checked() {
            let message = format!(
                "this request needs {needed} tokens of KV on worker {}, whose whole pool \
                 holds {capacity}; shorten the prompt or lower max_tokens",
                self.config.name
            );
            return Err((Failure::PoolTooSmall, message));
        }
        Ok(())
    }

    /// KV tokens this worker holds for the request.
    fn tokens_needed(&self, submit: &Submit) -> usize {
        match submit.plan {
            Plan::Prefill { .. } => submit.prompt.len() - 1,
            Plan::Unified | Plan::Decode { .. } => submit.prompt.len() + submit.max_tokens as usize,
        }
    }

    /// Gives pages to queued requests in arrival order; the first that does not fit waits
    /// (and so do those behind it: a big request is not starved by small ones).
    fn admit_queued(&mut self) {
        while let Some(&key) = self.queue.front() {
            let request = self
                .requests
                .get(&key)
                .expect("queued keys are live requests");
            let mut needed = self.tokens_needed(&request.submit);
            let is_prefill = matches!(request.submit.plan, Plan::Prefill { .. });
            let placeholder =
                is_prefill && needed > self.pool.capacity_tokens() && self.config.faults.incident();
            if placeholder {
                // The incident, planted: the prompt can never fit, so run a one-token
                // placeholder and let `Done` claim the whole prompt.
                needed = 1;
            }
            let owner = request.owner;
            let table = match self.pool.allocate(owner, needed) {
                Ok(table) => table,
                Err(kv::Error::OutOfPages { .. }) => return,
                Err(error) => panic!("allocation fails only for want of pages: {error}"),
            };
            self.queue.pop_front();
            if placeholder {
                tracing::warn!("fault injection: incident placeholder for a prompt over the pool");
                self.requests
                    .get_mut(&key)
                    .expect("queued keys are live")
                    .placeholder = true;
            }
            self.start(key, table);
        }
    }

    fn start(&mut self, key: Key, table: PageTable) {
        let page_size = self.pool.layout().page_size_tokens as u32;
        let page_bytes = self.pool.layout().page_bytes();
        let request = self.requests.get_mut(&key).expect("started keys are live");
        let prompt_tokens = request.submit.prompt.len();
        match request.submit.plan {
            Plan::Unified | Plan::Prefill { .. } => {
                let target = if request.placeholder {
                    1.min(prompt_tokens - 1)
                } else {
                    prompt_tokens - 1
                };
                request.phase = Phase::Prefilling { done: 0, target };
            }
            Plan::Decode { transfer } => {
                self.pool
                    .set_state(&table, PageState::Receiving)
                    .expect("fresh pages go Writing -> Receiving");
                let inbound = Inbound::new(
                    transfer,
                    request.submit.request,
                    request.submit.tenant,
                    (prompt_tokens - 1) as u32,
                    page_size,
                    page_bytes,
                );
                request.phase = Phase::Receiving {
                    inbound,
                    sender: None,
                    since: Instant::now(),
                };
                self.inbound.insert(transfer, key);
            }
        }
        request.table = Some(table);
        let request_id = key.1;
        self.send(
            key.0,
            Frame::Admitted {
                request: request_id,
            },
        );
        if matches!(
            self.requests[&key].phase,
            Phase::Prefilling { target: 0, .. }
        ) {
            self.prefilled(key);
        }
    }

    // ---- The forward step ----------------------------------------------------------------

    fn step(&mut self) {
        let mut decoding: Vec<(u64, Key)> = Vec::new();
        let mut prefilling: Vec<(u64, Key)> = Vec::new();
        for (key, request) in &self.requests {
            match request.phase {
                Phase::Decoding => decoding.push((request.seq, *key)),
                Phase::Prefilling { .. } => prefilling.push((request.seq, *key)),
                _ => {}
            }
        }
        if decoding.is_empty() && prefilling.is_empty() {
            return;
        }
        decoding.sort_unstable();
        prefilling.sort_unstable();
        decoding.truncate(self.config.max_batch);
        let mut budget = self
            .config
            .step_tokens
            .saturating_sub(decoding.len())
            .max(1);
        // (key, first prompt token, token count) for each prefill row.
        let mut chunks: Vec<(Key, usize, usize)> = Vec::new();
        for &(_, key) in &prefilling {
            if budget == 0 {
                break;
            }
            if let Phase::Prefilling { done, target } = self.requests[&key].phase {
                let count = (target - done).min(budget);
                budget -= count;
                chunks.push((key, done, count));
            }
        }
        if let Some(delay) = self.config.faults.step_delay() {
            std::thread::sleep(delay);
        }
        let Engine {
            model,
            pool,
            requests,
            ..
        } = self;
        let mut steps = Vec::with_capacity(decoding.len() + chunks.len());
        for &(_, key) in &decoding {
            let request = &requests[&key];
            let state = request
                .decode
                .as_ref()
                .expect("decoding requests have state");
            steps.push(SeqStep {
                table: request
                    .table
                    .as_ref()
                    .expect("decoding requests hold pages"),
                tokens: std::slice::from_ref(&state.next_input),
                start_pos: state.position,
                want_logits: true,
            });
        }
        for &(key, start, count) in &chunks {
            let request = &requests[&key];
            steps.push(SeqStep {
                table: request
                    .table
                    .as_ref()
                    .expect("prefilling requests hold pages"),
                tokens: &request.submit.prompt[start..start + count],
                start_pos: start,
                want_logits: false,
            });
        }
        let result = model.forward(pool, &steps);
        drop(steps);
        let logits = match result {
            Ok(logits) => logits,
            Err(error) => {
                self.step_failed(&error, decoding.iter().map(|&(_, k)| k), &chunks);
                return;
            }
        };
        for (&(_, key), logits) in decoding.iter().zip(&logits) {
            self.sampled(key, logits);
        }
        for &(key, _, count) in &chunks {
            let request = self.requests.get_mut(&key).expect("batched keys are live");
            if let Phase::Prefilling { done, target } = &mut request.phase {
                *done += count;
                if *done == *target {
                    self.prefilled(key);
                }
            }
        }
    }

    /// A step refused to run: a page check failed (a bug in this worker, or a fault planted
    /// in a test; counted and exported) or the model refused the batch. The checks run before
    /// any K/V is touched, so nothing was written. The requests whose own pages no longer
    /// verify fail; the others run again next step. If none can be singled out, all fail:
    /// none is answered from what the step might have read.
    fn step_failed(
        &mut self,
        error: &model::Error,
        decoding: impl Iterator<Item = Key>,
        chunks: &[(Key, usize, usize)],
    ) {
        if matches!(error, model::Error::Kv(_)) {
            self.ownership_failures += 1;
        }
        tracing::error!(%error, "forward step refused; failing the requests it concerns");
        let keys: Vec<Key> = decoding.chain(chunks.iter().map(|c| c.0)).collect();
        let unverified: Vec<Key> = keys
            .iter()
            .copied()
            .filter(|key| {
                let table = self.requests[key].table.as_ref();
                table.is_none_or(|table| self.pool.verify_batch(&[table]).is_err())
            })
            .collect();
        let failing = if unverified.is_empty() {
            keys
        } else {
            unverified
        };
        for key in failing {
            self.end(
                key,
                Err((Failure::Internal, "the worker refused a step".into())),
            );
        }
    }

    fn prefilled(&mut self, key: Key) {
        let request = self
            .requests
            .get_mut(&key)
            .expect("prefilled keys are live");
        match request.submit.plan.clone() {
            Plan::Unified => {
                request.phase = Phase::Decoding;
                request.decode = Some(decode_state(&request.submit));
                self.send(key.0, Frame::Started { request: key.1 });
            }
            Plan::Prefill { transfer, .. } => self.send_pages(key, transfer),
            Plan::Decode { .. } => unreachable!("decode plans receive, they never prefill"),
        }
    }

    fn sampled(&mut self, key: Key, logits: &[f32]) {
        let eos = self.tokenizer.eos_id();
        let request = self.requests.get_mut(&key).expect("sampled keys are live");
        let state = request
            .decode
            .as_mut()
            .expect("decoding requests have state");
        let token = state.sampler.sample(logits);
        if token == eos && !request.submit.ignore_eos {
            self.finish(key, Finish::Stop);
            return;
        }
        state.generated.push(token);
        state
            .pending_bytes
            .extend_from_slice(self.tokenizer.token_bytes(token));
        let text = model::take_complete_utf8(&mut state.pending_bytes);
        let (shown, stopped) = state.stops.push(&text);
        let at_max_tokens = state.generated.len() == request.submit.max_tokens as usize;
        state.next_input = token;
        state.position += 1;
        if !shown.is_empty() {
            self.send(key.0, text_frame(key.1, shown));
        }
        if stopped {
            self.finish(key, Finish::Stop);
        } else if at_max_tokens {
            self.finish(key, Finish::Length);
        }
    }

    fn finish(&mut self, key: Key, finish: Finish) {
        let request = self.requests.get_mut(&key).expect("finished keys are live");
        let state = request.decode.as_mut().expect("finishing requests decoded");
        let mut tail = String::new();
        if !state.pending_bytes.is_empty() {
            let rest = String::from_utf8_lossy(&state.pending_bytes).into_owned();
            state.pending_bytes.clear();
            tail.push_str(&state.stops.push(&rest).0);
        }
        tail.push_str(&state.stops.finish());
        let frame = Frame::Finished {
            request: key.1,
            finish,
            prompt_tokens: request.submit.prompt.len() as u32,
            completion_tokens: state.generated.len() as u32,
        };
        if !tail.is_empty() {
            self.send(key.0, text_frame(key.1, tail));
        }
        self.end(key, Ok(frame));
    }

    // ---- Sending (prefill) -----------------------------------------------------------------

    fn send_pages(&mut self, key: Key, transfer: TransferId) {
        let request = self.requests.get_mut(&key).expect("sending keys are live");
        let table = request
            .table
            .as_ref()
            .expect("prefilled requests hold pages");
        let peer = request.peer.and_then(|peer| self.links.get(&peer));
        let Some(peer) = peer else {
            let message = "the link to the decode worker is gone".to_string();
            self.end(key, Err((Failure::PeerUnavailable, message)));
            return;
        };
        let token_count = (request.submit.prompt.len() - 1) as u32;
        let mut page_count = table.pages().len() as u32;
        if request.placeholder {
            // The incident's lie: "complete", with the counts of the prompt it never ran.
            page_count = self.pool.layout().pages_for_tokens(token_count as usize) as u32;
        }
        let mut done = TransferDone {
            transfer,
            request: key.1,
            tenant: request.submit.tenant,
            page_count,
            token_count,
            checksum: 0,
        };
        // Sealed: prefill wrote its last K/V; nothing writes these pages again.
        self.pool
            .set_state(table, PageState::Sealed)
            .expect("prefilled pages go Writing -> Sealed");
        let mut views = self
            .pool
            .verify_batch(&[table])
            .expect("a request's own pages verify");
        let view = views.pop().expect("one view per table");
        let mut pages: Vec<Vec<u8>> = (0..view.page_len())
            .map(|i| bytemuck::cast_slice::<_, u8>(view.page(i)).to_vec())
            .collect();
        if let Some(last) = pages.last_mut().filter(|_| !request.placeholder) {
            blank_unwritten_slots(last, view.layout(), token_count as usize);
        }
        if !cfg!(feature = "unguarded-checksum") {
            done.checksum = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
        }
        let mut frames: Vec<Frame> = pages
            .into_iter()
            .enumerate()
            .map(|(index, bytes)| Frame::Page {
                transfer,
                request: key.1,
                tenant: done.tenant,
                index: index as u32,
                bytes,
            })
            .collect();
        frames.push(Frame::Done(done));
        let outgoing = self.config.faults.shape_transfer(frames);
        for (sent, frame) in outgoing.frames.into_iter().enumerate() {
            if outgoing.crash_after == Some(sent) {
                crate::faults::crash("mid-transfer");
            }
            match (frame, outgoing.delay_done) {
                (frame @ Frame::Done(_), Some(delay)) => send_later(peer.tx.clone(), frame, delay),
                (frame, _) => {
                    let _ = peer.tx.send(frame);
                }
            }
        }
        drop(views);
        self.pool
            .set_state(table, PageState::Sending)
            .expect("sealed pages go Sealed -> Sending");
        request.phase = Phase::Sending {
            transfer,
            since: Instant::now(),
            abort_sent: false,
            quarantined: false,
        };
        self.outbound.insert(transfer, key);
        if cfg!(feature = "unguarded-deferred-release") {
            // Benchmark builds only: free the pages now instead of on the receiver's answer.
            self.end(key, Ok(Frame::Ack { transfer }));
        }
    }

    /// The receiver answered (or can no longer touch our pages): release them.
    fn sent(&mut self, link: LinkId, transfer: TransferId, reject: Option<Reject>) {
        let Some(&key) = self.outbound.get(&transfer) else {
            return;
        };
        // Only the decode worker the pages went to may release them.
        if self.requests.get(&key).and_then(|r| r.peer) != Some(link) {
            self.frames_rejected += 1;
            return;
        }
        self.outbound.remove(&transfer);
        match reject {
            None => self.end(key, Ok(Frame::Ack { transfer })),
            Some(reject) => {
                let message = format!("the decode worker refused the transfer: {reject:?}");
                self.end(key, Err((Failure::TransferFailed, message)));
            }
        }
    }

    // ---- Receiving (decode) ----------------------------------------------------------------

    fn receiving(&mut self, link: LinkId, transfer: TransferId) -> Option<Key> {
        let key = *self.inbound.get(&transfer)?;
        let request = self.requests.get_mut(&key).expect("reserved keys are live");
        let Phase::Receiving { sender, since, .. } = &mut request.phase else {
            return None;
        };
        match sender {
            None => {
                // The transfer's own clock starts at its first frame: until then the prefill
                // may have been queued for pages or running a long prompt.
                *sender = Some(link);
                *since = Instant::now();
            }
            Some(first) if *first != link => return None,
            Some(_) => {}
        }
        Some(key)
    }

    fn page(
        &mut self,
        link: LinkId,
        transfer: TransferId,
        request: RequestId,
        tenant: kv::TenantId,
        index: u32,
        bytes: &[u8],
    ) {
        let Some(key) = self.receiving(link, transfer) else {
            self.frames_rejected += 1;
            return;
        };
        let entry = self.requests.get_mut(&key).expect("reserved keys are live");
        let Phase::Receiving { inbound, .. } = &mut entry.phase else {
            unreachable!("receiving() checked the phase");
        };
        match inbound.accept_page(request, tenant, index, bytes.len()) {
            Ok(index) => {
                if self.config.faults.crash_on_page(index) {
                    crate::faults::crash("on a transfer's page");
                }
                let table = entry.table.as_ref().expect("reservations hold pages");
                let mut view = self
                    .pool
                    .verify_receiving(table)
                    .expect("a reservation's own pages verify");
                let page: &mut [u8] = bytemuck::cast_slice_mut(view.page_mut(index));
                page.copy_from_slice(bytes);
            }
            Err(reject) => self.reject(link, key, transfer, reject),
        }
    }

    fn done(&mut self, link: LinkId, done: TransferDone) {
        let Some(key) = self.receiving(link, done.transfer) else {
            self.frames_rejected += 1;
            self.send(
                link,
                Frame::Nack {
                    transfer: done.transfer,
                    reject: Reject::UnknownTransfer,
                },
            );
            return;
        };
        let request = self.requests.get_mut(&key).expect("reserved keys are live");
        let Phase::Receiving { inbound, .. } = &request.phase else {
            unreachable!("receiving() checked the phase");
        };
        let table = request.table.as_ref().expect("reservations hold pages");
        let verified = self.config.faults.transfer_verified();
        let verdict = inbound.check_done(&done).or_else(|reject| {
            // Fault injection only: the guard is off, so the sender's word is taken.
            if verified {
                Err(reject)
            } else {
                Ok(())
            }
        });
        let verdict = verdict.and_then(|()| {
            let view = self
                .pool
                .verify_receiving(table)
                .expect("a reservation's own pages verify");
            let pages = (0..done.page_count as usize).map(|i| bytemuck::cast_slice(view.page(i)));
            if cfg!(feature = "unguarded-checksum") || !verified {
                return Ok(());
            }
            inbound.verify_checksum(&done, transfer_checksum(&done, pages))
        });
        if let Err(reject) = verdict {
            self.reject(link, key, done.transfer, reject);
            return;
        }
        // I4: only now may decode read these pages.
        self.pool
            .set_state(table, PageState::Sealed)
            .expect("verified pages go Receiving -> Sealed");
        let written = (done.token_count as usize).min(table.capacity_tokens(self.pool.layout()));
        self.pool
            .verify_batch(&[table])
            .expect("sealed pages verify")[0]
            .mark_written(written);
        if self.config.faults.recycle_early() {
            // Fault injection only: free the pages while the request still decodes from them.
            tracing::warn!("fault injection: pages recycled early");
            let _ = self.pool.release(table.clone());
        }
        self.inbound.remove(&done.transfer);
        request.phase = Phase::Decoding;
        request.decode = Some(decode_state(&request.submit));
        self.answer(
            link,
            Frame::Ack {
                transfer: done.transfer,
            },
        );
        self.send(key.0, Frame::Started { request: key.1 });
    }

    fn reject(&mut self, link: LinkId, key: Key, transfer: TransferId, reject: Reject) {
        self.frames_rejected += 1;
        tracing::warn!(transfer = transfer.0, ?reject, "transfer refused");
        self.answer(link, Frame::Nack { transfer, reject });
        let message = format!("the KV transfer failed verification ({reject:?})");
        self.end(key, Err((Failure::TransferFailed, message)));
    }

    fn transfer_aborted(&mut self, link: LinkId, transfer: TransferId) {
        if let Some(key) = self.receiving(link, transfer) {
            let message = "the prefill worker aborted the transfer".to_string();
            self.end(key, Err((Failure::Aborted, message)));
        }
        self.answer(link, Frame::AbortAck { transfer });
    }

    // ---- Aborts, timeouts, lost links ------------------------------------------------------

    fn abort(&mut self, key: Key) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        if let Phase::Sending {
            transfer,
            abort_sent,
            ..
        } = &mut request.phase
        {
            // Pages stay until the receiver answers (I5).
            if !*abort_sent {
                *abort_sent = true;
                let frame = Frame::TransferAbort {
                    transfer: *transfer,
                    request: key.1,
                };
                let peer = request.peer.expect("sending requests have a peer");
                self.send(peer, frame);
            }
            return;
        }
        self.end(
            key,
            Err((Failure::Aborted, "the request was cancelled".into())),
        );
    }

    fn expire(&mut self, now: Instant) {
        let queue_timeout = self.config.queue_timeout;
        let transfer_timeout = self.config.transfer_timeout;
        let mut expired = Vec::new();
        for (key, request) in &self.requests {
            match &request.phase {
                Phase::Queued if now - request.arrived > queue_timeout => {
                    expired.push((*key, Failure::QueueTimeout))
                }
                // Until the first frame arrives, the prefill may still be queued for pages.
                Phase::Receiving { since, sender, .. }
                    if now - *since
                        > match sender {
                            None => queue_timeout + transfer_timeout,
                            Some(_) => transfer_timeout,
                        } =>
                {
                    expired.push((*key, Failure::TransferTimeout))
                }
                Phase::Sending {
                    since,
                    quarantined: false,
                    ..
                } if now - *since > transfer_timeout => {
                    expired.push((*key, Failure::TransferTimeout))
                }
                _ => {}
            }
        }
        for (key, failure) in expired {
            let waited = match failure {
                Failure::QueueTimeout => queue_timeout,
                _ => transfer_timeout,
            };
            let message = format!("{failure:?} after {waited:?}; retry later");
            let request = self.requests.get_mut(&key).expect("expired keys are live");
            if let Phase::Sending { quarantined, .. } = &mut request.phase {
                // The receiver may still be reading what we sent: the pages are neither freed
                // nor readable until it answers or its link is gone.
                *quarantined = true;
                let table = request.table.as_ref().expect("sending requests hold pages");
                self.pool
                    .set_state(table, PageState::Quarantined)
                    .expect("Sending -> Quarantined");
                self.report(key, Err((failure, message)));
                continue;
            }
            self.end(key, Err((failure, message)));
        }
    }

    fn link_down(&mut self, link: LinkId) {
        let Some(entry) = self.links.remove(&link) else {
            return;
        };
        let affected: Vec<Key> = self
            .requests
            .iter()
            .filter(|(key, request)| match entry.kind {
                LinkKind::Router => key.0 == link,
                LinkKind::DecodePeer => request.peer == Some(link),
                LinkKind::PrefillPeer => {
                    matches!(request.phase, Phase::Receiving { sender: Some(s), .. } if s == link)
                }
            })
            .map(|(key, _)| *key)
            .collect();
        for key in affected {
            let sending = matches!(self.requests[&key].phase, Phase::Sending { .. });
            if entry.kind == LinkKind::Router && sending {
                // The decode side may still be reading what we sent: abort through the
                // protocol and keep the pages until it answers (I5).
                self.abort(key);
                continue;
            }
            let message = match entry.kind {
                LinkKind::Router => "the router went away",
                LinkKind::DecodePeer => "the link to the decode worker was lost",
                LinkKind::PrefillPeer => "the link to the prefill worker was lost",
            };
            let failure = match entry.kind {
                LinkKind::Router => Failure::Aborted,
                _ => Failure::PeerUnavailable,
            };
            // A lost link can no longer touch our pages: nothing arrives from it any more and
            // nothing it held of ours is read again, so release is safe (I5).
            self.end(key, Err((failure, message.to_string())));
        }
    }

    /// Ends a request: tells the router (once), releases its pages, forgets it.
    fn end(&mut self, key: Key, outcome: Result<Frame, (Failure, String)>) {
        self.report(key, outcome);
        let Some(request) = self.requests.remove(&key) else {
            return;
        };
        self.queue.retain(|queued| *queued != key);
        match &request.phase {
            Phase::Receiving { inbound, .. } => {
                self.inbound.remove(&inbound.transfer);
            }
            Phase::Sending { transfer, .. } => {
                self.outbound.remove(transfer);
            }
            _ => {}
        }
        if let Some(table) = request.table {
            // A table that no longer verifies frees nothing: its pages are someone else's now,
            // and that is a bug worth counting, not a reason to free them again.
            if let Err(error) = self.pool.release(table) {
                self.ownership_failures += 1;
                tracing::error!(%error, "a request's pages did not verify at release");
            }
        }
    }

    fn report(&mut self, key: Key, outcome: Result<Frame, (Failure, String)>) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        if request.reported {
            return;
        }
        let frame = match outcome {
            // An Ack ends a prefill's part: the router hears the outcome from decode.
            Ok(Frame::Ack { .. }) => return,
            Ok(frame) => frame,
            Err((failure, message)) => failed(key.1, failure, message),
        };
        request.reported = true;
        self.send(key.0, frame);
    }

    // ---- Output --------------------------------------------------------------------------

    /// Decode's answer to a sender (`Ack`, `Nack`, `AbortAck`): what frees its pages.
    fn answer(&mut self, link: LinkId, frame: Frame) {
        match (self.config.faults.answer_delay(), self.links.get(&link)) {
            (Some(delay), Some(entry)) => send_later(entry.tx.clone(), frame, delay),
            _ => self.send(link, frame),
        }
    }

    fn send(&self, link: LinkId, frame: Frame) {
        if let Some(entry) = self.links.get(&link) {
            let _ = entry.tx.send(frame);
        }
    }

    fn publish_stats(&mut self) {
        let stats = Stats {
            pages_free: self.pool.pages_free(),
            pages_quarantined: self.pool.pages_in_state(PageState::Quarantined),
            queue_depth: self.queue.len(),
            ownership_failures: self.ownership_failures,
            frames_rejected: self.frames_rejected,
            auth_failures: self.auth_failures,
        };
        if self.last_stats == Some(stats) {
            return;
        }
        self.last_stats = Some(stats);
        let frame = Frame::PoolStats {
            pages_free: stats.pages_free as u32,
            pages_total: self.pool.page_count() as u32,
            pages_quarantined: stats.pages_quarantined as u32,
            queue_depth: stats.queue_depth as u32,
            ownership_failures: stats.ownership_failures,
            frames_rejected: stats.frames_rejected,
            auth_failures: stats.auth_failures,
        };
        for entry in self.links.values() {
            if entry.kind == LinkKind::Router {
                let _ = entry.tx.send(frame.clone());
            }
        }
    }
}

/// Zeroes the slots of the last page past the `token_count` tokens a transfer carries: pages
/// are reused without zeroing, so those slots may hold an earlier owner's K/V, which must not
/// leave this worker under another tenant's name (decode would never read them, but the bytes
/// would still cross the network).
fn blank_unwritten_slots(page: &mut [u8], layout: &kv::KvLayout, token_count: usize) {
    let used = token_count % layout.page_size_tokens;
    if used == 0 {
        return;
    }
    let slot_bytes = layout.head_dim * 2;
    for layer in 0..layout.layer_count {
        for kind in [kv::KvKind::Key, kv::KvKind::Value] {
            for kv_head in 0..layout.kv_head_count {
                let start = layout.head_offset(layer, kind, kv_head) * 2;
                let end = start + layout.page_size_tokens * slot_bytes;
                page[start + used * slot_bytes..end].fill(0);
            }
        }
    }
}

/// Sends `frame` after `delay` from a thread of its own (fault injection only: in a default
/// build no delay is ever asked for).
fn send_later(tx: UnboundedSender<Frame>, frame: Frame, delay: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let _ = tx.send(frame);
    });
}

fn plan_transfer(plan: &Plan) -> Option<TransferId> {
    match plan {
        Plan::Prefill { transfer, .. } | Plan::Decode { transfer } => Some(*transfer),
        Plan::Unified => None,
    }
}

fn decode_state(submit: &Submit) -> DecodeState {
    let sampling = SamplingParams {
        temperature: submit.sampling.temperature,
        top_k: submit.sampling.top_k as usize,
        top_p: submit.sampling.top_p,
        seed: submit.sampling.seed,
    };
    let prompt_tokens = submit.prompt.len();
    DecodeState {
        sampler: Sampler::new(sampling),
        stops: StopMatcher::new(&submit.stop),
        pending_bytes: Vec::new(),
        generated: Vec::new(),
        next_input: submit.prompt[prompt_tokens - 1],
        position: prompt_tokens - 1,
    }
}

fn failed(request: RequestId, failure: Failure, message: String) -> Frame {
    Frame::Failed {
        request,
        failure,
        message,
    }
}

fn text_frame(request: RequestId, text: String) -> Frame {
    Frame::Text {
        request,
        text,
        token_count: 1,
    }
}

fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Connect { .. } => "Connect",
        Frame::Challenge { .. } => "Challenge",
        Frame::Proof { .. } => "Proof",
        Frame::Hello(_) => "Hello",
        Frame::Submit(_) => "Submit",
        Frame::Abort { .. } => "Abort",
        Frame::Admitted { .. } => "Admitted",
        Frame::Started { .. } => "Started",
        Frame::Text { .. } => "Text",
        Frame::Finished { .. } => "Finished",
        Frame::Failed { .. } => "Failed",
        Frame::PoolStats { .. } => "PoolStats",
        Frame::Page { .. } => "Page",
        Frame::Done(_) => "Done",
        Frame::TransferAbort { .. } => "TransferAbort",
        Frame::Ack { .. } => "Ack",
        Frame::Nack { .. } => "Nack",
        Frame::AbortAck { .. } => "AbortAck",
    }
}

#[cfg(test)]
mod tests {
    use super::blank_unwritten_slots;

    #[test]
    fn only_the_slots_past_the_transfer_are_blanked() {
        let layout = kv::KvLayout {
            layer_count: 2,
            kv_head_count: 2,
            head_dim: 3,
            page_size_tokens: 4,
        };
        let mut page = vec![0xAAu8; layout.page_bytes()];
        // 6 tokens in pages of 4: the last page holds 2 written slots.
        blank_unwritten_slots(&mut page, &layout, 6);
        let slot_bytes = layout.head_dim * 2;
        let head_bytes = layout.page_size_tokens * slot_bytes;
        for (head, region) in page.chunks(head_bytes).enumerate() {
            assert!(
                region[..2 * slot_bytes].iter().all(|&b| b == 0xAA),
                "head {head}"
            );
            assert!(
                region[2 * slot_bytes..].iter().all(|&b| b == 0),
                "head {head}"
            );
        }
        // A full last page keeps everything.
        let mut full = vec![0xAAu8; layout.page_bytes()];
        blank_unwritten_slots(&mut full, &layout, 8);
        assert!(full.iter().all(|&b| b == 0xAA));
    }
}
