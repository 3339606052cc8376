//! Unit tests of the pure parts: markers, SSE joining, seeding, prompt sizing, which answers
//! judge prefix reuse, first-token detection and the timing audit's verdict.

use crate::plan::canary_prompt;
use crate::plan::estimated_tokens;
use crate::plan::lock;
use crate::plan::markers_in;
use crate::plan::Registry;
use crate::send::carries_token;
use crate::send::parse_body;
use crate::send::Outcome;
use crate::shared::Answered;
use crate::shared::Partitions;
use crate::shared::PrefixAudit;
use crate::shared::SharedPrefix;
use crate::timing::Kind;
use crate::timing::Measured;
use crate::PROMPT_OVERHEAD_TOKENS;

use crate::parse_range;
use stats::SplitMix64;

fn registry_with(codes: &[(&str, usize, usize)]) -> Registry {
    let registry = Registry::default();
    for &(code, tenant, index) in codes {
        lock(&registry.issued).insert(code.to_string(), (tenant, index));
    }
    registry
}

#[test]
fn markers_are_found_whole_bare_or_glued_and_unknown_ones_ignored() {
    let registry = registry_with(&[("ABCDEFGH", 1, 7), ("Z2345672", 0, 3)]);
    let found = registry.find("x CANARY-1-ABCDEFGH y Z2345672QQ CANARY-2-ABCDEFGX");
    let codes: Vec<&str> = found.iter().map(|(c, _, _)| c.as_str()).collect();
    assert_eq!(codes, ["ABCDEFGH", "Z2345672"]);
    assert_eq!((found[0].1, found[0].2), (1, 7));
    assert!(registry.find("abcdefgh ABCDEFG").is_empty());
}

#[test]
fn sse_chunks_are_joined_so_a_split_marker_is_whole() {
    let body =
        "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"CANARY-1-ABCD\"}}]}\n\n\
                data: {\"choices\":[{\"delta\":{\"content\":\"EFGH\"}}]}\n\n\
                event: error\ndata: {\"error\":{\"message\":\"boom\"}}\n\n";
    let parsed = parse_body(body);
    assert!(parsed.text.contains("CANARY-1-ABCDEFGH"), "{}", parsed.text);
    assert!(parsed.text.contains("boom"));
    assert!(parsed.error_event);
    assert_eq!(parsed.id.as_deref(), Some("c1"));
}

#[test]
fn prompts_carry_their_marker_as_the_estimate_counts_it() {
    let mut rng = SplitMix64::new(1);
    let prompt = canary_prompt(&mut rng, "CANARY-0-ABCDEFGH", 100);
    assert_eq!(prompt.matches("CANARY-0-ABCDEFGH").count(), markers_in(100));
    assert!(estimated_tokens(100) >= 100 + PROMPT_OVERHEAD_TOKENS);
}

#[test]
fn ranges_take_dots_or_a_dash() {
    assert_eq!(parse_range("8..48").ok(), Some((8, 48)));
    assert_eq!(parse_range("3-5").ok(), Some((3, 5)));
    assert!(parse_range("5..3").is_err());
    assert!(parse_range("0..3").is_err());
}

fn answered(outcome: &Outcome, salted: bool) -> Answered<'_> {
    Answered {
        request: 5,
        tenant: 1,
        what: "short prompt".to_string(),
        salted,
        outcome,
    }
}

fn outcome_with(cached_tokens: Option<u64>) -> Outcome {
    Outcome {
        status: Ok(200),
        body: String::new(),
        text: String::new(),
        cut_short: None,
        stream_error: false,
        server_id: Some("cmpl-1".to_string()),
        prompt_tokens: Some(1600),
        cached_tokens,
        seconds: 0.1,
    }
}

#[test]
fn only_the_first_request_of_a_partition_alone_in_flight_judges_reuse() {
    let mut partitions = Partitions::default();
    let mut alone = |tenant: usize, salt: Option<&str>| {
        let ticket = partitions.begin(tenant, salt);
        partitions.end(ticket)
    };
    // Tenant 0's first request, answered before its next: judges; then reuse is its own.
    assert!(alone(0, None));
    assert!(!alone(0, None));
    // Another tenant, and a fresh salt of the same tenant, are partitions of their own.
    assert!(alone(1, None));
    assert!(alone(0, Some("fresh")));
    assert!(!alone(0, Some("fresh")));
    // A first request overtaken by a second of its partition judges nothing: the second
    // may have cached the prefix before the first one's lookup.
    let first = partitions.begin(2, Some("s"));
    let second = partitions.begin(2, Some("s"));
    assert!(!partitions.end(second));
    assert!(!partitions.end(first));
}

#[test]
fn a_hit_is_cross_tenant_only_where_its_tenant_could_not_have_cached() {
    let mut prefix = PrefixAudit::default();
    let hit = outcome_with(Some(1584));
    let miss = outcome_with(Some(0));
    prefix.record(answered(&miss, false), true);
    prefix.record(answered(&miss, true), true);
    prefix.record(answered(&hit, false), false);
    prefix.record(answered(&hit, false), false);
    prefix.record(answered(&miss, false), false);
    assert_eq!((prefix.checked_first, prefix.checked_salted), (1, 1));
    assert!(prefix.cross_hits.is_empty());
    assert_eq!((prefix.reusable, prefix.own_hits), (3, 2));
    assert_eq!(prefix.own_cached_tokens, 2 * 1584);

    prefix.record(answered(&hit, true), true);
    let recorded = &prefix.cross_hits[0];
    assert_eq!((recorded.request, recorded.tenant), (5, 1));
    assert_eq!(recorded.cached_tokens, 1584);
    assert!(recorded.salted);
    assert_eq!(prefix.checked(), 3);

    // No cached_tokens in the usage: nothing judged either way.
    prefix.record(answered(&outcome_with(None), true), true);
    assert_eq!((prefix.checked(), prefix.unreported), (3, 1));
}

#[test]
fn the_shared_prompt_is_as_long_as_asked_and_salts_never_repeat() {
    let shared = SharedPrefix::new(1500, 42, 0.25);
    let words = shared.text.split_whitespace().count();
    assert!((1300..=1500).contains(&words), "{words} words");
    assert!(shared.tokens <= 1500 + 2, "{} tokens", shared.tokens);
    assert!(shared.text.starts_with("Session 42."));
    assert_eq!(SharedPrefix::new(1500, 42, 0.25).text, shared.text);
    assert_ne!(SharedPrefix::new(1500, 43, 0.25).text, shared.text);
    assert_ne!(shared.salt(1), shared.salt(2));
    assert_ne!(shared.salt(1), SharedPrefix::new(1500, 43, 0.25).salt(1));
}

#[test]
fn the_first_token_is_the_first_event_with_text_or_a_finish() {
    assert!(!carries_token(
        "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":null}]}"
    ));
    assert!(!carries_token(
        "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"},\"finish_reason\":null}]}"
    ));
    assert!(carries_token("data: {\"choices\":[{\"text\":\" Paris\"}]}"));
    assert!(carries_token(
        "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r"
    ));
    assert!(carries_token(
        "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}"
    ));
    assert!(!carries_token("data: [DONE]"));
    assert!(!carries_token(": keep-alive"));
    let usage = "{\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":\
                 16}}}";
    assert_eq!(parse_body(usage).cached_tokens, Some(16));
}

#[test]
fn the_timing_audit_fails_without_power_or_with_a_visible_difference() {
    let spread = |base: f64| -> Vec<f64> { (0..40).map(|i| base + f64::from(i) * 1e-3).collect() };
    let mut measured = Measured::default();
    measured.seconds[Kind::CrossShared as usize] = spread(0.100);
    measured.seconds[Kind::CrossFresh as usize] = spread(0.1005);
    measured.seconds[Kind::OwnShared as usize] = spread(0.010);
    measured.seconds[Kind::OwnFresh as usize] = spread(0.100);
    assert_eq!(measured.verdict(), Ok(()));

    // B sees A's prefix: cheaper for B too.
    measured.seconds[Kind::CrossShared as usize] = spread(0.010);
    assert!(measured.verdict().is_err());
    // No cache at all: the control shows nothing, so the audit proves nothing.
    measured.seconds[Kind::CrossShared as usize] = spread(0.100);
    measured.seconds[Kind::OwnShared as usize] = spread(0.100);
    assert!(measured.verdict().is_err());
    // B's answers say they reused tokens: a fail whatever the timings.
    measured.seconds[Kind::OwnShared as usize] = spread(0.010);
    measured.cached_tokens[Kind::CrossFresh as usize] = vec![0, 16];
    assert_eq!(measured.cross_hits(), 1);
    assert!(measured.verdict().is_err());
}
