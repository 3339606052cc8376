//! The unquantized formats: one value per "block".

pub(super) fn dequantize_f32(block: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
}

pub(super) fn dequantize_f16(block: &[u8], out: &mut [f32]) {
    out[0] = super::f16_at(block);
}

/// bfloat16 is the high half of an f32.
pub(super) fn dequantize_bf16(block: &[u8], out: &mut [f32]) {
    out[0] = f32::from_bits((u16::from_le_bytes([block[0], block[1]]) as u32) << 16);
}
