//! The handlers, one per route in `server::routes`, each with the OpenAPI description of
//! what it answers (the errors each can answer are listed once, in `openapi.rs`).

use crate::admission::{admit, authenticate, rate_limited, read_body, require_json};
use crate::error::ApiError;
use crate::metrics::{Counter, RequestOutcome, RouterGauges};
use crate::openai::{parse_chat, parse_completion, ChatRequest, CompletionRequest, Endpoint};
use crate::openai::{Job, Limits};
use crate::responses::{
    ChatCompletion, Health, HealthStatus, ModelList, Readiness, StreamEvent, TextCompletion,
    WorkerView,
};
use crate::run::Runs;
use crate::server::AppState;
use crate::tokens::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo,
};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use transfer::Role;

/// A chat completion: the messages rendered with the model's chat template.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "inference",
    request_body = ChatRequest,
    responses((status = 200, description = "The answer: one JSON object, or with `stream` an \
        SSE stream of `ChatCompletionChunk` events ending in `data: [DONE]` (or, after a late \
        failure, in an `error` event carrying an `ErrorBody`, and no `[DONE]`).",
        content((ChatCompletion = "application/json"), (StreamEvent = "text/event-stream")))),
    security(("bearer" = []))
)]
pub(crate) async fn chat(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    respond(state, headers, body, Endpoint::Chat).await
}

/// A text completion of a prompt given as text or token ids.
#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "inference",
    request_body = CompletionRequest,
    responses((status = 200, description = "The answer: one JSON object, or with `stream` an \
        SSE stream of `TextCompletionChunk` events ending in `data: [DONE]` (or, after a late \
        failure, in an `error` event carrying an `ErrorBody`, and no `[DONE]`).",
        content((TextCompletion = "application/json"), (StreamEvent = "text/event-stream")))),
    security(("bearer" = []))
)]
pub(crate) async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    respond(state, headers, body, Endpoint::Completions).await
}

/// Errors before the run exists are counted here; from then on the run counts its own end.
async fn respond(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let answer = match start(&state, &headers, body, endpoint).await {
        Ok(runs) => crate::run::answer(runs).await,
        Err(error) => {
            let outcome = match error {
                ApiError::ClientGone => RequestOutcome::Cancelled,
                _ => RequestOutcome::Error,
            };
            state.metrics.inc(Counter::Requests {
                outcome,
                reason: error.reason(),
            });
            Err(error)
        }
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

/// Everything from the key to the submit: nothing reaches a worker before it all passed.
/// One run per choice; each holds its own tenant permit and in-flight slot, as a sequence in
/// flight of its own.
async fn start(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Runs, ApiError> {
    // Nothing runs, and the body is not read, for a caller without a valid key.
    let tenant = authenticate(state, headers)?;
    require_json(headers)?;
    let body = read_body(body, &state.config).await?;
    let mut jobs = parse(state, &body, endpoint)?;
    let trace_parent = headers
        .get("traceparent")
        .and_then(|value| value.to_str().ok())
        .and_then(otlp::TraceContext::from_traceparent);
    for job in &mut jobs {
        job.trace_parent = trace_parent;
        admit(state, job)?;
    }
    // Every choice's permit and slot before any is submitted: a request over a limit sends
    // nothing.
    let mut admitted = Vec::with_capacity(jobs.len());
    for job in jobs {
        let total_tokens = job.prompt.len() + job.max_tokens as usize;
        let permit = tenant.admit(total_tokens).map_err(rate_limited)?;
        let slot =
            state
                .in_flight
                .clone()
                .try_acquire_owned()
                .map_err(|_| ApiError::Overloaded {
                    message: format!(
                        "the server is at its limit of {} requests in flight; retry shortly",
                        state.config.in_flight_max
                    ),
                })?;
        admitted.push((job, permit, slot));
    }
    Runs::submit(state, admitted)
}

fn parse(state: &AppState, body: &[u8], endpoint: Endpoint) -> Result<Vec<Job>, ApiError> {
    let limits = limits(state);
    match endpoint {
        Endpoint::Chat => parse_chat(body, &limits),
        Endpoint::Completions => parse_completion(body, &limits),
    }
}

/// What a request body is checked against.
fn limits(state: &AppState) -> Limits<'_> {
    Limits {
        model_id: &state.config.model_id,
        tokenizer: &state.tokenizer,
        chat_template: state.chat_template.as_ref(),
        context_length: state.config.context_length,
        default_max_tokens: state.config.default_max_tokens,
        sampling_defaults: state.config.sampling_defaults,
        vocabulary: state.vocabulary.as_ref(),
    }
}

/// The tokens of a prompt or a chat, counted as the generation endpoints count them.
#[utoipa::path(
    post,
    path = "/tokenize",
    tag = "inference",
    request_body = TokenizeRequest,
    responses((status = 200, description = "The token ids, their count and the context \
        length they must fit.", body = TokenizeResponse)),
    security(("bearer" = []))
)]
pub(crate) async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer_body(&state, &headers, body, crate::tokens::tokenize).await
}

/// The text of token ids.
#[utoipa::path(
    post,
    path = "/detokenize",
    tag = "inference",
    request_body = DetokenizeRequest,
    responses((status = 200, description = "The text.", body = DetokenizeResponse)),
    security(("bearer" = []))
)]
pub(crate) async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer_body(&state, &headers, body, crate::tokens::detokenize).await
}

/// The tokenizer's special tokens and chat template (vLLM's shape).
#[utoipa::path(
    get,
    path = "/tokenizer_info",
    tag = "inference",
    responses((status = 200, description = "The special tokens, chat template and limits.",
        body = TokenizerInfo)),
    security(("bearer" = []))
)]
pub(crate) async fn tokenizer_info(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        return error.into_response();
    }
    Json(crate::tokens::tokenizer_info(&limits(&state))).into_response()
}

/// `answer` of a JSON body from a caller with a valid key, within the body limits.
async fn answer_body<T: serde::Serialize>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    answer: fn(&[u8], &Limits) -> Result<T, ApiError>,
) -> Response {
    let answered = async {
        authenticate(state, headers)?;
        require_json(headers)?;
        let body = read_body(body, &state.config).await?;
        answer(&body, &limits(state))
    };
    answered.await.map(Json).into_response()
}

/// The one model served.
#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "inference",
    responses((status = 200, description = "The model this server runs.", body = ModelList)),
    security(("bearer" = []))
)]
pub(crate) async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        return error.into_response();
    }
    Json(ModelList::one(
        &state.config.model_id,
        state.config.context_length,
    ))
    .into_response()
}

/// Up or degraded for anyone; the workers' addresses, pools and shape only for a caller with a
/// valid key (in single-tenant mode, every caller).
#[utoipa::path(
    get,
    path = "/health",
    tag = "operations",
    responses(
        (status = 200, description = "Every worker is linked.", body = Health),
        (status = 503, description = "Some worker is not linked (`degraded`).", body = Health),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn health(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let (status, readiness) = readiness(&state);
    if authenticate(&state, &headers).is_err() {
        return (status, Json(HealthStatus { status: readiness })).into_response();
    }
    let workers = state
        .cluster
        .clients()
        .iter()
        .map(|client| {
            let info = client.info();
            WorkerView {
                address: client.addr.clone(),
                capacity_tokens: info.as_ref().map(|i| i.capacity_tokens),
                context_length: info.as_ref().map(|i| i.context_length),
                draining: client.is_draining(),
                kv_bytes: info.as_ref().map(|i| i.kv_bytes),
                name: info.as_ref().map(|i| i.name.clone()),
                page_size_tokens: info.as_ref().map(|i| i.page_size_tokens),
                refused: client.refused(),
                role: crate::cluster::role_name(client.role),
                up: client.is_up(),
                weight_bytes: info.as_ref().map(|i| i.weight_bytes),
            }
        })
        .collect();
    let body = Health {
        context_length: Some(state.config.context_length),
        model: Some(state.config.model_id.clone()),
        status: readiness,
        workers: Some(workers),
    };
    (status, Json(body)).into_response()
}

/// 200 "ok" when every worker is linked, else 503 "degraded".
fn readiness(state: &AppState) -> (StatusCode, Readiness) {
    if state.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, Readiness::Draining)
    } else if state.cluster.clients().iter().all(|c| c.is_up()) {
        (StatusCode::OK, Readiness::Ok)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Readiness::Degraded)
    }
}

/// 200 "ok" when a request can be served end to end: a unified worker is linked, or a
/// prefill and a decode worker both are (draining ones do not count); else 503 "degraded",
/// or 503 "draining" once the router itself is stopping.
fn can_serve(state: &AppState) -> (StatusCode, Readiness) {
    let up = |role| {
        state
            .cluster
            .clients()
            .iter()
            .any(|c| c.role == role && c.is_up() && !c.is_draining())
    };
    if state.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, Readiness::Draining)
    } else if up(Role::Unified) || (up(Role::Prefill) && up(Role::Decode)) {
        (StatusCode::OK, Readiness::Ok)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Readiness::Degraded)
    }
}

/// Liveness: the process answers HTTP. Says nothing else, to anyone.
#[utoipa::path(
    get,
    path = "/health/live",
    tag = "operations",
    responses((status = 200, description = "Always `ok`.", body = HealthStatus))
)]
pub(crate) async fn live() -> Response {
    Json(HealthStatus {
        status: Readiness::Ok,
    })
    .into_response()
}

/// Readiness: a request can be served end to end (a unified worker, or a prefill and a
/// decode worker, linked). Says nothing else, to anyone.
#[utoipa::path(
    get,
    path = "/health/ready",
    tag = "operations",
    responses(
        (status = 200, description = "A complete path through the workers is linked.",
            body = HealthStatus),
        (status = 503, description = "No complete path is linked (`degraded`).",
            body = HealthStatus),
    )
)]
pub(crate) async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let (status, readiness) = can_serve(&state);
    (status, Json(HealthStatus { status: readiness })).into_response()
}

/// Prometheus text exposition: requests, transfers, pools, latencies.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text format 0.0.4.",
        content_type = "text/plain", body = String))
)]
pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let router = RouterGauges {
        waiting: state.waiting.load(Ordering::Relaxed),
        in_flight: state.config.in_flight_max - state.in_flight.available_permits(),
    };
    let text = state.metrics.render(&state.cluster.gauges(), router);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// This document. Like `/health/live`, it needs no key: it describes the API, not the
/// deployment's state (it does name the model and its context length, as errors do).
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API.",
        content_type = "application/json", body = Object))
)]
pub(crate) async fn openapi(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi_json.clone(),
    )
        .into_response()
}
