//! CPU compute kernels for the llama forward pass: quantized weight matrices (four compute
//! layouts, `layout`, repacked at load into 8-row groups; [`formats`] turns each GGUF tensor
//! format into one of them), activation quantization, and the small element-wise
//! ops (RMSNorm, RoPE, SwiGLU, softmax, f16 dot products for attention).
//!
//! Every kernel has a portable scalar version beside its AVX2/FMA/F16C version; the backend is
//! chosen once at run time from the CPU's features ([`Backend::detect`]) and tests run the
//! same checks over every backend the machine has. [`ggml_exact`] is apart: chosen only on
//! request, it computes what llama.cpp computes rather than what `Scalar` does.
//!
//! This crate knows nothing about tenants, owners or models: it takes slices (K/V as lists of
//! fixed-size chunks) and returns numbers.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx512;
mod avx2;
mod backend;
mod expf;
pub mod formats;
pub mod ggml_exact;
mod layout;
mod matrix;
mod ops;
mod quant;
mod scalar;
mod sync;
mod vnni;
mod workers;
mod xxh3;

pub use attention::{key_index, load_key, store_key, KvHeadAttention};
pub use backend::Backend;
pub use expf::expf;
pub use formats::{Fidelity, TensorFormat};
pub use layout::WeightFormat;
pub use matrix::QuantMatrix;
pub use ops::{
    add_in_place, attention_mix_f16, attention_scores_f16, gelu, gelu_mul, rms_norm, rms_norm_rows,
    rope_in_place, silu_mul, softmax_in_place, RopeStyle, RopeTable,
};
pub use quant::{quantize_acts, quantize_blocks, ActBlock, QuantActs, BLOCK};
pub use workers::{Turn, Workers};
pub use xxh3::{
    xxh3_64_long, xxh3_64_long_copy, xxh3_64_long_scalar, XXH3_SECRET_BYTES, XXH3_SHORT_MAX,
};

/// Errors from building kernels' data structures out of untrusted bytes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("matrix {rows}x{cols} has {got} bytes of {format:?} data, expected {expected}")]
    WrongByteLength {
        format: WeightFormat,
        rows: usize,
        cols: usize,
        got: usize,
        expected: usize,
    },
    #[error("matrix shape {rows}x{cols} unsupported: rows must be a multiple of 8 and cols of 32")]
    UnsupportedShape { rows: usize, cols: usize },
    #[error("tensor {rows}x{cols} has {got} bytes of {format} data, expected {expected}")]
    WrongTensorBytes {
        format: TensorFormat,
        rows: usize,
        cols: usize,
        got: usize,
        expected: usize,
    },
    #[error(
        "a row of {cols} values is not a whole number of {format} blocks \
         ({values} values each) and of 32-value blocks",
        values = format.block_values()
    )]
    NotWholeBlocks { format: TensorFormat, cols: usize },
    #[error("cannot concatenate matrices with different column counts or formats")]
    ConcatMismatch,
}

pub type Result<T> = std::result::Result<T, Error>;

// Under `--cfg loom` only `tests/loom.rs` runs: these tests use the pool outside a loom model.
#[cfg(all(test, not(loom)))]
mod tests;
