//! The one-sided transport: a prefill and a decode worker on one host, linked by a Unix
//! socket. Decode's page pool is a sealed memfd that it passes to prefill at link-up
//! ([`offer_pool`], [`accept_pool`]); prefill copies each page of a transfer straight into the
//! pool page decode granted for it, and the socket carries only control frames.
//!
//! The protocol is the formal model's one-sided one (`crates/spec`, `Transport::OneSided`):
//!
//! - Prefill asks for a grant (`GrantAsk`) on a transfer's first page; decode binds its
//!   reservation to the link and answers with the pool pages (`WriteGrant`). Pages wait on the
//!   prefill side until then.
//! - A page write is *posted*: it runs on the link's copy thread, behind the writes posted
//!   before it, while the link goes on (`copier`; non-temporal stores, since decode's cores
//!   read the page, not prefill's). The writer never waits for a copy to post the next, so
//!   the copy thread always has the transfer's next page; a write of a transfer decode has
//!   stopped, or prefill has aborted, that has not started when the stop comes is skipped
//!   (it still counts as a write the closing frame waits for). A control frame that ends a transfer's writes (`Done`,
//!   `TransferAbort`, `WriteAbortAck`) leaves only once every posted write of that transfer has
//!   completed (`Done` follows the bytes it vouches for); other transfers on the link go on
//!   meanwhile.
//! - Each granted page is written at most once, and a `Written` frame says so as soon as its
//!   write has landed (before the transfer's `Done`, on the same socket): decode hashes the
//!   page then, while the transfer runs, rather than every page at `Done`.
//! - The writer computes `Done`'s checksum: each copy hashes the page as it copies it
//!   (`kernels::xxh3_64_long_copy`, one read of the source for both), the engine hands the
//!   writer the pages decode holds too, which are hashed and not written, and `Done` leaves
//!   with the root over those hashes (a page never hashed counts as 0, so decode's checksum
//!   cannot match). The hash is taken from the bytes the copy stores, which are the frame's
//!   own, so it vouches for what prefill lent, as the engine's did. Fault plans that alter a
//!   transfer's frames on their way to the writer keep the engine's checksum instead
//!   ([`WriterFaults::engine_checksums`]), so that what they plant stays a corruption.
//! - Decode, dropping a reservation prefill may still write into, quarantines its pages and
//!   sends `WriteAbort`; prefill stops posting that transfer's pages, its queued writes skip
//!   their copies, and it answers `WriteAbortAck` once every posted write has completed or
//!   been skipped. Only then are the pages reused.
//! - If the link is lost, decode raises the link's [`WriteFence`] and waits until no write of
//!   that link is in progress (or the prefill process is gone) before it frees anything.
//!
//! Everything decode reads is still verified as on TCP: `Done`'s counts against the
//! reservation and the checksum recomputed over decode's own pages, after the writes.

mod copier;

use crate::transport::{read_frame, write_frame, BoxStream, Link, LinkTasks};
use crate::{Frame, PageBytes, TransferId};
use copier::{Copier, Pending};
use hugemem::shared::{recv_fds, send_fds, RemotePages, WriteFence};
use kv::{RequestId, TenantId};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncWriteExt, Interest, WriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// What decode tells prefill about its pool, with the pool's memfd and the link's fence.
const OFFER_MAGIC: [u8; 4] = *b"ALSM";
const OFFER_BYTES: usize = 16;

/// Decode's side, after the handshake with a prefill on a Unix socket: passes the pool
/// (`page_count` pages of `page_bytes`) and the link's write fence.
pub async fn offer_pool(
    stream: &UnixStream,
    pool: BorrowedFd<'_>,
    page_count: u32,
    page_bytes: u64,
    fence: &WriteFence,
) -> io::Result<()> {
    let mut data = [0u8; OFFER_BYTES];
    data[..4].copy_from_slice(&OFFER_MAGIC);
    data[4..8].copy_from_slice(&page_count.to_le_bytes());
    data[8..].copy_from_slice(&page_bytes.to_le_bytes());
    let fds = [pool, fence.fd()];
    let sent = stream
        .async_io(Interest::WRITABLE, || send_fds(stream.as_fd(), &data, &fds))
        .await?;
    if sent != OFFER_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "the pool offer was cut short",
        ));
    }
    Ok(())
}

/// A decode worker's pool as a prefill worker maps it, and the link's fence.
pub struct SharedPool {
    pub pages: RemotePages,
    pub fence: WriteFence,
}

/// Prefill's side: receives and maps what [`offer_pool`] sent. Pages are refused if they do
/// not match the size the handshake agreed on (`page_bytes`).
pub async fn accept_pool(stream: &UnixStream, page_bytes: usize) -> io::Result<SharedPool> {
    let mut data = [0u8; OFFER_BYTES];
    let (received, fds) = stream
        .async_io(Interest::READABLE, || recv_fds(stream.as_fd(), &mut data))
        .await?;
    let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
    if received != OFFER_BYTES || data[..4] != OFFER_MAGIC {
        return Err(bad("the decode worker sent no pool offer"));
    }
    let [pool, fence]: [_; 2] = fds
        .try_into()
        .map_err(|_| bad("a pool offer carries exactly two descriptors"))?;
    let page_count = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes")) as usize;
    let offered_bytes = u64::from_le_bytes(data[8..].try_into().expect("8 bytes"));
    if offered_bytes != page_bytes as u64 {
        return Err(bad("the offered pool's pages are not the agreed size"));
    }
    Ok(SharedPool {
        pages: RemotePages::open(pool, page_count, page_bytes)?,
        fence: WriteFence::open(fence)?,
    })
}

/// Fault injection (test builds) for the prefill side's writer; the default is the protocol.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriterFaults {
    /// Each posted write waits this long before it copies (a slow or stalled transport).
    pub write_delay: Option<Duration>,
    /// Only the writes of the link's n-th transfer (from 0) are delayed; `None`: all.
    pub delayed_transfer: Option<u64>,
    /// The spec's `AbortAckBeforeQuiescence` mutant: `WriteAbortAck` leaves at once, while
    /// posted writes may still land.
    pub ack_before_quiescence: bool,
    /// The spec's `RewriteAfterWritten` mutant: a page frame for a page already written is
    /// written again, unreported, after decode was told (`Written`) that the page is final.
    pub rewrite_written: bool,
    /// The link's n-th transfer (from 0) reports each of its writes twice: a writer bug that
    /// decode refuses.
    pub reported_twice: Option<u64>,
    /// `Done` keeps the checksum the engine gave it instead of the one the writer computes
    /// from its copies: for fault plans that alter a transfer's frames before they reach the
    /// writer, whose planted corruption must stay a corruption of what prefill computed.
    pub engine_checksums: bool,
}

/// Runs a prefill worker's link to a decode worker whose pool it mapped: `Page` frames sent
/// on it are written one-sidedly into the granted pool pages; every other frame goes over
/// `stream`. Same channels as [`crate::transport::spawn_link`].
pub fn spawn_one_sided_link(
    stream: BoxStream,
    name: String,
    pool: Arc<SharedPool>,
    faults: WriterFaults,
) -> Link {
    let (mut read_half, write_half) = tokio::io::split(stream);
    let (in_tx, in_rx) = mpsc::channel(256);
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Frame>();
    let (news_tx, news_rx) = mpsc::unbounded_channel::<News>();
    let reader_name = name.clone();
    let reader = tokio::spawn(async move {
        loop {
            let frame = match read_frame(&mut read_half).await {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(link = %reader_name, %error, "link closed");
                    return;
                }
            };
            // Grants are the writer's business; refusals and stops are both's.
            let news = match &frame {
                Frame::WriteGrant {
                    transfer,
                    first_index,
                    pool_pages,
                } => {
                    let _ = news_tx.send(News::Granted {
                        transfer: *transfer,
                        first_index: *first_index,
                        pool_pages: pool_pages.clone(),
                    });
                    continue;
                }
                Frame::Nack { transfer, .. } => Some(News::Refused(*transfer)),
                Frame::WriteAbort { transfer } => Some(News::Stop(*transfer)),
                _ => None,
            };
            if let Some(news) = news {
                let _ = news_tx.send(news);
            }
            if in_tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    let (ready_tx, ready_rx) = mpsc::unbounded_channel();
    let copier = Copier::start(&name);
    let writer = Writer {
        copier,
        socket: write_half,
        pool,
        faults,
        transfers: HashMap::new(),
        posted: HashMap::new(),
        ready: ready_tx,
        transfers_seen: 0,
        name,
    };
    let writer = tokio::spawn(writer.run(out_rx, news_rx, ready_rx));
    Link {
        tx: out_tx,
        rx: in_rx,
        tasks: LinkTasks::new(reader, writer),
    }
}

/// Control frames the writer sends in one write at most (a `Written` frame is 21 bytes).
const READY_BATCH_MAX: usize = 64;

/// What the link's reader tells its writer.
enum News {
    Granted {
        transfer: TransferId,
        first_index: u32,
        pool_pages: Vec<u32>,
    },
    /// Decode refused the transfer: its pages go nowhere.
    Refused(TransferId),
    /// Decode asked to stop writing into the transfer's reservation.
    Stop(TransferId),
}

/// Where one transfer's pages go.
enum Outgoing {
    /// `GrantAsk` sent for this request and tenant; the transfer's frames wait, in order.
    Asked {
        request: RequestId,
        tenant: TenantId,
        waiting: Vec<Frame>,
    },
    Granted {
        /// The request and tenant the grant was asked for: a page frame naming others is not
        /// written (a one-sided write carries no header for decode to check).
        request: RequestId,
        tenant: TenantId,
        first_index: u32,
        pool_pages: Vec<u32>,
        /// Per granted slot: a write was posted into it. Decode hashes a page once it is told
        /// the page's write landed, so a second write would change bytes it already hashed.
        posted: Vec<bool>,
        /// Fault injection: this transfer's writes wait this long.
        delay: Option<Duration>,
        /// Fault injection: each write of this transfer is reported twice.
        report_twice: bool,
        /// Each page's hash, by transfer index, taken as it was copied (or, for a page decode
        /// holds, read): what `Done`'s checksum is computed from.
        hashes: PageHashes,
        /// Set when the transfer is stopped, refused or aborted: its writes still queued on
        /// the copy thread skip their copies.
        stopped: Arc<AtomicBool>,
    },
    /// Refused or stopped: pages are dropped, control frames still go.
    Closed,
}

struct Writer {
    socket: WriteHalf<BoxStream>,
    pool: Arc<SharedPool>,
    faults: WriterFaults,
    transfers: HashMap<TransferId, Outgoing>,
    /// Posted writes not yet known to be complete, per transfer.
    posted: HashMap<TransferId, VecDeque<Pending>>,
    copier: Copier,
    /// Control frames whose transfer's writes have completed, to send.
    ready: mpsc::UnboundedSender<Frame>,
    /// Transfers this link has asked grants for (for `WriterFaults::delayed_transfer`).
    transfers_seen: u64,
    name: String,
}

impl Writer {
    async fn run(
        mut self,
        mut frames: mpsc::UnboundedReceiver<Frame>,
        mut news: mpsc::UnboundedReceiver<News>,
        mut ready: mpsc::UnboundedReceiver<Frame>,
    ) {
        loop {
            let step = tokio::select! {
                biased;
                Some(news) = news.recv() => self.news(news).await,
                Some(frame) = ready.recv() => self.write_ready(frame, &mut ready).await,
                frame = frames.recv() => match frame {
                    Some(frame) => self.frame(frame).await,
                    None => break,
                },
            };
            if let Err(error) = step {
                tracing::warn!(link = %self.name, %error, "link write failed");
                return;
            }
        }
        // The engine let go: what is still waiting for its writes goes once they complete.
        let waiting: Vec<Pending> = self.posted.drain().flat_map(|(_, w)| w).collect();
        for write in waiting {
            let _ = write.finished().await;
        }
        while let Ok(frame) = ready.try_recv() {
            if write_frame(&mut self.socket, &frame).await.is_err() {
                return;
            }
        }
        let _ = self.socket.shutdown().await;
    }

    /// Writes `first` and the control frames already queued behind it in one write: at a
    /// page's copy a time, each `Written` its own write would cost a system call here and a
    /// wake-up at decode per page.
    async fn write_ready(
        &mut self,
        first: Frame,
        ready: &mut mpsc::UnboundedReceiver<Frame>,
    ) -> io::Result<()> {
        let mut batch = first.encode_prefixed();
        for _ in 1..READY_BATCH_MAX {
            match ready.try_recv() {
                Ok(frame) => batch.extend_from_slice(&frame.encode_prefixed()),
                Err(_) => break,
            }
        }
        self.socket.write_all(&batch).await
    }

    async fn news(&mut self, news: News) -> io::Result<()> {
        match news {
            News::Granted {
                transfer,
                first_index,
                pool_pages,
            } => {
                let Some(&Outgoing::Asked {
                    request, tenant, ..
                }) = self.transfers.get(&transfer)
                else {
                    return Ok(()); // not asked for, or already closed
                };
                let delayed = match self.faults.delayed_transfer {
                    Some(n) => n + 1 == self.transfers_seen,
                    None => true,
                };
                let granted = Outgoing::Granted {
                    request,
                    tenant,
                    first_index,
                    posted: vec![false; pool_pages.len()],
                    pool_pages,
                    delay: self.faults.write_delay.filter(|_| delayed),
                    report_twice: self.faults.reported_twice.map(|n| n + 1)
                        == Some(self.transfers_seen),
                    hashes: PageHashes::default(),
                    stopped: Arc::default(),
                };
                let Some(Outgoing::Asked { waiting, .. }) =
                    self.transfers.insert(transfer, granted)
                else {
                    unreachable!("matched above");
                };
                for frame in waiting {
                    self.frame(frame).await?;
                }
                Ok(())
            }
            News::Refused(transfer) | News::Stop(transfer) => {
                // A transfer this link never wrote (or has finished) has nothing to close.
                let Some(outgoing) = self.transfers.get_mut(&transfer) else {
                    return Ok(());
                };
                let previous = std::mem::replace(outgoing, Outgoing::Closed);
                if let Outgoing::Granted { stopped, .. } = &previous {
                    stopped.store(true, Ordering::Release);
                }
                if let Outgoing::Asked { waiting, .. } = previous {
                    // The pages are dropped (their leases go back); control frames still go.
                    for frame in waiting {
                        if !matches!(frame, Frame::Page { .. }) {
                            self.frame(frame).await?;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    async fn frame(&mut self, frame: Frame) -> io::Result<()> {
        match frame {
            Frame::Page {
                transfer,
                request,
                tenant,
                index,
                bytes,
            } => match self.transfers.get_mut(&transfer) {
                None => {
                    let first = Frame::Page {
                        transfer,
                        request,
                        tenant,
                        index,
                        bytes,
                    };
                    let asked = Outgoing::Asked {
                        request,
                        tenant,
                        waiting: vec![first],
                    };
                    self.transfers.insert(transfer, asked);
                    self.transfers_seen += 1;
                    let ask = Frame::GrantAsk {
                        transfer,
                        request,
                        tenant,
                    };
                    write_frame(&mut self.socket, &ask).await
                }
                Some(Outgoing::Asked { waiting, .. }) => {
                    waiting.push(Frame::Page {
                        transfer,
                        request,
                        tenant,
                        index,
                        bytes,
                    });
                    Ok(())
                }
                Some(Outgoing::Granted {
                    request: granted_request,
                    tenant: granted_tenant,
                    first_index,
                    pool_pages,
                    posted,
                    delay,
                    report_twice,
                    hashes,
                    stopped,
                }) => {
                    let slot = index.checked_sub(*first_index).map(|slot| slot as usize);
                    let page = slot.and_then(|slot| pool_pages.get(slot)).copied();
                    let (delay, reports) = (*delay, 1 + usize::from(*report_twice));
                    let (hashes, stopped) = (hashes.clone(), stopped.clone());
                    if slot.is_none() && (request, tenant) == (*granted_request, *granted_tenant) {
                        // A page decode holds: hashed for `Done`, not written.
                        let write = move || {
                            if !stopped.load(Ordering::Acquire) {
                                hashes.put(index, crate::page_hash(&bytes));
                            }
                        };
                        let pending = self.copier.post(write);
                        self.posted.entry(transfer).or_default().push_back(pending);
                        return Ok(());
                    }
                    match (page, slot) {
                        (Some(page), Some(slot))
                            if (request, tenant) == (*granted_request, *granted_tenant) =>
                        {
                            let first = !std::mem::replace(&mut posted[slot], true);
                            if !first && !self.faults.rewrite_written {
                                tracing::warn!(
                                    link = %self.name,
                                    index,
                                    "a page already written was not written again"
                                );
                                return Ok(());
                            }
                            let report = first.then_some((index, reports));
                            let write = PageWrite {
                                page: page as usize,
                                bytes,
                                report,
                                delay,
                                hashes,
                                stopped,
                            };
                            self.post(transfer, write);
                            Ok(())
                        }
                        _ => {
                            tracing::warn!(
                                link = %self.name,
                                index,
                                "a page outside its transfer's grant was not written"
                            );
                            Ok(())
                        }
                    }
                }
                Some(Outgoing::Closed) => Ok(()),
            },
            Frame::Done(done) => self.close(done.transfer, Frame::Done(done)).await,
            Frame::TransferAbort { transfer, request } => {
                self.close(transfer, Frame::TransferAbort { transfer, request })
                    .await
            }
            Frame::WriteAbortAck { transfer } => {
                self.transfers.remove(&transfer);
                let ack = Frame::WriteAbortAck { transfer };
                if self.faults.ack_before_quiescence {
                    // The mutant: the answer overtakes the writes it vouches for.
                    return write_frame(&mut self.socket, &ack).await;
                }
                self.after_writes(transfer, Closing::Frame(ack)).await
            }
            frame => write_frame(&mut self.socket, &frame).await,
        }
    }

    /// A frame that ends the writes of `transfer`: it waits behind the transfer's pages if they
    /// wait for a grant, and otherwise leaves once the transfer's posted writes have landed.
    async fn close(&mut self, transfer: TransferId, frame: Frame) -> io::Result<()> {
        if let Some(Outgoing::Asked { waiting, .. }) = self.transfers.get_mut(&transfer) {
            waiting.push(frame);
            return Ok(());
        }
        let hashes = match self.transfers.remove(&transfer) {
            Some(Outgoing::Granted {
                hashes, stopped, ..
            }) => {
                if matches!(frame, Frame::TransferAbort { .. }) {
                    // Prefill gave up on it: what has not been copied yet need not be.
                    stopped.store(true, Ordering::Release);
                }
                Some(hashes)
            }
            // No page of it came: a transfer of no pages (a one-token prompt) still needs its
            // checksum, over none.
            None => Some(PageHashes::default()),
            // Refused or stopped: decode has dropped it, whatever `Done` says.
            Some(_) => None,
        };
        let frame = match (frame, hashes) {
            (Frame::Done(done), Some(hashes)) if !self.faults.engine_checksums => {
                Closing::Done(done, hashes)
            }
            (frame, _) => Closing::Frame(frame),
        };
        self.after_writes(transfer, frame).await
    }

    /// Sends `frame` once every posted write of `transfer` has landed: next if none is in
    /// flight, else from a task that waits for them (the link goes on meanwhile). That task
    /// counts as one of the transfer's writes, so a later frame of the transfer waits for it
    /// and leaves after this one. Either way it goes behind the `Written` frames of the
    /// writes that finished.
    async fn after_writes(&mut self, transfer: TransferId, frame: Closing) -> io::Result<()> {
        self.posted.retain(|_, writes| {
            writes.retain_mut(|write| !write.is_finished());
            !writes.is_empty()
        });
        let Some(writes) = self.posted.remove(&transfer) else {
            let _ = self.ready.send(frame.into_frame());
            return Ok(());
        };
        let ready = self.ready.clone();
        let waiter = tokio::spawn(async move {
            for write in writes {
                // Over either way: a write that panicked runs no more (what it left is for
                // decode's checksum to judge).
                let _ = write.finished().await;
            }
            let _ = ready.send(frame.into_frame());
        });
        self.posted
            .entry(transfer)
            .or_default()
            .push_back(Pending::Task(waiter));
        Ok(())
    }

    /// Posts `write` behind the link's earlier copies. A delayed write (fault injection)
    /// waits on a thread of its own, not in front of every later copy of the link.
    fn post(&mut self, transfer: TransferId, write: PageWrite) {
        let posted = self.posted.entry(transfer).or_default();
        let delayed = write.delay.is_some();
        let (pool, ready) = (self.pool.clone(), self.ready.clone());
        let write = move || write.run(&pool, &ready, transfer);
        posted.push_back(match delayed {
            false => self.copier.post(write),
            true => Pending::Task(tokio::task::spawn_blocking(write)),
        });
    }
}

/// One posted write: `bytes` into pool page `page`. Once it has landed, `Written` tells
/// decode it was the transfer's page `report.0` (`report.1` times: once but under fault
/// injection; the mutant's second write reports nothing).
struct PageWrite {
    page: usize,
    bytes: PageBytes,
    report: Option<(u32, usize)>,
    /// Fault injection: the write waits this long first.
    delay: Option<Duration>,
    hashes: PageHashes,
    stopped: Arc<AtomicBool>,
}

impl PageWrite {
    fn run(self, pool: &SharedPool, ready: &mpsc::UnboundedSender<Frame>, transfer: TransferId) {
        match self.delay {
            // A delayed write is the one the fault plan lands late, stopped or not.
            Some(delay) => std::thread::sleep(delay),
            // Stopped before it began: nothing is copied, nothing reported.
            None if self.stopped.load(Ordering::Acquire) => return,
            None => {}
        }
        // Fenced (the link is gone and decode may reuse the page): nothing is written.
        let mut written = false;
        if let Some(_writing) = pool.fence.begin_write() {
            // SAFETY: `xxh3_64_long_copy` writes exactly `bytes.len()` bytes at the pointer,
            // which `write_with` checked is a whole page of the mapping.
            let hash = unsafe {
                pool.pages.write_with(self.page, &self.bytes, |from, to| {
                    kernels::xxh3_64_long_copy(from, to, &crate::checksum::PAGE_SECRET)
                })
            };
            if let (Some(hash), Some((index, _))) = (hash, self.report) {
                self.hashes.put(index, hash);
            }
            written = hash.is_some();
            if !written {
                tracing::warn!(
                    page = self.page,
                    "a grant named a page outside the pool; dropped"
                );
            }
        }
        drop(self.bytes); // the source page goes back to prefill's pool after the copy
        if let Some((index, times)) = self.report.filter(|_| written) {
            // Queued before this write counts as finished, so before the transfer's `Done`,
            // which waits for it.
            for _ in 0..times {
                let _ = ready.send(Frame::Written { transfer, index });
            }
        }
    }
}

#[cfg(test)]
mod tests;

/// A frame that waits for its transfer's posted writes: `Done` takes its checksum from the
/// hashes of the transfer's pages once they are all in.
enum Closing {
    Frame(Frame),
    Done(crate::TransferDone, PageHashes),
}

impl Closing {
    fn into_frame(self) -> Frame {
        match self {
            Closing::Frame(frame) => frame,
            Closing::Done(mut done, hashes) => {
                done.checksum = hashes.checksum(&done);
                Frame::Done(done)
            }
        }
    }
}

/// One transfer's page hashes by index, filled by its copies as they run.
#[derive(Clone, Default)]
struct PageHashes(Arc<std::sync::Mutex<std::collections::BTreeMap<u32, u64>>>);

impl PageHashes {
    fn put(&self, index: u32, hash: u64) {
        self.0.lock().expect("page hashes lock").insert(index, hash);
    }

    /// The transfer checksum over the `done.page_count` pages; a page never hashed (not sent,
    /// or not written) counts as hash 0, so decode's own checksum cannot match.
    fn checksum(&self, done: &crate::TransferDone) -> u64 {
        crate::checksum::checksum_over(done, &self.0.lock().expect("page hashes lock"))
    }
}
