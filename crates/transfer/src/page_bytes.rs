//! A `Page` frame's bytes: lent straight from the sender's pool, so sending one copies
//! nothing before the socket, or owned (as decoded from the wire, or built by a test).

use std::fmt;
use std::ops::{Deref, DerefMut};

#[derive(Clone)]
pub enum PageBytes {
    Owned(Vec<u8>),
    /// The sender's own page, read in place until the frame is written and dropped; the pool
    /// reuses the page only after that (`kv::LentPage`).
    Lent(kv::LentPage),
}

impl PageBytes {
    /// The bytes as an owned buffer (a copy if they were lent).
    pub fn into_owned(self) -> Vec<u8> {
        match self {
            PageBytes::Owned(bytes) => bytes,
            PageBytes::Lent(page) => page.bytes().to_vec(),
        }
    }
}

impl Deref for PageBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            PageBytes::Owned(bytes) => bytes,
            PageBytes::Lent(page) => page.bytes(),
        }
    }
}

impl DerefMut for PageBytes {
    /// Copies lent bytes out first: a lent page is the sender's and is never written through
    /// a frame (only tests and planted faults change a frame's bytes).
    fn deref_mut(&mut self) -> &mut [u8] {
        if let PageBytes::Lent(page) = self {
            *self = PageBytes::Owned(page.bytes().to_vec());
        }
        match self {
            PageBytes::Owned(bytes) => bytes,
            PageBytes::Lent(_) => unreachable!("made owned above"),
        }
    }
}

impl From<Vec<u8>> for PageBytes {
    fn from(bytes: Vec<u8>) -> PageBytes {
        PageBytes::Owned(bytes)
    }
}

impl PartialEq for PageBytes {
    fn eq(&self, other: &PageBytes) -> bool {
        **self == **other
    }
}

impl fmt::Debug for PageBytes {
    /// The length only: the bytes are tenant data and have no place in logs.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lent = matches!(self, PageBytes::Lent(_));
        write!(formatter, "PageBytes({} bytes, lent: {lent})", self.len())
    }
}
