//! A link's page copies, run one after another on a thread of the link's own.
//!
//! A page copy is memory-bound: on a two-core machine, several copies at once only take turns
//! at the memory bus and push decode's hashing of the landed pages off the other core, and a
//! blocking task per page pays a thread hand-off each time. One thread that takes the next
//! copy as soon as it finishes the last keeps the bus busy and leaves the other core to decode.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// The link's copy thread. Dropping it lets the thread finish what was posted and end.
pub(super) struct Copier {
    /// `None` if the thread could not be started: each copy then runs as a blocking task.
    jobs: Option<mpsc::Sender<Job>>,
}

impl Copier {
    pub(super) fn start(link: &str) -> Copier {
        let (jobs, queue) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name(format!("copy-{link}"))
            .spawn(move || {
                for job in queue {
                    // A copy that panicked is over (what it left is for decode's checksum to
                    // judge); its handle reports it, and the next copy still runs.
                    let _ = catch_unwind(AssertUnwindSafe(job));
                }
            });
        if let Err(error) = &started {
            tracing::warn!(link, %error, "no copy thread; page copies run as blocking tasks");
        }
        Copier {
            jobs: started.ok().map(|_| jobs),
        }
    }

    /// Queues `job` behind the copies already posted.
    pub(super) fn post(&self, job: impl FnOnce() + Send + 'static) -> Pending {
        let (finished, handle) = oneshot::channel();
        let job: Job = Box::new(move || {
            job();
            let _ = finished.send(());
        });
        let Some(jobs) = &self.jobs else {
            return Pending::Task(tokio::task::spawn_blocking(job));
        };
        match jobs.send(job) {
            Ok(()) => Pending::Copy(handle),
            // The thread is gone (it cannot be while we hold `jobs`, but a blocking task
            // does the same work).
            Err(mpsc::SendError(job)) => Pending::Task(tokio::task::spawn_blocking(job)),
        }
    }
}

/// Work of one transfer the link waits for before the transfer's closing frame: a posted
/// copy, or a task (a delayed write under fault injection, or a frame waiting on writes).
pub(super) enum Pending {
    Copy(oneshot::Receiver<()>),
    Task(JoinHandle<()>),
    /// A copy seen to finish (its answer taken).
    Copied,
}

impl Pending {
    pub(super) fn is_finished(&mut self) -> bool {
        match self {
            Pending::Copy(handle) => match handle.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => false,
                Ok(()) => {
                    *self = Pending::Copied;
                    true
                }
                // Panicked: over too; waiting on it still reports the panic.
                Err(oneshot::error::TryRecvError::Closed) => true,
            },
            Pending::Task(task) => task.is_finished(),
            Pending::Copied => true,
        }
    }

    /// Waits until it is over; an error if it panicked.
    pub(super) async fn finished(self) -> std::io::Result<()> {
        match self {
            Pending::Copy(handle) => handle
                .await
                .map_err(|_| std::io::Error::other("a page copy panicked")),
            Pending::Task(task) => task.await.map_err(std::io::Error::other),
            Pending::Copied => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[tokio::test]
    async fn copies_run_one_after_another_in_posting_order_on_one_thread() {
        let copier = Copier::start("test");
        let ran = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<Pending> = (0..32)
            .map(|index| {
                let ran = ran.clone();
                copier.post(move || {
                    let thread = std::thread::current().name().map(str::to_owned);
                    ran.lock().unwrap().push((index, thread));
                })
            })
            .collect();
        assert!(handles.iter().all(|h| matches!(h, Pending::Copy(_))));
        for handle in handles {
            handle.finished().await.expect("no copy panicked");
        }
        let ran = ran.lock().unwrap();
        let order: Vec<usize> = ran.iter().map(|(index, _)| *index).collect();
        assert_eq!(order, (0..32).collect::<Vec<_>>());
        assert!(ran
            .iter()
            .all(|(_, thread)| thread.as_deref() == Some("copy-test")));
    }

    #[tokio::test]
    async fn a_copy_that_panics_is_reported_and_the_next_still_runs() {
        let copier = Copier::start("test");
        let panicked = copier.post(|| panic!("a planted panic in a copy"));
        let (tx, rx) = std::sync::mpsc::channel();
        let next = copier.post(move || tx.send(7).unwrap());
        assert!(panicked.finished().await.is_err());
        next.finished().await.expect("the next copy ran");
        assert_eq!(rx.try_recv(), Ok(7));
    }

    #[tokio::test]
    async fn a_copy_is_finished_only_once_it_has_run() {
        let copier = Copier::start("test");
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let mut handle = copier.post(move || gate.recv().unwrap());
        assert!(!handle.is_finished(), "still waiting at its gate");
        release.send(()).unwrap();
        while !handle.is_finished() {
            tokio::task::yield_now().await;
        }
        // Seen finished (its answer taken), it still waits as finished.
        assert!(matches!(handle, Pending::Copied));
        handle.finished().await.expect("finished cleanly");
    }
}
