//! File system calls that std does not offer: `fallocate`, vectored positional I/O on raw
//! addresses, and the O_DIRECT open flag.
//!
//! Invariant: an [`IoReq`] names memory the caller owns for the duration of the request; the
//! functions here never keep an address after they return.
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::mem::{AlignedBuf, IO_ALIGN};

/// One piece of memory taking part in a vectored read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IoSeg {
    pub addr: usize,
    pub len: usize,
}

/// Which way a request moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoOp {
    /// File -> memory.
    Read,
    /// Memory -> file.
    Write,
}

impl IoOp {
    /// `"read"` or `"write"`, for messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
        }
    }
}

/// One positional, vectored read or write (a disk slot: header page + payload).
#[derive(Clone, Debug)]
pub(crate) struct IoReq {
    pub fd: i32,
    pub offset: u64,
    pub segs: Vec<IoSeg>,
    pub op: IoOp,
}

impl IoReq {
    pub(crate) fn total_len(&self) -> usize {
        self.segs.iter().map(|s| s.len).sum()
    }
}

/// Open (creating; truncating if `truncate`) a cache file with mode 0600, with O_DIRECT if
/// `direct`. Never follows a symlink at the last component (`O_NOFOLLOW`).
pub(crate) fn open_cache_file(path: &Path, direct: bool, truncate: bool) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .mode(0o600);
    let mut flags = libc::O_NOFOLLOW;
    if direct {
        flags |= libc::O_DIRECT;
    }
    o.custom_flags(flags);
    o.open(path)
}

/// Try to take an exclusive `flock` on `file` without blocking: `Ok(false)` if another open
/// file description holds it (another process, or another store in this one). The lock lives
/// as long as the descriptor and is dropped by the kernel when the process dies (SIGKILL
/// included), which is what makes a dead process's files reclaimable.
pub(crate) fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    loop {
        // SAFETY: flock on an open descriptor we own, with plain integer arguments.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// fsync a directory, so the names created or renamed in it survive a power cut.
pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// Reserve `len` bytes of disk for `file`. Returns `Ok(false)` where the file system cannot
/// preallocate (then the file is only extended, sparse).
pub(crate) fn preallocate(file: &File, len: u64) -> io::Result<bool> {
    let len_i = i64::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file too large"))?;
    // SAFETY: fallocate on an open descriptor we own, with plain integer arguments.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_i) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {
            file.set_len(len)?;
            Ok(false)
        }
        _ => Err(err),
    }
}

/// Run one request synchronously with `preadv`/`pwritev`, continuing after partial transfers.
/// Returns the bytes moved (less than `total_len` only at end of file).
///
/// # Safety
/// Every segment must be valid memory for the whole call (writable for reads), not accessed by
/// anyone else meanwhile, and `fd` an open descriptor.
pub(crate) unsafe fn run_sync(req: &IoReq) -> io::Result<usize> {
    let mut segs = req.segs.clone();
    let mut done = 0usize;
    let total = req.total_len();
    while done < total {
        let iov: Vec<libc::iovec> = segs
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| libc::iovec {
                iov_base: s.addr as *mut libc::c_void,
                iov_len: s.len,
            })
            .collect();
        let off = req.offset + done as u64;
        let off = libc::off_t::try_from(off)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset too large"))?;
        let cnt = libc::c_int::try_from(iov.len()).unwrap_or(libc::c_int::MAX);
        // SAFETY: the iovecs describe caller-owned memory valid for the call (see # Safety).
        let n = unsafe {
            if req.op == IoOp::Write {
                libc::pwritev(req.fd, iov.as_ptr(), cnt, off)
            } else {
                libc::preadv(req.fd, iov.as_ptr(), cnt, off)
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let n = n as usize;
        if n == 0 {
            if req.op == IoOp::Write {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write returned 0 bytes",
                ));
            }
            break;
        }
        done += n;
        advance(&mut segs, n);
    }
    Ok(done)
}

/// Drop the first `n` bytes from a segment list.
pub(crate) fn advance(segs: &mut Vec<IoSeg>, mut n: usize) {
    while n > 0 && !segs.is_empty() {
        if segs[0].len <= n {
            n -= segs[0].len;
            segs.remove(0);
        } else {
            segs[0].addr += n;
            segs[0].len -= n;
            n = 0;
        }
    }
}

/// Read the first page with O_DIRECT and write the same bytes back.
pub(crate) fn probe_direct(f: &File) -> io::Result<()> {
    let buf = AlignedBuf::new(IO_ALIGN)?;
    let r = IoReq {
        fd: f.as_raw_fd(),
        offset: 0,
        segs: vec![IoSeg {
            addr: buf.addr(),
            len: IO_ALIGN,
        }],
        op: IoOp::Read,
    };
    // SAFETY: `buf` is ours and lives across both calls; `f` is an open file.
    let n = unsafe { run_sync(&r) }?;
    if n < IO_ALIGN {
        return Err(io::Error::other("short O_DIRECT probe read"));
    }
    let w = IoReq {
        op: IoOp::Write,
        ..r
    };
    // SAFETY: as above.
    unsafe { run_sync(&w) }?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn advance_splits_segments() {
        let mut s = vec![IoSeg { addr: 100, len: 10 }, IoSeg { addr: 500, len: 20 }];
        advance(&mut s, 15);
        assert_eq!(s, vec![IoSeg { addr: 505, len: 15 }]);
    }
}
