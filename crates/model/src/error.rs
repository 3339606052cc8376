/// Everything that can go wrong loading the model or running a step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error(transparent)]
    Kernels(#[from] kernels::Error),
    #[error(transparent)]
    Kv(#[from] kv::Error),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        got: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("token id {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("a step for sequence {index} has no tokens")]
    EmptyStep { index: usize },
    #[error("position {position} is past the context length {context_length}")]
    ContextOverflow {
        position: usize,
        context_length: usize,
    },
    #[error(
        "the forward pass this step was merged into failed on another thread; retry the request"
    )]
    MergedPassFailed,
    #[error("page table holds {capacity} tokens but the step needs {needed}")]
    PageTableTooSmall { needed: usize, capacity: usize },
    #[error(
        "step starts at position {start_pos} but only {written} positions hold this request's K/V"
    )]
    UnwrittenPositions { start_pos: usize, written: usize },
    #[error(
        "prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the context \
         length {context_length}; shorten the prompt or lower max_tokens"
    )]
    ContextLengthExceeded {
        prompt_tokens: usize,
        max_tokens: usize,
        context_length: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
}

pub type Result<T> = std::result::Result<T, Error>;
