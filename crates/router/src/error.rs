//! Every error a client can get, and the one table that maps each to its HTTP status and
//! OpenAI error `type` and `code`. Messages say what to do; they never carry prompt text,
//! keys or KV contents (internals are logged, not sent).

use crate::responses::{ErrorBody, ErrorDetail};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::borrow::Cow;
use transfer::Failure;

#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// 400: the request is malformed or asks for something we do not do.
    InvalidRequest {
        message: String,
        /// The field at fault, as a dotted path for nested ones (`messages[1].content`).
        param: Option<Cow<'static, str>>,
    },
    /// 400: prompt + max_tokens over the context length or a worker's whole pool.
    /// `param` names what to change: the prompt (`messages` or `prompt`) when it alone is too
    /// long, else `max_tokens`.
    ContextLengthExceeded {
        message: String,
        param: &'static str,
    },
    /// 401
    Unauthorized,
    /// 404: the model named is not the one served.
    ModelNotFound { model: String, served: String },
    /// 404: no such path.
    NotFound,
    /// 405
    MethodNotAllowed,
    /// 413
    BodyTooLarge { limit_bytes: usize },
    /// 408: the request body did not arrive within the body timeout.
    BodyTimeout { timeout: std::time::Duration },
    /// 415: a JSON endpoint got a body that does not say it is JSON.
    UnsupportedMediaType,
    /// 431: the request's headers are over the size limit.
    HeadersTooLarge { limit_bytes: usize },
    /// 429: the tenant is over one of its limits.
    RateLimited { message: String },
    /// 503: the server or a worker queue is full, or a wait for pages timed out.
    Overloaded { message: String },
    /// 503: no worker of a needed role is connected.
    NoWorkers { message: String },
    /// 503: a KV transfer failed verification or its link broke (retryable, TEST-MATRIX).
    TransferFailed { message: String },
    /// 504: a transfer or the first token took too long.
    Timeout { message: String },
    /// 499 (client closed): only ever logged and counted, the client is gone.
    Cancelled,
    /// 499: the client hung up before its request body was complete; counted, never sent.
    ClientGone,
    /// 500
    Internal,
}

/// One row of the table: status, OpenAI `type`, `code`.
struct Row {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
}

impl ApiError {
    fn row(&self) -> Row {
        let (status, kind, code) = match self {
            ApiError::InvalidRequest { .. } => (400, "invalid_request_error", "invalid_request"),
            ApiError::ContextLengthExceeded { .. } => {
                (400, "invalid_request_error", "context_length_exceeded")
            }
            ApiError::Unauthorized => (401, "authentication_error", "invalid_api_key"),
            ApiError::ModelNotFound { .. } => (404, "invalid_request_error", "model_not_found"),
            ApiError::NotFound => (404, "invalid_request_error", "not_found"),
            ApiError::MethodNotAllowed => (405, "invalid_request_error", "method_not_allowed"),
            ApiError::BodyTooLarge { .. } => (413, "invalid_request_error", "request_too_large"),
            ApiError::BodyTimeout { .. } => (408, "invalid_request_error", "request_timeout"),
            ApiError::UnsupportedMediaType => {
                (415, "invalid_request_error", "unsupported_media_type")
            }
            ApiError::HeadersTooLarge { .. } => (
                431,
                "invalid_request_error",
                "request_header_fields_too_large",
            ),
            ApiError::RateLimited { .. } => (429, "rate_limit_error", "rate_limit_exceeded"),
            ApiError::Overloaded { .. } => (503, "server_error", "overloaded"),
            ApiError::NoWorkers { .. } => (503, "server_error", "no_workers"),
            ApiError::TransferFailed { .. } => (503, "server_error", "kv_transfer_failed"),
            ApiError::Timeout { .. } => (504, "server_error", "timeout"),
            ApiError::Cancelled => (499, "server_error", "request_cancelled"),
            ApiError::ClientGone => (499, "invalid_request_error", "client_gone"),
            ApiError::Internal => (500, "server_error", "internal_error"),
        };
        Row {
            status: StatusCode::from_u16(status).expect("table statuses are valid"),
            kind,
            code,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.row().status
    }

    pub fn code(&self) -> &'static str {
        self.row().code
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::InvalidRequest { message, .. }
            | ApiError::ContextLengthExceeded { message, .. }
            | ApiError::RateLimited { message }
            | ApiError::Overloaded { message }
            | ApiError::NoWorkers { message }
            | ApiError::TransferFailed { message }
            | ApiError::Timeout { message } => message.clone(),
            ApiError::Unauthorized => "missing or invalid API key; send it as \
                 'Authorization: Bearer <key>'"
                .into(),
            ApiError::ModelNotFound { model, served } => {
                format!("model '{model}' is not served here; use '{served}' (see GET /v1/models)")
            }
            ApiError::NotFound => "no such endpoint; see /v1/chat/completions, \
                 /v1/completions, /v1/models, /health, /metrics"
                .into(),
            ApiError::MethodNotAllowed => "method not allowed on this endpoint".into(),
            ApiError::BodyTooLarge { limit_bytes } => {
                format!("request body is over the {limit_bytes}-byte limit; send a smaller one")
            }
            ApiError::BodyTimeout { timeout } => format!(
                "the request body did not arrive within {} s; send it at once",
                timeout.as_secs_f64()
            ),
            ApiError::UnsupportedMediaType => {
                "send the body as JSON with 'Content-Type: application/json'".into()
            }
            ApiError::HeadersTooLarge { limit_bytes } => format!(
                "request headers are over the {limit_bytes}-byte limit; send fewer or shorter \
                 headers"
            ),
            ApiError::Cancelled => "the request was cancelled".into(),
            ApiError::ClientGone => "the client closed the connection mid-request".into(),
            ApiError::Internal => "internal error; the request was not answered".into(),
        }
    }

    /// The OpenAI error object: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> ErrorBody {
        let row = self.row();
        let param = match self {
            ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ContextLengthExceeded { param, .. } => Some(Cow::Borrowed(*param)),
            ApiError::ModelNotFound { .. } => Some(Cow::Borrowed("model")),
            _ => None,
        };
        ErrorBody {
            error: ErrorDetail {
                code: row.code,
                message: self.message(),
                param,
                kind: row.kind,
            },
        }
    }

    /// [`ApiError::body`] as JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.body()).expect("an error body always serializes")
    }

    /// Short label for metrics.
    pub fn reason(&self) -> &'static str {
        self.code()
    }

    /// How a worker's failure reaches the client.
    pub fn from_failure(failure: Failure, message: String) -> ApiError {
        match failure {
            Failure::ContextLengthExceeded | Failure::PoolTooSmall => {
                ApiError::ContextLengthExceeded {
                    message,
                    param: "max_tokens",
                }
            }
            Failure::BadRequest => ApiError::InvalidRequest {
                message,
                param: None,
            },
            Failure::QueueTimeout | Failure::Overloaded => ApiError::Overloaded { message },
            Failure::TransferFailed | Failure::PeerUnavailable => {
                ApiError::TransferFailed { message }
            }
            Failure::TransferTimeout => ApiError::Timeout { message },
            Failure::Aborted => ApiError::Cancelled,
            Failure::Internal => ApiError::Internal,
        }
    }

    pub fn invalid(message: impl Into<String>, param: impl Into<Cow<'static, str>>) -> ApiError {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        match self {
            ApiError::RateLimited { .. } | ApiError::Overloaded { .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ApiError::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        response
    }
}
