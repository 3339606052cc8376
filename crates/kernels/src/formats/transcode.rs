//! Turning a tensor's blocks into a compute layout's blocks (GGUF Q4_1 or Q8_0 bytes), once,
//! at load.

use super::{kquants, legacy, Fidelity, Plan, TensorFormat};
use crate::{Error, Result, WeightFormat, BLOCK};
use half::f16;
use std::borrow::Cow;

/// A tensor's values as blocks of a compute layout, ready for `QuantMatrix::from_gguf_bytes`.
pub struct Transcoded<'a> {
    pub layout: WeightFormat,
    pub fidelity: Fidelity,
    /// Row-major blocks of `layout` (borrowed when the file's blocks are already that).
    pub bytes: Cow<'a, [u8]>,
}

/// The `rows × cols` values of `format` in `bytes` (row-major, whole blocks) as blocks of its
/// own compute layout ([`TensorFormat::plan`]). Never panics on a hostile file's bytes: a
/// wrong length is an error, and non-finite scales stay non-finite.
pub fn transcode(
    format: TensorFormat,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> Result<Transcoded<'_>> {
    // An empty matrix has no blocks to turn (and no row to step by).
    if rows == 0 || cols == 0 {
        return Err(Error::UnsupportedShape { rows, cols });
    }
    let expected = format
        .row_bytes(cols)
        .filter(|_| cols.is_multiple_of(BLOCK))
        .and_then(|row| row.checked_mul(rows))
        .ok_or(Error::NotWholeBlocks { format, cols })?;
    if bytes.len() != expected {
        return Err(Error::WrongTensorBytes {
            format,
            rows,
            cols,
            got: bytes.len(),
            expected,
        });
    }
    let done = |layout, fidelity, bytes| Transcoded {
        layout,
        fidelity,
        bytes,
    };
    let requantized = || {
        done(
            WeightFormat::Q8_0,
            Fidelity::Requantized,
            Cow::Owned(requantize(format, cols, bytes)),
        )
    };
    let owned = |layout, fidelity, bytes: Vec<u8>| done(layout, fidelity, Cow::Owned(bytes));
    Ok(match format.plan() {
        Plan::Native(layout) => done(layout, Fidelity::Exact, Cow::Borrowed(bytes)),
        Plan::Q4_0AsQ5_0 => owned(WeightFormat::Q5_0, Fidelity::Exact, q4_0_as_q5_0(bytes)),
        Plan::Q5_1AsQ8Offset => owned(
            WeightFormat::Q8Offset,
            Fidelity::Exact,
            q5_1_as_q8_offset(bytes),
        ),
        Plan::Q4_KAsQ4_1 => match q4_k_as_q4_1(bytes) {
            Some(q41) => owned(WeightFormat::Q4_1, Fidelity::RoundedScales, q41),
            None => requantized(),
        },
        Plan::Q5_KAsQ8Offset => match q5_k_as_q8_offset(bytes) {
            Some(blocks) => owned(WeightFormat::Q8Offset, Fidelity::RoundedScales, blocks),
            None => requantized(),
        },
        Plan::Requantize => requantized(),
    })
}

/// The layout matrices of `layouts` take to be stacked into one: their own when they share
/// one; Q8_0 when each is Q8_0 or Q5_0 (which Q8_0 holds exactly, and which has VNNI
/// kernels); else [`WeightFormat::Q8Offset`], which every layout reaches with its values.
pub fn stacking_layout(layouts: &[WeightFormat]) -> WeightFormat {
    match layouts {
        [first, rest @ ..] if rest.iter().all(|l| l == first) => *first,
        _ if layouts
            .iter()
            .all(|l| matches!(l, WeightFormat::Q5_0 | WeightFormat::Q8_0)) =>
        {
            WeightFormat::Q8_0
        }
        _ => WeightFormat::Q8Offset,
    }
}

/// `transcoded` in layout `target`, with the same values: any layout into Q8Offset, Q5_0
/// into Q8_0, or a layout into itself; `None` for any other pair.
pub fn into_layout(transcoded: Transcoded<'_>, target: WeightFormat) -> Option<Transcoded<'_>> {
    if transcoded.layout == target {
        return Some(transcoded);
    }
    let blocks = transcoded
        .bytes
        .chunks_exact(transcoded.layout.block_bytes());
    let bytes: Vec<u8> = match (transcoded.layout, target) {
        (WeightFormat::Q5_0, WeightFormat::Q8_0) => blocks
            .flat_map(|block| {
                let values = legacy::five_bit_values(&block[2..6], &block[6..22]);
                let mut out = [0u8; Q8_0_BYTES];
                out[0..2].copy_from_slice(&block[0..2]);
                for (dst, q) in out[2..].iter_mut().zip(values) {
                    *dst = (q as i8 - 16) as u8;
                }
                out
            })
            .collect(),
        (WeightFormat::Q4_1, WeightFormat::Q8Offset) => blocks
            .flat_map(|block| {
                let mut values = [0u8; 32];
                for (j, &byte) in block[4..20].iter().enumerate() {
                    (values[j], values[j + 16]) = (byte & 0x0F, byte >> 4);
                }
                q8_offset_block(&block[0..2], &block[2..4], values.map(|q| q as i8))
            })
            .collect(),
        (WeightFormat::Q5_0, WeightFormat::Q8Offset) => blocks
            .flat_map(|block| {
                let values = legacy::five_bit_values(&block[2..6], &block[6..22]);
                q8_offset_block(&block[0..2], &[0, 0], values.map(|q| q as i8 - 16))
            })
            .collect(),
        (WeightFormat::Q8_0, WeightFormat::Q8Offset) => blocks
            .flat_map(|block| {
                let values: [i8; 32] = std::array::from_fn(|j| block[2 + j] as i8);
                q8_offset_block(&block[0..2], &[0, 0], values)
            })
            .collect(),
        _ => return None,
    };
    Some(Transcoded {
        layout: target,
        fidelity: transcoded.fidelity,
        bytes: Cow::Owned(bytes),
    })
}

/// One Q8Offset block: f16 scale and offset bits, then 32 signed bytes.
fn q8_offset_block(d: &[u8], m: &[u8], values: [i8; 32]) -> [u8; Q8_OFFSET_BYTES] {
    let mut block = [0u8; Q8_OFFSET_BYTES];
    block[0..2].copy_from_slice(d);
    block[2..4].copy_from_slice(m);
    for (dst, q) in block[4..].iter_mut().zip(values) {
        *dst = q as u8;
    }
    block
}

/// Q5_1 blocks as Q8Offset blocks: the same scale and offset, the 5-bit values as bytes.
fn q5_1_as_q8_offset(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(24)
        .flat_map(|block| {
            let values = legacy::five_bit_values(&block[4..8], &block[8..24]);
            q8_offset_block(&block[0..2], &block[2..4], values.map(|q| q as i8))
        })
        .collect()
}

/// Q5_K super-blocks as eight Q8Offset blocks each (`d = f16(d·sc)`, `m = f16(−dmin·m)`), or
/// `None` where a rounded scale or min is not finite.
fn q5_k_as_q8_offset(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len() / 176 * 8 * Q8_OFFSET_BYTES);
    for block in bytes.chunks_exact(176) {
        for j in 0..8 {
            let (scale, min) = kquants::sub_block_scale_min(block, j);
            let (d, m) = (f16::from_f32(scale), f16::from_f32(-min));
            if !d.is_finite() || !m.is_finite() {
                return None;
            }
            let nibbles = kquants::sub_block_nibbles(&block[48..176], j);
            let values: [i8; 32] =
                std::array::from_fn(|l| (nibbles[l] | (((block[16 + l] >> j) & 1) << 4)) as i8);
            out.extend_from_slice(&q8_offset_block(&d.to_le_bytes(), &m.to_le_bytes(), values));
        }
    }
    Some(out)
}

const Q4_1_BYTES: usize = WeightFormat::Q4_1.block_bytes();
const Q5_0_BYTES: usize = WeightFormat::Q5_0.block_bytes();
const Q8_OFFSET_BYTES: usize = WeightFormat::Q8Offset.block_bytes();
const Q8_0_BYTES: usize = WeightFormat::Q8_0.block_bytes();

/// Q4_0 blocks as Q5_0 blocks: the same scale, values `q + 8` (so `q − 8 = (q + 8) − 16`).
fn q4_0_as_q5_0(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() / 18 * Q5_0_BYTES);
    for block in bytes.chunks_exact(18) {
        let nibbles = &block[2..18];
        let value = |j: usize| {
            let byte = nibbles[j % 16];
            (if j < 16 { byte & 0x0F } else { byte >> 4 }) + 8
        };
        let qh = (0..32).fold(0u32, |qh, j| qh | (((value(j) >> 4) as u32) << j));
        out.extend_from_slice(&block[0..2]);
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend((0..16).map(|j| (value(j) & 0x0F) | ((value(j + 16) & 0x0F) << 4)));
    }
    out
}

/// Q4_K super-blocks as eight Q4_1 blocks each (`d = f16(d·sc)`, `m = f16(−dmin·m)`), or
/// `None` where a rounded scale or min is not finite.
fn q4_k_as_q4_1(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(bytes.len() / 144 * 8 * Q4_1_BYTES);
    for block in bytes.chunks_exact(144) {
        for j in 0..8 {
            let (scale, min) = kquants::sub_block_scale_min(block, j);
            let (d, m) = (f16::from_f32(scale), f16::from_f32(-min));
            if !d.is_finite() || !m.is_finite() {
                return None;
            }
            out.extend_from_slice(&d.to_le_bytes());
            out.extend_from_slice(&m.to_le_bytes());
            let q = kquants::sub_block_nibbles(&block[16..144], j);
            out.extend((0..16).map(|l| q[l] | (q[l + 16] << 4)));
        }
    }
    Some(out)
}

/// Every value through f32 into Q8_0 blocks, a row at a time.
fn requantize(format: TensorFormat, cols: usize, bytes: &[u8]) -> Vec<u8> {
    let row_bytes = format.row_bytes(cols).expect("checked by transcode");
    let rows = bytes.len().checked_div(row_bytes).unwrap_or(0);
    let mut out = Vec::with_capacity(rows * cols / BLOCK * Q8_0_BYTES);
    let mut values = vec![0f32; cols];
    for row in bytes.chunks_exact(row_bytes) {
        format.dequantize(row, &mut values);
        for chunk in values.chunks_exact(BLOCK) {
            out.extend_from_slice(&quantize_q8_0_block(chunk));
        }
    }
    out
}

/// One Q8_0 block of 32 values: scale `f16(amax / 127)`, each value divided by that f16 scale
/// and rounded half away from zero (as ggml's `quantize_row_q8_0_ref` rounds), so it lies
/// within half a step of its value.
pub(super) fn quantize_q8_0_block(x: &[f32]) -> [u8; Q8_0_BYTES] {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / 127.0);
    let step = d.to_f32();
    let mut block = [0u8; Q8_0_BYTES];
    block[0..2].copy_from_slice(&d.to_le_bytes());
    for (q, &v) in block[2..].iter_mut().zip(x) {
        let scaled = if step == 0.0 { 0.0 } else { (v / step).round() };
        // NaN becomes 0; a subnormal step's overshoot is clamped.
        *q = scaled.clamp(-127.0, 127.0) as i8 as u8;
    }
    block
}
