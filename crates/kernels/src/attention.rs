//! Grouped-query attention over f16 K/V pages for the fast backends. One call serves every
//! query head that shares a K/V head, so each key and value is widened from f16 once per
//! group instead of once per head, and scores, softmax and the weighted sum of values stay in
//! registers and one reused scratch buffer.
//!
//! The AVX2 kernel computes each head the same way whatever the group size: a request's bits
//! do not depend on how many heads shared the call (tested). `Scalar` runs the plain
//! per-head arithmetic (`ops::attention_scores_f16` and friends) that the SIMD version is
//! tested against within float tolerance.

use crate::{avx2, ops, Backend};
use half::f16;

/// Positions `0..len` of one K/V head, held in pages of `page_size` positions: `keys[p]` and
/// `values[p]` are page p's slots for this head, `head_dim` f16 each.
pub struct KvHeadAttention<'a> {
    pub keys: &'a [&'a [f16]],
    pub values: &'a [&'a [f16]],
    pub page_size: usize,
    pub head_dim: usize,
    pub len: usize,
    /// Multiplies every score (1/√head_dim).
    pub scale: f32,
}

impl KvHeadAttention<'_> {
    /// For each query head g of `queries` (`heads × head_dim`, all reading this K/V head),
    /// `out[g] = softmax(scale · K·q_g) · V`, with Q and the probabilities rounded to f16 as
    /// the reference multiplies them against the f16 cache.
    pub fn run(&self, backend: Backend, queries: &[f32], out: &mut [f32]) {
        self.check(queries, out);
        match backend {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 | Backend::Avx512Vnni if avx2::attention_fits(self.head_dim) => {
                avx2::attend_kv_head(self, backend, queries, out)
            }
            _ => self.run_per_head(backend, queries, out),
        }
    }

    /// The bounds every implementation relies on: whole heads, and pages enough for `len`
    /// positions, each holding `page_size` slots.
    pub(crate) fn check(&self, queries: &[f32], out: &[f32]) {
        assert!(
            self.head_dim > 0 && self.len > 0 && self.page_size > 0,
            "a head, a position and a page size"
        );
        assert!(
            queries.len().is_multiple_of(self.head_dim) && out.len() == queries.len(),
            "whole query heads and an output for each"
        );
        let pages = self.len.div_ceil(self.page_size);
        assert!(
            self.keys.len() >= pages && self.values.len() >= pages,
            "a page for every position"
        );
        let page_elems = self
            .page_size
            .checked_mul(self.head_dim)
            .expect("a page's size fits in memory");
        assert!(
            self.keys[..pages]
                .iter()
                .chain(&self.values[..pages])
                .all(|page| page.len() >= page_elems),
            "whole pages"
        );
    }

    /// The written values among slots `slots` of page `page`: a range within that page's
    /// `page_size × head_dim` values, or `None` when none of those slots holds a position
    /// below `len` (slots past it may hold an earlier owner's bytes: not even a prefetch
    /// goes there).
    pub(crate) fn written_slots(
        &self,
        page: usize,
        slots: std::ops::Range<usize>,
    ) -> Option<std::ops::Range<usize>> {
        let first = page.checked_mul(self.page_size)?;
        let written = self.len.checked_sub(first)?.min(self.page_size);
        let end = slots.end.min(written);
        (slots.start < end).then(|| slots.start * self.head_dim..end * self.head_dim)
    }

    /// One head at a time, page by page: the plain arithmetic.
    pub(crate) fn run_per_head(&self, backend: Backend, queries: &[f32], out: &mut [f32]) {
        let heads = queries
            .chunks_exact(self.head_dim)
            .zip(out.chunks_exact_mut(self.head_dim));
        for (q, out) in heads {
            let mut scores = vec![0f32; self.len];
            let q: Vec<f32> = q.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
            for (page, scores) in scores.chunks_mut(self.page_size).enumerate() {
                ops::attention_scores_f16(backend, &q, self.keys[page], self.scale, scores);
            }
            ops::softmax_in_place(backend, &mut scores);
            out.fill(0.0);
            for (page, weights) in scores.chunks(self.page_size).enumerate() {
                ops::attention_mix_f16(backend, weights, self.values[page], out);
            }
        }
    }
}
