//! Integration tests against the real SmolLM2-135M-Instruct GGUF file.
//!
//! The file is found through `AIRLOCK_MODEL` or at
//! `<workspace>/models/SmolLM2-135M-Instruct.Q4_1.gguf`; when it is missing
//! the tests fail and say how to fetch it.

mod chat;
mod common;
mod model;
mod tokenizer;
