//! What a request must pass before anything is sent to a worker: its key, its media type,
//! its body within the size and time limits, and (I3) a size that some worker can hold.

use crate::error::ApiError;
use crate::openai::Job;
use crate::server::{AppState, RouterConfig};
use crate::tenants::{LimitExceeded, Tenant};
use axum::body::Body;
use axum::http::{header, HeaderMap};
use std::sync::Arc;
use transfer::Role;

/// JSON endpoints take only bodies labelled JSON. A browser may send a cross-origin POST
/// without asking first only with a "simple" content type (form, text, none): refusing those
/// is what keeps a web page from running inference on a server it can reach.
pub(crate) fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
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
pub(crate) async fn read_body(
    body: Body,
    config: &RouterConfig,
) -> Result<axum::body::Bytes, ApiError> {
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

pub(crate) fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
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
pub(crate) fn admit(state: &AppState, job: &Job) -> Result<(), ApiError> {
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

/// The 429 for a tenant over one of its limits, saying which.
pub(crate) fn rate_limited(limit: LimitExceeded) -> ApiError {
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
}
