//! The paged, owner-tagged KV pool.
//!
//! `kv` preallocates every KV page a worker will ever use, tags each page with a header
//! (owner, generation, state), and hands out KV bytes only through a [`PageView`], which
//! [`PagePool::verify_batch`] builds after checking a request's [`PageTable`] against those
//! headers. A view borrows the pool mutably, so no page can be freed or handed to another
//! request while a view of it exists.
//!
//! Invariants kept here (numbers from DESIGN.md):
//! - **I1 Ownership**: the only way to reach KV bytes is a `PageView`, and the only way to get
//!   one is a batch whose every page has the owner and the generation its table recorded, is
//!   in a readable state, and appears once in the whole batch. A table is a claim, never proof.
//! - **I9 No page leak**, in part: allocation and extension are all or nothing, a release that
//!   does not verify frees nothing, and `check_invariants` proves the free list and the headers
//!   agree. That every request eventually releases its pages is the workers' job.
//!
//! - **I5** in part: a page lent to a transport ([`LentPage`]: the send path reads it straight
//!   from pool memory on another thread) is never written or reallocated while lent; a release
//!   parks it until the last lent guard drops.
//!
//! What this crate is not: it does no I/O, spawns no threads, knows nothing of the model or the
//! transfer protocol beyond page states, and contains no `unsafe` (the pages' storage is
//! `hugemem::PageCells`, whose per-page run-time borrow checks hand out every page slice).
//! Pages are reused without zeroing unless `scrub_on_free` is set: the header check, not
//! zeroing, is what keeps tenants apart.
#![forbid(unsafe_code)]

mod pool;
mod prefix;
mod shared;

pub use pool::{LentPage, LentPageMut, PagePool, PageTable, PageView};
pub use prefix::{CachedPrefix, Partition, PrefixCache, PrefixStats};

/// The value scrub-on-free writes into every element of a freed page.
///
/// Zero by default. Under the `ghost-fill` feature it is a recognisable non-zero "ghost"
/// value (203.25 as f16, bits 0x5A5A), so tests can tell a scrubbed page from a page that
/// was never written and any stale read of one stands out.
#[cfg(not(feature = "ghost-fill"))]
pub const SCRUB_FILL: half::f16 = half::f16::ZERO;
/// The value scrub-on-free writes into every element of a freed page (see above).
#[cfg(feature = "ghost-fill")]
pub const SCRUB_FILL: half::f16 = half::f16::from_bits(0x5A5A);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Who a page belongs to: one request of one tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    pub tenant: TenantId,
    pub request: RequestId,
}

/// Index of a physical page in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

/// Bumped every time a page is allocated, so a table kept past its release no longer matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

/// Life cycle of a page. Only `release` makes a page `Free`; only `allocate`/`extend` take one
/// out of `Free` (into `Writing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageState {
    Free,
    Writing,
    Sealed,
    Sending,
    Receiving,
    /// Fate unknown (a transfer may still land bytes in it): neither read nor reused until the
    /// holder of the table has proof and releases it.
    Quarantined,
    /// A full page published in the prefix cache: read-only, held by its tenant (not by one
    /// request) and refcounted by the tables that reference it. Only [`PagePool::share`]
    /// enters this state and only [`PagePool::evict`] leaves it, so `set_state` never moves a
    /// page in or out.
    Shared,
}

impl PageState {
    /// Whether `set_state` may move a page from `self` to `to`: the one transition table, which
    /// the pool enforces and `spec`'s model of the pool checks with.
    pub fn may_become(self, to: PageState) -> bool {
        use PageState::{Free, Quarantined, Receiving, Sealed, Sending, Shared, Writing};
        match (self, to) {
            // Free is entered only by release and left only by allocation, which keep the
            // free list in step with the headers.
            (Free, _) | (_, Free) => false,
            // Shared is entered only by share and left only by eviction.
            (Shared, _) | (_, Shared) => false,
            (from, to) if from == to => true,
            (Writing, Sealed | Receiving | Quarantined) => true,
            (Sealed, Writing | Sending | Quarantined) => true,
            (Sending, Sealed | Quarantined) => true,
            (Receiving, Sealed | Quarantined) => true,
            _ => false,
        }
    }
}

/// Who holds a page that is not free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// One request's private page.
    Request(Owner),
    /// A prefix-cache page of this tenant, readable by that tenant's requests only.
    Tenant(TenantId),
}

/// The tag every physical page carries. `holder` is `None` exactly when the page is `Free`;
/// it is `Holder::Tenant` exactly when the page is `Shared`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageHeader {
    pub holder: Option<Holder>,
    pub generation: Generation,
    pub state: PageState,
}

/// K or V; the discriminant is the kind's index inside a layer (see [`KvLayout::head_offset`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvKind {
    Key = 0,
    Value = 1,
}

/// Shape of one page: for every layer, K and V, for every kv head, `page_size_tokens` slots of
/// `head_dim` f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub layer_count: usize,
    pub kv_head_count: usize,
    pub head_dim: usize,
    pub page_size_tokens: usize,
}

impl KvLayout {
    /// Elements (f16) in one page.
    ///
    /// Panics if the product overflows `usize`; [`PagePool::new`] refuses such a layout with an
    /// error first.
    pub fn page_elems(&self) -> usize {
        self.checked_page_bytes()
            .map(|bytes| bytes / 2)
            .expect("layout overflows usize; PagePool::new refuses such a layout before use")
    }

    /// Bytes in one page (f16 is two bytes).
    pub fn page_bytes(&self) -> usize {
        self.page_elems() * 2
    }

    /// Pages needed to hold `token_count` tokens (rounded up).
    pub fn pages_for_tokens(&self, token_count: usize) -> usize {
        token_count.div_ceil(self.page_size_tokens)
    }

    /// Elements in one (layer, kind, kv head) of one page: its slots, slot-major.
    pub fn head_elems(&self) -> usize {
        self.page_size_tokens * self.head_dim
    }

    /// Offset of the first element of (layer, kind, kv_head) inside a page; the
    /// `page_size_tokens * head_dim` elements from there are that head's slots, slot-major
    /// (`slot * head_dim + d`).
    ///
    /// Panics when `layer` or `kv_head` is out of range: an out-of-range index would silently
    /// address another head's data, so it is a bug, not bad input.
    pub fn head_offset(&self, layer: usize, kind: KvKind, kv_head: usize) -> usize {
        assert!(layer < self.layer_count, "layer {layer} out of range");
        assert!(
            kv_head < self.kv_head_count,
            "kv head {kv_head} out of range"
        );
        ((layer * 2 + kind as usize) * self.kv_head_count + kv_head) * self.head_elems()
    }

    /// `page_bytes`, or `None` when a dimension is zero or the size overflows `usize`.
    fn checked_page_bytes(&self) -> Option<usize> {
        let dims = [
            self.layer_count,
            self.kv_head_count,
            self.head_dim,
            self.page_size_tokens,
        ];
        if dims.contains(&0) {
            return None;
        }
        // Two kinds (K, V) and two bytes per f16.
        dims.iter()
            .try_fold(4usize, |acc, &dim| acc.checked_mul(dim))
    }
}

/// How big a pool to build; rounded down to whole pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSize {
    Tokens(usize),
    Bytes(usize),
}

/// Everything `PagePool::new` needs. No `Default`: a pool size is always a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub layout: KvLayout,
    pub size: PoolSize,
    /// Overwrite a page with [`SCRUB_FILL`] when it is freed (costs a memset per page).
    pub scrub_on_free: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("KV layout {layout:?} has a zero dimension or a page size that overflows usize")]
    BadLayout { layout: KvLayout },
    #[error(
        "pool size {size:?} holds zero whole pages of {page_size_tokens} tokens \
         ({page_bytes} bytes); give at least one page"
    )]
    PoolTooSmall {
        size: PoolSize,
        page_size_tokens: usize,
        page_bytes: usize,
    },
    #[error("pool size {size:?} is {page_count} pages, over the {max} a PageId can name")]
    TooManyPages {
        size: PoolSize,
        page_count: usize,
        max: usize,
    },
    #[error(
        "pool size {size:?} is {page_count} pages of {page_bytes} bytes, more memory than \
         this machine can address; give a smaller size"
    )]
    PoolTooLarge {
        size: PoolSize,
        page_count: usize,
        page_bytes: usize,
    },
    #[error("cannot create the shared-memory KV pool: {reason}")]
    SharedMemory { reason: String },
    #[error("out of KV pages: {needed} needed, {free} free")]
    OutOfPages { needed: usize, free: usize },
    #[error("page {page:?} does not exist in this pool")]
    UnknownPage { page: PageId },
    #[error("page {page:?} belongs to {found:?}, the table claims {expected:?}")]
    OwnerMismatch {
        page: PageId,
        expected: Holder,
        found: Option<Holder>,
    },
    #[error("page {page:?} is a shared prefix-cache page: {reason}")]
    SharedPage { page: PageId, reason: &'static str },
    #[error(
        "a step writes position {position}, inside the {shared_tokens} tokens of shared \
         prefix-cache pages, which are read-only"
    )]
    WriteToShared {
        position: usize,
        shared_tokens: usize,
    },
    #[error("page {page:?} is at generation {found:?}, the table recorded {expected:?}")]
    StaleGeneration {
        page: PageId,
        expected: Generation,
        found: Generation,
    },
    #[error("page {page:?} is {state:?}, not in a state this access allows")]
    PageNotReadable { page: PageId, state: PageState },
    #[error("page {page:?} is lent to a transport (or otherwise borrowed) and cannot be taken")]
    PageBusy { page: PageId },
    #[error("page {page:?} appears more than once in one batch or table")]
    DuplicatePage { page: PageId },
    #[error("page {page:?} cannot go from {from:?} to {to:?}")]
    InvalidTransition {
        page: PageId,
        from: PageState,
        to: PageState,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod lend_tests;
#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod tests;
