//! Shared prefix pages with the real model: the K/V of a prompt is the same bytes however it
//! was computed (whole, in chunks, or after a cached prefix, beside other sequences), which is
//! what lets decode check a delta transfer's checksum over pages it cached earlier; and no
//! step writes into a shared page.

use crate::common::{model, owner, pool, snapshot, tokenizer, PAGE_SIZE};
use kv::{Partition, PrefixCache, TenantId};
use model::SeqStep;

/// Runs `tokens` at positions `start..` of `table` in steps of `chunk`, each beside
/// `neighbour`'s one decode token, so the batch differs from a lone prompt.
fn prefill(
    pool: &mut kv::PagePool,
    table: &kv::PageTable,
    tokens: &[u32],
    start: usize,
    chunk: usize,
    neighbour: Option<(&kv::PageTable, u32, usize)>,
) {
    let mut done = 0;
    while done < tokens.len() {
        let count = chunk.min(tokens.len() - done);
        let mut steps = vec![SeqStep {
            table,
            tokens: &tokens[done..done + count],
            start_pos: start + done,
            logits: model::LogitRows::None,
        }];
        let neighbour_token;
        if let Some((other, token, position)) = neighbour {
            neighbour_token = [token];
            steps.push(SeqStep {
                table: other,
                tokens: &neighbour_token,
                start_pos: position,
                logits: model::LogitRows::Last,
            });
        }
        model().forward(pool, &steps).expect("forward");
        done += count;
    }
}

fn prompt() -> Vec<u32> {
    let text: String = (1..=4)
        .map(|day| {
            format!(
                "On day {day} the quick brown fox jumps over the lazy dog while the cat, \
                 unimpressed, watches from the windowsill and plans its own escape. "
            )
        })
        .collect();
    let mut tokens = tokenizer().encode(&text, true);
    tokens.truncate(tokens.len() / PAGE_SIZE * PAGE_SIZE);
    assert!(tokens.len() >= 4 * PAGE_SIZE, "{} tokens", tokens.len());
    tokens
}

#[test]
fn a_prompts_kv_is_the_same_bytes_however_it_was_computed() {
    let prompt = prompt();
    let mut pool = pool(8 * prompt.len());
    let whole = pool.allocate(owner(1, 1), prompt.len()).expect("pages");
    prefill(&mut pool, &whole, &prompt, 0, prompt.len(), None);
    let chunked = pool.allocate(owner(1, 2), prompt.len()).expect("pages");
    prefill(&mut pool, &chunked, &prompt, 0, 7, None);
    assert_eq!(snapshot(&mut pool, &whole), snapshot(&mut pool, &chunked));

    // Publish the first two pages, then compute the rest after them, beside another sequence.
    let mut cache = PrefixCache::new(PAGE_SIZE);
    let mut published = whole.clone();
    let two_pages = &prompt[..2 * PAGE_SIZE];
    cache.publish(&mut pool, &mut published, Partition(0), two_pages);
    assert_eq!(published.shared_pages(), 2);
    let hit = cache.lookup(TenantId(1), Partition(0), &prompt, &pool);
    assert_eq!(hit.page_count(), 2);
    let after_cache = pool
        .allocate_with_prefix(owner(1, 3), &hit, prompt.len())
        .expect("pages");
    let neighbour = pool.allocate(owner(2, 4), PAGE_SIZE).expect("pages");
    prefill(&mut pool, &neighbour, &prompt[..3], 0, 3, None);
    let shared_tokens = 2 * PAGE_SIZE;
    prefill(
        &mut pool,
        &after_cache,
        &prompt[shared_tokens..],
        shared_tokens,
        5,
        Some((&neighbour, prompt[3], 3)),
    );
    assert_eq!(
        snapshot(&mut pool, &published),
        snapshot(&mut pool, &after_cache)
    );
}

#[test]
fn a_step_that_would_write_into_a_shared_page_is_refused() {
    let prompt = prompt();
    let mut pool = pool(4 * prompt.len());
    let mut first = pool.allocate(owner(1, 1), prompt.len()).expect("pages");
    prefill(&mut pool, &first, &prompt, 0, prompt.len(), None);
    let mut cache = PrefixCache::new(PAGE_SIZE);
    cache.publish(&mut pool, &mut first, Partition(0), &prompt);
    let hit = cache.lookup(TenantId(1), Partition(0), &prompt, &pool);
    let second = pool
        .allocate_with_prefix(owner(1, 2), &hit, prompt.len() + 1)
        .expect("pages");
    let before = snapshot(&mut pool, &second);
    // Position 1 lies in the first shared page.
    let step = SeqStep {
        table: &second,
        tokens: &prompt[1..3],
        start_pos: 1,
        logits: model::LogitRows::Last,
    };
    let error = model().forward(&mut pool, &[step]).unwrap_err();
    assert!(
        matches!(
            error,
            model::Error::Kv(kv::Error::WriteToShared { position: 1, .. })
        ),
        "{error:?}"
    );
    assert_eq!(
        snapshot(&mut pool, &second),
        before,
        "no shared byte changed"
    );
    // Past the shared pages it runs.
    let step = SeqStep {
        table: &second,
        tokens: &prompt[prompt.len() - 1..],
        start_pos: prompt.len(),
        logits: model::LogitRows::Last,
    };
    model()
        .forward(&mut pool, &[step])
        .expect("a write past the shared pages");
}
