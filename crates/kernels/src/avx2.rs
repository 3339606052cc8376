//! AVX2 + FMA + F16C kernels. Each public function is safe to call on any CPU: it checks
//! `Backend::detect` (cached by std) and falls back to the scalar kernel, so a wrong backend
//! choice can cost speed but never correctness or safety.

use crate::matrix::{Q41GroupBlock, Q80GroupBlock};
use crate::{scalar, Backend, QuantActs};
use half::f16;

fn cpu_ok() -> bool {
    Backend::detect() == Backend::Avx2
}

pub(crate) fn q41_group(group: &[Q41GroupBlock], acts: &QuantActs, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above).
        unsafe { x86::q41_group(group, acts, out) };
        return;
    }
    scalar::q41_group(group, acts, out)
}

pub(crate) fn q80_group(group: &[Q80GroupBlock], acts: &QuantActs, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above).
        unsafe { x86::q80_group(group, acts, out) };
        return;
    }
    scalar::q80_group(group, acts, out)
}

pub(crate) fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    assert_eq!(q.len(), k.len(), "dot product operands have equal length");
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above); lengths are equal.
        return unsafe { x86::dot_f16(q, k) };
    }
    scalar::dot_f16(q, k)
}

pub(crate) fn axpy_f16(out: &mut [f32], weight: f32, v: &[f16]) {
    assert_eq!(out.len(), v.len(), "axpy operands have equal length");
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above); lengths are equal.
        unsafe { x86::axpy_f16(out, weight, v) };
        return;
    }
    scalar::axpy_f16(out, weight, v)
}

// Inside these functions nearly every line is an intrinsic; the safety contract is the
// function's (`# Safety`), so the bodies are not split into per-line unsafe blocks.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use crate::matrix::{Q41GroupBlock, Q80GroupBlock, GROUP_ROWS, Q41_LANE_ROW};
    use crate::QuantActs;
    use half::f16;
    use std::arch::x86_64::*;

    // All loads below are unaligned loads (`loadu`) of exactly the bytes of a fixed-size array
    // field, so every pointer is in bounds for the width read.

    /// 8 rows × every token of one row group; `out[r * tokens + t]`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `group` has one block per activation block.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q41_group(group: &[Q41GroupBlock], acts: &QuantActs, out: &mut [f32]) {
        let tokens = acts.rows();
        let low_nibble = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for token in 0..tokens {
            let act_row = acts.row(token);
            assert_eq!(
                act_row.len(),
                group.len(),
                "one activation block per weight block"
            );
            let mut acc = _mm256_setzero_ps();
            let mut acc_offset = _mm256_setzero_ps();
            for (w, a) in group.iter().zip(act_row) {
                let a_ptr = a.qs.as_ptr() as *const __m128i;
                let act_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(a_ptr));
                let act_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(a_ptr.add(1)));
                let w_ptr = w.qs.as_ptr() as *const __m256i;
                let mut pair_sums = [_mm256_setzero_si256(); 4];
                for (pair, sum) in pair_sums.iter_mut().enumerate() {
                    let packed = _mm256_loadu_si256(w_ptr.add(pair));
                    let lo = _mm256_and_si256(packed, low_nibble);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibble);
                    // u4 × i8 pairs fit i16 (15·127·2·2 < 2^15): add before widening.
                    let s16 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, act_lo),
                        _mm256_maddubs_epi16(hi, act_hi),
                    );
                    *sum = _mm256_madd_epi16(s16, ones);
                }
                // Lanes become rows [0,2,4,6,1,3,5,7]: the order `d` and `m` are stored in.
                let sumi = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(pair_sums[0], pair_sums[1]),
                    _mm256_hadd_epi32(pair_sums[2], pair_sums[3]),
                );
                let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
                let m = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr() as *const __m128i));
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc);
                acc_offset = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s), acc_offset);
            }
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc, acc_offset));
            for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
                out[row * tokens + token] = lanes[lane];
            }
        }
    }

    /// 8 rows × every token of one row group; `out[r * tokens + t]`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `group` has one block per activation block.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q80_group(group: &[Q80GroupBlock], acts: &QuantActs, out: &mut [f32]) {
        let tokens = acts.rows();
        let ones = _mm256_set1_epi16(1);
        for token in 0..tokens {
            let act_row = acts.row(token);
            assert_eq!(
                act_row.len(),
                group.len(),
                "one activation block per weight block"
            );
            let mut acc = _mm256_setzero_ps();
            for (w, a) in group.iter().zip(act_row) {
                let act = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let w_ptr = w.qs.as_ptr() as *const __m256i;
                let mut row_sums = [_mm256_setzero_si256(); GROUP_ROWS];
                for (row, sum) in row_sums.iter_mut().enumerate() {
                    let weights = _mm256_loadu_si256(w_ptr.add(row));
                    // maddubs wants one unsigned operand: move the sign onto the activations.
                    let prod = _mm256_maddubs_epi16(
                        _mm256_sign_epi8(weights, weights),
                        _mm256_sign_epi8(act, weights),
                    );
                    *sum = _mm256_madd_epi16(prod, ones);
                }
                let g0 = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(row_sums[0], row_sums[1]),
                    _mm256_hadd_epi32(row_sums[2], row_sums[3]),
                );
                let g1 = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(row_sums[4], row_sums[5]),
                    _mm256_hadd_epi32(row_sums[6], row_sums[7]),
                );
                let sumi = _mm256_add_epi32(
                    _mm256_permute2x128_si256(g0, g1, 0x20),
                    _mm256_permute2x128_si256(g0, g1, 0x31),
                );
                let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc);
            }
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            for (row, value) in lanes.iter().enumerate() {
                out[row * tokens + token] = *value;
            }
        }
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c; `q.len() == k.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
        let full = q.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < full {
            let kv = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(i) as *const __m128i));
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), kv, acc);
            i += 8;
        }
        let mut sum = hsum(acc);
        for j in full..q.len() {
            sum += q[j] * k[j].to_f32();
        }
        sum
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c; `out.len() == v.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_f16(out: &mut [f32], weight: f32, v: &[f16]) {
        let full = out.len() / 8 * 8;
        let w = _mm256_set1_ps(weight);
        let mut i = 0;
        while i < full {
            let vv = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i));
            let o = out.as_mut_ptr().add(i);
            _mm256_storeu_ps(o, _mm256_fmadd_ps(w, vv, _mm256_loadu_ps(o)));
            i += 8;
        }
        for j in full..out.len() {
            out[j] += weight * v[j].to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}
