//! Prefix reuse through a serving cluster on the real model (TEST-MATRIX I04, I05, and the
//! deterministic side of I07): a tenant's repeated prompt is served from its own cached
//! pages, with the same greedy text; another tenant sending the very same prompt gets none of
//! them, and its worker computes every one of its prompt tokens; `cache_salt` only narrows
//! sharing; and disaggregated decode receives only the pages it lacks.

use crate::harness::{metrics, post_raw, runtime, samples, start, wait_idle, Mode, Options, MODEL};
use serde_json::{json, Value};

const KEYS: &str = r#"
[tenants.alice]
keys = ["sk-alice-0123456789"]
[tenants.bob]
keys = ["sk-bob-0123456789"]
[tenants.carol]
keys = ["sk-carol-0123456789"]
prefix_cache = false
[tenants.org_1]
keys = ["sk-org-1-0123456789"]
[tenants.org_12345]
keys = ["sk-org-12345-0123456789"]
"#;
const ALICE: &str = "sk-alice-0123456789";
const BOB: &str = "sk-bob-0123456789";
const CAROL: &str = "sk-carol-0123456789";

/// A system prompt long enough for several pages of 16 tokens, then a question.
fn prompt() -> String {
    let system: String = (1..=12)
        .map(|rule| format!("Rule {rule}: answer briefly, politely and only in English. "))
        .collect();
    format!("{system}\nQuestion: what is the capital of France?\nAnswer:")
}

fn request(salt: Option<Value>) -> Value {
    let mut body = json!({
        "model": MODEL,
        "prompt": prompt(),
        "max_tokens": 8,
        "temperature": 0,
    });
    if let Some(salt) = salt {
        body["cache_salt"] = salt;
    }
    body
}

/// The answer's text and `usage.prompt_tokens_details.cached_tokens`.
async fn ask(url: &str, key: &str, salt: Option<Value>) -> (String, u64, u64) {
    let body = request(salt).to_string().into_bytes();
    let answer = post_raw(url, "/v1/completions", body, Some(key)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let json = answer.json();
    let usage = &json["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens_details.cached_tokens");
    let text = json["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    let prompt_tokens = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    (text, cached, prompt_tokens)
}

/// The sum over workers of a counter.
async fn total(url: &str, name: &str) -> f64 {
    samples(&metrics(url).await, name).iter().map(|s| s.1).sum()
}

fn tenants_never_share_and_a_tenant_reuses(mode: Mode) {
    let mut options = Options::new(mode);
    options.keys = Some(KEYS);
    let server = start(options);
    runtime().block_on(async {
        let url = server.url.as_str();
        let prefilled = "airlock_prompt_tokens_prefilled_total";
        let (cold_text, cached, prompt_tokens) = ask(url, ALICE, None).await;
        assert_eq!(cached, 0, "nothing cached yet");
        let kv_tokens = prompt_tokens - 1;
        assert_eq!(total(url, prefilled).await as u64, kv_tokens);

        // Alice again: her own pages, the same greedy answer, only the rest computed.
        let (text, cached, _) = ask(url, ALICE, None).await;
        assert_eq!(text, cold_text);
        assert!(cached >= 3 * 16, "cached_tokens = {cached}");
        assert_eq!(
            total(url, prefilled).await as u64,
            2 * kv_tokens - cached,
            "only the uncached tokens were computed"
        );

        // Bob sends the very same prompt: nothing of Alice's, every token computed.
        let before = total(url, prefilled).await as u64;
        let (text, cached, _) = ask(url, BOB, None).await;
        assert_eq!(text, cold_text);
        assert_eq!(cached, 0, "another tenant's cache is not this tenant's");
        assert_eq!(total(url, prefilled).await as u64 - before, kv_tokens);

        // Carol opted out in the keys file: never a hit, even on her own repeat.
        for _ in 0..2 {
            assert_eq!(ask(url, CAROL, None).await.1, 0);
        }
        if mode == Mode::Disaggregated {
            // Alice's second request: decode already held the cached pages, so prefill did
            // not send them.
            let not_sent = total(url, "airlock_transfer_pages_not_sent_total").await;
            assert!(not_sent >= 3.0, "pages not sent: {not_sent}");
            // Transfer bandwidth is readable from /metrics: what prefill sent is what decode
            // verified, and each of the five requests' transfers was timed.
            let page = metrics(url).await;
            let bytes = samples(&page, "airlock_transfer_bytes_total");
            let by_role = |role: &str| -> f64 {
                let label = format!("role=\"{role}\"");
                bytes
                    .iter()
                    .filter(|s| s.0.contains(&label))
                    .map(|s| s.1)
                    .sum()
            };
            assert!(by_role("prefill") > 0.0, "{bytes:?}");
            assert_eq!(by_role("prefill"), by_role("decode"), "{bytes:?}");
            // The cluster moves pages through shared memory (serve's default): every byte is
            // counted there, and none over TCP.
            let over = |transport: &str| -> f64 {
                let label = format!("transport=\"{transport}\"");
                bytes
                    .iter()
                    .filter(|s| s.0.contains(&label))
                    .map(|s| s.1)
                    .sum()
            };
            assert_eq!(
                over("shm"),
                by_role("prefill") + by_role("decode"),
                "{bytes:?}"
            );
            assert_eq!(over("tcp"), 0.0, "{bytes:?}");
            let timed = samples(&page, "airlock_transfer_seconds_count");
            assert_eq!(timed.iter().map(|s| s.1).sum::<f64>(), 5.0, "{timed:?}");
        }
        let hits = total(url, "airlock_prefix_cache_hit_tokens_total").await;
        assert!(hits > 0.0);
        let (idle, page) = wait_idle(url).await;
        assert!(idle, "every page free or only cached: {page}");
        assert!(total(url, "airlock_prefix_cache_pages").await > 0.0);
    });
}

#[test]
fn unified_reuses_a_tenants_prefix_and_never_another_tenants() {
    tenants_never_share_and_a_tenant_reuses(Mode::Unified);
}

#[test]
fn disaggregated_reuses_on_both_roles_and_sends_only_missing_pages() {
    tenants_never_share_and_a_tenant_reuses(Mode::Disaggregated);
}

#[test]
fn cache_salt_narrows_sharing_within_a_tenant_and_never_widens_it() {
    let mut options = Options::new(Mode::Unified);
    options.keys = Some(KEYS);
    let server = start(options);
    runtime().block_on(async {
        let url = server.url.as_str();
        let salt = || Some(json!("2345"));
        assert_eq!(ask(url, ALICE, None).await.1, 0);
        assert_eq!(
            ask(url, ALICE, salt()).await.1,
            0,
            "a salt is its own partition"
        );
        assert!(ask(url, ALICE, salt()).await.1 > 0, "the same salt shares");
        assert_eq!(ask(url, BOB, salt()).await.1, 0, "not across tenants");
        // I05's vector: ("org_1", "2345") and ("org_12345", no salt) name different pages.
        assert_eq!(ask(url, "sk-org-1-0123456789", salt()).await.1, 0);
        assert_eq!(ask(url, "sk-org-12345-0123456789", None).await.1, 0);

        // A salt that is not a string of 1 to 256 characters is refused with 400, and the server
        // serves on.
        for bad in [json!(5), json!(""), json!("x".repeat(257)), json!(["a"])] {
            let body = request(Some(bad.clone())).to_string().into_bytes();
            let answer = post_raw(url, "/v1/completions", body, Some(ALICE)).await;
            assert_eq!(answer.status, 400, "{bad}: {}", answer.body);
            assert_eq!(
                answer.json()["error"]["param"],
                "cache_salt",
                "{}",
                answer.body
            );
        }
        assert!(ask(url, ALICE, Some(Value::Null)).await.2 > 0);
        assert!(ask(url, ALICE, Some(json!("x".repeat(256)))).await.2 > 0);
        let (idle, page) = wait_idle(url).await;
        assert!(idle, "{page}");
    });
}

#[test]
fn the_operator_can_turn_prefix_reuse_off() {
    let mut options = Options::new(Mode::Unified);
    options.keys = Some(KEYS);
    options.prefix_cache = false;
    let server = start(options);
    runtime().block_on(async {
        let url = server.url.as_str();
        for _ in 0..2 {
            assert_eq!(ask(url, ALICE, None).await.1, 0);
        }
        assert_eq!(total(url, "airlock_prefix_cache_pages").await, 0.0);
        assert_eq!(total(url, "airlock_prefix_cache_lookups_total").await, 0.0);
    });
}

/// With the prefix index forgetting the tenant (a planted bug), the pool's own tenant check
/// keeps Bob off Alice's cached pages: he is answered cold and the refusal is counted. With
/// the pool's check off too, Bob's request starts from Alice's pages: a cross-tenant hit
/// (the oracle cannot tell the same tokens apart, so the hit itself is the leak signal).
#[test]
fn a_prefix_index_that_forgets_the_tenant_is_stopped_by_the_pools_check() {
    use crate::harness::Backend;
    use transfer::Role;
    use worker::Fault;
    let plan = crate::harness::always;
    for (faults, guarded) in [
        (plan(&[Fault::CacheIgnoresTenant]), true),
        (
            plan(&[Fault::CacheIgnoresTenant, Fault::NoOwnerCheck]),
            false,
        ),
    ] {
        let mut options = Options::new(Mode::Unified);
        options.backend = Backend::Oracle;
        options.keys = Some(KEYS);
        options.faults = vec![(Role::Unified, faults)];
        let server = start(options);
        runtime().block_on(async {
            let url = server.url.as_str();
            let (alice_text, _, _) = ask(url, ALICE, None).await;
            let (bob_text, bob_cached, _) = ask(url, BOB, None).await;
            let refused = total(url, "airlock_ownership_check_failures_total").await;
            if guarded {
                assert_eq!(bob_cached, 0, "the pool refused Alice's pages to Bob");
                assert_eq!(bob_text, alice_text, "Bob answered cold, oracle-exact");
                assert!(refused >= 1.0, "the refusal is counted: {refused}");
            } else {
                assert!(
                    bob_cached > 0,
                    "without both guards Bob starts from Alice's pages"
                );
            }
        });
    }
}
