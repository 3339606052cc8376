//! The start of every link, on the raw stream before frames flow: authenticate both sides
//! (I11), then the worker describes itself and the connecting side checks every field that
//! must match (I8): model, weights hash, KV dtype, page size, shape, context length. The
//! protocol version is checked on every frame by the decoder.

use crate::auth::{nonce, ClusterSecret, CLIENT_LABEL, SERVER_LABEL};
use crate::transport::{read_frame_limited, write_frame, ByteStream, LinkError};
use crate::{DecodeError, Frame, PeerRole, WorkerInfo};
use std::time::Duration;

/// How long either side waits for each handshake frame.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest handshake frame: nobody gets to make us allocate before proving the secret.
pub(crate) const HANDSHAKE_FRAME_BYTES_MAX: usize = 16 << 10;

/// Why a link was refused at its start.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("the peer failed cluster authentication (wrong or missing cluster secret)")]
    Auth,
    #[error("the peer speaks another protocol version: {0}")]
    Version(DecodeError),
    #[error("the peer broke the handshake: {0}")]
    Protocol(String),
    #[error("the peer did not answer in time")]
    Timeout,
    #[error("link I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("worker mismatch: its {field} is {found}, expected {expected}")]
    Mismatch {
        field: &'static str,
        found: String,
        expected: String,
    },
}

impl HandshakeError {
    /// Short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Auth => "auth",
            HandshakeError::Version(_) => "protocol_version",
            HandshakeError::Protocol(_) | HandshakeError::Io(_) => "handshake",
            HandshakeError::Timeout => "timeout",
            HandshakeError::Mismatch { field, .. } => field,
        }
    }
}

/// What a worker must match to be used: the model (id, weights, shape), the KV layout and the
/// context length.
#[derive(Clone, Debug, PartialEq)]
pub struct Expectation {
    pub model_id: String,
    pub weights_hash: u64,
    pub kv_dtype: String,
    pub page_size_tokens: u32,
    pub layer_count: u32,
    pub kv_head_count: u32,
    pub head_dim: u32,
    /// `None` accepts any context length (a router then admits up to the smallest).
    pub context_length: Option<u32>,
}

impl Expectation {
    /// The first field of `info` that differs from what is expected.
    pub fn check(&self, info: &WorkerInfo) -> Result<(), HandshakeError> {
        let context = |n: Option<u32>| n.map_or_else(|| "any".to_string(), |n| n.to_string());
        let expected_context = match self.context_length {
            None => context(Some(info.context_length)),
            some => context(some),
        };
        let fields: [(&'static str, String, String); 8] = [
            ("model_id", info.model_id.clone(), self.model_id.clone()),
            (
                "weights_hash",
                format!("{:016x}", info.weights_hash),
                format!("{:016x}", self.weights_hash),
            ),
            ("kv_dtype", info.kv_dtype.clone(), self.kv_dtype.clone()),
            (
                "page_size",
                info.page_size_tokens.to_string(),
                self.page_size_tokens.to_string(),
            ),
            (
                "layers",
                info.layer_count.to_string(),
                self.layer_count.to_string(),
            ),
            (
                "kv_heads",
                info.kv_head_count.to_string(),
                self.kv_head_count.to_string(),
            ),
            (
                "head_dim",
                info.head_dim.to_string(),
                self.head_dim.to_string(),
            ),
            (
                "context_length",
                info.context_length.to_string(),
                expected_context,
            ),
        ];
        for (field, found, expected) in fields {
            if found != expected {
                return Err(HandshakeError::Mismatch {
                    field,
                    found,
                    expected,
                });
            }
        }
        Ok(())
    }

    /// What a worker described by `info` expects of its peers.
    pub fn of(info: &WorkerInfo) -> Expectation {
        Expectation {
            model_id: info.model_id.clone(),
            weights_hash: info.weights_hash,
            kv_dtype: info.kv_dtype.clone(),
            page_size_tokens: info.page_size_tokens,
            layer_count: info.layer_count,
            kv_head_count: info.kv_head_count,
            head_dim: info.head_dim,
            context_length: Some(info.context_length),
        }
    }
}

async fn read<S: ByteStream>(stream: &mut S) -> Result<Frame, HandshakeError> {
    let frame = read_frame_limited(stream, HANDSHAKE_FRAME_BYTES_MAX);
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, frame).await {
        Err(_) => Err(HandshakeError::Timeout),
        Ok(Ok(Some(frame))) => Ok(frame),
        Ok(Ok(None)) => Err(HandshakeError::Protocol("the peer closed the link".into())),
        Ok(Err(LinkError::Decode(error @ DecodeError::Version { .. }))) => {
            Err(HandshakeError::Version(error))
        }
        Ok(Err(LinkError::Io(error))) => Err(HandshakeError::Io(error)),
        Ok(Err(error)) => Err(HandshakeError::Protocol(error.to_string())),
    }
}

/// The connecting side: send our challenge, prove ourselves against the worker's, then check
/// the worker's proof and its `Hello` against `expect`.
///
/// We prove first: the side that accepts connections hands no proof to a peer that has not
/// shown it holds the secret, so anyone who can reach a worker port can collect nothing to
/// guess the secret from. We connect only to addresses we were given.
pub async fn connect_handshake<S: ByteStream>(
    stream: &mut S,
    peer: PeerRole,
    secret: &ClusterSecret,
    expect: &Expectation,
) -> Result<WorkerInfo, HandshakeError> {
    let client_nonce = nonce();
    write_frame(
        stream,
        &Frame::Connect {
            peer,
            nonce: client_nonce,
        },
    )
    .await?;
    let server_nonce = match read(stream).await? {
        Frame::Challenge { nonce } => nonce,
        _ => return Err(HandshakeError::Protocol("expected a challenge".into())),
    };
    let proof = secret.proof(CLIENT_LABEL, &client_nonce, &server_nonce);
    write_frame(stream, &Frame::Proof { proof }).await?;
    // A worker that hangs up now did not accept our proof: it holds another secret.
    let server_proof = match read(stream).await {
        Ok(Frame::Proof { proof }) => proof,
        Ok(_) => return Err(HandshakeError::Protocol("expected a proof".into())),
        Err(HandshakeError::Protocol(_) | HandshakeError::Io(_)) => {
            return Err(HandshakeError::Auth)
        }
        Err(error) => return Err(error),
    };
    if !secret.verify(SERVER_LABEL, &client_nonce, &server_nonce, &server_proof) {
        return Err(HandshakeError::Auth);
    }
    let info = match read(stream).await? {
        Frame::Hello(info) => info,
        _ => return Err(HandshakeError::Protocol("expected a hello".into())),
    };
    expect.check(&info)?;
    Ok(info)
}

/// The worker's side: send our challenge, check the peer's proof, and only then prove
/// ourselves and describe ourselves.
pub async fn accept_handshake<S: ByteStream>(
    stream: &mut S,
    secret: &ClusterSecret,
    info: &WorkerInfo,
) -> Result<PeerRole, HandshakeError> {
    let (peer, client_nonce) = match read(stream).await? {
        Frame::Connect { peer, nonce } => (peer, nonce),
        _ => return Err(HandshakeError::Protocol("expected a connect".into())),
    };
    let server_nonce = nonce();
    write_frame(
        stream,
        &Frame::Challenge {
            nonce: server_nonce,
        },
    )
    .await?;
    let client_proof = match read(stream).await? {
        Frame::Proof { proof } => proof,
        _ => return Err(HandshakeError::Protocol("expected a proof".into())),
    };
    if !secret.verify(CLIENT_LABEL, &client_nonce, &server_nonce, &client_proof) {
        return Err(HandshakeError::Auth);
    }
    let proof = secret.proof(SERVER_LABEL, &client_nonce, &server_nonce);
    write_frame(stream, &Frame::Proof { proof }).await?;
    write_frame(stream, &Frame::Hello(info.clone())).await?;
    Ok(peer)
}
