//! The model: state, actions (including faults), properties.

use kv::{RequestId, TenantId};
use stateright::{Model, Property};
use transfer::{transfer_checksum, Inbound, TransferDone, TransferId};

/// A guard removed on purpose, to show the checker notices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// Writes and reads skip the page owner/generation comparison.
    NoOwnerCheck,
    /// Allocation does not bump the page generation.
    NoGenerationBump,
    /// Decode seals without comparing the checksum.
    NoChecksum,
    /// Decode seals without comparing token and page counts to the reservation.
    NoLengthCheck,
    /// Prefill frees its pages as soon as it has sent them, not on decode's answer.
    NoDeferredRelease,
    /// The router admits a request larger than the pool, and decode gives it what it can.
    NoAdmission,
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
pub enum PageState {
    Free,
    Receiving,
    Sealed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Page {
    pub owner: Option<u8>,
    pub generation: u8,
    pub state: PageState,
    pub content: Content,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouterPhase {
    Idle,
    WaitingDecode,
    WaitingStart,
    Streaming,
    Ended,
}

/// (page, generation recorded at allocation).
type Table = Vec<(u8, u8)>;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodePhase {
    Idle,
    Receiving { table: Table, inbound: Inbound },
    Decoding { table: Table },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub router: RouterPhase,
    pub attempt: u8,
    /// Answers the client got for the current attempt (I6: at most one).
    pub responses: u8,
    pub decode: DecodePhase,
    /// Prefill holds the request's source pages.
    pub prefill_holds: bool,
    /// A table an earlier attempt left behind: what a stale reference would still point at.
    pub stale: Option<(u8, Table)>,
}

/// Messages between prefill and decode; the network is an unordered multiset.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
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
    Abort {
        request: u8,
        attempt: u8,
    },
    Ack {
        request: u8,
        attempt: u8,
    },
    Nack {
        request: u8,
        attempt: u8,
    },
    AbortAck {
        request: u8,
        attempt: u8,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub pages: Vec<Page>,
    pub requests: Vec<Request>,
    pub net: Vec<Msg>,
    pub faults: Faults,
    // Ghost flags, set by the action that breaks an invariant.
    pub read_foreign: bool,
    pub read_corrupt: bool,
    pub wrote_foreign: bool,
    pub released_early: bool,
    pub over_capacity: bool,
    pub stale_refused: bool,
    pub completed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Submit(u8),
    Reserve(u8),
    /// Reserve, with the incident's placeholder transfer from prefill.
    ReservePlaceholder(u8),
    Deliver(usize),
    DecodeStep(u8),
    Timeout(u8),
    Disconnect(u8),
    Retry(u8),
    Drop(usize),
    Duplicate(usize),
    Corrupt(usize),
    LinkReset,
    CrashPrefill,
    CrashDecode,
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

    /// The owner/generation check of `kv::PagePool::verify_page`.
    fn verify(&self, page: &Page, request: u8, generation: u8) -> bool {
        self.has(Mutant::NoOwnerCheck)
            || (page.owner == Some(request) && page.generation == generation)
    }

    /// Frees a request's decode pages (through the check, as `PagePool::release` does).
    fn release(&self, state: &mut State, request: u8, table: &Table) {
        for &(page, generation) in table {
            let entry = &mut state.pages[page as usize];
            if entry.owner == Some(request) && entry.generation == generation {
                entry.owner = None;
                entry.state = PageState::Free;
            }
        }
        let attempt = state.requests[request as usize].attempt;
        state.requests[request as usize].stale = Some((attempt, table.clone()));
    }

    /// The router answers the client once.
    fn end(state: &mut State, request: u8) {
        let entry = &mut state.requests[request as usize];
        if entry.router != RouterPhase::Ended {
            entry.router = RouterPhase::Ended;
            entry.responses += 1;
        }
    }

    /// Decode drops whatever it holds for the request and fails it.
    fn fail_decode(&self, state: &mut State, request: u8) {
        let decode = std::mem::replace(
            &mut state.requests[request as usize].decode,
            DecodePhase::Idle,
        );
        match decode {
            DecodePhase::Receiving { table, .. } | DecodePhase::Decoding { table } => {
                self.release(state, request, &table)
            }
            DecodePhase::Idle => {}
        }
        TransferSpec::end(state, request);
    }

    fn prefill_release(state: &mut State, request: u8, answered: bool) {
        let entry = &mut state.requests[request as usize];
        if entry.prefill_holds {
            entry.prefill_holds = false;
            if !answered {
                state.released_early = true;
            }
        }
    }

    fn reserve(&self, state: &mut State, request: u8, placeholder: bool) {
        let needed = self.requests[request as usize].pages;
        let free: Vec<u8> = (0..self.pool_pages)
            .filter(|&p| state.pages[p as usize].state == PageState::Free)
            .collect();
        let taking = needed.min(free.len() as u8);
        let mut table = Vec::new();
        for &page in free.iter().take(taking as usize) {
            let entry = &mut state.pages[page as usize];
            if !self.has(Mutant::NoGenerationBump) {
                entry.generation += 1;
            }
            entry.owner = Some(request);
            entry.state = PageState::Receiving;
            table.push((page, entry.generation));
        }
        if needed > self.pool_pages {
            state.over_capacity = true;
        }
        let attempt = state.requests[request as usize].attempt;
        let inbound = Inbound::new(
            transfer_id(request, attempt),
            RequestId(u64::from(request)),
            self.tenant(request),
            u32::from(needed),
            1,
            PAGE_BYTES,
        );
        let entry = &mut state.requests[request as usize];
        entry.decode = DecodePhase::Receiving { table, inbound };
        entry.router = RouterPhase::WaitingStart;
        // The router now asks prefill, which sends every page and `Done`.
        entry.prefill_holds = true;
        let content = Content::Data { request, attempt };
        // The placeholder claims one page, and its checksum agrees with that claim.
        let sent = if placeholder { 1 } else { needed };
        for index in 0..sent {
            state.net.push(Msg::Page {
                request,
                attempt,
                index,
                content,
            });
        }
        let mut done = self.done(request, attempt, sent);
        let pages = vec![content_bytes(content); sent as usize];
        done.checksum = transfer_checksum(&done, pages.iter().map(|p| &p[..]));
        state.net.push(Msg::Done {
            request,
            attempt,
            pages: sent,
            checksum: done.checksum,
        });
        if self.has(Mutant::NoDeferredRelease) {
            TransferSpec::prefill_release(state, request, false);
        }
    }

    fn deliver(&self, state: &mut State, msg: Msg) {
        match msg {
            Msg::Page {
                request,
                attempt,
                index,
                content,
            } => self.land_page(state, request, attempt, index, content),
            Msg::Done {
                request,
                attempt,
                pages,
                checksum,
            } => self.verify_done(state, request, attempt, pages, checksum),
            Msg::Abort { request, attempt } => {
                let entry = &state.requests[request as usize];
                if entry.attempt == attempt && matches!(entry.decode, DecodePhase::Receiving { .. })
                {
                    self.fail_decode(state, request);
                }
                state.net.push(Msg::AbortAck { request, attempt });
            }
            Msg::Ack { request, attempt }
            | Msg::Nack { request, attempt }
            | Msg::AbortAck { request, attempt } => {
                if state.requests[request as usize].attempt == attempt {
                    TransferSpec::prefill_release(state, request, true);
                }
            }
        }
    }

    fn land_page(&self, state: &mut State, request: u8, attempt: u8, index: u8, content: Content) {
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
                if let Ok(slot) = verdict {
                    if let Some(&(page, generation)) = table.get(slot) {
                        let entry = &state.pages[page as usize];
                        let writable =
                            self.has(Mutant::NoOwnerCheck) || entry.state == PageState::Receiving;
                        if writable && self.verify(entry, request, generation) {
                            if entry.owner != Some(request) {
                                state.wrote_foreign = true;
                            }
                            state.pages[page as usize].content = content;
                        }
                    }
                }
                return;
            }
        }
        // A frame for a transfer decode no longer holds. The engine drops it at the
        // reservation lookup; the model also lets it reach the pages through the table that
        // transfer used, as a stale reference would, so that the owner/generation check is
        // what must stop it.
        let stale = state.requests[request as usize].stale.clone();
        let Some((stale_attempt, table)) = stale else {
            return;
        };
        if stale_attempt != attempt {
            return;
        }
        if let Some(&(page, generation)) = table.get(index as usize) {
            let entry = &state.pages[page as usize];
            if self.verify(entry, request, generation) {
                if entry.owner != Some(request) {
                    state.wrote_foreign = true;
                }
                state.pages[page as usize].content = content;
            } else {
                state.stale_refused = true;
            }
        }
    }

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
        // Like the engine, hash the first `page_count` pages that `Done` names.
        let ours: Vec<[u8; PAGE_BYTES]> = table
            .iter()
            .take(pages as usize)
            .map(|&(page, _)| content_bytes(state.pages[page as usize].content))
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
                for &(page, _) in &table {
                    state.pages[page as usize].state = PageState::Sealed;
                }
                let entry = &mut state.requests[request as usize];
                entry.decode = DecodePhase::Decoding { table };
                if entry.router == RouterPhase::WaitingStart {
                    entry.router = RouterPhase::Streaming;
                }
                state.net.push(Msg::Ack { request, attempt });
            }
            Err(_) => {
                state.net.push(Msg::Nack { request, attempt });
                self.fail_decode(state, request);
            }
        }
    }

    fn decode_step(&self, state: &mut State, request: u8) {
        let DecodePhase::Decoding { table } = state.requests[request as usize].decode.clone()
        else {
            return;
        };
        let attempt = state.requests[request as usize].attempt;
        let mut refused = false;
        for &(page, generation) in &table {
            let entry = &state.pages[page as usize];
            if !self.verify(entry, request, generation) {
                // The forward pass refuses the step: the request fails, nothing is read.
                refused = true;
                break;
            }
        }
        if !refused {
            for &(page, _) in &table {
                match state.pages[page as usize].content {
                    Content::Data {
                        request: r,
                        attempt: a,
                    } if r == request && a == attempt => {}
                    Content::Data { .. } => state.read_foreign = true,
                    Content::Empty | Content::Junk => state.read_corrupt = true,
                }
            }
            if state.requests[request as usize].router == RouterPhase::Streaming {
                state.completed = true;
            }
        }
        state.requests[request as usize].decode = DecodePhase::Idle;
        self.release(state, request, &table);
        TransferSpec::end(state, request);
    }

    fn quiescent(state: &State) -> bool {
        state.net.is_empty()
            && state.requests.iter().all(|r| {
                matches!(r.router, RouterPhase::Idle | RouterPhase::Ended)
                    && r.decode == DecodePhase::Idle
                    && !r.prefill_holds
            })
    }
}

impl Model for TransferSpec {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let page = Page {
            owner: None,
            generation: 0,
            state: PageState::Free,
            content: Content::Empty,
        };
        let request = Request {
            router: RouterPhase::Idle,
            attempt: 0,
            responses: 0,
            decode: DecodePhase::Idle,
            prefill_holds: false,
            stale: None,
        };
        vec![State {
            pages: vec![page; self.pool_pages as usize],
            requests: vec![request; self.requests.len()],
            net: Vec::new(),
            faults: self.faults,
            read_foreign: false,
            read_corrupt: false,
            wrote_foreign: false,
            released_early: false,
            over_capacity: false,
            stale_refused: false,
            completed: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for (index, entry) in state.requests.iter().enumerate() {
            let r = index as u8;
            let free = state
                .pages
                .iter()
                .filter(|p| p.state == PageState::Free)
                .count() as u8;
            let needed = self.requests[index].pages;
            match entry.router {
                RouterPhase::Idle => actions.push(Action::Submit(r)),
                RouterPhase::WaitingDecode
                    if entry.decode == DecodePhase::Idle
                        && !entry.prefill_holds
                        && (free >= needed || (self.has(Mutant::NoAdmission) && free > 0)) =>
                {
                    actions.push(Action::Reserve(r));
                    if state.faults.placeholders > 0 && needed > 1 {
                        actions.push(Action::ReservePlaceholder(r));
                    }
                }
                RouterPhase::Ended
                    if state.faults.retries > 0
                        && entry.decode == DecodePhase::Idle
                        && !entry.prefill_holds =>
                {
                    actions.push(Action::Retry(r))
                }
                _ => {}
            }
            if matches!(entry.decode, DecodePhase::Decoding { .. }) {
                actions.push(Action::DecodeStep(r));
            }
            if matches!(entry.decode, DecodePhase::Receiving { .. }) {
                actions.push(Action::Timeout(r));
            }
            if state.faults.disconnects > 0
                && !matches!(entry.router, RouterPhase::Idle | RouterPhase::Ended)
            {
                actions.push(Action::Disconnect(r));
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
        if state.faults.link_resets > 0 && !state.net.is_empty() {
            actions.push(Action::LinkReset);
        }
        if state.faults.crashes > 0 {
            actions.push(Action::CrashPrefill);
            actions.push(Action::CrashDecode);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Submit(r) => {
                let needed = self.requests[r as usize].pages;
                if needed > self.pool_pages && !self.has(Mutant::NoAdmission) {
                    // I3: refused with its reason before any page is touched.
                    TransferSpec::end(&mut state, r);
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
            Action::DecodeStep(r) => self.decode_step(&mut state, r),
            // Decode gives up on a transfer (the engine's `transfer_timeout`).
            Action::Timeout(r) => self.fail_decode(&mut state, r),
            Action::Disconnect(r) => {
                state.faults.disconnects -= 1;
                TransferSpec::end(&mut state, r);
                let entry = &state.requests[r as usize];
                let attempt = entry.attempt;
                if !matches!(entry.decode, DecodePhase::Idle) {
                    self.fail_decode(&mut state, r);
                }
                if state.requests[r as usize].prefill_holds {
                    state.net.push(Msg::Abort {
                        request: r,
                        attempt,
                    });
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
            Action::LinkReset => {
                // The prefill-decode link breaks: nothing in flight arrives, and each side
                // releases what only that link could still touch (I5 allows it).
                state.faults.link_resets -= 1;
                state.net.clear();
                for r in 0..state.requests.len() as u8 {
                    TransferSpec::prefill_release(&mut state, r, true);
                    if matches!(
                        state.requests[r as usize].decode,
                        DecodePhase::Receiving { .. }
                    ) {
                        self.fail_decode(&mut state, r);
                    }
                }
            }
            Action::CrashPrefill => {
                // Its memory is gone with it, and its links: nothing it sent arrives any more,
                // and decode fails every transfer it was waiting for.
                state.faults.crashes -= 1;
                state.net.clear();
                for r in 0..state.requests.len() as u8 {
                    state.requests[r as usize].prefill_holds = false;
                    if matches!(
                        state.requests[r as usize].decode,
                        DecodePhase::Receiving { .. }
                    ) {
                        self.fail_decode(&mut state, r);
                    }
                }
            }
            Action::CrashDecode => {
                // A restarted decode worker starts with a fresh pool: every page free, every
                // generation new, nothing of the old links. Prefill sees its link drop.
                state.faults.crashes -= 1;
                state.net.clear();
                for page in &mut state.pages {
                    page.owner = None;
                    page.state = PageState::Free;
                    page.generation += 1;
                }
                for r in 0..state.requests.len() as u8 {
                    let entry = &mut state.requests[r as usize];
                    entry.decode = DecodePhase::Idle;
                    entry.stale = None;
                    entry.prefill_holds = false;
                    if !matches!(entry.router, RouterPhase::Idle | RouterPhase::WaitingDecode) {
                        TransferSpec::end(&mut state, r);
                    }
                }
            }
        }
        state.net.sort();
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties: Vec<Property<Self>> = vec![
            Property::always(
                "I1 a decode step reads only its own request's KV",
                |_, s: &State| !s.read_foreign,
            ),
            Property::always("I4 a decode step reads only verified KV", |_, s: &State| {
                !s.read_corrupt
            }),
            Property::always(
                "I5 no write lands in another request's page",
                |_, s: &State| !s.wrote_foreign,
            ),
            Property::always(
                "I5 prefill frees pages only on decode's answer",
                |_, s: &State| !s.released_early,
            ),
            Property::always("I6 at most one answer per request", |_, s: &State| {
                s.requests.iter().all(|r| r.responses <= 1)
            }),
            Property::always(
                "I3 a request that can never fit holds no page",
                |_, s: &State| !s.over_capacity,
            ),
            Property::always("I9 a quiescent pool is whole", |_, s: &State| {
                !TransferSpec::quiescent(s) || s.pages.iter().all(|p| p.state == PageState::Free)
            }),
            Property::sometimes("a request is answered from its own KV", |_, s: &State| {
                s.completed
            }),
        ];
        if self.faults.retries > 0 {
            properties.push(Property::sometimes(
                "a stale frame is refused by the page check",
                |_, s: &State| s.stale_refused,
            ));
        }
        // Liveness holds where no message is lost: a lost answer leaves the sender's pages
        // quarantined until its link is torn down, which nothing forces in the model.
        if self.faults.drops == 0 && self.faults.link_resets == 0 {
            properties.push(Property::eventually(
                "every request ends and the pool is whole",
                |_, s: &State| {
                    TransferSpec::quiescent(s)
                        && s.requests.iter().all(|r| r.router == RouterPhase::Ended)
                        && s.pages.iter().all(|p| p.state == PageState::Free)
                },
            ));
        }
        properties
    }
}
