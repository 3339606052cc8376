//! Every JSON body the router answers, as types: the same definitions are serialized onto the
//! wire and described in the OpenAPI document (`openapi.rs`), so the two cannot drift.
//!
//! Fields are declared in alphabetical order, the order `serde_json::json!` wrote them in
//! before these types existed: the bytes on the wire did not change with them.

use crate::openai::Endpoint;
pub use crate::tools::ToolCall;
use serde::Serialize;
use std::time::SystemTime;
use transfer::Finish;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{RefOr, Schema};
use utoipa::ToSchema;

/// Why generation stopped: an end-of-sequence token or stop string, or `max_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
    /// The answer is a call to one of the request's tools.
    #[serde(rename = "tool_calls")]
    ToolCalls,
}

impl From<Finish> for FinishReason {
    fn from(finish: Finish) -> FinishReason {
        match finish {
            Finish::Stop => FinishReason::Stop,
            Finish::Length => FinishReason::Length,
        }
    }
}

impl FinishReason {
    /// The metrics label, the same word as on the wire.
    pub fn label(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of one request, as the workers report them at its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct Usage {
    pub completion_tokens: u32,
    pub prompt_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose K/V came from the prefix cache of the caller's own tenant (and
    /// `cache_salt`) instead of being computed.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Usage {
        Usage {
            completion_tokens,
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }

    /// A request's usage from its choices' (`first_of_prompt`: whether the choice is its
    /// prompt's first): each prompt is counted once, as OpenAI counts it however many choices
    /// it has, and every choice's completion.
    pub fn total(choices: impl IntoIterator<Item = (bool, Usage)>) -> Usage {
        let (mut prompt, mut completion, mut cached) = (0u32, 0u32, 0u32);
        for (first_of_prompt, usage) in choices {
            if first_of_prompt {
                prompt = prompt.saturating_add(usage.prompt_tokens);
                cached = cached.saturating_add(usage.prompt_tokens_details.cached_tokens);
            }
            completion = completion.saturating_add(usage.completion_tokens);
        }
        Usage::new(prompt, completion, cached)
    }
}

/// A field that is always `null` (`refusal`: the model never refuses as OpenAI's do).
fn null_schema() -> utoipa::openapi::Object {
    ObjectBuilder::new().schema_type(Type::Null).build()
}

/// What OpenAI reports for an impossible token (JSON has no -infinity).
const LOGPROB_FLOOR: f32 = -9999.0;

/// A token as a client reads it: its text (invalid UTF-8 shown as U+FFFD), its bytes, and its
/// log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenScore {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// An answer token's score and the most likely tokens' at its step.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub chosen: TokenScore,
    pub top: Vec<TokenScore>,
}

impl TokenScore {
    pub fn new(tokenizer: &gguf::Tokenizer, token: u32, logprob: f32) -> TokenScore {
        let bytes = tokenizer.token_bytes(token).to_vec();
        TokenScore {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob: if logprob.is_finite() {
                logprob
            } else {
                LOGPROB_FLOOR
            },
        }
    }
}

/// `logprobs` of a chat choice (OpenAI's shape).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    #[schema(schema_with = null_schema)]
    pub refusal: Option<()>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatTokenLogprob {
    pub bytes: Vec<u8>,
    /// The log-softmax of the model's raw logits (before penalties, bias and temperature);
    /// -9999 for a token the model gives no chance.
    pub logprob: f32,
    pub token: String,
    /// The most likely tokens at this step, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TopLogprob {
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub token: String,
}

/// `logprobs` of a completion choice (OpenAI's legacy shape).
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    /// Where each token starts in the choice's text, in characters.
    pub text_offset: Vec<usize>,
    /// `null` for an echoed prompt's first token, which nothing predicts.
    pub token_logprobs: Vec<Option<f32>>,
    pub tokens: Vec<String>,
    /// Per token, the most likely tokens at its step and their log-probabilities (`null` for
    /// an echoed prompt's first token).
    pub top_logprobs: Vec<Option<std::collections::BTreeMap<String, f32>>>,
}

impl ChatLogprobs {
    fn new(scored: &[Scored]) -> ChatLogprobs {
        let top = |score: &TokenScore| TopLogprob {
            bytes: score.bytes.clone(),
            logprob: score.logprob,
            token: score.token.clone(),
        };
        ChatLogprobs {
            content: scored
                .iter()
                .map(|s| ChatTokenLogprob {
                    bytes: s.chosen.bytes.clone(),
                    logprob: s.chosen.logprob,
                    token: s.chosen.token.clone(),
                    top_logprobs: s.top.iter().map(top).collect(),
                })
                .collect(),
            refusal: None,
        }
    }
}

impl CompletionLogprobs {
    /// The scores of tokens whose text starts `offset` characters into the choice's text,
    /// after an unscored first token (an echoed prompt's) when there is one.
    fn new(unscored_first: Option<&str>, scored: &[Scored], offset: usize) -> CompletionLogprobs {
        let mut logprobs = CompletionLogprobs {
            text_offset: Vec::with_capacity(scored.len() + 1),
            token_logprobs: Vec::with_capacity(scored.len() + 1),
            tokens: Vec::with_capacity(scored.len() + 1),
            top_logprobs: Vec::with_capacity(scored.len() + 1),
        };
        let mut offset = offset;
        let mut push = |token: &str, scores: Option<(f32, &[TokenScore])>| {
            logprobs.text_offset.push(offset);
            offset += token.chars().count();
            logprobs.tokens.push(token.to_string());
            logprobs
                .token_logprobs
                .push(scores.map(|(logprob, _)| logprob));
            logprobs.top_logprobs.push(
                scores.map(|(_, top)| top.iter().map(|t| (t.token.clone(), t.logprob)).collect()),
            );
        };
        if let Some(first) = unscored_first {
            push(first, None);
        }
        for s in scored {
            push(&s.chosen.token, Some((s.chosen.logprob, &s.top)));
        }
        logprobs
    }
}

/// A non-streamed answer of `/v1/chat/completions`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub choices: Vec<ChatChoice>,
    /// Unix seconds.
    pub created: u64,
    #[schema(example = "chatcmpl-0123456789abcdef")]
    pub id: String,
    pub model: String,
    #[schema(value_type = String, pattern = "^chat\\.completion$")]
    pub object: &'static str,
    pub usage: Usage,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    pub finish_reason: FinishReason,
    pub index: u32,
    /// Only when the request asked for `logprobs`.
    pub logprobs: Option<ChatLogprobs>,
    pub message: AssistantMessage,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// `null` when the answer is a tool call.
    pub content: Option<String>,
    #[schema(value_type = String, pattern = "^assistant$")]
    pub role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One `data:` event of a streamed `/v1/chat/completions` answer. The first carries the
/// role, the last choice its `finish_reason`; with `stream_options.include_usage` one more
/// follows with no choices and the `usage`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub choices: Vec<ChatChunkChoice>,
    pub created: u64,
    pub id: String,
    pub model: String,
    #[schema(value_type = String, pattern = "^chat\\.completion\\.chunk$")]
    pub object: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub delta: Delta,
    pub finish_reason: Option<FinishReason>,
    pub index: u32,
    /// The scores of this event's tokens, when the request asked for `logprobs`.
    pub logprobs: Option<ChatLogprobs>,
}

#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, pattern = "^assistant$")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallChunk>>,
}

/// A tool call in a streamed answer: the whole call, in one event.
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolCallChunk {
    #[serde(flatten)]
    pub call: ToolCall,
    /// Which call of the choice.
    pub index: u32,
}

/// One event of a streamed answer, as an SSE client parses it (OpenAPI before 3.2 describes
/// `text/event-stream` event by event).
pub struct StreamEvent;

impl utoipa::PartialSchema for StreamEvent {
    fn schema() -> RefOr<Schema> {
        let schema = serde_json::json!({
            "type": "object",
            "description": "A `message` event's `data` is a chunk as JSON \
                (`ChatCompletionChunk` or `TextCompletionChunk`), the last one `[DONE]`; an \
                `error` event's `data` is an `ErrorBody` as JSON, and no `[DONE]` follows.",
            "properties": {
                "event": {"type": "string", "enum": ["message", "error"]},
                "data": {"type": "string"},
            },
            "required": ["data"],
        });
        RefOr::T(serde_json::from_value(schema).expect("the literal is a schema"))
    }
}

impl ToSchema for StreamEvent {}

/// A non-streamed answer of `/v1/completions`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TextCompletion {
    pub choices: Vec<TextChoice>,
    pub created: u64,
    #[schema(example = "cmpl-0123456789abcdef")]
    pub id: String,
    pub model: String,
    #[schema(value_type = String, pattern = "^text_completion$")]
    pub object: &'static str,
    pub usage: Usage,
}

/// One `data:` event of a streamed `/v1/completions` answer: the same shape as the whole
/// answer, `finish_reason` null but in the last, and `usage` only in the extra last event
/// `stream_options.include_usage` asks for.
#[derive(Debug, Serialize, ToSchema)]
pub struct TextCompletionChunk {
    pub choices: Vec<TextChoice>,
    pub created: u64,
    pub id: String,
    pub model: String,
    #[schema(value_type = String, pattern = "^text_completion$")]
    pub object: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TextChoice {
    /// Set in a whole answer; in a stream, only in the last chunk.
    pub finish_reason: Option<FinishReason>,
    pub index: u32,
    /// Only when the request asked for `logprobs`.
    pub logprobs: Option<CompletionLogprobs>,
    pub text: String,
}

/// What every answer of one request shares: its id and the model that wrote it.
pub struct Head {
    pub endpoint: Endpoint,
    pub id: String,
    pub model: String,
    /// Whether the request asked for log-probabilities.
    pub logprobs: bool,
}

/// What one streamed event says.
#[derive(Clone, Copy, Debug)]
pub enum Piece<'a> {
    /// The first event: the assistant's role (chat), empty text.
    Opening,
    /// Text, the scores of the tokens it came from, and (completions) where it starts in the
    /// choice's text, in characters. An echoed prompt's first token comes without a score.
    Text {
        text: &'a str,
        unscored_first: Option<&'a str>,
        scored: &'a [Scored],
        offset: usize,
    },
    /// The choice's answer is these tool calls (chat).
    ToolCalls(&'a [ToolCall]),
    Finish(FinishReason),
    /// After the finish, when the client asked for usage.
    Usage(Usage),
}

/// One streamed event's JSON, of either endpoint.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Chunk {
    Chat(ChatCompletionChunk),
    Text(TextCompletionChunk),
}

/// The whole answer of a non-streamed request, of either endpoint.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Whole {
    Chat(ChatCompletion),
    Text(TextCompletion),
}

/// One choice of a whole answer.
pub struct WholeChoice {
    pub index: u32,
    pub text: String,
    pub finish: FinishReason,
    /// Each token's score, when asked for: an echoed prompt's (all but the first) first.
    pub scores: Vec<Scored>,
    /// An echoed prompt's first token, which has no score.
    pub unscored_first: Option<String>,
    /// The answer as tool calls (then `text` is not shown).
    pub tool_calls: Option<Vec<ToolCall>>,
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Head {
    /// The whole answer: each choice's, and the request's usage.
    pub fn whole(&self, choices: Vec<WholeChoice>, usage: Usage) -> Whole {
        let asked = self.logprobs;
        match self.endpoint {
            Endpoint::Chat => Whole::Chat(ChatCompletion {
                choices: choices
                    .into_iter()
                    .map(|choice| ChatChoice {
                        finish_reason: choice.finish,
                        index: choice.index,
                        logprobs: asked.then(|| ChatLogprobs::new(&choice.scores)),
                        message: AssistantMessage {
                            content: choice.tool_calls.is_none().then_some(choice.text),
                            role: "assistant",
                            tool_calls: choice.tool_calls,
                        },
                    })
                    .collect(),
                created: created(),
                id: self.id.clone(),
                model: self.model.clone(),
                object: "chat.completion",
                usage,
            }),
            Endpoint::Completions => Whole::Text(TextCompletion {
                choices: choices
                    .into_iter()
                    .map(|choice| TextChoice {
                        finish_reason: Some(choice.finish),
                        index: choice.index,
                        logprobs: asked.then(|| {
                            let first = choice.unscored_first.as_deref();
                            CompletionLogprobs::new(first, &choice.scores, 0)
                        }),
                        text: choice.text,
                    })
                    .collect(),
                created: created(),
                id: self.id.clone(),
                model: self.model.clone(),
                object: "text_completion",
                usage,
            }),
        }
    }

    /// One streamed event, of the choice `index` (the usage event has none).
    pub fn chunk(&self, index: u32, piece: Piece) -> Chunk {
        let (text, finish, usage) = match piece {
            Piece::Opening => (Some(""), None, None),
            Piece::Text { text, .. } => (Some(text), None, None),
            Piece::ToolCalls(_) => (None, None, None),
            Piece::Finish(finish) => (None, Some(finish), None),
            Piece::Usage(usage) => (None, None, Some(usage)),
        };
        let scored = match piece {
            Piece::Text {
                unscored_first,
                scored,
                offset,
                ..
            } if self.logprobs => Some((unscored_first, scored, offset)),
            _ => None,
        };
        // The usage event has no choices; every other event has one.
        let one_choice = usage.is_none();
        match self.endpoint {
            Endpoint::Chat => Chunk::Chat(ChatCompletionChunk {
                choices: one_choice
                    .then(|| ChatChunkChoice {
                        delta: Delta {
                            content: text.map(str::to_string),
                            role: matches!(piece, Piece::Opening).then_some("assistant"),
                            tool_calls: match piece {
                                Piece::ToolCalls(calls) => Some(
                                    (0..)
                                        .zip(calls)
                                        .map(|(index, call)| ToolCallChunk {
                                            call: call.clone(),
                                            index,
                                        })
                                        .collect(),
                                ),
                                _ => None,
                            },
                        },
                        finish_reason: finish,
                        index,
                        logprobs: scored.map(|(_, scored, _)| ChatLogprobs::new(scored)),
                    })
                    .into_iter()
                    .collect(),
                created: created(),
                id: self.id.clone(),
                model: self.model.clone(),
                object: "chat.completion.chunk",
                usage,
            }),
            Endpoint::Completions => Chunk::Text(TextCompletionChunk {
                choices: one_choice
                    .then(|| TextChoice {
                        finish_reason: finish,
                        index,
                        logprobs: scored.map(|(first, scored, offset)| {
                            CompletionLogprobs::new(first, scored, offset)
                        }),
                        text: text.unwrap_or("").to_string(),
                    })
                    .into_iter()
                    .collect(),
                created: created(),
                id: self.id.clone(),
                model: self.model.clone(),
                object: "text_completion",
                usage,
            }),
        }
    }
}

/// `/v1/models`: the one model served.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    pub data: Vec<ModelCard>,
    #[schema(value_type = String, pattern = "^list$")]
    pub object: &'static str,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelCard {
    pub created: u64,
    pub id: String,
    /// The most tokens a request (prompt + max_tokens) may hold.
    pub max_model_len: usize,
    #[schema(value_type = String, pattern = "^model$")]
    pub object: &'static str,
    #[schema(value_type = String, pattern = "^airlock$")]
    pub owned_by: &'static str,
}

impl ModelList {
    pub fn one(model_id: &str, max_model_len: usize) -> ModelList {
        ModelList {
            data: vec![ModelCard {
                created: 0,
                id: model_id.to_string(),
                max_model_len,
                object: "model",
                owned_by: "airlock",
            }],
            object: "list",
        }
    }
}

/// `ok` when every worker is linked, else `degraded` (with status 503).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Readiness {
    Ok,
    Degraded,
    /// The router is shutting down: it finishes what it has and wants nothing new.
    Draining,
}

/// `/health/live` and `/health/ready`, and `/health` for a caller without a valid key.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthStatus {
    pub status: Readiness,
}

/// `/health`: the status for anyone; the model, context length and workers only for a caller
/// with a valid key (in single-tenant mode, every caller).
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_length: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub status: Readiness,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<Vec<WorkerView>>,
}

/// One configured worker; what it reported at its handshake is null until it linked once.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkerView {
    pub address: String,
    pub capacity_tokens: Option<u64>,
    pub context_length: Option<u32>,
    /// The worker reported that it is shutting down: it is not given new requests.
    pub draining: bool,
    pub kv_bytes: Option<u64>,
    pub name: Option<String>,
    pub page_size_tokens: Option<u32>,
    /// Why the router refused this worker at its handshake, if it did.
    pub refused: Option<String>,
    #[schema(value_type = String, pattern = "^(prefill|decode|unified)$")]
    pub role: &'static str,
    pub up: bool,
    pub weight_bytes: Option<u64>,
}

/// The OpenAI error object every error answer carries.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable: `invalid_request`, `context_length_exceeded`, `invalid_api_key`,
    /// `model_not_found`, `rate_limit_exceeded`, `overloaded`, ...
    #[schema(value_type = String)]
    pub code: &'static str,
    /// What went wrong and what to do about it.
    pub message: String,
    /// The request field to change, when one is at fault.
    #[schema(value_type = Option<String>)]
    pub param: Option<std::borrow::Cow<'static, str>>,
    /// OpenAI's error class: `invalid_request_error`, `authentication_error`,
    /// `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    #[schema(value_type = String)]
    pub kind: &'static str,
}
