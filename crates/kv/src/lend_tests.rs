//! Pages lent to a transport: readable from another thread, never written or reallocated
//! while lent, and back on the free list once the last lent guard drops.

use half::f16;

use crate::tests::{fill, owner, pool, read_all, LAYOUT};
use crate::{Error, PageState};

#[test]
fn a_lent_page_is_read_only_to_views_and_readable_from_another_thread() {
    let mut pool = pool(4, false);
    let mut table = pool
        .allocate(owner(1, 1), 2 * LAYOUT.page_size_tokens)
        .unwrap();
    fill(&mut pool, &table, f16::from_f32(3.0));
    let lent = pool.lend(&table, 0..1).expect("own Writing pages lend");
    // Not frozen: a view would take page 0 for writing, which the lent guard refuses.
    match pool.verify_batch(&[&table]) {
        Err(Error::PageBusy { page }) => assert_eq!(page, table.pages()[0].0),
        other => panic!("expected PageBusy, got {other:?}"),
    }
    // Frozen: page 0 comes read-only, page 1 writable, and the step may not write in page 0.
    table.freeze(1);
    {
        let mut views = pool.verify_batch(&[&table]).expect("frozen pages read");
        assert_eq!(views[0].shared_tokens(), LAYOUT.page_size_tokens);
        views[0].page_mut(1).fill(f16::from_f32(4.0));
        assert_eq!(views[0].page(0)[0], f16::from_f32(3.0));
    }
    let sent = std::thread::spawn(move || lent[0].bytes().to_vec())
        .join()
        .unwrap();
    assert_eq!(sent.len(), LAYOUT.page_bytes());
    assert_eq!(&sent[..2], &f16::from_f32(3.0).to_le_bytes());
    pool.release(table).unwrap();
    pool.check_invariants();
}

#[test]
fn a_page_released_while_lent_is_not_reused_until_the_transport_lets_go() {
    let mut pool = pool(2, true);
    let table = pool.allocate(owner(1, 1), LAYOUT.page_size_tokens).unwrap();
    fill(&mut pool, &table, f16::from_f32(5.0));
    let page = table.pages()[0].0;
    let lent = pool.lend(&table, 0..1).unwrap();
    pool.release(table).unwrap();
    pool.check_invariants();
    // Free to the headers, but not to allocation: both pages asked for cannot be had.
    assert_eq!(pool.pages_returning(), 1);
    assert_eq!(pool.pages_free(), 1);
    assert!(matches!(
        pool.allocate(owner(2, 2), 2 * LAYOUT.page_size_tokens),
        Err(Error::OutOfPages { .. })
    ));
    let other = pool.allocate(owner(2, 2), LAYOUT.page_size_tokens).unwrap();
    assert_ne!(other.pages()[0].0, page, "the lent page is not handed out");
    // The transport still reads the first owner's bytes, unscrubbed.
    assert_eq!(&lent[0].bytes()[..2], &f16::from_f32(5.0).to_le_bytes());
    drop(lent);
    assert_eq!(pool.reclaim_returned(), 1);
    assert_eq!(pool.pages_returning(), 0);
    pool.check_invariants();
    // Back on the free list, scrubbed as this pool does on free, for its next owner.
    let next = pool.allocate(owner(3, 3), LAYOUT.page_size_tokens).unwrap();
    assert_eq!(next.pages()[0].0, page);
    pool.verify_batch(&[&next]).unwrap()[0].mark_written(0);
    assert!(pool.headers[page.index()].state == PageState::Writing);
    pool.release(next).unwrap();
    pool.release(other).unwrap();
    assert_eq!(pool.pages_free(), 2);
}

#[test]
fn allocation_reclaims_pages_whose_lending_ended() {
    let mut pool = pool(1, false);
    let table = pool.allocate(owner(1, 1), 1).unwrap();
    let lent = pool.lend(&table, 0..1).unwrap();
    pool.release(table).unwrap();
    drop(lent);
    // No explicit reclaim: allocation looks at the returning pages itself.
    let table = pool
        .allocate(owner(2, 2), 1)
        .expect("the lent page came back");
    assert_eq!(read_all(&mut pool, &table).len(), LAYOUT.page_elems());
    pool.release(table).unwrap();
    pool.check_invariants();
}

#[test]
fn only_a_tables_own_readable_pages_lend() {
    let mut pool = pool(2, false);
    let table = pool.allocate(owner(1, 1), 1).unwrap();
    let stranger = crate::PageTable::forge(owner(9, 9), table.pages().to_vec());
    assert!(matches!(
        pool.lend(&stranger, 0..1),
        Err(Error::OwnerMismatch { .. })
    ));
    pool.set_state(&table, PageState::Receiving).unwrap();
    assert!(matches!(
        pool.lend(&table, 0..1),
        Err(Error::PageNotReadable { .. })
    ));
    pool.release(table).unwrap();
}

#[test]
fn pages_lent_for_receive_give_no_view_until_returned() {
    let mut pool = pool(2, false);
    let table = pool
        .allocate(owner(1, 1), 2 * LAYOUT.page_size_tokens)
        .unwrap();
    // Only a reservation's pages lend for receiving.
    assert!(matches!(
        pool.lend_for_receive(&table, 0..2),
        Err(Error::PageNotReadable { .. })
    ));
    pool.set_state(&table, PageState::Receiving).unwrap();
    let mut leases = pool.lend_for_receive(&table, 1..2).unwrap();
    // A reader thread lands bytes; meanwhile the receiver cannot take a view to checksum.
    assert!(matches!(
        pool.verify_receiving(&table),
        Err(Error::PageBusy { .. })
    ));
    let mut lease = leases.pop().unwrap();
    let lease = std::thread::spawn(move || {
        lease.bytes_mut().fill(0x3c);
        lease
    })
    .join()
    .unwrap();
    drop(lease);
    let view = pool.verify_receiving(&table).expect("every lease returned");
    assert!(view.page(1).iter().all(|v| v.to_bits() == 0x3c3c));
    drop(view);
    // A reservation dropped while a lease is out: the page is parked, not reused.
    let lease = pool.lend_for_receive(&table, 0..1).unwrap();
    pool.release(table).unwrap();
    assert_eq!(pool.pages_returning(), 1);
    drop(lease);
    assert_eq!(pool.reclaim_returned(), 1);
    pool.check_invariants();
}

/// The one-sided transport's receive side: a shared pool's reserved page, lent for receiving,
/// is written by a peer mapping of the pool's memfd, and the bytes are what a view reads once
/// the lease is back.
#[cfg(target_os = "linux")]
#[test]
fn a_shared_pool_page_lent_for_receiving_takes_a_peer_mappings_write() {
    use crate::{PagePool, PoolConfig, PoolSize};
    let mut pool = PagePool::new_shared(PoolConfig {
        layout: LAYOUT,
        size: PoolSize::Tokens(3 * LAYOUT.page_size_tokens),
        scrub_on_free: false,
    })
    .expect("a memfd pool");
    assert!(crate::tests::pool(1, false).shared_fd().is_none());
    let fd = pool
        .shared_fd()
        .expect("shared")
        .try_clone_to_owned()
        .unwrap();
    let peer = hugemem::shared::RemotePages::open(fd, pool.page_count(), LAYOUT.page_bytes())
        .expect("the peer maps the pool");
    let table = pool
        .allocate(owner(1, 1), 2 * LAYOUT.page_size_tokens)
        .unwrap();
    pool.set_state(&table, PageState::Receiving).unwrap();
    let leases = pool.lend_for_receive(&table, 1..2).unwrap();
    let granted = leases[0].page();
    assert_eq!(granted, table.pages()[1].0 .0);
    let bytes: Vec<u8> = (0..LAYOUT.page_bytes()).map(|i| i as u8).collect();
    assert!(peer.write(granted as usize, &bytes));
    drop(leases);
    pool.set_state(&table, PageState::Sealed).unwrap();
    let read = read_all(&mut pool, &table);
    let page_elems = LAYOUT.page_bytes() / 2;
    assert_eq!(
        bytemuck::cast_slice::<f16, u8>(&read[page_elems..]),
        &bytes[..]
    );
    assert!(
        read[..page_elems].iter().all(|v| *v == f16::ZERO),
        "page 0 untouched"
    );
    pool.release(table).unwrap();
    pool.check_invariants();
}
