//! Prints how far our first-step logits are from llama.cpp's on the reference prompts:
//! `cargo run --release -p model --example reference_diff [-- BACKEND]` (scalar, avx2,
//! avx512-vnni, ggml-exact, ggml-exact-avx2);
//! `AIRLOCK_REFERENCE_DIR=DIR` compares against another `make_reference.py --out DIR` run.

use kv::{Owner, PagePool, PoolConfig, PoolSize, RequestId, TenantId};
use model::{LoadOptions, Model, SeqStep};
use std::path::Path;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let backend = std::env::args().nth(1).map(|name| {
        kernels::Backend::from_name(&name)
            .expect("a backend: scalar, avx2, avx512-vnni, ggml-exact or ggml-exact-avx2")
    });
    let options = LoadOptions {
        threads: 2,
        backend,
    };
    let loaded = Model::load(
        &root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        &options,
        &mut |_| {},
    )
    .expect("model loads");
    // AIRLOCK_REFERENCE_DIR: another run of make_reference.py (e.g. llama.cpp on this CPU).
    let data = std::env::var_os("AIRLOCK_REFERENCE_DIR")
        .map_or_else(|| root.join("tests/data"), std::path::PathBuf::from);
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("reference.json")).expect("reference"))
            .expect("json");
    let layout = loaded.model.config().kv_layout(16);
    let mut pool = PagePool::new(PoolConfig {
        layout,
        size: PoolSize::Tokens(4096),
        scrub_on_free: false,
    })
    .expect("pool");
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let prompt: Vec<u32> = case["prompt_tokens"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let bytes =
            std::fs::read(data.join(format!("reference_logits/{name}.f32"))).expect("logits");
        let theirs: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let owner = Owner {
            tenant: TenantId(0),
            request: RequestId(1),
        };
        let table = pool.allocate(owner, prompt.len()).expect("pages");
        let ours = loaded
            .model
            .forward(
                &mut pool,
                &[SeqStep {
                    table: &table,
                    tokens: &prompt,
                    start_pos: 0,
                    logits: model::LogitRows::Last,
                }],
            )
            .expect("forward")[0]
            .to_vec();
        pool.release(table).expect("release");
        let diffs: Vec<f32> = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .collect();
        let max = diffs.iter().cloned().fold(0f32, f32::max);
        let unequal = ours
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
        let shift = ours.iter().zip(&theirs).map(|(a, b)| a - b).sum::<f32>() / diffs.len() as f32;
        let request = model::GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: 64,
            sampling: model::SamplingParams::greedy(),
            stop: Vec::new(),
            stop_at_eos: false,
            prefill_chunk: 512,
        };
        let generated = model::generate(
            &loaded.model,
            &loaded.tokenizer,
            &mut pool,
            owner,
            &request,
            &mut |_| {},
        )
        .expect("generate");
        let expected: Vec<u32> = case["greedy_tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let margins = case["top1_top2_margins"].as_array().expect("margins");
        let equal = generated
            .tokens
            .iter()
            .zip(&expected)
            .take_while(|(a, b)| a == b)
            .count();
        let margin = margins
            .get(equal)
            .and_then(|m| m.as_f64())
            .unwrap_or(f64::NAN);
        println!(
            "{name:>20}: logits max {max:.4} mean {mean:.4} shift {shift:+.4}, {unequal} not \
             bit-equal; greedy equal for {equal}/64 (llama.cpp margin at the first difference \
             {margin:.4})"
        );
    }
}
