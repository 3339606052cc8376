//! A small fork-join thread pool for the forward pass.
//!
//! A decode step runs ~150 parallel regions of a few tens of microseconds each; a general
//! pool that puts threads to sleep between them loses a large share of each region to wake-ups.
//! Here workers spin briefly between regions (then park, so an idle server burns no CPU), the
//! calling thread takes part in the work, and a region never waits for a worker that did not
//! join it: on a busy machine a descheduled worker costs its share of speed, not a time slice.
//!
//! Protocol: the caller publishes a job (task, count) and opens it; workers join by bumping
//! `active`, then re-check that the job is open before touching it; tasks are claimed with
//! `next`. When all tasks are `done`, the caller closes the job and waits for `active == 0`,
//! after which no worker can still hold the job, and only then returns (the task borrows the
//! caller's stack). All flags use SeqCst: the join (`active` up, then read `open`) and the close
//! (`open` down, then read `active`) must not both miss each other.
//!
//! Every primitive here comes from `crate::sync`, so `tests/loom.rs` model-checks this
//! protocol (`scripts/loom-mutant.sh` runs it, and shows it catches broken variants).

use crate::sync::{
    hint, park_idle, seq_cst_store_load, thread, Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex,
    MutexGuard, UnsafeCell,
};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::SeqCst;

/// Idle polls before a worker parks (a few hundred microseconds of spinning).
#[cfg(not(loom))]
const SPIN_LIMIT: u32 = 20_000;
/// Each poll is a scheduling point to loom: spin once, then park, to keep the model small.
#[cfg(loom)]
const SPIN_LIMIT: u32 = 2;
/// Polls before a waiting caller starts yielding its core to whoever holds the work.
const CALLER_SPIN_LIMIT: u32 = 2_000;

type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// The job a region publishes: a lifetime-erased task and its count.
struct Job {
    task: Option<Task<'static>>,
    count: usize,
}

struct Shared {
    /// Bumped once per region, so idle workers notice new work.
    epoch: AtomicU64,
    job: UnsafeCell<Job>,
    open: AtomicBool,
    next: AtomicUsize,
    done: AtomicUsize,
    /// Workers currently joined to the job.
    active: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the caller holding `Workers::region` while the job is
// closed and `active == 0` (no worker reads it then), and read by workers only while they are
// counted in `active` and saw `open` (the caller waits for them before writing again).
unsafe impl Sync for Shared {}

/// A fixed set of compute threads; `for_each` runs `tasks` closures across them.
pub struct Workers {
    shared: Arc<Shared>,
    handles: Vec<thread::JoinHandle<()>>,
    /// One region at a time.
    region: Mutex<()>,
    /// One caller's sequence of regions at a time ([`Workers::turn`]).
    turn: Mutex<()>,
}

/// Held while a caller runs a sequence of regions that belong together (a forward pass).
pub struct Turn<'a> {
    _held: MutexGuard<'a, ()>,
}

impl Workers {
    /// A pool of `threads` threads in all, the caller included (so `threads - 1` are spawned).
    pub fn new(threads: usize) -> Workers {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                task: None,
                count: 0,
            }),
            open: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let handles = (1..threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("airlock-compute-{i}"))
                    .spawn(move || worker_loop(&shared))
                    .expect("the OS can start a compute thread")
            })
            .collect();
        Workers {
            shared,
            handles,
            region: Mutex::new(()),
            turn: Mutex::new(()),
        }
    }

    /// Waits until no other caller holds a turn, then holds it until the guard drops. Callers
    /// that share a pool (models on each other's threads, `Model::share_compute`; a model that
    /// merges its callers' passes takes one turn per merged pass) take turns by whole forward
    /// passes, so
    /// one pass's regions run back to back on weights and activations still in cache rather
    /// than interleaved with another model's; regions still lock on their own, so a caller
    /// that does not take turns stays correct.
    pub fn turn(&self) -> Turn<'_> {
        Turn {
            _held: self.turn.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Threads that run tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Runs `task(i)` for every `i` in `0..tasks`, spread over the threads; returns when all
    /// are done. A panic in any task is re-raised here. A task must not call `for_each` on the
    /// same pool (regions do not nest; it would wait for itself).
    pub fn for_each(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if self.handles.is_empty() || tasks <= 1 {
            (0..tasks).for_each(task);
            return;
        }
        let _region = self.region.lock().unwrap_or_else(|e| e.into_inner());
        let shared = &*self.shared;
        // SAFETY: the lifetime is erased only for the duration of this call: we return only
        // after closing the job and seeing `active == 0` (see the module comment).
        let task: Task<'static> = unsafe { std::mem::transmute::<Task<'_>, Task<'static>>(task) };
        shared.job.with_mut(|job| {
            let job_now = Job {
                task: Some(task),
                count: tasks,
            };
            // SAFETY: the job is closed and no worker is active (the previous call waited).
            unsafe { *job = job_now }
        });
        shared.next.store(0, SeqCst);
        shared.done.store(0, SeqCst);
        shared.open.store(true, SeqCst);
        self.wake_workers();
        run_tasks(shared, task, tasks);
        wait_until(|| shared.done.load(SeqCst) >= tasks);
        shared.open.store(false, SeqCst);
        seq_cst_store_load();
        wait_until(|| shared.active.load(SeqCst) == 0);
        // SAFETY: closed and no worker active: nobody reads the job now.
        shared.job.with_mut(|job| unsafe { (*job).task = None });
        if shared.panicked.swap(false, SeqCst) {
            panic!("a compute task panicked");
        }
    }

    /// Bumps the epoch, which idle workers poll, then unparks those that stopped polling. In
    /// the other order a worker could spend the unpark on a park, still see the old epoch and
    /// park again: a lost wakeup.
    fn wake_workers(&self) {
        #[cfg(loom)]
        if crate::sync::mutant("unpark_before_epoch") {
            for handle in &self.handles {
                handle.thread().unpark();
            }
            self.shared.epoch.fetch_add(1, SeqCst);
            return;
        }
        self.shared.epoch.fetch_add(1, SeqCst);
        for handle in &self.handles {
            handle.thread().unpark();
        }
    }

    /// Tells every worker to exit. A worker that sees the new epoch must see the shutdown too,
    /// so the shutdown is stored first.
    fn close(&self) {
        #[cfg(loom)]
        if crate::sync::mutant("shutdown_after_epoch") {
            self.wake_workers();
            self.shared.shutdown.store(true, SeqCst);
            return;
        }
        self.shared.shutdown.store(true, SeqCst);
        self.wake_workers();
    }

    /// Runs `task(i, &mut items[i])` for every item, spread over the threads: each task gets
    /// its own item mutably.
    pub fn for_each_item_mut<T: Send>(&self, items: &mut [T], task: impl Fn(usize, &mut T) + Sync) {
        // One uncontended lock per item hands each task its disjoint `&mut` safely.
        let items: Vec<Mutex<&mut T>> = items.iter_mut().map(Mutex::new).collect();
        self.for_each(items.len(), &|i| {
            let mut item = items[i].lock().unwrap_or_else(|e| e.into_inner());
            task(i, &mut item);
        });
    }

    /// Splits `data` into `chunk_len`-sized chunks (the last may be shorter) and runs
    /// `task(chunk_index, chunk)` for each, spread over the threads.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        task: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let mut chunks: Vec<&mut [T]> = data.chunks_mut(chunk_len.max(1)).collect();
        self.for_each_item_mut(&mut chunks, |i, chunk| task(i, chunk));
    }

    /// Runs `task(i, a_i, b_i)` for each pair of matching chunks, `a_i` of `a_len` items of
    /// `a` and `b_i` of `b_len` items of `b` (both slices must split into as many chunks),
    /// spread over the threads.
    pub fn for_each_chunk_pair_mut<A: Send, B: Send>(
        &self,
        (a, a_len): (&mut [A], usize),
        (b, b_len): (&mut [B], usize),
        task: impl Fn(usize, &mut [A], &mut [B]) + Sync,
    ) {
        let (a_len, b_len) = (a_len.max(1), b_len.max(1));
        assert_eq!(
            a.len().div_ceil(a_len),
            b.len().div_ceil(b_len),
            "as many chunks of each"
        );
        let mut pairs: Vec<(&mut [A], &mut [B])> =
            a.chunks_mut(a_len).zip(b.chunks_mut(b_len)).collect();
        self.for_each_item_mut(&mut pairs, |i, (a, b)| task(i, a, b));
    }
}

fn wait_until(condition: impl Fn() -> bool) {
    let mut polls = 0u32;
    while !condition() {
        polls += 1;
        if polls < CALLER_SPIN_LIMIT {
            hint::spin_loop();
        } else {
            thread::yield_now();
        }
    }
}

fn run_tasks(shared: &Shared, task: Task<'_>, count: usize) {
    loop {
        let i = shared.next.fetch_add(1, SeqCst);
        if i >= count {
            return;
        }
        if catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
            shared.panicked.store(true, SeqCst);
        }
        shared.done.fetch_add(1, SeqCst);
    }
}

fn worker_loop(shared: &Shared) {
    let mut seen = 0;
    loop {
        let mut idle = 0u32;
        while shared.epoch.load(SeqCst) == seen {
            idle += 1;
            if idle < SPIN_LIMIT {
                hint::spin_loop();
            } else {
                park_idle();
            }
        }
        seen = shared.epoch.load(SeqCst);
        if shared.shutdown.load(SeqCst) {
            return;
        }
        if join(shared) {
            // Held until the tasks are done: loom counts it as a read of the job till then.
            let job_ptr = shared.job.get();
            // SAFETY: we are counted in `active` and saw the job open, so the caller will not
            // rewrite or drop the job, nor return from `for_each` (ending the task's borrow),
            // until we leave (see the module comment).
            let job = unsafe { job_ptr.deref() };
            if let Some(task) = job.task {
                run_tasks(shared, task, job.count);
            }
        }
        shared.active.fetch_sub(1, SeqCst);
    }
}

/// Counts this worker in `active`, then reports whether the job is open; in this order, the
/// closing caller sees the count or this worker sees the job closed (the module comment).
fn join(shared: &Shared) -> bool {
    #[cfg(loom)]
    if crate::sync::mutant("open_before_active") {
        let open = shared.open.load(SeqCst);
        shared.active.fetch_add(1, SeqCst);
        return open;
    }
    shared.active.fetch_add(1, SeqCst);
    seq_cst_store_load();
    shared.open.load(SeqCst)
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.close();
        for handle in self.handles.drain(..) {
            // A worker only exits through the loop's shutdown check; it cannot have panicked.
            let _ = handle.join();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn every_task_runs_exactly_once_across_many_regions() {
        let workers = Workers::new(3);
        for tasks in [0usize, 1, 2, 7, 100] {
            for _ in 0..200 {
                let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                workers.for_each(tasks, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn a_panicking_task_is_reported_to_the_caller_and_the_pool_survives() {
        let workers = Workers::new(2);
        let result = catch_unwind(AssertUnwindSafe(|| {
            workers.for_each(4, &|i| assert!(i != 2, "task 2 fails"));
        }));
        assert!(result.is_err());
        let sum = AtomicUsize::new(0);
        workers.for_each(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn chunks_are_handed_out_disjoint_and_complete() {
        let workers = Workers::new(2);
        let mut data = vec![0usize; 1000];
        workers.for_each_chunk_mut(&mut data, 7, &|chunk, values| {
            for (i, v) in values.iter_mut().enumerate() {
                *v += chunk * 7 + i;
            }
        });
        assert!(data.iter().enumerate().all(|(i, &v)| v == i));
    }

    #[test]
    fn chunk_pairs_match_up_and_cover_both_slices() {
        let workers = Workers::new(2);
        let (mut rows, mut sums) = (vec![1usize; 3 * 50], vec![0usize; 50]);
        workers.for_each_chunk_pair_mut((&mut rows, 3 * 4), (&mut sums, 4), |chunk, rows, sums| {
            for (i, (row, sum)) in rows.chunks_mut(3).zip(sums).enumerate() {
                row[0] = chunk * 4 + i;
                *sum = row.iter().sum();
            }
        });
        assert!(sums.iter().enumerate().all(|(i, &s)| s == i + 2));
        let unequal = catch_unwind(AssertUnwindSafe(|| {
            workers.for_each_chunk_pair_mut((&mut rows, 3), (&mut sums, 2), |_, _, _| {});
        }));
        assert!(unequal.is_err(), "50 rows against 25 pairs of sums");
    }

    /// Two callers sharing a pool, each running passes of several regions: a pass holds its
    /// turn from its first region to its last, so the other caller's regions never run in
    /// between, and every task of both still runs once.
    #[test]
    fn callers_sharing_a_pool_take_whole_turns() {
        const PASSES: usize = 300;
        const REGIONS: usize = 4;
        let workers = Workers::new(2);
        let inside = AtomicUsize::new(0);
        let overlaps = AtomicUsize::new(0);
        let tasks_run = AtomicUsize::new(0);
        let start = std::sync::Barrier::new(2);
        let pass = || {
            let _turn = workers.turn();
            inside.fetch_add(1, Ordering::SeqCst);
            for _ in 0..REGIONS {
                workers.for_each(8, &|_| {
                    tasks_run.fetch_add(1, Ordering::Relaxed);
                    if inside.load(Ordering::SeqCst) != 1 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                });
                // Leaves the other caller time to slip a region in, were it let.
                std::thread::yield_now();
            }
            inside.fetch_sub(1, Ordering::SeqCst);
        };
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| {
                    start.wait();
                    (0..PASSES).for_each(|_| pass());
                });
            }
        });
        assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two passes overlapped");
        assert_eq!(tasks_run.load(Ordering::Relaxed), 2 * PASSES * REGIONS * 8);
    }

    #[test]
    fn single_thread_pool_runs_inline() {
        let workers = Workers::new(1);
        assert_eq!(workers.threads(), 1);
        let sum = AtomicUsize::new(0);
        workers.for_each(5, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 10);
    }
}
