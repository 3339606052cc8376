use super::*;

/// Says that `what` could not be tested on this machine, and why: on stderr, and appended to
/// the file `AIRLOCK_SKIPPED_TESTS` names, which `.ci/run` prints after the run (cargo shows a
/// passing test's output only with `--nocapture`, so a skip would otherwise pass unseen).
pub(crate) fn skipped(what: &str, why: &str) {
    let line = format!("SKIPPED {what}: {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("AIRLOCK_SKIPPED_TESTS") {
        use std::io::Write;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        if let Ok(mut file) = file {
            let _ = writeln!(file, "{line}");
        }
    }
}

#[test]
fn starts_zeroed_and_keeps_what_is_written() {
    // Below, at, and just above one huge page, and not a whole number of them.
    for len in [
        0,
        1,
        1000,
        HUGE_PAGE_BYTES / 4,
        HUGE_PAGE_BYTES / 4 + 1,
        3_000_001,
    ] {
        let mut buffer = HugeBuffer::<u32>::zeroed(len);
        assert_eq!(buffer.len(), len);
        assert!(buffer.iter().all(|&value| value == 0), "len {len}: zeroed");
        for (index, value) in buffer.iter_mut().enumerate() {
            *value = index as u32 ^ 0x5A5A_5A5A;
        }
        let expected = (0..len).map(|index| index as u32 ^ 0x5A5A_5A5A);
        assert!(buffer.iter().copied().eq(expected), "len {len}: kept");
    }
}

#[test]
fn only_buffers_of_a_huge_page_or_more_are_mapped() {
    let small = HugeBuffer::<u8>::zeroed(HUGE_PAGE_BYTES - 1);
    let large = HugeBuffer::<u8>::zeroed(HUGE_PAGE_BYTES);
    assert!(!small.is_advised());
    assert_eq!(large.is_advised(), cfg!(target_os = "linux"));
}

#[cfg(target_os = "linux")]
#[test]
fn mapped_buffers_start_on_a_huge_page_boundary() {
    let buffer = HugeBuffer::<u16>::zeroed(3 * HUGE_PAGE_BYTES);
    assert!(buffer.is_advised());
    assert_eq!(buffer.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
}

/// The advice is what makes a mapping eligible for huge pages when the kernel's THP mode is
/// `madvise` (the default of most distributions, and of the machines we measure on): the
/// kernel's own `THPeligible` says so for our buffer, and says the opposite for a plain heap
/// buffer of the same size, so the check can tell the two apart. Where THP is `always` both
/// are eligible and where it is `never` neither; the test then checks only the buffer.
#[cfg(target_os = "linux")]
#[test]
fn the_kernel_counts_the_buffer_eligible_for_huge_pages() {
    let Ok(mode) = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled") else {
        skipped(
            "hugemem::the_kernel_counts_the_buffer_eligible_for_huge_pages",
            "no transparent huge pages in this kernel",
        );
        return;
    };
    let bytes = 8 * HUGE_PAGE_BYTES;
    let advised = HugeBuffer::<u8>::zeroed(bytes);
    // Over glibc's largest mmap threshold, so this is a mapping of its own too.
    let plain = vec![0u8; bytes];
    let eligible = |address: usize| thp_eligible(address).expect("the address is mapped");
    match mode.split_whitespace().find(|word| word.starts_with('[')) {
        Some("[madvise]") => {
            assert!(
                eligible(advised.as_ptr() as usize),
                "advised buffer eligible"
            );
            assert!(
                !eligible(plain.as_ptr() as usize),
                "plain buffer not eligible"
            );
        }
        Some("[always]") => assert!(eligible(advised.as_ptr() as usize)),
        _ => assert!(!eligible(advised.as_ptr() as usize)),
    }
}

/// `THPeligible` of the mapping in `/proc/self/smaps` that holds `address`.
#[cfg(target_os = "linux")]
fn thp_eligible(address: usize) -> Option<bool> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps is readable");
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((start, end)) = range.split_once('-') {
                if let (Ok(start), Ok(end)) = (
                    usize::from_str_radix(start, 16),
                    usize::from_str_radix(end, 16),
                ) {
                    inside = (start..end).contains(&address);
                    continue;
                }
            }
        }
        if inside {
            if let Some(value) = line.strip_prefix("THPeligible:") {
                return Some(value.trim() == "1");
            }
        }
    }
    None
}

mod cells {
    use crate::PageCells;
    use std::sync::Arc;

    #[test]
    fn readers_share_a_page_and_exclude_its_writer_until_they_drop() {
        let cells = PageCells::<u32>::zeroed(3, 4);
        let first = cells.read(1).expect("a free page reads");
        let second = cells.read(1).expect("readers share");
        assert!(cells.write(1).is_none(), "no writer beside readers");
        assert!(cells.is_borrowed(1) && !cells.is_borrowed(0));
        drop((first, second));
        let mut writer = cells.write(1).expect("the readers are gone");
        writer.copy_from_slice(&[1, 2, 3, 4]);
        assert!(cells.read(1).is_none(), "no reader beside the writer");
        assert!(cells.write(1).is_none(), "one writer at a time");
        // Other pages are independent of this one.
        cells.write(0).expect("page 0 is free")[0] = 9;
        drop(writer);
        assert_eq!(&*cells.read(1).unwrap(), &[1, 2, 3, 4]);
        assert_eq!(&*cells.read(0).unwrap(), &[9, 0, 0, 0]);
        assert_eq!(&*cells.read(2).unwrap(), &[0; 4], "pages start zeroed");
        assert!(!cells.is_borrowed(0) && !cells.is_borrowed(1));
    }

    #[test]
    fn an_owned_reader_crosses_threads_and_keeps_the_page_and_the_memory() {
        // Large enough for the huge-page mapping path, and a small one for the heap path.
        for page_len in [1 << 20, 16] {
            let cells = Arc::new(PageCells::<u16>::zeroed(4, page_len));
            cells.write(2).unwrap().fill(7);
            let lent = cells.read_owned(2).expect("a free page lends");
            let copy = lent.clone();
            // The pool's own handle goes; the lent page stays readable and unwritable.
            let weak = Arc::downgrade(&cells);
            assert!(cells.write(2).is_none());
            drop(cells);
            let sum = std::thread::spawn(move || lent.iter().map(|&v| u64::from(v)).sum::<u64>())
                .join()
                .unwrap();
            assert_eq!(sum, 7 * page_len as u64);
            assert_eq!(copy.page(), 2);
            assert!(
                weak.upgrade().is_some(),
                "the memory lives while a page is lent"
            );
            drop(copy);
            assert!(weak.upgrade().is_none(), "and goes with the last guard");
        }
    }

    #[test]
    fn an_owned_writer_fills_a_page_from_another_thread_and_excludes_everyone() {
        let cells = Arc::new(PageCells::<u8>::zeroed(2, 8));
        let mut lease = cells.write_owned(1).expect("a free page lends for writing");
        assert!(cells.read(1).is_none() && cells.write_owned(1).is_none());
        assert!(cells.read(0).is_some(), "other pages stay free");
        let lease = std::thread::spawn(move || {
            lease.copy_from_slice(b"received");
            lease
        })
        .join()
        .unwrap();
        assert_eq!(lease.page(), 1);
        drop(lease);
        assert_eq!(&*cells.read(1).unwrap(), b"received");
    }

    #[test]
    fn concurrent_readers_and_writers_of_other_pages_never_collide() {
        let cells = Arc::new(PageCells::<u64>::zeroed(8, 64));
        let threads: Vec<_> = (0..4)
            .map(|thread| {
                let cells = cells.clone();
                std::thread::spawn(move || {
                    for round in 0..2_000u64 {
                        // Each thread writes its own page and reads every page.
                        let own = thread * 2;
                        if let Some(mut page) = cells.write(own) {
                            page.fill(round);
                        }
                        for page in 0..8 {
                            if let Some(read) = cells.read(page) {
                                let first = read[0];
                                assert!(read.iter().all(|&v| v == first), "torn page");
                            }
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert!((0..8).all(|page| !cells.is_borrowed(page)));
    }
}
