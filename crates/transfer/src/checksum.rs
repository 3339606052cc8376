//! The transfer checksum: xxh3-64 over the transfer's header fields and then every page's
//! bytes in page order. The receiver computes it over the bytes as they lie in its own pages,
//! so it proves what decode will read, not just what crossed the wire.

use crate::TransferDone;
use xxhash_rust::xxh3::Xxh3;

/// Checksum of a transfer whose header is `done` (its `checksum` field is not hashed) and
/// whose pages are `pages`, in index order.
pub fn transfer_checksum<'a>(
    done: &TransferDone,
    pages: impl IntoIterator<Item = &'a [u8]>,
) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(&done.transfer.0.to_le_bytes());
    hasher.update(&done.request.0.to_le_bytes());
    hasher.update(&done.tenant.0.to_le_bytes());
    hasher.update(&done.page_count.to_le_bytes());
    hasher.update(&done.token_count.to_le_bytes());
    for page in pages {
        hasher.update(page);
    }
    hasher.digest()
}
