//! Decode's side of a transfer: page bytes land only in a live reservation (through
//! [`Grants`](super::grants::Grants), from the link's reader or, for frames that reach the
//! engine as events, from here), and `Done` seals the pages only once counts and checksum
//! agree (I4); anything else is refused.

use super::grants::Claim;
use super::{DecodeState, Engine, Key, LinkId, Phase, Request, Stage};
use kv::{PageState, RequestId};
use std::time::Instant;
use transfer::transport::PageHeader;
use transfer::{Failure, Frame, Reject, TransferDone, TransferHasher, TransferId};

impl Engine {
    /// A page frame that reached the engine as an event (in-process tests; a link without a
    /// reader that lands pages): the same claim as a reader's, then a copy.
    pub(super) fn page(
        &mut self,
        link: LinkId,
        transfer: TransferId,
        request: RequestId,
        tenant: kv::TenantId,
        index: u32,
        bytes: &[u8],
    ) {
        let header = PageHeader {
            transfer,
            request,
            tenant,
            index,
            len: bytes.len(),
        };
        match self.grants.claim(link, &header) {
            Claim::Land(mut page) => {
                if self.config.faults.crash_on_page(index as usize) {
                    crate::faults::crash("on a transfer's page");
                }
                page.bytes_mut().copy_from_slice(bytes);
                self.grants.landed(transfer, index, page);
            }
            Claim::Unknown => self.page_refused(link, transfer, None),
            Claim::Refused(reject) => self.page_refused(link, transfer, Some(reject)),
        }
    }

    /// A page frame no reservation took: counted; one the reservation's checks refused fails
    /// its transfer.
    pub(super) fn page_refused(
        &mut self,
        link: LinkId,
        transfer: TransferId,
        reject: Option<Reject>,
    ) {
        let key = self.inbound.get(&transfer).copied();
        match (key, reject) {
            (Some(key), Some(reject)) => self.reject(link, key, transfer, reject),
            _ => self.frames_rejected += 1,
        }
    }

    pub(super) fn done(&mut self, link: LinkId, done: TransferDone) {
        let key = self.inbound.get(&done.transfer).copied();
        let closed = key.and_then(|_| self.grants.close(link, done.transfer));
        let (Some(key), Some(closed)) = (key, closed) else {
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
        let inbound = closed.inbound;
        // The reservation is closed: every lease is back, so its pages verify for reading.
        let Some(Request {
            phase: Phase::Admitted { table, .. },
            ..
        }) = self.requests.get_mut(&key)
        else {
            return;
        };
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
            if cfg!(feature = "unguarded-checksum") || !verified {
                return Ok(());
            }
            // Over every page decode will read: the ones it holds hashed now, the received
            // ones as their bytes landed (check_done proved the counts match).
            let view = self
                .pool
                .verify_receiving(table)
                .expect("a closed reservation's own pages verify");
            let mut root = TransferHasher::new(&done);
            for (index, landed) in closed.hashes.iter().enumerate() {
                match landed {
                    Some(hash) => root.page_hash(*hash),
                    None if index < inbound.held_pages() as usize => {
                        root.page(bytemuck::cast_slice(view.page(index)))
                    }
                    // A page whose frame was cut short: nothing proves its bytes.
                    None => return Err(Reject::ChecksumMismatch),
                }
            }
            inbound.verify_checksum(&done, root.finish())
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
        let one_sided = self.links.get(&link).is_some_and(|entry| entry.one_sided);
        self.transfer_counters[usize::from(one_sided)].observe(
            received_pages * self.pool.layout().page_bytes() as u64,
            closed.first_frame.unwrap_or_else(Instant::now).elapsed(),
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
        let key = self.inbound.get(&transfer).copied();
        let (sender, _) = self.grants.activity(transfer);
        if let Some(key) = key.filter(|_| sender.is_none() || sender == Some(link)) {
            let message = "the prefill worker aborted the transfer".to_string();
            self.end(key, Err((Failure::Aborted, message)));
        }
        self.answer(link, Frame::AbortAck { transfer });
    }
}
