//! Decode's side of a transfer: page frames land only in a live reservation, and `Done` seals
//! the pages only once counts and checksum agree (I4); anything else is refused.

use super::{DecodeState, Engine, Key, LinkId, Phase, Request, Stage};
use kv::{PageState, PageTable, RequestId};
use std::time::Instant;
use transfer::{transfer_checksum, Failure, Frame, Inbound, Reject, TransferDone, TransferId};

impl Engine {
    /// The request whose reservation `transfer` is, if `link` may send to it: the first frame
    /// binds the transfer to its link, and starts the transfer's clock.
    fn receiving(&mut self, link: LinkId, transfer: TransferId) -> Option<Key> {
        let key = *self.inbound.get(&transfer)?;
        let request = self.requests.get_mut(&key)?;
        let Phase::Admitted {
            stage:
                Stage::Receiving {
                    sender,
                    since,
                    first_frame,
                    ..
                },
            ..
        } = &mut request.phase
        else {
            return None;
        };
        match sender {
            None => *sender = Some(link),
            Some(first) if *first != link => return None,
            Some(_) => {}
        }
        // The transfer's clock runs from its latest frame: before the first the prefill may
        // have been queued for pages, and between frames it is computing the next chunk.
        let now = Instant::now();
        *since = now;
        first_frame.get_or_insert(now);
        Some(key)
    }

    pub(super) fn page(
        &mut self,
        link: LinkId,
        transfer: TransferId,
        request: RequestId,
        tenant: kv::TenantId,
        index: u32,
        bytes: &[u8],
    ) {
        let Some(key) = self.receiving(link, transfer) else {
            self.frames_rejected += 1;
            return;
        };
        // receiving() found the reservation: this let only names its parts.
        let Some((table, inbound)) = self.requests.get_mut(&key).and_then(Request::reservation)
        else {
            return;
        };
        match inbound.accept_page(request, tenant, index, bytes.len()) {
            Ok(index) => {
                if self.config.faults.crash_on_page(index) {
                    crate::faults::crash("on a transfer's page");
                }
                let mut view = self
                    .pool
                    .verify_receiving(table)
                    .expect("a reservation's own pages verify");
                let page: &mut [u8] = bytemuck::cast_slice_mut(view.page_mut(index));
                page.copy_from_slice(bytes);
            }
            Err(reject) => self.reject(link, key, transfer, reject),
        }
    }

    pub(super) fn done(&mut self, link: LinkId, done: TransferDone) {
        let Some(key) = self.receiving(link, done.transfer) else {
            self.frames_rejected += 1;
            self.send(
                link,
                Frame::Nack {
                    transfer: done.transfer,
                    reject: Reject::UnknownTransfer,
                },
            );
            return;
        };
        // receiving() found the reservation: these lets only name its parts.
        let Some(Request {
            phase: Phase::Admitted { table, stage },
            ..
        }) = self.requests.get_mut(&key)
        else {
            return;
        };
        let Stage::Receiving {
            inbound,
            first_frame,
            ..
        } = stage
        else {
            return;
        };
        let first_frame = first_frame.unwrap_or_else(Instant::now);
        let verified = self.config.faults.transfer_verified();
        let verdict = inbound.check_done(&done).or_else(|reject| {
            // Fault injection only: the guard is off, so the sender's word is taken.
            if verified {
                Err(reject)
            } else {
                Ok(())
            }
        });
        let verdict = verdict.and_then(|()| {
            let view = self
                .pool
                .verify_receiving(table)
                .expect("a reservation's own pages verify");
            let pages = (0..done.page_count as usize).map(|i| bytemuck::cast_slice(view.page(i)));
            if cfg!(feature = "unguarded-checksum") || !verified {
                return Ok(());
            }
            inbound.verify_checksum(&done, transfer_checksum(&done, pages))
        });
        if let Err(reject) = verdict {
            self.reject(link, key, done.transfer, reject);
            return;
        }
        // I4: only now may decode read these pages.
        self.pool
            .set_state(table, PageState::Sealed)
            .expect("verified pages go Receiving -> Sealed");
        let received_pages = (done.page_count - inbound.held_pages()) as u64;
        self.transfer_counters.observe(
            received_pages * self.pool.layout().page_bytes() as u64,
            first_frame.elapsed(),
        );
        let written = (done.token_count as usize).min(table.capacity_tokens(self.pool.layout()));
        self.pool
            .verify_batch(&[table])
            .expect("sealed pages verify")[0]
            .mark_written(written);
        // Verified: the received full pages may serve this tenant's next requests.
        self.inbound.remove(&done.transfer);
        self.publish_prompt(key);
        let Some(Request {
            submit,
            phase: Phase::Admitted { table, stage },
            ..
        }) = self.requests.get_mut(&key)
        else {
            return;
        };
        if self.config.faults.recycle_early() {
            // Fault injection only: free the pages while the request still decodes from them.
            tracing::warn!("fault injection: pages recycled early");
            let _ = self.pool.release(table.clone());
        }
        *stage = Stage::Decoding(DecodeState::new(submit));
        self.answer(
            link,
            Frame::Ack {
                transfer: done.transfer,
            },
        );
        self.send(key.0, Frame::Started { request: key.1 });
    }

    fn reject(&mut self, link: LinkId, key: Key, transfer: TransferId, reject: Reject) {
        self.frames_rejected += 1;
        tracing::warn!(transfer = transfer.0, ?reject, "transfer refused");
        self.answer(link, Frame::Nack { transfer, reject });
        let message = format!("the KV transfer failed verification ({reject:?})");
        self.end(key, Err((Failure::TransferFailed, message)));
    }

    pub(super) fn transfer_aborted(&mut self, link: LinkId, transfer: TransferId) {
        if let Some(key) = self.receiving(link, transfer) {
            let message = "the prefill worker aborted the transfer".to_string();
            self.end(key, Err((Failure::Aborted, message)));
        }
        self.answer(link, Frame::AbortAck { transfer });
    }
}

impl Request {
    /// A receiving request's reserved pages and the transfer that may fill them.
    fn reservation(&mut self) -> Option<(&PageTable, &mut Inbound)> {
        match &mut self.phase {
            Phase::Admitted {
                table,
                stage: Stage::Receiving { inbound, .. },
            } => Some((table, inbound)),
            _ => None,
        }
    }
}
