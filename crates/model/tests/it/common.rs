//! Shared fixtures: the model (loaded once), pools, owners, greedy generation, page snapshots.

use gguf::{ChatTemplate, Tokenizer};
use kv::{Owner, PagePool, PageTable, PoolConfig, PoolSize, RequestId, TenantId};
use model::{GenerateRequest, Generated, LoadOptions, Model, SamplingParams};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Tokens per KV page in every pool these tests build.
pub const PAGE_SIZE: usize = 16;

pub struct Fixture {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Test model `name` of scripts/fetch-test-models.sh (`$AIRLOCK_TEST_MODELS`, else
/// models/requant).
pub fn test_model(name: &str) -> PathBuf {
    let dir = std::env::var_os("AIRLOCK_TEST_MODELS")
        .map_or_else(|| workspace_root().join("models/requant"), PathBuf::from);
    dir.join(name)
}

fn model_path() -> PathBuf {
    match std::env::var_os("AIRLOCK_MODEL") {
        Some(path) => PathBuf::from(path),
        None => workspace_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

/// The model, tokenizer and chat template, loaded once per test binary with 2 threads.
pub fn loaded() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| load_with(None))
}

/// The model with a `ggml-exact` backend (llama.cpp's arithmetic), loaded once per backend.
pub fn exact_model(backend: kernels::Backend) -> &'static Model {
    static AVX512: OnceLock<Fixture> = OnceLock::new();
    static AVX2: OnceLock<Fixture> = OnceLock::new();
    let cell = match backend {
        kernels::Backend::GgmlExact => &AVX512,
        kernels::Backend::GgmlExactAvx2 => &AVX2,
        other => panic!("{} is not a ggml-exact backend", other.name()),
    };
    &cell.get_or_init(|| load_with(Some(backend))).model
}

fn load_with(backend: Option<kernels::Backend>) -> Fixture {
    let path = model_path();
    assert!(
        path.is_file(),
        "model file {} is missing: run scripts/fetch-model.sh from the workspace root \
         (or point AIRLOCK_MODEL at the GGUF)",
        path.display()
    );
    let options = LoadOptions {
        threads: 2,
        backend,
    };
    let loaded = Model::load(&path, &options, &mut |_| {})
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    Fixture {
        model: loaded.model,
        tokenizer: loaded.tokenizer,
        chat_template: loaded.chat_template,
    }
}

/// A second copy of the model, of its own.
pub fn another_model() -> Model {
    load_with(None).model
}

pub fn model() -> &'static Model {
    &loaded().model
}

pub fn tokenizer() -> &'static Tokenizer {
    &loaded().tokenizer
}

/// A pool shaped for the model with room for `tokens` tokens (whole pages of `PAGE_SIZE`).
pub fn pool(tokens: usize) -> PagePool {
    pool_for(model(), tokens)
}

/// `pool`, shaped for `model`.
pub fn pool_for(model: &Model, tokens: usize) -> PagePool {
    PagePool::new(PoolConfig {
        layout: model.config().kv_layout(PAGE_SIZE),
        size: PoolSize::Tokens(tokens),
        scrub_on_free: false,
    })
    .expect("pool")
}

pub fn owner(tenant: u64, request: u64) -> Owner {
    Owner {
        tenant: TenantId(tenant),
        request: RequestId(request),
    }
}

pub fn greedy_request(prompt: &[u32], max_tokens: usize, prefill_chunk: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        stop_at_eos: false,
        prefill_chunk,
    }
}

/// Runs `request` in a fresh pool just big enough for it, checks the pool is whole afterwards
/// (I9), and returns the result with the text streamed through `on_text`.
pub fn generate_in_fresh_pool(request: &GenerateRequest) -> (Generated, String) {
    generate_with(model(), request)
}

/// `generate_in_fresh_pool` with `model`; returns the result.
pub fn generate_on(model: &Model, request: &GenerateRequest) -> Generated {
    generate_with(model, request).0
}

fn generate_with(model: &Model, request: &GenerateRequest) -> (Generated, String) {
    let mut pool = pool_for(model, request.prompt.len() + request.max_tokens + PAGE_SIZE);
    let mut streamed = String::new();
    let generated = model::generate(
        model,
        tokenizer(),
        &mut pool,
        owner(1, 1),
        request,
        &mut |piece| streamed.push_str(piece),
    )
    .unwrap_or_else(|e| panic!("generate: {e}"));
    assert_eq!(
        pool.pages_free(),
        pool.page_count(),
        "generate leaked pages"
    );
    pool.check_invariants();
    (generated, streamed)
}

/// A copy of every page of `table` (raw f16 bits), read through a verified view.
pub fn snapshot(pool: &mut PagePool, table: &PageTable) -> Vec<Vec<u16>> {
    let views = pool.verify_batch(&[table]).expect("the table verifies");
    let view = &views[0];
    (0..view.page_len())
        .map(|i| view.page(i).iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Largest absolute element-wise difference (infinite where either side is NaN); panics on
/// different lengths.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .map(|d| if d.is_nan() { f32::INFINITY } else { d })
        .fold(0.0, f32::max)
}

/// Indices of the `k` largest values, largest first (lowest index on ties).
pub fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    ids.truncate(k);
    ids
}
