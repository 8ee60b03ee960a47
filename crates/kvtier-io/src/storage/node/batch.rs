//! The node client's direct paths' phases, used by the transfer engine (`direct.rs`) to copy
//! between device blocks and arena slots with no staging copy: the slots a `Reserve` or `Lease`
//! granted, the ends of a `Finish` or `EndLeases`, and the ordered load (one `Lease`, the device
//! copy, one `EndLeases`); stores and unordered loads run these phases in parts (`pipeline.rs`).
//!
//! Invariants:
//! - an ordered load takes one round trip per phase (per [`MAX_BATCH`](super::protocol::MAX_BATCH)
//!   pairs of a longer job) and adds one `EndLeases` before its copy only when some lease failed
//!   its size check;
//! - every reservation and lease of a job is on one connection;
//! - only a connection that verifies nothing (a client of the node's own uid without `verify`,
//!   see `client.rs`) goes direct: a checksum of an arena slot proves nothing about the bytes a
//!   DMA moves a moment earlier or later, since any process that maps the arena may write the
//!   slot between the two. A verifying connection's jobs are staged (`staged.rs`), where every
//!   checksum is taken of private memory;
//! - a pair counts done only when the node answered it: `Present` to its reservation, or
//!   `Done` to its commit or end of lease on the connection that holds it. A connection that
//!   fails midway (the node then detached this client, so its slots may be reused) is not
//!   pooled again, and every pair still open fails with the reason, never reported done.
use std::sync::Arc;

use kvtier::hash::SequenceHash;
use kvtier::transfer::RemoteError;

use super::client::{Conn, NodeStore};
use super::protocol::{GetAnswer, ItemAnswer, LeaseEnd, PutAnswer, PutEnd};
use crate::sys::shm::Arena;

/// One pair of a direct or staged job: done, or why not.
pub(crate) type PairResult = Result<(), String>;

/// Items a direct job's device leg copies: `(index into the job's keys, arena address)`;
/// the leg returns the indices it failed, with reasons.
pub(crate) type DeviceLeg<'a> = dyn FnOnce(&[(usize, usize)]) -> Vec<(usize, String)> + 'a;

/// The device leg over `items` (none: no call), failing the pairs it reports.
pub(super) fn copy_leg(
    out: &mut [PairResult],
    items: &[(usize, usize)],
    copy: impl FnOnce(&[(usize, usize)]) -> Vec<(usize, String)>,
) {
    if items.is_empty() {
        return;
    }
    for (k, why) in copy(items) {
        if let Some(o) = out.get_mut(k) {
            *o = Err(why);
        }
    }
}

/// Fails each of `pairs` still counted done: the connection broke before the node answered.
pub(super) fn fail_open(
    out: &mut [PairResult],
    pairs: impl Iterator<Item = usize>,
    e: &RemoteError,
) {
    for k in pairs {
        if let Some(o) = out.get_mut(k) {
            if o.is_ok() {
                *o = Err(format!("node: {e}"));
            }
        }
    }
}

/// Fails each of `pairs` still counted done whose end the node answered other than `Done`
/// (`answers[i]` is pair `pairs[i]`'s; a pair already failed, e.g. aborted, stays as it is).
pub(super) fn ended(answers: &[ItemAnswer], pairs: &[usize], out: &mut [PairResult], what: &str) {
    for (&k, answer) in pairs.iter().zip(answers) {
        if let Some(o) = out.get_mut(k) {
            if *answer != ItemAnswer::Done && o.is_ok() {
                *o = Err(format!("{what}: {answer:?}"));
            }
        }
    }
}

/// A slot the node granted: `(pair, reservation or lease id, offset)`.
pub(super) type Grant = (usize, u64, u64);

/// A lease of the right size inside the mapping: `(grant, address, checksum)`.
pub(super) type Leased = (Grant, usize, Option<u64>);

impl NodeStore {
    /// A connection for a direct job of `n` pairs, or the job's early answer: every pair failed
    /// (the node is unreachable) or `None` (the caller stages the job: the connection verifies,
    /// or `need_cuda` and the arena is not registered with CUDA).
    pub(super) fn direct_conn(
        &self,
        n: usize,
        need_cuda: bool,
    ) -> Result<(Conn, Arc<Arena>), Option<Vec<PairResult>>> {
        let (c, arena) = self.job_conn(n).map_err(Some)?;
        if c.verify || (need_cuda && !arena.cuda_registered()) {
            self.pool(c);
            return Err(None);
        }
        Ok((c, arena))
    }

    /// A connection for a job of `n` pairs, or every pair failed (the node is unreachable).
    pub(super) fn job_conn(&self, n: usize) -> Result<(Conn, Arc<Arena>), Vec<PairResult>> {
        self.conn().map_err(|e| vec![Err(format!("node: {e}")); n])
    }

    /// `Reserve` of `keys` (blocks of `bytes`): the slots granted and addressable, as
    /// `(grant, address)`; a key the node holds already is done, a full node fails its pair, a
    /// slot outside the mapping fails its pair and is aborted (`aborts`). `Err`: the round trip
    /// failed (every pair failed, the connection dropped).
    pub(super) fn reserve_slots(
        c: &mut Conn,
        arena: &Arena,
        keys: &[u128],
        bytes: usize,
        out: &mut [PairResult],
        aborts: &mut Vec<PutEnd>,
    ) -> Result<Vec<(Grant, usize)>, ()> {
        match c.reserve(bytes as u64, keys) {
            Ok(a) => Ok(Self::reserved_slots(a, arena, bytes, 0, out, aborts)),
            Err(e) => {
                out.iter_mut().for_each(|o| *o = Err(format!("node: {e}")));
                Err(())
            }
        }
    }

    /// The grants of a `Reserve` answered `answers`, whose first key is pair `base`: as
    /// [`Self::reserve_slots`].
    pub(super) fn reserved_slots(
        answers: Vec<PutAnswer>,
        arena: &Arena,
        bytes: usize,
        base: usize,
        out: &mut [PairResult],
        aborts: &mut Vec<PutEnd>,
    ) -> Vec<(Grant, usize)> {
        let mut grants = Vec::new();
        for (i, a) in answers.into_iter().enumerate() {
            let k = base + i;
            match a {
                PutAnswer::Slot { id, offset } => match arena.addr(offset, bytes) {
                    Ok(addr) => grants.push(((k, id, offset), addr)),
                    Err(e) => {
                        out[k] = Err(format!("node slot: {e}"));
                        aborts.push(PutEnd::Abort(id));
                    }
                },
                PutAnswer::Present => {}
                PutAnswer::Full => out[k] = Err("the kvtier node is full; store skipped".into()),
            }
        }
        grants
    }

    /// `Finish` of a job's reservations: `ends[i]` ends pair `pairs[i]`'s reservation (a commit,
    /// or an abort of a pair already failed); the ends after `pairs.len()` are early aborts. A
    /// commit the node refuses fails its pair; a broken connection fails every open pair and is
    /// not pooled.
    pub(super) fn finish_job(
        &self,
        mut c: Conn,
        ends: &[PutEnd],
        pairs: &[usize],
        out: &mut [PairResult],
    ) {
        if ends.is_empty() {
            self.pool(c);
            return;
        }
        match c.finish(ends) {
            Ok(answers) => {
                ended(&answers, pairs, out, "node commit refused");
                self.pool(c);
            }
            // Not pooled: the node detached this connection, its reservations vanished.
            Err(e) => fail_open(out, pairs.iter().copied(), &e),
        }
    }

    /// `Lease` of `keys` (blocks of `bytes`): the leases of the right size and addressable, as
    /// `(grant, address, checksum)`; a missing key fails its pair, a lease of another size or
    /// outside the mapping fails its pair and is ended at once (`early`). `Err`: the round trip
    /// failed (every pair failed, the connection dropped).
    pub(super) fn lease_slots(
        c: &mut Conn,
        arena: &Arena,
        keys: &[u128],
        bytes: usize,
        out: &mut [PairResult],
        early: &mut Vec<LeaseEnd>,
    ) -> Result<Vec<Leased>, ()> {
        match c.lease(keys) {
            Ok(a) => Ok(Self::leased_slots(a, arena, keys, bytes, 0, out, early)),
            Err(e) => {
                out.iter_mut().for_each(|o| *o = Err(format!("node: {e}")));
                Err(())
            }
        }
    }

    /// The leases of a `Lease` of `keys` (whose first is pair `base`) answered `answers`: as
    /// [`Self::lease_slots`].
    pub(super) fn leased_slots(
        answers: Vec<GetAnswer>,
        arena: &Arena,
        keys: &[u128],
        bytes: usize,
        base: usize,
        out: &mut [PairResult],
        early: &mut Vec<LeaseEnd>,
    ) -> Vec<Leased> {
        let mut leased = Vec::new();
        for (i, a) in answers.into_iter().enumerate() {
            let k = base + i;
            let key = keys[i];
            match a {
                GetAnswer::Missing => {
                    out[k] = Err(RemoteError::Missing {
                        key: SequenceHash(key),
                    }
                    .to_string())
                }
                GetAnswer::Lease {
                    id,
                    offset,
                    bytes: stored,
                    checksum,
                } => {
                    let addr = if stored != bytes as u64 {
                        Err(RemoteError::SizeMismatch {
                            key: SequenceHash(key),
                            expected: bytes,
                            stored: stored as usize,
                        }
                        .to_string())
                    } else {
                        arena
                            .addr(offset, bytes)
                            .map_err(|e| format!("node slot: {e}"))
                    };
                    match addr {
                        Ok(a) => leased.push(((k, id, offset), a, checksum)),
                        Err(why) => {
                            out[k] = Err(why);
                            early.push(LeaseEnd::Done(id));
                        }
                    }
                }
            }
        }
        leased
    }

    /// `EndLeases` of a job: `ends[i]` ends pair `pairs[i]`'s lease; the ends after
    /// `pairs.len()` are of pairs failed already. A pair whose end the node does not answer
    /// `Done` fails (its lease ended before the copy did); a broken connection fails every open
    /// pair (the bytes are not trusted) and is not pooled.
    pub(super) fn end_job(
        &self,
        mut c: Conn,
        ends: &[LeaseEnd],
        pairs: &[usize],
        out: &mut [PairResult],
    ) {
        if ends.is_empty() {
            self.pool(c);
            return;
        }
        match c.end_leases(ends) {
            Ok(answers) => {
                ended(&answers, pairs, out, "node end of lease");
                self.pool(c);
            }
            Err(e) => fail_open(out, pairs.iter().copied(), &e),
        }
    }

    /// Arena -> device for `keys`: lease each block, check its size, let `copy` move the leased
    /// slots to the device, then end the leases. A pair counts only when its lease was still
    /// held when its copy finished (the node answered its end of lease `Done`). `None` as in
    /// [`Self::store_direct`].
    pub(crate) fn load_direct(
        &self,
        keys: &[u128],
        bytes: usize,
        need_cuda: bool,
        copy: Box<DeviceLeg<'_>>,
    ) -> Option<Vec<PairResult>> {
        let (mut c, arena) = match self.direct_conn(keys.len(), need_cuda) {
            Ok(x) => x,
            Err(early) => return early,
        };
        let mut out: Vec<PairResult> = vec![Ok(()); keys.len()];
        let mut early = Vec::new();
        let Ok(leased) = Self::lease_slots(&mut c, &arena, keys, bytes, &mut out, &mut early)
        else {
            return Some(out);
        };
        let pairs: Vec<usize> = leased.iter().map(|l| l.0 .0).collect();
        // Failed leases end before the copy; their answers do not matter (those pairs failed
        // already).
        if !early.is_empty() {
            if let Err(e) = c.end_leases(&early) {
                fail_open(&mut out, pairs.iter().copied(), &e);
                return Some(out);
            }
        }
        let items: Vec<(usize, usize)> = leased.iter().map(|&((k, _, _), a, _)| (k, a)).collect();
        copy_leg(&mut out, &items, copy);
        let ends: Vec<LeaseEnd> = leased
            .iter()
            .map(|&((_, id, _), _, _)| LeaseEnd::Done(id))
            .collect();
        self.end_job(c, &ends, &pairs, &mut out);
        Some(out)
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
pub(super) mod tests;
