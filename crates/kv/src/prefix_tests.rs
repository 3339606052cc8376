//! Shared pages and the prefix index: reuse within a tenant, never across one (I1, I10), and
//! no leak (I9) whatever order tables come and go in.

use half::f16;

use crate::tests::{fill, owner, pool, read_all, LAYOUT};
use crate::{
    CachedPrefix, Error, Holder, PageId, PagePool, PageState, PageTable, Partition, PrefixCache,
    TenantId,
};

const PAGE: usize = LAYOUT.page_size_tokens;

fn tokens(count: usize, first: u32) -> Vec<u32> {
    (0..count as u32).map(|i| first + i).collect()
}

/// A table of `owner` holding `prompt` (written in full, filled with `value`) with its full
/// pages published; what the prefill of a first request leaves behind.
fn publish(
    pool: &mut PagePool,
    cache: &mut PrefixCache,
    owner: crate::Owner,
    prompt: &[u32],
    value: f16,
) -> PageTable {
    let mut table = pool.allocate(owner, prompt.len()).expect("fits");
    fill(pool, &table, value);
    pool.verify_batch(&[&table]).expect("own")[0].mark_written(prompt.len());
    cache.publish(pool, &mut table, Partition(0), prompt);
    pool.check_invariants();
    table
}

#[test]
fn a_tenant_reuses_its_own_full_pages_and_no_one_else_does() {
    let mut pool = pool(8, false);
    let mut cache = PrefixCache::new(PAGE);
    let prompt = tokens(2 * PAGE + 1, 100);
    let first = publish(&mut pool, &mut cache, owner(1, 1), &prompt, f16::ONE);
    assert_eq!(
        first.shared_pages(),
        2,
        "the two full pages, not the partial one"
    );
    assert_eq!(pool.pages_in_state(PageState::Shared), 2);

    let hit = cache.lookup(TenantId(1), Partition(0), &prompt, &pool);
    assert_eq!(hit.pages(), &first.pages()[..2]);
    // Another tenant, another partition of the same tenant, or another first token: cold.
    let other_tenant = cache.lookup(TenantId(2), Partition(0), &prompt, &pool);
    assert_eq!(other_tenant.page_count(), 0);
    assert_eq!(
        cache
            .lookup(TenantId(1), Partition(7), &prompt, &pool)
            .page_count(),
        0
    );
    let mut changed = prompt.clone();
    changed[0] += 1;
    assert_eq!(
        cache
            .lookup(TenantId(1), Partition(0), &changed, &pool)
            .page_count(),
        0
    );
    // A change in the second page keeps the first.
    let mut tail_changed = prompt.clone();
    tail_changed[PAGE] += 1;
    assert_eq!(
        cache
            .lookup(TenantId(1), Partition(0), &tail_changed, &pool)
            .page_count(),
        1
    );

    // The second request of tenant 1 reads the first one's K/V through its shared entries.
    let second = pool
        .allocate_with_prefix(owner(1, 2), &hit, prompt.len() + 3)
        .expect("fits");
    assert_eq!(second.shared_pages(), 2);
    assert_eq!(second.pages().len(), 3);
    assert_eq!(pool.shared_refs(hit.pages()[0].0), 2);
    let views = pool.verify_batch(&[&second]).expect("own tenant's pages");
    assert_eq!(views[0].written_tokens(), 2 * PAGE, "shared pages are full");
    assert_eq!(views[0].shared_tokens(), 2 * PAGE);
    assert!(views[0].page(0).iter().all(|&x| x == f16::ONE));
    drop(views);

    // Tenant 2 handed tenant 1's prefix (a bug upstream) is refused by the pool itself.
    let error = pool
        .allocate_with_prefix(owner(2, 3), &hit, prompt.len())
        .unwrap_err();
    assert!(matches!(error, Error::SharedPage { .. }), "{error:?}");
    pool.release(first).expect("own");
    pool.release(second).expect("own");
    pool.check_invariants();
    assert_eq!(cache.flush(&mut pool), 2);
    assert_eq!(pool.pages_free(), pool.page_count(), "I9");
    pool.check_invariants();
}

#[test]
fn shared_entries_verify_only_for_the_pages_tenant() {
    let mut pool = pool(4, false);
    let mut cache = PrefixCache::new(PAGE);
    let prompt = tokens(PAGE, 1);
    let table = publish(&mut pool, &mut cache, owner(1, 1), &prompt, f16::ONE);
    let shared = table.pages()[..1].to_vec();
    // Another tenant claiming the page as shared, or anyone claiming it as their own.
    for forged in [
        PageTable::forge_shared(owner(2, 9), shared.clone(), 1),
        PageTable::forge(owner(1, 1), shared.clone()),
        PageTable::forge(owner(2, 9), shared.clone()),
    ] {
        let error = pool.verify_batch(&[&forged]).unwrap_err();
        assert!(
            matches!(
                error,
                Error::OwnerMismatch {
                    found: Some(Holder::Tenant(TenantId(1))),
                    ..
                }
            ),
            "{error:?}"
        );
    }
    // The tenant's other requests may read it; a stale generation may not.
    let same_tenant = PageTable::forge_shared(owner(1, 5), shared.clone(), 1);
    assert!(pool.verify_batch(&[&same_tenant]).is_ok());
    let (page, generation) = shared[0];
    let stale = PageTable::forge_shared(
        owner(1, 5),
        vec![(page, crate::Generation(generation.0 - 1))],
        1,
    );
    assert!(matches!(
        pool.verify_batch(&[&stale]).unwrap_err(),
        Error::StaleGeneration { .. }
    ));
}

#[test]
fn a_shared_page_is_read_by_many_tables_in_one_batch_but_written_by_none() {
    let mut pool = pool(6, false);
    let mut cache = PrefixCache::new(PAGE);
    let prompt = tokens(PAGE, 1);
    let first = publish(&mut pool, &mut cache, owner(1, 1), &prompt, f16::ONE);
    let hit = cache.lookup(TenantId(1), Partition(0), &prompt, &pool);
    let second = pool
        .allocate_with_prefix(owner(1, 2), &hit, 2 * PAGE)
        .expect("fits");
    let views = pool.verify_batch(&[&first, &second]).expect("shared twice");
    assert_eq!(views[0].page(0), views[1].page(0));
    drop(views);
    // A private page twice is still refused.
    let twice = PageTable::forge(owner(1, 2), vec![second.pages()[1], second.pages()[1]]);
    assert!(matches!(
        pool.verify_batch(&[&twice]).unwrap_err(),
        Error::DuplicatePage { .. }
    ));
    // State changes pass shared pages by; the receive path reads them but lands nothing.
    pool.set_state(&second, PageState::Receiving)
        .expect("own page");
    assert_eq!(
        pool.header(second.pages()[0].0).map(|h| h.state),
        Some(PageState::Shared)
    );
    let view = pool.verify_receiving(&second).expect("own receiving page");
    assert!(view.page(0).iter().all(|&x| x == f16::ONE));
}

#[test]
#[should_panic(expected = "read-only")]
fn a_view_refuses_to_hand_out_a_shared_page_mutably() {
    let mut pool = pool(2, false);
    let mut cache = PrefixCache::new(PAGE);
    let table = publish(
        &mut pool,
        &mut cache,
        owner(1, 1),
        &tokens(PAGE, 1),
        f16::ONE,
    );
    let mut views = pool.verify_batch(&[&table]).expect("own");
    views[0].page_mut(0);
}

#[test]
fn only_full_written_pages_can_be_shared() {
    let mut pool = pool(4, false);
    let mut table = pool.allocate(owner(1, 1), 2 * PAGE).expect("fits");
    pool.verify_batch(&[&table]).expect("own")[0].mark_written(PAGE + 1);
    assert!(matches!(
        pool.share(&mut table, 2).unwrap_err(),
        Error::SharedPage { .. }
    ));
    pool.verify_batch(&[&table]).expect("own")[0].mark_written(2 * PAGE);
    pool.set_state(&table, PageState::Sending).unwrap_err();
    pool.set_state(&table, PageState::Sealed)
        .expect("Writing -> Sealed");
    pool.set_state(&table, PageState::Sending)
        .expect("Sealed -> Sending");
    assert!(matches!(
        pool.share(&mut table, 2).unwrap_err(),
        Error::SharedPage { .. }
    ));
    assert_eq!(table.shared_pages(), 0, "all or nothing");
    pool.check_invariants();
}

#[test]
fn eviction_never_frees_a_referenced_page_and_bumps_generations() {
    let mut pool = pool(3, false);
    let mut cache = PrefixCache::new(PAGE);
    let prompt = tokens(2 * PAGE, 1);
    let table = publish(&mut pool, &mut cache, owner(1, 1), &prompt, f16::ONE);
    let (page, generation) = table.pages()[0];
    assert!(matches!(
        pool.evict(page, generation).unwrap_err(),
        Error::SharedPage { .. }
    ));
    assert_eq!(
        cache.evict(&mut pool, 2, &[]),
        0,
        "both pages are referenced"
    );
    let kept = table.clone();
    pool.release(table).expect("own");
    assert_eq!(pool.pages_reclaimable(), 2);
    assert_eq!(pool.pages_free(), 1, "released shared pages stay cached");
    assert_eq!(cache.evict(&mut pool, 1, &[]), 1);
    assert_eq!(cache.stats().evictions, 1);
    assert_eq!(cache.evict(&mut pool, 5, &[]), 1);
    assert_eq!(pool.pages_free(), 3);
    // A table kept past eviction matches nothing, even once the page is someone else's.
    let other = pool.allocate(owner(2, 2), 3 * PAGE).expect("fits");
    assert!(pool.verify_batch(&[&kept]).is_err());
    assert_eq!(
        cache
            .lookup(TenantId(1), Partition(0), &prompt, &pool)
            .page_count(),
        0
    );
    assert!(other
        .pages()
        .iter()
        .all(|&(p, g)| p != page || g != generation));
    pool.check_invariants();
}

#[test]
fn eviction_takes_leaves_least_recently_used_first() {
    let mut pool = pool(6, false);
    let mut cache = PrefixCache::new(PAGE);
    let old = publish(
        &mut pool,
        &mut cache,
        owner(1, 1),
        &tokens(2 * PAGE, 1),
        f16::ONE,
    );
    let new = publish(
        &mut pool,
        &mut cache,
        owner(1, 2),
        &tokens(2 * PAGE, 500),
        f16::ONE,
    );
    let (old_pages, new_pages) = (old.pages().to_vec(), new.pages().to_vec());
    pool.release(old).expect("own");
    pool.release(new).expect("own");
    // Touch the old prefix: the new one is now least recently used.
    cache.lookup(TenantId(1), Partition(0), &tokens(2 * PAGE, 1), &pool);
    assert_eq!(cache.evict(&mut pool, 1, &[]), 1);
    let still_shared = |pool: &PagePool, (page, _): (PageId, crate::Generation)| {
        pool.header(page).map(|h| h.state) == Some(PageState::Shared)
    };
    assert!(
        !still_shared(&pool, new_pages[1]),
        "the leaf of the older use goes"
    );
    assert!(still_shared(&pool, new_pages[0]), "its parent stays");
    assert!(old_pages.iter().all(|&entry| still_shared(&pool, entry)));
    assert_eq!(cache.flush(&mut pool), 3);
    assert_eq!(pool.pages_free(), pool.page_count());
    pool.check_invariants();
}

#[test]
fn a_prefix_published_twice_keeps_one_copy_and_leaks_nothing() {
    let mut pool = pool(6, false);
    let mut cache = PrefixCache::new(PAGE);
    let prompt = tokens(2 * PAGE, 1);
    let first = publish(&mut pool, &mut cache, owner(1, 1), &prompt, f16::ONE);
    // Prefilled at the same time, before the first was published: its pages stay private.
    let second = publish(&mut pool, &mut cache, owner(1, 2), &prompt, f16::ONE);
    assert_eq!(first.shared_pages(), 2);
    assert_eq!(second.shared_pages(), 0);
    assert_eq!(cache.stats().cached_pages, 2);
    pool.release(second).expect("own");
    pool.release(first).expect("own");
    cache.flush(&mut pool);
    assert_eq!(pool.pages_free(), pool.page_count(), "I9");
    pool.check_invariants();
}

#[test]
fn a_request_without_the_cache_gets_only_own_pages() {
    let mut pool = pool(2, false);
    let table = pool
        .allocate_with_prefix(owner(1, 1), &CachedPrefix::none(TenantId(1)), PAGE + 1)
        .expect("fits");
    assert_eq!(table.shared_pages(), 0);
    assert_eq!(table.pages().len(), 2);
    assert!(matches!(
        pool.allocate_with_prefix(owner(1, 2), &CachedPrefix::none(TenantId(1)), 1),
        Err(Error::OutOfPages { .. })
    ));
    let _ = read_all(&mut pool, &table);
}

/// Seeded random life cycles of two tenants' requests over a small pool: look up, allocate
/// (evicting when short), write, publish, release, evict, in any order. After every step the
/// pool's own bookkeeping holds, every shared page's count equals the live tables that hold
/// it, no table holds a shared page of another tenant, and at the end the pool comes back
/// whole (I9) once the cache is flushed.
#[test]
fn random_life_cycles_keep_counts_tenants_and_the_pool_whole() {
    let mut rng = stats::SplitMix64::new(23);
    let (mut hits, mut evictions) = (0, 0);
    for _ in 0..200 {
        let mut pool = pool(10, rng.below(2) == 0);
        let mut cache = PrefixCache::new(PAGE);
        // Three prompts that share their first page, of 2 to 3 full pages each.
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|p| {
                let mut prompt = tokens((2 + p % 2) * PAGE, 1);
                for token in &mut prompt[PAGE..] {
                    *token += 100 * p as u32;
                }
                prompt
            })
            .collect();
        let mut live: Vec<PageTable> = Vec::new();
        let mut next_request = 0;
        for _ in 0..40 {
            match rng.below(4) {
                0 | 1 => {
                    let tenant = 1 + rng.below(2) as u64;
                    let prompt = &prompts[rng.below(prompts.len())];
                    let partition = Partition(rng.below(2) as u64);
                    let hit = cache.lookup(TenantId(tenant), partition, prompt, &pool);
                    next_request += 1;
                    let owner = owner(tenant, next_request);
                    let needed = prompt.len() + 1;
                    let table = match pool.allocate_with_prefix(owner, &hit, needed) {
                        Ok(table) => table,
                        Err(Error::OutOfPages {
                            needed: short_pages,
                            free,
                        }) => {
                            cache.evict(&mut pool, short_pages - free, hit.pages());
                            match pool.allocate_with_prefix(owner, &hit, needed) {
                                Ok(table) => table,
                                Err(Error::OutOfPages { .. }) => continue,
                                Err(error) => panic!("{error}"),
                            }
                        }
                        Err(error) => panic!("{error}"),
                    };
                    let mut table = table;
                    pool.verify_batch(&[&table]).expect("own")[0].mark_written(prompt.len());
                    if rng.below(3) != 0 {
                        cache.publish(&mut pool, &mut table, partition, prompt);
                    }
                    live.push(table);
                }
                2 if !live.is_empty() => {
                    let table = live.swap_remove(rng.below(live.len()));
                    pool.release(table).expect("a live table releases");
                }
                _ => {
                    cache.evict(&mut pool, 1 + rng.below(3), &[]);
                }
            }
            pool.check_invariants();
            for page in 0..pool.page_count() as u32 {
                let holders = live
                    .iter()
                    .filter(|t| t.pages()[..t.shared_pages()].iter().any(|e| e.0 .0 == page))
                    .count();
                assert_eq!(pool.shared_refs(PageId(page)) as usize, holders);
            }
            for table in &live {
                for &(page, _) in &table.pages()[..table.shared_pages()] {
                    let holder = pool.header(page).and_then(|h| h.holder);
                    assert_eq!(holder, Some(Holder::Tenant(table.owner().tenant)));
                }
            }
            assert!(pool.verify_batch(&live.iter().collect::<Vec<_>>()).is_ok());
        }
        for table in live {
            pool.release(table).expect("a live table releases");
        }
        hits += cache.stats().hit_pages;
        evictions += cache.stats().evictions;
        cache.flush(&mut pool);
        assert_eq!(pool.pages_free(), pool.page_count(), "I9");
        assert_eq!(cache.stats().cached_pages, 0);
        pool.check_invariants();
    }
    // Not vacuous: pages were reused and evicted under pressure.
    assert!(
        hits > 100 && evictions > 100,
        "hits {hits}, evictions {evictions}"
    );
}

#[test]
fn eviction_empties_the_oldest_chain_before_touching_a_newer_one() {
    // Two chains of three pages; the newer must keep every page while the older one still
    // has any (one leaf per chain at a time would strip the newer chain's tail first).
    let mut pool = pool(8, false);
    let mut cache = PrefixCache::new(PAGE);
    let old_prompt = tokens(3 * PAGE, 1);
    let new_prompt = tokens(3 * PAGE, 500);
    let old = publish(&mut pool, &mut cache, owner(1, 1), &old_prompt, f16::ONE);
    let new = publish(&mut pool, &mut cache, owner(1, 2), &new_prompt, f16::ONE);
    pool.release(old).expect("own");
    pool.release(new).expect("own");
    assert_eq!(cache.evict(&mut pool, 3, &[]), 3);
    let new_hit = cache.lookup(TenantId(1), Partition(0), &new_prompt, &pool);
    assert_eq!(new_hit.page_count(), 3, "the newer chain is whole");
    let old_hit = cache.lookup(TenantId(1), Partition(0), &old_prompt, &pool);
    assert_eq!(old_hit.page_count(), 0, "the older chain went first");
}

/// Evicting a cached page a transport still reads (prefill streams pages it has published)
/// frees it, but no allocation gets it until the transport lets go: eviction can report
/// pages freed that an allocation right after cannot have yet (the engine then waits).
#[test]
fn an_evicted_page_a_transport_still_reads_comes_back_only_when_it_lets_go() {
    let mut pool = pool(3, false);
    let mut cache = PrefixCache::new(PAGE);
    let prompt = tokens(2 * PAGE, 1);
    let table = publish(&mut pool, &mut cache, owner(1, 1), &prompt, f16::ONE);
    let lent = pool.lend(&table, 0..2).expect("the owner's pages lend");
    pool.release(table).expect("own");
    assert_eq!(cache.evict(&mut pool, 2, &[]), 2, "both leave the cache");
    assert!(matches!(
        pool.allocate(owner(2, 2), 3 * PAGE),
        Err(Error::OutOfPages { .. })
    ));
    drop(lent);
    let table = pool
        .allocate(owner(2, 2), 3 * PAGE)
        .expect("back once let go");
    pool.release(table).expect("own");
    pool.check_invariants();
}
