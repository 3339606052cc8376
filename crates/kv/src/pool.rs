//! The pool itself: headers, page storage, the free list, and the one checked road to KV bytes.

use std::fmt;
use std::sync::Arc;

use half::f16;
use hugemem::{OwnedPageMut, OwnedPageRef, PageCells, PageMut, PageRef};

use crate::{
    Error, Generation, Holder, KvKind, KvLayout, Owner, PageHeader, PageId, PageState, PoolConfig,
    PoolSize, Result, SCRUB_FILL,
};

/// A request's pages, as it recorded them: (page, generation at allocation). NOT proof of
/// anything: every use goes back to the headers through the pool.
///
/// The first `shared` entries are prefix-cache pages of the owner's tenant (read-only, held
/// by reference); the rest are the request's own. The first `frozen` entries (at least the
/// shared ones) are final: views give them read-only, so they may be lent to a transport
/// while later pages are still written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTable {
    pub(crate) owner: Owner,
    pub(crate) pages: Vec<(PageId, Generation)>,
    pub(crate) shared: usize,
    pub(crate) frozen: usize,
}

/// A fixed set of preallocated, owner-tagged KV pages.
pub struct PagePool {
    pub(crate) layout: KvLayout,
    scrub_on_free: bool,
    /// One header per page, indexed by `PageId`.
    pub(crate) headers: Vec<PageHeader>,
    /// Every page's KV bytes (`layout.page_elems()` each), in one buffer: one allocation
    /// however many pages, advised for huge pages (attention's scattered reads measured the
    /// same on them, BENCHMARKS.md). Each page is borrowed through a run-time checked guard,
    /// so a page lent to a transport (read by a socket writer on another thread) can never be
    /// written or reused meanwhile.
    storage: Arc<PageCells<f16>>,
    /// Released pages a transport still reads: free, but handed out again only once the last
    /// lent guard is gone ([`PagePool::reclaim_returned`]).
    returning: Vec<PageId>,
    /// Per page: slots `0..written_tokens` hold K/V written since the page's last allocation;
    /// the rest still hold whatever an earlier owner left (pages are not zeroed), so nothing
    /// may read them. Reset at every allocation.
    pub(crate) written_tokens: Vec<usize>,
    /// Per page: how many tables reference it while it is `Shared` (0 otherwise). A shared
    /// page with no reference is only cached, and the one kind eviction may free.
    pub(crate) refs: Vec<u32>,
    /// LIFO: the most recently freed page is reused first, which makes a stale read show up
    /// at once in tests instead of hiding behind untouched pages.
    free: Vec<PageId>,
    /// Test builds only: the owner/generation compare on reads is switched off at run time,
    /// to show what the guard stops.
    #[cfg(feature = "fault-injection")]
    owner_check_off: bool,
}

/// One verified page, borrowed.
enum Page<'p> {
    /// The request's own page: its KV bytes and its count of written token slots.
    Private {
        data: PageMut<'p, f16>,
        written_tokens: &'p mut usize,
    },
    /// A full page the request only reads: a prefix-cache page of its tenant (possibly in
    /// other views of the same batch), or one of its own pages it froze.
    ReadOnly { data: PageRef<'p, f16> },
}

/// One page's bytes lent to a transport: readable from any thread, and while it lives the
/// pool neither writes the page nor hands it to anyone else.
#[derive(Clone, Debug)]
pub struct LentPage(OwnedPageRef<f16>);

impl LentPage {
    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// One `Receiving` page lent to a transport to land a transfer's bytes in: writable from any
/// thread, and while it lives no view of the page exists (the receiver cannot checksum or read
/// it) and no allocation hands it out.
#[derive(Debug)]
pub struct LentPageMut(OwnedPageMut<f16>);

impl LentPageMut {
    /// The page's index in its pool (what a one-sided writer is granted).
    pub fn page(&self) -> u32 {
        self.0.page() as u32
    }

    /// The page's size in bytes.
    pub fn byte_len(&self) -> usize {
        std::mem::size_of_val::<[f16]>(&self.0)
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }

    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Proof that a table's pages were checked: `&'p mut` to exactly the table's pages, in table
/// order. Only [`PagePool::verify_batch`] makes one, and it borrows the pool for `'p`, so no
/// page in a view can be released or reallocated while the view lives.
pub struct PageView<'p> {
    owner: Owner,
    layout: KvLayout,
    /// Leading pages that are read-only (shared or frozen).
    read_only: usize,
    pages: Vec<Page<'p>>,
}

impl PageTable {
    pub fn owner(&self) -> Owner {
        self.owner
    }

    pub fn pages(&self) -> &[(PageId, Generation)] {
        &self.pages
    }

    /// How many leading pages are shared prefix-cache pages.
    pub fn shared_pages(&self) -> usize {
        self.shared
    }

    /// How many leading pages are read-only in views: shared, or frozen by the holder.
    pub fn read_only_pages(&self) -> usize {
        self.shared.max(self.frozen).min(self.pages.len())
    }

    /// Declares the first `pages` entries final: views give them read-only from now on (so
    /// they can be lent to a transport while the rest is written). Never shrinks.
    pub fn freeze(&mut self, pages: usize) {
        self.frozen = self.frozen.max(pages.min(self.pages.len()));
    }

    /// The request's own pages, past the shared prefix.
    pub fn private_pages(&self) -> &[(PageId, Generation)] {
        &self.pages[self.shared..]
    }

    /// Tokens the recorded pages can hold under `layout`.
    pub fn capacity_tokens(&self, layout: &KvLayout) -> usize {
        self.pages.len() * layout.page_size_tokens
    }

    /// A table that claims whatever pages it is given: for tests that attack the pool with
    /// tables it never issued.
    #[cfg(any(test, feature = "test-support"))]
    pub fn forge(owner: Owner, pages: Vec<(PageId, Generation)>) -> PageTable {
        PageTable {
            owner,
            pages,
            shared: 0,
            frozen: 0,
        }
    }

    /// A forged table whose first `shared` entries claim to be shared prefix-cache pages.
    #[cfg(any(test, feature = "test-support"))]
    pub fn forge_shared(
        owner: Owner,
        pages: Vec<(PageId, Generation)>,
        shared: usize,
    ) -> PageTable {
        assert!(shared <= pages.len(), "shared prefix within the table");
        PageTable {
            owner,
            pages,
            shared,
            frozen: 0,
        }
    }

    /// Whether entry `position` is a shared page.
    fn is_shared(&self, position: usize) -> bool {
        position < self.shared
    }
}

/// What state a checked page must be in.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Its bytes are about to be handed out: `Writing` or `Sealed` only.
    Bytes,
    /// Only its header changes (release, extend, state change): any state the owner holds.
    Header,
    /// A transfer is landing in it: `Receiving` only.
    Receive,
}

/// One page a batch claims, and where it goes back: table `table_index`, slot `position`.
pub(crate) struct Claim {
    page: PageId,
    table_index: usize,
    position: usize,
    shared: bool,
    /// Taken read-only in a view: shared, or frozen by its table.
    read_only: bool,
}

impl PagePool {
    /// Preallocates every page, zeroed (or filled with [`SCRUB_FILL`] when `scrub_on_free` is
    /// set). Pages are never cleared again unless `scrub_on_free` is set.
    pub fn new(config: PoolConfig) -> Result<PagePool> {
        PagePool::with_storage(config, |count, len| Ok(PageCells::zeroed(count, len)))
    }

    /// [`PagePool::new`] in memory that prefill workers on this host may map and write
    /// granted pages into ([`PagePool::shared_fd`]): a decode worker's pool for the one-sided
    /// transport.
    #[cfg(target_os = "linux")]
    pub fn new_shared(config: PoolConfig) -> Result<PagePool> {
        PagePool::with_storage(config, |count, len| {
            PageCells::zeroed_shared(count, len).map_err(|error| Error::SharedMemory {
                reason: error.to_string(),
            })
        })
    }

    /// The memfd behind a pool made by [`PagePool::new_shared`].
    #[cfg(target_os = "linux")]
    pub fn shared_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.storage.shared_fd()
    }

    fn with_storage(
        config: PoolConfig,
        storage: impl FnOnce(usize, usize) -> Result<PageCells<f16>>,
    ) -> Result<PagePool> {
        let layout = config.layout;
        let page_bytes = layout.checked_page_bytes().ok_or(Error::BadLayout {
            layout: config.layout,
        })?;
        let page_count = match config.size {
            PoolSize::Tokens(tokens) => tokens / layout.page_size_tokens,
            PoolSize::Bytes(bytes) => bytes / page_bytes,
        };
        if page_count == 0 {
            return Err(Error::PoolTooSmall {
                size: config.size,
                page_size_tokens: layout.page_size_tokens,
                page_bytes,
            });
        }
        let max = u32::MAX as usize;
        if page_count > max {
            return Err(Error::TooManyPages {
                size: config.size,
                page_count,
                max,
            });
        }
        let page_elems = layout.page_elems();
        let initial_fill = if config.scrub_on_free {
            SCRUB_FILL
        } else {
            f16::ZERO
        };
        let header = PageHeader {
            holder: None,
            generation: Generation(0),
            state: PageState::Free,
        };
        // f16 elements: bytes are twice the count, and must stay within isize.
        page_count
            .checked_mul(page_elems)
            .filter(|&elems| elems <= isize::MAX as usize / 2)
            .ok_or(Error::PoolTooLarge {
                size: config.size,
                page_count,
                page_bytes,
            })?;
        let storage = Arc::new(storage(page_count, page_elems)?);
        // Scrubbing pools start scrubbed, so a never-used page looks like a freed one (the
        // ghost value under `ghost-fill`): a zeroed pool hides stale reads.
        if initial_fill != f16::ZERO {
            for page in 0..page_count {
                let mut data = storage.write(page).expect("a new pool lends nothing");
                data.fill(initial_fill);
            }
        }
        Ok(PagePool {
            layout,
            scrub_on_free: config.scrub_on_free,
            headers: vec![header; page_count],
            storage,
            returning: Vec::new(),
            written_tokens: vec![0; page_count],
            refs: vec![0; page_count],
            // Reversed so that a fresh pool hands out page 0 first.
            free: (0..page_count as u32).rev().map(PageId).collect(),
            #[cfg(feature = "fault-injection")]
            owner_check_off: false,
        })
    }

    /// Test builds only (`fault-injection`): switch the owner/generation compare on reads
    /// off (or back on), to show that the guard is what stops a stale or foreign read.
    #[cfg(feature = "fault-injection")]
    pub fn set_owner_check_for_test(&mut self, on: bool) {
        self.owner_check_off = !on;
    }

    pub(crate) fn owner_check_skipped(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.owner_check_off {
            return true;
        }
        cfg!(feature = "unguarded-owner-check")
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn page_count(&self) -> usize {
        self.headers.len()
    }

    pub fn pages_free(&self) -> usize {
        self.free.len()
    }

    /// Pages currently in `state` (a scan: for metrics, not the hot path).
    pub fn pages_in_state(&self, state: PageState) -> usize {
        self.headers
            .iter()
            .filter(|header| header.state == state)
            .count()
    }

    pub fn capacity_tokens(&self) -> usize {
        self.page_count() * self.layout.page_size_tokens
    }

    /// Bytes of KV storage (headers not counted).
    pub fn bytes(&self) -> usize {
        self.page_count() * self.layout.page_bytes()
    }

    pub fn header(&self, page: PageId) -> Option<&PageHeader> {
        self.headers.get(page.index())
    }

    /// Allocate enough pages for `token_count` tokens to `owner`, all or nothing. Bumps each
    /// page's generation and puts it in `Writing`. Zero tokens gives an empty table.
    ///
    /// Short of pages, returns `Error::OutOfPages` and changes nothing.
    pub fn allocate(&mut self, owner: Owner, token_count: usize) -> Result<PageTable> {
        let needed = self.layout.pages_for_tokens(token_count);
        let mut table = PageTable {
            owner,
            pages: Vec::with_capacity(needed),
            shared: 0,
            frozen: 0,
        };
        self.take_free_pages(&mut table, needed)?;
        Ok(table)
    }

    /// Grow `table` to hold at least `token_count` tokens: verify it first, then all or
    /// nothing. A table that already holds that many tokens is left as it is.
    pub fn extend(&mut self, table: &mut PageTable, token_count: usize) -> Result<()> {
        self.verify_tables(&[table], Access::Header)?;
        let needed = self
            .layout
            .pages_for_tokens(token_count)
            .saturating_sub(table.pages.len());
        self.take_free_pages(table, needed)
    }

    /// Free the table's own pages after verifying that every page still belongs to it (owner
    /// and generation), scrubbing them if configured, and drop its references to shared
    /// pages (which stay cached until evicted). A table that does not verify frees nothing.
    ///
    /// Any state the owner holds can be released, `Quarantined` included: releasing is how
    /// the holder says the proof has arrived.
    pub fn release(&mut self, table: PageTable) -> Result<()> {
        self.verify_tables(&[&table], Access::Header)?;
        // A shared page still verifies after its table was released once (it is its
        // tenant's, not the request's): the count is what catches a second release.
        if let Some(&(page, _)) = table.pages[..table.shared]
            .iter()
            .find(|(page, _)| self.refs[page.index()] == 0)
        {
            return Err(Error::SharedPage {
                page,
                reason: "released more often than it was referenced",
            });
        }
        for &(page, _) in &table.pages[..table.shared] {
            self.refs[page.index()] -= 1;
        }
        // Pushed in reverse so the next allocation pops them back in the table's order.
        for &(page, _) in table.private_pages().iter().rev() {
            self.free_page(page);
        }
        Ok(())
    }

    /// Puts one held page back on the free list (scrubbing it if configured).
    pub(crate) fn free_page(&mut self, page: PageId) {
        let header = &mut self.headers[page.index()];
        assert!(
            header.state != PageState::Free,
            "verified page {page:?} is already free"
        );
        header.holder = None;
        header.state = PageState::Free;
        if self.storage.is_borrowed(page.index()) {
            // A transport still reads it: free, but not reusable until it lets go.
            self.returning.push(page);
            return;
        }
        self.put_on_free_list(page);
    }

    fn put_on_free_list(&mut self, page: PageId) {
        if self.scrub_on_free {
            let mut data = self
                .storage
                .write(page.index())
                .expect("only pages no guard holds reach the free list");
            data.fill(SCRUB_FILL);
        }
        self.free.push(page);
    }

    /// Puts released pages whose lent guards are all gone back on the free list; returns how
    /// many. Call before counting free pages; allocation calls it itself.
    pub fn reclaim_returned(&mut self) -> usize {
        let mut reclaimed = 0;
        let mut index = 0;
        while index < self.returning.len() {
            let page = self.returning[index];
            if self.storage.is_borrowed(page.index()) {
                index += 1;
                continue;
            }
            self.returning.swap_remove(index);
            self.put_on_free_list(page);
            reclaimed += 1;
        }
        reclaimed
    }

    /// Released pages still lent to a transport (not yet reusable).
    pub fn pages_returning(&self) -> usize {
        self.returning.len()
    }

    /// Lends pages `range` of a verified table in `Receiving` for writing: a transport lands
    /// received bytes straight in them. Until every [`LentPageMut`] is dropped the pages give
    /// no view (so nothing checksums or reads a page a write may still land in) and a release
    /// parks them.
    pub fn lend_for_receive(
        &self,
        table: &PageTable,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<LentPageMut>> {
        self.verify_tables(&[table], Access::Receive)?;
        table.pages[range]
            .iter()
            .map(|&(page, _)| {
                self.storage
                    .write_owned(page.index())
                    .map(LentPageMut)
                    .ok_or(Error::PageBusy { page })
            })
            .collect()
    }

    /// Lends pages `range` of a verified table (`Writing`, `Sealed` or shared pages only) to
    /// a transport: each [`LentPage`] reads the page from any thread until it drops, and
    /// meanwhile no view writes the page and no allocation hands it out (a release parks it
    /// until then). Freeze the pages first ([`PageTable::freeze`]) to go on taking views of
    /// the table while they are lent.
    pub fn lend(&self, table: &PageTable, range: std::ops::Range<usize>) -> Result<Vec<LentPage>> {
        self.verify_tables(&[table], Access::Bytes)?;
        table.pages[range]
            .iter()
            .map(|&(page, _)| {
                self.storage
                    .read_owned(page.index())
                    .map(LentPage)
                    .ok_or(Error::PageBusy { page })
            })
            .collect()
    }

    /// Move every page of a verified table to `state`, all or nothing.
    ///
    /// Allowed moves (each state may also be set again): Writing -> Sealed | Receiving |
    /// Quarantined; Sealed -> Writing (decode appends into a received page's spare slots) |
    /// Sending | Quarantined; Sending -> Sealed (transfer aborted, pages kept) | Quarantined;
    /// Receiving -> Sealed (transfer verified, I4) | Quarantined. Nothing leaves Quarantined
    /// but `release`, and nothing becomes Free but through `release`.
    ///
    /// Only the table's own pages change: its shared pages stay `Shared`.
    pub fn set_state(&mut self, table: &PageTable, state: PageState) -> Result<()> {
        self.verify_tables(&[table], Access::Header)?;
        for &(page, _) in table.private_pages() {
            let from = self.headers[page.index()].state;
            if !from.may_become(state) {
                return Err(Error::InvalidTransition {
                    page,
                    from,
                    to: state,
                });
            }
        }
        for &(page, _) in table.private_pages() {
            self.headers[page.index()].state = state;
        }
        Ok(())
    }

    /// The only way to touch KV bytes. Checks every page of every table (owner and generation
    /// match the header, state is `Writing` or `Sealed`, no page appears twice across the
    /// whole batch) and returns one view per table, in order. A table's shared entries must
    /// be `Shared` pages of its own tenant; they may appear in several tables, read-only.
    ///
    /// Cost: O(k log k) for the k pages of the batch (a sort that also finds duplicates), none
    /// of it proportional to the pool's size.
    pub fn verify_batch<'p>(&'p mut self, tables: &[&PageTable]) -> Result<Vec<PageView<'p>>> {
        self.views(tables, Access::Bytes)
    }

    /// The view a receiver writes a transfer's bytes through: the same owner and generation
    /// checks as [`PagePool::verify_batch`], but only for own pages in `Receiving`, so bytes
    /// from a transfer can never land in pages that are being read or sent. Shared entries
    /// (pages the receiver already holds from its cache) are in the view read-only.
    pub fn verify_receiving<'p>(&'p mut self, table: &PageTable) -> Result<PageView<'p>> {
        let mut views = self.views(&[table], Access::Receive)?;
        Ok(views.pop().expect("one view per table"))
    }

    fn views<'p>(&'p mut self, tables: &[&PageTable], access: Access) -> Result<Vec<PageView<'p>>> {
        let claims = self.verify_tables(tables, access)?;
        let layout = self.layout;
        let mut slots: Vec<Vec<Option<Page<'p>>>> = tables
            .iter()
            .map(|table| (0..table.pages.len()).map(|_| None).collect())
            .collect();
        // Claims are sorted and distinct, so each one lies beyond the previous: split the
        // written counts just past it and keep walking the tails (safe disjoint borrows, one
        // per page). The bytes come through the page's guard: a write guard for a page the
        // table may write, a read guard for one it only reads (which a transport may be
        // reading too); a page whose guard is taken (lent) refuses the batch.
        let storage: &'p PageCells<f16> = &self.storage;
        let mut rest_written: &'p mut [usize] = &mut self.written_tokens;
        let mut rest_first_index = 0;
        let mut last_read_only: Option<PageId> = None;
        for claim in claims {
            let page_index = claim.page.index();
            let page = if claim.read_only {
                let data = storage
                    .read(page_index)
                    .ok_or(Error::PageBusy { page: claim.page })?;
                if last_read_only != Some(claim.page) {
                    let skip = page_index - rest_first_index;
                    let (_, from_claim) = std::mem::take(&mut rest_written).split_at_mut(skip);
                    rest_written = &mut from_claim[1..];
                    rest_first_index = page_index + 1;
                }
                last_read_only = Some(claim.page);
                Page::ReadOnly { data }
            } else {
                let data = storage
                    .write(page_index)
                    .ok_or(Error::PageBusy { page: claim.page })?;
                let skip = page_index - rest_first_index;
                let (_, written_from_claim) = std::mem::take(&mut rest_written).split_at_mut(skip);
                let (written_tokens, written_after) = written_from_claim
                    .split_first_mut()
                    .expect("a verified page id is below page_count, so the tail is not empty");
                rest_written = written_after;
                rest_first_index = page_index + 1;
                Page::Private {
                    data,
                    written_tokens,
                }
            };
            slots[claim.table_index][claim.position] = Some(page);
        }
        let views = tables
            .iter()
            .zip(slots)
            .map(|(table, table_slots)| PageView {
                owner: table.owner,
                layout,
                read_only: table.read_only_pages(),
                pages: table_slots
                    .into_iter()
                    .map(|slot| slot.expect("every claim of every table was filled above"))
                    .collect(),
            })
            .collect();
        Ok(views)
    }

    /// Debug self-check that the free list and the headers agree; panics on the first
    /// violation. O(page_count): tests call it after every operation.
    pub fn check_invariants(&self) {
        let page_count = self.headers.len();
        assert_eq!(
            (self.storage.page_count(), self.storage.page_len()),
            (page_count, self.layout.page_elems()),
            "storage for every header's page"
        );
        assert_eq!(
            self.written_tokens.len(),
            page_count,
            "a written count per header"
        );
        for &written_tokens in &self.written_tokens {
            assert!(
                written_tokens <= self.layout.page_size_tokens,
                "written within the page"
            );
        }
        let mut on_free_list = vec![false; page_count];
        for page in self.free.iter().chain(&self.returning) {
            assert!(
                page.index() < page_count,
                "free list names {page:?}, out of range"
            );
            assert!(
                !on_free_list[page.index()],
                "{page:?} is on the free list twice"
            );
            on_free_list[page.index()] = true;
        }
        for (index, header) in self.headers.iter().enumerate() {
            let is_free = header.state == PageState::Free;
            assert_eq!(
                is_free, on_free_list[index],
                "page {index}: Free iff on free list"
            );
            assert_eq!(
                is_free,
                header.holder.is_none(),
                "page {index}: Free iff no holder"
            );
            let is_shared = header.state == PageState::Shared;
            assert_eq!(
                is_shared,
                matches!(header.holder, Some(Holder::Tenant(_))),
                "page {index}: Shared iff held by a tenant"
            );
            assert!(
                is_shared || self.refs[index] == 0,
                "page {index}: only shared pages are referenced"
            );
            assert!(
                !is_shared || self.written_tokens[index] == self.layout.page_size_tokens,
                "page {index}: shared pages are full"
            );
            if !is_free {
                assert!(
                    header.generation.0 > 0,
                    "page {index}: owned but never allocated"
                );
            }
        }
    }

    /// Pop `needed` free pages onto `table`, or change nothing and say how short we are.
    fn take_free_pages(&mut self, table: &mut PageTable, needed: usize) -> Result<()> {
        if needed > self.free.len() {
            self.reclaim_returned();
        }
        if needed > self.free.len() {
            return Err(Error::OutOfPages {
                needed,
                free: self.free.len(),
            });
        }
        table.pages.reserve(needed);
        for _ in 0..needed {
            let page = self
                .free
                .pop()
                .expect("needed <= free pages, checked above");
            let header = &mut self.headers[page.index()];
            assert!(
                header.state == PageState::Free,
                "{page:?} on free list is not Free"
            );
            assert!(
                header.holder.is_none(),
                "{page:?} on free list has a holder"
            );
            let next = header.generation.0.checked_add(1);
            header.generation = Generation(next.expect("2^64 allocations of one page"));
            header.holder = Some(Holder::Request(table.owner));
            header.state = PageState::Writing;
            self.written_tokens[page.index()] = 0;
            table.pages.push((page, header.generation));
        }
        Ok(())
    }

    /// Check every page of every table against its header, then that no page is claimed
    /// twice. Returns the claims sorted by page id. Errors name the first failing page in
    /// table order; duplicates are reported after all headers passed.
    ///
    /// A shared page may be claimed by several tables (each claim verified as shared); a
    /// request's own page only once.
    pub(crate) fn verify_tables(
        &self,
        tables: &[&PageTable],
        access: Access,
    ) -> Result<Vec<Claim>> {
        let claim_count = tables.iter().map(|table| table.pages.len()).sum();
        let mut claims = Vec::with_capacity(claim_count);
        for (table_index, table) in tables.iter().enumerate() {
            for (position, &(page, generation)) in table.pages.iter().enumerate() {
                let shared = table.is_shared(position);
                let holder = if shared {
                    Holder::Tenant(table.owner.tenant)
                } else {
                    Holder::Request(table.owner)
                };
                self.verify_page(page, holder, generation, access)?;
                claims.push(Claim {
                    page,
                    table_index,
                    position,
                    shared,
                    read_only: position < table.read_only_pages(),
                });
            }
        }
        claims.sort_unstable_by_key(|claim| claim.page);
        let twice = claims
            .windows(2)
            .find(|pair| pair[0].page == pair[1].page && !(pair[0].shared && pair[1].shared));
        if let Some(pair) = twice {
            return Err(Error::DuplicatePage { page: pair[0].page });
        }
        Ok(claims)
    }

    /// Generation first: a table kept past its release is the common bug, and its error
    /// should say "stale" rather than name whoever holds the page now.
    fn verify_page(
        &self,
        page: PageId,
        holder: Holder,
        generation: Generation,
        access: Access,
    ) -> Result<()> {
        let header = self
            .headers
            .get(page.index())
            .ok_or(Error::UnknownPage { page })?;
        // Benchmark builds only (`unguarded-owner-check`) and fault-injection test runs: the
        // per-step read checks go. Release and state changes keep theirs, except for shared
        // pages, whose tenant check goes everywhere (so a test can show a wrong prefix lookup
        // reaching another tenant's pages).
        let shared = matches!(holder, Holder::Tenant(_));
        let skip = self.owner_check_skipped() && (access != Access::Header || shared);
        if !skip && header.generation != generation {
            return Err(Error::StaleGeneration {
                page,
                expected: generation,
                found: header.generation,
            });
        }
        if !skip && header.holder != Some(holder) {
            return Err(Error::OwnerMismatch {
                page,
                expected: holder,
                found: header.holder,
            });
        }
        // A shared claim is only ever read, whatever the access: it never receives bytes.
        let allowed = match access {
            _ if shared => header.state == PageState::Shared,
            Access::Bytes => matches!(header.state, PageState::Writing | PageState::Sealed),
            Access::Receive => header.state == PageState::Receiving,
            Access::Header => header.state != PageState::Shared,
        };
        if !allowed {
            return Err(Error::PageNotReadable {
                page,
                state: header.state,
            });
        }
        Ok(())
    }
}

impl fmt::Debug for PagePool {
    /// Headers and sizes only: KV bytes are tenant data and have no place in logs.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("PagePool")
            .field("layout", &self.layout)
            .field("page_count", &self.page_count())
            .field("pages_free", &self.pages_free())
            .field("scrub_on_free", &self.scrub_on_free)
            .finish_non_exhaustive()
    }
}

impl<'p> PageView<'p> {
    pub fn owner(&self) -> Owner {
        self.owner
    }

    pub fn capacity_tokens(&self) -> usize {
        self.pages.len() * self.layout.page_size_tokens
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in this view.
    pub fn page_len(&self) -> usize {
        self.pages.len()
    }

    /// Tokens held by the leading shared (read-only) pages: positions a step may read but
    /// never write.
    pub fn shared_tokens(&self) -> usize {
        self.read_only * self.layout.page_size_tokens
    }

    /// The slots of one (layer, kind, kv_head) in page number `page_index` of this table
    /// (`page_size_tokens * head_dim` f16, slot-major).
    ///
    /// Panics when an index is out of range: that is a bug in the caller, not bad input.
    pub fn head(&self, page_index: usize, layer: usize, kind: KvKind, kv_head: usize) -> &[f16] {
        let start = self.layout.head_offset(layer, kind, kv_head);
        &self.page(page_index)[start..start + self.layout.head_elems()]
    }

    /// Mutable form of [`PageView::head`].
    ///
    /// Panics on a shared page: callers check first that a step writes past
    /// [`PageView::shared_tokens`] (the model's `checked_views` refuses the step otherwise).
    pub fn head_mut(
        &mut self,
        page_index: usize,
        layer: usize,
        kind: KvKind,
        kv_head: usize,
    ) -> &mut [f16] {
        let start = self.layout.head_offset(layer, kind, kv_head);
        let head_elems = self.layout.head_elems();
        &mut self.page_mut(page_index)[start..start + head_elems]
    }

    /// All of page number `page_index` of this table (`layout.page_elems()` f16), e.g. to
    /// checksum or send it whole.
    pub fn page(&self, page_index: usize) -> &[f16] {
        match &self.pages[page_index] {
            Page::Private { data, .. } => data,
            Page::ReadOnly { data } => data,
        }
    }

    /// Mutable form of [`PageView::page`]. Panics on a shared page, which is read-only.
    pub fn page_mut(&mut self, page_index: usize) -> &mut [f16] {
        match &mut self.pages[page_index] {
            Page::Private { data, .. } => data,
            Page::ReadOnly { .. } => {
                panic!("page {page_index} of this table is read-only (shared or frozen)")
            }
        }
    }

    /// Tokens written from the start of the table since its pages were allocated: positions
    /// at or past this still hold an earlier owner's bytes and must not be read. Shared pages
    /// are always full.
    pub fn written_tokens(&self) -> usize {
        let page_size = self.layout.page_size_tokens;
        let mut written = 0;
        for page in &self.pages {
            let page_written = match page {
                Page::Private { written_tokens, .. } => **written_tokens,
                Page::ReadOnly { .. } => page_size,
            };
            written += page_written;
            if page_written < page_size {
                break;
            }
        }
        written
    }

    /// Records that positions `0..tokens` now hold this owner's K/V. Panics past capacity.
    /// Shared pages are full already and are left as they are.
    pub fn mark_written(&mut self, tokens: usize) {
        assert!(
            tokens <= self.capacity_tokens(),
            "written tokens within the table"
        );
        let page_size = self.layout.page_size_tokens;
        for (i, page) in self.pages.iter_mut().enumerate() {
            if let Page::Private { written_tokens, .. } = page {
                **written_tokens = tokens.saturating_sub(i * page_size).min(page_size);
            }
        }
    }
}

impl fmt::Debug for PageView<'_> {
    /// Owner and size only: KV bytes are tenant data and have no place in logs.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("PageView")
            .field("owner", &self.owner)
            .field("page_len", &self.page_len())
            .finish_non_exhaustive()
    }
}

impl PageId {
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}
