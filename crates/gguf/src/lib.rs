//! Reading GGUF model files: the header, the tokenizer and the chat template.
//!
//! What this crate is:
//! - a strict, panic-free parser of the GGUF v2/v3 header ([`GgufFile::parse`]):
//!   metadata key/values, tensor names, shapes, types and the location of
//!   each tensor's data inside the file, every length, count and offset
//!   checked against the bytes present and against sanity limits
//!   ([`MAX_STRING_LEN`], [`MAX_ARRAY_LEN`], ...);
//! - typed metadata getters that name the key in their errors;
//! - the byte-level BPE tokenizer stored in the file ([`Tokenizer`]), matching
//!   llama.cpp's tokenization for `gpt2` vocabularies with the `smollm`,
//!   `gpt-2`, `llama-bpe` (Llama 3) and `qwen2` pre-tokenizers;
//! - the chat template renderer ([`ChatTemplate`]), using MiniJinja.
//!
//! What it is not:
//! - not an I/O layer: it parses a byte slice the caller provides (usually a
//!   memory map) and never copies tensor data; [`GgufFile::tensor_bytes`]
//!   slices it out of that same buffer;
//! - not a dequantizer or a model: it knows each ggml type's block layout
//!   only to size tensors;
//! - not a writer of GGUF files, and not a general tokenizer library
//!   (SentencePiece, WordPiece and other pre-tokenizers are refused).
//!
//! All failures are [`Error`] values; no input bytes make it panic.

#![forbid(unsafe_code)]

pub mod chat;
mod error;
mod file;
mod ggml_type;
mod parse;
mod reader;
pub mod tokenizer;
mod value;

#[cfg(test)]
mod testutil;

pub use chat::{ChatMessage, ChatTemplate};
pub use error::{Error, Result};
pub use file::{GgufFile, TensorInfo};
pub use ggml_type::GgmlType;
pub use parse::{
    DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_KV_COUNT, MAX_STRING_LEN,
    MAX_TENSOR_COUNT, MAX_TENSOR_DIMS,
};
pub use tokenizer::{TokenType, Tokenizer};
pub use value::Value;
