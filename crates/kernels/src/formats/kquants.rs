//! ggml's k-quant formats of 256-value super-blocks: Q4_K, Q5_K and Q6_K (reference
//! dequantizers, each value computed as ggml's `dequantize_row_*` computes it).
//!
//! Q4_K and Q5_K split a super-block into eight sub-blocks of 32, each with a 6-bit scale and
//! a 6-bit min under the super-block's f16 `d` and `dmin`: `value = d·sc·q − dmin·m`. Q6_K
//! splits it into sixteen sub-blocks of 16 with signed 8-bit scales: `value = d·sc·(q − 32)`.

use super::f16_at;

/// Sub-block `j`'s 6-bit scale and min from Q4_K/Q5_K's 12 packed bytes: the first four
/// sub-blocks' in the low 6 bits of bytes 0–3 (scales) and 4–7 (mins); the last four's low
/// 4 bits in bytes 8–11 and high 2 bits in the top bits of bytes 0–7.
pub(super) fn scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Sub-block `j`'s scale `d·sc` and min `dmin·m` as ggml computes them (f32, exact: an f16
/// times a 6-bit integer).
pub(super) fn sub_block_scale_min(block: &[u8], j: usize) -> (f32, f32) {
    let (d, dmin) = (f16_at(block), f16_at(&block[2..]));
    let (sc, m) = scale_min(j, &block[4..16]);
    (d * sc as f32, dmin * m as f32)
}

/// Sub-block `j`'s 32 nibbles of a super-block's 128 bytes `qs`: the low nibbles of 32 bytes
/// for even `j`, the high ones of the same bytes for odd `j`.
pub(super) fn sub_block_nibbles(qs: &[u8], j: usize) -> [u8; 32] {
    let bytes = &qs[32 * (j / 2)..32 * (j / 2 + 1)];
    let shift = 4 * (j % 2);
    std::array::from_fn(|l| (bytes[l] >> shift) & 0x0F)
}

/// `d`, `dmin` (f16), 12 bytes of scales and mins, 128 bytes of nibbles.
pub(super) fn dequantize_q4_k(block: &[u8], out: &mut [f32]) {
    for (j, out) in out.chunks_exact_mut(32).enumerate() {
        let (scale, min) = sub_block_scale_min(block, j);
        for (o, q) in out.iter_mut().zip(sub_block_nibbles(&block[16..144], j)) {
            *o = scale * q as f32 - min;
        }
    }
}

/// `d`, `dmin` (f16), 12 bytes of scales and mins, 32 bytes of fifth bits (`qh`), 128 bytes
/// of nibbles: sub-block j's value l has its fifth bit at bit j of `qh[l]`.
pub(super) fn dequantize_q5_k(block: &[u8], out: &mut [f32]) {
    let qh = &block[16..48];
    for (j, out) in out.chunks_exact_mut(32).enumerate() {
        let (scale, min) = sub_block_scale_min(block, j);
        let nibbles = sub_block_nibbles(&block[48..176], j);
        for (l, (o, q)) in out.iter_mut().zip(nibbles).enumerate() {
            let high = ((qh[l] >> j) & 1) << 4;
            *o = scale * (q | high) as f32 - min;
        }
    }
}

/// 128 bytes of low nibbles (`ql`), 64 bytes of high 2-bit pairs (`qh`), 16 signed scales,
/// then `d` (f16). Each half of 128 values reads 64 bytes of `ql`, 32 of `qh` and 8 scales.
pub(super) fn dequantize_q6_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(&block[208..]);
    for (half, out) in out.chunks_exact_mut(128).enumerate() {
        let ql = &block[64 * half..64 * (half + 1)];
        let qh = &block[128 + 32 * half..128 + 32 * (half + 1)];
        let scales = &block[192 + 8 * half..192 + 8 * (half + 1)];
        for l in 0..32 {
            let sub = l / 16;
            let q = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (quarter, q) in q.into_iter().enumerate() {
                let scale = scales[sub + 2 * quarter] as i8 as f32;
                out[l + 32 * quarter] = d * scale * (q as i32 - 32) as f32;
            }
        }
    }
}
