//! A bounds-checked little-endian cursor over the file bytes.
//!
//! Every read checks the bytes that remain first, so no input can make the
//! parser index out of range.

use crate::{Error, Result};

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    /// Absolute position of the next byte to read.
    pub(crate) fn pos(&self) -> u64 {
        self.pos as u64
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// Error for wanting `needed` bytes at the current position.
    pub(crate) fn truncated(&self, what: &str, needed: u64) -> Error {
        Error::Truncated {
            what: what.to_string(),
            offset: self.pos(),
            needed,
            available: self.remaining(),
        }
    }

    /// The next `n` bytes, advancing past them.
    pub(crate) fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.truncated(what, n));
        }
        // `n <= remaining <= usize::MAX`, so the cast is lossless.
        let end = self.pos + n as usize;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    pub(crate) fn magic(&mut self) -> Result<[u8; 4]> {
        self.array("magic")
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn i8(&mut self, what: &str) -> Result<i8> {
        Ok(i8::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn i16(&mut self, what: &str) -> Result<i16> {
        Ok(i16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn i32(&mut self, what: &str) -> Result<i32> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn i64(&mut self, what: &str) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn f32(&mut self, what: &str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn f64(&mut self, what: &str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string: u64 byte length, then that many UTF-8 bytes.
    pub(crate) fn string(&mut self, what: &str, max_len: u64) -> Result<String> {
        let len = self.u64(what)?;
        if len > max_len {
            return Err(Error::TooLarge {
                what: format!("length of {what} at offset {}", self.pos() - 8),
                value: len,
                max: max_len,
            });
        }
        let at = self.pos();
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(Error::InvalidUtf8 {
                what: what.to_string(),
                offset: at,
            }),
        }
    }
}
