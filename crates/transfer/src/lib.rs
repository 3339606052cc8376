//! The transfer protocol (DESIGN.md, Transfer protocol): the messages every link carries,
//! their bounded encoding, the checksum, the receiver's verification rules, and the
//! transports (TCP, Unix sockets with the one-sided shared-memory path, in-process) that
//! carry frames.
//!
//! Invariants kept here: **I4** in part (what a receiver accepts before sealing: header,
//! counts fixed by the reservation, every page, checksum, in [`Inbound`]); hostile bytes
//! never panic the decoder ([`Frame::decode`], fuzzed).
//!
//! What this crate is not: it owns no pages and runs no model. The workers apply its verdicts
//! to their pools; it never decides when a page is freed.

pub mod auth;
mod checksum;
mod frame;
pub mod handshake;
mod inbound;
pub mod one_sided;
mod page_bytes;
pub mod transport;

pub use auth::ClusterSecret;
pub use checksum::{page_hash, transfer_checksum, SenderHashes, TransferHasher};
pub use frame::{
    page_fits_frame, DecodeError, Failure, Finish, Frame, FrameKind, PeerRole, PerTransport, Plan,
    PrefixCounters, Reject, Role, Sampling, Submit, TokenLogprob, TransferCounters, TransferDone,
    TransferId, WorkerInfo, MAX_FRAME_BYTES, MAX_LOGIT_BIAS, MAX_PROMPT_TOKENS, MAX_STOP_STRINGS,
    MAX_STRING_BYTES, MAX_TEXT_LOGPROBS, MAX_TOP_LOGPROBS, PAGE_FRAME_OVERHEAD_BYTES_MAX,
    PROTOCOL_VERSION, TRANSFER_SECONDS_BOUNDS, TRANSPORTS,
};
pub use handshake::{accept_handshake, connect_handshake, Expectation, HandshakeError};
pub use inbound::Inbound;
pub use page_bytes::PageBytes;

#[cfg(test)]
mod tests;
