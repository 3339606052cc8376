//! Bad input at the HTTP edge: each gets its 4xx with an OpenAI error body and a message that
//! says what to do, nothing runs for it, and the server keeps serving (TEST-MATRIX group A).

use crate::harness::{
    completion, post, post_raw, runtime, start, wait_idle, Mode, Options, TestServer, MODEL,
};
use serde_json::json;
use std::sync::OnceLock;

fn server() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| start(Options::new(Mode::Disaggregated)))
}

/// Runs `check` for each case; every case must get `status` and `code`, and a message.
fn expect_errors(cases: Vec<(&str, Vec<u8>, u16, &str, &str)>) {
    let url = &server().url;
    runtime().block_on(async {
        for (name, body, status, code, needle) in cases {
            let answer = post_raw(url, "/v1/completions", body, None).await;
            assert_eq!(answer.status, status, "{name}: {}", answer.body);
            assert_eq!(answer.code(), code, "{name}");
            let message = answer.message();
            assert!(
                message.to_lowercase().contains(needle),
                "{name}: message {message:?} should mention {needle:?}"
            );
        }
        // The server is still serving, and nothing was left allocated.
        let answer = post(
            url,
            "/v1/completions",
            completion("The capital of France is", 4),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let (idle, page) = wait_idle(url).await;
        assert!(idle, "pools back to their start after bad input:\n{page}");
    });
}

fn body(value: serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

#[test]
fn malformed_bodies_get_400_with_the_reason() {
    expect_errors(vec![
        (
            "not JSON",
            b"{\"model\": ".to_vec(),
            400,
            "invalid_request",
            "invalid json",
        ),
        (
            "invalid UTF-8",
            vec![b'{', 0xff, 0xfe, b'}'],
            400,
            "invalid_request",
            "utf-8",
        ),
        (
            "empty body",
            Vec::new(),
            400,
            "invalid_request",
            "invalid json",
        ),
        (
            "wrong type for max_tokens",
            body(json!({"model": MODEL, "prompt": "hi", "max_tokens": "ten"})),
            400,
            "invalid_request",
            "invalid type",
        ),
        (
            "wrong type for prompt",
            body(json!({"model": MODEL, "prompt": {"text": "hi"}})),
            400,
            "invalid_request",
            "invalid json",
        ),
        (
            "missing model",
            body(json!({"prompt": "hi"})),
            400,
            "invalid_request",
            "model",
        ),
    ]);
}

#[test]
fn out_of_range_fields_get_400_naming_the_field() {
    let case = |name, extra: serde_json::Value, needle| {
        let mut request = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4});
        for (key, value) in extra.as_object().expect("object") {
            request[key] = value.clone();
        }
        (name, body(request), 400, "invalid_request", needle)
    };
    expect_errors(vec![
        case(
            "negative max_tokens",
            json!({"max_tokens": -5}),
            "max_tokens",
        ),
        case("zero max_tokens", json!({"max_tokens": 0}), "max_tokens"),
        case(
            "float max_tokens",
            json!({"max_tokens": 1e30}),
            "invalid type",
        ),
        case("n = 2", json!({"n": 2}), "n = 1"),
        case("temperature 5", json!({"temperature": 5}), "temperature"),
        case("top_p 0", json!({"top_p": 0}), "top_p"),
        case("empty prompt", json!({"prompt": ""}), "empty"),
        case(
            "token out of vocab",
            json!({"prompt": [1, 2, 999999]}),
            "vocabulary",
        ),
        case("negative token", json!({"prompt": [-1]}), "vocabulary"),
        case("two prompts", json!({"prompt": ["a", "b"]}), "one prompt"),
        case("empty stop", json!({"stop": [""]}), "stop"),
        case("echo", json!({"echo": true}), "echo"),
    ]);
}

#[test]
fn requests_that_can_never_fit_get_400_with_the_numbers() {
    expect_errors(vec![
        (
            "huge max_tokens",
            body(json!({"model": MODEL, "prompt": "Hello", "max_tokens": 1_000_000_000_000i64})),
            400,
            "context_length_exceeded",
            "8192",
        ),
        (
            "prompt over the context",
            body(json!({"model": MODEL, "prompt": "word ".repeat(9000), "max_tokens": 1})),
            400,
            "context_length_exceeded",
            "8192",
        ),
    ]);
}

#[test]
fn unknown_model_path_and_method_get_their_status() {
    let url = &server().url;
    runtime().block_on(async {
        let answer = post(
            url,
            "/v1/completions",
            json!({"model": "gpt-4", "prompt": "hi"}),
        )
        .await;
        assert_eq!(answer.status, 404, "{}", answer.body);
        assert_eq!(answer.code(), "model_not_found");
        assert!(answer.message().contains(MODEL));

        let answer = post(url, "/v1/nothing", json!({})).await;
        assert_eq!(answer.status, 404);
        assert_eq!(answer.code(), "not_found");

        let response = crate::harness::client()
            .get(format!("{url}/v1/chat/completions"))
            .send()
            .await
            .expect("sent");
        assert_eq!(response.status().as_u16(), 405);
    });
}

#[test]
fn a_huge_body_gets_413_and_the_server_keeps_serving() {
    expect_errors(vec![(
        "2 MiB body",
        body(json!({"model": MODEL, "prompt": "a".repeat(2 << 20)})),
        413,
        "request_too_large",
        "limit",
    )]);
}

/// TEST-MATRIX A08: oversized headers get 431 (ours with an OpenAI body for one large header;
/// hyper's for more than 100), an oversized URI 414, and the server keeps serving.
#[test]
fn oversized_headers_and_uris_get_431_and_414() {
    use std::io::{Read, Write};
    let url = &server().url;
    let address = url.trim_start_matches("http://").to_string();
    let status_of = |request: Vec<u8>| -> (u16, String) {
        let mut stream = std::net::TcpStream::connect(&address).expect("connects");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .expect("timeout set");
        stream.write_all(&request).expect("sent");
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer).to_string();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("an HTTP status line in {text:?}"));
        (status, text)
    };
    let head = |extra: &str| {
        format!("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n").into_bytes()
    };
    let (status, text) = status_of(head(&format!("X-Big: {}\r\n", "a".repeat(64 << 10))));
    assert_eq!(status, 431, "{text}");
    assert!(text.contains("request_header_fields_too_large"), "{text}");
    let many: String = (0..150).map(|i| format!("X-{i}: y\r\n")).collect();
    assert_eq!(status_of(head(&many)).0, 431);
    let uri = format!(
        "GET /health?{} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "a".repeat(64 << 10)
    );
    assert_eq!(status_of(uri.into_bytes()).0, 414);
    // Just under the limit is served.
    let (status, text) = status_of(head(&format!("X-Big: {}\r\n", "a".repeat(8 << 10))));
    assert_eq!(status, 200, "{text}");
    expect_errors(Vec::new());
}

#[test]
fn chat_requests_are_validated_too() {
    let url = &server().url;
    runtime().block_on(async {
        for (request, needle) in [
            (json!({"model": MODEL, "messages": []}), "messages"),
            (
                json!({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}),
                "role",
            ),
            (
                json!({"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
                "invalid json",
            ),
            (
                json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "logprobs": true}),
                "logprobs",
            ),
        ] {
            let answer = post(url, "/v1/chat/completions", request.clone()).await;
            assert_eq!(answer.status, 400, "{request}: {}", answer.body);
            assert!(
                answer.message().to_lowercase().contains(needle),
                "{request}: {}",
                answer.body
            );
        }
        // Unknown fields, whatever their type, are ignored as OpenAI clients expect.
        let answer = post(
            url,
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                   "max_tokens": 2, "frobnicate": {"deep": [1, 2]}, "user": 7}),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    });
}
