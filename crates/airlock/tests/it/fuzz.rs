//! TEST-MATRIX A17: the HTTP request parsers (`router::openai::parse_chat` and
//! `parse_completion`, the conversion of a client's body into a checked `Job`) fuzzed with
//! proptest: structured bodies whose every field may be missing, of the wrong type, out of
//! range or huge, and random byte mutations of valid bodies. Whatever the input, the parser
//! returns, never panics; an accepted job keeps the invariants admission relies on; a refusal is
//! a 4xx with an OpenAI error body. (cargo-fuzz needs a nightly toolchain; this runs in CI.)

use crate::harness::{model_file, ModelFile, MODEL};
use proptest::prelude::*;
use router::openai::{parse_chat, parse_completion, Job, Limits};
use serde_json::{json, Value};
use std::sync::OnceLock;

fn file() -> &'static ModelFile {
    static FILE: OnceLock<ModelFile> = OnceLock::new();
    FILE.get_or_init(model_file)
}

const DEFAULT_MAX_TOKENS: usize = 256;

fn limits() -> Limits<'static> {
    let file = file();
    Limits {
        model_id: MODEL,
        tokenizer: &file.tokenizer,
        chat_template: file.chat_template.as_ref(),
        context_length: file.context_length,
        default_max_tokens: DEFAULT_MAX_TOKENS,
        sampling_defaults: Default::default(),
        vocabulary: Some(vocabulary()),
    }
}

fn vocabulary() -> &'static grammar::Vocabulary {
    static VOCABULARY: OnceLock<grammar::Vocabulary> = OnceLock::new();
    VOCABULARY.get_or_init(|| grammar::Vocabulary::new(&file().tokenizer).expect("vocabulary"))
}

/// What the rest of the server assumes of every job the parser lets through.
fn check_outcome(result: Result<Vec<Job>, router::ApiError>) -> Result<(), TestCaseError> {
    let limits = limits();
    match result {
        Ok(jobs) => {
            prop_assert!(!jobs.is_empty() && jobs.len() <= router::openai::MAX_CHOICES);
            for (index, job) in jobs.iter().enumerate() {
                prop_assert_eq!(job.index as usize, index);
                check_job(job, &limits)?;
            }
        }
        Err(error) => {
            prop_assert!(
                error.status().is_client_error(),
                "client input answered {}",
                error.status()
            );
            let body = error.body();
            prop_assert!(!body.error.message.is_empty());
            prop_assert!(!body.error.code.is_empty());
        }
    }
    Ok(())
}

fn check_job(job: &Job, limits: &Limits) -> Result<(), TestCaseError> {
    prop_assert!(!job.prompt.is_empty(), "an empty prompt was accepted");
    prop_assert!(job.max_tokens >= 1);
    prop_assert!(
        job.prompt.len() + job.max_tokens as usize <= limits.context_length,
        "prompt {} + max_tokens {} over the context {}",
        job.prompt.len(),
        job.max_tokens,
        limits.context_length
    );
    let vocab = limits.tokenizer.vocab_size();
    prop_assert!(job.prompt.iter().all(|&t| (t as usize) < vocab));
    prop_assert!((0.0..=2.0).contains(&job.sampling.temperature));
    prop_assert!(job.sampling.top_p > 0.0 && job.sampling.top_p <= 1.0);
    prop_assert!((0.0..=1.0).contains(&job.sampling.min_p));
    prop_assert!(job.sampling.repetition_penalty > 0.0);
    prop_assert!(job.sampling.logit_bias.len() <= transfer::MAX_LOGIT_BIAS);
    prop_assert!(job
        .sampling
        .logit_bias
        .iter()
        .all(|&(t, b)| (t as usize) < vocab && (-100.0..=100.0).contains(&b)));
    Ok(())
}

/// Any JSON value, small: what a hostile client may put where a field's value belongs.
fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        prop_oneof![
            Just(-1i64),
            Just(0),
            Just(1),
            Just(8192),
            Just(u32::MAX as i64 + 1)
        ]
        .prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        Just(json!(1e30)),
        ".{0,24}".prop_map(Value::String),
        Just(Value::String("a ".repeat(5000))),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec(("[a-z]{1,8}", inner), 0..3)
                .prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

/// The fields the parsers read, each present or not, with a value of any type.
const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "echo",
    "best_of",
    "ignore_eos",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "tools",
    "tool_choice",
    "top_logprobs",
    "suffix",
    "user",
];

fn any_body() -> impl Strategy<Value = Value> {
    let field = (0..FIELDS.len(), any_value());
    let message = (
        prop_oneof![
            Just(json!("user")),
            Just(json!("system")),
            Just(json!("assistant")),
            Just(json!("robot")),
            any_value()
        ],
        prop_oneof![".{0,40}".prop_map(Value::String), any_value()],
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    // Each endpoint refuses the other's prompt field, so a body has one, the other or both.
    (
        proptest::collection::vec(field, 0..6),
        prop_oneof![Just(json!(MODEL)), any_value()],
        proptest::option::of(proptest::collection::vec(message, 0..3)),
        proptest::option::of(prop_oneof![".{0,60}".prop_map(Value::String), any_value()]),
    )
        .prop_map(|(fields, model, messages, prompt)| {
            let mut body = json!({"model": model});
            if let Some(messages) = messages {
                body["messages"] = json!(messages);
            }
            if let Some(prompt) = prompt {
                body["prompt"] = prompt;
            }
            for (index, value) in fields {
                body[FIELDS[index]] = value;
            }
            body
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn structured_bodies_never_panic_and_refusals_are_4xx(body in any_body()) {
        let bytes = body.to_string().into_bytes();
        check_outcome(parse_completion(&bytes, &limits()))?;
        check_outcome(parse_chat(&bytes, &limits()))?;
    }

    #[test]
    fn mutated_valid_bodies_never_panic(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let common = json!({
            "model": MODEL,
            "max_tokens": 16,
            "temperature": 0.5,
            "min_p": 0.05,
            "frequency_penalty": 0.5,
            "logit_bias": {"42": -100},
            "stop": ["\n"],
            "stream": true,
        });
        let mut completion = common.clone();
        completion["prompt"] = json!("The capital of France is");
        let mut chat = common;
        chat["messages"] = json!([{"role": "user", "content": "Hi!"}]);
        // The starting points are accepted, so mutations explore near a yes.
        let completion = completion.to_string().into_bytes();
        let chat = chat.to_string().into_bytes();
        prop_assert!(parse_completion(&completion, &limits()).is_ok());
        prop_assert!(parse_chat(&chat, &limits()).is_ok());
        let mutate = |mut bytes: Vec<u8>| {
            for &(at, value) in &flips {
                let at = at % bytes.len();
                bytes[at] = value;
            }
            bytes.truncate(cut % (bytes.len() + 1));
            bytes
        };
        check_outcome(parse_completion(&mutate(completion), &limits()))?;
        check_outcome(parse_chat(&mutate(chat), &limits()))?;
    }
}

/// Deep nesting (TEST-MATRIX A05: 10⁵ levels) is refused with a 400, not a stack overflow.
#[test]
fn deeply_nested_json_is_a_400() {
    let depth = 100_000;
    let mut text = String::from("{\"model\":\"x\",\"prompt\":");
    text.push_str(&"[".repeat(depth));
    text.push_str(&"]".repeat(depth));
    text.push('}');
    for result in [
        parse_completion(text.as_bytes(), &limits()),
        parse_chat(text.as_bytes(), &limits()),
    ] {
        let error = result.expect_err("refused");
        assert_eq!(error.status().as_u16(), 400, "{error:?}");
    }
}
