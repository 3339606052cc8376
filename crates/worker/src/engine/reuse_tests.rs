//! Prefix reuse driven through the engine: within a tenant (and partition) a later request
//! starts from the cached pages and computes only the rest; across tenants nothing is shared;
//! decode receives only the pages it lacks and still checks every page it will read.

use super::tests::{
    admitted, answer, expected_text, failure_of, prefill_plan, split_transfer, submit, Link,
    Worker, MAX_TOKENS, PEER, PREFILL, PROMPT, ROUTER, TENANT, TRANSFER,
};
use super::{Event, LinkKind};
use kv::{Partition, RequestId, TenantId};
use transfer::{transfer_checksum, Failure, Frame, Plan, Reject, Role, Submit, TransferId};

/// [`PROMPT`] moves nine tokens of K/V: two full pages of four, and one partial page.
const CACHED_PAGES: u32 = 2;
const CACHED_TOKENS: u32 = 8;

/// A submit that may use the cache of `tenant`'s `partition`.
fn cached(request: u64, tenant: TenantId, partition: u64, plan: Plan) -> Submit {
    Submit {
        tenant,
        prefix_cache: Some(Partition(partition)),
        ..submit(request, &PROMPT, MAX_TOKENS, plan)
    }
}

fn admitted_from_cache(request: u64) -> Frame {
    Frame::Admitted {
        request: RequestId(request),
        cached_tokens: CACHED_TOKENS,
        cached_pages: CACHED_PAGES,
    }
}

impl Worker {
    /// Runs a unified request to its end and returns its router frames.
    fn run_unified(&mut self, router: &mut Link, submit: Submit) -> Vec<Frame> {
        self.frame(ROUTER, Frame::Submit(submit));
        self.settle();
        router.frames()
    }

    /// Nothing held by requests: every page is free or cached with no reference (I9).
    fn assert_idle_but_cached(&mut self) {
        let pool = &self.engine.pool;
        assert_eq!(
            pool.pages_free() + pool.pages_reclaimable(),
            pool.page_count(),
            "every page is free or only cached"
        );
        assert!(self.engine.requests.is_empty());
        self.engine.cache.flush(&mut self.engine.pool);
        self.assert_idle();
    }
}

#[test]
fn a_tenants_second_request_computes_only_what_it_has_not_cached() {
    let (mut unified, mut router) = Worker::new(Role::Unified, 32);
    let expected = expected_text(&PROMPT, MAX_TOKENS);
    let frames = unified.run_unified(&mut router, cached(1, TENANT, 0, Plan::Unified));
    assert_eq!(frames[0], admitted(RequestId(1)), "a cold cache");
    assert_eq!(answer(&frames).0, expected);
    assert_eq!(unified.engine.prefilled_tokens, 8 + 1);
    assert_eq!(unified.engine.pool.pages_reclaimable(), 2);

    // The same tenant and partition: two pages from the cache, one token computed. The
    // oracle echoes the prompt only if every slot it read holds this tenant's K/V of it.
    let frames = unified.run_unified(&mut router, cached(2, TENANT, 0, Plan::Unified));
    assert_eq!(frames[0], admitted_from_cache(2));
    assert_eq!(answer(&frames).0, expected);
    assert_eq!(unified.engine.prefilled_tokens, 9 + 1);

    // Another tenant, another partition, or a request told not to use the cache: cold, and
    // every prompt token computed again.
    let other_tenant = cached(3, TenantId(8), 0, Plan::Unified);
    let other_partition = cached(4, TENANT, 5, Plan::Unified);
    let no_cache = submit(5, &PROMPT, MAX_TOKENS, Plan::Unified);
    let mut prefilled = unified.engine.prefilled_tokens;
    for (request, submit) in [(3, other_tenant), (4, other_partition), (5, no_cache)] {
        let frames = unified.run_unified(&mut router, submit);
        assert_eq!(frames[0], admitted(RequestId(request)), "request {request}");
        assert_eq!(answer(&frames).0, expected);
        prefilled += 9;
        assert_eq!(unified.engine.prefilled_tokens, prefilled);
    }
    let stats = unified.engine.cache.stats();
    assert_eq!((stats.lookups, stats.hit_pages), (4, 2), "{stats:?}");
    // Tenant 7, tenant 8 and partition 5 each left two pages; the last request needed room,
    // and the least recently used two (tenant 7's) made it.
    assert_eq!((stats.cached_pages, stats.evictions), (4, 2), "{stats:?}");
    unified.assert_idle_but_cached();
}

#[test]
fn cached_pages_give_way_to_a_request_that_needs_them() {
    // Four pages: the first request leaves two cached, the next needs all four.
    let (mut unified, mut router) = Worker::new(Role::Unified, 16);
    let frames = unified.run_unified(&mut router, cached(1, TENANT, 0, Plan::Unified));
    assert_eq!(answer(&frames).0, expected_text(&PROMPT, MAX_TOKENS));
    assert_eq!(unified.pages_free(), 2);
    let other = cached(2, TenantId(8), 0, Plan::Unified);
    let frames = unified.run_unified(&mut router, other);
    assert_eq!(frames[0], admitted(RequestId(2)), "admitted at once");
    assert_eq!(answer(&frames).0, expected_text(&PROMPT, MAX_TOKENS));
    assert_eq!(unified.engine.cache.stats().evictions, 2);
    unified.assert_idle_but_cached();
}

/// A prefill and a decode worker with their cache on, linked, and the frames prefill sent for
/// request `request` (pages then `Done`), decode having said it holds `holds` pages.
struct Pair {
    prefill: Worker,
    decode: Worker,
    decode_router: Link,
    to_prefill: Link,
    to_decode: Link,
}

impl Pair {
    fn new() -> Pair {
        let (prefill, _) = Worker::new(Role::Prefill, 32);
        let (mut decode, decode_router) = Worker::new(Role::Decode, 32);
        let to_prefill = decode.link(PREFILL, LinkKind::PrefillPeer);
        let mut pair = Pair {
            prefill,
            decode,
            decode_router,
            to_prefill,
            to_decode: Link::closed(),
        };
        pair.to_decode = pair.prefill.link(PEER, LinkKind::DecodePeer);
        pair
    }

    /// Decode reserves request `request`; returns its `Admitted`.
    fn reserve(&mut self, request: u64, transfer: TransferId) -> Frame {
        let plan = Plan::Decode { transfer };
        self.decode
            .frame(ROUTER, Frame::Submit(cached(request, TENANT, 0, plan)));
        self.decode.turn();
        self.decode_router.frames().remove(0)
    }

    /// Prefill runs request `request`, told decode holds `holds` pages; returns what it sent.
    fn prefill(&mut self, request: u64, transfer: TransferId, holds: u32) -> Vec<Frame> {
        let mut plan = prefill_plan(transfer);
        if let Plan::Prefill {
            decode_holds_pages, ..
        } = &mut plan
        {
            *decode_holds_pages = holds;
        }
        self.prefill.send(Event::SubmitToPeer {
            link: ROUTER,
            submit: cached(request, TENANT, 0, plan),
            peer: PEER,
        });
        self.prefill.settle();
        self.to_decode.frames()
    }

    /// Request 1 of the tenant, sent by prefill (its frames passed through `tamper` first) and
    /// delivered to decode, which caches its pages if it verifies; returns decode's answer to
    /// prefill, with decode's router frames read and dropped.
    fn first_transfer(&mut self, tamper: impl FnOnce(&mut Vec<Frame>)) -> Vec<Frame> {
        self.reserve(1, TRANSFER);
        let mut sent = self.prefill(1, TRANSFER, 0);
        tamper(&mut sent);
        let answer = self.deliver(sent);
        self.decode.settle();
        self.decode_router.frames();
        answer
    }

    /// Delivers `frames` to decode and returns decode's answer to prefill.
    fn deliver(&mut self, frames: Vec<Frame>) -> Vec<Frame> {
        for frame in frames {
            self.decode.frame(PREFILL, frame);
        }
        self.decode.turn();
        self.to_prefill.frames()
    }
}

impl Link {
    /// A placeholder until the real link is opened.
    fn closed() -> Link {
        let (_, rx) = tokio::sync::mpsc::unbounded_channel();
        Link { rx }
    }
}

#[test]
fn decode_receives_only_the_pages_it_lacks_and_checks_all_it_reads() {
    let mut pair = Pair::new();
    // First request: nothing cached anywhere; three pages travel.
    assert_eq!(pair.reserve(1, TRANSFER), admitted(RequestId(1)));
    let sent = pair.prefill(1, TRANSFER, 0);
    assert_eq!(split_transfer(&sent).0.len(), 3);
    assert_eq!(pair.deliver(sent), [Frame::Ack { transfer: TRANSFER }]);
    pair.decode.settle();
    let frames = pair.decode_router.frames();
    assert_eq!(answer(&frames).0, expected_text(&PROMPT, MAX_TOKENS));

    // Second request of the tenant: decode holds two pages, so only the third travels, and
    // `Done`'s checksum still covers all three.
    let second = TransferId(501);
    assert_eq!(pair.reserve(2, second), admitted_from_cache(2));
    let sent = pair.prefill(2, second, CACHED_PAGES);
    let (pages, done) = split_transfer_of(&sent, second);
    assert_eq!(pages, [2]);
    assert_eq!(done.page_count, 3);
    assert_eq!(pair.prefill.engine.pages_not_sent, 2);
    assert_eq!(pair.prefill.engine.pages_sent, 3 + 1);
    assert_eq!(pair.deliver(sent), [Frame::Ack { transfer: second }]);
    pair.decode.settle();
    let frames = pair.decode_router.frames();
    assert_eq!(answer(&frames).0, expected_text(&PROMPT, MAX_TOKENS));
    assert_eq!(pair.decode.engine.cache.stats().hit_pages, 2);
    pair.decode.assert_idle_but_cached();
}

#[test]
fn decode_goes_by_its_own_count_of_held_pages_not_the_senders() {
    let mut pair = Pair::new();
    pair.first_transfer(|_| {});
    // Decode holds two pages; a sender that believes it holds none sends a frame for a held
    // page, which would overwrite a shared page: refused, and the request fails cleanly.
    let second = TransferId(501);
    assert_eq!(pair.reserve(2, second), admitted_from_cache(2));
    let sent = pair.prefill(2, second, 0);
    let answer_to_prefill = pair.deliver(sent);
    assert_eq!(
        answer_to_prefill[0],
        Frame::Nack {
            transfer: second,
            reject: Reject::BadPage
        }
    );
    let frames = pair.decode_router.frames();
    assert_eq!(failure_of(&frames[0]), Failure::TransferFailed);
    pair.decode.assert_idle_but_cached();
}

#[test]
fn a_wrong_reuse_on_decode_fails_the_checksum_like_corruption() {
    let mut pair = Pair::new();
    // A sender that lies consistently: page 1 altered and the checksum made to match. Decode
    // cannot tell, and caches what it verified.
    let answer = pair.first_transfer(|sent| {
        if let Frame::Page { bytes, .. } = &mut sent[1] {
            bytes[5] ^= 1;
        }
        let (pages, mut done) = split_transfer(sent);
        done.checksum = transfer_checksum(&done, pages.iter().map(|p| p.1.as_slice()));
        *sent.last_mut().expect("Done") = Frame::Done(done);
    });
    assert_eq!(answer, [Frame::Ack { transfer: TRANSFER }]);
    // The honest sender's checksum covers the pages decode reuses: they differ, so the
    // transfer is refused rather than answered from K/V the sender never vouched for.
    let second = TransferId(501);
    assert_eq!(pair.reserve(2, second), admitted_from_cache(2));
    let sent = pair.prefill(2, second, CACHED_PAGES);
    let answer_to_prefill = pair.deliver(sent);
    assert_eq!(
        answer_to_prefill[0],
        Frame::Nack {
            transfer: second,
            reject: Reject::ChecksumMismatch
        }
    );
    pair.decode.assert_idle_but_cached();
}

#[test]
fn a_corrupt_transfer_never_enters_the_cache() {
    // TEST-MATRIX I12: the repeat recomputes instead of reusing what failed verification.
    let mut pair = Pair::new();
    let answer_to_prefill = pair.first_transfer(|sent| {
        if let Frame::Page { bytes, .. } = &mut sent[0] {
            bytes[5] ^= 1;
        }
    });
    assert!(matches!(
        answer_to_prefill[0],
        Frame::Nack {
            reject: Reject::ChecksumMismatch,
            ..
        }
    ));
    assert_eq!(pair.decode.engine.cache.stats().cached_pages, 0);
    let second = TransferId(501);
    assert_eq!(pair.reserve(2, second), admitted(RequestId(2)));
    let sent = pair.prefill(2, second, 0);
    assert_eq!(pair.deliver(sent), [Frame::Ack { transfer: second }]);
    pair.decode.settle();
    let frames = pair.decode_router.frames();
    assert_eq!(answer(&frames).0, expected_text(&PROMPT, MAX_TOKENS));
    pair.decode.assert_idle_but_cached();
}

/// The page indices of a transfer's frames, and its `Done`, which must come last.
fn split_transfer_of(sent: &[Frame], transfer: TransferId) -> (Vec<u32>, transfer::TransferDone) {
    let (last, pages) = sent.split_last().expect("a transfer sends frames");
    let Frame::Done(done) = last else {
        panic!("Done comes last, got {last:?}");
    };
    assert_eq!(done.transfer, transfer);
    let indices = pages
        .iter()
        .map(|frame| match frame {
            Frame::Page { index, .. } => *index,
            other => panic!("expected a page, got {other:?}"),
        })
        .collect();
    (indices, *done)
}

#[test]
fn decodes_cache_is_keyed_by_tenant_too() {
    // TEST-MATRIX I06: every tier honours the namespace, decode's as well as prefill's.
    let mut pair = Pair::new();
    pair.first_transfer(|_| {});
    assert_eq!(pair.decode.engine.cache.stats().cached_pages, 2);
    let plan = Plan::Decode {
        transfer: TransferId(502),
    };
    let other = cached(2, TenantId(8), 0, plan);
    pair.decode.frame(ROUTER, Frame::Submit(other));
    pair.decode.turn();
    assert_eq!(pair.decode_router.frames()[0], admitted(RequestId(2)));
    pair.decode.frame(
        ROUTER,
        Frame::Abort {
            request: RequestId(2),
        },
    );
    pair.decode.turn();
    pair.decode.assert_idle_but_cached();
}

/// Tenant 8 submits three prompts at once after tenant 7 ran `earlier`; returns the order in
/// which tenant 8's requests finished and the prompt tokens the worker computed for them.
fn tenant_8_batch_after(earlier: &[u32]) -> (Vec<RequestId>, u64) {
    let (mut unified, mut router) = Worker::new(Role::Unified, 64);
    let first = Submit {
        prefix_cache: Some(Partition(0)),
        ..submit(1, earlier, MAX_TOKENS, Plan::Unified)
    };
    unified.run_unified(&mut router, first);
    let before = unified.engine.prefilled_tokens;
    let mut candidates = [PROMPT; 3];
    candidates[0][0] = 3;
    candidates[2][0] = 9;
    for (i, prompt) in candidates.iter().enumerate() {
        let request = Submit {
            tenant: TenantId(8),
            prefix_cache: Some(Partition(0)),
            ..submit(10 + i as u64, prompt, MAX_TOKENS, Plan::Unified)
        };
        unified.frame(ROUTER, Frame::Submit(request));
    }
    unified.settle();
    let finished = router
        .frames()
        .into_iter()
        .filter_map(|frame| match frame {
            Frame::Finished { request, .. } => Some(request),
            _ => None,
        })
        .collect();
    (finished, unified.engine.prefilled_tokens - before)
}

#[test]
fn another_tenants_cache_changes_neither_the_order_nor_the_work_of_a_batch() {
    // TEST-MATRIX I08: with tenant 7 having cached the middle candidate, tenant 8's batch
    // finishes in the same order and costs the same prefill as when tenant 7 sent something
    // else: scheduling never sees another tenant's hit.
    let mut other = PROMPT;
    other[0] = 20;
    let with_victim_cached = tenant_8_batch_after(&PROMPT);
    let without = tenant_8_batch_after(&other);
    assert_eq!(with_victim_cached, without);
    assert_eq!(with_victim_cached.1, 3 * 9, "every prompt token computed");
    assert_eq!(with_victim_cached.0.len(), 3);
}
