//! One batched forward step over verified pages.

use crate::{Error, Logits, Model, Result};
use half::{f16, slice::HalfFloatSliceExt};
use kernels::ggml_exact::{self, Build, DotKind, HeadAttention};
use kernels::{
    add_in_place, gelu_mul, quantize_acts, quantize_blocks, rms_norm, rms_norm_rows, silu_mul,
    KvHeadAttention, QuantActs,
};
use kv::{KvKind, PagePool, PageTable, PageView};

/// One sequence's part of a batched step: `tokens` go at positions `start_pos..`, with K/V
/// stored in (and attention reading from) the pages of `table`.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    pub table: &'a PageTable,
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// Which of this sequence's rows give next-token logits.
    pub logits: LogitRows,
}

impl SeqStep<'_> {
    /// How many logit rows this step adds to its pass's [`Logits`].
    fn logit_rows(&self) -> usize {
        match self.logits {
            LogitRows::None => 0,
            LogitRows::Last => 1,
            LogitRows::Every => self.tokens.len(),
        }
    }
}

/// One caller's part of a forward pass: its pool and the steps that read and write it.
pub(crate) struct PoolSteps<'a, 'p> {
    pub pool: &'p mut PagePool,
    pub steps: &'a [SeqStep<'a>],
}

/// Which rows of a sequence's step give next-token logits (in the step's `Logits`, one row
/// each, in step order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// After the last token: what sampling needs.
    Last,
    /// After every token: what prompt log-probabilities need.
    Every,
}

/// Where each batch row comes from.
#[derive(Clone, Copy)]
struct RowSource {
    seq: usize,
    pos: usize,
}

/// One (row, query heads) task of an attention step: where the row comes from, its
/// sequence's pages, the K/V head its query heads read, and the queries.
struct HeadTask<'a> {
    source: RowSource,
    view: &'a PageView<'a>,
    kv_head: usize,
    q: &'a [f32],
}

impl<'a> HeadTask<'a> {
    /// The task's K/V head in each page its row attends to (positions `0..=pos`): keys, then
    /// values, one slice of `page_size × head_dim` f16 per page.
    fn pages(&self, layer: usize) -> (Vec<&'a [f16]>, Vec<&'a [f16]>) {
        let page_count = (self.source.pos + 1).div_ceil(self.view.layout().page_size_tokens);
        let head = |kind| {
            (0..page_count)
                .map(|p| self.view.head(p, layer, kind, self.kv_head))
                .collect()
        };
        (head(KvKind::Key), head(KvKind::Value))
    }
}

/// Per-step activation buffers, `rows × width` each.
struct Buffers {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    /// Attention's output K/V-head-major when prefill runs in row blocks (`attend_blocks`).
    attn_by_head: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    hidden: Vec<f32>,
    acts: QuantActs,
}

/// What a worker runs its forward steps with: the real [`Model`], or in tests the
/// [`crate::OracleModel`], whose output says exactly which KV entries it read.
pub trait Forward: Send + 'static {
    /// Runs one step for every sequence in `steps` and returns the logits of each step that
    /// asked for them, in order. Implementations reach K/V only through [`checked_views`].
    fn forward(&self, pool: &mut PagePool, steps: &[SeqStep]) -> Result<Logits>;
    /// The page shape a pool must have to hold this model's KV.
    fn kv_layout(&self, page_size_tokens: usize) -> kv::KvLayout;
    /// Bytes of weights held in memory (reported at the handshake and in `/health`).
    fn weight_bytes(&self) -> usize;
}

impl Forward for Model {
    fn forward(&self, pool: &mut PagePool, steps: &[SeqStep]) -> Result<Logits> {
        Model::forward(self, pool, steps)
    }

    fn kv_layout(&self, page_size_tokens: usize) -> kv::KvLayout {
        self.config.kv_layout(page_size_tokens)
    }

    fn weight_bytes(&self) -> usize {
        Model::weight_bytes(self)
    }
}

/// A model shared by several workers (`serve`'s two engines run on one model).
impl<M: Forward + Sync> Forward for std::sync::Arc<M> {
    fn forward(&self, pool: &mut PagePool, steps: &[SeqStep]) -> Result<Logits> {
        M::forward(self, pool, steps)
    }

    fn kv_layout(&self, page_size_tokens: usize) -> kv::KvLayout {
        M::kv_layout(self, page_size_tokens)
    }

    fn weight_bytes(&self) -> usize {
        M::weight_bytes(self)
    }
}

/// The one road from a step to K/V, for every [`Forward`]: checks the steps' tokens and
/// positions, checks the pool's shape, verifies every page table against the pool's headers
/// (I1: a stale, foreign or freed page fails the whole step), and refuses a step that would
/// attend to slots its owner never wrote.
pub(crate) fn checked_views<'p>(
    pool: &'p mut PagePool,
    steps: &[SeqStep],
    vocab_size: usize,
    context_length: usize,
    expected_layout: kv::KvLayout,
) -> Result<Vec<PageView<'p>>> {
    check_steps(steps, vocab_size, context_length)?;
    if *pool.layout() != expected_layout {
        return Err(Error::Unsupported(format!(
            "pool layout {:?} does not fit this model ({expected_layout:?})",
            pool.layout()
        )));
    }
    let tables: Vec<&PageTable> = steps.iter().map(|s| s.table).collect();
    let views = pool.verify_batch(&tables)?;
    for (step, view) in steps.iter().zip(&views) {
        let needed = step.start_pos + step.tokens.len();
        if needed > view.capacity_tokens() {
            let capacity = view.capacity_tokens();
            return Err(Error::PageTableTooSmall { needed, capacity });
        }
        // Shared prefix-cache pages are read-only: a step writes only past them.
        if step.start_pos < view.shared_tokens() {
            return Err(Error::Kv(kv::Error::WriteToShared {
                position: step.start_pos,
                shared_tokens: view.shared_tokens(),
            }));
        }
        // Slots past what this owner wrote hold an earlier owner's K/V: attending to them
        // would answer from someone else's memory.
        if step.start_pos > view.written_tokens() {
            let written = view.written_tokens();
            return Err(Error::UnwrittenPositions {
                start_pos: step.start_pos,
                written,
            });
        }
    }
    Ok(views)
}

/// Records what a step wrote, after it ran.
pub(crate) fn mark_steps_written(steps: &[SeqStep], views: &mut [PageView]) {
    for (step, view) in steps.iter().zip(views) {
        let end = step.start_pos + step.tokens.len();
        view.mark_written(end.max(view.written_tokens()));
    }
}

fn check_steps(steps: &[SeqStep], vocab_size: usize, context_length: usize) -> Result<()> {
    for (index, step) in steps.iter().enumerate() {
        if step.tokens.is_empty() {
            return Err(Error::EmptyStep { index });
        }
        if let Some(&token) = step.tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(Error::TokenOutOfRange { token, vocab_size });
        }
        let end = step.start_pos + step.tokens.len();
        if end > context_length {
            return Err(Error::ContextOverflow {
                position: end - 1,
                context_length,
            });
        }
    }
    Ok(())
}

impl Model {
    /// Runs one step for every sequence in `steps` and returns the logits of each step that
    /// asked for them, in order. Every page table is verified against the pool's headers before
    /// any K/V is touched (I1): a stale, foreign or freed page fails the whole step.
    ///
    /// On a model that merges concurrent passes ([`Model::merge_concurrent_passes`]), steps
    /// that other threads hand in at the same time run in the same pass, each on its own
    /// pool; each caller gets its own steps' logits, the bits it would get alone.
    pub fn forward(&self, pool: &mut PagePool, steps: &[SeqStep]) -> Result<Logits> {
        if steps.is_empty() {
            return Ok(Logits::none(self.config.vocab_size));
        }
        if let Some(merger) = &self.merger {
            return merger.forward(self, pool, steps);
        }
        let _turn = self.workers.turn();
        let mut parts = [PoolSteps { pool, steps }];
        self.forward_parts(&mut parts)
            .pop()
            .expect("one part, one result")
    }

    /// Runs every part's steps in one pass, each part on its own pool, and returns each
    /// part's logits in part order. Each part's tables are verified against its own pool (I1)
    /// and a part that fails the checks gets its error while the others run. The caller holds
    /// the compute threads' turn.
    pub(crate) fn forward_parts(&self, parts: &mut [PoolSteps]) -> Vec<Result<Logits>> {
        let c = &self.config;
        let mut results: Vec<Option<Result<Logits>>> = parts.iter().map(|_| None).collect();
        let mut steps = Vec::new();
        let mut views = Vec::new();
        // (part, its range of `steps` and `views`, its logit rows)
        let mut running = Vec::new();
        for (index, part) in parts.iter_mut().enumerate() {
            let layout = c.kv_layout(part.pool.layout().page_size_tokens);
            match checked_views(
                part.pool,
                part.steps,
                c.vocab_size,
                c.context_length,
                layout,
            ) {
                Ok(part_views) => {
                    let start = steps.len();
                    steps.extend_from_slice(part.steps);
                    views.extend(part_views);
                    let rows: usize = part.steps.iter().map(SeqStep::logit_rows).sum();
                    running.push((index, start..steps.len(), rows));
                }
                Err(error) => results[index] = Some(Err(error)),
            }
        }
        if !running.is_empty() {
            let mut logits = self.run(&steps, &mut views);
            // Each part's rows follow the earlier parts'; split them off from the back.
            let mut row_end = logits.len();
            for (index, range, rows) in running.into_iter().rev() {
                mark_steps_written(&steps[range.clone()], &mut views[range]);
                row_end -= rows;
                let mine = match row_end {
                    0 => std::mem::replace(&mut logits, Logits::none(c.vocab_size)),
                    _ => logits.split_off_rows(row_end),
                };
                results[index] = Some(Ok(mine));
            }
        }
        results
            .into_iter()
            .map(|result| result.expect("every part ran or failed its checks"))
            .collect()
    }

    fn run(&self, steps: &[SeqStep], views: &mut [PageView]) -> Logits {
        let rows: Vec<RowSource> = steps
            .iter()
            .enumerate()
            .flat_map(|(seq, step)| {
                (0..step.tokens.len()).map(move |i| RowSource {
                    seq,
                    pos: step.start_pos + i,
                })
            })
            .collect();
        let mut buffers = self.buffers(rows.len());
        let dim = self.config.dim;
        let tokens = steps.iter().flat_map(|s| s.tokens.iter());
        for (row, &token) in buffers.x.chunks_exact_mut(dim).zip(tokens) {
            self.embedding.dequantize_row(token as usize, row);
        }
        if self.config.architecture.is_gemma() {
            // Gemma scales its embeddings by √width (in f32, as llama.cpp).
            let scale = (dim as f32).sqrt();
            buffers.x.iter_mut().for_each(|v| *v *= scale);
        }
        for layer in 0..self.layers.len() {
            self.attention_block(layer, &rows, views, &mut buffers);
            self.ffn_block(layer, &mut buffers);
        }
        let mut last_rows = Vec::new();
        let mut end = 0;
        for step in steps {
            let start = end;
            end += step.tokens.len();
            match step.logits {
                LogitRows::None => {}
                LogitRows::Last => last_rows.push(end - 1),
                LogitRows::Every => last_rows.extend(start..end),
            }
        }
        // The last layer's FFN output is still to be added, to the rows that give logits.
        let residual = (!self.layers.is_empty()).then_some(&buffers.proj[..]);
        self.logits(&buffers.x, residual, &last_rows)
    }

    fn buffers(&self, rows: usize) -> Buffers {
        let c = &self.config;
        Buffers {
            x: vec![0.0; rows * c.dim],
            normed: vec![0.0; rows * c.dim],
            qkv: vec![0.0; rows * (c.q_dim() + 2 * c.kv_dim())],
            attn: vec![0.0; rows * c.q_dim()],
            attn_by_head: Vec::new(),
            proj: vec![0.0; rows * c.dim],
            gate_up: vec![0.0; rows * 2 * c.ffn_dim],
            hidden: vec![0.0; rows * c.ffn_dim],
            acts: QuantActs::default(),
        }
    }

    /// Adds the pending residual (the last block's projection) into `x` where there is one,
    /// then RMSNorms `x` into `normed` and quantizes it: one region, each task its own rows.
    /// The add runs here rather than on its own after the matmul that made the projection:
    /// there it ran on the caller's thread alone while the others waited, 0.13 ms of a 10 ms
    /// batch-16 step, 0.6 ms when the machine is in its slow mode (where folding it in made
    /// 2-thread batch-16 steps 2.4–3.5 % faster; 0–0.6 % in the fast mode). Same sums.
    fn add_norm_and_quantize(
        &self,
        x: &mut [f32],
        residual: Option<&[f32]>,
        weight: &[f32],
        normed: &mut [f32],
        acts: &mut QuantActs,
    ) {
        let dim = self.config.dim;
        let rows = x.len() / dim;
        let blocks = acts.reshape(rows, dim);
        let chunk = rows.div_ceil(4 * self.workers.threads()) * dim;
        let mut tasks: Vec<_> = x
            .chunks_mut(chunk)
            .zip(normed.chunks_mut(chunk))
            .zip(blocks.chunks_mut(chunk / kernels::BLOCK))
            .enumerate()
            .collect();
        self.workers
            .for_each_item_mut(&mut tasks, |_, (task, ((x, normed), blocks))| {
                if let Some(residual) = residual {
                    add_in_place(x, &residual[*task * chunk..][..x.len()]);
                }
                if self.exact().is_some() {
                    for (x, normed) in x.chunks_exact(dim).zip(normed.chunks_exact_mut(dim)) {
                        ggml_exact::rms_norm(x, weight, self.config.norm_eps, normed);
                    }
                } else {
                    rms_norm_rows(x, weight, self.config.norm_eps, normed);
                }
                quantize_blocks(normed, blocks);
            });
    }

    /// Runs `fill(first_row, rows)` on runs of whole `cols`-wide rows of `out` (`rows` starts
    /// at row `first_row`), then quantizes the rows into `acts`: a few rows per task, spread
    /// over the workers (this per-row glue between matmuls would otherwise leave all threads
    /// but one waiting).
    fn fill_and_quantize(
        &self,
        out: &mut [f32],
        cols: usize,
        acts: &mut QuantActs,
        fill: &(dyn Fn(usize, &mut [f32]) + Sync),
    ) {
        let rows = out.len() / cols;
        let blocks = acts.reshape(rows, cols);
        let rows_per_task = rows.div_ceil(4 * self.workers.threads());
        self.workers.for_each_chunk_pair_mut(
            (out, rows_per_task * cols),
            (blocks, rows_per_task * cols / kernels::BLOCK),
            |task, out, blocks| {
                fill(task * rows_per_task, out);
                quantize_blocks(out, blocks);
            },
        );
    }

    /// Rotates each row's Q and K (RoPE at the row's position) and stores its K and V in its
    /// sequence's pages: one task per sequence, spread over the workers.
    fn rotate_and_store_kv(
        &self,
        layer: usize,
        rows: &[RowSource],
        qkv: &mut [f32],
        views: &mut [PageView],
    ) {
        let c = &self.config;
        let qkv_width = c.q_dim() + 2 * c.kv_dim();
        let mut rest = qkv;
        let mut first_row = 0;
        let mut tasks = Vec::with_capacity(views.len());
        for (seq, view) in views.iter_mut().enumerate() {
            let n = rows[first_row..]
                .iter()
                .take_while(|r| r.seq == seq)
                .count();
            let (mine, after) = std::mem::take(&mut rest).split_at_mut(n * qkv_width);
            tasks.push((&rows[first_row..first_row + n], mine, view));
            (rest, first_row) = (after, first_row + n);
        }
        self.workers
            .for_each_item_mut(&mut tasks, |_, (rows, qkv, view)| {
                for (row, source) in qkv.chunks_exact_mut(qkv_width).zip(rows.iter()) {
                    self.rotate_and_store_row(layer, source.pos, row, view);
                }
            });
    }

    /// One row's Q, K and V biases and Q/K norms where the model has them, RoPE on its Q and
    /// K at `pos`, then its K and V into their slot of `view`.
    fn rotate_and_store_row(&self, layer: usize, pos: usize, qkv: &mut [f32], view: &mut PageView) {
        let c = &self.config;
        let weights = &self.layers[layer];
        if let Some(bias) = &weights.qkv_bias {
            add_in_place(qkv, bias);
        }
        let (q, kv) = qkv.split_at_mut(c.q_dim());
        if let Some(norm) = &weights.qk_norm {
            self.norm_heads(q, &norm.q);
            self.norm_heads(&mut kv[..c.kv_dim()], &norm.k);
        }
        let rope = self.rope_of(layer);
        if self.exact().is_some() {
            ggml_exact::rope(rope, q, pos);
            ggml_exact::rope(rope, &mut kv[..c.kv_dim()], pos);
        } else {
            rope.apply(q, pos);
            rope.apply(&mut kv[..c.kv_dim()], pos);
        }
        store_kv(view, layer, pos, kv, c.head_dim);
    }

    /// Whether a step takes [`Self::decode_attention`]: the fast kernels, one row per sequence
    /// (a decode step), and rows enough that a task per row keeps the threads busy.
    fn attends_per_row(&self, rows: &[RowSource], views: &[PageView]) -> bool {
        self.exact().is_none()
            && rows.len() == views.len()
            && rows.len() >= 2 * self.workers.threads()
    }

    /// A decode step's RoPE, K/V store, attention and quantization of the result, one task
    /// per row (each row is its own sequence here, so no task reads what another writes). One
    /// region instead of three, and a task reads each page's K and V for all K/V heads of the
    /// layer, which lie side by side: longer runs from memory than one head's. The bits are
    /// those of `rotate_and_store_kv`, `attend` and `fill_and_quantize` (tested).
    fn decode_attention(
        &self,
        layer: usize,
        rows: &[RowSource],
        qkv: &mut [f32],
        views: &mut [PageView],
        out: &mut [f32],
        acts: &mut QuantActs,
    ) {
        let c = &self.config;
        let (q_dim, qkv_width) = (c.q_dim(), c.q_dim() + 2 * c.kv_dim());
        let group_width = c.group_size() * c.head_dim;
        let blocks = acts.reshape(rows.len(), q_dim);
        let mut tasks: Vec<_> = qkv
            .chunks_exact_mut(qkv_width)
            .zip(views.iter_mut())
            .zip(out.chunks_exact_mut(q_dim))
            .zip(blocks.chunks_exact_mut(q_dim / kernels::BLOCK))
            .zip(rows)
            .collect();
        self.workers
            .for_each_item_mut(&mut tasks, |_, ((((qkv, view), out), blocks), source)| {
                self.rotate_and_store_row(layer, source.pos, qkv, view);
                let q = &qkv[..q_dim];
                for (kv_head, out) in out.chunks_exact_mut(group_width).enumerate() {
                    let task = HeadTask {
                        source: **source,
                        view,
                        kv_head,
                        q: &q[kv_head * group_width..][..group_width],
                    };
                    self.attend_heads(layer, &task, out);
                }
                quantize_blocks(out, blocks);
            });
    }

    /// The llama.cpp build whose arithmetic this model reproduces (`ggml-exact` kernels).
    fn exact(&self) -> Option<Build> {
        self.backend.ggml_build()
    }

    /// The RoPE of `layer`: a sliding-window layer's has its own base.
    fn rope_of(&self, layer: usize) -> &kernels::RopeTable {
        match (&self.rope_sliding, self.config.sliding_window) {
            (Some(rope), Some(sw)) if sw.applies_to(layer) => rope,
            _ => &self.rope,
        }
    }

    /// The first position a row at `pos` attends to in `layer`: 0, or the start of its
    /// sliding window.
    fn first_attended(&self, layer: usize, pos: usize) -> usize {
        match self.config.sliding_window {
            Some(sw) if sw.applies_to(layer) => (pos + 1).saturating_sub(sw.window),
            _ => 0,
        }
    }

    /// RMSNorm in place of each `dim`-wide row of `x` (Gemma's post-norms), a few rows per
    /// task.
    fn norm_rows_in_place(&self, x: &mut [f32], weight: &[f32]) {
        let dim = self.config.dim;
        let rows_per_task = (x.len() / dim).div_ceil(4 * self.workers.threads()).max(1);
        let mut tasks: Vec<&mut [f32]> = x.chunks_mut(rows_per_task * dim).collect();
        self.workers.for_each_item_mut(&mut tasks, |_, rows| {
            let mut row = vec![0f32; dim];
            for normed in rows.chunks_exact_mut(dim) {
                row.copy_from_slice(normed);
                self.rms_norm(&row, weight, normed);
            }
        });
    }

    /// RMSNorm of each `head_dim`-wide head of `x` in place, with `weight` (the Q/K norms of
    /// qwen3 and gemma3).
    fn norm_heads(&self, x: &mut [f32], weight: &[f32]) {
        let mut head = vec![0f32; self.config.head_dim];
        for normed in x.chunks_exact_mut(self.config.head_dim) {
            head.copy_from_slice(normed);
            self.rms_norm(&head, weight, normed);
        }
    }

    fn rms_norm(&self, x: &[f32], weight: &[f32], out: &mut [f32]) {
        if self.exact().is_some() {
            ggml_exact::rms_norm(x, weight, self.config.norm_eps, out);
        } else {
            rms_norm(x, weight, self.config.norm_eps, out);
        }
    }

    fn attention_block(
        &self,
        layer: usize,
        rows: &[RowSource],
        views: &mut [PageView],
        b: &mut Buffers,
    ) {
        let c = &self.config;
        let weights = &self.layers[layer];
        // The previous layer's FFN output is still to be added (`add_norm_and_quantize`).
        let residual = (layer > 0).then_some(&b.proj[..]);
        self.add_norm_and_quantize(
            &mut b.x,
            residual,
            &weights.attn_norm,
            &mut b.normed,
            &mut b.acts,
        );
        weights
            .qkv
            .matmul(self.backend, &self.workers, &b.acts, &mut b.qkv);
        if self.attends_per_row(rows, views) {
            self.decode_attention(layer, rows, &mut b.qkv, views, &mut b.attn, &mut b.acts);
        } else {
            self.rotate_and_store_kv(layer, rows, &mut b.qkv, views);
            self.attend(layer, rows, &b.qkv, views, &mut b.attn, &mut b.attn_by_head);
            self.fill_and_quantize(&mut b.attn, c.q_dim(), &mut b.acts, &|_, _| {});
        }
        weights
            .attn_output
            .matmul(self.backend, &self.workers, &b.acts, &mut b.proj);
        if let Some(post) = &weights.post_norms {
            self.norm_rows_in_place(&mut b.proj, &post.attention);
        }
    }

    /// The FFN of `layer`, which first adds the attention block's output into `x`; its own
    /// output is left in `b.proj` for the next norm to add.
    fn ffn_block(&self, layer: usize, b: &mut Buffers) {
        let c = &self.config;
        let weights = &self.layers[layer];
        self.add_norm_and_quantize(
            &mut b.x,
            Some(&b.proj),
            &weights.ffn_norm,
            &mut b.normed,
            &mut b.acts,
        );
        weights
            .gate_up
            .matmul(self.backend, &self.workers, &b.acts, &mut b.gate_up);
        let gate_up = &b.gate_up;
        self.fill_and_quantize(&mut b.hidden, c.ffn_dim, &mut b.acts, &|first_row, rows| {
            for (i, hidden) in rows.chunks_exact_mut(c.ffn_dim).enumerate() {
                let gate_up = &gate_up[(first_row + i) * 2 * c.ffn_dim..][..2 * c.ffn_dim];
                let (gate, up) = gate_up.split_at(c.ffn_dim);
                hidden.copy_from_slice(gate);
                if c.architecture.is_gemma() {
                    gelu_mul(hidden, up);
                } else if let Some(build) = self.exact() {
                    ggml_exact::silu_mul(build, hidden, up);
                } else {
                    silu_mul(self.backend, hidden, up);
                }
            }
        });
        weights
            .down
            .matmul(self.backend, &self.workers, &b.acts, &mut b.proj);
        if let Some(post) = &weights.post_norms {
            self.norm_rows_in_place(&mut b.proj, &post.ffn);
        }
    }

    /// Causal grouped-query attention for every row, reading K/V from the verified pages.
    /// One task per (row, K/V head), or per (row, query head) when that is too few tasks for
    /// the threads (decode at batch 1).
    fn attend(
        &self,
        layer: usize,
        rows: &[RowSource],
        qkv: &[f32],
        views: &[PageView],
        out: &mut [f32],
        by_head: &mut Vec<f32>,
    ) {
        if let Some(build) = self.exact() {
            return self.attend_exact(build, layer, rows, qkv, views, out);
        }
        let blocks = row_blocks(rows, self.rows_per_block(rows));
        if blocks.len() < rows.len() {
            return self.attend_blocks(layer, rows, &blocks, qkv, views, out, by_head);
        }
        let c = &self.config;
        // The query heads that share a K/V head go in one task, which widens each key and
        // value once for all of them; with too few tasks to keep the threads busy, one head per
        // task. Each head's bits are the same either way.
        let kv_tasks = rows.len() * c.kv_head_count;
        let heads_per_task = if kv_tasks >= self.workers.threads() {
            c.group_size()
        } else {
            1
        };
        self.for_each_head(rows, qkv, views, out, heads_per_task, &|task, out| {
            self.attend_heads(layer, &task, out)
        });
    }

    /// How many rows of one sequence a prefill attention task takes (`attend_blocks`): up to
    /// [`MAX_ROWS_PER_BLOCK`], fewer where the block's scores (`rows × group × positions`
    /// f32) would pass [`BLOCK_SCORES_BYTES`], and at least 4 tasks per thread.
    fn rows_per_block(&self, rows: &[RowSource]) -> usize {
        let c = &self.config;
        let positions = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        let fits = BLOCK_SCORES_BYTES / (c.group_size() * positions * 4).max(1);
        let spread = (rows.len() * c.kv_head_count).div_ceil(4 * self.workers.threads());
        fits.min(spread).clamp(1, MAX_ROWS_PER_BLOCK)
    }

    /// Prefill's attention in blocks of rows at consecutive positions of one sequence, one
    /// task per (block, K/V head), K/V-head-major: `KvHeadAttention::run_rows` reads each run
    /// of a head's keys and values once for the block and widens it once, where a task per
    /// row read and widened it per row. The outputs go K/V-head-major into `by_head`, so that
    /// each task owns one contiguous range, then into `out`'s rows. Bits as `attend_heads`
    /// row by row (the kernels' tests, and the model's
    /// `prefill_in_row_blocks_gives_each_row_its_logits_one_token_at_a_time`).
    #[allow(clippy::too_many_arguments)]
    fn attend_blocks(
        &self,
        layer: usize,
        rows: &[RowSource],
        blocks: &[std::ops::Range<usize>],
        qkv: &[f32],
        views: &[PageView],
        out: &mut [f32],
        by_head: &mut Vec<f32>,
    ) {
        let c = &self.config;
        let group_width = c.group_size() * c.head_dim;
        let qkv_width = c.q_dim() + 2 * c.kv_dim();
        by_head.clear();
        by_head.resize(out.len(), 0.0);
        let mut tasks = Vec::with_capacity(blocks.len() * c.kv_head_count);
        let mut rest = &mut by_head[..];
        for kv_head in 0..c.kv_head_count {
            for block in blocks {
                let (task_out, tail) = rest.split_at_mut(block.len() * group_width);
                rest = tail;
                tasks.push((kv_head, block.clone(), task_out));
            }
        }
        self.workers
            .for_each_item_mut(&mut tasks, |_, (kv_head, block, out)| {
                let query =
                    |row: usize| &qkv[row * qkv_width + *kv_head * group_width..][..group_width];
                let task = |row: usize| HeadTask {
                    source: rows[row],
                    view: &views[rows[row].seq],
                    kv_head: *kv_head,
                    q: query(row),
                };
                let last = task(block.end - 1);
                if self.first_attended(layer, last.source.pos) > 0 {
                    // Inside a sliding window every row starts elsewhere: one at a time.
                    for (row, out) in block.clone().zip(out.chunks_exact_mut(group_width)) {
                        self.attend_heads(layer, &task(row), out);
                    }
                    return;
                }
                let (keys, values) = last.pages(layer);
                let attention = KvHeadAttention {
                    keys: &keys,
                    values: &values,
                    page_size: last.view.layout().page_size_tokens,
                    head_dim: c.head_dim,
                    len: last.source.pos + 1,
                    masked: 0,
                    scale: c.attention_scale,
                };
                let queries: Vec<&[f32]> = block.clone().map(query).collect();
                attention.run_rows(self.backend, &queries, out);
            });
        let heads = by_head.chunks_exact(rows.len() * group_width);
        for (kv_head, head) in heads.enumerate() {
            let outputs = out.chunks_exact_mut(c.q_dim());
            for (out, src) in outputs.zip(head.chunks_exact(group_width)) {
                out[kv_head * group_width..][..group_width].copy_from_slice(src);
            }
        }
    }

    /// Attention of a task's query heads over its K/V head (fast kernels).
    fn attend_heads(&self, layer: usize, task: &HeadTask, out: &mut [f32]) {
        let head_dim = self.config.head_dim;
        let (keys, values) = task.pages(layer);
        // A sliding window skips the pages before it and masks the positions before it on
        // its first page.
        let page_size = task.view.layout().page_size_tokens;
        let first = self.first_attended(layer, task.source.pos);
        let first_page = first / page_size;
        let attention = KvHeadAttention {
            keys: &keys[first_page..],
            values: &values[first_page..],
            page_size,
            head_dim,
            len: task.source.pos + 1 - first_page * page_size,
            masked: first - first_page * page_size,
            scale: self.config.attention_scale,
        };
        attention.run(self.backend, task.q, out);
    }

    /// `attend` in llama.cpp's arithmetic (`ggml_exact`). Which f16 dot product llama.cpp
    /// uses depends on whether its batch holds one token or more; each sequence is computed
    /// as if evaluated alone (its own rows in this step decide), so a request's bits do not
    /// depend on what it was batched with.
    fn attend_exact(
        &self,
        build: Build,
        layer: usize,
        rows: &[RowSource],
        qkv: &[f32],
        views: &[PageView],
        out: &mut [f32],
    ) {
        let head_dim = self.config.head_dim;
        let scale = self.config.attention_scale;
        let mut seq_rows = vec![0usize; views.len()];
        for row in rows {
            seq_rows[row.seq] += 1;
        }
        self.for_each_head(rows, qkv, views, out, 1, &|task, out| {
            let (page_size, len) = (task.view.layout().page_size_tokens, task.source.pos + 1);
            let (keys, values) = task.pages(layer);
            let attention = HeadAttention {
                keys: &keys,
                values: &values,
                page_size,
                head_dim,
                len,
                scale,
                kind: if seq_rows[task.source.seq] >= 2 {
                    DotKind::Gemm
                } else {
                    DotKind::Vector
                },
                build,
            };
            attention.run(task.q, out);
        });
    }

    /// Runs `attend_heads` once per (row, run of `heads_per_task` query heads sharing one K/V
    /// head), spread over the workers, with those heads' output slots (`head_dim` values each
    /// of `out`).
    fn for_each_head(
        &self,
        rows: &[RowSource],
        qkv: &[f32],
        views: &[PageView],
        out: &mut [f32],
        heads_per_task: usize,
        attend_heads: &(dyn Fn(HeadTask, &mut [f32]) + Sync),
    ) {
        let c = &self.config;
        assert!(
            c.group_size().is_multiple_of(heads_per_task),
            "a task's heads share one K/V head"
        );
        let qkv_width = c.q_dim() + 2 * c.kv_dim();
        let tasks_per_row = c.head_count / heads_per_task;
        let task_width = heads_per_task * c.head_dim;
        // K/V-head-major: the threads take the tasks in order, so at any moment they read one
        // K/V head's pages, which stay in cache from one row to the next, rather than every
        // head's in turn (at 8,192 positions one head's K and V are 2 MiB, all three 6 MiB).
        let mut tasks: Vec<(usize, &mut [f32])> = out.chunks_mut(task_width).enumerate().collect();
        tasks.sort_by_key(|&(chunk, _)| (chunk % tasks_per_row, chunk / tasks_per_row));
        self.workers
            .for_each_item_mut(&mut tasks, |_, (chunk, out)| {
                let chunk = *chunk;
                let (row, first_head) = (
                    chunk / tasks_per_row,
                    chunk % tasks_per_row * heads_per_task,
                );
                let source = rows[row];
                let task = HeadTask {
                    source,
                    view: &views[source.seq],
                    kv_head: first_head / c.group_size(),
                    q: &qkv[row * qkv_width + first_head * c.head_dim..][..task_width],
                };
                attend_heads(task, out);
            });
    }

    /// Final norm and output projection: the logits of rows `rows` of `x`, after adding their
    /// `residual` where there is one.
    fn logits(&self, x: &[f32], residual: Option<&[f32]>, rows: &[usize]) -> Logits {
        if rows.is_empty() {
            return Logits::none(self.config.vocab_size);
        }
        let c = &self.config;
        let mut normed = vec![0f32; rows.len() * c.dim];
        let mut row_x = vec![0f32; c.dim];
        for (out, &row) in normed.chunks_exact_mut(c.dim).zip(rows) {
            row_x.copy_from_slice(&x[row * c.dim..(row + 1) * c.dim]);
            if let Some(residual) = residual {
                add_in_place(&mut row_x, &residual[row * c.dim..(row + 1) * c.dim]);
            }
            self.rms_norm(&row_x, &self.output_norm, out);
        }
        let mut acts = QuantActs::default();
        quantize_acts(&normed, rows.len(), c.dim, &mut acts);
        let output = self.output.as_ref().unwrap_or(&self.embedding);
        let mut logits = vec![0f32; rows.len() * c.vocab_size];
        output.matmul(self.backend, &self.workers, &acts, &mut logits);
        Logits::from_values(logits, c.vocab_size)
    }
}

/// The most bytes of scores a prefill attention block keeps (`Model::rows_per_block`): 10
/// rows of SmolLM2's 3 query heads at 16,384 positions. Past the model's 8,192 positions
/// nothing was measured to choose it by.
const BLOCK_SCORES_BYTES: usize = 2 << 20;
/// The most rows in a prefill attention block. Each run of keys and values is widened from
/// f16 once per block, so more rows widen less; past 10, the rows' scores crowd the keys and
/// values out of the caches. `examples/prefill_attention_speed` (one thread, one K/V head,
/// 2026-12-07, the 2-core AMD EPYC VM), µs per row against 16 rows:
/// 8,192 positions 87.5 vs 92.1 (and 97.3 with 5 rows, what a 512 KiB limit on the scores
/// gave), 4,096 40.5 vs 41.5, 2,048 19.2 vs 19.5, 512 3.04 vs 3.09.
const MAX_ROWS_PER_BLOCK: usize = 10;

/// `rows` cut into blocks of at most `max` rows, each of one sequence at consecutive
/// positions, in order.
fn row_blocks(rows: &[RowSource], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        match blocks.last_mut() {
            Some(block)
                if block.len() < max
                    && rows[block.end - 1].seq == row.seq
                    && rows[block.end - 1].pos + 1 == row.pos =>
            {
                block.end = i + 1
            }
            _ => blocks.push(i..i + 1),
        }
    }
    blocks
}

/// Writes one token's K (already rotated) and V into its slot of the sequence's pages.
fn store_kv(view: &mut PageView, layer: usize, pos: usize, kv: &[f32], head_dim: usize) {
    let page_size = view.layout().page_size_tokens;
    let (page, slot) = (pos / page_size, pos % page_size);
    let kv_dim = kv.len() / 2;
    let (k, v) = kv.split_at(kv_dim);
    // Keys dimension-major, values slot-major: the layout `kernels::KvHeadAttention` reads.
    for (kv_head, key) in k.chunks_exact(head_dim).enumerate() {
        let keys = view.head_mut(page, layer, KvKind::Key, kv_head);
        kernels::store_key(keys, page_size, slot, key);
    }
    for (kv_head, value) in v.chunks_exact(head_dim).enumerate() {
        let dst = &mut view.head_mut(page, layer, KvKind::Value, kv_head)[slot * head_dim..];
        // Vectorized (F16C where the CPU has it); the same rounding as `f16::from_f32`.
        dst[..head_dim].convert_from_f32_slice(value);
    }
}
