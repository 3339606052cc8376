//! Portable reference kernels. They define what the SIMD kernels must compute.

use crate::layout::{
    GroupJob, Q41GroupBlock, Q50GroupBlock, Q80GroupBlock, Q8OffsetGroupBlock, GROUP_ROWS,
    Q41_LANE_ROW,
};
use half::f16;

#[inline(always)]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Where row `row` of a group sits among the Q4_1 scale lanes.
pub(crate) fn q41_lane(row: usize) -> usize {
    Q41_LANE_ROW
        .iter()
        .position(|&r| r == row)
        .expect("every row of a group has a lane")
}

#[inline(always)]
pub(crate) fn q41_row_nibbles(block: &Q41GroupBlock, row: usize) -> &[u8] {
    q41_row_nibbles_of(&block.qs, row)
}

/// Row `row`'s 16 bytes of nibbles among a group's 128 (`[row 2p | row 2p+1]` pairs).
#[inline(always)]
fn q41_row_nibbles_of(qs: &[u8; 128], row: usize) -> &[u8] {
    let start = (row / 2) * 32 + (row % 2) * 16;
    &qs[start..start + 16]
}

/// Computes 8 rows × the job's tokens.
pub(crate) fn q41_group(group: &[Q41GroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    let (acts, tokens) = (job.acts, job.tokens.clone());
    for row in 0..GROUP_ROWS {
        let lane = q41_lane(row);
        for token in tokens.clone() {
            let mut sum = 0f32;
            for (w, a) in group.iter().zip(acts.row(token)) {
                let nibbles = q41_row_nibbles(w, row);
                let mut sumi = 0i32;
                for (j, &byte) in nibbles.iter().enumerate() {
                    sumi += (byte & 0x0F) as i32 * a.qs[j] as i32;
                    sumi += (byte >> 4) as i32 * a.qs[j + 16] as i32;
                }
                sum += f16_to_f32(w.d[lane]) * a.d * sumi as f32 + f16_to_f32(w.m[lane]) * a.s;
            }
            job.put(token, row, sum);
        }
    }
}

/// Row `row`'s 32 five-bit values (0..=31) of a Q5_0 group block.
pub(crate) fn q50_row_values(block: &Q50GroupBlock, row: usize) -> [u8; 32] {
    let qh = block.qh[q41_lane(row)];
    let mut values = [0u8; 32];
    for (j, &byte) in q41_row_nibbles_of(&block.qs, row).iter().enumerate() {
        values[j] = (byte & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        values[j + 16] = (byte >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    values
}

/// Computes 8 rows × the job's tokens: `Σ (q − 16) · x` in integers, as llama.cpp does.
pub(crate) fn q50_group(group: &[Q50GroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    let (acts, tokens) = (job.acts, job.tokens.clone());
    for row in 0..GROUP_ROWS {
        let lane = q41_lane(row);
        for token in tokens.clone() {
            let mut sum = 0f32;
            for (w, a) in group.iter().zip(acts.row(token)) {
                let values = q50_row_values(w, row);
                let sumi: i32 = values
                    .iter()
                    .zip(&a.qs)
                    .map(|(&q, &x)| (q as i32 - 16) * x as i32)
                    .sum();
                sum += f16_to_f32(w.d[lane]) * a.d * sumi as f32;
            }
            job.put(token, row, sum);
        }
    }
}

/// Computes 8 rows × the job's tokens.
pub(crate) fn q8_offset_group(group: &[Q8OffsetGroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    let (acts, tokens) = (job.acts, job.tokens.clone());
    for row in 0..GROUP_ROWS {
        for token in tokens.clone() {
            let mut sum = 0f32;
            for (w, a) in group.iter().zip(acts.row(token)) {
                let values = &w.qs[row * 32..(row + 1) * 32];
                let sumi: i32 = values
                    .iter()
                    .zip(&a.qs)
                    .map(|(&q, &x)| q as i32 * x as i32)
                    .sum();
                sum += f16_to_f32(w.d[row]) * a.d * sumi as f32 + f16_to_f32(w.m[row]) * a.s;
            }
            job.put(token, row, sum);
        }
    }
}

/// Computes 8 rows × the job's tokens.
pub(crate) fn q80_group(group: &[Q80GroupBlock], mut job: GroupJob) {
    job.check(group.len(), GROUP_ROWS);
    let (acts, tokens) = (job.acts, job.tokens.clone());
    for row in 0..GROUP_ROWS {
        for token in tokens.clone() {
            let mut sum = 0f32;
            for (w, a) in group.iter().zip(acts.row(token)) {
                let weights = &w.qs[row * 32..(row + 1) * 32];
                let sumi: i32 = weights
                    .iter()
                    .zip(&a.qs)
                    .map(|(&x, &y)| x as i32 * y as i32)
                    .sum();
                sum += f16_to_f32(w.d[row]) * a.d * sumi as f32;
            }
            job.put(token, row, sum);
        }
    }
}

pub(crate) fn dequantize_q41(block: &Q41GroupBlock, row: usize, out: &mut [f32]) {
    let lane = q41_lane(row);
    let (d, m) = (f16_to_f32(block.d[lane]), f16_to_f32(block.m[lane]));
    for (j, &byte) in q41_row_nibbles(block, row).iter().enumerate() {
        out[j] = d * (byte & 0x0F) as f32 + m;
        out[j + 16] = d * (byte >> 4) as f32 + m;
    }
}

pub(crate) fn dequantize_q50(block: &Q50GroupBlock, row: usize, out: &mut [f32]) {
    let d = f16_to_f32(block.d[q41_lane(row)]);
    for (o, q) in out.iter_mut().zip(q50_row_values(block, row)) {
        *o = (q as i32 - 16) as f32 * d;
    }
}

pub(crate) fn dequantize_q8_offset(block: &Q8OffsetGroupBlock, row: usize, out: &mut [f32]) {
    let (d, m) = (f16_to_f32(block.d[row]), f16_to_f32(block.m[row]));
    for (o, &q) in out.iter_mut().zip(&block.qs[row * 32..(row + 1) * 32]) {
        *o = d * q as f32 + m;
    }
}

pub(crate) fn dequantize_q80(block: &Q80GroupBlock, row: usize, out: &mut [f32]) {
    let d = f16_to_f32(block.d[row]);
    for (o, &q) in out.iter_mut().zip(&block.qs[row * 32..(row + 1) * 32]) {
        *o = d * q as f32;
    }
}

pub(crate) fn axpy_f16(out: &mut [f32], weight: f32, v: &[f16]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += weight * x.to_f32();
    }
}
