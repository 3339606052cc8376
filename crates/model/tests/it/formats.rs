//! Every tensor format Airlock loads, on a real model: SmolLM2-135M-Instruct requantized by
//! llama.cpp's own `llama-quantize` (scripts/fetch-test-models.sh) to Q4_0, Q5_0, Q5_1, Q8_0,
//! Q4_K_M, Q5_K_M, Q6_K and F16, and the Q4_1 file with Llama 3's RoPE frequency scaling added
//! (`llama3-rope`), each held to llama.cpp on the same file
//! (`tests/data/formats/<TYPE>/reference.json`, `make_reference.py --top-logits 20`, AVX-512
//! build): first-step logits, and greedy tokens up to a near-tie.
//!
//! With 576 columns (not a multiple of 256), llama-quantize writes most of the k-quant files'
//! matrices in its fallback types (Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K); only the
//! 1,536-column `ffn_down` matrices are k-quants. Each test prints what its file holds.

use crate::against_llama_cpp::{self, KnownParting};
use crate::common;
use std::path::PathBuf;

/// Partings past the near-tie bar that are known, by (file, prompt, token). The F16 file's
/// matrices are requantized to Q8_0 (`Fidelity::Requantized`), so its weights are not the
/// file's, and llama.cpp's margin there (0.306) and ours (0.375) are just past the bar. A
/// layout of f16 weights is what would remove it. Listed, a parting is reported and allowed;
/// any other fails.
const KNOWN_PARTINGS: &[KnownParting] = &[("F16", "code_fibonacci", 21)];

fn model_path(type_name: &str) -> PathBuf {
    common::test_model(&format!("SmolLM2-135M-Instruct.{type_name}.gguf"))
}

/// Loads the `type_name` file and holds it to llama.cpp on the six reference prompts.
fn check_file(type_name: &str) {
    let reference =
        common::workspace_root().join(format!("tests/data/formats/{type_name}/reference.json"));
    against_llama_cpp::check_file(
        type_name,
        &model_path(type_name),
        &reference,
        KNOWN_PARTINGS,
    );
}

#[test]
fn q4_0_file_agrees_with_llama_cpp() {
    check_file("Q4_0");
}

#[test]
fn q5_0_file_agrees_with_llama_cpp() {
    check_file("Q5_0");
}

#[test]
fn q5_1_file_agrees_with_llama_cpp() {
    check_file("Q5_1");
}

#[test]
fn q8_0_file_agrees_with_llama_cpp() {
    check_file("Q8_0");
}

#[test]
fn q4_k_m_file_agrees_with_llama_cpp() {
    check_file("Q4_K_M");
}

#[test]
fn q5_k_m_file_agrees_with_llama_cpp() {
    check_file("Q5_K_M");
}

#[test]
fn q6_k_file_agrees_with_llama_cpp() {
    check_file("Q6_K");
}

#[test]
fn f16_file_agrees_with_llama_cpp() {
    check_file("F16");
}

/// Llama 3's RoPE frequency scaling: the Q4_1 file with a `rope_freqs.weight` tensor
/// (scripts/make-rope-scaled-model.py), whose factors divide most pairs' angles by up to 8.
#[test]
fn llama3_rope_scaled_file_agrees_with_llama_cpp() {
    check_file("llama3-rope");
}
