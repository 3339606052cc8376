//! Prefill's side of a transfer: stream the prompt's pages to the decode worker as each
//! prefill chunk completes them, then seal, send `Done`, and hold the pages until it answers
//! (I5).
//!
//! A page is final once the chunk that wrote its last slot has run: prefill never writes a
//! position twice. So each step sends the pages it completed, hashed in index order on the
//! way ([`TransferHasher`]), and only the last chunk's pages and `Done` wait for the end of
//! the prompt. To a one-sided peer the engine hashes nothing: the link's writer hashes each
//! page as it copies it and fills in `Done`'s checksum (`transfer::one_sided`), so the pages
//! decode holds go to the writer too, to be hashed there. Decode's guards do not change: pages land only through its live reservation,
//! and it seals only when `Done`'s counts match the router's and the checksum matches its own
//! pages (I4).

use super::{send_later, Engine, Key, LinkId, Phase, Stage};
use kv::{LentPage, PageState};
use std::time::Instant;
use transfer::{
    Failure, Frame, PageBytes, Plan, Reject, Submit, TransferDone, TransferHasher, TransferId,
};

/// A prefill's transfer while its prompt is being computed.
pub(super) struct Stream {
    peer: LinkId,
    /// `Done` as it will be sent, but its checksum.
    done: TransferDone,
    hasher: TransferHasher,
    /// Pages lent to the link so far (each sent, or hashed if decode holds it).
    pages_done: usize,
    /// Who computes `Done`'s checksum.
    checksummer: Checksummer,
    /// Leading pages decode holds from its own cache: hashed, never sent.
    decode_holds: usize,
    /// Fault builds whose plan reshapes transfers keep the frames until `Done` and shape the
    /// whole transfer then; `None` streams.
    held: Option<Vec<Frame>>,
}

impl Stream {
    pub(super) fn transfer(&self) -> TransferId {
        self.done.transfer
    }

    /// The stream of a prefill request's transfer, or `None` for other plans.
    pub(super) fn open(
        submit: &Submit,
        peer: Option<LinkId>,
        layout: &kv::KvLayout,
        hold_frames: bool,
        checksummer: Checksummer,
    ) -> Option<Box<Stream>> {
        let Plan::Prefill {
            transfer,
            decode_holds_pages,
            ..
        } = submit.plan
        else {
            return None;
        };
        let token_count = (submit.prompt.len() - 1) as u32;
        let done = TransferDone {
            transfer,
            request: submit.request,
            tenant: submit.tenant,
            // The router fixed the count: the pages of the whole prompt (the incident's
            // placeholder claims these too, for a prompt it never ran).
            page_count: layout.pages_for_tokens(token_count as usize) as u32,
            token_count,
            checksum: 0,
        };
        Some(Box::new(Stream {
            peer: peer?,
            hasher: TransferHasher::new(&done),
            pages_done: 0,
            checksummer,
            done,
            decode_holds: decode_holds_pages as usize,
            held: hold_frames.then(Vec::new),
        }))
    }
}

impl Engine {
    /// Sends the pages of a prefilling request that its chunks have completed so far.
    pub(super) fn stream_pages(&mut self, key: Key) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        let Phase::Admitted {
            table,
            stage:
                Stage::Prefilling {
                    done,
                    stream: Some(stream),
                    ..
                },
        } = &mut request.phase
        else {
            return;
        };
        let complete = (*done / self.pool.layout().page_size_tokens).min(table.pages().len());
        let from = stream.pages_done;
        if complete <= from {
            return;
        }
        // Final pages: later chunks read them, never write them, so they can be lent to the
        // link's writer while the prompt goes on.
        table.freeze(complete);
        let lent = self
            .pool
            .lend(table, from..complete)
            .expect("a request's own pages lend");
        let frames = page_frames(stream, from, lent);
        self.emit(key, frames, false);
    }

    /// The whole prompt is in KV: seal, send the rest of the pages and `Done`.
    pub(super) fn send_pages(&mut self, key: Key, transfer: TransferId) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        let Phase::Admitted {
            table,
            stage:
                Stage::Prefilling {
                    placeholder,
                    stream,
                    ..
                },
        } = &mut request.phase
        else {
            return;
        };
        let Some(stream) = stream.as_mut().filter(|s| self.links.contains_key(&s.peer)) else {
            let message = "the link to the decode worker is gone".to_string();
            self.end(key, Err((Failure::PeerUnavailable, message)));
            return;
        };
        // Sealed: prefill wrote its last K/V; nothing writes these pages again.
        self.pool
            .set_state(table, PageState::Sealed)
            .expect("prefilled pages go Writing -> Sealed");
        let token_count = stream.done.token_count as usize;
        let layout = *self.pool.layout();
        let page_count = table.pages().len();
        // (A one-token prompt moves no KV at all: no pages, only `Done`.)
        if !token_count.is_multiple_of(layout.page_size_tokens) && page_count > 0 && !*placeholder {
            // The last page is partial, private and not lent yet: its unused slots are
            // blanked in place before it leaves.
            let mut views = self
                .pool
                .verify_batch(&[table])
                .expect("a request's own pages verify");
            let last = views[0].page_mut(page_count - 1);
            blank_unwritten_slots(bytemuck::cast_slice_mut(last), &layout, token_count);
        }
        let from = stream.pages_done;
        table.freeze(page_count);
        let lent = self
            .pool
            .lend(table, from..page_count)
            .expect("a request's own pages lend");
        let mut frames = page_frames(stream, from, lent);
        let mut done = stream.done;
        if !cfg!(feature = "unguarded-checksum")
            && matches!(stream.checksummer, Checksummer::Engine)
        {
            done.checksum = stream.hasher.finish();
        }
        frames.push(Frame::Done(done));
        self.pages_not_sent += stream.decode_holds.min(stream.pages_done) as u64;
        let peer = stream.peer;
        self.emit(key, frames, true);
        let Some(Phase::Admitted { table, stage }) =
            self.requests.get_mut(&key).map(|r| &mut r.phase)
        else {
            return;
        };
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

    /// Puts a streaming request's frames on its decode link (or, in fault builds that reshape
    /// transfers, holds them until the `last` batch and shapes the whole transfer).
    fn emit(&mut self, key: Key, frames: Vec<Frame>, last: bool) {
        let Some(Phase::Admitted {
            stage:
                Stage::Prefilling {
                    stream: Some(stream),
                    ..
                },
            ..
        }) = self.requests.get_mut(&key).map(|r| &mut r.phase)
        else {
            return;
        };
        let page_bytes = self.pool.layout().page_bytes() as u64;
        // Pages decode holds go to a one-sided writer only to be hashed: not sent.
        let holds = stream.decode_holds;
        let pages = frames
            .iter()
            .filter(|frame| matches!(frame, Frame::Page { index, .. } if *index as usize >= holds))
            .count() as u64;
        self.pages_sent += pages;
        let Some(peer) = self.links.get(&stream.peer) else {
            return;
        };
        self.transfer_counters[usize::from(peer.one_sided)].bytes_sent += pages * page_bytes;
        let frames = match &mut stream.held {
            Some(held) => {
                held.extend(frames);
                if !last {
                    return;
                }
                std::mem::take(held)
            }
            None => {
                for frame in frames {
                    let _ = peer.tx.send(frame);
                }
                return;
            }
        };
        let outgoing = self.config.faults.shape_transfer(frames);
        for (sent, frame) in outgoing.frames.into_iter().enumerate() {
            if outgoing.crash_after == Some(sent) {
                crate::faults::crash("mid-transfer");
            }
            match (frame, outgoing.delay_done) {
                (frame @ Frame::Done(_), Some(delay)) => send_later(peer.tx.clone(), frame, delay),
                (frame, _) => {
                    let _ = peer.tx.send(frame);
                }
            }
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
    let (page_size, head_dim) = (layout.page_size_tokens, layout.head_dim);
    for layer in 0..layout.layer_count {
        for kv_head in 0..layout.kv_head_count {
            // Keys are dimension-major (`kernels::key_index`): each dimension's row of slots
            // ends in unwritten ones.
            let keys = layout.head_offset(layer, kv::KvKind::Key, kv_head) * 2;
            for d in 0..head_dim {
                let row = keys + kernels::key_index(page_size, 0, d) * 2;
                page[row + used * 2..row + page_size * 2].fill(0);
            }
            // Values are slot-major: the unwritten slots are one run at the end.
            let values = layout.head_offset(layer, kv::KvKind::Value, kv_head) * 2;
            page[values + used * head_dim * 2..values + page_size * head_dim * 2].fill(0);
        }
    }
}

/// Who computes a transfer's `Done` checksum.
pub(super) enum Checksummer {
    /// The engine, hashing each page in index order as it lends it: links whose writer does
    /// not hash, and fault plans that reshape transfers (whose planted corruption must stay a
    /// corruption of what the engine hashed).
    Engine,
    /// A one-sided link's writer, hashing each page as it copies it; the pages decode holds
    /// are handed to it too, to be hashed unwritten.
    OneSidedWriter,
    /// A framed link's writer (`transfer::transport::spawn_hashing_link`), hashing each page
    /// just before it writes it; the engine hashes the pages decode holds into the link's
    /// hashes, and sends them nowhere.
    FramedWriter(transfer::SenderHashes),
}

/// Hashes what the transfer's checksummer leaves to the engine of its pages from `from` on,
/// in index order (`lent` holds them), and returns frames for those that go to the link:
/// each carries its lent page, so the bytes go from the pool to the socket (or the copy)
/// with no copy of their own.
fn page_frames(stream: &mut Stream, from: usize, lent: Vec<LentPage>) -> Vec<Frame> {
    let mut frames = Vec::new();
    for (index, page) in (from..).zip(lent) {
        stream.pages_done = index + 1;
        let held = index < stream.decode_holds;
        match &stream.checksummer {
            Checksummer::Engine => stream.hasher.page(page.bytes()),
            Checksummer::FramedWriter(hashes) if held => {
                let hash = transfer::page_hash(page.bytes());
                hashes.put(stream.done.transfer, index as u32, hash);
            }
            Checksummer::FramedWriter(_) | Checksummer::OneSidedWriter => {}
        }
        if !held || matches!(stream.checksummer, Checksummer::OneSidedWriter) {
            frames.push(Frame::Page {
                transfer: stream.done.transfer,
                request: stream.done.request,
                tenant: stream.done.tenant,
                index: index as u32,
                bytes: PageBytes::Lent(page),
            });
        }
    }
    frames
}
