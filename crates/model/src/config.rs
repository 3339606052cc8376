use crate::{Error, Result};
use gguf::GgufFile;

/// Hyper-parameters of a llama-family model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub layer_count: usize,
    pub head_count: usize,
    pub kv_head_count: usize,
    pub head_dim: usize,
    pub rope_freq_base: f32,
    pub norm_eps: f32,
    pub context_length: usize,
}

impl LlamaConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<LlamaConfig> {
        let arch = file.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(Error::Unsupported(format!(
                "architecture {arch:?}; Airlock loads llama (qwen2, qwen3 and gemma3 are not \
                 supported yet)"
            )));
        }
        let key = |name: &str| format!("llama.{name}");
        let dim = file.get_u32(&key("embedding_length"))? as usize;
        let head_count = file.get_u32(&key("attention.head_count"))? as usize;
        let kv_head_count = file.get_u32(&key("attention.head_count_kv"))? as usize;
        let vocab_size = match file.get_u32(&key("vocab_size")) {
            Ok(n) => n as usize,
            Err(_) => file.tensor("token_embd.weight")?.dims[1] as usize,
        };
        let config = LlamaConfig {
            vocab_size,
            dim,
            ffn_dim: file.get_u32(&key("feed_forward_length"))? as usize,
            layer_count: file.get_u32(&key("block_count"))? as usize,
            head_count,
            kv_head_count,
            head_dim: dim.checked_div(head_count).unwrap_or(0),
            rope_freq_base: file.get_f32_or(&key("rope.freq_base"), 10000.0)?,
            norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: file.get_u32(&key("context_length"))? as usize,
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
        if !self.dim.is_multiple_of(self.head_count)
            || !self.head_count.is_multiple_of(self.kv_head_count)
        {
            return bad("heads do not divide the embedding width");
        }
        if !self.head_dim.is_multiple_of(8)
            || !self.dim.is_multiple_of(32)
            || !self.ffn_dim.is_multiple_of(32)
        {
            return bad("widths must be multiples of 32 (head size of 8)");
        }
        if self.vocab_size == 0 || self.context_length == 0 || self.context_length > 1 << 20 {
            return bad("vocabulary or context length out of range");
        }
        Ok(())
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

    fn smollm2() -> LlamaConfig {
        LlamaConfig {
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
        }
    }

    /// A hostile header's zero widths are refused here, before any matrix of that shape is
    /// built (a zero width once reached the requantizer's row loop).
    #[test]
    fn zero_widths_and_counts_are_refused() {
        assert!(smollm2().check().is_ok());
        let zeroed: [fn(&mut LlamaConfig); 4] = [
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
