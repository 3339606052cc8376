//! A checked model of the KV-transfer protocol and the decode page pool (issue 5, first part),
//! explored exhaustively by `stateright` within small bounds.
//!
//! The model has a router, a prefill and a decode worker and two requests of two tenants that
//! compete for a three-page decode pool. Its receiving side runs the real verification code:
//! `transfer::Inbound` (which frames a reservation accepts, when `Done` may seal) and
//! `transfer::transfer_checksum`; pages, generations and the owner check are a small copy of
//! `kv::PagePool`'s rules (see ARCHITECTURE.md for the mapping). Faults are actions: message
//! loss, duplication, reordering (the network is a multiset), corruption, a link reset, a
//! client disconnect, a retry that reuses the request's identity, and a request too large for
//! the pool (the incident).
//!
//! Each guard has a mutant that removes it; `tests/` asserts the checker finds a
//! counterexample for the property it protects, and none without the mutant.

pub mod model;

pub use model::{Faults, Mutant, RequestSpec, TransferSpec};
