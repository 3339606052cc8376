//! The page pool under threads, every interleaving explored by `loom` (TEST-MATRIX U2).
//!
//! `PagePool` takes `&mut self` and has no internal concurrency: a worker shares it by owning it
//! on its one engine thread, and every network task reaches it through that thread. These tests
//! model the sharing as a `Mutex<PagePool>` with threads that race at the points where the
//! engine's events can interleave (a stale reference being used, a release, a reallocation, a
//! late frame landing), and check, for every order loom can produce, that the generation and
//! owner checks keep each request's bytes its own and that no page is lost or freed twice.
//!
//! They run in plain `cargo test -p kv` (loom's `model`, `Mutex`, `Arc` and `thread` need no cfg
//! flag), exploring every interleaving with up to three preemptions. The conventional loom
//! invocation runs the same tests; `LOOM_MAX_PREEMPTIONS` raises the bound:
//! `LOOM_MAX_PREEMPTIONS=5 RUSTFLAGS="--cfg loom" cargo test -p kv --test loom --release`.

use half::f16;
use kv::{Error, KvLayout, Owner, PagePool, PageState, PageTable, PoolConfig, PoolSize};
use kv::{RequestId, TenantId};
use loom::sync::{Arc, Mutex};
use loom::thread;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Outcomes seen across all of a test's executions (plain atomics: loom runs executions one
/// after another on one OS thread, and every access below happens under the pool's lock), so
/// each test can show the interleavings it is about were really explored.
struct Seen([AtomicUsize; 4]);

impl Seen {
    const fn new() -> Seen {
        Seen([const { AtomicUsize::new(0) }; 4])
    }

    fn note(&self, outcome: usize) {
        self.0[outcome].fetch_add(1, Ordering::Relaxed);
    }

    fn assert_all(&self, names: &[&str]) {
        for (index, name) in names.iter().enumerate() {
            let count = self.0[index].load(Ordering::Relaxed);
            println!("{name}: {count} executions");
            assert!(count > 0, "no interleaving reached: {name}");
        }
    }
}

/// Every interleaving within the preemption bound: `LOOM_MAX_PREEMPTIONS`, or three (the
/// bound loom's authors find catches nearly every bug, at a runtime fit for every test run).
fn model(test: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(test);
}

/// Small pages: what matters is which bytes a page holds, not how many.
const LAYOUT: KvLayout = KvLayout {
    layer_count: 1,
    kv_head_count: 1,
    head_dim: 2,
    page_size_tokens: 1,
};

fn pool(pages: usize) -> Arc<Mutex<PagePool>> {
    let pool = PagePool::new(PoolConfig {
        layout: LAYOUT,
        size: PoolSize::Tokens(pages),
        scrub_on_free: false,
    })
    .expect("a valid pool");
    Arc::new(Mutex::new(pool))
}

fn owner(tenant: u64, request: u64) -> Owner {
    Owner {
        tenant: TenantId(tenant),
        request: RequestId(request),
    }
}

/// The bytes each request writes, so a read can tell whose they are.
fn mark(request: &Owner) -> f16 {
    f16::from_f32(request.request.0 as f32)
}

/// Fill every page of a live table with its owner's mark, through a verified view.
fn write_own(pool: &Mutex<PagePool>, table: &PageTable) {
    let mut pool = pool.lock().unwrap();
    let mut views = pool.verify_batch(&[table]).expect("a live table verifies");
    for index in 0..views[0].page_len() {
        views[0].page_mut(index).fill(mark(&table.owner()));
    }
}

/// Read a table's pages through a verified view: its owner's bytes, or the refusal.
fn read(pool: &Mutex<PagePool>, table: &PageTable) -> Result<Vec<f16>, Error> {
    let mut pool = pool.lock().unwrap();
    let views = pool.verify_batch(&[table])?;
    Ok((0..views[0].page_len())
        .flat_map(|index| views[0].page(index).to_vec())
        .collect())
}

/// A refusal a stale table may get: its page went back to the pool (owner gone) or to a
/// new allocation (generation moved on).
fn stale_refusal(error: &Error) -> bool {
    matches!(
        error,
        Error::StaleGeneration { .. } | Error::OwnerMismatch { .. }
    )
}

/// U2: a reader holds request A's table while another thread releases A and reallocates its
/// pages to B (another tenant), and a third allocates, writes, checks and releases pages of
/// its own. The reader sees A's bytes or a stale-table refusal, never B's; every page comes
/// back at the end.
#[test]
fn a_reader_with_a_stale_table_never_sees_the_next_owners_bytes() {
    static SEEN: Seen = Seen::new();
    static B_WROTE: AtomicBool = AtomicBool::new(false);
    model(|| {
        B_WROTE.store(false, Ordering::Relaxed);
        let pool = pool(3);
        let a = owner(1, 10);
        let b = owner(2, 20);
        let c = owner(2, 30);
        let a_table = pool.lock().unwrap().allocate(a, 2).expect("fits");
        write_own(&pool, &a_table);

        let reader = {
            let pool = pool.clone();
            let stale = a_table.clone();
            thread::spawn(move || match read(&pool, &stale) {
                Ok(bytes) => {
                    assert!(
                        bytes.iter().all(|&x| x == mark(&a)),
                        "a verified read of A's table returned bytes that are not A's"
                    );
                    SEEN.note(0);
                }
                Err(Error::OwnerMismatch { found: None, .. }) => SEEN.note(1),
                // B holds the pages; before B writes, they still hold A's bytes.
                Err(Error::StaleGeneration { .. }) if !B_WROTE.load(Ordering::Relaxed) => {
                    SEEN.note(2)
                }
                Err(Error::StaleGeneration { .. }) => SEEN.note(3),
                Err(error) => panic!("unexpected {error:?}"),
            })
        };
        let reallocator = {
            let pool = pool.clone();
            thread::spawn(move || {
                pool.lock()
                    .unwrap()
                    .release(a_table)
                    .expect("A's own release");
                let b_table = pool
                    .lock()
                    .unwrap()
                    .allocate(b, 2)
                    .expect("A's pages are free again");
                let mut guard = pool.lock().unwrap();
                let mut views = guard.verify_batch(&[&b_table]).expect("B's own table");
                for index in 0..2 {
                    views[0].page_mut(index).fill(mark(&b));
                }
                B_WROTE.store(true, Ordering::Relaxed);
                drop(views);
                drop(guard);
                b_table
            })
        };
        let bystander = {
            let pool = pool.clone();
            thread::spawn(move || {
                let c_table = pool.lock().unwrap().allocate(c, 1).expect("one page spare");
                write_own(&pool, &c_table);
                let mut pool = pool.lock().unwrap();
                let views = pool.verify_batch(&[&c_table]).expect("C's own table");
                assert!(views[0].page(0).iter().all(|&x| x == mark(&c)));
                drop(views);
                pool.release(c_table).expect("C's own release");
            })
        };
        reader.join().unwrap();
        bystander.join().unwrap();
        let b_table = reallocator.join().unwrap();

        let bytes = read(&pool, &b_table).expect("B's own table");
        assert!(
            bytes.iter().all(|&x| x == mark(&b)),
            "B's pages hold B's bytes"
        );
        let mut pool = pool.lock().unwrap();
        pool.release(b_table).expect("B's own release");
        assert_eq!(pool.pages_free(), 3, "every page is back");
        pool.check_invariants();
    });
    SEEN.assert_all(&[
        "read A's own bytes",
        "refused: A's pages freed",
        "refused: pages reallocated to B, still holding A's bytes",
        "refused: pages reallocated to B and written",
    ]);
}

/// A transfer's late frame (the network side holding the reservation's table) races the
/// abort that releases the reservation and reserves the pages for the next transfer. The
/// frame lands in the old reservation or is refused; the next transfer's pages end with its
/// own bytes only (S4 at the pool level).
#[test]
fn a_late_frame_never_lands_in_the_next_reservation() {
    static SEEN: Seen = Seen::new();
    model(|| {
        let pool = pool(2);
        let r = owner(1, 10);
        let s = owner(2, 20);
        let r_table = {
            let mut pool = pool.lock().unwrap();
            let table = pool.allocate(r, 2).expect("fits");
            pool.set_state(&table, PageState::Receiving)
                .expect("Writing -> Receiving");
            table
        };

        let network = {
            let pool = pool.clone();
            let held = r_table.clone();
            thread::spawn(move || {
                for index in 0..2 {
                    let mut pool = pool.lock().unwrap();
                    match pool.verify_receiving(&held) {
                        Ok(mut view) => {
                            view.page_mut(index).fill(mark(&r));
                            SEEN.note(0);
                        }
                        Err(error) => {
                            assert!(stale_refusal(&error), "unexpected {error:?}");
                            SEEN.note(1);
                        }
                    };
                }
            })
        };
        let abort = {
            let pool = pool.clone();
            thread::spawn(move || {
                pool.lock()
                    .unwrap()
                    .release(r_table)
                    .expect("R's own release");
                let s_table = {
                    let mut pool = pool.lock().unwrap();
                    let table = pool.allocate(s, 2).expect("R's pages are free again");
                    pool.set_state(&table, PageState::Receiving)
                        .expect("Writing -> Receiving");
                    table
                };
                for index in 0..2 {
                    let mut pool = pool.lock().unwrap();
                    let mut view = pool.verify_receiving(&s_table).expect("S's own pages");
                    view.page_mut(index).fill(mark(&s));
                }
                pool.lock()
                    .unwrap()
                    .set_state(&s_table, PageState::Sealed)
                    .expect("Receiving -> Sealed");
                s_table
            })
        };
        network.join().unwrap();
        let s_table = abort.join().unwrap();

        let bytes = read(&pool, &s_table).expect("S's own table");
        assert!(
            bytes.iter().all(|&x| x == mark(&s)),
            "S's pages hold S's bytes only"
        );
        let mut pool = pool.lock().unwrap();
        pool.release(s_table).expect("S's own release");
        assert_eq!(pool.pages_free(), 2, "every page is back");
        pool.check_invariants();
    });
    SEEN.assert_all(&["frame landed in its reservation", "frame refused"]);
}

/// An abort races a finish (TEST-MATRIX L05): both release the same table, while a third
/// thread tries to take the pages for the next request. Exactly one release frees the pages;
/// the other is refused and frees nothing, in particular not the next request's pages
/// ("Dup Free").
#[test]
fn two_releases_of_one_table_free_its_pages_once() {
    static SEEN: Seen = Seen::new();
    model(|| {
        let pool = pool(2);
        let a = owner(1, 10);
        let b = owner(2, 20);
        let a_table = pool.lock().unwrap().allocate(a, 2).expect("fits");

        let release = |table: PageTable| {
            let pool = pool.clone();
            thread::spawn(move || pool.lock().unwrap().release(table))
        };
        let finish = release(a_table.clone());
        let abort = release(a_table);
        let next = {
            let pool = pool.clone();
            thread::spawn(move || pool.lock().unwrap().allocate(b, 2).ok())
        };
        let outcomes = [finish.join().unwrap(), abort.join().unwrap()];
        let b_table = next.join().unwrap();

        let freed = outcomes.iter().filter(|outcome| outcome.is_ok()).count();
        assert_eq!(freed, 1, "exactly one release frees: {outcomes:?}");
        for outcome in &outcomes {
            if let Err(error) = outcome {
                assert!(stale_refusal(error), "unexpected {error:?}");
            }
        }
        let mut pool = pool.lock().unwrap();
        match b_table {
            Some(b_table) => {
                SEEN.note(usize::from(outcomes[1].is_ok()));
                assert_eq!(pool.pages_free(), 0, "B holds both pages");
                pool.verify_batch(&[&b_table])
                    .expect("B's pages are still B's");
                pool.release(b_table).expect("B's own release");
            }
            None => {
                SEEN.note(2);
                assert_eq!(pool.pages_free(), 2);
            }
        }
        assert_eq!(pool.pages_free(), 2, "every page is back, none twice");
        pool.check_invariants();
    });
    SEEN.assert_all(&[
        "finish freed, B took the pages, abort refused",
        "abort freed, B took the pages, finish refused",
        "B found no pages",
    ]);
}
