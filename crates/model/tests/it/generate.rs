//! The generation loop: how it ends, what it refuses before allocating (I3), that it leaves the
//! pool whole (I9) on every path, seeded sampling, and out-of-range tokens.

use crate::common::{self, generate_in_fresh_pool, greedy_request, owner, PAGE_SIZE};
use kv::{PagePool, PageTable};
use model::{Error, FinishReason, GenerateRequest, SamplingParams, SeqStep};

const PROMPT: &str = "The capital of France is";

fn prompt() -> Vec<u32> {
    common::tokenizer().encode(PROMPT, false)
}

fn generate(pool: &mut PagePool, request: &GenerateRequest) -> model::Result<model::Generated> {
    model::generate(
        common::model(),
        common::tokenizer(),
        pool,
        owner(7, 70),
        request,
        &mut |_| {},
    )
}

#[test]
fn max_tokens_8_gives_8_tokens_and_finish_reason_length() {
    let mut request = greedy_request(&prompt(), 8, 512);
    request.stop_at_eos = true;
    let (generated, streamed) = generate_in_fresh_pool(&request);
    assert_eq!(generated.tokens.len(), 8);
    assert_eq!(generated.finish_reason, FinishReason::Length);
    assert_eq!(generated.stats.completion_tokens, 8);
    assert_eq!(generated.stats.prompt_tokens, request.prompt.len());
    assert_eq!(
        generated.text,
        common::tokenizer().decode(&generated.tokens)
    );
    assert_eq!(
        streamed, generated.text,
        "streamed pieces add up to the text"
    );
    assert!(!generated.tokens.contains(&common::tokenizer().eos_id()));
}

#[test]
fn stop_string_from_the_reference_continuation_cuts_the_text_before_it() {
    // llama.cpp continues "The capital of France is" with " Paris.\n\nThe United States has a
    // population of ..." (tests/data/reference.json, capital_france).
    let stop = "United States";
    let (unstopped, _) = generate_in_fresh_pool(&greedy_request(&prompt(), 64, 512));
    let cut = unstopped.text.find(stop).unwrap_or_else(|| {
        panic!(
            "the greedy continuation no longer contains {stop:?}: {:?}",
            unstopped.text
        )
    });

    let mut request = greedy_request(&prompt(), 64, 512);
    request.stop = vec!["never appears \u{1F600}".to_string(), stop.to_string()];
    let (generated, streamed) = generate_in_fresh_pool(&request);
    assert_eq!(generated.finish_reason, FinishReason::Stop);
    assert_eq!(generated.text, &unstopped.text[..cut]);
    assert!(
        !generated.text.contains(stop),
        "the stop string is not shown"
    );
    assert_eq!(
        streamed, generated.text,
        "the stream never showed the stop string"
    );
    assert!(
        generated.tokens.len() < 64,
        "generation stopped early: {} tokens",
        generated.tokens.len()
    );
    assert_eq!(
        generated.tokens[..],
        unstopped.tokens[..generated.tokens.len()],
        "same greedy tokens up to the stop"
    );
}

#[test]
fn prompt_plus_max_tokens_over_the_context_length_is_refused_before_allocating() {
    let context_length = common::model().config().context_length;
    let prompt = prompt();
    let mut pool = common::pool(context_length + 4 * PAGE_SIZE);
    let free = pool.pages_free();
    let max_tokens = context_length - prompt.len() + 1;
    match generate(&mut pool, &greedy_request(&prompt, max_tokens, 512)) {
        Err(Error::ContextLengthExceeded {
            prompt_tokens,
            max_tokens: got_max,
            context_length: got_context,
        }) => {
            assert_eq!(prompt_tokens, prompt.len());
            assert_eq!(got_max, max_tokens);
            assert_eq!(got_context, context_length);
        }
        other => panic!("expected ContextLengthExceeded, got {other:?}"),
    }
    assert_eq!(pool.pages_free(), free, "refusal allocated pages");
    pool.check_invariants();

    // One token less is admitted (not off by one): with a pool far too small for it, the
    // request gets past admission and fails at allocation instead, still taking nothing.
    let mut small = common::pool(4 * PAGE_SIZE);
    let exact = greedy_request(&prompt, context_length - prompt.len(), 512);
    match generate(&mut small, &exact) {
        Err(Error::Kv(kv::Error::OutOfPages { needed, .. })) => {
            assert_eq!(needed, context_length.div_ceil(PAGE_SIZE))
        }
        other => panic!("expected the exact fit to pass admission, got {other:?}"),
    }
    assert_eq!(small.pages_free(), small.page_count());
}

#[test]
fn pool_too_small_for_the_request_fails_with_out_of_pages_and_changes_nothing() {
    let mut pool = common::pool(4 * PAGE_SIZE);
    let free = pool.pages_free();
    let prompt = prompt();
    let request = greedy_request(&prompt, 100, 512);
    let needed = (prompt.len() + 100).div_ceil(PAGE_SIZE);
    match generate(&mut pool, &request) {
        Err(Error::Kv(kv::Error::OutOfPages {
            needed: got_needed,
            free: got_free,
        })) => {
            assert_eq!(got_needed, needed);
            assert_eq!(got_free, free);
        }
        other => panic!("expected OutOfPages, got {other:?}"),
    }
    assert_eq!(pool.pages_free(), free, "a failed allocation kept pages");
    pool.check_invariants();

    // The same pool serves a request that fits.
    let fits = greedy_request(&prompt, 2, 512);
    generate(&mut pool, &fits).expect("a request that fits runs");
    assert_eq!(pool.pages_free(), free);
}

fn sampled(seed: u64) -> Vec<u32> {
    let fixture = common::loaded();
    let template = fixture.chat_template.as_ref().expect("chat template");
    let rendered = template
        .render(
            &[gguf::ChatMessage::new("user", "Tell me a short story.")],
            true,
        )
        .unwrap();
    let request = GenerateRequest {
        prompt: fixture.tokenizer.encode(&rendered, true),
        max_tokens: 32,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed,
            ..SamplingParams::greedy()
        },
        stop: Vec::new(),
        stop_at_eos: false,
        prefill_chunk: 512,
    };
    let (generated, _) = generate_in_fresh_pool(&request);
    assert_eq!(generated.tokens.len(), 32);
    generated.tokens
}

#[test]
fn seeded_temperature_sampling_repeats_with_the_same_seed_and_differs_with_another() {
    let first = sampled(1234);
    let again = sampled(1234);
    let other = sampled(98765);
    assert_eq!(first, again, "same seed, same tokens");
    assert_ne!(first, other, "different seeds, different tokens");
}

#[test]
fn out_of_range_token_is_refused_before_any_kv_write_and_leaks_nothing() {
    let vocab_size = common::model().config().vocab_size;
    let bad = vocab_size as u32;
    let mut pool = common::pool(8 * PAGE_SIZE);
    let free = pool.pages_free();

    // Through forward: a valid prefix then the bad id. Nothing may be written, not even the
    // valid tokens' K/V (a fresh pool is all zeros).
    let table: PageTable = pool.allocate(owner(7, 71), 2 * PAGE_SIZE).unwrap();
    let before = common::snapshot(&mut pool, &table);
    assert!(before.iter().flatten().all(|&bits| bits == 0));
    let mut tokens = prompt();
    tokens.push(bad);
    let step = SeqStep {
        table: &table,
        tokens: &tokens,
        start_pos: 0,
        logits: model::LogitRows::Last,
    };
    match common::model().forward(&mut pool, &[step]) {
        Err(Error::TokenOutOfRange {
            token,
            vocab_size: v,
        }) => {
            assert_eq!(token, bad);
            assert_eq!(v, vocab_size);
        }
        other => panic!("expected TokenOutOfRange, got {other:?}"),
    }
    assert_eq!(
        common::snapshot(&mut pool, &table),
        before,
        "K/V was written"
    );
    pool.release(table).unwrap();
    assert_eq!(pool.pages_free(), free);

    // Through generate: it allocates, fails in the step, and must give every page back.
    let request = greedy_request(&tokens, 4, 512);
    match generate(&mut pool, &request) {
        Err(Error::TokenOutOfRange { token, .. }) => assert_eq!(token, bad),
        other => panic!("expected TokenOutOfRange, got {other:?}"),
    }
    assert_eq!(pool.pages_free(), free, "pages leaked (I9)");
    pool.check_invariants();
}

#[test]
fn an_empty_batch_is_a_no_op_and_a_huge_max_tokens_is_refused_without_overflow() {
    let mut pool = common::pool(8 * PAGE_SIZE);
    let free = pool.pages_free();
    assert!(common::model().forward(&mut pool, &[]).unwrap().is_empty());
    let request = common::greedy_request(&prompt(), usize::MAX, 512);
    let result = model::generate(
        common::model(),
        common::tokenizer(),
        &mut pool,
        owner(8, 81),
        &request,
        &mut |_| {},
    );
    assert!(
        matches!(result, Err(model::Error::ContextLengthExceeded { .. })),
        "{result:?}"
    );
    assert_eq!(pool.pages_free(), free);
}
