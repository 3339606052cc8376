//! The prefix index: which shared pages hold the K/V of which token prefix, per tenant.
//!
//! A node is one full page, keyed by `(tenant, partition, parent digest, the page's tokens)`,
//! where the parent digest names every token before the page. The tenant is a typed field of
//! the key and a parameter of every lookup and publish, taken from the request's `Owner` (set
//! by the router from the API key, never from the request body): there is no way to ask for a
//! page without naming whose it must be. A `Partition` (the client's `cache_salt`, hashed)
//! only splits a tenant's pages further.
//!
//! The index holds no reference of its own: a node's page is `Shared` in the pool, and the
//! pool counts the tables that use it. Eviction takes least-recently-used leaves whose page no
//! table references and frees them through the pool, which refuses a referenced page anyway.
//! Sans-I/O: no threads, no clocks (recency is a counter).

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3;

use crate::{Generation, PageId, PagePool, PageTable, TenantId};

/// A split of one tenant's cache (OpenAI's `cache_salt`): requests only share pages within
/// the same tenant *and* partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Partition(pub u64);

/// Digest of every token before a page (and of nothing, for the first page).
type Digest = u128;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct NodeKey {
    tenant: TenantId,
    partition: Partition,
    parent: Digest,
    tokens: Box<[u32]>,
}

struct Node {
    page: PageId,
    generation: Generation,
    /// Digest of the tokens up to and including this page: its children's `parent`.
    digest: Digest,
    /// The parent node's key, to keep its child count (None for a first page).
    parent: Option<NodeKey>,
    children: usize,
    last_used: u64,
}

/// Counters for `/metrics`; they only grow, except `cached_pages`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hit_pages: u64,
    pub hit_tokens: u64,
    pub published_pages: u64,
    pub evictions: u64,
    pub cached_pages: u64,
}

/// What a lookup found: leading shared pages of one tenant, for
/// [`PagePool::allocate_with_prefix`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedPrefix {
    tenant: TenantId,
    pages: Vec<(PageId, Generation)>,
}

impl CachedPrefix {
    /// No cached pages: what a request that may not use the cache starts from.
    pub fn none(tenant: TenantId) -> CachedPrefix {
        CachedPrefix {
            tenant,
            pages: Vec::new(),
        }
    }

    pub fn tenant(&self) -> TenantId {
        self.tenant
    }

    pub fn pages(&self) -> &[(PageId, Generation)] {
        &self.pages
    }

    pub fn page_count(&self) -> usize {
        self.pages.len()
    }
}

/// The index of one worker's shared pages; see the module docs.
pub struct PrefixCache {
    page_size_tokens: usize,
    nodes: HashMap<NodeKey, Node>,
    clock: u64,
    stats: PrefixStats,
    /// Test builds only: the index forgets the tenant (every key and check uses one tenant),
    /// to show that the pool's own tenant check is what stops the bug, and that without both
    /// one tenant reads another's pages.
    #[cfg(feature = "fault-injection")]
    tenant_ignored: bool,
}

impl PrefixCache {
    pub fn new(page_size_tokens: usize) -> PrefixCache {
        assert!(page_size_tokens > 0, "pages hold at least one token");
        PrefixCache {
            page_size_tokens,
            nodes: HashMap::new(),
            clock: 0,
            stats: PrefixStats::default(),
            #[cfg(feature = "fault-injection")]
            tenant_ignored: false,
        }
    }

    /// Test builds only (`fault-injection`): key the index without the tenant (see the field).
    #[cfg(feature = "fault-injection")]
    pub fn set_tenant_ignored_for_test(&mut self, ignored: bool) {
        self.tenant_ignored = ignored;
    }

    /// The tenant the index keys by: `tenant`, except in a fault-injection run that forgets it.
    fn key_tenant(&self, tenant: TenantId) -> TenantId {
        #[cfg(feature = "fault-injection")]
        if self.tenant_ignored {
            return TenantId(0);
        }
        tenant
    }

    /// The longest run of leading full pages of `tokens` that `tenant` has cached in
    /// `partition`, each still a shared page of that tenant in `pool`. Marks them used.
    pub fn lookup(
        &mut self,
        tenant: TenantId,
        partition: Partition,
        tokens: &[u32],
        pool: &PagePool,
    ) -> CachedPrefix {
        self.stats.lookups += 1;
        self.clock += 1;
        let mut found = CachedPrefix::none(tenant);
        let mut parent: Digest = 0;
        let key_tenant = self.key_tenant(tenant);
        for page_tokens in tokens.chunks_exact(self.page_size_tokens) {
            let key = NodeKey {
                tenant: key_tenant,
                partition,
                parent,
                tokens: page_tokens.into(),
            };
            let Some(node) = self.nodes.get_mut(&key) else {
                break;
            };
            if !pool.is_shared_by(node.page, node.generation, key_tenant) && key_tenant == tenant {
                // Only eviction through this index frees a shared page, so this is a bug;
                // the pool would refuse the page anyway.
                debug_assert!(false, "indexed page {:?} is no longer shared", node.page);
                break;
            }
            node.last_used = self.clock;
            found.pages.push((node.page, node.generation));
            parent = node.digest;
        }
        self.stats.hit_pages += found.pages.len() as u64;
        self.stats.hit_tokens += (found.pages.len() * self.page_size_tokens) as u64;
        found
    }

    /// Shares and indexes the full pages of `table` that hold `tokens` (the K/V the table
    /// holds from position 0), under the table's own tenant. Stops at the first page whose
    /// prefix another table already published: that one and the rest stay private. Returns
    /// how many pages are shared afterwards.
    pub fn publish(
        &mut self,
        pool: &mut PagePool,
        table: &mut PageTable,
        partition: Partition,
        tokens: &[u32],
    ) -> usize {
        let tenant = self.key_tenant(table.owner().tenant);
        let full_pages = (tokens.len() / self.page_size_tokens).min(table.pages().len());
        let mut parent: Digest = 0;
        let mut publishable = 0;
        let mut keys = Vec::with_capacity(full_pages);
        for (index, page_tokens) in tokens
            .chunks_exact(self.page_size_tokens)
            .take(full_pages)
            .enumerate()
        {
            let key = NodeKey {
                tenant,
                partition,
                parent,
                tokens: page_tokens.into(),
            };
            let digest = chain(parent, page_tokens);
            match self.nodes.get(&key) {
                // Ours already (we found it at lookup): keep walking.
                Some(node)
                    if index < table.shared_pages() && table.pages()[index].0 == node.page => {}
                // Someone else's copy of the same prefix: ours stays private.
                Some(_) => break,
                None if index < table.shared_pages() => break,
                None => {}
            }
            keys.push((key, digest));
            parent = digest;
            publishable = index + 1;
        }
        if publishable <= table.shared_pages() {
            return table.shared_pages();
        }
        let entries = match pool.share(table, publishable) {
            Ok(entries) => entries,
            Err(error) => {
                debug_assert!(false, "publishing a table's own full pages: {error}");
                return table.shared_pages();
            }
        };
        self.clock += 1;
        let mut parent_key: Option<NodeKey> = None;
        for ((key, digest), (page, generation)) in keys.into_iter().zip(entries) {
            if !self.nodes.contains_key(&key) {
                if let Some(parent) = parent_key.as_ref().and_then(|k| self.nodes.get_mut(k)) {
                    parent.children += 1;
                }
                self.nodes.insert(
                    key.clone(),
                    Node {
                        page,
                        generation,
                        digest,
                        parent: parent_key.clone(),
                        children: 0,
                        last_used: self.clock,
                    },
                );
                self.stats.published_pages += 1;
            }
            parent_key = Some(key);
        }
        table.shared_pages()
    }

    /// Frees up to `wanted` cached pages that no table references, least recently used
    /// first and one at a time, so a parent freed of its last child competes with every other
    /// leaf by its own last use; never one of `keep` (a prefix about to be referenced).
    /// Returns how many it freed.
    pub fn evict(
        &mut self,
        pool: &mut PagePool,
        wanted: usize,
        keep: &[(PageId, Generation)],
    ) -> usize {
        let mut freed = 0;
        while freed < wanted {
            // A node's last use is its chain's (a lookup touches the whole path), so the
            // oldest evictable leaf is the tail of the least recently used chain.
            let oldest = self
                .nodes
                .iter()
                .filter(|(_, node)| {
                    node.children == 0
                        && pool.shared_refs(node.page) == 0
                        && !keep.contains(&(node.page, node.generation))
                })
                .min_by_key(|(_, node)| node.last_used)
                .map(|(key, _)| key.clone());
            let Some(key) = oldest else {
                break;
            };
            let node = self.nodes.remove(&key).expect("the leaf just found");
            if let Some(parent) = node.parent.as_ref().and_then(|k| self.nodes.get_mut(k)) {
                parent.children -= 1;
            }
            match pool.evict(node.page, node.generation) {
                Ok(()) => {
                    freed += 1;
                    self.stats.evictions += 1;
                }
                Err(error) => debug_assert!(false, "evicting an unreferenced leaf: {error}"),
            }
        }
        freed
    }

    /// Evicts every page no table references (tests and shutdown: back to a full pool).
    pub fn flush(&mut self, pool: &mut PagePool) -> usize {
        self.evict(pool, usize::MAX, &[])
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            cached_pages: self.nodes.len() as u64,
            ..self.stats
        }
    }

    pub fn page_size_tokens(&self) -> usize {
        self.page_size_tokens
    }
}

/// The digest naming `parent`'s tokens followed by `tokens`.
fn chain(parent: Digest, tokens: &[u32]) -> Digest {
    let mut hasher = Xxh3::new();
    hasher.update(&parent.to_le_bytes());
    for token in tokens {
        hasher.update(&token.to_le_bytes());
    }
    hasher.digest128()
}
