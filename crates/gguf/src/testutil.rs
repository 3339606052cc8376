//! Test-only builder of small GGUF files.

use crate::Value;

/// The on-disk type id of a value.
pub(crate) fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Writes a value's payload (without its type id). An empty array is
/// written with element type u32.
pub(crate) fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            let elem = items.first().map_or(4, type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
    /// Written as the relative offset instead of the computed one.
    forced_offset: Option<u64>,
}

/// Builds a GGUF file; tensor data is laid out in order, each aligned.
pub(crate) struct Builder {
    version: u32,
    alignment: u64,
    kvs: Vec<(String, Value)>,
    tensors: Vec<TensorSpec>,
}

impl Builder {
    pub(crate) fn new() -> Self {
        Builder {
            version: 3,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub(crate) fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Adds a key; `general.alignment` (u32) also sets the data layout.
    pub(crate) fn kv(mut self, key: &str, value: Value) -> Self {
        if let ("general.alignment", Value::U32(a)) = (key, &value) {
            self.alignment = u64::from(*a).max(1);
        }
        self.kvs.push((key.to_string(), value));
        self
    }

    pub(crate) fn tensor(mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            data,
            forced_offset: None,
        });
        self
    }

    /// A tensor info with this relative offset and no data of its own.
    pub(crate) fn raw_tensor(
        mut self,
        name: &str,
        dims: &[u64],
        type_id: u32,
        offset: u64,
    ) -> Self {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            data: Vec::new(),
            forced_offset: Some(offset),
        });
        self
    }

    pub(crate) fn build(self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (key, value) in &self.kvs {
            put_str(&mut out, key);
            out.extend_from_slice(&type_id(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let align = |n: u64| n.div_ceil(self.alignment) * self.alignment;
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&t.forced_offset.unwrap_or(offset).to_le_bytes());
            offsets.push(offset);
            offset = align(offset + t.data.len() as u64);
        }
        if !self.tensors.is_empty() {
            let data_start = align(out.len() as u64);
            for (t, off) in self.tensors.iter().zip(offsets) {
                out.resize((data_start + off) as usize, 0);
                out.extend_from_slice(&t.data);
            }
        }
        out
    }
}
