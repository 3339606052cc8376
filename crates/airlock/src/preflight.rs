//! `airlock preflight`: checks a deployment's capacity node by node, from a TOML file before
//! it runs or from a running router's `/health`, and exits non-zero if any node fails.

use anyhow::{bail, Context, Result};
use config::preflight::{evaluate, evaluate_live, parse, render, LiveNode};
use config::ModelShape;
use gguf::GgufFile;
use model_args::ModelArgs;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Deployment file: [router] and one [[node]] per worker (name, role, kv_memory or
    /// kv_tokens or kv_memory_fraction + memory, context_length, page_size); see README
    file: Option<PathBuf>,
    /// Check a running deployment instead, from its router's /health (e.g.
    /// http://127.0.0.1:8080)
    #[arg(long, env = "AIRLOCK_PREFLIGHT_URL", conflicts_with = "file")]
    url: Option<String>,
    /// API key for --url: /health shows the workers only to a caller with a valid key (any
    /// tenant's), unless the router runs without keys
    #[arg(long, env = "AIRLOCK_API_KEY", requires = "url")]
    api_key: Option<String>,
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: Args) -> Result<()> {
    let reports = match (&args.file, &args.url) {
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let deployment =
                parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let (shape, weight_bytes) = model_shape(&args.model)?;
            evaluate(&deployment, &shape, weight_bytes)
        }
        (None, Some(url)) => live_reports(url, args.api_key.as_deref())?,
        _ => bail!("give a deployment file, or --url of a running router"),
    };
    print!("{}", render(&reports));
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.ok())
        .map(|r| r.name.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("preflight failed for: {}", failed.join(", "));
    }
    println!("preflight ok: {} nodes", reports.len());
    Ok(())
}

/// The model's shape from its GGUF metadata, and the bytes its weights take in memory: each
/// matrix in its format's compute layout (`kernels::TensorFormat::layout`), vectors as f32,
/// and the file's size for tensors of a type Airlock does not load (it will refuse them).
fn model_shape(model: &ModelArgs) -> Result<(ModelShape, u64)> {
    let path = model.resolve_model()?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let file = GgufFile::parse(&bytes)?;
    let config = model::ModelConfig::from_gguf(&file)?;
    let shape = ModelShape {
        layer_count: config.layer_count as u64,
        kv_head_count: config.kv_head_count as u64,
        head_dim: config.head_dim as u64,
        context_length_max: config.context_length as u64,
    };
    let weight_bytes = file
        .tensors
        .iter()
        .map(|tensor| {
            let values: u64 = tensor.dims.iter().product();
            let format = tensor
                .ggml_type
                .name()
                .and_then(kernels::TensorFormat::from_name);
            match format {
                Some(format) if tensor.dims.len() >= 2 => {
                    values / 32 * format.layout().block_bytes() as u64
                }
                Some(_) => values * 4,
                None => tensor.byte_len,
            }
        })
        .sum();
    Ok((shape, weight_bytes))
}

fn live_reports(url: &str, key: Option<&str>) -> Result<Vec<config::preflight::NodeReport>> {
    let url = url.trim_end_matches('/');
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let health: serde_json::Value = runtime.block_on(async {
        let mut request = reqwest::Client::new().get(format!("{url}/health"));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("reaching {url}/health"))?;
        response.json().await.context("reading /health")
    })?;
    let workers = health["workers"].as_array().with_context(|| {
        if key.is_none() {
            "/health lists no workers: a router with API keys shows them only to a caller with \
             one; pass --api-key"
        } else {
            "/health lists no workers"
        }
    })?;
    let nodes: Vec<LiveNode> = workers
        .iter()
        .map(|worker| LiveNode {
            name: worker["name"]
                .as_str()
                .or(worker["address"].as_str())
                .unwrap_or("?")
                .to_string(),
            role: worker["role"].as_str().unwrap_or("?").to_string(),
            up: worker["up"].as_bool().unwrap_or(false),
            weight_bytes: worker["weight_bytes"].as_u64(),
            kv_bytes: worker["kv_bytes"].as_u64(),
            capacity_tokens: worker["capacity_tokens"].as_u64(),
            context_length: worker["context_length"].as_u64(),
            page_size: worker["page_size_tokens"].as_u64(),
        })
        .collect();
    Ok(evaluate_live(&nodes, health["context_length"].as_u64()))
}
