//! The router's shared state and its HTTP routes: which handler answers which method and
//! path (`routes.rs` holds the handlers), and the layers around them.
//!
//! [`routes`] is the one list `app` serves; the OpenAPI document (`openapi.rs`) is
//! tested against it, so a route cannot be added without being documented.

use crate::cluster::Cluster;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::tenants::Tenants;
use axum::handler::Handler;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter};
use gguf::{ChatTemplate, Tokenizer};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::Semaphore;

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
    /// Sampling settings for a request that leaves them out.
    pub sampling_defaults: crate::openai::SamplingDefaults,
    /// Requests admitted and not yet finished, over all tenants; more get 503.
    pub in_flight_max: usize,
    /// How long a request may wait for its first answer from the workers (504 past it).
    pub start_timeout: Duration,
    /// How long an authenticated request's body may take to arrive (408 past it).
    pub body_timeout: Duration,
    /// Origins a browser may call from (CORS); empty: no `Access-Control-Allow-*` header is
    /// ever sent. `*` allows any origin.
    pub cors_allow_origins: Vec<String>,
    /// Whether workers may reuse cached prompt pages at all (each tenant's `prefix_cache`
    /// in the keys file can still turn it off for that tenant).
    pub prefix_cache: bool,
    /// How many more times a request that failed on a worker's transport (lost link, failed
    /// transfer) before anything of its answer was sent is tried on other workers.
    pub retries: u32,
}

/// Everything the handlers share.
pub struct AppState {
    pub config: RouterConfig,
    pub tenants: Tenants,
    pub cluster: Cluster,
    pub metrics: Arc<Metrics>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) chat_template: Option<ChatTemplate>,
    /// The model's tokens for structured output (`None`: the grammar engine refused them).
    pub(crate) vocabulary: Option<grammar::Vocabulary>,
    pub(crate) in_flight: Arc<Semaphore>,
    /// Requests submitted to the workers and not yet started (a metrics gauge).
    pub(crate) waiting: AtomicUsize,
    pub(crate) next_request: AtomicU64,
    /// High bits of every transfer id: a restarted router never reuses an earlier one's ids.
    pub(crate) transfer_salt: u64,
    /// The OpenAPI document served at `/openapi.json`, with this deployment's model and
    /// limits in it; built once.
    pub(crate) openapi_json: String,
    /// Set when the process is told to stop: readiness answers 503 `draining` from then on,
    /// so a load balancer sends nothing new while the requests in progress finish.
    pub draining: AtomicBool,
    /// Where each request's span goes (off unless `--otlp-endpoint` is given).
    pub tracer: otlp::Tracer,
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
            openapi_json: crate::openapi::document_json(&config, tokenizer.vocab_size()),
            config,
            tenants,
            cluster,
            metrics,
            vocabulary: grammar::Vocabulary::new(&tokenizer)
                .inspect_err(|error| {
                    tracing::warn!(%error, "structured output is off: JSON response_format \
                        requests get 400");
                })
                .ok(),
            tokenizer,
            chat_template,
            waiting: AtomicUsize::new(0),
            next_request: AtomicU64::new(1),
            transfer_salt: salt << 32,
            draining: AtomicBool::new(false),
            tracer: otlp::Tracer::off(),
        }
    }
}

/// One route: the method and path it answers, and its handler.
pub(crate) struct Route {
    // Read by the OpenAPI document's test, which checks every route is described.
    #[allow(dead_code)]
    pub method: Method,
    pub path: &'static str,
    handler: MethodRouter<Arc<AppState>>,
}

impl Route {
    fn new<H, T>(method: Method, path: &'static str, handler: H) -> Route
    where
        H: Handler<T, Arc<AppState>>,
        T: 'static,
    {
        let filter = MethodFilter::try_from(method.clone()).expect("GET and POST are filters");
        Route {
            method,
            path,
            handler: axum::routing::on(filter, handler),
        }
    }
}

/// Every route `app` serves, and nothing else.
pub(crate) fn routes() -> Vec<Route> {
    use crate::routes::{chat, completions, detokenize, health, live, metrics, models};
    use crate::routes::{openapi, ready, tokenize, tokenizer_info};
    vec![
        Route::new(Method::POST, "/v1/chat/completions", chat),
        Route::new(Method::POST, "/v1/completions", completions),
        Route::new(Method::GET, "/v1/models", models),
        Route::new(Method::POST, "/tokenize", tokenize),
        Route::new(Method::POST, "/detokenize", detokenize),
        Route::new(Method::GET, "/tokenizer_info", tokenizer_info),
        Route::new(Method::GET, "/health", health),
        Route::new(Method::GET, "/health/live", live),
        Route::new(Method::GET, "/health/ready", ready),
        Route::new(Method::GET, "/metrics", metrics),
        Route::new(Method::GET, "/openapi.json", openapi),
    ]
}

/// The HTTP routes over `state`.
pub fn app(state: Arc<AppState>) -> axum::Router {
    let routes = routes()
        .into_iter()
        .fold(axum::Router::new(), |router, route| {
            router.route(route.path, route.handler)
        })
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
