//! The bounded check of the transfer model, and one test per mutant showing the checker finds
//! the counterexample for the invariant that mutant's guard protects.

use spec::{Faults, Mutant, RequestSpec, TransferSpec};
use stateright::{Checker, Model};

/// Two tenants' requests of two pages each over a three-page pool: they cannot both hold
/// pages at once, so pages are reused, and every fault may happen once.
fn spec(mutant: Option<Mutant>, faults: Faults) -> TransferSpec {
    TransferSpec {
        pool_pages: 3,
        requests: vec![
            RequestSpec {
                tenant: 1,
                pages: 2,
            },
            RequestSpec {
                tenant: 2,
                pages: 2,
            },
        ],
        faults,
        mutant,
    }
}

/// The bounded check: each group of faults, every fault once, explored exhaustively. All
/// faults at once (`deep_check`) is too large for every CI run.
const FAULT_GROUPS: [(&str, Faults); 6] = [
    (
        "loss, duplication, retry",
        Faults {
            drops: 1,
            duplicates: 1,
            retries: 1,
            ..Faults::NONE
        },
    ),
    (
        "corruption, disconnect",
        Faults {
            corruptions: 1,
            disconnects: 1,
            ..Faults::NONE
        },
    ),
    (
        "link reset, disconnect, retry",
        Faults {
            link_resets: 1,
            disconnects: 1,
            retries: 1,
            ..Faults::NONE
        },
    ),
    (
        "crash and restart, disconnect",
        Faults {
            crashes: 1,
            disconnects: 1,
            ..Faults::NONE
        },
    ),
    (
        "duplication, disconnect, retry",
        Faults {
            duplicates: 1,
            disconnects: 1,
            retries: 1,
            ..Faults::NONE
        },
    ),
    (
        "placeholder transfer, loss",
        Faults {
            placeholders: 1,
            drops: 1,
            ..Faults::NONE
        },
    ),
];

fn check(model: TransferSpec) -> impl Checker<TransferSpec> {
    let checker = model.checker().threads(2).spawn_bfs().join();
    println!(
        "states: {} unique, {} visited, max depth {}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth()
    );
    checker
}

#[test]
fn the_protocol_keeps_every_invariant_under_each_fault_group() {
    for (name, faults) in FAULT_GROUPS {
        println!("{name}:");
        check(spec(None, faults)).assert_properties();
    }
}

/// Duplication, corruption, disconnect, retry and a crash together (tens of millions of
/// states): `AIRLOCK_SPEC_DEEP=1 cargo test --release -p spec deep_check -- --nocapture`.
#[test]
fn deep_check() {
    if std::env::var_os("AIRLOCK_SPEC_DEEP").is_none() {
        println!("skipped: set AIRLOCK_SPEC_DEEP=1 for the deep check");
        return;
    }
    let faults = Faults {
        duplicates: 1,
        corruptions: 1,
        disconnects: 1,
        retries: 1,
        crashes: 1,
        ..Faults::NONE
    };
    check(spec(None, faults)).assert_properties();
}

#[test]
fn without_faults_every_request_ends_and_the_pool_is_whole() {
    let liveness = Faults {
        disconnects: 1,
        ..Faults::NONE
    };
    let checker = check(spec(None, liveness));
    checker.assert_properties();
}

fn assert_found(mutant: Mutant, faults: Faults, property: &'static str) {
    let checker = check(spec(Some(mutant), faults));
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("{mutant:?}: no counterexample for '{property}'"));
    println!("{mutant:?} breaks '{property}':\n{path}");
}

#[test]
fn without_the_owner_check_a_stale_frame_lands_in_another_requests_page() {
    assert_found(
        Mutant::NoOwnerCheck,
        Faults {
            duplicates: 1,
            ..Faults::NONE
        },
        "I5 no write lands in another request's page",
    );
}

#[test]
fn without_the_generation_bump_a_retry_reads_its_earlier_attempts_kv() {
    assert_found(
        Mutant::NoGenerationBump,
        Faults {
            disconnects: 1,
            retries: 1,
            ..Faults::NONE
        },
        "I1 a decode step reads only its own request's KV",
    );
}

#[test]
fn without_the_checksum_corrupt_kv_is_decoded() {
    assert_found(
        Mutant::NoChecksum,
        Faults {
            corruptions: 1,
            ..Faults::NONE
        },
        "I4 a decode step reads only verified KV",
    );
}

#[test]
fn without_the_length_check_a_short_transfer_is_decoded() {
    assert_found(
        Mutant::NoLengthCheck,
        Faults {
            placeholders: 1,
            ..Faults::NONE
        },
        "I4 a decode step reads only verified KV",
    );
}

#[test]
fn without_deferred_release_prefill_frees_pages_a_transfer_still_uses() {
    assert_found(
        Mutant::NoDeferredRelease,
        Faults::NONE,
        "I5 prefill frees pages only on decode's answer",
    );
}

#[test]
fn without_admission_a_request_larger_than_the_pool_gets_pages() {
    let model = TransferSpec {
        pool_pages: 3,
        requests: vec![RequestSpec {
            tenant: 1,
            pages: 4,
        }],
        faults: Faults::NONE,
        mutant: Some(Mutant::NoAdmission),
    };
    let checker = check(model);
    let property = "I3 a request that can never fit holds no page";
    let path = checker.discovery(property).expect("admission mutant found");
    println!("NoAdmission breaks '{property}':\n{path}");
    // With admission, the same request is refused and never holds a page.
    let model = TransferSpec {
        pool_pages: 3,
        requests: vec![RequestSpec {
            tenant: 1,
            pages: 4,
        }],
        faults: Faults::NONE,
        mutant: None,
    };
    let checker = model.checker().spawn_bfs().join();
    assert!(checker.discovery(property).is_none());
}
