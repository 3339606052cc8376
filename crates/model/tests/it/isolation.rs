//! I1 (a forward pass reads or writes a page only if the table's owner and generation match the
//! page's header) through `Model::forward`, I9 (the pool is whole again once everything is
//! released), and that sequences in one batched step do not mix.

use crate::common::{self, max_abs_diff, owner, snapshot, PAGE_SIZE};
use kv::{Generation, PageId, PagePool, PageState, PageTable};
use model::{Error, SeqStep};

fn encode(text: &str) -> Vec<u32> {
    common::tokenizer().encode(text, false)
}

const A_PROMPT: &str = "Tenant A's launch code is 4711-ALPHA; never tell anyone.";
const B_PROMPT: &str = "Tenant B keeps a shopping list: apples, pears, bread and milk.";

/// Room for each request: its prompt plus a few decode steps, three pages.
const REQUEST_TOKENS: usize = 3 * PAGE_SIZE;

/// A pool of 16 pages.
fn small_pool() -> PagePool {
    common::pool(16 * PAGE_SIZE)
}

/// Prefills `prompt` into `table` from position 0.
fn prefill(pool: &mut PagePool, table: &PageTable, prompt: &[u32]) -> Vec<f32> {
    assert!(prompt.len() + 4 <= REQUEST_TOKENS, "prompt fits the table");
    let step = SeqStep {
        table,
        tokens: prompt,
        start_pos: 0,
        logits: model::LogitRows::Last,
    };
    let logits = common::model()
        .forward(pool, &[step])
        .unwrap_or_else(|e| panic!("prefill: {e}"));
    assert_eq!(logits.len(), 1);
    logits[0].to_vec()
}

/// One decode step of `token` at `pos`.
fn decode(pool: &mut PagePool, table: &PageTable, token: u32, pos: usize) -> Vec<f32> {
    let step = SeqStep {
        table,
        tokens: &[token],
        start_pos: pos,
        logits: model::LogitRows::Last,
    };
    common::model()
        .forward(pool, &[step])
        .unwrap_or_else(|e| panic!("decode: {e}"))[0]
        .to_vec()
}

/// A forward step by `table` that must be refused; returns the error.
fn refused(pool: &mut PagePool, steps: &[SeqStep]) -> Error {
    match common::model().forward(pool, steps) {
        Ok(_) => panic!("a forward step over pages the tables do not own succeeded"),
        Err(e) => e,
    }
}

/// I9: every table released, the pool is back to all pages free and consistent.
fn release_all_and_check_pool_is_whole(pool: &mut PagePool, tables: Vec<PageTable>) {
    for table in tables {
        pool.release(table).expect("release");
    }
    pool.check_invariants();
    assert_eq!(pool.pages_free(), pool.page_count(), "pages leaked (I9)");
    assert_eq!(pool.pages_in_state(PageState::Free), pool.page_count());
}

fn page_ids(table: &PageTable) -> Vec<PageId> {
    table.pages().iter().map(|&(page, _)| page).collect()
}

#[test]
fn stale_table_of_a_released_request_is_refused_and_writes_nothing_into_the_new_owners_pages() {
    let mut pool = small_pool();
    let (a_prompt, b_prompt) = (encode(A_PROMPT), encode(B_PROMPT));

    let a = pool.allocate(owner(1, 10), REQUEST_TOKENS).unwrap();
    let a_logits = prefill(&mut pool, &a, &a_prompt);
    let a_stale = a.clone();
    pool.release(a).unwrap();

    // The LIFO free list hands A's pages straight to B, in the same order, one generation on.
    let b = pool.allocate(owner(2, 20), REQUEST_TOKENS).unwrap();
    assert_eq!(page_ids(&b), page_ids(&a_stale), "B reuses A's pages");
    for (&(_, a_gen), &(_, b_gen)) in a_stale.pages().iter().zip(b.pages()) {
        assert!(b_gen > a_gen, "reallocation bumps the generation");
    }
    prefill(&mut pool, &b, &b_prompt);
    let b_before = snapshot(&mut pool, &b);
    let free_before = pool.pages_free();

    let next_a = common::top_k(&a_logits, 1)[0];
    let attacks: [(&[u32], usize); 3] = [
        (&[next_a], a_prompt.len()), // A decodes on as if nothing happened
        (&a_prompt, 0),              // A re-prefills its whole prompt
        (&[next_a], 0),              // A writes slot 0 of B's first page
    ];
    for (tokens, start_pos) in attacks {
        let step = SeqStep {
            table: &a_stale,
            tokens,
            start_pos,
            logits: model::LogitRows::Last,
        };
        match refused(&mut pool, &[step]) {
            Error::Kv(kv::Error::StaleGeneration {
                page,
                expected,
                found,
            }) => {
                assert_eq!(page, a_stale.pages()[0].0);
                assert_eq!(expected, a_stale.pages()[0].1);
                assert_eq!(found, b.pages()[0].1);
            }
            other => panic!("expected StaleGeneration, got {other:?}"),
        }
        assert_eq!(
            snapshot(&mut pool, &b),
            b_before,
            "a refused step changed B's KV bytes"
        );
        assert_eq!(pool.pages_free(), free_before);
    }

    // Control: a legitimate step by B does change B's bytes, so the snapshot would have seen
    // a write by the stale table.
    decode(&mut pool, &b, next_a, b_prompt.len());
    assert_ne!(
        snapshot(&mut pool, &b),
        b_before,
        "B's own step writes its KV"
    );

    release_all_and_check_pool_is_whole(&mut pool, vec![b]);
}

#[test]
fn forged_table_naming_the_victims_pages_and_generations_under_another_owner_is_refused() {
    let mut pool = small_pool();
    let attacker = owner(1, 11);
    let victim = owner(2, 21);
    let a = pool.allocate(attacker, REQUEST_TOKENS).unwrap();
    let b = pool.allocate(victim, REQUEST_TOKENS).unwrap();
    prefill(&mut pool, &a, &encode(A_PROMPT));
    prefill(&mut pool, &b, &encode(B_PROMPT));
    let (a_before, b_before) = (snapshot(&mut pool, &a), snapshot(&mut pool, &b));
    let token = encode(" code")[0];

    // All of B's pages, B's current generations, A's name.
    let forged = PageTable::forge(attacker, b.pages().to_vec());
    // A's own pages with one of B's slipped in after them.
    let mut mixed = a.pages().to_vec();
    mixed.push(b.pages()[0]);
    let mixed = PageTable::forge(attacker, mixed);

    for (table, start_pos) in [(&forged, 0), (&forged, 20), (&mixed, 3 * PAGE_SIZE + 1)] {
        let step = SeqStep {
            table,
            tokens: &[token],
            start_pos,
            logits: model::LogitRows::Last,
        };
        match refused(&mut pool, &[step]) {
            Error::Kv(kv::Error::OwnerMismatch {
                page,
                expected,
                found,
            }) => {
                assert_eq!(page, b.pages()[0].0);
                assert_eq!(expected, kv::Holder::Request(attacker));
                assert_eq!(found, Some(kv::Holder::Request(victim)));
            }
            other => panic!("expected OwnerMismatch, got {other:?}"),
        }
    }
    assert_eq!(snapshot(&mut pool, &b), b_before, "B's KV bytes changed");
    assert_eq!(snapshot(&mut pool, &a), a_before, "A's KV bytes changed");
    release_all_and_check_pool_is_whole(&mut pool, vec![a, b]);
}

#[test]
fn table_naming_a_released_or_unknown_page_is_refused() {
    let mut pool = small_pool();
    let keeper = pool.allocate(owner(3, 30), REQUEST_TOKENS).unwrap();
    let c = pool.allocate(owner(4, 40), REQUEST_TOKENS).unwrap();
    prefill(&mut pool, &c, &encode(A_PROMPT));
    let c_kept = c.clone();
    let released = page_ids(&c);
    pool.release(c).unwrap();
    let free_before = pool.pages_free();
    let token = encode(" code")[0];

    let step = SeqStep {
        table: &c_kept,
        tokens: &[token],
        start_pos: 5,
        logits: model::LogitRows::Last,
    };
    match refused(&mut pool, &[step]) {
        // Release leaves the generation as it was and clears the owner.
        Error::Kv(kv::Error::OwnerMismatch {
            found: None, page, ..
        })
        | Error::Kv(kv::Error::PageNotReadable {
            state: PageState::Free,
            page,
        }) => assert_eq!(page, released[0]),
        other => panic!("expected a refusal of the freed page, got {other:?}"),
    }
    for page in &released {
        let header = pool.header(*page).unwrap();
        assert_eq!(
            header.state,
            PageState::Free,
            "refused step left {page:?} Free"
        );
        assert_eq!(header.holder, None);
    }
    assert_eq!(pool.pages_free(), free_before);

    let beyond = PageId(pool.page_count() as u32);
    let unknown = PageTable::forge(owner(3, 30), vec![(beyond, Generation(1))]);
    let step = SeqStep {
        table: &unknown,
        tokens: &[token],
        start_pos: 0,
        logits: model::LogitRows::Last,
    };
    match refused(&mut pool, &[step]) {
        Error::Kv(kv::Error::UnknownPage { page }) => assert_eq!(page, beyond),
        other => panic!("expected UnknownPage, got {other:?}"),
    }
    assert_eq!(pool.pages_free(), free_before);
    release_all_and_check_pool_is_whole(&mut pool, vec![keeper]);
}

#[test]
fn two_tables_sharing_a_page_in_one_batch_are_refused_with_duplicate_page() {
    let mut pool = small_pool();
    let b_owner = owner(2, 22);
    let b = pool.allocate(b_owner, REQUEST_TOKENS).unwrap();
    let other = pool.allocate(owner(5, 50), REQUEST_TOKENS).unwrap();
    let b_prompt = encode(B_PROMPT);
    prefill(&mut pool, &b, &b_prompt);
    let b_before = snapshot(&mut pool, &b);
    let token = [encode(" eggs")[0]];
    let pos = b_prompt.len();

    // The same owner's page named by a second table: each table verifies alone.
    let alias = PageTable::forge(b_owner, vec![b.pages()[pos / PAGE_SIZE]]);
    pool.verify_batch(&[&alias])
        .expect("the alias alone verifies");
    let cases: [[&PageTable; 2]; 3] = [[&b, &b], [&b, &alias], [&alias, &b]];
    for [first, second] in cases {
        let steps = [
            SeqStep {
                table: first,
                tokens: &token,
                start_pos: if first.pages().len() == 1 {
                    pos % PAGE_SIZE
                } else {
                    pos
                },
                logits: model::LogitRows::Last,
            },
            SeqStep {
                table: second,
                tokens: &token,
                start_pos: if second.pages().len() == 1 {
                    pos % PAGE_SIZE
                } else {
                    pos
                },
                logits: model::LogitRows::Last,
            },
        ];
        match refused(&mut pool, &steps) {
            Error::Kv(kv::Error::DuplicatePage { page }) => assert!(page_ids(&b).contains(&page)),
            other => panic!("expected DuplicatePage, got {other:?}"),
        }
        assert_eq!(snapshot(&mut pool, &b), b_before, "B's KV bytes changed");
    }
    // A batch with an innocent table and a duplicate is refused as a whole.
    let innocent = SeqStep {
        table: &other,
        tokens: &token,
        start_pos: 0,
        logits: model::LogitRows::Last,
    };
    let other_before = snapshot(&mut pool, &other);
    let dup = |table| SeqStep {
        table,
        tokens: &token,
        start_pos: pos,
        logits: model::LogitRows::Last,
    };
    match refused(&mut pool, &[innocent, dup(&b), dup(&b)]) {
        Error::Kv(kv::Error::DuplicatePage { .. }) => {}
        other => panic!("expected DuplicatePage, got {other:?}"),
    }
    assert_eq!(
        snapshot(&mut pool, &other),
        other_before,
        "refused batch wrote"
    );
    release_all_and_check_pool_is_whole(&mut pool, vec![b, other]);
}

/// Largest logit difference allowed between a sequence run alone and the same sequence run in
/// a batch with another one.
const BATCH_TOLERANCE: f32 = 1e-3;

#[test]
fn batched_step_gives_each_sequence_the_logits_it_gets_alone() {
    let mut pool = common::pool(64 * PAGE_SIZE);
    let prompts = [
        encode("The capital of France is"),
        encode("def fibonacci(n):\n    if n < 2:\n        return n\n"),
    ];
    assert_ne!(
        prompts[0].len(),
        prompts[1].len(),
        "sequences at different positions"
    );

    // Alone: each sequence prefilled and decoded one step in calls of its own.
    let mut alone_prefill = Vec::new();
    let mut alone_decode = Vec::new();
    let mut next = Vec::new();
    let mut alone_tables = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let table = pool.allocate(owner(1, i as u64), REQUEST_TOKENS).unwrap();
        let logits = prefill(&mut pool, &table, prompt);
        let token = common::top_k(&logits, 1)[0];
        alone_decode.push(decode(&mut pool, &table, token, prompt.len()));
        alone_prefill.push(logits);
        next.push(token);
        alone_tables.push(table);
    }
    assert!(
        max_abs_diff(&alone_decode[0], &alone_decode[1]) > 1.0,
        "the two sequences' logits differ, so mixing them would show"
    );

    // Batched: both prefills in one step, then both decodes in one step, with a third
    // sequence that asks for no logits placed between them.
    let tables: Vec<PageTable> = (0..3)
        .map(|i| pool.allocate(owner(2, i), REQUEST_TOKENS).unwrap())
        .collect();
    let filler = encode(B_PROMPT);
    let prefill_steps = [
        SeqStep {
            table: &tables[0],
            tokens: &prompts[0],
            start_pos: 0,
            logits: model::LogitRows::Last,
        },
        SeqStep {
            table: &tables[2],
            tokens: &filler,
            start_pos: 0,
            logits: model::LogitRows::None,
        },
        SeqStep {
            table: &tables[1],
            tokens: &prompts[1],
            start_pos: 0,
            logits: model::LogitRows::Last,
        },
    ];
    let batched_prefill = common::model()
        .forward(&mut pool, &prefill_steps)
        .expect("batched prefill");
    let decode_steps = [
        SeqStep {
            table: &tables[0],
            tokens: &next[0..1],
            start_pos: prompts[0].len(),
            logits: model::LogitRows::Last,
        },
        SeqStep {
            table: &tables[2],
            tokens: &next[0..1],
            start_pos: filler.len(),
            logits: model::LogitRows::None,
        },
        SeqStep {
            table: &tables[1],
            tokens: &next[1..2],
            start_pos: prompts[1].len(),
            logits: model::LogitRows::Last,
        },
    ];
    let batched_decode = common::model()
        .forward(&mut pool, &decode_steps)
        .expect("batched decode");
    assert_eq!(
        batched_prefill.len(),
        2,
        "logits only for steps that want them"
    );
    assert_eq!(
        batched_decode.len(),
        2,
        "logits only for steps that want them"
    );

    for i in 0..2 {
        let prefill_diff = max_abs_diff(&batched_prefill[i], &alone_prefill[i]);
        let decode_diff = max_abs_diff(&batched_decode[i], &alone_decode[i]);
        eprintln!(
            "sequence {i}: batched vs alone, max abs diff: prefill {prefill_diff}, \
             decode {decode_diff}"
        );
        assert!(
            prefill_diff <= BATCH_TOLERANCE,
            "sequence {i}: batched prefill logits differ from alone by {prefill_diff}"
        );
        assert!(
            decode_diff <= BATCH_TOLERANCE,
            "sequence {i}: batched decode logits differ from alone by {decode_diff}"
        );
    }
    let mut all = alone_tables;
    all.extend(tables);
    release_all_and_check_pool_is_whole(&mut pool, all);
}

/// A decode step with a row per sequence and rows enough for the threads (at least 4 on the
/// test model's 2) takes the fused per-row path: RoPE, K/V store, attention and quantization
/// in one task per sequence. Each sequence must get, bit for bit, the logits it gets decoding
/// alone (batch 1, the unfused path), at five different positions.
#[test]
fn fused_decode_step_gives_each_sequence_its_logits_alone_bit_for_bit() {
    let mut pool = common::pool(64 * PAGE_SIZE);
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "def fibonacci(n):",
        A_PROMPT,
        B_PROMPT,
        "One, two, three, four, five, six, seven,",
    ]
    .iter()
    .map(|text| encode(text))
    .collect();
    let run = |pool: &mut PagePool, tenant: u64, batched: bool| {
        let tables: Vec<PageTable> = (0..prompts.len())
            .map(|i| {
                pool.allocate(owner(tenant, i as u64), REQUEST_TOKENS)
                    .unwrap()
            })
            .collect();
        let next: Vec<u32> = prompts
            .iter()
            .zip(&tables)
            .map(|(prompt, table)| common::top_k(&prefill(pool, table, prompt), 1)[0])
            .collect();
        let logits: Vec<Vec<f32>> = if batched {
            let steps: Vec<SeqStep> = (0..prompts.len())
                .map(|i| SeqStep {
                    table: &tables[i],
                    tokens: &next[i..i + 1],
                    start_pos: prompts[i].len(),
                    logits: model::LogitRows::Last,
                })
                .collect();
            let logits = common::model()
                .forward(pool, &steps)
                .expect("batched decode");
            logits.rows().map(<[f32]>::to_vec).collect()
        } else {
            (0..prompts.len())
                .map(|i| decode(pool, &tables[i], next[i], prompts[i].len()))
                .collect()
        };
        (tables, logits)
    };
    let (alone_tables, alone) = run(&mut pool, 1, false);
    let (batched_tables, batched) = run(&mut pool, 2, true);
    assert_eq!(batched.len(), prompts.len());
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        let same_bits = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same_bits,
            "sequence {i}: batched decode differs from alone (max abs diff {})",
            max_abs_diff(a, b)
        );
    }
    assert!(
        max_abs_diff(&batched[0], &batched[1]) > 1.0,
        "the sequences' logits differ, so a mix-up would show"
    );
    let mut all = alone_tables;
    all.extend(batched_tables);
    release_all_and_check_pool_is_whole(&mut pool, all);
}

/// A step that starts past what its own table has written would attend over whatever its pages
/// hold. Pages are reused without zeroing, so a request that skips (or loses) its prefill
/// would be answered from the previous owner's KV, and the header check cannot see it: the
/// pages are now really the request's own. Before commit 4c4faa0 this step succeeded with
/// logits equal to A's continuation bit for bit; now `forward` must refuse it.
#[test]
fn step_past_written_tokens_is_refused_instead_of_reading_the_previous_owners_kv() {
    let mut pool = small_pool();
    let a_prompt = encode(A_PROMPT);
    let a = pool.allocate(owner(1, 12), REQUEST_TOKENS).unwrap();
    let a_logits = prefill(&mut pool, &a, &a_prompt);
    let next = common::top_k(&a_logits, 1)[0];
    let a_continuation = decode(&mut pool, &a, next, a_prompt.len());
    pool.release(a).unwrap();

    // B gets A's pages and, without any prefill of its own, steps at A's next position.
    let b = pool.allocate(owner(2, 23), REQUEST_TOKENS).unwrap();
    let step = SeqStep {
        table: &b,
        tokens: &[next],
        start_pos: a_prompt.len(),
        logits: model::LogitRows::Last,
    };
    match common::model().forward(&mut pool, &[step]) {
        Err(Error::UnwrittenPositions { start_pos, written }) => {
            assert_eq!(start_pos, a_prompt.len());
            assert_eq!(written, 0);
        }
        Ok(logits) => {
            let diff = max_abs_diff(&logits[0], &a_continuation);
            panic!(
                "a step past B's written tokens ran (logits vs A's continuation: max abs diff \
                 {diff}; 0 means B was answered from A's KV)"
            );
        }
        Err(other) => panic!("expected UnwrittenPositions, got {other:?}"),
    }

    // Writing from position 0 is always allowed, and then the next position is.
    prefill(&mut pool, &b, &encode(B_PROMPT));
    let b_len = encode(B_PROMPT).len();
    decode(&mut pool, &b, next, b_len);
    // A gap of one position inside B's own pages is refused as well.
    let step = SeqStep {
        table: &b,
        tokens: &[next],
        start_pos: b_len + 2,
        logits: model::LogitRows::Last,
    };
    match common::model().forward(&mut pool, &[step]) {
        Err(Error::UnwrittenPositions { start_pos, written }) => {
            assert_eq!((start_pos, written), (b_len + 2, b_len + 1));
        }
        other => panic!("expected UnwrittenPositions, got {other:?}"),
    }
    release_all_and_check_pool_is_whole(&mut pool, vec![b]);
}

/// Prefill attends in blocks of rows at consecutive positions of one sequence
/// (`KvHeadAttention::run_rows`, whose rows' bits the kernels' tests hold to a row alone).
/// Here through the model: two prompts prefilled together in one step, their blocks cut at
/// the sequences' boundary and crossing pages, give every row, bit for bit, the logits that
/// row gets when its sequence is fed one token per step (one row, the per-row path).
#[test]
fn prefill_in_row_blocks_gives_each_row_its_logits_one_token_at_a_time() {
    let text = "The committee met on Tuesday to review the budget, the schedule and the \
                open questions about the bridge. ";
    let prompts: Vec<Vec<u32>> = [150, 97]
        .iter()
        .map(|&n| {
            let tokens = encode(&text.repeat(8));
            assert!(tokens.len() >= n, "a prompt of {n} tokens");
            tokens[tokens.len() - n..].to_vec()
        })
        .collect();
    let room = 160;
    let mut pool = common::pool(4 * room);
    let together: Vec<PageTable> = (0..2)
        .map(|i| pool.allocate(owner(1, i), room).unwrap())
        .collect();
    let steps: Vec<SeqStep> = together
        .iter()
        .zip(&prompts)
        .map(|(table, prompt)| SeqStep {
            table,
            tokens: prompt,
            start_pos: 0,
            logits: model::LogitRows::Every,
        })
        .collect();
    let blocks = common::model()
        .forward(&mut pool, &steps)
        .expect("both prefills in one step");
    assert_eq!(blocks.len(), 150 + 97, "a row of logits per prompt token");
    let mut rows = blocks.rows();
    let mut tables = together.clone();
    for (i, prompt) in prompts.iter().enumerate() {
        let table = pool.allocate(owner(2, i as u64), room).unwrap();
        for (pos, &token) in prompt.iter().enumerate() {
            let alone = decode(&mut pool, &table, token, pos);
            let block = rows.next().expect("a row");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(block) == bits(&alone),
                "prompt {i} position {pos}: max abs diff {}",
                max_abs_diff(block, &alone)
            );
        }
        tables.push(table);
    }
    release_all_and_check_pool_is_whole(&mut pool, tables);
}

/// `serve`'s two engines share one set of compute threads (`Model::share_compute`): passes
/// from both, run at once from two threads, each get the logits they get alone, bit for bit.
#[test]
fn two_models_sharing_compute_threads_each_get_their_own_logits() {
    let mut second = common::another_model();
    second.share_compute(common::model().compute());
    assert!(std::sync::Arc::ptr_eq(
        &second.compute(),
        &common::model().compute()
    ));
    let prompts = [encode(A_PROMPT), encode(B_PROMPT)];
    let models = [common::model(), &second];
    let alone: Vec<Vec<f32>> = models
        .iter()
        .zip(&prompts)
        .map(|(model, prompt)| prefill_on(model, prompt))
        .collect();
    std::thread::scope(|scope| {
        for ((model, prompt), alone) in models.iter().zip(&prompts).zip(&alone) {
            scope.spawn(move || {
                for round in 0..8 {
                    let logits = prefill_on(model, prompt);
                    assert!(
                        logits
                            .iter()
                            .zip(alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "round {round}: max abs diff {}",
                        max_abs_diff(&logits, alone)
                    );
                }
            });
        }
    });
}

/// Prefills `prompt` on `model` in a pool of its own and returns the last row's logits; the
/// pool must be whole again afterwards.
fn prefill_on(model: &model::Model, prompt: &[u32]) -> Vec<f32> {
    let mut pool = common::pool_for(model, 4 * PAGE_SIZE);
    let table = pool.allocate(owner(7, 0), prompt.len()).unwrap();
    let step = SeqStep {
        table: &table,
        tokens: prompt,
        start_pos: 0,
        logits: model::LogitRows::Last,
    };
    let logits = model.forward(&mut pool, &[step]).expect("prefill")[0].to_vec();
    release_all_and_check_pool_is_whole(&mut pool, vec![table]);
    logits
}
