//! A small fork-join thread pool for the forward pass.
//!
//! A decode step runs ~150 parallel regions of a few tens of microseconds each; a general
//! pool that puts threads to sleep between them loses a large share of each region to wake-ups.
//! Here workers spin briefly between regions (they park after `SPIN_LIMIT` idle rounds, so an
//! idle server burns no CPU) and the calling thread takes part in the work.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Idle polls before a worker parks (a few hundred microseconds of spinning).
const SPIN_LIMIT: u32 = 20_000;

type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// The job a region publishes: a lifetime-erased task and its count.
struct Job {
    task: Option<Task<'static>>,
    count: usize,
}

struct Shared {
    /// Bumped once per region; workers run each epoch exactly once.
    epoch: AtomicU64,
    job: UnsafeCell<Job>,
    next: AtomicUsize,
    /// Workers that have finished the current epoch.
    finished: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding `Workers::region` while every worker
// has finished the previous epoch (so none reads it), and read by workers only between seeing
// a new epoch and bumping `finished`, during which the writer waits.
unsafe impl Sync for Shared {}

/// A fixed set of compute threads; `for_each` runs `tasks` closures across them.
pub struct Workers {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// One region at a time.
    region: Mutex<()>,
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
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let handles = (1..threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("airlock-compute-{i}"))
                    .spawn(move || worker_loop(&shared, 0))
                    .expect("the OS can start a compute thread")
            })
            .collect();
        Workers {
            shared,
            handles,
            region: Mutex::new(()),
        }
    }

    /// Threads that run tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Runs `task(i)` for every `i` in `0..tasks`, spread over the threads; returns when all
    /// are done. A panic in any task is re-raised here.
    pub fn for_each(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if self.handles.is_empty() || tasks <= 1 {
            (0..tasks).for_each(task);
            return;
        }
        let _region = self.region.lock().unwrap_or_else(|e| e.into_inner());
        let shared = &*self.shared;
        // SAFETY: the lifetime is erased only for the duration of this call: we do not return
        // until every worker has bumped `finished` for this epoch, after which none touches
        // the job again (see `Shared`).
        let task: Task<'static> = unsafe { std::mem::transmute::<Task<'_>, Task<'static>>(task) };
        // SAFETY: all workers finished the previous epoch (we waited) and we hold `region`.
        unsafe {
            *shared.job.get() = Job {
                task: Some(task),
                count: tasks,
            }
        };
        shared.next.store(0, Ordering::Relaxed);
        shared.finished.store(0, Ordering::Relaxed);
        shared.epoch.fetch_add(1, Ordering::Release);
        for handle in &self.handles {
            handle.thread().unpark();
        }
        run_tasks(shared, task, tasks);
        let workers = self.handles.len();
        while shared.finished.load(Ordering::Acquire) < workers {
            std::hint::spin_loop();
        }
        // SAFETY: every worker is done with this epoch; drop our reference to the task.
        unsafe { (*shared.job.get()).task = None };
        if shared.panicked.swap(false, Ordering::Relaxed) {
            panic!("a compute task panicked");
        }
    }
}

impl Workers {
    /// Splits `data` into `chunk_len`-sized chunks (the last may be shorter) and runs
    /// `task(chunk_index, chunk)` for each, spread over the threads.
    pub fn for_each_chunk_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        task: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        // One uncontended lock per chunk hands each task its disjoint `&mut` safely.
        let chunks: Vec<Mutex<&mut [T]>> =
            data.chunks_mut(chunk_len.max(1)).map(Mutex::new).collect();
        self.for_each(chunks.len(), &|i| {
            let mut chunk = chunks[i].lock().unwrap_or_else(|e| e.into_inner());
            task(i, &mut chunk);
        });
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::Release);
        for handle in self.handles.drain(..) {
            handle.thread().unpark();
            // A worker only exits through the loop's shutdown check; it cannot have panicked.
            let _ = handle.join();
        }
    }
}

fn run_tasks(shared: &Shared, task: Task<'_>, count: usize) {
    loop {
        let i = shared.next.fetch_add(1, Ordering::Relaxed);
        if i >= count {
            return;
        }
        if catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
            shared.panicked.store(true, Ordering::Relaxed);
        }
    }
}

/// `seen` is the epoch at pool creation: a worker that starts late must still run the first
/// region, so it must not read the current epoch as already seen.
fn worker_loop(shared: &Shared, mut seen: u64) {
    loop {
        let mut idle = 0u32;
        let epoch = loop {
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                break epoch;
            }
            idle += 1;
            if idle < SPIN_LIMIT {
                std::hint::spin_loop();
            } else {
                std::thread::park_timeout(std::time::Duration::from_millis(50));
            }
        };
        seen = epoch;
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: a new epoch was published with Release after the job was written, and the
        // publisher will not change it until we bump `finished` below.
        let job = unsafe { &*shared.job.get() };
        if let Some(task) = job.task {
            run_tasks(shared, task, job.count);
        }
        shared.finished.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
