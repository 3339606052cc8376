use half::f16;
use stats::SplitMix64;

use crate::{
    Error, Generation, Holder, KvKind, KvLayout, Owner, PageId, PagePool, PageState, PageTable,
    PoolConfig, PoolSize, RequestId, TenantId, SCRUB_FILL,
};

/// Small but with every dimension > 1, so a wrong offset formula lands somewhere visible.
pub(crate) const LAYOUT: KvLayout = KvLayout {
    layer_count: 2,
    kv_head_count: 2,
    head_dim: 4,
    page_size_tokens: 4,
};

pub(crate) fn pool(page_count: usize, scrub_on_free: bool) -> PagePool {
    let size = PoolSize::Tokens(page_count * LAYOUT.page_size_tokens);
    let pool = PagePool::new(PoolConfig {
        layout: LAYOUT,
        size,
        scrub_on_free,
    })
    .expect("a pool of at least one page of a valid layout");
    pool.check_invariants();
    pool
}

pub(crate) fn owner(tenant: u64, request: u64) -> Owner {
    Owner {
        tenant: TenantId(tenant),
        request: RequestId(request),
    }
}

/// Fill every page of the table with `value` through a verified view.
pub(crate) fn fill(pool: &mut PagePool, table: &PageTable, value: f16) {
    let mut views = pool
        .verify_batch(&[table])
        .expect("the caller passes a live table");
    for page_index in 0..views[0].page_len() {
        views[0].page_mut(page_index).fill(value);
    }
}

/// Every element of every page of the table, read through a fresh verified view.
pub(crate) fn read_all(pool: &mut PagePool, table: &PageTable) -> Vec<f16> {
    let views = pool
        .verify_batch(&[table])
        .expect("the caller passes a live table");
    (0..views[0].page_len())
        .flat_map(|page_index| views[0].page(page_index).to_vec())
        .collect()
}

#[test]
fn layout_sizes_and_offsets() {
    assert_eq!(LAYOUT.page_elems(), 2 * 2 * 2 * 4 * 4);
    assert_eq!(LAYOUT.page_bytes(), 256);
    assert_eq!(LAYOUT.head_elems(), 16);
    let check = |layer, kind, kv_head, expect| {
        assert_eq!(
            LAYOUT.head_offset(layer, kind, kv_head),
            expect,
            "{layer} {kind:?} {kv_head}"
        );
    };
    check(0, KvKind::Key, 0, 0);
    check(0, KvKind::Key, 1, 16);
    check(0, KvKind::Value, 0, 32);
    check(0, KvKind::Value, 1, 48);
    check(1, KvKind::Key, 0, 64);
    check(1, KvKind::Value, 1, 112);
}

#[test]
#[should_panic(expected = "kv head 2 out of range")]
fn head_offset_refuses_out_of_range_head() {
    LAYOUT.head_offset(0, KvKind::Key, 2);
}

#[test]
fn allocation_rounds_tokens_up_to_whole_pages() {
    let check = |token_count: usize, expect_pages: usize| {
        let mut pool = pool(4, false);
        let table = pool
            .allocate(owner(1, 1), token_count)
            .expect("fits in four pages");
        pool.check_invariants();
        assert_eq!(table.pages().len(), expect_pages, "{token_count} tokens");
        assert_eq!(table.capacity_tokens(&LAYOUT), expect_pages * 4);
        assert_eq!(pool.pages_free(), 4 - expect_pages);
        assert_eq!(LAYOUT.pages_for_tokens(token_count), expect_pages);
    };
    check(0, 0);
    check(1, 1);
    check(4, 1);
    check(5, 2);
    check(8, 2);
    check(9, 3);
    check(16, 4);
}

#[test]
fn fresh_pages_start_writing_at_generation_one() {
    let mut pool = pool(2, false);
    let table = pool.allocate(owner(1, 1), 8).expect("fits");
    assert_eq!(
        table.pages(),
        &[(PageId(0), Generation(1)), (PageId(1), Generation(1))]
    );
    let header = pool.header(PageId(1)).expect("page 1 exists");
    assert_eq!(header.holder, Some(Holder::Request(owner(1, 1))));
    assert_eq!(header.state, PageState::Writing);
    assert!(pool.header(PageId(2)).is_none());
}

#[test]
fn out_of_pages_is_a_value_and_changes_nothing() {
    let mut pool = pool(3, false);
    let error = pool.allocate(owner(1, 1), 13).unwrap_err();
    assert!(
        matches!(error, Error::OutOfPages { needed: 4, free: 3 }),
        "{error:?}"
    );
    assert_eq!(pool.pages_free(), 3);
    pool.check_invariants();

    let mut table = pool.allocate(owner(1, 1), 8).expect("two of three pages");
    let error = pool.allocate(owner(2, 2), 5).unwrap_err();
    assert!(
        matches!(error, Error::OutOfPages { needed: 2, free: 1 }),
        "{error:?}"
    );
    assert_eq!(pool.pages_free(), 1);
    pool.check_invariants();

    let before = table.clone();
    let error = pool.extend(&mut table, 20).unwrap_err();
    assert!(
        matches!(error, Error::OutOfPages { needed: 3, free: 1 }),
        "{error:?}"
    );
    assert_eq!(table, before);
    assert_eq!(pool.pages_free(), 1);
    pool.check_invariants();

    pool.extend(&mut table, 12).expect("the last page");
    assert_eq!(table.pages().len(), 3);
    pool.extend(&mut table, 3)
        .expect("already big enough: no change");
    assert_eq!(table.pages().len(), 3);
    assert_eq!(pool.pages_free(), 0);
    pool.check_invariants();
}

#[test]
fn pool_sizes_from_tokens_and_bytes_round_down() {
    let check = |size: PoolSize, expect_pages: usize| {
        let pool = PagePool::new(PoolConfig {
            layout: LAYOUT,
            size,
            scrub_on_free: false,
        })
        .expect("at least one page");
        pool.check_invariants();
        assert_eq!(pool.page_count(), expect_pages, "{size:?}");
        assert_eq!(pool.pages_free(), expect_pages);
        assert_eq!(pool.capacity_tokens(), expect_pages * 4);
        assert_eq!(pool.bytes(), expect_pages * 256);
    };
    check(PoolSize::Tokens(4), 1);
    check(PoolSize::Tokens(17), 4);
    check(PoolSize::Bytes(256), 1);
    check(PoolSize::Bytes(3 * 256 + 255), 3);
}

#[test]
fn pool_of_zero_pages_or_bad_layout_is_refused() {
    let build = |layout: KvLayout, size: PoolSize| {
        PagePool::new(PoolConfig {
            layout,
            size,
            scrub_on_free: false,
        })
        .unwrap_err()
    };
    let error = build(LAYOUT, PoolSize::Tokens(3));
    assert!(
        matches!(
            error,
            Error::PoolTooSmall {
                page_size_tokens: 4,
                ..
            }
        ),
        "{error:?}"
    );
    let error = build(LAYOUT, PoolSize::Bytes(255));
    assert!(
        matches!(
            error,
            Error::PoolTooSmall {
                page_bytes: 256,
                ..
            }
        ),
        "{error:?}"
    );
    let error = build(
        KvLayout {
            head_dim: 0,
            ..LAYOUT
        },
        PoolSize::Tokens(64),
    );
    assert!(matches!(error, Error::BadLayout { .. }), "{error:?}");
    let error = build(
        KvLayout {
            layer_count: usize::MAX,
            ..LAYOUT
        },
        PoolSize::Tokens(64),
    );
    assert!(matches!(error, Error::BadLayout { .. }), "{error:?}");
    // Pages that each fit but together pass what the address space holds (2^22 pages of
    // 2^42 bytes): an error, not a panic or an abort in the allocator.
    let error = build(
        KvLayout {
            layer_count: 1,
            kv_head_count: 1,
            head_dim: 1 << 40,
            page_size_tokens: 1,
        },
        PoolSize::Tokens(1 << 22),
    );
    assert!(matches!(error, Error::PoolTooLarge { .. }), "{error:?}");
    let error = build(LAYOUT, PoolSize::Tokens(usize::MAX));
    assert!(matches!(error, Error::TooManyPages { .. }), "{error:?}");
}

#[test]
fn i1_stale_table_fails_after_its_page_is_reused() {
    let mut pool = pool(2, false);
    let table_a = pool.allocate(owner(1, 1), 4).expect("fits");
    let kept_a = table_a.clone();
    pool.release(table_a).expect("A owns its page");
    pool.check_invariants();
    let table_b = pool.allocate(owner(2, 2), 4).expect("fits");
    pool.check_invariants();
    assert_eq!(
        table_b.pages(),
        &[(PageId(0), Generation(2))],
        "LIFO reuse of A's page"
    );

    let error = pool.verify_batch(&[&kept_a]).unwrap_err();
    assert!(
        matches!(
            error,
            Error::StaleGeneration {
                page: PageId(0),
                expected: Generation(1),
                found: Generation(2)
            }
        ),
        "{error:?}"
    );
    let views = pool.verify_batch(&[&table_b]).expect("B owns the page now");
    assert_eq!(views[0].owner(), owner(2, 2));
    assert_eq!(views[0].page_len(), 1);
    assert_eq!(views[0].capacity_tokens(), 4);
    assert_eq!(views[0].layout(), &LAYOUT);
}

/// The canary for the test above: with the owner/generation compare switched off (test
/// builds only), the same stale table reads the new owner's bytes. So the compare is what
/// stops that read.
#[cfg(feature = "fault-injection")]
#[test]
fn i1_with_the_owner_check_off_a_stale_table_reads_the_new_owners_bytes() {
    let mut pool = pool(2, false);
    let table_a = pool.allocate(owner(1, 1), 4).expect("fits");
    let kept_a = table_a.clone();
    pool.release(table_a).expect("A owns its page");
    let table_b = pool.allocate(owner(2, 2), 4).expect("fits");
    let secret = f16::from_f32(42.0);
    fill(&mut pool, &table_b, secret);
    pool.set_owner_check_for_test(false);
    let leaked = read_all(&mut pool, &kept_a);
    assert!(leaked.iter().all(|&v| v == secret), "A reads B's bytes");
    pool.set_owner_check_for_test(true);
    assert!(pool.verify_batch(&[&kept_a]).is_err());
}

#[test]
fn i1_forged_table_claiming_another_owners_page_fails() {
    let mut pool = pool(2, false);
    let table_b = pool.allocate(owner(2, 2), 4).expect("fits");
    let forged = PageTable::forge(owner(1, 1), table_b.pages().to_vec());
    let error = pool.verify_batch(&[&forged]).unwrap_err();
    let expected = Holder::Request(owner(1, 1));
    let found = Some(Holder::Request(owner(2, 2)));
    assert!(
        matches!(error, Error::OwnerMismatch { page: PageId(0), expected: e, found: f }
            if e == expected && f == found),
        "{error:?}"
    );
    // The same tenant with another request id is another owner too.
    let forged = PageTable::forge(owner(2, 3), table_b.pages().to_vec());
    assert!(matches!(
        pool.verify_batch(&[&forged]),
        Err(Error::OwnerMismatch { .. })
    ));
    // Nor can a forged table release, extend or relabel B's page.
    let mut forged = PageTable::forge(owner(1, 1), table_b.pages().to_vec());
    assert!(matches!(
        pool.extend(&mut forged, 8),
        Err(Error::OwnerMismatch { .. })
    ));
    let sealed = PageState::Sealed;
    assert!(matches!(
        pool.set_state(&forged, sealed),
        Err(Error::OwnerMismatch { .. })
    ));
    assert!(matches!(
        pool.release(forged),
        Err(Error::OwnerMismatch { .. })
    ));
    assert_eq!(pool.pages_free(), 1);
    assert_eq!(
        pool.header(PageId(0)).expect("exists").state,
        PageState::Writing
    );
    pool.check_invariants();
}

#[test]
fn i1_double_release_fails_and_frees_nothing() {
    let mut pool = pool(3, false);
    let table = pool.allocate(owner(1, 1), 8).expect("fits");
    let kept = table.clone();
    pool.release(table).expect("first release");
    let error = pool.release(kept.clone()).unwrap_err();
    assert!(
        matches!(error, Error::OwnerMismatch { found: None, .. }),
        "{error:?}"
    );
    assert_eq!(pool.pages_free(), 3);
    pool.check_invariants();

    // Page 0 goes back to the same owner: only the generation tells the tables apart, and
    // page 1 (still free) must not be pushed onto the free list a second time.
    let table_again = pool.allocate(owner(1, 1), 4).expect("fits");
    assert_eq!(table_again.pages(), &[(PageId(0), Generation(2))]);
    let error = pool.release(kept).unwrap_err();
    assert!(
        matches!(
            error,
            Error::StaleGeneration {
                page: PageId(0),
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(pool.pages_free(), 2);
    pool.check_invariants();
}

#[test]
fn i1_duplicate_page_in_one_batch_fails() {
    let mut pool = pool(3, false);
    let table_a = pool.allocate(owner(1, 1), 8).expect("fits");
    let copy = PageTable::forge(owner(1, 1), vec![table_a.pages()[1]]);
    let error = pool.verify_batch(&[&table_a, &copy]).unwrap_err();
    assert!(
        matches!(error, Error::DuplicatePage { page: PageId(1) }),
        "{error:?}"
    );
    let error = pool.verify_batch(&[&table_a, &table_a]).unwrap_err();
    assert!(
        matches!(error, Error::DuplicatePage { page: PageId(0) }),
        "{error:?}"
    );

    // A table naming a page twice would otherwise push it onto the free list twice.
    let doubled = PageTable::forge(owner(1, 1), vec![table_a.pages()[0], table_a.pages()[0]]);
    let error = pool.release(doubled).unwrap_err();
    assert!(
        matches!(error, Error::DuplicatePage { page: PageId(0) }),
        "{error:?}"
    );
    assert_eq!(pool.pages_free(), 1);
    pool.check_invariants();
}

#[test]
fn i1_free_unknown_or_busy_pages_cannot_be_viewed() {
    let mut pool = pool(2, false);
    let free_page = PageTable::forge(owner(1, 1), vec![(PageId(0), Generation(0))]);
    let error = pool.verify_batch(&[&free_page]).unwrap_err();
    assert!(
        matches!(error, Error::OwnerMismatch { found: None, .. }),
        "{error:?}"
    );

    let unknown = PageTable::forge(owner(1, 1), vec![(PageId(2), Generation(1))]);
    let error = pool.verify_batch(&[&unknown]).unwrap_err();
    assert!(
        matches!(error, Error::UnknownPage { page: PageId(2) }),
        "{error:?}"
    );

    let table = pool.allocate(owner(1, 1), 4).expect("fits");
    pool.set_state(&table, PageState::Sealed)
        .expect("Writing -> Sealed");
    pool.verify_batch(&[&table])
        .expect("Sealed pages are readable");
    for state in [PageState::Sending, PageState::Quarantined] {
        pool.set_state(&table, state)
            .expect("Sealed -> Sending -> Quarantined");
        let error = pool.verify_batch(&[&table]).unwrap_err();
        assert!(
            matches!(error, Error::PageNotReadable { state: s, .. } if s == state),
            "{error:?}"
        );
    }
    pool.check_invariants();
}

#[test]
fn set_state_follows_the_life_cycle_all_or_nothing() {
    let mut pool = pool(3, false);
    let mut table = pool.allocate(owner(1, 1), 4).expect("fits");
    pool.set_state(&table, PageState::Sealed)
        .expect("Writing -> Sealed");
    let error = pool.set_state(&table, PageState::Free).unwrap_err();
    assert!(
        matches!(
            error,
            Error::InvalidTransition {
                to: PageState::Free,
                ..
            }
        ),
        "{error:?}"
    );

    // Page 0 is Sealed, page 1 Writing: Writing -> Receiving is allowed, Sealed -> Receiving
    // is not, so neither page may change.
    pool.extend(&mut table, 8).expect("one more page");
    let error = pool.set_state(&table, PageState::Receiving).unwrap_err();
    assert!(
        matches!(
            error,
            Error::InvalidTransition {
                page: PageId(0),
                from: PageState::Sealed,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        pool.header(PageId(1)).expect("exists").state,
        PageState::Writing
    );

    pool.set_state(&table, PageState::Quarantined)
        .expect("anything -> Quarantined");
    let error = pool.set_state(&table, PageState::Sealed).unwrap_err();
    assert!(
        matches!(error, Error::InvalidTransition { .. }),
        "{error:?}"
    );
    assert_eq!(pool.pages_in_state(PageState::Quarantined), 2);
    pool.release(table).expect("release is how quarantine ends");
    assert_eq!(pool.pages_free(), 3);
    pool.check_invariants();
}

#[test]
fn writes_land_in_exactly_the_right_page_and_offset() {
    let mut pool = pool(4, false);
    let table_a = pool.allocate(owner(1, 1), 8).expect("fits");
    let table_b = pool.allocate(owner(2, 2), 4).expect("fits");
    let marker = f16::from_f32(7.5);
    {
        let mut views = pool
            .verify_batch(&[&table_a, &table_b])
            .expect("both own their pages");
        assert_eq!(views[0].owner(), owner(1, 1));
        assert_eq!(views[1].owner(), owner(2, 2));
        // Slot 2, element 3 of (layer 1, V, head 1) in A's second page.
        views[0].head_mut(1, 1, KvKind::Value, 1)[2 * 4 + 3] = marker;
        views[1].head_mut(0, 0, KvKind::Key, 0)[0] = marker;
    }
    let views = pool
        .verify_batch(&[&table_a, &table_b])
        .expect("still theirs");
    let expected_offset = LAYOUT.head_offset(1, KvKind::Value, 1) + 2 * 4 + 3;
    assert_eq!(expected_offset, 123);
    for (view_index, page_index, offset) in [(0, 1, expected_offset), (1, 0, 0)] {
        for (index, &value) in views[view_index].page(page_index).iter().enumerate() {
            let expect = if index == offset { marker } else { f16::ZERO };
            assert_eq!(
                value, expect,
                "view {view_index} page {page_index} index {index}"
            );
        }
    }
    assert!(views[0].page(0).iter().all(|&value| value == f16::ZERO));
    assert_eq!(views[0].head(1, 1, KvKind::Value, 1)[11], marker);
    // A's page 1 is physical page 1, B's page 0 is physical page 2: the views follow tables.
    assert_eq!(table_a.pages()[1].0, PageId(1));
    assert_eq!(table_b.pages()[0].0, PageId(2));
}

#[test]
fn pages_are_not_zeroed_on_reuse_unless_scrub_is_on() {
    for scrub_on_free in [false, true] {
        let mut pool = pool(2, scrub_on_free);
        let table_a = pool.allocate(owner(1, 1), 8).expect("fits");
        let secret = f16::from_f32(42.0);
        fill(&mut pool, &table_a, secret);
        pool.release(table_a).expect("A owns its pages");
        let table_b = pool.allocate(owner(2, 2), 8).expect("fits");
        let expect = if scrub_on_free { SCRUB_FILL } else { secret };
        // Without scrubbing B sees A's bytes: only the header check stands between tenants.
        assert!(read_all(&mut pool, &table_b)
            .iter()
            .all(|&value| value == expect));
        pool.check_invariants();
    }
}

#[test]
fn pool_debug_shows_no_kv_bytes() {
    let mut pool = pool(1, false);
    let table = pool.allocate(owner(1, 1), 1).expect("fits");
    fill(&mut pool, &table, f16::from_f32(1234.0));
    let pool_text = format!("{pool:?}");
    assert!(!pool_text.contains("1234"), "{pool_text}");
    let view_text = format!("{:?}", pool.verify_batch(&[&table]).expect("live"));
    assert!(!view_text.contains("1234"), "{view_text}");
}

/// A live request in the random test: its table and the value it wrote into all its pages.
struct Live {
    table: PageTable,
    marker: f16,
}

struct RandomRun {
    rng: SplitMix64,
    pool: PagePool,
    live: Vec<Live>,
    /// Tables that were released: every later use must fail.
    released: Vec<PageTable>,
    next_request: u64,
}

#[test]
fn random_operations_keep_invariants_and_leak_nothing() {
    let seed_from_env = std::env::var("KV_SEED")
        .ok()
        .and_then(|text| text.parse().ok());
    let seeds: Vec<u64> = match seed_from_env {
        Some(seed) => vec![seed],
        None => (1..=24).collect(),
    };
    for seed in seeds {
        // Captured output is shown on failure: rerun one seed with KV_SEED.
        println!("seed {seed}");
        RandomRun::new(seed).run(3_000);
    }
}

impl RandomRun {
    fn new(seed: u64) -> RandomRun {
        let mut rng = SplitMix64::new(seed);
        let layout = KvLayout {
            layer_count: 1 + rng.below(2),
            kv_head_count: 1 + rng.below(2),
            head_dim: 2,
            page_size_tokens: 1 + rng.below(3),
        };
        let page_count = 1 + rng.below(6);
        let size = PoolSize::Tokens(page_count * layout.page_size_tokens);
        let scrub_on_free = rng.below(2) == 0;
        let pool = PagePool::new(PoolConfig {
            layout,
            size,
            scrub_on_free,
        })
        .expect("at least one page of a valid layout");
        RandomRun {
            rng,
            pool,
            live: Vec::new(),
            released: Vec::new(),
            next_request: 1,
        }
    }

    fn run(mut self, op_count: usize) {
        for _ in 0..op_count {
            match self.rng.below(8) {
                0 | 1 => self.allocate(),
                2 => self.extend(),
                3 => self.release(),
                4 | 5 => self.verify_live(),
                6 => self.misuse(),
                _ => self.toggle_seal(),
            }
            self.pool.check_invariants();
        }
        for live in std::mem::take(&mut self.live) {
            self.pool.release(live.table).expect("live tables release");
            self.pool.check_invariants();
        }
        assert_eq!(
            self.pool.pages_free(),
            self.pool.page_count(),
            "I9: every page came back"
        );
    }

    fn random_tokens(&mut self) -> usize {
        self.rng
            .below(self.pool.capacity_tokens() + 2 * self.pool.layout().page_size_tokens)
    }

    fn allocate(&mut self) {
        let owner = owner(self.rng.below(3) as u64, self.next_request);
        let token_count = self.random_tokens();
        let needed = self.pool.layout().pages_for_tokens(token_count);
        let free_before = self.pool.pages_free();
        match self.pool.allocate(owner, token_count) {
            Ok(table) => {
                assert!(needed <= free_before);
                assert_eq!(table.pages().len(), needed);
                // Unique per live request while requests stay under 2048 (exact in f16).
                let marker = f16::from_f32((self.next_request % 2048) as f32);
                fill(&mut self.pool, &table, marker);
                self.live.push(Live { table, marker });
                self.next_request += 1;
            }
            Err(Error::OutOfPages { needed: n, free }) => {
                assert_eq!((n, free), (needed, free_before));
                assert_eq!(
                    self.pool.pages_free(),
                    free_before,
                    "failed allocate took pages"
                );
            }
            Err(error) => panic!("allocate: {error:?}"),
        }
    }

    fn extend(&mut self) {
        if self.live.is_empty() {
            return;
        }
        let index = self.rng.below(self.live.len());
        let token_count = self.random_tokens();
        let free_before = self.pool.pages_free();
        let live = &mut self.live[index];
        let pages_before = live.table.pages().len();
        let wanted = self.pool.layout().pages_for_tokens(token_count);
        let missing = wanted.saturating_sub(pages_before);
        match self.pool.extend(&mut live.table, token_count) {
            Ok(()) => {
                assert_eq!(live.table.pages().len(), pages_before + missing);
                assert_eq!(self.pool.pages_free(), free_before - missing);
                // Only the new pages need the marker, but refilling all is simpler.
                fill(&mut self.pool, &live.table, live.marker);
            }
            Err(Error::OutOfPages { needed, free }) => {
                assert_eq!((needed, free), (missing, free_before));
                assert_eq!(
                    live.table.pages().len(),
                    pages_before,
                    "failed extend grew table"
                );
                assert_eq!(
                    self.pool.pages_free(),
                    free_before,
                    "failed extend took pages"
                );
            }
            Err(error) => panic!("extend: {error:?}"),
        }
    }

    fn release(&mut self) {
        if self.live.is_empty() {
            return;
        }
        let live = self.live.swap_remove(self.rng.below(self.live.len()));
        let free_before = self.pool.pages_free();
        let page_len = live.table.pages().len();
        self.pool
            .release(live.table.clone())
            .expect("a live table releases");
        assert_eq!(self.pool.pages_free(), free_before + page_len);
        if page_len > 0 {
            self.released.push(live.table);
        }
        if self.released.len() > 16 {
            self.released
                .swap_remove(self.rng.below(self.released.len()));
        }
    }

    /// A random subset of live tables in one batch: each sees only its own marker.
    fn verify_live(&mut self) {
        let chosen: Vec<&Live> = self
            .live
            .iter()
            .filter(|_| self.rng.below(2) == 0)
            .collect();
        let tables: Vec<&PageTable> = chosen.iter().map(|live| &live.table).collect();
        let views = self
            .pool
            .verify_batch(&tables)
            .expect("distinct live tables verify");
        assert_eq!(views.len(), chosen.len());
        for (view, live) in views.iter().zip(&chosen) {
            assert_eq!(view.owner(), live.table.owner());
            assert_eq!(view.page_len(), live.table.pages().len());
            for page_index in 0..view.page_len() {
                let page = view.page(page_index);
                assert!(
                    page.iter().all(|&value| value == live.marker),
                    "I1: foreign bytes"
                );
            }
        }
    }

    /// Stale tables and duplicated batches must fail and change nothing.
    fn misuse(&mut self) {
        let free_before = self.pool.pages_free();
        if !self.released.is_empty() {
            let stale = self.released[self.rng.below(self.released.len())].clone();
            assert!(
                self.pool.verify_batch(&[&stale]).is_err(),
                "stale table verified"
            );
            assert!(self.pool.release(stale).is_err(), "stale table released");
        }
        let nonempty: Vec<&PageTable> = self
            .live
            .iter()
            .map(|live| &live.table)
            .filter(|t| !t.pages().is_empty())
            .collect();
        if !nonempty.is_empty() {
            let table = nonempty[self.rng.below(nonempty.len())];
            let error = self.pool.verify_batch(&[table, table]).unwrap_err();
            assert!(matches!(error, Error::DuplicatePage { .. }), "{error:?}");
        }
        assert_eq!(self.pool.pages_free(), free_before);
    }

    fn toggle_seal(&mut self) {
        if self.live.is_empty() {
            return;
        }
        let table = &self.live[self.rng.below(self.live.len())].table;
        let state = if self.rng.below(2) == 0 {
            PageState::Sealed
        } else {
            PageState::Writing
        };
        let all_sealed_or_writing = table.pages().iter().all(|&(page, _)| {
            let header = self.pool.header(page).expect("live page exists");
            matches!(header.state, PageState::Sealed | PageState::Writing)
        });
        assert!(
            all_sealed_or_writing,
            "the random run only uses Writing and Sealed"
        );
        self.pool
            .set_state(table, state)
            .expect("Writing <-> Sealed is allowed");
    }
}

#[cfg(feature = "ghost-fill")]
#[test]
fn ghost_fill_is_visibly_not_zero() {
    assert_ne!(SCRUB_FILL, f16::ZERO);
    assert!(SCRUB_FILL.is_finite());
}

#[test]
fn written_tokens_track_the_owner_and_reset_on_reallocation() {
    let mut pool = pool(4, false);
    let page_size = pool.layout().page_size_tokens;
    let a = pool.allocate(owner(1, 1), 3 * page_size).unwrap();
    {
        let mut views = pool.verify_batch(&[&a]).unwrap();
        assert_eq!(views[0].written_tokens(), 0);
        views[0].mark_written(page_size + 1);
        assert_eq!(views[0].written_tokens(), page_size + 1);
    }
    assert_eq!(
        pool.verify_batch(&[&a]).unwrap()[0].written_tokens(),
        page_size + 1
    );
    pool.release(a).unwrap();
    // The same pages come back to a new owner: what A wrote does not count as B's.
    let b = pool.allocate(owner(2, 2), 3 * page_size).unwrap();
    assert_eq!(pool.verify_batch(&[&b]).unwrap()[0].written_tokens(), 0);
}

#[test]
fn received_bytes_go_only_into_receiving_pages_of_their_owner() {
    let mut pool = pool(4, false);
    let table = pool.allocate(owner(1, 1), 4).expect("fits");
    // Writing pages are not open to a transfer.
    let error = pool.verify_receiving(&table).unwrap_err();
    assert!(
        matches!(
            error,
            Error::PageNotReadable {
                state: PageState::Writing,
                ..
            }
        ),
        "{error:?}"
    );
    pool.set_state(&table, PageState::Receiving)
        .expect("Writing -> Receiving");
    // Receiving pages cannot be read by a forward pass...
    assert!(pool.verify_batch(&[&table]).is_err());
    // ...but take the transfer's bytes, and only for their owner and generation.
    pool.verify_receiving(&table)
        .expect("owner's receiving view")
        .page_mut(0)
        .fill(f16::ONE);
    let forged = PageTable::forge(owner(2, 2), table.pages().to_vec());
    assert!(matches!(
        pool.verify_receiving(&forged),
        Err(Error::OwnerMismatch { .. })
    ));
    pool.set_state(&table, PageState::Sealed)
        .expect("Receiving -> Sealed");
    assert_eq!(read_all(&mut pool, &table)[0], f16::ONE);
    pool.check_invariants();
}
