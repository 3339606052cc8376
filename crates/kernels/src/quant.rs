//! Activation quantization: each row of f32 activations becomes blocks of 32 signed bytes with
//! one scale, the same scheme (and rounding) llama.cpp uses for its Q8_1/Q8_0 dot products, so
//! our integer dot products see the same numbers as the reference.

use half::f16;

/// Values per quantized block, for weights and activations alike.
pub const BLOCK: usize = 32;

/// One block of 32 quantized activations: `x[i] ≈ d * qs[i]`, `s = d * Σ qs` (needed by
/// Q4_1 weights, whose values carry an offset), and `qsum = Σ qs` exactly (needed where the
/// integer dot product biases the weights to unsigned bytes).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ActBlock {
    pub qs: [i8; BLOCK],
    pub d: f32,
    pub s: f32,
    pub qsum: i32,
}

// 32 quantized values and three 4-byte fields, no padding: kernels read `qs` as 32 bytes.
const _: () = assert!(std::mem::size_of::<ActBlock>() == BLOCK + 12);

/// A batch of activation rows, quantized: `rows` rows of `blocks_per_row` blocks.
#[derive(Clone, Debug, Default)]
pub struct QuantActs {
    rows: usize,
    blocks_per_row: usize,
    blocks: Vec<ActBlock>,
}

impl QuantActs {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.blocks_per_row * BLOCK
    }

    pub fn row(&self, row: usize) -> &[ActBlock] {
        &self.blocks[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }

    /// Shapes `self` for `rows` rows of `cols` values (a multiple of 32) and returns its
    /// blocks, `cols / 32` per row, each of which the caller must fill with
    /// [`quantize_blocks`] (they may hold an earlier batch's values until then; rows may be
    /// filled in parallel through `chunks_mut`). Reuses the allocation.
    pub fn reshape(&mut self, rows: usize, cols: usize) -> &mut [ActBlock] {
        assert_eq!(
            cols % BLOCK,
            0,
            "activation width must be a multiple of the block size"
        );
        self.rows = rows;
        self.blocks_per_row = cols / BLOCK;
        self.blocks
            .resize(rows * self.blocks_per_row, ActBlock::default());
        &mut self.blocks
    }
}

/// Quantizes `x` (`rows` rows of `cols` values, `cols` a multiple of 32) into `out`, reusing
/// its allocation.
pub fn quantize_acts(x: &[f32], rows: usize, cols: usize, out: &mut QuantActs) {
    assert_eq!(
        x.len(),
        rows * cols,
        "activation buffer must hold rows*cols values"
    );
    quantize_blocks(x, out.reshape(rows, cols));
}

/// Quantizes `x` into `out`, one block per 32 values (`x` may hold several rows).
pub fn quantize_blocks(x: &[f32], out: &mut [ActBlock]) {
    assert_eq!(x.len(), out.len() * BLOCK, "a block for every 32 values");
    #[cfg(target_arch = "x86_64")]
    if crate::backend::has_avx2() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above).
        unsafe { quantize_blocks_avx2(x, out) };
        return;
    }
    for (block, x) in out.iter_mut().zip(x.chunks_exact(BLOCK)) {
        *block = quantize_block(x);
    }
}

/// `quantize_acts` without SIMD: what the SIMD version must reproduce.
#[cfg(test)]
pub(crate) fn quantize_acts_portable(x: &[f32], cols: usize) -> Vec<ActBlock> {
    assert_eq!(cols % BLOCK, 0, "whole blocks");
    x.chunks_exact(BLOCK).map(quantize_block).collect()
}

/// `quantize_block` over every block, in AVX2: the same operations on the same values (abs-max,
/// `amax / 127`, `127 / amax`, multiply, round half to even), so the bytes and scales are
/// identical to the portable version's (tested), at a fraction of its cost.
///
/// # Safety
/// The CPU must support avx2, fma and f16c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], out: &mut [ActBlock]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // `packs` interleaves 128-bit lanes; this puts the 32 bytes back in order.
    let byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (chunk, block) in x.chunks_exact(BLOCK).zip(out) {
        let mut v = [_mm256_setzero_ps(); 4];
        for (i, v) in v.iter_mut().enumerate() {
            // SAFETY: `chunk` holds 32 floats: four unaligned loads of 8 stay inside it.
            *v = unsafe { _mm256_loadu_ps(chunk.as_ptr().add(8 * i)) };
        }
        let mut max = _mm256_and_ps(v[0], abs_mask);
        for value in &v[1..] {
            max = _mm256_max_ps(_mm256_and_ps(*value, abs_mask), max);
        }
        let max4 = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
        let max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        let amax = _mm_cvtss_f32(_mm_max_ss(max2, _mm_movehdup_ps(max2)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let mut q = [_mm256_setzero_si256(); 4];
        for (q, v) in q.iter_mut().zip(&v) {
            let scaled = _mm256_mul_ps(*v, id);
            *q = _mm256_cvtps_epi32(_mm256_round_ps(
                scaled,
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ));
        }
        let sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum8),
            _mm256_extracti128_si256(sum8, 1),
        );
        let sum2 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32(sum2, 1)));
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        // SAFETY: `qs` is 32 bytes, exactly one unaligned 256-bit store.
        unsafe {
            _mm256_storeu_si256(
                block.qs.as_mut_ptr() as *mut __m256i,
                _mm256_permutevar8x32_epi32(packed, byte_order),
            )
        };
        block.d = f16::from_f32(d).to_f32();
        block.s = f16::from_f32(d * sum as f32).to_f32();
        block.qsum = sum;
    }
}

#[inline(always)]
fn quantize_block(x: &[f32]) -> ActBlock {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut block = ActBlock::default();
    let mut sum = 0i32;
    for (q, v) in block.qs.iter_mut().zip(x) {
        // Ties to even, as the reference's SIMD path rounds.
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    // The reference stores both scales as f16; keep exactly those values.
    block.d = f16::from_f32(d).to_f32();
    block.s = f16::from_f32(d * sum as f32).to_f32();
    block.qsum = sum;
    block
}
