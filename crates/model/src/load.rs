use crate::{Error, LlamaConfig, Result};
use gguf::{ChatTemplate, GgmlType, GgufFile, Tokenizer};
use kernels::{Backend, QuantMatrix, RopeTable, WeightFormat, Workers};
use std::path::Path;

/// How to load and run a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Worker threads for the forward pass.
    pub threads: usize,
    /// Kernel backend; `None` picks the fastest the CPU supports.
    pub backend: Option<Backend>,
}

/// Load progress, reported once per tensor.
#[derive(Clone, Copy, Debug)]
pub struct LoadProgress {
    pub tensors_done: usize,
    pub tensors_total: usize,
}

/// Everything a GGUF file gives us: the weights, the tokenizer and the chat template.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// `None` when the file carries no chat template.
    pub chat_template: Option<ChatTemplate>,
    /// Bytes of the model file, for memory accounting.
    pub file_bytes: usize,
}

pub(crate) struct Layer {
    pub attn_norm: Vec<f32>,
    /// Q, K and V stacked: one pass over the normed input serves all three.
    pub qkv: QuantMatrix,
    pub attn_output: QuantMatrix,
    pub ffn_norm: Vec<f32>,
    /// Gate and up stacked, for the same reason.
    pub gate_up: QuantMatrix,
    pub down: QuantMatrix,
}

/// A loaded llama-family model, ready to run forward steps.
pub struct Model {
    pub(crate) config: LlamaConfig,
    pub(crate) embedding: QuantMatrix,
    pub(crate) layers: Vec<Layer>,
    pub(crate) output_norm: Vec<f32>,
    /// `None` when the output projection is tied to the embedding.
    pub(crate) output: Option<QuantMatrix>,
    pub(crate) rope: RopeTable,
    pub(crate) backend: Backend,
    pub(crate) workers: Workers,
}

impl Model {
    /// Reads a GGUF file and builds the model, tokenizer and chat template.
    pub fn load(
        path: &Path,
        options: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Loaded> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let file = GgufFile::parse(&bytes)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let chat_template = match file.get_str("tokenizer.chat_template") {
            Ok(_) => Some(ChatTemplate::from_gguf(&file)?),
            Err(_) => None,
        };
        let model = Model::from_gguf(&file, &bytes, options, progress)?;
        Ok(Loaded {
            model,
            tokenizer,
            chat_template,
            file_bytes: bytes.len(),
        })
    }

    /// Builds the model from a parsed GGUF file and its bytes.
    pub fn from_gguf(
        file: &GgufFile,
        bytes: &[u8],
        options: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Model> {
        let config = LlamaConfig::from_gguf(file)?;
        let tensors_total = file.tensors.len();
        let mut tensors_done = 0;
        let mut tick = |count: usize| {
            tensors_done = (tensors_done + count).min(tensors_total);
            progress(LoadProgress {
                tensors_done,
                tensors_total,
            });
        };
        let loader = TensorLoader { file, bytes };
        let (dim, kv_dim) = (config.dim, config.kv_dim());
        let mut embedding = loader.matrix("token_embd.weight", config.vocab_size, dim)?;
        tick(1);
        let mut layers: Vec<Layer> = Vec::with_capacity(config.layer_count);
        for i in 0..config.layer_count {
            let name = |t: &str| format!("blk.{i}.{t}.weight");
            let q = loader.matrix(&name("attn_q"), dim, dim)?;
            let k = loader.matrix(&name("attn_k"), kv_dim, dim)?;
            let v = loader.matrix(&name("attn_v"), kv_dim, dim)?;
            let gate = loader.matrix(&name("ffn_gate"), config.ffn_dim, dim)?;
            let up = loader.matrix(&name("ffn_up"), config.ffn_dim, dim)?;
            layers.push(Layer {
                attn_norm: loader.vector(&name("attn_norm"), dim)?,
                qkv: QuantMatrix::concat_rows(&[q, k, v])?,
                attn_output: loader.matrix(&name("attn_output"), dim, dim)?,
                ffn_norm: loader.vector(&name("ffn_norm"), dim)?,
                gate_up: QuantMatrix::concat_rows(&[gate, up])?,
                down: loader.matrix(&name("ffn_down"), dim, config.ffn_dim)?,
            });
            tick(9);
        }
        let output_norm = loader.vector("output_norm.weight", dim)?;
        let mut output = match file.tensor("output.weight") {
            Ok(_) => Some(loader.matrix("output.weight", config.vocab_size, dim)?),
            Err(_) => None,
        };
        tick(tensors_total);
        let mut matrices: Vec<&mut QuantMatrix> = layers
            .iter_mut()
            .flat_map(|layer| {
                [
                    &mut layer.qkv,
                    &mut layer.attn_output,
                    &mut layer.gate_up,
                    &mut layer.down,
                ]
            })
            .collect();
        matrices.push(&mut embedding);
        matrices.extend(output.as_mut());
        // One buffer per format, so the weights lie on huge pages (`share_buffers` says why).
        QuantMatrix::share_buffers(&mut matrices);
        let backend = options.backend.unwrap_or_else(Backend::detect);
        if backend == Backend::Avx512Vnni {
            // The output projection only: the shipped model's one Q8_0 matrix, and its largest
            // (`add_vnni_layout` says why). Copies of a Q8_0 model's every layer would double
            // its weights for a smaller share of the step.
            output.as_mut().unwrap_or(&mut embedding).add_vnni_layout();
        }
        Ok(Model {
            rope: RopeTable::new(
                config.head_dim,
                config.rope_freq_base,
                config.context_length,
            ),
            config,
            embedding,
            layers,
            output_norm,
            output,
            backend,
            workers: Workers::new(options.threads),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn thread_count(&self) -> usize {
        self.workers.threads()
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.attn_output.bytes() + l.gate_up.bytes() + l.down.bytes())
            .sum();
        layer_bytes + self.embedding.bytes() + self.output.as_ref().map_or(0, |m| m.bytes())
    }
}

struct TensorLoader<'a> {
    file: &'a GgufFile,
    bytes: &'a [u8],
}

impl TensorLoader<'_> {
    fn check_shape(&self, name: &str, expected: &[u64]) -> Result<GgmlType> {
        let info = self.file.tensor(name)?;
        if info.dims != expected {
            let (got, expected) = (info.dims.clone(), expected.to_vec());
            return Err(Error::TensorShape {
                name: name.to_string(),
                got,
                expected,
            });
        }
        Ok(info.ggml_type)
    }

    /// A `rows × cols` quantized matrix (GGUF dims `[cols, rows]`).
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QuantMatrix> {
        let format = match self.check_shape(name, &[cols as u64, rows as u64])? {
            GgmlType::Q4_1 => WeightFormat::Q4_1,
            GgmlType::Q8_0 => WeightFormat::Q8_0,
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor {name} is {other:?}; this build runs Q4_1 and Q8_0 weights"
                )))
            }
        };
        let data = self.file.tensor_bytes(self.bytes, name)?;
        Ok(QuantMatrix::from_gguf_bytes(format, rows, cols, data)?)
    }

    /// An f32 vector (norm weights).
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        match self.check_shape(name, &[len as u64])? {
            GgmlType::F32 => {}
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor {name} is {other:?}, not F32"
                )))
            }
        }
        let data = self.file.tensor_bytes(self.bytes, name)?;
        Ok(data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}
