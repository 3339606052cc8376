//! Decode's side of a transfer as the code runs it: reserve, deliver a message, land a page
//! frame or a posted write, verify `Done` with the real `transfer::Inbound`, and the decode
//! steps that read the pages (an honest one and a stale one).

use kv::{PageState, RequestId};
use transfer::{transfer_checksum, Inbound, Reject};

use super::properties::foreign;
use super::{
    content_bytes, event, transfer_id, Answer, Content, DecodePhase, Msg, Mutant, PrefillPhase,
    RouterPhase, State, TransferSpec, Write, PAGE_BYTES,
};
use crate::pages::Access;

impl TransferSpec {
    /// Decode reserves pages (`Engine::admit_queued` + `start`), the router asks prefill, and
    /// prefill sends its pages (framed) or posts its writes (one-sided).
    pub(super) fn reserve(&self, state: &mut State, request: u8, placeholder: bool) {
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
            0,
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
                    reported: true,
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
        entry.decode = DecodePhase::Receiving {
            table,
            inbound,
            reported: vec![None; needed as usize],
        };
        entry.router = if self.has(Mutant::HeadersBeforeSeal) {
            RouterPhase::Streaming
        } else {
            RouterPhase::WaitingStart
        };
        if self.has(Mutant::NoDeferredRelease) {
            TransferSpec::prefill_release(state, request);
        }
    }

    pub(super) fn deliver(&self, state: &mut State, msg: Msg) {
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
            Msg::Written {
                request,
                attempt,
                index,
            } => self.written(state, request, attempt, index),
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
    pub(super) fn land_frame(
        &self,
        state: &mut State,
        request: u8,
        attempt: u8,
        index: u8,
        content: Content,
    ) {
        let current = state.requests[request as usize].attempt == attempt;
        let tenant = self.tenant(request);
        if current {
            if let DecodePhase::Receiving { table, inbound, .. } =
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
    pub(super) fn land_write(&self, state: &mut State, write: Write) {
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
        // The writer reports the write once it has landed (`Frame::Written`); the mutant then
        // writes the page again, unreported.
        if write.reported {
            state.net.push(Msg::Written {
                request: write.request,
                attempt: write.attempt,
                index: write.index,
            });
            if self.has(Mutant::RewriteAfterWritten) {
                state.writes.push(Write {
                    content: Content::Junk,
                    reported: false,
                    ..write.clone()
                });
                state.writes.sort();
            }
        }
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

    /// One-sided: prefill says page `index`'s write landed (`Grants::written`): decode takes
    /// the page's hash now. A page reported twice, or past the reservation, fails the
    /// transfer, and as on any end before `Done`, other writes may still be posted: the
    /// reservation is quarantined until prefill's answer (the code also sends a `Nack`; the
    /// prefill pages a posted write reads from stay leased to it, which the model leaves out).
    /// A report for a reservation decode no longer holds changes nothing.
    fn written(&self, state: &mut State, request: u8, attempt: u8, index: u8) {
        let entry = &state.requests[request as usize];
        if entry.attempt != attempt {
            return;
        }
        let DecodePhase::Receiving {
            table, reported, ..
        } = &entry.decode
        else {
            return;
        };
        let slot = index as usize;
        let fresh = reported.get(slot).is_some_and(Option::is_none);
        let Some(&(page, _)) = table.get(slot).filter(|_| fresh) else {
            self.abort_decode(state, request, Answer::Failed);
            return;
        };
        let content = state.content[page as usize];
        if let DecodePhase::Receiving { reported, .. } =
            &mut state.requests[request as usize].decode
        {
            reported[slot] = Some(content);
        }
    }

    /// `Engine::done`.
    pub(super) fn verify_done(
        &self,
        state: &mut State,
        request: u8,
        attempt: u8,
        pages: u8,
        checksum: u64,
    ) {
        let entry = &state.requests[request as usize];
        let DecodePhase::Receiving {
            table,
            inbound,
            reported,
        } = &entry.decode
        else {
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
        // Like the engine, hash the first `page_count` pages that `Done` names: each as it was
        // when its `Written` came, or as it is now.
        let ours: Vec<[u8; PAGE_BYTES]> = table
            .iter()
            .zip(reported)
            .take(pages as usize)
            .map(|(&(page, _), reported)| {
                content_bytes(reported.unwrap_or(state.content[page as usize]))
            })
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
    pub(super) fn decode_step(&self, state: &mut State, request: u8) {
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
    pub(super) fn stale_step(&self, state: &mut State, request: u8) {
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
}
