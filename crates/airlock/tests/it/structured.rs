//! Structured output: with a JSON `response_format` every answer that ends (not cut by
//! `max_tokens`) parses, and validates against the request's schema, sampled at temperature
//! 1, served disaggregated; the same requests without the constraint do not (the guard is
//! what makes them JSON).

use crate::harness::{post, runtime, start, Mode, Options, MODEL};
use serde_json::{json, Value};

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
            "is_capital": {"type": "boolean"},
        },
        "required": ["name", "population_millions", "is_capital"],
        "additionalProperties": false,
    })
}

/// Whether `value` is what `schema()` accepts.
fn validates(value: &Value) -> bool {
    let Some(object) = value.as_object() else {
        return false;
    };
    let name_ok = object["name"]
        .as_str()
        .is_some_and(|n| n.chars().count() <= 24);
    let population_ok = object["population_millions"]
        .as_i64()
        .is_some_and(|p| (0..=100).contains(&p));
    object.len() == 3 && name_ok && population_ok && object["is_capital"].is_boolean()
}

#[test]
fn json_answers_parse_and_follow_their_schema() {
    let server = start(Options::new(Mode::Disaggregated));
    runtime().block_on(async {
        let url = &server.url;
        let ask = |format: Value, seed: u64| {
            let body = json!({"model": MODEL, "max_tokens": 120, "temperature": 1, "seed": seed,
                "response_format": format,
                "messages": [{"role": "system", "content": "Answer in JSON."},
                             {"role": "user", "content": "Describe the city of Paris."}]});
            async move {
                let answer = post(url, "/v1/chat/completions", body).await;
                assert_eq!(answer.status, 200, "{}", answer.body);
                let answer = answer.json();
                let choice = &answer["choices"][0];
                let content = choice["message"]["content"]
                    .as_str()
                    .expect("text")
                    .to_string();
                (
                    content,
                    choice["finish_reason"].as_str().map(str::to_string),
                )
            }
        };
        let with_schema = json!({"type": "json_schema",
                                 "json_schema": {"name": "city", "schema": schema()}});
        for seed in 0..20 {
            let (content, finish) = ask(with_schema.clone(), seed).await;
            assert_eq!(finish.as_deref(), Some("stop"), "seed {seed}: {content}");
            let value: Value = serde_json::from_str(&content)
                .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {content}"));
            assert!(validates(&value), "seed {seed}: off the schema: {content}");
        }
        let mut objects = 0;
        for seed in 0..10 {
            let (content, finish) = ask(json!({"type": "json_object"}), seed).await;
            if finish.as_deref() == Some("stop") {
                let value: Value = serde_json::from_str(&content)
                    .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {content}"));
                assert!(value.is_object(), "{content}");
                objects += 1;
            }
        }
        assert!(
            objects >= 5,
            "most json_object answers end within 120 tokens"
        );
        // The canary: without the constraint the model answers in prose.
        let mut free_valid = 0;
        for seed in 0..10 {
            let (content, _) = ask(json!({"type": "text"}), seed).await;
            let parsed: Option<Value> = serde_json::from_str(&content).ok();
            free_valid += usize::from(parsed.as_ref().is_some_and(validates));
        }
        assert!(
            free_valid < 10,
            "unconstrained answers validate too: the test shows nothing"
        );
    });
}
