//! The OpenAI request bodies we accept, and their validation into a [`Job`]: tokens,
//! sampling and limits the core can trust. Every check happens here, once; whatever is
//! refused is refused with the field it concerns.
//!
//! No field is silently ignored. Each one a body may carry is honoured, or accepted as a
//! documented no-op where ignoring it cannot change the answer (`user`, `metadata`, `store`,
//! `service_tier`, `parallel_tool_calls`), or refused with 400 naming it, as OpenAI refuses a
//! field it does not know.

use crate::error::ApiError;
use crate::tools;
use gguf::{ChatMessage, ChatTemplate, Tokenizer};
use grammar::{Shape, Vocabulary};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use transfer::{Sampling, MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS};
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

/// The body of `POST /v1/chat/completions`. A field not listed here gets 400.
#[derive(Deserialize, ToSchema)]
pub struct ChatRequest {
    /// The served model's id (`GET /v1/models`). May be left out: the one model served
    /// answers (as vLLM and llama.cpp's server do).
    model: Option<String>,
    #[schema(min_items = 1)]
    messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    common: Common,
    /// Takes precedence over `max_tokens`.
    #[schema(minimum = 1)]
    max_completion_tokens: Option<i64>,
    /// Each answer token's log-probability under the model (the log-softmax of its raw
    /// logits, before penalties, bias and temperature), in `choices[].logprobs.content`.
    logprobs: Option<bool>,
    /// With `logprobs`: also this many of the most likely tokens at each step.
    #[schema(minimum = 0, maximum = 20)]
    top_logprobs: Option<i64>,
    /// `{"type": "text"}` (the default); `{"type": "json_object"}`: the answer is a JSON
    /// object; `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`: the
    /// answer is JSON the schema accepts. Enforced token by token (constrained decoding with
    /// llguidance); an answer cut short by `max_tokens` ends with `finish_reason: length`.
    #[schema(schema_with = response_format)]
    response_format: Option<Value>,
    /// Functions the model may call (`{"type": "function", "function": {"name",
    /// "description", "parameters"}}`), at most 128. The served model's chat template has no
    /// tool support: they are described in the system prompt, and a call is the JSON
    /// `{"name", "arguments"}` (see the README).
    #[schema(value_type = Option<Vec<Object>>, max_items = 128)]
    tools: Option<Vec<Value>>,
    /// `none`, `auto` (the default with tools), `required`, or
    /// `{"type": "function", "function": {"name": ...}}`. A required call is held to the
    /// tools' parameter schemas token by token.
    #[schema(value_type = Option<Object>)]
    tool_choice: Option<Value>,
    /// Accepted: an answer makes at most one call.
    #[serde(rename = "parallel_tool_calls")]
    _parallel_tool_calls: Option<bool>,
    /// Any other field: refused.
    #[serde(flatten)]
    #[schema(ignore)]
    unknown: Map<String, Value>,
}

/// The body of `POST /v1/completions`. A field not listed here gets 400.
#[derive(Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// The served model's id (`GET /v1/models`). May be left out: the one model served
    /// answers (as vLLM and llama.cpp's server do).
    model: Option<String>,
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
    /// Each answer token's log-probability under the model (the log-softmax of its raw
    /// logits), with this many of the most likely tokens' at each step.
    #[schema(minimum = 0, maximum = 20)]
    logprobs: Option<i64>,
    /// Answer with the prompt's text before the completion's; with `logprobs`, the prompt
    /// tokens' log-probabilities too (the first has none). With `max_tokens: 0`, only the
    /// prompt.
    echo: Option<bool>,
    /// Sample this many completions per prompt and answer with the `n` whose tokens have the
    /// highest mean log-probability (at least `n`; not with `stream` when more than `n`).
    /// Usage counts every completion sampled.
    #[schema(minimum = 1, maximum = 16)]
    best_of: Option<i64>,
    /// Only empty: insertion (text after the completion) is not supported.
    #[schema(max_length = 0)]
    suffix: Option<String>,
    /// Any other field: refused.
    #[serde(flatten)]
    #[schema(ignore)]
    unknown: Map<String, Value>,
}

/// Fields both endpoints share.
#[derive(Deserialize, ToSchema)]
struct Common {
    /// At least 1 (0 only with `echo`); the prompt and `max_tokens` together must fit the
    /// context length. Default: the server's default, capped by what the context leaves.
    #[schema(minimum = 0)]
    max_tokens: Option<i64>,
    /// Default: the server's `--temperature` (1 unless set).
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    /// Default: the server's `--top-p` (1 unless set).
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    /// Not in OpenAI's API; accepted as llama.cpp and vLLM do. 0 is off. Default: the
    /// server's `--top-k` (0 unless set).
    #[schema(minimum = 0, maximum = 4294967295_i64)]
    top_k: Option<i64>,
    /// Not in OpenAI's API; as llama.cpp and vLLM: keep only tokens at least this many
    /// times as likely as the most likely one. 0 is off. Default: the server's `--min-p`.
    #[schema(minimum = 0.0, maximum = 1.0)]
    min_p: Option<f64>,
    /// Subtracted from the logit of every token the answer already holds.
    #[schema(minimum = -2.0, maximum = 2.0)]
    presence_penalty: Option<f64>,
    /// Subtracted from a token's logit once for every time the answer already holds it.
    #[schema(minimum = -2.0, maximum = 2.0)]
    frequency_penalty: Option<f64>,
    /// Not in OpenAI's API; as vLLM and Hugging Face: a token of the prompt or the answer
    /// has a positive logit divided by this, a negative one multiplied. 1 is off.
    #[schema(exclusive_minimum = 0.0, maximum = 10.0)]
    repetition_penalty: Option<f64>,
    /// Token id (as a string) to a bias from -100 to 100, added to that token's logit;
    /// -100 all but bans it, 100 all but forces it.
    #[schema(value_type = Option<HashMap<String, f64>>)]
    logit_bias: Option<Value>,
    /// The same seed and request give the same answer; without one, each request samples
    /// from a fresh random seed.
    seed: Option<i64>,
    stop: Option<Stop>,
    /// Choices per prompt, each sampled on its own (with `seed`, choice i uses seed + i).
    #[schema(minimum = 1, maximum = 16)]
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
    /// Accepted and not used: it cannot change the answer.
    #[serde(rename = "user")]
    _user: Option<String>,
    /// Accepted and not used: it cannot change the answer.
    #[schema(value_type = Option<Object>)]
    #[serde(rename = "metadata")]
    _metadata: Option<Value>,
    /// Accepted; nothing is ever stored.
    #[serde(rename = "store")]
    _store: Option<bool>,
    /// Accepted and not used: every request is served alike.
    #[serde(rename = "service_tier")]
    _service_tier: Option<String>,
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
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Deserialize, ToSchema)]
pub(crate) struct ChatMessageIn {
    /// `developer` is read as `system`; a `tool` message is a call's result.
    #[schema(value_type = String, pattern = "^(system|developer|user|assistant|tool)$")]
    role: String,
    /// `null` only for an assistant message (an empty turn, or one of only `tool_calls`).
    #[schema(value_type = Option<Content>)]
    content: Option<Content>,
    /// The participant's name, given to the chat template beside the role.
    #[schema(min_length = 1, max_length = 256)]
    name: Option<String>,
    /// An assistant's earlier calls (OpenAI's shape), rendered as the JSON a call is.
    #[schema(value_type = Option<Vec<Object>>)]
    tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    tool_call_id: Option<String>,
    /// Any other field (`audio`, `refusal`...): refused.
    #[serde(flatten)]
    #[schema(ignore)]
    unknown: Map<String, Value>,
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
    /// The run this job is: prompt `p`'s run `i` is `p * best_of + i`. Without `best_of`
    /// that is the choice it answers (OpenAI's `index`).
    pub index: u32,
    /// Choices per prompt (`n`).
    pub n: u32,
    /// Runs per prompt, of which the `n` best are answered (`n` unless `best_of` is more).
    pub best_of: u32,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// The client's `cache_salt`, checked (1 to 256 characters).
    pub cache_salt: Option<String>,
    /// Answer with the prompt's text (and, with logprobs, its tokens' scores) first.
    pub echo: bool,
    /// Echo only: the one token generated is not shown (`max_tokens: 0`).
    pub hide_completion: bool,
    /// The client asked for `logprobs` (ranking for `best_of` asks the workers for them
    /// without showing them).
    pub show_logprobs: bool,
    /// The tools the answer may call: an answer that is a call becomes `tool_calls`.
    pub tools: Option<tools::ToolUse>,
    /// The client's `traceparent`: the request's span joins the client's trace.
    pub trace_parent: Option<otlp::TraceContext>,
}

/// What validation needs to know about the deployment.
pub struct Limits<'a> {
    pub model_id: &'a str,
    pub tokenizer: &'a Tokenizer,
    pub chat_template: Option<&'a ChatTemplate>,
    pub context_length: usize,
    pub default_max_tokens: usize,
    pub sampling_defaults: SamplingDefaults,
    /// The model's tokens for structured output; `None` where the grammar engine could not
    /// take them (a JSON `response_format` then gets 400).
    pub vocabulary: Option<&'a Vocabulary>,
}

/// The sampling settings a request gets for those it leaves out: the server's
/// `--temperature`, `--top-p`, `--top-k` and `--min-p`, which default to OpenAI's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: u32,
    pub min_p: f64,
}

impl Default for SamplingDefaults {
    fn default() -> SamplingDefaults {
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
        }
    }
}

/// Most choices one request may ask for, over all its prompts (`n` × prompts): each is a
/// sequence in flight of its own.
pub const MAX_CHOICES: usize = 16;

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

/// `response_format`.
fn response_format() -> RefOr<Schema> {
    schema(json!({
        "type": ["object", "null"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
        "required": ["type"],
    }))
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
            "description": format!("The text, texts, token ids (below the vocabulary size) \
                or lists of token ids: each prompt gets `n` choices, at most {MAX_CHOICES} in \
                all."),
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1},
                 "minItems": 1, "maxItems": MAX_CHOICES},
                {"type": "array", "items": {"type": "integer", "minimum": 0},
                 "minItems": 1},
                {"type": "array", "items": {"type": "array",
                    "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                 "minItems": 1, "maxItems": MAX_CHOICES},
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

/// A chat request's jobs: one per choice (`n`), in `index` order.
pub fn parse_chat(body: &[u8], limits: &Limits) -> Result<Vec<Job>, ApiError> {
    let request: ChatRequest = parse_json(body)?;
    refuse_unknown(&request.unknown, "")?;
    check_model(request.model.as_deref().unwrap_or(limits.model_id), limits)?;
    let logprobs = match (request.logprobs.unwrap_or(false), request.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs needs logprobs: true",
                "top_logprobs",
            ))
        }
        (true, top) => Some(top_logprobs(top.unwrap_or(0), "top_logprobs")?),
    };
    let constraint = response_shape(request.response_format.as_ref(), limits)?;
    if constraint.is_some() && request.common.ignore_eos == Some(true) {
        return Err(ApiError::invalid(
            "ignore_eos cannot go with a JSON response_format: the answer ends with the JSON",
            "ignore_eos",
        ));
    }
    let (tools, choice) = tools::parse(request.tools, request.tool_choice)?;
    let forced: Vec<&tools::Tool> = match &choice {
        tools::Choice::Required => tools.iter().collect(),
        tools::Choice::Named(name) => tools.iter().filter(|t| t.name == *name).collect(),
        tools::Choice::Text | tools::Choice::Auto => Vec::new(),
    };
    let constraint = if forced.is_empty() {
        constraint
    } else if constraint.is_some() {
        return Err(ApiError::invalid(
            "a required tool call cannot also have a JSON response_format",
            "response_format",
        ));
    } else {
        let shape = Shape::JsonSchema(tools::call_schema(&forced));
        Some(compile_shape(shape, limits, "tools")?)
    };
    let tool_use = (choice != tools::Choice::Text).then(|| tools::ToolUse {
        names: tools.iter().map(|t| t.name.clone()).collect(),
    });
    let system = (!tools.is_empty()).then(|| tools::system_text(&tools));
    let prompt = chat_prompt(request.messages, true, system.as_deref(), limits)?;
    let max_tokens = request.max_completion_tokens.or(request.common.max_tokens);
    let report = Report {
        logprobs,
        echo: false,
        best_of: None,
        constraint,
        tools: tool_use,
    };
    build_jobs(
        Endpoint::Chat,
        vec![prompt],
        max_tokens,
        report,
        request.common,
        limits,
    )
}

/// The tokens of `messages` rendered with the model's chat template, ending in the
/// assistant's turn when `add_generation_prompt`.
pub(crate) fn chat_prompt(
    messages: Vec<ChatMessageIn>,
    add_generation_prompt: bool,
    system: Option<&str>,
    limits: &Limits,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", "messages"));
    }
    let mut checked = Vec::with_capacity(messages.len() + 1);
    for (index, message) in messages.into_iter().enumerate() {
        checked.push(chat_message(index, message)?);
    }
    // What the system prompt gains (the tools): after the caller's system message, or as one.
    if let Some(system) = system {
        match checked.first_mut() {
            Some(first) if first.role == "system" => {
                first.content.push_str("\n\n");
                first.content.push_str(system);
            }
            _ => checked.insert(0, ChatMessage::new("system", system)),
        }
    }
    let template = limits.chat_template.ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; use /v1/completions",
            "messages",
        )
    })?;
    let text = template
        .render(&checked, add_generation_prompt)
        .map_err(|error| {
            ApiError::invalid(
                format!("the chat template refused these messages: {error}"),
                "messages",
            )
        })?;
    Ok(limits.tokenizer.encode_prompt(&text, true))
}

/// One message, checked, as the chat template gets it.
fn chat_message(index: usize, message: ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let field = |name: &str| format!("messages[{index}].{name}");
    refuse_unknown(&message.unknown, &format!("messages[{index}]."))?;
    let role = match message.role.as_str() {
        "system" | "user" | "assistant" => message.role,
        "developer" => "system".to_string(),
        "tool" if message.tool_call_id.is_some() => message.role,
        "tool" => {
            return Err(ApiError::invalid(
                "a tool message needs the tool_call_id of the call it answers",
                field("tool_call_id"),
            ))
        }
        other => {
            return Err(ApiError::invalid(
                format!(
                    "message role '{}' is not one of system, developer, user, assistant, tool",
                    other.chars().take(32).collect::<String>()
                ),
                field("role"),
            ))
        }
    };
    if message.tool_call_id.is_some() && role != "tool" {
        return Err(ApiError::invalid(
            "only a tool message has a tool_call_id",
            field("tool_call_id"),
        ));
    }
    let calls = match message.tool_calls {
        Some(calls) if role == "assistant" => tools::render_calls(&calls, &field("tool_calls"))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "only an assistant message has tool_calls",
                field("tool_calls"),
            ))
        }
        None => String::new(),
    };
    let content = match message.content {
        Some(content) => content_text(content, || field("content"))?,
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid(
                format!("a {role} message needs content (only an assistant's may be null)"),
                field("content"),
            ))
        }
    };
    if message
        .name
        .as_ref()
        .is_some_and(|name| name.is_empty() || name.chars().count() > 256)
    {
        return Err(ApiError::invalid(
            "a message's name must be 1 to 256 characters",
            field("name"),
        ));
    }
    // An assistant turn's calls follow its text, as the JSON a call is.
    let content = match (content.is_empty(), calls.is_empty()) {
        (_, true) => content,
        (true, false) => calls,
        (false, false) => format!("{content}\n{calls}"),
    };
    let mut out = ChatMessage::new(role, content);
    out.name = message.name;
    Ok(out)
}

/// How many of the most likely tokens to report beside each answer token's own.
fn top_logprobs(top: i64, param: &'static str) -> Result<u8, ApiError> {
    match u8::try_from(top) {
        Ok(top) if usize::from(top) <= MAX_TOP_LOGPROBS => Ok(top),
        _ => Err(ApiError::invalid(
            format!("{param} must be from 0 to {MAX_TOP_LOGPROBS}"),
            param,
        )),
    }
}

/// OpenAI answers a field it does not know with 400 naming it; so do we.
pub(crate) fn refuse_unknown(unknown: &Map<String, Value>, prefix: &str) -> Result<(), ApiError> {
    match unknown.keys().next() {
        None => Ok(()),
        Some(key) => {
            let key: String = key.chars().take(64).collect();
            Err(ApiError::invalid(
                format!(
                    "Unrecognized request argument supplied: {key} (the README lists the fields \
                     Airlock takes)"
                ),
                format!("{prefix}{key}"),
            ))
        }
    }
}

/// The shape `response_format` asks of the answer, compiled once here so that a schema the
/// grammar engine refuses gets 400 (the worker compiles it again for the request's decode).
/// Returns it as the `Submit` carries it; `None` for plain text.
fn response_shape(format: Option<&Value>, limits: &Limits) -> Result<Option<String>, ApiError> {
    let param = "response_format";
    let kind = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(format) => format.get("type").and_then(Value::as_str),
    };
    let shape = match kind {
        Some("text") => return Ok(None),
        Some("json_object") => Shape::JsonObject,
        Some("json_schema") => {
            let schema = format
                .and_then(|f| f.get("json_schema"))
                .and_then(|j| j.get("schema"))
                .filter(|schema| schema.is_object())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "response_format.json_schema.schema must be a JSON schema object",
                        param,
                    )
                })?;
            Shape::JsonSchema(schema.clone())
        }
        _ => {
            return Err(ApiError::invalid(
                "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
                param,
            ))
        }
    };
    compile_shape(shape, limits, param).map(Some)
}

/// `shape` compiled once (a schema the grammar engine refuses gets 400 naming `param`), as
/// the `Submit` carries it.
fn compile_shape(shape: Shape, limits: &Limits, param: &'static str) -> Result<String, ApiError> {
    let wire = shape.to_wire();
    if wire.len() > transfer::MAX_STRING_BYTES {
        return Err(ApiError::invalid(
            format!(
                "{param}: the schema is {} bytes; at most {} are accepted",
                wire.len(),
                transfer::MAX_STRING_BYTES
            ),
            param,
        ));
    }
    let vocabulary = limits.vocabulary.ok_or_else(|| {
        ApiError::invalid(
            format!("{param}: structured output is not available on this server"),
            param,
        )
    })?;
    vocabulary.constraint(&shape).map_err(|error| {
        let error: String = error.chars().take(300).collect();
        ApiError::invalid(
            format!("{param}: the schema cannot be followed: {error}"),
            param,
        )
    })?;
    Ok(wire)
}

/// A completion request's jobs: `n` per prompt, in `index` order.
pub fn parse_completion(body: &[u8], limits: &Limits) -> Result<Vec<Job>, ApiError> {
    let request: CompletionRequest = parse_json(body)?;
    refuse_unknown(&request.unknown, "")?;
    check_model(request.model.as_deref().unwrap_or(limits.model_id), limits)?;
    let logprobs = request
        .logprobs
        .map(|top| top_logprobs(top, "logprobs"))
        .transpose()?;
    let echo = request.echo.unwrap_or(false);
    if request.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "suffix is not supported: this model does not fill in the middle",
            "suffix",
        ));
    }
    let vocab = limits.tokenizer.vocab_size();
    let ids = |tokens: Vec<i64>| -> Result<Vec<u32>, ApiError> {
        tokens
            .into_iter()
            .map(|token| {
                token_id(token, vocab).ok_or_else(|| {
                    ApiError::invalid(
                        format!("token id {token} is outside the vocabulary (0..{vocab})"),
                        "prompt",
                    )
                })
            })
            .collect()
    };
    let prompts = match request.prompt {
        Prompt::Text(text) => vec![limits.tokenizer.encode_prompt(&text, false)],
        Prompt::Texts(texts) => texts
            .iter()
            .map(|text| limits.tokenizer.encode_prompt(text, false))
            .collect(),
        Prompt::Tokens(tokens) => vec![ids(tokens)?],
        Prompt::TokenLists(lists) => lists.into_iter().map(ids).collect::<Result<_, _>>()?,
    };
    let max_tokens = request.common.max_tokens;
    let report = Report {
        logprobs,
        echo,
        best_of: request.best_of,
        constraint: None,
        tools: None,
    };
    build_jobs(
        Endpoint::Completions,
        prompts,
        max_tokens,
        report,
        request.common,
        limits,
    )
}

/// `token` as a token id of a vocabulary of `vocab` tokens.
pub(crate) fn token_id(token: i64, vocab: usize) -> Option<u32> {
    u32::try_from(token)
        .ok()
        .filter(|&id| (id as usize) < vocab)
}

pub(crate) fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
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

pub(crate) fn check_model(model: &str, limits: &Limits) -> Result<(), ApiError> {
    if model != limits.model_id {
        return Err(ApiError::ModelNotFound {
            model: model.chars().take(128).collect(),
            served: limits.model_id.to_string(),
        });
    }
    Ok(())
}

fn content_text(content: Content, field: impl Fn() -> String) -> Result<String, ApiError> {
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
                            field(),
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

/// `n` jobs for each prompt, each checked against the context, choice `i` of a prompt
/// sampling from the request's seed + `i`.
fn build_jobs(
    endpoint: Endpoint,
    prompts: Vec<Vec<u32>>,
    max_tokens: Option<i64>,
    report: Report,
    common: Common,
    limits: &Limits,
) -> Result<Vec<Job>, ApiError> {
    let n = common.n.unwrap_or(1);
    let best_of = report.best_of.unwrap_or(n);
    let runs = (best_of as i128).saturating_mul(prompts.len() as i128);
    let (what, count) = match report.best_of {
        Some(_) => ("best_of", best_of),
        None => ("n", n),
    };
    if n < 1 || best_of < 1 || runs > MAX_CHOICES as i128 || prompts.is_empty() {
        let param = if prompts.len() > 1 { "prompt" } else { what };
        return Err(ApiError::invalid(
            format!(
                "{what} must be at least 1, and {what} times the number of prompts at most \
                 {MAX_CHOICES} (got {what} = {count} for {} prompts)",
                prompts.len()
            ),
            param,
        ));
    }
    if best_of < n {
        return Err(ApiError::invalid(
            format!("best_of must be at least n (got best_of = {best_of}, n = {n})"),
            "best_of",
        ));
    }
    let ranked = best_of > n;
    if ranked && common.stream == Some(true) {
        return Err(ApiError::invalid(
            "best_of greater than n cannot be streamed: the best are known only at the end; \
             leave out stream or best_of",
            "best_of",
        ));
    }
    let mut jobs = Vec::with_capacity(runs as usize);
    for prompt in prompts {
        let mut job = build_job(endpoint, prompt, max_tokens, &report, &common, limits)?;
        if ranked {
            // Ranking reads every sampled token's log-probability.
            job.sampling.logprobs.get_or_insert(0);
        }
        for choice in 0..best_of as u32 {
            let mut job = job.clone();
            job.index = jobs.len() as u32;
            job.n = n as u32;
            job.best_of = best_of as u32;
            job.sampling.seed = job.sampling.seed.wrapping_add(choice.into());
            jobs.push(job);
        }
    }
    Ok(jobs)
}

/// What a request asks beside sampling: what to be told, and what shape to answer in.
#[derive(Clone)]
struct Report {
    logprobs: Option<u8>,
    echo: bool,
    /// Completions sampled per prompt, of which the best `n` are answered.
    best_of: Option<i64>,
    /// Structured output, as the `Submit` carries it.
    constraint: Option<String>,
    /// The tools an answer may call.
    tools: Option<tools::ToolUse>,
}

fn build_job(
    endpoint: Endpoint,
    prompt: Vec<u32>,
    max_tokens: Option<i64>,
    report: &Report,
    common: &Common,
    limits: &Limits,
) -> Result<Job, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", "prompt"));
    }
    let context_length = limits.context_length;
    let prompt_tokens = prompt.len();
    let max_tokens_asked = max_tokens;
    let max_tokens = match max_tokens {
        None => limits
            .default_max_tokens
            .min(context_length.saturating_sub(prompt_tokens))
            .max(1) as i64,
        // Only the prompt, echoed: one token is generated (every request is) and not shown.
        Some(0) if report.echo => 1,
        Some(n) if n < 1 => {
            return Err(ApiError::invalid(
                format!("max_tokens must be at least 1, or 0 with echo (got {n})"),
                "max_tokens",
            ))
        }
        Some(n) => n,
    };
    let hide_completion = report.echo && max_tokens_asked == Some(0);
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
    let mut sampling = sampling(common, limits)?;
    sampling.logprobs = report.logprobs;
    sampling.prompt_logprobs = report.echo && report.logprobs.is_some();
    sampling.constraint = report.constraint.clone();
    let stop = match &common.stop {
        None => Vec::new(),
        Some(Stop::One(stop)) => vec![stop.clone()],
        Some(Stop::Many(stops)) => stops.clone(),
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
    let cache_salt = match &common.cache_salt {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(salt))
            if !salt.is_empty() && salt.chars().count() <= CACHE_SALT_CHARS_MAX =>
        {
            Some(salt.clone())
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
        tools: report.tools.clone(),
        echo: report.echo,
        hide_completion,
        show_logprobs: report.logprobs.is_some(),
        endpoint,
        index: 0,
        n: 1,
        best_of: 1,
        prompt,
        max_tokens: max_tokens as u32,
        sampling,
        stop,
        ignore_eos: common.ignore_eos.unwrap_or(false),
        cache_salt,
        stream,
        include_usage: stream
            && common
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        trace_parent: None,
    })
}

/// The request's sampling settings, each checked, with the server's defaults for those it
/// leaves out.
fn sampling(common: &Common, limits: &Limits) -> Result<Sampling, ApiError> {
    let defaults = &limits.sampling_defaults;
    let temperature = common.temperature.unwrap_or(defaults.temperature);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature must be between 0 and 2",
            "temperature",
        ));
    }
    // Checked as the f32 the sampler gets: a positive f64 below f32's range would become 0.
    let top_p = common.top_p.unwrap_or(defaults.top_p) as f32;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]", "top_p"));
    }
    let top_k = common.top_k.unwrap_or(defaults.top_k.into());
    if !(0..=u32::MAX as i64).contains(&top_k) {
        return Err(ApiError::invalid("top_k must be 0 (off) or more", "top_k"));
    }
    let min_p = common.min_p.unwrap_or(defaults.min_p);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(
            "min_p must be between 0 (off) and 1",
            "min_p",
        ));
    }
    let penalty = |value: Option<f64>, name: &'static str| match value.unwrap_or(0.0) {
        value if (-2.0..=2.0).contains(&value) => Ok(value as f32),
        _ => Err(ApiError::invalid(
            format!("{name} must be between -2 and 2"),
            name,
        )),
    };
    let presence_penalty = penalty(common.presence_penalty, "presence_penalty")?;
    let frequency_penalty = penalty(common.frequency_penalty, "frequency_penalty")?;
    let repetition_penalty = common.repetition_penalty.unwrap_or(1.0) as f32;
    if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
        return Err(ApiError::invalid(
            "repetition_penalty must be in (0, 10]; 1 is off",
            "repetition_penalty",
        ));
    }
    Ok(Sampling {
        temperature: temperature as f32,
        top_p,
        top_k: top_k as u32,
        min_p: min_p as f32,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias: logit_bias(common.logit_bias.as_ref(), limits.tokenizer.vocab_size())?,
        seed: sampling_seed(common.seed),
        logprobs: None,
        prompt_logprobs: false,
        constraint: None,
    })
}

/// `logit_bias` as OpenAI takes it: an object from token ids (as strings) to numbers from
/// -100 to 100; sorted by token id.
fn logit_bias(value: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias must be an object from token ids to biases, as {\"50256\": -100}",
                "logit_bias",
            ))
        }
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            format!("logit_bias may name at most {MAX_LOGIT_BIAS} tokens"),
            "logit_bias",
        ));
    }
    let mut biases = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let key_shown: String = key.chars().take(32).collect();
        let token = key
            .parse::<i64>()
            .ok()
            .and_then(|token| token_id(token, vocab))
            .ok_or_else(|| {
                ApiError::invalid(
                    format!(
                        "logit_bias key '{key_shown}' is not a token id of this model \
                         (0..{vocab}); POST /tokenize shows a text's ids"
                    ),
                    "logit_bias",
                )
            })?;
        let bias = bias
            .as_f64()
            .filter(|bias| (-100.0..=100.0).contains(bias))
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("logit_bias for token {token} must be a number from -100 to 100"),
                    "logit_bias",
                )
            })?;
        biases.push((token, bias as f32));
    }
    biases.sort_unstable_by_key(|&(token, _)| token);
    Ok(biases)
}
