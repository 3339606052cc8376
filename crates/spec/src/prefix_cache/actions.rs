//! The prefix-cache model's actions: the initial state, which actions each state enables (the
//! code's steps, evictions and the faults), and the state each one leads to.

use stateright::{Model, Property};

use super::{
    event, DecodePhase, Ghost, Msg, PrefillPhase, PrefixAction, PrefixSpec, PrefixState, Request,
    RouterPhase, Side, Worker,
};
use crate::Mutant;

impl Model for PrefixSpec {
    type State = PrefixState;
    type Action = PrefixAction;

    fn init_states(&self) -> Vec<PrefixState> {
        let request = Request {
            router: RouterPhase::Idle,
            responses: 0,
            prefill: PrefillPhase::Idle,
            decode: DecodePhase::Idle,
        };
        vec![PrefixState {
            prefill: Worker::new(self.prefill_pages),
            decode: Worker::new(self.decode_pages),
            requests: vec![request; self.requests.len()],
            net: Vec::new(),
            faults: self.faults,
            ghost: Ghost::default(),
            events: 0,
        }]
    }

    fn actions(&self, state: &PrefixState, actions: &mut Vec<PrefixAction>) {
        for (index, entry) in state.requests.iter().enumerate() {
            let r = index as u8;
            match entry.router {
                RouterPhase::Idle => actions.push(PrefixAction::Submit(r)),
                // Admission waits for pages; evictions may free them.
                RouterPhase::WaitingDecode
                    if self.lookup(state, Side::Decode, r).1 as usize
                        <= state.decode.pool.pages_free() =>
                {
                    actions.push(PrefixAction::Reserve(r))
                }
                RouterPhase::WaitingPrefill { reused }
                    if self.lookup(state, Side::Prefill, r).1 as usize
                        <= state.prefill.pool.pages_free() =>
                {
                    actions.push(PrefixAction::Prefill {
                        request: r,
                        claim: reused,
                    });
                    if state.faults.misclaims > 0 {
                        let claims = [reused.checked_sub(1), Some(reused + 1)];
                        for claim in claims.into_iter().flatten() {
                            if claim <= self.full_pages(r) {
                                actions.push(PrefixAction::Prefill { request: r, claim });
                            }
                        }
                    }
                }
                _ => {}
            }
            match entry.decode {
                DecodePhase::Decoding { .. } => actions.push(PrefixAction::DecodeStep(r)),
                DecodePhase::Receiving { .. } if state.faults.timeouts > 0 => {
                    actions.push(PrefixAction::Timeout(r))
                }
                _ => {}
            }
        }
        for index in 0..state.net.len() {
            if index > 0 && state.net[index] == state.net[index - 1] {
                continue;
            }
            actions.push(PrefixAction::Deliver(index));
            if state.faults.corruptions > 0 && matches!(state.net[index], Msg::Page { .. }) {
                actions.push(PrefixAction::Corrupt(index));
            }
        }
        for side in [Side::Prefill, Side::Decode] {
            for (index, entry) in state.worker(side).cache.iter().enumerate() {
                if entry.refcount == 0 || self.has(Mutant::EvictReferenced) {
                    actions.push(PrefixAction::Evict(side, index));
                }
            }
        }
    }

    fn next_state(&self, last: &PrefixState, action: PrefixAction) -> Option<PrefixState> {
        let mut state = last.clone();
        state.events = 0;
        match action {
            PrefixAction::Submit(r) => {
                state.requests[r as usize].router = RouterPhase::WaitingDecode;
            }
            PrefixAction::Reserve(r) => self.reserve(&mut state, r),
            PrefixAction::Prefill { request, claim } => self.prefill(&mut state, request, claim),
            PrefixAction::Deliver(index) => {
                let msg = state.net.remove(index);
                self.deliver(&mut state, msg);
            }
            PrefixAction::Corrupt(index) => {
                state.faults.corruptions -= 1;
                if let Msg::Page { content, .. } = &mut state.net[index] {
                    *content = super::Content::Junk;
                }
            }
            PrefixAction::DecodeStep(r) => self.decode_step(&mut state, r),
            PrefixAction::Timeout(r) => {
                state.faults.timeouts -= 1;
                self.fail_decode(&mut state, r);
            }
            PrefixAction::Evict(side, index) => {
                state.worker_mut(side).evict(index);
                state.events |= event::EVICTED;
            }
        }
        state.net.sort();
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        self.property_list()
    }
}
