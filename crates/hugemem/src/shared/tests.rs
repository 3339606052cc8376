use super::*;
use crate::PageCells;
use std::os::unix::net::UnixStream;

fn dup(fd: BorrowedFd<'_>) -> OwnedFd {
    fd.try_clone_to_owned().expect("dup")
}

#[test]
fn a_peer_mapping_writes_into_the_pool_pages_it_names_and_nowhere_else() {
    let cells = PageCells::<u16>::zeroed_shared(4, 2048).expect("memfd pool");
    let remote = RemotePages::open(dup(cells.shared_fd().expect("shared")), 4, 4096)
        .expect("the peer maps it");
    let page = vec![0xA5u8; 4096];
    assert!(remote.write(2, &page));
    assert!(!remote.write(4, &page), "past the pool");
    assert!(!remote.write(1, &page[..100]), "not a page's length");
    for index in 0..4 {
        let read = cells.read(index).expect("no writer");
        let expected = if index == 2 { 0xA5A5 } else { 0 };
        assert!(read.iter().all(|&v| v == expected), "page {index}");
    }
}

#[test]
fn a_region_of_another_size_or_without_its_seals_is_refused() {
    let cells = PageCells::<u16>::zeroed_shared(4, 2048).expect("memfd pool");
    let fd = || dup(cells.shared_fd().expect("shared"));
    assert!(
        RemotePages::open(fd(), 5, 4096).is_err(),
        "larger than announced"
    );
    assert!(
        RemotePages::open(fd(), 3, 4096).is_err(),
        "smaller than announced"
    );
    assert!(
        RemotePages::open(fd(), usize::MAX, 4096).is_err(),
        "overflow"
    );
    // A memfd that is the right size but could still shrink under our writes.
    // SAFETY: a fresh descriptor from memfd_create, owned here.
    let unsealed = unsafe {
        let raw = libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC);
        assert!(raw >= 0);
        assert_eq!(libc::ftruncate(raw, 4 * 4096), 0);
        OwnedFd::from_raw_fd(raw)
    };
    let error = RemotePages::open(unsealed, 4, 4096).err().expect("refused");
    assert!(error.to_string().contains("sealed"), "{error}");
}

#[test]
fn descriptors_cross_a_unix_socket_with_their_bytes() {
    let (ours, theirs) = UnixStream::pair().expect("socket pair");
    let fence = WriteFence::create().expect("fence");
    let cells = PageCells::<u16>::zeroed_shared(2, 2048).expect("memfd pool");
    let sent = send_fds(
        ours.as_fd(),
        b"pool",
        &[cells.shared_fd().expect("shared"), fence.fd()],
    )
    .expect("sent");
    assert_eq!(sent, 4);
    let mut data = [0u8; 16];
    let (received, mut fds) = recv_fds(theirs.as_fd(), &mut data).expect("received");
    assert_eq!(&data[..received], b"pool");
    assert_eq!(fds.len(), 2);
    let peer_fence = WriteFence::open(fds.pop().expect("fence fd")).expect("maps");
    let remote = RemotePages::open(fds.pop().expect("pool fd"), 2, 4096).expect("maps");
    assert!(remote.write(1, &[7u8; 4096]));
    assert!(cells
        .read(1)
        .expect("readable")
        .iter()
        .all(|&v| v == 0x0707));
    // The fence is the same memory on both ends.
    let ticket = peer_fence.begin_write().expect("not fenced");
    fence.fence();
    assert!(!fence.quiesced(), "a write is in progress");
    drop(ticket);
    assert!(fence.quiesced());
    assert_eq!(
        fence.written(),
        1,
        "the finished write counts, on both ends"
    );
    assert!(
        peer_fence.begin_write().is_none(),
        "fenced: no write starts"
    );
    assert!(
        fence.quiesced(),
        "a refused write leaves nothing in progress"
    );
    // Nothing waiting: no descriptor appears from nowhere.
    let error = recv_fds(theirs.as_fd(), &mut data).expect_err("empty socket");
    assert_eq!(error.kind(), io::ErrorKind::WouldBlock);
}

#[test]
fn a_fence_waits_for_writes_on_other_threads_and_stops_new_ones() {
    let fence = std::sync::Arc::new(WriteFence::create().expect("fence"));
    let writers: Vec<_> = (0..2)
        .map(|_| {
            let fence = fence.clone();
            std::thread::spawn(move || {
                let mut written = 0u32;
                while let Some(_ticket) = fence.begin_write() {
                    written += 1;
                    std::thread::yield_now();
                }
                written
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(20));
    fence.fence();
    while !fence.quiesced() {
        std::thread::yield_now();
    }
    let total: u32 = writers.into_iter().map(|w| w.join().expect("writer")).sum();
    assert!(total > 0, "the writers ran before the fence");
    assert!(fence.begin_write().is_none());
}

#[test]
fn a_gone_process_is_told_apart_from_a_living_one() {
    assert!(process_exists(std::process::id() as i32));
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let pid = child.id() as i32;
    child.wait().expect("reaped");
    assert!(
        !process_exists(pid),
        "reaped, and pids are not reused this fast"
    );
}

/// Whether this kernel takes `MADV_POPULATE_WRITE` (on a page of anonymous memory).
fn kernel_populates() -> bool {
    // SAFETY: maps one fresh anonymous page, advises on exactly it, and unmaps it.
    unsafe {
        let page = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(page, libc::MAP_FAILED, "mmap");
        let advised = libc::madvise(page, 4096, libc::MADV_POPULATE_WRITE) == 0;
        libc::munmap(page, 4096);
        advised
    }
}

/// This thread's minor page faults so far.
fn minor_faults() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a writable rusage; RUSAGE_THREAD reports on the calling thread.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: getrusage filled it (checked above).
    unsafe { usage.assume_init() }.ru_minflt
}

/// The pool's own mapping is populated when the pool is made: writing every 4 KiB of it
/// afterwards takes (almost) no page fault, where an unpopulated mapping takes one per 4 KiB
/// (shared memory gets no huge pages by default), on the transfer's path. A peer's mapping of
/// it, made on a request's path, is left to fault in: it only maps pages that exist.
#[test]
fn a_pool_in_shared_memory_is_populated_when_made() {
    if !kernel_populates() {
        crate::tests::skipped(
            "hugemem::shared::a_pool_in_shared_memory_is_populated_when_made",
            "this kernel refuses MADV_POPULATE_WRITE (Linux 5.14 and later have it)",
        );
        return;
    }
    const PAGES: usize = 64;
    const PAGE_LEN: usize = 32 * 1024;
    let small_pages = PAGES * PAGE_LEN * 2 / 4096;
    let cells = PageCells::<u16>::zeroed_shared(PAGES, PAGE_LEN).expect("memfd pool");
    let before = minor_faults();
    for index in 0..PAGES {
        cells.write(index).expect("no reader").fill(0x5A5A);
    }
    let faults = minor_faults() - before;
    eprintln!("{small_pages} small pages written: {faults} faults");
    assert!(
        faults < (small_pages / 8) as i64,
        "{faults} faults writing {small_pages} small pages"
    );
    let remote = RemotePages::open(dup(cells.shared_fd().expect("shared")), PAGES, PAGE_LEN * 2)
        .expect("the peer maps it");
    assert!(remote.write(3, &vec![0xA5u8; PAGE_LEN * 2]));
    assert!(cells
        .read(3)
        .expect("no writer")
        .iter()
        .all(|&v| v == 0xA5A5));
}

#[test]
fn a_streaming_copy_writes_exactly_its_range_at_any_alignment_and_length() {
    // Lengths around the 16-byte head and 64-byte lines, and a real KV page; destinations at
    // every offset of a 16-byte boundary. The bytes around the range must stay untouched.
    let source: Vec<u8> = (0..368_640u32 + 200).map(|i| (i * 7 + 3) as u8).collect();
    for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 4096, 368_640] {
        for offset in 0..17 {
            for source_offset in [0, 3] {
                let mut target = vec![0xEEu8; len + 64];
                let from = &source[source_offset..source_offset + len];
                // SAFETY: `target` holds `offset + len` bytes past its start (len + 64 in
                // all), and it is a buffer of its own, apart from `source`.
                unsafe { copy_streaming(from, target.as_mut_ptr().add(offset)) };
                assert_eq!(&target[offset..offset + len], from, "len {len} at {offset}");
                assert!(
                    target[..offset]
                        .iter()
                        .chain(&target[offset + len..])
                        .all(|&b| b == 0xEE),
                    "a byte outside the range changed: len {len} at {offset}"
                );
            }
        }
    }
}
