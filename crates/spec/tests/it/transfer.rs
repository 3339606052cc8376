//! The bounded check of the transfer model, and one test per mutant showing the checker finds
//! the counterexample for the invariant that mutant's guard protects.

use std::time::Instant;

use spec::{Faults, Mutant, RequestSpec, TransferSpec, Transport};
use stateright::{Checker, Model};

/// Two tenants' requests of two pages each over a three-page pool: they cannot both hold
/// pages at once, so pages are reused, and every fault may happen once.
fn spec(transport: Transport, mutant: Option<Mutant>, faults: Faults) -> TransferSpec {
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
        transport,
        faults,
        mutant,
    }
}

/// The bounded check of the framed transport (the code's): each group of faults, every fault
/// once, explored exhaustively. All faults at once (`deep_check`) is too large for every run.
const FRAMED_GROUPS: [(&str, Faults); 7] = [
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
        "duplication, disconnect",
        Faults {
            duplicates: 1,
            disconnects: 1,
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
    (
        "stale read, retry",
        Faults {
            stale_reads: 1,
            retries: 1,
            ..Faults::NONE
        },
    ),
];

/// The one-sided transport (a design model): the faults that touch its quiescence protocol.
const ONE_SIDED_GROUPS: [(&str, Faults); 4] = [
    (
        "disconnect, retry",
        Faults {
            disconnects: 1,
            retries: 1,
            ..Faults::NONE
        },
    ),
    (
        "loss, duplication",
        Faults {
            drops: 1,
            duplicates: 1,
            ..Faults::NONE
        },
    ),
    (
        "corruption, crash and restart",
        Faults {
            corruptions: 1,
            crashes: 1,
            ..Faults::NONE
        },
    ),
    (
        "link reset, placeholder transfer, disconnect",
        Faults {
            link_resets: 1,
            placeholders: 1,
            disconnects: 1,
            ..Faults::NONE
        },
    ),
];

/// Breadth first, so a counterexample is a shortest one.
fn check(model: TransferSpec) -> impl Checker<TransferSpec> {
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    report(&checker, started);
    checker
}

/// Depth first: the same states, in about half the time and memory of breadth first at
/// millions of states (no frontier to hold), for checks expected to pass.
fn check_dfs(model: TransferSpec) -> impl Checker<TransferSpec> {
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_dfs().join();
    report(&checker, started);
    checker
}

fn report(checker: &impl Checker<TransferSpec>, started: Instant) {
    println!(
        "  states: {} unique, {} visited, max depth {}, {:.1} s",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
}

fn check_groups(transport: Transport, groups: &[(&str, Faults)]) {
    for &(name, faults) in groups {
        println!("{transport:?}, {name}:");
        check_dfs(spec(transport, None, faults)).assert_properties();
    }
}

#[test]
fn the_framed_protocol_keeps_every_property_under_each_fault_group() {
    check_groups(Transport::Framed, &FRAMED_GROUPS);
}

#[test]
fn the_one_sided_protocol_keeps_every_property_under_each_fault_group() {
    check_groups(Transport::OneSided, &ONE_SIDED_GROUPS);
}

/// Larger combinations than every run can afford:
/// `AIRLOCK_SPEC_DEEP=1 cargo test --release -p spec deep_check -- --nocapture`.
#[test]
fn deep_check() {
    if std::env::var_os("AIRLOCK_SPEC_DEEP").is_none() {
        println!("skipped: set AIRLOCK_SPEC_DEEP=1 for the deep check");
        return;
    }
    println!("Framed, duplication, disconnect, retry:");
    let faults = Faults {
        duplicates: 1,
        disconnects: 1,
        retries: 1,
        ..Faults::NONE
    };
    check_dfs(spec(Transport::Framed, None, faults)).assert_properties();
    let faults = Faults {
        duplicates: 1,
        corruptions: 1,
        disconnects: 1,
        retries: 1,
        crashes: 1,
        ..Faults::NONE
    };
    println!("Framed, duplication, corruption, disconnect, retry, crash:");
    check_dfs(spec(Transport::Framed, None, faults)).assert_properties();
    let faults = Faults {
        drops: 1,
        duplicates: 1,
        corruptions: 1,
        disconnects: 1,
        retries: 1,
        crashes: 1,
        ..Faults::NONE
    };
    println!("OneSided, loss, duplication, corruption, disconnect, retry, crash:");
    check_dfs(spec(Transport::OneSided, None, faults)).assert_properties();
}

/// The checker finds a counterexample to each property with the mutant, and none to any of
/// them in the same configuration without it: the mutant's guard is what keeps them.
fn assert_found_in(model: TransferSpec, properties: &[&'static str]) {
    let mutant = model.mutant.expect("a mutant");
    let control = TransferSpec {
        mutant: None,
        ..model.clone()
    };
    println!("{mutant:?}:");
    let checker = check(model);
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
    let checker = check(control);
    for &property in properties {
        if let Some(path) = checker.discovery(property) {
            panic!(
                "'{property}' fails even without {mutant:?}: {:?}",
                path.into_actions()
            );
        }
    }
}

fn assert_found(transport: Transport, mutant: Mutant, faults: Faults, properties: &[&'static str]) {
    assert_found_in(spec(transport, Some(mutant), faults), properties);
}

#[test]
fn without_the_owner_check_a_stale_frame_lands_in_another_requests_page() {
    assert_found(
        Transport::Framed,
        Mutant::NoOwnerCheck,
        Faults {
            duplicates: 1,
            ..Faults::NONE
        },
        &["S4/I5 no write lands in a page its transfer does not hold"],
    );
}

#[test]
fn without_the_generation_bump_a_frame_of_an_earlier_attempt_lands_in_the_retrys_pages() {
    assert_found(
        Transport::Framed,
        Mutant::NoGenerationBump,
        Faults {
            retries: 1,
            ..Faults::NONE
        },
        &["S4/I5 no write lands in a page its transfer does not hold"],
    );
}

#[test]
fn without_the_checksum_corrupt_kv_is_decoded() {
    assert_found(
        Transport::Framed,
        Mutant::NoChecksum,
        Faults {
            corruptions: 1,
            ..Faults::NONE
        },
        &[
            "S2 a transfer is sealed only when every page holds this attempt's KV",
            "S1/I4 a decode step reads only verified KV",
        ],
    );
}

#[test]
fn without_the_length_check_a_short_transfer_is_decoded() {
    assert_found(
        Transport::Framed,
        Mutant::NoLengthCheck,
        Faults {
            placeholders: 1,
            ..Faults::NONE
        },
        &[
            "S2 a transfer is sealed only when every page holds this attempt's KV",
            "S1/I4 a decode step reads only verified KV",
        ],
    );
}

/// The read-time check (I1) on its own: a decode step with a released table (an engine bug
/// the `stale_reads` fault plants) reads the pages' next owner's KV without it.
#[test]
fn without_the_owner_check_a_stale_table_reads_the_next_owners_kv() {
    assert_found(
        Transport::Framed,
        Mutant::NoOwnerCheck,
        Faults {
            stale_reads: 1,
            ..Faults::NONE
        },
        &["S1/I1 a decode step reads only its own request's KV"],
    );
}

/// Prefill's framed transport copies pages into frames, so what deferred release protects is
/// the zero-copy one: a posted write reads prefill's source pages until it lands.
#[test]
fn without_deferred_release_prefill_frees_source_pages_a_posted_write_still_reads() {
    assert_found(
        Transport::OneSided,
        Mutant::NoDeferredRelease,
        Faults::NONE,
        &["I5 prefill frees its source pages only once no write from them is in flight"],
    );
}

/// Several ends reach the router for one request (a disconnect, then decode's abort); only
/// the first may answer.
#[test]
fn without_the_one_end_guard_a_request_is_answered_twice() {
    assert_found(
        Transport::Framed,
        Mutant::NoEndOnce,
        Faults {
            disconnects: 1,
            ..Faults::NONE
        },
        &["S11/I6 at most one answer per request, and one once it ended"],
    );
}

/// 200 headers sent on the reservation, before the transfer is verified: a transfer that then
/// fails is a 200 with an error inside (the incident's "HTTP 200 instead of 400").
#[test]
fn headers_sent_before_the_seal_are_a_200_for_an_unverified_transfer() {
    assert_found(
        Transport::Framed,
        Mutant::HeadersBeforeSeal,
        Faults::NONE,
        &["S6 200 headers only after a verified commit"],
    );
}

/// A disconnect that does not reach decode leaves its reservation receiving: the transfer is
/// sealed for a request that has already ended.
#[test]
fn without_the_abort_to_decode_a_transfer_is_committed_after_its_request_ended() {
    assert_found(
        Transport::Framed,
        Mutant::NoDecodeAbort,
        Faults {
            disconnects: 1,
            ..Faults::NONE
        },
        &["S7 an aborted transfer is never committed"],
    );
}

/// A rejected transfer that forgets to release: the pool is not whole when all is quiet.
#[test]
fn a_rejected_transfer_that_does_not_release_leaks_its_pages() {
    assert_found(
        Transport::Framed,
        Mutant::LeakOnReject,
        Faults {
            corruptions: 1,
            ..Faults::NONE
        },
        &[
            "I9 a quiescent pool is whole",
            "L2 at every terminal state the pool is whole and nothing is in flight or held",
        ],
    );
}

/// Without admission a request larger than the whole pool is admitted (S10) and then waits
/// in decode's queue for pages that can never all be free: it is never answered (L1). With
/// admission, the same request gets its 400 and touches nothing.
#[test]
fn without_admission_a_request_larger_than_the_pool_is_admitted_and_never_answered() {
    let oversize = |mutant| TransferSpec {
        pool_pages: 3,
        requests: vec![
            RequestSpec {
                tenant: 1,
                pages: 4,
            },
            RequestSpec {
                tenant: 2,
                pages: 2,
            },
        ],
        transport: Transport::Framed,
        faults: Faults::NONE,
        mutant,
    };
    assert_found_in(
        oversize(Some(Mutant::NoAdmission)),
        &[
            "S10 a request that can never fit is never admitted",
            "L1 at every terminal state each request has ended with exactly one answer",
        ],
    );
    println!("with admission:");
    check(oversize(None)).assert_properties();
}

/// The one-sided transport's quiescence protocol: prefill answers decode's `WriteAbort` only
/// once every write it posted has landed. Answering on receipt lets decode free the
/// reservation while a write is still in flight; the write then lands in the next request's
/// page, which that request reads as its own (SGLang #31357). No fault is needed: a timeout
/// is enough.
#[test]
fn an_abort_ack_before_quiescence_lets_a_late_write_land_in_the_next_requests_page() {
    assert_found(
        Transport::OneSided,
        Mutant::AbortAckBeforeQuiescence,
        Faults::NONE,
        &[
            "S4 no page is freed while a write to it may still land",
            "S4/I5 no write lands in a page its transfer does not hold",
            "S1/I1 a decode step reads only its own request's KV",
        ],
    );
}

/// What the framed engine does on abort (free the reservation at once) is safe only because
/// a frame lands through the reservation. Over a one-sided transport it is the bug of
/// Dynamo #13855: a posted write lands in a page that already belongs to someone else.
#[test]
fn over_a_one_sided_transport_freeing_at_once_on_abort_lets_writes_land_in_reused_pages() {
    assert_found(
        Transport::OneSided,
        Mutant::ImmediateRelease,
        Faults::NONE,
        &[
            "S4 no page is freed while a write to it may still land",
            "S4/I5 no write lands in a page its transfer does not hold",
            "S1/I1 a decode step reads only its own request's KV",
        ],
    );
}

/// Decode hashes a one-sided page when prefill reports its write landed (`Written`), not at
/// `Done`: that holds only while each page is written once. A writer that writes a reported
/// page again lets decode seal, and read, bytes its checksum never covered.
#[test]
fn a_page_written_again_after_its_report_is_sealed_unverified() {
    assert_found(
        Transport::OneSided,
        Mutant::RewriteAfterWritten,
        Faults::NONE,
        &[
            "S2 a transfer is sealed only when every page holds this attempt's KV",
            "S1/I4 a decode step reads only verified KV",
        ],
    );
}
