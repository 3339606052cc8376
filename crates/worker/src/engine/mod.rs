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
//!
//! A request's state is data inside its [`Phase`]: only an admitted request holds a page
//! table, and only the stage that uses them holds a transfer, a peer link or a sampler.
//!
//! Modules, one per part of a request's life: this one holds the types, the loop and event
//! dispatch; [`admit`] checks and queues submits and hands out pages; [`step`] runs the batched
//! forward step, samples and finishes; [`send`] is prefill's side of a transfer, [`receive`]
//! decode's; [`end`] covers aborts, timeouts, lost links and the one report per request.

mod admit;
mod constrain;
mod end;
mod grants;
pub(crate) use grants::{OneSidedPeer, PageSinks};
#[cfg(test)]
mod grants_tests;
mod receive;
mod reuse;
#[cfg(test)]
mod reuse_tests;
mod send;
mod step;
#[cfg(test)]
mod stream_tests;
#[cfg(test)]
mod tests;

use crate::config::WorkerConfig;
use gguf::Tokenizer;
use kv::{Owner, PagePool, PageState, PageTable, PrefixCache, RequestId};
use model::{Forward, Sampler, StopMatcher};
use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use transfer::{Failure, Frame, PerTransport, PrefixCounters, Submit, TokenLogprob, TransferId};

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
        /// A peer link whose pages are written through shared memory (`transfer::one_sided`).
        one_sided: bool,
        /// A framed peer link whose writer computes `Done`'s checksum
        /// (`transfer::transport::spawn_hashing_link`): the engine puts the hashes of the
        /// pages decode holds here and hashes nothing else.
        sender_hashes: Option<transfer::SenderHashes>,
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
    /// A page frame a link's reader did not land: no live reservation of its transfer takes
    /// frames from that link (`reject` is `None`), or the reservation's checks refused it.
    PageRefused {
        link: LinkId,
        transfer: TransferId,
        reject: Option<transfer::Reject>,
    },
    /// A peer failed cluster authentication (counted, exported).
    AuthFailure,
    /// Stop taking new requests (each is refused as `Overloaded`, which a router retries on
    /// another worker), tell the routers, finish the rest, and say so on `idle` once nothing
    /// is left.
    Drain {
        idle: tokio::sync::oneshot::Sender<()>,
    },
    Shutdown,
}

/// A request is named by the router link it came on and the router's id for it.
type Key = (LinkId, RequestId);

struct Request {
    submit: Submit,
    /// Pool owner: the tenant, and a request id local to this worker (router ids are only
    /// unique per router).
    owner: Owner,
    arrived: Instant,
    /// Wall-clock arrival, for the request's span.
    received_at: std::time::SystemTime,
    /// Arrival order, for FIFO prefill scheduling.
    seq: u64,
    /// The decode worker's link named by a prefill plan's submit; its pages go there.
    peer: Option<LinkId>,
    /// The router has been told how this request ended (exactly one end, I6).
    reported: bool,
    /// Prompt tokens whose K/V came from this worker's prefix cache.
    cached_tokens: usize,
    phase: Phase,
}

// Queued requests are few and short-lived; boxing the admitted state would cost an
// allocation per request for no gain.
#[allow(clippy::large_enum_variant)]
enum Phase {
    /// Waiting for pages.
    Queued,
    /// Holding `table`, and doing what `stage` says with it.
    Admitted { table: PageTable, stage: Stage },
}

/// What an admitted request is doing with its pages.
enum Stage {
    /// `done` of `target` prompt tokens are in KV.
    Prefilling {
        done: usize,
        target: usize,
        /// Fault injection only (`incident`): the prompt was swapped for a one-token
        /// placeholder.
        placeholder: bool,
        /// Prefill plans: the transfer, streaming as chunks complete pages (boxed: the
        /// hasher's state is large, and most stages are not streams).
        stream: Option<Box<send::Stream>>,
    },
    /// Decode: pages reserved and lent to the transfer's reservation in [`grants::Grants`]
    /// (its `Inbound`, its sender link and its frames' times live there, where the link's
    /// reader checks and lands each page).
    Receiving {
        transfer: TransferId,
        /// When the reservation was made.
        since: Instant,
    },
    /// Prefill: pages sent on `peer`, held until the receiver answers.
    Sending {
        transfer: TransferId,
        peer: LinkId,
        since: Instant,
        abort_sent: bool,
        quarantined: bool,
    },
    Decoding(DecodeState),
}

struct DecodeState {
    // Boxed: its penalty counts would make every `Stage` as large.
    sampler: Box<Sampler>,
    stops: StopMatcher,
    pending_bytes: Vec<u8>,
    generated: Vec<u32>,
    /// Log-probabilities of the tokens sampled since the last `Text` sent (when asked).
    logprobs: Vec<TokenLogprob>,
    /// Structured output: the grammar state, compiled at the first step.
    constraint: Constrained,
    /// The token the next step feeds, and its position.
    next_input: u32,
    position: usize,
}

/// A request's structured-output state.
enum Constrained {
    Free,
    /// The shape as the `Submit` carries it, not compiled yet.
    Pending(String),
    Active(Box<grammar::Constraint>),
    /// Out of the state for this step while its mask is computed (`constrain`).
    Masking,
}

struct LinkEntry {
    kind: LinkKind,
    tx: UnboundedSender<Frame>,
    one_sided: bool,
    sender_hashes: Option<transfer::SenderHashes>,
}

#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct Stats {
    /// Free pages plus cached pages no request references (reclaimable at once).
    pages_free: usize,
    pages_quarantined: usize,
    queue_depth: usize,
    ownership_failures: u64,
    frames_rejected: u64,
    auth_failures: u64,
    prefix: PrefixCounters,
    transfer: PerTransport,
    draining: bool,
}

/// The worker's state; see the module docs.
pub struct Engine {
    config: WorkerConfig,
    model: Box<dyn Forward>,
    tokenizer: Tokenizer,
    pool: PagePool,
    /// Full prompt pages this worker keeps for reuse, per tenant (I10); see `admit`.
    cache: PrefixCache,
    /// Decode's open reservations, shared with the readers of its prefill links.
    grants: Arc<grants::Grants>,
    /// Prompt tokens this worker computed K/V for (not taken from the cache).
    prefilled_tokens: u64,
    /// Page frames sent to decode workers, and pages not sent because decode held them.
    pages_sent: u64,
    pages_not_sent: u64,
    /// Bytes sent and received, and verified transfers' times, per transport, for `/metrics`.
    transfer_counters: PerTransport,
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
    /// The model's tokens for the grammar engine, built on its own thread at start.
    vocabulary: constrain::GrammarVocabulary,
    /// Set by `Event::Drain`: whom to tell once no request is left (taken when told).
    drain: Option<Drain>,
}

struct Drain {
    idle: Option<tokio::sync::oneshot::Sender<()>>,
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
        #[allow(unused_mut)]
        let mut cache = PrefixCache::new(pool.layout().page_size_tokens);
        #[cfg(feature = "fault-injection")]
        cache.set_tenant_ignored_for_test(!config.faults.cache_keyed_by_tenant());
        let vocabulary = constrain::GrammarVocabulary::start(config.role, &tokenizer);
        Engine {
            config,
            model,
            tokenizer,
            pool,
            cache,
            grants: Arc::default(),
            prefilled_tokens: 0,
            pages_sent: 0,
            pages_not_sent: 0,
            transfer_counters: PerTransport::default(),
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
            vocabulary,
            drain: None,
        }
    }

    /// What makes the page sinks of this engine's prefill links (see [`PageSinks`]); taken
    /// before the engine moves to its thread.
    pub(crate) fn page_sinks(&self) -> PageSinks {
        PageSinks {
            grants: self.grants.clone(),
            faults: self.config.faults.clone(),
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
            if self.apply_events(first, &events).is_break() {
                return;
            }
            self.work(Instant::now);
        }
    }

    /// Applies `first` and every event already waiting; breaks on `Shutdown`.
    fn apply_events(
        &mut self,
        first: Option<Event>,
        events: &mpsc::Receiver<Event>,
    ) -> ControlFlow<()> {
        let mut next = first;
        while let Some(event) = next {
            if matches!(event, Event::Shutdown) {
                return ControlFlow::Break(());
            }
            self.handle(event);
            next = events.try_recv().ok();
        }
        ControlFlow::Continue(())
    }

    /// The rest of a turn: admission, timeouts as of `now` (read after admission, which
    /// stamps the reservations it makes), one forward step, the pool report.
    fn work(&mut self, now: impl FnOnce() -> Instant) {
        // Pages released while a link's writer still sent them are free once it let go.
        self.pool.reclaim_returned();
        self.admit_queued();
        self.expire(now());
        self.step();
        self.publish_stats();
        self.tell_when_drained();
    }

    /// A draining engine with no request left (nothing running, queued, sending or
    /// receiving) says so, once.
    fn tell_when_drained(&mut self) {
        let Some(drain) = &mut self.drain else {
            return;
        };
        if self.requests.is_empty() && self.inbound.is_empty() && self.outbound.is_empty() {
            if let Some(idle) = drain.idle.take() {
                tracing::info!(worker = %self.config.name, "drained: no request left");
                let _ = idle.send(());
            }
        }
    }

    pub(super) fn is_draining(&self) -> bool {
        self.drain.is_some()
    }

    fn has_runnable_work(&self) -> bool {
        self.requests.values().any(|r| {
            matches!(
                r.phase,
                Phase::Admitted {
                    stage: Stage::Prefilling { .. } | Stage::Decoding(_),
                    ..
                }
            )
        })
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::LinkUp {
                link,
                kind,
                tx,
                one_sided,
                sender_hashes,
            } => {
                let entry = LinkEntry {
                    kind,
                    tx,
                    one_sided,
                    sender_hashes,
                };
                self.links.insert(link, entry);
                self.last_stats = None;
            }
            Event::LinkDown { link } => self.link_down(link),
            Event::Frame { link, frame } => self.frame(link, frame),
            Event::SubmitToPeer { link, submit, peer } => self.submit(link, submit, Some(peer)),
            Event::PageRefused {
                link,
                transfer,
                reject,
            } => self.page_refused(link, transfer, reject),
            Event::AuthFailure => self.auth_failures += 1,
            Event::Drain { idle } => {
                tracing::info!(
                    worker = %self.config.name,
                    requests = self.requests.len(),
                    "draining: finishing the requests held, refusing new ones"
                );
                self.drain = Some(Drain { idle: Some(idle) });
            }
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
            (LinkKind::DecodePeer, Frame::WriteAbort { transfer }) => {
                self.write_abort(link, transfer)
            }
            (LinkKind::PrefillPeer, Frame::WriteAbortAck { transfer }) => {
                if !self.grants.write_abort_acked(link, transfer) {
                    self.frames_rejected += 1;
                }
            }
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

    // ---- Output --------------------------------------------------------------------------

    /// Decode's answer to a sender (`Ack`, `Nack`, `AbortAck`): what frees its pages.
    fn answer(&mut self, link: LinkId, frame: Frame) {
        let delay = self.config.faults.answer_delay();
        self.send_after(link, frame, delay);
    }

    /// Sends `frame` on `link`, `delay` later from another thread when there is one (fault
    /// injection), so the engine goes on meanwhile.
    fn send_after(&self, link: LinkId, frame: Frame, delay: Option<Duration>) {
        match (delay, self.links.get(&link)) {
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
        let cache = self.cache.stats();
        let stats = Stats {
            pages_free: self.pool.pages_free() + self.pool.pages_reclaimable(),
            // Released pages a link's writer still reads count as quarantined until it is done.
            pages_quarantined: self.pool.pages_in_state(PageState::Quarantined)
                + self.pool.pages_returning(),
            queue_depth: self.queue.len(),
            ownership_failures: self.ownership_failures,
            frames_rejected: self.frames_rejected,
            auth_failures: self.auth_failures,
            prefix: PrefixCounters {
                lookups: cache.lookups,
                hit_pages: cache.hit_pages,
                hit_tokens: cache.hit_tokens,
                evictions: cache.evictions,
                cached_pages: cache.cached_pages,
                prefilled_tokens: self.prefilled_tokens,
                pages_sent: self.pages_sent,
                pages_not_sent: self.pages_not_sent,
            },
            transfer: self.transfer_counters,
            draining: self.drain.is_some(),
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
            prefix: stats.prefix,
            transfer: Box::new(stats.transfer),
            draining: stats.draining,
        };
        for entry in self.links.values() {
            if entry.kind == LinkKind::Router {
                let _ = entry.tx.send(frame.clone());
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

fn failed(request: RequestId, failure: Failure, message: String) -> Frame {
    Frame::Failed {
        request,
        failure,
        message,
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
        Frame::PromptLogprobs { .. } => "PromptLogprobs",
        Frame::Finished { .. } => "Finished",
        Frame::Failed { .. } => "Failed",
        Frame::PoolStats { .. } => "PoolStats",
        Frame::Page { .. } => "Page",
        Frame::Done(_) => "Done",
        Frame::TransferAbort { .. } => "TransferAbort",
        Frame::Ack { .. } => "Ack",
        Frame::Nack { .. } => "Nack",
        Frame::AbortAck { .. } => "AbortAck",
        Frame::GrantAsk { .. } => "GrantAsk",
        Frame::WriteGrant { .. } => "WriteGrant",
        Frame::WriteAbort { .. } => "WriteAbort",
        Frame::WriteAbortAck { .. } => "WriteAbortAck",
        Frame::Written { .. } => "Written",
    }
}
