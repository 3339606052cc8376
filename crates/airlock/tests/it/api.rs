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
        case("n = 17", json!({"n": 17}), "n must be"),
        case("n = 0", json!({"n": 0}), "n must be"),
        case("temperature 5", json!({"temperature": 5}), "temperature"),
        case("top_p 0", json!({"top_p": 0}), "top_p"),
        case("empty prompt", json!({"prompt": ""}), "empty"),
        case(
            "token out of vocab",
            json!({"prompt": [1, 2, 999999]}),
            "vocabulary",
        ),
        case("negative token", json!({"prompt": [-1]}), "vocabulary"),
        case(
            "17 prompts",
            json!({"prompt": vec!["a"; 17]}),
            "number of prompts",
        ),
        case("min_p 2", json!({"min_p": 2}), "min_p"),
        case(
            "presence_penalty 3",
            json!({"presence_penalty": 3}),
            "presence_penalty",
        ),
        case(
            "frequency_penalty -2.5",
            json!({"frequency_penalty": -2.5}),
            "frequency_penalty",
        ),
        case(
            "repetition_penalty 0",
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
        ),
        case(
            "logit_bias on a word",
            json!({"logit_bias": {"hello": 5}}),
            "token id",
        ),
        case(
            "logit_bias past the vocabulary",
            json!({"logit_bias": {"999999": 5}}),
            "token id",
        ),
        case(
            "logit_bias of 101",
            json!({"logit_bias": {"42": 101}}),
            "-100 to 100",
        ),
        case(
            "logit_bias not an object",
            json!({"logit_bias": [1, 2]}),
            "object",
        ),
        case("empty stop", json!({"stop": [""]}), "stop"),
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
fn unknown_model_path_and_method_get_their_status_and_no_model_is_the_served_one() {
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

        // No model named (or null): the one served answers, as vLLM's and llama.cpp's do.
        for body in [
            json!({"prompt": "hi", "max_tokens": 1}),
            json!({"model": null, "prompt": "hi", "max_tokens": 1}),
        ] {
            let answer = post(url, "/v1/completions", body).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            assert_eq!(answer.json()["model"], MODEL);
        }
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        let answer = post(url, "/v1/chat/completions", chat).await;
        assert_eq!(answer.status, 200, "{}", answer.body);

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
                       "logprobs": "yes"}),
                "invalid json",
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
        // The fields that cannot change the answer are accepted, whatever they hold.
        let answer = post(
            url,
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 2, "user": "u-7", "store": false,
                   "metadata": {"run": "x"}, "service_tier": "auto",
                   "parallel_tool_calls": true, "tools": [], "tool_choice": "none",
                   "response_format": {"type": "text"},
                   "messages": [{"role": "user", "content": "Hi", "name": "ada"},
                                {"role": "assistant", "content": null},
                                {"role": "user", "content": "Hi?"}]}),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    });
}

/// No field is silently dropped: one we do not know, or one whose value we cannot serve yet,
/// gets 400 naming it in `param` (as OpenAI answers), on either endpoint, nested too.
#[test]
fn every_refused_field_gets_400_naming_it() {
    let chat = |extra: serde_json::Value| {
        let mut request = json!({"model": MODEL, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "Hi"}]});
        for (key, value) in extra.as_object().expect("object") {
            request[key] = value.clone();
        }
        ("/v1/chat/completions", request)
    };
    let completion = |extra: serde_json::Value| {
        let mut request = json!({"model": MODEL, "max_tokens": 2, "prompt": "Hi"});
        for (key, value) in extra.as_object().expect("object") {
            request[key] = value.clone();
        }
        ("/v1/completions", request)
    };
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
    let cases = [
        (chat(json!({"frobnicate": 1})), "frobnicate"),
        (chat(json!({"functions": [tool.clone()]})), "functions"),
        (chat(json!({"prompt": "Hi"})), "prompt"),
        (
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (chat(json!({"top_logprobs": 3})), "top_logprobs"),
        (chat(json!({"n": 30})), "n"),
        (
            chat(json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})),
            "tools[0]",
        ),
        (
            chat(json!({"tools": [tool], "tool_choice": {"type": "function",
                                                       "function": {"name": "g"}}})),
            "tool_choice",
        ),
        (chat(json!({"tool_choice": "required"})), "tool_choice"),
        (
            chat(json!({"response_format": {"type": "json_schema",
                                             "json_schema": {"schema": 5}}})),
            "response_format",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema":
                {"name": "x", "schema": {"type": "no-such-type"}}}}),
            ),
            "response_format",
        ),
        (
            chat(json!({"response_format": {"type": "json_object"}, "ignore_eos": true})),
            "ignore_eos",
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": "Hi", "audio": {}}]})),
            "messages[0].audio",
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": "4", "tool_call_id": "a"}]})),
            "messages[0].tool_call_id",
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": "Hi"},
                                      {"role": "tool", "content": "4"}]})),
            "messages[1].tool_call_id",
        ),
        (
            chat(json!({"messages": [{"role": "user", "content": null}]})),
            "messages[0].content",
        ),
        (completion(json!({"messages": []})), "messages"),
        (completion(json!({"logprobs": -1})), "logprobs"),
        (completion(json!({"best_of": 2, "n": 3})), "best_of"),
        (completion(json!({"best_of": 2, "stream": true})), "best_of"),
        (completion(json!({"suffix": "end"})), "suffix"),
        (completion(json!({"top_logprobs": 1})), "top_logprobs"),
    ];
    let url = &server().url;
    runtime().block_on(async {
        for ((path, request), param) in cases {
            let answer = post(url, path, request.clone()).await;
            assert_eq!(answer.status, 400, "{request}: {}", answer.body);
            assert_eq!(answer.param(), param, "{request}: {}", answer.body);
            assert!(
                answer
                    .message()
                    .contains(param.rsplit('.').next().expect("a name")),
                "{request}: the message names the field: {}",
                answer.body
            );
        }
    });
}

/// `/tokenize` counts a prompt as `/v1/completions` does and a chat as
/// `/v1/chat/completions` does (the usage of a real answer agrees); `/detokenize` gives the
/// text back; `/v1/models` says the context length; bad input gets 400 naming the field.
#[test]
fn tokenize_and_detokenize_count_as_generation_does() {
    let url = &server().url;
    runtime().block_on(async {
        let prompt = "The capital of France is";
        let tokenized = post(url, "/tokenize", json!({"model": MODEL, "prompt": prompt})).await;
        assert_eq!(tokenized.status, 200, "{}", tokenized.body);
        let tokenized = tokenized.json();
        let tokens = tokenized["tokens"].as_array().expect("tokens").clone();
        assert_eq!(tokenized["count"], json!(tokens.len()));
        let answer = post(url, "/v1/completions", completion(prompt, 2)).await;
        assert_eq!(
            answer.json()["usage"]["prompt_tokens"],
            json!(tokens.len()),
            "{}",
            answer.body
        );
        let models = crate::harness::client()
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .expect("answered")
            .json::<serde_json::Value>()
            .await
            .expect("JSON");
        assert_eq!(
            models["data"][0]["max_model_len"],
            tokenized["max_model_len"]
        );
        assert!(tokenized["max_model_len"].as_u64() > Some(0), "{tokenized}");

        // With the beginning-of-sequence token, as vLLM's /tokenize adds it when asked.
        let with_bos = post(
            url,
            "/tokenize",
            json!({"prompt": prompt, "add_special_tokens": true}),
        )
        .await
        .json();
        let bos = crate::harness::tokenizer()
            .bos_id()
            .expect("the model has one");
        assert_eq!(with_bos["tokens"][0], json!(bos));
        assert_eq!(with_bos["count"], json!(tokens.len() + 1));
        // What lm-evaluation-harness's remote tokenizer reads first.
        let info: serde_json::Value = crate::harness::client()
            .get(format!("{url}/tokenizer_info"))
            .send()
            .await
            .expect("answered")
            .json()
            .await
            .expect("JSON");
        assert!(info["eos_token"].is_string(), "{info}");
        assert!(
            info["chat_template"]
                .as_str()
                .is_some_and(|t| t.contains("im_start")),
            "{info}"
        );
        assert_eq!(info["model_max_length"], tokenized["max_model_len"]);

        let text = post(url, "/detokenize", json!({"tokens": tokens})).await;
        assert_eq!(text.status, 200, "{}", text.body);
        assert_eq!(text.json()["prompt"], json!(prompt));

        let messages = json!([{"role": "user", "content": "Hi there"}]);
        let chat = post(url, "/tokenize", json!({"messages": messages})).await;
        let chat_tokens = chat.json()["count"].clone();
        let answer = post(
            url,
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "max_tokens": 1}),
        )
        .await;
        assert_eq!(answer.json()["usage"]["prompt_tokens"], chat_tokens);
        let without_turn = post(
            url,
            "/tokenize",
            json!({"messages": messages, "add_generation_prompt": false}),
        )
        .await;
        assert!(
            without_turn.json()["count"].as_u64() < chat_tokens.as_u64(),
            "the assistant's turn adds tokens"
        );

        for (path, request, param) in [
            (
                "/tokenize",
                json!({"prompt": "a", "messages": messages}),
                "prompt",
            ),
            (
                "/tokenize",
                json!({"prompt": "a", "truncate_prompt_tokens": 4}),
                "truncate_prompt_tokens",
            ),
            (
                "/tokenize",
                json!({"model": "gpt-4", "prompt": "a"}),
                "model",
            ),
            ("/detokenize", json!({"tokens": [1, -3]}), "tokens"),
            ("/detokenize", json!({"tokens": [99999999]}), "tokens"),
        ] {
            let answer = post(url, path, request.clone()).await;
            assert!(
                matches!(answer.status, 400 | 404),
                "{request}: {}",
                answer.body
            );
            assert_eq!(answer.param(), param, "{request}: {}", answer.body);
        }
    });
}
