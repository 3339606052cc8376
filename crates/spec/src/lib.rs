//! A checked model of the KV-transfer protocol and the decode page pool (issue 5), explored
//! exhaustively by `stateright` within small bounds.
//!
//! The model has a router, a prefill and a decode worker and two requests of two tenants that
//! compete for a three-page decode pool. Its receiving side runs the real verification code:
//! `transfer::Inbound` (which frames a reservation accepts, when `Done` may seal) and
//! `transfer::transfer_checksum`; the page rules are a copy of `kv::PagePool`'s ([`pages`]),
//! tested against the real pool operation by operation. Faults are actions: message loss,
//! duplication, reordering (the network is a multiset), corruption, a link reset, a crash and
//! restart, a client disconnect, a retry that reuses the request's identity, and the incident's
//! placeholder transfer. Two transports, both in the code: the framed one (TCP), and the
//! one-sided one (`transfer::one_sided`, through shared memory; an RDMA-write transport would
//! follow the same rules), where posted writes land without looking at page headers and only
//! the quiescence protocol keeps them out of reused pages.
//!
//! A second model, [`prefix_cache`], checks the tenant-scoped prefix cache on both workers and
//! the delta transfer it enables (decode reuses its cached pages, prefill sends only the rest):
//! namespaces, refcounts, eviction, what may be written, what may enter a cache, and that
//! decode judges a delta transfer by its own reservation. It runs the same real `Inbound` and
//! checksum and the same page rules, over a smaller protocol; see its module docs for what it
//! leaves to the transfer model.
//!
//! Each guard has a mutant that removes it; `tests/` asserts the checker finds a
//! counterexample for the property it protects, and none without the mutant. See
//! ARCHITECTURE.md for how each action maps to the code.

pub mod model;
pub mod pages;
pub mod prefix_cache;

pub use model::{Faults, Mutant, RequestSpec, TransferSpec, Transport};
pub use prefix_cache::{PrefixFaults, PrefixRequest, PrefixSpec};
