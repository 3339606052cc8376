//! AVX2 + FMA + F16C kernels. Each public function is safe to call on any CPU: it checks
//! the CPU's features (cached by std) and falls back to the scalar kernel, so a wrong backend
//! choice can cost speed but never correctness or safety.

use crate::layout::{
    GroupJob, Q41GroupBlock, Q50GroupBlock, Q80GroupBlock, Q8OffsetGroupBlock, GROUP_ROWS,
};
use crate::scalar;
use half::f16;

fn cpu_ok() -> bool {
    crate::backend::has_avx2()
}

pub(crate) fn q41_group(group: &[Q41GroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        let mut token = job.tokens.start;
        while token + 4 <= job.tokens.end {
            // SAFETY: the CPU has avx2, fma and f16c; `GroupJob::check` bounded the job.
            unsafe { x86::q41_tokens::<4>(group, &mut job, token) };
            token += 4;
        }
        for token in token..job.tokens.end {
            // SAFETY: as above.
            unsafe { x86::q41_tokens::<1>(group, &mut job, token) };
        }
        return;
    }
    scalar::q41_group(group, job)
}

pub(crate) fn q50_group(group: &[Q50GroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        let mut token = job.tokens.start;
        while token + 4 <= job.tokens.end {
            // SAFETY: the CPU has avx2, fma and f16c; `GroupJob::check` bounded the job.
            unsafe { x86::q50_tokens::<4>(group, &mut job, token) };
            token += 4;
        }
        for token in token..job.tokens.end {
            // SAFETY: as above.
            unsafe { x86::q50_tokens::<1>(group, &mut job, token) };
        }
        return;
    }
    scalar::q50_group(group, job)
}

pub(crate) fn q8_offset_group(group: &[Q8OffsetGroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        let mut token = job.tokens.start;
        while token + 4 <= job.tokens.end {
            // SAFETY: the CPU has avx2, fma and f16c; `GroupJob::check` bounded the job.
            unsafe { x86::q8_offset_tokens::<4>(group, &mut job, token) };
            token += 4;
        }
        for token in token..job.tokens.end {
            // SAFETY: as above.
            unsafe { x86::q8_offset_tokens::<1>(group, &mut job, token) };
        }
        return;
    }
    scalar::q8_offset_group(group, job)
}

pub(crate) fn q80_group(group: &[Q80GroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        for token in job.tokens.clone() {
            // SAFETY: the CPU has avx2, fma and f16c; `GroupJob::check` bounded tokens and output.
            unsafe { x86::q80_token(group, &mut job, token) };
        }
        return;
    }
    scalar::q80_group(group, job)
}

pub(crate) fn mix_f16(weights: &[f32], values: &[f16], out: &mut [f32]) {
    assert!(
        values.len() >= weights.len() * out.len(),
        "a value for every weight"
    );
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above); `values` holds
        // `weights.len()` values of `out.len()` (asserted above).
        unsafe { x86::mix_f16(weights, values, out) };
        return;
    }
    for (&weight, value) in weights.iter().zip(values.chunks_exact(out.len())) {
        scalar::axpy_f16(out, f16::from_f32(weight).to_f32(), value);
    }
}

/// Whether the AVX2 attention kernels take a head of `head_dim` values on this CPU (whole
/// registers).
pub(crate) fn attention_fits(head_dim: usize) -> bool {
    cpu_ok() && head_dim.is_multiple_of(8)
}

/// The AVX2 grouped attention kernels, for a head size that `attention_fits`.
#[cfg(target_arch = "x86_64")]
pub(crate) const ATTENTION_KERNELS: crate::attention::GroupedKernels =
    crate::attention::GroupedKernels {
        scores: x86::scores_of_heads,
        mix: x86::mix_of_heads,
    };

/// The AVX2 row-block kernels (`KvHeadAttention::run_rows`), for a head size that
/// `attention_fits`: runs of 8 keys and values widened once per block.
#[cfg(target_arch = "x86_64")]
pub(crate) const ROW_KERNELS: crate::attention::RowKernels = crate::attention::RowKernels {
    positions: 8,
    scores: scores_of_rows,
    mix: mix_of_rows,
};

/// Every row's scores, head by head (`attention::RowKernels::scores`).
///
/// # Safety
/// The CPU must support avx2, fma and f16c; as `RowKernels::scores` otherwise.
#[cfg(target_arch = "x86_64")]
unsafe fn scores_of_rows(
    att: &crate::KvHeadAttention,
    block: &crate::attention::RowBlock,
    g: usize,
    q: &[f32],
    probs: &mut [f32],
    tile: &mut [f32],
) {
    block.check(att, g, q, probs, tile, 8);
    // SAFETY: the caller's contract; the bounds of every slice just checked.
    unsafe { x86::scores_of_rows(att, block, g, q, probs, tile) }
}

/// Every row's mix (`attention::RowKernels::mix`).
///
/// # Safety
/// As [`scores_of_rows`], with `probs` the rows' probabilities and `out` strided as `q`.
#[cfg(target_arch = "x86_64")]
unsafe fn mix_of_rows(
    att: &crate::KvHeadAttention,
    block: &crate::attention::RowBlock,
    g: usize,
    probs: &[f32],
    out: &mut [f32],
    tile: &mut [f32],
) {
    block.check(att, g, out, probs, tile, 8);
    // SAFETY: the caller's contract; the bounds of every slice just checked.
    unsafe {
        match g {
            3 => x86::mix_of_rows::<3>(att, block, probs, out, tile),
            2 => x86::mix_of_rows::<2>(att, block, probs, out, tile),
            _ => x86::mix_of_rows::<1>(att, block, probs, out, tile),
        }
    }
}

/// Rounds each value of `x` to f16 and back, in place.
pub(crate) fn round_through_f16_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above).
        unsafe { x86::round_through_f16_in_place(x) };
        return;
    }
    for v in x.iter_mut() {
        *v = f16::from_f32(*v).to_f32();
    }
}

// Inside these functions nearly every line is an intrinsic; the safety contract is the
// function's (`# Safety`), so the bodies are not split into per-line unsafe blocks.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use crate::attention::{score_dot, Fold, KeyRun, KvHeadAttention, RowBlock, RunPrefetch};
    use crate::layout::{
        GroupJob, Q41GroupBlock, Q50GroupBlock, Q80GroupBlock, Q8OffsetGroupBlock, GROUP_ROWS,
        Q41_LANE_ROW,
    };
    use half::f16;
    use std::arch::x86_64::*;

    // All loads below are unaligned loads (`loadu`) of exactly the bytes of a fixed-size array
    // field, so every pointer is in bounds for the width read.

    /// 8 rows × tokens `first..first + N` of one row group, sharing each weight unpack
    /// across the N tokens.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c, and `job` passed `GroupJob::check` with
    /// `first + N <= job.tokens.end`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q41_tokens<const N: usize>(
        group: &[Q41GroupBlock],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let low_nibble = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let rows: [&[crate::ActBlock]; N] = std::array::from_fn(|n| acts.row(first + n));
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, w) in group.iter().enumerate() {
            let w_ptr = w.qs.as_ptr() as *const __m256i;
            let mut lo = [_mm256_setzero_si256(); 4];
            let mut hi = [_mm256_setzero_si256(); 4];
            for pair in 0..4 {
                let packed = _mm256_loadu_si256(w_ptr.add(pair));
                lo[pair] = _mm256_and_si256(packed, low_nibble);
                hi[pair] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibble);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
            let m = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr() as *const __m128i));
            for n in 0..N {
                let a = rows[n].get_unchecked(b);
                let a_ptr = a.qs.as_ptr() as *const __m128i;
                let act_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(a_ptr));
                let act_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(a_ptr.add(1)));
                let mut pair_sums = [_mm256_setzero_si256(); 4];
                for pair in 0..4 {
                    // u4 × i8 pairs fit i16 (15·127·2·2 < 2^15): add before widening.
                    let s16 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo[pair], act_lo),
                        _mm256_maddubs_epi16(hi[pair], act_hi),
                    );
                    pair_sums[pair] = _mm256_madd_epi16(s16, ones);
                }
                // Lanes become rows [0,2,4,6,1,3,5,7]: the order `d` and `m` are stored in.
                let sumi = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(pair_sums[0], pair_sums[1]),
                    _mm256_hadd_epi32(pair_sums[2], pair_sums[3]),
                );
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc[n] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc[n]);
                acc[n] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s), acc[n]);
            }
        }
        for (n, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
            for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
                job.put(first + n, row, lanes[lane]);
            }
        }
    }

    /// The 8 lanes of `sums[r]` (row r's partial sums) added up, lane r holding row r's total.
    ///
    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn row_totals(sums: &[__m256i; GROUP_ROWS]) -> __m256i {
        let g0 = _mm256_hadd_epi32(
            _mm256_hadd_epi32(sums[0], sums[1]),
            _mm256_hadd_epi32(sums[2], sums[3]),
        );
        let g1 = _mm256_hadd_epi32(
            _mm256_hadd_epi32(sums[4], sums[5]),
            _mm256_hadd_epi32(sums[6], sums[7]),
        );
        _mm256_add_epi32(
            _mm256_permute2x128_si256(g0, g1, 0x20),
            _mm256_permute2x128_si256(g0, g1, 0x31),
        )
    }

    /// 16 in each byte whose bit is set: byte j tests bit `j % 8` of `qh`'s byte `spread[j]`.
    ///
    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn fifth_bits(
        qh: __m256i,
        spread: __m256i,
        bit_of_byte: __m256i,
        fifth: __m256i,
    ) -> __m256i {
        let picked = _mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit_of_byte);
        _mm256_and_si256(_mm256_cmpeq_epi8(picked, bit_of_byte), fifth)
    }

    /// As `q41_tokens`, for Q5_0: the nibbles unpacked the same way, each value's fifth bit
    /// (16) put in from `qh`, and `Σ (q − 16) · x` taken as `Σ q · x − 16 · Σ x` with the
    /// activations' exact integer sum, so the integer sums are llama.cpp's.
    ///
    /// # Safety
    /// As `q41_tokens`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q50_tokens<const N: usize>(
        group: &[Q50GroupBlock],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let low_nibble = _mm256_set1_epi8(0x0F);
        let fifth = _mm256_set1_epi8(0x10);
        let ones = _mm256_set1_epi16(1);
        // Byte j of a half tests bit j % 8 of qh byte `SPREAD[j]` (the half's row's qh).
        let bit_of_byte = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let spread_low = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1,
            1, 1, 1,
        );
        let spread_high = _mm256_add_epi8(spread_low, _mm256_set1_epi8(2));
        let rows: [&[crate::ActBlock]; N] = std::array::from_fn(|n| acts.row(first + n));
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, w) in group.iter().enumerate() {
            let w_ptr = w.qs.as_ptr() as *const __m256i;
            let mut lo = [_mm256_setzero_si256(); 4];
            let mut hi = [_mm256_setzero_si256(); 4];
            for pair in 0..4 {
                let packed = _mm256_loadu_si256(w_ptr.add(pair));
                // Rows 2·pair and 2·pair + 1 sit in lanes `pair` and 4 + pair of `qh`.
                let qh = _mm256_setr_m128i(
                    _mm_set1_epi32(w.qh[pair] as i32),
                    _mm_set1_epi32(w.qh[4 + pair] as i32),
                );
                lo[pair] = _mm256_or_si256(
                    _mm256_and_si256(packed, low_nibble),
                    fifth_bits(qh, spread_low, bit_of_byte, fifth),
                );
                hi[pair] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibble),
                    fifth_bits(qh, spread_high, bit_of_byte, fifth),
                );
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
            for n in 0..N {
                let a = rows[n].get_unchecked(b);
                let a_ptr = a.qs.as_ptr() as *const __m128i;
                let act_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(a_ptr));
                let act_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128(a_ptr.add(1)));
                let mut pair_sums = [_mm256_setzero_si256(); 4];
                for pair in 0..4 {
                    // u5 × i8 pairs, two of them, fit i16 (31·127·2·2 < 2^15).
                    let s16 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo[pair], act_lo),
                        _mm256_maddubs_epi16(hi[pair], act_hi),
                    );
                    pair_sums[pair] = _mm256_madd_epi16(s16, ones);
                }
                // Lanes become rows [0,2,4,6,1,3,5,7]: the order `d` and `qh` are stored in.
                let sumi = _mm256_sub_epi32(
                    _mm256_hadd_epi32(
                        _mm256_hadd_epi32(pair_sums[0], pair_sums[1]),
                        _mm256_hadd_epi32(pair_sums[2], pair_sums[3]),
                    ),
                    _mm256_set1_epi32(16 * a.qsum),
                );
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc[n] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc[n]);
            }
        }
        for (n, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
            for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
                job.put(first + n, row, lanes[lane]);
            }
        }
    }

    /// As `q41_tokens`, for Q8Offset blocks: each row's 32 values are one register, no
    /// unpacking.
    ///
    /// # Safety
    /// As `q41_tokens`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q8_offset_tokens<const N: usize>(
        group: &[Q8OffsetGroupBlock],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let ones = _mm256_set1_epi16(1);
        let rows: [&[crate::ActBlock]; N] = std::array::from_fn(|n| acts.row(first + n));
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, w) in group.iter().enumerate() {
            let w_ptr = w.qs.as_ptr() as *const __m256i;
            let weights: [__m256i; GROUP_ROWS] =
                std::array::from_fn(|row| _mm256_loadu_si256(w_ptr.add(row)));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr() as *const __m128i));
            let m = _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr() as *const __m128i));
            for n in 0..N {
                let a = rows[n].get_unchecked(b);
                let act = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                // maddubs wants one unsigned operand: move the sign onto the activations.
                // |w| · |x| pairs fit i16 (128·127·2 < 2^15).
                let sums: [__m256i; GROUP_ROWS] = std::array::from_fn(|row| {
                    let w = weights[row];
                    let prod =
                        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(act, w));
                    _mm256_madd_epi16(prod, ones)
                });
                let sumi = row_totals(&sums);
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d));
                acc[n] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc[n]);
                acc[n] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s), acc[n]);
            }
        }
        for (n, acc) in acc.iter().enumerate() {
            let mut lanes = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *acc);
            job.token_rows(first + n).copy_from_slice(&lanes);
        }
    }

    /// 8 rows × one token of one row group.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c, and `job` passed `GroupJob::check` with `token`
    /// in `job.tokens`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q80_token(group: &[Q80GroupBlock], job: &mut GroupJob, token: usize) {
        let ones = _mm256_set1_epi16(1);
        let act_row = job.acts.row(token);
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
        job.token_rows(token).copy_from_slice(&lanes);
    }

    /// # Safety
    /// The CPU must support avx2, fma and f16c; `values.len() >= weights.len() * out.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mix_f16(weights: &[f32], values: &[f16], out: &mut [f32]) {
        if out.len() == 64 {
            mix_f16_in_registers::<8>(weights, values, out);
            return;
        }
        let width = out.len();
        for (i, &weight) in weights.iter().enumerate() {
            let value = values.get_unchecked(i * width..(i + 1) * width);
            axpy_f16(out, round_through_f16(weight), value);
        }
    }

    /// `mix_f16` for `out.len() == 8 * CHUNKS`, with `out` held in registers across weights.
    ///
    /// # Safety
    /// As `mix_f16`, and `out.len() == 8 * CHUNKS`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mix_f16_in_registers<const CHUNKS: usize>(
        weights: &[f32],
        values: &[f16],
        out: &mut [f32],
    ) {
        let width = 8 * CHUNKS;
        let mut acc: [__m256; CHUNKS] =
            std::array::from_fn(|c| _mm256_loadu_ps(out.as_ptr().add(8 * c)));
        for (i, &weight) in weights.iter().enumerate() {
            let w = _mm256_set1_ps(round_through_f16(weight));
            let base = values.as_ptr().add(i * width);
            for (c, acc) in acc.iter_mut().enumerate() {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(base.add(8 * c) as *const __m128i));
                *acc = _mm256_fmadd_ps(w, v, *acc);
            }
        }
        for (c, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *acc);
        }
    }

    /// The reference multiplies probabilities by V in f16: round the same way.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn round_through_f16(x: f32) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(
            _mm_set_ss(x),
            _MM_FROUND_TO_NEAREST_INT,
        )))
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

    /// Rounds each value of `x` to f16 and back, in place.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn round_through_f16_in_place(x: &mut [f32]) {
        let whole = x.len() / 8 * 8;
        let ptr = x.as_mut_ptr();
        for i in (0..whole).step_by(8) {
            let v = _mm256_loadu_ps(ptr.add(i));
            let r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
            _mm256_storeu_ps(ptr.add(i), r);
        }
        for v in &mut x[whole..] {
            *v = round_through_f16(*v);
        }
    }

    /// `probs[g * len + pos] = scale · (q_g · key_pos)` for the heads of `q`, each dot
    /// product `attention::score_dot`, 8 keys per register. A head at a time: the 8 lane
    /// sums of three heads would not fit in 16 registers.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `att` passed `KvHeadAttention::check` with
    /// `head_dim` a multiple of 8; `q` holds whole heads and `probs` `len` values for each.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_of_heads(att: &KvHeadAttention, q: &[f32], probs: &mut [f32]) {
        let (hd, len) = (att.head_dim, att.len);
        assert!(
            q.len().is_multiple_of(hd) && probs.len() == q.len() / hd * len,
            "whole heads"
        );
        for (q, probs) in q.chunks_exact(hd).zip(probs.chunks_exact_mut(len)) {
            scores_of_head(att, q, probs);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_of_head(att: &KvHeadAttention, q: &[f32], probs: &mut [f32]) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        let scale = _mm256_set1_ps(att.scale);
        for run in att.key_runs(8) {
            let written = (len - run.page * ps).min(ps);
            let pairs = (written / 4 * 4).saturating_sub(run.slot).min(run.n);
            if run.n < 8 || pairs < run.n {
                // A run shorter than a register, or one with keys that fold in halves: the
                // same sums, one key at a time.
                score_keys_one_by_one(att, q, probs, run);
                continue;
            }
            let keys = att.keys[run.page].as_ptr().add(run.slot);
            let prefetch = RunPrefetch::new(att, run);
            let mut l = [_mm256_setzero_ps(); 8];
            for c in 0..hd / 8 {
                // The page ahead is `hd / 2` lines: four per step.
                for line in 4 * c..4 * c + 4 {
                    prefetch.line(line);
                }
                for (lane, sum) in l.iter_mut().enumerate() {
                    let d = 8 * c + lane;
                    let k = _mm256_cvtph_ps(_mm_loadu_si128(keys.add(d * ps) as *const __m128i));
                    *sum = _mm256_fmadd_ps(_mm256_set1_ps(*q.get_unchecked(d)), k, *sum);
                }
            }
            let add = |a, b| _mm256_add_ps(a, b);
            let dot = add(
                add(add(l[0], l[1]), add(l[2], l[3])),
                add(add(l[4], l[5]), add(l[6], l[7])),
            );
            let dst = probs.as_mut_ptr().add(run.pos(ps));
            _mm256_storeu_ps(dst, _mm256_mul_ps(dot, scale));
        }
    }

    /// The keys of `run` one at a time, in the same arithmetic.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn score_keys_one_by_one(
        att: &KvHeadAttention,
        q: &[f32],
        probs: &mut [f32],
        run: KeyRun,
    ) {
        let ps = att.page_size;
        let keys = att.keys[run.page];
        let written = (att.len - run.page * ps).min(ps);
        for slot in run.slot..run.slot + run.n {
            let key = |d| keys[crate::attention::key_index(ps, slot, d)].to_f32();
            let dot = score_dot(q, key, Fold::of_slot(slot, written));
            probs[run.pos(ps) + slot - run.slot] = dot * att.scale;
        }
    }

    /// The mix for the heads of `out` (one to `HEADS_PER_PASS`).
    ///
    /// # Safety
    /// As `scores_of_heads`, with `probs` `len` values and `out` an output head for each head.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mix_of_heads(att: &KvHeadAttention, probs: &[f32], out: &mut [f32]) {
        match probs.len() / att.len {
            3 => mix::<3>(att, probs, out),
            2 => mix::<2>(att, probs, out),
            _ => mix::<1>(att, probs, out),
        }
    }

    /// `out[g] = Σ_pos probs[g * len + pos] · value_pos` for the G heads of `out`, 32 values
    /// of each head per pass so the sums stay in registers. Each output value is one chain
    /// of FMAs in position order, whatever G is.
    ///
    /// # Safety
    /// As `scores`, with `probs` G × `len` values and `out` G heads.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mix<const G: usize>(att: &KvHeadAttention, probs: &[f32], out: &mut [f32]) {
        let (hd, len) = (att.head_dim, att.len);
        assert!(out.len() == G * hd && probs.len() == G * len, "G heads");
        for part in (0..hd).step_by(32) {
            let chunks = ((hd - part) / 8).min(4);
            let mut acc = [[_mm256_setzero_ps(); 4]; G];
            for (page, values) in att
                .values
                .iter()
                .enumerate()
                .take(len.div_ceil(att.page_size))
            {
                let first = page * att.page_size;
                let slots = (len - first).min(att.page_size);
                for slot in 0..slots {
                    let value = values.as_ptr().add(slot * hd + part);
                    let mut w = [_mm256_setzero_ps(); G];
                    for (g, w) in w.iter_mut().enumerate() {
                        *w = _mm256_set1_ps(*probs.get_unchecked(g * len + first + slot));
                    }
                    for c in 0..chunks {
                        let v =
                            _mm256_cvtph_ps(_mm_loadu_si128(value.add(8 * c) as *const __m128i));
                        for (acc, w) in acc.iter_mut().zip(&w) {
                            acc[c] = _mm256_fmadd_ps(*w, v, acc[c]);
                        }
                    }
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                for (c, acc) in acc.iter().enumerate().take(chunks) {
                    _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + part + 8 * c), *acc);
                }
            }
        }
    }

    /// `super::scores_of_rows`: each run of up to 8 keys widened into `tile` (dimension-major,
    /// 8 to a dimension) once, then scored for every row and head that reaches it with the
    /// chains of `scores_of_head`; a row whose part of the run is short of a register or
    /// folds in halves takes `score_keys_one_by_one`, as it does alone.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_of_rows(
        att: &KvHeadAttention,
        block: &RowBlock,
        g: usize,
        q: &[f32],
        probs: &mut [f32],
        tile: &mut [f32],
    ) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        let scale = _mm256_set1_ps(att.scale);
        let tile = tile.as_mut_ptr();
        for run in att.key_runs(8) {
            let keys = att.keys[run.page].as_ptr().add(run.slot);
            if run.n == 8 {
                let prefetch = RunPrefetch::new(att, run);
                for d in 0..hd {
                    if d % 2 == 0 {
                        prefetch.line(d / 2);
                    }
                    let k = _mm256_cvtph_ps(_mm_loadu_si128(keys.add(d * ps) as *const __m128i));
                    _mm256_storeu_ps(tile.add(d * 8), k);
                }
            }
            let pos = run.pos(ps);
            for i in block.first_row_at(pos)..block.rows {
                let row_len = block.first_len + i;
                let n = run.n.min(row_len - pos);
                let written = (row_len - run.page * ps).min(ps);
                let pairs = (written / 4 * 4).saturating_sub(run.slot).min(n);
                let row_probs = &mut probs[i * block.probs_stride..];
                let row_q = &q[i * block.q_stride..];
                if n < 8 || pairs < n {
                    let alone = KvHeadAttention {
                        len: row_len,
                        ..*att
                    };
                    let run = KeyRun { n, ..run };
                    for h in 0..g {
                        let q = &row_q[h * hd..][..hd];
                        score_keys_one_by_one(&alone, q, &mut row_probs[h * len..], run);
                    }
                    continue;
                }
                for h in 0..g {
                    let q = row_q.as_ptr().add(h * hd);
                    let mut l = [_mm256_setzero_ps(); 8];
                    for c in 0..hd / 8 {
                        for (lane, sum) in l.iter_mut().enumerate() {
                            let d = 8 * c + lane;
                            let k = _mm256_loadu_ps(tile.add(d * 8));
                            *sum = _mm256_fmadd_ps(_mm256_set1_ps(*q.add(d)), k, *sum);
                        }
                    }
                    let add = |a, b| _mm256_add_ps(a, b);
                    let dot = add(
                        add(add(l[0], l[1]), add(l[2], l[3])),
                        add(add(l[4], l[5]), add(l[6], l[7])),
                    );
                    let dst = row_probs.as_mut_ptr().add(h * len + pos);
                    _mm256_storeu_ps(dst, _mm256_mul_ps(dot, scale));
                }
            }
        }
    }

    /// `super::mix_of_rows` for G heads: each run of up to 8 values widened into `tile`
    /// (slot-major) once, then added into every row that reaches it, 32 values of each head
    /// at a time, the sums loaded from and stored back to `out` around the run.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mix_of_rows<const G: usize>(
        att: &KvHeadAttention,
        block: &RowBlock,
        probs: &[f32],
        out: &mut [f32],
        tile: &mut [f32],
    ) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        let tile = tile.as_mut_ptr();
        for run in att.key_runs(8) {
            let values = att.values[run.page].as_ptr().add(run.slot * hd);
            for i in (0..run.n * hd).step_by(8) {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(values.add(i) as *const __m128i));
                _mm256_storeu_ps(tile.add(i), v);
            }
            let pos = run.pos(ps);
            for i in block.first_row_at(pos)..block.rows {
                let n = run.n.min(block.first_len + i - pos);
                let p = probs.as_ptr().add(i * block.probs_stride + pos);
                let row = out.as_mut_ptr().add(i * block.q_stride);
                for part in (0..hd).step_by(32) {
                    let (out, tile) = (row.add(part), tile.add(part) as *const f32);
                    match (hd - part) / 8 {
                        1 => mix_run::<G, 1>(out, p, tile, n, hd, len),
                        2 => mix_run::<G, 2>(out, p, tile, n, hd, len),
                        3 => mix_run::<G, 3>(out, p, tile, n, hd, len),
                        _ => mix_run::<G, 4>(out, p, tile, n, hd, len),
                    }
                }
            }
        }
    }

    /// One row's sums for `C` registers of each of G heads' values (at `out`, heads `hd`
    /// apart), plus `n` slots of a widened run (`tile`, slot-major, `hd` to a slot) weighted by
    /// `p` (heads `len` apart).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn mix_run<const G: usize, const C: usize>(
        out: *mut f32,
        p: *const f32,
        tile: *const f32,
        n: usize,
        hd: usize,
        len: usize,
    ) {
        let mut acc: [[__m256; C]; G] = std::array::from_fn(|g| {
            std::array::from_fn(|c| _mm256_loadu_ps(out.add(g * hd + 8 * c)))
        });
        for slot in 0..n {
            let w: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(*p.add(g * len + slot)));
            for c in 0..C {
                let v = _mm256_loadu_ps(tile.add(slot * hd + 8 * c));
                for (acc, w) in acc.iter_mut().zip(&w) {
                    acc[c] = _mm256_fmadd_ps(*w, v, acc[c]);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (c, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(g * hd + 8 * c), *acc);
            }
        }
    }
}
