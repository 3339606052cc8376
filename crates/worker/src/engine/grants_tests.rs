//! Decode's grants to a one-sided prefill, against a real shared-memory pool written through
//! the mapping prefill would use: each page is hashed when its `Written` comes, the pass at
//! `Done` hashes only the pages no `Written` reported, and a report decode cannot take fails
//! the transfer.

use super::grants::{Grants, OneSidedPeer};
use hugemem::shared::{RemotePages, WriteFence};
use kv::{Owner, PagePool, PageState, PoolConfig, PoolSize, RequestId, TenantId};
use std::sync::Arc;
use transfer::{Frame, Inbound, Reject, TransferId};

const LINK: u64 = 1;
const OTHER_LINK: u64 = 2;
const T: TransferId = TransferId(5);
const REQUEST: RequestId = RequestId(3);
const TENANT: TenantId = TenantId(9);
const PAGES: usize = 3;

/// A decode pool in shared memory with one reservation of `PAGES` pages granted to `LINK`,
/// and prefill's mapping of that pool; returns the grants, the mapping and the pool pages of
/// the transfer's pages in order.
fn granted() -> (Grants, PagePool, RemotePages, Vec<u32>) {
    let layout = kv::KvLayout {
        layer_count: 1,
        kv_head_count: 1,
        head_dim: 8,
        page_size_tokens: 4,
    };
    let mut pool = PagePool::new_shared(PoolConfig {
        layout,
        size: PoolSize::Tokens(8 * layout.page_size_tokens),
        scrub_on_free: false,
    })
    .expect("a shared pool");
    let tokens = PAGES * layout.page_size_tokens;
    let owner = Owner {
        tenant: TENANT,
        request: REQUEST,
    };
    let table = pool.allocate(owner, tokens).expect("pages");
    pool.set_state(&table, PageState::Receiving)
        .expect("receiving");
    let inbound = Inbound::new(
        T,
        REQUEST,
        TENANT,
        tokens as u32,
        layout.page_size_tokens as u32,
        layout.page_bytes(),
        0,
    );
    let leases = pool.lend_for_receive(&table, 0..PAGES).expect("leases");
    let grants = Grants::default();
    grants.open(inbound, leases);
    let fence = Arc::new(WriteFence::create().expect("fence"));
    let pid = Some(std::process::id() as i32);
    grants.one_sided_link(LINK, OneSidedPeer { fence, pid });
    let fd = pool
        .shared_fd()
        .expect("shared")
        .try_clone_to_owned()
        .expect("fd");
    let remote =
        RemotePages::open(fd, pool.page_count(), layout.page_bytes()).expect("prefill's map");
    let Ok(Frame::WriteGrant { pool_pages, .. }) = grants.grant(LINK, T, REQUEST, TENANT) else {
        panic!("granted");
    };
    (grants, pool, remote, pool_pages)
}

fn bytes(remote: &RemotePages, fill: u8) -> Vec<u8> {
    vec![fill; remote.page_bytes()]
}

#[test]
fn a_page_reported_written_is_hashed_then_and_done_hashes_only_the_rest() {
    let (grants, _pool, remote, pages) = granted();
    for (index, &page) in pages.iter().enumerate() {
        assert!(remote.write(page as usize, &bytes(&remote, index as u8 + 1)));
    }
    grants.written(LINK, T, 0).expect("taken");
    grants.written(LINK, T, 2).expect("taken");
    // After its report, page 0 changes (a writer that broke the one-write rule): the hash
    // decode keeps is the one taken at the report.
    assert!(remote.write(pages[0] as usize, &bytes(&remote, 0xEE)));
    let closed = grants.close(LINK, T).expect("closed");
    let expected: Vec<Option<u64>> = [1u8, 2, 3]
        .iter()
        .map(|&fill| Some(transfer::page_hash(&bytes(&remote, fill))))
        .collect();
    assert_eq!(
        closed.hashes, expected,
        "page 1 was hashed at Done, the others before"
    );
}

#[test]
fn a_report_decode_cannot_take_fails_the_transfer_and_other_links_are_not_heard() {
    let (grants, _pool, _remote, _pages) = granted();
    assert_eq!(
        grants.written(LINK, T, PAGES as u32),
        Err(Reject::BadPage),
        "past the grant"
    );
    grants.written(LINK, T, 1).expect("taken");
    assert_eq!(
        grants.written(LINK, T, 1),
        Err(Reject::BadPage),
        "a page reported twice"
    );
    // Not the transfer's link, or no live grant: nothing changes, nothing fails.
    assert_eq!(grants.written(OTHER_LINK, T, 2), Ok(()));
    assert_eq!(grants.written(LINK, TransferId(99), 0), Ok(()));
    let closed = grants.close(LINK, T).expect("closed");
    assert!(closed.hashes.iter().all(Option::is_some));
}
