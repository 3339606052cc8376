//! What the run-time guards cost, measured directly rather than as a small difference of two
//! noisy throughputs: each guard's own work timed beside the work it guards, in the same run.
//!
//! - Owner/generation check (I1): `PagePool::verify_batch` over a decode batch's tables, against
//!   one batched decode step of the real model over the same tables.
//! - Transfer checksum (I4): `transfer_checksum` over a prompt's pages (computed twice per
//!   transfer: by prefill, and by decode over its own copy), against prefilling that prompt.
//!
//! Deferred release costs no CPU: it holds a transfer's prefill pages one ack round trip
//! longer (see BENCHMARKS.md).
//!
//! `cargo bench -p airlock --bench guard_cost` (model from `AIRLOCK_MODEL`, else the default
//! path `scripts/fetch-model.sh` fills). Prints medians of repeated runs and the ratios.

use kv::{Owner, PagePool, PageTable, PoolConfig, PoolSize, RequestId, TenantId};
use model::{LoadOptions, Model, SeqStep};
use std::time::Instant;
use transfer::{transfer_checksum, TransferDone, TransferId};

const PAGE_SIZE: usize = 16;
const BATCH: usize = 8;
const CONTEXT: usize = 512;
const PROMPT: usize = 256;

fn model_path() -> String {
    std::env::var("AIRLOCK_MODEL").unwrap_or_else(|_| {
        format!(
            "{}/../../models/SmolLM2-135M-Instruct.Q4_1.gguf",
            env!("CARGO_MANIFEST_DIR")
        )
    })
}

/// Median wall time in seconds of `runs` calls of `work`.
fn median_seconds(runs: usize, mut work: impl FnMut()) -> f64 {
    let times: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            work();
            start.elapsed().as_secs_f64()
        })
        .collect();
    stats::median(&times)
}

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let options = LoadOptions {
        threads,
        backend: None,
    };
    let loaded = Model::load(model_path().as_ref(), &options, &mut |_| {})
        .unwrap_or_else(|e| panic!("{e}: run scripts/fetch-model.sh or set AIRLOCK_MODEL"));
    let model = loaded.model;
    let mut pool = PagePool::new(PoolConfig {
        layout: model.config().kv_layout(PAGE_SIZE),
        size: PoolSize::Tokens(BATCH * CONTEXT),
        scrub_on_free: false,
    })
    .expect("pool");
    let tables: Vec<PageTable> = (0..BATCH)
        .map(|i| {
            let owner = Owner {
                tenant: TenantId(i as u64 % 2),
                request: RequestId(i as u64),
            };
            pool.allocate(owner, CONTEXT).expect("pages")
        })
        .collect();
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 100 + i % 1000).collect();
    let prefill_seconds = median_seconds(3, || {
        let step = SeqStep {
            table: &tables[0],
            tokens: &prompt,
            start_pos: 0,
            logits: model::LogitRows::None,
        };
        model.forward(&mut pool, &[step]).expect("prefill");
    });
    for table in &tables[1..] {
        let step = SeqStep {
            table,
            tokens: &prompt,
            start_pos: 0,
            logits: model::LogitRows::None,
        };
        model.forward(&mut pool, &[step]).expect("prefill");
    }
    let next = [7u32];
    let decode_seconds = median_seconds(15, || {
        let steps: Vec<SeqStep> = tables
            .iter()
            .map(|table| SeqStep {
                table,
                tokens: &next,
                start_pos: PROMPT,
                logits: model::LogitRows::Last,
            })
            .collect();
        model.forward(&mut pool, &steps).expect("decode");
    });
    let refs: Vec<&PageTable> = tables.iter().collect();
    let verify_seconds = median_seconds(2001, || {
        std::hint::black_box(pool.verify_batch(&refs).expect("verifies"));
    });
    let page_count = PROMPT / PAGE_SIZE;
    let pages: Vec<Vec<u8>> = {
        let views = pool.verify_batch(&[&tables[0]]).expect("verifies");
        (0..page_count)
            .map(|i| bytemuck::cast_slice::<_, u8>(views[0].page(i)).to_vec())
            .collect()
    };
    let done = TransferDone {
        transfer: TransferId(1),
        request: RequestId(1),
        tenant: TenantId(0),
        page_count: page_count as u32,
        token_count: PROMPT as u32,
        checksum: 0,
    };
    let checksum_seconds = median_seconds(201, || {
        std::hint::black_box(transfer_checksum(&done, pages.iter().map(Vec::as_slice)));
    });
    let bytes: usize = pages.iter().map(Vec::len).sum();
    let ms = |s: f64| s * 1e3;
    println!("guard cost, SmolLM2-135M, {threads} threads, pages of {PAGE_SIZE} tokens");
    println!(
        "owner/generation check: verify_batch of {BATCH} tables x {} pages = {:.2} us; \
         decode step at batch {BATCH}, position {PROMPT} = {:.2} ms; cost {:.4} %",
        CONTEXT / PAGE_SIZE,
        verify_seconds * 1e6,
        ms(decode_seconds),
        100.0 * verify_seconds / decode_seconds
    );
    println!(
        "transfer checksum: {} KiB of KV for a {PROMPT}-token prompt = {:.3} ms ({:.1} GB/s), \
         twice per transfer; prefill of the prompt = {:.1} ms; cost {:.3} %",
        bytes >> 10,
        ms(checksum_seconds),
        bytes as f64 / checksum_seconds / 1e9,
        ms(prefill_seconds),
        100.0 * 2.0 * checksum_seconds / prefill_seconds
    );
}
