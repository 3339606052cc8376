//! What a worker needs to run, already checked by the binary's config layer.

use std::time::Duration;
use transfer::Role;

/// A worker's settings. The pool is built by the caller and handed in with the model.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub role: Role,
    /// Shown in logs, metrics labels and errors.
    pub name: String,
    /// The model id clients name; a router refuses a worker that serves another.
    pub model_id: String,
    /// xxh3-64 of the model file, exchanged at the handshake.
    pub weights_hash: u64,
    /// Most tokens (prompt + max_tokens) one request may use.
    pub context_length: usize,
    /// Requests that may wait for pages at once; more get `Overloaded` (503).
    pub queue_max: usize,
    /// How long a request may wait for pages before `QueueTimeout` (503).
    pub queue_timeout: Duration,
    /// How long a transfer may take before `TransferTimeout`.
    pub transfer_timeout: Duration,
    /// Tokens per forward step: one per decoding request, the rest for prompt chunks.
    pub step_tokens: usize,
    /// Most decoding requests in one step.
    pub max_batch: usize,
    /// Faults to inject (test builds with `fault-injection` only; always empty otherwise).
    pub faults: crate::FaultPlan,
    /// Where each request's span goes, as a child of the router's (off by default).
    pub tracer: otlp::Tracer,
}
