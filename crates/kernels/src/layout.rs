//! The compute layouts the matmul kernels run: weight blocks repacked into groups of 8 rows,
//! and the job one kernel call computes. The lowest layer of the matmul: the per-ISA kernels
//! (`scalar`, `avx2`, `vnni`, `ggml_exact`) and `formats` read it, `matrix` builds on all of
//! them, and nothing here imports a kernel.
//!
//! Q4_1 group block (one 32-column block of 8 rows): `qs` holds the rows' packed nibbles as four
//! 32-byte pairs `[row 2p | row 2p+1]`, and `d`/`m` the f16 scales in the lane order the AVX2
//! reduction produces (`LANE_ROW`). Q8_0 group block: 8 rows of 32 signed bytes, scales in row
//! order. Both keep the file's exact bit patterns, so results do not depend on the repacking.

use crate::{QuantActs, BLOCK};
use std::ops::Range;

/// Rows per group: one AVX2 register of f32 results.
pub(crate) const GROUP_ROWS: usize = 8;
/// The row each output lane of the Q4_1 reduction holds (see `avx2::q41_group`).
pub(crate) const Q41_LANE_ROW: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// The compute layouts, each named by the GGUF format whose blocks it is built from
/// (`QuantMatrix::from_gguf_bytes`); `formats` turns every other format into one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Q4_1,
    Q5_0,
    Q8_0,
    /// Signed bytes with an f16 scale and an f16 offset per 32 values (`value = d · q + m`):
    /// an encoding of Airlock's own (`formats`), since no GGUF format has both. Every format
    /// reaches it as faithfully as its own layout, so matrices of different formats stacked
    /// into one (Q, K and V) meet here.
    Q8Offset,
}

impl WeightFormat {
    /// Bytes of one 32-value block in the GGUF file.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q5_0 => 22,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q8Offset => 36,
        }
    }
}

#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Q41GroupBlock {
    pub qs: [u8; 128],
    pub d: [u16; 8],
    pub m: [u16; 8],
}

/// One 32-column block of 8 rows of Q5_0 (`value = d · (q − 16)`, q of 5 bits): `qs` holds the
/// low nibbles as [`Q41GroupBlock`] does, `qh` each row's 32 fifth bits (bit j is value j's),
/// and `qh` and `d` follow the Q4_1 reduction's lane order (`Q41_LANE_ROW`), so the kernels
/// unpack as for Q4_1 and put the fifth bits in before multiplying.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Q50GroupBlock {
    pub qs: [u8; 128],
    pub qh: [u32; 8],
    pub d: [u16; 8],
}

/// One 32-column block of 8 rows of [`WeightFormat::Q8Offset`]: `qs[32 r + j]` is row r's value
/// j, and `d`/`m` its f16 scale and offset in row order (`value = d · q + m`).
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Q8OffsetGroupBlock {
    pub qs: [i8; 256],
    pub d: [u16; 8],
    pub m: [u16; 8],
}

#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Q80GroupBlock {
    pub qs: [i8; 256],
    pub d: [u16; 8],
}

/// One 32-column block of a pair of Q8_0 row groups (16 rows), laid out as the VNNI kernel
/// uses it: `qs[64k + 4i..64k + 4i + 4]` is dword k (columns 4k..4k+4) of row i, each byte
/// +128 (sign bit flipped) so it is `vpdpbusd`'s unsigned operand; `d` holds the 16 rows'
/// scales in row order. Row i < 8 is row i of the pair's first group, row 8 + i row i of the
/// second (the first again when a matrix ends on an odd group).
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Q80PairBlock {
    pub qs: [u8; 512],
    pub d: [u16; 16],
}

// The kernels index these blocks by byte offsets (prefetch strides, `size_of` steps): no
// padding may creep in. 8 rows × 32 values at 4 (Q4_1) or 8 (Q8_0) bits, then f16 scales.
const _: () = assert!(std::mem::size_of::<Q41GroupBlock>() == 8 * 16 + 2 * 8 * 2);
const _: () = assert!(std::mem::size_of::<Q80GroupBlock>() == 8 * 32 + 8 * 2);
const _: () = assert!(std::mem::size_of::<Q80PairBlock>() == 16 * 32 + 16 * 2);
const _: () = assert!(std::mem::size_of::<Q8OffsetGroupBlock>() == 8 * 32 + 2 * 8 * 2);
const _: () =
    assert!(std::mem::size_of::<Q8OffsetGroupBlock>() == 8 * WeightFormat::Q8Offset.block_bytes());
// Each group block holds 8 of the file's blocks, repacked, and nothing else.
const _: () = assert!(std::mem::size_of::<Q41GroupBlock>() == 8 * WeightFormat::Q4_1.block_bytes());
const _: () = assert!(std::mem::size_of::<Q80GroupBlock>() == 8 * WeightFormat::Q8_0.block_bytes());
const _: () = assert!(std::mem::size_of::<Q50GroupBlock>() == 8 * WeightFormat::Q5_0.block_bytes());

// SAFETY: all five are arrays of integers only; all-zero bytes are a valid value of each.
unsafe impl bytemuck::Zeroable for Q41GroupBlock {}
// SAFETY: as above.
unsafe impl bytemuck::Zeroable for Q50GroupBlock {}
// SAFETY: as above.
unsafe impl bytemuck::Zeroable for Q8OffsetGroupBlock {}
// SAFETY: as above.
unsafe impl bytemuck::Zeroable for Q80GroupBlock {}
// SAFETY: as above.
unsafe impl bytemuck::Zeroable for Q80PairBlock {}

/// What one kernel call computes: `rows` rows (one group of 8, or two for the VNNI kernels)
/// for tokens `tokens` of `acts`; row r of token t goes to `out[t][first_row + r]`.
pub(crate) struct GroupJob<'a, 'o> {
    pub acts: &'a QuantActs,
    pub tokens: Range<usize>,
    out: &'a mut [&'o mut [f32]],
    first_row: usize,
    rows: usize,
}

impl<'a, 'o> GroupJob<'a, 'o> {
    /// A job over `out[t][first_row..first_row + rows]`.
    pub(crate) fn new(
        acts: &'a QuantActs,
        tokens: Range<usize>,
        out: &'a mut [&'o mut [f32]],
        first_row: usize,
        rows: usize,
    ) -> Self {
        GroupJob {
            acts,
            tokens,
            out,
            first_row,
            rows,
        }
    }

    /// Rows this job writes for each token.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The part of a two-group job that is group `g` (0 or 1).
    pub fn group(&mut self, g: usize) -> GroupJob<'_, 'o> {
        assert!((g + 1) * GROUP_ROWS <= self.rows, "a group of the job");
        GroupJob {
            acts: self.acts,
            tokens: self.tokens.clone(),
            out: &mut *self.out,
            first_row: self.first_row + g * GROUP_ROWS,
            rows: GROUP_ROWS,
        }
    }

    /// Stores row `row`'s result for token `token`.
    #[inline(always)]
    pub fn put(&mut self, token: usize, row: usize, value: f32) {
        debug_assert!(row < self.rows, "row within the job");
        self.out[token][self.first_row + row] = value;
    }

    /// Token `token`'s results, all of the job's rows in order.
    #[inline(always)]
    pub fn token_rows(&mut self, token: usize) -> &mut [f32] {
        &mut self.out[token][self.first_row..self.first_row + self.rows]
    }

    /// The bounds the kernels rely on: one activation block per weight block, tokens within
    /// the activations and the outputs, and room for the job's rows in every token's output.
    pub fn check(&self, blocks: usize, rows: usize) {
        assert_eq!(self.rows, rows, "a job for this kernel's row count");
        assert_eq!(
            self.acts.cols() / BLOCK,
            blocks,
            "one activation block per weight block"
        );
        assert!(
            self.tokens.end <= self.acts.rows() && self.tokens.end <= self.out.len(),
            "tokens within the activations and the outputs"
        );
        for out in &self.out[self.tokens.clone()] {
            assert!(
                self.first_row + self.rows <= out.len(),
                "room for the job's rows"
            );
        }
    }
}
