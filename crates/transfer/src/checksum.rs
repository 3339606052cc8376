//! The transfer checksum: xxh3-64 over the transfer's header fields and then each page's own
//! XXH3-64 (under a fixed secret, [`page_hash`]), in page order: per-page hashes under a root. The receiver computes it over the
//! bytes as they lie in its own pages, so it proves what decode will read, not just what
//! crossed the wire.
//!
//! Per-page hashes let both sides hash while the transfer runs: the sender hashes each page
//! as the prefill chunk that wrote it completes ([`TransferHasher`]; one-sided, the link's
//! writer hashes it as it copies it), and decode's link reader
//! hashes each page right after landing it, while it alone may write the page (its lease), or,
//! one-sided, when the writer reports the page's one write landed (`Frame::Written`); so at
//! `Done` only the root is left to compute.

use crate::{TransferDone, TransferId};
use kernels::{xxh3_64_long, XXH3_SECRET_BYTES, XXH3_SHORT_MAX};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use xxhash_rust::xxh3::{xxh3_64_with_secret, Xxh3};

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

/// One page's hash, as the root folds it in: XXH3-64 under [`PAGE_SECRET`]. A KV page is long
/// (368,640 bytes for the default model), which takes the run-time dispatched SIMD kernel.
pub fn page_hash(page: &[u8]) -> u64 {
    if page.len() > XXH3_SHORT_MAX {
        xxh3_64_long(page, &PAGE_SECRET)
    } else {
        xxh3_64_with_secret(page, &PAGE_SECRET)
    }
}

/// The page hashes' secret: 192 bytes of SplitMix64 from a fixed seed. Any fixed,
/// random-looking secret serves (XXH3's requirement); both sides of a transfer use this one.
pub const PAGE_SECRET: [u8; XXH3_SECRET_BYTES] = page_secret();

const fn page_secret() -> [u8; XXH3_SECRET_BYTES] {
    let mut secret = [0u8; XXH3_SECRET_BYTES];
    let mut state: u64 = u64::from_le_bytes(*b"AIRLOCK&");
    let mut word = 0;
    while word < XXH3_SECRET_BYTES / 8 {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let bytes = z.to_le_bytes();
        let mut byte = 0;
        while byte < 8 {
            secret[word * 8 + byte] = bytes[byte];
            byte += 1;
        }
        word += 1;
    }
    secret
}

/// [`transfer_checksum`] one page at a time: the header when the transfer starts, then each
/// page (or its [`page_hash`]) in index order as it becomes final.
pub struct TransferHasher {
    root: Xxh3,
    pages: u32,
}

impl TransferHasher {
    /// Starts the checksum of the transfer whose header is `done` (`checksum` not hashed).
    pub fn new(done: &TransferDone) -> TransferHasher {
        let mut root = Xxh3::new();
        root.update(&done.transfer.0.to_le_bytes());
        root.update(&done.request.0.to_le_bytes());
        root.update(&done.tenant.0.to_le_bytes());
        root.update(&done.page_count.to_le_bytes());
        root.update(&done.token_count.to_le_bytes());
        TransferHasher { root, pages: 0 }
    }

    /// Hashes the next page (pages must come in index order).
    pub fn page(&mut self, page: &[u8]) {
        self.page_hash(page_hash(page));
    }

    /// Folds in the next page's [`page_hash`], computed elsewhere.
    pub fn page_hash(&mut self, hash: u64) {
        self.root.update(&hash.to_le_bytes());
        self.pages += 1;
    }

    /// Pages hashed so far.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn finish(&self) -> u64 {
        self.root.digest()
    }
}

/// The page hashes a link's writer takes as it sends or copies each page, by transfer and page
/// index, from which it computes the transfer's `Done` checksum (a writer that hashes each
/// page just before its copy reads it from memory once, where the engine's hash, taken when
/// the page was lent, was a second read). The engine adds the hashes of pages decode holds,
/// which go nowhere. Shared by the engine and the link.
///
/// A transfer that ends without `Done` or `TransferAbort` (a request cancelled while its
/// prompt streams) leaves its hashes behind, so at most [`SENDER_HASHES_TRANSFERS_MAX`]
/// transfers are kept, the oldest dropped first: a live transfer whose hashes were dropped
/// gets a checksum that fails, never a wrong page accepted.
#[derive(Clone, Default)]
pub struct SenderHashes(Arc<Mutex<BTreeMap<TransferId, BTreeMap<u32, u64>>>>);

/// Transfers a link's [`SenderHashes`] keeps hashes for, far above the transfers one link can
/// have streaming at once (a pool's pages).
pub const SENDER_HASHES_TRANSFERS_MAX: usize = 4096;

impl SenderHashes {
    pub fn put(&self, transfer: TransferId, index: u32, hash: u64) {
        let mut hashes = self.0.lock().expect("sender hashes lock");
        hashes.entry(transfer).or_default().insert(index, hash);
        while hashes.len() > SENDER_HASHES_TRANSFERS_MAX {
            hashes.pop_first();
        }
    }

    /// The checksum over `done.page_count` pages from the hashes put for its transfer, which
    /// are dropped: a page never hashed counts as 0, so the receiver's checksum cannot match.
    pub fn take_checksum(&self, done: &TransferDone) -> u64 {
        checksum_over(done, &self.forget(done.transfer))
    }

    /// Drops what was put for `transfer` (it ended without a `Done`), returning it.
    pub fn forget(&self, transfer: TransferId) -> BTreeMap<u32, u64> {
        let mut hashes = self.0.lock().expect("sender hashes lock");
        hashes.remove(&transfer).unwrap_or_default()
    }
}

/// The checksum over `done.page_count` pages from their hashes by index; a page missing from
/// `hashes` counts as 0, so the receiver's checksum cannot match.
pub(crate) fn checksum_over(done: &TransferDone, hashes: &BTreeMap<u32, u64>) -> u64 {
    let mut root = TransferHasher::new(done);
    for index in 0..done.page_count {
        root.page_hash(hashes.get(&index).copied().unwrap_or(0));
    }
    root.finish()
}
