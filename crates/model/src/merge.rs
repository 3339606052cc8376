//! Concurrent forward passes on one model, merged into one pass (`serve`'s two engines).
//!
//! `serve` runs a prefill engine and a decode engine on one model and one set of compute
//! threads. Taking turns, each pays for its own pass over the weights: a decode step of 16
//! rows reads every matrix as a 256-token prefill chunk does. `unified` folds its decode rows
//! into its prefill passes instead, and that is most of what `serve` was short of it at
//! concurrency 16 (BENCHMARKS.md, issue 26). So a caller here queues its pool and steps; the
//! first caller to find no pass running leads: it takes the compute threads' turn, waits a
//! moment for a caller whose pass just ended (it will be back with its next step), then runs
//! everything queued as one pass ([`Model::forward_parts`]) and hands each caller its logits.
//! Each part keeps its own pool, so its tables are verified against its own pages (I1) as
//! when it runs alone; only the weights and the threads are shared.

use crate::forward::PoolSteps;
use crate::{Error, Logits, Model, Result, SeqStep};
use kv::PagePool;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How long a leader waits for a caller whose pass just ended to hand in its next one. An
/// engine comes back in 0.2–2 ms (sampling, sending, admitting; `serve`'s decode engine at
/// concurrency 16 on the 2-core VM, 2026-12-07), a decode pass alone takes 4–13 ms there, and
/// a caller that does not come back costs the leader this much once.
pub(crate) const RETURN_GRACE: Duration = Duration::from_millis(4);

/// Merges the forward passes that threads hand one model at the same time.
pub(crate) struct PassMerger {
    state: Mutex<State>,
    changed: Condvar,
    grace: Duration,
    /// Tests: the next pass panics once it has taken the queue (`Model::panic_in_next_pass`).
    #[cfg(feature = "test-support")]
    pub(crate) panic_next: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct State {
    /// Parts waiting for a leader to run them.
    queued: Vec<Queued>,
    /// Whether a caller is leading a pass (from taking the queue to posting the results).
    leading: bool,
    /// Results the leader posted, by ticket, for their callers to take.
    finished: HashMap<u64, Result<Logits>>,
    next_ticket: u64,
    /// Callers whose pass ended within the grace, and when: a leader waits for them.
    returning: Vec<(ThreadId, Instant)>,
    counts: PassCounts,
}

/// How many passes a merging model ran, and how many of them carried several callers' steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassCounts {
    pub passes: u64,
    pub merged: u64,
}

struct Queued {
    ticket: u64,
    caller: ThreadId,
    part: LentPart,
}

/// A caller's pool and steps, lent to whichever caller leads the pass that runs them.
struct LentPart {
    pool: NonNull<PagePool>,
    steps: NonNull<[SeqStep<'static>]>,
}

// SAFETY: a `LentPart` moves the lender's `&mut PagePool` and `&[SeqStep]` to the leader's
// thread. `PagePool` is `Send` and `SeqStep` is `Sync` (asserted below), and the lender stays
// blocked in `PassMerger::forward`, its borrows alive and unused, until the leader has posted
// its result, which the leader does only after the pass that used them has ended (or has
// unwound: `Lead`).
unsafe impl Send for LentPart {}

const _: () = {
    const fn pool_is_send<T: Send>() {}
    const fn steps_are_sync<T: Sync>() {}
    pool_is_send::<PagePool>();
    steps_are_sync::<SeqStep<'static>>();
};

impl LentPart {
    fn new(pool: &mut PagePool, steps: &[SeqStep]) -> LentPart {
        let steps: NonNull<[SeqStep]> = NonNull::from(steps);
        LentPart {
            pool: NonNull::from(pool),
            // SAFETY: only the lifetime changes (the lender outlives every use; `LentPart`).
            steps: unsafe {
                std::mem::transmute::<NonNull<[SeqStep<'_>]>, NonNull<[SeqStep<'static>]>>(steps)
            },
        }
    }
}

impl PassMerger {
    pub(crate) fn new(grace: Duration) -> PassMerger {
        PassMerger {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            // A bound that keeps `Instant + grace` from overflowing.
            grace: grace.min(Duration::from_secs(3600)),
            #[cfg(feature = "test-support")]
            panic_next: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn counts(&self) -> PassCounts {
        self.lock().counts
    }

    /// Parts waiting for a leader (tests: to know that callers have queued).
    pub(crate) fn queued(&self) -> usize {
        self.lock().queued.len()
    }

    /// Runs `steps` on `pool` in the next pass of `model`, with whatever other callers hand
    /// in meanwhile, and returns this caller's logits.
    pub(crate) fn forward(
        &self,
        model: &Model,
        pool: &mut PagePool,
        steps: &[SeqStep],
    ) -> Result<Logits> {
        let caller = std::thread::current().id();
        let mut state = self.lock();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        let part = LentPart::new(pool, steps);
        state.queued.push(Queued {
            ticket,
            caller,
            part,
        });
        self.changed.notify_all();
        loop {
            if let Some(result) = state.finished.remove(&ticket) {
                return result;
            }
            if !state.leading {
                break;
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        // No pass is running and ours has not run: it is still queued, and we lead. From here
        // `Lead` ends the lead whatever happens, unwinding included.
        state.leading = true;
        drop(state);
        let mut lead = Lead {
            merger: self,
            ticket,
            taken: Vec::new(),
            done: false,
        };
        lead.run(model, caller);
        self.lock()
            .finished
            .remove(&ticket)
            .expect("the leader's own part ran in its pass")
    }

    /// Waits while a caller whose pass ended within the grace (other than `leader`) has not
    /// queued again, then takes the queue.
    fn take_queue(&self, leader: ThreadId) -> Vec<Queued> {
        let mut state = self.lock();
        loop {
            let now = Instant::now();
            let grace = self.grace;
            state.returning.retain(|&(_, ended)| now < ended + grace);
            let awaited = state
                .returning
                .iter()
                .filter(|&&(caller, _)| {
                    caller != leader && !state.queued.iter().any(|q| q.caller == caller)
                })
                .map(|&(_, ended)| ended + grace)
                .max();
            let Some(until) = awaited else { break };
            state = self
                .changed
                .wait_timeout(state, until - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let taken = std::mem::take(&mut state.queued);
        state.counts.passes += 1;
        state.counts.merged += u64::from(taken.len() > 1);
        taken
    }
}

/// A caller's lead of one pass: takes the compute threads' turn, then the queue, runs it as one
/// pass and posts each caller's result. Dropped without having posted (the leader unwinds), it
/// still ends the lead: the leader's own part leaves the queue (it points into the unwinding
/// frame), every other part it took gets an error instead of waiting for ever, and those it
/// did not take stay queued for the next leader.
struct Lead<'m> {
    merger: &'m PassMerger,
    /// The leader's own part.
    ticket: u64,
    taken: Vec<Queued>,
    done: bool,
}

impl Lead<'_> {
    fn run(&mut self, model: &Model, leader: ThreadId) {
        let turn = model.workers.turn();
        self.taken = self.merger.take_queue(leader);
        let mut parts: Vec<PoolSteps> = self
            .taken
            .iter()
            .map(|queued| {
                // SAFETY: each lender is blocked in `forward` until its result is posted
                // (`LentPart`); the pointers came from live references, and each pool is
                // lent by one caller, so these are the only references in use.
                unsafe {
                    PoolSteps {
                        pool: &mut *queued.part.pool.as_ptr(),
                        steps: &*queued.part.steps.as_ptr(),
                    }
                }
            })
            .collect();
        #[cfg(feature = "test-support")]
        if self
            .merger
            .panic_next
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("a merged pass failed (planted: PassMerger::panic_next)");
        }
        let results = model.forward_parts(&mut parts);
        drop(parts);
        drop(turn);
        self.end(results.into_iter().map(Some).collect());
        self.done = true;
    }

    fn end(&self, results: Vec<Option<Result<Logits>>>) {
        let mut state = self.merger.lock();
        let now = Instant::now();
        state.queued.retain(|queued| queued.ticket != self.ticket);
        for (queued, result) in self.taken.iter().zip(results) {
            match result {
                Some(result) => {
                    state.finished.insert(queued.ticket, result);
                }
                // Unwinding: the leader itself takes no result.
                None if queued.ticket == self.ticket => {}
                None => {
                    state
                        .finished
                        .insert(queued.ticket, Err(Error::MergedPassFailed));
                }
            }
            state
                .returning
                .retain(|&(caller, _)| caller != queued.caller);
            state.returning.push((queued.caller, now));
        }
        state.leading = false;
        self.merger.changed.notify_all();
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.end(self.taken.iter().map(|_| None).collect());
        }
    }
}
