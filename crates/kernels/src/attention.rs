//! Grouped-query attention over f16 K/V pages for the fast backends. One call serves every
//! query head that shares a K/V head, so each key and value is widened from f16 once per
//! group instead of once per head, and scores, softmax and the weighted sum of values stay in
//! registers and one reused scratch buffer.
//!
//! **Page layout.** One head's slots of a page hold its keys *dimension-major*
//! (`keys[d * page_size + slot]`, [`key_index`]) and its values slot-major
//! (`values[slot * head_dim + d]`). With keys dimension-major, one register load holds
//! dimension d of 8 or 16 consecutive keys, so a score is one chain of FMAs over d in its own
//! lane, with no reduction across lanes, and the same chain whatever the register width, the
//! number of heads or rows that share the call, or the step (prefill or decode). Values
//! slot-major make each output value one chain of FMAs over positions, the same way.
//!
//! Every SIMD kernel computes each score as `fma(q[d], k[d], acc)` for d = 0, 1, … from
//! zero, then times the scale, and each output value as `fma(p_pos, v_pos[d], acc)` over
//! positions in order: the AVX2 and AVX-512 kernels agree bit for bit, and a head's bits do
//! not depend on how many heads shared the call (tested). `Scalar` runs the plain per-head
//! arithmetic (`ops::attention_scores_f16` and friends) that the SIMD versions are tested
//! against within float tolerance.

#[cfg(target_arch = "x86_64")]
use crate::attention_avx512;
use crate::{avx2, ops, Backend};
use half::f16;

/// Where dimension `d` of the key in slot `slot` lies in one head's keys of a page of
/// `page_size` slots.
#[inline(always)]
pub fn key_index(page_size: usize, slot: usize, d: usize) -> usize {
    d * page_size + slot
}

/// How the 8 lane sums of a score are folded ([`score_dot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fold {
    /// `((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))`, as two rounds of `_mm256_hadd_ps` over
    /// four keys' sums fold them.
    Pairs,
    /// `((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))`, as a one-register `hsum` folds them.
    Halves,
}

impl Fold {
    /// The fold of the key in slot `slot` of a page whose first `written` slots hold
    /// positions below `len`: whole groups of four take [`Fold::Pairs`], the last one to
    /// three [`Fold::Halves`].
    #[inline(always)]
    pub fn of_slot(slot: usize, written: usize) -> Fold {
        if slot < written / 4 * 4 {
            Fold::Pairs
        } else {
            Fold::Halves
        }
    }

    #[inline(always)]
    pub fn apply(self, l: [f32; 8]) -> f32 {
        match self {
            Fold::Pairs => ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])),
            Fold::Halves => ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])),
        }
    }
}

/// The dot product of every attention score: 8 lane sums, lane l a chain of fused
/// multiply-adds from zero over dimensions l, l + 8, l + 16, …, folded by `fold`. This is,
/// bit for bit, what the slot-major AVX2 kernel computed before keys were laid out
/// dimension-major (2026-12-06): it scored four keys at a time, 8 dimensions to a register,
/// and the keys left over one at a time, hence the two folds. Kept so that the layout change
/// moved no output (greedy agreement with llama.cpp rests on near-ties; ARCHITECTURE.md).
/// With keys dimension-major a register holds one lane of 8 or 16 keys, so the SIMD kernels
/// compute exactly this, with no shuffles.
#[inline(always)]
pub(crate) fn score_dot(q: &[f32], key: impl Fn(usize) -> f32, fold: Fold) -> f32 {
    let mut lanes = [0f32; 8];
    for (d, &q) in q.iter().enumerate() {
        lanes[d % 8] = q.mul_add(key(d), lanes[d % 8]);
    }
    fold.apply(lanes)
}

/// Writes `key` (rounded to f16) into slot `slot` of one head's keys of a page of `page_size`
/// slots.
pub fn store_key(keys: &mut [f16], page_size: usize, slot: usize, key: &[f32]) {
    assert!(
        slot < page_size && keys.len() >= key.len() * page_size,
        "a slot of a whole page"
    );
    for (d, &value) in key.iter().enumerate() {
        keys[key_index(page_size, slot, d)] = f16::from_f32(value);
    }
}

/// Reads the key in slot `slot` of one head's keys of a page into `key` (widened to f32).
pub fn load_key(keys: &[f16], page_size: usize, slot: usize, key: &mut [f32]) {
    for (d, value) in key.iter_mut().enumerate() {
        *value = keys[key_index(page_size, slot, d)].to_f32();
    }
}

/// Positions `0..len` of one K/V head, held in pages of `page_size` positions: `keys[p]` and
/// `values[p]` are page p's slots for this head, `page_size × head_dim` f16 each, laid out as
/// the module says.
#[derive(Clone, Copy)]
pub struct KvHeadAttention<'a> {
    pub keys: &'a [&'a [f16]],
    pub values: &'a [&'a [f16]],
    pub page_size: usize,
    pub head_dim: usize,
    pub len: usize,
    /// Positions below this get no weight (a sliding window's start, within the first page
    /// given; 0 attends to every position).
    pub masked: usize,
    /// Multiplies every score (1/√head_dim).
    pub scale: f32,
}

/// Query heads per scores/mix pass of the SIMD kernels: their accumulators fill the registers.
pub(crate) const HEADS_PER_PASS: usize = 3;

/// One ISA's scores and mix passes over up to [`HEADS_PER_PASS`] heads (`q`: their rounded
/// queries; `probs`: `heads × len`; `out`: their outputs).
#[cfg(target_arch = "x86_64")]
pub(crate) struct GroupedKernels {
    /// # Safety
    /// The CPU has the kernel's features; `att` passed `check`; `q` holds whole heads.
    pub scores: unsafe fn(&KvHeadAttention, &[f32], &mut [f32]),
    /// # Safety
    /// As `scores`, with `probs` `heads × len` values and `out` the heads' outputs.
    pub mix: unsafe fn(&KvHeadAttention, &[f32], &mut [f32]),
}

/// A block of query rows at consecutive positions of one sequence
/// (`KvHeadAttention::run_rows`): row i attends to `first_len + i` positions; its queries
/// start `q_stride` values after row i − 1's, its scores `probs_stride` after.
pub(crate) struct RowBlock {
    pub rows: usize,
    pub first_len: usize,
    pub q_stride: usize,
    pub probs_stride: usize,
}

impl RowBlock {
    /// The first row that attends to position `pos`.
    pub fn first_row_at(&self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.first_len)
    }

    /// The bounds a row kernel relies on for `g` heads: `by_q` strided as the queries (the
    /// queries, or the outputs) and `by_probs` as the scores each hold every row's heads,
    /// `tile` holds `positions` keys or values, and `att.len` is the last row's.
    pub fn check(
        &self,
        att: &KvHeadAttention,
        g: usize,
        by_q: &[f32],
        by_probs: &[f32],
        tile: &[f32],
        positions: usize,
    ) {
        let last = self.rows - 1;
        assert!(
            by_q.len() >= last * self.q_stride + g * att.head_dim
                && by_probs.len() >= last * self.probs_stride + g * att.len
                && tile.len() >= positions * att.head_dim
                && self.first_len + last == att.len,
            "a block's rows, scores and tile"
        );
    }
}

/// A row-block pass (`RowKernels`): the attention, the block, `g` heads, the rows' queries or
/// probabilities, the rows' scores or outputs, and the tile.
#[cfg(target_arch = "x86_64")]
pub(crate) type RowPass =
    unsafe fn(&KvHeadAttention, &RowBlock, usize, &[f32], &mut [f32], &mut [f32]);

/// One ISA's row-block passes over `g` heads (1 to [`HEADS_PER_PASS`]): each run of
/// `positions` keys, then values, widened into `tile` (`positions × head_dim` values) once
/// for every row of the block.
#[cfg(target_arch = "x86_64")]
pub(crate) struct RowKernels {
    pub positions: usize,
    /// Every row's scores: `probs[i × probs_stride + h × len + pos]` for row i's head h, each
    /// the `score_dot` the row gets alone, from `q[i × q_stride + h × head_dim..]`.
    ///
    /// # Safety
    /// The CPU has the kernels' features; `att` passed `check` with `len` the last row's and
    /// a head size the kernels take; `tile` holds `positions × head_dim` values.
    pub scores: RowPass,
    /// Every row's mix into `out` (strided as `q`), each output value the row's chain of FMAs
    /// in position order from what `out` held.
    ///
    /// # Safety
    /// As `scores`, with `probs` the rows' probabilities.
    pub mix: RowPass,
}

/// Up to a register's worth of consecutive slots of one page, all below `len`: the keys one
/// register load of a scores kernel holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyRun {
    pub page: usize,
    pub slot: usize,
    /// Slots in the run, `1..=lanes`.
    pub n: usize,
}

impl KeyRun {
    /// The position of the run's first slot.
    pub fn pos(&self, page_size: usize) -> usize {
        self.page * page_size + self.slot
    }
}

/// How many pages ahead of the keys being scored their successors' keys are requested: about
/// one pass of a scores kernel on. Pages are scattered and one head's slots of a page are only
/// `page_size × head_dim` values, too short a run for the hardware prefetcher to pick up
/// before it ends.
const KEY_PAGES_AHEAD: usize = 4;

/// What a scores kernel asks for while it scores one run: when the run starts a page, the
/// keys of the page [`KEY_PAGES_AHEAD`] on, if that page is whole (a dimension-major page
/// interleaves written and unwritten slots, and slots past `len` may hold an earlier
/// owner's bytes: not even a prefetch goes there). One line every other dimension step, so
/// the requests spread over the pass instead of filling the core's miss buffers in one burst;
/// into L2 (`T1`), not L1, whose few miss buffers a burst would hold up.
///
/// Measured with `examples/attention_speed` (2026-12-06, one thread): 16 sequences × 500
/// positions from DRAM 24.0 → 21.7 ms per step; one sequence of 2,048 from L3 31.8 → 34.2 µs
/// per task and from L2 20.6 → 24.0 µs, at every step (values as well, as the slot-major
/// kernel did: 20.7, 41.3 and 27.0).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct RunPrefetch {
    start: *const i8,
    bytes: usize,
}

#[cfg(target_arch = "x86_64")]
impl RunPrefetch {
    pub fn new(att: &KvHeadAttention, run: KeyRun) -> RunPrefetch {
        let ahead = run.page + KEY_PAGES_AHEAD;
        match att.keys.get(ahead) {
            Some(page) if run.slot == 0 && att.page_is_full(ahead) => RunPrefetch {
                start: page.as_ptr() as *const i8,
                bytes: att.page_size * att.head_dim * std::mem::size_of::<f16>(),
            },
            _ => RunPrefetch {
                start: std::ptr::null(),
                bytes: 0,
            },
        }
    }

    /// Asks for line `line` of the page ahead, if it has one (the kernels call this once per
    /// two dimension steps).
    #[inline(always)]
    pub fn line(&self, line: usize) {
        let offset = line * 64;
        if offset < self.bytes {
            // SAFETY: a prefetch never faults, and `offset` is inside the page's slice.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    self.start.add(offset),
                )
            };
        }
    }
}

thread_local! {
    /// The grouped kernels' rounded queries and scores, reused across calls on this thread.
    static ATTENTION_SCRATCH: std::cell::RefCell<Vec<f32>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// The first `len` values of `scratch`, grown to hold them if it must. What an earlier call
/// left there is not cleared: the kernels write every query, score and tile value before they
/// read it. (Clearing a block's scores, up to 2 MiB, cost 1 % of prefill at 8,192 tokens.)
#[cfg(target_arch = "x86_64")]
fn at_least(scratch: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if scratch.len() < len {
        scratch.resize(len, 0.0);
    }
    &mut scratch[..len]
}

impl KvHeadAttention<'_> {
    /// For each query head g of `queries` (`heads × head_dim`, all reading this K/V head),
    /// `out[g] = softmax(scale · K·q_g) · V`, with Q and the probabilities rounded to f16 as
    /// the reference multiplies them against the f16 cache.
    pub fn run(&self, backend: Backend, queries: &[f32], out: &mut [f32]) {
        self.check(queries, out);
        match backend {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512Vnni if attention_avx512::fits(self.head_dim) => {
                self.run_grouped(backend, &attention_avx512::KERNELS, queries, out)
            }
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 | Backend::Avx512Vnni if avx2::attention_fits(self.head_dim) => {
                self.run_grouped(backend, &avx2::ATTENTION_KERNELS, queries, out)
            }
            _ => self.run_per_head(backend, queries, out),
        }
    }

    #[cfg(target_arch = "x86_64")]
    /// `run` with one ISA's kernels, which the caller has checked this CPU and head size
    /// take: scores for every head, softmax, probabilities rounded to f16, then the mix.
    fn run_grouped(
        &self,
        backend: Backend,
        kernels: &GroupedKernels,
        queries: &[f32],
        out: &mut [f32],
    ) {
        let (head_dim, len) = (self.head_dim, self.len);
        let heads = queries.len() / head_dim;
        ATTENTION_SCRATCH.with_borrow_mut(|scratch| {
            let scratch = at_least(scratch, heads * (head_dim + len));
            let (q16, probs) = scratch.split_at_mut(heads * head_dim);
            // The reference multiplies Q against the f16 cache in f16: round Q the same way.
            q16.copy_from_slice(queries);
            avx2::round_through_f16_in_place(q16);
            let passes = q16
                .chunks(HEADS_PER_PASS * head_dim)
                .zip(probs.chunks_mut(HEADS_PER_PASS * len));
            for (q, probs) in passes {
                // SAFETY: the caller chose `kernels` for this CPU and head size; `check` ran
                // in `run`; `q` holds whole heads and `probs` `len` values for each.
                unsafe { (kernels.scores)(self, q, probs) };
            }
            self.mask(probs);
            // Probabilities rounded to f16, as the reference multiplies them by V in f16.
            ops::attention_softmax_rows(backend, probs, len);
            let passes = probs
                .chunks(HEADS_PER_PASS * len)
                .zip(out.chunks_mut(HEADS_PER_PASS * head_dim));
            for (probs, out) in passes {
                // SAFETY: as above; `out` holds an output head for each row of `probs`.
                unsafe { (kernels.mix)(self, probs, out) };
            }
        });
    }

    /// `run` for a block of query rows at consecutive positions of one sequence: row i
    /// (`queries[i]`, the same heads for every row) attends to positions
    /// `0..len + 1 - rows + i`, so the last row to all `len`, and its heads' outputs go to
    /// `out[i × width..]`. The same bits as `run` row by row (tested). The AVX-512 kernels
    /// widen each run of 16 keys and of 16 values from f16 once for the whole block instead
    /// of once per row, and read them from memory once: what prefill at long prompts spent
    /// its attention on (ARCHITECTURE.md, "Prefill attention in row blocks").
    pub fn run_rows(&self, backend: Backend, queries: &[&[f32]], out: &mut [f32]) {
        let rows = queries.len();
        assert!(
            rows > 0 && rows <= self.len - self.masked,
            "rows that each keep a position"
        );
        let width = queries[0].len();
        assert!(
            queries.iter().all(|q| q.len() == width) && out.len() == rows * width,
            "the same heads for every row, and an output for each"
        );
        self.check(queries[0], &out[..width]);
        #[cfg(target_arch = "x86_64")]
        if rows > 1 {
            match backend {
                Backend::Avx512Vnni if attention_avx512::fits(self.head_dim) => {
                    return self.run_rows_with(
                        backend,
                        &attention_avx512::ROW_KERNELS,
                        queries,
                        out,
                    )
                }
                Backend::Avx2 | Backend::Avx512Vnni if avx2::attention_fits(self.head_dim) => {
                    return self.run_rows_with(backend, &avx2::ROW_KERNELS, queries, out)
                }
                _ => {}
            }
        }
        for (i, (q, out)) in queries.iter().zip(out.chunks_exact_mut(width)).enumerate() {
            let row = KvHeadAttention {
                len: self.row_len(rows, i),
                ..*self
            };
            row.run(backend, q, out);
        }
    }

    /// How many positions row `i` of a block of `rows` attends to (`run_rows`).
    fn row_len(&self, rows: usize, i: usize) -> usize {
        self.len + 1 - rows + i
    }

    /// `run_rows` with one ISA's kernels, which the caller has checked this CPU and head size
    /// take: every row's scores for all heads, each row's softmax, then the mix, with the
    /// rows' probabilities `heads × len` apart.
    #[cfg(target_arch = "x86_64")]
    fn run_rows_with(
        &self,
        backend: Backend,
        kernels: &RowKernels,
        queries: &[&[f32]],
        out: &mut [f32],
    ) {
        let (head_dim, len, rows) = (self.head_dim, self.len, queries.len());
        let width = queries[0].len();
        let heads = width / head_dim;
        let block = RowBlock {
            rows,
            first_len: self.row_len(rows, 0),
            q_stride: width,
            probs_stride: heads * len,
        };
        ATTENTION_SCRATCH.with_borrow_mut(|scratch| {
            let tile = kernels.positions * head_dim;
            let scratch = at_least(scratch, rows * width + rows * heads * len + tile);
            let (q16, rest) = scratch.split_at_mut(rows * width);
            let (probs, tile) = rest.split_at_mut(rows * heads * len);
            for (q16, q) in q16.chunks_exact_mut(width).zip(queries) {
                q16.copy_from_slice(q);
            }
            // The reference multiplies Q against the f16 cache in f16: round Q the same way.
            avx2::round_through_f16_in_place(q16);
            for first_head in (0..heads).step_by(HEADS_PER_PASS) {
                let g = (heads - first_head).min(HEADS_PER_PASS);
                // SAFETY: the caller checked this CPU and head size; `check` ran in
                // `run_rows` (pages for the last row's `len`); the pass's heads lie within
                // each row's stride of `q16` and of `probs`, and `tile` holds a run of keys.
                unsafe {
                    (kernels.scores)(
                        self,
                        &block,
                        g,
                        &q16[first_head * head_dim..],
                        &mut probs[first_head * len..],
                        tile,
                    )
                };
            }
            for (i, row) in probs.chunks_exact_mut(heads * len).enumerate() {
                let row_len = self.row_len(rows, i);
                let alone = KvHeadAttention {
                    len: row_len,
                    ..*self
                };
                for head in row.chunks_exact_mut(len) {
                    let head = &mut head[..row_len];
                    alone.mask(head);
                    // Probabilities rounded to f16, as the reference multiplies them by V.
                    ops::attention_softmax_rows(backend, head, row_len);
                }
            }
            out.fill(0.0);
            for first_head in (0..heads).step_by(HEADS_PER_PASS) {
                let g = (heads - first_head).min(HEADS_PER_PASS);
                // SAFETY: as above, with `out` a row of `width` values for each row.
                unsafe {
                    (kernels.mix)(
                        self,
                        &block,
                        g,
                        &probs[first_head * len..],
                        &mut out[first_head * head_dim..],
                        tile,
                    )
                };
            }
        });
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
        assert!(self.masked < self.len, "a position the window keeps");
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

    /// The runs of up to `lanes` consecutive slots that cover positions `0..len`, page by page.
    pub(crate) fn key_runs(&self, lanes: usize) -> impl Iterator<Item = KeyRun> + '_ {
        let pages = self.len.div_ceil(self.page_size);
        (0..pages).flat_map(move |page| {
            let slots = (self.len - page * self.page_size).min(self.page_size);
            (0..slots).step_by(lanes).map(move |slot| KeyRun {
                page,
                slot,
                n: (slots - slot).min(lanes),
            })
        })
    }

    /// Gives the positions below `masked` no weight: a score of −∞ in each `len`-long row of
    /// `scores`, which softmax turns into a probability of exactly 0 (their values, this
    /// sequence's own, are then multiplied by 0).
    fn mask(&self, scores: &mut [f32]) {
        if self.masked > 0 {
            for row in scores.chunks_exact_mut(self.len) {
                row[..self.masked].fill(f32::NEG_INFINITY);
            }
        }
    }

    /// Whether every slot of page `page` holds a position below `len`: only such a page's
    /// keys are prefetched (a dimension-major page interleaves written and unwritten slots).
    pub(crate) fn page_is_full(&self, page: usize) -> bool {
        page.checked_add(1)
            .and_then(|end| end.checked_mul(self.page_size))
            .is_some_and(|end| end <= self.len)
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
                let keys = self.keys[page];
                ops::attention_scores_f16(&q, keys, self.page_size, self.scale, scores);
            }
            self.mask(&mut scores);
            ops::attention_softmax_rows(backend, &mut scores, self.len);
            out.fill(0.0);
            for (page, weights) in scores.chunks(self.page_size).enumerate() {
                ops::attention_mix_f16(backend, weights, self.values[page], out);
            }
        }
    }
}
