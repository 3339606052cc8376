//! The llama-family forward pass on CPU, reading and writing K/V only through pages that the
//! KV pool verified for the request (I1), plus sampling and a single-sequence generation loop.
//!
//! A forward step is batched: several sequences, each at its own position with its own page
//! table, go through one pass, so the weights are read once for all of them (the basis of
//! continuous batching); a prefill step is the same call with many tokens for one sequence.
//!
//! This crate does no I/O beyond reading the model file, and owns no pool: callers pass the
//! pool in, so the scheduler decides who gets pages.

mod config;
mod error;
mod forward;
mod generate;
mod load;
mod logits;
mod merge;
mod oracle;
mod sampling;
mod stop;

pub use config::{Architecture, ModelConfig, SlidingWindow};
pub use error::{Error, Result};
pub use forward::{Forward, LogitRows, SeqStep};
pub use generate::{
    generate, take_complete_utf8, FinishReason, GenerateRequest, GenerateStats, Generated,
};
pub use load::{LoadOptions, LoadProgress, Loaded, Model, WeightReport};
pub use logits::Logits;
pub use merge::PassCounts;
pub use oracle::OracleModel;
pub use sampling::{logprobs, Sampler, SamplingParams};
pub use stop::StopMatcher;
