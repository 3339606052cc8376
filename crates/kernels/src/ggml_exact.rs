//! llama.cpp's CPU arithmetic, reproduced operation for operation in portable Rust, so that
//! our logits equal those of a llama.cpp build bit for bit (`--kernels ggml-exact`).
//!
//! Greedy decoding is chaotic at near-ties: a one-ulp difference anywhere (a different
//! summation order, a fused multiply-add where the reference rounds twice, another `expf`)
//! can flip one activation's 8-bit rounding and, some tokens later, the chosen token. The fast
//! backends keep their own summation order; this one follows, for every operation on the road
//! from token to logits, what ggml 0.3.36 (as vendored by `llama-cpp-python` 0.3.36) computes
//! when built with GCC for an AVX-512 CPU (`GGML_NATIVE`), flash attention off, f16 KV cache,
//! or for an AVX2 CPU ([`Build`]; the rows below marked 16 lanes have 8 there):
//!
//! | operation | ggml code | what is reproduced |
//! |---|---|---|
//! | Q4_1 × Q8_1 | `ggml_vec_dot_q4_1_q8_1` (AVX2 path) | eight 4-product lanes per block, one FMA per block and lane, `hsum_float_8`, then the offset sum (f16 × f16: exact, fused or not) |
//! | Q8_0 × Q8_0 | `ggml_vec_dot_q8_0_q8_0` (AVX2 path) | the same lanes without offset |
//! | RMSNorm | `ggml_compute_forward_rms_norm_f32` | f32 squares summed in f64 |
//! | RoPE | `rotate_pairs` as GCC contracts it | `x0·cos − x1·sin` with the first product fused |
//! | K·Q, p·V, prompt | `llamafile_sgemm` (tinyBLAS, 16 lanes) | one 16-lane FMA accumulator, `_mm512_reduce_add_ps` |
//! | K·Q, p·V, one token | `ggml_vec_dot_f16` | four 16-lane accumulators, folded 0+2, 1+3, then 0+1 (AVX2: then `hadd` twice) |
//! | softmax | `ggml_vec_soft_max_f32` | `ggml_v_expf` (the build's own), 16-wide partial sums added in f64 |
//! | SwiGLU | `ggml_vec_swiglu_f32` | `ggml_v_silu` (the build's own) times up |
//!
//! Everything here is elementwise emulation of those lanes: slower than the fast backends (for
//! tests and for checking a model port), never used unless asked for. Bit-equality holds for a
//! sequence evaluated on its own, as the reference runs are: when llama.cpp batches several
//! sequences, where their cells sit in its shared cache decides the attention lanes, which a
//! paged engine does not reproduce (and does not need to).

use crate::layout::{GroupJob, Q41GroupBlock, Q80GroupBlock, GROUP_ROWS, Q41_LANE_ROW};
use crate::scalar::{f16_to_f32, q41_lane, q41_row_nibbles};
use crate::ActBlock;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Runs `body` (an expression calling `#[inline(always)]` code) compiled with FMA enabled
/// where the CPU has it: `f32::mul_add` is then one instruction instead of a call to libm's
/// `fmaf`. Both give the same, correctly rounded, result.
macro_rules! with_fma {
    ($body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "fma")]
            #[inline]
            unsafe fn fused<R>(run: impl FnOnce() -> R) -> R {
                run()
            }
            if std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports FMA (checked just above), the only feature `fused`
                // is compiled with.
                unsafe { fused(|| $body) }
            } else {
                $body
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $body
        }
    }};
}

/// Which llama.cpp CPU build to reproduce: they differ in vector width (the attention lanes
/// and softmax sums), in `ggml_v_expf` and in one reduction; everything else is shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    /// AVX-512 (F, DQ): 16-lane registers.
    Avx512,
    /// AVX2, FMA and F16C without AVX-512: 8-lane registers.
    Avx2,
}

impl Build {
    /// f32 lanes in one vector register.
    #[inline(always)]
    fn lanes(self) -> usize {
        match self {
            Build::Avx512 => 16,
            Build::Avx2 => 8,
        }
    }

    /// One register's lanes summed as tinyBLAS's `hsum` and the softmax sum do.
    #[inline(always)]
    fn hsum(self, v: &[f32]) -> f32 {
        match self {
            Build::Avx512 => reduce_add_16(v.try_into().expect("16 lanes")),
            Build::Avx2 => hsum_float_8(v.try_into().expect("8 lanes")),
        }
    }

    /// The last step of `ggml_vec_dot_f16`'s `GGML_F32xN_REDUCE`, over one register.
    #[inline(always)]
    fn reduce_dot(self, v: &[f32]) -> f32 {
        match self {
            Build::Avx512 => reduce_add_16(v.try_into().expect("16 lanes")),
            Build::Avx2 => {
                // Halves added, then `_mm_hadd_ps` twice.
                let t: [f32; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
                (t[0] + t[1]) + (t[2] + t[3])
            }
        }
    }

    /// One lane of the build's `ggml_v_expf`.
    #[inline(always)]
    fn expf(self, x: f32) -> f32 {
        match self {
            Build::Avx512 => expf(x),
            Build::Avx2 => expf_avx2(x),
        }
    }
}

/// `_mm512_reduce_add_ps` as GCC defines it: halves, then quarters, then pairs.
#[inline(always)]
fn reduce_add_16(v: &[f32; 16]) -> f32 {
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = v[i + 8] + v[i];
    }
    let mut t4 = [0f32; 4];
    for i in 0..4 {
        t4[i] = t8[i + 4] + t8[i];
    }
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// `hsum_float_8` of ggml's x86 quant kernels: the same tree over eight lanes.
#[inline(always)]
fn hsum_float_8(v: &[f32; 8]) -> f32 {
    let t4 = [v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]];
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// One lane of ggml's AVX-512 `ggml_v_expf` (a polynomial after Arm's optimized routines;
/// within 1.5 ulp of `expf`, not equal to it).
#[inline(always)]
fn expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000); // 0x1.8p23: adding it rounds to an integer
    let z = x.mul_add(c(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x)); // ln 2, low and high
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // `_mm512_scalef_ps(j, n)`: j·2^n, rounded once (f64 holds the exact product; n is an
    // integer within ±192 here, so 2^n is an exact f64 built from its exponent bits).
    let power = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * power) as f32
}

/// One lane of ggml's AVX2 `ggml_v_expf`: the same reduction and polynomial as the AVX-512
/// one but for its last term, with 2^n built from exponent bits and scaled in two steps
/// where it leaves the normal range.
#[inline(always)]
fn expf_avx2(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000);
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    // The vector compare is false for NaN, which takes this (the common) path.
    let outside_normal = n.abs() > 126.0;
    if !outside_normal {
        return k.mul_add(j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    if n.abs() > 192.0 {
        return s1 * s1;
    }
    let s2 = f32::from_bits(e.wrapping_sub(g));
    s2.mul_add(j, s2) * s1
}

/// `gate = silu(gate) * up` as `ggml_vec_swiglu_f32` computes it (`ggml_v_silu`:
/// `x / (1 + exp(0 - x))` with the build's `ggml_v_expf`).
pub fn silu_mul(build: Build, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up have equal length");
    with_fma!(silu_mul_body(build, gate, up))
}

#[inline(always)]
fn silu_mul_body(build: Build, gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + build.expf(0.0 - *g)) * u;
    }
}

/// `out = x / rms(x) * weight`: f32 squares summed in f64, as `rms_norm_f32` does.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "norm weight matches the row width");
    assert_eq!(x.len(), out.len(), "norm output matches the row width");
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// Rotates every head of `x` for position `pos` as GCC compiles ggml's `rotate_pairs`.
pub fn rope(table: &crate::RopeTable, x: &mut [f32], pos: usize) {
    with_fma!(table.apply_with(x, pos, rotate_pair))
}

/// One pair: the first product of each expression fused into the subtraction or addition.
#[inline(always)]
fn rotate_pair(x0: f32, x1: f32, cos: f32, sin: f32) -> (f32, f32) {
    (x0.mul_add(cos, -(x1 * sin)), x0.mul_add(sin, x1 * cos))
}

/// The 4-product integer sums of one block, in the eight lanes `mul_sum_*_pairs_float` gives.
#[inline(always)]
fn lane_sums(weight: impl Fn(usize) -> i32, acts: &[i8; 32]) -> [f32; 8] {
    let mut sums = [0f32; 8];
    for (lane, sum) in sums.iter_mut().enumerate() {
        let s: i32 = (4 * lane..4 * lane + 4)
            .map(|e| weight(e) * acts[e] as i32)
            .sum();
        *sum = s as f32;
    }
    sums
}

/// Q4_1 weights × Q8_1 activations, 8 rows × the job's tokens.
pub(crate) fn q41_group(group: &[Q41GroupBlock], job: GroupJob) {
    #[cfg(target_arch = "x86_64")]
    if crate::backend::has_avx2() {
        // SAFETY: `has_avx2` checked avx2, fma and f16c, the features the kernel needs.
        return unsafe { q41_group_avx2(group, job) };
    }
    q41_group_portable(group, job)
}

// The AVX2 kernel loads a block's activations as one 32-byte register.
const _: () = assert!(crate::BLOCK == 32);

/// `q41_group` in AVX2: the very lanes ggml's AVX2 kernel has (`maddubs` then `madd` gives
/// the eight 4-product sums), so the floats are the portable version's (tested).
///
/// # Safety
/// The CPU must support avx2, fma and f16c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q41_group_avx2(group: &[Q41GroupBlock], mut job: GroupJob) {
    use std::arch::x86_64::*;
    job.check(group.len(), GROUP_ROWS);
    let (acts, tokens) = (job.acts, job.tokens.clone());
    let low_nibbles = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
        for token in tokens.clone() {
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0f32;
            for (w, a) in group.iter().zip(acts.row(token)) {
                summs = f16_to_f32(w.m[lane]).mul_add(a.s, summs);
                let d = _mm256_set1_ps(f16_to_f32(w.d[lane]) * a.d);
                let nibbles = q41_row_nibbles(w, row);
                // SAFETY: `nibbles` is 16 bytes and `a.qs` 32: one unaligned load each.
                let (packed, qy) = unsafe {
                    (
                        _mm_loadu_si128(nibbles.as_ptr() as *const __m128i),
                        _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i),
                    )
                };
                // Elements 0..16 are the low nibbles, 16..32 the high ones.
                let qx = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                    low_nibbles,
                );
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), ones);
                acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc);
            }
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            job.put(token, row, hsum_float_8(&lanes) + summs);
        }
    }
}

/// `q41_group` without SIMD: what the AVX2 version must reproduce.
pub(crate) fn q41_group_portable(group: &[Q41GroupBlock], job: GroupJob) {
    with_fma!(q41_group_body(group, job))
}

/// The loop both exact quant kernels share: for each of the group's 8 rows and each token,
/// `block` folds one 32-column block into the row's eight lanes and its offset sum; the
/// result is `hsum_float_8(lanes) + offset`, as ggml's AVX2 kernels end.
#[inline(always)]
fn group_dot_products<B>(
    group: &[B],
    mut job: GroupJob,
    initial_offset: f32,
    block: impl Fn(&B, usize, &ActBlock, &mut [f32; 8], &mut f32),
) {
    job.check(group.len(), GROUP_ROWS);
    let (acts, tokens) = (job.acts, job.tokens.clone());
    for row in 0..GROUP_ROWS {
        for token in tokens.clone() {
            let (mut acc, mut offset) = ([0f32; 8], initial_offset);
            for (w, a) in group.iter().zip(acts.row(token)) {
                block(w, row, a, &mut acc, &mut offset);
            }
            job.put(token, row, hsum_float_8(&acc) + offset);
        }
    }
}

#[inline(always)]
fn q41_group_body(group: &[Q41GroupBlock], job: GroupJob) {
    let lanes: [usize; GROUP_ROWS] = std::array::from_fn(q41_lane);
    // ggml's `summs` starts at 0.
    group_dot_products(group, job, 0.0, |w, row, a, acc, summs| {
        let lane = lanes[row];
        let nibbles = q41_row_nibbles(w, row);
        let nibble = |e: usize| {
            if e < 16 {
                (nibbles[e] & 0x0F) as i32
            } else {
                (nibbles[e - 16] >> 4) as i32
            }
        };
        *summs = f16_to_f32(w.m[lane]).mul_add(a.s, *summs);
        let d = f16_to_f32(w.d[lane]) * a.d;
        for (acc, sum) in acc.iter_mut().zip(lane_sums(nibble, &a.qs)) {
            *acc = d.mul_add(sum, *acc);
        }
    })
}

/// Q8_0 weights × Q8_0 activations, 8 rows × the job's tokens.
pub(crate) fn q80_group(group: &[Q80GroupBlock], job: GroupJob) {
    with_fma!(q80_group_body(group, job))
}

#[inline(always)]
fn q80_group_body(group: &[Q80GroupBlock], job: GroupJob) {
    // No offset term: -0.0 is the one value whose addition changes no float, not even ±0.
    group_dot_products(group, job, -0.0, |w, row, a, acc, _| {
        let weights = &w.qs[row * 32..(row + 1) * 32];
        let d = f16_to_f32(w.d[row]) * a.d;
        for (acc, sum) in acc.iter_mut().zip(lane_sums(|e| weights[e] as i32, &a.qs)) {
            *acc = d.mul_add(sum, *acc);
        }
    })
}

/// Which f16 dot product llama.cpp uses for attention: tinyBLAS when the batch holds two or
/// more tokens (the prompt), `ggml_vec_dot_f16` for a single token (decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DotKind {
    Gemm,
    Vector,
}

/// Folds `ggml_vec_dot_f16`'s four accumulators as `GGML_F32xN_REDUCE` does: 0+2 and 1+3,
/// then 0+1, then across the lanes of the one register left.
#[inline(always)]
fn fold_4(build: Build, acc: &[[f32; 16]; 4]) -> f32 {
    let w = build.lanes();
    let [mut a0, mut a1, a2, a3] = *acc;
    for lane in 0..w {
        a0[lane] += a2[lane];
        a1[lane] += a3[lane];
    }
    for lane in 0..w {
        a0[lane] += a1[lane];
    }
    build.reduce_dot(&a0[..w])
}

/// `x · y` as llama.cpp's f16 dot product of `kind` sums it (inputs already widened to f32).
#[inline(always)]
fn dot(build: Build, kind: DotKind, x: &[f32], y: &[f32]) -> f32 {
    let w = build.lanes();
    match kind {
        DotKind::Gemm => {
            assert!(
                x.len().is_multiple_of(w),
                "tinyBLAS needs whole register steps"
            );
            let mut acc = [0f32; 16];
            for (x, y) in x.chunks_exact(w).zip(y.chunks_exact(w)) {
                for lane in 0..w {
                    acc[lane] = x[lane].mul_add(y[lane], acc[lane]);
                }
            }
            build.hsum(&acc[..w])
        }
        DotKind::Vector => {
            let step = 4 * w;
            let whole = x.len() - x.len() % step;
            let mut acc = [[0f32; 16]; 4];
            for (x, y) in x[..whole]
                .chunks_exact(step)
                .zip(y[..whole].chunks_exact(step))
            {
                let registers = x.chunks_exact(w).zip(y.chunks_exact(w));
                for (acc, (x, y)) in acc.iter_mut().zip(registers) {
                    for (lane, acc) in acc[..w].iter_mut().enumerate() {
                        *acc = x[lane].mul_add(y[lane], *acc);
                    }
                }
            }
            let mut sum = fold_4(build, &acc) as f64;
            for (x, y) in x[whole..].iter().zip(&y[whole..]) {
                sum += (x * y) as f64;
            }
            sum as f32
        }
    }
}

/// One query head's attention over `len` positions of K/V held in pages of `page_size`
/// positions (`keys[p]`, `values[p]`: that page's slots for this head, keys dimension-major
/// and values slot-major as `KvHeadAttention` holds them), as llama.cpp computes it without flash attention: Q rounded to f16, `K·Q`, scaled
/// softmax, probabilities rounded to f16, `V·p`.
pub struct HeadAttention<'a> {
    pub keys: &'a [&'a [f16]],
    pub values: &'a [&'a [f16]],
    pub page_size: usize,
    pub head_dim: usize,
    pub len: usize,
    pub scale: f32,
    pub kind: DotKind,
    pub build: Build,
}

impl HeadAttention<'_> {
    /// The value at position `pos` (values are slot-major).
    #[inline(always)]
    fn value_slot(&self, pos: usize) -> &[f16] {
        let (page, slot) = (pos / self.page_size, pos % self.page_size);
        &self.values[page][slot * self.head_dim..][..self.head_dim]
    }

    /// Writes the head's output (`head_dim` values) for query `q`.
    pub fn run(&self, q: &[f32], out: &mut [f32]) {
        with_fma!(self.run_body(q, out))
    }

    #[inline(always)]
    fn run_body(&self, q: &[f32], out: &mut [f32]) {
        assert_eq!(q.len(), self.head_dim, "one query head");
        assert_eq!(out.len(), self.head_dim, "one output head");
        let mut probs = self.scores(q);
        self.softmax_to_f16(&mut probs);
        self.mix(&probs, out);
    }

    /// `scale · (K·q)` for every position, Q rounded to f16 first (ggml converts it to the
    /// cache's type). Zero-padded to a whole register.
    #[inline(always)]
    fn scores(&self, q: &[f32]) -> Vec<f32> {
        let w = self.build.lanes();
        let q16: Vec<f32> = q.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        // tinyBLAS declines a head size that is not a whole number of registers; ggml then
        // uses `ggml_vec_dot_f16`.
        let kind = if self.head_dim.is_multiple_of(w) {
            self.kind
        } else {
            DotKind::Vector
        };
        let mut key = vec![0f32; self.head_dim];
        let mut scores = vec![0f32; self.len.div_ceil(w) * w];
        for (pos, score) in scores[..self.len].iter_mut().enumerate() {
            let (page, slot) = (pos / self.page_size, pos % self.page_size);
            crate::attention::load_key(self.keys[page], self.page_size, slot, &mut key);
            *score = dot(self.build, kind, &key, &q16) * self.scale;
        }
        scores
    }

    /// Softmax over the first `len` scores, then each probability rounded to f16 (ggml
    /// converts them to the cache's type for V·p).
    #[inline(always)]
    fn softmax_to_f16(&self, probs: &mut [f32]) {
        let build = self.build;
        let max = probs[..self.len]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for p in &mut probs[..self.len] {
            *p = build.expf(*p - max);
        }
        // Masked positions up to the next whole register are exp(-inf) = 0 in llama.cpp.
        let sum: f64 = probs
            .chunks_exact(build.lanes())
            .map(|chunk| build.hsum(chunk) as f64)
            .sum();
        let inv = (1.0 / sum) as f32;
        for p in &mut probs[..self.len] {
            *p = f16::from_f32(*p * inv).to_f32();
        }
    }

    /// `out[d] = V[·][d] · p`: one dot product over positions per output value, in `kind`'s
    /// lanes, computed for all values at once (`acc[register][lane][value]`). llama.cpp runs
    /// it over its cache length, a multiple of 256 (so of every register step); positions
    /// past `len` have zero probability and would leave every lane as it is
    /// (`acc + ±0 == acc`), so they are skipped.
    #[inline(always)]
    fn mix(&self, probs: &[f32], out: &mut [f32]) {
        let (head_dim, build, w) = (self.head_dim, self.build, self.build.lanes());
        let registers = match self.kind {
            DotKind::Gemm => 1,
            DotKind::Vector => 4,
        };
        let mut acc = vec![0f32; registers * w * head_dim];
        let mut value = vec![0f32; head_dim];
        for (pos, &p) in probs[..self.len].iter().enumerate() {
            self.value_slot(pos).convert_to_f32_slice(&mut value);
            let register = match self.kind {
                DotKind::Gemm => 0,
                DotKind::Vector => (pos % (4 * w)) / w,
            };
            let row = &mut acc[(register * w + pos % w) * head_dim..][..head_dim];
            for (a, &v) in row.iter_mut().zip(&value) {
                *a = v.mul_add(p, *a);
            }
        }
        let lanes = |register: usize, d: usize| -> [f32; 16] {
            std::array::from_fn(|lane| {
                if lane < w {
                    acc[(register * w + lane) * head_dim + d]
                } else {
                    0.0
                }
            })
        };
        for (d, o) in out.iter_mut().enumerate() {
            *o = match self.kind {
                DotKind::Gemm => build.hsum(&lanes(0, d)[..w]),
                DotKind::Vector => fold_4(build, &std::array::from_fn(|r| lanes(r, d))),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `expf` within 4 ulp of libm's over -86..86 (the normal range of results).
    fn assert_close_to_libm(expf: fn(f32) -> f32) {
        for i in -2000..=2000 {
            let x = i as f32 * 0.043;
            let (ours, libm) = (expf(x), x.exp());
            assert!(
                ((ours - libm) / libm).abs() < 4.0 * f32::EPSILON,
                "expf({x}) = {ours}, libm {libm}"
            );
        }
    }

    #[test]
    fn expf_is_close_to_libm_and_saturates_like_ggml() {
        assert_close_to_libm(expf);
        // The polynomial, not libm: they part somewhere in this range.
        assert!((-2000..2000).any(|i| {
            let x = i as f32 * 0.011;
            expf(x) != x.exp()
        }));
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
        assert_eq!(expf(0.0), 1.0);
    }

    #[test]
    fn avx2_expf_is_close_to_libm_including_its_two_step_scaling() {
        assert_close_to_libm(expf_avx2);
        // 126 < |n| <= 192: the scaled path; below 2^-126 the results are subnormal.
        for x in [-88.5f32, -90.0, -95.0, 88.5] {
            let (ours, libm) = (expf_avx2(x), x.exp());
            assert!(
                ((ours - libm) / libm).abs() < 1.0e-5,
                "expf_avx2({x}) = {ours}, libm {libm}"
            );
        }
        assert_eq!(expf_avx2(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf_avx2(-200.0), 0.0);
        assert_eq!(expf_avx2(200.0), f32::INFINITY);
        assert_eq!(expf_avx2(0.0), 1.0);
        // The two builds' polynomials are not the same function.
        assert!((-2000..2000).any(|i| {
            let x = i as f32 * 0.011;
            expf(x) != expf_avx2(x)
        }));
    }

    /// A head size that is not a whole number of registers takes ggml's fallback dot
    /// product for K·q instead of failing, on either build, prompt or decode.
    #[test]
    fn attention_takes_any_head_size() {
        let head_dim = 24;
        let page_size = 4;
        let len = 7;
        let keys_data: Vec<f16> = (0..8 * head_dim)
            .map(|i| f16::from_f32((i % 13) as f32 * 0.1 - 0.6))
            .collect();
        let values_data: Vec<f16> = (0..8 * head_dim)
            .map(|i| f16::from_f32((i % 7) as f32 * 0.2 - 0.5))
            .collect();
        let pages: Vec<&[f16]> = keys_data.chunks(page_size * head_dim).collect();
        let value_pages: Vec<&[f16]> = values_data.chunks(page_size * head_dim).collect();
        let q: Vec<f32> = (0..head_dim).map(|i| (i as f32 * 0.37).sin()).collect();
        for build in [Build::Avx512, Build::Avx2] {
            for kind in [DotKind::Gemm, DotKind::Vector] {
                let attention = HeadAttention {
                    keys: &pages,
                    values: &value_pages,
                    page_size,
                    head_dim,
                    len,
                    scale: 0.2,
                    kind,
                    build,
                };
                let mut out = vec![0f32; head_dim];
                attention.run(&q, &mut out);
                // Each output is a convex mix of the values in -0.5..=0.7.
                assert!(out.iter().all(|v| (-0.51..=0.71).contains(v)), "{out:?}");
            }
        }
    }

    #[test]
    fn reductions_follow_the_lane_tree() {
        // 1e8 + 1 - 1e8 depends on the order of the adds: the tree pairs lane 0 with lane 8.
        let mut v = [0f32; 16];
        v[0] = 1.0e8;
        v[8] = -1.0e8;
        v[1] = 1.0;
        assert_eq!(reduce_add_16(&v), 1.0);
        v[8] = 0.0;
        v[4] = -1.0e8;
        assert_eq!(reduce_add_16(&v), 1.0);
        v[4] = 0.0;
        v[2] = -1.0e8;
        // lanes 0 and 2 meet before lane 1 joins.
        assert_eq!(reduce_add_16(&v), 1.0);
        let mut w = [0f32; 8];
        w[0] = 1.0e8;
        w[1] = 1.0;
        w[4] = -1.0e8;
        assert_eq!(hsum_float_8(&w), 1.0);
    }
}
