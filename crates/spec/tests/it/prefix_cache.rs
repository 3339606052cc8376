//! The bounded check of the prefix-cache model, and one test per prefix-cache mutant.
//!
//! Requests share one prompt. Mostly it fills two pages: a full one, which either worker may
//! cache, and a partial last page of the request's own; both pools have three pages, so two
//! requests that reuse nothing cannot both hold pages on one worker, and admission waits on
//! releases and evictions. One configuration mixes prompts of two and three pages over pools
//! of four, so a request reuses a shorter cached prefix and publishes the page after it.

use std::time::Instant;

use spec::{Mutant, PrefixFaults, PrefixRequest, PrefixSpec};
use stateright::{Checker, Model};

const A: u8 = 1;
const B: u8 = 2;

/// Every fault once.
const ALL_FAULTS: PrefixFaults = PrefixFaults {
    corruptions: 1,
    misclaims: 1,
    timeouts: 1,
};

/// One request per tenant named, each with the two-page prompt, over pools of three pages.
fn spec(tenants: &[u8], faults: PrefixFaults, mutant: Option<Mutant>) -> PrefixSpec {
    let requests: Vec<_> = tenants.iter().map(|&tenant| (tenant, 2)).collect();
    spec_of(&requests, 3, faults, mutant)
}

/// Requests given as (tenant, pages of the prompt), over pools of `pool_pages` each.
fn spec_of(
    requests: &[(u8, u8)],
    pool_pages: u8,
    faults: PrefixFaults,
    mutant: Option<Mutant>,
) -> PrefixSpec {
    PrefixSpec {
        prefill_pages: pool_pages,
        decode_pages: pool_pages,
        requests: requests
            .iter()
            .map(|&(tenant, pages)| PrefixRequest {
                tenant,
                prompt: 7,
                pages,
            })
            .collect(),
        faults,
        mutant,
    }
}

/// Breadth first, so a counterexample is a shortest one.
fn check(model: PrefixSpec) -> impl Checker<PrefixSpec> {
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    report(&checker, started);
    checker
}

/// Depth first, for checks expected to pass: no frontier to hold.
fn check_dfs(model: PrefixSpec) -> impl Checker<PrefixSpec> {
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_dfs().join();
    report(&checker, started);
    checker
}

fn report(checker: &impl Checker<PrefixSpec>, started: Instant) {
    println!(
        "  states: {} unique, {} visited, max depth {}, {:.1} s",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
}

/// Two requests of one tenant and one of another, with no fault: every order of lookups,
/// inserts, evictions and releases across them. Each pair of tenants with every fault once.
/// Prompts of two lengths. The `sometimes` properties among them show a page reused on each
/// worker, one shared by two requests at once, a delta transfer answered from decode's cache,
/// and a shorter cached prefix extended, so the check cannot pass because nothing is cached.
#[test]
fn the_prefix_cache_keeps_every_property() {
    let groups: [(&str, PrefixSpec); 4] = [
        (
            "tenants A, A, B, no fault",
            spec(&[A, A, B], PrefixFaults::NONE, None),
        ),
        ("tenants A, A, every fault", spec(&[A, A], ALL_FAULTS, None)),
        ("tenants A, B, every fault", spec(&[A, B], ALL_FAULTS, None)),
        (
            "tenant A, prompts of 2 and 3 pages, pools of 4, no fault",
            spec_of(&[(A, 2), (A, 3)], 4, PrefixFaults::NONE, None),
        ),
    ];
    for (name, model) in groups {
        println!("prefix cache, {name}:");
        check_dfs(model).assert_properties();
    }
}

/// Larger configurations than every run can afford:
/// `AIRLOCK_SPEC_DEEP=1 cargo test --release -p spec deep_check -- --nocapture`.
#[test]
fn deep_check() {
    if std::env::var_os("AIRLOCK_SPEC_DEEP").is_none() {
        println!("skipped: set AIRLOCK_SPEC_DEEP=1 for the deep check");
        return;
    }
    let each_fault = [
        (
            "corruption",
            PrefixFaults {
                corruptions: 1,
                ..PrefixFaults::NONE
            },
        ),
        (
            "misclaimed reuse",
            PrefixFaults {
                misclaims: 1,
                ..PrefixFaults::NONE
            },
        ),
        (
            "timeout",
            PrefixFaults {
                timeouts: 1,
                ..PrefixFaults::NONE
            },
        ),
    ];
    for (name, faults) in each_fault {
        println!("prefix cache, tenants A, A, B, {name}:");
        check_dfs(spec(&[A, A, B], faults, None)).assert_properties();
    }
    println!("prefix cache, tenant A, prompts of 2 and 3 pages, pools of 4, every fault:");
    check_dfs(spec_of(&[(A, 2), (A, 3)], 4, ALL_FAULTS, None)).assert_properties();
    println!("prefix cache, tenants A, B, prompts of 3 pages, pools of 4, every fault:");
    check_dfs(spec_of(&[(A, 3), (B, 3)], 4, ALL_FAULTS, None)).assert_properties();
}

/// The checker finds a counterexample to each property with the mutant, and none to any of
/// them in the same configuration without it: the mutant's guard is what keeps them.
fn assert_found(tenants: &[u8], faults: PrefixFaults, mutant: Mutant, properties: &[&'static str]) {
    println!("{mutant:?}:");
    let checker = check(spec(tenants, faults, Some(mutant)));
    for &property in properties {
        let path = checker
            .discovery(property)
            .unwrap_or_else(|| panic!("{mutant:?}: no counterexample for '{property}'"));
        println!("{mutant:?} breaks '{property}':");
        for (step, (state, action)) in path.into_vec().into_iter().enumerate() {
            if let Some(action) = action {
                println!("  {:2}. {}", step + 1, action.describe(&state));
            }
        }
    }
    println!("the same configuration without {mutant:?}:");
    let checker = check(spec(tenants, faults, None));
    for &property in properties {
        if let Some(path) = checker.discovery(property) {
            panic!(
                "'{property}' fails even without {mutant:?}: {:?}",
                path.into_actions()
            );
        }
    }
}

/// Tenant B's lookup finds the page tenant A's request published: B reads A's KV on both
/// workers, and the checksum cannot tell (the bytes are the same tokens' KV).
#[test]
fn a_cache_key_without_the_tenant_serves_one_tenants_kv_to_another() {
    assert_found(
        &[A, B],
        PrefixFaults::NONE,
        Mutant::CacheKeyWithoutTenant,
        &[
            "S9/I10 a lookup returns only pages of the request's tenant",
            "S1/I10 a request reads only its own pages and cached pages of its tenant",
            "S1 a request reads only its own tokens' KV, computed for its tenant",
            "S3 a page is free, one request's, or cached with refcount = holders of its tenant",
        ],
    );
}

/// A cached page is freed while the request that published it still holds it.
#[test]
fn evicting_a_referenced_page_leaves_its_holders_pointing_at_a_free_page() {
    assert_found(
        &[A, B],
        PrefixFaults::NONE,
        Mutant::EvictReferenced,
        &[
            "S3 a page is free, one request's, or cached with refcount = holders of its tenant",
            "the engine's expectations hold (its tables verify and release)",
        ],
    );
}

/// A prefill that starts one page early sends a page decode reuses from its cache. Written
/// into the cached page, a corrupted copy replaces the tenant's cached KV, and another request
/// that holds the page, its own transfer verified, decodes from the garbage.
#[test]
fn a_frame_written_into_a_shared_page_corrupts_the_cache() {
    assert_found(
        &[A, A],
        PrefixFaults {
            misclaims: 1,
            corruptions: 1,
            ..PrefixFaults::NONE
        },
        Mutant::WriteToShared,
        &[
            "no write lands in a shared page",
            "S9/I12 every cached page holds the KV its key names",
            "S1/I4 a request reads only written, uncorrupted KV",
        ],
    );
}

/// A prefill that starts one page late says decode holds that page. Trusting it, decode never
/// receives the page, and the checksum passes when the page, freshly allocated, still holds
/// the same tokens' KV from another tenant's evicted cache page: B decodes from A's KV.
#[test]
fn decode_that_trusts_prefills_reuse_count_decodes_a_page_it_never_received() {
    assert_found(
        &[A, B],
        PrefixFaults {
            misclaims: 1,
            ..PrefixFaults::NONE
        },
        Mutant::DeltaTrustsPrefill,
        &[
            "S2 a transfer is sealed only when every page decode reads is its own KV",
            "S1 a request reads only its own tokens' KV, computed for its tenant",
        ],
    );
}

/// Published when `Done` arrives, before the checks: `Done` overtakes a page frame, and the
/// page that never arrived enters decode's cache though the transfer is refused (a corrupted
/// frame does the same: TEST-MATRIX I12). The next request of the tenant reuses it, and the
/// checksum over every page decode reads, reused ones included, refuses that transfer: the bad
/// page breaks the cache but is never decoded from.
#[test]
fn caching_before_the_checks_lets_an_unverified_page_into_the_cache() {
    assert_found(
        &[A],
        PrefixFaults::NONE,
        Mutant::CacheBeforeVerify,
        &["S9/I12 every cached page holds the KV its key names"],
    );
    println!("CacheBeforeVerify, tenants A, A:");
    let checker = check(spec(
        &[A, A],
        PrefixFaults::NONE,
        Some(Mutant::CacheBeforeVerify),
    ));
    assert!(checker
        .discovery("S9/I12 every cached page holds the KV its key names")
        .is_some());
    for property in [
        "S1/I4 a request reads only written, uncorrupted KV",
        "S2 a transfer is sealed only when every page decode reads is its own KV",
    ] {
        assert!(
            checker.discovery(property).is_none(),
            "the checksum over reused pages should keep '{property}'"
        );
    }
}
