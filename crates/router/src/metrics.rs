//! Prometheus text exposition, hand-rolled: a few labelled counters, two histograms, and
//! gauges read from the workers' latest pool reports at scrape time.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// One increment of a counter, with its labels: each counter's name and label set is fixed
/// by its variant, so a wrong name or a missing label does not compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Counter {
    /// `airlock_requests_total{outcome, reason}`; `reason` is the finish reason or error code.
    Requests {
        outcome: RequestOutcome,
        reason: &'static str,
    },
    /// `airlock_transfers_total{outcome, reason}`.
    Transfers {
        outcome: TransferOutcome,
        reason: &'static str,
    },
    /// `airlock_http_connections_refused_total{reason}`.
    HttpConnectionsRefused { reason: &'static str },
    /// `airlock_http_connections_closed_total{reason}`.
    HttpConnectionsClosed { reason: &'static str },
    /// `airlock_workers_refused_total{reason}`.
    WorkersRefused { reason: &'static str },
    /// `airlock_request_retries_total{reason}`: tries of a request on other workers after a
    /// transport failure, by the failure.
    Retries { reason: &'static str },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestOutcome {
    Ok,
    Error,
    Cancelled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferOutcome {
    Ok,
    Failed,
}

/// The counters' names in the order /metrics lists them, with their help text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CounterName {
    Requests,
    Transfers,
    HttpConnectionsRefused,
    HttpConnectionsClosed,
    WorkersRefused,
    Retries,
}

impl CounterName {
    const ALL: [CounterName; 6] = [
        CounterName::Requests,
        CounterName::Transfers,
        CounterName::HttpConnectionsRefused,
        CounterName::HttpConnectionsClosed,
        CounterName::WorkersRefused,
        CounterName::Retries,
    ];

    fn name(self) -> &'static str {
        match self {
            CounterName::Requests => "airlock_requests_total",
            CounterName::Transfers => "airlock_transfers_total",
            CounterName::HttpConnectionsRefused => "airlock_http_connections_refused_total",
            CounterName::HttpConnectionsClosed => "airlock_http_connections_closed_total",
            CounterName::WorkersRefused => "airlock_workers_refused_total",
            CounterName::Retries => "airlock_request_retries_total",
        }
    }

    fn help(self) -> &'static str {
        match self {
            CounterName::Requests => {
                "Requests by outcome (ok, error, cancelled) and reason (finish reason, error code)."
            }
            CounterName::Transfers => {
                "KV transfers seen by the router, by outcome (ok, failed) and reason."
            }
            CounterName::HttpConnectionsRefused => {
                "HTTP connections answered at once and closed, by reason (per_client: the address \
                 holds its share; full: every slot busy)."
            }
            CounterName::HttpConnectionsClosed => {
                "HTTP connections the server closed, by reason (header_timeout, idle: kept alive \
                 with no request, evicted: the longest idle, to make room)."
            }
            CounterName::WorkersRefused => {
                "Workers the router refused at the handshake, by reason (auth, a mismatched field)."
            }
            CounterName::Retries => {
                "Requests tried again on other workers after a transport failure, before any of \
                 the answer was sent, by the failure."
            }
        }
    }
}

impl Counter {
    fn name(self) -> CounterName {
        match self {
            Counter::Requests { .. } => CounterName::Requests,
            Counter::Transfers { .. } => CounterName::Transfers,
            Counter::HttpConnectionsRefused { .. } => CounterName::HttpConnectionsRefused,
            Counter::HttpConnectionsClosed { .. } => CounterName::HttpConnectionsClosed,
            Counter::WorkersRefused { .. } => CounterName::WorkersRefused,
            Counter::Retries { .. } => CounterName::Retries,
        }
    }

    /// The label set, rendered: `{outcome="ok",reason="stop"}`.
    fn labels(self) -> String {
        match self {
            Counter::Requests { outcome, reason } => {
                let outcome = match outcome {
                    RequestOutcome::Ok => "ok",
                    RequestOutcome::Error => "error",
                    RequestOutcome::Cancelled => "cancelled",
                };
                format_labels(&[("outcome", outcome), ("reason", reason)])
            }
            Counter::Transfers { outcome, reason } => {
                let outcome = match outcome {
                    TransferOutcome::Ok => "ok",
                    TransferOutcome::Failed => "failed",
                };
                format_labels(&[("outcome", outcome), ("reason", reason)])
            }
            Counter::HttpConnectionsRefused { reason }
            | Counter::HttpConnectionsClosed { reason }
            | Counter::WorkersRefused { reason }
            | Counter::Retries { reason } => format_labels(&[("reason", reason)]),
        }
    }
}

/// (name, help, value) of one per-worker gauge.
type GaugeRow = (&'static str, &'static str, fn(&PoolGauges) -> f64);
/// (name, help, value) of one per-worker 0/1 gauge.
type FlagRow = (&'static str, &'static str, fn(&PoolGauges) -> bool);

const TTFT_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const ITL_BUCKETS: &[f64] = &[0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0];
const REQUEST_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0,
];

pub struct Metrics {
    /// Keyed by the increment itself: labels are rendered at scrape time, not per request.
    counters: Mutex<HashMap<Counter, u64>>,
    ttft: Histogram,
    itl: Histogram,
    request_duration: Histogram,
    queue: Histogram,
    http_connections_open: AtomicUsize,
    /// Tokens of finished requests: prompt, generated, and the prompt's share that came from
    /// the prefix cache.
    tokens: [AtomicU64; 3],
}

/// The token counters, in `Metrics::tokens` order: (name, help).
const TOKEN_COUNTERS: [(&str, &str); 3] = [
    (
        "airlock_prompt_tokens_total",
        "Prompt tokens of requests that finished (cached ones included).",
    ),
    (
        "airlock_generation_tokens_total",
        "Tokens generated for requests that finished.",
    ),
    (
        "airlock_cached_prompt_tokens_total",
        "Prompt tokens of finished requests whose K/V came from the prefix cache.",
    ),
];

/// What /metrics reads from the router itself at scrape time.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouterGauges {
    /// Requests submitted to the workers and not yet started.
    pub waiting: usize,
    /// Requests admitted and not finished (waiting ones included).
    pub in_flight: usize,
}

struct Histogram {
    name: &'static str,
    help: &'static str,
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

#[derive(Default)]
struct HistogramState {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// One worker's pool as last reported, for the gauges.
pub struct PoolGauges {
    pub worker: String,
    pub role: &'static str,
    pub up: bool,
    pub pages_free: u32,
    pub pages_total: u32,
    pub pages_quarantined: u32,
    pub queue_depth: u32,
    pub ownership_failures: u64,
    pub frames_rejected: u64,
    pub auth_failures: u64,
    pub prefix: transfer::PrefixCounters,
    pub transfer: transfer::PerTransport,
    pub draining: bool,
    pub breaker_open: bool,
    /// Transport failures laid at the worker, in `TransportFault::ALL` order.
    pub failures: [u64; 4],
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            counters: Mutex::new(HashMap::new()),
            ttft: Histogram::new(
                "airlock_ttft_seconds",
                "Time from request arrival to its first token.",
                TTFT_BUCKETS,
            ),
            itl: Histogram::new(
                "airlock_itl_seconds",
                "Time between consecutive streamed tokens of one request.",
                ITL_BUCKETS,
            ),
            request_duration: Histogram::new(
                "airlock_request_duration_seconds",
                "Time from request arrival to its last token, for requests that finished.",
                REQUEST_BUCKETS,
            ),
            queue: Histogram::new(
                "airlock_queue_seconds",
                "Time from request arrival until a decode (or unified) worker reserved its KV \
                 pages.",
                QUEUE_BUCKETS,
            ),
            http_connections_open: AtomicUsize::new(0),
            tokens: Default::default(),
        }
    }

    pub fn inc(&self, counter: Counter) {
        *self
            .counters
            .lock()
            .expect("metrics lock is never held across a panic")
            .entry(counter)
            .or_insert(0) += 1;
    }

    /// The HTTP edge's count of open client connections.
    pub fn set_http_connections_open(&self, open: usize) {
        self.http_connections_open.store(open, Ordering::Relaxed);
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn observe_itl(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    pub fn observe_queue(&self, seconds: f64) {
        self.queue.observe(seconds);
    }

    /// A finished request: its token counts and how long it took from arrival.
    pub fn request_finished(&self, prompt: u64, generated: u64, cached: u64, seconds: f64) {
        for (counter, n) in self.tokens.iter().zip([prompt, generated, cached]) {
            counter.fetch_add(n, Ordering::Relaxed);
        }
        self.request_duration.observe(seconds);
    }

    pub fn render(&self, pools: &[PoolGauges], router: RouterGauges) -> String {
        let router_waiting = router.waiting;
        let mut out = String::new();
        let counters = self
            .counters
            .lock()
            .expect("metrics lock is never held across a panic");
        for counter_name in CounterName::ALL {
            let (name, help) = (counter_name.name(), counter_name.help());
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let mut rows: Vec<(String, u64)> = counters
                .iter()
                .filter(|(counter, _)| counter.name() == counter_name)
                .map(|(counter, value)| (counter.labels(), *value))
                .collect();
            rows.sort();
            for (labels, value) in rows {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        }
        drop(counters);
        for ((name, help), value) in TOKEN_COUNTERS.iter().zip(&self.tokens) {
            let value = value.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let gauges: [GaugeRow; 16] = [
            (
                "airlock_kv_usage_ratio",
                "Share of a worker's KV pages held by requests (0 to 1).",
                |p| f64::from(p.pages_total - p.pages_free) / f64::from(p.pages_total.max(1)),
            ),
            (
                "airlock_kv_pages_free",
                "Free KV pages per worker (cached pages no request uses count as free).",
                |p| f64::from(p.pages_free),
            ),
            (
                "airlock_kv_pages_used",
                "KV pages held by requests per worker (quarantined included).",
                |p| f64::from(p.pages_total - p.pages_free),
            ),
            (
                "airlock_kv_pages_quarantined",
                "KV pages neither free nor readable until a peer answers.",
                |p| f64::from(p.pages_quarantined),
            ),
            (
                "airlock_worker_queue_depth",
                "Requests waiting for KV pages per worker.",
                |p| f64::from(p.queue_depth),
            ),
            (
                "airlock_ownership_check_failures_total",
                "Forward steps refused by the page owner/generation check (I1).",
                |p| p.ownership_failures as f64,
            ),
            (
                "airlock_transfer_frames_rejected_total",
                "Transfer frames a decode worker refused (unknown, mismatched, corrupt).",
                |p| p.frames_rejected as f64,
            ),
            (
                "airlock_cluster_auth_failures_total",
                "Links a worker refused because the peer failed cluster authentication (I11).",
                |p| p.auth_failures as f64,
            ),
            (
                "airlock_prefix_cache_pages",
                "KV pages in a worker's prefix cache (its tenants' shared prompt pages).",
                |p| p.prefix.cached_pages as f64,
            ),
            (
                "airlock_prefix_cache_lookups_total",
                "Prefix-cache lookups (one per admitted request that may use the cache).",
                |p| p.prefix.lookups as f64,
            ),
            (
                "airlock_prefix_cache_hit_pages_total",
                "Cached pages requests started from (same tenant and partition only).",
                |p| p.prefix.hit_pages as f64,
            ),
            (
                "airlock_prefix_cache_hit_tokens_total",
                "Prompt tokens whose K/V came from the cache: not computed (prefill, \
                 unified) or not transferred (decode).",
                |p| p.prefix.hit_tokens as f64,
            ),
            (
                "airlock_prefix_cache_evictions_total",
                "Cached pages evicted to make room (only pages no request referenced).",
                |p| p.prefix.evictions as f64,
            ),
            (
                "airlock_prompt_tokens_prefilled_total",
                "Prompt tokens a worker computed K/V for.",
                |p| p.prefix.prefilled_tokens as f64,
            ),
            (
                "airlock_transfer_pages_sent_total",
                "KV pages a prefill worker sent to decode workers.",
                |p| p.prefix.pages_sent as f64,
            ),
            (
                "airlock_transfer_pages_not_sent_total",
                "KV pages a prefill worker did not send because decode held them (delta).",
                |p| p.prefix.pages_not_sent as f64,
            ),
        ];
        for (name, help, value) in gauges {
            let kind = if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for pool in pools {
                let labels = format_labels(&[("worker", &pool.worker), ("role", pool.role)]);
                let _ = writeln!(out, "{name}{labels} {}", value(pool));
            }
        }
        let _ = writeln!(
            out,
            "# HELP airlock_worker_up 1 if the router holds a live link to the worker.\n\
             # TYPE airlock_worker_up gauge"
        );
        for pool in pools {
            let labels = format_labels(&[("worker", &pool.worker), ("role", pool.role)]);
            let _ = writeln!(out, "airlock_worker_up{labels} {}", u8::from(pool.up));
        }
        render_worker_health(&mut out, pools);
        let _ = writeln!(
            out,
            "# HELP airlock_router_queue_depth Requests admitted by the router and not yet \
             started.\n# TYPE airlock_router_queue_depth gauge\n\
             airlock_router_queue_depth {router_waiting}"
        );
        let running = router.in_flight.saturating_sub(router.waiting);
        let _ = writeln!(
            out,
            "# HELP airlock_requests_waiting Requests admitted and not yet started (as \
             airlock_router_queue_depth).\n# TYPE airlock_requests_waiting gauge\n\
             airlock_requests_waiting {router_waiting}\n\
             # HELP airlock_requests_running Requests started and not yet finished.\n\
             # TYPE airlock_requests_running gauge\nairlock_requests_running {running}"
        );
        let _ = writeln!(
            out,
            "# HELP airlock_http_connections_open Client connections open at the HTTP edge.\n\
             # TYPE airlock_http_connections_open gauge\n\
             airlock_http_connections_open {}",
            self.http_connections_open.load(Ordering::Relaxed)
        );
        render_transfer(&mut out, pools);
        self.ttft.render(&mut out);
        self.itl.render(&mut out);
        self.request_duration.render(&mut out);
        self.queue.render(&mut out);
        out
    }
}

impl Histogram {
    fn new(name: &'static str, help: &'static str, bounds: &'static [f64]) -> Histogram {
        Histogram {
            name,
            help,
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    fn observe(&self, value: f64) {
        let mut state = self
            .state
            .lock()
            .expect("metrics lock is never held across a panic");
        for (bound, count) in self.bounds.iter().zip(&mut state.counts) {
            if value <= *bound {
                *count += 1;
            }
        }
        state.sum += value;
        state.count += 1;
    }

    fn render(&self, out: &mut String) {
        let state = self
            .state
            .lock()
            .expect("metrics lock is never held across a panic");
        let name = self.name;
        let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} histogram", self.help);
        for (bound, count) in self.bounds.iter().zip(&state.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", state.count);
        let _ = writeln!(out, "{name}_sum {}", state.sum);
        let _ = writeln!(out, "{name}_count {}", state.count);
    }
}

/// `airlock_transfer_bytes_total` (prefill: page bytes sent; decode: page bytes of verified
/// transfers) and `airlock_transfer_seconds` (decode: from a transfer's first page frame to
/// its verified seal), per worker and transport: bandwidth is their ratio.
/// Draining and breaker gauges, and the transport failures laid at each worker.
fn render_worker_health(out: &mut String, pools: &[PoolGauges]) {
    let flags: [FlagRow; 2] = [
        (
            "airlock_worker_draining",
            "1 if the worker reported that it is shutting down (it gets no new requests).",
            |p| p.draining,
        ),
        (
            "airlock_worker_breaker_open",
            "1 while the worker's circuit breaker keeps it out of rotation (after consecutive \
             transport failures).",
            |p| p.breaker_open,
        ),
    ];
    for (name, help, value) in flags {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for pool in pools {
            let labels = format_labels(&[("worker", &pool.worker), ("role", pool.role)]);
            let _ = writeln!(out, "{name}{labels} {}", u8::from(value(pool)));
        }
    }
    let name = "airlock_worker_failures_total";
    let _ = writeln!(
        out,
        "# HELP {name} Transport failures laid at a worker, by kind (link_lost, \
         transfer_failed, transfer_timeout, peer_unavailable); a client's bad request is \
         never one.\n# TYPE {name} counter"
    );
    for pool in pools {
        for (fault, count) in crate::cluster::TransportFault::ALL
            .iter()
            .zip(pool.failures)
        {
            let labels = [
                ("worker", &*pool.worker),
                ("role", pool.role),
                ("kind", fault.label()),
            ];
            let _ = writeln!(out, "{name}{} {count}", format_labels(&labels));
        }
    }
}

fn render_transfer(out: &mut String, pools: &[PoolGauges]) {
    let name = "airlock_transfer_bytes_total";
    let _ = writeln!(
        out,
        "# HELP {name} KV page bytes a prefill worker sent, or a decode worker received in \
         transfers it verified.\n# TYPE {name} counter"
    );
    for pool in pools {
        for (transport, counters) in transfer::TRANSPORTS.iter().zip(pool.transfer.iter()) {
            let labels = [
                ("worker", &*pool.worker),
                ("role", pool.role),
                ("transport", transport),
            ];
            let bytes = match pool.role {
                "prefill" => counters.bytes_sent,
                _ => counters.bytes_received,
            };
            let _ = writeln!(out, "{name}{} {bytes}", format_labels(&labels));
        }
    }
    let name = "airlock_transfer_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Time from a transfer's first page frame to its verified seal, on the \
         decode worker.\n# TYPE {name} histogram"
    );
    for pool in pools.iter().filter(|pool| pool.role == "decode") {
        for (transport, counters) in transfer::TRANSPORTS.iter().zip(pool.transfer.iter()) {
            let labels = [
                ("worker", &*pool.worker),
                ("role", pool.role),
                ("transport", transport),
            ];
            let mut cumulative = 0;
            for (bound, count) in transfer::TRANSFER_SECONDS_BOUNDS
                .iter()
                .zip(counters.buckets)
            {
                cumulative += count;
                let le = bound.to_string();
                let labels = format_labels(&[labels[0], labels[1], labels[2], ("le", &le)]);
                let _ = writeln!(out, "{name}_bucket{labels} {cumulative}");
            }
            let inf = format_labels(&[labels[0], labels[1], labels[2], ("le", "+Inf")]);
            let transfers = counters.transfers;
            let _ = writeln!(out, "{name}_bucket{inf} {transfers}");
            let labels = format_labels(&labels);
            let seconds = counters.micros_sum as f64 / 1e6;
            let _ = writeln!(out, "{name}_sum{labels} {seconds}");
            let _ = writeln!(out, "{name}_count{labels} {transfers}");
        }
    }
}

fn format_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let body: Vec<String> = labels
        .iter()
        .map(|(key, value)| {
            let escaped = value
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{key}=\"{escaped}\"")
        })
        .collect();
    format!("{{{}}}", body.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counters' lines exactly as /metrics has always written them.
    #[test]
    fn counters_render_with_their_names_help_and_labels() {
        let metrics = Metrics::new();
        metrics.inc(Counter::Requests {
            outcome: RequestOutcome::Cancelled,
            reason: "client_gone",
        });
        metrics.inc(Counter::Requests {
            outcome: RequestOutcome::Ok,
            reason: "stop",
        });
        metrics.inc(Counter::Requests {
            outcome: RequestOutcome::Ok,
            reason: "stop",
        });
        metrics.inc(Counter::Transfers {
            outcome: TransferOutcome::Failed,
            reason: "kv_transfer_failed",
        });
        metrics.inc(Counter::HttpConnectionsRefused { reason: "full" });
        metrics.inc(Counter::HttpConnectionsClosed { reason: "idle" });
        metrics.inc(Counter::WorkersRefused { reason: "auth" });
        let page = metrics.render(&[], RouterGauges::default());
        let expected = "\
# HELP airlock_requests_total Requests by outcome (ok, error, cancelled) and reason (finish reason, error code).
# TYPE airlock_requests_total counter
airlock_requests_total{outcome=\"cancelled\",reason=\"client_gone\"} 1
airlock_requests_total{outcome=\"ok\",reason=\"stop\"} 2
# HELP airlock_transfers_total KV transfers seen by the router, by outcome (ok, failed) and reason.
# TYPE airlock_transfers_total counter
airlock_transfers_total{outcome=\"failed\",reason=\"kv_transfer_failed\"} 1
# HELP airlock_http_connections_refused_total HTTP connections answered at once and closed, by reason (per_client: the address holds its share; full: every slot busy).
# TYPE airlock_http_connections_refused_total counter
airlock_http_connections_refused_total{reason=\"full\"} 1
# HELP airlock_http_connections_closed_total HTTP connections the server closed, by reason (header_timeout, idle: kept alive with no request, evicted: the longest idle, to make room).
# TYPE airlock_http_connections_closed_total counter
airlock_http_connections_closed_total{reason=\"idle\"} 1
# HELP airlock_workers_refused_total Workers the router refused at the handshake, by reason (auth, a mismatched field).
# TYPE airlock_workers_refused_total counter
airlock_workers_refused_total{reason=\"auth\"} 1
";
        assert!(page.starts_with(expected), "{page}");
    }

    /// Finished requests' tokens and durations, queue times, the running and waiting gauges,
    /// and each worker's KV usage ratio, draining flag, breaker and failures, as /metrics
    /// writes them.
    #[test]
    fn tokens_durations_running_and_kv_usage_render() {
        let metrics = Metrics::new();
        metrics.request_finished(100, 20, 64, 0.3);
        metrics.request_finished(10, 5, 0, 2.0);
        let pool = PoolGauges {
            worker: "d".into(),
            role: "decode",
            up: true,
            pages_free: 30,
            pages_total: 40,
            pages_quarantined: 0,
            queue_depth: 0,
            ownership_failures: 0,
            frames_rejected: 0,
            auth_failures: 0,
            prefix: Default::default(),
            transfer: Default::default(),
            draining: true,
            breaker_open: false,
            failures: [3, 1, 0, 2],
        };
        metrics.observe_queue(0.02);
        let gauges = RouterGauges {
            waiting: 2,
            in_flight: 5,
        };
        let page = metrics.render(&[pool], gauges);
        for line in [
            "airlock_prompt_tokens_total 110",
            "airlock_generation_tokens_total 25",
            "airlock_cached_prompt_tokens_total 64",
            "airlock_kv_usage_ratio{worker=\"d\",role=\"decode\"} 0.25",
            "airlock_requests_waiting 2",
            "airlock_requests_running 3",
            "airlock_request_duration_seconds_bucket{le=\"0.5\"} 1",
            "airlock_request_duration_seconds_bucket{le=\"2.5\"} 2",
            "airlock_request_duration_seconds_count 2",
            "airlock_queue_seconds_bucket{le=\"0.01\"} 0",
            "airlock_queue_seconds_bucket{le=\"0.05\"} 1",
            "airlock_worker_draining{worker=\"d\",role=\"decode\"} 1",
            "airlock_worker_breaker_open{worker=\"d\",role=\"decode\"} 0",
            "airlock_worker_failures_total{worker=\"d\",role=\"decode\",kind=\"link_lost\"} 3",
            "airlock_worker_failures_total{worker=\"d\",role=\"decode\",kind=\"peer_unavailable\"} 2",
        ] {
            assert!(
                page.lines().any(|l| l == line),
                "no line {line:?} in:\n{page}"
            );
        }
    }
}
