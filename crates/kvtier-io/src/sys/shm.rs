//! Shared memory for the node tier: one file (on tmpfs, e.g. `/dev/shm`) mapped `MAP_SHARED` by
//! the node and by every attached engine process, which receive the file as a descriptor passed
//! over the node's socket (never by path).
//!
//! Invariants:
//! - an [`Arena`] maps exactly `len` bytes of a file whose space was reserved with `fallocate`
//!   when it was created, so a write into the mapping never faults for lack of tmpfs space (a
//!   sparse tmpfs file would SIGBUS the engine instead);
//! - bytes of the mapping are only ever accessed through raw copies ([`Arena::write`],
//!   [`Arena::read`]) with bounds checked here; no Rust reference to shared bytes is created,
//!   because other processes write them. Which process writes which range when is the node's
//!   books' business (one writer per reserved slot; leased slots are never rewritten);
//! - a client maps only a descriptor that is a regular file of the node's uid, large enough and
//!   open read-write ([`Arena::from_fd`]), checked before `mmap`; from a node of another uid,
//!   only a tmpfs file sealed against shrinking (`F_SEAL_SHRINK`), so that node cannot truncate
//!   it under the engine's mapping (a SIGBUS, a crash, where a bad block must be a miss);
//! - an arena passed to another uid is a sealed memfd ([`Arena::create_sealed`]): its size is
//!   sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before any process gets it, so no
//!   process it was passed to can truncate it under the node's mapping;
//! - the node holds an exclusive `flock` on its arena file for its lifetime, so a file whose lock
//!   is free belongs to a node that died and may be removed;
//! - an engine process on a CUDA machine may register its mapping with the driver
//!   ([`Arena::register_cuda`], `cuMemHostRegister`) so the device copies arena slots by DMA; the
//!   registration is undone before the mapping is unmapped.
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

/// A shared file mapping (see the module docs).
#[derive(Debug)]
pub(crate) struct Arena {
    ptr: NonNull<u8>,
    len: usize,
    _file: File,
    /// The CUDA context the mapping is registered with (unregistered on drop).
    cuda: Option<std::sync::Arc<super::cuda::Driver>>,
}

// SAFETY: the mapping is plain shared memory owned by this value; concurrent access to its bytes
// is arbitrated by the node's books (one writer per slot), and this type only performs raw copies.
unsafe impl Send for Arena {}
// SAFETY: as above; `&Arena` never hands out references to the shared bytes.
unsafe impl Sync for Arena {}

impl Arena {
    /// Create the arena file at `path` (mode 0600, must not exist), reserve `len` bytes for it
    /// and map it. With `lock`, take an exclusive `flock` held for the arena's life.
    pub(crate) fn create(path: &Path, len: usize, lock: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty arena"));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        if lock {
            flock(&file, libc::LOCK_EX | libc::LOCK_NB)?;
        }
        let off_len = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "arena too large"))?;
        // SAFETY: a valid open file descriptor; no memory is passed.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, off_len) };
        if rc != 0 {
            let _ = std::fs::remove_file(path);
            return Err(io::Error::from_raw_os_error(rc));
        }
        Self::map(file, len)
    }

    /// Create an arena of `len` bytes with no path (`memfd_create`, named `name` in
    /// `/proc/*/maps`), its space reserved and its size sealed (`F_SEAL_SHRINK | F_SEAL_GROW |
    /// F_SEAL_SEAL`) before it is mapped or passed anywhere: a process it is passed to (a
    /// tenant of another uid) can write its bytes but cannot truncate it, which would make every
    /// other mapping of it fault (SIGBUS) beyond the new end.
    pub(crate) fn create_sealed(name: &str, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty arena"));
        }
        let cname = std::ffi::CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
        const MFD_NOEXEC_SEAL: libc::c_uint = 0x0008;
        let base = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // Not executable where the kernel knows the flag (6.3+; `vm.memfd_noexec = 2` requires
        // it); older kernels refuse it with EINVAL and get the plain flags.
        let mut fd = -1;
        for flags in [base | MFD_NOEXEC_SEAL, base] {
            // SAFETY: `cname` is a live NUL-terminated string; no other memory is passed.
            fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
            if fd >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                break;
            }
        }
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let off_len = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "arena too large"))?;
        // SAFETY: a valid open file descriptor; no memory is passed.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, off_len) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on a valid open descriptor; no memory is passed.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map(file, len)
    }

    /// Map the arena a node passed as a descriptor (an attached engine process): accepted only
    /// when it is a regular file owned by `owner` (the node's uid, from `SO_PEERCRED`), holding
    /// at least `len` bytes, and open for reading and writing; with `sealed` (a node of
    /// another uid), only a tmpfs file sealed against shrinking, so that node cannot truncate it
    /// under this mapping. No path is opened.
    pub(crate) fn from_fd(fd: OwnedFd, len: usize, owner: u32, sealed: bool) -> io::Result<Self> {
        let file = File::from(fd);
        let m = file.metadata()?;
        let bad = |why: String| io::Error::new(io::ErrorKind::PermissionDenied, why);
        if sealed && !sealed_tmpfs(&file) {
            return Err(bad(
                "the arena passed by a node of another uid is not a tmpfs file \
                 sealed against shrinking (F_SEAL_SHRINK): it could be truncated under this \
                 process's mapping"
                    .into(),
            ));
        }
        if !m.file_type().is_file() {
            return Err(bad("the arena passed is not a regular file".into()));
        }
        if m.uid() != owner {
            return Err(bad(format!(
                "the arena passed is owned by uid {}, not the node's uid {owner}",
                m.uid()
            )));
        }
        if len == 0 || m.len() < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the arena passed holds {} bytes, {len} announced", m.len()),
            ));
        }
        // SAFETY: F_GETFL on a valid open descriptor; no memory is passed.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 || flags & libc::O_ACCMODE != libc::O_RDWR {
            return Err(bad(
                "the arena passed is not open for reading and writing".into()
            ));
        }
        Self::map(file, len)
    }

    /// Truncate the arena's file to `len` bytes, as a hostile holder of its descriptor would
    /// (tests only: a sealed arena refuses).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn truncate_file(&self, len: u64) -> io::Result<()> {
        self._file.set_len(len)
    }

    /// Another descriptor of the arena's file (tests only).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn file(&self) -> io::Result<File> {
        self._file.try_clone()
    }

    /// The arena file's descriptor (the node passes it to each client with `SCM_RIGHTS`).
    pub(crate) fn fd(&self) -> RawFd {
        self._file.as_raw_fd()
    }

    fn map(file: File, len: usize) -> io::Result<Self> {
        let ptr = super::mem::map_shared_aligned(len, file.as_raw_fd())?;
        Ok(Arena {
            ptr,
            len,
            _file: file,
            cuda: None,
        })
    }

    /// Page-lock the whole mapping for CUDA device `ordinal` (its primary context), so device
    /// copies to and from arena slots are direct DMA. Fails cleanly without a driver.
    pub(crate) fn register_cuda(&mut self, ordinal: i32) -> Result<(), String> {
        if self.cuda.is_some() {
            return Ok(());
        }
        let d = super::cuda::Driver::open(ordinal)?;
        d.host_register(self.ptr.as_ptr() as usize, self.len)?;
        self.cuda = Some(d);
        Ok(())
    }

    /// Back the arena with 2 MiB pages now (`MADV_COLLAPSE`; before any engine pins it), on up
    /// to `threads` threads: the node's `--huge-pages collapse`. The bytes are kept. The bytes the
    /// kernel refused and its last error (see [`super::mem::collapse_huge`]).
    pub(crate) fn collapse_huge(&self, threads: usize) -> io::Result<(usize, Option<io::Error>)> {
        super::mem::collapse_huge(self.ptr, self.len, threads)
    }

    /// Bytes of this mapping mapped by 2 MiB page-table entries (`ShmemPmdMapped` of its
    /// `/proc/self/smaps` entry), if the table can be read.
    pub(crate) fn huge_mapped_bytes(&self) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        smaps_field(&smaps, self.ptr.as_ptr() as usize, "ShmemPmdMapped")
    }

    /// Whether the mapping is registered with CUDA.
    pub(crate) fn cuda_registered(&self) -> bool {
        self.cuda.is_some()
    }

    /// The address of `offset..offset + n` in this process (bounds checked): for device copies
    /// of a slot this process holds (a reservation it writes or a lease it reads).
    pub(crate) fn addr(&self, offset: u64, n: usize) -> io::Result<usize> {
        let o = self.check(offset, n)?;
        Ok(self.ptr.as_ptr() as usize + o)
    }

    /// The node checksum (`protocol::block_checksum`) of `n` bytes at `offset`, read through a
    /// private buffer in pieces: no Rust reference to shared bytes is made.
    pub(crate) fn checksum(&self, key: u128, offset: u64, n: usize) -> io::Result<u64> {
        const PIECE: usize = 64 << 10;
        let o = self.check(offset, n)?;
        let seed = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        let mut buf = vec![0u8; PIECE.min(n)];
        let mut done = 0;
        while done < n {
            let k = PIECE.min(n - done);
            // SAFETY: `o + done .. o + done + k` lies inside the mapping (checked above) and
            // `buf` is a private allocation of at least `k` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(o + done), buf.as_mut_ptr(), k);
            }
            h.update(&buf[..k]);
            done += k;
        }
        Ok(h.digest())
    }

    fn check(&self, offset: u64, n: usize) -> io::Result<usize> {
        let off = usize::try_from(offset).ok();
        match off.and_then(|o| o.checked_add(n).map(|end| (o, end))) {
            Some((o, end)) if end <= self.len => Ok(o),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("arena range {offset}+{n} outside its {} bytes", self.len),
            )),
        }
    }

    /// Copy `data` into the arena at `offset`.
    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let o = self.check(offset, data.len())?;
        // SAFETY: `o..o+len` lies inside the mapping (checked above); `data` is a live slice of
        // another allocation, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(o), data.len());
        }
        Ok(())
    }

    /// Copy `out.len()` bytes of the arena at `offset` into `out`.
    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let o = self.check(offset, out.len())?;
        // SAFETY: as in `write`, with the direction reversed.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(o), out.as_mut_ptr(), out.len());
        }
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if let Some(d) = self.cuda.take() {
            if let Err(e) = d.host_unregister(self.ptr.as_ptr() as usize) {
                tracing::warn!("unregistering the node arena from CUDA: {e}");
            }
        }
        // SAFETY: unmapping the mapping made in `map`, exactly once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The value, in bytes, of `field` (a `kB` line) in the `smaps` entry of the mapping that starts
/// at `start`.
fn smaps_field(smaps: &str, start: usize, field: &str) -> Option<u64> {
    // An entry's first line is `start-end perms ...` (hex addresses); its other lines `Key: value`.
    let range = |l: &str| -> Option<u64> {
        let (a, b) = l.split_whitespace().next()?.split_once('-')?;
        u64::from_str_radix(b, 16).ok()?;
        u64::from_str_radix(a, 16).ok()
    };
    let mut lines = smaps
        .lines()
        .skip_while(|l| range(l) != Some(start as u64))
        .skip(1);
    let line = lines
        .by_ref()
        .take_while(|l| range(l).is_none())
        .find(|l| l.split(':').next() == Some(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Whether `file` is on tmpfs (so a page of it is never missing for lack of reserved huge
/// pages, as on hugetlbfs) and sealed against shrinking.
fn sealed_tmpfs(file: &File) -> bool {
    // SAFETY: F_GET_SEALS on a valid open descriptor; no memory is passed. A file that cannot
    // be sealed answers -1 (EINVAL).
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return false;
    }
    // SAFETY: statfs is plain data, filled by the kernel for a valid descriptor.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live local of the type fstatfs fills.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    rc == 0 && st.f_type == libc::TMPFS_MAGIC
}

/// `flock(file, op)`.
pub(crate) fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    // SAFETY: a valid open file descriptor; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), op) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_arena_see_each_other_and_bounds_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arena");
        let a = Arena::create(&path, 8192, true).unwrap();
        let open = |len| {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            Arena::from_fd(f.into(), len, super::super::sock::current_uid(), false)
        };
        let b = open(8192).unwrap();
        a.write(4000, b"shared bytes").unwrap();
        let mut out = [0u8; 12];
        b.read(4000, &mut out).unwrap();
        assert_eq!(&out, b"shared bytes");
        assert!(a.write(8190, b"xyz").is_err());
        assert!(b.read(u64::MAX, &mut out).is_err());
        assert!(open(1 << 20).is_err(), "announced size beyond the file");
        let other = super::super::sock::current_uid().wrapping_add(1);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let e = Arena::from_fd(f.into(), 8192, other, false).unwrap_err();
        assert!(e.to_string().contains("owned by"), "{e}");
        let ro = File::open(&path).unwrap();
        let uid = super::super::sock::current_uid();
        assert!(
            Arena::from_fd(ro.into(), 8192, uid, false).is_err(),
            "read-only"
        );
        assert!(
            Arena::create(&path, 8192, true).is_err(),
            "never clobbers an arena"
        );
        // The live arena's lock is held.
        let f = File::open(&path).unwrap();
        assert!(flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_err());
        drop(a);
        assert!(flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_ok());
    }

    /// A collapse over several 64 MiB pieces taken by several threads keeps every piece's bytes
    /// and, where the kernel did it all, maps every whole 2 MiB page huge (shared memory only:
    /// `/dev/shm`, where the machine has one).
    #[test]
    fn a_threaded_collapse_keeps_every_piece_and_maps_it_huge() {
        let shm = std::path::Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("no /dev/shm: skipped");
            return;
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        let len = 3 * (64 << 20) + 4 * super::super::mem::HUGE_PAGE + 4096;
        let a = Arena::create(&dir.path().join("arena"), len, false).unwrap();
        let marks: Vec<u64> = (0..8).map(|k| (k * (len as u64 - 8)) / 7).collect();
        for (k, &at) in marks.iter().enumerate() {
            a.write(at, &(k as u64 * 0x0101_0101_0101).to_le_bytes())
                .unwrap();
        }
        let collapsed = a.collapse_huge(3);
        for (k, &at) in marks.iter().enumerate() {
            let mut x = [0u8; 8];
            a.read(at, &mut x).unwrap();
            assert_eq!(
                u64::from_le_bytes(x),
                k as u64 * 0x0101_0101_0101,
                "mark {k} at {at}"
            );
        }
        match (collapsed, a.huge_mapped_bytes()) {
            (Ok((0, None)), Some(huge)) => {
                let whole =
                    (len / super::super::mem::HUGE_PAGE * super::super::mem::HUGE_PAGE) as u64;
                assert_eq!(
                    huge, whole,
                    "every whole 2 MiB page of the arena mapped huge"
                );
            }
            (r, huge) => {
                eprintln!("collapse not done here ({r:?}, {huge:?} bytes huge): bytes checked only")
            }
        }
    }

    /// An arena passed to another uid cannot be truncated by anyone who holds it (which would
    /// fault every other mapping: SIGBUS), and a client of a node of another uid maps only such
    /// a sealed arena.
    #[test]
    fn a_sealed_arena_cannot_be_truncated_and_only_sealed_ones_pass_as_sealed() {
        let uid = super::super::sock::current_uid();
        let a = Arena::create_sealed("kvtier-node-test.arena", 8192).unwrap();
        a.write(8000, b"end").unwrap();
        // What a process it was passed to holds: a read-write descriptor of the same file.
        let reopen = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/self/fd/{}", a.fd()))
                .unwrap()
        };
        let f = reopen();
        assert_eq!(f.metadata().unwrap().len(), 8192);
        assert!(f.set_len(0).is_err(), "shrinking is sealed");
        assert!(f.set_len(1 << 20).is_err(), "growing is sealed");
        assert_eq!(f.metadata().unwrap().len(), 8192);
        let b = Arena::from_fd(f.into(), 8192, uid, true).unwrap();
        let mut out = [0u8; 3];
        b.read(8000, &mut out).unwrap();
        assert_eq!(&out, b"end");
        // A plain file (which its holder could truncate) is refused where a seal is required.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arena");
        let _plain = Arena::create(&path, 8192, false).unwrap();
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap()
        };
        let e = Arena::from_fd(open().into(), 8192, uid, true).unwrap_err();
        assert!(e.to_string().contains("sealed"), "{e}");
        assert!(Arena::from_fd(open().into(), 8192, uid, false).is_ok());
    }

    #[test]
    fn arenas_map_at_2mib_aligned_addresses_and_collapse_keeps_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let len = 3 * super::super::mem::HUGE_PAGE + 8192;
        let a = Arena::create(&dir.path().join("arena"), len, false).unwrap();
        assert_eq!(a.addr(0, 1).unwrap() % super::super::mem::HUGE_PAGE, 0);
        a.write(0, b"first").unwrap();
        a.write(len as u64 - 4, b"last").unwrap();
        // Collapse is a request: kernels before 6.1 or without THP refuse it; the bytes stay.
        let collapsed = a.collapse_huge(4).map(|(refused, _)| refused);
        let (mut x, mut y) = ([0u8; 5], [0u8; 4]);
        a.read(0, &mut x).unwrap();
        a.read(len as u64 - 4, &mut y).unwrap();
        assert_eq!((&x, &y), (b"first", b"last"));
        if collapsed.is_ok_and(|refused| refused == 0) {
            // /proc/self/smaps shows the whole 2 MiB pages mapped huge (tmpfs under tempdir may
            // be another file system: only where the collapse succeeded).
            let huge = a.huge_mapped_bytes().unwrap_or(0);
            eprintln!("collapsed: {huge} bytes in 2 MiB pages");
        }
        let b = {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.path().join("arena"))
                .unwrap();
            Arena::from_fd(f.into(), len, super::super::sock::current_uid(), false).unwrap()
        };
        assert_eq!(b.addr(0, 1).unwrap() % super::super::mem::HUGE_PAGE, 0);
        b.read(0, &mut x).unwrap();
        assert_eq!(&x, b"first");
    }

    #[test]
    fn smaps_fields_are_read_from_the_right_entry() {
        let smaps = "\
7f0000000000-7f0000200000 rw-s 00000000 00:1a 12 /dev/shm/a
Size:               2048 kB
ShmemPmdMapped:        0 kB
VmFlags: rd wr sh mr mw me ms
7f0000400000-7f0000800000 rw-s 00000000 00:1a 13 /dev/shm/b
Size:               4096 kB
ShmemPmdMapped:     4096 kB
VmFlags: rd wr sh mr mw me ms hg
7f0000800000-7f0000a00000 rw-p 00000000 00:00 0
ShmemPmdMapped:     9999 kB
";
        assert_eq!(
            smaps_field(smaps, 0x7f00_0040_0000, "ShmemPmdMapped"),
            Some(4096 * 1024)
        );
        assert_eq!(
            smaps_field(smaps, 0x7f00_0000_0000, "ShmemPmdMapped"),
            Some(0)
        );
        assert_eq!(smaps_field(smaps, 0x7f00_0000_0000, "Missing"), None);
        assert_eq!(smaps_field(smaps, 0x1234, "ShmemPmdMapped"), None);
    }

    #[test]
    fn checksum_in_pieces_equals_the_protocol_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arena::create(&dir.path().join("arena"), 300_000, false).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        a.write(1000, &data).unwrap();
        let want = crate::storage::node::block_checksum(9 << 70, &data);
        assert_eq!(a.checksum(9 << 70, 1000, data.len()).unwrap(), want);
        assert_ne!(a.checksum(9 << 70, 1001, data.len()).unwrap(), want);
        assert!(a.checksum(1, 200_000, 200_000).is_err());
        assert_eq!(a.addr(1000, 10).unwrap(), a.addr(0, 1).unwrap() + 1000);
        assert!(a.addr(299_999, 2).is_err());
    }
}
