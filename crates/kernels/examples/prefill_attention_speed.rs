//! Micro-benchmark of prefill attention in row blocks: `cargo run --release -p kernels
//! --example prefill_attention_speed -- [CONTEXT] [ROWS] [REPS]` runs the last ROWS rows of a
//! CONTEXT-token prompt (default 8,192 and 240) through `KvHeadAttention::run_rows` for one
//! K/V head of SmolLM2's shape (3 query heads of 64), on one thread, in blocks of each size in
//! `BLOCKS` (default `5,8,10,16`), the sizes taking turns within each of REPS rounds. Prints
//! the median and least µs per row for each block size. It chose the model's
//! `MAX_ROWS_PER_BLOCK` (2026-12-07, the 2-core AMD EPYC VM: 8,192 positions 97.3 µs a row in
//! blocks of 5, 87.5 in blocks of 10, 92.1 in blocks of 16).

use half::f16;
use kernels::{Backend, KvHeadAttention};
use std::time::Instant;

const GROUP: usize = 3;
const HEAD_DIM: usize = 64;
const PAGE: usize = 16;
const LAYERS: usize = 30;
const KV_HEADS: usize = 3;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric argument"))
        .collect();
    let context = args.first().copied().unwrap_or(8192);
    let total_rows = args.get(1).copied().unwrap_or(240);
    let reps = args.get(2).copied().unwrap_or(5);
    let blocks: Vec<usize> = std::env::var("BLOCKS").map_or(vec![5, 8, 10, 16], |s| {
        s.split(',')
            .map(|v| v.parse().expect("block sizes, comma separated"))
            .collect()
    });
    let page_elems = LAYERS * 2 * KV_HEADS * PAGE * HEAD_DIM;
    assert!(
        total_rows > 0 && total_rows <= context && blocks.iter().all(|&b| (1..=16).contains(&b)),
        "ROWS within the context, block sizes 1 to 16"
    );
    // Each page holds all layers' K and V heads for PAGE positions, as the pool's do.
    let pages = context.div_ceil(PAGE);
    let pool: Vec<f16> = (0..pages * page_elems)
        .map(|i| f16::from_f32(((i * 7 + i / 977) % 97) as f32 / 97.0 - 0.5))
        .collect();
    let head = |p: usize, kind: usize| {
        let start = p * page_elems + (kind * KV_HEADS) * PAGE * HEAD_DIM;
        &pool[start..start + PAGE * HEAD_DIM]
    };
    let keys: Vec<&[f16]> = (0..pages).map(|p| head(p, 0)).collect();
    let values: Vec<&[f16]> = (0..pages).map(|p| head(p, 1)).collect();
    let qs: Vec<Vec<f32>> = (0..16)
        .map(|r| {
            (0..GROUP * HEAD_DIM)
                .map(|i| ((i * 5 + r) % 13) as f32 / 4.0 - 1.5)
                .collect()
        })
        .collect();
    let backend = Backend::detect();
    let mut times = vec![Vec::new(); blocks.len()];
    let mut checksum = 0f32;
    for _ in 0..reps {
        for (b, &rows) in blocks.iter().enumerate() {
            let started = Instant::now();
            let mut done = 0;
            let mut out = vec![0f32; rows * GROUP * HEAD_DIM];
            let queries: Vec<&[f32]> = qs[..rows].iter().map(|q| &q[..]).collect();
            while done + rows <= total_rows {
                let att = KvHeadAttention {
                    keys: &keys,
                    values: &values,
                    page_size: PAGE,
                    head_dim: HEAD_DIM,
                    len: context - done,
                    masked: 0,
                    scale: 0.125,
                };
                att.run_rows(backend, &queries, &mut out);
                done += rows;
            }
            times[b].push(started.elapsed().as_secs_f64() * 1e6 / done as f64);
            checksum += out.iter().sum::<f32>();
        }
    }
    for (b, t) in blocks.iter().zip(&mut times) {
        t.sort_by(f64::total_cmp);
        println!(
            "{backend:?}, {context} positions, blocks of {b:2} rows: median {:.2} µs per row, least {:.2}",
            t[t.len() / 2],
            t[0]
        );
    }
    println!("(checksum {checksum:.3})");
}
