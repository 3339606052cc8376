//! The model: state, actions (including faults), properties.
//!
//! This module holds the state and the configuration; [`actions`] what each state enables and
//! where it leads, [`decode`] decode's side of a transfer, [`end`] how a request ends and its
//! pages go back, [`properties`] what the checker judges.

mod actions;
mod decode;
mod end;
mod properties;

use kv::{RequestId, TenantId};
use transfer::{transfer_checksum, Inbound, TransferDone, TransferId};

use crate::pages::{Pool, Table};

/// A guard removed on purpose, to show the checker notices. The prefix-cache variants act on
/// [`crate::PrefixSpec`] only, the others on [`TransferSpec`] only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// Byte and receive access skip the page owner/generation compare (kv's benchmark-only
    /// `unguarded-owner-check` feature).
    NoOwnerCheck,
    /// Allocation does not bump the page generation.
    NoGenerationBump,
    /// Decode seals without comparing the checksum.
    NoChecksum,
    /// Decode seals without comparing token and page counts to the reservation.
    NoLengthCheck,
    /// Prefill frees its pages as soon as it has sent them, not on decode's answer.
    NoDeferredRelease,
    /// The router answers every time an end reaches it, not only the first (the guard of
    /// `Engine::report` and the router's `Run`: one end per request).
    NoEndOnce,
    /// The router sends its 200 headers when decode reserves pages, before the transfer is
    /// verified (the code waits for decode's `Started`, sent after `Sealed`).
    HeadersBeforeSeal,
    /// A client's disconnect aborts only prefill: decode keeps its reservation (the router's
    /// `Abort` to decode, I7).
    NoDecodeAbort,
    /// A transfer that fails verification drops its table without releasing the pages
    /// (`Engine::end` → `release` on every way out of a request, I9).
    LeakOnReject,
    /// Neither the router nor the engine refuses a request larger than the pool.
    NoAdmission,
    /// One-sided transport: prefill answers decode's abort at once, while writes it posted
    /// may still land.
    AbortAckBeforeQuiescence,
    /// One-sided transport: decode frees an aborted or timed-out reservation at once, as the
    /// framed engine does (safe there only because a frame lands through the reservation).
    ImmediateRelease,
    /// One-sided transport: prefill writes a page again, unreported, after its `Written` told
    /// decode the page was final (the writer's one write per page is off).
    RewriteAfterWritten,
    /// Prefix cache: a lookup matches by tokens only, whichever tenant published the page.
    CacheKeyWithoutTenant,
    /// Prefix cache: eviction may free a cached page that live tables still hold.
    EvictReferenced,
    /// Prefix cache: decode's receive path does not know which pages it reuses from its cache
    /// (its `Inbound` has no `held_pages`), and writes a frame for one into the cached page.
    WriteToShared,
    /// Prefix cache: decode takes `Done`'s word for how many pages it already holds, instead
    /// of its own reservation's count.
    DeltaTrustsPrefill,
    /// Prefix cache: decode publishes received pages when `Done` arrives, before the checksum
    /// has verified them.
    CacheBeforeVerify,
}

/// How page bytes get from prefill into decode's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// TCP in the code: prefill sends its pages in `Page` frames on a link; decode writes a
    /// frame's bytes only through the live reservation (`Grants::claim`, `Inbound`), so a
    /// frame of a dropped reservation touches nothing and decode may free at once.
    Framed,
    /// The zero-copy transport that the `Sending` / `Quarantined` states and deferred release
    /// exist for: shared memory in the code (`transfer::one_sided`, `worker`'s `Grants`), and
    /// what an RDMA-write transport would follow. Prefill posts writes straight into decode's
    /// pages, and a posted write lands whatever the page's header says until prefill has seen
    /// it complete. Prefill sends `Done` only after its
    /// writes completed; decode, aborting, quarantines the reservation and asks prefill to
    /// stop (`WriteAbort`), and frees it on prefill's `WriteAbortAck` (sent once prefill's
    /// writes have quiesced) or when the link is gone.
    OneSided,
}

/// How many of each fault the checker may inject on one path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Faults {
    pub drops: u8,
    pub duplicates: u8,
    pub corruptions: u8,
    pub link_resets: u8,
    pub disconnects: u8,
    pub retries: u8,
    /// Crash-and-restart of either worker (it loses every volatile state).
    pub crashes: u8,
    /// The incident's prefill bug: send one page and a `Done` for one page, checksum and all,
    /// for a request that needs more.
    pub placeholders: u8,
    /// An engine bug that keeps a released table and runs a decode step with it: only the
    /// read-time owner/generation check (I1) stands between it and the pages' next owner.
    pub stale_reads: u8,
}

impl Faults {
    pub const NONE: Faults = Faults {
        drops: 0,
        duplicates: 0,
        corruptions: 0,
        link_resets: 0,
        disconnects: 0,
        retries: 0,
        crashes: 0,
        placeholders: 0,
        stale_reads: 0,
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestSpec {
    pub tenant: u8,
    /// KV pages the request needs (one token per page in the model).
    pub pages: u8,
}

/// One configuration of the model.
#[derive(Clone, Debug)]
pub struct TransferSpec {
    /// Pages in the decode pool.
    pub pool_pages: u8,
    pub requests: Vec<RequestSpec>,
    pub transport: Transport,
    pub faults: Faults,
    pub mutant: Option<Mutant>,
}

/// What a page holds: nothing yet, one attempt of one request's KV, or garbage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Content {
    Empty,
    Data { request: u8, attempt: u8 },
    Junk,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouterPhase {
    Idle,
    /// Submitted to decode, waiting in its queue for pages.
    WaitingDecode,
    /// Decode reserved pages and prefill runs; no response headers yet.
    WaitingStart,
    /// `Started` arrived: 200 headers are out.
    Streaming,
    Ended,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodePhase {
    Idle,
    Receiving {
        table: Table,
        inbound: Inbound,
        /// One-sided: what each page held when its `Written` reached decode (the code hashes
        /// the page then), for the checksum at `Done`; `None` until then.
        reported: Vec<Option<Content>>,
    },
    Decoding {
        table: Table,
    },
    /// One-sided only: aborted, pages `Quarantined` until prefill's `WriteAbortAck` or the
    /// link is gone.
    Quarantined {
        table: Table,
    },
}

impl DecodePhase {
    fn table(&self) -> Option<&Table> {
        match self {
            DecodePhase::Idle => None,
            DecodePhase::Receiving { table, .. }
            | DecodePhase::Decoding { table }
            | DecodePhase::Quarantined { table } => Some(table),
        }
    }
}

/// Prefill's side of the current attempt. Anything but `Idle` holds its source pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PrefillPhase {
    Idle,
    /// One-sided: writes posted for this many pages, `Done` not sent yet.
    Writing {
        pages: u8,
    },
    /// Pages (or writes) and `Done` sent; waiting for decode's answer.
    Sent,
    /// One-sided: decode asked to stop; waiting for the posted writes to complete.
    Aborting,
}

/// A table an earlier attempt released: what a stale reference would still point at.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Stale {
    pub attempt: u8,
    pub table: Table,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub router: RouterPhase,
    pub attempt: u8,
    /// Answers the client got for the current attempt (I6: exactly one).
    pub responses: u8,
    pub decode: DecodePhase,
    pub prefill: PrefillPhase,
    pub stale: Option<Stale>,
}

/// Messages between prefill and decode; the network is an unordered multiset.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// Framed: one page's bytes.
    Page {
        request: u8,
        attempt: u8,
        index: u8,
        content: Content,
    },
    Done {
        request: u8,
        attempt: u8,
        pages: u8,
        checksum: u64,
    },
    /// Framed, prefill → decode (`Frame::TransferAbort`).
    TransferAbort { request: u8, attempt: u8 },
    /// Decode → prefill.
    Ack { request: u8, attempt: u8 },
    /// Decode → prefill.
    Nack { request: u8, attempt: u8 },
    /// Framed, decode → prefill: decode dropped the reservation.
    AbortAck { request: u8, attempt: u8 },
    /// One-sided, decode → prefill: stop writing into the reservation.
    WriteAbort { request: u8, attempt: u8 },
    /// One-sided, prefill → decode: every write prefill posted for the transfer is over.
    WriteAbortAck { request: u8, attempt: u8 },
    /// One-sided, prefill → decode: the write of page `index` has landed and is its last.
    Written { request: u8, attempt: u8, index: u8 },
}

/// One-sided: a write prefill posted into one of decode's pages, not landed yet.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Write {
    pub request: u8,
    pub attempt: u8,
    pub index: u8,
    pub page: u8,
    pub generation: u8,
    pub content: Content,
    /// Reported to decode once landed (`Written`); only the `RewriteAfterWritten` mutant's
    /// second write is not.
    pub reported: bool,
}

/// Flags set by the action that breaks an invariant; every one stays false in a correct model.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    pub read_foreign: bool,
    pub read_corrupt: bool,
    pub bad_commit: bool,
    pub committed_after_end: bool,
    pub wrote_foreign: bool,
    pub freed_under_writer: bool,
    /// Prefill freed its source pages while a write it posted from them could still be read
    /// by the transport.
    pub source_freed_under_write: bool,
    pub wrong_answer: bool,
    /// An `.expect()` of the engine would have fired (a reservation's own pages failed to
    /// verify, release, or change state).
    pub engine_panic: bool,
}

/// Things that happened in the step that led to a state, for the `sometimes` properties.
/// Cleared at every step, so they do not multiply the states that follow.
pub mod event {
    pub const COMPLETED: u16 = 1;
    pub const STALE_REFUSED: u16 = 1 << 1;
    pub const CORRUPTION_CAUGHT: u16 = 1 << 2;
    pub const CRASH_MID_TRANSFER: u16 = 1 << 3;
    pub const LANDED_IN_QUARANTINE: u16 = 1 << 4;
    pub const QUARANTINE_FREED_FOR_WAITER: u16 = 1 << 5;
    pub const STALE_READ_REFUSED: u16 = 1 << 6;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub pool: Pool,
    pub content: Vec<Content>,
    pub requests: Vec<Request>,
    pub net: Vec<Msg>,
    pub writes: Vec<Write>,
    pub faults: Faults,
    pub ghost: Ghost,
    pub events: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Submit(u8),
    Reserve(u8),
    /// Reserve, with the incident's placeholder transfer from prefill.
    ReservePlaceholder(u8),
    Deliver(usize),
    /// One-sided: a posted write lands.
    Land(usize),
    /// One-sided: prefill's writes completed; it sends `Done`.
    SendDone(u8),
    /// One-sided: prefill's writes quiesced after decode's `WriteAbort`; it answers.
    AckAbort(u8),
    DecodeStep(u8),
    /// A decode step over the table of the request's released attempt (the `stale_reads`
    /// fault).
    StaleStep(u8),
    Timeout(u8),
    Disconnect(u8),
    Retry(u8),
    Drop(usize),
    Duplicate(usize),
    Corrupt(usize),
    CorruptWrite(usize),
    LinkReset,
    CrashPrefill,
    CrashDecode,
}

impl Action {
    /// The action, with the message or write it picks (an index into `state`) spelled out.
    pub fn describe(&self, state: &State) -> String {
        match *self {
            Action::Deliver(i) => format!("Deliver {:?}", state.net[i]),
            Action::Drop(i) => format!("Drop {:?}", state.net[i]),
            Action::Duplicate(i) => format!("Duplicate {:?}", state.net[i]),
            Action::Corrupt(i) => format!("Corrupt {:?}", state.net[i]),
            Action::Land(i) => format!("Land {:?}", state.writes[i]),
            Action::CorruptWrite(i) => format!("Corrupt {:?}", state.writes[i]),
            ref other => format!("{other:?}"),
        }
    }
}

/// How a request's one answer ends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// 200 with a normal finish.
    Ok,
    /// 400 before any page: the request can never fit.
    Rejected,
    /// 5xx, or an SSE error event after the headers.
    Failed,
    /// The client went away.
    Gone,
}

const PAGE_BYTES: usize = 3;

fn content_bytes(content: Content) -> [u8; PAGE_BYTES] {
    match content {
        Content::Empty => [0, 0, 0],
        Content::Data { request, attempt } => [1, request, attempt],
        Content::Junk => [2, 0xff, 0xff],
    }
}

fn transfer_id(request: u8, attempt: u8) -> TransferId {
    TransferId(u64::from(request) * 16 + u64::from(attempt))
}

impl TransferSpec {
    fn has(&self, mutant: Mutant) -> bool {
        self.mutant == Some(mutant)
    }

    fn one_sided(&self) -> bool {
        self.transport == Transport::OneSided
    }

    fn needed(&self, request: u8) -> u8 {
        self.requests[request as usize].pages
    }

    /// A request the whole pool can never hold: admission must refuse it.
    fn oversize(&self, request: u8) -> bool {
        self.needed(request) > self.pool_pages
    }

    fn tenant(&self, request: u8) -> TenantId {
        TenantId(u64::from(self.requests[request as usize].tenant))
    }

    fn done(&self, request: u8, attempt: u8, pages: u8) -> TransferDone {
        TransferDone {
            transfer: transfer_id(request, attempt),
            request: RequestId(u64::from(request)),
            tenant: self.tenant(request),
            page_count: u32::from(pages),
            token_count: u32::from(pages),
            checksum: 0,
        }
    }

    /// The checksum prefill computes over the pages it sends (`Engine::send_pages`).
    fn checksum(&self, request: u8, attempt: u8, pages: u8) -> u64 {
        let done = self.done(request, attempt, pages);
        let bytes = vec![content_bytes(Content::Data { request, attempt }); pages as usize];
        transfer_checksum(&done, bytes.iter().map(|p| &p[..]))
    }
}
