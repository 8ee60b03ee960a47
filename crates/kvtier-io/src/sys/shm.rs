//! Shared memory for the node tier: one file (on tmpfs, e.g. `/dev/shm`) mapped `MAP_SHARED` by
//! the node and by every attached engine process, plus the peer-credential check of its socket.
//!
//! Invariants:
//! - an [`Arena`] maps exactly `len` bytes of a file whose space was reserved with `fallocate`
//!   when it was created, so a write into the mapping never faults for lack of tmpfs space (a
//!   sparse tmpfs file would SIGBUS the engine instead);
//! - bytes of the mapping are only ever accessed through raw copies ([`Arena::write`],
//!   [`Arena::read`]) with bounds checked here; no Rust reference to shared bytes is created,
//!   because other processes write them. Which process writes which range when is the node's
//!   books' business (one writer per reserved slot; leased slots are never rewritten);
//! - the node holds an exclusive `flock` on its arena file for its lifetime, so a file whose lock
//!   is free belongs to a node that died and may be removed.
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

/// A shared file mapping (see the module docs).
#[derive(Debug)]
pub(crate) struct Arena {
    ptr: NonNull<u8>,
    len: usize,
    _file: File,
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

    /// Map an existing arena file of `len` bytes read-write (an attached engine process).
    pub(crate) fn open(path: &Path, len: usize) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let actual = file.metadata()?.len();
        if actual < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "arena {} holds {actual} bytes, {len} announced",
                    path.display()
                ),
            ));
        }
        Self::map(file, len)
    }

    fn map(file: File, len: usize) -> io::Result<Self> {
        let ptr = super::mem::map_huge(len, libc::MAP_SHARED, file.as_raw_fd())?;
        Ok(Arena {
            ptr,
            len,
            _file: file,
        })
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
        // SAFETY: unmapping the mapping made in `map`, exactly once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// `flock(file, op)`.
pub(crate) fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    // SAFETY: a valid open file descriptor; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), op) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The user id of the process at the other end of a Unix socket (`SO_PEERCRED`).
pub(crate) fn peer_uid(sock: &impl AsRawFd) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes passed; the descriptor is valid.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// This process's effective user id.
pub(crate) fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
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
        let b = Arena::open(&path, 8192).unwrap();
        a.write(4000, b"shared bytes").unwrap();
        let mut out = [0u8; 12];
        b.read(4000, &mut out).unwrap();
        assert_eq!(&out, b"shared bytes");
        assert!(a.write(8190, b"xyz").is_err());
        assert!(b.read(u64::MAX, &mut out).is_err());
        assert!(
            Arena::open(&path, 1 << 20).is_err(),
            "announced size beyond the file"
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
}
