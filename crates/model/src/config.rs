use crate::{Error, Result};
use gguf::GgufFile;

/// The model families Airlock runs, named as GGUF's `general.architecture` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    /// Llama's block with biases on Q, K and V, and RoPE on halves.
    Qwen2,
    /// Llama's block with each head of Q and K RMS-normed before RoPE (on halves), and a head
    /// size of its own (not the width over the head count).
    Qwen3,
    /// Qwen3's attention, with sliding-window layers between global ones (each with its own
    /// RoPE base), RMSNorm after attention and after the FFN too, GeGLU for SwiGLU, and the
    /// embeddings scaled by √width.
    Gemma3,
}

impl Architecture {
    const ALL: [Architecture; 4] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma3,
    ];

    /// The `general.architecture` value, which also prefixes the file's hyper-parameter keys.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
        }
    }

    fn from_name(name: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Which values RoPE rotates together (llama.cpp's `llama_model_rope_type`).
    pub fn rope_style(self) -> kernels::RopeStyle {
        match self {
            Architecture::Llama => kernels::RopeStyle::Adjacent,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Gemma3 => {
                kernels::RopeStyle::Halves
            }
        }
    }

    pub fn has_qkv_bias(self) -> bool {
        self == Architecture::Qwen2
    }

    pub fn has_qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Gemma3)
    }

    /// Gemma's: RMSNorm on attention's and the FFN's outputs before the residual add, GeGLU,
    /// and embeddings scaled by √width.
    pub fn is_gemma(self) -> bool {
        self == Architecture::Gemma3
    }
}

/// Hyper-parameters of a model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub layer_count: usize,
    pub head_count: usize,
    pub kv_head_count: usize,
    /// Values per head of Q, K and V; `dim / head_count` unless the file says otherwise.
    pub head_dim: usize,
    pub rope_freq_base: f32,
    pub norm_eps: f32,
    pub context_length: usize,
    /// Sliding-window attention (gemma3): which layers see only the last `window` positions.
    pub sliding_window: Option<SlidingWindow>,
    /// Multiplies attention scores: 1/√head_dim (Gemma 3 27B's differs).
    pub attention_scale: f32,
}

/// Layers that attend to their last `window` positions only, as llama.cpp runs them: every
/// layer but each `pattern`-th (layers `pattern − 1`, `2·pattern − 1`, … attend globally),
/// with RoPE of base `rope_freq_base`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    pub pattern: usize,
    pub rope_freq_base: f32,
}

impl SlidingWindow {
    pub fn applies_to(&self, layer: usize) -> bool {
        layer % self.pattern < self.pattern - 1
    }
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig> {
        let arch = file.get_str("general.architecture")?;
        let Some(architecture) = Architecture::from_name(arch) else {
            let names: Vec<&str> = Architecture::ALL.iter().map(|a| a.name()).collect();
            return Err(Error::Unsupported(format!(
                "architecture {arch:?}; Airlock loads {}",
                names.join(", ")
            )));
        };
        let key = |name: &str| format!("{arch}.{name}");
        let dim = file.get_u32(&key("embedding_length"))? as usize;
        let head_count = file.get_u32(&key("attention.head_count"))? as usize;
        let kv_head_count = file.get_u32(&key("attention.head_count_kv"))? as usize;
        let vocab_size = match file.get_u32(&key("vocab_size")) {
            Ok(n) => n as usize,
            Err(_) => file.tensor("token_embd.weight")?.dims[1] as usize,
        };
        let head_dim = match file.get_u32(&key("attention.key_length")) {
            Ok(n) => n as usize,
            Err(_) => dim.checked_div(head_count).unwrap_or(0),
        };
        if let Ok(value_dim) = file.get_u32(&key("attention.value_length")) {
            if value_dim as usize != head_dim {
                return Err(Error::Unsupported(format!(
                    "value heads of {value_dim} values beside key heads of {head_dim}; \
                     Airlock needs them equal"
                )));
            }
        }
        let layer_count = file.get_u32(&key("block_count"))? as usize;
        let sliding_window = match (architecture, file.get_u32(&key("attention.sliding_window"))) {
            (Architecture::Gemma3, Ok(window)) if window > 0 => Some(SlidingWindow {
                window: window as usize,
                pattern: file.get_u32_or(&key("attention.sliding_window_pattern"), 6)? as usize,
                rope_freq_base: file.get_f32_or(&key("rope.freq_base_swa"), 10000.0)?,
            }),
            _ => None,
        };
        if let Ok(factor) = file.get_f32(&key("rope.scaling.factor")) {
            if factor != 1.0 {
                return Err(Error::Unsupported(format!(
                    "RoPE scaling by {factor} ({}); Airlock runs unscaled RoPE and Llama 3's \
                     frequency factors",
                    key("rope.scaling.factor")
                )));
            }
        }
        // llama.cpp's rule: Gemma 3 27B (62 layers) scales by its width per head.
        let attention_scale = if architecture == Architecture::Gemma3 && layer_count == 62 {
            1.0 / (dim.checked_div(head_count).unwrap_or(1) as f32).sqrt()
        } else {
            1.0 / (head_dim.max(1) as f32).sqrt()
        };
        let config = ModelConfig {
            architecture,
            vocab_size,
            dim,
            ffn_dim: file.get_u32(&key("feed_forward_length"))? as usize,
            layer_count,
            head_count,
            kv_head_count,
            head_dim,
            rope_freq_base: file.get_f32_or(&key("rope.freq_base"), 10000.0)?,
            norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: file.get_u32(&key("context_length"))? as usize,
            sliding_window,
            attention_scale,
        };
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Unsupported(what.to_string()));
        if self.head_count == 0 || self.kv_head_count == 0 || self.layer_count == 0 {
            return bad("zero heads or layers");
        }
        if self.dim == 0 || self.ffn_dim == 0 {
            return bad("zero embedding or feed-forward width");
        }
        if !self.head_count.is_multiple_of(self.kv_head_count) {
            return bad("K/V heads do not divide the query heads");
        }
        if self.head_dim == 0
            || !self.head_dim.is_multiple_of(8)
            || !self.dim.is_multiple_of(32)
            || !self.ffn_dim.is_multiple_of(32)
            || !self.q_dim().is_multiple_of(32)
        {
            return bad("widths must be multiples of 32 (head size of 8)");
        }
        if self.vocab_size == 0 || self.context_length == 0 || self.context_length > 1 << 20 {
            return bad("vocabulary or context length out of range");
        }
        if let Some(sw) = self.sliding_window {
            if sw.window == 0 || sw.pattern == 0 {
                return bad("a sliding window or pattern of 0");
            }
        }
        Ok(())
    }

    /// Width of the Q projection (and of attention's output): all query heads.
    pub fn q_dim(&self) -> usize {
        self.head_count * self.head_dim
    }

    /// Width of the K (or V) projection: all kv heads.
    pub fn kv_dim(&self) -> usize {
        self.kv_head_count * self.head_dim
    }

    /// Query heads sharing one kv head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.head_count / self.kv_head_count
    }

    /// The page shape a pool must have to hold this model's KV.
    pub fn kv_layout(&self, page_size_tokens: usize) -> kv::KvLayout {
        kv::KvLayout {
            layer_count: self.layer_count,
            kv_head_count: self.kv_head_count,
            head_dim: self.head_dim,
            page_size_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 49152,
            dim: 576,
            ffn_dim: 1536,
            layer_count: 30,
            head_count: 9,
            kv_head_count: 3,
            head_dim: 64,
            rope_freq_base: 100_000.0,
            norm_eps: 1e-5,
            context_length: 8192,
            sliding_window: None,
            attention_scale: 0.125,
        }
    }

    /// A hostile header's zero widths are refused here, before any matrix of that shape is
    /// built (a zero width once reached the requantizer's row loop).
    #[test]
    fn zero_widths_and_counts_are_refused() {
        assert!(smollm2().check().is_ok());
        let zeroed: [fn(&mut ModelConfig); 4] = [
            |c| c.dim = 0,
            |c| c.ffn_dim = 0,
            |c| c.head_count = 0,
            |c| c.layer_count = 0,
        ];
        for zero in zeroed {
            let mut config = smollm2();
            zero(&mut config);
            assert!(config.check().is_err(), "{config:?}");
        }
    }
}
