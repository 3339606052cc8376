//! Every message that crosses a link (router <-> worker, prefill -> decode), and its bounded
//! binary encoding.
//!
//! A frame on the wire is `u32 length (LE) | body`, and a body is
//! `magic "AL" | protocol version u16 | kind u8 | fields`. Every length inside a body is checked
//! against what is left of the body and against a per-field cap before anything is allocated,
//! so a hostile peer can make the decoder return an error but never panic or allocate more
//! than [`MAX_FRAME_BYTES`].

use crate::PageBytes;
use kv::{Partition, RequestId, TenantId};

/// Version of this encoding and of the transfer protocol; a peer with another version is
/// refused at the first frame.
/// Version 2: the accepting side proves itself only after the connecting side has.
/// Version 5: the one-sided transport's `GrantAsk`, `WriteGrant`, `WriteAbort`, `WriteAbortAck`.
/// Version 6: `Sampling` carries min-p, the penalties, the logit bias and the log-probabilities
/// asked for; `Text` carries its tokens' log-probabilities instead of a token count;
/// `PromptLogprobs`; `Sampling::constraint`.
/// Version 7: `PoolStats::draining`; `Submit::trace`.
/// Version 8: the one-sided transport's `Written`.
pub const PROTOCOL_VERSION: u16 = 8;

/// Largest frame body accepted or sent: a whole KV page plus its header must fit.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Most bytes a `Page` frame's body holds beside the page itself (magic, version, kind, ids,
/// index, length prefix); tested against the encoding.
pub const PAGE_FRAME_OVERHEAD_BYTES_MAX: usize = 64;

/// Whether pages of `page_bytes` fit one frame: layouts that do not cannot be transferred.
pub fn page_fits_frame(page_bytes: usize) -> bool {
    page_bytes + PAGE_FRAME_OVERHEAD_BYTES_MAX <= MAX_FRAME_BYTES
}

/// Caps on variable-length fields, each far above what a legitimate peer sends.
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;
pub const MAX_STRING_BYTES: usize = 64 << 10;
pub const MAX_STOP_STRINGS: usize = 16;
/// Tokens one request's `logit_bias` may name.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most alternatives a token's log-probability comes with (OpenAI's `top_logprobs` cap).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most tokens one `Text` frame reports log-probabilities for.
pub const MAX_TEXT_LOGPROBS: usize = 4096;
/// Pages one `WriteGrant` names: a whole prompt of the largest context at one token a page.
pub const MAX_GRANT_PAGES: usize = 1 << 20;

// The caps must leave every frame a legitimate peer sends inside one frame: a prompt at its
// cap (4 bytes a token) with every stop string and the constraint at their caps, the logit
// bias at its, and a handshake frame.
const _: () = assert!(
    MAX_PROMPT_TOKENS * 4
        + (MAX_STOP_STRINGS + 1) * (MAX_STRING_BYTES + 4)
        + MAX_LOGIT_BIAS * 8
        + 1024
        <= MAX_FRAME_BYTES
);
const _: () = assert!(crate::handshake::HANDSHAKE_FRAME_BYTES_MAX <= MAX_FRAME_BYTES);
// A page of the default model's layout (30 layers × 3 KV heads × 64 dims × K and V × f16 ×
// 16 tokens = 360 KiB) fits with room for pages 32 times larger.
const _: () =
    assert!(32 * (30 * 3 * 64 * 2 * 2 * 16) + PAGE_FRAME_OVERHEAD_BYTES_MAX <= MAX_FRAME_BYTES);

pub(crate) const MAGIC: [u8; 2] = *b"AL";

/// Names one transfer of one request's pages from a prefill worker to a decode worker.
/// Chosen by the router, unique per router run; decode accepts pages only for a transfer it
/// reserved, so a frame of an earlier (aborted) transfer can never land in reused pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

/// A fieldless enum sent as one byte (its declaration order, or the values given), with `ALL`,
/// every variant in that order: the one list both directions of the encoding use, so no
/// variant can be sent that the decoder does not know.
macro_rules! wire_enum {
    ($(#[$meta:meta])* $vis:vis enum $name:ident {
        $($(#[$variant_meta:meta])* $variant:ident $(= $value:literal)?,)+
    }) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$variant_meta])* $variant $(= $value)?,)+
        }

        impl $name {
            /// Every variant, in wire order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            fn from_wire(value: u8, field: &'static str) -> Result<$name, DecodeError> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|candidate| *candidate as u8 == value)
                    .ok_or(DecodeError::UnknownEnum { field, value })
            }
        }
    };
}

wire_enum! {
    /// What a worker does in a deployment.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Role {
        Prefill,
        Decode,
        Unified,
    }
}

wire_enum! {
    /// Who opened a link to a worker.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum PeerRole {
        Router,
        /// A prefill worker that will send pages to this (decode) worker.
        Prefill,
    }
}

/// What a worker tells whoever connects to it: enough for the router's admission check and
/// to refuse a worker that serves another model or another page layout.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerInfo {
    pub role: Role,
    pub name: String,
    pub model_id: String,
    /// xxh3-64 of the model file: same id, different weights is still a mismatch.
    pub weights_hash: u64,
    pub kv_dtype: String,
    pub layer_count: u32,
    pub kv_head_count: u32,
    pub head_dim: u32,
    pub page_size_tokens: u32,
    pub capacity_tokens: u64,
    pub context_length: u32,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// Random per process start: frames meant for an earlier incarnation are refused.
    pub epoch: u64,
}

/// Sampling settings as the router validated them (`model::SamplingParams` says how each
/// one acts).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// Token ids with what to add to their logits; at most [`MAX_LOGIT_BIAS`].
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
    /// Report each sampled token's log-probability, with this many of the most likely
    /// tokens' (at most [`MAX_TOP_LOGPROBS`]); `None`: report none.
    pub logprobs: Option<u8>,
    /// With `logprobs`: the worker that computes the prompt also reports every prompt token's
    /// log-probability (but the first's), in `PromptLogprobs` frames. Such a request reuses
    /// no cached prompt pages: every token must be computed.
    pub prompt_logprobs: bool,
    /// Structured output: the answer must be JSON this schema accepts (`""`: any JSON
    /// object), as `grammar::Shape::to_wire` writes it; at most [`MAX_STRING_BYTES`].
    pub constraint: Option<String>,
}

/// A sampled token's log-probability under the model (the log-softmax of its raw logits,
/// before any penalty, bias or temperature), with the most likely tokens' at that step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first; as many as the request asked for.
    pub top: Vec<(u32, f32)>,
}

impl Sampling {
    /// Argmax, with every other setting off.
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: 0,
            logprobs: None,
            prompt_logprobs: false,
            constraint: None,
        }
    }
}

/// Which part of a request a worker runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Prefill and decode here, in one pool.
    Unified,
    /// Prefill here, then send the pages to the decode worker at `decode_addr`, all but the
    /// first `decode_holds_pages`, which decode already holds from its own prefix cache (its
    /// `Admitted` said so). Decode checks the transfer against its own count, not this one.
    Prefill {
        transfer: TransferId,
        decode_addr: String,
        decode_holds_pages: u32,
    },
    /// Reserve pages, receive them from a prefill worker, verify, then decode.
    Decode { transfer: TransferId },
}

/// A request as the router hands it to a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct Submit {
    pub request: RequestId,
    pub tenant: TenantId,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// The prefix-cache partition of `tenant` this request may reuse and publish pages in;
    /// `None` when the tenant (or the operator) turned prefix reuse off.
    pub prefix_cache: Option<Partition>,
    pub plan: Plan,
    /// The router's span of this request, when tracing: the worker's span joins its trace.
    pub trace: Option<otlp::TraceContext>,
}

/// A worker's prefix-cache counters, in its `PoolStats` (they only grow, but `cached_pages`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCounters {
    pub lookups: u64,
    pub hit_pages: u64,
    /// Prompt tokens whose K/V came from the cache (prefill and unified: not computed;
    /// decode: not transferred).
    pub hit_tokens: u64,
    pub evictions: u64,
    pub cached_pages: u64,
    /// Prompt tokens this worker computed K/V for.
    pub prefilled_tokens: u64,
    /// Page frames this (prefill) worker sent, and pages it did not send because decode
    /// held them already (delta transfer).
    pub pages_sent: u64,
    pub pages_not_sent: u64,
}

/// Upper bounds (seconds) of the transfer-time histogram a decode worker reports: from the
/// first page frame of a transfer to its verified seal.
pub const TRANSFER_SECONDS_BOUNDS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// The transports a transfer can take, as `/metrics` labels them: [`PoolStats`] counts
/// transfers per transport, in this order (frames over TCP or the in-process pipe; one-sided
/// writes through shared memory).
///
/// [`PoolStats`]: Frame::PoolStats
pub const TRANSPORTS: [&str; 2] = ["tcp", "shm"];

/// [`TransferCounters`] per transport, indexed as [`TRANSPORTS`].
pub type PerTransport = [TransferCounters; TRANSPORTS.len()];

/// A worker's transfer counters, in its `PoolStats` (they only grow). Prefill counts what it
/// sent; decode what it received and verified, and how long each verified transfer took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferCounters {
    /// Page bytes this (prefill) worker sent.
    pub bytes_sent: u64,
    /// Page bytes of transfers this (decode) worker verified and sealed.
    pub bytes_received: u64,
    /// Verified transfers, and the sum of their times in microseconds.
    pub transfers: u64,
    pub micros_sum: u64,
    /// Verified transfers per bucket of [`TRANSFER_SECONDS_BOUNDS`] (not cumulative: a
    /// transfer counts in the first bucket whose bound it is within; slower ones in none).
    pub buckets: [u64; TRANSFER_SECONDS_BOUNDS.len()],
}

impl TransferCounters {
    /// Records one verified transfer of `bytes` that took `elapsed`.
    pub fn observe(&mut self, bytes: u64, elapsed: std::time::Duration) {
        self.bytes_received += bytes;
        self.transfers += 1;
        self.micros_sum += elapsed.as_micros() as u64;
        let seconds = elapsed.as_secs_f64();
        if let Some(bucket) = TRANSFER_SECONDS_BOUNDS.iter().position(|&b| seconds <= b) {
            self.buckets[bucket] += 1;
        }
    }
}

wire_enum! {
    /// Why a finished request stopped.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Finish {
        Stop,
        Length,
    }
}

wire_enum! {
    /// Why a request failed; the router maps each to an HTTP status.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Failure {
        /// Cancelled (client gone, or the router gave up).
        Aborted,
        /// Prompt + max_tokens over the context length.
        ContextLengthExceeded,
        /// Prompt + max_tokens over this worker's whole pool.
        PoolTooSmall,
        /// Waited for pages past the queue timeout.
        QueueTimeout,
        /// The worker's queue is full.
        Overloaded,
        /// The transfer was refused by verification, or its link broke.
        TransferFailed,
        /// The transfer did not complete in time.
        TransferTimeout,
        /// A peer could not be reached.
        PeerUnavailable,
        /// The request itself is invalid (empty prompt, token out of range).
        BadRequest,
        Internal,
    }
}

wire_enum! {
    /// Why a decode worker refused a transfer.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Reject {
        /// No reservation for this transfer (never made, already ended, or another request's).
        UnknownTransfer,
        /// Request or tenant differ from the reservation.
        HeaderMismatch,
        /// Page index or byte count outside the reservation.
        BadPage,
        /// Token or page count differ from what the reservation expects.
        LengthMismatch,
        /// A page announced in `Done` never arrived.
        MissingPage,
        /// The bytes do not hash to the sender's checksum.
        ChecksumMismatch,
    }
}

/// The end of a transfer as the sender states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferDone {
    pub transfer: TransferId,
    pub request: RequestId,
    pub tenant: TenantId,
    pub page_count: u32,
    pub token_count: u32,
    pub checksum: u64,
}

wire_enum! {
    /// Which frame a body holds: its first byte after the header. `Frame::kind` and the decoder
    /// both match on this one list, exhaustively, so a frame cannot be added without its byte
    /// or decoded without its fields. Values are fixed by the protocol: never renumber.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(u8)]
    pub enum FrameKind {
        Connect = 1,
        Hello = 2,
        Submit = 3,
        Abort = 4,
        Admitted = 5,
        Started = 6,
        Text = 7,
        Finished = 8,
        Failed = 9,
        PoolStats = 10,
        Page = 11,
        Done = 12,
        TransferAbort = 13,
        Ack = 14,
        Nack = 15,
        AbortAck = 16,
        Challenge = 17,
        Proof = 18,
        GrantAsk = 19,
        WriteGrant = 20,
        WriteAbort = 21,
        WriteAbortAck = 22,
        PromptLogprobs = 23,
        Written = 24,
    }
}

/// One message on a link.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// First frame of every link, from the side that connected, with its challenge.
    Connect {
        peer: PeerRole,
        nonce: [u8; 32],
    },
    /// The worker's own challenge. It carries no proof: the worker proves nothing to a peer
    /// that has not proved itself first.
    Challenge {
        nonce: [u8; 32],
    },
    /// A proof that the sender holds the cluster secret: first the connecting side's, then,
    /// once that one verified, the worker's.
    Proof {
        proof: [u8; 32],
    },
    /// The worker describes itself once the peer is authenticated.
    Hello(WorkerInfo),
    // Router -> worker.
    Submit(Submit),
    Abort {
        request: RequestId,
    },
    // Worker -> router.
    /// Pages are reserved (decode) or allocated (prefill, unified), `cached_pages` of them
    /// (`cached_tokens` prompt tokens) from this worker's prefix cache.
    Admitted {
        request: RequestId,
        cached_tokens: u32,
        cached_pages: u32,
    },
    /// Decode has sealed a verified transfer (or unified has prefilled): answers may start.
    Started {
        request: RequestId,
    },
    /// Text a request may show, and the log-probabilities of the tokens sampled since the
    /// last `Text` (when the request asked for them).
    Text {
        request: RequestId,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Log-probabilities of prompt tokens `first..` (as positions in the prompt), from the
    /// worker that computed them, for a request with `prompt_logprobs`.
    PromptLogprobs {
        request: RequestId,
        first: u32,
        logprobs: Vec<TokenLogprob>,
    },
    Finished {
        request: RequestId,
        finish: Finish,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    Failed {
        request: RequestId,
        failure: Failure,
        message: String,
    },
    PoolStats {
        pages_free: u32,
        pages_total: u32,
        pages_quarantined: u32,
        queue_depth: u32,
        /// Page-ownership checks that failed in a forward step (a bug if ever non-zero).
        ownership_failures: u64,
        /// Transfer frames refused (unknown transfer, header, length or checksum).
        frames_rejected: u64,
        /// Links refused because the peer failed cluster authentication.
        auth_failures: u64,
        prefix: PrefixCounters,
        /// Boxed: its histogram would double the size of every frame.
        transfer: Box<PerTransport>,
        /// The worker is shutting down: it finishes what it has and takes nothing new.
        draining: bool,
    },
    // Prefill -> decode.
    Page {
        transfer: TransferId,
        request: RequestId,
        tenant: TenantId,
        index: u32,
        bytes: PageBytes,
    },
    Done(TransferDone),
    TransferAbort {
        transfer: TransferId,
        request: RequestId,
    },
    // Decode -> prefill.
    /// Verified and sealed: the sender may release its pages.
    Ack {
        transfer: TransferId,
    },
    /// Refused: the receiver has dropped the transfer; the sender may release its pages.
    Nack {
        transfer: TransferId,
        reject: Reject,
    },
    /// The receiver has seen the sender's abort and released its side.
    AbortAck {
        transfer: TransferId,
    },
    // The one-sided transport (prefill and decode on one host, decode's pool mapped by
    // prefill; see `transport::one_sided`).
    /// Prefill -> decode: which of your pool's pages may this transfer's pages be written to?
    /// Binds the reservation to the link it comes on, as a first page frame does.
    GrantAsk {
        transfer: TransferId,
        request: RequestId,
        tenant: TenantId,
    },
    /// Decode -> prefill: the transfer's page `first_index + i` goes to pool page
    /// `pool_pages[i]` (the pages before `first_index` decode holds from its own cache). An
    /// empty grant answers an ask no live reservation takes: write nothing.
    WriteGrant {
        transfer: TransferId,
        first_index: u32,
        pool_pages: Vec<u32>,
    },
    /// Decode -> prefill: the reservation is dropped; stop writing into it and say when
    /// every write already started has landed. Its pages stay quarantined until then.
    WriteAbort {
        transfer: TransferId,
    },
    /// Prefill -> decode: no write of this transfer is in progress or will start.
    WriteAbortAck {
        transfer: TransferId,
    },
    /// Prefill -> decode: the write of the transfer's page `index` has landed, and no other
    /// write of that page will follow; decode may hash it now, while the transfer runs,
    /// instead of at `Done`.
    Written {
        transfer: TransferId,
        index: u32,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("frame ends early: {needed} more bytes needed at offset {offset}")]
    Truncated { offset: usize, needed: usize },
    #[error("frame has {extra} bytes after its last field")]
    TrailingBytes { extra: usize },
    #[error("frame does not start with the Airlock magic")]
    BadMagic,
    #[error("peer speaks protocol version {found}, this build speaks {PROTOCOL_VERSION}")]
    Version { found: u16 },
    #[error("unknown frame kind {kind}")]
    UnknownKind { kind: u8 },
    #[error("unknown {field} value {value}")]
    UnknownEnum { field: &'static str, value: u8 },
    #[error("{field} is {len}, over its cap of {cap}")]
    TooLong {
        field: &'static str,
        len: usize,
        cap: usize,
    },
    #[error("{field} is not UTF-8")]
    NotUtf8 { field: &'static str },
    #[error("frame body is {len} bytes, over the cap of {MAX_FRAME_BYTES}")]
    FrameTooLarge { len: usize },
}

impl Frame {
    /// The body of this frame (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let mut body = self.encode_prefixed();
        body.drain(..4);
        body
    }

    /// The frame as it goes on the wire: a 4-byte little-endian body length, then the body, in
    /// one buffer sized up front (one allocation and one write for a page of KV).
    pub fn encode_prefixed(&self) -> Vec<u8> {
        let payload = match self {
            Frame::Page { bytes, .. } => bytes.len(),
            _ => 0,
        };
        let mut w = Writer(Vec::with_capacity(64 + payload));
        w.u32(0);
        w.bytes(&MAGIC);
        w.u16(PROTOCOL_VERSION);
        w.u8(self.kind() as u8);
        self.encode_fields(&mut w);
        let body_len = (w.0.len() - 4) as u32;
        w.0[..4].copy_from_slice(&body_len.to_le_bytes());
        w.0
    }

    /// [`Frame::encode_prefixed`] in two parts: the length prefix and every field but a page's
    /// bytes, then the page's bytes themselves (`None` for other frames), to be written
    /// together without copying the page (a vectored write).
    pub fn encode_prefixed_split(&self) -> (Vec<u8>, Option<&[u8]>) {
        let Frame::Page {
            transfer,
            request,
            tenant,
            index,
            bytes,
        } = self
        else {
            return (self.encode_prefixed(), None);
        };
        let mut w = Writer(Vec::with_capacity(PAGE_FRAME_OVERHEAD_BYTES_MAX));
        w.u32(0);
        w.bytes(&MAGIC);
        w.u16(PROTOCOL_VERSION);
        w.u8(FrameKind::Page as u8);
        w.u64(transfer.0);
        w.u64(request.0);
        w.u64(tenant.0);
        w.u32(*index);
        w.u32(bytes.len() as u32);
        let body_len = (w.0.len() - 4 + bytes.len()) as u32;
        w.0[..4].copy_from_slice(&body_len.to_le_bytes());
        (w.0, Some(bytes))
    }

    /// [`Frame::decode`] taking the body by value: a page's bytes are moved to the front of
    /// the body's own allocation instead of being copied into a new one.
    pub fn decode_owned(mut body: Vec<u8>) -> Result<Frame, DecodeError> {
        let (mut frame, page) = Frame::decode_inner(&body, true)?;
        if let (Frame::Page { bytes, .. }, Some(range)) = (&mut frame, page) {
            let len = range.len();
            body.copy_within(range, 0);
            body.truncate(len);
            *bytes = PageBytes::Owned(body);
        }
        Ok(frame)
    }

    /// Parses one frame body; never panics, whatever the bytes.
    pub fn decode(body: &[u8]) -> Result<Frame, DecodeError> {
        Frame::decode_inner(body, false).map(|(frame, _)| frame)
    }

    /// Parses `body`; with `defer_page_copy`, a page frame comes back with empty `bytes` and
    /// the range of `body` they are in, for the caller to move.
    fn decode_inner(
        body: &[u8],
        defer_page_copy: bool,
    ) -> Result<(Frame, Option<std::ops::Range<usize>>), DecodeError> {
        if body.len() > MAX_FRAME_BYTES {
            return Err(DecodeError::FrameTooLarge { len: body.len() });
        }
        let mut r = Reader {
            body,
            offset: 0,
            defer_page_copy,
            page_range: None,
        };
        if r.take(2)? != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = r.u16()?;
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::Version { found: version });
        }
        let kind = r.u8()?;
        let kind =
            FrameKind::from_wire(kind, "kind").map_err(|_| DecodeError::UnknownKind { kind })?;
        let frame = Frame::decode_fields(kind, &mut r)?;
        if r.offset != body.len() {
            return Err(DecodeError::TrailingBytes {
                extra: body.len() - r.offset,
            });
        }
        Ok((frame, r.page_range))
    }

    /// Which kind of frame this is.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Connect { .. } => FrameKind::Connect,
            Frame::Hello(_) => FrameKind::Hello,
            Frame::Submit(_) => FrameKind::Submit,
            Frame::Abort { .. } => FrameKind::Abort,
            Frame::Admitted { .. } => FrameKind::Admitted,
            Frame::Started { .. } => FrameKind::Started,
            Frame::Text { .. } => FrameKind::Text,
            Frame::PromptLogprobs { .. } => FrameKind::PromptLogprobs,
            Frame::Finished { .. } => FrameKind::Finished,
            Frame::Failed { .. } => FrameKind::Failed,
            Frame::PoolStats { .. } => FrameKind::PoolStats,
            Frame::Page { .. } => FrameKind::Page,
            Frame::Done(_) => FrameKind::Done,
            Frame::TransferAbort { .. } => FrameKind::TransferAbort,
            Frame::Ack { .. } => FrameKind::Ack,
            Frame::Nack { .. } => FrameKind::Nack,
            Frame::AbortAck { .. } => FrameKind::AbortAck,
            Frame::GrantAsk { .. } => FrameKind::GrantAsk,
            Frame::WriteGrant { .. } => FrameKind::WriteGrant,
            Frame::WriteAbort { .. } => FrameKind::WriteAbort,
            Frame::WriteAbortAck { .. } => FrameKind::WriteAbortAck,
            Frame::Written { .. } => FrameKind::Written,
            Frame::Challenge { .. } => FrameKind::Challenge,
            Frame::Proof { .. } => FrameKind::Proof,
        }
    }

    fn encode_fields(&self, w: &mut Writer) {
        match self {
            Frame::Connect { peer, nonce } => {
                w.u8(*peer as u8);
                w.bytes(nonce);
            }
            Frame::Challenge { nonce } => w.bytes(nonce),
            Frame::Proof { proof } => w.bytes(proof),
            Frame::Hello(info) => {
                w.u8(info.role as u8);
                w.string(&info.name);
                w.string(&info.model_id);
                w.u64(info.weights_hash);
                w.string(&info.kv_dtype);
                w.u32(info.layer_count);
                w.u32(info.kv_head_count);
                w.u32(info.head_dim);
                w.u32(info.page_size_tokens);
                w.u64(info.capacity_tokens);
                w.u32(info.context_length);
                w.u64(info.weight_bytes);
                w.u64(info.kv_bytes);
                w.u64(info.epoch);
            }
            Frame::Submit(submit) => encode_submit(w, submit),
            Frame::Abort { request } | Frame::Started { request } => w.u64(request.0),
            Frame::Admitted {
                request,
                cached_tokens,
                cached_pages,
            } => {
                w.u64(request.0);
                w.u32(*cached_tokens);
                w.u32(*cached_pages);
            }
            Frame::Text {
                request,
                text,
                logprobs,
            } => {
                w.u64(request.0);
                w.string(text);
                encode_logprobs(w, logprobs);
            }
            Frame::PromptLogprobs {
                request,
                first,
                logprobs,
            } => {
                w.u64(request.0);
                w.u32(*first);
                encode_logprobs(w, logprobs);
            }
            Frame::Finished {
                request,
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                w.u64(request.0);
                w.u8(*finish as u8);
                w.u32(*prompt_tokens);
                w.u32(*completion_tokens);
            }
            Frame::Failed {
                request,
                failure,
                message,
            } => {
                w.u64(request.0);
                w.u8(*failure as u8);
                w.string(message);
            }
            Frame::PoolStats {
                pages_free,
                pages_total,
                pages_quarantined,
                queue_depth,
                ownership_failures,
                frames_rejected,
                auth_failures,
                prefix,
                transfer,
                draining,
            } => {
                w.u32(*pages_free);
                w.u32(*pages_total);
                w.u32(*pages_quarantined);
                w.u32(*queue_depth);
                w.u64(*ownership_failures);
                w.u64(*frames_rejected);
                w.u64(*auth_failures);
                for counter in [
                    prefix.lookups,
                    prefix.hit_pages,
                    prefix.hit_tokens,
                    prefix.evictions,
                    prefix.cached_pages,
                    prefix.prefilled_tokens,
                    prefix.pages_sent,
                    prefix.pages_not_sent,
                ] {
                    w.u64(counter);
                }
                for counters in transfer.iter() {
                    for counter in [
                        counters.bytes_sent,
                        counters.bytes_received,
                        counters.transfers,
                        counters.micros_sum,
                    ] {
                        w.u64(counter);
                    }
                    for bucket in counters.buckets {
                        w.u64(bucket);
                    }
                }
                w.u8(u8::from(*draining));
            }
            Frame::Page {
                transfer,
                request,
                tenant,
                index,
                bytes,
            } => {
                w.u64(transfer.0);
                w.u64(request.0);
                w.u64(tenant.0);
                w.u32(*index);
                w.u32(bytes.len() as u32);
                w.bytes(bytes);
            }
            Frame::Done(done) => {
                w.u64(done.transfer.0);
                w.u64(done.request.0);
                w.u64(done.tenant.0);
                w.u32(done.page_count);
                w.u32(done.token_count);
                w.u64(done.checksum);
            }
            Frame::TransferAbort { transfer, request } => {
                w.u64(transfer.0);
                w.u64(request.0);
            }
            Frame::Ack { transfer }
            | Frame::AbortAck { transfer }
            | Frame::WriteAbort { transfer }
            | Frame::WriteAbortAck { transfer } => w.u64(transfer.0),
            Frame::Written { transfer, index } => {
                w.u64(transfer.0);
                w.u32(*index);
            }
            Frame::GrantAsk {
                transfer,
                request,
                tenant,
            } => {
                w.u64(transfer.0);
                w.u64(request.0);
                w.u64(tenant.0);
            }
            Frame::WriteGrant {
                transfer,
                first_index,
                pool_pages,
            } => {
                w.u64(transfer.0);
                w.u32(*first_index);
                w.u32(pool_pages.len() as u32);
                for &page in pool_pages {
                    w.u32(page);
                }
            }
            Frame::Nack { transfer, reject } => {
                w.u64(transfer.0);
                w.u8(*reject as u8);
            }
        }
    }

    fn decode_fields(kind: FrameKind, r: &mut Reader) -> Result<Frame, DecodeError> {
        let frame = match kind {
            FrameKind::Connect => Frame::Connect {
                peer: PeerRole::from_wire(r.u8()?, "peer")?,
                nonce: r.array()?,
            },
            FrameKind::Challenge => Frame::Challenge { nonce: r.array()? },
            FrameKind::Proof => Frame::Proof { proof: r.array()? },
            FrameKind::Hello => Frame::Hello(WorkerInfo {
                role: Role::from_wire(r.u8()?, "role")?,
                name: r.string("name")?,
                model_id: r.string("model_id")?,
                weights_hash: r.u64()?,
                kv_dtype: r.string("kv_dtype")?,
                layer_count: r.u32()?,
                kv_head_count: r.u32()?,
                head_dim: r.u32()?,
                page_size_tokens: r.u32()?,
                capacity_tokens: r.u64()?,
                context_length: r.u32()?,
                weight_bytes: r.u64()?,
                kv_bytes: r.u64()?,
                epoch: r.u64()?,
            }),
            FrameKind::Submit => Frame::Submit(decode_submit(r)?),
            FrameKind::Abort => Frame::Abort {
                request: RequestId(r.u64()?),
            },
            FrameKind::Admitted => Frame::Admitted {
                request: RequestId(r.u64()?),
                cached_tokens: r.u32()?,
                cached_pages: r.u32()?,
            },
            FrameKind::Started => Frame::Started {
                request: RequestId(r.u64()?),
            },
            FrameKind::Text => Frame::Text {
                request: RequestId(r.u64()?),
                text: r.string("text")?,
                logprobs: decode_logprobs(r)?,
            },
            FrameKind::PromptLogprobs => Frame::PromptLogprobs {
                request: RequestId(r.u64()?),
                first: r.u32()?,
                logprobs: decode_logprobs(r)?,
            },
            FrameKind::Finished => Frame::Finished {
                request: RequestId(r.u64()?),
                finish: Finish::from_wire(r.u8()?, "finish")?,
                prompt_tokens: r.u32()?,
                completion_tokens: r.u32()?,
            },
            FrameKind::Failed => Frame::Failed {
                request: RequestId(r.u64()?),
                failure: Failure::from_wire(r.u8()?, "failure")?,
                message: r.string("message")?,
            },
            FrameKind::PoolStats => Frame::PoolStats {
                pages_free: r.u32()?,
                pages_total: r.u32()?,
                pages_quarantined: r.u32()?,
                queue_depth: r.u32()?,
                ownership_failures: r.u64()?,
                frames_rejected: r.u64()?,
                auth_failures: r.u64()?,
                prefix: PrefixCounters {
                    lookups: r.u64()?,
                    hit_pages: r.u64()?,
                    hit_tokens: r.u64()?,
                    evictions: r.u64()?,
                    cached_pages: r.u64()?,
                    prefilled_tokens: r.u64()?,
                    pages_sent: r.u64()?,
                    pages_not_sent: r.u64()?,
                },
                transfer: {
                    let mut per_transport = Box::<PerTransport>::default();
                    for counters in per_transport.iter_mut() {
                        *counters = TransferCounters {
                            bytes_sent: r.u64()?,
                            bytes_received: r.u64()?,
                            transfers: r.u64()?,
                            micros_sum: r.u64()?,
                            buckets: {
                                let mut buckets = [0; TRANSFER_SECONDS_BOUNDS.len()];
                                for bucket in &mut buckets {
                                    *bucket = r.u64()?;
                                }
                                buckets
                            },
                        };
                    }
                    per_transport
                },
                draining: match r.u8()? {
                    0 => false,
                    1 => true,
                    value => {
                        return Err(DecodeError::UnknownEnum {
                            field: "draining",
                            value,
                        })
                    }
                },
            },
            FrameKind::Page => {
                let transfer = TransferId(r.u64()?);
                let request = RequestId(r.u64()?);
                let tenant = TenantId(r.u64()?);
                let index = r.u32()?;
                let len = r.u32()? as usize;
                let bytes = r.page_bytes(len)?;
                Frame::Page {
                    transfer,
                    request,
                    tenant,
                    index,
                    bytes: PageBytes::Owned(bytes),
                }
            }
            FrameKind::Done => Frame::Done(TransferDone {
                transfer: TransferId(r.u64()?),
                request: RequestId(r.u64()?),
                tenant: TenantId(r.u64()?),
                page_count: r.u32()?,
                token_count: r.u32()?,
                checksum: r.u64()?,
            }),
            FrameKind::TransferAbort => Frame::TransferAbort {
                transfer: TransferId(r.u64()?),
                request: RequestId(r.u64()?),
            },
            FrameKind::Ack => Frame::Ack {
                transfer: TransferId(r.u64()?),
            },
            FrameKind::Nack => Frame::Nack {
                transfer: TransferId(r.u64()?),
                reject: Reject::from_wire(r.u8()?, "reject")?,
            },
            FrameKind::AbortAck => Frame::AbortAck {
                transfer: TransferId(r.u64()?),
            },
            FrameKind::GrantAsk => Frame::GrantAsk {
                transfer: TransferId(r.u64()?),
                request: RequestId(r.u64()?),
                tenant: TenantId(r.u64()?),
            },
            FrameKind::WriteGrant => {
                let transfer = TransferId(r.u64()?);
                let first_index = r.u32()?;
                let len = r.count("pool_pages", MAX_GRANT_PAGES, 4)?;
                let mut pool_pages = Vec::with_capacity(len);
                for _ in 0..len {
                    pool_pages.push(r.u32()?);
                }
                Frame::WriteGrant {
                    transfer,
                    first_index,
                    pool_pages,
                }
            }
            FrameKind::WriteAbort => Frame::WriteAbort {
                transfer: TransferId(r.u64()?),
            },
            FrameKind::WriteAbortAck => Frame::WriteAbortAck {
                transfer: TransferId(r.u64()?),
            },
            FrameKind::Written => Frame::Written {
                transfer: TransferId(r.u64()?),
                index: r.u32()?,
            },
        };
        Ok(frame)
    }
}

fn encode_submit(w: &mut Writer, submit: &Submit) {
    w.u64(submit.request.0);
    w.u64(submit.tenant.0);
    w.u32(submit.prompt.len() as u32);
    for &token in &submit.prompt {
        w.u32(token);
    }
    w.u32(submit.max_tokens);
    w.f32(submit.sampling.temperature);
    w.f32(submit.sampling.top_p);
    w.u32(submit.sampling.top_k);
    w.f32(submit.sampling.min_p);
    w.f32(submit.sampling.presence_penalty);
    w.f32(submit.sampling.frequency_penalty);
    w.f32(submit.sampling.repetition_penalty);
    w.u32(submit.sampling.logit_bias.len() as u32);
    for &(token, bias) in &submit.sampling.logit_bias {
        w.u32(token);
        w.f32(bias);
    }
    w.u64(submit.sampling.seed);
    match submit.sampling.logprobs {
        None => w.u8(0),
        Some(top) => {
            w.u8(1);
            w.u8(top);
        }
    }
    w.u8(submit.sampling.prompt_logprobs as u8);
    match &submit.sampling.constraint {
        None => w.u8(0),
        Some(shape) => {
            w.u8(1);
            w.string(shape);
        }
    }
    w.u8(submit.stop.len() as u8);
    for stop in &submit.stop {
        w.string(stop);
    }
    w.u8(submit.ignore_eos as u8);
    match submit.prefix_cache {
        None => w.u8(0),
        Some(partition) => {
            w.u8(1);
            w.u64(partition.0);
        }
    }
    match &submit.plan {
        Plan::Unified => w.u8(0),
        Plan::Prefill {
            transfer,
            decode_addr,
            decode_holds_pages,
        } => {
            w.u8(1);
            w.u64(transfer.0);
            w.string(decode_addr);
            w.u32(*decode_holds_pages);
        }
        Plan::Decode { transfer } => {
            w.u8(2);
            w.u64(transfer.0);
        }
    }
    match &submit.trace {
        None => w.u8(0),
        Some(context) => {
            w.u8(1);
            w.bytes(&context.trace_id);
            w.bytes(&context.span_id);
        }
    }
}

fn decode_submit(r: &mut Reader) -> Result<Submit, DecodeError> {
    let request = RequestId(r.u64()?);
    let tenant = TenantId(r.u64()?);
    let prompt_len = r.count("prompt", MAX_PROMPT_TOKENS, 4)?;
    let mut prompt = Vec::with_capacity(prompt_len);
    for _ in 0..prompt_len {
        prompt.push(r.u32()?);
    }
    let max_tokens = r.u32()?;
    let temperature = r.f32()?;
    let top_p = r.f32()?;
    let top_k = r.u32()?;
    let min_p = r.f32()?;
    let presence_penalty = r.f32()?;
    let frequency_penalty = r.f32()?;
    let repetition_penalty = r.f32()?;
    let bias_count = r.count("logit_bias", MAX_LOGIT_BIAS, 8)?;
    let mut logit_bias = Vec::with_capacity(bias_count);
    for _ in 0..bias_count {
        logit_bias.push((r.u32()?, r.f32()?));
    }
    let sampling = Sampling {
        temperature,
        top_p,
        top_k,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias,
        seed: r.u64()?,
        logprobs: match r.flag("logprobs")? {
            true => Some(r.bounded_u8("logprobs", MAX_TOP_LOGPROBS)?),
            false => None,
        },
        prompt_logprobs: r.flag("prompt_logprobs")?,
        constraint: match r.flag("constraint")? {
            true => Some(r.string("constraint")?),
            false => None,
        },
    };
    let stop_count = r.u8()? as usize;
    if stop_count > MAX_STOP_STRINGS {
        return Err(DecodeError::TooLong {
            field: "stop",
            len: stop_count,
            cap: MAX_STOP_STRINGS,
        });
    }
    let mut stop = Vec::with_capacity(stop_count);
    for _ in 0..stop_count {
        stop.push(r.string("stop")?);
    }
    let ignore_eos = r.flag("ignore_eos")?;
    let prefix_cache = match r.u8()? {
        0 => None,
        1 => Some(Partition(r.u64()?)),
        value => {
            return Err(DecodeError::UnknownEnum {
                field: "prefix_cache",
                value,
            })
        }
    };
    let plan = match r.u8()? {
        0 => Plan::Unified,
        1 => Plan::Prefill {
            transfer: TransferId(r.u64()?),
            decode_addr: r.string("decode_addr")?,
            decode_holds_pages: r.u32()?,
        },
        2 => Plan::Decode {
            transfer: TransferId(r.u64()?),
        },
        value => {
            return Err(DecodeError::UnknownEnum {
                field: "plan",
                value,
            })
        }
    };
    let trace = match r.flag("trace")? {
        true => Some(otlp::TraceContext {
            trace_id: r.array()?,
            span_id: r.array()?,
        }),
        false => None,
    };
    Ok(Submit {
        request,
        tenant,
        prompt,
        max_tokens,
        sampling,
        stop,
        ignore_eos,
        prefix_cache,
        plan,
        trace,
    })
}

fn encode_logprobs(w: &mut Writer, logprobs: &[TokenLogprob]) {
    w.u32(logprobs.len() as u32);
    for entry in logprobs {
        w.u32(entry.token);
        w.f32(entry.logprob);
        w.u8(entry.top.len() as u8);
        for &(token, logprob) in &entry.top {
            w.u32(token);
            w.f32(logprob);
        }
    }
}

fn decode_logprobs(r: &mut Reader) -> Result<Vec<TokenLogprob>, DecodeError> {
    let count = r.count("logprobs", MAX_TEXT_LOGPROBS, 9)?;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        let token = r.u32()?;
        let logprob = r.f32()?;
        let top_count = r.bounded_u8("top_logprobs", MAX_TOP_LOGPROBS)?;
        let mut top = Vec::with_capacity(top_count.into());
        for _ in 0..top_count {
            top.push((r.u32()?, r.f32()?));
        }
        entries.push(TokenLogprob {
            token,
            logprob,
            top,
        });
    }
    Ok(entries)
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, value: u8) {
        self.0.push(value);
    }
    fn u16(&mut self, value: u16) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn u32(&mut self, value: u32) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn u64(&mut self, value: u64) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn f32(&mut self, value: f32) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn bytes(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
    /// Strings longer than the cap are cut at a character boundary: an encoder never makes a
    /// frame its own decoder refuses.
    fn string(&mut self, text: &str) {
        let mut end = text.len().min(MAX_STRING_BYTES);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.bytes(&text.as_bytes()[..end]);
    }
}

struct Reader<'a> {
    body: &'a [u8],
    offset: usize,
    /// Leave a page's bytes in place and record where they are (`Frame::decode_owned`).
    defer_page_copy: bool,
    page_range: Option<std::ops::Range<usize>>,
}

impl<'a> Reader<'a> {
    /// A page's `len` bytes: copied out, or (deferred) left where they are, their range noted.
    fn page_bytes(&mut self, len: usize) -> Result<Vec<u8>, DecodeError> {
        let start = self.offset;
        let bytes = self.take(len)?;
        if self.defer_page_copy {
            self.page_range = Some(start..start + len);
            return Ok(Vec::new());
        }
        Ok(bytes.to_vec())
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], DecodeError> {
        let rest = self.body.len() - self.offset;
        if len > rest {
            return Err(DecodeError::Truncated {
                offset: self.offset,
                needed: len - rest,
            });
        }
        let bytes = &self.body[self.offset..self.offset + len];
        self.offset += len;
        Ok(bytes)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let bytes = self.take(N)?;
        Ok(bytes.try_into().expect("take returned exactly N bytes"))
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn f32(&mut self) -> Result<f32, DecodeError> {
        Ok(f32::from_le_bytes(self.array()?))
    }
    /// A count of items of `item_bytes` each, checked against its cap and against the bytes
    /// left, before the caller allocates for it.
    fn count(
        &mut self,
        field: &'static str,
        cap: usize,
        item_bytes: usize,
    ) -> Result<usize, DecodeError> {
        let len = self.u32()? as usize;
        if len > cap {
            return Err(DecodeError::TooLong { field, len, cap });
        }
        let rest = self.body.len() - self.offset;
        if len * item_bytes > rest {
            return Err(DecodeError::Truncated {
                offset: self.offset,
                needed: len * item_bytes - rest,
            });
        }
        Ok(len)
    }
    /// A one-byte flag: 0 or 1.
    fn flag(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(DecodeError::UnknownEnum { field, value }),
        }
    }
    /// A one-byte count, at most `cap`.
    fn bounded_u8(&mut self, field: &'static str, cap: usize) -> Result<u8, DecodeError> {
        let value = self.u8()?;
        if usize::from(value) > cap {
            return Err(DecodeError::TooLong {
                field,
                len: value.into(),
                cap,
            });
        }
        Ok(value)
    }
    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let len = self.count(field, MAX_STRING_BYTES, 1)?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| DecodeError::NotUtf8 { field })
    }
}
