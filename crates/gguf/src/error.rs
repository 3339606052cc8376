//! The crate's single error type.

/// Everything that can go wrong while reading a GGUF file, looking things up
/// in it, building its tokenizer or rendering its chat template.
///
/// Offsets are absolute byte positions in the file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file ended before a field could be read completely.
    #[error("truncated GGUF file: reading {what} at offset {offset} needs {needed} bytes, but only {available} remain")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: [u8; 4] },

    /// A format version other than 2 or 3 (v1 and big-endian files are refused).
    #[error("unsupported GGUF version {version} (supported: 2 and 3, little-endian){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },

    /// A metadata value type id this crate does not know.
    #[error("metadata key {key:?}: unknown value type id {type_id} at offset {offset}")]
    UnknownValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },

    /// A length, count or size field exceeds a sanity limit.
    #[error("{what} is {value}, above the limit of {max}")]
    TooLarge { what: String, value: u64, max: u64 },

    /// A string in the file is not valid UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },

    /// A boolean metadata value that is neither 0 nor 1.
    #[error("metadata key {key:?}: boolean byte is {byte}, expected 0 or 1")]
    InvalidBool { key: String, byte: u8 },

    /// Arrays nested deeper than this crate accepts.
    #[error("metadata key {key:?}: arrays nested more than {max} levels deep")]
    NestingTooDeep { key: String, max: u32 },

    /// The same metadata key appears twice.
    #[error("duplicate metadata key {key:?}")]
    DuplicateKey { key: String },

    /// The same tensor name appears twice.
    #[error("duplicate tensor name {name:?}")]
    DuplicateTensor { name: String },

    /// `general.alignment` is zero or not a power of two.
    #[error("general.alignment is {alignment}; it must be a non-zero power of two")]
    BadAlignment { alignment: u32 },

    /// A tensor whose element type this crate cannot size.
    #[error("tensor {tensor:?}: unknown ggml type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },

    /// A tensor whose shape is invalid (too many dims, overflowing size,
    /// first dimension not a multiple of the block size...).
    #[error("tensor {tensor:?}: {reason}")]
    BadTensorShape { tensor: String, reason: String },

    /// A tensor offset that is not a multiple of the file's alignment.
    #[error(
        "tensor {tensor:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    /// A tensor whose data would lie (partly) outside the file.
    #[error("tensor {tensor:?}: data [{start}, {start}+{len}) lies outside the file of {file_len} bytes")]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        len: u64,
        file_len: u64,
    },

    /// `tensor_bytes` was given a buffer other than the one that was parsed.
    #[error("file buffer is {actual} bytes but the parsed GGUF file was {expected} bytes")]
    FileMismatch { expected: u64, actual: u64 },

    /// No tensor of this name.
    #[error("tensor {name:?} not found")]
    MissingTensor { name: String },

    /// No metadata value under this key.
    #[error("metadata key {key:?} not found")]
    MissingKey { key: String },

    /// A metadata value of a different type than the caller asked for.
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// The tokenizer kind (`tokenizer.ggml.model`) is not supported.
    #[error(
        "unsupported tokenizer model {model:?}: Airlock loads \"gpt2\" (byte-level BPE) and \
         \"llama\" (SentencePiece)"
    )]
    UnsupportedTokenizer { model: String },

    /// The tokenizer metadata is inconsistent.
    #[error("invalid tokenizer metadata: {reason}")]
    BadTokenizer { reason: String },

    /// The chat template failed to compile or render.
    #[error("chat template error: {message}")]
    Template { message: String },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
