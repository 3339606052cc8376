use crate::merge::{PassCounts, PassMerger, RETURN_GRACE};
use crate::{Error, ModelConfig, Result};
use gguf::{ChatTemplate, GgmlType, GgufFile, Tokenizer};
use kernels::formats::Transcoded;
use kernels::{Backend, Fidelity, QuantMatrix, RopeTable, TensorFormat, WeightFormat, Workers};
use std::path::Path;
use std::sync::Arc;

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
    /// The file's chat template, or its family's turn format where it has none
    /// (`ChatTemplate::from_gguf_or_family`).
    pub chat_template: Option<ChatTemplate>,
    /// Bytes of the model file, for memory accounting.
    pub file_bytes: usize,
}

pub(crate) struct Layer {
    pub attn_norm: Vec<f32>,
    /// Q, K and V stacked: one pass over the normed input serves all three.
    pub qkv: QuantMatrix,
    /// Q, K and V's biases stacked as `qkv` is (qwen2).
    pub qkv_bias: Option<Vec<f32>>,
    /// The RMSNorm weights each head of Q, and of K, is normed with before RoPE (qwen3).
    pub qk_norm: Option<QkNorm>,
    pub attn_output: QuantMatrix,
    pub ffn_norm: Vec<f32>,
    /// Gate and up stacked, for the same reason.
    pub gate_up: QuantMatrix,
    pub down: QuantMatrix,
    /// Gemma's RMSNorms of attention's output and of the FFN's, before each residual add.
    pub post_norms: Option<PostNorms>,
}

/// RMSNorm weights of attention's output and of the FFN's output (gemma3), `dim` each.
pub(crate) struct PostNorms {
    pub attention: Vec<f32>,
    pub ffn: Vec<f32>,
}

/// Per-head RMSNorm weights of Q and K, `head_dim` each.
pub(crate) struct QkNorm {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
}

/// A loaded model (llama, qwen2 or qwen3), ready to run forward steps.
pub struct Model {
    pub(crate) config: ModelConfig,
    pub(crate) embedding: QuantMatrix,
    pub(crate) layers: Vec<Layer>,
    pub(crate) output_norm: Vec<f32>,
    /// `None` when the output projection is tied to the embedding.
    pub(crate) output: Option<QuantMatrix>,
    pub(crate) rope: RopeTable,
    /// The sliding-window layers' RoPE, where the model has them (its own base).
    pub(crate) rope_sliding: Option<RopeTable>,
    pub(crate) backend: Backend,
    /// Shared when another model in the process runs on the same threads
    /// ([`Model::share_compute`]).
    pub(crate) workers: Arc<Workers>,
    /// Set when several threads run passes on this model at once and should share them
    /// ([`Model::merge_concurrent_passes`]).
    pub(crate) merger: Option<PassMerger>,
    pub(crate) weight_report: WeightReport,
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
        let (chat_template, _) = ChatTemplate::from_gguf_or_family(&file)?;
        let model = Model::from_gguf(&file, &bytes, options, progress)?;
        Ok(Loaded {
            model,
            tokenizer,
            chat_template: Some(chat_template),
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
        let config = ModelConfig::from_gguf(file)?;
        let tensors_total = file.tensors.len();
        let mut tensors_done = 0;
        let mut tick = |count: usize| {
            tensors_done = (tensors_done + count).min(tensors_total);
            progress(LoadProgress {
                tensors_done,
                tensors_total,
            });
        };
        let loader = TensorLoader {
            file,
            bytes,
            report: Default::default(),
        };
        let (dim, q_dim, kv_dim) = (config.dim, config.q_dim(), config.kv_dim());
        let arch = config.architecture;
        let mut embedding = loader.matrix("token_embd.weight", config.vocab_size, dim)?;
        tick(1);
        let mut layers: Vec<Layer> = Vec::with_capacity(config.layer_count);
        for i in 0..config.layer_count {
            let name = |t: &str| format!("blk.{i}.{t}.weight");
            let (q, k, v) = (name("attn_q"), name("attn_k"), name("attn_v"));
            let (gate, up) = (name("ffn_gate"), name("ffn_up"));
            let qkv_bias = if arch.has_qkv_bias() {
                let bias = |t: &str, len| loader.vector(&format!("blk.{i}.{t}.bias"), len);
                Some(
                    [
                        bias("attn_q", q_dim)?,
                        bias("attn_k", kv_dim)?,
                        bias("attn_v", kv_dim)?,
                    ]
                    .concat(),
                )
            } else {
                None
            };
            let qk_norm = if arch.has_qk_norm() {
                Some(QkNorm {
                    q: loader.vector(&name("attn_q_norm"), config.head_dim)?,
                    k: loader.vector(&name("attn_k_norm"), config.head_dim)?,
                })
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: loader.vector(&name("attn_norm"), dim)?,
                qkv: loader.stacked(&[(&q, q_dim), (&k, kv_dim), (&v, kv_dim)], dim)?,
                qkv_bias,
                qk_norm,
                attn_output: loader.matrix(&name("attn_output"), dim, q_dim)?,
                ffn_norm: loader.vector(&name("ffn_norm"), dim)?,
                gate_up: loader.stacked(&[(&gate, config.ffn_dim), (&up, config.ffn_dim)], dim)?,
                down: loader.matrix(&name("ffn_down"), dim, config.ffn_dim)?,
                post_norms: if arch.is_gemma() {
                    Some(PostNorms {
                        attention: loader.vector(&name("post_attention_norm"), dim)?,
                        ffn: loader.vector(&name("post_ffw_norm"), dim)?,
                    })
                } else {
                    None
                },
            });
            tick(
                9 + 3 * usize::from(arch.has_qkv_bias())
                    + 2 * usize::from(arch.has_qk_norm())
                    + 2 * usize::from(arch.is_gemma()),
            );
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
        if backend.ggml_build().is_some() && config.sliding_window.is_some() {
            return Err(Error::Unsupported(
                "the ggml-exact kernels on a model with sliding-window attention (gemma3); \
                 use --kernels auto"
                    .to_string(),
            ));
        }
        if backend == Backend::Avx512Vnni {
            // The output projection only: the shipped model's one Q8_0 matrix, and its largest
            // (`add_vnni_layout` says why). Copies of a Q8_0 model's every layer would double
            // its weights for a smaller share of the step.
            output.as_mut().unwrap_or(&mut embedding).add_vnni_layout();
        }
        // Llama 3's RoPE frequency scaling: one factor per rotary pair, when the file has them.
        let rope_factors = match file.tensor("rope_freqs.weight") {
            Ok(_) => loader.vector("rope_freqs.weight", config.head_dim / 2)?,
            Err(_) => Vec::new(),
        };
        Ok(Model {
            weight_report: loader.report.into_inner(),
            rope: RopeTable::with_freq_factors(
                config.head_dim,
                config.rope_freq_base,
                config.context_length,
                &rope_factors,
            )
            .with_style(arch.rope_style()),
            rope_sliding: config.sliding_window.map(|sw| {
                RopeTable::new(config.head_dim, sw.rope_freq_base, config.context_length)
                    .with_style(arch.rope_style())
            }),
            config,
            embedding,
            layers,
            output_norm,
            output,
            backend,
            workers: Arc::new(Workers::new(options.threads)),
            merger: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// How the file's matrices reached the compute layouts, and how faithfully.
    pub fn weight_report(&self) -> &WeightReport {
        &self.weight_report
    }

    pub fn thread_count(&self) -> usize {
        self.workers.threads()
    }

    /// The compute threads this model's forward passes run on.
    pub fn compute(&self) -> Arc<Workers> {
        Arc::clone(&self.workers)
    }

    /// Runs this model's forward passes on `workers` (another model's [`Model::compute`])
    /// instead of its own threads. Two engines in one process then take turns on the same
    /// threads, one parallel region at a time, rather than running twice as many spinning
    /// threads as there are cores; either gets all of them while the other is idle.
    pub fn share_compute(&mut self, workers: Arc<Workers>) {
        self.workers = workers;
    }

    /// Makes passes that several threads hand this model at the same time run as one pass
    /// over the weights, each caller's steps on its own pool (`serve`'s prefill and decode
    /// engines on one shared model; `merge.rs` says how and why). A model used by one
    /// thread at a time has no need of it: its passes run as before.
    pub fn merge_concurrent_passes(&mut self) {
        self.merge_concurrent_passes_with_grace(RETURN_GRACE);
    }

    /// [`Model::merge_concurrent_passes`], with a leader waiting up to `grace` for a caller
    /// whose pass has just ended (tests: a grace no machine's pause outlasts).
    #[doc(hidden)]
    pub fn merge_concurrent_passes_with_grace(&mut self, grace: std::time::Duration) {
        self.merger = Some(PassMerger::new(grace));
    }

    /// Passes run and passes merged since [`Model::merge_concurrent_passes`] (`None` when
    /// the model does not merge).
    pub fn pass_counts(&self) -> Option<PassCounts> {
        self.merger.as_ref().map(PassMerger::counts)
    }

    /// Tests: the next merged pass panics once it has taken its callers' parts, as a bug in
    /// the forward pass would (what the callers it took get, and that the next pass runs).
    #[cfg(feature = "test-support")]
    pub fn panic_in_next_pass(&self) {
        let merger = self.merger.as_ref().expect("a model that merges passes");
        merger
            .panic_next
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Callers waiting for a pass to take them (tests of merging: to know that callers have
    /// queued before letting the pass start).
    #[doc(hidden)]
    pub fn queued_passes(&self) -> usize {
        self.merger.as_ref().map_or(0, PassMerger::queued)
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
    report: std::cell::RefCell<WeightReport>,
}

/// How the file's matrices reached the compute layouts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WeightReport {
    /// One entry per matrix loaded, in order.
    matrices: Vec<(TensorFormat, WeightFormat, Fidelity)>,
}

impl WeightReport {
    fn note(&mut self, format: TensorFormat, layout: WeightFormat, fidelity: Fidelity) {
        self.matrices.push((format, layout, fidelity));
    }

    /// Each way a matrix took (file format, layout, fidelity) and how many took it, in the
    /// order first seen.
    pub fn entries(&self) -> Vec<(TensorFormat, WeightFormat, Fidelity, usize)> {
        let mut entries: Vec<(TensorFormat, WeightFormat, Fidelity, usize)> = Vec::new();
        for &(format, layout, fidelity) in &self.matrices {
            match entries
                .iter_mut()
                .find(|e| (e.0, e.1, e.2) == (format, layout, fidelity))
            {
                Some(entry) => entry.3 += 1,
                None => entries.push((format, layout, fidelity, 1)),
            }
        }
        entries
    }

    /// One line per way, e.g. `150 × Q5_0 as Q8_0 (exact)`.
    pub fn lines(&self) -> Vec<String> {
        self.entries()
            .iter()
            .map(|(format, layout, fidelity, count)| {
                format!("{count} × {format} as {layout:?} ({})", fidelity.describe())
            })
            .collect()
    }
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

    /// The format of tensor `name`, if Airlock loads it.
    fn format(&self, name: &str, ggml_type: GgmlType) -> Result<TensorFormat> {
        ggml_type
            .name()
            .and_then(TensorFormat::from_name)
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "tensor {name} is {ggml_type}; Airlock loads {}",
                    TensorFormat::supported_names()
                ))
            })
    }

    /// Tensor `name`, a `rows × cols` matrix (GGUF dims `[cols, rows]`), turned into its
    /// format's compute layout, with its format.
    fn transcoded(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(TensorFormat, Transcoded<'_>)> {
        let ggml_type = self.check_shape(name, &[cols as u64, rows as u64])?;
        let format = self.format(name, ggml_type)?;
        let data = self.file.tensor_bytes(self.bytes, name)?;
        Ok((
            format,
            kernels::formats::transcode(format, rows, cols, data)?,
        ))
    }

    /// A matrix of `transcoded` blocks, noted in the report.
    fn build(
        &self,
        format: TensorFormat,
        transcoded: &Transcoded<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<QuantMatrix> {
        let matrix =
            QuantMatrix::from_gguf_bytes(transcoded.layout, rows, cols, &transcoded.bytes)?;
        self.report
            .borrow_mut()
            .note(format, transcoded.layout, transcoded.fidelity);
        Ok(matrix)
    }

    /// A `rows × cols` matrix in its format's compute layout.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QuantMatrix> {
        let (format, transcoded) = self.transcoded(name, rows, cols)?;
        self.build(format, &transcoded, rows, cols)
    }

    /// Matrices `(name, rows)` of `cols` columns stacked into one, so one pass over the
    /// input serves all (Q, K and V; gate and up). Matrices whose layouts differ (a Q4_K Q
    /// beside a Q6_K V) all take the layout `kernels::formats::stacking_layout` picks, which
    /// keeps each one's values.
    fn stacked(&self, parts: &[(&str, usize)], cols: usize) -> Result<QuantMatrix> {
        let transcoded = parts
            .iter()
            .map(|&(name, rows)| self.transcoded(name, rows, cols))
            .collect::<Result<Vec<_>>>()?;
        let layouts: Vec<WeightFormat> = transcoded.iter().map(|(_, t)| t.layout).collect();
        let target = kernels::formats::stacking_layout(&layouts);
        let matrices = transcoded
            .into_iter()
            .zip(parts)
            .map(|((format, transcoded), &(_, rows))| {
                let transcoded = kernels::formats::into_layout(transcoded, target)
                    .ok_or(kernels::Error::ConcatMismatch)?;
                self.build(format, &transcoded, rows, cols)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(QuantMatrix::concat_rows(&matrices)?)
    }

    /// A vector of f32 values (norm weights), from any float format.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let ggml_type = self.check_shape(name, &[len as u64])?;
        let format = match self.format(name, ggml_type)? {
            format @ (TensorFormat::F32 | TensorFormat::F16 | TensorFormat::BF16) => format,
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor {name} is {other}; vectors must be F32, F16 or BF16"
                )))
            }
        };
        let data = self.file.tensor_bytes(self.bytes, name)?;
        let mut values = vec![0f32; len];
        if data.len() != len * format.block_bytes() {
            return Err(Error::Unsupported(format!(
                "tensor {name} holds {} bytes, not {len} {format} values",
                data.len()
            )));
        }
        format.dequantize(data, &mut values);
        Ok(values)
    }
}
