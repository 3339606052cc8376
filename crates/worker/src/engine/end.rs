//! How requests end other than by finishing: aborts, timeouts and lost links, all through
//! [`Engine::end`], which reports once (I6) and releases the pages (I9); pages a receiver may
//! still read stay held until it answers or its link is gone (I5, I7).

use super::{failed, Engine, Key, LinkId, LinkKind, Phase, Request, Stage};
use kv::PageState;
use std::time::Instant;
use transfer::{Failure, Frame, Role, TransferId};

impl Engine {
    pub(super) fn abort(&mut self, key: Key) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        if let Phase::Admitted {
            stage:
                Stage::Sending {
                    transfer,
                    peer,
                    abort_sent,
                    ..
                },
            ..
        } = &mut request.phase
        {
            // Pages stay until the receiver answers (I5).
            if !*abort_sent {
                *abort_sent = true;
                let frame = Frame::TransferAbort {
                    transfer: *transfer,
                    request: key.1,
                };
                let peer = *peer;
                self.send(peer, frame);
            }
            return;
        }
        self.end(
            key,
            Err((Failure::Aborted, "the request was cancelled".into())),
        );
    }

    pub(super) fn expire(&mut self, now: Instant) {
        let queue_timeout = self.config.queue_timeout;
        let transfer_timeout = self.config.transfer_timeout;
        let mut expired = Vec::new();
        for (key, request) in &self.requests {
            let stage = match &request.phase {
                Phase::Queued => {
                    if now - request.arrived > queue_timeout {
                        expired.push((*key, Failure::QueueTimeout));
                    }
                    continue;
                }
                Phase::Admitted { stage, .. } => stage,
            };
            match stage {
                // Until the first frame arrives the prefill may still be queued for pages;
                // then the clock runs from the latest frame (prefill streams pages as its
                // chunks complete them, so silence, not the prompt's length, is what times
                // out).
                Stage::Receiving { transfer, since } => {
                    let deadline = match self.grants.activity(*transfer) {
                        (Some(_), Some(last_frame)) => last_frame + transfer_timeout,
                        _ => *since + queue_timeout + transfer_timeout,
                    };
                    if now > deadline {
                        expired.push((*key, Failure::TransferTimeout))
                    }
                }
                Stage::Sending {
                    since,
                    quarantined: false,
                    ..
                } if now - *since > transfer_timeout => {
                    expired.push((*key, Failure::TransferTimeout))
                }
                _ => {}
            }
        }
        for (key, failure) in expired {
            let waited = match failure {
                Failure::QueueTimeout => queue_timeout,
                _ => transfer_timeout,
            };
            let message = format!("{failure:?} after {waited:?}; retry later");
            if let Some(Phase::Admitted {
                table,
                stage: Stage::Sending { quarantined, .. },
            }) = self.requests.get_mut(&key).map(|r| &mut r.phase)
            {
                // The receiver may still be reading what we sent: the pages are neither freed
                // nor readable until it answers or its link is gone.
                *quarantined = true;
                self.pool
                    .set_state(table, PageState::Quarantined)
                    .expect("Sending -> Quarantined");
                self.report(key, Err((failure, message)));
                continue;
            }
            self.end(key, Err((failure, message)));
        }
    }

    pub(super) fn link_down(&mut self, link: LinkId) {
        let Some(entry) = self.links.remove(&link) else {
            return;
        };
        let affected: Vec<Key> = self
            .requests
            .iter()
            .filter(|(key, request)| match entry.kind {
                LinkKind::Router => key.0 == link,
                LinkKind::DecodePeer => request.peer == Some(link),
                LinkKind::PrefillPeer => match request.phase {
                    Phase::Admitted {
                        stage: Stage::Receiving { transfer, .. },
                        ..
                    } => self.grants.activity(transfer).0 == Some(link),
                    _ => false,
                },
            })
            .map(|(key, _)| *key)
            .collect();
        for key in affected {
            let sending = self.requests.get(&key).is_some_and(|request| {
                matches!(
                    request.phase,
                    Phase::Admitted {
                        stage: Stage::Sending { .. },
                        ..
                    }
                )
            });
            if entry.kind == LinkKind::Router && sending {
                // The decode side may still be reading what we sent: abort through the
                // protocol and keep the pages until it answers (I5).
                self.abort(key);
                continue;
            }
            let message = match entry.kind {
                LinkKind::Router => "the router went away",
                LinkKind::DecodePeer => "the link to the decode worker was lost",
                LinkKind::PrefillPeer => "the link to the prefill worker was lost",
            };
            let failure = match entry.kind {
                LinkKind::Router => Failure::Aborted,
                _ => Failure::PeerUnavailable,
            };
            // A lost link can no longer touch our pages: nothing arrives from it any more and
            // nothing it held of ours is read again, so release is safe (I5). A one-sided
            // prefill's writes are the exception: its quarantined pages wait for its fence.
            self.end(key, Err((failure, message.to_string())));
        }
        if entry.kind == LinkKind::PrefillPeer {
            self.grants.link_down(link);
        }
    }

    /// Prefill: decode dropped `transfer`'s reservation and asks us to stop writing into it.
    /// The request ends (decode has told the router), and the answer goes on the link behind
    /// every page already handed to it, so the link's writer sends it only once those writes
    /// have landed.
    pub(super) fn write_abort(&mut self, link: LinkId, transfer: TransferId) {
        let key = self.requests.iter().find_map(|(key, request)| {
            let ours = request.peer == Some(link);
            let named = match &request.phase {
                Phase::Admitted {
                    stage:
                        Stage::Prefilling {
                            stream: Some(stream),
                            ..
                        },
                    ..
                } => stream.transfer() == transfer,
                Phase::Admitted {
                    stage: Stage::Sending { transfer: sent, .. },
                    ..
                } => *sent == transfer,
                _ => false,
            };
            (ours && named).then_some(*key)
        });
        if let Some(key) = key {
            self.outbound.remove(&transfer);
            let message = "the decode worker dropped the transfer".to_string();
            self.end(key, Err((Failure::TransferFailed, message)));
        }
        self.send(link, Frame::WriteAbortAck { transfer });
    }

    /// Ends a request: tells the router (once), releases its pages, forgets it.
    pub(super) fn end(&mut self, key: Key, outcome: Result<Frame, (Failure, String)>) {
        let error = outcome.as_ref().err().map(|(_, message)| message.clone());
        self.report(key, outcome);
        let Some(request) = self.requests.remove(&key) else {
            return;
        };
        self.record_span(&request, error);
        self.queue.retain(|queued| *queued != key);
        let Phase::Admitted { table, stage } = request.phase else {
            return;
        };
        match stage {
            Stage::Receiving { transfer, .. } => {
                self.inbound.remove(&transfer);
                // Leases go back (one a reader is writing into, when its write ends; the
                // page is parked until then). A one-sided prefill may still be writing: the
                // pages stay quarantined until it says it has stopped.
                let quarantine = self.config.faults.write_quarantined();
                if let Some(writer) = self.grants.revoke(transfer, quarantine) {
                    self.send(writer, Frame::WriteAbort { transfer });
                }
            }
            Stage::Sending { transfer, .. } => {
                self.outbound.remove(&transfer);
            }
            Stage::Prefilling { .. } | Stage::Decoding(_) => {}
        }
        // A table that no longer verifies frees nothing: its pages are someone else's now,
        // and that is a bug worth counting, not a reason to free them again.
        if let Err(error) = self.pool.release(table) {
            self.ownership_failures += 1;
            tracing::error!(%error, "a request's pages did not verify at release");
        }
    }

    /// The request's span on this worker, a child of the router's, when the router sent its
    /// trace and this worker exports spans.
    fn record_span(&self, request: &Request, error: Option<String>) {
        let (Some(parent), true) = (request.submit.trace, self.config.tracer.is_on()) else {
            return;
        };
        let role = match self.config.role {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Unified => "unified",
        };
        let int = |n: usize| otlp::Value::Int(n as i64);
        self.config.tracer.record(otlp::Span {
            context: parent.child(),
            parent: Some(parent.span_id),
            name: role.to_string(),
            kind: otlp::SpanKind::Server,
            start: request.received_at,
            end: std::time::SystemTime::now(),
            attributes: vec![
                ("airlock.worker", otlp::Value::Str(self.config.name.clone())),
                ("airlock.request_id", int(request.submit.request.0 as usize)),
                ("airlock.prompt_tokens", int(request.submit.prompt.len())),
                ("airlock.cached_tokens", int(request.cached_tokens)),
            ],
            error,
        });
    }

    fn report(&mut self, key: Key, outcome: Result<Frame, (Failure, String)>) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        if request.reported {
            return;
        }
        let frame = match outcome {
            // An Ack ends a prefill's part: the router hears the outcome from decode.
            Ok(Frame::Ack { .. }) => return,
            Ok(frame) => frame,
            Err((failure, message)) => failed(key.1, failure, message),
        };
        request.reported = true;
        self.send(key.0, frame);
    }
}
