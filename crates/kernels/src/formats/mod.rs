//! The tensor formats a GGUF file may store a matrix in (ggml's types), and for each one its
//! scalar reference dequantizer and its way into a compute layout.
//!
//! The matmul kernels run four layouts: [`WeightFormat::Q4_1`], [`WeightFormat::Q5_0`],
//! [`WeightFormat::Q8_0`] and [`WeightFormat::Q8Offset`] (signed bytes with a scale and an
//! offset, which every format reaches, so matrices of different formats can be stacked).
//! Every other format is turned into one of them once, at load ([`transcode`]), so a new
//! format adds its own dequantizer and one row of [`TensorFormat::plan`], and no kernel. How
//! faithful each way is, is stated by its [`Fidelity`] and tested against the reference.
//!
//! This module depends on nothing else in the crate except `layout`'s names: formats sit
//! below the matmul layer, never beside it.

mod floats;
mod kquants;
mod legacy;
mod transcode;

#[cfg(test)]
mod tests;

use crate::WeightFormat;
pub use transcode::{into_layout, stacking_layout, transcode, Transcoded};

/// A tensor format of a GGUF file that Airlock can load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum TensorFormat {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// How a format's values reach the compute layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fidelity {
    /// Every value is the file's, bit for bit.
    Exact,
    /// The file's integers, with each 32-value sub-block's scale and offset rounded to f16 (a
    /// relative error of at most 2⁻¹¹ on each): Q4_K as Q4_1, Q5_K as Q8Offset.
    RoundedScales,
    /// Dequantized and quantized again to Q8_0: each value within half a Q8_0 step (the
    /// block's largest magnitude / 254, times 1.002 for the f16 scale) of the file's, for a
    /// block whose scale is a normal f16 (largest magnitude at least 127 × 2⁻¹⁴); below that
    /// the f16 scale loses precision, as in ggml's own Q8_0.
    Requantized,
}

impl Fidelity {
    pub fn describe(self) -> &'static str {
        match self {
            Fidelity::Exact => "exact",
            Fidelity::RoundedScales => "scales rounded to f16",
            Fidelity::Requantized => "requantized to Q8_0",
        }
    }
}

/// Which way a format takes into a compute layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub(crate) enum Plan {
    /// The file's blocks are the layout's own (GGUF Q4_1, Q5_0 and Q8_0).
    Native(WeightFormat),
    /// Q4_0 as Q5_0: `q − 8 = (q + 8) − 16`, with the same scale. (As Q4_1, with an offset of
    /// −8 × scale, its weights would be as exact, but the Q4_1 kernel's offset term multiplies
    /// by the activations' f16-rounded sum, where llama.cpp's Q4_0 dot product is exact in
    /// integers, as the Q5_0 kernel's is: on the Q4_0 file that moved one reference prompt's
    /// first-step logits 1.2 from llama.cpp's and its first token.)
    Q4_0AsQ5_0,
    /// Q4_K's 32-value sub-blocks as Q4_1 blocks, their scales rounded to f16.
    Q4_KAsQ4_1,
    /// Q5_1 as Q8Offset: its 5-bit values as bytes, the same scale and offset.
    Q5_1AsQ8Offset,
    /// Q5_K's 32-value sub-blocks as Q8Offset blocks, their scales rounded to f16.
    Q5_KAsQ8Offset,
    /// Through f32 into Q8_0.
    Requantize,
}

impl TensorFormat {
    pub const ALL: [TensorFormat; 11] = [
        TensorFormat::F32,
        TensorFormat::F16,
        TensorFormat::BF16,
        TensorFormat::Q4_0,
        TensorFormat::Q4_1,
        TensorFormat::Q5_0,
        TensorFormat::Q5_1,
        TensorFormat::Q8_0,
        TensorFormat::Q4_K,
        TensorFormat::Q5_K,
        TensorFormat::Q6_K,
    ];

    /// ggml's name for it (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        match self {
            TensorFormat::F32 => "F32",
            TensorFormat::F16 => "F16",
            TensorFormat::BF16 => "BF16",
            TensorFormat::Q4_0 => "Q4_0",
            TensorFormat::Q4_1 => "Q4_1",
            TensorFormat::Q5_0 => "Q5_0",
            TensorFormat::Q5_1 => "Q5_1",
            TensorFormat::Q8_0 => "Q8_0",
            TensorFormat::Q4_K => "Q4_K",
            TensorFormat::Q5_K => "Q5_K",
            TensorFormat::Q6_K => "Q6_K",
        }
    }

    /// The format ggml calls `name`, if Airlock loads it.
    pub fn from_name(name: &str) -> Option<TensorFormat> {
        TensorFormat::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Every name [`Self::from_name`] takes, for error messages.
    pub fn supported_names() -> String {
        TensorFormat::ALL.map(TensorFormat::name).join(", ")
    }

    /// Values per block (1 for the float formats).
    pub const fn block_values(self) -> usize {
        match self {
            TensorFormat::F32 | TensorFormat::F16 | TensorFormat::BF16 => 1,
            TensorFormat::Q4_0
            | TensorFormat::Q4_1
            | TensorFormat::Q5_0
            | TensorFormat::Q5_1
            | TensorFormat::Q8_0 => 32,
            TensorFormat::Q4_K | TensorFormat::Q5_K | TensorFormat::Q6_K => 256,
        }
    }

    /// Bytes per block in the file.
    pub const fn block_bytes(self) -> usize {
        match self {
            TensorFormat::F32 => 4,
            TensorFormat::F16 | TensorFormat::BF16 => 2,
            TensorFormat::Q4_0 => 18,
            TensorFormat::Q4_1 => 20,
            TensorFormat::Q5_0 => 22,
            TensorFormat::Q5_1 => 24,
            TensorFormat::Q8_0 => 34,
            TensorFormat::Q4_K => 144,
            TensorFormat::Q5_K => 176,
            TensorFormat::Q6_K => 210,
        }
    }

    /// Bytes a row of `cols` values takes, or `None` when `cols` is not a whole number of
    /// blocks (or overflows).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_values()) {
            return None;
        }
        (cols / self.block_values()).checked_mul(self.block_bytes())
    }

    /// The compute layout this format's matrices take in memory (Q8_0 where a rounded scale
    /// overflows, which no real file has).
    pub fn layout(self) -> WeightFormat {
        match self.plan() {
            Plan::Native(layout) => layout,
            Plan::Q4_0AsQ5_0 => WeightFormat::Q5_0,
            Plan::Q4_KAsQ4_1 => WeightFormat::Q4_1,
            Plan::Q5_1AsQ8Offset | Plan::Q5_KAsQ8Offset => WeightFormat::Q8Offset,
            Plan::Requantize => WeightFormat::Q8_0,
        }
    }

    pub(crate) fn plan(self) -> Plan {
        match self {
            TensorFormat::Q4_1 => Plan::Native(WeightFormat::Q4_1),
            TensorFormat::Q5_1 => Plan::Q5_1AsQ8Offset,
            TensorFormat::Q5_0 => Plan::Native(WeightFormat::Q5_0),
            TensorFormat::Q8_0 => Plan::Native(WeightFormat::Q8_0),
            TensorFormat::Q4_0 => Plan::Q4_0AsQ5_0,
            TensorFormat::Q4_K => Plan::Q4_KAsQ4_1,
            TensorFormat::Q5_K => Plan::Q5_KAsQ8Offset,
            TensorFormat::F32 | TensorFormat::F16 | TensorFormat::BF16 | TensorFormat::Q6_K => {
                Plan::Requantize
            }
        }
    }

    /// The reference dequantizer: `bytes` holds whole blocks, `out` their values in order.
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        let blocks = bytes.len() / self.block_bytes();
        assert_eq!(
            bytes.len(),
            blocks * self.block_bytes(),
            "whole {} blocks",
            self.name()
        );
        assert_eq!(
            out.len(),
            blocks * self.block_values(),
            "one output per value"
        );
        let per_block = bytes
            .chunks_exact(self.block_bytes())
            .zip(out.chunks_exact_mut(self.block_values()));
        let one: fn(&[u8], &mut [f32]) = match self {
            TensorFormat::F32 => floats::dequantize_f32,
            TensorFormat::F16 => floats::dequantize_f16,
            TensorFormat::BF16 => floats::dequantize_bf16,
            TensorFormat::Q4_0 => legacy::dequantize_q4_0,
            TensorFormat::Q4_1 => legacy::dequantize_q4_1,
            TensorFormat::Q5_0 => legacy::dequantize_q5_0,
            TensorFormat::Q5_1 => legacy::dequantize_q5_1,
            TensorFormat::Q8_0 => legacy::dequantize_q8_0,
            TensorFormat::Q4_K => kquants::dequantize_q4_k,
            TensorFormat::Q5_K => kquants::dequantize_q5_k,
            TensorFormat::Q6_K => kquants::dequantize_q6_k,
        };
        for (block, out) in per_block {
            one(block, out);
        }
    }
}

impl std::fmt::Display for TensorFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The f16 at `bytes[0..2]`, widened.
#[inline]
pub(crate) fn f16_at(bytes: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32()
}
