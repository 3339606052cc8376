//! The OpenAI request bodies we accept, and their validation into a [`Job`]: tokens,
//! sampling and limits the core can trust. Every check happens here, once; whatever is
//! refused is refused with the field it concerns.
//!
//! Fields we do not know are ignored (clients send many); fields we know are type-checked,
//! and the ones whose other values we do not support (n > 1, logprobs, echo, best_of) are
//! refused rather than silently ignored.

use crate::error::ApiError;
use gguf::{ChatMessage, ChatTemplate, Tokenizer};
use serde::Deserialize;
use serde_json::json;
use transfer::{Sampling, MAX_STOP_STRINGS};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{PartialSchema, ToSchema};

/// Which endpoint a job came from: it decides the response shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    /// What a request over a token limit must change: the prompt's field when the prompt
    /// alone is over `limit`, else `max_tokens`.
    pub fn param_over_limit(self, prompt_tokens: usize, limit: usize) -> &'static str {
        match self {
            _ if prompt_tokens < limit => "max_tokens",
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
        }
    }
}

// The `#[schema]` bounds below are the ones `build_job` and the parsers enforce; the served
// document adds the deployment's own (model id, max_tokens, vocabulary) in `openapi.rs`.

/// The body of `POST /v1/chat/completions`. Unknown fields are ignored.
#[derive(Deserialize, ToSchema)]
pub struct ChatRequest {
    /// The served model's id (`GET /v1/models`).
    model: String,
    #[schema(min_items = 1)]
    messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    common: Common,
    /// Takes precedence over `max_tokens`.
    #[schema(minimum = 1)]
    max_completion_tokens: Option<i64>,
    /// Only `false`: log probabilities are not supported.
    #[schema(schema_with = only_false)]
    logprobs: Option<bool>,
}

/// The body of `POST /v1/completions`. Unknown fields are ignored.
#[derive(Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// The served model's id (`GET /v1/models`).
    model: String,
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
    /// Only 0 or less: log probabilities are not supported.
    #[schema(maximum = 0)]
    logprobs: Option<i64>,
    /// Only `false`.
    #[schema(schema_with = only_false)]
    echo: Option<bool>,
    #[schema(minimum = 1, maximum = 1)]
    best_of: Option<i64>,
}

/// Fields both endpoints share.
#[derive(Deserialize, ToSchema)]
struct Common {
    /// At least 1; the prompt and `max_tokens` together must fit the context length.
    /// Default: the server's default, capped by what the context leaves.
    #[schema(minimum = 1)]
    max_tokens: Option<i64>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    /// Not in OpenAI's API; accepted as llama.cpp and vLLM do. 0 is off.
    #[schema(minimum = 0, maximum = 4294967295_i64)]
    top_k: Option<i64>,
    /// The same seed and request give the same answer; without one, each request samples
    /// from a fresh random seed.
    seed: Option<i64>,
    stop: Option<Stop>,
    #[schema(minimum = 1, maximum = 1)]
    n: Option<i64>,
    /// Answer as server-sent events (`text/event-stream`).
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Not in OpenAI's API: keep going past the end-of-sequence token.
    ignore_eos: Option<bool>,
    /// Splits the caller's prefix cache: requests reuse each other's cached prompt pages only
    /// when they come from the same tenant (API key) *and* carry the same salt. It can narrow
    /// sharing within a tenant, never widen it past one.
    #[schema(value_type = Option<String>, min_length = 1, max_length = 256)]
    cache_salt: Option<serde_json::Value>,
}

#[derive(Deserialize, ToSchema)]
struct StreamOptions {
    /// One more event before `[DONE]` with the `usage` (only with `stream`).
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
}

#[derive(Deserialize, ToSchema)]
struct ChatMessageIn {
    /// `developer` is read as `system`.
    #[schema(value_type = String, pattern = "^(system|developer|user|assistant)$")]
    role: String,
    content: Content,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// A request's sampling seed: the client's, so the same seed and request reproduce the answer
/// (OpenAI seeds are signed; the bits are what matter), or a fresh random one, so identical
/// requests sample independently, as OpenAI's, vLLM's and llama-server's do.
fn sampling_seed(requested: Option<i64>) -> u64 {
    if let Some(seed) = requested {
        return seed as u64;
    }
    let mut bytes = [0u8; 8];
    if getrandom::getrandom(&mut bytes).is_ok() {
        return u64::from_le_bytes(bytes);
    }
    // No OS randomness: std's per-process random keys, stepped for every hasher, are fresh
    // enough to sample from (this seed guards nothing).
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// A checked request, ready for admission.
#[derive(Clone, Debug)]
pub struct Job {
    pub endpoint: Endpoint,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// The client's `cache_salt`, checked (1 to 256 characters).
    pub cache_salt: Option<String>,
}

/// What validation needs to know about the deployment.
pub struct Limits<'a> {
    pub model_id: &'a str,
    pub tokenizer: &'a Tokenizer,
    pub chat_template: Option<&'a ChatTemplate>,
    pub context_length: usize,
    pub default_max_tokens: usize,
}

/// Longest stop string a client may send. Far below what a Submit frame carries, so every
/// request the router accepts is one the worker link can encode.
const STOP_BYTES_MAX: usize = 256;

/// Longest `cache_salt`, in characters (as the schema's `maxLength` counts).
pub const CACHE_SALT_CHARS_MAX: usize = 256;
const _: () = assert!(STOP_BYTES_MAX <= transfer::MAX_STRING_BYTES);

// The untagged enums' schemas are written out: a `oneOf` of what each variant accepts, with
// the bounds the derive cannot put on a variant's field.

/// A schema from its JSON text; only ever called on the literals below.
fn schema(value: serde_json::Value) -> RefOr<Schema> {
    RefOr::T(serde_json::from_value(value).expect("the literal is a schema"))
}

/// A flag whose `true` is refused.
fn only_false() -> RefOr<Schema> {
    schema(json!({"type": ["boolean", "null"], "enum": [false, null]}))
}

impl PartialSchema for Stop {
    fn schema() -> RefOr<Schema> {
        // Stop strings are bounded in bytes; the schema can only count characters.
        let one = json!({"type": "string", "minLength": 1, "maxLength": STOP_BYTES_MAX});
        schema(json!({
            "description": format!("Up to {MAX_STOP_STRINGS} strings of 1 to {STOP_BYTES_MAX} \
                bytes; generation stops before the first one it would write."),
            "oneOf": [one, {"type": "array", "items": one, "maxItems": MAX_STOP_STRINGS}],
        }))
    }
}

impl ToSchema for Stop {}

impl PartialSchema for Prompt {
    fn schema() -> RefOr<Schema> {
        schema(json!({
            "description": "The text, one text in an array, or token ids (below the \
                vocabulary size).",
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1},
                 "minItems": 1, "maxItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0},
                 "minItems": 1},
            ],
        }))
    }
}

impl ToSchema for Prompt {}

impl PartialSchema for Content {
    fn schema() -> RefOr<Schema> {
        schema(json!({
            "description": "The text, or text parts (no other kind of part).",
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {
                    "type": "object",
                    "properties": {
                        "type": {"type": "string", "enum": ["text"]},
                        "text": {"type": "string"},
                    },
                    "required": ["type", "text"],
                }},
            ],
        }))
    }
}

impl ToSchema for Content {}

pub fn parse_chat(body: &[u8], limits: &Limits) -> Result<Job, ApiError> {
    let request: ChatRequest = parse_json(body)?;
    check_model(&request.model, limits)?;
    if request.logprobs == Some(true) {
        return Err(ApiError::invalid("logprobs are not supported", "logprobs"));
    }
    if request.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", "messages"));
    }
    let mut messages = Vec::with_capacity(request.messages.len());
    for message in request.messages {
        if !matches!(
            message.role.as_str(),
            "system" | "user" | "assistant" | "developer"
        ) {
            return Err(ApiError::invalid(
                format!(
                    "message role '{}' is not one of system, developer, user, assistant",
                    message.role
                ),
                "messages",
            ));
        }
        let role = if message.role == "developer" {
            "system".to_string()
        } else {
            message.role
        };
        messages.push(ChatMessage::new(role, content_text(message.content)?));
    }
    let template = limits.chat_template.ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; use /v1/completions",
            "messages",
        )
    })?;
    let text = template.render(&messages, true).map_err(|error| {
        ApiError::invalid(
            format!("the chat template refused these messages: {error}"),
            "messages",
        )
    })?;
    let prompt = limits.tokenizer.encode(&text, true);
    let max_tokens = request.max_completion_tokens.or(request.common.max_tokens);
    build_job(Endpoint::Chat, prompt, max_tokens, request.common, limits)
}

pub fn parse_completion(body: &[u8], limits: &Limits) -> Result<Job, ApiError> {
    let request: CompletionRequest = parse_json(body)?;
    check_model(&request.model, limits)?;
    if request.logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::invalid("logprobs are not supported", "logprobs"));
    }
    if request.echo == Some(true) {
        return Err(ApiError::invalid("echo is not supported", "echo"));
    }
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("best_of must be 1", "best_of"));
    }
    let prompt = match request.prompt {
        Prompt::Text(text) => limits.tokenizer.encode(&text, false),
        Prompt::Texts(texts) if texts.len() == 1 => limits.tokenizer.encode(&texts[0], false),
        Prompt::Texts(_) => {
            return Err(ApiError::invalid(
                "send exactly one prompt per request",
                "prompt",
            ))
        }
        Prompt::Tokens(tokens) => {
            let vocab = limits.tokenizer.vocab_size();
            let mut ids = Vec::with_capacity(tokens.len());
            for token in tokens {
                match u32::try_from(token) {
                    Ok(id) if (id as usize) < vocab => ids.push(id),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("token id {token} is outside the vocabulary (0..{vocab})"),
                            "prompt",
                        ))
                    }
                }
            }
            ids
        }
    };
    let max_tokens = request.common.max_tokens;
    build_job(
        Endpoint::Completions,
        prompt,
        max_tokens,
        request.common,
        limits,
    )
}

fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::InvalidRequest {
            message: "the request body is not valid UTF-8".into(),
            param: None,
        });
    }
    serde_json::from_slice(body).map_err(|error| ApiError::InvalidRequest {
        message: format!("invalid JSON body: {error}"),
        param: None,
    })
}

fn check_model(model: &str, limits: &Limits) -> Result<(), ApiError> {
    if model != limits.model_id {
        return Err(ApiError::ModelNotFound {
            model: model.chars().take(128).collect(),
            served: limits.model_id.to_string(),
        });
    }
    Ok(())
}

fn content_text(content: Content) -> Result<String, ApiError> {
    match content {
        Content::Text(text) => Ok(text),
        Content::Parts(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(piece)) => text.push_str(&piece),
                    _ => {
                        return Err(ApiError::invalid(
                            "only text content parts are supported",
                            "messages",
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

fn build_job(
    endpoint: Endpoint,
    prompt: Vec<u32>,
    max_tokens: Option<i64>,
    common: Common,
    limits: &Limits,
) -> Result<Job, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", "prompt"));
    }
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", "n"));
    }
    let context_length = limits.context_length;
    let prompt_tokens = prompt.len();
    let max_tokens = match max_tokens {
        None => limits
            .default_max_tokens
            .min(context_length.saturating_sub(prompt_tokens))
            .max(1) as i64,
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                format!("max_tokens must be at least 1 (got {n})"),
                "max_tokens",
            ))
        }
        Some(n) => n,
    };
    let total = (prompt_tokens as i64).saturating_add(max_tokens);
    if total > context_length as i64 {
        return Err(ApiError::ContextLengthExceeded {
            param: endpoint.param_over_limit(prompt_tokens, context_length),
            message: format!(
                "this model's maximum context length is {context_length} tokens, but you \
                 asked for {total} ({prompt_tokens} in the prompt + {max_tokens} max_tokens); \
                 shorten the prompt or lower max_tokens"
            ),
        });
    }
    let temperature = common.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature must be between 0 and 2",
            "temperature",
        ));
    }
    // Checked as the f32 the sampler gets: a positive f64 below f32's range would become 0.
    let top_p = common.top_p.unwrap_or(1.0) as f32;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]", "top_p"));
    }
    let top_k = common.top_k.unwrap_or(0);
    if !(0..=u32::MAX as i64).contains(&top_k) {
        return Err(ApiError::invalid("top_k must be 0 (off) or more", "top_k"));
    }
    let stop = match common.stop {
        None => Vec::new(),
        Some(Stop::One(stop)) => vec![stop],
        Some(Stop::Many(stops)) => stops,
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!("at most {MAX_STOP_STRINGS} stop strings"),
            "stop",
        ));
    }
    if stop
        .iter()
        .any(|s| s.is_empty() || s.len() > STOP_BYTES_MAX)
    {
        return Err(ApiError::invalid(
            format!("stop strings must be 1 to {STOP_BYTES_MAX} bytes"),
            "stop",
        ));
    }
    let cache_salt = match common.cache_salt {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(salt))
            if !salt.is_empty() && salt.chars().count() <= CACHE_SALT_CHARS_MAX =>
        {
            Some(salt)
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("cache_salt must be a string of 1 to {CACHE_SALT_CHARS_MAX} characters"),
                "cache_salt",
            ))
        }
    };
    let stream = common.stream.unwrap_or(false);
    Ok(Job {
        endpoint,
        prompt,
        max_tokens: max_tokens as u32,
        sampling: Sampling {
            temperature: temperature as f32,
            top_p,
            top_k: top_k as u32,
            seed: sampling_seed(common.seed),
        },
        stop,
        ignore_eos: common.ignore_eos.unwrap_or(false),
        cache_salt,
        stream,
        include_usage: stream
            && common
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
    })
}
