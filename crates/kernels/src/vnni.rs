//! AVX-512 VNNI matmul kernels, on 256-bit registers (AVX512VL). `vpdpbusd` multiplies 4 bytes
//! by 4 bytes and adds the four products into an i32 lane, so with a block's weights turned
//! around (lane = row, one dword of 4 columns at a time) each lane ends the block holding its
//! row's integer sum: no horizontal reduction, and each weight unpack is shared by up to 8
//! tokens. The integer sums are exact and the float steps are the AVX2 kernels' own, in the
//! same order, so the results are bit for bit those of `avx2` (tested).
//!
//! Each public function is safe to call on any CPU: without VNNI it runs the AVX2 kernel.

use crate::avx2;
use crate::matrix::{GroupJob, Q41GroupBlock, Q80GroupBlock};

/// Below this many tokens the AVX2 kernels are faster (the turn-around costs more than the
/// reduction tree it saves when there is nothing to share it with); same results either way.
const MIN_TOKENS: usize = 4;

fn cpu_ok() -> bool {
    crate::backend::has_avx512_vnni()
}

/// Splits tokens `range` into runs of 8, then 4, then 1: `(first, width)`.
fn token_runs(range: std::ops::Range<usize>) -> impl Iterator<Item = (usize, usize)> {
    let eights = (range.end - range.start) / 8 * 8;
    let fours = (range.end - range.start - eights) / 4 * 4;
    let (start, four_start) = (range.start, range.start + eights);
    let one_start = four_start + fours;
    (start..four_start)
        .step_by(8)
        .map(|t| (t, 8))
        .chain((four_start..one_start).step_by(4).map(|t| (t, 4)))
        .chain((one_start..range.end).map(|t| (t, 1)))
}

pub(crate) fn q41_group(group: &[Q41GroupBlock], mut job: GroupJob) {
    avx2::check_job(group.len(), &job);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() && job.tokens.len() >= MIN_TOKENS {
        for (first, width) in token_runs(job.tokens.clone()) {
            // SAFETY: the CPU has avx2, fma, f16c, avx512f, avx512vl and avx512vnni (checked
            // above); `check_job` bounded the job, and `first + width <= job.tokens.end`.
            unsafe {
                match width {
                    8 => x86::q41_tokens::<8>(group, &mut job, first),
                    4 => x86::q41_tokens::<4>(group, &mut job, first),
                    _ => x86::q41_tokens::<1>(group, &mut job, first),
                }
            }
        }
        return;
    }
    avx2::q41_group(group, job)
}

pub(crate) fn q80_group(group: &[Q80GroupBlock], mut job: GroupJob) {
    avx2::check_job(group.len(), &job);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() && job.tokens.len() >= MIN_TOKENS {
        for (first, width) in token_runs(job.tokens.clone()) {
            // SAFETY: as in `q41_group`.
            unsafe {
                match width {
                    8 => x86::q80_tokens::<8>(group, &mut job, first),
                    4 => x86::q80_tokens::<4>(group, &mut job, first),
                    _ => x86::q80_tokens::<1>(group, &mut job, first),
                }
            }
        }
        return;
    }
    avx2::q80_group(group, job)
}

// As in `avx2`: nearly every line is an intrinsic under the function's safety contract.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use crate::matrix::{GroupJob, Q41GroupBlock, Q80GroupBlock, GROUP_ROWS, Q41_LANE_ROW};
    use std::arch::x86_64::*;

    // Loads are unaligned loads of exactly the bytes of fixed-size array fields (`qs`, `d`,
    // `m` of a block; dword `k < 8` of an activation block's 32 bytes), so every pointer is in
    // bounds for the width it reads.

    /// Dword `k` (bytes 4k..4k+4) of an activation block, in every lane.
    #[inline(always)]
    unsafe fn act_dword(qs: &[i8; 32], k: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned((qs.as_ptr() as *const i32).add(k)))
    }

    /// 8 rows × tokens `first..first + N` of one Q4_1 row group.
    ///
    /// The block's 128 bytes are four registers `[row 2p | row 2p+1]` of 16 bytes (byte j:
    /// column j low nibble, column j+16 high). Two rounds of unpacks turn them into four
    /// registers whose lane i holds dword k of row `Q41_LANE_ROW[i]`, the order `d` and `m` are
    /// stored in; masking and shifting then gives columns 4k..4k+4 (low nibbles) and
    /// 16+4k..16+4k+4 (high), as unsigned bytes for `vpdpbusd`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512vl and avx512vnni, and `job`
    /// passed `check_job` with `first + N <= job.tokens.end`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn q41_tokens<const N: usize>(
        group: &[Q41GroupBlock],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let low_nibble = _mm256_set1_epi8(0x0F);
        let rows: [&[crate::ActBlock]; N] = std::array::from_fn(|n| acts.row(first + n));
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, w) in group.iter().enumerate() {
            let w_ptr = w.qs.as_ptr() as *const __m256i;
            // Plain loops, not `array::from_fn` or `map`: closures may stay out of line in a
            // `target_feature` function.
            let mut p = [_mm256_setzero_si256(); 4];
            for (i, p) in p.iter_mut().enumerate() {
                *p = _mm256_loadu_si256(w_ptr.add(i));
            }
            let lo01 = _mm256_unpacklo_epi32(p[0], p[1]);
            let hi01 = _mm256_unpackhi_epi32(p[0], p[1]);
            let lo23 = _mm256_unpacklo_epi32(p[2], p[3]);
            let hi23 = _mm256_unpackhi_epi32(p[2], p[3]);
            let dwords = [
                _mm256_unpacklo_epi64(lo01, lo23),
                _mm256_unpackhi_epi64(lo01, lo23),
                _mm256_unpacklo_epi64(hi01, hi23),
                _mm256_unpackhi_epi64(hi01, hi23),
            ];
            let mut low = [_mm256_setzero_si256(); 4];
            let mut high = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                low[k] = _mm256_and_si256(dwords[k], low_nibble);
                high[k] = _mm256_and_si256(_mm256_srli_epi16(dwords[k], 4), low_nibble);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
            let m = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr() as *const __m128i));
            for n in 0..N {
                let a = rows[n].get_unchecked(b);
                let mut sumi = _mm256_setzero_si256();
                for k in 0..4 {
                    sumi = _mm256_dpbusd_epi32(sumi, low[k], act_dword(&a.qs, k));
                    sumi = _mm256_dpbusd_epi32(sumi, high[k], act_dword(&a.qs, 4 + k));
                }
                // The AVX2 kernel's float steps, in its order.
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc[n] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc[n]);
                acc[n] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s), acc[n]);
            }
        }
        for (n, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
            for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
                job.out[row * job.stride + first + n] = lanes[lane];
            }
        }
    }

    /// 8 rows × tokens `first..first + N` of one Q8_0 row group.
    ///
    /// The block's 8 rows of 32 signed bytes are transposed 8×8 in dwords (lane = row, in row
    /// order). `vpdpbusd` wants one unsigned operand: the weights get +128 (a sign-bit flip),
    /// and each token's sum starts at −128·Σqs of its activation block, so what the lane ends
    /// with is exactly Σ w·a.
    ///
    /// # Safety
    /// As `q41_tokens`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn q80_tokens<const N: usize>(
        group: &[Q80GroupBlock],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let sign_bits = _mm256_set1_epi8(i8::MIN);
        let rows: [&[crate::ActBlock]; N] = std::array::from_fn(|n| acts.row(first + n));
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, w) in group.iter().enumerate() {
            let w_ptr = w.qs.as_ptr() as *const __m256i;
            // Plain loops, as in `q41_tokens`.
            let mut r = [_mm256_setzero_si256(); 8];
            for (i, r) in r.iter_mut().enumerate() {
                *r = _mm256_loadu_si256(w_ptr.add(i));
            }
            // Rows (a, b) → [a0 b0 a1 b1 | a4 b4 a5 b5] and [a2 b2 a3 b3 | a6 b6 a7 b7].
            let mut s = [_mm256_setzero_si256(); 8];
            for pair in 0..4 {
                s[2 * pair] = _mm256_unpacklo_epi32(r[2 * pair], r[2 * pair + 1]);
                s[2 * pair + 1] = _mm256_unpackhi_epi32(r[2 * pair], r[2 * pair + 1]);
            }
            // Rows 0-3 (from s0..s3) and 4-7 (s4..s7): half[j] holds dwords j | j+4.
            let mut halves = [[_mm256_setzero_si256(); 4]; 2];
            for (half, base) in halves.iter_mut().zip([0, 4]) {
                half[0] = _mm256_unpacklo_epi64(s[base], s[base + 2]);
                half[1] = _mm256_unpackhi_epi64(s[base], s[base + 2]);
                half[2] = _mm256_unpacklo_epi64(s[base + 1], s[base + 3]);
                half[3] = _mm256_unpackhi_epi64(s[base + 1], s[base + 3]);
            }
            let mut biased = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                let (top, bottom) = (halves[0][j], halves[1][j]);
                biased[j] =
                    _mm256_xor_si256(_mm256_permute2x128_si256(top, bottom, 0x20), sign_bits);
                biased[j + 4] =
                    _mm256_xor_si256(_mm256_permute2x128_si256(top, bottom, 0x31), sign_bits);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
            for n in 0..N {
                let a = rows[n].get_unchecked(b);
                let mut sumi = _mm256_set1_epi32(-128 * a.qsum);
                for (k, weights) in biased.iter().enumerate() {
                    sumi = _mm256_dpbusd_epi32(sumi, *weights, act_dword(&a.qs, k));
                }
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc[n] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc[n]);
            }
        }
        for (n, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
            for (row, value) in lanes.iter().enumerate() {
                job.out[row * job.stride + first + n] = *value;
            }
        }
    }
}
