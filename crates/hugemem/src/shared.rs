//! Memory that two processes on one host map at once: what the one-sided KV transport is
//! built on. A decode worker's page pool lives in a sealed memfd ([`SharedMemory`]); it passes
//! the descriptor over a Unix socket ([`send_fds`], [`recv_fds`]) to a prefill worker, which
//! maps it ([`RemotePages`]) and copies each granted page straight into it. Beside it, one
//! small memfd per link holds a [`WriteFence`]: how decode stops a prefill's writes, and
//! learns that they have stopped, when the link between them is gone.
//!
//! The pool's safety across processes rests on the transfer protocol, not on this module:
//! decode lends every page it grants as a write lease, so no view of it exists in decode while
//! prefill may write, and it reuses a granted page only once prefill has said its writes are
//! over or the fence has shown they are. What this module guarantees is narrower and local:
//! every write is bounds-checked against the mapping, and the mapping cannot shrink under a
//! writer (the memfd is sealed), so a peer can make a write land in the wrong page only by
//! naming it, never make one fault.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// A `MAP_SHARED` mapping of a whole memfd, read-write.
pub struct SharedMemory {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain bytes owned by this value (and, by design, by the peer process
// that maps the same memfd: see the module docs for what keeps that sound); moving or sharing
// the handle moves or shares only the pointer, and every access through it goes through raw
// copies or atomics, never through a Rust reference to the bytes handed to another thread.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

/// The seals a shared region must carry before a peer writes into it: its size can never
/// change again, so no write within its length can fault.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

impl SharedMemory {
    /// A new zeroed memfd of `len` bytes (`name` shows in `/proc/PID/maps`), sealed at that
    /// size, and mapped. `len` must be non-zero.
    pub fn create(name: &CStr, len: usize) -> io::Result<SharedMemory> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an empty shared region",
            ));
        }
        // SAFETY: `name` is a valid C string; the result is checked before use.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `memfd_create` returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
        // SAFETY: plain syscalls on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let memory = SharedMemory::map(fd, len)?;
        memory.populate();
        Ok(memory)
    }

    /// Allocates the whole region and maps it now. Shared memory gets no transparent huge
    /// pages unless the host opts in (`shmem_enabled`), so each 4 KiB of a KV pool would
    /// otherwise be allocated, zeroed and mapped on first touch: ~90 faults per page, on the
    /// transfer's path, for the first requests through the pool. The creator pays it once at
    /// start; a peer's mapping of the region ([`SharedMemory::open`]) then only maps pages
    /// that exist, lazily, rather than making its first request wait for the whole pool. A
    /// kernel older than 5.14 refuses the advice, and the faults come back; nothing else
    /// changes.
    fn populate(&self) {
        // SAFETY: advice on exactly this mapping, which `self` keeps alive.
        unsafe {
            libc::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
    }

    /// Maps a memfd a peer passed us, after checking that it is exactly `len` bytes and
    /// sealed against resizing (a peer that could shrink it could make our writes fault).
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        // SAFETY: `fstat` fills a plain struct for a descriptor we own.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `stat` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if usize::try_from(stat.st_size).ok() != Some(len) || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the shared region is {} bytes, not the {len} announced",
                    stat.st_size
                ),
            ));
        }
        // SAFETY: a plain query on a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SIZE_SEALS != SIZE_SEALS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the shared region is not sealed against resizing",
            ));
        }
        SharedMemory::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        // SAFETY: a shared mapping of `len` bytes of a memfd that is exactly that long and
        // sealed so; the kernel picks the address, and the result is checked before use.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if len >= crate::HUGE_PAGE_BYTES {
            // SAFETY: advice on the range just mapped; where shmem huge pages are off it
            // changes nothing, which is still correct.
            unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
        }
        let ptr = NonNull::new(raw.cast::<u8>()).expect("mmap never maps page zero");
        Ok(SharedMemory { ptr, len, fd })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to pass to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Start of the mapping (aligned to the system page size).
    pub(crate) fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; no pointer into it outlives `self` (the
        // owners of such pointers hold `self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A peer's page pool, mapped for writing granted pages into (the prefill side of the
/// one-sided transport).
pub struct RemotePages {
    memory: SharedMemory,
    page_bytes: usize,
    page_count: usize,
}

impl RemotePages {
    /// Maps the pool memfd a decode worker passed: `page_count` pages of `page_bytes`.
    pub fn open(fd: OwnedFd, page_count: usize, page_bytes: usize) -> io::Result<RemotePages> {
        let len = page_count
            .checked_mul(page_bytes)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "pool size overflows"))?;
        Ok(RemotePages {
            memory: SharedMemory::open(fd, len)?,
            page_bytes,
            page_count,
        })
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub fn page_count(&self) -> usize {
        self.page_count
    }

    /// Copies `bytes` into page `page` with `copy` (given the source and the page's start) and
    /// returns what it returns; `None` (and nothing written) for a page past the pool or bytes
    /// of another length than a page.
    ///
    /// # Safety
    /// `copy` must write at most `bytes.len()` bytes from the pointer it is given.
    pub unsafe fn write_with<R>(
        &self,
        page: usize,
        bytes: &[u8],
        copy: impl FnOnce(&[u8], *mut u8) -> R,
    ) -> Option<R> {
        if page >= self.page_count || bytes.len() != self.page_bytes {
            return None;
        }
        // SAFETY: `page < page_count` and the mapping is `page_count * page_bytes` long and
        // sealed against shrinking, so the page lies inside it and cannot fault; `bytes` is a
        // live slice of our own memory, which the mapping never overlaps (it is a fresh mapping
        // of the peer's memfd); `copy` writes within the page (this function's contract).
        let destination = unsafe { self.memory.as_ptr().as_ptr().add(page * self.page_bytes) };
        Some(copy(bytes, destination))
    }

    /// Copies `bytes` into page `page` ([`copy_streaming`]). False (and nothing written) for a
    /// page past the pool or bytes of another length than a page.
    pub fn write(&self, page: usize, bytes: &[u8]) -> bool {
        // SAFETY: `write_with` hands `copy_streaming` a whole page of the mapping, apart from
        // `bytes`, and it writes exactly `bytes.len()` bytes there. The peer process may read
        // the page meanwhile only by breaking the protocol (module docs); a raw copy creates no
        // Rust reference to the destination.
        let written = unsafe { self.write_with(page, bytes, |from, to| copy_streaming(from, to)) };
        written.is_some()
    }
}

/// Copies `source` to `destination` with non-temporal stores where the CPU has them (every
/// x86-64 does), then fences them.
///
/// Why: a page written into a peer's pool is for the peer's cores to read, not this one's, so
/// ordinary stores, which first read each destination line into this core's cache, spend
/// memory bandwidth for nothing. On the 2-core AMD EPYC VM of 2026-12-07 a C probe copied
/// 368,640-byte pages at 18.4 GB/s this way against 12.5–13.4 GB/s for `memcpy`. The fence
/// makes the stores visible to every later store of this thread (the write fence's counter,
/// the channel that reports the write), as ordinary stores are.
///
/// # Safety
/// `destination` must be valid for writes of `source.len()` bytes, and those bytes must not
/// overlap `source`.
pub(crate) unsafe fn copy_streaming(source: &[u8], destination: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LINE: usize = 64;
        let len = source.len();
        // Bytes up to the first 16-byte boundary of the destination go as ordinary stores,
        // as does the tail past the last whole line.
        let head = destination.align_offset(16).min(len);
        let lines = (len - head) / LINE;
        // SAFETY: every offset below is less than `len`, so every pointer stays inside the
        // caller's two ranges; `destination + head` is 16-byte aligned, as the streaming
        // stores need, and stays so in steps of 16; SSE2 is part of x86-64.
        unsafe {
            std::ptr::copy_nonoverlapping(source.as_ptr(), destination, head);
            let (from, to) = (source.as_ptr().add(head), destination.add(head));
            for line in 0..lines {
                for part in 0..LINE / 16 {
                    let at = line * LINE + part * 16;
                    let value = _mm_loadu_si128(from.add(at).cast::<__m128i>());
                    _mm_stream_si128(to.add(at).cast::<__m128i>(), value);
                }
            }
            let done = head + lines * LINE;
            std::ptr::copy_nonoverlapping(
                source.as_ptr().add(done),
                destination.add(done),
                len - done,
            );
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(source.as_ptr(), destination, source.len());
    }
}

/// Counters in a memory page shared by the two ends of one link: decode sets `fenced` when
/// the link is gone, and prefill counts the page writes it has in progress in `writing` and
/// those it has finished in `written` (decode's sign that a transfer is making progress,
/// since one-sided writes send it no frames).
///
/// A writer raises `writing`, then reads `fenced`; decode sets `fenced`, then reads `writing`.
/// Both in sequentially consistent order, so either the writer sees the fence and writes
/// nothing, or decode sees the writer and waits for `writing` to fall back to zero. After
/// that, no write of that link can land: what `quiesced` reports.
pub struct WriteFence {
    memory: SharedMemory,
}

/// Bytes of a fence's memfd (one system page).
pub const WRITE_FENCE_BYTES: usize = 4096;

impl WriteFence {
    /// A new fence (decode's side), to pass to the link's prefill with [`WriteFence::fd`].
    pub fn create() -> io::Result<WriteFence> {
        let memory = SharedMemory::create(c"airlock-write-fence", WRITE_FENCE_BYTES)?;
        Ok(WriteFence { memory })
    }

    /// Maps the fence a decode worker passed (prefill's side).
    pub fn open(fd: OwnedFd) -> io::Result<WriteFence> {
        Ok(WriteFence {
            memory: SharedMemory::open(fd, WRITE_FENCE_BYTES)?,
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.memory.fd()
    }

    fn counter(&self, index: usize) -> &AtomicU32 {
        assert!(index < 3);
        // SAFETY: the mapping is a page long and page-aligned, so the 4-byte counters lie
        // inside it, aligned; the memory is only ever accessed atomically, by this process
        // through this method and by the peer through its own, so any bit pattern another
        // process leaves there is a valid `u32`.
        unsafe { &*self.memory.as_ptr().as_ptr().cast::<AtomicU32>().add(index) }
    }

    fn fenced(&self) -> &AtomicU32 {
        self.counter(0)
    }

    fn writing(&self) -> &AtomicU32 {
        self.counter(1)
    }

    /// Page writes finished over the link's life (wrapping): it changes while a prefill
    /// makes progress.
    pub fn written(&self) -> u32 {
        self.counter(2).load(Ordering::Relaxed)
    }

    /// Prefill: a write may start, or `None` once decode has fenced the link. Hold the ticket
    /// until the write is over.
    pub fn begin_write(&self) -> Option<WriteTicket<'_>> {
        self.writing().fetch_add(1, Ordering::SeqCst);
        if self.fenced().load(Ordering::SeqCst) != 0 {
            self.writing().fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(WriteTicket { fence: self })
    }

    /// Decode: no write of this link starts from now on.
    pub fn fence(&self) {
        self.fenced().store(1, Ordering::SeqCst);
    }

    /// Decode, after [`WriteFence::fence`]: every write that had started is over.
    pub fn quiesced(&self) -> bool {
        self.fenced().load(Ordering::SeqCst) != 0 && self.writing().load(Ordering::SeqCst) == 0
    }
}

/// A write in progress under a [`WriteFence`]; its drop ends it.
pub struct WriteTicket<'f> {
    fence: &'f WriteFence,
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        self.fence.counter(2).fetch_add(1, Ordering::Relaxed);
        // Release: the page bytes written under this ticket are visible to whoever reads
        // `writing` as zero.
        self.fence.writing().fetch_sub(1, Ordering::SeqCst);
    }
}

/// At most this many descriptors travel in one message.
pub const FDS_MAX: usize = 4;

/// Sends `data` with `fds` attached on the Unix stream socket `socket`, without blocking:
/// `WouldBlock` when the socket is full (retry on writability). Returns the bytes sent.
pub fn send_fds(socket: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    assert!(
        !data.is_empty() && fds.len() <= FDS_MAX,
        "descriptors ride on at least one byte"
    );
    let raw: Vec<libc::c_int> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let fd_bytes = std::mem::size_of_val(raw.as_slice());
    let mut control = [0u64; 8]; // aligned for cmsghdr, larger than CMSG_SPACE of FDS_MAX ints
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: `msghdr` is plain data; every pointer set below outlives the `sendmsg` call.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic on a length.
    message.msg_controllen = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    assert!(message.msg_controllen <= std::mem::size_of_val(&control));
    // SAFETY: `msg_control` points at `control`, which is at least `msg_controllen` bytes and
    // aligned, so the first header and its data (`fd_bytes`) fit inside it.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
        std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), libc::CMSG_DATA(header), fd_bytes);
    }
    // SAFETY: a valid socket descriptor and a message whose buffers all live until return.
    let sent = unsafe {
        libc::sendmsg(
            socket.as_raw_fd(),
            &message,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// Receives bytes into `data` and the descriptors attached to them from the Unix stream
/// socket `socket`, without blocking (`WouldBlock`: retry on readability). Descriptors come
/// close-on-exec. A message with more descriptors than [`FDS_MAX`] is refused (the kernel
/// closes what did not fit; we close the rest).
pub fn recv_fds(socket: BorrowedFd<'_>, data: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: plain data; the pointers set below outlive the `recvmsg` call.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: a valid socket descriptor and buffers that live until return.
    let received = unsafe {
        libc::recvmsg(
            socket.as_raw_fd(),
            &mut message,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if received < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `control` with well-formed headers;
    // the CMSG_* macros walk exactly those. Each SCM_RIGHTS descriptor is a fresh one the
    // kernel installed for us, owned by nothing else, so wrapping it in `OwnedFd` is sound.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data_bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let count = data_bytes / size_of::<libc::c_int>();
                let first = libc::CMSG_DATA(header).cast::<libc::c_int>();
                for index in 0..count {
                    let raw = std::ptr::read_unaligned(first.add(index));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            header = libc::CMSG_NXTHDR(&message, header);
        }
    }
    if message.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > FDS_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a peer sent more descriptors than asked for",
        ));
    }
    Ok((received as usize, fds))
}

/// Whether a process with this id still exists (a pid can be reused, so `true` may name
/// another process: callers use this only to learn that a peer is gone, never that it lives).
pub fn process_exists(pid: i32) -> bool {
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let result = unsafe { libc::kill(pid, 0) };
    result == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests;
