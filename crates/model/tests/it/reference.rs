//! Our engine against llama.cpp (llama-cpp-python, same GGUF, greedy), from
//! `tests/data/reference.json` and `tests/data/reference_logits/<name>.f32` at the workspace
//! root (made by scripts/reference/make_reference.py on an AVX2 machine), and the greedy tokens
//! of a second llama.cpp build (same version, compiled for AVX-512) in
//! `tests/data/reference_avx512/`; and a second set of six prompts (`tests/data/reference_more/`,
//! `make_reference.py --set more`, AVX-512 build, tokens only).
//!
//! These tests hold the fast kernels to llama.cpp up to near-ties; `exact.rs` holds the
//! `ggml-exact` kernels to the AVX-512 build bit for bit.

use crate::common::{self, max_abs_diff, top_k};
use gguf::ChatMessage;
use model::{Generated, SeqStep};
use serde_json::Value;
use std::fmt::Write as _;
use std::sync::OnceLock;

/// One reference prompt and what llama.cpp made of it.
struct Case {
    name: String,
    /// "plain" or "chat".
    mode: String,
    /// The text llama.cpp tokenized (for chat: the rendered template).
    prompt: String,
    /// Chat messages (chat mode only).
    messages: Vec<ChatMessage>,
    prompt_tokens: Vec<u32>,
    greedy_tokens: Vec<u32>,
    /// Reference logit gap between the best and second-best token at each greedy step.
    margins: Vec<f32>,
    /// Empty for a set made without logits files (`reference_more`).
    first_logits: Vec<f32>,
}

fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| load_cases("tests/data", true))
}

/// The second set: other prompts, greedy tokens and margins, no logits files.
fn more_cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| load_cases("tests/data/reference_more", false))
}

fn load_cases(folder: &str, with_logits: bool) -> Vec<Case> {
    let dir = common::workspace_root().join(folder);
    let path = dir.join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; it is made by scripts/reference/make_reference.py",
            path.display()
        )
    });
    let json: Value = serde_json::from_str(&text).expect("reference.json is JSON");
    let config = common::model().config();
    assert_eq!(
        json["n_vocab"].as_u64(),
        Some(config.vocab_size as u64),
        "reference was made with another vocabulary"
    );
    assert_eq!(
        json["eos_token_id"].as_u64(),
        Some(common::tokenizer().eos_id() as u64),
        "reference was made with another EOS token"
    );
    let ids = |v: &Value, what: &str| -> Vec<u32> {
        v.as_array()
            .unwrap_or_else(|| panic!("{what} is an array"))
            .iter()
            .map(|t| t.as_u64().expect("token id") as u32)
            .collect()
    };
    let cases: Vec<Case> = json["cases"]
        .as_array()
        .expect("cases is an array")
        .iter()
        .map(|c| {
            let name = c["name"].as_str().expect("name").to_string();
            let first_logits = if with_logits {
                read_logits(&dir, c, &name, config.vocab_size)
            } else {
                Vec::new()
            };
            let messages = match c.get("messages").and_then(Value::as_array) {
                Some(messages) => messages
                    .iter()
                    .map(|m| {
                        ChatMessage::new(
                            m["role"].as_str().expect("role"),
                            m["content"].as_str().expect("content"),
                        )
                    })
                    .collect(),
                None => Vec::new(),
            };
            let case = Case {
                mode: c["mode"].as_str().expect("mode").to_string(),
                prompt: c["prompt"].as_str().expect("prompt").to_string(),
                messages,
                prompt_tokens: ids(&c["prompt_tokens"], "prompt_tokens"),
                greedy_tokens: ids(&c["greedy_tokens"], "greedy_tokens"),
                margins: c["top1_top2_margins"]
                    .as_array()
                    .expect("margins")
                    .iter()
                    .map(|m| m.as_f64().expect("margin") as f32)
                    .collect(),
                first_logits,
                name,
            };
            assert_eq!(
                case.greedy_tokens.len(),
                64,
                "{}: 64 greedy tokens",
                case.name
            );
            assert!(
                matches!(case.mode.as_str(), "plain" | "chat"),
                "{}: unknown mode {}",
                case.name,
                case.mode
            );
            case
        })
        .collect();
    assert_eq!(cases.len(), 6, "{folder}/reference.json holds 6 prompts");
    cases
}

fn read_logits(dir: &std::path::Path, case: &Value, name: &str, vocab_size: usize) -> Vec<f32> {
    let path = dir.join(case["first_logits_file"].as_str().expect("logits file"));
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert_eq!(
        bytes.len(),
        4 * vocab_size,
        "{name}: logits file holds n_vocab f32"
    );
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Greedy decoding of 64 tokens from llama.cpp's prompt ids in `prefill_chunk`-token prefill
/// steps (0: the whole prompt in one step), one result per case.
fn greedy_runs(prefill_chunk: usize) -> Vec<Generated> {
    greedy_runs_of(cases(), prefill_chunk)
}

fn greedy_runs_of(cases: &[Case], prefill_chunk: usize) -> Vec<Generated> {
    cases
        .iter()
        .map(|case| {
            let chunk = if prefill_chunk == 0 {
                case.prompt_tokens.len()
            } else {
                prefill_chunk
            };
            let request = common::greedy_request(&case.prompt_tokens, 64, chunk);
            let (generated, streamed) = common::generate_in_fresh_pool(&request);
            assert_eq!(streamed, generated.text, "{}: streamed text", case.name);
            generated
        })
        .collect()
}

/// Whole-prompt prefill runs, shared by the token and logit tests.
fn whole_prompt_runs() -> &'static [Generated] {
    static RUNS: OnceLock<Vec<Generated>> = OnceLock::new();
    RUNS.get_or_init(|| greedy_runs(0))
}

/// Our choice at one step of llama.cpp's greedy continuation, fed llama.cpp's tokens so far.
struct Forced {
    /// Our top-1 token.
    top1: u32,
    /// Our logit of `top1` minus our logit of llama.cpp's token (0 when they agree).
    gap: f32,
}

/// Teacher forcing: for case `index` and each of its 64 steps, our next-token choice after the
/// prompt and llama.cpp's greedy tokens before that step. Unlike free-running greedy decoding,
/// one disagreement does not hide the steps after it. Computed once per case, on demand.
fn teacher_forced(index: usize) -> &'static [Forced] {
    static FORCED: OnceLock<Vec<OnceLock<Vec<Forced>>>> = OnceLock::new();
    let all = FORCED.get_or_init(|| cases().iter().map(|_| OnceLock::new()).collect());
    all[index].get_or_init(|| {
        let case = &cases()[index];
        let n = case.prompt_tokens.len();
        let mut pool = common::pool(n + 64 + common::PAGE_SIZE);
        let table = pool.allocate(common::owner(9, 9), n + 64).unwrap();
        let step = |pool: &mut kv::PagePool, tokens: &[u32], start_pos| {
            let step = SeqStep {
                table: &table,
                tokens,
                start_pos,
                logits: model::LogitRows::Last,
            };
            common::model().forward(pool, &[step]).unwrap()[0].to_vec()
        };
        let mut logits = step(&mut pool, &case.prompt_tokens, 0);
        let mut forced = Vec::new();
        for (i, &reference) in case.greedy_tokens.iter().enumerate() {
            let top1 = top_k(&logits, 1)[0];
            let gap = logits[top1 as usize] - logits[reference as usize];
            forced.push(Forced { top1, gap });
            if i + 1 < case.greedy_tokens.len() {
                logits = step(&mut pool, &[reference], n + i);
            }
        }
        pool.release(table).unwrap();
        assert_eq!(pool.pages_free(), pool.page_count());
        forced
    })
}

/// Where two token lists first differ, with context, or `None` when they are equal.
fn first_difference(
    case: &Case,
    (ours_label, ours): (&str, &[u32]),
    (theirs_label, theirs): (&str, &[u32]),
) -> Option<String> {
    let tok = common::tokenizer();
    let index = (0..ours.len().max(theirs.len())).find(|&i| ours.get(i) != theirs.get(i))?;
    let show = |t: Option<&u32>| match t {
        Some(&t) => format!("{t} {:?}", tok.decode(&[t])),
        None => "(none)".to_string(),
    };
    let from = index.saturating_sub(12);
    let window =
        |tokens: &[u32]| tok.decode(&tokens[from.min(tokens.len())..(index + 6).min(tokens.len())]);
    let margin = case
        .margins
        .get(index)
        .map_or("?".to_string(), |m| format!("{m:.4}"));
    Some(format!(
        "{}: first difference at generated token {index}: {ours_label} {} vs {theirs_label} {} \
         (llama.cpp top1-top2 margin there {margin})\n  {ours_label:>10}: {:?}\n  {theirs_label:>10}: {:?}",
        case.name,
        show(ours.get(index)),
        show(theirs.get(index)),
        window(ours),
        window(theirs),
    ))
}

#[test]
fn tokenizer_gives_llama_cpp_prompt_ids_for_every_reference_prompt() {
    let fixture = common::loaded();
    let mut failures = Vec::new();
    for case in cases() {
        let ids = if case.mode == "chat" {
            let template = fixture
                .chat_template
                .as_ref()
                .expect("the GGUF carries a chat template");
            let rendered = template
                .render(&case.messages, true)
                .unwrap_or_else(|e| panic!("{}: render: {e}", case.name));
            if rendered != case.prompt {
                failures.push(format!(
                    "{}: our chat template renders\n  {rendered:?}\n  llama.cpp script rendered\n  {:?}",
                    case.name, case.prompt
                ));
            }
            fixture.tokenizer.encode(&rendered, true)
        } else {
            fixture.tokenizer.encode(&case.prompt, false)
        };
        if ids != case.prompt_tokens {
            let index = (0..ids.len().max(case.prompt_tokens.len()))
                .find(|&i| ids.get(i) != case.prompt_tokens.get(i))
                .expect("lists differ somewhere");
            failures.push(format!(
                "{}: {} ids vs llama.cpp {}; first difference at {index}: ours {:?} vs {:?}",
                case.name,
                ids.len(),
                case.prompt_tokens.len(),
                ids.get(index),
                case.prompt_tokens.get(index)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A step where llama.cpp's own top-1/top-2 logit margin is below this is a near-tie: which
/// way it falls depends on float summation order, because activations are re-quantized to 8
/// bits before every matmul and a one-ulp difference can flip a rounding. Two correct orderings
/// (our scalar and AVX2 kernels) move first-step logits by up to ~1.0, mostly as a common shift.
/// Observed first divergences from llama.cpp, by its margin there: AVX2 kernels 0.029
/// (apollo_digits, token 51), 0.056 (chat_boiling, 41), 0.118 (chat_system_colors, 1), the
/// other three prompts equal for 64/64; scalar kernels 0.039–0.232 on all six
/// (`cargo run --release -p model --example reference_diff -- scalar`).
const NEAR_TIE: f32 = 0.3;

/// Greedy decoding equals llama.cpp token for token, except that past a near-tie (both
/// engines see the two tokens within `NEAR_TIE` of each other) the continuations may part.
#[test]
fn greedy_64_tokens_equal_llama_cpp_up_to_a_near_tie() {
    let mut failures = Vec::new();
    let mut full_matches = 0;
    for (index, (case, run)) in cases().iter().zip(whole_prompt_runs()).enumerate() {
        assert_eq!(run.tokens.len(), 64, "{}: stop_at_eos is off", case.name);
        assert_eq!(run.stats.prompt_tokens, case.prompt_tokens.len());
        let ours = ("ours", &run.tokens[..]);
        let Some(report) = first_difference(case, ours, ("llama.cpp", &case.greedy_tokens)) else {
            eprintln!("{}: 64/64 tokens equal", case.name);
            full_matches += 1;
            continue;
        };
        let at = (0..64)
            .find(|&i| run.tokens[i] != case.greedy_tokens[i])
            .expect("the lists differ");
        // The same step with llama.cpp's tokens before it (equal to ours up to there).
        let forced = &teacher_forced(index)[at];
        let their_margin = case.margins[at];
        eprintln!(
            "{}: equal for {at} tokens, then llama.cpp margin {their_margin:.4}, ours {:.4}",
            case.name, forced.gap
        );
        if their_margin >= NEAR_TIE || forced.gap >= NEAR_TIE {
            failures.push(format!(
                "{report}\n  not a near-tie: llama.cpp margin {their_margin:.4}, our logit of {} \
                 exceeds our logit of llama.cpp's {} by {:.4} (limit {NEAR_TIE})",
                forced.top1, case.greedy_tokens[at], forced.gap
            ));
        }
    }
    eprintln!(
        "{full_matches}/{} prompts equal for all 64 tokens",
        cases().len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Greedy tokens of the same prompts from a second llama.cpp build: the same
/// llama-cpp-python 0.3.36, GGUF and settings, compiled on an AVX-512 machine
/// (`tests/data/reference_avx512/reference.json`, `make_reference.py --out`; its
/// `llama_cpp_system_info` says which CPU features it used).
fn second_build_tokens() -> Vec<(String, Vec<u32>)> {
    let path = common::workspace_root().join("tests/data/reference_avx512/reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("reference.json is JSON");
    json["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let tokens = c["greedy_tokens"]
                .as_array()
                .expect("greedy_tokens")
                .iter()
                .map(|t| t.as_u64().expect("token id") as u32)
                .collect();
            (c["name"].as_str().expect("name").to_string(), tokens)
        })
        .collect()
}

fn equal_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// llama.cpp does not reproduce itself across CPUs: its AVX2 and AVX-512 builds part at the
/// same near-ties we do (3 of the 6 prompts equal for 64 tokens, one after 0). So the
/// requirement that can hold for any engine is this one: on every prompt, our greedy tokens
/// agree with each llama.cpp build for at least as long as the two builds agree with each
/// other.
#[test]
fn greedy_tokens_agree_with_each_llama_cpp_build_as_long_as_the_builds_agree() {
    let second = second_build_tokens();
    assert_eq!(second.len(), cases().len(), "the same six prompts");
    let mut failures = Vec::new();
    for ((case, run), (name, other)) in cases().iter().zip(whole_prompt_runs()).zip(&second) {
        assert_eq!(&case.name, name, "the same prompts in the same order");
        let builds = equal_prefix(&case.greedy_tokens, other);
        let with_first = equal_prefix(&run.tokens, &case.greedy_tokens);
        let with_second = equal_prefix(&run.tokens, other);
        eprintln!(
            "{name}: builds agree for {builds}/64; ours with the AVX2 build {with_first}, \
             with the AVX-512 build {with_second}"
        );
        if with_first < builds || with_second < builds {
            failures.push(format!(
                "{name}: the llama.cpp builds agree for {builds} tokens, ours with them for \
                 {with_first} and {with_second}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// llama.cpp's top1-top2 margin above which our top-1 must agree with its token under
/// teacher forcing. Our first-step logits differ from llama.cpp's by up to ~0.85 (see
/// LOGIT_TOLERANCE), so a gap between two logits can move by about that much; below that the
/// two engines may legitimately rank a near-tie differently.
const CLEAR_MARGIN: f32 = 1.0;

/// Longest prompt the teacher-forced test runs (for runtime).
const TEACHER_FORCED_MAX_PROMPT: usize = 256;

#[test]
fn teacher_forced_top1_equals_llama_cpp_wherever_its_margin_is_clear() {
    let mut report = String::new();
    let mut failures = Vec::new();
    let (mut agree, mut total) = (0, 0);
    for (index, case) in cases().iter().enumerate() {
        // The 1211-token prompt is left out: its prefill alone is most of this binary's
        // runtime, and its free-running greedy run is compared token for token above.
        if case.prompt_tokens.len() > TEACHER_FORCED_MAX_PROMPT {
            eprintln!(
                "{}: skipped ({} prompt tokens)",
                case.name,
                case.prompt_tokens.len()
            );
            continue;
        }
        for (i, step) in teacher_forced(index).iter().enumerate() {
            total += 1;
            let reference = case.greedy_tokens[i];
            if step.top1 == reference {
                agree += 1;
                continue;
            }
            let line = format!(
                "{} step {i}: ours {} vs llama.cpp {}; llama.cpp margin {:.4}, our gap {:.4}",
                case.name, step.top1, reference, case.margins[i], step.gap
            );
            writeln!(report, "{line}").unwrap();
            if case.margins[i] >= CLEAR_MARGIN {
                failures.push(line);
            }
        }
    }
    eprintln!("teacher-forced top-1 agrees with llama.cpp at {agree}/{total} steps\n{report}");
    assert!(
        failures.is_empty(),
        "disagreements where llama.cpp's margin is >= {CLEAR_MARGIN}:\n{}",
        failures.join("\n")
    );
}

/// Tolerance on the largest per-token logit difference against llama.cpp at the first step.
///
/// Observed at commit 8414824 (AVX2 backend, 2 threads), max abs diff / mean abs diff:
/// capital_france 0.803 / 0.203, code_fibonacci 0.615 / 0.124, apollo_digits 0.685 / 0.283,
/// chat_boiling 0.546 / 0.090, chat_system_colors 0.830 / 0.195, long_city 0.826 / 0.420
/// (much of the mean a constant shift, -0.42 to +0.19, which softmax ignores; correlation
/// with llama.cpp's logits 0.9991-0.9996). Earlier kernels (afa4d22) gave 0.53-0.84. This is
/// the noise floor of this Q4_1 model, not an engine error: our own scalar and AVX2 backends,
/// the same algorithm summed in another order, differ from each other by 0.51-1.01 on the
/// same prompts (Q8 activation rounding amplifies tiny differences through 30 layers).
/// 2.0 is about 2.4x the largest observed difference against llama.cpp.
const LOGIT_TOLERANCE: f32 = 2.0;

#[test]
fn first_step_logits_are_close_to_llama_cpp() {
    let mut report = String::new();
    let mut failures = Vec::new();
    for (case, run) in cases().iter().zip(whole_prompt_runs()) {
        let (ours, theirs) = (&run.first_logits, &case.first_logits);
        let max = max_abs_diff(ours, theirs);
        let mean = ours
            .iter()
            .zip(theirs.iter())
            .map(|(a, b)| (a - b).abs() as f64)
            .sum::<f64>()
            / ours.len() as f64;
        let (top_ours, top_theirs) = (top_k(ours, 5), top_k(theirs, 5));
        let overlap = top_ours.iter().filter(|t| top_theirs.contains(t)).count();
        writeln!(
            report,
            "{:>20}: max abs diff {max:.4}, mean abs diff {mean:.5}, top-1 {} vs {}, \
             top-5 overlap {overlap}/5",
            case.name, top_ours[0], top_theirs[0]
        )
        .unwrap();
        if max > LOGIT_TOLERANCE {
            failures.push(format!(
                "{}: max abs diff {max} over {LOGIT_TOLERANCE}",
                case.name
            ));
        }
        if top_ours[0] != top_theirs[0] {
            failures.push(format!(
                "{}: top-1 token {} vs llama.cpp {}",
                case.name, top_ours[0], top_theirs[0]
            ));
        }
        if overlap < 4 {
            failures.push(format!(
                "{}: top-5 {top_ours:?} vs llama.cpp {top_theirs:?} share only {overlap}",
                case.name
            ));
        }
    }
    eprint!("{report}");
    assert!(failures.is_empty(), "{report}{}", failures.join("\n"));
}

#[test]
fn prefill_in_chunks_of_7_gives_the_same_tokens_as_whole_prompt_prefill() {
    let chunked = greedy_runs(7);
    let mut failures = Vec::new();
    for ((case, whole), chunked) in cases().iter().zip(whole_prompt_runs()).zip(&chunked) {
        let diff = max_abs_diff(&whole.first_logits, &chunked.first_logits);
        eprintln!(
            "{}: first-step logits, chunks of 7 vs whole prompt: max abs diff {diff}",
            case.name
        );
        if let Some(report) =
            first_difference(case, ("chunked", &chunked.tokens), ("whole", &whole.tokens))
        {
            failures.push(format!("chunked vs whole-prompt prefill: {report}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The engine issue's bar, counted over every prompt we hold llama.cpp's tokens for (the six
/// core prompts against either llama.cpp build, the second set against the AVX-512 build):
/// at least five prompts equal for all 64 greedy tokens, one of them over 1,000 tokens. Every
/// other prompt of the second set must part only where llama.cpp's own top-2 margin is a
/// near-tie (the core ones are held to that by the tests above). The table is printed
/// whatever the outcome.
#[test]
fn greedy_64_tokens_equal_llama_cpp_on_at_least_five_prompts() {
    let second = second_build_tokens();
    let more_runs = greedy_runs_of(more_cases(), 0);
    let mut exact = Vec::new();
    let mut failures = Vec::new();
    let mut report = String::new();
    let line = |report: &mut String, case: &Case, equal: usize, note: String| {
        let (name, mode, n) = (&case.name, &case.mode, case.prompt_tokens.len());
        writeln!(
            report,
            "{name:>20} {mode:>5} {n:>5} prompt tokens: {equal}/64{note}"
        )
        .unwrap();
    };
    let core = cases().iter().zip(whole_prompt_runs()).zip(&second);
    for ((case, run), (_, other)) in core {
        let equal =
            equal_prefix(&run.tokens, &case.greedy_tokens).max(equal_prefix(&run.tokens, other));
        line(&mut report, case, equal, String::new());
        if equal == 64 {
            exact.push(case);
        }
    }
    for (case, run) in more_cases().iter().zip(&more_runs) {
        let equal = equal_prefix(&run.tokens, &case.greedy_tokens);
        let margin = case.margins.get(equal).copied();
        let note = margin.map_or(String::new(), |m| {
            format!(", then llama.cpp's margin {m:.4}")
        });
        line(&mut report, case, equal, note);
        match margin {
            None => exact.push(case),
            Some(m) if m >= NEAR_TIE => failures.push(format!(
                "{}: parts from llama.cpp at token {equal}, where its margin is {m:.4}",
                case.name
            )),
            Some(_) => {}
        }
    }
    println!(
        "{report}{} of 12 prompts equal for all 64 tokens",
        exact.len()
    );
    assert!(
        exact.len() >= 5,
        "only {} prompts equal:\n{report}",
        exact.len()
    );
    assert!(
        exact.iter().any(|case| case.prompt_tokens.len() > 1000),
        "no prompt over 1,000 tokens among the equal ones:\n{report}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
