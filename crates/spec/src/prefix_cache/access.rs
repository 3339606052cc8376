//! How a request gets at a worker's pages, on either side: admission (`CacheLookup`, hold the
//! hits, allocate the rest) and the checked read of a forward pass, where S1 is judged.

use super::worker::Held;
use super::{event, Content, Entry, PrefixSpec, PrefixState, Side};
use crate::pages::Access;
use crate::Mutant;

impl PrefixSpec {
    /// The pages a request would reuse on `side` now, and how many it must allocate.
    pub(super) fn lookup(&self, state: &PrefixState, side: Side, request: u8) -> (Vec<Entry>, u8) {
        let spec = self.spec(request);
        let hits = state.worker(side).lookup(
            spec.tenant,
            spec.prompt,
            self.full_pages(request),
            self.has(Mutant::CacheKeyWithoutTenant),
        );
        let needed = spec.pages - hits.len() as u8;
        (hits, needed)
    }

    /// `CacheLookup` on one worker, at admission: hold the hits, allocate the rest.
    pub(super) fn admit(&self, state: &mut PrefixState, side: Side, request: u8) -> Held {
        let (hits, needed) = self.lookup(state, side, request);
        let tenant = self.spec(request).tenant;
        if hits.iter().any(|e| e.key.tenant != tenant) {
            state.ghost.lookup_foreign = true;
        }
        let passed_over = state.worker(side).cache.iter().any(|e| {
            e.key.tenant != tenant && e.key.prompt == self.spec(request).prompt && e.key.index == 0
        });
        if passed_over && hits.is_empty() {
            state.events |= event::OTHER_TENANT_PASSED_OVER;
        }
        let worker = state.worker_mut(side);
        let shared = worker.hold(&hits);
        let shared_by_two = worker.cache.iter().any(|e| e.refcount >= 2);
        let Ok(private) = worker.pool.allocate(request, needed as usize, true) else {
            unreachable!("admission is enabled only when the pages are free");
        };
        if shared_by_two {
            state.events |= event::SHARED_BY_TWO;
        }
        Held { shared, private }
    }

    /// A forward pass reads the first `slots` pages of a table (prefill: the reused prefix;
    /// decode: all of them) after the page check. Judges S1 for each page it reads. Returns
    /// false when the page check refused the read.
    pub(super) fn read(
        &self,
        state: &mut PrefixState,
        side: Side,
        request: u8,
        held: &Held,
        slots: usize,
    ) -> bool {
        let worker = state.worker(side);
        if !worker.verify(request, held, Access::Bytes) {
            // The engine's own table fails its check: a held page was taken from under it.
            state.ghost.engine_panic = true;
            return false;
        }
        let tenant = self.spec(request).tenant;
        let mut foreign_page = false;
        let mut foreign_kv = false;
        let mut corrupt = false;
        for slot in 0..slots {
            let page = held.page(slot);
            if let Some(shared) = held.shared.get(slot) {
                let in_namespace = worker
                    .entry(shared.page, shared.generation)
                    .is_some_and(|e| e.key.tenant == tenant);
                foreign_page |= !in_namespace;
            }
            match worker.content[page as usize] {
                Content::Empty | Content::Junk => corrupt = true,
                kv => foreign_kv |= kv != self.own_kv(request, slot as u8),
            }
        }
        state.ghost.read_foreign_page |= foreign_page;
        state.ghost.read_foreign_kv |= foreign_kv;
        state.ghost.read_corrupt |= corrupt;
        !(foreign_page || foreign_kv || corrupt)
    }
}
