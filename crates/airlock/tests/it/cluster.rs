//! A deployment that is wrong refuses to run (I8, I11): a worker whose pool cannot hold one
//! request of its context length does not start, `preflight` names the bad node, the router
//! refuses any worker whose handshake differs in one field or that lacks the cluster secret,
//! and a peer without the secret is refused and counted.

use crate::cli::{airlock, model_path};
use crate::harness::{completion, model_file, post, runtime, samples, start, Mode, Options, MODEL};
use std::time::{Duration, Instant};
use transfer::transport::{BoxStream, Tcp, Transport};
use transfer::{
    accept_handshake, connect_handshake, ClusterSecret, Expectation, HandshakeError, PeerRole,
    Role, WorkerInfo,
};

fn temp_file(name: &str, text: &str) -> String {
    let dir = crate::harness::scratch().join(format!("airlock-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path.display().to_string()
}

fn secret_file() -> String {
    temp_file("cluster.secret", "cluster-test-secret-0123456789abcdef\n")
}

#[test]
fn a_worker_whose_pool_cannot_hold_its_context_refuses_to_start() {
    // The incident's shape scaled to this model: a 1,048,576-token context over a 681,280-token
    // pool is, at 8,192 tokens of context, a 5,322-token pool (5,312 in whole pages).
    for (flag, value, capacity) in [
        ("--kv-tokens", "5322", "5312"),
        ("--kv-memory", "64MiB", "2912"),
    ] {
        let output = airlock()
            .args([
                "decode",
                "--port",
                "0",
                flag,
                value,
                "--context-length",
                "8192",
            ])
            .args(["--model", &model_path(), "--threads", "1"])
            .args(["--cluster-secret-file", &secret_file()])
            .output()
            .expect("runs");
        assert_eq!(output.status.code(), Some(78), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        for needle in [capacity, "8192", "--kv-memory", "--context-length"] {
            assert!(stderr.contains(needle), "{flag} {value}: {stderr}");
        }
    }
}

#[test]
fn context_length_auto_takes_what_the_pool_holds() {
    let mut child = airlock()
        .args([
            "unified",
            "--port",
            "0",
            "--kv-tokens",
            "4096",
            "--context-length",
            "auto",
        ])
        .args(["--model", &model_path(), "--threads", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starts");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    // Keep reading: a closed pipe would end the server at its next line of output.
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            if line.contains(" at http://") {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("serving line");
    let url = line
        .split(" at ")
        .nth(1)
        .expect("url")
        .trim_end_matches("/v1")
        .to_string();
    runtime().block_on(async {
        let health: serde_json::Value = crate::harness::client()
            .get(format!("{url}/health"))
            .send()
            .await
            .expect("health")
            .json()
            .await
            .expect("json");
        assert_eq!(health["context_length"], 4096, "{health}");
        assert_eq!(health["workers"][0]["context_length"], 4096, "{health}");
        let answer = post(&url, "/v1/completions", completion("Hello", 4096)).await;
        assert_eq!(answer.status, 400, "{}", answer.body);
        assert!(answer.message().contains("4096"), "{}", answer.body);
        let answer = post(&url, "/v1/completions", completion("Hello", 4)).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    });
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn preflight_names_the_node_that_cannot_hold_its_context() {
    let good = "[router]\ncontext_length = 8192\n\
                [[node]]\nname = \"prefill-a\"\nrole = \"prefill\"\nkv_memory = \"256MiB\"\n\
                [[node]]\nname = \"decode-b\"\nrole = \"decode\"\nkv_tokens = 16384\n";
    let output = airlock()
        .args([
            "preflight",
            &temp_file("good.toml", good),
            "--model",
            &model_path(),
        ])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("preflight ok"), "{stdout}");

    let bad = good.replace("kv_tokens = 16384", "kv_tokens = 5322");
    let output = airlock()
        .args([
            "preflight",
            &temp_file("bad.toml", &bad),
            "--model",
            &model_path(),
        ])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stdout.contains("FAIL"), "{stdout}");
    assert!(
        stdout.contains("decode-b: pool holds 5312 tokens, under its context length 8192"),
        "{stdout}"
    );
    assert!(
        stderr.contains("decode-b") && !stderr.contains("prefill-a"),
        "{stderr}"
    );
}

#[test]
fn preflight_checks_a_running_deployment_through_health() {
    let mut options = Options::new(Mode::Disaggregated);
    options.kv_tokens = 8192;
    let server = start(options);
    let output = airlock()
        .args(["preflight", "--url", &server.url])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("preflight ok: 2 nodes"), "{stdout}");
}

#[test]
fn preflight_of_a_keyed_deployment_needs_a_key_and_says_so() {
    let mut options = Options::new(Mode::Disaggregated);
    options.kv_tokens = 8192;
    options.keys = Some("[tenants.ops]\nkeys = [\"sk-ops-0123456789\"]\n");
    let server = start(options);
    let output = airlock()
        .args(["preflight", "--url", &server.url])
        .env_remove("AIRLOCK_API_KEY")
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--api-key"), "{stderr}");
    let output = airlock()
        .args([
            "preflight",
            "--url",
            &server.url,
            "--api-key",
            "sk-ops-0123456789",
        ])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("preflight ok: 2 nodes"), "{stdout}");
}

/// A worker that speaks the protocol but describes itself as `info`, with `secret`.
fn impostor(secret: ClusterSecret, info: WorkerInfo) -> String {
    runtime().block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let secret = secret.clone();
                let info = info.clone();
                tokio::spawn(async move {
                    let mut stream: BoxStream = Box::new(stream);
                    // A peer that fails our handshake is hung up on, as a worker does; a
                    // greeted link is held open: only the router's verdict should end it.
                    if accept_handshake(&mut stream, &secret, &info).await.is_ok() {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                });
            }
        });
        address
    })
}

/// A worker from another protocol version: it answers every greeting with a frame of the
/// next version.
fn old_protocol_worker() -> String {
    runtime().block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    let _ = transfer::transport::read_frame(&mut stream).await;
                    let mut body = transfer::Frame::Proof { proof: [0; 32] }.encode();
                    let version = transfer::PROTOCOL_VERSION + 1;
                    body[2..4].copy_from_slice(&version.to_le_bytes());
                    let _ = stream.write_all(&(body.len() as u32).to_le_bytes()).await;
                    let _ = stream.write_all(&body).await;
                    tokio::time::sleep(Duration::from_secs(60)).await;
                });
            }
        });
        address
    })
}

#[test]
fn the_router_refuses_a_worker_that_differs_in_any_field_and_serves_with_the_rest() {
    let file = model_file();
    let options = Options::new(Mode::Unified);
    let good = WorkerInfo {
        role: Role::Unified,
        name: "impostor".into(),
        model_id: MODEL.into(),
        weights_hash: file.weights_hash,
        kv_dtype: config::KV_DTYPE.into(),
        layer_count: file.config.layer_count as u32,
        kv_head_count: file.config.kv_head_count as u32,
        head_dim: file.config.head_dim as u32,
        page_size_tokens: 16,
        capacity_tokens: 8192,
        context_length: file.context_length as u32,
        weight_bytes: 1,
        kv_bytes: 1,
        epoch: 1,
    };
    type Change = Box<dyn Fn(&mut WorkerInfo)>;
    let variants: Vec<(&str, Change)> = vec![
        ("model_id", Box::new(|i| i.model_id = "other-model".into())),
        ("weights_hash", Box::new(|i| i.weights_hash ^= 1)),
        ("kv_dtype", Box::new(|i| i.kv_dtype = "f32".into())),
        ("page_size", Box::new(|i| i.page_size_tokens = 32)),
        ("layers", Box::new(|i| i.layer_count += 1)),
        ("kv_heads", Box::new(|i| i.kv_head_count += 1)),
        ("head_dim", Box::new(|i| i.head_dim *= 2)),
        ("context_length", Box::new(|i| i.context_length /= 2)),
        ("role", Box::new(|i| i.role = Role::Decode)),
    ];
    let mut options = options;
    let mut reasons = Vec::new();
    for (reason, change) in &variants {
        let mut info = good.clone();
        change(&mut info);
        let address = impostor(options.secret.clone(), info);
        options.extra_workers.push((address, Role::Unified));
        reasons.push(*reason);
    }
    // One that does not hold the cluster secret, and one from another protocol version.
    let stranger = impostor(ClusterSecret::random(), good.clone());
    options.extra_workers.push((stranger, Role::Unified));
    reasons.push("auth");
    options
        .extra_workers
        .push((old_protocol_worker(), Role::Unified));
    reasons.push("protocol_version");
    let secret = options.secret.clone();
    let server = start(options);

    runtime().block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let page = crate::harness::metrics(&server.url).await;
            let refused = samples(&page, "airlock_workers_refused_total");
            let missing: Vec<&&str> = reasons
                .iter()
                .filter(|reason| {
                    !refused
                        .iter()
                        .any(|(labels, n)| labels.contains(&format!("\"{reason}\"")) && *n >= 1.0)
                })
                .collect();
            let answer = post(&server.url, "/v1/completions", completion("Hello", 4)).await;
            if missing.is_empty() && answer.status == 200 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not refused: {missing:?}; last answer {}\n{page}",
                answer.status
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Every request goes to the one good worker, many times over.
        for _ in 0..4 {
            let answer = post(&server.url, "/v1/completions", completion("Hello", 2)).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
        }

        // A peer without the secret cannot link to a real worker, and the worker counts it.
        let worker = &server.worker_addresses[0];
        let mut stream = Tcp.connect(worker).await.expect("connect");
        let wrong = ClusterSecret::random();
        let expect = Expectation {
            model_id: MODEL.into(),
            weights_hash: good.weights_hash,
            kv_dtype: config::KV_DTYPE.into(),
            page_size_tokens: 16,
            layer_count: good.layer_count,
            kv_head_count: good.kv_head_count,
            head_dim: good.head_dim,
            context_length: None,
        };
        let refused = connect_handshake(&mut stream, PeerRole::Router, &wrong, &expect).await;
        assert!(matches!(refused, Err(HandshakeError::Auth)), "{refused:?}");
        drop(stream);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let page = crate::harness::metrics(&server.url).await;
            let failures: f64 = samples(&page, "airlock_cluster_auth_failures_total")
                .iter()
                .map(|s| s.1)
                .sum();
            if failures >= 1.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "auth failure not counted:\n{page}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // With the secret, the same peer is let in.
        let mut stream = Tcp.connect(worker).await.expect("connect");
        let info = connect_handshake(&mut stream, PeerRole::Router, &secret, &expect).await;
        assert!(info.is_ok(), "{info:?}");
    });
}
