//! The exporter: spans batched into OTLP/HTTP JSON requests.

use crate::{hex, Span, SpanKind, Value};
use serde_json::{json, Value as Json};
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Spans sent in one request at most.
const BATCH_SPANS: usize = 512;
/// How long a span may wait for its batch.
const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// How long one export may take, connect to answer.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of an answer read (its status line is all that counts).
const ANSWER_BYTES_MAX: usize = 4096;

/// An OTLP/HTTP collector: `http://HOST:PORT[/PREFIX]`; spans go to `PREFIX/v1/traces`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    authority: String,
    path: String,
}

impl Endpoint {
    /// Parses `http://HOST:PORT[/PREFIX]`, saying what is wrong otherwise.
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let Some(rest) = url.strip_prefix("http://") else {
            return Err(format!(
                "{url}: the OTLP endpoint must be http://HOST:PORT (OTLP/HTTP; for TLS, run \
                 a collector beside the server and point this at it)"
            ));
        };
        let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let port_ok = authority
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok || authority.chars().any(|c| c.is_whitespace() || c == '@') {
            return Err(format!(
                "{url}: expected http://HOST:PORT, e.g. http://127.0.0.1:4318"
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        let path = match prefix {
            "" => "/v1/traces".to_string(),
            prefix => format!("/{prefix}/v1/traces"),
        };
        Ok(Endpoint {
            authority: authority.to_string(),
            path,
        })
    }
}

/// The resource every span of this process belongs to.
pub(crate) fn resource(service: &str, instance: &str) -> Json {
    json!({
        "attributes": [
            attribute("service.name", &Value::Str(service.to_string())),
            attribute("service.instance.id", &Value::Str(instance.to_string())),
        ]
    })
}

/// Batches spans from `spans` and posts them until every sender is gone (then flushes).
pub(crate) async fn run(mut spans: mpsc::Receiver<Span>, endpoint: Endpoint, resource: Json) {
    let mut batch = Vec::new();
    let mut failing = false;
    loop {
        let deadline = tokio::time::Instant::now() + FLUSH_EVERY;
        let open = loop {
            match tokio::time::timeout_at(deadline, spans.recv()).await {
                Ok(Some(span)) => {
                    batch.push(span);
                    if batch.len() >= BATCH_SPANS {
                        break true;
                    }
                }
                Ok(None) => break false,
                Err(_) => break true,
            }
        };
        if !batch.is_empty() {
            let body = encode(&resource, &batch).to_string();
            match tokio::time::timeout(EXPORT_TIMEOUT, post(&endpoint, &body)).await {
                Ok(Ok(())) => failing = false,
                Ok(Err(error)) if !failing => {
                    failing = true;
                    tracing::warn!(%error, spans = batch.len(), "OTLP export failed; spans dropped");
                }
                Err(_) if !failing => {
                    failing = true;
                    tracing::warn!(spans = batch.len(), "OTLP export timed out; spans dropped");
                }
                _ => {}
            }
            batch.clear();
        }
        if !open {
            return;
        }
    }
}

/// One HTTP/1.1 POST of `body`; an error unless the collector answers 2xx.
async fn post(endpoint: &Endpoint, body: &str) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(&endpoint.authority).await?;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        endpoint.path,
        endpoint.authority,
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut answer = Vec::new();
    let mut chunk = [0; 512];
    while !answer.contains(&b'\n') && answer.len() < ANSWER_BYTES_MAX {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..n]);
    }
    let status_line = String::from_utf8_lossy(&answer);
    let status = status_line.split_whitespace().nth(1).unwrap_or("none");
    match status.starts_with('2') {
        true => Ok(()),
        false => Err(std::io::Error::other(format!(
            "collector answered {status}"
        ))),
    }
}

/// The OTLP JSON body (`ExportTraceServiceRequest`) of `spans`.
pub(crate) fn encode(resource: &Json, spans: &[Span]) -> Json {
    let spans: Vec<Json> = spans.iter().map(span_json).collect();
    json!({
        "resourceSpans": [{
            "resource": resource,
            "scopeSpans": [{
                "scope": { "name": "airlock", "version": env!("CARGO_PKG_VERSION") },
                "spans": spans,
            }],
        }]
    })
}

fn span_json(span: &Span) -> Json {
    let nanos = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            .to_string()
    };
    let status = match &span.error {
        None => json!({ "code": 1 }),
        Some(message) => json!({ "code": 2, "message": message }),
    };
    let mut out = json!({
        "traceId": hex(&span.context.trace_id),
        "spanId": hex(&span.context.span_id),
        "name": span.name,
        "kind": match span.kind {
            SpanKind::Internal => 1,
            SpanKind::Server => 2,
        },
        "startTimeUnixNano": nanos(span.start),
        "endTimeUnixNano": nanos(span.end),
        "attributes": span
            .attributes
            .iter()
            .map(|(key, value)| attribute(key, value))
            .collect::<Vec<_>>(),
        "status": status,
    });
    if let Some(parent) = span.parent {
        out["parentSpanId"] = json!(hex(&parent));
    }
    out
}

fn attribute(key: &str, value: &Value) -> Json {
    let value = match value {
        Value::Str(text) => json!({ "stringValue": text }),
        // OTLP JSON writes 64-bit integers as strings.
        Value::Int(n) => json!({ "intValue": n.to_string() }),
        Value::Bool(b) => json!({ "boolValue": b }),
    };
    json!({ "key": key, "value": value })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{TraceContext, Tracer};

    #[test]
    fn endpoints_parse_or_say_what_is_expected() {
        let plain = Endpoint::parse("http://collector:4318").unwrap();
        assert_eq!(plain.authority, "collector:4318");
        assert_eq!(plain.path, "/v1/traces");
        let prefixed = Endpoint::parse("http://127.0.0.1:4318/otlp/").unwrap();
        assert_eq!(prefixed.path, "/otlp/v1/traces");
        for bad in [
            "https://collector:4318",
            "collector:4318",
            "http://collector",
            "http://:4318",
        ] {
            let error = Endpoint::parse(bad).unwrap_err();
            assert!(error.contains("http://"), "{bad}: {error}");
        }
    }

    /// The body follows OTLP's JSON mapping: hex ids, nanosecond strings, typed attributes,
    /// the parent only where there is one.
    #[test]
    fn spans_encode_as_otlp_json() {
        let root = TraceContext::root();
        let child = root.child();
        let at = SystemTime::UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let span = Span {
            context: child,
            parent: Some(root.span_id),
            name: "decode".into(),
            kind: SpanKind::Server,
            start: at,
            end: at + Duration::from_millis(5),
            attributes: vec![
                ("airlock.prompt_tokens", Value::Int(12)),
                ("airlock.role", Value::Str("decode".into())),
            ],
            error: Some("lost the link".into()),
        };
        let body = encode(&resource("airlock-decode", "decode-0"), &[span]);
        let span = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], hex(&root.trace_id));
        assert_eq!(span["parentSpanId"], hex(&root.span_id));
        assert_eq!(span["startTimeUnixNano"], "1700000000123456789");
        assert_eq!(span["endTimeUnixNano"], "1700000000128456789");
        assert_eq!(span["kind"], 2);
        assert_eq!(span["attributes"][0]["value"]["intValue"], "12");
        assert_eq!(span["status"]["code"], 2);
        let service = &body["resourceSpans"][0]["resource"]["attributes"][0];
        assert_eq!(service["value"]["stringValue"], "airlock-decode");
    }

    /// A collector on a socket gets the recorded spans in a POST to /v1/traces.
    #[tokio::test]
    async fn the_exporter_posts_recorded_spans_to_the_collector() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let tracer = Tracer::start(Endpoint::parse(&url).unwrap(), "test", "t-0");
        let now = SystemTime::now();
        let context = TraceContext::root();
        tracer.record(Span {
            context,
            parent: None,
            name: "request".into(),
            kind: SpanKind::Server,
            start: now,
            end: now,
            attributes: Vec::new(),
            error: None,
        });
        let (mut stream, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .expect("the exporter connects")
            .unwrap();
        let mut request = Vec::new();
        let mut chunk = [0; 4096];
        loop {
            let n = stream.read(&mut chunk).await.unwrap();
            request.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&request);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .unwrap()
                    .parse()
                    .unwrap();
                if body.len() >= length {
                    assert!(head.starts_with("POST /v1/traces HTTP/1.1"), "{head}");
                    let body: Json = serde_json::from_str(body).unwrap();
                    let span = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
                    assert_eq!(span["traceId"], hex(&context.trace_id));
                    break;
                }
            }
            assert!(n > 0, "closed early");
        }
        stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
    }
}
