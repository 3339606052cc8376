//! The model: state, actions (including faults), properties.

use kv::{PageState, RequestId, TenantId};
use stateright::{Model, Property};
use transfer::{transfer_checksum, Inbound, Reject, TransferDone, TransferId};

use crate::pages::{Access, Pool, Table};

/// A guard removed on purpose, to show the checker notices.
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
}

/// How page bytes get from prefill into decode's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// The code today: prefill copies its pages into `Page` frames on a link; decode writes a
    /// frame's bytes only through the live reservation (`Engine::page`, `verify_receiving`),
    /// so a frame of a dropped reservation touches nothing and decode may free at once.
    Framed,
    /// A design model of the zero-copy (RDMA-write) transport that the `Sending` /
    /// `Quarantined` states and deferred release exist for, not implemented: prefill posts
    /// writes straight into decode's pages, and a posted write lands whatever the page's
    /// header says until prefill has seen it complete. Prefill sends `Done` only after its
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

    /// The router answers the client, once.
    fn end(&self, state: &mut State, request: u8, answer: Answer) {
        let entry = &mut state.requests[request as usize];
        if entry.router == RouterPhase::Ended && !self.has(Mutant::NoEndOnce) {
            return;
        }
        entry.router = RouterPhase::Ended;
        entry.responses += 1;
        // S11: a request that can never fit gets its 400 and nothing else; a 400 is only for
        // such a request.
        if (answer == Answer::Rejected) != self.oversize(request) {
            state.ghost.wrong_answer = true;
        }
    }

    /// Frees a request's decode pages through `PagePool::release`.
    fn release(&self, state: &mut State, request: u8, table: &Table) {
        if state.pool.release(request, table).is_err() {
            // `Engine::end`: `expect("a request's own pages release")`.
            state.ghost.engine_panic = true;
        }
        // S4: nothing may free a page a posted write can still land in.
        if state
            .writes
            .iter()
            .any(|w| table.contains(&(w.page, w.generation)))
        {
            state.ghost.freed_under_writer = true;
        }
        let attempt = state.requests[request as usize].attempt;
        state.requests[request as usize].stale = Some(Stale {
            attempt,
            table: table.clone(),
        });
    }

    fn set_state(&self, state: &mut State, request: u8, table: &Table, to: PageState) {
        if state.pool.set_state(request, table, to).is_err() {
            state.ghost.engine_panic = true;
        }
    }

    /// Decode ends what it holds for the request at once: the transfer failed verification,
    /// or whatever could still write into the pages is known to be over (`Done` was sent
    /// after the writes completed; the link is gone).
    fn fail_decode(&self, state: &mut State, request: u8, answer: Answer) {
        let decode = std::mem::replace(
            &mut state.requests[request as usize].decode,
            DecodePhase::Idle,
        );
        if let Some(table) = decode.table() {
            let rejected =
                matches!(decode, DecodePhase::Receiving { .. }) && answer == Answer::Failed;
            if !(rejected && self.has(Mutant::LeakOnReject)) {
                self.release(state, request, table);
            }
        }
        self.end(state, request, answer);
    }

    /// Decode gives up on the request (client gone, timeout). Framed: the same as a failure.
    /// One-sided: a reservation still receiving is quarantined and prefill asked to stop;
    /// the pages wait for its answer.
    fn abort_decode(&self, state: &mut State, request: u8, answer: Answer) {
        let entry = &state.requests[request as usize];
        let receiving = matches!(entry.decode, DecodePhase::Receiving { .. });
        if !self.one_sided() || !receiving || self.has(Mutant::ImmediateRelease) {
            if !matches!(entry.decode, DecodePhase::Quarantined { .. }) {
                self.fail_decode(state, request, answer);
            }
            self.end(state, request, answer);
            return;
        }
        let attempt = entry.attempt;
        let DecodePhase::Receiving { table, .. } = std::mem::replace(
            &mut state.requests[request as usize].decode,
            DecodePhase::Idle,
        ) else {
            unreachable!("checked above");
        };
        self.set_state(state, request, &table, PageState::Quarantined);
        state.requests[request as usize].decode = DecodePhase::Quarantined { table };
        state.net.push(Msg::WriteAbort { request, attempt });
        self.end(state, request, answer);
    }

    /// Prefill frees its source pages. A posted one-sided write reads them until it lands, so
    /// freeing them while one is in flight would send whatever prefill puts there next (I5).
    fn prefill_release(state: &mut State, request: u8) {
        let entry = &mut state.requests[request as usize];
        if entry.prefill != PrefillPhase::Idle {
            entry.prefill = PrefillPhase::Idle;
            let attempt = entry.attempt;
            if TransferSpec::writes_pending(state, request, attempt) {
                state.ghost.source_freed_under_write = true;
            }
        }
    }

    fn writes_pending(state: &State, request: u8, attempt: u8) -> bool {
        state
            .writes
            .iter()
            .any(|w| w.request == request && w.attempt == attempt)
    }

    /// Decode reserves pages (`Engine::admit_queued` + `start`), the router asks prefill, and
    /// prefill sends its pages (framed) or posts its writes (one-sided).
    fn reserve(&self, state: &mut State, request: u8, placeholder: bool) {
        let needed = self.needed(request);
        let bump = !self.has(Mutant::NoGenerationBump);
        let Ok(table) = state.pool.allocate(request, needed as usize, bump) else {
            // The action is enabled only when the pages are free.
            unreachable!("Reserve needs free pages");
        };
        self.set_state(state, request, &table, PageState::Receiving);
        let attempt = state.requests[request as usize].attempt;
        let inbound = Inbound::new(
            transfer_id(request, attempt),
            RequestId(u64::from(request)),
            self.tenant(request),
            u32::from(needed),
            1,
            PAGE_BYTES,
        );
        let content = Content::Data { request, attempt };
        // The placeholder claims one page, and its checksum agrees with that claim.
        let sent = if placeholder { 1 } else { needed };
        if self.one_sided() {
            for index in 0..sent {
                let (page, generation) = table[index as usize];
                state.writes.push(Write {
                    request,
                    attempt,
                    index,
                    page,
                    generation,
                    content,
                });
            }
            state.requests[request as usize].prefill = PrefillPhase::Writing { pages: sent };
        } else {
            for index in 0..sent {
                state.net.push(Msg::Page {
                    request,
                    attempt,
                    index,
                    content,
                });
            }
            state.net.push(Msg::Done {
                request,
                attempt,
                pages: sent,
                checksum: self.checksum(request, attempt, sent),
            });
            state.requests[request as usize].prefill = PrefillPhase::Sent;
        }
        let entry = &mut state.requests[request as usize];
        entry.decode = DecodePhase::Receiving { table, inbound };
        entry.router = if self.has(Mutant::HeadersBeforeSeal) {
            RouterPhase::Streaming
        } else {
            RouterPhase::WaitingStart
        };
        if self.has(Mutant::NoDeferredRelease) {
            TransferSpec::prefill_release(state, request);
        }
    }

    fn deliver(&self, state: &mut State, msg: Msg) {
        match msg {
            Msg::Page {
                request,
                attempt,
                index,
                content,
            } => self.land_frame(state, request, attempt, index, content),
            Msg::Done {
                request,
                attempt,
                pages,
                checksum,
            } => self.verify_done(state, request, attempt, pages, checksum),
            Msg::TransferAbort { request, attempt } => {
                // `Engine::transfer_aborted`: end the reservation if it is live, answer anyway.
                let entry = &state.requests[request as usize];
                if entry.attempt == attempt && matches!(entry.decode, DecodePhase::Receiving { .. })
                {
                    self.fail_decode(state, request, Answer::Failed);
                }
                state.net.push(Msg::AbortAck { request, attempt });
            }
            Msg::Ack { request, attempt }
            | Msg::Nack { request, attempt }
            | Msg::AbortAck { request, attempt } => {
                // `Engine::sent`: the receiver answered; prefill frees its pages.
                if state.requests[request as usize].attempt == attempt {
                    TransferSpec::prefill_release(state, request);
                }
            }
            Msg::WriteAbort { request, attempt } => {
                let entry = &mut state.requests[request as usize];
                let writing = matches!(entry.prefill, PrefillPhase::Writing { .. });
                if entry.attempt == attempt && writing {
                    if self.has(Mutant::AbortAckBeforeQuiescence) {
                        state.net.push(Msg::WriteAbortAck { request, attempt });
                        TransferSpec::prefill_release(state, request);
                    } else {
                        entry.prefill = PrefillPhase::Aborting;
                    }
                } else if entry.attempt != attempt || entry.prefill != PrefillPhase::Aborting {
                    // `Done` went out only after the writes completed, or nothing was posted:
                    // nothing of this transfer can land any more.
                    if entry.attempt == attempt {
                        TransferSpec::prefill_release(state, request);
                    }
                    state.net.push(Msg::WriteAbortAck { request, attempt });
                }
            }
            Msg::WriteAbortAck { request, attempt } => {
                let entry = &state.requests[request as usize];
                if entry.attempt == attempt {
                    if let DecodePhase::Quarantined { table } = entry.decode.clone() {
                        state.requests[request as usize].decode = DecodePhase::Idle;
                        self.release(state, request, &table);
                        if state
                            .requests
                            .iter()
                            .any(|r| r.router == RouterPhase::WaitingDecode)
                        {
                            state.events |= event::QUARANTINE_FREED_FOR_WAITER;
                        }
                    }
                }
            }
        }
    }

    /// Framed: a page frame arrives (`Engine::page`).
    fn land_frame(&self, state: &mut State, request: u8, attempt: u8, index: u8, content: Content) {
        let current = state.requests[request as usize].attempt == attempt;
        let tenant = self.tenant(request);
        if current {
            if let DecodePhase::Receiving { table, inbound } =
                &mut state.requests[request as usize].decode
            {
                let verdict = inbound.accept_page(
                    RequestId(u64::from(request)),
                    tenant,
                    u32::from(index),
                    PAGE_BYTES,
                );
                match verdict {
                    Ok(slot) => {
                        let (page, _) = table[slot];
                        let verified = state.pool.verify(
                            &[(request, table)],
                            Access::Receive,
                            self.has(Mutant::NoOwnerCheck),
                        );
                        if verified.is_ok() {
                            state.content[page as usize] = content;
                        } else {
                            // `expect("a reservation's own pages verify")`.
                            state.ghost.engine_panic = true;
                        }
                    }
                    Err(_) => {
                        // `Engine::reject`.
                        state.net.push(Msg::Nack { request, attempt });
                        self.fail_decode(state, request, Answer::Failed);
                    }
                }
                return;
            }
        }
        // A frame for a transfer decode no longer holds. The engine drops it at the
        // reservation lookup; the model also lets it reach the pages through the table that
        // transfer used, as a stale reference would, so that the owner/generation check is
        // what must stop it.
        let Some(stale) = state.requests[request as usize].stale.clone() else {
            return;
        };
        if stale.attempt != attempt {
            return;
        }
        if let Some(&(page, generation)) = stale.table.get(index as usize) {
            let claim = vec![(page, generation)];
            let verified = state.pool.verify(
                &[(request, &claim)],
                Access::Receive,
                self.has(Mutant::NoOwnerCheck),
            );
            if verified.is_ok() {
                if foreign(state, request, attempt, page, generation) {
                    state.ghost.wrote_foreign = true;
                }
                state.content[page as usize] = content;
            } else {
                state.events |= event::STALE_REFUSED;
            }
        }
    }

    /// One-sided: a posted write lands, whatever the page's header says (the NIC does not
    /// look), and decode's completion for it goes through the reservation.
    fn land_write(&self, state: &mut State, write: Write) {
        if foreign(
            state,
            write.request,
            write.attempt,
            write.page,
            write.generation,
        ) {
            state.ghost.wrote_foreign = true;
        }
        if state.pool.header(write.page).state == PageState::Quarantined {
            state.events |= event::LANDED_IN_QUARANTINE;
        }
        state.content[write.page as usize] = write.content;
        let tenant = self.tenant(write.request);
        let entry = &mut state.requests[write.request as usize];
        if entry.attempt == write.attempt {
            if let DecodePhase::Receiving { inbound, .. } = &mut entry.decode {
                let _ = inbound.accept_page(
                    RequestId(u64::from(write.request)),
                    tenant,
                    u32::from(write.index),
                    PAGE_BYTES,
                );
            }
        }
    }

    /// `Engine::done`.
    fn verify_done(&self, state: &mut State, request: u8, attempt: u8, pages: u8, checksum: u64) {
        let entry = &state.requests[request as usize];
        let DecodePhase::Receiving { table, inbound } = &entry.decode else {
            state.net.push(Msg::Nack { request, attempt });
            return;
        };
        if entry.attempt != attempt {
            state.net.push(Msg::Nack { request, attempt });
            return;
        }
        let mut done = self.done(request, attempt, pages);
        done.checksum = checksum;
        let length = if self.has(Mutant::NoLengthCheck) {
            Ok(())
        } else {
            inbound.check_done(&done)
        };
        if state
            .pool
            .verify(
                &[(request, table)],
                Access::Receive,
                self.has(Mutant::NoOwnerCheck),
            )
            .is_err()
        {
            state.ghost.engine_panic = true;
        }
        // Like the engine, hash the first `page_count` pages that `Done` names.
        let ours: Vec<[u8; PAGE_BYTES]> = table
            .iter()
            .take(pages as usize)
            .map(|&(page, _)| content_bytes(state.content[page as usize]))
            .collect();
        let verified = length.and_then(|()| {
            if self.has(Mutant::NoChecksum) {
                return Ok(());
            }
            inbound.verify_checksum(&done, transfer_checksum(&done, ours.iter().map(|p| &p[..])))
        });
        let table = table.clone();
        match verified {
            Ok(()) => {
                // S2, judged by the model rather than by the code under test: every page the
                // request needs is there, still its own, and holds this attempt's KV.
                let whole = table.len() == self.needed(request) as usize
                    && table.iter().all(|&(page, generation)| {
                        let header = state.pool.header(page);
                        header.owner == Some(request)
                            && header.generation == generation
                            && state.content[page as usize] == Content::Data { request, attempt }
                    });
                if !whole {
                    state.ghost.bad_commit = true;
                }
                if state.requests[request as usize].router == RouterPhase::Ended {
                    state.ghost.committed_after_end = true;
                }
                self.set_state(state, request, &table, PageState::Sealed);
                let entry = &mut state.requests[request as usize];
                entry.decode = DecodePhase::Decoding { table };
                entry.router = RouterPhase::Streaming;
                state.net.push(Msg::Ack { request, attempt });
            }
            Err(reject) => {
                if reject == Reject::ChecksumMismatch {
                    state.events |= event::CORRUPTION_CAUGHT;
                }
                state.net.push(Msg::Nack { request, attempt });
                self.fail_decode(state, request, Answer::Failed);
            }
        }
    }

    /// One decode step reads every page of the request (`Model::forward` through
    /// `verify_batch`), then the request finishes (`Engine::finish`).
    fn decode_step(&self, state: &mut State, request: u8) {
        let DecodePhase::Decoding { table } = state.requests[request as usize].decode.clone()
        else {
            return;
        };
        let attempt = state.requests[request as usize].attempt;
        let verified = state.pool.verify(
            &[(request, &table)],
            Access::Bytes,
            self.has(Mutant::NoOwnerCheck),
        );
        let mut answer = Answer::Failed;
        if verified.is_ok() {
            let mut clean = true;
            for &(page, _) in &table {
                match state.content[page as usize] {
                    Content::Data {
                        request: r,
                        attempt: a,
                    } if r == request && a == attempt => {}
                    Content::Data { .. } => {
                        state.ghost.read_foreign = true;
                        clean = false;
                    }
                    Content::Empty | Content::Junk => {
                        state.ghost.read_corrupt = true;
                        clean = false;
                    }
                }
            }
            if clean {
                state.events |= event::COMPLETED;
            }
            answer = Answer::Ok;
        }
        state.requests[request as usize].decode = DecodePhase::Idle;
        self.release(state, request, &table);
        self.end(state, request, answer);
    }

    /// The `stale_reads` fault: a decode step over the table the request's last attempt
    /// released. The owner/generation check must refuse it, whoever holds the pages now.
    fn stale_step(&self, state: &mut State, request: u8) {
        state.faults.stale_reads -= 1;
        let Some(stale) = state.requests[request as usize].stale.clone() else {
            unreachable!("StaleStep is enabled only with a released table");
        };
        let verified = state.pool.verify(
            &[(request, &stale.table)],
            Access::Bytes,
            self.has(Mutant::NoOwnerCheck),
        );
        if verified.is_err() {
            state.events |= event::STALE_READ_REFUSED;
            return;
        }
        for &(page, _) in &stale.table {
            match state.content[page as usize] {
                Content::Data {
                    request: r,
                    attempt,
                } if r == request && attempt == stale.attempt => {}
                Content::Data { .. } => state.ghost.read_foreign = true,
                Content::Empty | Content::Junk => state.ghost.read_corrupt = true,
            }
        }
    }

    /// Nothing in flight and nothing held: the state every run must come back to.
    fn quiescent(state: &State) -> bool {
        state.net.is_empty()
            && state.writes.is_empty()
            && state.requests.iter().all(|r| {
                matches!(r.router, RouterPhase::Idle | RouterPhase::Ended)
                    && r.decode == DecodePhase::Idle
                    && r.prefill == PrefillPhase::Idle
            })
    }

    /// No action is enabled: where a bounded run ends, and where liveness is judged.
    fn terminal(&self, state: &State) -> bool {
        // Cheap exits first: nearly every state has something in flight.
        if !state.net.is_empty() || !state.writes.is_empty() {
            return false;
        }
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions.is_empty()
    }

    /// S3: the pool's own bookkeeping agrees (free list and headers), and every allocated
    /// page is held by exactly one request's decode table, the one its header names, at the
    /// generation the table recorded; no request holds a page that is not its own.
    fn single_ownership(state: &State) -> bool {
        if !state.pool.consistent() {
            return false;
        }
        let holds = |r: &Request, page: usize, generation: u8| {
            r.decode
                .table()
                .is_some_and(|t| t.contains(&(page as u8, generation)))
        };
        let pages_ok = state.pool.headers().iter().enumerate().all(|(p, h)| {
            h.owner.is_none_or(|owner| {
                state
                    .requests
                    .iter()
                    .enumerate()
                    .all(|(r, entry)| holds(entry, p, h.generation) == (r as u8 == owner))
            })
        });
        let tables_ok = state.requests.iter().enumerate().all(|(r, entry)| {
            entry.decode.table().is_none_or(|table| {
                table.iter().all(|&(page, generation)| {
                    let header = state.pool.header(page);
                    header.owner == Some(r as u8) && header.generation == generation
                })
            })
        });
        pages_ok && tables_ok
    }
}

fn msg_request(msg: &Msg) -> u8 {
    match *msg {
        Msg::Page { request, .. }
        | Msg::Done { request, .. }
        | Msg::TransferAbort { request, .. }
        | Msg::Ack { request, .. }
        | Msg::Nack { request, .. }
        | Msg::AbortAck { request, .. }
        | Msg::WriteAbort { request, .. }
        | Msg::WriteAbortAck { request, .. } => request,
    }
}

impl Model for TransferSpec {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let request = Request {
            router: RouterPhase::Idle,
            attempt: 0,
            responses: 0,
            decode: DecodePhase::Idle,
            prefill: PrefillPhase::Idle,
            stale: None,
        };
        vec![State {
            pool: Pool::new(self.pool_pages),
            content: vec![Content::Empty; self.pool_pages as usize],
            requests: vec![request; self.requests.len()],
            net: Vec::new(),
            writes: Vec::new(),
            faults: self.faults,
            ghost: Ghost::default(),
            events: 0,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let free = state.pool.pages_free();
        for (index, entry) in state.requests.iter().enumerate() {
            let r = index as u8;
            let needed = self.needed(r);
            let idle = entry.decode == DecodePhase::Idle && entry.prefill == PrefillPhase::Idle;
            match entry.router {
                RouterPhase::Idle => actions.push(Action::Submit(r)),
                // Decode's FIFO queue: the reservation is all or nothing.
                RouterPhase::WaitingDecode if idle && free >= needed as usize => {
                    actions.push(Action::Reserve(r));
                    if state.faults.placeholders > 0 && needed > 1 {
                        actions.push(Action::ReservePlaceholder(r));
                    }
                }
                RouterPhase::Ended if state.faults.retries > 0 && idle => {
                    actions.push(Action::Retry(r))
                }
                _ => {}
            }
            if state.faults.stale_reads > 0 && entry.stale.is_some() {
                actions.push(Action::StaleStep(r));
            }
            match entry.decode {
                DecodePhase::Decoding { .. } => actions.push(Action::DecodeStep(r)),
                DecodePhase::Receiving { .. } => actions.push(Action::Timeout(r)),
                _ => {}
            }
            if state.faults.disconnects > 0
                && !matches!(entry.router, RouterPhase::Idle | RouterPhase::Ended)
            {
                actions.push(Action::Disconnect(r));
            }
            if !TransferSpec::writes_pending(state, r, entry.attempt) {
                match entry.prefill {
                    PrefillPhase::Writing { .. } => actions.push(Action::SendDone(r)),
                    PrefillPhase::Aborting => actions.push(Action::AckAbort(r)),
                    _ => {}
                }
            }
        }
        for index in 0..state.net.len() {
            if index > 0 && state.net[index] == state.net[index - 1] {
                continue;
            }
            actions.push(Action::Deliver(index));
            if state.faults.drops > 0 {
                actions.push(Action::Drop(index));
            }
            if state.faults.duplicates > 0 {
                actions.push(Action::Duplicate(index));
            }
            if state.faults.corruptions > 0 && matches!(state.net[index], Msg::Page { .. }) {
                actions.push(Action::Corrupt(index));
            }
        }
        for index in 0..state.writes.len() {
            if index > 0 && state.writes[index] == state.writes[index - 1] {
                continue;
            }
            actions.push(Action::Land(index));
            if state.faults.corruptions > 0 {
                actions.push(Action::CorruptWrite(index));
            }
        }
        if state.faults.link_resets > 0 && !(state.net.is_empty() && state.writes.is_empty()) {
            actions.push(Action::LinkReset);
        }
        // A crash matters only while something is under way; at rest it would only reset the
        // pool, and could hide a leak from the terminal-state checks.
        if state.faults.crashes > 0 && !TransferSpec::quiescent(state) {
            actions.push(Action::CrashPrefill);
            actions.push(Action::CrashDecode);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        state.events = 0;
        match action {
            Action::Submit(r) => {
                if self.oversize(r) && !self.has(Mutant::NoAdmission) {
                    // I3: refused with its reason before any page is touched.
                    self.end(&mut state, r, Answer::Rejected);
                } else {
                    state.requests[r as usize].router = RouterPhase::WaitingDecode;
                }
            }
            Action::Reserve(r) => self.reserve(&mut state, r, false),
            Action::ReservePlaceholder(r) => {
                state.faults.placeholders -= 1;
                self.reserve(&mut state, r, true);
            }
            Action::Deliver(index) => {
                let msg = state.net.remove(index);
                self.deliver(&mut state, msg);
            }
            Action::Land(index) => {
                let write = state.writes.remove(index);
                self.land_write(&mut state, write);
            }
            Action::SendDone(r) => {
                let attempt = state.requests[r as usize].attempt;
                let PrefillPhase::Writing { pages: sent } = state.requests[r as usize].prefill
                else {
                    unreachable!("SendDone is enabled only while writing");
                };
                state.net.push(Msg::Done {
                    request: r,
                    attempt,
                    pages: sent,
                    checksum: self.checksum(r, attempt, sent),
                });
                state.requests[r as usize].prefill = PrefillPhase::Sent;
            }
            Action::AckAbort(r) => {
                let attempt = state.requests[r as usize].attempt;
                state.net.push(Msg::WriteAbortAck {
                    request: r,
                    attempt,
                });
                TransferSpec::prefill_release(&mut state, r);
            }
            Action::DecodeStep(r) => self.decode_step(&mut state, r),
            Action::StaleStep(r) => self.stale_step(&mut state, r),
            // Decode gives up on a transfer (the engine's `transfer_timeout`).
            Action::Timeout(r) => self.abort_decode(&mut state, r, Answer::Failed),
            Action::Disconnect(r) => {
                state.faults.disconnects -= 1;
                self.end(&mut state, r, Answer::Gone);
                if self.one_sided() {
                    // The router's abort reaches decode, which drives the transfer to an end.
                    self.abort_decode(&mut state, r, Answer::Gone);
                } else {
                    // The router's abort reaches both: decode drops its reservation at once;
                    // prefill, if still sending, asks decode through the protocol (I7).
                    let entry = &state.requests[r as usize];
                    let attempt = entry.attempt;
                    let sending = entry.prefill != PrefillPhase::Idle;
                    if entry.decode != DecodePhase::Idle && !self.has(Mutant::NoDecodeAbort) {
                        self.fail_decode(&mut state, r, Answer::Gone);
                    }
                    if sending {
                        state.net.push(Msg::TransferAbort {
                            request: r,
                            attempt,
                        });
                    }
                }
            }
            Action::Retry(r) => {
                state.faults.retries -= 1;
                let entry = &mut state.requests[r as usize];
                entry.attempt += 1;
                entry.responses = 0;
                entry.router = RouterPhase::WaitingDecode;
            }
            Action::Drop(index) => {
                state.faults.drops -= 1;
                state.net.remove(index);
            }
            Action::Duplicate(index) => {
                state.faults.duplicates -= 1;
                let msg = state.net[index].clone();
                state.net.push(msg);
            }
            Action::Corrupt(index) => {
                state.faults.corruptions -= 1;
                if let Msg::Page { content, .. } = &mut state.net[index] {
                    *content = Content::Junk;
                }
            }
            Action::CorruptWrite(index) => {
                state.faults.corruptions -= 1;
                state.writes[index].content = Content::Junk;
            }
            Action::LinkReset => {
                // The prefill-decode link breaks: nothing in flight arrives (one-sided: the
                // queue pair is torn down, so no posted write lands any more: the fence), and
                // each side releases what only that link could still touch (I5 allows it).
                state.faults.link_resets -= 1;
                state.net.clear();
                state.writes.clear();
                for r in 0..state.requests.len() as u8 {
                    TransferSpec::prefill_release(&mut state, r);
                    if matches!(
                        state.requests[r as usize].decode,
                        DecodePhase::Receiving { .. } | DecodePhase::Quarantined { .. }
                    ) {
                        self.fail_decode(&mut state, r, Answer::Failed);
                    }
                }
            }
            Action::CrashPrefill => {
                // Its memory is gone with it, and its links: nothing it sent arrives any more,
                // and decode fails every transfer it was waiting for.
                state.faults.crashes -= 1;
                if in_transfer(&state) {
                    state.events |= event::CRASH_MID_TRANSFER;
                }
                state.net.clear();
                state.writes.clear();
                for r in 0..state.requests.len() as u8 {
                    state.requests[r as usize].prefill = PrefillPhase::Idle;
                    if matches!(
                        state.requests[r as usize].decode,
                        DecodePhase::Receiving { .. } | DecodePhase::Quarantined { .. }
                    ) {
                        self.fail_decode(&mut state, r, Answer::Failed);
                    }
                }
            }
            Action::CrashDecode => {
                // A restarted decode worker starts with a fresh pool (`PagePool::new`: every
                // page free, zeroed, at generation 0) and nothing of the old links; nothing
                // from before the crash reaches it. Prefill sees its link drop.
                state.faults.crashes -= 1;
                if in_transfer(&state) {
                    state.events |= event::CRASH_MID_TRANSFER;
                }
                state.net.clear();
                state.writes.clear();
                state.pool = Pool::new(self.pool_pages);
                state.content = vec![Content::Empty; self.pool_pages as usize];
                for r in 0..state.requests.len() as u8 {
                    let entry = &mut state.requests[r as usize];
                    entry.decode = DecodePhase::Idle;
                    entry.stale = None;
                    entry.prefill = PrefillPhase::Idle;
                    if !matches!(entry.router, RouterPhase::Idle | RouterPhase::WaitingDecode) {
                        self.end(&mut state, r, Answer::Failed);
                    }
                }
            }
        }
        state.net.sort();
        state.writes.sort();
        // A released table matters only while a page frame of that attempt is in flight (the
        // stale path) or a stale read may still happen; forgetting it afterwards merges states
        // that cannot behave differently.
        let stale_reads = state.faults.stale_reads > 0;
        for (r, entry) in state.requests.iter_mut().enumerate() {
            let live = stale_reads
                || entry.stale.as_ref().is_some_and(|stale| {
                    state.net.iter().any(|m| {
                        matches!(*m, Msg::Page { request, attempt, .. }
                        if request as usize == r && attempt == stale.attempt)
                    })
                });
            if !live {
                entry.stale = None;
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties: Vec<Property<Self>> = vec![
            Property::always(
                "S1/I1 a decode step reads only its own request's KV",
                |_, s: &State| !s.ghost.read_foreign,
            ),
            Property::always(
                "S1/I4 a decode step reads only verified KV",
                |_, s: &State| !s.ghost.read_corrupt,
            ),
            Property::always(
                "S2 a transfer is sealed only when every page holds this attempt's KV",
                |_, s: &State| !s.ghost.bad_commit,
            ),
            Property::always(
                "S3 every page is free or held by exactly one request, the one its header names",
                |_, s: &State| TransferSpec::single_ownership(s),
            ),
            Property::always(
                "S4/I5 no write lands in a page its transfer does not hold",
                |_, s: &State| !s.ghost.wrote_foreign,
            ),
            Property::always(
                "S4 no page is freed while a write to it may still land",
                |_, s: &State| !s.ghost.freed_under_writer,
            ),
            Property::always(
                "I5 prefill frees its source pages only once no write from them is in flight",
                |_, s: &State| !s.ghost.source_freed_under_write,
            ),
            Property::always(
                "S6 200 headers only after a verified commit",
                |_, s: &State| {
                    s.requests.iter().all(|r| {
                        r.router != RouterPhase::Streaming
                            || matches!(r.decode, DecodePhase::Decoding { .. })
                    })
                },
            ),
            Property::always(
                "S7 an aborted transfer is never committed",
                |_, s: &State| !s.ghost.committed_after_end,
            ),
            Property::always(
                "S10 a request that can never fit is never admitted",
                |m: &TransferSpec, s: &State| {
                    (0..s.requests.len() as u8)
                        .filter(|&r| m.oversize(r))
                        .all(|r| {
                            matches!(
                                s.requests[r as usize].router,
                                RouterPhase::Idle | RouterPhase::Ended
                            )
                        })
                },
            ),
            Property::always(
                "S11/I6 at most one answer per request, and one once it ended",
                |_, s: &State| {
                    s.requests
                        .iter()
                        .all(|r| r.responses == u8::from(r.router == RouterPhase::Ended))
                },
            ),
            Property::always(
                "S11 every answer is of the kind the request allows",
                |_, s: &State| !s.ghost.wrong_answer,
            ),
            Property::always("I9 a quiescent pool is whole", |_, s: &State| {
                !TransferSpec::quiescent(s)
                    || s.pool.headers().iter().all(|h| h.state == PageState::Free)
            }),
            Property::always(
                "the engine's expectations hold (own pages verify, release, change state)",
                |_, s: &State| !s.ghost.engine_panic,
            ),
            Property::sometimes(
                "R1 a request is answered from its own KV",
                |_, s: &State| s.events & event::COMPLETED != 0,
            ),
        ];
        // Liveness, judged at terminal states (stateright's `eventually` is sound only on
        // terminating paths, and every path here terminates: faults and retries are bounded).
        // A lost frame on a one-sided transport leaves a quarantine waiting for an answer that
        // never comes until the link is torn down (T16: by design); so does a lost answer to
        // prefill on either transport.
        if !(self.one_sided() && self.faults.drops > 0) {
            properties.push(Property::always(
                "L1 at every terminal state each request has ended with exactly one answer",
                |m: &TransferSpec, s: &State| {
                    !m.terminal(s)
                        || s.requests
                            .iter()
                            .all(|r| r.router == RouterPhase::Ended && r.responses == 1)
                },
            ));
        }
        if self.faults.drops == 0 {
            properties.push(Property::always(
                "L2 at every terminal state the pool is whole and nothing is in flight or held",
                |m: &TransferSpec, s: &State| {
                    !m.terminal(s)
                        || (TransferSpec::quiescent(s)
                            && s.pool.pages_free() == s.pool.headers().len())
                },
            ));
            properties.push(Property::always(
                "L3 at every terminal state no page is quarantined",
                |m: &TransferSpec, s: &State| {
                    !m.terminal(s)
                        || s.pool
                            .headers()
                            .iter()
                            .all(|h| h.state != PageState::Quarantined)
                },
            ));
        }
        if self.faults.disconnects > 0 {
            properties.push(Property::sometimes(
                "R2 an abort races the transfer's Done",
                |_, s: &State| {
                    s.net.iter().any(|m| match *m {
                        Msg::TransferAbort { request, attempt }
                        | Msg::WriteAbort { request, attempt } => s.net.iter().any(|d| {
                            matches!(*d, Msg::Done { request: r, attempt: a, .. }
                                if r == request && a == attempt)
                        }),
                        _ => false,
                    })
                },
            ));
        }
        // Pages change hands only between transfers: two requests that fit, or a retry.
        let fitting = (0..self.requests.len() as u8)
            .filter(|&r| !self.oversize(r))
            .count();
        let reuse = fitting >= 2 || self.faults.retries > 0;
        if self.transport == Transport::Framed {
            if reuse {
                properties.push(Property::sometimes(
                    "R3 a page is allocated again while frames of the transfer that had it are in flight",
                    |_, s: &State| reused_under_old_frames(s),
                ));
            }
            properties.push(Property::sometimes(
                "R4 a stale frame is refused by the page check",
                |_, s: &State| s.events & event::STALE_REFUSED != 0,
            ));
        } else {
            if fitting >= 2 {
                properties.push(Property::sometimes(
                    "R3 a quarantined reservation is freed on the writer's ack while a request waits for pages",
                    |_, s: &State| s.events & event::QUARANTINE_FREED_FOR_WAITER != 0,
                ));
            }
            properties.push(Property::sometimes(
                "a posted write lands in a quarantined page",
                |_, s: &State| s.events & event::LANDED_IN_QUARANTINE != 0,
            ));
        }
        if self.faults.corruptions > 0 {
            properties.push(Property::sometimes(
                "R5 a corruption is caught by the checksum",
                |_, s: &State| s.events & event::CORRUPTION_CAUGHT != 0,
            ));
        }
        if self.faults.stale_reads > 0 {
            properties.push(Property::sometimes(
                "a stale read is refused by the page check",
                |_, s: &State| s.events & event::STALE_READ_REFUSED != 0,
            ));
        }
        if self.faults.crashes > 0 {
            properties.push(Property::sometimes(
                "R6 a worker crashes mid-transfer",
                |_, s: &State| s.events & event::CRASH_MID_TRANSFER != 0,
            ));
        }
        properties
    }
}

/// A write of `request`'s transfer `attempt` into (`page`, `generation`) would land in a page
/// that transfer does not hold: another request's, or another attempt's of the same request
/// (the model reuses a request's identity across retries, so only the generation and the
/// reservation tell attempts apart).
fn foreign(state: &State, request: u8, attempt: u8, page: u8, generation: u8) -> bool {
    let header = state.pool.header(page);
    let entry = &state.requests[request as usize];
    header.owner != Some(request)
        || header.generation != generation
        || entry.attempt != attempt
        || !entry
            .decode
            .table()
            .is_some_and(|t| t.contains(&(page, generation)))
}

/// R3: a page of a released table belongs to another transfer now, while a page frame of the
/// transfer that released it is still in flight (it ended early: aborted, failed, timed out).
fn reused_under_old_frames(state: &State) -> bool {
    state.requests.iter().enumerate().any(|(r, entry)| {
        let Some(stale) = &entry.stale else {
            return false;
        };
        let reused = stale.table.iter().any(|&(page, generation)| {
            let header = state.pool.header(page);
            header.owner.is_some()
                && (header.owner != Some(r as u8) || header.generation != generation)
        });
        reused
            && state.net.iter().any(|m| {
                msg_request(m) == r as u8
                    && match *m {
                        Msg::Page { attempt, .. } => attempt == stale.attempt,
                        _ => false,
                    }
            })
    })
}

/// A transfer is under way: pages reserved for it or held to send.
fn in_transfer(state: &State) -> bool {
    state.requests.iter().any(|r| {
        matches!(r.decode, DecodePhase::Receiving { .. }) || r.prefill != PrefillPhase::Idle
    })
}
