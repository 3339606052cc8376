//! The isolation matrix (TEST-MATRIX.md groups T, L, A, P; SECURITY.md maps each case): a
//! disaggregated cluster on loopback TCP running the oracle model, two tenants, faults
//! planted in the workers (`fault-injection`, on in test builds only), and for every case the
//! exact outcome of the faulty request, oracle-exact answers for every other request, and
//! every pool back to all-free afterwards (I9).
//!
//! The oracle answers a request by echoing its own prompt when it read only its own KV, and
//! by echoing what it read otherwise, so "oracle-exact" is a string compare and a leak shows
//! the other tenant's marker in the text.

use crate::harness::{
    self, post_raw, wait_idle, Answer, Backend, KvTransport, Mode, Options, KV_TRANSPORTS, MODEL,
};
use model::OracleModel;
use std::time::Duration;
use transfer::Role;
use worker::{Fault, FaultPlan, When};

const KEYS: &str = "[tenants.alice]\nkeys = [\"sk-alice-0123456789\"]\n\
                    [tenants.bob]\nkeys = [\"sk-bob-0123456789\"]\n";
const ALICE: Tenant = Tenant {
    key: "sk-alice-0123456789",
    marker: "ALICEMARK",
};
const BOB: Tenant = Tenant {
    key: "sk-bob-0123456789",
    marker: "BOBMARK",
};
const MAX_TOKENS: usize = 24;

#[derive(Clone, Copy, Debug)]
struct Tenant {
    key: &'static str,
    marker: &'static str,
}

impl Tenant {
    fn other(self) -> Tenant {
        if self.marker == ALICE.marker {
            BOB
        } else {
            ALICE
        }
    }

    /// A prompt of about `words` words, the tenant's marker in every other word.
    fn prompt(self, index: usize, words: usize) -> String {
        (0..words)
            .map(|w| {
                if w % 2 == 0 {
                    format!("{}{index}", self.marker)
                } else {
                    ["kiwi", "plum", "fig", "lime"][w % 4].to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// One request's outcome, with what the oracle says it must be if it succeeds.
#[derive(Debug)]
struct Outcome {
    tenant: Tenant,
    answer: Answer,
    expected: String,
}

impl Outcome {
    fn text(&self) -> String {
        self.answer.json()["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Never a 200 that is not exactly the oracle's answer, never another tenant's marker.
    fn assert_clean(&self) {
        let foreign = self.tenant.other().marker;
        assert!(
            !self.answer.body.contains(foreign),
            "LEAK: {foreign} in an answer to {:?}: {}",
            self.tenant,
            self.answer.body
        );
        if self.answer.status == 200 {
            assert_eq!(self.text(), self.expected, "200 but not oracle-exact");
        }
    }

    fn assert_exact(&self) {
        self.assert_clean();
        assert_eq!(self.answer.status, 200, "{}", self.answer.body);
    }
}

fn oracle_options() -> Options {
    let mut options = Options::new(Mode::Disaggregated);
    options.backend = Backend::Oracle;
    options.keys = Some(KEYS);
    options.context_length = Some(1024);
    // A small decode pool, so pages pass from tenant to tenant all the time.
    options.kv_tokens = 512;
    options.transfer_timeout = Duration::from_secs(5);
    // Poisoned pools: every free page holds the ghost value, so a read of a page nobody wrote
    // for this request shows in the answer.
    options.scrub_on_free = true;
    options
}

fn plan(faults: &[(Fault, When)]) -> FaultPlan {
    faults
        .iter()
        .fold(FaultPlan::none(), |plan, &(fault, when)| {
            plan.with(fault, when)
        })
}

fn expected_text(prompt: &str, max_tokens: usize) -> String {
    let tokenizer = harness::tokenizer();
    let ids = tokenizer.encode(prompt, false);
    let answer = OracleModel::expected(&ids, max_tokens, tokenizer.eos_id(), false);
    let bytes: Vec<u8> = answer
        .iter()
        .flat_map(|&id| tokenizer.token_bytes(id).to_vec())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn ask(url: &str, tenant: Tenant, prompt: String, max_tokens: usize) -> Outcome {
    let body = serde_json::json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    });
    let answer = post_raw(
        url,
        "/v1/completions",
        body.to_string().into_bytes(),
        Some(tenant.key),
    )
    .await;
    Outcome {
        tenant,
        answer,
        expected: expected_text(&prompt, max_tokens),
    }
}

/// `count` requests per tenant, all at once, with prompts of 20–60 words.
async fn burst(url: &str, count: usize, first_index: usize) -> Vec<Outcome> {
    let mut tasks = Vec::new();
    for i in first_index..first_index + count {
        for tenant in [ALICE, BOB] {
            let url = url.to_string();
            let words = 20 + (i * 7) % 40;
            tasks.push(tokio::spawn(async move {
                ask(&url, tenant, tenant.prompt(i, words), MAX_TOKENS).await
            }));
        }
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("request task"));
    }
    outcomes
}

async fn assert_idle(url: &str) {
    let (idle, metrics) = wait_idle(url).await;
    assert!(idle, "pools did not return to all-free (I9):\n{metrics}");
}

#[test]
fn clean_runs_are_oracle_exact_for_both_tenants() {
    let server = harness::start(oracle_options());
    harness::runtime().block_on(async {
        for outcome in burst(&server.url, 12, 0).await {
            outcome.assert_exact();
        }
        assert_idle(&server.url).await;
    });
}

/// T01–T10, T16 and a recycled page: the first transfer meets the fault, and gets exactly its
/// outcome; every other request, before and after, is oracle-exact; pools end all-free.
#[test]
fn each_transfer_fault_gets_its_outcome_and_spares_the_rest() {
    let ms = Duration::from_millis;
    // (case, role, fault, status of the faulty request)
    let cases: &[(&str, Role, Fault, u16)] = &[
        ("T01 drop a page", Role::Prefill, Fault::DropPage, 503),
        (
            "T02 duplicate a page",
            Role::Prefill,
            Fault::DuplicatePage,
            200,
        ),
        ("T04 reorder pages", Role::Prefill, Fault::Reorder, 200),
        (
            "T04 Done before the last page",
            Role::Prefill,
            Fault::DoneEarly,
            503,
        ),
        ("T05 flip a bit", Role::Prefill, Fault::CorruptPage, 503),
        (
            "T07 page names another tenant",
            Role::Prefill,
            Fault::ForeignPage,
            503,
        ),
        (
            "T08 truncated transfer",
            Role::Prefill,
            Fault::Truncate,
            503,
        ),
        (
            "T10 slow Done",
            Role::Prefill,
            Fault::DelayDone(ms(300)),
            200,
        ),
        (
            "T16 stalled ack",
            Role::Decode,
            Fault::StallAck(ms(300)),
            200,
        ),
        (
            "I1 page recycled mid-decode",
            Role::Decode,
            Fault::RecycleEarly,
            500,
        ),
    ];
    for (transport, &(case, role, fault, status)) in on_each_transport(cases) {
        let case = format!("{case} over {transport:?}");
        let mut options = oracle_options();
        options.kv_transport = transport;
        options.faults = vec![(role, plan(&[(fault, When::Nth(0))]))];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            // Long enough for several pages, so a middle page exists to lose or corrupt.
            let faulty = ask(&server.url, ALICE, ALICE.prompt(99, 60), MAX_TOKENS).await;
            faulty.assert_clean();
            assert_eq!(
                faulty.answer.status, status,
                "{case}: {}",
                faulty.answer.body
            );
            if status == 503 {
                assert_eq!(faulty.answer.code(), "kv_transfer_failed", "{case}");
            }
            for outcome in burst(&server.url, 4, 0).await {
                outcome.assert_exact();
            }
            assert_idle(&server.url).await;
        });
    }
}

/// Defense in depth against the incident: the planted bug swaps a prompt that does not fit
/// the prefill pool for a one-token placeholder and claims the transfer complete. Admission
/// stops it; without admission, decode's transfer verification (I4) stops it; without both,
/// the victim's KV is read and its marker comes back: the guards are what stop the leak.
#[test]
fn the_incident_is_stopped_by_admission_then_by_verification_and_leaks_without_them() {
    let incident = (Fault::Incident, When::Always);
    let no_admission = (Fault::NoAdmission, When::Always);
    let no_verify = (Fault::NoTransferVerify, When::Always);
    // (prefill's rules, decode's rules, the status Alice's request gets)
    type Rules<'a> = &'a [(Fault, When)];
    let stages: &[(Rules, Rules, u16)] = &[
        (&[incident], &[], 400),
        (&[incident, no_admission], &[], 503),
        (&[incident, no_admission], &[no_verify], 200),
    ];
    for (transport, (stage, &(prefill, decode, status))) in
        on_each_transport(&stages.iter().enumerate().collect::<Vec<_>>())
            .map(|(t, &(stage, rules))| (t, (stage, rules)))
    {
        let stage = format!("{stage} over {transport:?}");
        let mut options = oracle_options();
        options.kv_transport = transport;
        // The incident's setup: a prefill pool smaller than the context length, and pages
        // reused unscrubbed (the production default), so stale KV is another tenant's.
        options.prefill_kv_tokens = Some(128);
        options.scrub_on_free = false;
        options.faults = vec![(Role::Prefill, plan(prefill)), (Role::Decode, plan(decode))];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            // Bob's requests run first, so their pages are the ones reused next.
            for i in 0..3 {
                ask(&server.url, BOB, BOB.prompt(i, 40), MAX_TOKENS)
                    .await
                    .assert_exact();
            }
            // ~200 tokens: over the prefill pool of 128, within the context of 1024.
            let victim_reader = ask(&server.url, ALICE, ALICE.prompt(7, 100), MAX_TOKENS).await;
            let answer = &victim_reader.answer;
            assert_eq!(answer.status, status, "stage {stage}: {}", answer.body);
            match status {
                400 => assert_eq!(answer.code(), "context_length_exceeded"),
                503 => assert_eq!(answer.code(), "kv_transfer_failed"),
                _ => assert!(
                    answer.body.contains(BOB.marker),
                    "with every guard off the planted bug must leak Bob's KV into Alice's \
                     answer (or this test proves nothing): {}",
                    answer.body
                ),
            }
            if status != 200 {
                victim_reader.assert_clean();
                assert_idle(&server.url).await;
            }
        });
    }
}

/// P04/L: more requests than the decode pool holds at once queue for pages and all finish
/// oracle-exact; a request whose max_tokens can never fit the pool is refused up front (400),
/// before any allocation.
#[test]
fn pool_exhaustion_queues_and_an_impossible_max_tokens_is_refused() {
    let mut options = oracle_options();
    options.kv_tokens = 256;
    let server = harness::start(options);
    harness::runtime().block_on(async {
        let outcomes = burst(&server.url, 12, 0).await;
        for outcome in &outcomes {
            outcome.assert_exact();
        }
        let too_long = ask(&server.url, BOB, BOB.prompt(1, 10), 400).await;
        assert_eq!(too_long.answer.status, 400, "{}", too_long.answer.body);
        assert_eq!(too_long.answer.code(), "context_length_exceeded");
        // The prompt fits; max_tokens is what to change (A03).
        assert_eq!(too_long.answer.json()["error"]["param"], "max_tokens");
        assert_idle(&server.url).await;
    });
}

/// T19, the fault soup: a seeded mix of every transfer fault at a few percent, two tenants,
/// a small pool. Every answer is in its allowed set (200 oracle-exact, or 503/504 for a
/// broken transfer), both kinds happen (so the run is not vacuous), and pools end all-free.
#[test]
fn fault_soup_keeps_every_answer_in_its_allowed_set() {
    let seed: u64 = std::env::var("AIRLOCK_SOUP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2026);
    let prefill = "drop-page@4%;duplicate-page@4%;reorder@4%;done-early@4%;corrupt-page@4%;\
                   foreign-page@4%;truncate@4%;delay-done=40@4%";
    for transport in KV_TRANSPORTS {
        let mut options = oracle_options();
        options.kv_transport = transport;
        options.faults = vec![
            (
                Role::Prefill,
                FaultPlan::parse(prefill, seed).expect("plan"),
            ),
            (
                Role::Decode,
                FaultPlan::parse("stall-ack=40@5%", seed + 1).expect("plan"),
            ),
        ];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            let (mut ok, mut failed) = (0, 0);
            for round in 0..5 {
                for outcome in burst(&server.url, 10, round * 10).await {
                    outcome.assert_clean();
                    match outcome.answer.status {
                        200 => ok += 1,
                        503 | 504 => failed += 1,
                        other => panic!("seed {seed}: status {other}: {}", outcome.answer.body),
                    }
                }
            }
            assert!(
                ok > 0 && failed > 0,
                "seed {seed} over {transport:?}: {ok} ok, {failed} failed"
            );
            assert_idle(&server.url).await;
        });
    }
}

/// The canary side of the table above: the same transfer faults with decode's transfer
/// verification (I4) switched off are answered 200 from KV that is not the request's own, and
/// the oracle sees it. So I4 is what turned each of them into a clean 503.
#[test]
fn with_transfer_verification_off_the_same_faults_corrupt_answers() {
    let cases: &[(&str, Fault)] = &[
        ("T01 drop a page", Fault::DropPage),
        ("T04 Done before the last page", Fault::DoneEarly),
        ("T05 flip a bit", Fault::CorruptPage),
        ("T08 truncated transfer", Fault::Truncate),
    ];
    for (transport, &(case, fault)) in on_each_transport(cases) {
        let case = format!("{case} over {transport:?}");
        let mut options = oracle_options();
        options.kv_transport = transport;
        options.faults = vec![
            (Role::Prefill, plan(&[(fault, When::Nth(0))])),
            (
                Role::Decode,
                plan(&[(Fault::NoTransferVerify, When::Always)]),
            ),
        ];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            let faulty = ask(&server.url, ALICE, ALICE.prompt(99, 60), MAX_TOKENS).await;
            assert_eq!(faulty.answer.status, 200, "{case}: {}", faulty.answer.body);
            assert_ne!(
                faulty.text(),
                faulty.expected,
                "{case}: with I4 off the fault must show in the answer, or the test proves \
                 nothing"
            );
        });
    }
}

/// Sends a completion and gives up (dropping the connection) after `leave_after`.
async fn ask_and_leave(
    url: &str,
    tenant: Tenant,
    prompt: String,
    max_tokens: usize,
    stream: bool,
    leave_after: Duration,
) -> Option<Outcome> {
    let body = serde_json::json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    });
    let client = reqwest::Client::builder()
        .timeout(leave_after)
        .build()
        .expect("client");
    let sent = client
        .post(format!("{url}/v1/completions"))
        .bearer_auth(tenant.key)
        .json(&body)
        .send()
        .await
        .ok()?;
    let status = sent.status().as_u16();
    let body = sent.text().await.ok()?;
    Some(Outcome {
        tenant,
        answer: Answer { status, body },
        expected: expected_text(&prompt, max_tokens),
    })
}

/// L01–L04: a client that goes away while its request waits for pages, prefills, is in
/// transfer or decodes leaves no page behind on any worker (I9), and the requests around it
/// stay oracle-exact. Slow steps and a held-back `Done` (planted delays) widen each window.
#[test]
fn a_client_leaving_at_any_phase_leaves_no_page_behind() {
    let leave = Duration::from_millis(150);
    // (case, prefill faults, decode faults, decode pool, prompt words, max_tokens, stream)
    let cases: &[(&str, &str, &str, usize, usize, usize, bool)] = &[
        (
            "L01 queued for pages",
            "",
            "slow-step=10",
            256,
            20,
            100,
            false,
        ),
        ("L02 mid-prefill", "slow-step=100", "", 2048, 200, 4, false),
        ("L03 mid-transfer", "delay-done=400", "", 512, 60, 4, false),
        ("L04 mid-decode", "", "slow-step=20", 512, 10, 200, true),
    ];
    for (transport, &(case, prefill, decode, kv_tokens, words, max_tokens, stream)) in
        on_each_transport(cases)
    {
        let case = format!("{case} over {transport:?}");
        let mut options = oracle_options();
        options.kv_transport = transport;
        options.kv_tokens = kv_tokens;
        options.faults = vec![
            (Role::Prefill, FaultPlan::parse(prefill, 1).expect("plan")),
            (Role::Decode, FaultPlan::parse(decode, 1).expect("plan")),
        ];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            let url = server.url.clone();
            // L01 needs the pool busy first: Bob holds most of it while Alice waits.
            let holder = tokio::spawn(async move { ask(&url, BOB, BOB.prompt(1, 20), 100).await });
            if case.starts_with("L01") {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let left = ask_and_leave(
                &server.url,
                ALICE,
                ALICE.prompt(2, words),
                max_tokens,
                stream,
                leave,
            )
            .await;
            assert!(
                left.is_none(),
                "{case}: the request finished before the client left: {left:?}"
            );
            holder.await.expect("task").assert_exact();
            for outcome in burst(&server.url, 2, 0).await {
                outcome.assert_exact();
            }
            assert_idle(&server.url).await;
        });
    }
}

/// L05: clients give up at every moment around completion (the abort races the last token,
/// the transfer's end, the answer). Each request ends once: exact, or gone; every page comes
/// back.
#[test]
fn aborts_racing_completion_free_every_page_exactly_once() {
    for transport in KV_TRANSPORTS {
        let mut options = oracle_options();
        options.kv_transport = transport;
        options.faults = vec![
            (
                Role::Prefill,
                FaultPlan::parse("slow-step=1", 1).expect("plan"),
            ),
            (
                Role::Decode,
                FaultPlan::parse("slow-step=2", 1).expect("plan"),
            ),
        ];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            let mut tasks = Vec::new();
            for i in 0..48 {
                let url = server.url.clone();
                let tenant = if i % 2 == 0 { ALICE } else { BOB };
                let leave = Duration::from_millis(5 + (i as u64 * 37) % 300);
                tasks.push(tokio::spawn(async move {
                    ask_and_leave(
                        &url,
                        tenant,
                        tenant.prompt(i, 30),
                        MAX_TOKENS,
                        i % 3 == 0,
                        leave,
                    )
                    .await
                }));
            }
            let (mut finished, mut left) = (0, 0);
            for task in tasks {
                match task.await.expect("task") {
                    Some(outcome) if outcome.answer.body.starts_with("data:") => {
                        assert_eq!(outcome.answer.status, 200);
                        assert!(!outcome.answer.body.contains(outcome.tenant.other().marker));
                        finished += 1;
                    }
                    Some(outcome) => {
                        outcome.assert_exact();
                        finished += 1;
                    }
                    None => left += 1,
                }
            }
            assert!(
                finished > 0 && left > 0,
                "over {transport:?}: {finished} finished, {left} left: no race"
            );
            assert_idle(&server.url).await;
            for outcome in burst(&server.url, 2, 100).await {
                outcome.assert_exact();
            }
        });
    }
}

/// I11: error answers, the metrics page and worker messages carry no prompt text, so no
/// tenant's words reach anyone through an error path.
#[test]
fn error_answers_and_metrics_never_carry_prompt_text() {
    let mut options = oracle_options();
    options.faults = vec![(Role::Prefill, plan(&[(Fault::CorruptPage, When::Nth(0))]))];
    let server = harness::start(options);
    harness::runtime().block_on(async {
        let url = &server.url;
        let secret = "SECRETWORD";
        let prompt = |words| format!("{secret} ").repeat(words);
        let transfer_failed = ask(url, ALICE, prompt(60), MAX_TOKENS).await;
        assert_eq!(
            transfer_failed.answer.status, 503,
            "{}",
            transfer_failed.answer.body
        );
        let over_context = ask(url, ALICE, prompt(2000), MAX_TOKENS).await;
        assert_eq!(over_context.answer.status, 400);
        // The prompt alone is over the limit: it is what to change (A01).
        assert_eq!(over_context.answer.json()["error"]["param"], "prompt");
        let bad_max_tokens = post_raw(
            url,
            "/v1/completions",
            serde_json::json!({"model": MODEL, "prompt": prompt(3), "max_tokens": -1})
                .to_string()
                .into_bytes(),
            Some(ALICE.key),
        )
        .await;
        assert_eq!(bad_max_tokens.status, 400);
        let bad_key = post_raw(
            url,
            "/v1/completions",
            serde_json::json!({"model": MODEL, "prompt": prompt(3)})
                .to_string()
                .into_bytes(),
            Some("sk-nobody-0123456789"),
        )
        .await;
        assert_eq!(bad_key.status, 401);
        let metrics = harness::metrics(url).await;
        for (what, text) in [
            ("transfer failure", &transfer_failed.answer.body),
            ("context error", &over_context.answer.body),
            ("max_tokens error", &bad_max_tokens.body),
            ("auth error", &bad_key.body),
            ("metrics", &metrics),
        ] {
            assert!(!text.contains(secret), "{what} carries prompt text: {text}");
        }
    });
}

/// A prefill that takes longer than the transfer timeout to run its prompt (queued, or a long
/// prompt on a busy machine) still gets its transfer through: the transfer's clock starts at
/// its first frame, not at decode's reservation. `Done` is held back a little so decode's
/// timeout check runs between the first page and `Done`. (Found by `airlock canary` under
/// load: 34 of 839 requests got 504.)
#[test]
fn a_slow_prefill_does_not_use_up_the_transfer_timeout() {
    for transport in KV_TRANSPORTS {
        let mut options = oracle_options();
        options.kv_transport = transport;
        options.transfer_timeout = Duration::from_millis(800);
        options.faults = vec![(
            Role::Prefill,
            FaultPlan::parse("slow-step=1200;delay-done=200", 1).expect("plan"),
        )];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            ask(&server.url, ALICE, ALICE.prompt(1, 20), 4)
                .await
                .assert_exact();
            assert_idle(&server.url).await;
        });
    }
}

/// Every case of `cases` on each transport.
fn on_each_transport<T>(cases: &[T]) -> impl Iterator<Item = (KvTransport, &T)> {
    KV_TRANSPORTS
        .into_iter()
        .flat_map(move |transport| cases.iter().map(move |case| (transport, case)))
}

/// T16/T17 on the one-sided transport (the formal model's `AbortAckBeforeQuiescence` and
/// `ImmediateRelease` mutants, run against the code): Alice's transfer is aborted while its
/// page writes are held back 2 s past the abort. With the guards on, decode keeps her pages
/// quarantined until prefill answers that its writes have landed, and Bob, admitted at once,
/// gets other pages and an exact answer. Either guard off frees her pages while the writes
/// are still coming: Bob's pages are the freed ones (the pool hands out the most recently
/// freed first), the late writes land in his KV while he decodes, and his answer is not his.
#[test]
fn writes_held_past_an_abort_keep_their_pages_quarantined_and_corrupt_without_the_guards() {
    // (case, prefill faults, decode faults, Bob's answer is exact)
    let cases: &[(&str, &str, &str, bool)] = &[
        ("guards on", "delay-writes=2000@0", "slow-step=15", true),
        (
            "prefill answers WriteAbort before its writes land",
            "delay-writes=2000@0;abort-ack-early",
            "slow-step=15",
            false,
        ),
        (
            "decode frees a written reservation at once",
            "delay-writes=2000@0",
            "slow-step=15;no-write-quarantine",
            false,
        ),
    ];
    for &(case, prefill, decode, exact) in cases {
        let mut options = oracle_options();
        options.kv_transport = KvTransport::Shm;
        options.faults = vec![
            (Role::Prefill, FaultPlan::parse(prefill, 1).expect("plan")),
            (Role::Decode, FaultPlan::parse(decode, 1).expect("plan")),
        ];
        let server = harness::start(options);
        harness::runtime().block_on(async {
            let url = &server.url;
            // Alice's pages are granted and her writes posted at once, then held back; she
            // leaves well before they land.
            let prompt = ALICE.prompt(1, 30);
            let left = ask_and_leave(url, ALICE, prompt, 4, false, ms(400)).await;
            assert!(left.is_none(), "{case}: Alice's transfer ended: {left:?}");
            // Bob comes after the abort has run its course (the same wait in every case, well
            // inside the 2 s): with the guards, her pages are still quarantined; without,
            // they are free and his.
            let quarantined = peak_quarantined(url, ms(600)).await;
            if exact {
                assert!(
                    quarantined > 0.0,
                    "{case}: decode must hold Alice's pages until prefill's writes land"
                );
            }
            let bob = ask(url, BOB, BOB.prompt(2, 10), 120).await;
            if exact {
                bob.assert_exact();
            } else {
                assert_eq!(bob.answer.status, 200, "{case}: {}", bob.answer.body);
                assert_ne!(
                    bob.text(),
                    bob.expected,
                    "{case}: the late writes must show in Bob's answer, or this test proves \
                     nothing"
                );
            }
            assert_idle(url).await;
        });
    }
}

/// A one-sided writer that reports a page's write twice (`report-twice`: it broke the rule
/// that lets decode hash a page when its write is reported): decode refuses the transfer as
/// it would a bad page frame, quarantines the reservation until the writer's posted writes
/// are over, and the request gets its 503. Every request after it is oracle-exact, and the
/// pools end all-free.
#[test]
fn a_write_reported_twice_fails_its_transfer_and_spares_the_rest() {
    let mut options = oracle_options();
    options.kv_transport = KvTransport::Shm;
    options.faults = vec![(
        Role::Prefill,
        FaultPlan::parse("report-twice@0", 1).expect("plan"),
    )];
    let server = harness::start(options);
    harness::runtime().block_on(async {
        let faulty = ask(&server.url, ALICE, ALICE.prompt(99, 60), MAX_TOKENS).await;
        faulty.assert_clean();
        assert_eq!(faulty.answer.status, 503, "{}", faulty.answer.body);
        assert_eq!(faulty.answer.code(), "kv_transfer_failed");
        for outcome in burst(&server.url, 4, 0).await {
            outcome.assert_exact();
        }
        assert_idle(&server.url).await;
    });
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// The most pages decode's pool reported quarantined over `window`.
async fn peak_quarantined(url: &str, window: Duration) -> f64 {
    let start = std::time::Instant::now();
    let mut peak: f64 = 0.0;
    while start.elapsed() < window {
        let metrics = harness::metrics(url).await;
        for (labels, value) in harness::samples(&metrics, "airlock_kv_pages_quarantined") {
            if labels.contains("role=\"decode\"") {
                peak = peak.max(value);
            }
        }
        tokio::time::sleep(ms(20)).await;
    }
    peak
}
