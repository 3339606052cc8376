//! Streamed transfers: prefill sends each page as the chunk that completes it runs, and an
//! abort at any phase of the stream frees both sides' pages.

use super::tests::{
    admitted, answer, expected_text, failure_of, prefill_plan, reserved, split_transfer, submit,
    Link, Worker, MAX_TOKENS, PEER, PREFILL, PROMPT, ROUTER, TRANSFER, TRANSFER_TIMEOUT,
};
use super::{Event, LinkKind};
use kv::{PageState, RequestId};
use std::time::{Duration, Instant};
use transfer::{transfer_checksum, Failure, Frame, Reject, Role};

/// A prefill worker that prefills [`PROMPT`] (nine tokens of KV, pages of four) four tokens
/// a step, so each step completes one page; the request is submitted, nothing has run.
fn chunked_prefill() -> (Worker, Link, Link) {
    let (mut prefill, router) = Worker::with_step_tokens(Role::Prefill, 32, 4);
    let peer = prefill.link(PEER, LinkKind::DecodePeer);
    prefill.send(Event::SubmitToPeer {
        link: ROUTER,
        submit: submit(1, &PROMPT, MAX_TOKENS, prefill_plan(TRANSFER)),
        peer: PEER,
    });
    (prefill, router, peer)
}

fn page_indexes(frames: &[Frame]) -> Vec<u32> {
    frames
        .iter()
        .filter_map(|frame| match frame {
            Frame::Page { index, .. } => Some(*index),
            _ => None,
        })
        .collect()
}

#[test]
fn pages_leave_as_each_chunk_completes_them_and_decode_answers_from_them() {
    let (mut prefill, mut router, mut peer) = chunked_prefill();
    let (mut decode, mut decode_router, mut to_prefill) = reserved();
    let mut sent = Vec::new();
    // Steps of 4, 4 and 1 tokens: pages 0 and 1 go out while the prompt is still running,
    // page 2 (partial) and `Done` with the last chunk. Decode takes each page as it comes.
    for expected in [vec![0], vec![1], vec![2]] {
        prefill.turn();
        let frames = peer.frames();
        assert_eq!(page_indexes(&frames), expected);
        let has_done = frames.iter().any(|f| matches!(f, Frame::Done(_)));
        assert_eq!(
            has_done,
            expected == [2],
            "Done comes only with the last chunk"
        );
        for frame in &frames {
            decode.frame(PREFILL, frame.clone());
        }
        decode.turn();
        sent.extend(frames);
    }
    assert_eq!(router.frames(), vec![admitted(RequestId(1))]);
    // The streamed checksum is the one over the whole transfer.
    let (pages, done) = split_transfer(&sent);
    assert_eq!((done.page_count, done.token_count), (3, 9));
    let whole = transfer_checksum(&done, pages.iter().map(|p| p.1.as_slice()));
    assert_eq!(done.checksum, whole);
    let ack = Frame::Ack { transfer: TRANSFER };
    assert_eq!(to_prefill.frames(), std::slice::from_ref(&ack));
    decode.settle();
    let (text, _) = answer(&decode_router.frames());
    assert_eq!(text, expected_text(&PROMPT, MAX_TOKENS));
    decode.assert_idle();
    prefill.frame(PEER, ack);
    prefill.turn();
    prefill.assert_idle();
}

#[test]
fn an_abort_of_both_sides_mid_stream_frees_every_page() {
    let (mut prefill, mut router, mut peer) = chunked_prefill();
    let (mut decode, mut decode_router, mut to_prefill) = reserved();
    prefill.turn();
    let first = peer.frames();
    assert_eq!(page_indexes(&first), [0]);
    for frame in first {
        decode.frame(PREFILL, frame);
    }
    decode.turn();
    // The client goes away: the router aborts both sides (I7).
    let abort = Frame::Abort {
        request: RequestId(1),
    };
    prefill.frame(ROUTER, abort.clone());
    decode.frame(ROUTER, abort);
    prefill.turn();
    decode.turn();
    // Prefill was still computing: nothing of its pages is left anywhere but in frames
    // already sent, so they are free at once, and no more frames go out.
    prefill.assert_idle();
    assert_eq!(peer.frames(), []);
    decode.assert_idle();
    let frames = router.frames();
    assert_eq!(failure_of(&frames[1]), Failure::Aborted, "{frames:?}");
    assert_eq!(failure_of(&decode_router.frames()[0]), Failure::Aborted);
    assert_eq!(to_prefill.frames(), []);
}

#[test]
fn decode_aborted_mid_stream_refuses_the_rest_and_prefill_frees_on_the_nack() {
    let (mut prefill, _router, mut peer) = chunked_prefill();
    let (mut decode, mut decode_router, mut to_prefill) = reserved();
    prefill.turn();
    for frame in peer.frames() {
        decode.frame(PREFILL, frame);
    }
    decode.frame(
        ROUTER,
        Frame::Abort {
            request: RequestId(1),
        },
    );
    decode.turn();
    assert_eq!(failure_of(&decode_router.frames()[0]), Failure::Aborted);
    decode.assert_idle();
    // Prefill has not heard yet: it streams the rest, which lands nowhere.
    prefill.settle();
    let rest = peer.frames();
    assert_eq!(page_indexes(&rest), [1, 2]);
    for frame in rest {
        decode.frame(PREFILL, frame);
    }
    decode.turn();
    decode.assert_idle();
    assert_eq!(decode.engine.frames_rejected, 3);
    let answer = to_prefill.frames();
    assert_eq!(
        answer,
        [Frame::Nack {
            transfer: TRANSFER,
            reject: Reject::UnknownTransfer,
        }]
    );
    assert_eq!(prefill.engine.pool.pages_in_state(PageState::Sending), 3);
    for frame in answer {
        prefill.frame(PEER, frame);
    }
    prefill.turn();
    prefill.assert_idle();
}

#[test]
fn a_stream_that_goes_silent_times_out_on_decode_and_frees_its_pages() {
    let (mut prefill, _router, mut peer) = chunked_prefill();
    let (mut decode, mut decode_router, _to_prefill) = reserved();
    prefill.turn();
    for frame in peer.frames() {
        decode.frame(PREFILL, frame);
    }
    decode.turn();
    // The prefill worker stops (hung, or its chunks starved): decode's clock runs from the
    // last frame, and silence longer than the transfer timeout ends the reservation.
    let later = Instant::now() + TRANSFER_TIMEOUT / 2;
    decode.turn_at(later);
    assert_eq!(
        decode_router.frames(),
        [],
        "half the timeout is not silence"
    );
    decode.turn_at(Instant::now() + TRANSFER_TIMEOUT + Duration::from_secs(1));
    let frames = decode_router.frames();
    assert_eq!(failure_of(&frames[0]), Failure::TransferTimeout);
    decode.assert_idle();
}

#[test]
fn losing_the_decode_link_mid_stream_fails_prefill_and_frees_its_pages() {
    let (mut prefill, mut router, mut peer) = chunked_prefill();
    prefill.turn();
    assert_eq!(page_indexes(&peer.frames()), [0]);
    prefill.send(Event::LinkDown { link: PEER });
    prefill.turn();
    let frames = router.frames();
    assert_eq!(
        failure_of(&frames[1]),
        Failure::PeerUnavailable,
        "{frames:?}"
    );
    prefill.assert_idle();
}

#[test]
fn a_one_token_prompt_sends_only_done() {
    let (mut prefill, _router) = Worker::with_step_tokens(Role::Prefill, 32, 4);
    let mut peer = prefill.link(PEER, LinkKind::DecodePeer);
    prefill.send(Event::SubmitToPeer {
        link: ROUTER,
        submit: submit(1, &PROMPT[..1], MAX_TOKENS, prefill_plan(TRANSFER)),
        peer: PEER,
    });
    prefill.settle();
    let (pages, done) = split_transfer(&peer.frames());
    assert!(pages.is_empty());
    assert_eq!((done.page_count, done.token_count), (0, 0));
    prefill.frame(PEER, Frame::Ack { transfer: TRANSFER });
    prefill.turn();
    prefill.assert_idle();
}

#[test]
fn sent_pages_are_lent_from_the_pool_and_reused_only_once_the_writer_lets_go() {
    let (mut prefill, _router, mut peer) = chunked_prefill();
    prefill.settle();
    // Read the link as its writer would, without copying the bytes out.
    let mut in_flight = Vec::new();
    while let Ok(frame) = peer.rx.try_recv() {
        if let Frame::Page { bytes, .. } = &frame {
            assert!(matches!(bytes, transfer::PageBytes::Lent(_)), "{bytes:?}");
        }
        in_flight.push(frame);
    }
    assert_eq!(page_indexes(&in_flight), [0, 1, 2]);
    // Decode's Ack comes while the writer still holds the frames: the pages are released but
    // parked, counted with the quarantined ones, and not handed out.
    prefill.frame(PEER, Frame::Ack { transfer: TRANSFER });
    prefill.turn();
    assert_eq!(prefill.engine.pool.pages_returning(), 3);
    assert_eq!(prefill.pages_free(), prefill.pages_total() - 3);
    drop(in_flight);
    prefill.turn();
    prefill.assert_idle();
}

/// A framed link whose writer hashes (`transfer::transport::spawn_hashing_link`): the engine
/// hashes only the page decode holds, into the link's hashes, and sends it nowhere, and `Done`
/// leaves without a checksum. The one the writer then computes, hashing each page frame it
/// writes, is the engine's own over the same transfer.
#[test]
fn a_hashing_links_writer_gets_the_held_pages_hash_and_computes_the_engines_checksum() {
    let run = |hashes: Option<transfer::SenderHashes>| {
        let (mut prefill, _router) = Worker::with_step_tokens(Role::Prefill, 32, 4);
        let mut peer = prefill.link_hashing(PEER, LinkKind::DecodePeer, hashes);
        let plan = transfer::Plan::Prefill {
            transfer: TRANSFER,
            decode_addr: "decode.test:1".into(),
            decode_holds_pages: 1,
        };
        prefill.send(Event::SubmitToPeer {
            link: ROUTER,
            submit: submit(1, &PROMPT, MAX_TOKENS, plan),
            peer: PEER,
        });
        let mut sent = Vec::new();
        while !sent.iter().any(|frame| matches!(frame, Frame::Done(_))) {
            prefill.turn();
            sent.extend(peer.frames());
        }
        sent
    };
    let by_engine = run(None);
    let hashes = transfer::SenderHashes::default();
    let for_writer = run(Some(hashes.clone()));
    assert_eq!(
        page_indexes(&by_engine),
        [1, 2],
        "the held page is not sent"
    );
    assert_eq!(page_indexes(&for_writer), [1, 2]);
    let (_, engine_done) = split_transfer(&by_engine);
    let (pages, writer_done) = split_transfer(&for_writer);
    assert_ne!(engine_done.checksum, 0);
    assert_eq!(writer_done.checksum, 0, "the writer fills it in");
    // What the writer does: each page frame's hash as it writes it, then the root at `Done`.
    for (index, bytes) in &pages {
        hashes.put(TRANSFER, *index, transfer::page_hash(bytes));
    }
    assert_eq!(hashes.take_checksum(&writer_done), engine_done.checksum);
    // Without the held page's hash (an engine that forgot it), the writer's checksum fails.
    for (index, bytes) in &pages {
        hashes.put(TRANSFER, *index, transfer::page_hash(bytes));
    }
    assert_ne!(hashes.take_checksum(&writer_done), engine_done.checksum);
}
