//! The parsed file: tensor lookup and typed metadata getters.

use std::collections::BTreeMap;

use crate::{Error, GgmlType, Result, Value};

/// A parsed GGUF header. It borrows nothing: tensor data stays in the
/// caller's buffer (typically a memory map) and is sliced out with
/// [`GgufFile::tensor_bytes`].
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// All metadata key/value pairs.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    pub(crate) data_offset: u64,
    pub(crate) file_len: u64,
    pub(crate) alignment: u64,
}

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file (aligned).
    pub offset: u64,
    /// Bytes of data; `offset + byte_len` is within the file.
    pub byte_len: u64,
}

impl TensorInfo {
    /// Number of elements (product of `dims`; fits in `u64`, checked at parse).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

impl GgufFile {
    /// Parses the header of a complete GGUF file held in `bytes`.
    ///
    /// Never panics: malformed, truncated or hostile input gives an [`Error`].
    /// Every tensor's data range is checked to lie inside `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<GgufFile> {
        crate::parse::parse(bytes)
    }

    /// Absolute offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Length of the file that was parsed.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The tensor called `name`, or [`Error::MissingTensor`].
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
            })
    }

    /// The data of tensor `name`, sliced from `file`, which must be the
    /// same bytes that were given to [`GgufFile::parse`].
    pub fn tensor_bytes<'a>(&self, file: &'a [u8], name: &str) -> Result<&'a [u8]> {
        let info = self.tensor(name)?;
        if file.len() as u64 != self.file_len {
            return Err(Error::FileMismatch {
                expected: self.file_len,
                actual: file.len() as u64,
            });
        }
        // Checked at parse time against this same length; checked again so
        // that a hand-edited `TensorInfo` cannot cause a panic.
        let range = usize::try_from(info.offset)
            .ok()
            .zip(usize::try_from(info.byte_len).ok())
            .and_then(|(start, len)| Some(start..start.checked_add(len)?));
        range
            .and_then(|r| file.get(r))
            .ok_or_else(|| Error::TensorOutOfBounds {
                tensor: info.name.clone(),
                start: info.offset,
                len: info.byte_len,
                file_len: file.len() as u64,
            })
    }

    /// The raw metadata value under `key`, if any.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The value under `key`, or [`Error::MissingKey`].
    pub fn value(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| Error::MissingKey {
            key: key.to_string(),
        })
    }

    /// An integer value that fits in `u32` (any integer type is accepted if
    /// the value fits losslessly).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_int(key, "u32")
    }

    /// An integer value that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_int(key, "u64")
    }

    /// An integer value that fits in `i32`.
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.get_int(key, "i32")
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T> {
        let value = self.value(key)?;
        let wrong = |found: String| Error::WrongType {
            key: key.to_string(),
            expected,
            found,
        };
        let int = value
            .as_i128()
            .ok_or_else(|| wrong(value.type_name().to_string()))?;
        T::try_from(int).map_err(|_| wrong(format!("{} {int} (out of range)", value.type_name())))
    }

    /// A float value (`f32`, or `f64` narrowed to `f32`).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.value(key)? {
            Value::F32(v) => Ok(*v),
            Value::F64(v) => Ok(*v as f32),
            other => Err(Error::WrongType {
                key: key.to_string(),
                expected: "f32",
                found: other.type_name().to_string(),
            }),
        }
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.value(key)? {
            Value::Bool(v) => Ok(*v),
            other => Err(Error::WrongType {
                key: key.to_string(),
                expected: "bool",
                found: other.type_name().to_string(),
            }),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let value = self.value(key)?;
        value.as_str().ok_or_else(|| Error::WrongType {
            key: key.to_string(),
            expected: "string",
            found: value.type_name().to_string(),
        })
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        let value = self.value(key)?;
        value.as_array().ok_or_else(|| Error::WrongType {
            key: key.to_string(),
            expected: "array",
            found: value.type_name().to_string(),
        })
    }

    /// Like [`GgufFile::get_u32`], but `default` when the key is absent
    /// (a present value of the wrong type is still an error).
    pub fn get_u32_or(&self, key: &str, default: u32) -> Result<u32> {
        self.or_default(key, default, Self::get_u32)
    }

    /// Like [`GgufFile::get_u64`], but `default` when the key is absent.
    pub fn get_u64_or(&self, key: &str, default: u64) -> Result<u64> {
        self.or_default(key, default, Self::get_u64)
    }

    /// Like [`GgufFile::get_f32`], but `default` when the key is absent.
    pub fn get_f32_or(&self, key: &str, default: f32) -> Result<f32> {
        self.or_default(key, default, Self::get_f32)
    }

    /// Like [`GgufFile::get_bool`], but `default` when the key is absent.
    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool> {
        self.or_default(key, default, Self::get_bool)
    }

    /// Like [`GgufFile::get_str`], but `default` when the key is absent.
    pub fn get_str_or<'a>(&'a self, key: &str, default: &'a str) -> Result<&'a str> {
        if self.metadata.contains_key(key) {
            self.get_str(key)
        } else {
            Ok(default)
        }
    }

    fn or_default<T>(
        &self,
        key: &str,
        default: T,
        get: impl FnOnce(&Self, &str) -> Result<T>,
    ) -> Result<T> {
        if self.metadata.contains_key(key) {
            get(self, key)
        } else {
            Ok(default)
        }
    }
}
