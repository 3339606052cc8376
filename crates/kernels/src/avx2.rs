//! AVX2 + FMA + F16C kernels. Each public function is safe to call on any CPU: it checks
//! the CPU's features (cached by std) and falls back to the scalar kernel, so a wrong backend
//! choice can cost speed but never correctness or safety.

#[cfg(target_arch = "x86_64")]
use crate::attention::KvHeadAttention;
use crate::matrix::{GroupJob, Q41GroupBlock, Q80GroupBlock, GROUP_ROWS};
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

pub(crate) fn scores_f16(q: &[f32], keys: &[f16], scale: f32, scores: &mut [f32]) {
    assert!(
        keys.len() >= scores.len() * q.len(),
        "a key for every score"
    );
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        // SAFETY: the CPU has avx2, fma and f16c (checked just above); `keys` holds
        // `scores.len()` keys of `q.len()` values (asserted above).
        unsafe { x86::scores_f16(q, keys, scale, scores) };
        return;
    }
    for (score, key) in scores.iter_mut().zip(keys.chunks_exact(q.len())) {
        *score = scalar::dot_f16(q, key) * scale;
    }
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

/// Whether `attend_kv_head` takes a head of `head_dim` values on this CPU (whole registers).
pub(crate) fn attention_fits(head_dim: usize) -> bool {
    cpu_ok() && head_dim.is_multiple_of(8)
}

/// Query heads per scores/mix pass: their accumulators fill the 16 registers.
const HEADS_PER_PASS: usize = 3;

thread_local! {
    /// `attend_kv_head`'s rounded queries and scores, reused across calls on this thread.
    static ATTENTION_SCRATCH: std::cell::RefCell<Vec<f32>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// [`KvHeadAttention::run`] in AVX2 for a `head_dim` that `attention_fits`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn attend_kv_head(
    att: &KvHeadAttention,
    backend: crate::Backend,
    queries: &[f32],
    out: &mut [f32],
) {
    assert!(attention_fits(att.head_dim), "a head of whole registers");
    att.check(queries, out);
    let (head_dim, len) = (att.head_dim, att.len);
    let heads = queries.len() / head_dim;
    ATTENTION_SCRATCH.with_borrow_mut(|scratch| {
        scratch.clear();
        scratch.resize(heads * (head_dim + len), 0.0);
        let (q16, probs) = scratch.split_at_mut(heads * head_dim);
        // SAFETY (every call below): the CPU has avx2, fma and f16c (`attention_fits`);
        // `KvHeadAttention::check` (just above) ensured the pages hold `len` positions of
        // `head_dim` values; `q16`, `probs` and `out` hold `heads` heads of `head_dim` and `len`
        // values. The reference multiplies Q against the f16 cache in f16: round Q the same way.
        q16.copy_from_slice(queries);
        unsafe { x86::round_through_f16_in_place(q16) };
        let passes = q16
            .chunks(HEADS_PER_PASS * head_dim)
            .zip(probs.chunks_mut(HEADS_PER_PASS * len));
        for (q, probs) in passes {
            unsafe {
                match q.len() / head_dim {
                    3 => x86::scores::<3>(att, q, probs),
                    2 => x86::scores::<2>(att, q, probs),
                    _ => x86::scores::<1>(att, q, probs),
                }
            }
        }
        crate::ops::softmax_rows_in_place(backend, probs, len);
        // Probabilities rounded to f16, as the reference multiplies them by V in f16.
        unsafe { x86::round_through_f16_in_place(probs) };
        let passes = probs
            .chunks(HEADS_PER_PASS * len)
            .zip(out.chunks_mut(HEADS_PER_PASS * head_dim));
        for (probs, out) in passes {
            unsafe {
                match probs.len() / len {
                    3 => x86::mix::<3>(att, probs, out),
                    2 => x86::mix::<2>(att, probs, out),
                    _ => x86::mix::<1>(att, probs, out),
                }
            }
        }
    });
}

// Inside these functions nearly every line is an intrinsic; the safety contract is the
// function's (`# Safety`), so the bodies are not split into per-line unsafe blocks.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use crate::attention::KvHeadAttention;
    use crate::matrix::{GroupJob, Q41GroupBlock, Q80GroupBlock, GROUP_ROWS, Q41_LANE_ROW};
    use half::f16;
    use std::arch::x86_64::*;
    use std::mem::size_of;

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
    /// The CPU must support avx2, fma and f16c; `keys.len() >= scores.len() * q.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_f16(q: &[f32], keys: &[f16], scale: f32, scores: &mut [f32]) {
        let width = q.len();
        let mut i = 0;
        if width.is_multiple_of(8) {
            // Four keys per pass: each chunk of q is loaded once for four keys, and one
            // reduction tree finishes all four dot products.
            while i + 4 <= scores.len() {
                let base = keys.as_ptr().add(i * width);
                let mut acc = [_mm256_setzero_ps(); 4];
                for c in (0..width).step_by(8) {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(c));
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let kv = _mm_loadu_si128(base.add(k * width + c) as *const __m128i);
                        *acc = _mm256_fmadd_ps(qv, _mm256_cvtph_ps(kv), *acc);
                    }
                }
                let h = _mm256_hadd_ps(
                    _mm256_hadd_ps(acc[0], acc[1]),
                    _mm256_hadd_ps(acc[2], acc[3]),
                );
                let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                _mm_storeu_ps(
                    scores.as_mut_ptr().add(i),
                    _mm_mul_ps(sums, _mm_set1_ps(scale)),
                );
                i += 4;
            }
        }
        for (j, score) in scores.iter_mut().enumerate().skip(i) {
            *score = dot_f16(q, keys.get_unchecked(j * width..(j + 1) * width)) * scale;
        }
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

    /// How many pages ahead of the keys being scored their successors' lines are requested.
    /// Pages are scattered and one head's slots of a page are only `page_size × head_dim`
    /// values, too short a run for the hardware prefetcher to pick up before it ends.
    const KEY_PAGES_AHEAD: usize = 2;

    /// Asks for the cache lines of slots `slots` of `page` in `pages` (one head's keys or
    /// values), keeping to written positions: positions past `len` are never touched, not
    /// even by a prefetch. Into L2 (`T1`), not L1: a burst of prefetches into L1 waits on
    /// L1's few miss buffers (batch-16 attention ran a third faster into L2; BENCHMARKS.md).
    ///
    /// The scores pass asks for a few slots at a time as it goes rather than whole pages at
    /// once: a page-sized burst fills the core's miss buffers, and what does not fit is
    /// dropped or holds up the loads that compute. Spread out, `examples/attention_speed`
    /// 16 × 80 from memory went from 3.4 to 2.4 ms per step on one thread (16 × 500: 17.8 →
    /// 13.3 ms), and a 2-thread batch-16 decode step 4–6 % faster (BENCHMARKS.md).
    #[inline(always)]
    unsafe fn prefetch_slots(
        att: &KvHeadAttention,
        pages: &[&[f16]],
        page: usize,
        slots: std::ops::Range<usize>,
    ) {
        let (Some(page_values), Some(written)) = (pages.get(page), att.written_slots(page, slots))
        else {
            return;
        };
        let start = page_values.as_ptr().wrapping_add(written.start) as *const i8;
        for offset in (0..written.len() * size_of::<f16>()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(offset));
        }
    }

    /// As the scores pass goes through slots `slots` of `page`: asks for the same slots'
    /// keys `KEY_PAGES_AHEAD` pages on, and for this page's values, which `mix` reads after
    /// the softmax.
    #[inline(always)]
    unsafe fn prefetch_while_scoring(
        att: &KvHeadAttention,
        page: usize,
        slots: std::ops::Range<usize>,
    ) {
        prefetch_slots(att, att.keys, page + KEY_PAGES_AHEAD, slots.clone());
        prefetch_slots(att, att.values, page, slots);
    }

    /// `probs[g * len + pos] = scale · (q_g · key_pos)` for the G heads of `q`.
    ///
    /// # Safety
    /// The CPU must support avx2, fma and f16c; `att` passed `KvHeadAttention::check` with
    /// `head_dim` a multiple of 8; `q` holds G heads and `probs` G × `len` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores<const G: usize>(
        att: &KvHeadAttention,
        q: &[f32],
        probs: &mut [f32],
    ) {
        let (hd, len) = (att.head_dim, att.len);
        assert!(q.len() == G * hd && probs.len() == G * len, "G heads");
        let scale = _mm_set1_ps(att.scale);
        let q = q.as_ptr();
        let pages = len.div_ceil(att.page_size);
        for page in 0..KEY_PAGES_AHEAD {
            prefetch_slots(att, att.keys, page, 0..att.page_size);
        }
        for (page, keys) in att.keys.iter().enumerate().take(pages) {
            let first = page * att.page_size;
            let slots = (len - first).min(att.page_size);
            let keys = keys.as_ptr();
            let mut i = 0;
            // Four keys per pass: each key chunk is widened once for the G heads, and one
            // reduction tree finishes four dot products per head.
            while i + 4 <= slots {
                prefetch_while_scoring(att, page, i..i + 4);
                let mut acc = [[_mm256_setzero_ps(); 4]; G];
                for c in (0..hd).step_by(8) {
                    for k in 0..4 {
                        let key = keys.add((i + k) * hd + c) as *const __m128i;
                        let kv = _mm256_cvtph_ps(_mm_loadu_si128(key));
                        for (g, acc) in acc.iter_mut().enumerate() {
                            let qv = _mm256_loadu_ps(q.add(g * hd + c));
                            acc[k] = _mm256_fmadd_ps(qv, kv, acc[k]);
                        }
                    }
                }
                for (g, acc) in acc.iter().enumerate() {
                    let h = _mm256_hadd_ps(
                        _mm256_hadd_ps(acc[0], acc[1]),
                        _mm256_hadd_ps(acc[2], acc[3]),
                    );
                    let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                    let dst = probs.as_mut_ptr().add(g * len + first + i);
                    _mm_storeu_ps(dst, _mm_mul_ps(sums, scale));
                }
                i += 4;
            }
            while i < slots {
                prefetch_while_scoring(att, page, i..i + 1);
                let mut acc = [_mm256_setzero_ps(); G];
                for c in (0..hd).step_by(8) {
                    let key = keys.add(i * hd + c) as *const __m128i;
                    let kv = _mm256_cvtph_ps(_mm_loadu_si128(key));
                    for (g, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(g * hd + c)), kv, *acc);
                    }
                }
                for (g, acc) in acc.iter().enumerate() {
                    probs[g * len + first + i] = hsum(*acc) * att.scale;
                }
                i += 1;
            }
        }
    }

    /// `out[g] = Σ_pos probs[g * len + pos] · value_pos` for the G heads of `out`, 32 values
    /// of each head per pass so the sums stay in registers. Each output value is one chain
    /// of FMAs in position order, whatever G is. The values were requested during `scores`.
    ///
    /// # Safety
    /// As `scores`, with `probs` G × `len` values and `out` G heads.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mix<const G: usize>(
        att: &KvHeadAttention,
        probs: &[f32],
        out: &mut [f32],
    ) {
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
}
