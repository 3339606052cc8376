//! AVX-512 VNNI matmul kernels for batches: two row groups (16 rows) per pass, one row per
//! lane of a 512-bit register. `vpdpbusd` multiplies 4 bytes by 4 bytes and adds the four
//! products into an i32 lane, so with a block's weights turned around (lane = row, one dword
//! of 4 columns at a time) each lane ends the block holding its row's integer sum: no
//! horizontal reduction, and each weight unpack is shared by up to 16 tokens. The integer sums
//! are exact and the float steps are the AVX2 kernels' own, per lane and in the same order, so
//! the results are bit for bit those of `avx2` (tested).
//!
//! The rows stay in the 8-row groups every backend shares: the low half of each register works
//! on one group, the high half on the next, and the unpacks (which never cross a 128-bit lane)
//! serve both. Each public function is safe to call on any CPU: without VNNI it runs the AVX2
//! kernel, one group at a time.

use crate::avx2;
use crate::layout::{
    GroupJob, Q41GroupBlock, Q50GroupBlock, Q80GroupBlock, Q80PairBlock, GROUP_ROWS,
};

/// Below this many tokens the AVX2 kernels are faster (the turn-around costs more than the
/// reduction tree it saves when there is nothing to share it with); same results either way.
const MIN_TOKENS: usize = 4;

/// Whether a job of `tokens` tokens should take these kernels.
pub(crate) fn worth_it(tokens: usize) -> bool {
    tokens >= MIN_TOKENS && cpu_ok()
}

/// Whether this CPU runs these kernels (AVX-512 with VNNI).
pub(crate) fn cpu_ok() -> bool {
    crate::backend::has_avx512_vnni()
}

/// Splits tokens `range` into runs of 8, 4, then 1, and calls `run(first, width)` for each.
fn for_token_runs(range: std::ops::Range<usize>, mut run: impl FnMut(usize, usize)) {
    let mut first = range.start;
    for width in [8, 4, 1] {
        while first + width <= range.end {
            run(first, width);
            first += width;
        }
    }
}

/// Rows `groups[0]` then `groups[1]` (16 rows) of a Q4_1 matrix for the job's tokens. When
/// the job holds 8 rows, `groups[1]` is computed too but not stored (pass the same group).
pub(crate) fn q41_pair(groups: [&[Q41GroupBlock]; 2], mut job: GroupJob) {
    check_pair(groups, &job);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        for_token_runs(job.tokens.clone(), |first, width| {
            // SAFETY: the CPU has the features `x86` needs (checked above); `check_pair`
            // bounded the job, and `first + width <= job.tokens.end`.
            unsafe {
                match width {
                    8 => x86::q41_tokens::<8>(groups, &mut job, first),
                    4 => x86::q41_tokens::<4>(groups, &mut job, first),
                    _ => x86::q41_tokens::<1>(groups, &mut job, first),
                }
            }
        });
        return;
    }
    for_each_group(job, |g, job| avx2::q41_group(groups[g], job));
}

/// As `q41_pair`, for Q5_0.
pub(crate) fn q50_pair(groups: [&[Q50GroupBlock]; 2], mut job: GroupJob) {
    check_pair(groups, &job);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        for_token_runs(job.tokens.clone(), |first, width| {
            // SAFETY: as in `q41_pair`.
            unsafe {
                match width {
                    8 => x86::q50_tokens::<8>(groups, &mut job, first),
                    4 => x86::q50_tokens::<4>(groups, &mut job, first),
                    _ => x86::q50_tokens::<1>(groups, &mut job, first),
                }
            }
        });
        return;
    }
    for_each_group(job, |g, job| avx2::q50_group(groups[g], job));
}

/// As `q41_pair`, for Q8_0.
pub(crate) fn q80_pair(groups: [&[Q80GroupBlock]; 2], mut job: GroupJob) {
    check_pair(groups, &job);
    #[cfg(target_arch = "x86_64")]
    if cpu_ok() {
        for_token_runs(job.tokens.clone(), |first, width| {
            // SAFETY: as in `q41_pair`.
            unsafe {
                match width {
                    8 => x86::q80_tokens::<8>(groups, &mut job, first),
                    4 => x86::q80_tokens::<4>(groups, &mut job, first),
                    _ => x86::q80_tokens::<1>(groups, &mut job, first),
                }
            }
        });
        return;
    }
    for_each_group(job, |g, job| avx2::q80_group(groups[g], job));
}

/// As `q80_pair`, from blocks already turned ([`crate::QuantMatrix::add_vnni_layout`]): the
/// same sums and float steps without the shuffles. Only on a CPU with VNNI (the turned copy is
/// only made there): there is no AVX2 kernel for this layout.
pub(crate) fn q80_turned_pair(pairs: &[Q80PairBlock], mut job: GroupJob) {
    check_rows(pairs.len(), &job);
    assert!(
        cpu_ok(),
        "turned Q8_0 blocks are only made on a CPU with VNNI"
    );
    #[cfg(target_arch = "x86_64")]
    for_token_runs(job.tokens.clone(), |first, width| {
        // SAFETY: as in `q41_pair` (`cpu_ok` asserted above, the job checked against the
        // pair's blocks).
        unsafe {
            match width {
                8 => x86::q80_turned_tokens::<8>(pairs, &mut job, first),
                4 => x86::q80_turned_tokens::<4>(pairs, &mut job, first),
                _ => x86::q80_turned_tokens::<1>(pairs, &mut job, first),
            }
        }
    });
}

/// Both groups' blocks match the activations, and the job is for 8 or 16 rows.
fn check_pair<B>(groups: [&[B]; 2], job: &GroupJob) {
    assert_eq!(groups[0].len(), groups[1].len(), "groups of one matrix");
    check_rows(groups[0].len(), job);
}

/// The job is for 8 or 16 rows, and `blocks` blocks per row match its activations.
fn check_rows(blocks: usize, job: &GroupJob) {
    let rows = job.rows();
    assert!(
        rows == GROUP_ROWS || rows == 2 * GROUP_ROWS,
        "one or two groups"
    );
    job.check(blocks, rows);
}

/// Runs `kernel(g, job)` for each 8-row group of a pair job (the fallback without VNNI).
fn for_each_group(mut job: GroupJob, kernel: impl Fn(usize, GroupJob)) {
    for g in 0..job.rows() / GROUP_ROWS {
        kernel(g, job.group(g));
    }
}

// As in `avx2`: nearly every line is an intrinsic under the function's safety contract.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use crate::layout::{
        GroupJob, Q41GroupBlock, Q50GroupBlock, Q80GroupBlock, Q80PairBlock, GROUP_ROWS,
    };
    use crate::ActBlock;
    use std::arch::x86_64::*;
    use std::mem::size_of;

    // Loads are unaligned loads of exactly the bytes of fixed-size array fields (`qs`, `d`,
    // `m` of a block; dword `k < 8` of an activation block's 32 bytes), so every pointer is in
    // bounds for the width it reads. Activation blocks are read with `get_unchecked(b)` for
    // `b` below the group's block count, which `check_pair` tied to the activations' width.

    /// Dword `k` (bytes 4k..4k+4) of an activation block, in every lane.
    #[inline(always)]
    unsafe fn act_dword(qs: &[i8; 32], k: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned((qs.as_ptr() as *const i32).add(k)))
    }

    /// Activation rows `first..first + N`. (Plain loops here and below, not `array::from_fn`:
    /// its closure may stay out of line in a `target_feature` function, a call per block.)
    #[inline(always)]
    fn token_rows<const N: usize>(acts: &crate::QuantActs, first: usize) -> [&[ActBlock]; N] {
        let mut rows = [acts.row(first); N];
        for (n, row) in rows.iter_mut().enumerate().skip(1) {
            *row = acts.row(first + n);
        }
        rows
    }

    /// Block `b` of each row.
    #[inline(always)]
    unsafe fn blocks_at<'a, const N: usize>(
        rows: &[&'a [ActBlock]; N],
        b: usize,
    ) -> [&'a ActBlock; N] {
        let mut blocks = [rows[0].get_unchecked(b); N];
        for n in 1..N {
            blocks[n] = rows[n].get_unchecked(b);
        }
        blocks
    }

    /// Two 256-bit loads, one per group, as the low and high halves of a register.
    #[inline(always)]
    unsafe fn load_pair(low: *const __m256i, high: *const __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(low)),
            _mm256_loadu_si256(high),
        )
    }

    /// Asks for the cache lines of one block's worth of bytes `ahead` bytes past `block`. A
    /// pair's rows are short runs (576 values: 18 blocks), which the hardware prefetcher does
    /// not pick up in time when the weights stream from memory (`examples/matmul_speed` with
    /// copies: Q4_1 98–115 GMAC/s without, 126–145 with). Into L2 (`T1`), as attention's
    /// pages: batch-16 decode won 14 of 15 alternating runs against `T0` (+2–4 % at 2
    /// threads). `wrapping_add`: the address may pass the end of the weights; a prefetch never
    /// faults.
    #[inline(always)]
    unsafe fn prefetch_ahead<B>(block: &B, ahead: usize) {
        let start = (block as *const B as *const i8).wrapping_add(ahead);
        for line in (0..size_of::<B>()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(line));
        }
    }

    /// Prefetches ahead in both groups' streams and returns pointers to the two blocks'
    /// weights (`qs`, the first field of either block type).
    #[inline(always)]
    unsafe fn start_blocks<B>(w0: &B, w1: &B, ahead: usize) -> (*const __m256i, *const __m256i) {
        prefetch_ahead(w0, ahead);
        prefetch_ahead(w1, ahead);
        (
            w0 as *const B as *const __m256i,
            w1 as *const B as *const __m256i,
        )
    }

    const _: () = assert!(
        std::mem::offset_of!(Q41GroupBlock, qs) == 0
            && std::mem::offset_of!(Q50GroupBlock, qs) == 0
            && std::mem::offset_of!(Q80GroupBlock, qs) == 0
            && std::mem::offset_of!(Q80PairBlock, qs) == 0
    );

    /// How far ahead to prefetch: the same block of the next pair of groups (which follows
    /// this pair in memory), so a pair's weights arrive while the pair before it is computed;
    /// at most `MAX_AHEAD` blocks ahead for long rows.
    fn prefetch_distance<B>(group: &[B]) -> usize {
        const MAX_AHEAD: usize = 64;
        (2 * group.len()).min(MAX_AHEAD) * size_of::<B>()
    }

    /// Both groups' eight f16 scales, as 16 floats.
    #[inline(always)]
    unsafe fn scales_pair(low: &[u16; 8], high: &[u16; 8]) -> __m512 {
        _mm512_cvtph_ps(_mm256_set_m128i(
            _mm_loadu_si128(high.as_ptr() as *const __m128i),
            _mm_loadu_si128(low.as_ptr() as *const __m128i),
        ))
    }

    /// Stores one token's 16 lanes (in row order) to its output, or the first 8 when the job
    /// holds one group. `token_rows` is a bounds-checked slice of exactly the job's rows, which
    /// `check_pair` allowed to be only 8 or 16: each store writes inside it.
    #[inline(always)]
    unsafe fn store_token(job: &mut GroupJob, token: usize, acc: __m512) {
        let out = job.token_rows(token);
        if out.len() == 2 * GROUP_ROWS {
            _mm512_storeu_ps(out.as_mut_ptr(), acc);
        } else {
            assert_eq!(out.len(), GROUP_ROWS, "a job of one or two groups");
            _mm256_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps256(acc));
        }
    }

    /// 16 rows × tokens `first..first + N` of two Q4_1 row groups.
    ///
    /// Each group block's 128 bytes are four 32-byte registers `[row 2p | row 2p+1]` (byte j:
    /// column j low nibble, column j+16 high). Two rounds of in-lane unpacks turn them into
    /// four registers whose lane i holds dword k of row `Q41_LANE_ROW[i]` (the order `d` and
    /// `m` are stored in); masking and shifting then gives columns 4k..4k+4 (low nibbles) and
    /// 16+4k..16+4k+4 (high), as unsigned bytes for `vpdpbusd`. The sums are put back in row
    /// order before they are stored.
    ///
    /// # Safety
    /// The CPU must support avx2, fma, f16c, avx512f, avx512bw, avx512vl and avx512vnni;
    /// `job` passed `check_pair` with these groups and `first + N <= job.tokens.end`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q41_tokens<const N: usize>(
        groups: [&[Q41GroupBlock]; 2],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let low_nibble = _mm512_set1_epi8(0x0F);
        let rows = token_rows::<N>(acts, first);
        let mut acc = [_mm512_setzero_ps(); N];
        let ahead = prefetch_distance(groups[0]);
        for (b, (w0, w1)) in groups[0].iter().zip(groups[1]).enumerate() {
            let (p0, p1) = start_blocks(w0, w1, ahead);
            // Plain loops, not `array::from_fn` or `map`: closures may stay out of line in a
            // `target_feature` function.
            let mut p = [_mm512_setzero_si512(); 4];
            for (i, p) in p.iter_mut().enumerate() {
                *p = load_pair(p0.add(i), p1.add(i));
            }
            let lo01 = _mm512_unpacklo_epi32(p[0], p[1]);
            let hi01 = _mm512_unpackhi_epi32(p[0], p[1]);
            let lo23 = _mm512_unpacklo_epi32(p[2], p[3]);
            let hi23 = _mm512_unpackhi_epi32(p[2], p[3]);
            let dwords = [
                _mm512_unpacklo_epi64(lo01, lo23),
                _mm512_unpackhi_epi64(lo01, lo23),
                _mm512_unpacklo_epi64(hi01, hi23),
                _mm512_unpackhi_epi64(hi01, hi23),
            ];
            let mut low = [_mm512_setzero_si512(); 4];
            let mut high = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                low[k] = _mm512_and_si512(dwords[k], low_nibble);
                high[k] = _mm512_and_si512(_mm512_srli_epi16(dwords[k], 4), low_nibble);
            }
            let d = scales_pair(&w0.d, &w1.d);
            let m = scales_pair(&w0.m, &w1.m);
            // Column dwords outermost: the tokens' sums are independent chains, interleaved.
            let a = blocks_at::<N>(&rows, b);
            let mut sumi = [_mm512_setzero_si512(); N];
            for k in 0..4 {
                for n in 0..N {
                    sumi[n] = _mm512_dpbusd_epi32(sumi[n], low[k], act_dword(&a[n].qs, k));
                }
                for n in 0..N {
                    sumi[n] = _mm512_dpbusd_epi32(sumi[n], high[k], act_dword(&a[n].qs, 4 + k));
                }
            }
            for n in 0..N {
                // The AVX2 kernel's float steps, in its order.
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(a[n].d));
                acc[n] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sumi[n]), acc[n]);
                acc[n] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[n].s), acc[n]);
            }
        }
        // Lane i holds row Q41_LANE_ROW[i % 8] of its group; row r sits in lane ROW_LANE[r].
        let row_order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
        for (n, acc) in acc.iter().enumerate() {
            store_token(job, first + n, _mm512_permutexvar_ps(row_order, *acc));
        }
    }

    /// As `q41_tokens`, for Q5_0: the same unpack, each value's fifth bit (16) added where
    /// `qh` has it, and `Σ q · x − 16 · Σ x` with the activations' exact integer sum: the
    /// AVX2 kernel's integer sums and float steps, per lane.
    ///
    /// # Safety
    /// As `q41_tokens`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn q50_tokens<const N: usize>(
        groups: [&[Q50GroupBlock]; 2],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let low_nibble = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(0x10);
        // Byte j of each dword tests bit j of the dword's low byte, copied to all four.
        let dword_base = _mm512_setr_epi32(
            0x0000_0000,
            0x0404_0404,
            0x0808_0808,
            0x0C0C_0C0C,
            0x0000_0000,
            0x0404_0404,
            0x0808_0808,
            0x0C0C_0C0C,
            0x0000_0000,
            0x0404_0404,
            0x0808_0808,
            0x0C0C_0C0C,
            0x0000_0000,
            0x0404_0404,
            0x0808_0808,
            0x0C0C_0C0C,
        );
        let bit_of_byte = _mm512_set1_epi32(0x0804_0201);
        let rows = token_rows::<N>(acts, first);
        let mut acc = [_mm512_setzero_ps(); N];
        let ahead = prefetch_distance(groups[0]);
        for (b, (w0, w1)) in groups[0].iter().zip(groups[1]).enumerate() {
            let (p0, p1) = start_blocks(w0, w1, ahead);
            let mut p = [_mm512_setzero_si512(); 4];
            for (i, p) in p.iter_mut().enumerate() {
                *p = load_pair(p0.add(i), p1.add(i));
            }
            let lo01 = _mm512_unpacklo_epi32(p[0], p[1]);
            let hi01 = _mm512_unpackhi_epi32(p[0], p[1]);
            let lo23 = _mm512_unpacklo_epi32(p[2], p[3]);
            let hi23 = _mm512_unpackhi_epi32(p[2], p[3]);
            let dwords = [
                _mm512_unpacklo_epi64(lo01, lo23),
                _mm512_unpackhi_epi64(lo01, lo23),
                _mm512_unpacklo_epi64(hi01, hi23),
                _mm512_unpackhi_epi64(hi01, hi23),
            ];
            // Lane i's row's fifth bits, in the lane order of the unpacked nibbles.
            let qh = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(w0.qh.as_ptr() as *const __m256i)),
                _mm256_loadu_si256(w1.qh.as_ptr() as *const __m256i),
                1,
            );
            let mut low = [_mm512_setzero_si512(); 4];
            let mut high = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                // Dword k holds values 4k..4k+4 (low nibbles) and 16+4k.. (high nibbles).
                let low_bits = fifth_bit_mask(qh, 4 * k as u32, dword_base, bit_of_byte);
                let high_bits = fifth_bit_mask(qh, 16 + 4 * k as u32, dword_base, bit_of_byte);
                low[k] = _mm512_and_si512(dwords[k], low_nibble);
                low[k] = _mm512_mask_add_epi8(low[k], low_bits, low[k], sixteen);
                high[k] = _mm512_and_si512(_mm512_srli_epi16(dwords[k], 4), low_nibble);
                high[k] = _mm512_mask_add_epi8(high[k], high_bits, high[k], sixteen);
            }
            let d = scales_pair(&w0.d, &w1.d);
            let a = blocks_at::<N>(&rows, b);
            let mut sumi = [_mm512_setzero_si512(); N];
            for k in 0..4 {
                for n in 0..N {
                    sumi[n] = _mm512_dpbusd_epi32(sumi[n], low[k], act_dword(&a[n].qs, k));
                }
                for n in 0..N {
                    sumi[n] = _mm512_dpbusd_epi32(sumi[n], high[k], act_dword(&a[n].qs, 4 + k));
                }
            }
            for n in 0..N {
                let sumi = _mm512_sub_epi32(sumi[n], _mm512_set1_epi32(16 * a[n].qsum));
                // The AVX2 kernel's float steps, in its order.
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(a[n].d));
                acc[n] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sumi), acc[n]);
            }
        }
        let row_order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
        for (n, acc) in acc.iter().enumerate() {
            store_token(job, first + n, _mm512_permutexvar_ps(row_order, *acc));
        }
    }

    /// A byte mask of the bytes whose value (`4k + j` for byte j of a dword) has its fifth
    /// bit set: each dword's bits `shift..shift + 4` of `qh`, byte j testing bit `shift + j`.
    ///
    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn fifth_bit_mask(
        qh: __m512i,
        shift: u32,
        dword_base: __m512i,
        bit_of_byte: __m512i,
    ) -> __mmask64 {
        let shifted = _mm512_srlv_epi32(qh, _mm512_set1_epi32(shift as i32));
        // Every byte of a dword gets the dword's low byte (shuffle within 128-bit lanes).
        let spread = _mm512_shuffle_epi8(shifted, dword_base);
        _mm512_test_epi8_mask(spread, bit_of_byte)
    }

    /// 16 rows × tokens `first..first + N` of two Q8_0 row groups.
    ///
    /// Each group block's 8 rows of 32 signed bytes are transposed 8×8 in dwords (lane = row,
    /// in row order). `vpdpbusd` wants one unsigned operand: the weights get +128 (a sign-bit
    /// flip), and each token's sum starts at −128·Σqs of its activation block, so what the
    /// lane ends with is exactly Σ w·a.
    ///
    /// # Safety
    /// As `q41_tokens`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q80_tokens<const N: usize>(
        groups: [&[Q80GroupBlock]; 2],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let sign_bits = _mm512_set1_epi8(i8::MIN);
        // 128-bit lanes [top 0, bottom 0, top 2, bottom 2] and [top 1, bottom 1, top 3,
        // bottom 3]: what `permute2x128` 0x20 / 0x31 does in each 256-bit half.
        let even_lanes = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let odd_lanes = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        let rows = token_rows::<N>(acts, first);
        let mut acc = [_mm512_setzero_ps(); N];
        let ahead = prefetch_distance(groups[0]);
        for (b, (w0, w1)) in groups[0].iter().zip(groups[1]).enumerate() {
            let (p0, p1) = start_blocks(w0, w1, ahead);
            // Plain loops, as in `q41_tokens`.
            let mut r = [_mm512_setzero_si512(); 8];
            for (i, r) in r.iter_mut().enumerate() {
                *r = load_pair(p0.add(i), p1.add(i));
            }
            // Rows (a, b) → [a0 b0 a1 b1 | a4 b4 a5 b5] and [a2 b2 a3 b3 | a6 b6 a7 b7].
            let mut s = [_mm512_setzero_si512(); 8];
            for pair in 0..4 {
                s[2 * pair] = _mm512_unpacklo_epi32(r[2 * pair], r[2 * pair + 1]);
                s[2 * pair + 1] = _mm512_unpackhi_epi32(r[2 * pair], r[2 * pair + 1]);
            }
            // Rows 0-3 (from s0..s3) and 4-7 (s4..s7): half[j] holds dwords j | j+4.
            let mut halves = [[_mm512_setzero_si512(); 4]; 2];
            for (half, base) in halves.iter_mut().zip([0, 4]) {
                half[0] = _mm512_unpacklo_epi64(s[base], s[base + 2]);
                half[1] = _mm512_unpackhi_epi64(s[base], s[base + 2]);
                half[2] = _mm512_unpacklo_epi64(s[base + 1], s[base + 3]);
                half[3] = _mm512_unpackhi_epi64(s[base + 1], s[base + 3]);
            }
            let mut biased = [_mm512_setzero_si512(); 8];
            for j in 0..4 {
                let (top, bottom) = (halves[0][j], halves[1][j]);
                biased[j] = _mm512_xor_si512(
                    _mm512_permutex2var_epi64(top, even_lanes, bottom),
                    sign_bits,
                );
                biased[j + 4] =
                    _mm512_xor_si512(_mm512_permutex2var_epi64(top, odd_lanes, bottom), sign_bits);
            }
            let d = scales_pair(&w0.d, &w1.d);
            q80_block_sums(&biased, d, &blocks_at::<N>(&rows, b), &mut acc);
        }
        for (n, acc) in acc.iter().enumerate() {
            store_token(job, first + n, *acc);
        }
    }

    /// One block of a Q8_0 pair for N tokens, from its turned, biased weights `biased` (lane =
    /// row, register k = columns 4k..4k+4) and its 16 scales `d`: each token's sum starts at
    /// −128·Σqs of its activation block, so what the lane ends with is exactly Σ w·a, and is
    /// scaled into `acc` with the AVX2 kernel's float steps, in its order.
    #[inline(always)]
    unsafe fn q80_block_sums<const N: usize>(
        biased: &[__m512i; 8],
        d: __m512,
        a: &[&ActBlock; N],
        acc: &mut [__m512; N],
    ) {
        let mut sumi = [_mm512_setzero_si512(); N];
        for n in 0..N {
            sumi[n] = _mm512_set1_epi32(-128 * a[n].qsum);
        }
        // Column dwords outermost, as in `q41_tokens`.
        for (k, weights) in biased.iter().enumerate() {
            for n in 0..N {
                sumi[n] = _mm512_dpbusd_epi32(sumi[n], *weights, act_dword(&a[n].qs, k));
            }
        }
        for n in 0..N {
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(a[n].d));
            acc[n] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sumi[n]), acc[n]);
        }
    }

    /// 16 rows × tokens `first..first + N` of a pair of Q8_0 groups already turned
    /// ([`Q80PairBlock`]): `q80_tokens` with its `biased` registers as eight plain loads.
    ///
    /// # Safety
    /// As `q41_tokens`, with `job` checked against `pairs`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q80_turned_tokens<const N: usize>(
        pairs: &[Q80PairBlock],
        job: &mut GroupJob,
        first: usize,
    ) {
        let acts = job.acts;
        let rows = token_rows::<N>(acts, first);
        let mut acc = [_mm512_setzero_ps(); N];
        // One pair's row of blocks ahead: the same bytes ahead as `q80_tokens` asks for.
        let ahead = pairs.len().min(32) * size_of::<Q80PairBlock>();
        for (b, w) in pairs.iter().enumerate() {
            prefetch_ahead(w, ahead);
            let p = w as *const Q80PairBlock as *const __m512i;
            let mut biased = [_mm512_setzero_si512(); 8];
            for (k, weights) in biased.iter_mut().enumerate() {
                *weights = _mm512_loadu_si512(p.add(k));
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr() as *const __m256i));
            q80_block_sums(&biased, d, &blocks_at::<N>(&rows, b), &mut acc);
        }
        for (n, acc) in acc.iter().enumerate() {
            store_token(job, first + n, *acc);
        }
    }
}
