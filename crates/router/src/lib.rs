//! The router: the OpenAI-compatible HTTP front (axum, served by its own hyper edge that
//! bounds every connection's time and number), API keys -> tenants, admission, the choice of
//! workers, and the relay of each answer back to its client.
//!
//! One job per module: `server` (state and the route table), `routes` (handlers),
//! `admission` (key, body, I3), `openai` (request types and validation), `tokens`
//! (`/tokenize`, `/detokenize`), `run` (one
//! request's phases through the workers), `stream` (SSE), `responses` (every JSON body as a
//! type), `error` (the error table), `openapi` (the document at `/openapi.json`, derived from
//! those types), `metrics`, `tenants`, `cluster`, `edge`, `cors`.
//!
//! Invariants kept here (DESIGN.md): **I2** no 200 before the decode worker reports a sealed,
//! verified transfer, and a late failure is an SSE `error` event without `[DONE]`; **I3**
//! admission against the context length and the workers' pool capacity before anything is
//! sent to a worker; **I7** a client that disconnects aborts its request through the workers;
//! **I11** in part: the tenant comes only from the API key.
//!
//! What this crate is not: it never holds KV bytes, never frees a page, and never runs the
//! model; it tokenizes only to count and submit.

mod admission;
pub mod cluster;
pub mod cors;
pub mod discovery;
pub mod edge;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod responses;
mod routes;
mod run;
pub mod server;
mod stream;
pub mod tenants;
pub mod tokens;
pub mod tools;

pub use cluster::Cluster;
pub use edge::EdgeConfig;
pub use error::ApiError;
pub use metrics::Metrics;
pub use server::{app, AppState, RouterConfig};
pub use tenants::Tenants;
