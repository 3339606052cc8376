//! Activation quantization: each row of f32 activations becomes blocks of 32 signed bytes with
//! one scale, the same scheme (and rounding) llama.cpp uses for its Q8_1/Q8_0 dot products, so
//! our integer dot products see the same numbers as the reference.

use half::f16;

/// Values per quantized block, for weights and activations alike.
pub const BLOCK: usize = 32;

/// One block of 32 quantized activations: `x[i] ≈ d * qs[i]`, and `s = d * Σ qs` (needed by
/// Q4_1 weights, whose values carry an offset).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ActBlock {
    pub qs: [i8; BLOCK],
    pub d: f32,
    pub s: f32,
}

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
}

/// Quantizes `x` (`rows` rows of `cols` values, `cols` a multiple of 32) into `out`, reusing
/// its allocation.
pub fn quantize_acts(x: &[f32], rows: usize, cols: usize, out: &mut QuantActs) {
    assert_eq!(
        cols % BLOCK,
        0,
        "activation width must be a multiple of the block size"
    );
    assert_eq!(
        x.len(),
        rows * cols,
        "activation buffer must hold rows*cols values"
    );
    out.rows = rows;
    out.blocks_per_row = cols / BLOCK;
    out.blocks.clear();
    #[cfg(target_arch = "x86_64")]
    if crate::Backend::detect() == crate::Backend::Avx2 {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above).
        unsafe { quantize_blocks_avx2(x, &mut out.blocks) };
        return;
    }
    out.blocks.extend(x.chunks_exact(BLOCK).map(quantize_block));
}

/// The same code compiled with SSE4.1+ so rounding is one instruction, not a libm call.
///
/// # Safety
/// The CPU must support avx2, fma and f16c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(x: &[f32], out: &mut Vec<ActBlock>) {
    // A plain loop, not an iterator adapter: `quantize_block` must inline here, where the
    // target features apply, or rounding falls back to a libm call.
    for chunk in x.chunks_exact(BLOCK) {
        out.push(quantize_block(chunk));
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
    block
}
