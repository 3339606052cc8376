//! Decode's side: reserve (reusing its own cache), take page frames into its own pages only,
//! judge `Done` against its own reservation with the real `transfer::Inbound` and checksum,
//! publish what it received once verified, decode, and end.

use kv::{PageState, RequestId, TenantId};
use transfer::{transfer_checksum, Inbound, Reject, TransferId};

use super::{
    content_bytes, event, Content, DecodePhase, Key, Msg, PrefixSpec, PrefixState, RouterPhase,
    Side, PAGE_BYTES,
};
use crate::pages::Access;
use crate::Mutant;

impl PrefixSpec {
    /// Decode admits the request: its cache's hits first, its own pages for the rest, and an
    /// `Inbound` that counts the reused pages as present and refuses any frame for them. It
    /// tells the router how many it reuses.
    pub(super) fn reserve(&self, state: &mut PrefixState, request: u8) {
        let held = self.admit(state, Side::Decode, request);
        let receiving = state
            .decode
            .pool
            .set_state(request, &held.private, PageState::Receiving);
        assert!(receiving.is_ok(), "freshly allocated pages start receiving");
        let reused = held.shared.len() as u8;
        let spec = self.spec(request);
        let write_to_shared = self.has(Mutant::WriteToShared);
        let mut inbound = Inbound::new(
            TransferId(u64::from(request)),
            RequestId(u64::from(request)),
            TenantId(u64::from(spec.tenant)),
            u32::from(spec.pages),
            1,
            PAGE_BYTES,
            if write_to_shared { 0 } else { reused.into() },
        );
        if write_to_shared {
            // The receive path does not know which pages are shared: they are only counted
            // present, and a frame for one is accepted.
            for index in 0..reused {
                let present =
                    inbound.accept_page(inbound.request, inbound.tenant, index.into(), PAGE_BYTES);
                assert!(present.is_ok(), "a reused page is inside the reservation");
            }
        }
        let entry = &mut state.requests[request as usize];
        entry.decode = DecodePhase::Receiving { held, inbound };
        entry.router = RouterPhase::WaitingPrefill { reused };
    }

    pub(super) fn deliver(&self, state: &mut PrefixState, msg: Msg) {
        match msg {
            Msg::Page {
                request,
                index,
                content,
            } => self.land(state, request, index, content),
            Msg::Done {
                request,
                pages,
                reused,
                checksum,
            } => self.verify_done(state, request, pages, reused, checksum),
            Msg::Ack { request } | Msg::Nack { request } => self.prefill_release(state, request),
        }
    }

    /// A page frame arrives. Its bytes go only into one of the reservation's own pages: the
    /// real `Inbound` refuses a frame for a page decode reuses from its cache like any frame
    /// outside the reservation (`WriteToShared`: accepted and written into the cached page).
    fn land(&self, state: &mut PrefixState, request: u8, index: u8, content: Content) {
        let DecodePhase::Receiving { held, inbound } = &mut state.requests[request as usize].decode
        else {
            // No reservation: the engine drops the frame at the lookup.
            return;
        };
        let verdict =
            inbound.accept_page(inbound.request, inbound.tenant, index.into(), PAGE_BYTES);
        let held = held.clone();
        let Ok(slot) = verdict else {
            if usize::from(index) < held.shared.len() {
                state.events |= event::MISCLAIM_REFUSED;
            }
            self.refuse(state, request);
            return;
        };
        if let Some(shared) = held.shared.get(slot) {
            state.ghost.wrote_shared = true;
            state.decode.content[shared.page as usize] = content;
            return;
        }
        let own = state
            .decode
            .pool
            .verify(&[(request, &held.private)], Access::Receive, false);
        if own.is_err() {
            state.ghost.engine_panic = true;
            return;
        }
        state.decode.content[held.page(slot) as usize] = content;
    }

    /// `Done` arrives: the counts the router fixed and every page present (the reused ones
    /// by decode's own reservation, never by `Done`'s word), then the checksum over every page
    /// decode will read. Verified: seal, publish the received full pages, start decoding.
    fn verify_done(&self, state: &mut PrefixState, request: u8, pages: u8, claim: u8, sum: u64) {
        let DecodePhase::Receiving { held, inbound } = &state.requests[request as usize].decode
        else {
            state.net.push(Msg::Nack { request });
            return;
        };
        let (mut held, mut inbound) = (held.clone(), inbound.clone());
        let reused = held.shared.len() as u8;
        if self.has(Mutant::CacheBeforeVerify) {
            self.publish_received(state, request, &mut held);
        }
        if self.has(Mutant::DeltaTrustsPrefill) {
            // Decode takes `Done`'s word for which pages it already holds.
            for index in 0..claim {
                let _ =
                    inbound.accept_page(inbound.request, inbound.tenant, index.into(), PAGE_BYTES);
            }
        }
        let mut done = self.done(request, pages);
        done.checksum = sum;
        let bytes: Vec<_> = state
            .decode
            .contents(&held)
            .into_iter()
            .map(content_bytes)
            .collect();
        let computed = transfer_checksum(&done, bytes.iter().map(|b| &b[..]));
        let verified = inbound
            .check_done(&done)
            .and_then(|()| inbound.verify_checksum(&done, computed));
        if let Err(reject) = verified {
            if reject == Reject::ChecksumMismatch {
                state.events |= event::CORRUPTION_CAUGHT;
            }
            if claim != reused {
                state.events |= event::MISCLAIM_REFUSED;
            }
            state.requests[request as usize].decode = DecodePhase::Receiving { held, inbound };
            self.refuse(state, request);
            return;
        }
        if !self.whole(state, request, &held) {
            state.ghost.bad_commit = true;
        }
        let sealed = state
            .decode
            .pool
            .set_state(request, &held.private, PageState::Sealed);
        if sealed.is_err() {
            state.ghost.engine_panic = true;
        }
        if self.publish_received(state, request, &mut held) > 0 && reused > 0 {
            state.events |= event::CHAIN_EXTENDED;
        }
        let entry = &mut state.requests[request as usize];
        entry.decode = DecodePhase::Decoding { held, reused };
        entry.router = RouterPhase::Streaming;
        state.net.push(Msg::Ack { request });
    }

    /// Decode's `CacheInsert`: its own full pages, now part of the cache.
    fn publish_received(
        &self,
        state: &mut PrefixState,
        request: u8,
        held: &mut super::Held,
    ) -> usize {
        let spec = self.spec(request);
        let key = |index| Key {
            tenant: spec.tenant,
            prompt: spec.prompt,
            index,
        };
        state
            .decode
            .publish(request, key, self.full_pages(request), held)
    }

    /// S2, judged by the model rather than by the code under test: every page decode will
    /// read holds the request's own tokens' KV computed for its tenant, each reused page is
    /// cached in its tenant's namespace, and each of its own pages is still its own.
    fn whole(&self, state: &PrefixState, request: u8, held: &super::Held) -> bool {
        let spec = self.spec(request);
        let contents = state.decode.contents(held);
        held.len() == spec.pages as usize
            && contents
                .iter()
                .enumerate()
                .all(|(slot, &c)| c == self.own_kv(request, slot as u8))
            && held.shared.iter().all(|r| {
                state
                    .decode
                    .entry(r.page, r.generation)
                    .is_some_and(|e| e.key.tenant == spec.tenant)
            })
            && state
                .decode
                .pool
                .verify(&[(request, &held.private)], Access::Header, false)
                .is_ok()
    }

    /// One decode step reads every page through the page check, then the request finishes.
    pub(super) fn decode_step(&self, state: &mut PrefixState, request: u8) {
        let phase = std::mem::replace(
            &mut state.requests[request as usize].decode,
            DecodePhase::Idle,
        );
        let DecodePhase::Decoding { held, reused } = phase else {
            unreachable!("DecodeStep is enabled only while decoding");
        };
        if self.read(state, Side::Decode, request, &held, held.len()) {
            state.events |= event::COMPLETED;
            if reused > 0 {
                state.events |= event::DELTA_ANSWERED;
            }
        }
        if !state.decode.release(request, &held) {
            state.ghost.engine_panic = true;
        }
        self.end(state, request);
    }

    /// Decode refuses the transfer: `Nack`, and the request fails.
    fn refuse(&self, state: &mut PrefixState, request: u8) {
        state.net.push(Msg::Nack { request });
        self.fail_decode(state, request);
    }

    /// Decode ends what it holds for the request and the router answers with an error.
    pub(super) fn fail_decode(&self, state: &mut PrefixState, request: u8) {
        let phase = std::mem::replace(
            &mut state.requests[request as usize].decode,
            DecodePhase::Idle,
        );
        if let Some(held) = phase.held() {
            if !state.decode.release(request, held) {
                state.ghost.engine_panic = true;
            }
        }
        self.end(state, request);
    }

    /// The router answers the client, once.
    pub(super) fn end(&self, state: &mut PrefixState, request: u8) {
        let entry = &mut state.requests[request as usize];
        if entry.router != RouterPhase::Ended {
            entry.router = RouterPhase::Ended;
            entry.responses += 1;
        }
    }
}
