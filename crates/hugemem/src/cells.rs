//! Pages of one buffer that several threads may borrow at once, each page checked at run time
//! like a `RefCell`, atomically: any number of readers or one writer per page.
//!
//! Why: the KV pool lends pages to the transport's writer task, which sends them straight
//! from pool memory while the engine thread goes on computing, on other pages of the same
//! buffer and, reading only, on the very same pages. Slices split off one `&mut [T]` cannot
//! cross threads that way, and a page must not be reused while a socket still reads it: an
//! owned borrow ([`OwnedPageRef`]) keeps the buffer alive and the page marked as read, and
//! [`PageCells::is_borrowed`] is how the pool knows to wait before handing the page out.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A page's borrow count: readers, or `WRITER` for its one writer.
const WRITER: usize = usize::MAX;

/// `page_count` pages of `page_len` elements each, in one zeroed allocation (advised for huge
/// pages when large, as [`crate::HugeBuffer`]).
pub struct PageCells<T> {
    memory: Memory<T>,
    page_len: usize,
    borrows: Box<[AtomicUsize]>,
}

// SAFETY: every access to a page's elements goes through a guard whose acquisition follows
// the page's borrow count (readers XOR one writer, Acquire on take, Release on drop), so two
// threads never hold a `&mut` and any other reference to the same page at once; `T: Send +
// Sync` lets the elements themselves be shared and moved between threads.
unsafe impl<T: Send + Sync> Sync for PageCells<T> {}
// SAFETY: `PageCells` owns its memory like a `Box<[T]>` does.
unsafe impl<T: Send> Send for PageCells<T> {}

impl<T: bytemuck::Zeroable> PageCells<T> {
    /// Panics if the total overflows `isize::MAX` bytes, as `Vec` does.
    pub fn zeroed(page_count: usize, page_len: usize) -> PageCells<T> {
        let len = page_count
            .checked_mul(page_len)
            .expect("PageCells length overflows usize");
        PageCells {
            memory: Memory::zeroed(len),
            page_len,
            borrows: (0..page_count).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// [`PageCells::zeroed`] in a sealed memfd that another process may map
    /// ([`PageCells::shared_fd`]): the pool of a decode worker that takes one-sided writes.
    #[cfg(target_os = "linux")]
    pub fn zeroed_shared(page_count: usize, page_len: usize) -> std::io::Result<PageCells<T>> {
        let bytes = page_count
            .checked_mul(page_len)
            .and_then(|len| len.checked_mul(size_of::<T>()))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or_else(|| std::io::Error::other("PageCells length overflows isize::MAX bytes"))?;
        let memory = crate::shared::SharedMemory::create(c"airlock-kv-pool", bytes.max(1))?;
        const {
            assert!(
                align_of::<T>() <= 4096,
                "a mapping starts on a system page boundary"
            )
        };
        Ok(PageCells {
            memory: Memory {
                ptr: memory.as_ptr().cast::<T>(),
                backing: MemoryBacking::Shared { memory },
            },
            page_len,
            borrows: (0..page_count).map(|_| AtomicUsize::new(0)).collect(),
        })
    }
}

impl<T> PageCells<T> {
    pub fn page_count(&self) -> usize {
        self.borrows.len()
    }

    pub fn page_len(&self) -> usize {
        self.page_len
    }

    /// The memfd behind cells made by [`PageCells::zeroed_shared`], to pass to a peer.
    #[cfg(target_os = "linux")]
    pub fn shared_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.memory.backing {
            MemoryBacking::Shared { memory } => Some(memory.fd()),
            _ => None,
        }
    }

    /// Whether any guard of `page` is alive (a reader, a writer, or a lent page).
    pub fn is_borrowed(&self, page: usize) -> bool {
        self.borrows[page].load(Ordering::Acquire) != 0
    }

    /// Shared access to `page`, or `None` while it has a writer. Panics past the last page.
    pub fn read(&self, page: usize) -> Option<PageRef<'_, T>> {
        self.acquire_read(page)
            .then(|| PageRef { cells: self, page })
    }

    /// Exclusive access to `page`, or `None` while it has any other guard.
    pub fn write(&self, page: usize) -> Option<PageMut<'_, T>> {
        self.acquire_write(page)
            .then(|| PageMut { cells: self, page })
    }

    /// [`PageCells::read`] that owns a reference to the cells: it may move to another thread
    /// and outlive every other handle to the buffer.
    pub fn read_owned(self: &Arc<Self>, page: usize) -> Option<OwnedPageRef<T>> {
        self.acquire_read(page).then(|| OwnedPageRef {
            cells: self.clone(),
            page,
        })
    }

    /// [`PageCells::write`] that owns a reference to the cells (see [`PageCells::read_owned`]).
    pub fn write_owned(self: &Arc<Self>, page: usize) -> Option<OwnedPageMut<T>> {
        self.acquire_write(page).then(|| OwnedPageMut {
            cells: self.clone(),
            page,
        })
    }

    // `then`, never `then_some`, below and above: a guard built for a borrow that was refused
    // would release, on drop, a borrow it never took.

    fn acquire_read(&self, page: usize) -> bool {
        let count = &self.borrows[page];
        let mut seen = count.load(Ordering::Relaxed);
        loop {
            if seen >= WRITER - 1 {
                // A writer, or as many readers as the count holds.
                return false;
            }
            match count.compare_exchange_weak(seen, seen + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => seen = now,
            }
        }
    }

    fn acquire_write(&self, page: usize) -> bool {
        self.borrows[page]
            .compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn release_read(&self, page: usize) {
        self.borrows[page].fetch_sub(1, Ordering::Release);
    }

    fn release_write(&self, page: usize) {
        self.borrows[page].store(0, Ordering::Release);
    }

    /// Start of `page`. Panics past the last page.
    fn page_ptr(&self, page: usize) -> *mut T {
        assert!(page < self.page_count(), "page {page} out of range");
        // SAFETY: `page < page_count`, so the offset stays inside the allocation of
        // `page_count * page_len` elements.
        unsafe { self.memory.ptr.as_ptr().add(page * self.page_len) }
    }

    /// # Safety
    /// The caller holds a read or write guard of `page`.
    unsafe fn slice(&self, page: usize) -> &[T] {
        // SAFETY: the page's `page_len` elements lie inside the allocation, aligned and
        // initialised (zeroed at creation, `T: Zeroable`); a read or write guard is held, so
        // no `&mut` to them exists elsewhere.
        unsafe { std::slice::from_raw_parts(self.page_ptr(page), self.page_len) }
    }

    /// # Safety
    /// The caller holds the write guard of `page`, exclusively borrowed.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, page: usize) -> &mut [T] {
        // SAFETY: as in `slice`; the write guard excludes every other reference to the page,
        // and the caller's `&mut` to that guard makes this one the only one it gives out.
        unsafe { std::slice::from_raw_parts_mut(self.page_ptr(page), self.page_len) }
    }
}

/// A read guard of one page.
pub struct PageRef<'c, T> {
    cells: &'c PageCells<T>,
    page: usize,
}

impl<T> Deref for PageRef<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: this guard holds a read borrow of the page until it drops.
        unsafe { self.cells.slice(self.page) }
    }
}

impl<T> Drop for PageRef<'_, T> {
    fn drop(&mut self) {
        self.cells.release_read(self.page);
    }
}

/// The write guard of one page.
pub struct PageMut<'c, T> {
    cells: &'c PageCells<T>,
    page: usize,
}

impl<T> Deref for PageMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: this guard holds the page's write borrow until it drops.
        unsafe { self.cells.slice(self.page) }
    }
}

impl<T> DerefMut for PageMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: the write borrow is this guard's, and `&mut self` makes the slice unique.
        unsafe { self.cells.slice_mut(self.page) }
    }
}

impl<T> Drop for PageMut<'_, T> {
    fn drop(&mut self) {
        self.cells.release_write(self.page);
    }
}

/// A read guard that owns a handle to its cells (see [`PageCells::read_owned`]).
pub struct OwnedPageRef<T> {
    cells: Arc<PageCells<T>>,
    page: usize,
}

impl<T> OwnedPageRef<T> {
    pub fn page(&self) -> usize {
        self.page
    }
}

impl<T> Clone for OwnedPageRef<T> {
    /// Another reader of the same page: never refused, since this one keeps writers out.
    fn clone(&self) -> Self {
        assert!(
            self.cells.acquire_read(self.page),
            "a read-borrowed page has no writer"
        );
        OwnedPageRef {
            cells: self.cells.clone(),
            page: self.page,
        }
    }
}

impl<T> Deref for OwnedPageRef<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: this guard holds a read borrow of the page until it drops.
        unsafe { self.cells.slice(self.page) }
    }
}

impl<T> Drop for OwnedPageRef<T> {
    fn drop(&mut self) {
        self.cells.release_read(self.page);
    }
}

/// The write guard of one page, owning a handle to its cells (see [`PageCells::write_owned`]):
/// a socket reader on another thread writes a received page through it.
pub struct OwnedPageMut<T> {
    cells: Arc<PageCells<T>>,
    page: usize,
}

impl<T> OwnedPageMut<T> {
    pub fn page(&self) -> usize {
        self.page
    }
}

impl<T> Deref for OwnedPageMut<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: this guard holds the page's write borrow until it drops.
        unsafe { self.cells.slice(self.page) }
    }
}

impl<T> DerefMut for OwnedPageMut<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: the write borrow is this guard's, and `&mut self` makes the slice unique.
        unsafe { self.cells.slice_mut(self.page) }
    }
}

impl<T> Drop for OwnedPageMut<T> {
    fn drop(&mut self) {
        self.cells.release_write(self.page);
    }
}

impl<T> std::fmt::Debug for OwnedPageMut<T> {
    /// The page number only: the contents may be tenant data.
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("OwnedPageMut")
            .field("page", &self.page)
            .finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for OwnedPageRef<T> {
    /// The page number only: the contents may be tenant data.
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("OwnedPageRef")
            .field("page", &self.page)
            .finish_non_exhaustive()
    }
}

/// The allocation behind the cells, held by pointer only: no `&mut [T]` or `Box<[T]>` over
/// the whole of it ever exists, so guards on different threads never alias one.
struct Memory<T> {
    ptr: NonNull<T>,
    backing: MemoryBacking<T>,
}

enum MemoryBacking<T> {
    #[cfg(target_os = "linux")]
    /// Held for its `Drop`, which unmaps.
    Mapped {
        _mapping: crate::mapped::Mapping<T>,
    },
    /// A memfd another process may map too (held for its `Drop`, which unmaps).
    #[cfg(target_os = "linux")]
    Shared {
        memory: crate::shared::SharedMemory,
    },
    Heap {
        layout: std::alloc::Layout,
    },
    Empty,
}

impl<T: bytemuck::Zeroable> Memory<T> {
    fn zeroed(len: usize) -> Memory<T> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .expect("PageCells length overflows isize::MAX bytes");
        if bytes == 0 {
            return Memory {
                ptr: NonNull::dangling(),
                backing: MemoryBacking::Empty,
            };
        }
        #[cfg(target_os = "linux")]
        if bytes >= crate::HUGE_PAGE_BYTES {
            if let Some(mapping) = crate::mapped::Mapping::new(len) {
                return Memory {
                    ptr: mapping.as_non_null(),
                    backing: MemoryBacking::Mapped { _mapping: mapping },
                };
            }
        }
        let layout = std::alloc::Layout::array::<T>(len).expect("checked against isize above");
        // SAFETY: `layout` has a non-zero size (bytes > 0 above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            NonNull::new(raw.cast::<T>()).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Memory {
            ptr,
            backing: MemoryBacking::Heap { layout },
        }
    }
}

impl<T> Drop for Memory<T> {
    fn drop(&mut self) {
        match &self.backing {
            #[cfg(target_os = "linux")]
            MemoryBacking::Mapped { .. } => {} // unmapped by the mapping's own drop
            #[cfg(target_os = "linux")]
            MemoryBacking::Shared { .. } => {} // likewise
            // SAFETY: allocated above with this very layout; no guard outlives the cells
            // (each holds `&PageCells` or an `Arc` of it). The elements are plain data
            // (`Zeroable`), with nothing to drop.
            MemoryBacking::Heap { layout } => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr().cast(), *layout)
            },
            MemoryBacking::Empty => {}
        }
    }
}
