//! Model checks of the `Workers` fork-join protocol: loom runs each test body under every
//! interleaving of the pool's threads (up to a preemption bound) and every outcome its model of
//! the memory orderings allows, through `kernels::sync`'s loom primitives.
//!
//! Run: `scripts/loom-mutant.sh` (these tests, then each mutant, which must fail), or just
//! `RUSTFLAGS="--cfg loom" cargo test -p kernels --test loom` with its own target dir.
//!
//! Covered: every task of a region runs exactly once and its writes are visible when
//! `for_each` returns (a late or unordered write is a race loom reports on the task's cell);
//! no worker reads the job while the caller rewrites it; a second region on the same pool;
//! drop wakes and joins every worker with no lost wakeup (parking has no timeout in the model,
//! so a lost one deadlocks). Not covered: sizes beyond 3 threads and 2 regions, panicking
//! tasks, regions from several callers at once (the `region` mutex serializes them), the real
//! spin counts and park timeout, and the few C11 behaviours loom does not explore (its README).
#![cfg(loom)]

use kernels::Workers;
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;

/// One slot per task: the task counts its runs and writes its slot through a loom cell, so a
/// write the caller is not ordered after when it reads the slot is reported as a race.
struct Slots {
    values: Vec<UnsafeCell<usize>>,
    runs: Vec<AtomicUsize>,
}

// SAFETY: slot `i` is written only by task `i` and read or reset only by the caller between
// regions; whether those accesses are ordered is exactly what loom checks here.
unsafe impl Sync for Slots {}

impl Slots {
    fn new(tasks: usize) -> Slots {
        Slots {
            values: (0..tasks).map(|_| UnsafeCell::new(0)).collect(),
            runs: (0..tasks).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// The task for region `region`: writes a value only this region's task `i` writes.
    fn task(&self, region: usize) -> impl Fn(usize) + Sync + '_ {
        move |i| {
            self.runs[i].fetch_add(1, Relaxed);
            // SAFETY: loom checks that no other access overlaps this write (`Slots`' Sync).
            self.values[i].with_mut(|value| unsafe { *value = region * 10 + i });
        }
    }

    /// After region `region` returned: each task ran once and its write is visible. Resets
    /// the slots (a write, so a worker still writing a slot of this region is a race).
    fn check_and_reset(&self, region: usize) {
        for (i, (value, runs)) in self.values.iter().zip(&self.runs).enumerate() {
            assert_eq!(
                runs.swap(0, Relaxed),
                1,
                "task {i} of region {region} ran once"
            );
            // SAFETY: loom checks that no task's write overlaps this access.
            let seen = value.with_mut(|value| unsafe { std::mem::replace(&mut *value, 0) });
            assert_eq!(seen, region * 10 + i, "task {i}'s write is visible");
        }
    }
}

/// Runs `body` under loom with at most `preemptions` forced switches per execution (the bound
/// keeps the larger pools' state spaces to seconds; the 2-thread ones are explored in full).
fn check(preemptions: Option<usize>, body: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = preemptions;
    builder.check(body);
}

#[test]
fn a_region_runs_each_task_once_and_returns_after_all_ran() {
    check(None, || {
        let workers = Workers::new(2);
        let slots = Slots::new(2);
        workers.for_each(2, &slots.task(1));
        slots.check_and_reset(1);
    });
}

#[test]
fn a_second_region_reuses_the_pool() {
    check(Some(5), || {
        let workers = Workers::new(2);
        let slots = Slots::new(2);
        for region in 1..=2 {
            workers.for_each(2, &slots.task(region));
            slots.check_and_reset(region);
        }
    });
}

#[test]
fn drop_wakes_and_joins_every_worker() {
    check(None, || drop(Workers::new(3)));
}

#[test]
fn a_region_over_three_threads_runs_each_task_once() {
    check(Some(3), || {
        let workers = Workers::new(3);
        let slots = Slots::new(3);
        workers.for_each(3, &slots.task(1));
        slots.check_and_reset(1);
    });
}
