//! Unix-socket system calls std does not offer: the peer's credentials (`SO_PEERCRED`), passing
//! a file descriptor (`SCM_RIGHTS`), and a non-blocking check that the peer closed.
//!
//! Invariants: a descriptor received here is owned at once ([`OwnedFd`], close-on-exec), so
//! none leaks, extra descriptors included; buffers passed to the kernel are live locals of the
//! sizes given.
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

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

/// Room for one descriptor's control message (u64 words keep it aligned for `cmsghdr`).
const CMSG_WORDS: usize = 8;

/// Send one byte carrying `fd` (`SCM_RIGHTS`) on the stream socket `sock`.
pub(crate) fn send_fd(sock: &impl AsRawFd, fd: RawFd) -> io::Result<()> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; CMSG_WORDS];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    if space > std::mem::size_of_val(&cbuf) {
        return Err(io::Error::other("control buffer too small"));
    }
    // SAFETY: msghdr is plain data; every pointer set below is a live local.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` names `cbuf`, which holds `space` bytes (checked above), so the first
    // header and its data (one RawFd) lie inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() {
            return Err(io::Error::other("no room for a control message"));
        }
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
    }
    loop {
        // SAFETY: `msg` and everything it points to are live for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n == 1 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if n < 0 && e.kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return Err(if n < 0 {
            e
        } else {
            io::ErrorKind::WriteZero.into()
        });
    }
}

/// Receive the one byte [`send_fd`] sent and the descriptor it carries (bounded by the
/// socket's read timeout). Extra descriptors are closed; a byte without one is an error.
pub(crate) fn recv_fd(sock: &impl AsRawFd) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; CMSG_WORDS];
    // SAFETY: msghdr is plain data; every pointer set below is a live local.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let n = loop {
        // SAFETY: `msg` and everything it points to are live for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        break n;
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf`; the CMSG macros walk only
    // within them. Each SCM_RIGHTS descriptor is new in this process and owned once here.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let head = libc::CMSG_LEN(0) as usize;
                let count =
                    ((*c).cmsg_len as usize).saturating_sub(head) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed before passing a descriptor",
        ));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("descriptors truncated"));
    }
    let mut fds = fds.into_iter();
    match (fds.next(), fds.next()) {
        (Some(fd), None) => Ok(fd),
        (None, _) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "no descriptor passed",
        )),
        (Some(_), Some(_)) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more than one descriptor passed",
        )),
    }
}

/// Whether reading the stream socket now would not block: bytes have arrived, or the peer's end
/// of stream, or an error (which the read then reports); checked without consuming data. On a
/// connection that expects nothing, any of them means it is closed or out of step.
pub(crate) fn readable_now(sock: &impl AsRawFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: `b` is a live local of the length passed.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        );
    }
    true
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_descriptor_crosses_the_socket_and_a_closed_peer_is_seen() {
        let (a, b) = UnixStream::pair().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(dir.path().join("f")).unwrap();
        send_fd(&a, f.as_raw_fd()).unwrap();
        let got = recv_fd(&b).unwrap();
        let m = std::fs::File::from(got).metadata().unwrap();
        assert_eq!(m.len(), 0);
        assert!(!readable_now(&b));
        // A byte without a descriptor is refused.
        (&a).write_all(b"x").unwrap();
        assert!(recv_fd(&b).is_err());
        assert_eq!(peer_uid(&a).unwrap(), current_uid());
        a.shutdown(std::net::Shutdown::Both).unwrap();
        assert!(readable_now(&b));
    }
}
