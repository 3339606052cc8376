//! Prefill's side: look up its cache, compute the rest of the prompt, publish its full pages,
//! send decode the pages it lacks and a `Done` over all of them; release on decode's answer.

use kv::PageState;
use transfer::transfer_checksum;

use super::{
    content_bytes, event, Key, Msg, PrefillPhase, PrefixSpec, PrefixState, RouterPhase, Side,
};

impl PrefixSpec {
    /// Prefill runs the request: admit, compute the pages it does not reuse (reading the ones
    /// it does), publish its full pages (`CacheInsert`: its own computation needs no
    /// verification), send pages `claim..` and `Done`.
    pub(super) fn prefill(&self, state: &mut PrefixState, request: u8, claim: u8) {
        let RouterPhase::WaitingPrefill { reused } = state.requests[request as usize].router else {
            unreachable!("Prefill is enabled only once decode has reserved");
        };
        if claim != reused {
            state.faults.misclaims -= 1;
        }
        let mut held = self.admit(state, Side::Prefill, request);
        if !held.shared.is_empty() {
            state.events |= event::PREFILL_REUSED;
        }
        let reads = held.shared.len();
        self.read(state, Side::Prefill, request, &held, reads);
        let tenant = self.spec(request).tenant;
        for slot in held.shared.len()..held.len() {
            let kv = self.own_kv(request, slot as u8);
            state.prefill.content[held.page(slot) as usize] = kv;
        }
        let sealed = state
            .prefill
            .pool
            .set_state(request, &held.private, PageState::Sealed);
        assert!(sealed.is_ok(), "a request's own pages seal");
        let prompt = self.spec(request).prompt;
        let hits = held.shared.len();
        let published = state.prefill.publish(
            request,
            |index| Key {
                tenant,
                prompt,
                index,
            },
            self.full_pages(request),
            &mut held,
        );
        if hits > 0 && published > 0 {
            state.events |= event::CHAIN_EXTENDED;
        }
        let contents = state.prefill.contents(&held);
        for (index, &content) in contents.iter().enumerate().skip(claim as usize) {
            state.net.push(Msg::Page {
                request,
                index: index as u8,
                content,
            });
        }
        let pages = held.len() as u8;
        let bytes: Vec<_> = contents.iter().map(|&c| content_bytes(c)).collect();
        let checksum = transfer_checksum(&self.done(request, pages), bytes.iter().map(|b| &b[..]));
        state.net.push(Msg::Done {
            request,
            pages,
            reused: claim,
            checksum,
        });
        let entry = &mut state.requests[request as usize];
        entry.prefill = PrefillPhase::Sent { held };
        entry.router = RouterPhase::WaitingStart;
    }

    /// Decode answered: prefill drops its table (`Engine::sent`).
    pub(super) fn prefill_release(&self, state: &mut PrefixState, request: u8) {
        let phase = std::mem::replace(
            &mut state.requests[request as usize].prefill,
            PrefillPhase::Idle,
        );
        if let PrefillPhase::Sent { held } = phase {
            if !state.prefill.release(request, &held) {
                state.ghost.engine_panic = true;
            }
        }
    }
}
