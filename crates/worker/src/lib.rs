//! A prefill, decode or unified worker: the engine loop that owns a model and a page pool
//! (sync, one thread), and the network side that feeds it frames from its links.
//!
//! Invariants kept here (DESIGN.md): **I3** admission re-checked before any allocation;
//! **I4** decode seals received pages only after `transfer::Inbound` and the checksum over
//! its own pages agree, and reads nothing before; **I5** a sender releases only on the
//! receiver's answer or when the link to it is gone; **I6** each request is reported to the
//! router exactly once; **I7** a router's abort or a lost link ends the request through the
//! same paths; **I9** every path out of a request releases its pages.
//!
//! What this crate is not: it does no HTTP, knows no API keys, and never decides tenancy:
//! the tenant arrives in the router's `Submit` and only gates page ownership here.

mod config;
mod engine;
mod faults;
mod net;
mod refusals;

pub use config::WorkerConfig;
pub use engine::{Engine, Event, LinkId, LinkKind};
#[cfg(feature = "fault-injection")]
pub use faults::{Fault, When};
pub use faults::{FaultPlan, FaultPlanError};
pub use net::{start_worker, start_worker_on, Listener, Worker};
