//! A model that merges concurrent passes (`serve`'s two engines on one model): callers'
//! steps run in one pass, each on its own pool, each caller gets the bits it would get alone,
//! and a caller whose pages fail their check fails alone.

use crate::common::{self, max_abs_diff, owner, snapshot, PAGE_SIZE};
use kv::{PagePool, PageState};
use model::{Error, LogitRows, Model, PassCounts, SeqStep};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const A_PROMPT: &str = "Tenant A's launch code is 4711-ALPHA; never tell anyone.";
const B_PROMPT: &str = "Tenant B keeps a shopping list: apples, pears, bread and milk.";

fn encode(text: &str) -> Vec<u32> {
    common::tokenizer().encode(text, false)
}

fn merging_model(grace: Option<Duration>) -> Model {
    let mut model = common::another_model();
    match grace {
        Some(grace) => model.merge_concurrent_passes_with_grace(grace),
        None => model.merge_concurrent_passes(),
    }
    model
}

/// Prefills `prompt` on `model` in a pool of its own, then decodes one token after it, and
/// returns the rows of logits the prefill asked for followed by the decode step's (which
/// reads the K/V the prefill wrote, so it fails if the prefill's positions were not marked
/// written in its own pool); the pool must be whole again afterwards.
fn prefill_rows(model: &Model, prompt: &[u32], rows: LogitRows) -> Vec<Vec<f32>> {
    try_prefill_rows(model, prompt, rows).expect("prefill and decode")
}

fn try_prefill_rows(
    model: &Model,
    prompt: &[u32],
    rows: LogitRows,
) -> Result<Vec<Vec<f32>>, Error> {
    let mut pool = common::pool_for(model, 4 * PAGE_SIZE);
    let table = pool.allocate(owner(7, 0), prompt.len() + 1).unwrap();
    let mut run = |tokens: &[u32], start_pos, logits| {
        let step = SeqStep {
            table: &table,
            tokens,
            start_pos,
            logits,
        };
        model.forward(&mut pool, &[step])
    };
    let result = run(prompt, 0, rows).and_then(|prefilled| {
        let mut out: Vec<Vec<f32>> = prefilled.rows().map(<[f32]>::to_vec).collect();
        let next = common::top_k(out.last().expect("a row"), 1)[0];
        out.extend(
            run(&[next], prompt.len(), LogitRows::Last)?
                .rows()
                .map(<[f32]>::to_vec),
        );
        Ok(out)
    });
    pool.release(table).expect("release");
    assert_whole(&pool);
    result
}

fn assert_whole(pool: &PagePool) {
    pool.check_invariants();
    assert_eq!(pool.pages_free(), pool.page_count(), "pages leaked (I9)");
    assert_eq!(pool.pages_in_state(PageState::Free), pool.page_count());
}

fn assert_same_bits(got: &[Vec<f32>], alone: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), alone.len(), "{what}: logit rows");
    for (row, (got, alone)) in got.iter().zip(alone).enumerate() {
        assert!(
            got.iter()
                .zip(alone)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}, row {row}: max abs diff {} from the pass alone",
            max_abs_diff(got, alone)
        );
    }
}

/// Runs `part(model, 0)` and `part(model, 1)` on two threads so that both have queued before
/// either pass can start: the test holds the compute threads' turn until then.
fn run_together<T: Send>(model: &Model, part: impl Fn(&Model, usize) -> T + Sync) -> [T; 2] {
    let compute = model.compute();
    let turn = compute.turn();
    std::thread::scope(|scope| {
        let part = &part;
        let handles = [0, 1].map(|i| scope.spawn(move || part(model, i)));
        let deadline = Instant::now() + Duration::from_secs(60);
        while model.queued_passes() < 2 {
            assert!(Instant::now() < deadline, "both callers never queued");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(turn);
        handles.map(|handle| handle.join().expect("caller"))
    })
}

/// Two callers hand in passes together: one pass runs both, and each caller gets its own
/// rows, bit for bit those of its pass alone (every row of one prompt, the last of the other,
/// so the rows are split between callers where they meet).
#[test]
fn passes_handed_in_together_run_as_one_and_each_caller_gets_its_own_logits() {
    let model = merging_model(None);
    let prompts = [encode(A_PROMPT), encode(B_PROMPT)];
    let rows = [LogitRows::Every, LogitRows::Last];
    // Alone, on a model loaded from the same file that does not merge.
    let alone: Vec<_> = (0..2)
        .map(|i| prefill_rows(common::model(), &prompts[i], rows[i]))
        .collect();
    assert_eq!(alone[0].len(), prompts[0].len() + 1);
    let together = run_together(&model, |model, i| prefill_rows(model, &prompts[i], rows[i]));
    // The prefills ran as one pass; the decode steps after them as one or two.
    let counts = model.pass_counts().expect("a merging model");
    assert!(
        counts.merged >= 1 && counts.passes <= 3,
        "both callers' prefills ran in one pass: {counts:?}"
    );
    assert_same_bits(&together[0], &alone[0], "A (every row)");
    assert_same_bits(&together[1], &alone[1], "B (last row)");
}

/// A caller whose table is stale (its request's pages already went to another owner) gets
/// the stale-generation error (I1) from the merged pass and nothing of its pool is written;
/// the other caller's steps run in the same pass and get their own logits.
#[test]
fn a_caller_whose_pages_fail_their_check_fails_alone_and_the_pass_runs_the_other() {
    let model = merging_model(None);
    let (a_prompt, b_prompt) = (encode(A_PROMPT), encode(B_PROMPT));
    let b_alone = prefill_rows(common::model(), &b_prompt, LogitRows::Last);
    let mut a_pool = common::pool_for(&model, 4 * PAGE_SIZE);
    let stale = a_pool.allocate(owner(1, 10), a_prompt.len()).unwrap();
    let released = stale.clone();
    a_pool.release(released).unwrap();
    let reuser = a_pool.allocate(owner(2, 20), a_prompt.len()).unwrap();
    let before = snapshot(&mut a_pool, &reuser);
    let a_pool = std::sync::Mutex::new(a_pool);

    let [a_result, b_result] = run_together(&model, |model, i| match i {
        0 => {
            let step = SeqStep {
                table: &stale,
                tokens: &a_prompt,
                start_pos: 0,
                logits: LogitRows::Last,
            };
            let mut pool = a_pool.lock().unwrap();
            model.forward(&mut pool, &[step]).map(|_| Vec::new())
        }
        _ => Ok(prefill_rows(model, &b_prompt, LogitRows::Last)),
    });
    // The stale step and B's prefill in one pass, then B's decode step alone.
    assert_eq!(
        model.pass_counts(),
        Some(PassCounts {
            passes: 2,
            merged: 1
        })
    );
    match a_result {
        Err(Error::Kv(kv::Error::StaleGeneration { .. })) => {}
        other => panic!("expected StaleGeneration for the stale table, got {other:?}"),
    }
    let mut a_pool = a_pool.into_inner().unwrap();
    assert_eq!(
        snapshot(&mut a_pool, &reuser),
        before,
        "the refused caller's step wrote into the pages' new owner"
    );
    a_pool.release(reuser).unwrap();
    assert_whole(&a_pool);
    assert_same_bits(&b_result.expect("B's steps ran"), &b_alone, "B");
}

/// A caller that leads a pass waits for a caller whose pass has just ended, so that the
/// second's next step joins the first's pass instead of following it (an engine comes back
/// between steps). With the wait taken out, B's passes run alone and the counts say so.
#[test]
fn a_leader_waits_for_a_caller_whose_pass_just_ended() {
    // A grace far longer than the test's own pause, so the wait cannot time out first.
    let model = merging_model(Some(Duration::from_secs(30)));
    let prompts = [encode(A_PROMPT), encode(B_PROMPT)];
    let alone: Vec<_> = prompts
        .iter()
        .map(|prompt| prefill_rows(common::model(), prompt, LogitRows::Last))
        .collect();
    let (ended, a_ended) = std::sync::mpsc::channel();
    let b_done = std::sync::atomic::AtomicBool::new(false);
    let (a_again, b_merged) = std::thread::scope(|scope| {
        let (model, prompts, b_done) = (&model, &prompts, &b_done);
        let a = scope.spawn(move || {
            let first = prefill_rows(model, &prompts[0], LogitRows::Last);
            ended.send(()).unwrap();
            // B leads meanwhile: come back once its pass is queued (and waiting for this
            // caller), or has run without waiting.
            let deadline = Instant::now() + Duration::from_secs(60);
            while model.queued_passes() == 0 && !b_done.load(Ordering::SeqCst) {
                assert!(Instant::now() < deadline, "B never queued");
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(50));
            let again = prefill_rows(model, &prompts[0], LogitRows::Last);
            (first, again)
        });
        let b = scope.spawn(move || {
            a_ended.recv().unwrap();
            let rows = prefill_rows(model, &prompts[1], LogitRows::Last);
            b_done.store(true, Ordering::SeqCst);
            rows
        });
        let (first, again) = a.join().expect("A");
        assert_same_bits(&first, &alone[0], "A's first pass");
        (again, b.join().expect("B"))
    });
    // A's prefill and decode alone, then B's prefill with A's second, and their decode steps.
    assert_eq!(
        model.pass_counts(),
        Some(PassCounts {
            passes: 4,
            merged: 2
        }),
        "B's pass waited for A's next one and ran it too"
    );
    assert_same_bits(&a_again, &alone[0], "A's second pass");
    assert_same_bits(&b_merged, &alone[1], "B");
}

/// A merged pass that panics (planted) after taking two callers' parts ends its lead: the
/// leader's panic reaches its own caller, the other caller gets `MergedPassFailed` instead of
/// waiting for ever, both pools are whole, and the model's next pass runs.
#[test]
fn a_merged_pass_that_panics_fails_the_other_caller_and_the_next_pass_runs() {
    let model = merging_model(None);
    let prompts = [encode(A_PROMPT), encode(B_PROMPT)];
    let alone = prefill_rows(common::model(), &prompts[0], LogitRows::Last);
    model.panic_in_next_pass();
    let outcomes = run_together(&model, |model, i| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            try_prefill_rows(model, &prompts[i], LogitRows::Last)
        }))
    });
    let panicked = outcomes.iter().filter(|o| o.is_err()).count();
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Err(Error::MergedPassFailed))))
        .count();
    assert_eq!(
        (panicked, failed),
        (1, 1),
        "the leader panics, the other caller gets MergedPassFailed: {:?}",
        outcomes
            .iter()
            .map(|o| o.as_ref().map(|r| r.as_ref().err()))
            .collect::<Vec<_>>()
    );
    assert_same_bits(
        &prefill_rows(&model, &prompts[0], LogitRows::Last),
        &alone,
        "the pass after",
    );
}
