//! The receiving side of one transfer, sans I/O: which frames a reservation accepts and when
//! its pages may be sealed (I4). The decode worker owns the pages; this type only decides.

use crate::{Reject, TransferDone, TransferId};
use kv::{RequestId, TenantId};

/// What decode reserved for one transfer and what has arrived so far. `Hash`/`Eq` so the
/// formal model (`crates/spec`) can hold the real type in its states.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Inbound {
    pub transfer: TransferId,
    pub request: RequestId,
    pub tenant: TenantId,
    /// Tokens of KV the sender must deliver: fixed by the router's request, not by the sender.
    pub token_count: u32,
    page_bytes: usize,
    held_pages: usize,
    received: Vec<bool>,
}

impl Inbound {
    /// A reservation for `token_count` tokens in pages of `page_size_tokens` tokens and
    /// `page_bytes` bytes each, whose first `held_pages` the receiver already holds (from its
    /// own prefix cache): those must not arrive, the rest must.
    pub fn new(
        transfer: TransferId,
        request: RequestId,
        tenant: TenantId,
        token_count: u32,
        page_size_tokens: u32,
        page_bytes: usize,
        held_pages: u32,
    ) -> Inbound {
        assert!(page_size_tokens > 0, "pages hold at least one token");
        let page_count = token_count.div_ceil(page_size_tokens) as usize;
        let held_pages = (held_pages as usize).min(page_count);
        Inbound {
            transfer,
            request,
            tenant,
            token_count,
            page_bytes,
            held_pages,
            received: (0..page_count).map(|index| index < held_pages).collect(),
        }
    }

    /// Leading pages the receiver holds itself: no frame may write them.
    pub fn held_pages(&self) -> u32 {
        self.held_pages as u32
    }

    pub fn page_count(&self) -> u32 {
        self.received.len() as u32
    }

    /// Checks a page frame against the reservation; on `Ok`, the caller writes the bytes into
    /// its page number `index`. A repeated page is accepted (its bytes replace the first copy)
    /// because the checksum at `Done` covers whatever the pages finally hold.
    pub fn accept_page(
        &mut self,
        request: RequestId,
        tenant: TenantId,
        index: u32,
        byte_count: usize,
    ) -> Result<usize, Reject> {
        if request != self.request || tenant != self.tenant {
            return Err(Reject::HeaderMismatch);
        }
        let index = index as usize;
        if index >= self.received.len() || byte_count != self.page_bytes {
            return Err(Reject::BadPage);
        }
        // A page the receiver already holds is shared and read-only: a frame for it is a
        // sender that does not know what decode holds, and is refused.
        if index < self.held_pages {
            return Err(Reject::BadPage);
        }
        self.received[index] = true;
        Ok(index)
    }

    /// Checks a one-sided sender's `GrantAsk` against the reservation; on `Ok`, every page
    /// the sender fills counts as sent: a one-sided write carries no header to check, so what
    /// stands between decode and a page that was never written is the checksum at `Done`,
    /// computed over decode's own pages once the writes are over.
    pub fn grant_writes(&mut self, request: RequestId, tenant: TenantId) -> Result<(), Reject> {
        if request != self.request || tenant != self.tenant {
            return Err(Reject::HeaderMismatch);
        }
        for received in &mut self.received[self.held_pages..] {
            *received = true;
        }
        Ok(())
    }

    /// Checks `Done` against the reservation: same request and tenant, the token and page
    /// counts the router asked for (never the sender's word alone: a sender that says
    /// "1 token, complete" is the incident), and every page present. The checksum is checked
    /// separately, over the pages' bytes, by [`Inbound::verify_checksum`].
    pub fn check_done(&self, done: &TransferDone) -> Result<(), Reject> {
        if done.transfer != self.transfer {
            return Err(Reject::UnknownTransfer);
        }
        if done.request != self.request || done.tenant != self.tenant {
            return Err(Reject::HeaderMismatch);
        }
        if done.token_count != self.token_count || done.page_count != self.page_count() {
            return Err(Reject::LengthMismatch);
        }
        if self.received.iter().any(|&received| !received) {
            return Err(Reject::MissingPage);
        }
        Ok(())
    }

    /// Compares the sender's checksum with the one computed over our pages.
    pub fn verify_checksum(&self, done: &TransferDone, computed: u64) -> Result<(), Reject> {
        if done.checksum != computed {
            return Err(Reject::ChecksumMismatch);
        }
        Ok(())
    }
}
