//! Element-wise and small vector ops of the llama block. Their arithmetic follows llama.cpp's
//! CPU reference where it affects results (f64 sums in RMSNorm and softmax, f32 RoPE angles
//! built by repeated multiplication), so greedy decoding can match it token for token.

use crate::expf::{self, expf};
use crate::{avx2, scalar, Backend};
use half::f16;

/// `out = x / rms(x) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "norm weight matches the row width");
    assert_eq!(x.len(), out.len(), "norm output matches the row width");
    let sum_sq: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    scale_row(x, weight, eps, sum_sq, out);
}

/// [`rms_norm`] of each `weight.len()`-wide row of `x` into `out`, each row's bits those of
/// `rms_norm`. A row's f64 sum of squares is a chain of dependent adds in index order (the
/// reference's order, so its bits); here up to four rows' chains run side by side, so they
/// overlap instead of each waiting on add latency.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    assert!(
        width > 0 && x.len().is_multiple_of(width),
        "whole rows of the norm weight's width"
    );
    assert_eq!(x.len(), out.len(), "norm output matches the rows");
    let rows = x.len() / width;
    let mut first = 0;
    while first < rows {
        let count = (rows - first).min(SIDE_BY_SIDE);
        let x = &x[first * width..(first + count) * width];
        let sums = row_sums(x, width, |v| (v as f64) * (v as f64));
        let out = &mut out[first * width..(first + count) * width];
        for ((x, out), sum_sq) in x
            .chunks_exact(width)
            .zip(out.chunks_exact_mut(width))
            .zip(sums)
        {
            scale_row(x, weight, eps, sum_sq, out);
        }
        first += count;
    }
}

/// Rows whose f64 chains [`rms_norm_rows`] runs side by side.
const SIDE_BY_SIDE: usize = 4;

/// For each `width`-wide row of `x` (at most [`SIDE_BY_SIDE`] rows): Σ term(v) in f64, in
/// index order, the rows' chains of adds interleaved.
fn row_sums(x: &[f32], width: usize, term: impl Fn(f32) -> f64) -> [f64; SIDE_BY_SIDE] {
    match x.len() / width {
        4 => row_sums_of::<4>(x, width, term),
        3 => row_sums_of::<3>(x, width, term),
        2 => row_sums_of::<2>(x, width, term),
        _ => row_sums_of::<1>(x, width, term),
    }
}

/// `row_sums` for exactly N rows (a constant, so the inner loop unrolls).
fn row_sums_of<const N: usize>(
    x: &[f32],
    width: usize,
    term: impl Fn(f32) -> f64,
) -> [f64; SIDE_BY_SIDE] {
    assert!(N <= SIDE_BY_SIDE && x.len() == N * width, "N whole rows");
    let mut sums = [0f64; SIDE_BY_SIDE];
    for i in 0..width {
        for (r, sum) in sums.iter_mut().enumerate().take(N) {
            *sum += term(x[r * width + i]);
        }
    }
    sums
}

/// `out = x / rms · weight`, from the row's sum of squares.
fn scale_row(x: &[f32], weight: &[f32], eps: f32, sum_sq: f64, out: &mut [f32]) {
    let mean = (sum_sq / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// `acc += x`, the residual connection.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "residual operands have equal length");
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// `gate = silu(gate) * up`, the SwiGLU activation. Every backend gets the same bits.
pub fn silu_mul(backend: Backend, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up have equal length");
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512Vnni && crate::backend::has_avx512_vnni() {
        // SAFETY: the CPU has avx512f (checked); the lengths are equal.
        unsafe { expf::x86_512::silu_mul(gate, up) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if backend.uses_avx2() {
        // SAFETY: the backend runs only where the CPU has avx2 and fma; the lengths are equal.
        unsafe { expf::x86::silu_mul(gate, up) };
        return;
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + expf(-*g)) * u;
    }
}

/// `gate = gelu(gate) * up`, the GeGLU activation (Gemma's FFN), with GELU's tanh form read
/// from a table of every f16 input, as llama.cpp reads it (`ggml_vec_gelu_f32` with
/// `GGML_GELU_FP16`): the input rounded to f16, the table's f16 value, identity past 10 and
/// 0 below −10. The same bits on every backend.
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up have equal length");
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let gelu = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x
        } else {
            table[usize::from(f16::from_f32(x).to_bits())].to_f32()
        };
        *g = gelu * u;
    }
}

/// GELU (tanh form) of every f16 value, rounded to f16, indexed by the input's bits.
fn gelu_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

/// GELU's tanh form, as ggml writes it: `½x(1 + tanh(√(2/π)·x·(1 + 0.044715x²)))`.
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// Softmax in place; returns nothing, the row sums to 1 afterwards. Every backend gets the
/// same bits.
pub fn softmax_in_place(backend: Backend, x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    exp_shifted(backend, x, max);
    let sum = x.iter().fold(0f64, |sum, &v| sum + v as f64);
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Attention's softmax of each `len`-wide row of `rows` in place, each probability then
/// rounded to f16 (the reference multiplies them by V in f16). Every backend gets the same
/// bits: the row's max; `expf` of each score less it; the f64 sum of those in 16 lanes
/// (lane l adds the indices ≡ l mod 16 in order), folded as a tree (lanes l and l + 8, then
/// l + 4, l + 2, l + 1); each value times the f32 inverse of that sum. Unlike
/// [`softmax_in_place`]'s one chain of adds in index order, the lanes do not wait on each
/// other.
pub(crate) fn attention_softmax_rows(backend: Backend, rows: &mut [f32], len: usize) {
    assert!(
        len > 0 && rows.len().is_multiple_of(len),
        "whole rows of {len} values"
    );
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512Vnni && crate::backend::has_avx512_vnni() {
        for row in rows.chunks_exact_mut(len) {
            // SAFETY: the CPU has avx512f, bw, vl and f16c (checked just above).
            unsafe { crate::attention_avx512::softmax_row_to_f16(row) };
        }
        return;
    }
    for row in rows.chunks_exact_mut(len) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        exp_shifted(backend, row, max);
        let mut lanes = [0f64; 16];
        for chunk in row.chunks(16) {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                *lane += v as f64;
            }
        }
        let inv = (1.0 / fold_lanes(lanes)) as f32;
        for v in row.iter_mut() {
            *v *= inv;
        }
        crate::avx2::round_through_f16_in_place(row);
    }
}

/// The tree [`attention_softmax_rows`] folds its 16 lane sums by.
pub(crate) fn fold_lanes(mut lanes: [f64; 16]) -> f64 {
    for half in [8, 4, 2, 1] {
        for i in 0..half {
            lanes[i] += lanes[i + half];
        }
    }
    lanes[0]
}

/// `x[i] = e^(x[i] − shift)`.
fn exp_shifted(backend: Backend, x: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512Vnni && crate::backend::has_avx512_vnni() {
        // SAFETY: the CPU has avx512f (checked).
        unsafe { expf::x86_512::exp_shifted(x, shift) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if backend.uses_avx2() {
        // SAFETY: the backend runs only where the CPU has avx2 and fma.
        unsafe { expf::x86::exp_shifted(x, shift) };
        return;
    }
    for v in x.iter_mut() {
        *v = expf(*v - shift);
    }
}

/// `scores[i] = scale * (q · key_i)` for the first `scores.len()` keys of one head's keys of
/// a page of `page_size` slots, held dimension-major (`attention::key_index`; f16, the KV
/// cache's element type), `scores.len()` being the page's written slots. Each dot product is
/// `attention::score_dot`, the arithmetic of every SIMD attention kernel, so the bits are
/// theirs on every backend.
pub fn attention_scores_f16(
    q: &[f32],
    keys: &[f16],
    page_size: usize,
    scale: f32,
    scores: &mut [f32],
) {
    assert!(
        scores.len() <= page_size && keys.len() >= page_size * q.len(),
        "a key for every score, in a whole page"
    );
    // `mul_add` rounds once whatever the CPU (so no backend to choose): the hardware
    // instruction only makes it fast.
    #[cfg(target_arch = "x86_64")]
    if crate::backend::has_avx2() {
        #[target_feature(enable = "fma,f16c")]
        unsafe fn fused(q: &[f32], keys: &[f16], page_size: usize, scale: f32, out: &mut [f32]) {
            scores_in_lanes(q, keys, page_size, scale, out)
        }
        // SAFETY: the CPU has fma and f16c (checked just above).
        unsafe { fused(q, keys, page_size, scale, scores) };
        return;
    }
    scores_in_lanes(q, keys, page_size, scale, scores)
}

#[inline(always)]
fn scores_in_lanes(q: &[f32], keys: &[f16], page_size: usize, scale: f32, out: &mut [f32]) {
    let written = out.len();
    for (slot, score) in out.iter_mut().enumerate() {
        let key = |d| keys[crate::attention::key_index(page_size, slot, d)].to_f32();
        let fold = crate::attention::Fold::of_slot(slot, written);
        *score = crate::attention::score_dot(q, key, fold) * scale;
    }
}

/// `out += Σ_i weights[i] * values[i]` for `out.len()`-wide values (f16); each weight is
/// rounded to f16 first, as the reference multiplies probabilities by V in f16.
pub fn attention_mix_f16(backend: Backend, weights: &[f32], values: &[f16], out: &mut [f32]) {
    assert!(
        values.len() >= weights.len() * out.len(),
        "a value for every weight"
    );
    match backend {
        Backend::Scalar | Backend::GgmlExact | Backend::GgmlExactAvx2 => {
            for (&weight, value) in weights.iter().zip(values.chunks_exact(out.len())) {
                scalar::axpy_f16(out, f16::from_f32(weight).to_f32(), value);
            }
        }
        Backend::Avx2 | Backend::Avx512Vnni => avx2::mix_f16(weights, values, out),
    }
}

/// Which of a head's values RoPE rotates together. llama.cpp calls these "normal" and "neox";
/// the model's architecture decides (GGUF files of llama have their Q/K rows permuted for
/// adjacent pairs, qwen2, qwen3 and gemma3 keep the halves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pair i is values (2i, 2i + 1).
    Adjacent,
    /// Pair i is values (i, i + head_dim / 2).
    Halves,
}

/// Precomputed rotary-embedding angles for positions `0..positions`.
pub struct RopeTable {
    head_dim: usize,
    positions: usize,
    style: RopeStyle,
    /// `[pos][pair] -> (cos, sin)`.
    cos_sin: Vec<(f32, f32)>,
}

impl RopeTable {
    /// Adjacent pairs, no frequency factors (llama's).
    pub fn new(head_dim: usize, freq_base: f32, positions: usize) -> RopeTable {
        RopeTable::with_freq_factors(head_dim, freq_base, positions, &[])
    }

    /// As `new`, with pair i's angle divided by `factors[i]` (a GGUF's `rope_freqs.weight`:
    /// Llama 3's frequency scaling), as llama.cpp divides it; no factors, no division.
    pub fn with_freq_factors(
        head_dim: usize,
        freq_base: f32,
        positions: usize,
        factors: &[f32],
    ) -> RopeTable {
        assert!(head_dim.is_multiple_of(2), "rotary dimension is even");
        let pairs = head_dim / 2;
        assert!(
            factors.is_empty() || factors.len() == pairs,
            "one frequency factor per rotary pair"
        );
        let theta_scale = freq_base.powf(-2.0 / head_dim as f32);
        let mut cos_sin = Vec::with_capacity(positions * pairs);
        for pos in 0..positions {
            let mut theta = pos as f32;
            for pair in 0..pairs {
                let angle = factors.get(pair).map_or(theta, |factor| theta / factor);
                cos_sin.push((angle.cos(), angle.sin()));
                theta *= theta_scale;
            }
        }
        RopeTable {
            head_dim,
            positions,
            style: RopeStyle::Adjacent,
            cos_sin,
        }
    }

    /// The same angles, rotating pairs of `style`.
    pub fn with_style(self, style: RopeStyle) -> RopeTable {
        RopeTable { style, ..self }
    }

    pub fn positions(&self) -> usize {
        self.positions
    }

    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// Rotates every head in `x` (a whole number of heads) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        rope_in_place(self, x, pos)
    }

    /// `apply` with another rotation of one pair `(x0, x1)` by `(cos, sin)`, which returns
    /// the rotated pair.
    #[inline]
    pub fn apply_with(
        &self,
        x: &mut [f32],
        pos: usize,
        rotate: impl Fn(f32, f32, f32, f32) -> (f32, f32),
    ) {
        assert!(pos < self.positions, "position within the rope table");
        assert_eq!(x.len() % self.head_dim, 0, "a whole number of heads");
        let pairs = self.head_dim / 2;
        let angles = &self.cos_sin[pos * pairs..(pos + 1) * pairs];
        for head in x.chunks_exact_mut(self.head_dim) {
            match self.style {
                RopeStyle::Adjacent => {
                    for (pair, &(cos, sin)) in head.chunks_exact_mut(2).zip(angles) {
                        (pair[0], pair[1]) = rotate(pair[0], pair[1], cos, sin);
                    }
                }
                RopeStyle::Halves => {
                    let (firsts, seconds) = head.split_at_mut(pairs);
                    for ((x0, x1), &(cos, sin)) in firsts.iter_mut().zip(seconds).zip(angles) {
                        (*x0, *x1) = rotate(*x0, *x1, cos, sin);
                    }
                }
            }
        }
    }
}

/// Rotates every `head_dim`-wide head of `x` by the angles of position `pos`.
pub fn rope_in_place(table: &RopeTable, x: &mut [f32], pos: usize) {
    table.apply_with(x, pos, |x0, x1, cos, sin| {
        (x0 * cos - x1 * sin, x0 * sin + x1 * cos)
    })
}
