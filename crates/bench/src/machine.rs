//! What the report says about the machine and the model the run measured.

use crate::Args;
use anyhow::Context;
use anyhow::Result;

/// What this machine is, for the report.
pub(crate) struct Machine {
    pub(crate) cores: usize,
    pub(crate) cpu: String,
}

impl Machine {
    pub(crate) fn read() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("model name"))
            .and_then(|rest| rest.split_once(':'))
            .map_or_else(|| "unknown CPU".to_string(), |(_, name)| name.trim().into());
        Machine {
            cores: std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            cpu,
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "machine: {} cores (nproc), {}; load average {}",
            self.cores,
            self.cpu,
            Machine::load_average()
        )
    }

    /// The 1-minute load average, as /proc/loadavg says it.
    pub(crate) fn load_average() -> String {
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|text| text.split_whitespace().next().map(str::to_string))
            .unwrap_or_else(|| "?".into())
    }
}

/// What the sweeps need from the model file: its KV layout, context length and tokenizer.
pub(crate) struct ModelFacts {
    pub(crate) layout: kv::KvLayout,
    pub(crate) context_length: usize,
    pub(crate) tokenizer: gguf::Tokenizer,
}

/// Tokens per KV page in the transfer sweep: `serve`'s default `--page-size`.
pub(crate) const PAGE_SIZE_TOKENS: usize = 16;

impl ModelFacts {
    pub(crate) fn read(args: &Args) -> Result<ModelFacts> {
        let path = args.model.resolve_model()?;
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let file =
            gguf::GgufFile::parse(&bytes).with_context(|| format!("parsing {}", path.display()))?;
        let config = model::ModelConfig::from_gguf(&file)?;
        Ok(ModelFacts {
            layout: config.kv_layout(PAGE_SIZE_TOKENS),
            context_length: config.context_length,
            tokenizer: gguf::Tokenizer::from_gguf(&file)?,
        })
    }
}
