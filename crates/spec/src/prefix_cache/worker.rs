//! One worker's pages: its pool (the copy of `kv::PagePool`'s rules, unchanged), each page's
//! bytes, and its prefix cache, with the cache's rules: lookup by key, hold and unhold
//! (refcount), publish a request's own full pages, evict an unheld page.
//!
//! A cached page stays allocated in the pool to the request that computed it, `Sealed`, and
//! the cache entry holds the refcount (`kv` hands it to the tenant instead, `Holder::Tenant`;
//! the pool copy here predates shared pages). Eviction frees it through `Pool::release`, so
//! its next allocation bumps the generation and every stale reference fails the page check.

use kv::PageState;

use super::Content;
use crate::pages::{Access, Pool, Table};

/// The cache key. The code's is (tenant, partition, parent page, tokens); a page is published
/// only after its parent, so (prompt, index) names the same chain of tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub tenant: u8,
    pub prompt: u8,
    pub index: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub key: Key,
    pub page: u8,
    pub generation: u8,
    /// The request that computed the page: its owner in the pool, kept while it is cached.
    pub owner: u8,
    /// Live tables that hold the page.
    pub refcount: u8,
}

/// A table's reference to a cached page: what it verifies against the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ref {
    pub page: u8,
    pub generation: u8,
    pub owner: u8,
}

/// A request's pages on one worker, in prompt order: the cached pages it reuses, then its own
/// (owned by it in the pool, the only pages any write may reach).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Held {
    pub shared: Vec<Ref>,
    pub private: Table,
}

impl Held {
    pub fn len(&self) -> usize {
        self.shared.len() + self.private.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The physical page at prompt position `slot`.
    pub fn page(&self, slot: usize) -> u8 {
        match self.shared.get(slot) {
            Some(shared) => shared.page,
            None => self.private[slot - self.shared.len()].0,
        }
    }

    pub fn holds_shared(&self, page: u8, generation: u8) -> bool {
        self.shared
            .iter()
            .any(|r| r.page == page && r.generation == generation)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Worker {
    pub pool: Pool,
    pub content: Vec<Content>,
    /// Sorted, so that equal caches make equal states.
    pub cache: Vec<Entry>,
}

impl Worker {
    pub fn new(pages: u8) -> Worker {
        Worker {
            pool: Pool::new(pages),
            content: vec![Content::Empty; pages as usize],
            cache: Vec::new(),
        }
    }

    /// The cache entries for the leading full pages of a prompt, in order, up to the first
    /// miss. `any_tenant` is the `CacheKeyWithoutTenant` mutant: match by tokens only.
    pub fn lookup(&self, tenant: u8, prompt: u8, full_pages: u8, any_tenant: bool) -> Vec<Entry> {
        let mut hits = Vec::new();
        for index in 0..full_pages {
            let hit = self.cache.iter().find(|e| {
                e.key.prompt == prompt
                    && e.key.index == index
                    && (any_tenant || e.key.tenant == tenant)
            });
            match hit {
                Some(&entry) => hits.push(entry),
                None => break,
            }
        }
        hits
    }

    /// Takes a reference to each entry (refcount + 1).
    pub fn hold(&mut self, entries: &[Entry]) -> Vec<Ref> {
        entries
            .iter()
            .map(|hit| {
                let entry = self
                    .cache
                    .iter_mut()
                    .find(|e| e.page == hit.page && e.generation == hit.generation)
                    .expect("a lookup's hit is in the cache");
                entry.refcount += 1;
                Ref {
                    page: entry.page,
                    generation: entry.generation,
                    owner: entry.owner,
                }
            })
            .collect()
    }

    /// Publishes a request's own full pages after its reused ones, in order, each under its
    /// key, and moves them to the shared part of its table (refcount 1: the publisher holds
    /// it). Stops at the first page whose key is taken: another request of the tenant computed
    /// the same tokens at the same time and published first; that page stays private.
    /// Returns how many pages it published.
    pub fn publish(
        &mut self,
        request: u8,
        key_of: impl Fn(u8) -> Key,
        full_pages: u8,
        held: &mut Held,
    ) -> usize {
        let before = held.shared.len();
        while held.shared.len() < full_pages as usize && !held.private.is_empty() {
            let key = key_of(held.shared.len() as u8);
            if self.cache.iter().any(|e| e.key == key) {
                break;
            }
            let (page, generation) = held.private.remove(0);
            self.seal(request, page, generation);
            self.cache.push(Entry {
                key,
                page,
                generation,
                owner: request,
                refcount: 1,
            });
            held.shared.push(Ref {
                page,
                generation,
                owner: request,
            });
        }
        self.cache.sort();
        held.shared.len() - before
    }

    /// A cached page is read-only: sealed before anyone else can hold it.
    fn seal(&mut self, owner: u8, page: u8, generation: u8) {
        let sealed = self
            .pool
            .set_state(owner, &vec![(page, generation)], PageState::Sealed);
        assert!(sealed.is_ok(), "a request's own page seals");
    }

    /// Drops a table's references. False when one no longer names a cached page.
    pub fn unhold(&mut self, refs: &[Ref]) -> bool {
        let mut all = true;
        for r in refs {
            match self
                .cache
                .iter_mut()
                .find(|e| e.page == r.page && e.generation == r.generation)
            {
                Some(entry) if entry.refcount > 0 => entry.refcount -= 1,
                _ => all = false,
            }
        }
        all
    }

    /// A request's table ends: references dropped, its own pages freed (`Engine::end`).
    /// False when either fails, which the engine's `expect` would not survive.
    pub fn release(&mut self, request: u8, held: &Held) -> bool {
        let unheld = self.unhold(&held.shared);
        let freed = self.pool.release(request, &held.private).is_ok();
        unheld && freed
    }

    /// Removes a cache entry and frees its page through the pool's ordinary release.
    pub fn evict(&mut self, index: usize) {
        let entry = self.cache.remove(index);
        let freed = self
            .pool
            .release(entry.owner, &vec![(entry.page, entry.generation)]);
        assert!(freed.is_ok(), "a cached page is allocated to its owner");
    }

    /// The page check before a read (`verify_batch`): every reused page against the owner
    /// its reference recorded, the request's own pages against it.
    pub fn verify(&self, request: u8, held: &Held, access: Access) -> bool {
        let shared_ok = held.shared.iter().all(|r| {
            let claim = vec![(r.page, r.generation)];
            self.pool
                .verify(&[(r.owner, &claim)], Access::Bytes, false)
                .is_ok()
        });
        shared_ok
            && self
                .pool
                .verify(&[(request, &held.private)], access, false)
                .is_ok()
    }

    /// The bytes at each prompt position of a table.
    pub fn contents(&self, held: &Held) -> Vec<Content> {
        (0..held.len())
            .map(|slot| self.content[held.page(slot) as usize])
            .collect()
    }

    pub fn entry(&self, page: u8, generation: u8) -> Option<&Entry> {
        self.cache
            .iter()
            .find(|e| e.page == page && e.generation == generation)
    }
}
