//! The tenant-scoped prefix cache and the delta transfer: a second model, beside the transfer
//! model, small enough to explore every order of lookups, inserts, evictions and releases on
//! both workers.
//!
//! What it models (issue 23's design): each worker, prefill and decode,
//! keeps a cache of full, sealed pages keyed by (tenant, prompt, page index), which names the
//! same chain of tokens as the code's (tenant, partition, parent page, tokens) because a page
//! is published only after its parent. A cached page is read-only and refcounted: a request
//! whose prompt starts with cached pages of its own tenant puts them at the front of its table
//! and allocates its own pages for the rest; the last, partial page is always its own. Decode
//! looks up its cache when it reserves, tells the router how many pages `k` it reuses, and
//! prefill sends only pages `k..` and a `Done` whose checksum covers every page decode will
//! read. Decode judges `Done` against its own reservation, seals, and only then publishes the
//! pages it received. A cached page nobody holds may be evicted at any time (a superset of
//! LRU under pressure), through the pool's ordinary release.
//!
//! Actions: `Submit`; `Reserve` (decode's `CacheLookup`, hold, allocate); `Prefill` (prefill's
//! `CacheLookup`, compute, `CacheInsert`, send); `Deliver` of a page frame, `Done` (verify,
//! seal, decode's `CacheInsert`) or prefill's `Ack`/`Nack` (release); `DecodeStep` (read,
//! release); `Evict` on either worker; and the faults `Corrupt`, `Timeout` and a prefill that
//! misstates decode's `k` by one page. Every release drops the table's references
//! (refcount − 1) and frees only the table's own pages.
//!
//! A page's bytes depend on its tokens only, as a real model's KV does: the checksum cannot
//! tell tenant A's KV of a prompt from tenant B's, so the tenant in the key is the only thing
//! that keeps them apart. Which tenant computed a page is kept beside the bytes as a ghost, for
//! the properties. Pages are reused without zeroing, as in `kv`.
//!
//! What the model says about the design: (1) the checksum over reused pages refuses a wrong
//! reuse of a different page, but never a cross-tenant one (same tokens, same bytes): only the
//! tenant in the key and in the page check stops that (`CacheKeyWithoutTenant`); (2) a decode
//! that counts a page as present on prefill's word can seal a page it never received, and the
//! checksum passes when that page, freshly allocated, still holds the same tokens' KV from a
//! refused transfer of another tenant: decode must count present pages from its own
//! reservation, as `Inbound::new`'s `held_pages` does (`DeltaTrustsPrefill`); (3) a page not
//! sealed by a verified transfer must not be published, not even once `Done` has arrived
//! (`CacheBeforeVerify`).
//!
//! How it maps to the code. Real: `transfer::Inbound` with `held_pages` (reused pages present,
//! a frame for one refused), `transfer_checksum` over every page decode reads, and the page
//! rules of `spec::pages`, the copy of `kv::PagePool` from before shared pages. Transcribed,
//! not run: the cache and its refcounts ([`worker`]). Where they differ: `kv` hands a
//! published page to its tenant (`Holder::Tenant`, state `Shared`, refcount in the pool); here
//! it stays allocated to the request that computed it, `Sealed`, and its cache entry holds
//! the refcount; a reference records that owner and the generation, so a stale one fails the
//! page check as in `kv`. `kv` also checks a shared entry's tenant at allocation and at every
//! verify, a second guard behind the key that the model leaves out, so `CacheKeyWithoutTenant`
//! shows what the key alone must stop. The code's `Done` carries no reuse count (prefill's
//! view travels in its `Plan` as `decode_holds_pages`); the model's `Done.reused` is that view,
//! for a mutant decode to trust. Decode steps read one table at a time, so shared pages that
//! repeat across one batch (`verify_batch` allows it for shared entries) are not modelled.
//!
//! What it leaves out, because the transfer model checks it: loss, duplication, retries,
//! crashes, link resets, disconnects, the one-sided transport and the stale paths (a request
//! has one attempt here). Also out: the append of generated tokens (the partial last page is
//! always private, so nothing in the design appends into a shared page), writes by prefill's
//! forward pass (it computes only its own pages by construction), the partition in the key,
//! chunked prefill, a crash that empties a cache, and timing: that eviction order can reveal
//! another tenant's load (TEST-MATRIX I10) is an accepted residual, not a property here.
//!
//! [`actions`] holds what each state enables and where it leads, [`access`] admission and the
//! checked read on either worker, [`prefill`] and [`decode`] each worker's side, [`worker`] a
//! worker's pages and cache rules, [`properties`] what the checker judges.

mod access;
mod actions;
mod decode;
mod prefill;
mod properties;
mod worker;

use kv::{RequestId, TenantId};
use transfer::{Inbound, TransferDone, TransferId};

pub use worker::{Entry, Held, Key, Ref, Worker};

/// One configuration of the prefix-cache model.
#[derive(Clone, Debug)]
pub struct PrefixSpec {
    pub prefill_pages: u8,
    pub decode_pages: u8,
    pub requests: Vec<PrefixRequest>,
    pub faults: PrefixFaults,
    /// Only the prefix-cache mutants act here; the transfer model's are ignored.
    pub mutant: Option<crate::Mutant>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixRequest {
    pub tenant: u8,
    /// Requests with the same prompt have the same full pages; each has its own last page.
    pub prompt: u8,
    /// Pages of KV the prompt fills, the last one partial (one token per page otherwise).
    pub pages: u8,
}

/// How many of each fault the checker may inject on one path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixFaults {
    /// A page frame's bytes are damaged on the way.
    pub corruptions: u8,
    /// A prefill (or router) bug: prefill starts one page before or after the `k` decode
    /// reported, and its `Done` says decode holds that many; the checksum agrees with it.
    pub misclaims: u8,
    /// Decode gives up on a reservation that is still receiving.
    pub timeouts: u8,
}

impl PrefixFaults {
    pub const NONE: PrefixFaults = PrefixFaults {
        corruptions: 0,
        misclaims: 0,
        timeouts: 0,
    };
}

/// Which tokens' KV a page holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tokens {
    /// Full page `index` of a prompt: the same for every request with that prompt.
    Prefix { prompt: u8, index: u8 },
    /// A request's partial last page.
    Tail { request: u8 },
}

/// What a page holds: nothing yet, the KV of some tokens, or garbage. `tenant` is whose
/// request computed the KV, a ghost that is not part of the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Content {
    Empty,
    Kv { tokens: Tokens, tenant: u8 },
    Junk,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouterPhase {
    Idle,
    /// Waiting in decode's queue for pages.
    WaitingDecode,
    /// Decode reserved, reusing `reused` pages of its cache (its `Admitted`); the router asks
    /// prefill for the rest.
    WaitingPrefill {
        reused: u8,
    },
    /// Prefill sent; no response headers yet.
    WaitingStart,
    /// The transfer verified: 200 headers are out.
    Streaming,
    Ended,
}

/// Prefill's side. It holds its pages, reused and its own, until decode answers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefillPhase {
    Idle,
    Sent { held: Held },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodePhase {
    Idle,
    /// `inbound` counts the reused pages as present from the start.
    Receiving {
        held: Held,
        inbound: Inbound,
    },
    /// `reused`: how many of the pages came from decode's cache at the reservation.
    Decoding {
        held: Held,
        reused: u8,
    },
}

impl DecodePhase {
    fn held(&self) -> Option<&Held> {
        match self {
            DecodePhase::Idle => None,
            DecodePhase::Receiving { held, .. } | DecodePhase::Decoding { held, .. } => Some(held),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub router: RouterPhase,
    pub responses: u8,
    pub prefill: PrefillPhase,
    pub decode: DecodePhase,
}

/// Messages between prefill and decode; an unordered multiset.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    Page {
        request: u8,
        index: u8,
        content: Content,
    },
    /// `reused` is prefill's word for how many pages decode holds: decode must not need it.
    Done {
        request: u8,
        pages: u8,
        reused: u8,
        checksum: u64,
    },
    Ack {
        request: u8,
    },
    Nack {
        request: u8,
    },
}

/// Flags set by the action that breaks an invariant; every one stays false in a correct model.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// A request read a page that is neither its own nor cached in its tenant's namespace.
    pub read_foreign_page: bool,
    /// A request read KV of other tokens, or KV another tenant's request computed.
    pub read_foreign_kv: bool,
    /// A request read a page holding nothing or garbage.
    pub read_corrupt: bool,
    pub lookup_foreign: bool,
    pub wrote_shared: bool,
    pub bad_commit: bool,
    pub engine_panic: bool,
}

/// Things that happened in the step that led to a state, for the `sometimes` properties.
pub mod event {
    pub const PREFILL_REUSED: u16 = 1;
    pub const DELTA_ANSWERED: u16 = 1 << 1;
    pub const SHARED_BY_TWO: u16 = 1 << 2;
    pub const OTHER_TENANT_PASSED_OVER: u16 = 1 << 3;
    pub const CORRUPTION_CAUGHT: u16 = 1 << 4;
    pub const MISCLAIM_REFUSED: u16 = 1 << 5;
    pub const EVICTED: u16 = 1 << 6;
    pub const COMPLETED: u16 = 1 << 7;
    /// A request that reused a cached prefix published the full pages after it.
    pub const CHAIN_EXTENDED: u16 = 1 << 8;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefixState {
    pub prefill: Worker,
    pub decode: Worker,
    pub requests: Vec<Request>,
    pub net: Vec<Msg>,
    pub faults: PrefixFaults,
    pub ghost: Ghost,
    pub events: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Prefill,
    Decode,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefixAction {
    Submit(u8),
    /// Decode looks up its cache, holds the hits and reserves the rest.
    Reserve(u8),
    /// Prefill looks up its cache, computes the rest, publishes its full pages and sends
    /// pages `claim..` with `Done`; `claim` is decode's `k` unless the `misclaims` fault.
    Prefill {
        request: u8,
        claim: u8,
    },
    Deliver(usize),
    Corrupt(usize),
    DecodeStep(u8),
    Timeout(u8),
    /// A cached page is evicted (its cache's index).
    Evict(Side, usize),
}

impl PrefixAction {
    /// The action, with the message it picks spelled out.
    pub fn describe(&self, state: &PrefixState) -> String {
        match *self {
            PrefixAction::Deliver(i) => format!("Deliver {:?}", state.net[i]),
            PrefixAction::Corrupt(i) => format!("Corrupt {:?}", state.net[i]),
            PrefixAction::Prefill { request, claim } => {
                match state.requests[request as usize].router {
                    RouterPhase::WaitingPrefill { reused } if reused != claim => format!(
                        "Prefill({request}), sending from page {claim} and claiming decode \
                         holds {claim} pages (decode reported {reused})"
                    ),
                    _ => format!("Prefill({request}), sending from page {claim}"),
                }
            }
            PrefixAction::Evict(side, i) => {
                let worker = state.worker(side);
                format!("Evict {side:?} {:?}", worker.cache[i])
            }
            ref other => format!("{other:?}"),
        }
    }
}

const PAGE_BYTES: usize = 3;

/// A page's bytes: its tokens' KV, whoever computed it.
fn content_bytes(content: Content) -> [u8; PAGE_BYTES] {
    match content {
        Content::Empty => [0, 0, 0],
        Content::Kv {
            tokens: Tokens::Prefix { prompt, index },
            ..
        } => [1, prompt, index],
        Content::Kv {
            tokens: Tokens::Tail { request },
            ..
        } => [2, request, 0],
        Content::Junk => [3, 0xff, 0xff],
    }
}

impl PrefixState {
    pub fn worker(&self, side: Side) -> &Worker {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    fn worker_mut(&mut self, side: Side) -> &mut Worker {
        match side {
            Side::Prefill => &mut self.prefill,
            Side::Decode => &mut self.decode,
        }
    }
}

impl PrefixSpec {
    fn has(&self, mutant: crate::Mutant) -> bool {
        self.mutant == Some(mutant)
    }

    fn spec(&self, request: u8) -> PrefixRequest {
        self.requests[request as usize]
    }

    /// The full pages of a prompt: every page but the partial last one may be cached.
    fn full_pages(&self, request: u8) -> u8 {
        self.spec(request).pages - 1
    }

    /// The tokens of page `index` of a request's prompt.
    fn tokens(&self, request: u8, index: u8) -> Tokens {
        if index < self.full_pages(request) {
            Tokens::Prefix {
                prompt: self.spec(request).prompt,
                index,
            }
        } else {
            Tokens::Tail { request }
        }
    }

    /// The KV a request must read at page `index`: its own tokens', computed for its tenant.
    fn own_kv(&self, request: u8, index: u8) -> Content {
        Content::Kv {
            tokens: self.tokens(request, index),
            tenant: self.spec(request).tenant,
        }
    }

    /// The header both sides hash: the token count the router fixed covers every page decode
    /// reads, reused or received.
    fn done(&self, request: u8, pages: u8) -> TransferDone {
        TransferDone {
            transfer: TransferId(u64::from(request)),
            request: RequestId(u64::from(request)),
            tenant: TenantId(u64::from(self.spec(request).tenant)),
            page_count: u32::from(pages),
            token_count: u32::from(pages),
            checksum: 0,
        }
    }
}
