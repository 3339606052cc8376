//! Prefill's side of a transfer: seal the prompt's pages, send them and `Done` to the decode
//! worker, and hold them until it answers (I5).

use super::{send_later, Engine, Key, LinkId, Phase, Stage};
use kv::PageState;
use std::time::Instant;
use transfer::{transfer_checksum, Failure, Frame, Plan, Reject, TransferDone, TransferId};

impl Engine {
    pub(super) fn send_pages(&mut self, key: Key, transfer: TransferId) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        let Phase::Admitted { table, stage } = &mut request.phase else {
            return;
        };
        let Stage::Prefilling { placeholder, .. } = *stage else {
            return;
        };
        let peer = request
            .peer
            .and_then(|peer| Some((peer, self.links.get(&peer)?)));
        let Some((peer, peer_entry)) = peer else {
            let message = "the link to the decode worker is gone".to_string();
            self.end(key, Err((Failure::PeerUnavailable, message)));
            return;
        };
        let token_count = (request.submit.prompt.len() - 1) as u32;
        let mut page_count = table.pages().len() as u32;
        if placeholder {
            // The incident's lie: "complete", with the counts of the prompt it never ran.
            page_count = self.pool.layout().pages_for_tokens(token_count as usize) as u32;
        }
        let mut done = TransferDone {
            transfer,
            request: key.1,
            tenant: request.submit.tenant,
            page_count,
            token_count,
            checksum: 0,
        };
        // Sealed: prefill wrote its last K/V; nothing writes these pages again.
        self.pool
            .set_state(table, PageState::Sealed)
            .expect("prefilled pages go Writing -> Sealed");
        let mut views = self
            .pool
            .verify_batch(&[table])
            .expect("a request's own pages verify");
        let view = views.pop().expect("one view per table");
        let mut pages: Vec<Vec<u8>> = (0..view.page_len())
            .map(|i| bytemuck::cast_slice::<_, u8>(view.page(i)).to_vec())
            .collect();
        if let Some(last) = pages.last_mut().filter(|_| !placeholder) {
            blank_unwritten_slots(last, view.layout(), token_count as usize);
        }
        if !cfg!(feature = "unguarded-checksum") {
            done.checksum = transfer_checksum(&done, pages.iter().map(Vec::as_slice));
        }
        // Delta transfer: the pages decode holds from its own cache stay here. The checksum
        // above still covers them, as decode's check does, so a decode whose cached pages
        // differ from ours refuses the transfer.
        let decode_holds = match &request.submit.plan {
            Plan::Prefill {
                decode_holds_pages, ..
            } => *decode_holds_pages as usize,
            _ => 0,
        };
        let mut frames: Vec<Frame> = pages
            .into_iter()
            .enumerate()
            .skip(decode_holds)
            .map(|(index, bytes)| Frame::Page {
                transfer,
                request: key.1,
                tenant: done.tenant,
                index: index as u32,
                bytes,
            })
            .collect();
        self.pages_sent += frames.len() as u64;
        self.pages_not_sent += decode_holds.min(page_count as usize) as u64;
        frames.push(Frame::Done(done));
        let outgoing = self.config.faults.shape_transfer(frames);
        for (sent, frame) in outgoing.frames.into_iter().enumerate() {
            if outgoing.crash_after == Some(sent) {
                crate::faults::crash("mid-transfer");
            }
            match (frame, outgoing.delay_done) {
                (frame @ Frame::Done(_), Some(delay)) => {
                    send_later(peer_entry.tx.clone(), frame, delay)
                }
                (frame, _) => {
                    let _ = peer_entry.tx.send(frame);
                }
            }
        }
        drop(views);
        self.pool
            .set_state(table, PageState::Sending)
            .expect("sealed pages go Sealed -> Sending");
        *stage = Stage::Sending {
            transfer,
            peer,
            since: Instant::now(),
            abort_sent: false,
            quarantined: false,
        };
        self.outbound.insert(transfer, key);
        if cfg!(feature = "unguarded-deferred-release") {
            // Benchmark builds only: free the pages now instead of on the receiver's answer.
            self.end(key, Ok(Frame::Ack { transfer }));
        }
    }

    /// The receiver answered (or can no longer touch our pages): release them.
    pub(super) fn sent(&mut self, link: LinkId, transfer: TransferId, reject: Option<Reject>) {
        let Some(&key) = self.outbound.get(&transfer) else {
            return;
        };
        // Only the decode worker the pages went to may release them.
        let sent_to = match self.requests.get(&key).map(|r| &r.phase) {
            Some(Phase::Admitted {
                stage: Stage::Sending { peer, .. },
                ..
            }) => Some(*peer),
            _ => None,
        };
        if sent_to != Some(link) {
            self.frames_rejected += 1;
            return;
        }
        self.outbound.remove(&transfer);
        match reject {
            None => self.end(key, Ok(Frame::Ack { transfer })),
            Some(reject) => {
                let message = format!("the decode worker refused the transfer: {reject:?}");
                self.end(key, Err((Failure::TransferFailed, message)));
            }
        }
    }
}

/// Zeroes the slots of the last page past the `token_count` tokens a transfer carries: pages
/// are reused without zeroing, so those slots may hold an earlier owner's K/V, which must not
/// leave this worker under another tenant's name (decode would never read them, but the bytes
/// would still cross the network).
pub(super) fn blank_unwritten_slots(page: &mut [u8], layout: &kv::KvLayout, token_count: usize) {
    let used = token_count % layout.page_size_tokens;
    if used == 0 {
        return;
    }
    let slot_bytes = layout.head_dim * 2;
    for layer in 0..layout.layer_count {
        for kind in [kv::KvKind::Key, kv::KvKind::Value] {
            for kv_head in 0..layout.kv_head_count {
                let start = layout.head_offset(layer, kind, kv_head) * 2;
                let end = start + layout.page_size_tokens * slot_bytes;
                page[start + used * slot_bytes..end].fill(0);
            }
        }
    }
}
