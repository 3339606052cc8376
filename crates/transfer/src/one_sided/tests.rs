//! The one-sided link between a prefill writer and a decode pool, over a real Unix socket pair
//! and a real memfd: grants, ordering, quiescence, and the guards' mutants.

use super::*;
use crate::transport::{read_frame, write_frame};
use crate::TransferDone;
use hugemem::PageCells;
use tokio::net::UnixStream;

const PAGE_BYTES: usize = 4096;
const PAGES: usize = 4;
const T: TransferId = TransferId(7);
const REQUEST: RequestId = RequestId(3);
const TENANT: TenantId = TenantId(5);

/// Decode's end: its pool, the link's fence, and the socket it answers on.
struct Decode {
    pool: PageCells<u8>,
    fence: WriteFence,
    socket: UnixStream,
    /// The `Written` frames read so far: (page index, the pool page's first byte then).
    written: Vec<(u32, u8)>,
    /// The pool page of each transfer page index, as the test granted it.
    granted: HashMap<u32, usize>,
}

impl Decode {
    fn page(&self, page: usize) -> Vec<u8> {
        self.pool.read(page).expect("no writer in decode").to_vec()
    }

    /// The next frame but `Written`, which is recorded with what its page held on arrival.
    async fn next(&mut self) -> Frame {
        loop {
            let frame = self.next_any().await;
            let Frame::Written { transfer, index } = frame else {
                return frame;
            };
            assert_eq!(transfer, T);
            let page = self.granted[&index];
            self.written.push((index, self.page(page)[0]));
        }
    }

    async fn next_any(&mut self) -> Frame {
        let read = tokio::time::timeout(Duration::from_secs(5), read_frame(&mut self.socket));
        read.await
            .expect("a frame in time")
            .expect("readable")
            .expect("not closed")
    }

    async fn send(&mut self, frame: Frame) {
        if let Frame::WriteGrant {
            first_index,
            pool_pages,
            ..
        } = &frame
        {
            for (slot, &page) in pool_pages.iter().enumerate() {
                self.granted
                    .insert(first_index + slot as u32, page as usize);
            }
        }
        write_frame(&mut self.socket, &frame).await.expect("sent");
    }
}

/// Decode offers a fresh pool of `PAGES` pages over a socket pair; prefill accepts it as pages
/// of `accepted_page_bytes`. Returns prefill's end, what it made of the offer, and decode's end.
async fn offer(accepted_page_bytes: usize) -> (UnixStream, io::Result<SharedPool>, Decode) {
    let (prefill_end, decode_end) = UnixStream::pair().expect("socket pair");
    let pool = PageCells::<u8>::zeroed_shared(PAGES, PAGE_BYTES).expect("memfd");
    let fence = WriteFence::create().expect("fence");
    let pool_fd = pool.shared_fd().expect("shared");
    let offered = offer_pool(
        &decode_end,
        pool_fd,
        PAGES as u32,
        PAGE_BYTES as u64,
        &fence,
    );
    let accepted = accept_pool(&prefill_end, accepted_page_bytes);
    let (offered, accepted) = tokio::join!(offered, accepted);
    offered.expect("offered");
    let decode = Decode {
        pool,
        fence,
        socket: decode_end,
        written: Vec::new(),
        granted: HashMap::new(),
    };
    (prefill_end, accepted, decode)
}

async fn linked(faults: WriterFaults) -> (Link, Decode) {
    let (prefill_end, accepted, decode) = offer(PAGE_BYTES).await;
    let shared = Arc::new(accepted.expect("accepted"));
    let link = spawn_one_sided_link(Box::new(prefill_end), "test".into(), shared, faults);
    (link, decode)
}

fn page(index: u32, fill: u8) -> Frame {
    page_of(REQUEST, TENANT, index, fill)
}

fn page_of(request: RequestId, tenant: TenantId, index: u32, fill: u8) -> Frame {
    Frame::Page {
        transfer: T,
        request,
        tenant,
        index,
        bytes: PageBytes::Owned(vec![fill; PAGE_BYTES]),
    }
}

fn done() -> Frame {
    Frame::Done(TransferDone {
        transfer: T,
        request: REQUEST,
        tenant: TENANT,
        page_count: 3,
        token_count: 40,
        checksum: 9,
    })
}

/// `done()` as the writer sends it: its checksum computed from the pages it hashed, page
/// `i` filled with `fills[i]` (`None`: never hashed, which counts as hash 0).
fn done_written(fills: [Option<u8>; 3]) -> Frame {
    let Frame::Done(mut done) = done() else {
        unreachable!("done() is a Done")
    };
    let mut root = crate::TransferHasher::new(&done);
    for fill in fills {
        root.page_hash(fill.map_or(0, |fill| crate::page_hash(&[fill; PAGE_BYTES])));
    }
    done.checksum = root.finish();
    Frame::Done(done)
}

fn grant(pool_pages: Vec<u32>) -> Frame {
    Frame::WriteGrant {
        transfer: T,
        first_index: 1,
        pool_pages,
    }
}

#[tokio::test]
async fn pages_wait_for_their_grant_and_done_follows_the_writes() {
    let (link, mut decode) = linked(WriterFaults::default()).await;
    for frame in [page(1, 0xA1), page(2, 0xB2), done()] {
        link.tx.send(frame).unwrap();
    }
    let ask = decode.next().await;
    assert_eq!(
        ask,
        Frame::GrantAsk {
            transfer: T,
            request: REQUEST,
            tenant: TENANT
        }
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        (0..PAGES).all(|p| decode.page(p).iter().all(|&b| b == 0)),
        "nothing is written before the grant"
    );
    decode.send(grant(vec![3, 0])).await;
    assert_eq!(
        decode.next().await,
        done_written([None, Some(0xA1), Some(0xB2)]),
        "Done, and only after the writes"
    );
    assert!(
        decode.page(3).iter().all(|&b| b == 0xA1),
        "page 1 went to pool page 3"
    );
    assert!(
        decode.page(0).iter().all(|&b| b == 0xB2),
        "page 2 went to pool page 0"
    );
    assert!(decode
        .page(1)
        .iter()
        .chain(&decode.page(2))
        .all(|&b| b == 0));
    assert!(decode.fence.written() >= 2, "the writes count as progress");
    let mut written = decode.written.clone();
    written.sort();
    assert_eq!(
        written,
        [(1, 0xA1), (2, 0xB2)],
        "each write is reported once, after its bytes landed, and before Done"
    );
}

/// A page is written once: decode hashes it when told it landed, so a second write would
/// change bytes already hashed, unseen by the checksum at `Done`. The spec's
/// `RewriteAfterWritten` mutant writes it again, after the report.
#[tokio::test]
async fn a_page_is_written_once_and_the_mutant_writes_it_again_after_reporting_it() {
    for rewrite_written in [false, true] {
        let faults = WriterFaults {
            rewrite_written,
            ..WriterFaults::default()
        };
        let (link, mut decode) = linked(faults).await;
        link.tx.send(page(1, 0xA1)).unwrap();
        assert!(matches!(decode.next().await, Frame::GrantAsk { .. }));
        decode.send(grant(vec![2])).await;
        assert_eq!(
            decode.next_any().await,
            Frame::Written {
                transfer: T,
                index: 1
            }
        );
        // The same page again (a duplicated frame, or a bug), with other bytes.
        link.tx.send(page(1, 0xEE)).unwrap();
        link.tx.send(done()).unwrap();
        // The checksum is the first write's: the mutant's second one is not hashed either.
        assert_eq!(decode.next().await, done_written([None, Some(0xA1), None]));
        let now = decode.page(2)[0];
        assert!(decode.written.is_empty(), "a page is reported once");
        if rewrite_written {
            assert_eq!(now, 0xEE, "the mutant overwrote a page reported final");
        } else {
            assert!(decode.page(2).iter().all(|&b| b == 0xA1), "written once");
        }
    }
}

#[tokio::test]
async fn a_page_outside_its_grant_or_of_another_request_is_not_written() {
    let (link, mut decode) = linked(WriterFaults::default()).await;
    link.tx.send(page(1, 0x11)).unwrap();
    assert!(matches!(decode.next().await, Frame::GrantAsk { .. }));
    decode.send(grant(vec![2])).await;
    for frame in [
        page(2, 0x22),                          // past the grant
        page(0, 0x33),                          // before it (a page decode holds)
        page_of(RequestId(4), TENANT, 1, 0x44), // another request
        page_of(REQUEST, TenantId(6), 1, 0x55), // another tenant
        done(),
    ] {
        link.tx.send(frame).unwrap();
    }
    // Page 0, which decode holds, is hashed for the checksum though not written; page 2,
    // past the grant, is neither.
    assert_eq!(
        decode.next().await,
        done_written([Some(0x33), Some(0x11), None])
    );
    assert!(
        decode.page(2).iter().all(|&b| b == 0x11),
        "only the granted page"
    );
    for other in [0, 1, 3] {
        assert!(decode.page(other).iter().all(|&b| b == 0), "page {other}");
    }
}

#[tokio::test]
async fn a_refused_grant_drops_the_pages_and_lets_done_through() {
    let (link, mut decode) = linked(WriterFaults::default()).await;
    link.tx.send(page(1, 0x11)).unwrap();
    link.tx.send(done()).unwrap();
    assert!(matches!(decode.next().await, Frame::GrantAsk { .. }));
    let nack = Frame::Nack {
        transfer: T,
        reject: crate::Reject::UnknownTransfer,
    };
    decode.send(nack.clone()).await;
    assert_eq!(decode.next().await, done());
    let mut link = link;
    assert_eq!(
        link.rx.recv().await,
        Some(nack),
        "the engine hears the refusal too"
    );
    assert!((0..PAGES).all(|p| decode.page(p).iter().all(|&b| b == 0)));
}

/// The quiescence guard, and the spec's `AbortAckBeforeQuiescence` mutant shown to break it:
/// a write held back past decode's `WriteAbort` lands before the answer, or after it.
#[tokio::test]
async fn the_abort_answer_waits_for_posted_writes_and_the_mutant_does_not() {
    for ack_before_quiescence in [false, true] {
        let faults = WriterFaults {
            write_delay: Some(Duration::from_millis(300)),
            delayed_transfer: None,
            ack_before_quiescence,
            ..WriterFaults::default()
        };
        let (mut link, mut decode) = linked(faults).await;
        link.tx.send(page(1, 0x77)).unwrap();
        assert!(matches!(decode.next().await, Frame::GrantAsk { .. }));
        decode.send(grant(vec![1])).await;
        // Let the write be posted (it then sleeps), then ask prefill to stop.
        tokio::time::sleep(Duration::from_millis(50)).await;
        decode.send(Frame::WriteAbort { transfer: T }).await;
        assert_eq!(
            link.rx.recv().await,
            Some(Frame::WriteAbort { transfer: T })
        );
        link.tx.send(page(2, 0x88)).unwrap(); // after the stop: never written
        link.tx.send(Frame::WriteAbortAck { transfer: T }).unwrap();
        assert_eq!(decode.next().await, Frame::WriteAbortAck { transfer: T });
        let landed = decode.page(1).iter().all(|&b| b == 0x77);
        assert_eq!(
            landed, !ack_before_quiescence,
            "with the guard the write has landed when the answer comes; the mutant answers first"
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            decode.page(1).iter().all(|&b| b == 0x77),
            "the held write lands in the end"
        );
        assert!((2..PAGES).all(|p| decode.page(p).iter().all(|&b| b == 0)));
    }
}

#[tokio::test]
async fn a_fenced_link_writes_nothing_more() {
    let (link, mut decode) = linked(WriterFaults::default()).await;
    link.tx.send(page(1, 0x11)).unwrap();
    assert!(matches!(decode.next().await, Frame::GrantAsk { .. }));
    decode.fence.fence();
    assert!(decode.fence.quiesced());
    decode.send(grant(vec![0])).await;
    link.tx.send(done()).unwrap();
    assert_eq!(decode.next().await, done_written([None, None, None]));
    assert!(
        decode.page(0).iter().all(|&b| b == 0),
        "fenced: not written"
    );
}

#[tokio::test]
async fn an_offer_of_another_page_size_is_refused() {
    let (_, accepted, _) = offer(PAGE_BYTES * 2).await;
    let error = accepted.err().expect("refused");
    assert!(error.to_string().contains("agreed size"), "{error}");
    // A peer that sends bytes but no descriptors is no pool offer either.
    let (prefill_end, decode_end) = UnixStream::pair().expect("socket pair");
    let mut decode_end = decode_end;
    tokio::io::AsyncWriteExt::write_all(&mut decode_end, &[0u8; 16])
        .await
        .unwrap();
    assert!(accept_pool(&prefill_end, PAGE_BYTES).await.is_err());
}

#[tokio::test]
async fn done_carries_the_writers_checksum_unless_the_engine_keeps_its_own() {
    for engine_checksums in [false, true] {
        let faults = WriterFaults {
            engine_checksums,
            ..WriterFaults::default()
        };
        let (link, mut decode) = linked(faults).await;
        for frame in [page(0, 0x10), page(1, 0xA1), page(2, 0xB2), done()] {
            link.tx.send(frame).unwrap();
        }
        assert!(matches!(decode.next().await, Frame::GrantAsk { .. }));
        decode.send(grant(vec![3, 0])).await;
        let expected = if engine_checksums {
            done()
        } else {
            done_written([Some(0x10), Some(0xA1), Some(0xB2)])
        };
        assert_eq!(
            decode.next().await,
            expected,
            "engine_checksums {engine_checksums}"
        );
        // Whoever computed it, the writer's checksum is what decode finds in its own pages.
        let Frame::Done(written) = done_written([Some(0x10), Some(0xA1), Some(0xB2)]) else {
            unreachable!()
        };
        let held = vec![0x10u8; PAGE_BYTES];
        let (one, two) = (decode.page(3), decode.page(0));
        let pages: [&[u8]; 3] = [&held, &one, &two];
        assert_eq!(crate::transfer_checksum(&written, pages), written.checksum);
    }
}

#[tokio::test]
async fn a_transfer_of_no_pages_gets_its_checksum_over_none() {
    // A one-token prompt moves no KV: `Done` alone, with no page to ask a grant for.
    let (link, mut decode) = linked(WriterFaults::default()).await;
    let Frame::Done(mut empty) = done() else {
        unreachable!()
    };
    empty.page_count = 0;
    link.tx.send(Frame::Done(empty)).unwrap();
    let Frame::Done(sent) = decode.next().await else {
        panic!("Done comes at once")
    };
    let none: [&[u8]; 0] = [];
    assert_eq!(sent.checksum, crate::transfer_checksum(&empty, none));
}

/// What lets a stop take effect at once with a whole transfer queued on the copy thread: a
/// write that has not begun when its transfer is stopped copies, hashes and reports nothing,
/// while one whose transfer goes on does all three. A delayed write (fault injection) is the
/// late write its fault plans, stopped or not.
#[tokio::test]
async fn a_write_of_a_stopped_transfer_is_skipped_unless_it_has_begun() {
    let (_prefill_end, accepted, decode) = offer(PAGE_BYTES).await;
    let pool = accepted.expect("accepted");
    let (ready, mut reports) = mpsc::unbounded_channel();
    let cases = [
        (0, false, None),
        (1, true, None),
        (2, true, Some(Duration::from_millis(1))),
    ];
    for (page, stopped, delay) in cases {
        let hashes = PageHashes::default();
        let bytes = vec![0x40 + page as u8; PAGE_BYTES];
        let write = PageWrite {
            page,
            bytes: PageBytes::Owned(bytes.clone()),
            report: Some((page as u32, 1)),
            delay,
            hashes: hashes.clone(),
            stopped: Arc::new(AtomicBool::new(stopped)),
        };
        write.run(&pool, &ready, T);
        let lands = !stopped || delay.is_some();
        let expected = if lands {
            bytes.clone()
        } else {
            vec![0; PAGE_BYTES]
        };
        assert_eq!(
            decode.page(page),
            expected,
            "page {page}: written iff {lands}"
        );
        let reported = reports.try_recv().ok();
        let written = Frame::Written {
            transfer: T,
            index: page as u32,
        };
        assert_eq!(reported, lands.then_some(written), "page {page}: reported");
        let hashed = hashes.0.lock().unwrap().get(&(page as u32)).copied();
        assert_eq!(hashed, lands.then(|| crate::page_hash(&bytes)));
    }
}
