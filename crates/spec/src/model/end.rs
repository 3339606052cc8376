//! How a request ends: the router's one answer, and the release of decode's and prefill's
//! pages on every path out (failure, abort, quarantine).

use kv::PageState;

use super::{
    Answer, DecodePhase, Msg, Mutant, PrefillPhase, RouterPhase, Stale, State, TransferSpec,
};
use crate::pages::Table;

impl TransferSpec {
    /// The router answers the client, once.
    pub(super) fn end(&self, state: &mut State, request: u8, answer: Answer) {
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
    pub(super) fn release(&self, state: &mut State, request: u8, table: &Table) {
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

    pub(super) fn set_state(&self, state: &mut State, request: u8, table: &Table, to: PageState) {
        if state.pool.set_state(request, table, to).is_err() {
            state.ghost.engine_panic = true;
        }
    }

    /// Decode ends what it holds for the request at once: the transfer failed verification,
    /// or whatever could still write into the pages is known to be over (`Done` was sent
    /// after the writes completed; the link is gone).
    pub(super) fn fail_decode(&self, state: &mut State, request: u8, answer: Answer) {
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
    pub(super) fn abort_decode(&self, state: &mut State, request: u8, answer: Answer) {
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
    pub(super) fn prefill_release(state: &mut State, request: u8) {
        let entry = &mut state.requests[request as usize];
        if entry.prefill != PrefillPhase::Idle {
            entry.prefill = PrefillPhase::Idle;
            let attempt = entry.attempt;
            if TransferSpec::writes_pending(state, request, attempt) {
                state.ghost.source_freed_under_write = true;
            }
        }
    }

    pub(super) fn writes_pending(state: &State, request: u8, attempt: u8) -> bool {
        state
            .writes
            .iter()
            .any(|w| w.request == request && w.attempt == attempt)
    }
}
