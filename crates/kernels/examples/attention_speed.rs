//! Micro-benchmark of batched-decode attention: `cargo run --release -p kernels --example
//! attention_speed -- [SEQS] [CONTEXT] [REPS]` runs one decode step's attention (30 layers ×
//! SEQS sequences × 3 K/V heads of 3 query heads, SmolLM2's shape) over K/V pages scattered in
//! a pool larger than the last-level cache, as a batch-16 step meets them, on one thread.
//! Prints the median step time and the K/V bytes read per second. On the 2026-12-04 machine:
//! 16 × 80 about 3.8 ms per step (7–8 GB/s, ~2.6 µs per task; 5.5 ms with the prefetches
//! into L1 of before); with 2 sequences kept cached (`CACHED=1 … 2 80`) ~1.7 µs per task: at
//! batch 16, attention waits on memory. On 2026-12-05, with the K/V requested a few slots at
//! a time as the scores pass goes instead of whole pages ahead: 16 × 80 3.4 → 2.4 ms per
//! step (~1.65 µs per task; cached ~1.4 µs), 16 × 500 17.8 → 13.3 ms. The pool is a
//! huge-page buffer like the real one; `SMALL_PAGES=1` puts it on 4 KiB pages (no difference
//! measured: TLB misses are not what attention waits on).

use half::f16;
use kernels::{Backend, KvHeadAttention};
use std::time::Instant;

const KV_HEADS: usize = 3;
const GROUP: usize = 3;
const HEAD_DIM: usize = 64;
const PAGE: usize = 16;

/// One K/V head's slots of a page: the layout of the pool's pages.
fn head(page: &[f16], layer: usize, kind: usize, kv_head: usize) -> &[f16] {
    let start = ((layer * 2 + kind) * KV_HEADS + kv_head) * PAGE * HEAD_DIM;
    &page[start..start + PAGE * HEAD_DIM]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric argument"))
        .collect();
    let seqs = args.first().copied().unwrap_or(16);
    let context = args.get(1).copied().unwrap_or(80).max(1);
    let reps = args.get(2).copied().unwrap_or(9).max(1);
    // CACHED=1: the same sequences every rep, so their pages may stay cached (the compute
    // part alone when they fit).
    let cached = std::env::var_os("CACHED").is_some();
    // LAYERS=n: fewer layers than SmolLM2's 30, so that with CACHED=1 the K/V stays in L2 as
    // prefill's does (the compute alone).
    let layers: usize = std::env::var("LAYERS").map_or(30, |n| n.parse().expect("a layer count"));
    // Each page holds all layers' K and V heads for PAGE positions, as the pool's do; the
    // pool is padded to ~256 MB so consecutive steps do not find each other's pages cached.
    let page_elems = layers * 2 * KV_HEADS * PAGE * HEAD_DIM;
    let pages_per_seq = context.div_ceil(PAGE);
    let fresh_pages = seqs * pages_per_seq * if cached { 1 } else { reps + 1 };
    let mut pool_pages = fresh_pages.max((256 << 20) / (2 * page_elems));
    if pool_pages.is_multiple_of(7919) {
        pool_pages += 1;
    }
    // One buffer of pages, as the pool's: advised for huge pages, or with `SMALL_PAGES=1` a
    // plain heap buffer on 4 KiB pages, to compare.
    let mut pool: Box<dyn std::ops::DerefMut<Target = [f16]>> =
        if std::env::var_os("SMALL_PAGES").is_some() {
            Box::new(vec![f16::ZERO; pool_pages * page_elems])
        } else {
            Box::new(hugemem::HugeBuffer::<f16>::zeroed(pool_pages * page_elems))
        };
    for (i, value) in pool.iter_mut().enumerate() {
        let (p, i) = (i / page_elems, i % page_elems);
        *value = f16::from_f32(((p * 31 + i * 7) % 97) as f32 / 97.0 - 0.5);
    }
    // Scattered page tables: sequence s, page p → a pool page, all distinct (7919 is prime
    // and does not divide the pool's size).
    let table = |s: usize, p: usize| (s * pages_per_seq + p) * 7919 % pool_pages;
    let queries: Vec<f32> = (0..GROUP * HEAD_DIM)
        .map(|i| (i % 13) as f32 / 13.0 - 0.5)
        .collect();
    let mut out = vec![0f32; GROUP * HEAD_DIM];
    // AVX2=1: the AVX2 kernels on a CPU that has AVX-512.
    let backend = if std::env::var_os("AVX2").is_some() {
        Backend::Avx2
    } else {
        Backend::detect()
    };
    // (layer, sequence, K/V head) in the order a step runs them.
    let tasks: Vec<(usize, usize, usize)> = (0..layers)
        .flat_map(|l| (0..seqs).flat_map(move |s| (0..KV_HEADS).map(move |h| (l, s, h))))
        .collect();
    let mut times = Vec::new();
    for rep in 0..reps + 1 {
        // Different sequences each rep (a fresh offset into the pool), so nothing is cached.
        let offset = if cached { 0 } else { rep * seqs };
        let started = Instant::now();
        let lists = |&(layer, seq, kv_head): &(usize, usize, usize)| {
            let page = |p| {
                let start = table(seq + offset, p) * page_elems;
                &pool[start..start + page_elems]
            };
            let keys: Vec<&[f16]> = (0..pages_per_seq)
                .map(|p| head(page(p), layer, 0, kv_head))
                .collect();
            let values: Vec<&[f16]> = (0..pages_per_seq)
                .map(|p| head(page(p), layer, 1, kv_head))
                .collect();
            (keys, values)
        };
        for task in &tasks {
            let (keys, values) = lists(task);
            KvHeadAttention {
                keys: &keys,
                values: &values,
                page_size: PAGE,
                head_dim: HEAD_DIM,
                len: context,
                masked: 0,
                scale: 0.125,
            }
            .run(backend, &queries, &mut out);
        }
        if rep > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let bytes = (layers * seqs * KV_HEADS * 2 * context * HEAD_DIM * 2) as f64;
    println!(
        "{backend:?} {seqs} seqs × context {context}: {:.3} ms per step, {:.2} GB/s of K/V, {:.0} ns per task (checksum {:.3})",
        median * 1e3,
        bytes / median / 1e9,
        median * 1e9 / (layers * seqs * KV_HEADS) as f64,
        out.iter().sum::<f32>()
    );
}
