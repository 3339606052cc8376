//! Integration tests of the model crate against the real SmolLM2-135M-Instruct GGUF.
//!
//! - `reference`: tokenizer ids, greedy tokens and first-step logits against llama.cpp
//!   (`tests/data/reference.json`), and chunked prefill against whole-prompt prefill.
//! - `exact`: the `ggml-exact` kernels equal llama.cpp bit for bit (first-step logits) and
//!   token for token (64 greedy tokens) on every reference prompt of the build they emulate.
//! - `isolation`: I1 (a forward pass touches only pages its table still owns) and I9 (no page
//!   leak), and that a batched step does not mix its sequences.
//! - `merge`: a model that merges concurrent passes gives each caller its own logits, and a
//!   caller whose pages fail their check fails alone.
//! - `formats`, `architectures`: every tensor format (SmolLM2 requantized) and every
//!   architecture (random-weight models) against llama.cpp on the same file.
//! - `generate`: the generation loop: length and stop endings, admission errors that leave the
//!   pool untouched, seeded sampling, out-of-range tokens.
//!
//! The model is loaded once per binary (see `common::loaded`).

mod against_llama_cpp;
mod architectures;
mod common;
mod exact;
mod formats;
mod generate;
mod isolation;
mod merge;
mod prefix;
mod reference;
