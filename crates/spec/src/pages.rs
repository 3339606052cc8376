//! The page rules of `kv::PagePool`, copied small enough to live inside a model state.
//!
//! `kv::PagePool` owns real KV storage and is neither `Clone` nor `Hash`, so the checker cannot
//! keep one per state. This is a line-by-line copy of its header logic (allocation from a LIFO
//! free list with a generation bump, the owner/generation/state check in table order and the
//! duplicate check after it, verified release) without the bytes; the state-transition table is
//! not copied but `kv::PageState::may_become` itself.
//! Owners are request numbers and generations are `u8`; everything else is the same, down to
//! which page an allocation takes and which error a bad table gets.
//!
//! `tests/pages.rs` runs random operation sequences against this copy and the real
//! `kv::PagePool` side by side and asserts identical outcomes, free counts and headers, so the
//! copy cannot drift from the code it stands for without a test failing.

use kv::PageState;

/// A page's header: `kv::PageHeader` with the owner reduced to a request number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    pub owner: Option<u8>,
    pub generation: u8,
    pub state: PageState,
}

/// A request's pages as it recorded them, (page, generation at allocation): `kv::PageTable`
/// without the owner, which callers pass beside it.
pub type Table = Vec<(u8, u8)>;

/// What state a checked page must be in (`kv`'s private `Access`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `verify_batch`: its bytes are about to be read or written, `Writing` or `Sealed` only.
    Bytes,
    /// `release`, `set_state`: only the header changes; any state the owner holds.
    Header,
    /// `verify_receiving`: a transfer lands in it, `Receiving` only.
    Receive,
}

/// `kv::Error`, for the variants the page rules can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolError {
    OutOfPages { needed: usize, free: usize },
    UnknownPage { page: u8 },
    StaleGeneration { page: u8 },
    OwnerMismatch { page: u8 },
    PageNotReadable { page: u8 },
    DuplicatePage { page: u8 },
    InvalidTransition { page: u8 },
}

/// Headers and the free list of one pool.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pool {
    headers: Vec<Header>,
    /// LIFO, as in `kv`: the most recently freed page is reused first.
    free: Vec<u8>,
}

impl Pool {
    /// A fresh pool: every page free at generation 0, page 0 handed out first.
    pub fn new(pages: u8) -> Pool {
        let header = Header {
            owner: None,
            generation: 0,
            state: PageState::Free,
        };
        Pool {
            headers: vec![header; pages as usize],
            free: (0..pages).rev().collect(),
        }
    }

    pub fn headers(&self) -> &[Header] {
        &self.headers
    }

    pub fn header(&self, page: u8) -> Header {
        self.headers[page as usize]
    }

    pub fn pages_free(&self) -> usize {
        self.free.len()
    }

    /// `PagePool::allocate` for `pages` pages (the model's pages hold one token): all or
    /// nothing, each page's generation bumped (unless `bump` is false: the
    /// `NoGenerationBump` mutant), state `Writing`.
    pub fn allocate(&mut self, owner: u8, pages: usize, bump: bool) -> Result<Table, PoolError> {
        if pages > self.free.len() {
            return Err(PoolError::OutOfPages {
                needed: pages,
                free: self.free.len(),
            });
        }
        let mut table = Vec::with_capacity(pages);
        for _ in 0..pages {
            let page = self.free.pop().expect("pages <= free, checked above");
            let header = &mut self.headers[page as usize];
            assert!(header.state == PageState::Free && header.owner.is_none());
            if bump {
                header.generation = header
                    .generation
                    .checked_add(1)
                    .expect("the model's bounds keep generations small");
            }
            header.owner = Some(owner);
            header.state = PageState::Writing;
            table.push((page, header.generation));
        }
        Ok(table)
    }

    /// `PagePool::release`: verify (`Header` access), then free every page, pushed in reverse
    /// so the next allocation takes them back in table order. A table that does not verify
    /// frees nothing.
    pub fn release(&mut self, owner: u8, table: &Table) -> Result<(), PoolError> {
        self.verify(&[(owner, table)], Access::Header, false)?;
        for &(page, _) in table.iter().rev() {
            let header = &mut self.headers[page as usize];
            assert!(
                header.state != PageState::Free,
                "verified page is already free"
            );
            header.owner = None;
            header.state = PageState::Free;
            self.free.push(page);
        }
        Ok(())
    }

    /// `PagePool::set_state`: verify, check every transition, then move them all.
    pub fn set_state(
        &mut self,
        owner: u8,
        table: &Table,
        state: PageState,
    ) -> Result<(), PoolError> {
        self.verify(&[(owner, table)], Access::Header, false)?;
        for &(page, _) in table {
            if !self.headers[page as usize].state.may_become(state) {
                return Err(PoolError::InvalidTransition { page });
            }
        }
        for &(page, _) in table {
            self.headers[page as usize].state = state;
        }
        Ok(())
    }

    /// `PagePool::verify_tables` (behind `verify_batch`, `verify_receiving`, `release`,
    /// `set_state`): every page of every table in order (unknown page, generation, owner,
    /// state), then no page twice across the batch. `unguarded` is kv's benchmark-only
    /// `unguarded-owner-check` feature (the `NoOwnerCheck` mutant): byte and receive access
    /// skip the generation and owner compares; header access keeps them.
    pub fn verify(
        &self,
        tables: &[(u8, &Table)],
        access: Access,
        unguarded: bool,
    ) -> Result<(), PoolError> {
        let mut claims = Vec::new();
        for &(owner, table) in tables {
            for &(page, generation) in table.iter() {
                let header = self
                    .headers
                    .get(page as usize)
                    .ok_or(PoolError::UnknownPage { page })?;
                let skip = unguarded && access != Access::Header;
                if !skip && header.generation != generation {
                    return Err(PoolError::StaleGeneration { page });
                }
                if !skip && header.owner != Some(owner) {
                    return Err(PoolError::OwnerMismatch { page });
                }
                let allowed = match access {
                    Access::Bytes => {
                        matches!(header.state, PageState::Writing | PageState::Sealed)
                    }
                    Access::Receive => header.state == PageState::Receiving,
                    Access::Header => true,
                };
                if !allowed {
                    return Err(PoolError::PageNotReadable { page });
                }
                claims.push(page);
            }
        }
        claims.sort_unstable();
        if let Some(pair) = claims.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(PoolError::DuplicatePage { page: pair[0] });
        }
        Ok(())
    }

    /// `PagePool::check_invariants`, as a predicate: the free list names each page at most
    /// once, a page is `Free` iff it is on the free list iff it has no owner, and an owned page
    /// has been allocated at least once.
    pub fn consistent(&self) -> bool {
        let mut on_free_list = vec![false; self.headers.len()];
        for &page in &self.free {
            match on_free_list.get_mut(page as usize) {
                Some(seen) if !*seen => *seen = true,
                _ => return false,
            }
        }
        self.headers.iter().zip(on_free_list).all(|(header, free)| {
            let is_free = header.state == PageState::Free;
            is_free == free
                && is_free == header.owner.is_none()
                && (is_free || header.generation > 0)
        })
    }
}
