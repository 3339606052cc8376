//! The transfer checksum: xxh3-64 over the transfer's header fields and then every page's
//! bytes in page order. The receiver computes it over the bytes as they lie in its own pages,
//! so it proves what decode will read, not just what crossed the wire.
//!
//! The sender streams: it hashes each page as the prefill chunk that wrote it completes
//! ([`TransferHasher`]), so the checksum is ready when the last page is, without a second pass
//! over the prompt's pages.

use crate::TransferDone;
use xxhash_rust::xxh3::Xxh3;

/// Checksum of a transfer whose header is `done` (its `checksum` field is not hashed) and
/// whose pages are `pages`, in index order.
pub fn transfer_checksum<'a>(
    done: &TransferDone,
    pages: impl IntoIterator<Item = &'a [u8]>,
) -> u64 {
    let mut hasher = TransferHasher::new(done);
    for page in pages {
        hasher.page(page);
    }
    hasher.finish()
}

/// [`transfer_checksum`] one page at a time: the header when the transfer starts, then each
/// page in index order as it becomes final.
pub struct TransferHasher {
    hasher: Xxh3,
    pages: u32,
}

impl TransferHasher {
    /// Starts the checksum of the transfer whose header is `done` (`checksum` not hashed).
    pub fn new(done: &TransferDone) -> TransferHasher {
        let mut hasher = Xxh3::new();
        hasher.update(&done.transfer.0.to_le_bytes());
        hasher.update(&done.request.0.to_le_bytes());
        hasher.update(&done.tenant.0.to_le_bytes());
        hasher.update(&done.page_count.to_le_bytes());
        hasher.update(&done.token_count.to_le_bytes());
        TransferHasher { hasher, pages: 0 }
    }

    /// Hashes the next page (pages must come in index order).
    pub fn page(&mut self, page: &[u8]) {
        self.hasher.update(page);
        self.pages += 1;
    }

    /// Pages hashed so far.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn finish(&self) -> u64 {
        self.hasher.digest()
    }
}
