//! OpenTelemetry traces, one per request across router, prefill and decode: the trace
//! context a `Submit` frame carries, the spans each process records, and an exporter that
//! batches them to an OTLP/HTTP collector (`POST {endpoint}/v1/traces`, JSON bodies).
//!
//! Hand-written rather than the `opentelemetry` crates: what is needed is a few dozen lines
//! of JSON and one HTTP POST, and those crates bring a gRPC or HTTP client stack the server
//! does not otherwise need. Plain `http://` only: run a collector beside the process (an
//! OpenTelemetry Collector sidecar) to forward over TLS.
//!
//! Off by default ([`Tracer::off`]): nothing is recorded, no task runs. Recording never
//! blocks a request: a full queue drops the span and counts it.

mod export;

pub use export::Endpoint;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::sync::mpsc;

/// Where a span sits: its trace and its own id (W3C trace context, without flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

impl TraceContext {
    /// A new trace's root span.
    pub fn root() -> TraceContext {
        let (a, b, c) = (random_u64(), random_u64(), random_u64());
        let mut trace_id = [0; 16];
        trace_id[..8].copy_from_slice(&a.to_be_bytes());
        trace_id[8..].copy_from_slice(&b.to_be_bytes());
        TraceContext {
            trace_id,
            span_id: c.to_be_bytes(),
        }
    }

    /// A new span in the same trace (its parent is this one).
    pub fn child(&self) -> TraceContext {
        TraceContext {
            trace_id: self.trace_id,
            span_id: random_u64().to_be_bytes(),
        }
    }

    /// A W3C `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`), or `None` when it is
    /// malformed or names the all-zero ids the standard forbids.
    pub fn from_traceparent(header: &str) -> Option<TraceContext> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || flags.len() != 2 {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let trace_id: [u8; 16] = hex_bytes(trace)?;
        let span_id: [u8; 8] = hex_bytes(span)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext { trace_id, span_id })
    }

    /// This context as a `traceparent` header (sampled).
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&self.span_id))
    }
}

/// A finished span.
#[derive(Clone, Debug)]
pub struct Span {
    pub context: TraceContext,
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, Value)>,
    /// `Some` marks the span failed, with why.
    pub error: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal,
    /// The span of a request this process answered.
    Server,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Bool(bool),
}

/// Records spans for export, or nothing when off. Cheap to clone.
#[derive(Clone, Default)]
pub struct Tracer {
    queue: Option<mpsc::Sender<Span>>,
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("on", &self.is_on())
            .field("dropped", &self.dropped())
            .finish()
    }
}

/// Spans waiting for export before new ones are dropped.
const QUEUE_SPANS: usize = 8192;

impl Tracer {
    /// Records nothing.
    pub fn off() -> Tracer {
        Tracer::default()
    }

    /// Exports to `endpoint` as `service` (`service.name`), this process being `instance`
    /// (`service.instance.id`). Starts the exporter task: call inside a tokio runtime.
    pub fn start(endpoint: Endpoint, service: &str, instance: &str) -> Tracer {
        let (queue, spans) = mpsc::channel(QUEUE_SPANS);
        let resource = export::resource(service, instance);
        tokio::spawn(export::run(spans, endpoint, resource));
        Tracer {
            queue: Some(queue),
            dropped: Arc::default(),
        }
    }

    pub fn is_on(&self) -> bool {
        self.queue.is_some()
    }

    /// Queues `span` for export; never blocks (a full queue drops it, counted).
    pub fn record(&self, span: Span) {
        if let Some(queue) = &self.queue {
            if queue.try_send(span).is_err() {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Spans dropped because the exporter fell behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A non-zero random 64-bit value: ids need uniqueness, not secrecy.
fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        let value = hasher.finish();
        if value != 0 {
            return value;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_bytes<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_refuses_what_the_standard_refuses() {
        let context = TraceContext::root();
        let header = context.traceparent();
        assert_eq!(TraceContext::from_traceparent(&header), Some(context));
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parsed = TraceContext::from_traceparent(good).expect("the W3C example");
        assert_eq!(hex(&parsed.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&parsed.span_id), "00f067aa0ba902b7");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é6-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::from_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_child_shares_the_trace_and_not_the_span() {
        let root = TraceContext::root();
        let child = root.child();
        assert_eq!(child.trace_id, root.trace_id);
        assert_ne!(child.span_id, root.span_id);
        assert_ne!(TraceContext::root().trace_id, root.trace_id);
    }

    #[test]
    fn an_off_tracer_records_nothing() {
        let tracer = Tracer::off();
        assert!(!tracer.is_on());
        let now = SystemTime::now();
        tracer.record(Span {
            context: TraceContext::root(),
            parent: None,
            name: "x".into(),
            kind: SpanKind::Internal,
            start: now,
            end: now,
            attributes: Vec::new(),
            error: None,
        });
        assert_eq!(tracer.dropped(), 0);
    }
}
