//! Tool calls through the chat API: with `tool_choice: required` (or a named function) the
//! answer is a call whose arguments validate against the function's parameters, streamed or
//! not; the call and its result go back into the conversation and the next turn answers.

use crate::harness::{post, post_stream, runtime, start, Mode, Options, MODEL};
use serde_json::{json, Value};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string", "maxLength": 30}},
                           "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": {"type": "object",
                           "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                          "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                           "required": ["a", "b"], "additionalProperties": false}}},
    ])
}

/// Whether `arguments` (JSON text) are what `name`'s parameters accept.
fn arguments_validate(name: &str, arguments: &str) -> bool {
    let Ok(Value::Object(args)) = serde_json::from_str::<Value>(arguments) else {
        return false;
    };
    match name {
        "get_weather" => {
            args.len() == 1
                && args["city"]
                    .as_str()
                    .is_some_and(|c| c.chars().count() <= 30)
        }
        "add" => {
            let int = |v: &Value| v.as_i64().is_some_and(|n| (-1000..=1000).contains(&n));
            args.len() == 2 && int(&args["a"]) && int(&args["b"])
        }
        _ => false,
    }
}

#[test]
fn a_required_call_validates_and_its_result_goes_back() {
    let server = start(Options::new(Mode::Disaggregated));
    runtime().block_on(async {
        let url = &server.url;
        let question = json!({"role": "user", "content": "What is the weather in Paris?"});
        for (seed, choice) in [
            (1, json!("required")),
            (2, json!("required")),
            (3, json!({"type": "function", "function": {"name": "add"}})),
        ] {
            let answer = post(
                url,
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [question], "tools": tools(),
                       "tool_choice": choice, "temperature": 1, "seed": seed,
                       "max_tokens": 60}),
            )
            .await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            let answer = answer.json();
            let choice_out = &answer["choices"][0];
            assert_eq!(choice_out["finish_reason"], "tool_calls", "{answer}");
            let message = &choice_out["message"];
            assert!(message["content"].is_null(), "{message}");
            let call = &message["tool_calls"][0];
            assert_eq!(call["type"], "function");
            let name = call["function"]["name"].as_str().expect("name");
            if choice.is_object() {
                assert_eq!(name, "add");
            }
            let arguments = call["function"]["arguments"].as_str().expect("arguments");
            assert!(arguments_validate(name, arguments), "{name}({arguments})");

            // The call and its result go back; the next turn answers.
            let result = json!({"role": "tool", "tool_call_id": call["id"],
                                "content": "{\"temperature_c\": 18}"});
            let next = post(
                url,
                "/v1/chat/completions",
                json!({"model": MODEL, "tools": tools(), "max_tokens": 16,
                       "messages": [question, message, result]}),
            )
            .await;
            assert_eq!(next.status, 200, "{}", next.body);
        }

        // Streamed: the call comes whole in one delta, then the finish, then [DONE].
        let streamed = json!({"model": MODEL, "messages": [question], "tools": tools(),
                              "tool_choice": "required", "max_tokens": 60, "stream": true,
                              "seed": 5});
        let (chunks, body) = post_stream(url, "/v1/chat/completions", &streamed).await;
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(calls.len(), 1, "{body}");
        let name = calls[0]["function"]["name"].as_str().expect("name");
        let arguments = calls[0]["function"]["arguments"]
            .as_str()
            .expect("arguments");
        assert!(arguments_validate(name, arguments), "{name}({arguments})");
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        assert!(chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));

        // `none`: plain text, no calls.
        let text = post(
            url,
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [question], "tools": tools(),
                   "tool_choice": "none", "max_tokens": 8, "temperature": 0}),
        )
        .await
        .json();
        assert!(
            text["choices"][0]["message"]["tool_calls"].is_null(),
            "{text}"
        );
        assert!(
            text["choices"][0]["message"]["content"].is_string(),
            "{text}"
        );
    });
}
