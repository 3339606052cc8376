//! The roles as separate processes on loopback, and the official `openai` Python client
//! against `airlock serve`.

use crate::cli::{airlock, airlock_fault_injection, model_path};
use crate::harness::{completion, post, runtime, KvTransport, SocketDir, KV_TRANSPORTS, MODEL};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A child process killed on drop.
struct Process {
    child: Child,
    name: &'static str,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `airlock ARGS` and waits (bounded) for the stdout line containing `marker`;
/// returns the process and the text after the marker up to the first space.
fn spawn(name: &'static str, args: &[&str], marker: &str) -> (Process, String) {
    spawn_command(airlock(), name, args, marker)
}

/// [`spawn`] of `serve` on a free port, with a pool of `kv_tokens` and the model's context
/// length, plus `extra` arguments; ready once it prints where it serves.
fn spawn_serve(kv_tokens: &str, extra: &[&str]) -> (Process, String) {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--kv-tokens",
        kv_tokens,
        "--context-length",
        "auto",
    ];
    args.extend_from_slice(extra);
    spawn("serve", &args, " at ")
}

/// [`spawn`] of the test-only `airlock-fault-injection`, with `AIRLOCK_FAULTS` set (test
/// builds have fault injection).
fn spawn_with_faults(
    name: &'static str,
    args: &[&str],
    marker: &str,
    faults: &str,
) -> (Process, String) {
    let mut command = airlock_fault_injection();
    command.env("AIRLOCK_FAULTS", faults);
    spawn_command(command, name, args, marker)
}

fn spawn_command(
    mut command: Command,
    name: &'static str,
    args: &[&str],
    marker: &str,
) -> (Process, String) {
    // One compute thread each unless the test asks for more.
    let threads: &[&str] = match args.contains(&"--threads") {
        true => &[],
        false => &["--threads", "1"],
    };
    let mut child = command
        .args(args)
        .args(threads)
        .args(["--model", &model_path()])
        .args(["--cluster-secret-file", &secret_file()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("airlock starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let process = Process { child, name };
    let (tx, rx) = mpsc::channel();
    let wanted = marker.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split(wanted.as_str()).nth(1) {
                let value = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let _ = tx.send(value);
            }
        }
    });
    let value = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{} never printed {marker:?}", process.name));
    (process, value)
}

/// One cluster secret for every process these tests start.
fn secret_file() -> String {
    let path =
        crate::harness::scratch().join(format!("airlock-test-secret-{}", std::process::id()));
    if !path.exists() {
        std::fs::write(&path, "test-cluster-secret-0123456789abcdef\n").expect("secret file");
    }
    path.display().to_string()
}

fn start_worker(role: &'static str, port: &str) -> (Process, String) {
    start_faulty_worker(role, port, "")
}

fn start_faulty_worker(role: &'static str, port: &str, faults: &str) -> (Process, String) {
    start_faulty_worker_with(role, port, faults, &[])
}

/// A worker with `extra` flags (a decode worker's `--kv-socket`).
fn start_faulty_worker_with(
    role: &'static str,
    port: &str,
    faults: &str,
    extra: &[&str],
) -> (Process, String) {
    let mut args = vec![
        role,
        "--port",
        port,
        "--kv-tokens",
        "2048",
        "--context-length",
        "2048",
    ];
    args.extend_from_slice(extra);
    spawn_with_faults(role, &args, "worker listening on ", faults)
}

fn base_url(line_value: &str) -> String {
    line_value.trim_end_matches("/v1").to_string()
}

/// `airlock router` on a free port in front of `prefill` and `decode`, with `extra` flags:
/// the process and its base URL.
fn start_router(prefill: &str, decode: &str, extra: &[&str]) -> (Process, String) {
    let mut args = vec![
        "router",
        "--port",
        "0",
        "--prefill",
        prefill,
        "--decode",
        decode,
    ];
    args.extend_from_slice(extra);
    let (router, url) = spawn("router", &args, " at ");
    (router, base_url(&url))
}

/// Decode, prefill and a router in front of them, each its own process. Returns them, the
/// decode worker's address and the router's base URL.
struct Deployment {
    decode: Process,
    decode_addr: String,
    prefill: Process,
    prefill_addr: String,
    _router: Process,
    url: String,
    /// Shared memory: the decode worker's `--kv-socket` flags, which the router and prefill
    /// reach it by (`unix:PATH`).
    decode_flags: Vec<String>,
    _socket_dir: Option<SocketDir>,
}

fn start_deployment() -> Deployment {
    start_deployment_on(KvTransport::Tcp)
}

/// [`start_deployment`] whose pages go over `transport`: with shared memory the decode worker
/// also listens on a Unix socket, and the router names it by that.
fn start_deployment_on(transport: KvTransport) -> Deployment {
    let socket_dir = (transport == KvTransport::Shm).then(SocketDir::new);
    let socket = socket_dir
        .as_ref()
        .map(|dir| dir.path().join("decode.sock").display().to_string());
    let decode_flags: Vec<String> = match &socket {
        Some(path) => vec!["--kv-socket".into(), path.clone()],
        None => Vec::new(),
    };
    let flags: Vec<&str> = decode_flags.iter().map(String::as_str).collect();
    let (decode, decode_addr) = start_faulty_worker_with("decode", "0", "", &flags);
    let (prefill, prefill_addr) = start_worker("prefill", "0");
    let routed_decode = match &socket {
        Some(path) => format!("unix:{path}"),
        None => decode_addr.clone(),
    };
    let (router, url) = start_router(&prefill_addr, &routed_decode, &[]);
    Deployment {
        decode,
        decode_addr,
        prefill,
        prefill_addr,
        _router: router,
        url,
        decode_flags,
        _socket_dir: socket_dir,
    }
}

#[test]
fn router_prefill_and_decode_as_separate_processes_serve_together() {
    let deployment = start_deployment();
    let url = deployment.url.clone();
    runtime().block_on(async {
        let answer = post(
            &url,
            "/v1/completions",
            completion("The capital of France is", 4),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let text = answer.json()["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(text.starts_with(" Paris"), "{text:?}");
        let health = crate::harness::client()
            .get(format!("{url}/health"))
            .send()
            .await
            .expect("health");
        assert_eq!(health.status().as_u16(), 200);
        let (idle, page) = crate::harness::wait_idle(&url).await;
        assert!(idle, "{page}");
    });
}

#[test]
fn a_restarted_decode_worker_is_linked_again() {
    let Deployment {
        decode,
        decode_addr,
        prefill: _prefill,
        prefill_addr: _,
        _router,
        url,
        ..
    } = start_deployment();
    // L11: one request decoding and one queued behind it for the decode pool (2048 tokens,
    // ~1500 each) when the decode worker goes: both end with 503 at once, neither hangs.
    let in_flight: Vec<_> = (0..2)
        .map(|i| {
            let url = url.clone();
            runtime().spawn(async move {
                let body = serde_json::json!({
                    "model": MODEL, "prompt": format!("Story {i}:"), "max_tokens": 1500,
                    "temperature": 0, "ignore_eos": true,
                });
                post(&url, "/v1/completions", body).await
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    drop(decode);
    runtime().block_on(async {
        for task in in_flight {
            let answer = tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .expect("ends once its decode worker is gone")
                .expect("task");
            assert_eq!(answer.status, 503, "{}", answer.body);
        }
        // With the decode worker gone, nothing answers 200.
        let answer = post(&url, "/v1/completions", completion("Hello", 4)).await;
        assert_eq!(answer.status, 503, "{}", answer.body);
    });
    let port = decode_addr.rsplit(':').next().expect("port");
    let (_decode, _) = start_worker("decode", port);
    runtime().block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let answer = post(&url, "/v1/completions", completion("Hello", 4)).await;
            if answer.status == 200 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never served again: {}",
                answer.body
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// `serve`'s prefill and decode engines run on one compute pool: with `--threads 3` the
/// process has two compute threads (each engine's own thread takes part in its passes), not
/// two per engine.
#[test]
fn serve_runs_both_engines_on_one_set_of_compute_threads() {
    let (serve, _url) = spawn_serve("2048", &["--threads", "3"]);
    let tasks = format!("/proc/{}/task", serve.child.id());
    let names: Vec<String> = std::fs::read_dir(&tasks)
        .unwrap_or_else(|e| panic!("{tasks}: {e}"))
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .collect();
    // Thread names are cut to 15 bytes: `airlock-compute-N` reads `airlock-compute`.
    let compute = names
        .iter()
        .filter(|name| name.starts_with("airlock-compute"))
        .count();
    assert_eq!(
        compute, 2,
        "compute threads of serve --threads 3: {names:?}"
    );
}

#[test]
fn the_openai_python_client_talks_to_serve() {
    let dir = crate::harness::scratch().join(format!("airlock-openai-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let keys = dir.join("keys.toml");
    std::fs::write(
        &keys,
        "[tenants.alice]\nkeys = [\"sk-alice-0123456789\"]\n\
         [tenants.bob]\nkeys = [\"sk-bob-0123456789\"]\n",
    )
    .expect("keys file");
    let keys = keys.display().to_string();
    let (_serve, url) = spawn_serve("2048", &["--api-keys", &keys]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let output = std::process::Command::new("python3")
        .args([
            script,
            &url,
            "sk-alice-0123456789",
            "sk-bob-0123456789",
            MODEL,
        ])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "openai client checks failed (CI installs the client: pip install openai)\n\
         stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("all openai client checks passed"),
        "{stdout}"
    );
}

#[test]
fn a_worker_lost_mid_stream_ends_the_stream_with_an_error_event_and_no_done() {
    let Deployment {
        decode,
        decode_addr: _,
        prefill: _prefill,
        prefill_addr: _,
        _router,
        url,
        ..
    } = start_deployment();
    runtime().block_on(async move {
        use futures_util::StreamExt;
        let response = crate::harness::client()
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500,
                "temperature": 0, "ignore_eos": true, "stream": true,
            }))
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status().as_u16(), 200);
        let mut body = response.bytes_stream();
        let mut text =
            String::from_utf8_lossy(&body.next().await.expect("a chunk").expect("ok")).into_owned();
        drop(decode);
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => break,
            }
        }
        assert!(text.contains("event: error"), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
        assert!(!text.contains("\"finish_reason\":\"stop\""), "{text}");
    });
}

/// T11 and T12: a prefill worker that dies mid-transfer, then a decode worker that dies as a
/// transfer lands (planted crashes: the process exits at once, as under SIGKILL), over TCP
/// and over shared memory (where the dead prefill's writes are fenced: decode frees what it
/// granted only once no write is in progress or the process is gone). The request in flight
/// gets 503 `kv_transfer_failed`, never 200; the surviving worker's pages all come back (I9);
/// a restarted worker on the same address serves again.
#[test]
fn a_worker_crashing_mid_transfer_fails_that_request_and_the_pools_recover() {
    for transport in KV_TRANSPORTS {
        crash_mid_transfer_and_recover(transport);
    }
}

fn crash_mid_transfer_and_recover(transport: KvTransport) {
    let deployment = start_deployment_on(transport);
    let decode_flags = deployment.decode_flags.clone();
    let decode_flags: Vec<&str> = decode_flags.iter().map(String::as_str).collect();
    let Deployment {
        decode,
        decode_addr,
        prefill,
        prefill_addr,
        _router,
        url,
        _socket_dir,
        ..
    } = deployment;
    let port = |addr: &str| addr.rsplit(':').next().expect("port").to_string();
    // A prompt of several pages, so "mid-transfer" has a middle.
    let long = "The history of the city is long and full of stories. ".repeat(12);
    let served_again = |url: String| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let answer = post(&url, "/v1/completions", completion("Hello", 2)).await;
            if answer.status == 200 {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "{}", answer.body);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    drop(prefill);
    let (prefill, _) = start_faulty_worker("prefill", &port(&prefill_addr), "crash-mid-transfer");
    runtime().block_on(async {
        served_again(url.clone()).await;
        let answer = post(&url, "/v1/completions", completion(&long, 4)).await;
        assert_eq!(
            answer.status, 503,
            "prefill crash over {transport:?}: {}",
            answer.body
        );
    });
    assert_crashed(prefill);
    let (_prefill, _) = start_worker("prefill", &port(&prefill_addr));
    drop(decode);
    let (decode, _) = start_faulty_worker_with(
        "decode",
        &port(&decode_addr),
        "crash-on-page",
        &decode_flags,
    );
    runtime().block_on(async {
        served_again(url.clone()).await;
        let answer = post(&url, "/v1/completions", completion(&long, 4)).await;
        assert_eq!(
            answer.status, 503,
            "decode crash over {transport:?}: {}",
            answer.body
        );
    });
    assert_crashed(decode);
    let (_decode, _) = start_faulty_worker_with("decode", &port(&decode_addr), "", &decode_flags);
    runtime().block_on(async {
        served_again(url.clone()).await;
        let answer = post(&url, "/v1/completions", completion(&long, 2)).await;
        assert_eq!(answer.status, 200, "over {transport:?}: {}", answer.body);
        let (idle, page) = crate::harness::wait_idle(&url).await;
        assert!(idle, "over {transport:?}: {page}");
        // The pages went the way asked for.
        let label = match transport {
            KvTransport::Tcp => "transport=\"tcp\"",
            KvTransport::Shm => "transport=\"shm\"",
        };
        let moved: f64 = crate::harness::samples(&page, "airlock_transfer_bytes_total")
            .iter()
            .filter(|(labels, _)| labels.contains("role=\"decode\"") && labels.contains(label))
            .map(|(_, bytes)| bytes)
            .sum();
        assert!(moved > 0.0, "no bytes over {transport:?}: {page}");
    });
}

/// The planted crash, not something else, is what the test saw.
fn assert_crashed(mut process: Process) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = process.child.try_wait().expect("wait") {
            assert_eq!(status.code(), Some(86), "{} exit status", process.name);
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} still runs",
            process.name
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `/health/ready` is 200 while one complete path (a prefill and a decode worker) is linked,
/// whatever else is down; `/health` is 200 only while every worker is. A router over two
/// prefill workers loses one: degraded, still ready; then loses its decode worker: not ready.
#[test]
fn ready_means_a_complete_path_and_health_means_every_worker() {
    let (mut decode, decode_addr) = start_worker("decode", "0");
    let (mut first, first_addr) = start_worker("prefill", "0");
    let (_second, second_addr) = start_worker("prefill", "0");
    let prefills = format!("{first_addr},{second_addr}");
    let (_router, url) = start_router(&prefills, &decode_addr, &[]);
    let status = |path: &'static str| {
        let url = url.clone();
        async move {
            let response = crate::harness::client()
                .get(format!("{url}{path}"))
                .send()
                .await
                .expect("answered");
            response.status().as_u16()
        }
    };
    // Polls until `path` answers `want` (links notice a dead peer within a few seconds).
    let settles = |path: &'static str, want: u16| {
        let status = &status;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let got = status(path).await;
                if got == want || std::time::Instant::now() > deadline {
                    return got;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    runtime().block_on(async {
        assert_eq!(status("/health").await, 200);
        assert_eq!(status("/health/ready").await, 200);
        let _ = first.child.kill();
        let _ = first.child.wait();
        assert_eq!(settles("/health", 503).await, 503, "one prefill down");
        assert_eq!(status("/health/ready").await, 200, "the other path serves");
        let answer = post(&url, "/v1/completions", completion("The capital of", 2)).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let _ = decode.child.kill();
        let _ = decode.child.wait();
        assert_eq!(settles("/health/ready", 503).await, 503, "no decode left");
    });
}

/// lm-evaluation-harness, as users run it against a server (`local-completions`, tokenizing
/// through `/tokenize`, and `gguf`, its client for llama-cpp-python's server), scores a small
/// log-likelihood task shipped in tests/data/lm_eval against `airlock serve`: every choice's
/// log-likelihood equals the one the server's own `echo` + `logprobs` answer gives, and the
/// accuracy is llama.cpp's on the same file (0.867; tests/data/reference_prompt_logprobs.json).
#[test]
fn lm_evaluation_harness_scores_a_log_likelihood_task_against_serve() {
    let (_serve, url) = spawn_serve("4096", &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/lm_eval_check.py");
    let task = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/lm_eval/capitals_and_facts.jsonl"
    );
    let reference = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/reference_prompt_logprobs.json"
    );
    let output = std::process::Command::new("python3")
        .args([script, &base_url(&url), MODEL, task, reference])
        .current_dir(crate::harness::scratch())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("lm-eval check passed"),
        "lm-eval check failed (scripts/test-deps.sh installs lm_eval)\nstdout:\n{stdout}\n\
         stderr:\n{stderr}"
    );
    println!("{stdout}");
}

/// `--log-format json`: every line `serve` writes on stderr, up to its workers' "worker
/// loaded", is one JSON object with a timestamp, a level and its fields, as log collectors
/// read them. Both workers' lines say they run on the model that merges their passes.
#[test]
fn json_logs_are_one_object_per_line() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let mut child = airlock()
        .args([
            "serve",
            "--log-format",
            "json",
            "--port",
            &port,
            "--threads",
            "1",
        ])
        .args(["--context-length", "512", "--model", &model_path()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("airlock starts");
    let stderr = child.stderr.take().expect("piped stderr");
    let process = Process {
        child,
        name: "serve --log-format json",
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut loaded = 0;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            loaded += usize::from(line.contains("worker loaded"));
            let _ = tx.send(line);
            if loaded == 2 {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let mut loaded = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(60)) {
        if line.contains("worker loaded") {
            loaded.push(line.clone());
        }
        lines.push(line);
        if loaded.len() == 2 {
            break;
        }
    }
    drop(process);
    assert_eq!(
        loaded.len(),
        2,
        "serve logged both workers loading: {lines:#?}"
    );
    for line in &loaded {
        let object: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert_eq!(
            object["fields"]["merges_passes"],
            serde_json::Value::Bool(true),
            "serve's workers run on one model that merges their passes: {line}"
        );
    }
    for line in &lines {
        let object: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
        for key in ["timestamp", "level", "fields"] {
            assert!(object.get(key).is_some(), "no {key:?} in {line}");
        }
    }
}

/// Sends SIGTERM to `process` (how Kubernetes stops a pod).
fn terminate(process: &Process) {
    let status = Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", process.child.id())])
        .status()
        .expect("sh runs");
    assert!(status.success(), "kill -TERM {}", process.name);
}

/// Waits (bounded) for `process` to exit by itself; its exit status.
fn wait_exit(process: &mut Process, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = process.child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} still running after {within:?}",
            process.name
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The router's `/health` workers: (address, up, draining).
async fn workers_health(url: &str) -> Vec<(String, bool, bool)> {
    let health = crate::harness::get_json(url, "/health").await;
    health["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .map(|w| {
            let address = w["address"].as_str().unwrap_or_default().to_string();
            (address, w["up"] == true, w["draining"] == true)
        })
        .collect()
}

/// Waits (bounded) until the router has every worker linked and none draining.
async fn wait_all_linked(url: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let workers = workers_health(url).await;
        if workers.iter().all(|(_, up, draining)| *up && !*draining) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not every worker linked: {workers:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 28's acceptance, scaled to a 2-core machine: a router in front of 2 prefill and 2
/// decode workers, each its own process. Under 16 concurrent requests (12 whole, 4 streamed)
/// one decode worker is killed (SIGKILL) and one prefill is stopped (SIGTERM). Every whole
/// answer is a complete 200 with the text the same prompt gets alone (the ones that were on
/// the killed worker were retried on a survivor); every stream is complete or ends with an
/// `error` event and no `[DONE]`; the stopped prefill drains and exits 0; later requests
/// succeed; restarted workers rejoin; every pool is back to baseline.
#[test]
fn two_by_two_workers_ride_out_a_killed_decode_and_a_drained_prefill() {
    let answers = kill_one_decode_and_stop_one_prefill_under_load("2");
    for (i, (status, text)) in answers.iter().enumerate().skip(12) {
        assert_eq!(*status, 200, "a stream starts only once it can run: {text}");
        let complete = text.contains("[DONE]") && text.contains("\"finish_reason\":\"length\"");
        let failed = text.contains("event: error") && !text.contains("[DONE]");
        assert!(
            complete ^ failed,
            "stream {i} neither complete nor cleanly failed: {text}"
        );
    }
}

/// The canary of the test above: with the router's retries off, whole answers that were on
/// the killed decode worker get 503 (what every one of them got before retries).
#[test]
fn without_retries_a_killed_decode_fails_its_whole_answers() {
    let answers = kill_one_decode_and_stop_one_prefill_under_load("0");
    let failed = answers[..12]
        .iter()
        .filter(|(status, _)| *status == 503)
        .count();
    assert!(failed >= 1, "{answers:?}");
}

/// The run behind both tests above, with the router's `--retries`: every check that holds
/// either way is made here; the whole answers come back as (status, body).
fn kill_one_decode_and_stop_one_prefill_under_load(retries: &str) -> Vec<(u16, String)> {
    let (decode_a, decode_a_addr) = start_worker("decode", "0");
    let (_decode_b, decode_b_addr) = start_worker("decode", "0");
    let (mut prefill_a, prefill_a_addr) = start_worker("prefill", "0");
    let (_prefill_b, prefill_b_addr) = start_worker("prefill", "0");
    let prefills = format!("{prefill_a_addr},{prefill_b_addr}");
    let decodes = format!("{decode_a_addr},{decode_b_addr}");
    let (_router, url) = start_router(&prefills, &decodes, &["--retries", retries]);
    // Long enough that one answer's decode outlasts the prefills of all sixteen, so twelve or
    // more run at once even on a fast machine (at 24 tokens a fast one finished them first).
    const MAX_TOKENS: usize = 64;
    let prompts: Vec<String> = (0..16)
        .map(|i| format!("Note {i}: the colours of the rainbow, in order, are"))
        .collect();
    let body = |prompt: &str, stream: bool| {
        serde_json::json!({
            "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": true, "stream": stream,
        })
    };
    let references: Vec<String> = runtime().block_on(async {
        wait_all_linked(&url).await;
        let mut references = Vec::new();
        for prompt in &prompts[..12] {
            let answer = post(&url, "/v1/completions", body(prompt, false)).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            references.push(answer.json()["choices"][0]["text"].as_str().unwrap().into());
        }
        references
    });
    let load: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let (url, request) = (url.clone(), body(prompt, i >= 12));
            runtime().spawn(async move {
                let answer = crate::harness::client()
                    .post(format!("{url}/v1/completions"))
                    .json(&request)
                    .send()
                    .await
                    .expect("sent");
                let status = answer.status().as_u16();
                (status, answer.text().await.unwrap_or_default())
            })
        })
        .collect();
    // The kills land while most of the load is generating (started, not finished), on a
    // machine of any speed.
    runtime().block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let page = crate::harness::metrics(&url).await;
            let running = crate::harness::samples(&page, "airlock_requests_running");
            if running.first().is_some_and(|(_, n)| *n >= 12.0) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the load never ran: {page}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    drop(decode_a);
    terminate(&prefill_a);
    let answers: Vec<(u16, String)> = runtime().block_on(async {
        let mut answers = Vec::new();
        for task in load {
            let answer = tokio::time::timeout(Duration::from_secs(120), task)
                .await
                .expect("every request ends")
                .expect("task");
            answers.push(answer);
        }
        answers
    });
    // Never a wrong 200: a whole answer is the prompt's own text, complete, or an error.
    for (i, (status, text)) in answers[..12].iter().enumerate() {
        let json: serde_json::Value = serde_json::from_str(text).expect("JSON");
        match status {
            200 => {
                assert_eq!(
                    json["choices"][0]["text"], references[i],
                    "answer {i}: {text}"
                );
                assert_eq!(json["usage"]["completion_tokens"], MAX_TOKENS, "{text}");
            }
            503 => assert!(json["error"]["code"].is_string(), "{text}"),
            _ => panic!("whole answer {i}: {status} {text}"),
        }
    }
    if retries != "0" {
        for (i, (status, text)) in answers[..12].iter().enumerate() {
            assert_eq!(*status, 200, "whole answer {i} was retried: {text}");
        }
    }
    let retries_on = retries != "0";
    let status = wait_exit(&mut prefill_a, Duration::from_secs(60));
    assert!(status.success(), "a drained prefill exits 0: {status}");
    runtime().block_on(async {
        let page = crate::harness::metrics(&url).await;
        let retried: f64 = crate::harness::samples(&page, "airlock_request_retries_total")
            .iter()
            .map(|s| s.1)
            .sum();
        assert_eq!(
            retried >= 1.0,
            retries_on,
            "the killed decode's requests were retried: {page}"
        );
        for prompt in &prompts[..4] {
            let answer = post(&url, "/v1/completions", body(prompt, false)).await;
            assert_eq!(
                answer.status, 200,
                "served by the survivors: {}",
                answer.body
            );
        }
    });
    let port = |addr: &str| addr.rsplit(':').next().expect("port").to_string();
    let (_decode_a, _) = start_worker("decode", &port(&decode_a_addr));
    let (_prefill_a, _) = start_worker("prefill", &port(&prefill_a_addr));
    runtime().block_on(async {
        wait_all_linked(&url).await;
        for prompt in &prompts[..4] {
            let answer = post(&url, "/v1/completions", body(prompt, false)).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
        }
        let (idle, page) = crate::harness::wait_idle(&url).await;
        assert!(idle, "{page}");
    });
    answers
}

/// SIGTERM to a router: readiness answers 503 `draining` at once (during `--drain-delay-ms`
/// the port stays open for the probe), the request in progress still completes with 200,
/// and the process exits 0.
#[test]
fn a_router_told_to_stop_turns_unready_finishes_its_requests_and_exits() {
    let (_decode, decode_addr) = start_worker("decode", "0");
    let (_prefill, prefill_addr) = start_worker("prefill", "0");
    let (mut router, url) =
        start_router(&prefill_addr, &decode_addr, &["--drain-delay-ms", "3000"]);
    runtime().block_on(wait_all_linked(&url));
    let request = {
        let url = url.clone();
        runtime().spawn(async move {
            let body = serde_json::json!({
                "model": MODEL, "prompt": "Count to ten:", "max_tokens": 64,
                "temperature": 0, "ignore_eos": true,
            });
            post(&url, "/v1/completions", body).await
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    terminate(&router);
    runtime().block_on(async {
        // The signal lands asynchronously: readiness turns within the delay, never after.
        let deadline = std::time::Instant::now() + Duration::from_millis(2500);
        loop {
            let ready = crate::harness::client()
                .get(format!("{url}/health/ready"))
                .send()
                .await
                .expect("the port is open during the drain delay");
            if ready.status().as_u16() == 503 {
                assert_eq!(ready.text().await.unwrap(), r#"{"status":"draining"}"#);
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "still ready after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let answer = request.await.expect("task");
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.json()["usage"]["completion_tokens"], 64);
    });
    let status = wait_exit(&mut router, Duration::from_secs(30));
    assert!(status.success(), "{status}");
}

/// Workers named by DNS (`dns:NAME:PORT`, looked up every `--dns-interval-ms`) are linked
/// and serve like workers named by address; `/health` lists each by the address found.
#[test]
fn workers_named_through_dns_are_found_linked_and_serve() {
    let (_decode, decode_addr) = start_worker("decode", "0");
    let (_prefill, prefill_addr) = start_worker("prefill", "0");
    let port = |addr: &str| addr.rsplit(':').next().expect("port").to_string();
    // A name whose records the test controls needs a DNS server; an address literal goes
    // through the same lookup (`getaddrinfo`) and the same membership code.
    let decode = format!("dns:127.0.0.1:{}", port(&decode_addr));
    let prefill = format!("dns:127.0.0.1:{}", port(&prefill_addr));
    let (_router, url) = start_router(&prefill, &decode, &["--dns-interval-ms", "200"]);
    runtime().block_on(async {
        wait_all_linked(&url).await;
        let mut workers: Vec<String> = workers_health(&url)
            .await
            .into_iter()
            .map(|(address, _, _)| address)
            .collect();
        workers.sort();
        let mut expected = vec![decode_addr.clone(), prefill_addr.clone()];
        expected.sort();
        assert_eq!(workers, expected);
        let answer = post(
            &url,
            "/v1/completions",
            completion("The capital of France is", 4),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    });
    let bad = airlock()
        .args([
            "router",
            "--decode",
            "dns:decode-no-port",
            "--prefill",
            "127.0.0.1:1",
        ])
        .args(["--model", &model_path()])
        .output()
        .expect("airlock runs");
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("dns:NAME:PORT"), "{stderr}");
}

/// Prefix-aware routing: with two unified workers, a request whose prompt starts like one
/// still running goes to that one's worker (busier by one, within the slack), where its
/// prompt pages are cached, rather than to the idle one that would compute them again.
#[test]
fn a_prompt_goes_to_the_worker_that_holds_its_prefix() {
    let (_a, a) = start_faulty_worker_with("unified", "0", "", &["--worker-only"]);
    let (_b, b) = start_faulty_worker_with("unified", "0", "", &["--worker-only"]);
    let (_router, url) = spawn(
        "router",
        &["router", "--port", "0", "--unified", &format!("{a},{b}")],
        " at ",
    );
    let url = base_url(&url);
    let shared = "The committee met on Tuesday to review the budget, the schedule and the \
                  open questions from the last meeting. "
        .repeat(6);
    runtime().block_on(async {
        wait_all_linked(&url).await;
        let long = {
            let (url, prompt) = (url.clone(), format!("{shared}Summarize the meeting."));
            tokio::spawn(async move {
                let body = serde_json::json!({
                    "model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0,
                    "ignore_eos": true,
                });
                post(&url, "/v1/completions", body).await
            })
        };
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let answer = post(
            &url,
            "/v1/completions",
            completion(&format!("{shared}List the open questions."), 4),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let usage = &answer.json()["usage"];
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached >= 96,
            "the shared prefix came from the first request's worker: {usage}"
        );
        assert_eq!(long.await.expect("task").status, 200);
    });
}

/// A minimal OTLP/HTTP collector: every JSON body POSTed to it, answered 200.
fn start_collector() -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let listener = runtime()
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("collector port");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let kept = bodies.clone();
    runtime().spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut chunk = [0; 8192];
                loop {
                    let n = stream.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&request).into_owned();
                    let Some((head, body)) = text.split_once("\r\n\r\n") else {
                        continue;
                    };
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(str::to_string)
                        })
                        .and_then(|l| l.trim().parse().ok())
                        .unwrap_or(0);
                    if body.len() < length {
                        continue;
                    }
                    if head.starts_with("POST /v1/traces ") {
                        if let Ok(json) = serde_json::from_str(body) {
                            kept.lock().unwrap().push(json);
                        }
                    }
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                        .await;
                    return;
                }
            });
        }
    });
    (url, bodies)
}

/// Every span the collector got: (service.name, span JSON).
fn collected_spans(
    bodies: &std::sync::Mutex<Vec<serde_json::Value>>,
) -> Vec<(String, serde_json::Value)> {
    let mut spans = Vec::new();
    for body in bodies.lock().unwrap().iter() {
        for resource in body["resourceSpans"].as_array().into_iter().flatten() {
            let service = resource["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["key"] == "service.name")
                .and_then(|a| a["value"]["stringValue"].as_str())
                .unwrap_or_default()
                .to_string();
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                for span in scope["spans"].as_array().into_iter().flatten() {
                    spans.push((service.clone(), span.clone()));
                }
            }
        }
    }
    spans
}

/// With `--otlp-endpoint`, one request is one trace across the three processes: the
/// router's span continues the client's `traceparent`, and the prefill's and the decode's
/// spans are its children (the context travels in the `Submit` frame).
#[test]
fn one_request_is_one_trace_across_router_prefill_and_decode() {
    let (collector, bodies) = start_collector();
    let otlp = ["--otlp-endpoint", collector.as_str()];
    let (_decode, decode_addr) = start_faulty_worker_with("decode", "0", "", &otlp);
    let (_prefill, prefill_addr) = start_faulty_worker_with("prefill", "0", "", &otlp);
    let (_router, url) = start_router(
        &prefill_addr,
        &decode_addr,
        &["--otlp-endpoint", &collector],
    );
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    runtime().block_on(async {
        wait_all_linked(&url).await;
        let answer = crate::harness::client()
            .post(format!("{url}/v1/completions"))
            .header("traceparent", format!("00-{client_trace}-{client_span}-01"))
            .json(&completion("The capital of France is", 4))
            .send()
            .await
            .expect("sent");
        assert_eq!(answer.status().as_u16(), 200);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let spans = collected_spans(&bodies);
            let of = |service: &str| {
                spans
                    .iter()
                    .find(|(s, span)| s == service && span["traceId"] == client_trace)
                    .map(|(_, span)| span.clone())
            };
            if let (Some(router), Some(prefill), Some(decode)) = (
                of("airlock-router"),
                of("airlock-prefill"),
                of("airlock-decode"),
            ) {
                assert_eq!(router["parentSpanId"], client_span, "{router}");
                assert_eq!(router["name"], "POST /v1/completions");
                assert_eq!(router["status"]["code"], 1, "{router}");
                for worker in [&prefill, &decode] {
                    assert_eq!(worker["parentSpanId"], router["spanId"], "{worker}");
                    assert_ne!(worker["spanId"], router["spanId"]);
                }
                assert_eq!(prefill["name"], "prefill");
                assert_eq!(decode["name"], "decode");
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "spans of the request's trace missing: {spans:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
