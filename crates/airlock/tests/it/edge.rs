//! The HTTP edge under clients that never finish (TEST-MATRIX A, SECURITY.md "the edge"):
//! half-sent headers and bodies are closed within their timeouts, connections past the caps
//! are answered at once, and a client with a valid key is answered throughout. Also: only
//! JSON reaches a JSON endpoint (415), no CORS header unless configured, a hang-up mid-body is
//! counted as one, and `/health` tells an unauthenticated caller only up or down.

use crate::harness::{
    client, completion, metrics, post_raw, runtime, samples, start, Backend, Mode, Options,
    TestServer,
};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const KEYS: &str = r#"
[tenants.alice]
keys = ["sk-alice-0123456789"]
"#;
const ALICE: &str = "sk-alice-0123456789";

/// Small caps and short timeouts, so a test can exceed and outlast them.
fn tight_edge(options: &mut Options) {
    options.edge.header_timeout = Duration::from_secs(4);
    options.edge.keep_alive_timeout = Duration::from_secs(1);
    options.edge.connections_max = 24;
    options.edge.connections_per_client_max = 8;
    options.body_timeout = Duration::from_secs(4);
}

fn oracle_server(keys: Option<&'static str>, tight: bool) -> TestServer {
    let mut options = Options::new(Mode::Unified);
    options.backend = Backend::Oracle;
    options.kv_tokens = 4096;
    options.context_length = Some(1024);
    options.keys = keys;
    if tight {
        tight_edge(&mut options);
    }
    start(options)
}

fn address(server: &TestServer) -> SocketAddr {
    server
        .url
        .trim_start_matches("http://")
        .parse()
        .expect("the test server's address")
}

/// A connection to `server` from loopback address `from` (127.0.0.x: another "client").
async fn connect_from(from: [u8; 4], server: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from((from, 0)))
        .expect("bind a loopback source address");
    socket.connect(server).await.expect("connect")
}

/// What the server sends before it closes, or `None` if it is still open after `within`.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut received = Vec::new();
    let read_all = async {
        let mut buffer = [0u8; 4096];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
    };
    tokio::time::timeout(within, read_all).await.ok()?;
    Some(String::from_utf8_lossy(&received).into_owned())
}

/// The request with a valid key that must keep being answered.
async fn keyed_request_is_answered(url: &str, when: &str) {
    let body = completion("The capital of France is", 4).to_string();
    let answer = post_raw(url, "/v1/completions", body.into_bytes(), Some(ALICE)).await;
    assert_eq!(answer.status, 200, "{when}: {}", answer.body);
}

fn counter(page: &str, name: &str, label: &str) -> f64 {
    samples(page, name)
        .iter()
        .filter(|(labels, _)| labels.contains(label))
        .map(|(_, value)| value)
        .sum()
}

const HALF_HEADERS: &[u8] = b"POST /v1/completions HTTP/1.1\r\nHost: airlock\r\nX-Slow: ";

fn half_body(key: Option<&str>, chunked: bool) -> Vec<u8> {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let length = if chunked {
        "Transfer-Encoding: chunked\r\n\r\n9\r\n{\"model\":"
    } else {
        "Content-Length: 1000\r\n\r\n{\"model\":"
    };
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: airlock\r\nContent-Type: application/json\r\n\
         {auth}{length}"
    )
    .into_bytes()
}

#[test]
fn half_sent_requests_past_the_caps_are_closed_and_a_keyed_client_is_answered_throughout() {
    let server = oracle_server(Some(KEYS), true);
    let url = server.url.clone();
    let target = address(&server);
    runtime().block_on(async move {
        keyed_request_is_answered(&url, "before any attack").await;

        // One address holds its whole share (8) with headers it never finishes.
        let mut held = Vec::new();
        for _ in 0..8 {
            let mut stream = connect_from([127, 0, 0, 2], target).await;
            stream.write_all(HALF_HEADERS).await.expect("write");
            held.push(stream);
        }
        keyed_request_is_answered(&url, "with one address at its cap").await;
        // More from the same address are answered 429 at once, with OpenAI error JSON.
        for _ in 0..4 {
            let mut stream = connect_from([127, 0, 0, 2], target).await;
            let answer = read_until_closed(&mut stream, Duration::from_secs(5))
                .await
                .expect("a refused connection is answered and closed at once");
            assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
            assert!(
                answer.contains("\"code\":\"rate_limit_exceeded\""),
                "{answer}"
            );
        }

        // Other addresses fill every remaining slot and more: half-sent headers, bodies with
        // a valid key that stop short (Content-Length and chunked), and bodies without one.
        for client in 3..=10u8 {
            let from = [127, 0, 0, client];
            for (i, request) in [
                HALF_HEADERS.to_vec(),
                half_body(Some(ALICE), false),
                half_body(Some(ALICE), true),
                half_body(None, false),
            ]
            .into_iter()
            .enumerate()
            {
                let mut stream = connect_from(from, target).await;
                stream.write_all(&request).await.expect("write");
                if i == 3 {
                    // No key: 401 without the body being read, and the connection closed.
                    let answer = read_until_closed(&mut stream, Duration::from_secs(5))
                        .await
                        .expect("answered and closed at once");
                    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
                } else {
                    held.push(stream);
                }
            }
            keyed_request_is_answered(&url, &format!("with 127.0.0.{client} attacking")).await;
        }
        assert!(held.len() > 24, "the test opened more than the cap of 24");

        // Every held connection is closed by the server within its timeout (4 s here; a
        // wide margin for a loaded machine), a body that stopped short with a 408.
        let started = Instant::now();
        let mut timed_out_bodies = 0;
        for stream in &mut held {
            let answer = read_until_closed(stream, Duration::from_secs(30))
                .await
                .expect("the server closes a half-sent request");
            if answer.starts_with("HTTP/1.1 408") {
                timed_out_bodies += 1;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(
            timed_out_bodies > 0,
            "some keyed half-bodies ran into the body timeout"
        );
        keyed_request_is_answered(&url, "after the attack").await;

        let page = metrics(&url).await;
        let refused = "airlock_http_connections_refused_total";
        let closed = "airlock_http_connections_closed_total";
        assert!(counter(&page, refused, "per_client") >= 4.0, "{page}");
        assert!(counter(&page, closed, "header_timeout") > 0.0, "{page}");
        assert!(counter(&page, closed, "evicted") > 0.0, "{page}");
        let timeouts = counter(&page, "airlock_requests_total", "request_timeout");
        assert!(timeouts > 0.0, "{page}");
    });
}

#[test]
fn a_kept_alive_connection_with_no_request_is_closed_after_its_timeout() {
    let server = oracle_server(Some(KEYS), true);
    let target = address(&server);
    runtime().block_on(async move {
        let mut stream = TcpStream::connect(target).await.expect("connect");
        let request = format!(
            "GET /v1/models HTTP/1.1\r\nHost: airlock\r\nAuthorization: Bearer {ALICE}\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        let answer = read_until_closed(&mut stream, Duration::from_secs(30))
            .await
            .expect("closed once idle past the keep-alive timeout");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let page = metrics(&server.url).await;
        let idle = counter(&page, "airlock_http_connections_closed_total", "idle");
        assert!(idle >= 1.0, "{page}");
    });
}

#[test]
fn json_endpoints_refuse_other_content_types_with_415() {
    // Single-tenant: every caller is let in, so the content type is what stops a web page's
    // cross-origin "simple" POST.
    let server = oracle_server(None, false);
    let body = completion("The capital of France is", 4).to_string();
    runtime().block_on(async {
        for content_type in [
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/jsonp"),
            None,
        ] {
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let mut request = client()
                    .post(format!("{}{path}", server.url))
                    .body(body.clone());
                if let Some(content_type) = content_type {
                    request = request.header("content-type", content_type);
                }
                let response = request.send().await.expect("answered");
                assert_eq!(response.status().as_u16(), 415, "{content_type:?} {path}");
                let error: serde_json::Value = response.json().await.expect("JSON error");
                assert_eq!(error["error"]["code"], "unsupported_media_type");
                let message = error["error"]["message"].as_str().unwrap_or_default();
                assert!(message.contains("application/json"), "{message}");
            }
        }
        for content_type in ["application/json; charset=utf-8", "Application/JSON"] {
            let response = client()
                .post(format!("{}/v1/completions", server.url))
                .header("content-type", content_type)
                .body(body.clone())
                .send()
                .await
                .expect("answered");
            assert_eq!(response.status().as_u16(), 200, "{content_type}");
        }
    });
}

fn cors_headers(response: &reqwest::Response) -> Vec<String> {
    response
        .headers()
        .keys()
        .map(|name| name.as_str().to_string())
        .filter(|name| name.starts_with("access-control-"))
        .collect()
}

#[test]
fn no_cors_header_is_sent_unless_an_origin_is_configured() {
    let default = oracle_server(None, false);
    let mut options = Options::new(Mode::Unified);
    options.backend = Backend::Oracle;
    options.context_length = Some(1024);
    options.cors_allow_origins = vec!["https://app.example".into()];
    let configured = start(options);
    let body = completion("The capital of France is", 4).to_string();
    runtime().block_on(async {
        let preflight = |url: String, origin: &'static str| async move {
            client()
                .request(reqwest::Method::OPTIONS, format!("{url}/v1/completions"))
                .header("origin", origin)
                .header("access-control-request-method", "POST")
                .header("access-control-request-headers", "content-type")
                .send()
                .await
                .expect("answered")
        };
        let post = |url: String, origin: &'static str| {
            let body = body.clone();
            async move {
                client()
                    .post(format!("{url}/v1/completions"))
                    .header("origin", origin)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .expect("answered")
            }
        };
        // Off by default: nothing for any origin, preflight or not.
        for origin in ["https://app.example", "https://evil.example"] {
            let response = preflight(default.url.clone(), origin).await;
            assert_eq!(cors_headers(&response), Vec::<String>::new(), "{origin}");
            assert_ne!(response.status().as_u16(), 204, "no preflight is answered");
            let response = post(default.url.clone(), origin).await;
            assert_eq!(response.status().as_u16(), 200);
            assert_eq!(cors_headers(&response), Vec::<String>::new(), "{origin}");
        }
        // Configured: the named origin only.
        let response = preflight(configured.url.clone(), "https://app.example").await;
        assert_eq!(response.status().as_u16(), 204);
        let allowed = response.headers()["access-control-allow-origin"].clone();
        assert_eq!(allowed, "https://app.example");
        let response = post(configured.url.clone(), "https://app.example").await;
        assert_eq!(response.headers()["access-control-allow-origin"], allowed);
        let response = preflight(configured.url.clone(), "https://evil.example").await;
        assert_eq!(cors_headers(&response), Vec::<String>::new());
        let response = post(configured.url.clone(), "https://evil.example").await;
        assert_eq!(cors_headers(&response), Vec::<String>::new());
    });
}

#[test]
fn a_client_hanging_up_mid_body_is_counted_as_client_gone_not_too_large() {
    let server = oracle_server(Some(KEYS), false);
    let target = address(&server);
    runtime().block_on(async move {
        for chunked in [false, true] {
            let mut stream = TcpStream::connect(target).await.expect("connect");
            let request = half_body(Some(ALICE), chunked);
            stream.write_all(&request).await.expect("write");
            // Let the server start reading the body before the hang-up.
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(stream);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let page = loop {
            let page = metrics(&server.url).await;
            let gone = samples(&page, "airlock_requests_total")
                .iter()
                .filter(|(labels, _)| {
                    labels.contains("client_gone") && labels.contains("cancelled")
                })
                .map(|(_, value)| value)
                .sum::<f64>();
            if gone >= 2.0 || Instant::now() > deadline {
                break page;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let gone = counter(&page, "airlock_requests_total", "client_gone");
        assert_eq!(gone, 2.0, "both hang-ups counted as client_gone:\n{page}");
        let too_large = counter(&page, "airlock_requests_total", "request_too_large");
        assert_eq!(too_large, 0.0, "{page}");
    });
}

#[test]
fn health_tells_an_unauthenticated_caller_only_up_or_down() {
    let server = oracle_server(Some(KEYS), false);
    runtime().block_on(async {
        for path in ["/health", "/health/live", "/health/ready"] {
            let response = client()
                .get(format!("{}{path}", server.url))
                .send()
                .await
                .expect("answered");
            assert_eq!(response.status().as_u16(), 200, "{path}");
            let body: serde_json::Value = response.json().await.expect("JSON");
            assert_eq!(body, serde_json::json!({"status": "ok"}), "{path}");
        }
        let wrong_key = client()
            .get(format!("{}/health", server.url))
            .bearer_auth("sk-not-a-key")
            .send()
            .await
            .expect("answered");
        let body: serde_json::Value = wrong_key.json().await.expect("JSON");
        assert_eq!(body, serde_json::json!({"status": "ok"}));
        let detailed = client()
            .get(format!("{}/health", server.url))
            .bearer_auth(ALICE)
            .send()
            .await
            .expect("answered");
        let body: serde_json::Value = detailed.json().await.expect("JSON");
        let workers = body["workers"]
            .as_array()
            .expect("workers for a key holder");
        assert_eq!(workers.len(), 1);
        assert!(workers[0]["address"].is_string(), "{body}");
        assert!(body["context_length"].is_u64(), "{body}");
    });
}
