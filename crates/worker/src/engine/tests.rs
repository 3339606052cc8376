//! The engine driven in process: events in through its channel, frames out through each
//! link's sender, no sockets. The oracle model writes K/V that says who wrote it, so a decode
//! that reads anything but its own prompt's pages answers differently.

use super::send::blank_unwritten_slots;
use super::{Engine, Event, LinkId, LinkKind};
use crate::{FaultPlan, WorkerConfig};
use gguf::{GgufFile, Tokenizer};
use kv::{PagePool, PageState, PoolConfig, PoolSize, RequestId, TenantId};
use model::{Forward, OracleModel};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use transfer::{
    transfer_checksum, Failure, Finish, Frame, Plan, Reject, Role, Sampling, Submit, TransferDone,
    TransferId,
};

pub(super) const PAGE_SIZE: usize = 4;
/// Token 0 is the end of text, tokens 1..=26 the letters `a..=z`.
pub(super) const EOS: u32 = 0;
pub(super) const VOCAB: usize = 27;
pub(super) const CONTEXT: usize = 64;
const QUEUE_TIMEOUT: Duration = Duration::from_secs(10);
pub(super) const TRANSFER_TIMEOUT: Duration = Duration::from_secs(20);
pub(super) const TENANT: TenantId = TenantId(7);
/// "helloworld": ten tokens, so prefill moves nine (three pages of four).
pub(super) const PROMPT: [u32; 10] = [8, 5, 12, 12, 15, 23, 15, 18, 12, 4];
pub(super) const MAX_TOKENS: u32 = 6;
pub(super) const ROUTER: LinkId = 1;
/// The decode worker's link, on a prefill worker.
pub(super) const PEER: LinkId = 2;
/// The prefill worker's link, on a decode worker.
pub(super) const PREFILL: LinkId = 3;
pub(super) const TRANSFER: TransferId = TransferId(500);

/// One engine and the sending end of its event channel.
pub(super) struct Worker {
    pub(super) engine: Engine,
    events: mpsc::Sender<Event>,
    inbox: mpsc::Receiver<Event>,
}

/// What the engine sent on one link.
pub(super) struct Link {
    pub(super) rx: UnboundedReceiver<Frame>,
}

impl Worker {
    /// A worker of `role` whose pool holds `kv_tokens` tokens, with a router on [`ROUTER`].
    pub(super) fn new(role: Role, kv_tokens: usize) -> (Worker, Link) {
        Worker::with_step_tokens(role, kv_tokens, 64)
    }

    /// [`Worker::new`] with forward steps of `step_tokens` tokens, so a prompt is prefilled
    /// in chunks of that size.
    pub(super) fn with_step_tokens(
        role: Role,
        kv_tokens: usize,
        step_tokens: usize,
    ) -> (Worker, Link) {
        let model = OracleModel::new(VOCAB, CONTEXT);
        let pool = PagePool::new(PoolConfig {
            layout: model.kv_layout(PAGE_SIZE),
            size: PoolSize::Tokens(kv_tokens),
            scrub_on_free: false,
        })
        .expect("a pool of whole pages");
        let config = WorkerConfig {
            role,
            name: format!("{role:?}-test"),
            model_id: "oracle".into(),
            weights_hash: 0,
            context_length: CONTEXT,
            queue_max: 2,
            queue_timeout: QUEUE_TIMEOUT,
            transfer_timeout: TRANSFER_TIMEOUT,
            step_tokens,
            max_batch: 8,
            faults: FaultPlan::none(),
            tracer: otlp::Tracer::off(),
        };
        let (events, inbox) = mpsc::channel();
        let mut worker = Worker {
            engine: Engine::new(config, Box::new(model), tokenizer(), pool),
            events,
            inbox,
        };
        let router = worker.link(ROUTER, LinkKind::Router);
        (worker, router)
    }

    /// Opens a link; what the engine sends on it comes out of the returned [`Link`].
    pub(super) fn link(&mut self, link: LinkId, kind: LinkKind) -> Link {
        self.link_hashing(link, kind, None)
    }

    /// [`Worker::link`] whose writer computes `Done`'s checksum from `sender_hashes`, as a
    /// framed link to decode does (`transfer::transport::spawn_hashing_link`).
    pub(super) fn link_hashing(
        &mut self,
        link: LinkId,
        kind: LinkKind,
        sender_hashes: Option<transfer::SenderHashes>,
    ) -> Link {
        let (tx, rx) = unbounded_channel();
        self.send(Event::LinkUp {
            link,
            kind,
            tx,
            one_sided: false,
            sender_hashes,
        });
        Link { rx }
    }

    pub(super) fn send(&self, event: Event) {
        self.events.send(event).expect("the engine's inbox is open");
    }

    pub(super) fn frame(&self, link: LinkId, frame: Frame) {
        self.send(Event::Frame { link, frame });
    }

    /// One turn of the engine's loop, with its clock at `now`.
    pub(super) fn turn_at(&mut self, now: Instant) {
        let first = self.inbox.try_recv().ok();
        assert!(self.engine.apply_events(first, &self.inbox).is_continue());
        self.engine.work(|| now);
    }

    pub(super) fn turn(&mut self) {
        self.turn_at(Instant::now());
    }

    /// Turns until no request has a step to run.
    pub(super) fn settle(&mut self) {
        for _ in 0..100 {
            self.turn();
            if !self.engine.has_runnable_work() {
                return;
            }
        }
        panic!("the engine still has work after 100 turns");
    }

    pub(super) fn pages_free(&self) -> usize {
        self.engine.pool.pages_free()
    }

    pub(super) fn pages_total(&self) -> usize {
        self.engine.pool.page_count()
    }

    /// I9: nothing held, nothing queued, nothing remembered.
    pub(super) fn assert_idle(&self) {
        assert_eq!(self.pages_free(), self.pages_total(), "every page is free");
        assert!(self.engine.requests.is_empty(), "no request is left");
        assert!(self.engine.queue.is_empty());
        assert!(self.engine.inbound.is_empty() && self.engine.outbound.is_empty());
        self.engine.pool.check_invariants();
    }
}

impl Link {
    /// Frames sent since the last call, pool reports left out. Lent page bytes are copied
    /// out, as a link's writer puts them on the wire and lets the pages go.
    pub(super) fn frames(&mut self) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Ok(mut frame) = self.rx.try_recv() {
            if let Frame::Page { bytes, .. } = &mut frame {
                *bytes = std::mem::replace(bytes, Vec::new().into())
                    .into_owned()
                    .into();
            }
            if !matches!(frame, Frame::PoolStats { .. }) {
                frames.push(frame);
            }
        }
        frames
    }
}

/// A tokenizer of [`VOCAB`] tokens, from a GGUF file built here: token 0 is a control token
/// (the end of text), the others the single letters, so token `t` reads as one letter.
pub(super) fn tokenizer() -> Tokenizer {
    fn put_str(out: &mut Vec<u8>, text: &str) {
        out.extend_from_slice(&(text.len() as u64).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    const STRING: u32 = 8;
    const ARRAY: u32 = 9;
    const U32: u32 = 4;
    const I32: u32 = 5;
    let mut tokens = vec!["<|endoftext|>".to_string()];
    tokens.extend(('a'..='z').map(String::from));
    let mut entries: Vec<(&str, u32, Vec<u8>)> = Vec::new();
    for (key, text) in [
        ("tokenizer.ggml.model", "gpt2"),
        ("tokenizer.ggml.pre", "gpt-2"),
    ] {
        let mut value = Vec::new();
        put_str(&mut value, text);
        entries.push((key, STRING, value));
    }
    let mut value = STRING.to_le_bytes().to_vec();
    value.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    tokens.iter().for_each(|token| put_str(&mut value, token));
    entries.push(("tokenizer.ggml.tokens", ARRAY, value));
    let mut value = I32.to_le_bytes().to_vec();
    value.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for id in 0..tokens.len() {
        let token_type: i32 = if id == EOS as usize { 3 } else { 1 };
        value.extend_from_slice(&token_type.to_le_bytes());
    }
    entries.push(("tokenizer.ggml.token_type", ARRAY, value));
    let mut value = STRING.to_le_bytes().to_vec();
    value.extend_from_slice(&0u64.to_le_bytes());
    entries.push(("tokenizer.ggml.merges", ARRAY, value));
    entries.push((
        "tokenizer.ggml.eos_token_id",
        U32,
        EOS.to_le_bytes().to_vec(),
    ));
    let mut file = b"GGUF".to_vec();
    file.extend_from_slice(&3u32.to_le_bytes());
    file.extend_from_slice(&0u64.to_le_bytes());
    file.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (key, type_id, value) in entries {
        put_str(&mut file, key);
        file.extend_from_slice(&type_id.to_le_bytes());
        file.extend_from_slice(&value);
    }
    let file = GgufFile::parse(&file).expect("the test vocabulary parses");
    let tokenizer = Tokenizer::from_gguf(&file).expect("the test vocabulary is valid");
    assert_eq!(tokenizer.vocab_size(), VOCAB);
    tokenizer
}

pub(super) fn submit(request: u64, prompt: &[u32], max_tokens: u32, plan: Plan) -> Submit {
    Submit {
        request: RequestId(request),
        tenant: TENANT,
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: Sampling::greedy(),
        stop: Vec::new(),
        ignore_eos: false,
        prefix_cache: None,
        plan,
        trace: None,
    }
}

pub(super) fn prefill_plan(transfer: TransferId) -> Plan {
    Plan::Prefill {
        transfer,
        decode_addr: "decode.test:1".into(),
        decode_holds_pages: 0,
    }
}

/// `Admitted` with nothing taken from the prefix cache.
pub(super) fn admitted(request: RequestId) -> Frame {
    Frame::Admitted {
        request,
        cached_tokens: 0,
        cached_pages: 0,
    }
}

/// The text the oracle answers `prompt` with when decode reads exactly its own K/V.
pub(super) fn expected_text(prompt: &[u32], max_tokens: u32) -> String {
    OracleModel::expected(prompt, max_tokens as usize, EOS, false)
        .into_iter()
        .map(|token| char::from(b'a' + token as u8 - 1))
        .collect()
}

/// The text of the `Text` frames, and the one frame that ended the request.
pub(super) fn answer(frames: &[Frame]) -> (String, Option<&Frame>) {
    let text = frames
        .iter()
        .filter_map(|frame| match frame {
            Frame::Text { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let end = frames
        .iter()
        .find(|frame| matches!(frame, Frame::Finished { .. } | Frame::Failed { .. }));
    (text, end)
}

pub(super) fn failure_of(frame: &Frame) -> Failure {
    match frame {
        Frame::Failed { failure, .. } => *failure,
        other => panic!("expected Failed, got {other:?}"),
    }
}

/// A prefill worker that has prefilled [`PROMPT`] and sent its transfer to [`PEER`]: the
/// worker, its router link, and the frames it sent (pages, then `Done`).
fn prefilled() -> (Worker, Link, Link, Vec<Frame>) {
    let (mut prefill, mut router) = Worker::new(Role::Prefill, 32);
    let mut peer = prefill.link(PEER, LinkKind::DecodePeer);
    let submit = submit(1, &PROMPT, MAX_TOKENS, prefill_plan(TRANSFER));
    prefill.send(Event::SubmitToPeer {
        link: ROUTER,
        submit,
        peer: PEER,
    });
    prefill.settle();
    assert_eq!(router.frames(), vec![admitted(RequestId(1))]);
    let sent = peer.frames();
    (prefill, router, peer, sent)
}

/// A decode worker with [`PROMPT`] reserved under [`TRANSFER`], and a prefill peer on
/// `PREFILL`: the worker, its router link and the prefill link.
pub(super) fn reserved() -> (Worker, Link, Link) {
    let (mut decode, mut router) = Worker::new(Role::Decode, 32);
    let prefill = decode.link(PREFILL, LinkKind::PrefillPeer);
    let submit = submit(1, &PROMPT, MAX_TOKENS, Plan::Decode { transfer: TRANSFER });
    decode.frame(ROUTER, Frame::Submit(submit));
    decode.turn();
    assert_eq!(router.frames(), vec![admitted(RequestId(1))]);
    // prompt + max_tokens = 16 tokens: four of the eight pages, waiting for the transfer.
    assert_eq!(decode.engine.pool.pages_in_state(PageState::Receiving), 4);
    (decode, router, prefill)
}

/// The page frames of a transfer as (index, bytes), and its `Done`, which must come last.
pub(super) fn split_transfer(sent: &[Frame]) -> (Vec<(u32, Vec<u8>)>, TransferDone) {
    let (last, pages) = sent.split_last().expect("a transfer sends frames");
    let Frame::Done(done) = last else {
        panic!("Done comes last, got {last:?}");
    };
    let pages = pages
        .iter()
        .map(|frame| match frame {
            Frame::Page {
                transfer,
                request,
                tenant,
                index,
                bytes,
            } => {
                assert_eq!(
                    (*transfer, *request, *tenant),
                    (TRANSFER, RequestId(1), TENANT)
                );
                (*index, bytes.to_vec())
            }
            other => panic!("expected a page, got {other:?}"),
        })
        .collect();
    (pages, *done)
}

#[test]
fn a_unified_request_answers_from_its_own_prompt_and_frees_its_pages() {
    let (mut unified, mut router) = Worker::new(Role::Unified, 32);
    let submit = submit(1, &PROMPT, MAX_TOKENS, Plan::Unified);
    unified.frame(ROUTER, Frame::Submit(submit));
    unified.turn();
    // prompt + max_tokens = 16 tokens: four pages of four.
    assert_eq!(unified.pages_free(), unified.pages_total() - 4);
    unified.settle();
    let frames = router.frames();
    let request = RequestId(1);
    assert_eq!(frames[..2], [admitted(request), Frame::Started { request }]);
    let (text, end) = answer(&frames);
    assert_eq!(text, expected_text(&PROMPT, MAX_TOKENS));
    let finished = Frame::Finished {
        request,
        finish: Finish::Length,
        prompt_tokens: PROMPT.len() as u32,
        completion_tokens: MAX_TOKENS,
    };
    assert_eq!(end, Some(&finished));
    assert_eq!(frames.last(), Some(&finished), "nothing after the end");
    unified.assert_idle();
}

#[test]
fn prefill_sends_its_pages_and_holds_them_until_decode_acks() {
    let (mut prefill, mut router, _peer, sent) = prefilled();
    // Nine prompt tokens of KV: three pages, counted by `Done` and summed by its checksum.
    let (pages, done) = split_transfer(&sent);
    assert_eq!(pages.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1, 2]);
    let page_bytes = prefill.engine.pool.layout().page_bytes();
    assert!(pages.iter().all(|(_, bytes)| bytes.len() == page_bytes));
    assert_eq!((done.page_count, done.token_count), (3, 9));
    let checksum = transfer_checksum(&done, pages.iter().map(|p| p.1.as_slice()));
    assert_eq!(done.checksum, checksum);
    assert_eq!(prefill.engine.pool.pages_in_state(PageState::Sending), 3);
    // Only the decode worker the pages went to may release them.
    let _stranger = prefill.link(9, LinkKind::DecodePeer);
    prefill.frame(9, Frame::Ack { transfer: TRANSFER });
    prefill.turn();
    assert_eq!(prefill.engine.pool.pages_in_state(PageState::Sending), 3);
    assert_eq!(prefill.engine.frames_rejected, 1);
    prefill.frame(PEER, Frame::Ack { transfer: TRANSFER });
    prefill.turn();
    prefill.assert_idle();
    assert_eq!(
        router.frames(),
        [],
        "decode reports the outcome, not prefill"
    );
}

#[test]
fn decode_verifies_what_prefill_sent_then_answers_from_it() {
    let (mut prefill, _, _, sent) = prefilled();
    let (mut decode, mut router, mut to_prefill) = reserved();
    for frame in sent {
        decode.frame(PREFILL, frame);
    }
    decode.turn();
    let ack = Frame::Ack { transfer: TRANSFER };
    assert_eq!(to_prefill.frames(), std::slice::from_ref(&ack));
    decode.settle();
    let frames = router.frames();
    let request = RequestId(1);
    assert_eq!(frames[0], Frame::Started { request });
    // The oracle echoes the prompt only if every slot it read is this request's own K/V,
    // as prefill wrote it.
    let (text, end) = answer(&frames);
    assert_eq!(text, expected_text(&PROMPT, MAX_TOKENS));
    let finished = Frame::Finished {
        request,
        finish: Finish::Length,
        prompt_tokens: PROMPT.len() as u32,
        completion_tokens: MAX_TOKENS,
    };
    assert_eq!(end, Some(&finished));
    decode.assert_idle();
    prefill.frame(PEER, ack);
    prefill.turn();
    prefill.assert_idle();
}

#[test]
fn a_corrupt_page_is_refused_before_decode_reads_it() {
    let (_, _, _, mut sent) = prefilled();
    let (mut decode, mut router, mut to_prefill) = reserved();
    let Frame::Page { bytes, .. } = &mut sent[1] else {
        panic!("pages come first");
    };
    bytes[5] ^= 1;
    for frame in sent {
        decode.frame(PREFILL, frame);
    }
    decode.turn();
    let nack = Frame::Nack {
        transfer: TRANSFER,
        reject: Reject::ChecksumMismatch,
    };
    assert_eq!(to_prefill.frames(), [nack]);
    let frames = router.frames();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(failure_of(&frames[0]), Failure::TransferFailed);
    decode.assert_idle();
}

#[test]
fn an_abort_mid_transfer_releases_every_reserved_page() {
    let (_, _, _, sent) = prefilled();
    let (mut decode, mut router, mut to_prefill) = reserved();
    let mut sent = sent.into_iter();
    decode.frame(PREFILL, sent.next().expect("a first page"));
    decode.turn();
    assert_eq!(decode.pages_free(), decode.pages_total() - 4);
    decode.frame(
        ROUTER,
        Frame::Abort {
            request: RequestId(1),
        },
    );
    decode.turn();
    let frames = router.frames();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(failure_of(&frames[0]), Failure::Aborted);
    decode.assert_idle();
    // The rest of the transfer lands nowhere: two pages and `Done` refused.
    for frame in sent {
        decode.frame(PREFILL, frame);
    }
    decode.turn();
    let nack = Frame::Nack {
        transfer: TRANSFER,
        reject: Reject::UnknownTransfer,
    };
    assert_eq!(to_prefill.frames(), [nack]);
    assert_eq!(decode.engine.frames_rejected, 3);
    decode.assert_idle();
}

#[test]
fn an_abort_while_sending_holds_the_pages_until_decode_answers() {
    let (mut prefill, mut router, mut peer, _) = prefilled();
    let abort = Frame::Abort {
        request: RequestId(1),
    };
    prefill.frame(ROUTER, abort.clone());
    prefill.turn();
    let transfer_abort = Frame::TransferAbort {
        transfer: TRANSFER,
        request: RequestId(1),
    };
    assert_eq!(peer.frames(), [transfer_abort]);
    // Decode may still be reading the pages (I5).
    assert_eq!(prefill.engine.pool.pages_in_state(PageState::Sending), 3);
    prefill.frame(ROUTER, abort);
    prefill.turn();
    assert_eq!(peer.frames(), [], "one TransferAbort per transfer");
    prefill.frame(PEER, Frame::AbortAck { transfer: TRANSFER });
    prefill.turn();
    prefill.assert_idle();
    assert_eq!(router.frames(), []);
}

#[test]
fn losing_the_prefill_link_mid_transfer_fails_the_request_and_frees_its_pages() {
    let (_, _, _, sent) = prefilled();
    let (mut decode, mut router, _to_prefill) = reserved();
    decode.frame(PREFILL, sent[0].clone());
    decode.turn();
    decode.send(Event::LinkDown { link: PREFILL });
    decode.turn();
    let frames = router.frames();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(failure_of(&frames[0]), Failure::PeerUnavailable);
    decode.assert_idle();
}

#[test]
fn losing_the_router_mid_transfer_aborts_through_the_protocol() {
    let (mut prefill, _, mut peer, _) = prefilled();
    prefill.send(Event::LinkDown { link: ROUTER });
    prefill.turn();
    let transfer_abort = Frame::TransferAbort {
        transfer: TRANSFER,
        request: RequestId(1),
    };
    assert_eq!(peer.frames(), [transfer_abort]);
    assert_eq!(prefill.engine.pool.pages_in_state(PageState::Sending), 3);
    // Once the decode link is gone too, nothing can read the pages: they are freed.
    prefill.send(Event::LinkDown { link: PEER });
    prefill.turn();
    prefill.assert_idle();
}

#[test]
fn requests_expire_in_the_queue_and_in_a_transfer_that_never_starts() {
    // One reservation of 16 tokens fills the pool; the second waits in the queue.
    let (mut decode, mut router) = Worker::new(Role::Decode, 16);
    for (request, transfer) in [(1, 501), (2, 502)] {
        let plan = Plan::Decode {
            transfer: TransferId(transfer),
        };
        decode.frame(
            ROUTER,
            Frame::Submit(submit(request, &PROMPT, MAX_TOKENS, plan)),
        );
    }
    decode.turn();
    let admitted = admitted(RequestId(1));
    assert_eq!(router.frames(), [admitted]);
    assert_eq!(decode.engine.queue.len(), 1);
    let submitted = Instant::now();
    let millisecond = Duration::from_millis(1);
    decode.turn_at(submitted + QUEUE_TIMEOUT + millisecond);
    let frames = router.frames();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(failure_of(&frames[0]), Failure::QueueTimeout);
    assert!(matches!(
        frames[0],
        Frame::Failed {
            request: RequestId(2),
            ..
        }
    ));
    // No frame has come yet: the prefill may itself have waited for pages.
    assert_eq!(decode.pages_free(), 0);
    decode.turn_at(submitted + QUEUE_TIMEOUT + TRANSFER_TIMEOUT + millisecond);
    let frames = router.frames();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(failure_of(&frames[0]), Failure::TransferTimeout);
    decode.assert_idle();
}

#[test]
fn a_transfer_never_answered_is_quarantined_until_its_link_goes() {
    let (mut prefill, mut router, _peer, _) = prefilled();
    let sent = Instant::now();
    prefill.turn_at(sent + TRANSFER_TIMEOUT + Duration::from_millis(1));
    let frames = router.frames();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(failure_of(&frames[0]), Failure::TransferTimeout);
    // Neither freed nor readable: decode may still be reading them.
    assert_eq!(
        prefill.engine.pool.pages_in_state(PageState::Quarantined),
        3
    );
    assert_eq!(prefill.pages_free(), prefill.pages_total() - 3);
    prefill.turn_at(sent + TRANSFER_TIMEOUT * 3);
    assert_eq!(router.frames(), [], "reported once");
    prefill.send(Event::LinkDown { link: PEER });
    prefill.turn();
    assert_eq!(router.frames(), [], "reported once");
    prefill.assert_idle();
}

#[test]
fn admission_refuses_what_cannot_fit_before_allocating() {
    let (mut decode, mut router) = Worker::new(Role::Decode, 16);
    let decode_plan = |transfer| Plan::Decode {
        transfer: TransferId(transfer),
    };
    let refused = [
        // 10 + 7 tokens, over the 16 the pool holds.
        (submit(1, &PROMPT, 7, decode_plan(1)), Failure::PoolTooSmall),
        (
            submit(2, &[1; 60], 5, decode_plan(2)),
            Failure::ContextLengthExceeded,
        ),
        (submit(3, &[], 1, decode_plan(3)), Failure::BadRequest),
        (
            submit(4, &[VOCAB as u32], 1, decode_plan(4)),
            Failure::BadRequest,
        ),
        (submit(5, &PROMPT, 0, decode_plan(5)), Failure::BadRequest),
        (submit(6, &PROMPT, 1, Plan::Unified), Failure::BadRequest),
    ];
    for (submit, failure) in refused {
        let request = submit.request;
        decode.frame(ROUTER, Frame::Submit(submit));
        decode.turn();
        let frames = router.frames();
        assert_eq!(frames.len(), 1, "{request:?}: {frames:?}");
        assert_eq!(failure_of(&frames[0]), failure, "{request:?}");
        decode.assert_idle();
    }
    // One reservation fills the pool, two more wait (queue_max), the next is turned away.
    for request in 10..14 {
        let submit = submit(request, &PROMPT, MAX_TOKENS, decode_plan(request));
        decode.frame(ROUTER, Frame::Submit(submit));
    }
    // So is a request whose id is already running.
    decode.frame(
        ROUTER,
        Frame::Submit(submit(10, &PROMPT, 1, decode_plan(99))),
    );
    decode.turn();
    let frames = router.frames();
    assert_eq!(frames.len(), 3, "{frames:?}");
    assert_eq!(frames[0], admitted(RequestId(10)));
    assert!(matches!(
        frames[1],
        Frame::Failed {
            request: RequestId(13),
            failure: Failure::Overloaded,
            ..
        }
    ));
    assert!(matches!(
        frames[2],
        Frame::Failed {
            request: RequestId(10),
            failure: Failure::BadRequest,
            ..
        }
    ));
    assert_eq!(decode.engine.queue.len(), 2);
    assert_eq!(decode.pages_free(), 0);
}

#[test]
fn only_the_slots_past_the_transfer_are_blanked() {
    let layout = kv::KvLayout {
        layer_count: 2,
        kv_head_count: 2,
        head_dim: 3,
        page_size_tokens: 4,
    };
    let mut page = vec![0xAAu8; layout.page_bytes()];
    // 6 tokens in pages of 4: the last page holds 2 written slots.
    blank_unwritten_slots(&mut page, &layout, 6);
    let (page_size, head_dim) = (layout.page_size_tokens, layout.head_dim);
    let mut checked = 0;
    for layer in 0..layout.layer_count {
        for kv_head in 0..layout.kv_head_count {
            for (kind, index) in [
                (
                    kv::KvKind::Key,
                    kernels::key_index as fn(usize, usize, usize) -> usize,
                ),
                (kv::KvKind::Value, |_, slot, d| slot * 3 + d),
            ] {
                let head = layout.head_offset(layer, kind, kv_head);
                for slot in 0..page_size {
                    for d in 0..head_dim {
                        let at = (head + index(page_size, slot, d)) * 2;
                        let want = if slot < 2 { 0xAA } else { 0 };
                        assert_eq!(
                            page[at..at + 2],
                            [want, want],
                            "layer {layer} {kind:?} head {kv_head} slot {slot} dim {d}"
                        );
                        checked += 2;
                    }
                }
            }
        }
    }
    assert_eq!(checked, page.len(), "every byte of the page is some slot's");
    // A full last page keeps everything.
    let mut full = vec![0xAAu8; layout.page_bytes()];
    blank_unwritten_slots(&mut full, &layout, 8);
    assert!(full.iter().all(|&b| b == 0xAA));
}

/// A draining worker finishes the request it holds, refuses a new one as `Overloaded` (a
/// router retries that elsewhere), says so in its pool report, and reports idle only once
/// the held request has ended and its pages are back.
#[test]
fn a_draining_worker_finishes_what_it_holds_and_refuses_new_requests() {
    let (mut unified, mut router) = Worker::new(Role::Unified, 32);
    unified.frame(
        ROUTER,
        Frame::Submit(submit(1, &PROMPT, MAX_TOKENS, Plan::Unified)),
    );
    unified.turn();
    let (idle, mut drained) = tokio::sync::oneshot::channel();
    unified.send(Event::Drain { idle });
    unified.frame(
        ROUTER,
        Frame::Submit(submit(2, &PROMPT, MAX_TOKENS, Plan::Unified)),
    );
    unified.turn();
    assert!(drained.try_recv().is_err(), "request 1 still runs");
    let mut reports_draining = false;
    let mut frames = Vec::new();
    while let Ok(frame) = router.rx.try_recv() {
        match frame {
            Frame::PoolStats { draining, .. } => reports_draining |= draining,
            frame => frames.push(frame),
        }
    }
    assert!(reports_draining, "the routers hear it drains");
    unified.settle();
    frames.extend(router.frames());
    let refused = frames
        .iter()
        .find(|f| matches!(f, Frame::Failed { request, .. } if *request == RequestId(2)))
        .expect("request 2 refused");
    assert_eq!(failure_of(refused), Failure::Overloaded);
    let (text, _) = answer(&frames);
    assert_eq!(
        text,
        expected_text(&PROMPT, MAX_TOKENS),
        "request 1 completed"
    );
    assert_eq!(drained.try_recv(), Ok(()), "idle once request 1 ended");
    unified.assert_idle();
}
