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

use super::{Event, LinkId};
use crate::FaultPlan;
use kv::LentPageMut;
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use transfer::transport::{PageHeader, PageSink};
use transfer::{Inbound, Reject, TransferDone, TransferId};

#[derive(Default)]
pub(crate) struct Grants {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    open: HashMap<TransferId, Grant>,
    /// Closed by a reader on `Done`, waiting for the engine to verify them.
    closed: HashMap<TransferId, Grant>,
}

struct Grant {
    inbound: Inbound,
    /// The link the first frame came on; later frames must come on it too.
    sender: Option<LinkId>,
    /// Leases by page index: `None` for pages decode holds, and for one a reader is writing.
    pages: Vec<Option<LentPageMut>>,
    /// Each landed page's hash, computed from the page right after its bytes landed, by the
    /// only one who could write it (`transfer::page_hash`).
    hashes: Vec<Option<u64>>,
    first_frame: Option<Instant>,
    last_frame: Option<Instant>,
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
        };
        self.state().open.insert(grant.inbound.transfer, grant);
    }

    /// Drops a reservation (abort, timeout, refusal, end): its leases go back, except one a
    /// reader is writing into, which goes back when that write ends.
    pub(crate) fn revoke(&self, transfer: TransferId) {
        let mut state = self.state();
        state.open.remove(&transfer);
        state.closed.remove(&transfer);
    }

    pub(crate) fn claim(&self, link: LinkId, header: &PageHeader) -> Claim {
        let mut state = self.state();
        let Some(grant) = state.open.get_mut(&header.transfer) else {
            return Claim::Unknown;
        };
        if !grant.bind(link) {
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

    /// `Done` of `transfer` arrived on `link` (a reader's call): the reservation takes no
    /// more frames. A `Done` from another link than the transfer's closes nothing.
    fn close_in_reader(&self, link: LinkId, transfer: TransferId) {
        let mut state = self.state();
        let bound = state
            .open
            .get_mut(&transfer)
            .is_some_and(|grant| grant.bind(link));
        if bound {
            let grant = state.open.remove(&transfer).expect("found above");
            state.closed.insert(transfer, grant.without_leases());
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

    /// Whether a frame came yet, from which link, and when the latest did.
    pub(crate) fn activity(&self, transfer: TransferId) -> (Option<LinkId>, Option<Instant>) {
        let state = self.state();
        match state.open.get(&transfer).or(state.closed.get(&transfer)) {
            Some(grant) => (grant.sender, grant.last_frame),
            None => (None, None),
        }
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
    /// reservations and tells the engine, through `events`, of each it refuses.
    pub(crate) fn for_link(&self, link: LinkId, events: mpsc::Sender<Event>) -> Arc<dyn PageSink> {
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
        let refused = Event::PageRefused {
            link: self.link,
            transfer: header.transfer,
            reject,
        };
        let _ = self
            .events
            .lock()
            .expect("the events lock is never held across a panic")
            .send(refused);
        None
    }

    fn landed(&self, header: &PageHeader, page: LentPageMut) {
        self.grants.landed(header.transfer, header.index, page);
    }

    fn closing(&self, done: &TransferDone) {
        self.grants.close_in_reader(self.link, done.transfer);
    }
}
