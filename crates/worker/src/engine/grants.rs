//! Decode's open reservations, shared by the engine and the readers of its prefill links: a
//! reader lands each page frame's bytes straight into the reserved page (no buffer, no copy,
//! no engine turn per page), under the checks the engine applied itself before:
//!
//! - a frame lands only in a live reservation, and only from the link whose frame came first
//!   (later frames of another link are unknown to it);
//! - `Inbound::accept_page` checks request, tenant, index and size, and refuses a page the
//!   receiver holds from its own cache (I4);
//! - the bytes go through a [`LentPageMut`]: while it is out, the pool gives no view of the
//!   page (nothing checksums it half-written) and never reuses it (a reservation dropped
//!   meanwhile parks the page until the lease comes back, I5);
//! - a `Done` closes the reservation in the reader, before the frame is passed on: no byte of
//!   that transfer lands after it, so the checksum decode computes covers what it will read.
//!
//! A prefill on this host may instead write the pages one-sidedly (`transfer::one_sided`):
//! its `GrantAsk` binds the reservation to its link and gets the pool pages; the leases stay
//! here while it writes. Each page is hashed when its `Written` says the page's one write
//! has landed (while the transfer still runs), and any page not reported so when its
//! `Done` closes the reservation (it sends `Done` only after its writes have landed). A
//! reservation dropped while such a prefill may still write is *quarantined*: its leases are
//! kept (the pool parks the pages) until the prefill's `WriteAbortAck` says its writes are
//! over, or, if the link is lost, until the link's [`WriteFence`] shows that none is in
//! progress or the prefill process is gone.

use super::{Event, LinkId};
use crate::FaultPlan;
use hugemem::shared::{process_exists, WriteFence};
use kv::{LentPageMut, RequestId, TenantId};
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use transfer::transport::{PageHeader, PageSink};
use transfer::{Frame, Inbound, Reject, TransferDone, TransferId};

#[derive(Default)]
pub(crate) struct Grants {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    open: HashMap<TransferId, Grant>,
    /// Closed by a reader on `Done`, waiting for the engine to verify them.
    closed: HashMap<TransferId, Grant>,
    /// Dropped reservations a one-sided prefill may still write into: their leases, until
    /// that link's prefill says its writes are over (or the link's fence shows it).
    quarantined: HashMap<TransferId, Quarantine>,
    /// The one-sided links, by id.
    one_sided: HashMap<LinkId, OneSidedPeer>,
}

struct Quarantine {
    link: LinkId,
    leases: Vec<LentPageMut>,
}

/// What decode knows of a prefill that writes into its pool.
pub(crate) struct OneSidedPeer {
    pub(crate) fence: Arc<WriteFence>,
    /// The peer process (from the socket's credentials), to learn that it is gone.
    pub(crate) pid: Option<i32>,
}

/// How often a fenced link's in-progress writes are looked at.
const FENCE_POLL: Duration = Duration::from_millis(1);

struct Grant {
    inbound: Inbound,
    /// The link the first frame came on; later frames must come on it too.
    sender: Option<LinkId>,
    /// Leases by page index: `None` for pages decode holds, and for one a reader is writing.
    pages: Vec<Option<LentPageMut>>,
    /// Each landed page's hash, computed from the page right after its bytes landed, by the
    /// only one who could write it (`transfer::page_hash`); one-sided, when its `Written`
    /// came (a second `Written` for it fails the transfer) or at `Done`.
    hashes: Vec<Option<u64>>,
    first_frame: Option<Instant>,
    last_frame: Option<Instant>,
    /// Granted to a one-sided prefill: it writes the leased pages itself.
    one_sided: bool,
    /// One-sided: the link's count of finished writes when last looked at.
    written_seen: u32,
}

/// A closed reservation, for the engine's verification of `Done`.
pub(crate) struct Closed {
    pub(crate) inbound: Inbound,
    pub(crate) first_frame: Option<Instant>,
    /// Per page index: its hash if its bytes landed (pages decode holds have none).
    pub(crate) hashes: Vec<Option<u64>>,
}

/// What a page frame gets.
pub(crate) enum Claim {
    Land(LentPageMut),
    /// No live reservation of this transfer takes frames from this link.
    Unknown,
    /// The reservation's checks refused the frame: the transfer fails.
    Refused(Reject),
}

impl Grants {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("the grants lock is never held across a panic")
    }

    /// Opens a reservation: `leases` lend its pages from `inbound.held_pages()` on.
    pub(crate) fn open(&self, inbound: Inbound, leases: Vec<LentPageMut>) {
        let held = inbound.held_pages() as usize;
        let pages = (0..held).map(|_| None).chain(leases.into_iter().map(Some));
        let grant = Grant {
            hashes: vec![None; inbound.page_count() as usize],
            pages: pages.collect(),
            inbound,
            sender: None,
            first_frame: None,
            last_frame: None,
            one_sided: false,
            written_seen: 0,
        };
        self.state().open.insert(grant.inbound.transfer, grant);
    }

    /// Drops a reservation (abort, timeout, refusal, end): its leases go back, except one a
    /// reader is writing into, which goes back when that write ends. A reservation granted to
    /// a one-sided prefill is quarantined instead (unless `quarantine` is off: fault
    /// injection only), and the link to send `WriteAbort` on is returned.
    pub(crate) fn revoke(&self, transfer: TransferId, quarantine: bool) -> Option<LinkId> {
        let mut state = self.state();
        state.closed.remove(&transfer);
        let grant = state.open.remove(&transfer)?;
        let link = grant.sender.filter(|_| grant.one_sided && quarantine)?;
        let leases = grant.pages.into_iter().flatten().collect();
        state
            .quarantined
            .insert(transfer, Quarantine { link, leases });
        Some(link)
    }

    /// `link`'s prefill says its writes into `transfer`'s pages are over: they may be reused.
    pub(crate) fn write_abort_acked(&self, link: LinkId, transfer: TransferId) -> bool {
        let mut state = self.state();
        match state.quarantined.get(&transfer) {
            Some(quarantine) if quarantine.link == link => {
                state.quarantined.remove(&transfer);
                true
            }
            _ => false,
        }
    }

    /// A one-sided prefill's link is up.
    pub(crate) fn one_sided_link(&self, link: LinkId, peer: OneSidedPeer) {
        self.state().one_sided.insert(link, peer);
    }

    /// `link` is gone (call after its reservations were revoked): if it was one-sided, raise
    /// its fence and release its quarantined pages once no write of it is in progress or its
    /// process is gone, from a thread of its own (a prefill stuck mid-write keeps them).
    pub(crate) fn link_down(&self, link: LinkId) {
        let mut state = self.state();
        let Some(peer) = state.one_sided.remove(&link) else {
            return;
        };
        peer.fence.fence();
        let transfers: Vec<TransferId> = state
            .quarantined
            .iter()
            .filter(|(_, q)| q.link == link)
            .map(|(transfer, _)| *transfer)
            .collect();
        let held: Vec<Quarantine> = transfers
            .iter()
            .filter_map(|transfer| state.quarantined.remove(transfer))
            .collect();
        drop(state);
        let ours = std::process::id() as i32;
        let spawned = std::thread::Builder::new()
            .name("write-fence".into())
            .spawn(move || {
                let started = Instant::now();
                let mut warned = false;
                loop {
                    let gone = peer
                        .pid
                        .is_some_and(|pid| pid != ours && !process_exists(pid));
                    if peer.fence.quiesced() || gone {
                        break;
                    }
                    if !warned && started.elapsed() > Duration::from_secs(10) {
                        warned = true;
                        tracing::warn!(
                            pages = held.iter().map(|q| q.leases.len()).sum::<usize>(),
                            "a lost prefill link still has a write in progress; its pages \
                             stay quarantined"
                        );
                    }
                    std::thread::sleep(FENCE_POLL);
                }
                drop(held);
            });
        if let Err(error) = spawned {
            // Without the thread the pages stay quarantined: safe, and said.
            tracing::error!(%error, "cannot wait on a write fence; pages stay quarantined");
        }
    }

    /// A one-sided prefill on `link` asks for `transfer`'s pages.
    pub(super) fn grant(
        &self,
        link: LinkId,
        transfer: TransferId,
        request: RequestId,
        tenant: TenantId,
    ) -> Result<Frame, Option<Reject>> {
        let mut state = self.state();
        let Some(peer) = state.one_sided.get(&link) else {
            return Err(None);
        };
        let written = peer.fence.written();
        let grant = state.open.get_mut(&transfer).ok_or(None)?;
        if grant.sender.is_some() || !grant.bind(link) {
            // Asked twice, or the transfer is another link's.
            return Err(None);
        }
        grant.inbound.grant_writes(request, tenant).map_err(Some)?;
        grant.one_sided = true;
        grant.written_seen = written;
        let first_index = grant.inbound.held_pages();
        let pool_pages = grant.pages[first_index as usize..]
            .iter()
            .map(|lease| lease.as_ref().map_or(u32::MAX, LentPageMut::page))
            .collect();
        Ok(Frame::WriteGrant {
            transfer,
            first_index,
            pool_pages,
        })
    }

    pub(crate) fn claim(&self, link: LinkId, header: &PageHeader) -> Claim {
        let mut state = self.state();
        let Some(grant) = state.open.get_mut(&header.transfer) else {
            return Claim::Unknown;
        };
        // A one-sided grant takes no frames: its prefill writes the pages itself.
        if grant.one_sided || !grant.bind(link) {
            return Claim::Unknown;
        }
        let accepted =
            grant
                .inbound
                .accept_page(header.request, header.tenant, header.index, header.len);
        match accepted {
            Ok(index) => match grant.pages.get_mut(index).and_then(Option::take) {
                Some(page) => {
                    // Until it lands again, this page has no hash: a frame cut short leaves
                    // none, and the checksum fails.
                    grant.hashes[index] = None;
                    Claim::Land(page)
                }
                // Only a reader writing this very page has its lease, and a link's reader
                // reads one frame at a time: unreachable, refused all the same.
                None => Claim::Refused(Reject::BadPage),
            },
            Err(reject) => Claim::Refused(reject),
        }
    }

    /// A claimed page's bytes have landed: its lease goes back into the reservation, or, if
    /// the reservation was dropped meanwhile, back to the pool.
    pub(crate) fn landed(&self, transfer: TransferId, index: u32, page: LentPageMut) {
        // Hashed before the lease goes back: no one else can write the page meanwhile.
        let hash = transfer::page_hash(page.bytes());
        let mut state = self.state();
        let Some(grant) = state.open.get_mut(&transfer) else {
            return;
        };
        let index = index as usize;
        if let (Some(slot), Some(hash_slot)) =
            (grant.pages.get_mut(index), grant.hashes.get_mut(index))
        {
            *slot = Some(page);
            *hash_slot = Some(hash);
        }
    }

    /// `link`'s one-sided prefill says its write of `transfer`'s page `index` landed and is
    /// the page's last (a reader's call): the page is hashed now, under the lock, so that
    /// nothing can take its lease meanwhile. `Err` refuses the transfer: a page outside the
    /// written range, or reported twice. Nothing happens for a transfer no live grant of this
    /// link holds (an abort may have dropped it while the write was under way).
    pub(super) fn written(
        &self,
        link: LinkId,
        transfer: TransferId,
        index: u32,
    ) -> Result<(), Reject> {
        let mut state = self.state();
        let Some(grant) = state.open.get_mut(&transfer) else {
            return Ok(());
        };
        if !grant.one_sided || grant.sender != Some(link) {
            return Ok(());
        }
        let index = index as usize;
        // Past the reservation, or a page decode holds itself (no lease): no write was granted.
        let (Some(Some(lease)), Some(hash)) = (grant.pages.get(index), grant.hashes.get_mut(index))
        else {
            return Err(Reject::BadPage);
        };
        if hash.is_some() {
            return Err(Reject::BadPage);
        }
        *hash = Some(transfer::page_hash(lease.bytes()));
        Ok(())
    }

    /// `Done` of `transfer` arrived on `link` (a reader's call): the reservation takes no
    /// more frames. A `Done` from another link than the transfer's closes nothing.
    fn close_in_reader(&self, link: LinkId, transfer: TransferId) {
        let mut state = self.state();
        let bound = state
            .open
            .get_mut(&transfer)
            .is_some_and(|grant| grant.bind(link));
        if bound {
            let mut grant = state.open.remove(&transfer).expect("found above");
            drop(state);
            if grant.one_sided {
                // The prefill sent `Done` after its writes landed: hash what they left on the
                // pages no `Written` reported, while the leases still keep everyone else out.
                for (hash, lease) in grant.hashes.iter_mut().zip(&grant.pages) {
                    if let (None, Some(lease)) = (&hash, lease) {
                        *hash = Some(transfer::page_hash(lease.bytes()));
                    }
                }
            }
            self.state().closed.insert(transfer, grant.without_leases());
        }
    }

    /// The engine's turn at `Done` of `transfer` from `link`: the reservation, closed (by the
    /// link's reader, or now, for a `Done` that came without one), or `None` if no live
    /// reservation of this transfer takes frames from `link`.
    pub(crate) fn close(&self, link: LinkId, transfer: TransferId) -> Option<Closed> {
        self.close_in_reader(link, transfer);
        let mut state = self.state();
        let grant = state.closed.remove(&transfer)?;
        if grant.sender != Some(link) {
            state.closed.insert(transfer, grant);
            return None;
        }
        Some(Closed {
            inbound: grant.inbound,
            first_frame: grant.first_frame,
            hashes: grant.hashes,
        })
    }

    /// Whether a frame came yet, from which link, and when the latest did. A one-sided
    /// transfer sends no frames while its pages are written: a write finished on its link
    /// since the last look counts as one.
    pub(crate) fn activity(&self, transfer: TransferId) -> (Option<LinkId>, Option<Instant>) {
        let mut state = self.state();
        let State {
            open,
            closed,
            one_sided,
            ..
        } = &mut *state;
        let Some(grant) = open.get_mut(&transfer).or(closed.get_mut(&transfer)) else {
            return (None, None);
        };
        if let (true, Some(peer)) = (
            grant.one_sided,
            grant.sender.and_then(|l| one_sided.get(&l)),
        ) {
            let written = peer.fence.written();
            if written != grant.written_seen {
                grant.written_seen = written;
                grant.last_frame = Some(Instant::now());
            }
        }
        (grant.sender, grant.last_frame)
    }
}

impl Grant {
    /// Binds the reservation to `link` on its first frame; false for a frame of another link.
    fn bind(&mut self, link: LinkId) -> bool {
        match self.sender {
            None => self.sender = Some(link),
            Some(first) if first != link => return false,
            Some(_) => {}
        }
        let now = Instant::now();
        self.first_frame.get_or_insert(now);
        self.last_frame = Some(now);
        true
    }

    fn without_leases(mut self) -> Grant {
        self.pages.clear();
        self
    }
}

/// Makes the [`PageSink`] of each prefill link of a decode worker.
pub(crate) struct PageSinks {
    pub(super) grants: Arc<Grants>,
    pub(super) faults: FaultPlan,
}

impl PageSinks {
    /// The sink of link `link`: it lands that link's page frames in the engine's
    /// reservations and tells the engine, through `events`, of each it refuses. A one-sided
    /// link's `peer` makes it answer `GrantAsk`s.
    pub(crate) fn for_link(
        &self,
        link: LinkId,
        events: mpsc::Sender<Event>,
        peer: Option<OneSidedPeer>,
    ) -> Arc<dyn PageSink> {
        if let Some(peer) = peer {
            self.grants.one_sided_link(link, peer);
        }
        Arc::new(LinkSink {
            grants: self.grants.clone(),
            link,
            events: Mutex::new(events),
            faults: Mutex::new(self.faults.clone()),
        })
    }
}

/// The [`PageSink`] of one prefill link of a decode worker.
struct LinkSink {
    grants: Arc<Grants>,
    link: LinkId,
    events: Mutex<mpsc::Sender<Event>>,
    /// The worker's fault plan, for `crash-on-page` (test builds only).
    faults: Mutex<FaultPlan>,
}

impl LinkSink {
    /// Tells the engine of a frame this link's reader did not land (`reject`: why, if the
    /// reservation's checks refused it; `None`: no live reservation takes it).
    fn refused(&self, transfer: TransferId, reject: Option<Reject>) {
        let refused = Event::PageRefused {
            link: self.link,
            transfer,
            reject,
        };
        let _ = self
            .events
            .lock()
            .expect("the events lock is never held across a panic")
            .send(refused);
    }
}

impl PageSink for LinkSink {
    fn claim(&self, header: &PageHeader) -> Option<LentPageMut> {
        let reject = match self.grants.claim(self.link, header) {
            Claim::Land(page) => {
                let crash = self
                    .faults
                    .lock()
                    .expect("the fault plan lock is never held across a panic")
                    .crash_on_page(header.index as usize);
                if crash {
                    crate::faults::crash("on a transfer's page");
                }
                return Some(page);
            }
            Claim::Unknown => None,
            Claim::Refused(reject) => Some(reject),
        };
        self.refused(header.transfer, reject);
        None
    }

    fn landed(&self, header: &PageHeader, page: LentPageMut) {
        self.grants.landed(header.transfer, header.index, page);
    }

    fn closing(&self, done: &TransferDone) {
        self.grants.close_in_reader(self.link, done.transfer);
    }

    fn written(&self, transfer: TransferId, index: u32) {
        if let Err(reject) = self.grants.written(self.link, transfer, index) {
            self.refused(transfer, Some(reject));
        }
    }

    fn grant(&self, transfer: TransferId, request: RequestId, tenant: TenantId) -> Frame {
        match self.grants.grant(self.link, transfer, request, tenant) {
            Ok(frame) => {
                // One-sided, decode sees no page land: it dies as it grants the pages instead.
                let crash = self
                    .faults
                    .lock()
                    .expect("the fault plan lock is never held across a panic")
                    .crash_on_page(1);
                if crash {
                    crate::faults::crash("on a transfer's grant");
                }
                frame
            }
            Err(reject) => {
                self.refused(transfer, reject);
                match reject {
                    // The reservation's checks refused it: the transfer fails, both sides.
                    Some(reject) => Frame::Nack { transfer, reject },
                    // No live reservation takes it from this link (a late page, a page after
                    // `Done`): nothing may be written, and nothing else changes, as a framed
                    // page of an unknown transfer is dropped and counted.
                    None => Frame::WriteGrant {
                        transfer,
                        first_index: 0,
                        pool_pages: Vec::new(),
                    },
                }
            }
        }
    }
}
