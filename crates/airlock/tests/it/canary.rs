//! `airlock canary`, the leak auditor: clean against `airlock serve` on the real model, and
//! shown able to fail, against fake engines served here: one that leaks another tenant's
//! earlier prompt into its answers, one that answers 200 to everything, and one whose prefix
//! cache is shared by every tenant. The shared-system-prompt mode runs against serve with
//! the checks shown to have run; the timing audit runs with a tiny sample, for its report.

use crate::cli::{airlock, model_path};
use crate::harness::runtime;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Output;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

/// A fresh path for one run's JSON report.
fn report_path(name: &str) -> PathBuf {
    crate::harness::scratch().join(format!("airlock-canary-{name}-{}.json", std::process::id()))
}

/// Runs `airlock canary ARGS --json FILE`; returns the process output and the parsed report.
fn canary(name: &str, args: &[&str]) -> (Output, Value) {
    canary_with_env(name, args, &[])
}

/// [`canary`] with `env` set for it and the servers it spawns.
fn canary_with_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> (Output, Value) {
    let path = report_path(name);
    let _ = std::fs::remove_file(&path);
    let output = airlock()
        .envs(env.iter().copied())
        .arg("canary")
        .args(args)
        .arg("--json")
        .arg(&path)
        .output()
        .expect("airlock canary runs");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}); stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    let _ = std::fs::remove_file(&path);
    (
        output,
        serde_json::from_str(&text).expect("the report is JSON"),
    )
}

fn shown(output: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The small mix every test runs: 24 requests over 4 tenants, a fifth of them oversized and a
/// fifth invalid, so each kind is there.
const MIX: &[&str] = &[
    "--requests",
    "24",
    "--concurrency",
    "4",
    "--max-tokens",
    "4",
    "--oversized-fraction",
    "0.2",
    "--invalid-fraction",
    "0.2",
    "--long-fraction",
    "0.1",
    "--seed",
    "7",
    "--timeout",
    "60",
];

/// The canary's arguments to spawn `serve` on the real model, small: four tenants, a context
/// of 512 and one thread.
fn spawned_serve(model: &str) -> Vec<&str> {
    vec![
        "--spawn",
        "serve",
        "--tenants",
        "4",
        "--context-length",
        "512",
        "--threads",
        "1",
        "--model-file",
        model,
    ]
}

/// On each KV transport `serve` has (`AIRLOCK_KV_TRANSPORT`, its `--kv-transport`).
#[test]
fn canary_against_serve_is_clean_and_every_should_fail_request_gets_4xx() {
    for transport in ["shm", "tcp"] {
        canary_against_serve_on(&model_path(), transport);
    }
}

/// The canary against `serve` of the GGUF at `model` over `transport` (also run per
/// architecture: `architectures.rs`).
pub fn canary_against_serve_on(model: &str, transport: &str) {
    let mut args = spawned_serve(model);
    args.extend_from_slice(MIX);
    // Half the good requests go twice: greedy twins must agree (no false alarm on a clean,
    // concurrently batched server).
    args.extend_from_slice(&["--twin-fraction", "0.5"]);
    let name = format!("serve-{transport}");
    let env = [("AIRLOCK_KV_TRANSPORT", transport)];
    let (output, report) = canary_with_env(&name, &args, &env);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", shown(&output));
    assert_eq!(report["verdict"], "clean", "{report:#}");
    assert!(report["twins_compared"].as_u64() > Some(0), "{report:#}");
    assert_eq!(report["inconsistent_twins"], json!([]), "{report:#}");
    assert_eq!(report["leaks"], json!([]), "{report:#}");
    assert_eq!(report["wrong_200"], json!([]), "{report:#}");
    // 24 planned requests, plus the twins sent again.
    assert!(report["requests"].as_u64() > Some(24), "{report:#}");
    let should_fail = &report["should_fail"];
    assert!(should_fail["sent"].as_u64() > Some(0), "{report:#}");
    assert_eq!(should_fail["got_4xx"], should_fail["sent"], "{report:#}");
    for class in ["oversized", "invalid"] {
        assert!(
            report["classes"][class]["sent"].as_u64() > Some(0),
            "no {class} request in the mix: {report:#}"
        );
    }
    for class in ["short", "long"] {
        let tally = &report["classes"][class];
        assert_eq!(tally["2xx"], tally["sent"], "{class}: {report:#}");
    }
    assert!(stdout.contains("leaks: 0"), "{stdout}");
    assert!(stdout.contains("verdict: clean (seed 7)"), "{stdout}");
}

/// How a fake engine misbehaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Checks requests as a server should, but answers each with the latest prompt another
    /// key sent: the cross-tenant leak the canary exists to catch.
    LeaksOtherTenants,
    /// Answers 200 to everything, even what it should refuse.
    AlwaysOk,
    /// Answers well, but its prefix cache is keyed by the prompt alone: any request whose
    /// prompt opens as an earlier one's (any key, any salt) reports cached tokens.
    SharedCache,
}

const FAKE_MODEL: &str = "fake-model";
const FAKE_CONTEXT: usize = 256;

struct Fake {
    fault: Fault,
    /// (API key, prompt) of every request seen.
    prompts: Mutex<Vec<(String, String)>>,
}

/// A fake engine on the shared test runtime; aborted on drop.
struct FakeServer {
    url: String,
    task: JoinHandle<()>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start_fake(fault: Fault) -> FakeServer {
    let state = Arc::new(Fake {
        fault,
        prompts: Mutex::new(Vec::new()),
    });
    let app = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .with_state(state);
    runtime().block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("fake serves");
        });
        FakeServer { url, task }
    })
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]}))
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok", "context_length": FAKE_CONTEXT}))
}

async fn completions(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&fake, &headers, &body, false)
}

async fn chat(State(fake): State<Arc<Fake>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&fake, &headers, &body, true)
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message}}))).into_response()
}

fn answer(fake: &Fake, headers: &HeaderMap, body: &[u8], chat: bool) -> Response {
    if fake.fault == Fault::AlwaysOk {
        return reply("all good", chat, false, None);
    }
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return error(StatusCode::BAD_REQUEST, "invalid JSON");
    };
    if request["model"] != FAKE_MODEL {
        return error(StatusCode::NOT_FOUND, "no such model");
    }
    let Some(max_tokens) = request["max_tokens"].as_i64().filter(|&n| n >= 1) else {
        return error(StatusCode::BAD_REQUEST, "max_tokens must be at least 1");
    };
    let prompt = if chat {
        request["messages"][0]["content"].as_str()
    } else {
        request["prompt"].as_str()
    };
    let stream = request["stream"] == true;
    let Some(prompt) = prompt else {
        return error(StatusCode::BAD_REQUEST, "no prompt");
    };
    // Every word is at least one token: a fair stand-in for the context check.
    if prompt.split_whitespace().count() + max_tokens as usize > FAKE_CONTEXT {
        return error(StatusCode::BAD_REQUEST, "context length exceeded");
    }
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    if fake.fault == Fault::SharedCache {
        // The first 64 bytes stand for the first cached page.
        let page = |text: &str| text.get(..64).map(str::to_string);
        let mut prompts = fake.prompts.lock().expect("prompts");
        let hit = page(prompt).is_some() && prompts.iter().any(|(_, p)| page(p) == page(prompt));
        prompts.push((key, prompt.to_string()));
        return reply("fine", chat, stream, Some(if hit { 16 } else { 0 }));
    }
    let leaked = {
        let mut prompts = fake.prompts.lock().expect("prompts");
        let other = prompts
            .iter()
            .rev()
            .find(|(k, _)| *k != key)
            .map(|(_, p)| p.clone());
        prompts.push((key, prompt.to_string()));
        other.unwrap_or_else(|| "nothing to leak yet".to_string())
    };
    reply(&leaked, chat, stream, None)
}

/// An OpenAI-shaped answer carrying `text`; streamed as SSE, split in two chunks mid-text.
/// With `cached`, a usage saying that many cached tokens (streams: in a last usage event).
fn reply(text: &str, chat: bool, stream: bool, cached: Option<u64>) -> Response {
    let usage = cached.map(|cached| {
        json!({"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
               "prompt_tokens_details": {"cached_tokens": cached}})
    });
    let piece = |text: &str| {
        if chat {
            json!({"id": "fake-1", "choices": [{"index": 0, "delta": {"content": text}}]})
        } else {
            json!({"id": "fake-1", "choices": [{"index": 0, "text": text}]})
        }
    };
    if !stream {
        let mut body = if chat {
            json!({"id": "fake-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})
        } else {
            piece(text)
        };
        if let Some(usage) = &usage {
            body["usage"] = usage.clone();
        }
        return Json(body).into_response();
    }
    let middle = (0..=text.len() / 2)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let (first, second) = text.split_at(middle);
    let usage = usage.map_or(String::new(), |usage| {
        format!(
            "data: {}\n\n",
            json!({"id": "fake-1", "choices": [], "usage": usage})
        )
    });
    let events = format!(
        "data: {}\n\ndata: {}\n\n{usage}data: [DONE]\n\n",
        piece(first),
        piece(second)
    );
    ([(header::CONTENT_TYPE, "text/event-stream")], events).into_response()
}

const FAKE_KEYS: &str = "sk-fake-a0,sk-fake-b1,sk-fake-c2,sk-fake-d3";

#[test]
fn canary_names_both_requests_and_tenants_of_a_leak() {
    let fake = start_fake(Fault::LeaksOtherTenants);
    let mut args = vec!["--url", &fake.url, "--keys", FAKE_KEYS];
    args.extend_from_slice(MIX);
    let (output, report) = canary("leak", &args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", shown(&output));
    assert_eq!(report["verdict"], "failed", "{report:#}");
    assert_eq!(report["context_length"], FAKE_CONTEXT, "from /health");
    assert_eq!(report["wrong_200"], json!([]), "{report:#}");
    let leaks = report["leaks"].as_array().expect("leaks");
    assert!(!leaks.is_empty(), "{report:#}");
    for leak in leaks {
        assert_ne!(leak["tenant"], leak["victim_tenant"], "{leak:#}");
        assert_ne!(leak["request"], leak["victim_request"], "{leak:#}");
        let marker = leak["marker"].as_str().expect("marker");
        assert!(marker.starts_with("CANARY-"), "{leak:#}");
        // One marker can leak into several answers: the line is the one naming this answer.
        let request = leak["request"].as_str().expect("request");
        let line = stdout
            .lines()
            .find(|line| {
                line.contains("LEAK:")
                    && line.contains(marker)
                    && line.contains(&format!("LEAK: {request} "))
            })
            .unwrap_or_else(|| panic!("no LEAK line for {request} and {marker}:\n{stdout}"));
        for field in ["request", "victim_request", "tenant", "victim_tenant"] {
            let value = leak[field].as_str().expect("a string");
            assert!(line.contains(value), "{field} {value} not in {line}");
        }
    }
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("leak(s)"),
        "{}",
        shown(&output)
    );
}

#[test]
fn canary_fails_a_server_that_answers_200_to_what_it_should_refuse() {
    let fake = start_fake(Fault::AlwaysOk);
    let mut args = vec!["--url", &fake.url, "--keys", FAKE_KEYS];
    args.extend_from_slice(MIX);
    let (output, report) = canary("always-ok", &args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", shown(&output));
    assert_eq!(report["verdict"], "failed", "{report:#}");
    assert_eq!(report["leaks"], json!([]), "{report:#}");
    let wrong = report["wrong_200"].as_array().expect("wrong_200");
    let should_fail = report["should_fail"]["sent"].as_u64().expect("sent");
    assert_eq!(wrong.len() as u64, should_fail, "{report:#}");
    assert!(should_fail > 0);
    for entry in wrong {
        let request = entry["request"].as_str().expect("request id");
        assert!(
            stdout
                .lines()
                .any(|line| line.contains("WRONG 200") && line.contains(request)),
            "no WRONG 200 line for {request}:\n{stdout}"
        );
    }
}

#[test]
fn canary_help_explains_the_options_with_an_example() {
    let output = airlock().args(["canary", "--help"]).output().expect("runs");
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success());
    for needle in [
        "--spawn",
        "--url",
        "--keys-file",
        "--single-key",
        "--oversized-fraction",
        "--seed",
        "airlock canary --spawn serve",
        "Exit status",
        "--shared-prefix-tokens",
        "--fresh-salt-fraction",
        "--timing-audit",
        "--timing-samples",
        "Kolmogorov-Smirnov",
    ] {
        assert!(help.contains(needle), "{needle} missing from:\n{help}");
    }
}

/// Shared-system-prompt mode against serve on the real model: 4 tenants open every prompt
/// with one system prompt; no answer reuses another tenant's prefix, and the run shows its
/// checks ran (tenants' first requests and fresh salts judged) and that the cache was on
/// (same-tenant hits), so a server with its cache off cannot pass this test.
#[test]
fn canary_shared_system_prompt_finds_no_cross_tenant_hit_and_sees_own_reuse() {
    let model = model_path();
    let mut args = spawned_serve(&model);
    args.extend_from_slice(&["--shared-prefix-tokens", "160"]);
    args.extend_from_slice(MIX);
    let (output, report) = canary("shared", &args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", shown(&output));
    assert_eq!(report["verdict"], "clean", "{report:#}");
    assert_eq!(report["leaks"], json!([]), "{report:#}");
    let shared = &report["shared_prefix"];
    assert_eq!(shared["cross_tenant_hits"], json!([]), "{report:#}");
    assert_eq!(
        shared["checked_first"], 4,
        "every tenant's first: {report:#}"
    );
    assert!(
        shared["checked_fresh_salt"].as_u64() > Some(0),
        "{report:#}"
    );
    assert!(
        shared["same_tenant_hits"].as_u64() > Some(0),
        "cache off? {report:#}"
    );
    assert_eq!(shared["no_cached_tokens"], 0, "{report:#}");
    assert!(stdout.contains("cross-tenant cache hits: 0"), "{stdout}");
}

#[test]
fn canary_fails_a_server_whose_prefix_cache_is_shared_by_every_tenant() {
    let fake = start_fake(Fault::SharedCache);
    let mut args = vec![
        "--url",
        &fake.url,
        "--keys",
        FAKE_KEYS,
        "--shared-prefix-tokens",
        "120",
    ];
    args.extend_from_slice(MIX);
    let (output, report) = canary("shared-cache", &args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", shown(&output));
    assert_eq!(report["verdict"], "failed", "{report:#}");
    assert_eq!(report["leaks"], json!([]), "{report:#}");
    let hits = report["shared_prefix"]["cross_tenant_hits"]
        .as_array()
        .expect("hits");
    // The first tenant's first request found nothing cached; every later check did.
    assert!(!hits.is_empty(), "{report:#}");
    for hit in hits {
        let request = hit["request"].as_str().expect("request id");
        assert!(
            stdout
                .lines()
                .any(|line| line.contains("CROSS-TENANT HIT") && line.contains(request)),
            "no CROSS-TENANT HIT line for {request}:\n{stdout}"
        );
    }
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("cross-tenant cache hit(s)"),
        "{}",
        shown(&output)
    );
}

#[test]
fn prefix_cache_audits_refuse_tenants_that_share_a_key() {
    for mode in ["--shared-system-prompt", "--timing-audit"] {
        let output = airlock()
            .args([
                "canary",
                "--url",
                "http://127.0.0.1:9",
                "--single-key",
                "sk-x",
                mode,
            ])
            .output()
            .expect("runs");
        assert_eq!(output.status.code(), Some(1), "{}", shown(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("a key of its own"), "{stderr}");
    }
}

/// The timing audit runs end to end and reports; with 3 samples of each kind its p-values
/// mean nothing (it is run by hand with 100 or more), so only its shape and B's cached_tokens
/// (deterministic: B's salts are fresh) are checked.
#[test]
fn canary_timing_audit_runs_against_serve_and_reports_both_tests() {
    let model = model_path();
    let args = [
        "--spawn",
        "serve",
        "--context-length",
        "512",
        "--threads",
        "1",
        "--model-file",
        &model,
        "--timing-audit",
        "--timing-samples",
        "3",
        "--timing-prefix-tokens",
        "64",
        "--seed",
        "5",
    ];
    let (output, report) = canary("timing", &args);
    assert!(
        matches!(output.status.code(), Some(0 | 1)),
        "{}",
        shown(&output)
    );
    assert_eq!(report["mode"], "timing_audit", "{report:#}");
    for kind in ["cross_shared", "cross_fresh", "own_shared", "own_fresh"] {
        let sample = &report["samples"][kind];
        assert_eq!(sample["answers"], 3, "{kind}: {report:#}");
        assert!(sample["median_ttft_ms"].as_f64() > Some(0.0), "{report:#}");
    }
    for test in ["cross_tenant", "control"] {
        assert!(report[test]["d"].is_f64(), "{report:#}");
        assert!(report[test]["p"].is_f64(), "{report:#}");
    }
    assert_eq!(report["cross_tenant_hits"], 0, "{report:#}");
    let cached = report["samples"]["own_shared"]["cached_tokens"]
        .as_array()
        .expect("cached tokens");
    assert!(
        cached.iter().all(|n| n.as_u64() >= Some(48)),
        "A's repeats of its prefix hit: {report:#}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("control (A)"), "{stdout}");
}

/// Defense in depth, end to end: the incident planted in a real cluster (the oracle model over
/// loopback TCP, prefill pool smaller than the context). With the guards on, the auditor finds
/// it clean; with admission and transfer verification off, it goes red and names the leak.
#[test]
fn canary_is_clean_with_the_incident_planted_and_red_without_the_guards() {
    use crate::harness::{self, Backend, Mode, Options};
    use transfer::Role;
    use worker::Fault;
    const KEYS: &str = "[tenants.t0]\nkeys = [\"sk-t0-0123456789\"]\n\
                        [tenants.t1]\nkeys = [\"sk-t1-0123456789\"]\n\
                        [tenants.t2]\nkeys = [\"sk-t2-0123456789\"]\n\
                        [tenants.t3]\nkeys = [\"sk-t3-0123456789\"]\n";
    let plan = crate::harness::always;
    let guarded = (plan(&[Fault::Incident]), plan(&[]));
    let unguarded = (
        plan(&[Fault::Incident, Fault::NoAdmission]),
        plan(&[Fault::NoTransferVerify]),
    );
    let stages = [("guarded", guarded, true), ("unguarded", unguarded, false)];
    for (transport, (name, (prefill, decode), clean)) in harness::KV_TRANSPORTS
        .into_iter()
        .flat_map(|transport| stages.clone().map(|stage| (transport, stage)))
    {
        let name = format!("{name}-{transport:?}");
        let name = name.as_str();
        let mut options = Options::new(Mode::Disaggregated);
        options.kv_transport = transport;
        options.backend = Backend::Oracle;
        options.keys = Some(KEYS);
        options.context_length = Some(1024);
        options.kv_tokens = 4096;
        // The incident's node: a prefill pool that cannot hold a long prompt.
        options.prefill_kv_tokens = Some(256);
        options.faults = vec![(Role::Prefill, prefill), (Role::Decode, decode)];
        let server = harness::start(options);
        let mut args = vec![
            "--url",
            &server.url,
            "--keys",
            "sk-t0-0123456789,sk-t1-0123456789,sk-t2-0123456789,sk-t3-0123456789",
        ];
        args.extend_from_slice(&[
            // Enough victims that one of them reads another tenant's stale pages however the
            // machine schedules the requests (48 sometimes saw none on a loaded 2-core VM).
            "--requests",
            "128",
            "--concurrency",
            "4",
            "--max-tokens",
            "64",
            "--long-fraction",
            "0.4",
            "--seed",
            "11",
        ]);
        let (output, report) = canary(name, &args);
        let leaks = report["leaks"].as_array().expect("leaks").len();
        if clean {
            assert_eq!(output.status.code(), Some(0), "{name}: {}", shown(&output));
            assert_eq!(leaks, 0, "{name}: {report:#}");
        } else {
            assert_eq!(output.status.code(), Some(1), "{name}: {}", shown(&output));
            assert!(
                leaks > 0,
                "{name}: the planted leak went unseen: {report:#}"
            );
        }
    }
}

/// The shared-system-prompt mode shown able to fail on the real server: a cluster whose
/// prefix index forgets the tenant (planted fault) is still clean while the pool's tenant
/// check refuses the pages; with that check off too, tenants start from each other's cached
/// system prompt, and the auditor names the cross-tenant hits.
#[test]
fn canary_shared_system_prompt_is_red_when_the_cache_forgets_the_tenant() {
    use crate::harness::{self, Backend, Mode, Options};
    use transfer::Role;
    use worker::Fault;
    const KEYS: &str = "[tenants.t0]\nkeys = [\"sk-t0-0123456789\"]\n\
                        [tenants.t1]\nkeys = [\"sk-t1-0123456789\"]\n\
                        [tenants.t2]\nkeys = [\"sk-t2-0123456789\"]\n";
    let plan = crate::harness::always;
    for (faults, clean) in [
        (plan(&[Fault::CacheIgnoresTenant]), true),
        (
            plan(&[Fault::CacheIgnoresTenant, Fault::NoOwnerCheck]),
            false,
        ),
    ] {
        let mut options = Options::new(Mode::Unified);
        options.backend = Backend::Oracle;
        options.keys = Some(KEYS);
        options.context_length = Some(1024);
        options.kv_tokens = 8192;
        options.faults = vec![(Role::Unified, faults)];
        let server = harness::start(options);
        let args = [
            "--url",
            &server.url,
            "--keys",
            "sk-t0-0123456789,sk-t1-0123456789,sk-t2-0123456789",
            "--shared-prefix-tokens",
            "160",
            "--requests",
            "24",
            "--concurrency",
            "4",
            "--max-tokens",
            "4",
            "--seed",
            "13",
        ];
        let name = if clean { "forgets-guarded" } else { "forgets" };
        let (output, report) = canary(name, &args);
        let shared = &report["shared_prefix"];
        let hits = shared["cross_tenant_hits"].as_array().expect("hits").len();
        assert!(shared["checked"].as_u64() > Some(0), "{report:#}");
        if clean {
            assert_eq!(output.status.code(), Some(0), "{}", shown(&output));
            assert_eq!(hits, 0, "{report:#}");
            assert!(shared["same_tenant_hits"].as_u64() > Some(0), "{report:#}");
        } else {
            assert_eq!(output.status.code(), Some(1), "{}", shown(&output));
            assert!(hits > 0, "the shared cache went unseen: {report:#}");
        }
    }
}
