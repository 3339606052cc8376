//! Links between processes: length-prefixed frames over any byte stream, and the two ways to
//! get a stream: TCP, or an in-process pipe registered under a name.
//!
//! Everything above this module sees a link as two channels of decoded [`Frame`]s; a link
//! that breaks (EOF, I/O error, an undecodable frame) closes its inbound channel, which is how
//! a worker learns that a peer is gone and that no more bytes can arrive from it.

use crate::{
    DecodeError, Frame, FrameKind, SenderHashes, TransferDone, TransferId, MAX_FRAME_BYTES,
};
use kv::{LentPageMut, RequestId, TenantId};
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A bidirectional byte stream a link can run over.
pub trait ByteStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> ByteStream for T {}

pub type BoxStream = Box<dyn ByteStream>;
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Opens streams to addresses. TCP takes `host:port`; in-process takes a registered name.
pub trait Transport: Send + Sync + 'static {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>>;
}

/// Why a link stopped.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("link I/O: {0}")]
    Io(#[from] io::Error),
    #[error("peer sent a frame of {len} bytes, over the cap of {MAX_FRAME_BYTES}")]
    FrameTooLarge { len: usize },
    #[error("peer sent an undecodable frame: {0}")]
    Decode(#[from] DecodeError),
}

/// Reads one frame; `Ok(None)` at a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Option<Frame>, LinkError> {
    read_frame_limited(reader, MAX_FRAME_BYTES).await
}

/// [`read_frame`] with a smaller cap, for frames from a peer not yet authenticated.
pub async fn read_frame_limited<R: AsyncRead + Unpin>(
    reader: &mut R,
    max_bytes: usize,
) -> Result<Option<Frame>, LinkError> {
    let Some(len) = read_length(reader, max_bytes).await? else {
        return Ok(None);
    };
    let mut body = Vec::with_capacity(len);
    read_more(reader, &mut body, len).await?;
    Ok(Some(Frame::decode_owned(body)?))
}

/// A frame's length prefix, checked against `max_bytes`; `Ok(None)` at a clean end of stream
/// between frames.
async fn read_length<R: AsyncRead + Unpin>(
    reader: &mut R,
    max_bytes: usize,
) -> Result<Option<usize>, LinkError> {
    let mut len_bytes = [0u8; 4];
    match reader.read_exact(&mut len_bytes).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len_bytes) as usize;
    if len > max_bytes {
        return Err(LinkError::FrameTooLarge { len });
    }
    Ok(Some(len))
}

/// Appends exactly `len` more bytes of the stream to `body`, read into its spare capacity (a
/// page-sized body is not zeroed first only to be overwritten).
async fn read_more<R: AsyncRead + Unpin>(
    reader: &mut R,
    body: &mut Vec<u8>,
    len: usize,
) -> Result<(), LinkError> {
    let read = (&mut *reader).take(len as u64).read_to_end(body).await?;
    if read < len {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(())
}

/// A `Page` frame's fields, read before its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageHeader {
    pub transfer: TransferId,
    pub request: RequestId,
    pub tenant: TenantId,
    pub index: u32,
    /// Bytes that follow.
    pub len: usize,
}

/// Where a link's reader puts the bytes of the page frames it receives: the receiving
/// worker's live reservations. The reader reads a page frame's header, asks for the page it
/// may land in, and reads the bytes from the socket straight into it; no buffer holds them,
/// and nothing of the engine runs per page.
pub trait PageSink: Send + Sync + 'static {
    /// The reserved page this frame's bytes go into, exactly `header.len` bytes long, or
    /// `None` to read and drop them (the sink has recorded why).
    fn claim(&self, header: &PageHeader) -> Option<LentPageMut>;
    /// `page` holds the bytes of `header`'s frame.
    fn landed(&self, header: &PageHeader, page: LentPageMut);
    /// `done` arrived on this link, after every page frame before it landed: no byte of its
    /// transfer may land once this returns. Called before the frame is passed on.
    fn closing(&self, done: &TransferDone);
    /// A one-sided prefill asks where `transfer`'s pages may be written: the answer to send
    /// back (`WriteGrant`, or `Nack`). Answered by the reader, so a grant never waits for the
    /// engine's step. A sink that takes frames only refuses.
    fn grant(&self, transfer: TransferId, _request: RequestId, _tenant: TenantId) -> Frame {
        Frame::Nack {
            transfer,
            reject: crate::Reject::UnknownTransfer,
        }
    }
    /// A one-sided prefill's write of `transfer`'s page `index` has landed, and is the
    /// page's last: the sink may hash it now. A sink that takes frames only ignores it.
    fn written(&self, _transfer: TransferId, _index: u32) {}
}

/// A page frame's body up to its bytes: magic, version, kind, transfer, request, tenant,
/// index, byte count.
const PAGE_HEAD_BYTES: usize = 2 + 2 + 1 + 8 + 8 + 8 + 4 + 4;

/// Scratch for the bytes of a page frame no reservation takes: read and dropped in pieces.
const DISCARD_CHUNK_BYTES: usize = 64 << 10;

/// Reads one frame with `sink` taking page bytes: `Ok(Some(None))` for a page frame consumed
/// (landed or dropped), `Ok(Some(Some(frame)))` for any other frame, `Ok(None)` at a clean end
/// of stream. Memory per frame: a page lands where it belongs, a dropped one passes through
/// 64 KiB of scratch, other frames are small.
async fn read_frame_into<R: AsyncRead + Unpin>(
    reader: &mut R,
    sink: &dyn PageSink,
) -> Result<Option<Option<Frame>>, LinkError> {
    let Some(len) = read_length(reader, MAX_FRAME_BYTES).await? else {
        return Ok(None);
    };
    let mut head = [0u8; PAGE_HEAD_BYTES];
    let head_len = len.min(PAGE_HEAD_BYTES);
    reader.read_exact(&mut head[..head_len]).await?;
    let header = page_header(&head[..head_len], len);
    let Some(header) = header else {
        // Not a well-formed page frame: the whole body through the decoder, which says why.
        let mut body = Vec::with_capacity(len);
        body.extend_from_slice(&head[..head_len]);
        read_more(reader, &mut body, len - head_len).await?;
        let frame = Frame::decode_owned(body)?;
        if let Frame::Done(done) = &frame {
            sink.closing(done);
        }
        return Ok(Some(Some(frame)));
    };
    match sink.claim(&header) {
        Some(mut page) if page.byte_len() == header.len => {
            reader.read_exact(page.bytes_mut()).await?;
            sink.landed(&header, page);
        }
        claimed => {
            // A sink that hands out a page of the wrong size gets it back untouched.
            if let Some(page) = claimed {
                sink.landed(&header, page);
            }
            let mut scratch = vec![0u8; header.len.min(DISCARD_CHUNK_BYTES)];
            let mut left = header.len;
            while left > 0 {
                let n = left.min(scratch.len());
                reader.read_exact(&mut scratch[..n]).await?;
                left -= n;
            }
        }
    }
    Ok(Some(None))
}

/// The header of a page frame whose body is `len` bytes and starts with `head`, if it is
/// one of this protocol's and its byte count fills the rest of the body exactly.
fn page_header(head: &[u8], len: usize) -> Option<PageHeader> {
    if head.len() < PAGE_HEAD_BYTES
        || head[..2] != crate::frame::MAGIC
        || u16::from_le_bytes([head[2], head[3]]) != crate::PROTOCOL_VERSION
        || head[4] != FrameKind::Page as u8
    {
        return None;
    }
    let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let bytes = u32_at(33) as usize;
    if bytes != len - PAGE_HEAD_BYTES {
        return None;
    }
    Some(PageHeader {
        transfer: TransferId(u64_at(5)),
        request: RequestId(u64_at(13)),
        tenant: TenantId(u64_at(21)),
        index: u32_at(29),
        len: bytes,
    })
}

/// Writes one frame (length prefix and body). A page's bytes go to the stream from where
/// they lie (lent from the pool, for a sender) in the same vectored write as its header.
pub async fn write_frame<W: AsyncWrite + Unpin>(writer: &mut W, frame: &Frame) -> io::Result<()> {
    let (head, payload) = frame.encode_prefixed_split();
    let payload = payload.unwrap_or_default();
    assert!(
        head.len() - 4 + payload.len() <= MAX_FRAME_BYTES,
        "we never build a frame our peer must refuse"
    );
    write_all_two(writer, &head, payload).await
}

/// Writes `first` then `second` with as few calls as the stream allows (a vectored write,
/// where it has one: TCP does, the in-process pipe takes one buffer at a time).
async fn write_all_two<W: AsyncWrite + Unpin>(
    writer: &mut W,
    mut first: &[u8],
    mut second: &[u8],
) -> io::Result<()> {
    while !first.is_empty() {
        let slices = [io::IoSlice::new(first), io::IoSlice::new(second)];
        let written = writer.write_vectored(&slices).await?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if written < first.len() {
            first = &first[written..];
        } else {
            second = &second[written - first.len()..];
            first = &[];
        }
    }
    writer.write_all(second).await
}

/// A running link: send frames with `tx`, receive with `rx`. `rx` yields `None` once the
/// link is down; dropping every `tx` closes the write side.
pub struct Link {
    pub tx: mpsc::UnboundedSender<Frame>,
    pub rx: mpsc::Receiver<Frame>,
    pub tasks: LinkTasks,
}

/// The reader and writer tasks of a link; aborted when dropped, so no task outlives its owner.
pub struct LinkTasks {
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl LinkTasks {
    pub(crate) fn new(reader: JoinHandle<()>, writer: JoinHandle<()>) -> LinkTasks {
        LinkTasks { reader, writer }
    }
}

impl Drop for LinkTasks {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

/// Inbound frames buffered per link before the reader stops reading (TCP backpressure).
const INBOUND_FRAMES_MAX: usize = 256;

/// The link reader's buffer: a few dozen control frames, or a page frame's header and the
/// first bytes of its page.
const READ_BUFFER_BYTES: usize = 4 << 10;

/// Runs a link over `stream`. `name` labels log lines.
pub fn spawn_link(stream: BoxStream, name: String) -> Link {
    spawn_link_with_sink(stream, name, None)
}

/// [`spawn_link`] whose reader lands page frames' bytes through `sink` (a decode worker's
/// link from a prefill worker) instead of passing them on as frames.
pub fn spawn_link_with_sink(
    stream: BoxStream,
    name: String,
    sink: Option<Arc<dyn PageSink>>,
) -> Link {
    spawn_link_announced(stream, name, sink, |_| {})
}

/// [`spawn_link_with_sink`] that first hands the link's sending side to `announce`, and
/// starts reading only once `announce` has returned. A sink reports what it refuses on
/// another path than the link's frames (a decode engine's event queue); announcing the link
/// on that path first means no such report can arrive before the link it names.
pub fn spawn_link_announced(
    stream: BoxStream,
    name: String,
    sink: Option<Arc<dyn PageSink>>,
    announce: impl FnOnce(&mpsc::UnboundedSender<Frame>),
) -> Link {
    spawn_link_full(stream, name, sink, announce, None)
}

/// A prefill worker's link to a decode worker over a byte stream whose writer computes each
/// transfer's `Done` checksum: it hashes each page frame just before writing it (the page is
/// then in cache for the socket's copy) into `hashes`, where the engine puts the hashes of the
/// pages decode holds, and `Done` leaves with the root over them (a page never hashed counts
/// as 0). The engine sends `Done` with no checksum of its own on such a link.
pub fn spawn_hashing_link(stream: BoxStream, name: String, hashes: SenderHashes) -> Link {
    spawn_link_full(stream, name, None, |_| {}, Some(hashes))
}

fn spawn_link_full(
    stream: BoxStream,
    name: String,
    sink: Option<Arc<dyn PageSink>>,
    announce: impl FnOnce(&mpsc::UnboundedSender<Frame>),
    hashes: Option<SenderHashes>,
) -> Link {
    let (read_half, mut write_half) = tokio::io::split(stream);
    // Small frames (a one-sided link's `Written`, one per page) come several to a read; a
    // page's bytes still go from the socket straight into the page, past the buffer, once
    // what the buffer holds of them is copied out.
    let mut read_half = tokio::io::BufReader::with_capacity(READ_BUFFER_BYTES, read_half);
    let (in_tx, in_rx) = mpsc::channel(INBOUND_FRAMES_MAX);
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Frame>();
    announce(&out_tx);
    let reader_name = name.clone();
    // Weak: the reader's answers must not keep the write side open once the owner lets go.
    let answers = out_tx.downgrade();
    let reader = tokio::spawn(async move {
        loop {
            let read = match &sink {
                Some(sink) => read_frame_into(&mut read_half, sink.as_ref()).await,
                None => read_frame(&mut read_half)
                    .await
                    .map(|frame| frame.map(Some)),
            };
            match read {
                Ok(Some(Some(Frame::GrantAsk {
                    transfer,
                    request,
                    tenant,
                }))) if sink.is_some() => {
                    let sink = sink.as_ref().expect("matched");
                    if let Some(answers) = answers.upgrade() {
                        let _ = answers.send(sink.grant(transfer, request, tenant));
                    }
                }
                Ok(Some(Some(Frame::Written { transfer, index }))) if sink.is_some() => {
                    sink.as_ref().expect("matched").written(transfer, index);
                }
                Ok(Some(Some(frame))) => {
                    if in_tx.send(frame).await.is_err() {
                        return;
                    }
                }
                Ok(Some(None)) => {}
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(link = %reader_name, %error, "link closed");
                    return;
                }
            }
        }
    });
    let writer = tokio::spawn(async move {
        while let Some(mut frame) = out_rx.recv().await {
            if let Some(hashes) = &hashes {
                take_hashes(hashes, &mut frame);
            }
            if let Err(error) = write_frame(&mut write_half, &frame).await {
                tracing::warn!(link = %name, %error, "link write failed");
                return;
            }
        }
        let _ = write_half.shutdown().await;
    });
    Link {
        tx: out_tx,
        rx: in_rx,
        tasks: LinkTasks { reader, writer },
    }
}

/// What a hashing link's writer does with `frame` before writing it (`spawn_hashing_link`).
fn take_hashes(hashes: &SenderHashes, frame: &mut Frame) {
    match frame {
        Frame::Page {
            transfer,
            index,
            bytes,
            ..
        } => hashes.put(*transfer, *index, crate::page_hash(bytes)),
        Frame::Done(done) => done.checksum = hashes.take_checksum(done),
        Frame::TransferAbort { transfer, .. } => {
            hashes.forget(*transfer);
        }
        _ => {}
    }
}

/// Plain TCP, `TCP_NODELAY` on (frames are small and latency-bound).
pub struct Tcp;

impl Transport for Tcp {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>> {
        Box::pin(async move {
            let stream = tokio::net::TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            Ok(Box::new(stream) as BoxStream)
        })
    }
}

/// The address prefix of a Unix socket (`unix:/run/airlock/decode.sock`): a worker on this
/// host, reached without TCP, whose prefill links use the one-sided transport. A path that
/// starts with `@` names a socket in Linux's abstract namespace (`unix:@airlock-decode`),
/// which leaves no file behind.
pub const UNIX_PREFIX: &str = "unix:";

/// The socket path of a `unix:` address.
pub fn unix_path(addr: &str) -> Option<&str> {
    addr.strip_prefix(UNIX_PREFIX)
}

/// The abstract-namespace address of an `@name` path.
fn abstract_address(path: &str) -> Option<io::Result<std::os::unix::net::SocketAddr>> {
    use std::os::linux::net::SocketAddrExt;
    let name = path.strip_prefix('@')?;
    Some(std::os::unix::net::SocketAddr::from_abstract_name(
        name.as_bytes(),
    ))
}

/// A stream to the Unix socket at `path` (`@name`: abstract).
pub async fn connect_unix(path: &str) -> io::Result<tokio::net::UnixStream> {
    match abstract_address(path) {
        Some(address) => {
            // A local connect: it completes at once, or fails, unless the listener's backlog
            // is full.
            let stream = std::os::unix::net::UnixStream::connect_addr(&address?)?;
            stream.set_nonblocking(true)?;
            tokio::net::UnixStream::from_std(stream)
        }
        None => tokio::net::UnixStream::connect(path).await,
    }
}

/// Listens on the Unix socket at `path` (`@name`: abstract). Must be called inside a tokio
/// runtime.
pub fn bind_unix(path: &str) -> io::Result<tokio::net::UnixListener> {
    match abstract_address(path) {
        Some(address) => {
            let listener = std::os::unix::net::UnixListener::bind_addr(&address?)?;
            listener.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(listener)
        }
        None => tokio::net::UnixListener::bind(path),
    }
}

/// TCP for `host:port`, a Unix socket for `unix:PATH`: how a router reaches workers of both
/// kinds.
pub struct Net;

impl Transport for Net {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>> {
        Box::pin(async move {
            match unix_path(addr) {
                Some(path) => Ok(Box::new(connect_unix(path).await?) as BoxStream),
                None => Tcp.connect(addr).await,
            }
        })
    }
}

/// Named in-process endpoints joined by in-memory pipes: the same framing and the same
/// protocol as TCP, without sockets (for tests that want many workers and no ports).
#[derive(Clone, Default)]
pub struct InProcess {
    endpoints: Arc<Mutex<HashMap<String, mpsc::Sender<BoxStream>>>>,
}

/// Bytes buffered in each direction of an in-process pipe.
const PIPE_BYTES: usize = 1 << 20;

impl InProcess {
    /// Registers `name` and returns the queue its incoming streams arrive on.
    pub fn bind(&self, name: &str) -> mpsc::Receiver<BoxStream> {
        let (tx, rx) = mpsc::channel(64);
        self.endpoints
            .lock()
            .expect("endpoint map lock is never held across a panic")
            .insert(name.to_string(), tx);
        rx
    }
}

impl Transport for InProcess {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<BoxStream>> {
        Box::pin(async move {
            let endpoint = self
                .endpoints
                .lock()
                .expect("endpoint map lock is never held across a panic")
                .get(addr)
                .cloned();
            let endpoint = endpoint.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!("no endpoint {addr}"),
                )
            })?;
            let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
            endpoint.send(Box::new(theirs)).await.map_err(|_| {
                io::Error::new(io::ErrorKind::ConnectionRefused, format!("{addr} is gone"))
            })?;
            Ok(Box::new(ours) as BoxStream)
        })
    }
}
