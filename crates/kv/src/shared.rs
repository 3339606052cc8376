//! Shared pages: how a request's own full pages become read-only prefix-cache pages of its
//! tenant, how a later request of that tenant references them, and how an unreferenced one
//! is evicted back to the free list.
//!
//! The guards are the pool's own (I1, I10): a shared page is held by a tenant, never by a
//! request; a table's shared entries verify only against pages held by the table's own
//! tenant, at the generation recorded when the page was shared; no write path hands out a
//! shared page mutably; and eviction frees a page only when no table references it.

use crate::pool::Access;
use crate::{
    CachedPrefix, Error, Generation, Holder, Owner, PageId, PagePool, PageState, PageTable, Result,
};

impl PagePool {
    /// A table for `owner` that starts with the shared pages of `prefix` (each verified as a
    /// page of the owner's tenant, and referenced) and holds `token_count` tokens in all,
    /// the rest in fresh own pages. All or nothing: short of pages, nothing changes.
    pub fn allocate_with_prefix(
        &mut self,
        owner: Owner,
        prefix: &CachedPrefix,
        token_count: usize,
    ) -> Result<PageTable> {
        let shared = prefix.pages();
        let mut table = PageTable {
            owner,
            pages: shared.to_vec(),
            shared: shared.len(),
            frozen: 0,
        };
        if prefix.tenant() != owner.tenant && !self.owner_check_skipped() {
            // Unreachable through the engine (the prefix came from a lookup under the
            // owner's tenant); the page check below would refuse it anyway.
            let page = shared.first().map_or(PageId(0), |entry| entry.0);
            return Err(Error::SharedPage {
                page,
                reason: "the prefix belongs to another tenant",
            });
        }
        self.verify_tables(&[&table], Access::Header)?;
        let own = self
            .layout
            .pages_for_tokens(token_count)
            .saturating_sub(shared.len());
        let free = self.pages_free();
        if own > free {
            return Err(Error::OutOfPages { needed: own, free });
        }
        for &(page, _) in shared {
            self.refs[page.index()] += 1;
        }
        let mut own_pages = PageTable {
            owner,
            pages: Vec::new(),
            shared: 0,
            frozen: 0,
        };
        self.extend(&mut own_pages, own * self.layout.page_size_tokens)
            .expect("enough free pages, checked above");
        table.pages.extend(own_pages.pages);
        Ok(table)
    }

    /// Publishes the table's own pages up to entry `page_count` as shared pages of its tenant:
    /// each must be full and no longer written (`Writing` or `Sealed`, every slot written). A
    /// page gets a new generation as it changes hands (the table is updated, so it keeps
    /// reading it) and one reference, the table's. All or nothing.
    ///
    /// Returns the table's leading `page_count` entries, for the prefix index.
    pub fn share(
        &mut self,
        table: &mut PageTable,
        page_count: usize,
    ) -> Result<Vec<(PageId, Generation)>> {
        self.verify_tables(&[table], Access::Header)?;
        let page_count = page_count.min(table.pages.len());
        let page_size = self.layout.page_size_tokens;
        for &(page, _) in &table.pages[table.shared.min(page_count)..page_count] {
            let header = &self.headers[page.index()];
            if !matches!(header.state, PageState::Writing | PageState::Sealed) {
                return Err(Error::SharedPage {
                    page,
                    reason: "only a written page can be shared, not one in a transfer",
                });
            }
            if self.written_tokens[page.index()] != page_size {
                return Err(Error::SharedPage {
                    page,
                    reason: "only a full page can be shared",
                });
            }
        }
        let tenant = table.owner.tenant;
        for entry in &mut table.pages[table.shared.min(page_count)..page_count] {
            let index = entry.0.index();
            let header = &mut self.headers[index];
            let next = header.generation.0.checked_add(1);
            header.generation = Generation(next.expect("2^64 generations of one page"));
            header.holder = Some(Holder::Tenant(tenant));
            header.state = PageState::Shared;
            self.refs[index] = 1;
            entry.1 = header.generation;
        }
        table.shared = table.shared.max(page_count);
        Ok(table.pages[..page_count].to_vec())
    }

    /// Frees a shared page that no table references (the prefix index's eviction). A page
    /// still referenced, not shared, or at another generation is refused and kept.
    pub fn evict(&mut self, page: PageId, generation: Generation) -> Result<()> {
        let header = self
            .headers
            .get(page.index())
            .ok_or(Error::UnknownPage { page })?;
        if header.generation != generation {
            return Err(Error::StaleGeneration {
                page,
                expected: generation,
                found: header.generation,
            });
        }
        if header.state != PageState::Shared {
            return Err(Error::SharedPage {
                page,
                reason: "not a shared page",
            });
        }
        if self.refs[page.index()] != 0 {
            return Err(Error::SharedPage {
                page,
                reason: "still referenced by a request",
            });
        }
        self.free_page(page);
        Ok(())
    }

    /// Tables referencing `page` (0 unless it is shared).
    pub fn shared_refs(&self, page: PageId) -> u32 {
        self.refs.get(page.index()).copied().unwrap_or(0)
    }

    /// Whether `(page, generation)` is a shared page of `tenant` right now.
    pub fn is_shared_by(
        &self,
        page: PageId,
        generation: Generation,
        tenant: crate::TenantId,
    ) -> bool {
        self.header(page).is_some_and(|header| {
            header.generation == generation
                && header.state == PageState::Shared
                && header.holder == Some(Holder::Tenant(tenant))
        })
    }

    /// Shared pages that no table references: cached only, and free for the asking.
    pub fn pages_reclaimable(&self) -> usize {
        self.headers
            .iter()
            .zip(&self.refs)
            .filter(|(header, &refs)| header.state == PageState::Shared && refs == 0)
            .count()
    }
}
