//! ggml's 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (reference dequantizers,
//! each value computed as ggml's `dequantize_row_*` computes it).
//!
//! In every 4- and 5-bit format, byte j's low nibble is value j and its high nibble value
//! j + 16. The 5-bit formats keep each value's fifth bit in a 32-bit mask `qh`.

use super::f16_at;

/// `d` (f16), then 16 bytes of nibbles: `(q - 8) · d`.
pub(super) fn dequantize_q4_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block);
    for (j, &byte) in block[2..18].iter().enumerate() {
        out[j] = ((byte & 0x0F) as i32 - 8) as f32 * d;
        out[j + 16] = ((byte >> 4) as i32 - 8) as f32 * d;
    }
}

/// `d`, `m` (f16), then 16 bytes of nibbles: `q · d + m`.
pub(super) fn dequantize_q4_1(block: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(block), f16_at(&block[2..]));
    for (j, &byte) in block[4..20].iter().enumerate() {
        out[j] = (byte & 0x0F) as f32 * d + m;
        out[j + 16] = (byte >> 4) as f32 * d + m;
    }
}

/// The 5-bit values of a block: nibbles `qs` plus bit j of `qh` as value j's fifth bit.
pub(super) fn five_bit_values(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut values = [0u8; 32];
    for (j, &byte) in qs.iter().enumerate() {
        let high_low = (((qh >> j) & 1) << 4) as u8;
        let high_high = (((qh >> (j + 16)) & 1) << 4) as u8;
        values[j] = (byte & 0x0F) | high_low;
        values[j + 16] = (byte >> 4) | high_high;
    }
    values
}

/// `d` (f16), `qh` (4 bytes), 16 bytes of nibbles: `(q - 16) · d`.
pub(super) fn dequantize_q5_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block);
    for (o, q) in out
        .iter_mut()
        .zip(five_bit_values(&block[2..6], &block[6..22]))
    {
        *o = (q as i32 - 16) as f32 * d;
    }
}

/// `d`, `m` (f16), `qh` (4 bytes), 16 bytes of nibbles: `q · d + m`.
pub(super) fn dequantize_q5_1(block: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(block), f16_at(&block[2..]));
    for (o, q) in out
        .iter_mut()
        .zip(five_bit_values(&block[4..8], &block[8..24]))
    {
        *o = q as f32 * d + m;
    }
}

/// `d` (f16), then 32 signed bytes: `q · d`.
pub(super) fn dequantize_q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block);
    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
        *o = q as i8 as f32 * d;
    }
}
