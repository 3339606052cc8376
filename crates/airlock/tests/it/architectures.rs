//! Serving every architecture Airlock runs: the serving, disconnect and canary tests that
//! SmolLM2 passes, run unchanged on Gemma 3 270M (sliding-window layers, a SentencePiece
//! vocabulary of 262,144, BOS first, no chat template in its file) and on the random-weight
//! qwen3, qwen2 and llama models of scripts/fetch-test-models.sh (qwen3's head size is not
//! the width over the heads, so its pages and attention take a shape SmolLM2's never do;
//! their text is noise). What is held: each path answers as `generate` does, pools come
//! back, and the canary finds no leak.

use crate::canary::canary_against_serve_on;
use crate::serving::{
    a_mixed_workload_with_cancellations_returns_every_pool_to_its_start_on,
    greedy_output_is_the_same_through_serve_unified_and_generate_on,
};
use std::path::{Path, PathBuf};

const MODELS: [&str; 4] = [
    "gemma-3-270m-q4_k_m.gguf",
    "random-qwen3.gguf",
    "random-qwen2.gguf",
    "random-llama.gguf",
];

/// Test model `name` (`$AIRLOCK_TEST_MODELS`, else models/requant).
fn test_model(name: &str) -> PathBuf {
    let dir = std::env::var_os("AIRLOCK_TEST_MODELS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/requant"),
        PathBuf::from,
    );
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-test-models.sh",
        path.display()
    );
    path
}

#[test]
fn every_architecture_answers_through_serve_as_generate_does() {
    for name in MODELS {
        eprintln!("model {name}");
        greedy_output_is_the_same_through_serve_unified_and_generate_on(&test_model(name));
    }
}

#[test]
fn every_architecture_returns_every_pool_after_disconnects() {
    for name in MODELS {
        eprintln!("model {name}");
        a_mixed_workload_with_cancellations_returns_every_pool_to_its_start_on(&test_model(name));
    }
}

/// The canary on the shared-memory transport, `serve`'s default (SmolLM2's test runs both).
#[test]
fn canary_against_serve_is_clean_on_every_architecture() {
    for name in MODELS {
        eprintln!("model {name}");
        canary_against_serve_on(&test_model(name).display().to_string(), "shm");
    }
}
