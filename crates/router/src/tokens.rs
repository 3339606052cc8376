//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: what a prompt costs in tokens
//! against the context length, and which ids a text has (for `logit_bias` or a token-id
//! prompt), counted exactly as the generation endpoints count them.

use crate::error::ApiError;
use crate::openai::{
    chat_prompt, check_model, parse_json, refuse_unknown, token_id, ChatMessageIn, Limits,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

/// The body of `POST /tokenize`: a `prompt` (tokenized as `/v1/completions` does) or
/// `messages` (rendered with the chat template and tokenized as `/v1/chat/completions` does),
/// not both. A field not listed here gets 400.
#[derive(Deserialize, ToSchema)]
pub struct TokenizeRequest {
    /// The served model's id, if given.
    model: Option<String>,
    prompt: Option<String>,
    #[schema(min_items = 1)]
    messages: Option<Vec<ChatMessageIn>>,
    /// With `messages`: end with the assistant's turn, as a chat request does. Default true.
    add_generation_prompt: Option<bool>,
    /// With `prompt`: start with the beginning-of-sequence token, where the model has one.
    /// Default false: a prompt is counted as `/v1/completions` counts it, which adds none.
    add_special_tokens: Option<bool>,
    #[serde(flatten)]
    #[schema(ignore)]
    unknown: Map<String, Value>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenizeResponse {
    /// How many tokens.
    pub count: usize,
    /// The most tokens a request (prompt + max_tokens) may hold.
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
}

/// The body of `POST /detokenize`. A field not listed here gets 400.
#[derive(Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    /// The served model's id, if given.
    model: Option<String>,
    /// Token ids of this model's vocabulary.
    #[schema(value_type = Vec<u32>)]
    tokens: Vec<i64>,
    #[serde(flatten)]
    #[schema(ignore)]
    unknown: Map<String, Value>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The text of the tokens (bytes that are not UTF-8 shown as U+FFFD).
    pub prompt: String,
}

pub(crate) fn tokenize(body: &[u8], limits: &Limits) -> Result<TokenizeResponse, ApiError> {
    let request: TokenizeRequest = parse_json(body)?;
    refuse_unknown(&request.unknown, "")?;
    if let Some(model) = &request.model {
        check_model(model, limits)?;
    }
    let tokens = match (request.prompt, request.messages) {
        (Some(text), None) => {
            let mut tokens = limits.tokenizer.encode(&text, false);
            if request.add_special_tokens == Some(true) {
                tokens.splice(0..0, limits.tokenizer.bos_id());
            }
            tokens
        }
        (None, Some(messages)) => chat_prompt(
            messages,
            request.add_generation_prompt.unwrap_or(true),
            None,
            limits,
        )?,
        _ => {
            return Err(ApiError::invalid(
                "send either prompt (text) or messages (a chat), not both",
                "prompt",
            ))
        }
    };
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: limits.context_length,
        tokens,
    })
}

/// `GET /tokenizer_info`, in vLLM's shape: what a client that tokenizes through this
/// server (lm-evaluation-harness's remote tokenizer) needs besides `/tokenize`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TokenizerInfo {
    pub bos_token: Option<String>,
    /// The model's chat template (Jinja), if it has one.
    pub chat_template: Option<String>,
    pub eos_token: Option<String>,
    /// The most tokens a request (prompt + max_tokens) may hold.
    pub model_max_length: usize,
    pub pad_token: Option<String>,
    pub vocab_size: usize,
}

pub(crate) fn tokenizer_info(limits: &Limits) -> TokenizerInfo {
    let tokenizer = limits.tokenizer;
    let text = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .map(str::to_string)
    };
    TokenizerInfo {
        bos_token: text(tokenizer.bos_id()),
        chat_template: limits.chat_template.map(|t| t.source().to_string()),
        eos_token: text(Some(tokenizer.eos_id())),
        model_max_length: limits.context_length,
        pad_token: None,
        vocab_size: tokenizer.vocab_size(),
    }
}

pub(crate) fn detokenize(body: &[u8], limits: &Limits) -> Result<DetokenizeResponse, ApiError> {
    let request: DetokenizeRequest = parse_json(body)?;
    refuse_unknown(&request.unknown, "")?;
    if let Some(model) = &request.model {
        check_model(model, limits)?;
    }
    let vocab = limits.tokenizer.vocab_size();
    let mut ids = Vec::with_capacity(request.tokens.len());
    for token in request.tokens {
        ids.push(token_id(token, vocab).ok_or_else(|| {
            ApiError::invalid(
                format!("token id {token} is outside the vocabulary (0..{vocab})"),
                "tokens",
            )
        })?);
    }
    Ok(DetokenizeResponse {
        prompt: limits.tokenizer.decode(&ids),
    })
}
