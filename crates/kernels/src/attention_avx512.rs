//! The grouped attention kernels in AVX-512: 16 keys or 16 values per register, the same
//! chains of FMAs as the AVX2 kernels (`attention.rs`), so the same bits. A run of fewer than
//! 16 keys is loaded under a mask, which reads nothing past the run: a slot past `len` may
//! hold an earlier owner's bytes.

use crate::attention::{GroupedKernels, RowBlock, RowKernels};

/// Whether these kernels take a head of `head_dim` values on this CPU (whole registers).
pub(crate) fn fits(head_dim: usize) -> bool {
    crate::backend::has_avx512_vnni() && head_dim.is_multiple_of(16)
}

/// The AVX-512 grouped attention kernels, for a head size that [`fits`].
pub(crate) const KERNELS: GroupedKernels = GroupedKernels {
    scores: x86::scores_of_heads,
    mix: x86::mix_of_heads,
};

/// Positions per run of the row-block kernels: one register of keys, widened to f32 once for
/// every row of a block.
pub(crate) const TILE_POSITIONS: usize = 16;

/// The AVX-512 row-block kernels, for a head size that [`fits`].
pub(crate) const ROW_KERNELS: RowKernels = RowKernels {
    positions: TILE_POSITIONS,
    scores: scores_of_rows,
    mix: mix_of_rows,
};

/// Every row's scores for `g` heads (1 to `HEADS_PER_PASS`): `probs[i × probs_stride + h ×
/// len + pos]` for row i's head h and its positions, each `attention::score_dot` of its
/// rounded query `q[i × q_stride + h × head_dim..]`, as `scores_of_heads` computes it for the
/// row alone.
///
/// # Safety
/// The CPU must support avx512f/bw/vl, fma and f16c; `att` passed `KvHeadAttention::check`
/// with `head_dim` a multiple of 16 and `len` the last row's; `tile` holds
/// `TILE_POSITIONS × head_dim` values.
pub(crate) unsafe fn scores_of_rows(
    att: &crate::KvHeadAttention,
    block: &RowBlock,
    g: usize,
    q: &[f32],
    probs: &mut [f32],
    tile: &mut [f32],
) {
    block.check(att, g, q, probs, tile, TILE_POSITIONS);
    // SAFETY: the caller's contract; the bounds of every slice just checked.
    unsafe {
        match g {
            3 => x86::scores_of_rows::<3>(att, block, q, probs, tile),
            2 => x86::scores_of_rows::<2>(att, block, q, probs, tile),
            _ => x86::scores_of_rows::<1>(att, block, q, probs, tile),
        }
    }
}

/// Every row's mix for `g` heads: `out[i × q_stride + h × head_dim..]` gains
/// `Σ_pos probs[i × probs_stride + h × len + pos] · value_pos` over row i's positions, each
/// output value one chain of FMAs in position order from what `out` held (zero for the bits
/// of `mix_of_heads`).
///
/// # Safety
/// As [`scores_of_rows`], with `probs` the rows' probabilities and `out` strided as `q`.
pub(crate) unsafe fn mix_of_rows(
    att: &crate::KvHeadAttention,
    block: &RowBlock,
    g: usize,
    probs: &[f32],
    out: &mut [f32],
    tile: &mut [f32],
) {
    block.check(att, g, out, probs, tile, TILE_POSITIONS);
    // SAFETY: the caller's contract; the bounds of every slice just checked.
    unsafe {
        match g {
            3 => x86::mix_of_rows::<3>(att, block, probs, out, tile),
            2 => x86::mix_of_rows::<2>(att, block, probs, out, tile),
            _ => x86::mix_of_rows::<1>(att, block, probs, out, tile),
        }
    }
}

/// One row of `ops::attention_softmax_rows`, in AVX-512.
///
/// # Safety
/// The CPU must support avx512f, bw, vl and f16c.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(crate) unsafe fn softmax_row_to_f16(row: &mut [f32]) {
    use crate::expf::x86_512::first_lanes as lanes;
    use std::arch::x86_64::*;
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    for chunk in row.chunks(16) {
        // SAFETY: a masked load reads only the chunk's lanes.
        let v = unsafe { _mm512_mask_loadu_ps(max, lanes(chunk.len()), chunk.as_ptr()) };
        max = _mm512_max_ps(max, v);
    }
    let max = _mm512_reduce_max_ps(max);
    // SAFETY: the CPU has avx512f and avx512vl (this function's contract); `max` is the
    // row's largest value.
    let sums = unsafe { crate::expf::x86_512::exp_shifted_lane_sums(row, max) };
    let inv = _mm512_set1_ps((1.0 / crate::ops::fold_lanes(sums)) as f32);
    for chunk in row.chunks_mut(16) {
        let mask = lanes(chunk.len());
        // SAFETY: masked loads and stores touch only the chunk's lanes.
        unsafe {
            let p = _mm512_maskz_loadu_ps(mask, chunk.as_ptr());
            let half = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm512_mul_ps(p, inv));
            _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, _mm512_cvtph_ps(half));
        }
    }
}

// Inside these functions nearly every line is an intrinsic; the safety contract is the
// function's (`# Safety`), so the bodies are not split into per-line unsafe blocks.
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use super::TILE_POSITIONS;
    use crate::attention::{KvHeadAttention, RowBlock, RunPrefetch};
    use crate::expf::x86_512::first_lanes;
    use std::arch::x86_64::*;

    /// `probs[g * len + pos] = scale · (q_g · key_pos)` for the heads of `q` (one to
    /// `HEADS_PER_PASS`), each dot product `attention::score_dot`.
    ///
    /// # Safety
    /// The CPU must support avx512f/bw/vl, fma and f16c; `att` passed `KvHeadAttention::check`
    /// with `head_dim` a multiple of 16; `q` holds whole heads and `probs` `len` values for each.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn scores_of_heads(att: &KvHeadAttention, q: &[f32], probs: &mut [f32]) {
        match q.len() / att.head_dim {
            3 => scores::<3>(att, q, probs),
            2 => scores::<2>(att, q, probs),
            _ => scores::<1>(att, q, probs),
        }
    }

    /// `scores_of_heads` for G heads, one run of up to 16 keys at a time: 8 lane sums per
    /// head in registers (24 of the 32 for three heads).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn scores<const G: usize>(att: &KvHeadAttention, q: &[f32], probs: &mut [f32]) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        assert!(q.len() == G * hd && probs.len() == G * len, "G heads");
        let q = q.as_ptr();
        let scale = _mm512_set1_ps(att.scale);
        for run in att.key_runs(16) {
            let mask = first_lanes(run.n);
            let keys = att.keys[run.page].as_ptr().add(run.slot);
            let prefetch = RunPrefetch::new(att, run);
            let mut lanes = [[_mm512_setzero_ps(); 8]; G];
            for c in 0..hd / 8 {
                // The page ahead is `hd / 2` lines: four per step.
                for line in 4 * c..4 * c + 4 {
                    prefetch.line(line);
                }
                for l in 0..8 {
                    let d = 8 * c + l;
                    // A masked load reads only the run's slots (faults suppressed past them).
                    let at = keys.add(d * ps) as *const i16;
                    let k = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at));
                    for (g, lanes) in lanes.iter_mut().enumerate() {
                        let qd = _mm512_set1_ps(*q.add(g * hd + d));
                        lanes[l] = _mm512_fmadd_ps(qd, k, lanes[l]);
                    }
                }
            }
            // The run's keys in whole groups of four of the page's written slots fold in pairs,
            // the rest in halves (`attention::Fold::of_slot`).
            let written = (len - run.page * ps).min(ps);
            let pairs = (written / 4 * 4).saturating_sub(run.slot).min(run.n);
            for (g, l) in lanes.iter().enumerate() {
                let add = |a, b| _mm512_add_ps(a, b);
                let by_pairs = add(
                    add(add(l[0], l[1]), add(l[2], l[3])),
                    add(add(l[4], l[5]), add(l[6], l[7])),
                );
                let dot = if pairs == run.n {
                    by_pairs
                } else {
                    let by_halves = add(
                        add(add(l[0], l[4]), add(l[2], l[6])),
                        add(add(l[1], l[5]), add(l[3], l[7])),
                    );
                    _mm512_mask_blend_ps(first_lanes(pairs), by_halves, by_pairs)
                };
                let dst = probs.as_mut_ptr().add(g * len + run.pos(ps));
                _mm512_mask_storeu_ps(dst, mask, _mm512_mul_ps(dot, scale));
            }
        }
    }

    /// The mix for the heads of `out` (one to `HEADS_PER_PASS`).
    ///
    /// # Safety
    /// As `scores_of_heads`, with `probs` `len` values and `out` an output head for each head.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn mix_of_heads(att: &KvHeadAttention, probs: &[f32], out: &mut [f32]) {
        match probs.len() / att.len {
            3 => mix::<3>(att, probs, out),
            2 => mix::<2>(att, probs, out),
            _ => mix::<1>(att, probs, out),
        }
    }

    /// `out[g] = Σ_pos probs[g * len + pos] · value_pos` for the G heads of `out`, 64 values
    /// of each head per pass so the sums stay in registers. Each output value is one chain
    /// of FMAs in position order, whatever G is.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn mix<const G: usize>(att: &KvHeadAttention, probs: &[f32], out: &mut [f32]) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        assert!(out.len() == G * hd && probs.len() == G * len, "G heads");
        for part in (0..hd).step_by(64) {
            let chunks = ((hd - part) / 16).min(4);
            let mut acc = [[_mm512_setzero_ps(); 4]; G];
            for (page, values) in att.values.iter().enumerate().take(len.div_ceil(ps)) {
                let first = page * ps;
                let slots = (len - first).min(ps);
                for slot in 0..slots {
                    let value = values.as_ptr().add(slot * hd + part);
                    let w: [__m512; G] = std::array::from_fn(|g| {
                        _mm512_set1_ps(*probs.get_unchecked(g * len + first + slot))
                    });
                    for c in 0..chunks {
                        let v = _mm512_cvtph_ps(_mm256_loadu_si256(
                            value.add(16 * c) as *const __m256i
                        ));
                        for (acc, w) in acc.iter_mut().zip(&w) {
                            acc[c] = _mm512_fmadd_ps(*w, v, acc[c]);
                        }
                    }
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                for (c, acc) in acc.iter().enumerate().take(chunks) {
                    _mm512_storeu_ps(out.as_mut_ptr().add(g * hd + part + 16 * c), *acc);
                }
            }
        }
    }

    /// `super::scores_of_rows` for G heads: each run of up to 16 keys is widened into `tile`
    /// (dimension-major, 16 to a dimension) once, then scored for every row that reaches it
    /// with the chains of `scores`, folded by that row's own written slots of the page.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn scores_of_rows<const G: usize>(
        att: &KvHeadAttention,
        block: &RowBlock,
        q: &[f32],
        probs: &mut [f32],
        tile: &mut [f32],
    ) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        let scale = _mm512_set1_ps(att.scale);
        let tile = tile.as_mut_ptr();
        for run in att.key_runs(TILE_POSITIONS) {
            let mask = first_lanes(run.n);
            let keys = att.keys[run.page].as_ptr().add(run.slot);
            let prefetch = RunPrefetch::new(att, run);
            for d in 0..hd {
                if d % 2 == 0 {
                    prefetch.line(d / 2);
                }
                // A masked load reads only the run's slots (faults suppressed past them);
                // the lanes past the run widen to 0.
                let at = keys.add(d * ps) as *const i16;
                let k = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at));
                _mm512_storeu_ps(tile.add(d * TILE_POSITIONS), k);
            }
            let pos = run.pos(ps);
            for i in block.first_row_at(pos)..block.rows {
                let row_len = block.first_len + i;
                let n = run.n.min(row_len - pos);
                let q = q.as_ptr().add(i * block.q_stride);
                let mut lanes = [[_mm512_setzero_ps(); 8]; G];
                for c in 0..hd / 8 {
                    for l in 0..8 {
                        let d = 8 * c + l;
                        let k = _mm512_loadu_ps(tile.add(d * TILE_POSITIONS));
                        for (g, lanes) in lanes.iter_mut().enumerate() {
                            let qd = _mm512_set1_ps(*q.add(g * hd + d));
                            lanes[l] = _mm512_fmadd_ps(qd, k, lanes[l]);
                        }
                    }
                }
                // As `scores`, with this row's written slots of the page and its run.
                let written = (row_len - run.page * ps).min(ps);
                let pairs = (written / 4 * 4).saturating_sub(run.slot).min(n);
                let row = probs.as_mut_ptr().add(i * block.probs_stride);
                for (g, l) in lanes.iter().enumerate() {
                    let add = |a, b| _mm512_add_ps(a, b);
                    let by_pairs = add(
                        add(add(l[0], l[1]), add(l[2], l[3])),
                        add(add(l[4], l[5]), add(l[6], l[7])),
                    );
                    let dot = if pairs == n {
                        by_pairs
                    } else {
                        let by_halves = add(
                            add(add(l[0], l[4]), add(l[2], l[6])),
                            add(add(l[1], l[5]), add(l[3], l[7])),
                        );
                        _mm512_mask_blend_ps(first_lanes(pairs), by_halves, by_pairs)
                    };
                    let dst = row.add(g * len + pos);
                    _mm512_mask_storeu_ps(dst, first_lanes(n), _mm512_mul_ps(dot, scale));
                }
            }
        }
    }

    /// `super::mix_of_rows` for G heads: each run of up to 16 values is widened into `tile`
    /// (slot-major) once, then added into every row that reaches it, 64 values of each head
    /// at a time, the sums loaded from and stored back to `out` around the run.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn mix_of_rows<const G: usize>(
        att: &KvHeadAttention,
        block: &RowBlock,
        probs: &[f32],
        out: &mut [f32],
        tile: &mut [f32],
    ) {
        let (hd, len, ps) = (att.head_dim, att.len, att.page_size);
        let tile = tile.as_mut_ptr();
        for run in att.key_runs(TILE_POSITIONS) {
            let values = att.values[run.page].as_ptr().add(run.slot * hd);
            for i in (0..run.n * hd).step_by(16) {
                let v = _mm512_cvtph_ps(_mm256_loadu_si256(values.add(i) as *const __m256i));
                _mm512_storeu_ps(tile.add(i), v);
            }
            let pos = run.pos(ps);
            for i in block.first_row_at(pos)..block.rows {
                let n = run.n.min(block.first_len + i - pos);
                let p = probs.as_ptr().add(i * block.probs_stride + pos);
                let row = out.as_mut_ptr().add(i * block.q_stride);
                for part in (0..hd).step_by(64) {
                    let (out, tile) = (row.add(part), tile.add(part) as *const f32);
                    match (hd - part) / 16 {
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
    /// `p` (heads `len` apart). Whole registers, so the sums stay in registers across the run.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[inline]
    unsafe fn mix_run<const G: usize, const C: usize>(
        out: *mut f32,
        p: *const f32,
        tile: *const f32,
        n: usize,
        hd: usize,
        len: usize,
    ) {
        let mut acc: [[__m512; C]; G] = std::array::from_fn(|g| {
            std::array::from_fn(|c| _mm512_loadu_ps(out.add(g * hd + 16 * c)))
        });
        for slot in 0..n {
            let w: [__m512; G] = std::array::from_fn(|g| _mm512_set1_ps(*p.add(g * len + slot)));
            for c in 0..C {
                let v = _mm512_loadu_ps(tile.add(slot * hd + 16 * c));
                for (acc, w) in acc.iter_mut().zip(&w) {
                    acc[c] = _mm512_fmadd_ps(*w, v, acc[c]);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (c, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(g * hd + 16 * c), *acc);
            }
        }
    }
}
