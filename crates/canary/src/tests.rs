//! Unit tests of the pure parts: markers, SSE joining, seeding, prompt sizing.

use crate::plan::canary_prompt;
use crate::plan::estimated_tokens;
use crate::plan::lock;
use crate::plan::markers_in;
use crate::plan::Registry;
use crate::send::parse_body;
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
