//! Parsing the GGUF header: magic, version, metadata and tensor infos.
//!
//! Layout (all little-endian): `"GGUF"`, `u32` version, `u64` tensor count,
//! `u64` metadata count, the metadata key/value pairs, the tensor infos,
//! padding up to the alignment, then the tensor data section. Tensor offsets
//! in the infos are relative to the start of that data section.

use std::collections::{BTreeMap, HashSet};

use crate::reader::Reader;
use crate::value::ValueType;
use crate::{Error, GgmlType, GgufFile, Result, TensorInfo, Value};

/// Longest string accepted anywhere in the header (keys, values, tensor names).
pub const MAX_STRING_LEN: u64 = 1 << 20;
/// Most elements accepted in one metadata array.
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Deepest nesting of arrays inside arrays accepted.
pub const MAX_ARRAY_DEPTH: u32 = 4;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_TENSOR_DIMS: u32 = 4;
/// Most tensors accepted in one file.
pub const MAX_TENSOR_COUNT: u64 = 65536;
/// Most metadata key/value pairs accepted in one file.
pub const MAX_KV_COUNT: u64 = 65536;
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// Smallest possible encoded tensor info: empty name (8), n_dims (4), type
/// (4), offset (8). Used to bound the tensor count by the remaining bytes.
const MIN_TENSOR_INFO_SIZE: u64 = 24;
/// Smallest possible encoded key/value pair: empty key (8) + type (4) + 1 byte.
const MIN_KV_SIZE: u64 = 13;

pub(crate) fn parse(bytes: &[u8]) -> Result<GgufFile> {
    let mut r = Reader::new(bytes);

    let magic = r.magic()?;
    if &magic != b"GGUF" {
        return Err(Error::BadMagic { found: magic });
    }
    let version = r.u32("version")?;
    check_version(version)?;

    let n_tensors = r.u64("tensor count")?;
    check_count("tensor count", n_tensors, MAX_TENSOR_COUNT)?;
    let n_kv = r.u64("metadata count")?;
    check_count("metadata count", n_kv, MAX_KV_COUNT)?;
    // Each entry takes some bytes, so a count the file cannot hold is a
    // truncation, reported before anything is allocated for it.
    let min_bytes = n_kv * MIN_KV_SIZE + n_tensors * MIN_TENSOR_INFO_SIZE;
    if min_bytes > r.remaining() {
        return Err(r.truncated("metadata and tensor infos", min_bytes));
    }

    let metadata = read_metadata(&mut r, n_kv)?;
    let alignment = alignment(&metadata)?;
    let infos = read_tensor_infos(&mut r, n_tensors)?;

    let data_offset = align_up(r.pos(), alignment).ok_or_else(|| Error::TooLarge {
        what: "data section offset".to_string(),
        value: r.pos(),
        max: u64::MAX - alignment,
    })?;
    let file_len = bytes.len() as u64;
    let tensors = infos
        .into_iter()
        .map(|raw| place_tensor(raw, data_offset, alignment, file_len))
        .collect::<Result<Vec<_>>>()?;

    Ok(GgufFile {
        version,
        metadata,
        tensors,
        data_offset,
        file_len,
        alignment,
    })
}

fn check_version(version: u32) -> Result<()> {
    let hint = match version {
        2 | 3 => return Ok(()),
        1 => " (GGUF v1 is obsolete; re-convert the model)",
        v if matches!(v.swap_bytes(), 1..=3) => " (this looks like a big-endian file)",
        _ => "",
    };
    Err(Error::UnsupportedVersion { version, hint })
}

fn check_count(what: &str, value: u64, max: u64) -> Result<()> {
    if value > max {
        return Err(Error::TooLarge {
            what: what.to_string(),
            value,
            max,
        });
    }
    Ok(())
}

fn read_metadata(r: &mut Reader<'_>, n_kv: u64) -> Result<BTreeMap<String, Value>> {
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("metadata key", MAX_STRING_LEN)?;
        let type_offset = r.pos();
        let type_id = r.u32("metadata value type")?;
        let ty = value_type(&key, type_id, type_offset)?;
        let value = read_value(r, &key, ty, 0).map_err(|e| in_key(e, &key))?;
        if metadata.contains_key(&key) {
            return Err(Error::DuplicateKey { key });
        }
        metadata.insert(key, value);
    }
    Ok(metadata)
}

fn value_type(key: &str, type_id: u32, offset: u64) -> Result<ValueType> {
    ValueType::from_id(type_id).ok_or_else(|| Error::UnknownValueType {
        key: key.to_string(),
        type_id,
        offset,
    })
}

/// Names the key in errors raised while reading its value.
fn in_key(err: Error, key: &str) -> Error {
    match err {
        Error::Truncated {
            what,
            offset,
            needed,
            available,
        } => Error::Truncated {
            what: format!("{what} of metadata key {key:?}"),
            offset,
            needed,
            available,
        },
        Error::TooLarge { what, value, max } => Error::TooLarge {
            what: format!("{what} of metadata key {key:?}"),
            value,
            max,
        },
        Error::InvalidUtf8 { what, offset } => Error::InvalidUtf8 {
            what: format!("{what} of metadata key {key:?}"),
            offset,
        },
        other => other,
    }
}

fn read_value(r: &mut Reader<'_>, key: &str, ty: ValueType, depth: u32) -> Result<Value> {
    Ok(match ty {
        ValueType::U8 => Value::U8(r.u8("u8 value")?),
        ValueType::I8 => Value::I8(r.i8("i8 value")?),
        ValueType::U16 => Value::U16(r.u16("u16 value")?),
        ValueType::I16 => Value::I16(r.i16("i16 value")?),
        ValueType::U32 => Value::U32(r.u32("u32 value")?),
        ValueType::I32 => Value::I32(r.i32("i32 value")?),
        ValueType::F32 => Value::F32(r.f32("f32 value")?),
        ValueType::U64 => Value::U64(r.u64("u64 value")?),
        ValueType::I64 => Value::I64(r.i64("i64 value")?),
        ValueType::F64 => Value::F64(r.f64("f64 value")?),
        ValueType::Bool => match r.u8("bool value")? {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            byte => {
                return Err(Error::InvalidBool {
                    key: key.to_string(),
                    byte,
                })
            }
        },
        ValueType::String => Value::String(r.string("string value", MAX_STRING_LEN)?),
        ValueType::Array => Value::Array(read_array(r, key, depth)?),
    })
}

fn read_array(r: &mut Reader<'_>, key: &str, depth: u32) -> Result<Vec<Value>> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(Error::NestingTooDeep {
            key: key.to_string(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let type_offset = r.pos();
    let elem_id = r.u32("array element type")?;
    let elem = value_type(key, elem_id, type_offset)?;
    let count = r.u64("array length")?;
    check_count("array length", count, MAX_ARRAY_LEN)?;
    // count <= 2^24 and min size <= 12, so this cannot overflow.
    let min_bytes = count * elem.min_encoded_size();
    if min_bytes > r.remaining() {
        return Err(r.truncated("array elements", min_bytes));
    }
    // Lossless: count <= MAX_ARRAY_LEN = 2^24.
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        out.push(read_value(r, key, elem, depth + 1)?);
    }
    Ok(out)
}

fn alignment(metadata: &BTreeMap<String, Value>) -> Result<u64> {
    const KEY: &str = "general.alignment";
    let alignment = match metadata.get(KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) => *a,
        Some(other) => {
            return Err(Error::WrongType {
                key: KEY.to_string(),
                expected: "u32",
                found: other.type_name().to_string(),
            })
        }
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(Error::BadAlignment { alignment });
    }
    Ok(alignment.into())
}

/// A tensor info as read, before its data range is placed in the file.
struct RawTensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    relative_offset: u64,
    byte_len: u64,
}

fn read_tensor_infos(r: &mut Reader<'_>, n_tensors: u64) -> Result<Vec<RawTensorInfo>> {
    // Lossless: n_tensors <= MAX_TENSOR_COUNT.
    let mut infos = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::new();
    for _ in 0..n_tensors {
        let name = r.string("tensor name", MAX_STRING_LEN)?;
        let n_dims = r.u32("tensor dimension count")?;
        if n_dims > MAX_TENSOR_DIMS {
            return Err(Error::BadTensorShape {
                tensor: name,
                reason: format!("{n_dims} dimensions, at most {MAX_TENSOR_DIMS} are supported"),
            });
        }
        let dims = (0..n_dims)
            .map(|_| r.u64("tensor dimension"))
            .collect::<Result<Vec<_>>>()?;
        let type_id = r.u32("tensor type")?;
        let relative_offset = r.u64("tensor offset")?;
        let ggml_type = GgmlType::from_id(type_id);
        let byte_len = tensor_byte_len(&name, &dims, ggml_type)?;
        if !names.insert(name.clone()) {
            return Err(Error::DuplicateTensor { name });
        }
        infos.push(RawTensorInfo {
            name,
            dims,
            ggml_type,
            relative_offset,
            byte_len,
        });
    }
    Ok(infos)
}

/// Bytes a tensor of this shape and type takes, with every step checked.
pub(crate) fn tensor_byte_len(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64> {
    let shape_err = |reason: String| Error::BadTensorShape {
        tensor: name.to_string(),
        reason,
    };
    let (Some(block), Some(size)) = (ggml_type.block_size(), ggml_type.type_size()) else {
        return Err(Error::UnknownTensorType {
            tensor: name.to_string(),
            type_id: ggml_type.id(),
        });
    };
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| shape_err(format!("element count of dims {dims:?} overflows")))?;
    // ggml's ne[0] is 1 for a tensor without dimensions.
    let row = dims.first().copied().unwrap_or(1);
    if row % block != 0 {
        return Err(shape_err(format!(
            "first dimension {row} is not a multiple of the {ggml_type} block size {block}"
        )));
    }
    // row % block == 0 and row divides n_elements (or n_elements is 0).
    (n_elements / block)
        .checked_mul(size)
        .ok_or_else(|| shape_err(format!("byte size of dims {dims:?} overflows")))
}

fn place_tensor(
    raw: RawTensorInfo,
    data_offset: u64,
    alignment: u64,
    file_len: u64,
) -> Result<TensorInfo> {
    if !raw.relative_offset.is_multiple_of(alignment) {
        return Err(Error::MisalignedTensor {
            tensor: raw.name,
            offset: raw.relative_offset,
            alignment,
        });
    }
    let out_of_bounds = |start: u64| Error::TensorOutOfBounds {
        tensor: raw.name.clone(),
        start,
        len: raw.byte_len,
        file_len,
    };
    let start = data_offset
        .checked_add(raw.relative_offset)
        .ok_or_else(|| out_of_bounds(u64::MAX))?;
    match start.checked_add(raw.byte_len) {
        Some(end) if end <= file_len => {}
        _ => return Err(out_of_bounds(start)),
    }
    Ok(TensorInfo {
        name: raw.name,
        dims: raw.dims,
        ggml_type: raw.ggml_type,
        offset: start,
        byte_len: raw.byte_len,
    })
}

fn align_up(pos: u64, alignment: u64) -> Option<u64> {
    let rem = pos % alignment;
    if rem == 0 {
        Some(pos)
    } else {
        pos.checked_add(alignment - rem)
    }
}

#[cfg(test)]
mod tests;
