//! The `ggml-exact` kernels against llama.cpp bit for bit, on the reference runs made by
//! scripts/reference/make_reference.py with llama-cpp-python 0.3.36 on two machines:
//! `--kernels ggml-exact` against the AVX-512 build (`tests/data/reference_avx512/` and
//! `tests/data/reference_more/`: twelve prompts) and `--kernels ggml-exact-avx2` against the
//! AVX2 build (`tests/data/`: six prompts), plain and chat-templated, one of 1,211 tokens.
//! Each run records the sha256 of its first-step logits, so equality of all 49,152 floats is
//! checked without shipping them.

use crate::common;
use kernels::Backend;
use model::{Model, SeqStep};
use serde_json::Value;
use sha2::{Digest, Sha256};

struct Case {
    name: String,
    mode: String,
    prompt_tokens: Vec<u32>,
    greedy_tokens: Vec<u32>,
    first_logits_sha256: String,
}

fn load(folder: &str) -> Vec<Case> {
    let path = common::workspace_root().join(folder).join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("reference.json is JSON");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("an array of token ids")
            .iter()
            .map(|t| t.as_u64().expect("token id") as u32)
            .collect()
    };
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_string(),
            mode: c["mode"].as_str().expect("mode").to_string(),
            prompt_tokens: ids(&c["prompt_tokens"]),
            greedy_tokens: ids(&c["greedy_tokens"]),
            first_logits_sha256: c["first_logits_sha256"]
                .as_str()
                .expect("first_logits_sha256")
                .to_string(),
        })
        .collect()
}

/// sha256 of logits as make_reference.py hashes them: little-endian f32 bytes.
fn logits_sha256(logits: &[f32]) -> String {
    let mut hasher = Sha256::new();
    for value in logits {
        hasher.update(value.to_le_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn first_step_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let mut pool = common::pool(prompt.len() + common::PAGE_SIZE);
    let table = pool.allocate(common::owner(7, 7), prompt.len()).unwrap();
    let step = SeqStep {
        table: &table,
        tokens: prompt,
        start_pos: 0,
        logits: model::LogitRows::Last,
    };
    let logits = model.forward(&mut pool, &[step]).unwrap()[0].to_vec();
    pool.release(table).unwrap();
    logits
}

/// Runs every case of `folders` on `backend`: first-step logits and 64 greedy tokens
/// through `generate`; returns what differs.
fn compare(backend: Backend, folders: &[&str]) -> Vec<String> {
    let model = common::exact_model(backend);
    let cases: Vec<Case> = folders.iter().flat_map(|folder| load(folder)).collect();
    let mut failures = Vec::new();
    for case in &cases {
        let sha = logits_sha256(&first_step_logits(model, &case.prompt_tokens));
        let request = common::greedy_request(&case.prompt_tokens, 64, case.prompt_tokens.len());
        let generated = common::generate_on(model, &request);
        let equal = generated
            .tokens
            .iter()
            .zip(&case.greedy_tokens)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{}: {} ({}, {} prompt tokens): first logits {}, greedy equal for {equal}/64",
            backend.name(),
            case.name,
            case.mode,
            case.prompt_tokens.len(),
            if sha == case.first_logits_sha256 {
                "bit-equal"
            } else {
                "DIFFERENT"
            }
        );
        if sha != case.first_logits_sha256 {
            failures.push(format!("{}: first-step logits differ", case.name));
        }
        if generated.tokens != case.greedy_tokens {
            failures.push(format!(
                "{}: greedy tokens part after {equal}: ours {:?}, llama.cpp {:?}",
                case.name,
                &generated.tokens[equal.min(generated.tokens.len())..],
                &case.greedy_tokens[equal..]
            ));
        }
    }
    failures
}

/// The bar, met without exceptions: on every prompt of both AVX-512 sets, the
/// first-step logits equal llama.cpp's bit for bit and greedy decoding through `generate`
/// gives its 64 tokens exactly.
#[test]
fn ggml_exact_kernels_equal_llama_cpp_avx512_bit_for_bit_on_all_twelve_prompts() {
    let folders = ["tests/data/reference_avx512", "tests/data/reference_more"];
    let cases: Vec<Case> = folders.iter().flat_map(|folder| load(folder)).collect();
    assert_eq!(cases.len(), 12, "two sets of six prompts");
    assert!(
        cases.iter().any(|c| c.mode == "chat"),
        "chat prompts included"
    );
    assert!(
        cases.iter().any(|c| c.prompt_tokens.len() > 1000),
        "a long prompt included"
    );
    let failures = compare(Backend::GgmlExact, &folders);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same against the build for the engine issue's machine class (AVX2, no AVX-512), whose
/// results differ from the AVX-512 build's on four of the six prompts.
#[test]
fn ggml_exact_avx2_kernels_equal_llama_cpp_avx2_bit_for_bit() {
    assert_eq!(load("tests/data").len(), 6, "six prompts");
    let failures = compare(Backend::GgmlExactAvx2, &["tests/data"]);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The bar is not met by accident: on a prompt where llama.cpp's two builds part, each
/// `ggml-exact` backend gives its own build's bits and not the other's, and the fast kernels
/// (which sum in another order) give neither.
#[test]
fn each_build_is_matched_only_by_its_own_emulation() {
    let pick = |folder: &str| {
        load(folder)
            .into_iter()
            .find(|c| c.name == "apollo_digits")
            .expect("apollo_digits in every core set")
    };
    let (avx512, avx2) = (pick("tests/data/reference_avx512"), pick("tests/data"));
    assert_eq!(avx512.prompt_tokens, avx2.prompt_tokens);
    assert_ne!(
        avx512.first_logits_sha256, avx2.first_logits_sha256,
        "the builds part on this prompt"
    );
    let sha = |model: &Model| logits_sha256(&first_step_logits(model, &avx512.prompt_tokens));
    let emulated_avx512 = sha(common::exact_model(Backend::GgmlExact));
    let emulated_avx2 = sha(common::exact_model(Backend::GgmlExactAvx2));
    let fast = sha(common::model());
    assert_eq!(emulated_avx512, avx512.first_logits_sha256);
    assert_eq!(emulated_avx2, avx2.first_logits_sha256);
    assert_ne!(emulated_avx512, avx2.first_logits_sha256);
    assert_ne!(emulated_avx2, avx512.first_logits_sha256);
    assert_ne!(fast, avx512.first_logits_sha256);
    assert_ne!(fast, avx2.first_logits_sha256);
}

/// A request's bits do not depend on what it is batched with: a decode step run beside
/// another sequence's gives the logits the same step gives alone (llama.cpp's own choice of
/// dot product follows its batch size, so each sequence is computed as if evaluated alone).
#[test]
fn ggml_exact_logits_do_not_depend_on_the_batch() {
    let model = common::exact_model(Backend::GgmlExact);
    let cases = load("tests/data/reference_avx512");
    let (a, b) = (&cases[0].prompt_tokens, &cases[1].prompt_tokens);
    let next = [cases[0].greedy_tokens[0]];
    let other_next = [cases[1].greedy_tokens[0]];
    let mut pool = common::pool(a.len() + b.len() + 4 * common::PAGE_SIZE);
    let table_a = pool.allocate(common::owner(1, 1), a.len() + 1).unwrap();
    let table_b = pool.allocate(common::owner(1, 2), b.len() + 1).unwrap();
    let step = |table, tokens, start_pos| SeqStep {
        table,
        tokens,
        start_pos,
        logits: model::LogitRows::Last,
    };
    model.forward(&mut pool, &[step(&table_a, a, 0)]).unwrap();
    model.forward(&mut pool, &[step(&table_b, b, 0)]).unwrap();
    let batched = model
        .forward(
            &mut pool,
            &[
                step(&table_a, &next, a.len()),
                step(&table_b, &other_next, b.len()),
            ],
        )
        .unwrap();
    // The same decode step for `a` alone, over the same prompt KV (rewritten identically).
    let mut alone_pool = common::pool(a.len() + 2 * common::PAGE_SIZE);
    let alone_table = alone_pool
        .allocate(common::owner(1, 3), a.len() + 1)
        .unwrap();
    let prompt = step(&alone_table, a, 0);
    model.forward(&mut alone_pool, &[prompt]).unwrap();
    let alone = model
        .forward(&mut alone_pool, &[step(&alone_table, &next, a.len())])
        .unwrap();
    let bits = |v: &[f32]| logits_sha256(v);
    assert_eq!(bits(&batched[0]), bits(&alone[0]));
    for (pool, tables) in [
        (&mut pool, vec![table_a, table_b]),
        (&mut alone_pool, vec![alone_table]),
    ] {
        for table in tables {
            pool.release(table).unwrap();
        }
    }
}
