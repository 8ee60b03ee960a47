//! Raw memory: anonymous mappings for the host tier, 4 KiB-aligned staging buffers, and chunk
//! copies between borrowed addresses.
//!
//! Invariants: a [`Mapping`] owns `len` bytes at `ptr` until dropped (then unmapped exactly once);
//! an [`AlignedBuf`] owns a 4 KiB-aligned heap buffer; [`copy`] is the single place where kvtier
//! copies bytes between raw addresses.
use std::io;
use std::ptr::NonNull;

/// Alignment of direct I/O buffers and of disk slots.
pub(crate) const IO_ALIGN: usize = 4096;

/// Whether `len` bytes at `start` are mapped readable and writable in this process, from
/// `/proc/self/maps` (adjacent mappings may share the range). `None` when the table cannot be
/// read (not Linux, no procfs, under Miri): the caller cannot tell and does not refuse.
pub(crate) fn mapped_rw(start: u64, len: u64) -> Option<bool> {
    if cfg!(miri) {
        return None; // Miri's addresses are not the host process's mappings.
    }
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let Some(end) = start.checked_add(len) else {
        return Some(false);
    };
    let mut spans: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (a, b) = f.next()?.split_once('-')?;
            let perms = f.next()?;
            let rw = perms.starts_with("rw");
            let a = u64::from_str_radix(a, 16).ok()?;
            let b = u64::from_str_radix(b, 16).ok()?;
            rw.then_some((a, b))
        })
        .collect();
    spans.sort_unstable();
    let mut at = start;
    for (a, b) in spans {
        if at >= end {
            break;
        }
        if a <= at && at < b {
            at = b;
        }
    }
    Some(at >= end)
}

/// `MemAvailable` of `/proc/meminfo` in bytes (memory the kernel can hand out without swapping),
/// if readable.
pub(crate) fn available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// An anonymous private memory mapping (the host tier's one large allocation).
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; which thread touches which bytes is
// governed by the host tier's block ownership (one writer per block at a time), not by the mapping.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` hands out only addresses, never references to the bytes.
unsafe impl Sync for Mapping {}

/// The huge page size of transparent and shared-memory huge pages on x86-64 (and 4 KiB-page
/// arm64).
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// `collapse_huge` asks for this many bytes at a time (a unit of work for one thread).
const COLLAPSE_PIECE: usize = 64 << 20;

/// `madvise(MADV_COLLAPSE)` (Linux 6.1+; the libc constant is not on every target).
const MADV_COLLAPSE: libc::c_int = 25;

/// Map `len` read-write bytes of the file `fd` shared, at a 2 MiB-aligned address, asking for
/// huge pages: a 2 MiB page of a shared-memory file can only be mapped whole (one page-table
/// entry) where the address is aligned like the file offset, which an unhinted `mmap` of a
/// file does not promise when the machine's `shmem_enabled` is `never`. The caller owns the
/// mapping and unmaps it (`len` bytes at the result).
pub(crate) fn map_shared_aligned(len: usize, fd: libc::c_int) -> io::Result<NonNull<u8>> {
    if cfg!(miri) {
        return map_huge(len, libc::MAP_SHARED, fd);
    }
    // SAFETY: sysconf has no memory preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let mapped = len
        .checked_next_multiple_of(page.max(1))
        .and_then(|m| m.checked_add(HUGE_PAGE).map(|r| (m, r)));
    let Some((mapped, reserve)) = mapped.filter(|_| len > 0) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "mapping length out of range",
        ));
    };
    // SAFETY: an anonymous, inaccessible reservation with no address hint has no preconditions;
    // checked against MAP_FAILED before use.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let b = base as usize;
    let at = b.next_multiple_of(HUGE_PAGE);
    // SAFETY: `at..at + mapped` lies inside the reservation just made (`at - b < HUGE_PAGE`), so
    // MAP_FIXED replaces only pages of ours; the result is checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        // SAFETY: unmapping the whole reservation made above, nothing else.
        unsafe { libc::munmap(base, reserve) };
        return Err(e);
    }
    // SAFETY: the head `b..at` and tail `at + mapped..b + reserve` are the unused, page-aligned
    // ends of our reservation (`at` and `mapped` are page multiples); the file mapping between
    // them stays. madvise is a hint whose failure is harmless.
    unsafe {
        if at > b {
            libc::munmap(base, at - b);
        }
        let tail = b + reserve - (at + mapped);
        if tail > 0 {
            libc::munmap((at + mapped) as *mut libc::c_void, tail);
        }
        libc::madvise(p, len, libc::MADV_HUGEPAGE);
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
}

/// Ask the kernel to back the 2 MiB-aligned whole huge pages of `len` bytes at `ptr` (a mapping
/// the caller owns) with huge pages now (`MADV_COLLAPSE`: synchronous, works on shared memory
/// whatever `shmem_enabled` says), in pieces of 64 MiB taken by up to `threads` threads at once
/// (the kernel zeroes and copies each piece on the calling thread: about 2.4 s per GiB of one
/// core), each piece tried up to 3 times on a transient refusal (`EAGAIN`). Pages it cannot
/// collapse (e.g. pinned ones) stay as they are. Returns the bytes of the pieces refused in the
/// end and the last error, or an error when the kernel does not know the request at all
/// (`EINVAL`: before Linux 6.1, or no THP).
pub(crate) fn collapse_huge(
    ptr: NonNull<u8>,
    len: usize,
    threads: usize,
) -> io::Result<(usize, Option<io::Error>)> {
    let start = (ptr.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr.as_ptr() as usize + len) / HUGE_PAGE * HUGE_PAGE;
    if end <= start || cfg!(miri) {
        return Ok((0, None));
    }
    // The first piece alone: a kernel that does not know the request says so once.
    let first = COLLAPSE_PIECE.min(end - start);
    if let Err(e) = collapse_piece(start, first) {
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Err(e);
        }
        return collapse_rest(start + first, end, threads).map(|(r, l)| (r + first, l.or(Some(e))));
    }
    collapse_rest(start + first, end, threads)
}

/// The pieces of `at..end` collapsed by `threads` threads, each taking the next piece.
fn collapse_rest(at: usize, end: usize, threads: usize) -> io::Result<(usize, Option<io::Error>)> {
    let next = std::sync::atomic::AtomicUsize::new(at);
    let refused = std::sync::Mutex::new((0usize, None::<io::Error>));
    let work = || loop {
        let at = next.fetch_add(COLLAPSE_PIECE, std::sync::atomic::Ordering::Relaxed);
        if at >= end {
            return;
        }
        let n = COLLAPSE_PIECE.min(end - at);
        if let Err(e) = collapse_piece(at, n) {
            let mut r = refused.lock().unwrap_or_else(|p| p.into_inner());
            r.0 += n;
            r.1 = Some(e);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads.max(1) {
            s.spawn(work);
        }
        work();
    });
    Ok(refused.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// `MADV_COLLAPSE` over `at..at + n`, retried twice on `EAGAIN`.
fn collapse_piece(at: usize, n: usize) -> io::Result<()> {
    let mut tries = 0;
    loop {
        // SAFETY: `at..at + n` lies inside the caller's mapping (collapse_huge's bounds);
        // MADV_COLLAPSE keeps the contents (the kernel copies them into the new pages) and only
        // changes the backing.
        let rc = unsafe { libc::madvise(at as *mut libc::c_void, n, MADV_COLLAPSE) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EAGAIN) && tries < 2 {
            tries += 1;
            continue;
        }
        return Err(e);
    }
}

/// `mmap` `len` read-write bytes with `flags` over `fd` (-1 for anonymous memory) at no address
/// hint, asking for transparent huge pages (fewer page faults on first touch and fewer pages to
/// pin). The caller owns the mapping and unmaps it.
pub(crate) fn map_huge(len: usize, flags: libc::c_int, fd: libc::c_int) -> io::Result<NonNull<u8>> {
    // Miri emulates plain MAP_PRIVATE|MAP_ANONYMOUS mappings only (no reservation hint, no
    // madvise): the memory it hands out behaves the same for every access kvtier makes.
    #[cfg(miri)]
    let flags = flags & !libc::MAP_NORESERVE;
    // SAFETY: a mapping with no address hint has no preconditions (an invalid `fd` is an error
    // return); the result is checked against MAP_FAILED before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ptr..ptr+len` is the mapping just created; madvise is only a hint and its failure
    // (e.g. THP or shmem huge pages disabled) is harmless, so its result is ignored.
    #[cfg(not(miri))]
    unsafe {
        libc::madvise(ptr, len, libc::MADV_HUGEPAGE);
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
}

impl Mapping {
    /// Map `len` bytes of zeroed anonymous memory, asking for transparent huge pages (fewer page
    /// faults on first touch and fewer pages to pin).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        let ptr = map_huge(
            len,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )?;
        Ok(Mapping { ptr, len })
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Fault every page in, splitting the range over `threads` threads (first touch decides the
    /// NUMA node and makes later pinning and copies fast). Zeroes the memory (it already is zero).
    pub(crate) fn touch_parallel(&self, threads: usize) {
        let threads = threads.max(1);
        let page = 2 << 20;
        let per = self.len.div_ceil(threads).div_ceil(page) * page;
        let base = self.addr();
        let len = self.len;
        std::thread::scope(|s| {
            for t in 0..threads {
                let start = t * per;
                if start >= len {
                    break;
                }
                let n = per.min(len - start);
                s.spawn(move || {
                    // SAFETY: `base+start .. base+start+n` lies inside this mapping, which outlives
                    // the scope; the threads write disjoint ranges, and nobody else can see the
                    // mapping yet (it is touched before the host tier is handed out).
                    unsafe { std::ptr::write_bytes((base + start) as *mut u8, 0, n) }
                });
            }
        });
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping created in `new`, unmapped only here.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A zero-initialised heap buffer aligned to [`IO_ALIGN`], for O_DIRECT staging and headers.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned; access goes through `&`/`&mut` methods.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `len` bytes (rounded up to a multiple of [`IO_ALIGN`], at least one page).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        let len = len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        let layout = std::alloc::Layout::from_size_align(len, IO_ALIGN)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        // SAFETY: `layout` has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot allocate {len} bytes"),
            )
        })?;
        Ok(AlignedBuf { ptr, len })
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised (zeroed at allocation) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len, IO_ALIGN) {
            // SAFETY: allocated in `new` with exactly this layout, freed only here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// Copy `len` bytes from address `src` to address `dst`.
///
/// # Safety
/// Both ranges must be valid, mapped, non-overlapping memory for the duration of the call, `dst`
/// writable, and no other thread may write `dst..dst+len` or `src..src+len` concurrently. kvtier
/// upholds this through block ownership: a job owns its destination blocks exclusively and its
/// source blocks are pinned read-only until the job completes.
pub(crate) unsafe fn copy(src: usize, dst: usize, len: usize) {
    // SAFETY: forwarded to the caller (see above).
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) }
}

/// Copies at least this long bypass the cache (non-temporal stores): bulk block moves do not
/// read their destination first and do not evict the engine's working set.
const STREAM_MIN: usize = 16 * 1024;

/// Whether [`copy_stream`] uses non-temporal stores (on by default: block copies below glibc's
/// own non-temporal threshold otherwise read every destination line first; measured at 95-99%
/// of one large memcpy against 42-57% with plain `memcpy`; `kvtier bench transfer` measures
/// both).
static NON_TEMPORAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Choose the bulk copy routine (see [`NON_TEMPORAL`]); the transfer benchmark compares both.
#[cfg(any(test, feature = "transfer-bench"))]
pub(crate) fn set_non_temporal(on: bool) {
    NON_TEMPORAL.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Like [`copy`], but with non-temporal stores for long copies (x86-64) when enabled. Call
/// [`store_fence`] before another thread may read the destination.
///
/// # Safety
/// As [`copy`].
pub(crate) unsafe fn copy_stream(src: usize, dst: usize, len: usize) {
    // Not under Miri: it does not run the streaming-store intrinsics (inline assembly); the
    // plain copy below covers the same ranges.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if NON_TEMPORAL.load(std::sync::atomic::Ordering::Relaxed) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        if len >= STREAM_MIN {
            let head = (32 - dst % 32) % 32;
            // SAFETY: the head is a prefix of the caller's ranges.
            unsafe { copy(src, dst, head) };
            let (mut s, mut d, mut n) = (src + head, dst + head, len - head);
            if has_avx2() {
                // SAFETY: AVX2 is present (checked at run time); `d` is 32-byte aligned and the
                // ranges are the caller's.
                (s, d, n) = unsafe { stream_avx2(s, d, n) };
            }
            while n >= 64 {
                // SAFETY: `s..s+64` and `d..d+64` lie inside the caller's ranges; `d` is
                // 16-byte aligned (after the head), loads are unaligned; SSE2 is part of the
                // x86-64 baseline.
                unsafe {
                    let a = _mm_loadu_si128(s as *const __m128i);
                    let b = _mm_loadu_si128((s + 16) as *const __m128i);
                    let c = _mm_loadu_si128((s + 32) as *const __m128i);
                    let e = _mm_loadu_si128((s + 48) as *const __m128i);
                    _mm_stream_si128(d as *mut __m128i, a);
                    _mm_stream_si128((d + 16) as *mut __m128i, b);
                    _mm_stream_si128((d + 32) as *mut __m128i, c);
                    _mm_stream_si128((d + 48) as *mut __m128i, e);
                }
                s += 64;
                d += 64;
                n -= 64;
            }
            // SAFETY: the tail is a suffix of the caller's ranges.
            unsafe { copy(s, d, n) };
            return;
        }
    }
    // SAFETY: forwarded to the caller.
    unsafe { copy(src, dst, len) }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

/// 128 bytes per iteration with 32-byte non-temporal stores; returns what is left.
///
/// # Safety
/// AVX2 must be available, `d` 32-byte aligned, and both ranges valid as for [`copy`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(mut s: usize, mut d: usize, mut n: usize) -> (usize, usize, usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    while n >= 128 {
        // SAFETY: 128 bytes inside the caller's ranges; aligned stores, unaligned loads.
        unsafe {
            let a = _mm256_loadu_si256(s as *const __m256i);
            let b = _mm256_loadu_si256((s + 32) as *const __m256i);
            let c = _mm256_loadu_si256((s + 64) as *const __m256i);
            let e = _mm256_loadu_si256((s + 96) as *const __m256i);
            _mm256_stream_si256(d as *mut __m256i, a);
            _mm256_stream_si256((d + 32) as *mut __m256i, b);
            _mm256_stream_si256((d + 64) as *mut __m256i, c);
            _mm256_stream_si256((d + 96) as *mut __m256i, e);
        }
        s += 128;
        d += 128;
        n -= 128;
    }
    (s, d, n)
}

/// Order earlier non-temporal stores before everything after (a job's completion).
pub(crate) fn store_fence() {
    // Miri does not run `sfence` (inline assembly); its copies are ordinary stores.
    #[cfg(miri)]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: `sfence` has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// View `len` bytes at `addr` as a slice (for checksums and remote puts).
///
/// # Safety
/// The range must be valid initialised memory that nobody writes while the slice lives.
pub(crate) unsafe fn slice<'a>(addr: usize, len: usize) -> &'a [u8] {
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// View `len` bytes at `addr` as a mutable slice (for remote gets).
///
/// # Safety
/// The range must be valid memory that nobody else reads or writes while the slice lives.
pub(crate) unsafe fn slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    #[cfg_attr(miri, ignore)]
    fn mapped_rw_tells_heap_from_unmapped_and_read_only() {
        let v = vec![0u8; 1 << 20];
        assert_eq!(mapped_rw(v.as_ptr() as u64, v.len() as u64), Some(true));
        // The first page is never mapped; code and constants are not writable.
        assert_eq!(mapped_rw(0x1000, 64), Some(false));
        static RO: [u8; 16] = [7; 16];
        assert_eq!(mapped_rw(RO.as_ptr() as u64, 16), Some(false));
        assert_eq!(mapped_rw(v.as_ptr() as u64, u64::MAX), Some(false));
    }

    use super::*;

    #[test]
    fn mapping_is_zeroed_and_writable() {
        // Miri interprets every byte check: a smaller mapping there, same code path.
        let m = Mapping::new(if cfg!(miri) { 256 << 10 } else { 8 << 20 }).unwrap();
        m.touch_parallel(3);
        // SAFETY: the mapping is live for the whole test and nothing else touches it.
        let s = unsafe { slice_mut(m.addr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
        s[12345] = 7;
        // SAFETY: as above; the mutable view is not used again.
        assert_eq!(unsafe { slice(m.addr(), m.len()) }[12345], 7);
    }

    #[test]
    fn streaming_copy_is_exact_for_any_alignment() {
        set_non_temporal(true);
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
        for (so, dof, len) in [
            (0, 0, 70_000),
            (3, 5, 65_537),
            (1, 0, 16 * 1024 + 7),
            (0, 9, 100),
        ] {
            let mut dst = vec![0u8; 100_050];
            // SAFETY: both ranges lie inside their vectors (offset + len < length) and differ.
            unsafe {
                copy_stream(
                    src.as_ptr() as usize + so,
                    dst.as_mut_ptr() as usize + dof,
                    len,
                )
            };
            store_fence();
            assert_eq!(&dst[dof..dof + len], &src[so..so + len]);
            assert!(dst[..dof].iter().all(|&b| b == 0));
            assert!(dst[dof + len..].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn aligned_buf_is_aligned() {
        let b = AlignedBuf::new(100).unwrap();
        assert_eq!(b.addr() % IO_ALIGN, 0);
        assert_eq!(b.len(), IO_ALIGN);
    }
}
