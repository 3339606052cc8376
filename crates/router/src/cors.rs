//! CORS, only where the operator named origins (`--cors-allow-origin`). Off by default: no
//! `Access-Control-Allow-*` header is ever sent, so a browser page from another origin can
//! read no answer, and (with JSON required, `server::require_json`) cannot send a request
//! that runs without a preflight either.

use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// How long a browser may cache a preflight's answer, in seconds.
const PREFLIGHT_MAX_AGE_SECONDS: &str = "600";

/// Answers preflights from allowed origins, and marks their responses readable.
pub async fn apply(origins: Arc<Vec<String>>, request: Request, next: Next) -> Response {
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|value| value.to_str().ok())
        .filter(|origin| allowed(&origins, origin))
        .map(str::to_owned);
    let Some(origin) = origin else {
        return next.run(request).await;
    };
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    let allow_origin = if origins.iter().any(|o| o == "*") {
        HeaderValue::from_static("*")
    } else {
        HeaderValue::from_str(&origin).expect("a header value read from the request")
    };
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin);
    headers.insert(header::VARY, HeaderValue::from_static("origin"));
    if preflight {
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        headers.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(PREFLIGHT_MAX_AGE_SECONDS),
        );
    }
    response
}

fn allowed(origins: &[String], origin: &str) -> bool {
    origins
        .iter()
        .any(|allowed| allowed == "*" || allowed == origin)
}
