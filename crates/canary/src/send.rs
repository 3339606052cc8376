//! Sending one request and reading its answer, with every byte from the server treated as
//! hostile: capped, timed out, parsed leniently.

use crate::plan::Endpoint;
use crate::plan::Plan;
use crate::plan::Setup;
use crate::BODY_CAP;
use futures_util::StreamExt;
use std::time::Instant;

/// What came back for one request.
pub(crate) struct Outcome {
    /// HTTP status, or the transport error that stopped the request before one came.
    pub(crate) status: std::result::Result<u16, String>,
    /// The body as text, up to BODY_CAP.
    pub(crate) body: String,
    /// Text a client would show: completion text, chat content (whole, or SSE deltas joined
    /// in order, so a marker split over chunks is whole), error messages.
    pub(crate) text: String,
    /// The body stopped early: over BODY_CAP, or the connection broke or timed out mid-body.
    pub(crate) cut_short: Option<String>,
    /// A 200 stream ended with an `error` event.
    pub(crate) stream_error: bool,
    pub(crate) server_id: Option<String>,
    pub(crate) prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the server reused.
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) seconds: f64,
}

pub(crate) async fn send(setup: &Setup, plan: &Plan) -> Outcome {
    let started = Instant::now();
    let mut request = setup
        .client
        .post(format!("{}{}", setup.url, plan.endpoint.path()))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(plan.body.clone());
    if let Some(key) = &setup.tenants[plan.tenant].key {
        request = request.bearer_auth(key);
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            return Outcome {
                status: Err(transport_error(&error)),
                body: String::new(),
                text: String::new(),
                cut_short: None,
                stream_error: false,
                server_id: None,
                prompt_tokens: None,
                cached_tokens: None,
                seconds: started.elapsed().as_secs_f64(),
            }
        }
    };
    let status = response.status().as_u16();
    let (bytes, cut_short) = read_capped(response, BODY_CAP).await;
    let body = String::from_utf8_lossy(&bytes).into_owned();
    let parsed = parse_body(&body);
    Outcome {
        status: Ok(status),
        text: parsed.text,
        cut_short,
        stream_error: parsed.error_event,
        server_id: parsed.id,
        prompt_tokens: parsed.prompt_tokens,
        cached_tokens: parsed.cached_tokens,
        body,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// A streamed request timed to its first token (the timing audit).
pub(crate) struct Timed {
    pub(crate) status: std::result::Result<u16, String>,
    /// Seconds from sending to the first event that carries text or a finish reason.
    pub(crate) first_token: Option<f64>,
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) body: String,
}

/// Sends `body` (a streamed request) as `tenant` and times its first token, then reads the
/// rest (up to BODY_CAP) for its usage.
pub(crate) async fn send_timed(setup: &Setup, tenant: usize, body: Vec<u8>) -> Timed {
    let mut request = setup
        .client
        .post(format!("{}{}", setup.url, Endpoint::Completions.path()))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(key) = &setup.tenants[tenant].key {
        request = request.bearer_auth(key);
    }
    let started = Instant::now();
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => {
            return Timed {
                status: Err(transport_error(&error)),
                first_token: None,
                cached_tokens: None,
                body: String::new(),
            }
        }
    };
    let status = response.status().as_u16();
    let mut stream = response.bytes_stream();
    let (mut bytes, mut scanned, mut first_token) = (Vec::new(), 0, None);
    while let Some(Ok(chunk)) = stream.next().await {
        bytes.extend_from_slice(&chunk[..chunk.len().min(BODY_CAP - bytes.len())]);
        // Whole lines only: an event split over chunks is judged once it is complete.
        while let Some(end) = bytes[scanned..].iter().position(|&b| b == b'\n') {
            let line = String::from_utf8_lossy(&bytes[scanned..scanned + end]).into_owned();
            scanned += end + 1;
            if first_token.is_none() && carries_token(&line) {
                first_token = Some(started.elapsed().as_secs_f64());
            }
        }
        if bytes.len() >= BODY_CAP {
            break;
        }
    }
    let body = String::from_utf8_lossy(&bytes).into_owned();
    Timed {
        status: Ok(status),
        first_token,
        cached_tokens: parse_body(&body).cached_tokens,
        body,
    }
}

/// An SSE `data:` line whose chunk carries generated text or a finish reason: the first
/// such is the first token. The opening chunk (empty text, or only the role) is not.
pub(crate) fn carries_token(line: &str) -> bool {
    let Some(data) = line.trim_end_matches('\r').strip_prefix("data:") else {
        return false;
    };
    let Ok(value) = serde_json::from_str::<serde_json::Value>(data.trim_start()) else {
        return false;
    };
    let mut choices = value["choices"].as_array().into_iter().flatten();
    choices.any(|choice| {
        let text = [&choice["text"], &choice["delta"]["content"]]
            .iter()
            .any(|text| text.as_str().is_some_and(|t| !t.is_empty()));
        text || !choice["finish_reason"].is_null()
    })
}

/// A transport error in one line, with its kind first (timeouts are common and expected).
pub(crate) fn transport_error(error: &reqwest::Error) -> String {
    let kind = if error.is_timeout() {
        "timeout"
    } else if error.is_connect() {
        "connect"
    } else {
        "transport"
    };
    let mut text = format!("{kind}: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// The body, chunk by chunk, up to `cap` bytes: more is not read (the connection is dropped).
/// A body that stops early says why, and what came so far is still scanned.
pub(crate) async fn read_capped(
    response: reqwest::Response,
    cap: usize,
) -> (Vec<u8>, Option<String>) {
    let mut stream = response.bytes_stream();
    let mut body = Vec::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => {
                let room = cap - body.len();
                body.extend_from_slice(&bytes[..bytes.len().min(room)]);
                if bytes.len() > room {
                    return (body, Some(format!("body over {cap} bytes, cut")));
                }
            }
            Err(error) => return (body, Some(transport_error(&error))),
        }
    }
    (body, None)
}

/// What `parse_body` finds in a JSON body or an SSE stream.
#[derive(Default)]
pub(crate) struct Parsed {
    pub(crate) text: String,
    pub(crate) id: Option<String>,
    pub(crate) prompt_tokens: Option<u64>,
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) error_event: bool,
}

/// A whole JSON body, or else an SSE stream of `data:` lines (each parsed alone; lines that
/// are not JSON are skipped: the raw body is scanned as well).
pub(crate) fn parse_body(body: &str) -> Parsed {
    let mut parsed = Parsed::default();
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(body) {
        collect(&value, &mut parsed);
        return parsed;
    }
    for line in body.lines() {
        let line = line.trim_end_matches('\r');
        if line.strip_prefix("event:").map(str::trim) == Some("error") {
            parsed.error_event = true;
        }
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(data.trim_start()) {
            collect(&value, &mut parsed);
        }
    }
    parsed
}

/// The text fields of one OpenAI response object or chunk, appended in order.
pub(crate) fn collect(value: &serde_json::Value, parsed: &mut Parsed) {
    if parsed.id.is_none() {
        parsed.id = value["id"].as_str().map(|id| clip(id, 64));
    }
    if let Some(tokens) = value["usage"]["prompt_tokens"].as_u64() {
        parsed.prompt_tokens = Some(tokens);
    }
    if let Some(tokens) = value["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
        parsed.cached_tokens = Some(tokens);
    }
    if let Some(choices) = value["choices"].as_array() {
        for choice in choices {
            for text in [
                &choice["text"],
                &choice["message"]["content"],
                &choice["delta"]["content"],
            ] {
                if let Some(text) = text.as_str() {
                    parsed.text.push_str(text);
                }
            }
        }
    }
    for message in [
        &value["error"]["message"],
        &value["error"],
        &value["message"],
    ] {
        if let Some(message) = message.as_str() {
            parsed.text.push('\n');
            parsed.text.push_str(message);
        }
    }
}

/// At most `max` characters of `text`, control characters as spaces: safe to print.
pub(crate) fn clip(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}
