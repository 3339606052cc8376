//! Every primitive `workers` synchronizes through: std's in a normal build, loom's under
//! `RUSTFLAGS="--cfg loom"`, so `tests/loom.rs` can model-check the pool's protocol (as tokio
//! does). In a normal build this module is re-exports and `#[inline(always)]` wrappers only.
//!
//! Two things loom cannot run as written are swapped for what it can model; see
//! [`park_idle`] (no timeout) and [`seq_cst_store_load`] (loom weakens SeqCst accesses).

#[cfg(not(loom))]
pub(crate) use std::{
    hint,
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize},
    sync::{Arc, Mutex, MutexGuard},
    thread,
};

#[cfg(loom)]
pub(crate) use loom::{
    hint,
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize},
    sync::{Arc, Mutex, MutexGuard},
    thread,
};

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// Parks an idle worker until it is unparked. The real pool wakes every 50 ms anyway, as a
/// safety net; the model parks without a timeout, so a lost wakeup shows up as a deadlock
/// instead of being papered over by the timeout.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn park_idle() {
    std::thread::park_timeout(std::time::Duration::from_millis(50));
}

#[cfg(loom)]
pub(crate) fn park_idle() {
    loom::thread::park();
}

/// Sits between a SeqCst store and a SeqCst load of another atomic where the code relies on
/// the single total order of SeqCst accesses (a store-load, "Dekker" handshake). In a normal
/// build the accesses themselves give that order, so this is nothing. Loom treats SeqCst
/// accesses as AcqRel (its README, "Unsupported features"), which would report the handshake
/// broken when it is not; a SeqCst fence, which loom does model, gives the model the same order.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn seq_cst_store_load() {}

#[cfg(loom)]
pub(crate) fn seq_cst_store_load() {
    // The `acq_rel` mutant: the handshake with Release/Acquire ordering only.
    if !mutant("acq_rel") {
        loom::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether the named mutant (a deliberately broken protocol step) is switched on for this loom
/// run, by `AIRLOCK_LOOM_MUTANT=<name>`. Only loom builds have mutants, so no binary a user
/// runs can carry one; `scripts/loom-mutant.sh` checks that loom catches each of them.
#[cfg(loom)]
pub(crate) fn mutant(name: &str) -> bool {
    std::env::var("AIRLOCK_LOOM_MUTANT").is_ok_and(|on| on == name)
}

/// `std::cell::UnsafeCell` behind loom's API (the part `workers` uses), so the model can track
/// every access to the cell and report one that races.
#[cfg(not(loom))]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> UnsafeCell<T> {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    /// A shared view of the value; loom counts it as a read for as long as it lives.
    #[inline(always)]
    pub(crate) fn get(&self) -> ConstPtr<T> {
        ConstPtr(self.0.get())
    }

    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(not(loom))]
pub(crate) struct ConstPtr<T>(*const T);

#[cfg(not(loom))]
impl<T> ConstPtr<T> {
    /// # Safety
    /// As dereferencing a `*const T`: the cell must still be alive, and no one may write the
    /// value while the reference lives.
    #[inline(always)]
    pub(crate) unsafe fn deref(&self) -> &T {
        // SAFETY: the caller upholds both conditions above.
        unsafe { &*self.0 }
    }
}
