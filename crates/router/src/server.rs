//! The HTTP front: routes, authentication, admission (I3), and each request's run through
//! the workers, from submit to the last SSE event.
//!
//! No 200 leaves before the decode worker reports `Started`, which it sends only after it
//! sealed a verified transfer (I2, I4); a failure after that ends the stream with an `error`
//! event and no `[DONE]`. A client that goes away drops its [`Run`], and the drop sends an
//! abort to every worker the request touched (I7): the workers end it through the protocol.

use crate::cluster::{Cluster, WorkerClient};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::{parse_chat, parse_completion, Endpoint, Job, Limits};
use crate::tenants::{LimitExceeded, TenantPermit, Tenants};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use futures_util::stream::{self, Stream};
use gguf::{ChatTemplate, Tokenizer};
use kv::RequestId;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use transfer::{Finish, Frame, Plan, Role, Submit, TransferId};

/// The router's settings, checked by the binary.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The model id clients must name.
    pub model_id: String,
    /// Most tokens (prompt + max_tokens) per request, before the workers' own limits.
    pub context_length: usize,
    /// Largest request body accepted (413 above).
    pub body_bytes_max: usize,
    /// max_tokens when a request gives none (capped by what the context leaves).
    pub default_max_tokens: usize,
    /// Requests admitted and not yet finished, over all tenants; more get 503.
    pub in_flight_max: usize,
    /// How long a request may wait for its first answer from the workers (504 past it).
    pub start_timeout: Duration,
    /// How long an authenticated request's body may take to arrive (408 past it).
    pub body_timeout: Duration,
    /// Origins a browser may call from (CORS); empty: no `Access-Control-Allow-*` header is
    /// ever sent. `*` allows any origin.
    pub cors_allow_origins: Vec<String>,
}

/// Everything the handlers share.
pub struct AppState {
    pub config: RouterConfig,
    pub tenants: Tenants,
    pub cluster: Cluster,
    pub metrics: Arc<Metrics>,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    in_flight: Arc<Semaphore>,
    waiting: AtomicUsize,
    next_request: AtomicU64,
    /// High bits of every transfer id: a restarted router never reuses an earlier one's ids.
    transfer_salt: u64,
}

impl AppState {
    pub fn new(
        config: RouterConfig,
        tenants: Tenants,
        cluster: Cluster,
        metrics: Arc<Metrics>,
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
    ) -> AppState {
        let salt = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        AppState {
            in_flight: Arc::new(Semaphore::new(config.in_flight_max)),
            config,
            tenants,
            cluster,
            metrics,
            tokenizer,
            chat_template,
            waiting: AtomicUsize::new(0),
            next_request: AtomicU64::new(1),
            transfer_salt: salt << 32,
        }
    }
}

/// The HTTP routes over `state`.
pub fn app(state: Arc<AppState>) -> axum::Router {
    let routes = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health/live", get(live))
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::NotFound })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed });
    let routes = if state.config.cors_allow_origins.is_empty() {
        routes
    } else {
        let origins = Arc::new(state.config.cors_allow_origins.clone());
        routes.layer(axum::middleware::from_fn(move |request, next| {
            crate::cors::apply(origins.clone(), request, next)
        }))
    };
    routes
        .layer(axum::middleware::from_fn(limit_header_bytes))
        .with_state(state)
}

/// Total bytes of header names and values a request may carry. hyper refuses more than 100
/// headers or about 400 KiB of them (431, and 414 for a URI over 64 KiB); one header of tens
/// of kilobytes would pass it, and no client of this API needs that.
pub const HEADER_BYTES_MAX: usize = 16 << 10;

async fn limit_header_bytes(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let bytes: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if bytes > HEADER_BYTES_MAX {
        return ApiError::HeadersTooLarge {
            limit_bytes: HEADER_BYTES_MAX,
        }
        .into_response();
    }
    next.run(request).await
}

async fn chat(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    respond(state, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    respond(state, headers, body, Endpoint::Completions).await
}

async fn respond(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    match generate(&state, &headers, body, endpoint).await {
        Ok(response) => response,
        Err(error) => {
            let outcome = match error {
                ApiError::ClientGone => "cancelled",
                _ => "error",
            };
            state.metrics.inc(
                "airlock_requests_total",
                &[("outcome", outcome), ("reason", error.reason())],
            );
            error.into_response()
        }
    }
}

async fn generate(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    // Nothing runs, and the body is not read, for a caller without a valid key.
    let tenant = authenticate(state, headers)?;
    require_json(headers)?;
    let body = read_body(body, &state.config).await?;
    let limits = Limits {
        model_id: &state.config.model_id,
        tokenizer: &state.tokenizer,
        chat_template: state.chat_template.as_ref(),
        context_length: state.config.context_length,
        default_max_tokens: state.config.default_max_tokens,
    };
    let job = match endpoint {
        Endpoint::Chat => parse_chat(&body, &limits)?,
        Endpoint::Completions => parse_completion(&body, &limits)?,
    };
    admit(state, &job)?;
    let total_tokens = job.prompt.len() + job.max_tokens as usize;
    let permit = tenant.admit(total_tokens).map_err(|limit| {
        let message = match limit {
            LimitExceeded::Concurrent { limit } => {
                format!("your key may run {limit} requests at once; wait for one to finish")
            }
            LimitExceeded::QueuedTokens { limit, asked } => format!(
                "your key may hold {limit} tokens (prompt + max_tokens) in flight and this \
                 request asks for {asked} more; wait or send less"
            ),
        };
        ApiError::RateLimited { message }
    })?;
    let slot = state
        .in_flight
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::Overloaded {
            message: format!(
                "the server is at its limit of {} requests in flight; retry shortly",
                state.config.in_flight_max
            ),
        })?;
    let mut run = Run::submit(state.clone(), job, permit, slot)?;
    run.wait_started().await?;
    if run.job.stream {
        Ok(stream_response(run))
    } else {
        run.collect().await
    }
}

/// JSON endpoints take only bodies labelled JSON. A browser may send a cross-origin POST
/// without asking first only with a "simple" content type (form, text, none): refusing those
/// is what keeps a web page from running inference on a server it can reach.
fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let media_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(str::trim);
    match media_type {
        Some(media_type) if media_type.eq_ignore_ascii_case("application/json") => Ok(()),
        _ => Err(ApiError::UnsupportedMediaType),
    }
}

/// The whole body, within the size limit and the body timeout; a client that hangs up
/// mid-body is `ClientGone`, not a body too large.
async fn read_body(body: Body, config: &RouterConfig) -> Result<axum::body::Bytes, ApiError> {
    // A body declared too large is still read up to the limit before the 413: answering at
    // once would close the connection under a client still writing, which then sees a broken
    // pipe instead of the answer.
    let limit_bytes = config.body_bytes_max;
    let too_large = ApiError::BodyTooLarge { limit_bytes };
    let read = async {
        let mut bytes = Vec::new();
        let mut chunks = body.into_data_stream();
        while let Some(chunk) = futures_util::StreamExt::next(&mut chunks).await {
            let chunk = chunk.map_err(body_error)?;
            if bytes.len() + chunk.len() > limit_bytes {
                return Err(too_large.clone());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(axum::body::Bytes::from(bytes))
    };
    tokio::time::timeout(config.body_timeout, read)
        .await
        .map_err(|_| ApiError::BodyTimeout {
            timeout: config.body_timeout,
        })?
}

/// A body that failed to arrive: framed wrongly (bad chunking), or the client hung up.
fn body_error(error: axum::Error) -> ApiError {
    let hyper_error =
        std::error::Error::source(&error).and_then(|source| source.downcast_ref::<hyper::Error>());
    let io_kind = hyper_error
        .and_then(std::error::Error::source)
        .and_then(|source| source.downcast_ref::<std::io::Error>())
        .map(std::io::Error::kind);
    let malformed = hyper_error.is_some_and(hyper::Error::is_parse)
        || matches!(
            io_kind,
            Some(std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput)
        );
    if malformed {
        ApiError::InvalidRequest {
            message: format!("the request body is malformed: {error}"),
            param: None,
        }
    } else {
        ApiError::ClientGone
    }
}

fn authenticate(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Arc<crate::tenants::Tenant>, ApiError> {
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "));
    state
        .tenants
        .authenticate(key)
        .ok_or(ApiError::Unauthorized)
}

/// I3 at the router: a request that no worker could ever hold is refused here, naming the
/// numbers, before anything is sent to a worker. The workers check again.
fn admit(state: &AppState, job: &Job) -> Result<(), ApiError> {
    let prompt_tokens = job.prompt.len();
    let total = prompt_tokens + job.max_tokens as usize;
    let roles: &[(Role, usize)] = if state.cluster.has_role(Role::Unified) {
        &[(Role::Unified, total)]
    } else {
        &[(Role::Prefill, prompt_tokens - 1), (Role::Decode, total)]
    };
    for &(role, needed) in roles {
        let Some((capacity, context_length)) = state.cluster.limits(role) else {
            return Err(ApiError::NoWorkers {
                message: format!(
                    "no {} worker is connected yet; retry shortly",
                    crate::cluster::role_name(role)
                ),
            });
        };
        if total > context_length as usize {
            return Err(ApiError::ContextLengthExceeded {
                param: job
                    .endpoint
                    .param_over_limit(prompt_tokens, context_length as usize),
                message: format!(
                    "the {} workers' context length is {context_length} tokens, but you asked \
                     for {total} ({prompt_tokens} in the prompt + {} max_tokens); shorten the \
                     prompt or lower max_tokens",
                    crate::cluster::role_name(role),
                    job.max_tokens
                ),
            });
        }
        if needed as u64 > capacity {
            return Err(ApiError::ContextLengthExceeded {
                param: job
                    .endpoint
                    .param_over_limit(prompt_tokens, capacity as usize),
                message: format!(
                    "this request needs {needed} tokens of KV on a {} worker, whose whole pool \
                     holds {capacity} ({prompt_tokens} in the prompt + {} max_tokens); shorten \
                     the prompt or lower max_tokens",
                    crate::cluster::role_name(role),
                    job.max_tokens
                ),
            });
        }
    }
    Ok(())
}

/// One request in flight. Dropping it before it ended aborts it on every worker it reached.
struct Run {
    state: Arc<AppState>,
    id: RequestId,
    job: Job,
    workers: Vec<Arc<WorkerClient>>,
    rx: UnboundedReceiver<(Role, Frame)>,
    arrived: Instant,
    last_token: Option<Instant>,
    ended: bool,
    /// Counted in `waiting` until started.
    waiting: bool,
    /// Disaggregated runs: the prefill submit, sent once decode has reserved its pages.
    pending_prefill: Option<PendingPrefill>,
    /// Decode has sealed the transfer: from here on only decode decides how the request ends
    /// (a prefill that loses its link before reading decode's `Ack` is no failure).
    started: bool,
    /// Ended with `Finished`: nobody needs an abort.
    finished: bool,
    text: String,
    prompt_tokens: u32,
    completion_tokens: u32,
    _permit: TenantPermit,
    _slot: OwnedSemaphorePermit,
}

/// The prefill worker, the channel its frames go to, and the submit to send it.
type PendingPrefill = (Arc<WorkerClient>, UnboundedSender<(Role, Frame)>, Frame);

/// What the request's frames amount to, one at a time.
enum Step {
    Text(String),
    Finished(Finish),
    Failed(ApiError),
}

impl Run {
    fn submit(
        state: Arc<AppState>,
        job: Job,
        permit: TenantPermit,
        slot: OwnedSemaphorePermit,
    ) -> Result<Run, ApiError> {
        let id = RequestId(state.next_request.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = unbounded_channel();
        let tenant = permit.tenant().id;
        let submit = |plan| Submit {
            request: id,
            tenant,
            prompt: job.prompt.clone(),
            max_tokens: job.max_tokens,
            sampling: job.sampling.clone(),
            stop: job.stop.clone(),
            ignore_eos: job.ignore_eos,
            plan,
        };
        let no_worker = |role| ApiError::NoWorkers {
            message: format!(
                "no {} worker is available; retry shortly",
                crate::cluster::role_name(role)
            ),
        };
        state.waiting.fetch_add(1, Ordering::Relaxed);
        let mut run = Run {
            state: state.clone(),
            id,
            job: job.clone(),
            workers: Vec::new(),
            rx,
            arrived: Instant::now(),
            last_token: None,
            ended: false,
            waiting: true,
            pending_prefill: None,
            started: false,
            finished: false,
            text: String::new(),
            prompt_tokens: job.prompt.len() as u32,
            completion_tokens: 0,
            _permit: permit,
            _slot: slot,
        };
        if state.cluster.has_role(Role::Unified) {
            let worker = state
                .cluster
                .pick(Role::Unified)
                .ok_or(no_worker(Role::Unified))?;
            if !worker.submit(id, tx, Frame::Submit(submit(Plan::Unified))) {
                return Err(no_worker(Role::Unified));
            }
            run.workers.push(worker);
            return Ok(run);
        }
        let decode = state
            .cluster
            .pick(Role::Decode)
            .ok_or(no_worker(Role::Decode))?;
        let prefill = state
            .cluster
            .pick(Role::Prefill)
            .ok_or(no_worker(Role::Prefill))?;
        let transfer = TransferId(state.transfer_salt | id.0);
        if !decode.submit(
            id,
            tx.clone(),
            Frame::Submit(submit(Plan::Decode { transfer })),
        ) {
            return Err(no_worker(Role::Decode));
        }
        run.workers.push(decode.clone());
        // The prefill worker is told only once decode has reserved pages (its `Admitted`),
        // so no page can arrive before there is somewhere verified to put it.
        run.pending_prefill = Some((
            prefill,
            tx,
            Frame::Submit(submit(Plan::Prefill {
                transfer,
                decode_addr: decode.addr.clone(),
            })),
        ));
        Ok(run)
    }

    /// Waits until decode has sealed a verified transfer (or unified has prefilled): only
    /// then may a 200 go out.
    async fn wait_started(&mut self) -> Result<(), ApiError> {
        let deadline = tokio::time::Instant::now() + self.state.config.start_timeout;
        loop {
            let (_, frame) = match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(frame)) => frame,
                Ok(None) => return Err(ApiError::Internal),
                Err(_) => {
                    return Err(ApiError::Timeout {
                        message: format!(
                            "no answer from the workers within {:?}; retry later",
                            self.state.config.start_timeout
                        ),
                    })
                }
            };
            match frame {
                Frame::Admitted { .. } => {
                    if let Some((prefill, tx, submit)) = self.pending_prefill.take() {
                        if !prefill.submit(self.id, tx, submit) {
                            return Err(ApiError::NoWorkers {
                                message: "the prefill worker went away; retry".into(),
                            });
                        }
                        self.workers.push(prefill);
                    }
                }
                Frame::Started { .. } => {
                    self.started = true;
                    self.stop_waiting();
                    if self.pending_prefill.is_none() && self.workers.len() == 2 {
                        self.state.metrics.inc(
                            "airlock_transfers_total",
                            &[("outcome", "ok"), ("reason", "sealed")],
                        );
                    }
                    return Ok(());
                }
                Frame::Failed {
                    failure, message, ..
                } => {
                    self.ended = true;
                    let error = ApiError::from_failure(failure, message);
                    self.count_transfer_failure(&error);
                    return Err(error);
                }
                _ => {}
            }
        }
    }

    fn stop_waiting(&mut self) {
        if std::mem::take(&mut self.waiting) {
            self.state.waiting.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn count_transfer_failure(&self, error: &ApiError) {
        if self.workers.len() == 2
            && matches!(
                error,
                ApiError::TransferFailed { .. } | ApiError::Timeout { .. }
            )
        {
            self.state.metrics.inc(
                "airlock_transfers_total",
                &[("outcome", "failed"), ("reason", error.code())],
            );
        }
    }

    /// The next thing the client should hear.
    async fn next(&mut self) -> Step {
        loop {
            let Some((role, frame)) = self.rx.recv().await else {
                self.ended = true;
                return Step::Failed(ApiError::Internal);
            };
            if self.started && role == Role::Prefill {
                continue;
            }
            match frame {
                Frame::Text {
                    text, token_count, ..
                } => {
                    let now = Instant::now();
                    match self.last_token {
                        None => self
                            .state
                            .metrics
                            .observe_ttft((now - self.arrived).as_secs_f64()),
                        Some(last) => self.state.metrics.observe_itl((now - last).as_secs_f64()),
                    }
                    self.last_token = Some(now);
                    self.completion_tokens += token_count;
                    return Step::Text(text);
                }
                Frame::Finished {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                } => {
                    self.ended = true;
                    self.finished = true;
                    self.prompt_tokens = prompt_tokens;
                    self.completion_tokens = completion_tokens;
                    let reason = finish_reason(finish);
                    self.state.metrics.inc(
                        "airlock_requests_total",
                        &[("outcome", "ok"), ("reason", reason)],
                    );
                    return Step::Finished(finish);
                }
                Frame::Failed {
                    failure, message, ..
                } => {
                    self.ended = true;
                    let error = ApiError::from_failure(failure, message);
                    self.state.metrics.inc(
                        "airlock_requests_total",
                        &[("outcome", "error"), ("reason", error.reason())],
                    );
                    return Step::Failed(error);
                }
                _ => {}
            }
        }
    }

    /// Non-streaming: the whole answer, or the error (nothing was sent yet, so the error
    /// gets its own status).
    async fn collect(mut self) -> Result<Response, ApiError> {
        loop {
            match self.next().await {
                Step::Text(text) => self.text.push_str(&text),
                Step::Failed(error) => return Err(error),
                Step::Finished(finish) => {
                    let body = full_body(&self, finish);
                    return Ok((StatusCode::OK, Json(body)).into_response());
                }
            }
        }
    }

    fn usage(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.stop_waiting();
        if self.finished {
            for worker in &self.workers {
                worker.forget(self.id);
            }
            return;
        }
        if self.ended {
            // One worker failed the request; the others may still hold pages for it (a decode
            // reservation waiting for a transfer that will never come): end it there too.
            for worker in &self.workers {
                worker.send(Frame::Abort { request: self.id });
                worker.forget(self.id);
            }
            return;
        }
        // The client is gone (or we gave up) before the end: abort through the protocol. The
        // workers release their pages once it is safe; nothing here touches them.
        tracing::debug!(request = self.id.0, "aborting request");
        self.state.metrics.inc(
            "airlock_requests_total",
            &[("outcome", "cancelled"), ("reason", "client_gone")],
        );
        for worker in &self.workers {
            worker.send(Frame::Abort { request: self.id });
            worker.forget(self.id);
        }
    }
}

fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn response_id(run: &Run) -> String {
    let prefix = match run.job.endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    format!("{prefix}-{:016x}", run.state.transfer_salt | run.id.0)
}

fn full_body(run: &Run, finish: Finish) -> serde_json::Value {
    let model = &run.state.config.model_id;
    let reason = finish_reason(finish);
    match run.job.endpoint {
        Endpoint::Chat => serde_json::json!({
            "id": response_id(run),
            "object": "chat.completion",
            "created": created(),
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": run.text},
                "logprobs": null,
                "finish_reason": reason,
            }],
            "usage": run.usage(),
        }),
        Endpoint::Completions => serde_json::json!({
            "id": response_id(run),
            "object": "text_completion",
            "created": created(),
            "model": model,
            "choices": [{
                "index": 0,
                "text": run.text,
                "logprobs": null,
                "finish_reason": reason,
            }],
            "usage": run.usage(),
        }),
    }
}

/// One streamed chunk: `delta` text, or the final chunk with `finish`.
fn chunk(run: &Run, text: Option<&str>, finish: Option<Finish>, first: bool) -> serde_json::Value {
    let reason = finish.map(finish_reason);
    let model = &run.state.config.model_id;
    match run.job.endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(text) = text {
                delta.insert("content".into(), text.into());
            }
            serde_json::json!({
                "id": response_id(run),
                "object": "chat.completion.chunk",
                "created": created(),
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason}],
            })
        }
        Endpoint::Completions => serde_json::json!({
            "id": response_id(run),
            "object": "text_completion",
            "created": created(),
            "model": model,
            "choices": [{
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": reason,
            }],
        }),
    }
}

struct StreamState {
    run: Run,
    queued: VecDeque<SseEvent>,
    first: bool,
    done: bool,
}

fn stream_response(run: Run) -> Response {
    let state = StreamState {
        run,
        queued: VecDeque::new(),
        first: true,
        done: false,
    };
    Sse::new(sse_events(state)).into_response()
}

fn data(value: &serde_json::Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

fn sse_events(state: StreamState) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.queued.pop_front() {
                return Some((Ok(event), state));
            }
            if state.done {
                // Dropping the state here drops the run, which has ended: no abort.
                return None;
            }
            if state.first {
                state.first = false;
                let opening = chunk(&state.run, Some(""), None, true);
                state.queued.push_back(data(&opening));
                continue;
            }
            match state.run.next().await {
                Step::Text(text) => {
                    let piece = chunk(&state.run, Some(&text), None, false);
                    state.queued.push_back(data(&piece));
                }
                Step::Finished(finish) => {
                    state.done = true;
                    let last = chunk(&state.run, None, Some(finish), false);
                    state.queued.push_back(data(&last));
                    if state.run.job.include_usage {
                        let mut usage = chunk(&state.run, None, None, false);
                        usage["choices"] = serde_json::json!([]);
                        usage["usage"] = state.run.usage();
                        state.queued.push_back(data(&usage));
                    }
                    state.queued.push_back(SseEvent::default().data("[DONE]"));
                }
                Step::Failed(error) => {
                    // Headers are out: the failure is an `error` event, and no [DONE].
                    state.done = true;
                    let event = SseEvent::default()
                        .event("error")
                        .data(error.body().to_string());
                    state.queued.push_back(event);
                }
            }
        }
    })
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        return error.into_response();
    }
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": state.config.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "airlock",
        }],
    }))
    .into_response()
}

/// `/health`: up or degraded for anyone; the workers' addresses, pools and shape only for a
/// caller with a valid key (in single-tenant mode, every caller).
async fn health(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if authenticate(&state, &headers).is_err() {
        let (status, word) = readiness(&state);
        return (status, Json(serde_json::json!({ "status": word }))).into_response();
    }
    let workers: Vec<serde_json::Value> = state
        .cluster
        .clients
        .iter()
        .map(|client| {
            let info = client.info();
            serde_json::json!({
                "address": client.addr,
                "role": crate::cluster::role_name(client.role),
                "up": client.is_up(),
                "refused": client.refused(),
                "weight_bytes": info.as_ref().map(|i| i.weight_bytes),
                "kv_bytes": info.as_ref().map(|i| i.kv_bytes),
                "name": info.as_ref().map(|i| i.name.clone()),
                "capacity_tokens": info.as_ref().map(|i| i.capacity_tokens),
                "context_length": info.as_ref().map(|i| i.context_length),
                "page_size_tokens": info.as_ref().map(|i| i.page_size_tokens),
            })
        })
        .collect();
    let (status, word) = readiness(&state);
    let body = serde_json::json!({
        "status": word,
        "model": state.config.model_id,
        "context_length": state.config.context_length,
        "workers": workers,
    });
    (status, Json(body)).into_response()
}

/// 200 "ok" when every worker is linked, else 503 "degraded".
fn readiness(state: &AppState) -> (StatusCode, &'static str) {
    if state.cluster.clients.iter().all(|c| c.is_up()) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "degraded")
    }
}

/// Liveness: the process answers HTTP. Says nothing else, to anyone.
async fn live() -> Response {
    Json(serde_json::json!({ "status": "ok" })).into_response()
}

/// Readiness: every worker linked. Says nothing else, to anyone.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let (status, word) = readiness(&state);
    (status, Json(serde_json::json!({ "status": word }))).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(
        &state.cluster.gauges(),
        state.waiting.load(Ordering::Relaxed),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
