//! io_uring submission of positional vectored reads and writes.
//!
//! Invariant: the iovec arrays handed to the kernel live in `IovStore` until every submitted
//! entry has completed (`run` does not return earlier, even on errors), so the kernel never sees
//! a dangling pointer.
use std::io;

use io_uring::{opcode, types, IoUring};

use super::file::{run_sync, IoOp, IoReq};

/// A ring of `depth` entries owned by one thread at a time.
pub(crate) struct Ring {
    ring: IoUring,
    depth: usize,
}

impl Ring {
    pub(crate) fn new(depth: u32) -> io::Result<Self> {
        let ring = IoUring::new(depth)?;
        Ok(Ring {
            ring,
            depth: depth as usize,
        })
    }

    /// Run every request; `results[i]` is the byte count of `reqs[i]` or its error.
    /// A partial transfer is completed synchronously (it happens at most at end of file or
    /// on a buffered write that ran out of room).
    ///
    /// # Safety
    /// As [`run_sync`]: every segment is valid, exclusively owned memory until this returns.
    pub(crate) unsafe fn run(&mut self, reqs: &[IoReq]) -> Vec<io::Result<usize>> {
        let mut results: Vec<Option<io::Result<usize>>> = (0..reqs.len()).map(|_| None).collect();
        let iovs: Vec<Vec<libc::iovec>> = reqs
            .iter()
            .map(|r| {
                r.segs
                    .iter()
                    .map(|s| libc::iovec {
                        iov_base: s.addr as *mut libc::c_void,
                        iov_len: s.len,
                    })
                    .collect()
            })
            .collect();
        let mut next = 0usize;
        let mut in_flight = 0usize;
        while next < reqs.len() || in_flight > 0 {
            {
                let mut sq = self.ring.submission();
                while next < reqs.len() && in_flight < self.depth {
                    let r = &reqs[next];
                    let iov = &iovs[next];
                    let len = u32::try_from(iov.len()).unwrap_or(u32::MAX);
                    let e = if r.op == IoOp::Write {
                        opcode::Writev::new(types::Fd(r.fd), iov.as_ptr(), len)
                            .offset(r.offset)
                            .build()
                    } else {
                        opcode::Readv::new(types::Fd(r.fd), iov.as_ptr(), len)
                            .offset(r.offset)
                            .build()
                    }
                    .user_data(next as u64);
                    // SAFETY: the entry points at `iovs[next]`, which lives until this function
                    // returns, and the loop below waits for every submitted entry first.
                    if unsafe { sq.push(&e) }.is_err() {
                        break;
                    }
                    next += 1;
                    in_flight += 1;
                }
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // The ring itself failed: finish everything still queued synchronously after
                // draining what completed. Entries already submitted may still be running, so
                // wait for them one by one before touching their memory again.
                loop {
                    let drained: Vec<(usize, i32)> = self
                        .ring
                        .completion()
                        .map(|c| (c.user_data() as usize, c.result()))
                        .collect();
                    for (i, res) in drained {
                        in_flight -= 1;
                        results[i] = Some(to_result(res));
                    }
                    if in_flight == 0 || self.ring.submit_and_wait(1).is_err() {
                        break;
                    }
                }
                for (i, r) in reqs.iter().enumerate() {
                    if results[i].is_none() {
                        // SAFETY: as this function's contract.
                        results[i] = Some(unsafe { run_sync(r) });
                    }
                }
                break;
            }
            let done: Vec<(usize, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data() as usize, c.result()))
                .collect();
            for (i, res) in done {
                in_flight -= 1;
                let mut r = to_result(res);
                if let Ok(n) = r {
                    let total = reqs[i].total_len();
                    if n > 0 && n < total {
                        let mut rest = reqs[i].clone();
                        rest.offset += n as u64;
                        super::file::advance(&mut rest.segs, n);
                        // SAFETY: the remainder is a sub-range of the caller's segments.
                        r = unsafe { run_sync(&rest) }.map(|m| n + m);
                    }
                }
                results[i] = Some(r);
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(io::Error::other("request was not run"))))
            .collect()
    }
}

fn to_result(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}
