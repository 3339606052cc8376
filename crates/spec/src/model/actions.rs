//! The model's actions: the initial state, which actions each state enables (the code's
//! steps and the faults), and the state each one leads to.

use stateright::{Model, Property};

use super::properties::in_transfer;
use super::{
    event, Action, Answer, Content, DecodePhase, Ghost, Msg, Mutant, PrefillPhase, Request,
    RouterPhase, State, TransferSpec,
};
use crate::pages::Pool;

pub(super) fn msg_request(msg: &Msg) -> u8 {
    match *msg {
        Msg::Page { request, .. }
        | Msg::Done { request, .. }
        | Msg::TransferAbort { request, .. }
        | Msg::Ack { request, .. }
        | Msg::Nack { request, .. }
        | Msg::AbortAck { request, .. }
        | Msg::WriteAbort { request, .. }
        | Msg::WriteAbortAck { request, .. }
        | Msg::Written { request, .. } => request,
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
        self.property_list()
    }
}
