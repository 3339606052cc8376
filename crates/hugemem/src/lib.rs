//! Zeroed buffers for the few big, long-lived arrays of a worker (the KV pool, the weights),
//! mapped straight from the kernel and advised to be backed by 2 MiB transparent huge pages.
//!
//! Why: with 4 KiB pages, streaming 92 MB of weights per decoded token costs a TLB miss every
//! 4 KiB. On the 2-core EPYC VMs we measure on, batch-1 decode ran 14–19 % faster with the
//! weights on huge pages (BENCHMARKS.md). Huge pages need an allocation that the kernel is
//! asked about before its first touch, which neither `Vec` nor glibc's heap does.
//!
//! What this crate is not: an allocator. A buffer has a fixed length, starts zeroed (so `T`
//! must accept all-zero bytes, [`bytemuck::Zeroable`]), and is freed when dropped. Where the
//! kernel has no transparent huge pages, or the mapping fails, the buffer is a plain zeroed
//! heap allocation: the advice is a speed hint, never a requirement.
//!
//! This crate holds the `unsafe` that lets `kv` forbid it: the mapping, the advice, and the
//! slice over the mapping; and, in [`shared`], the memory a decode worker's pool shares with
//! the prefill workers on its host (the one-sided transport).

use std::fmt;
use std::ops::{Deref, DerefMut};

mod cells;
pub use cells::{OwnedPageMut, OwnedPageRef, PageCells, PageMut, PageRef};
#[cfg(target_os = "linux")]
pub mod shared;

/// The huge-page size asked for (x86-64's PMD size).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A fixed-length, zero-initialised `[T]` whose memory is advised for huge pages (see the
/// crate docs). Derefs to `[T]`, like a `Box<[T]>`.
pub struct HugeBuffer<T> {
    backing: Backing<T>,
}

enum Backing<T> {
    #[cfg(target_os = "linux")]
    Mapped(mapped::Mapping<T>),
    Heap(Box<[T]>),
}

impl<T: bytemuck::Zeroable> HugeBuffer<T> {
    /// `len` zeroed elements. Buffers of at least [`HUGE_PAGE_BYTES`] start on a huge-page
    /// boundary and are advised for huge pages; smaller ones, and any the kernel will not
    /// map, live on the heap.
    ///
    /// Panics if `len` elements of `T` overflow `isize::MAX` bytes, as `Vec` does.
    pub fn zeroed(len: usize) -> HugeBuffer<T> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .expect("HugeBuffer length overflows isize::MAX bytes");
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE_BYTES {
            if let Some(mapping) = mapped::Mapping::new(len) {
                return HugeBuffer {
                    backing: Backing::Mapped(mapping),
                };
            }
        }
        let _ = bytes;
        HugeBuffer {
            backing: Backing::Heap(bytemuck::zeroed_slice_box(len)),
        }
    }

    /// Whether the memory is a mapping advised for huge pages (false: a plain heap buffer).
    /// Whether the kernel granted huge pages is its own decision, made at first touch.
    pub fn is_advised(&self) -> bool {
        match &self.backing {
            #[cfg(target_os = "linux")]
            Backing::Mapped(_) => true,
            Backing::Heap(_) => false,
        }
    }
}

impl<T> Deref for HugeBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.backing {
            #[cfg(target_os = "linux")]
            Backing::Mapped(mapping) => mapping.as_slice(),
            Backing::Heap(boxed) => boxed,
        }
    }
}

impl<T> DerefMut for HugeBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.backing {
            #[cfg(target_os = "linux")]
            Backing::Mapped(mapping) => mapping.as_mut_slice(),
            Backing::Heap(boxed) => boxed,
        }
    }
}

impl<T> fmt::Debug for HugeBuffer<T> {
    /// Length and backing only: the contents may be tenant data.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("HugeBuffer")
            .field("len", &self.len())
            .field(
                "backing",
                &match self.backing {
                    #[cfg(target_os = "linux")]
                    Backing::Mapped(_) => "mapped",
                    Backing::Heap(_) => "heap",
                },
            )
            .finish()
    }
}

#[cfg(target_os = "linux")]
pub(crate) mod mapped {
    use std::marker::PhantomData;
    use std::ptr::NonNull;

    use super::HUGE_PAGE_BYTES;

    /// An anonymous private mapping holding `len` `T`s from a huge-page boundary.
    pub(crate) struct Mapping<T> {
        /// Start of the whole mapping, as `mmap` returned it (what `munmap` takes).
        base: NonNull<libc::c_void>,
        mapped_bytes: usize,
        /// First element: `base` rounded up to a huge-page boundary.
        elements: NonNull<T>,
        len: usize,
        /// Owns `T`s, as `Box<[T]>` does (for drop check and auto traits' intent).
        _owns: PhantomData<T>,
    }

    // SAFETY: a `Mapping` is the only owner of its memory, like a `Box<[T]>`: sending it
    // sends the `T`s, sharing `&Mapping` only shares `&[T]`.
    unsafe impl<T: Send> Send for Mapping<T> {}
    // SAFETY: as above; `&Mapping` gives out only `&[T]`.
    unsafe impl<T: Sync> Sync for Mapping<T> {}

    impl<T: bytemuck::Zeroable> Mapping<T> {
        /// `None` when the kernel refuses the mapping (the caller falls back to the heap).
        pub(crate) fn new(len: usize) -> Option<Mapping<T>> {
            const {
                assert!(
                    align_of::<T>() <= HUGE_PAGE_BYTES,
                    "elements are placed at a huge-page boundary"
                )
            };
            // The caller checked that this fits in isize.
            let bytes = len * size_of::<T>();
            let advised_bytes = bytes.checked_next_multiple_of(HUGE_PAGE_BYTES)?;
            // One extra huge page of address space so a boundary lies inside the mapping.
            let mapped_bytes = advised_bytes.checked_add(HUGE_PAGE_BYTES)?;
            // SAFETY: an anonymous private mapping at an address of the kernel's choosing
            // touches no existing memory; the result is checked before use.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    mapped_bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw == libc::MAP_FAILED {
                return None;
            }
            let base = NonNull::new(raw)?;
            let offset = (raw as usize).next_multiple_of(HUGE_PAGE_BYTES) - raw as usize;
            // SAFETY: `offset < HUGE_PAGE_BYTES`, so the start stays inside the mapping,
            // and `offset + advised_bytes <= mapped_bytes`.
            let start = unsafe { raw.cast::<u8>().add(offset) };
            // SAFETY: the range lies inside the mapping made above, which nothing else
            // uses. Advice only: where THP is off or unsupported it fails and the memory
            // stays on 4 KiB pages, which is still correct.
            unsafe { libc::madvise(start.cast(), advised_bytes, libc::MADV_HUGEPAGE) };
            Some(Mapping {
                base,
                mapped_bytes,
                elements: NonNull::new(start.cast::<T>()).expect("inside a non-null mapping"),
                len,
                _owns: PhantomData,
            })
        }
    }

    impl<T> Mapping<T> {
        /// The first element, for owners that hand out their own per-page slices.
        pub(crate) fn as_non_null(&self) -> NonNull<T> {
            self.elements
        }

        pub(super) fn as_slice(&self) -> &[T] {
            // SAFETY: `elements` is aligned for `T` (a huge-page boundary, and `T`'s
            // alignment divides it), the mapping holds `len` of them and lives as long as
            // `self`, and its bytes started zeroed, which `T: Zeroable` accepts (checked at
            // construction). `&self` forbids writes meanwhile.
            unsafe { std::slice::from_raw_parts(self.elements.as_ptr(), self.len) }
        }

        pub(super) fn as_mut_slice(&mut self) -> &mut [T] {
            // SAFETY: as in `as_slice`; `&mut self` makes this the only reference.
            unsafe { std::slice::from_raw_parts_mut(self.elements.as_ptr(), self.len) }
        }
    }

    impl<T> Drop for Mapping<T> {
        fn drop(&mut self) {
            // SAFETY: drop every element first (a no-op for the plain-data `T`s this holds,
            // but correct for any), then unmap exactly what `mmap` returned; no reference to
            // it outlives `self`.
            unsafe {
                std::ptr::drop_in_place(self.as_mut_slice());
                libc::munmap(self.base.as_ptr(), self.mapped_bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests;
