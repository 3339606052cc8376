//! Quantized weight matrices, repacked at load into groups of 8 rows (`layout`) so one SIMD
//! pass computes 8 output rows at once from a single load of the activation block, and the
//! dispatch of each matmul to the kernels of the chosen backend.

use crate::formats::{self, Fidelity, TensorFormat};
use crate::layout::{
    GroupJob, Q41GroupBlock, Q50GroupBlock, Q80GroupBlock, Q80PairBlock, Q8OffsetGroupBlock,
    WeightFormat, GROUP_ROWS, Q41_LANE_ROW,
};
use crate::{avx2, ggml_exact, scalar, vnni, Backend, Error, QuantActs, Result, Workers, BLOCK};
use hugemem::HugeBuffer;
use std::ops::{Deref, Range};
use std::sync::Arc;

#[derive(Clone)]
enum Storage {
    Q41(Blocks<Q41GroupBlock>),
    Q50(Blocks<Q50GroupBlock>),
    Q8Offset(Blocks<Q8OffsetGroupBlock>),
    Q80(Blocks<Q80GroupBlock>),
}

/// A matrix's packed blocks: its range of a buffer that may hold other matrices' blocks too
/// (see [`QuantMatrix::share_buffers`]). Immutable once built, so sharing needs no lock.
#[derive(Clone)]
struct Blocks<T> {
    buffer: Arc<HugeBuffer<T>>,
    range: Range<usize>,
}

impl<T: bytemuck::Zeroable + Copy> Blocks<T> {
    /// `len` blocks in a buffer of their own, `pack(i)` giving block `i`.
    fn packed(len: usize, pack: impl Fn(usize) -> T) -> Blocks<T> {
        let mut buffer = HugeBuffer::zeroed(len);
        for (index, block) in buffer.iter_mut().enumerate() {
            *block = pack(index);
        }
        Blocks {
            buffer: Arc::new(buffer),
            range: 0..len,
        }
    }

    /// The parts' blocks one after another, in a buffer of their own.
    fn concatenated<'a>(parts: impl Iterator<Item = &'a Blocks<T>> + Clone) -> Blocks<T>
    where
        T: 'a,
    {
        let len = parts.clone().map(|part| part.len()).sum();
        let mut buffer = HugeBuffer::zeroed(len);
        let mut start = 0;
        for part in parts {
            buffer[start..start + part.len()].copy_from_slice(part);
            start += part.len();
        }
        Blocks {
            buffer: Arc::new(buffer),
            range: 0..len,
        }
    }
}

impl<T> Blocks<T> {
    /// The `len` blocks of this buffer from `*start` on, moving `*start` past them.
    fn next_range(&self, start: &mut usize, len: usize) -> Blocks<T> {
        let range = *start..*start + len;
        *start = range.end;
        Blocks {
            buffer: Arc::clone(&self.buffer),
            range,
        }
    }
}

impl Storage {
    fn q41(&self) -> Option<&Blocks<Q41GroupBlock>> {
        match self {
            Storage::Q41(blocks) => Some(blocks),
            _ => None,
        }
    }

    fn q50(&self) -> Option<&Blocks<Q50GroupBlock>> {
        match self {
            Storage::Q50(blocks) => Some(blocks),
            _ => None,
        }
    }

    fn q8_offset(&self) -> Option<&Blocks<Q8OffsetGroupBlock>> {
        match self {
            Storage::Q8Offset(blocks) => Some(blocks),
            _ => None,
        }
    }

    fn q80(&self) -> Option<&Blocks<Q80GroupBlock>> {
        match self {
            Storage::Q80(blocks) => Some(blocks),
            _ => None,
        }
    }
}

impl<T> Deref for Blocks<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.buffer[self.range.clone()]
    }
}

/// A `rows × cols` quantized matrix; `matmul` computes `out[t][r] = Σ_c W[r][c] · x[t][c]`.
#[derive(Clone)]
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    storage: Storage,
    /// A Q8_0 matrix's blocks again, turned for the VNNI kernel ([`Self::add_vnni_layout`]).
    vnni_q80: Option<Blocks<Q80PairBlock>>,
}

impl QuantMatrix {
    /// Repacks a GGUF tensor's bytes (row-major blocks) into 8-row groups.
    pub fn from_gguf_bytes(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<QuantMatrix> {
        if rows == 0 || cols == 0 || !rows.is_multiple_of(GROUP_ROWS) || !cols.is_multiple_of(BLOCK)
        {
            return Err(Error::UnsupportedShape { rows, cols });
        }
        let blocks_per_row = cols / BLOCK;
        let expected = rows
            .checked_mul(blocks_per_row)
            .and_then(|n| n.checked_mul(format.block_bytes()))
            .ok_or(Error::UnsupportedShape { rows, cols })?;
        if bytes.len() != expected {
            return Err(Error::WrongByteLength {
                format,
                rows,
                cols,
                got: bytes.len(),
                expected,
            });
        }
        let row_bytes = blocks_per_row * format.block_bytes();
        let source_block = |row: usize, block: usize| {
            let start = row * row_bytes + block * format.block_bytes();
            &bytes[start..start + format.block_bytes()]
        };
        // Storage order: for each group of 8 rows, its blocks left to right.
        let block_count = rows / GROUP_ROWS * blocks_per_row;
        let storage = match format {
            WeightFormat::Q4_1 => Storage::Q41(Blocks::packed(block_count, |index| {
                let (g, b) = (index / blocks_per_row, index % blocks_per_row);
                pack_q41(|r| source_block(g * GROUP_ROWS + r, b))
            })),
            WeightFormat::Q5_0 => Storage::Q50(Blocks::packed(block_count, |index| {
                let (g, b) = (index / blocks_per_row, index % blocks_per_row);
                pack_q50(|r| source_block(g * GROUP_ROWS + r, b))
            })),
            WeightFormat::Q8Offset => Storage::Q8Offset(Blocks::packed(block_count, |index| {
                let (g, b) = (index / blocks_per_row, index % blocks_per_row);
                pack_q8_offset(|r| source_block(g * GROUP_ROWS + r, b))
            })),
            WeightFormat::Q8_0 => Storage::Q80(Blocks::packed(block_count, |index| {
                let (g, b) = (index / blocks_per_row, index % blocks_per_row);
                pack_q80(|r| source_block(g * GROUP_ROWS + r, b))
            })),
        };
        Ok(QuantMatrix {
            rows,
            cols,
            storage,
            vnni_q80: None,
        })
    }

    /// A matrix from a GGUF tensor of any loadable format, turned into its format's compute
    /// layout ([`formats::transcode`]), or into `layout` ([`formats::into_layout`]) to be
    /// stacked with matrices of other layouts. Also says how faithful the layout's values
    /// are to the file's.
    pub fn from_tensor(
        format: TensorFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        layout: Option<WeightFormat>,
    ) -> Result<(QuantMatrix, Fidelity)> {
        let mut transcoded = formats::transcode(format, rows, cols, bytes)?;
        if let Some(target) = layout {
            transcoded = formats::into_layout(transcoded, target).ok_or(Error::ConcatMismatch)?;
        }
        let matrix =
            QuantMatrix::from_gguf_bytes(transcoded.layout, rows, cols, &transcoded.bytes)?;
        Ok((matrix, transcoded.fidelity))
    }

    /// Stacks matrices with the same width and format (e.g. Q, K and V into one QKV matrix, so
    /// one pass over the input serves all three).
    pub fn concat_rows(parts: &[QuantMatrix]) -> Result<QuantMatrix> {
        let first = parts.first().ok_or(Error::ConcatMismatch)?;
        let same_shape =
            |part: &QuantMatrix| part.cols == first.cols && part.format() == first.format();
        if !parts.iter().all(same_shape) {
            return Err(Error::ConcatMismatch);
        }
        let storage = match first.storage {
            Storage::Q41(_) => Storage::Q41(Blocks::concatenated(
                parts.iter().filter_map(|part| part.storage.q41()),
            )),
            Storage::Q50(_) => Storage::Q50(Blocks::concatenated(
                parts.iter().filter_map(|part| part.storage.q50()),
            )),
            Storage::Q8Offset(_) => Storage::Q8Offset(Blocks::concatenated(
                parts.iter().filter_map(|part| part.storage.q8_offset()),
            )),
            Storage::Q80(_) => Storage::Q80(Blocks::concatenated(
                parts.iter().filter_map(|part| part.storage.q80()),
            )),
        };
        Ok(QuantMatrix {
            rows: parts.iter().map(|part| part.rows).sum(),
            cols: first.cols,
            storage,
            vnni_q80: None,
        })
    }

    /// Moves the matrices' blocks into one buffer per format, each matrix keeping its range.
    ///
    /// Why: a model's matrices are each a few hundred KiB, too small to lie on 2 MiB huge
    /// pages alone; one buffer of all of them does, and batch-1 decode, which streams every
    /// weight per token, ran 14–19 % faster that way (BENCHMARKS.md). Results do not
    /// change: every block keeps its bits.
    pub fn share_buffers(matrices: &mut [&mut QuantMatrix]) {
        let q41 = Blocks::concatenated(matrices.iter().filter_map(|matrix| matrix.storage.q41()));
        let q50 = Blocks::concatenated(matrices.iter().filter_map(|matrix| matrix.storage.q50()));
        let q8_offset = Blocks::concatenated(
            matrices
                .iter()
                .filter_map(|matrix| matrix.storage.q8_offset()),
        );
        let q80 = Blocks::concatenated(matrices.iter().filter_map(|matrix| matrix.storage.q80()));
        let (mut q41_start, mut q50_start, mut q8_offset_start, mut q80_start) = (0, 0, 0, 0);
        for matrix in matrices.iter_mut() {
            matrix.storage = match &matrix.storage {
                Storage::Q41(blocks) => Storage::Q41(q41.next_range(&mut q41_start, blocks.len())),
                Storage::Q50(blocks) => Storage::Q50(q50.next_range(&mut q50_start, blocks.len())),
                Storage::Q8Offset(blocks) => {
                    Storage::Q8Offset(q8_offset.next_range(&mut q8_offset_start, blocks.len()))
                }
                Storage::Q80(blocks) => Storage::Q80(q80.next_range(&mut q80_start, blocks.len())),
            };
        }
    }

    /// Keeps a second copy of a Q8_0 matrix's blocks, turned the way the VNNI kernel computes
    /// with them ([`Q80PairBlock`]), for batches of 4 tokens or more on the VNNI backend; the
    /// kernels for one to three tokens and the embedding lookup keep reading the first copy.
    /// Does nothing for Q4_1, or on a CPU without AVX-512 VNNI.
    ///
    /// Why: turning a Q8_0 block in registers takes 32 shuffles per pass, and the output
    /// projection (the model's one Q8_0 matrix, 49152 × 576) ran 15–18 % faster without them
    /// (`examples/matmul_speed`, BENCHMARKS.md). Q4_1 needs no copy: its few unpacks cost
    /// nothing measurable. The results are the same bits either way (tested).
    pub fn add_vnni_layout(&mut self) {
        let Storage::Q80(blocks) = &self.storage else {
            return;
        };
        if !vnni::cpu_ok() || self.vnni_q80.is_some() {
            return;
        }
        let blocks_per_row = self.cols / BLOCK;
        let groups = self.rows / GROUP_ROWS;
        let group_block = |g: usize, b: usize| &blocks[g * blocks_per_row + b];
        self.vnni_q80 = Some(Blocks::packed(
            groups.div_ceil(2) * blocks_per_row,
            |index| {
                let (pair, b) = (index / blocks_per_row, index % blocks_per_row);
                let first = 2 * pair;
                let second = (first + 1).min(groups - 1);
                turn_q80_pair([group_block(first, b), group_block(second, b)])
            },
        ));
    }

    /// Whether [`Self::add_vnni_layout`] made a turned copy.
    pub fn has_vnni_layout(&self) -> bool {
        self.vnni_q80.is_some()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> WeightFormat {
        match self.storage {
            Storage::Q41(_) => WeightFormat::Q4_1,
            Storage::Q50(_) => WeightFormat::Q5_0,
            Storage::Q8Offset(_) => WeightFormat::Q8Offset,
            Storage::Q80(_) => WeightFormat::Q8_0,
        }
    }

    /// Whether this matrix's blocks live in the same buffer as `other`'s.
    #[cfg(test)]
    pub(crate) fn shares_buffer_with(&self, other: &QuantMatrix) -> bool {
        match (&self.storage, &other.storage) {
            (Storage::Q41(a), Storage::Q41(b)) => Arc::ptr_eq(&a.buffer, &b.buffer),
            (Storage::Q50(a), Storage::Q50(b)) => Arc::ptr_eq(&a.buffer, &b.buffer),
            (Storage::Q8Offset(a), Storage::Q8Offset(b)) => Arc::ptr_eq(&a.buffer, &b.buffer),
            (Storage::Q80(a), Storage::Q80(b)) => Arc::ptr_eq(&a.buffer, &b.buffer),
            _ => false,
        }
    }

    /// Whether this matrix's buffer is advised for huge pages.
    #[cfg(test)]
    pub(crate) fn storage_is_advised(&self) -> bool {
        match &self.storage {
            Storage::Q41(blocks) => blocks.buffer.is_advised(),
            Storage::Q50(blocks) => blocks.buffer.is_advised(),
            Storage::Q8Offset(blocks) => blocks.buffer.is_advised(),
            Storage::Q80(blocks) => blocks.buffer.is_advised(),
        }
    }

    /// The packed Q4_1 groups (`None` for Q8_0), for tests that call kernels directly.
    #[cfg(test)]
    pub(crate) fn q41_blocks(&self) -> Option<&[Q41GroupBlock]> {
        self.storage.q41().map(|blocks| &blocks[..])
    }

    /// Bytes of weight data held, the VNNI copy included.
    pub fn bytes(&self) -> usize {
        let vnni = self
            .vnni_q80
            .as_ref()
            .map_or(0, |pairs| std::mem::size_of_val::<[Q80PairBlock]>(pairs));
        vnni + match &self.storage {
            Storage::Q41(blocks) => std::mem::size_of_val::<[Q41GroupBlock]>(blocks),
            Storage::Q50(blocks) => std::mem::size_of_val::<[Q50GroupBlock]>(blocks),
            Storage::Q8Offset(blocks) => std::mem::size_of_val::<[Q8OffsetGroupBlock]>(blocks),
            Storage::Q80(blocks) => std::mem::size_of_val::<[Q80GroupBlock]>(blocks),
        }
    }

    /// Dequantizes one row into `out` (`cols` values): the embedding lookup.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row index within the matrix");
        assert_eq!(out.len(), self.cols, "output holds one row");
        let blocks_per_row = self.cols / BLOCK;
        let (group, lane_row) = (row / GROUP_ROWS, row % GROUP_ROWS);
        let chunks = out.chunks_exact_mut(BLOCK);
        match &self.storage {
            Storage::Q41(blocks) => {
                let group_blocks = &blocks[group * blocks_per_row..(group + 1) * blocks_per_row];
                for (chunk, block) in chunks.zip(group_blocks) {
                    scalar::dequantize_q41(block, lane_row, chunk);
                }
            }
            Storage::Q50(blocks) => {
                let group_blocks = &blocks[group * blocks_per_row..(group + 1) * blocks_per_row];
                for (chunk, block) in chunks.zip(group_blocks) {
                    scalar::dequantize_q50(block, lane_row, chunk);
                }
            }
            Storage::Q8Offset(blocks) => {
                let group_blocks = &blocks[group * blocks_per_row..(group + 1) * blocks_per_row];
                for (chunk, block) in chunks.zip(group_blocks) {
                    scalar::dequantize_q8_offset(block, lane_row, chunk);
                }
            }
            Storage::Q80(blocks) => {
                let group_blocks = &blocks[group * blocks_per_row..(group + 1) * blocks_per_row];
                for (chunk, block) in chunks.zip(group_blocks) {
                    scalar::dequantize_q80(block, lane_row, chunk);
                }
            }
        }
    }

    /// `out[t * rows + r] = W[r] · acts[t]`, spread over `workers` by row groups.
    pub fn matmul(&self, backend: Backend, workers: &Workers, acts: &QuantActs, out: &mut [f32]) {
        assert_eq!(
            acts.cols(),
            self.cols,
            "activation width matches the matrix"
        );
        let tokens = acts.rows();
        assert_eq!(
            out.len(),
            tokens * self.rows,
            "output holds tokens*rows values"
        );
        if tokens == 0 {
            return;
        }
        let group_count = self.rows / GROUP_ROWS;
        // One task per thread, so each thread streams one contiguous run of rows and its
        // weight prefetches stay ahead of it to the end. With four tasks per thread, claimed
        // in whatever order the threads came for them, every task started cold and its last
        // prefetches asked for rows the other thread computed: decode at 2 threads was 7–11 %
        // slower at batch 1 and 4–8 % at batch 16, prefill 0–4 % (alternating steps,
        // BENCHMARKS.md). A worker that is late to a region leaves its task to the caller.
        let tasks_wanted = workers.threads();
        // An even count, so the VNNI kernels' pairs of groups never straddle two tasks.
        let groups_per_task = group_count
            .div_ceil(tasks_wanted)
            .max(1)
            .next_multiple_of(2);
        let rows_per_task = groups_per_task * GROUP_ROWS;
        // Each task's rows of every token: the kernels write results where they belong, so
        // no transposed copy is needed.
        let mut task_outs: Vec<Vec<&mut [f32]>> = (0..group_count.div_ceil(groups_per_task))
            .map(|_| Vec::with_capacity(tokens))
            .collect();
        for token_out in out.chunks_exact_mut(self.rows) {
            for (task_out, rows) in task_outs
                .iter_mut()
                .zip(token_out.chunks_mut(rows_per_task))
            {
                task_out.push(rows);
            }
        }
        workers.for_each_chunk_mut(&mut task_outs, 1, &|task, task_out| {
            let first_group = task * groups_per_task;
            let groups = first_group..(first_group + groups_per_task).min(group_count);
            // Token tiles keep a tile's activations in L1/L2 while the task's weights stream.
            for first_token in (0..tokens).step_by(TOKEN_TILE) {
                let job = TaskJob {
                    acts,
                    tokens: first_token..(first_token + TOKEN_TILE).min(tokens),
                    out: &mut task_out[0],
                    first_group: groups.start,
                };
                self.run_groups(backend, groups.clone(), job);
            }
        });
    }

    /// Computes row groups `groups` (the task's) for the job's tokens.
    fn run_groups(&self, backend: Backend, groups: Range<usize>, mut job: TaskJob) {
        let blocks_per_row = self.cols / BLOCK;
        let blocks = |g: usize| g * blocks_per_row..(g + 1) * blocks_per_row;
        let vnni_kernel = !matches!(self.storage, Storage::Q8Offset(_));
        // Q5_0 takes the VNNI kernel at any token count: putting in its fifth bits costs the
        // AVX2 kernel more than the turn-around costs the VNNI one (Q4_K_M SmolLM2, mostly
        // Q5_0, batch-1 decode: 164 → 250 and 135 → 185 tok/s at 1 thread, 374 → 435 and
        // 262 → 319 at 2, alternating; BENCHMARKS.md). Same bits either way (tested).
        let vnni_tokens = match self.storage {
            Storage::Q50(_) => vnni::cpu_ok(),
            _ => vnni::worth_it(job.tokens.len()),
        };
        if backend == Backend::Avx512Vnni && vnni_kernel && vnni_tokens {
            // Two groups (16 rows) per pass; an odd last group goes alone.
            for first in groups.clone().step_by(2) {
                let second = (first + 1).min(groups.end - 1);
                let rows = (second - first + 1) * GROUP_ROWS;
                let pair = job.rows(first, rows);
                match (&self.storage, &self.vnni_q80) {
                    // Tasks start on even groups, so `first / 2` is this pair's number.
                    (_, Some(pairs)) => vnni::q80_turned_pair(&pairs[blocks(first / 2)], pair),
                    (Storage::Q41(all), None) => {
                        vnni::q41_pair([&all[blocks(first)], &all[blocks(second)]], pair)
                    }
                    (Storage::Q50(all), None) => {
                        vnni::q50_pair([&all[blocks(first)], &all[blocks(second)]], pair)
                    }
                    (Storage::Q80(all), None) => {
                        vnni::q80_pair([&all[blocks(first)], &all[blocks(second)]], pair)
                    }
                    (Storage::Q8Offset(_), None) => {
                        unreachable!("no VNNI kernel for Q8Offset blocks")
                    }
                }
            }
            return;
        }
        for g in groups {
            let group = job.rows(g, GROUP_ROWS);
            match &self.storage {
                Storage::Q41(all) => q41_group(backend, &all[blocks(g)], group),
                Storage::Q50(all) => q50_group(backend, &all[blocks(g)], group),
                Storage::Q8Offset(all) => q8_offset_group(backend, &all[blocks(g)], group),
                Storage::Q80(all) => q80_group(backend, &all[blocks(g)], group),
            }
        }
    }
}

/// Tokens per tile in a matmul: 64 tokens of a 1536-wide row are 120 KiB of activations.
const TOKEN_TILE: usize = 64;

/// One task's share of a matmul: its row groups from `first_group` on, for tokens `tokens`;
/// `out[t]` is token t's slice of the task's rows.
struct TaskJob<'a, 'o> {
    acts: &'a QuantActs,
    tokens: Range<usize>,
    out: &'a mut [&'o mut [f32]],
    first_group: usize,
}

impl<'o> TaskJob<'_, 'o> {
    /// The job for `rows` rows starting at group `group`.
    fn rows(&mut self, group: usize, rows: usize) -> GroupJob<'_, 'o> {
        let first_row = (group - self.first_group) * GROUP_ROWS;
        GroupJob::new(
            self.acts,
            self.tokens.clone(),
            &mut *self.out,
            first_row,
            rows,
        )
    }
}

fn q41_group(backend: Backend, group: &[Q41GroupBlock], job: GroupJob) {
    match backend {
        Backend::Scalar => scalar::q41_group(group, job),
        // VNNI below its token threshold (`run_groups` sends larger jobs to `vnni`).
        Backend::Avx2 | Backend::Avx512Vnni => avx2::q41_group(group, job),
        Backend::GgmlExact | Backend::GgmlExactAvx2 => ggml_exact::q41_group(group, job),
    }
}

/// Q5_0 has no ggml-exact kernel: those backends run the AVX2 one (integer sums equal to
/// llama.cpp's, float steps in the fast kernels' order).
fn q50_group(backend: Backend, group: &[Q50GroupBlock], job: GroupJob) {
    match backend {
        Backend::Scalar => scalar::q50_group(group, job),
        Backend::Avx2 | Backend::Avx512Vnni | Backend::GgmlExact | Backend::GgmlExactAvx2 => {
            avx2::q50_group(group, job)
        }
    }
}

/// Q8Offset blocks have no VNNI or ggml-exact kernel of their own: those backends run the
/// AVX2 one (which falls back to the scalar one on a CPU without AVX2).
fn q8_offset_group(backend: Backend, group: &[Q8OffsetGroupBlock], job: GroupJob) {
    match backend {
        Backend::Scalar => scalar::q8_offset_group(group, job),
        Backend::Avx2 | Backend::Avx512Vnni | Backend::GgmlExact | Backend::GgmlExactAvx2 => {
            avx2::q8_offset_group(group, job)
        }
    }
}

fn q80_group(backend: Backend, group: &[Q80GroupBlock], job: GroupJob) {
    match backend {
        Backend::Scalar => scalar::q80_group(group, job),
        Backend::Avx2 | Backend::Avx512Vnni => avx2::q80_group(group, job),
        Backend::GgmlExact | Backend::GgmlExactAvx2 => ggml_exact::q80_group(group, job),
    }
}

fn f16_bits(bytes: &[u8]) -> u16 {
    u16::from_le_bytes([bytes[0], bytes[1]])
}

/// Packs one 32-column block of 8 rows; `source(r)` is row r's 20-byte GGUF block
/// (f16 d, f16 m, 16 bytes of nibbles).
fn pack_q41<'a>(source: impl Fn(usize) -> &'a [u8]) -> Q41GroupBlock {
    let mut packed = Q41GroupBlock {
        qs: [0; 128],
        d: [0; 8],
        m: [0; 8],
    };
    for row in 0..GROUP_ROWS {
        let src = source(row);
        let start = (row / 2) * 32 + (row % 2) * 16;
        packed.qs[start..start + 16].copy_from_slice(&src[4..20]);
    }
    for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
        let src = source(row);
        packed.d[lane] = f16_bits(&src[0..2]);
        packed.m[lane] = f16_bits(&src[2..4]);
    }
    packed
}

/// Packs one 32-column block of 8 rows; `source(r)` is row r's 22-byte GGUF Q5_0 block
/// (f16 d, 4 bytes of fifth bits, 16 bytes of nibbles).
fn pack_q50<'a>(source: impl Fn(usize) -> &'a [u8]) -> Q50GroupBlock {
    let mut packed = Q50GroupBlock {
        qs: [0; 128],
        qh: [0; 8],
        d: [0; 8],
    };
    for row in 0..GROUP_ROWS {
        let src = source(row);
        let start = (row / 2) * 32 + (row % 2) * 16;
        packed.qs[start..start + 16].copy_from_slice(&src[6..22]);
    }
    for (lane, &row) in Q41_LANE_ROW.iter().enumerate() {
        let src = source(row);
        packed.d[lane] = f16_bits(&src[0..2]);
        packed.qh[lane] = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
    }
    packed
}

/// Packs one 32-column block of 8 rows; `source(r)` is row r's 36-byte Q8Offset block
/// (f16 d, f16 m, 32 signed bytes).
fn pack_q8_offset<'a>(source: impl Fn(usize) -> &'a [u8]) -> Q8OffsetGroupBlock {
    let mut packed = Q8OffsetGroupBlock {
        qs: [0; 256],
        d: [0; 8],
        m: [0; 8],
    };
    for row in 0..GROUP_ROWS {
        let src = source(row);
        packed.d[row] = f16_bits(&src[0..2]);
        packed.m[row] = f16_bits(&src[2..4]);
        for (dst, &byte) in packed.qs[row * 32..(row + 1) * 32]
            .iter_mut()
            .zip(&src[4..36])
        {
            *dst = byte as i8;
        }
    }
    packed
}

/// Packs one 32-column block of 8 rows; `source(r)` is row r's 34-byte GGUF block
/// (f16 d, 32 signed bytes).
fn pack_q80<'a>(source: impl Fn(usize) -> &'a [u8]) -> Q80GroupBlock {
    let mut packed = Q80GroupBlock {
        qs: [0; 256],
        d: [0; 8],
    };
    for row in 0..GROUP_ROWS {
        let src = source(row);
        packed.d[row] = f16_bits(&src[0..2]);
        for (dst, &byte) in packed.qs[row * 32..(row + 1) * 32]
            .iter_mut()
            .zip(&src[2..34])
        {
            *dst = byte as i8;
        }
    }
    packed
}

/// One block of a pair of Q8_0 groups, turned for the VNNI kernel (see [`Q80PairBlock`]).
fn turn_q80_pair(groups: [&Q80GroupBlock; 2]) -> Q80PairBlock {
    let mut turned = Q80PairBlock {
        qs: [0; 512],
        d: [0; 16],
    };
    for (half, group) in groups.iter().enumerate() {
        for row in 0..GROUP_ROWS {
            let lane = half * GROUP_ROWS + row;
            turned.d[lane] = group.d[row];
            let weights = &group.qs[row * BLOCK..(row + 1) * BLOCK];
            for (k, dword) in weights.chunks_exact(4).enumerate() {
                for (j, &w) in dword.iter().enumerate() {
                    turned.qs[64 * k + 4 * lane + j] = (w as u8) ^ 0x80;
                }
            }
        }
    }
    turned
}
