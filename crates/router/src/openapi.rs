//! The OpenAPI 3.1 document of the HTTP API, served at `GET /openapi.json` (no key needed):
//! derived from the request and response types and the handlers' `#[utoipa::path]`s, plus
//! the one table of the errors each route can answer, and this deployment's model id, context
//! length and vocabulary (the limits a request is checked against).

use crate::openai::{ChatRequest, CompletionRequest};
use crate::responses::{
    ChatCompletion, ChatCompletionChunk, ErrorBody, Health, HealthStatus, ModelList,
    TextCompletion, TextCompletionChunk,
};
use crate::server::RouterConfig;
use crate::tokens::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo,
};
use serde_json::{json, Value};
use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Airlock",
        description = "OpenAI-compatible inference. Every error is an `ErrorBody` with the \
            status its `code` implies. `/openapi.json`, `/health/live`, `/health/ready` and \
            `/metrics` need no key; `/health` says more with one."
    ),
    paths(
        crate::routes::chat,
        crate::routes::completions,
        crate::routes::models,
        crate::routes::tokenize,
        crate::routes::detokenize,
        crate::routes::tokenizer_info,
        crate::routes::health,
        crate::routes::live,
        crate::routes::ready,
        crate::routes::metrics,
        crate::routes::openapi,
    ),
    components(schemas(
        ChatRequest,
        CompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
        TextCompletion,
        TextCompletionChunk,
        ModelList,
        TokenizeRequest,
        TokenizeResponse,
        DetokenizeRequest,
        DetokenizeResponse,
        TokenizerInfo,
        Health,
        HealthStatus,
        ErrorBody,
    )),
    modifiers(&Errors, &Bearer),
)]
struct ApiDoc;

/// The statuses each route can answer besides its own, in one place. Every route can get
/// 429 and 503 from the HTTP edge (a client's or the server's connections all in use) and
/// 431 (headers over the limit).
fn errors(path: &str) -> &'static [u16] {
    match path {
        "/v1/chat/completions" | "/v1/completions" => {
            &[400, 401, 404, 408, 413, 415, 429, 431, 499, 500, 503, 504]
        }
        "/tokenize" | "/detokenize" => &[400, 401, 404, 408, 413, 415, 429, 431, 503],
        "/v1/models" | "/tokenizer_info" => &[401, 429, 431, 503],
        _ => &[429, 431, 503],
    }
}

fn error_description(status: u16) -> &'static str {
    match status {
        400 => {
            "`invalid_request` (malformed JSON, a field out of range or unsupported) or \
                `context_length_exceeded`; `param` names the field to change."
        }
        401 => "`invalid_api_key`: no valid `Authorization: Bearer <key>`. Nothing runs.",
        404 => "`model_not_found`: the model named is not the one served.",
        408 => "`request_timeout`: the body did not arrive within the body timeout.",
        413 => "`request_too_large`: the body is over the size limit.",
        415 => "`unsupported_media_type`: the body is not labelled `application/json`.",
        429 => {
            "`rate_limit_exceeded`: the key is over one of its limits, or the client's \
                address holds all the connections it may."
        }
        431 => "`request_header_fields_too_large`.",
        499 => "`request_cancelled`: a worker ended the request as cancelled.",
        500 => "`internal_error`: a worker's channel closed without an answer.",
        503 => "`overloaded`, `no_workers` or `kv_transfer_failed`: retry.",
        504 => "`timeout`: no answer from the workers in time, or a KV transfer timed out.",
        _ => "An error.",
    }
}

struct Errors;

impl Modify for Errors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            for operation in [&mut item.get, &mut item.post].into_iter().flatten() {
                add_errors(operation, errors(path));
            }
        }
    }
}

fn add_errors(operation: &mut Operation, statuses: &[u16]) {
    for &status in statuses {
        let content = ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("ErrorBody")))
            .build();
        let mut response = ResponseBuilder::new()
            .description(error_description(status))
            .content("application/json", content);
        let header = match status {
            429 | 503 => Some(("Retry-After", "Seconds to wait before retrying.")),
            401 => Some(("WWW-Authenticate", "`Bearer`.")),
            _ => None,
        };
        if let Some((name, description)) = header {
            let header = HeaderBuilder::new().description(Some(description)).build();
            response = response.header(name, header);
        }
        operation
            .responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| response.build().into());
    }
}

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// The document for this deployment, as served: the model enum and the numeric limits a
/// request is checked against here, so a client (or a fuzzer) can tell valid from invalid.
pub fn document(config: &RouterConfig, vocab_size: usize) -> Value {
    let mut document = serde_json::to_value(ApiDoc::openapi()).expect("the document serializes");
    // The longest answer any request may ask for: the context less a one-token prompt.
    let max_tokens_max = config.context_length.saturating_sub(1).max(1);
    let model = json!([config.model_id, null]);
    for request in ["ChatRequest", "CompletionRequest"] {
        set(
            &mut document,
            request,
            "/allOf/1/properties/model",
            "enum",
            &model,
        );
    }
    let max_tokens = json!(max_tokens_max);
    let field = "/allOf/1/properties/max_completion_tokens";
    set(&mut document, "ChatRequest", field, "maximum", &max_tokens);
    set(
        &mut document,
        "Common",
        "/properties/max_tokens",
        "maximum",
        &max_tokens,
    );
    let token_id_max = json!(vocab_size.saturating_sub(1));
    set(
        &mut document,
        "Prompt",
        "/oneOf/2/items",
        "maximum",
        &token_id_max,
    );
    document
}

/// Sets `key` in the schema at `pointer` under the component `schema`, which must exist: the
/// unit tests build the document, so a derive that moved it fails them, not a request.
fn set(document: &mut Value, schema: &str, pointer: &str, key: &str, value: &Value) {
    let pointer = format!("/components/schemas/{schema}{pointer}");
    let target = document
        .pointer_mut(&pointer)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("the OpenAPI document has {pointer}"));
    target.insert(key.to_string(), value.clone());
}

/// [`document`] as the text `/openapi.json` answers.
pub fn document_json(config: &RouterConfig, vocab_size: usize) -> String {
    serde_json::to_string(&document(config, vocab_size)).expect("the document serializes")
}

#[cfg(test)]
mod tests;
