//! Prefix reuse (I10): the pages a request starts with from this worker's cache, and the
//! prompt pages it leaves there once they are final.
//!
//! The cache is keyed by the tenant in the request's pool owner, which the router set from the
//! API key, and by the partition the router derived from the client's `cache_salt`; a request
//! the router marked `prefix_cache: None` neither reads nor publishes. Pages are published
//! only once their K/V is final and trusted: prefill and unified after computing the prompt,
//! decode only after the transfer verified (counts and checksum, I4), so a corrupt page never
//! enters the cache.

use super::{Engine, Key, Phase, Stage};
use kv::{CachedPrefix, PageTable};

impl Engine {
    /// The queued request's pages: `prefix` then own pages for `needed` tokens in all. Short
    /// of free pages, evicts cached pages no request references (never `prefix`'s own) and
    /// tries again; `None` when the request must wait.
    pub(super) fn allocate(
        &mut self,
        key: Key,
        prefix: &CachedPrefix,
        needed: usize,
    ) -> Option<PageTable> {
        let owner = self.requests.get(&key)?.owner;
        match self.pool.allocate_with_prefix(owner, prefix, needed) {
            Ok(table) => return Some(table),
            Err(kv::Error::OutOfPages { needed, free }) => {
                // Evict only when that makes the request fit: a request that must wait
                // anyway leaves the cache as it is.
                let kept_unreferenced = prefix
                    .pages()
                    .iter()
                    .filter(|(page, _)| self.pool.shared_refs(*page) == 0)
                    .count();
                let reclaimable = self.pool.pages_reclaimable() - kept_unreferenced;
                if free + reclaimable < needed {
                    return None;
                }
                let evicted = self
                    .cache
                    .evict(&mut self.pool, needed - free, prefix.pages());
                if evicted < needed - free {
                    return None;
                }
            }
            Err(error) => {
                // The pool refused the cached prefix (not this tenant's, or stale): a bug in
                // the index, counted like any failed page check. The request runs cold.
                self.ownership_failures += 1;
                tracing::error!(%error, "a cached prefix did not verify; computing it again");
                return self
                    .pool
                    .allocate_with_prefix(owner, &CachedPrefix::none(owner.tenant), needed)
                    .ok();
            }
        }
        match self.pool.allocate_with_prefix(owner, prefix, needed) {
            Ok(table) => Some(table),
            // An evicted page a transport still reads (a prefill's published prompt page
            // whose frame is still going out) is free but not reusable until it lets go
            // (`PagePool::reclaim_returned`): wait for it, as for any page.
            Err(kv::Error::OutOfPages { .. }) => None,
            Err(error) => panic!("pages were evicted for this allocation: {error}"),
        }
    }

    /// Publishes the request's full prompt pages (the K/V of `prompt[..n-1]`) under its
    /// tenant and partition, if it may use the cache.
    pub(super) fn publish_prompt(&mut self, key: Key) {
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        let Some(partition) = request.submit.prefix_cache else {
            return;
        };
        let table = match &mut request.phase {
            // The incident's placeholder never computed the prompt it claims.
            Phase::Admitted {
                stage:
                    Stage::Prefilling {
                        placeholder: true, ..
                    },
                ..
            } => return,
            Phase::Admitted { table, .. } => table,
            Phase::Queued => return,
        };
        let prompt = &request.submit.prompt;
        let kv_tokens = &prompt[..prompt.len() - 1];
        self.cache
            .publish(&mut self.pool, table, partition, kv_tokens);
    }
}
