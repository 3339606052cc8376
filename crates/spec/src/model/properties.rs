//! What the checker judges: the S/L/R properties and the predicates over states they use.

use kv::PageState;
use stateright::{Model, Property};

use super::actions::msg_request;
use super::{
    event, DecodePhase, Msg, PrefillPhase, Request, RouterPhase, State, TransferSpec, Transport,
};

impl TransferSpec {
    /// Nothing in flight and nothing held: the state every run must come back to.
    pub(super) fn quiescent(state: &State) -> bool {
        state.net.is_empty()
            && state.writes.is_empty()
            && state.requests.iter().all(|r| {
                matches!(r.router, RouterPhase::Idle | RouterPhase::Ended)
                    && r.decode == DecodePhase::Idle
                    && r.prefill == PrefillPhase::Idle
            })
    }

    /// No action is enabled: where a bounded run ends, and where liveness is judged.
    pub(super) fn terminal(&self, state: &State) -> bool {
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
    pub(super) fn single_ownership(state: &State) -> bool {
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

    /// Every property the checker judges, in the order it reports them.
    pub(super) fn property_list(&self) -> Vec<Property<Self>> {
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
pub(super) fn foreign(state: &State, request: u8, attempt: u8, page: u8, generation: u8) -> bool {
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
pub(super) fn reused_under_old_frames(state: &State) -> bool {
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
pub(super) fn in_transfer(state: &State) -> bool {
    state.requests.iter().any(|r| {
        matches!(r.decode, DecodePhase::Receiving { .. }) || r.prefill != PrefillPhase::Idle
    })
}
