//! The node client's direct paths, used by the transfer engine (`direct.rs`) to copy between
//! device blocks and arena slots with no staging copy: a job's stores are one `Reserve`, the
//! device copy, one `Finish`; its loads one `Lease`, the device copy, one `EndLeases`.
//!
//! Invariants:
//! - one round trip per phase per job (per [`MAX_BATCH`](super::protocol::MAX_BATCH) pairs of
//!   a longer job); a load adds one `EndLeases` before its copy only when some lease failed its
//!   size or checksum, so a damaged block is dropped at the node before the copy runs;
//! - every reservation and lease of a job is on one connection;
//! - on a verifying connection (`Conn::verify`, see `client.rs`) the slots a load leased are
//!   hashed and checked against their committed checksums before any byte is copied out (a
//!   failed pair never touches its device block), and the slots a store copied are hashed
//!   after the copy, before `Finish`, both in parallel (`hash.rs`); a private node's own-uid
//!   connection hashes nothing;
//! - a pair counts done only when the node answered it: `Present` to its reservation, or
//!   `Done` to its commit or end of lease on the connection that holds it. A connection that
//!   fails midway (the node then detached this client, so its slots may be reused) is not
//!   pooled again, and every pair still open fails with the reason, never reported done.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvtier::hash::SequenceHash;
use kvtier::transfer::RemoteError;

use super::client::{Conn, NodeStore};
use super::hash::{slot_checksums, Slot};
use super::protocol::{GetAnswer, ItemAnswer, LeaseEnd, PutAnswer, PutEnd};
use crate::sys::shm::Arena;

/// One pair of a direct job: done, or why not.
pub(crate) type PairResult = Result<(), String>;

/// Items a direct job's device leg copies: `(index into the job's keys, arena address)`;
/// the leg returns the indices it failed, with reasons.
pub(crate) type DeviceLeg<'a> = dyn FnOnce(&[(usize, usize)]) -> Vec<(usize, String)> + 'a;

/// The device leg over `items` (none: no call), failing the pairs it reports.
fn copy_leg(out: &mut [PairResult], items: &[(usize, usize)], copy: Box<DeviceLeg<'_>>) {
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
fn fail_open(out: &mut [PairResult], pairs: impl Iterator<Item = usize>, e: &RemoteError) {
    for k in pairs {
        if let Some(o) = out.get_mut(k) {
            if o.is_ok() {
                *o = Err(format!("node: {e}"));
            }
        }
    }
}

impl NodeStore {
    /// A connection for a direct job of `n` pairs, or the job's early answer: every pair failed
    /// (the node is unreachable) or `None` (`need_cuda` and the arena is not registered with
    /// CUDA: the caller stages the job).
    fn direct_conn(
        &self,
        n: usize,
        need_cuda: bool,
    ) -> Result<(Conn, Arc<Arena>), Option<Vec<PairResult>>> {
        let (c, arena) = self
            .conn()
            .map_err(|e| Some(vec![Err(format!("node: {e}")); n]))?;
        if need_cuda && !arena.cuda_registered() {
            self.pool(c);
            return Err(None);
        }
        Ok((c, arena))
    }

    /// Hash `slots` for a verifying connection, counted.
    fn hash(&self, arena: &Arena, slots: &[Slot]) -> Vec<std::io::Result<u64>> {
        self.hashed.fetch_add(slots.len() as u64, Ordering::Relaxed);
        slot_checksums(arena, slots)
    }

    /// Device -> arena for `keys` (blocks of `bytes`): reserve a slot per key, let `copy` fill
    /// the slots, then commit each slot copied (with its checksum on a verifying connection)
    /// or abort it. `None` when the direct path cannot serve this job (`need_cuda` and the
    /// arena is not registered with CUDA): the caller stages it instead. A key the node already
    /// holds is done without a copy; a full node fails the pair (the store is skipped).
    pub(crate) fn store_direct(
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
        let answers = match c.reserve(bytes as u64, keys) {
            Ok(a) => a,
            Err(e) => return Some(vec![Err(format!("node: {e}")); keys.len()]),
        };
        // (pair, reservation id, offset) of the slots granted and addressable.
        let mut grants: Vec<(usize, u64, u64)> = Vec::new();
        let mut items: Vec<(usize, usize)> = Vec::new();
        let mut aborts: Vec<PutEnd> = Vec::new();
        for (k, a) in answers.into_iter().enumerate() {
            match a {
                PutAnswer::Slot { id, offset } => match arena.addr(offset, bytes) {
                    Ok(addr) => {
                        grants.push((k, id, offset));
                        items.push((k, addr));
                    }
                    Err(e) => {
                        out[k] = Err(format!("node slot: {e}"));
                        aborts.push(PutEnd::Abort(id));
                    }
                },
                PutAnswer::Present => {}
                PutAnswer::Full => out[k] = Err("the kvtier node is full; store skipped".into()),
            }
        }
        copy_leg(&mut out, &items, copy);
        let hashed: Vec<bool> = grants
            .iter()
            .map(|g| c.verify && out[g.0].is_ok())
            .collect();
        let slots: Vec<Slot> = grants
            .iter()
            .zip(&hashed)
            .filter(|(_, h)| **h)
            .map(|(&(k, _, offset), _)| (keys[k], offset, bytes))
            .collect();
        let mut sums = self.hash(&arena, &slots).into_iter();
        // ends[i] is pair commits[i]'s commit (or abort); the early aborts follow.
        let mut ends: Vec<PutEnd> = Vec::with_capacity(grants.len() + aborts.len());
        let mut commits: Vec<usize> = Vec::with_capacity(grants.len());
        for (&(k, id, _), &h) in grants.iter().zip(&hashed) {
            let end = if out[k].is_err() {
                PutEnd::Abort(id)
            } else if !h {
                PutEnd::Commit { id, checksum: None }
            } else {
                match sums.next() {
                    Some(Ok(sum)) => PutEnd::Commit {
                        id,
                        checksum: Some(sum),
                    },
                    Some(Err(e)) => {
                        out[k] = Err(format!("node slot: {e}"));
                        PutEnd::Abort(id)
                    }
                    None => {
                        out[k] = Err("node slot: not hashed".into());
                        PutEnd::Abort(id)
                    }
                }
            };
            ends.push(end);
            commits.push(k);
        }
        ends.extend(aborts);
        if ends.is_empty() {
            self.pool(c);
            return Some(out);
        }
        match c.finish(&ends) {
            Ok(answers) => {
                for ((end, answer), &k) in ends.iter().zip(&answers).zip(&commits) {
                    let committed = matches!(end, PutEnd::Commit { .. });
                    if committed && *answer != ItemAnswer::Done && out[k].is_ok() {
                        out[k] = Err(format!("node commit refused: {answer:?}"));
                    }
                }
                self.pool(c);
            }
            // Not pooled: the node detached this connection, its reservations vanished.
            Err(e) => fail_open(&mut out, grants.iter().map(|g| g.0), &e),
        }
        Some(out)
    }

    /// Arena -> device for `keys`: lease each block, check it (size; on a verifying connection
    /// its arena bytes against the checksum its writer committed, a mismatch dropping it at the
    /// node), let `copy` move the slots that passed to the device, then end the leases. A pair
    /// counts only when its lease was still held when its copy finished (the node answered its
    /// end of lease `Done`). `None` as in [`Self::store_direct`].
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
        let answers = match c.lease(keys) {
            Ok(a) => a,
            Err(e) => return Some(vec![Err(format!("node: {e}")); keys.len()]),
        };
        // (pair, lease id, offset, address, checksum) of the leases of the right size.
        let mut pending: Vec<(usize, u64, u64, usize, Option<u64>)> = Vec::new();
        let mut early: Vec<LeaseEnd> = Vec::new();
        for (k, a) in answers.into_iter().enumerate() {
            let key = keys[k];
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
                        Ok(a) => pending.push((k, id, offset, a, checksum)),
                        Err(why) => {
                            out[k] = Err(why);
                            early.push(LeaseEnd::Done(id));
                        }
                    }
                }
            }
        }
        let verdicts: Vec<Result<(), (LeaseEnd, String)>> = if c.verify {
            let slots: Vec<Slot> = pending.iter().map(|p| (keys[p.0], p.2, bytes)).collect();
            let sums = self.hash(&arena, &slots);
            pending
                .iter()
                .zip(sums)
                .map(|(&(k, id, _, _, want), got)| {
                    let corrupt = |why: &str| {
                        RemoteError::Corrupt {
                            key: SequenceHash(keys[k]),
                            reason: why.into(),
                        }
                        .to_string()
                    };
                    match (want, got) {
                        (Some(w), Ok(g)) if w == g => Ok(()),
                        (Some(_), Ok(_)) => Err((
                            LeaseEnd::Damaged(id),
                            corrupt("the node's copy does not match its checksum"),
                        )),
                        (None, Ok(_)) => Err((
                            LeaseEnd::Done(id),
                            corrupt("the node committed it without a checksum"),
                        )),
                        (_, Err(e)) => Err((LeaseEnd::Done(id), format!("node slot: {e}"))),
                    }
                })
                .collect()
        } else {
            pending.iter().map(|_| Ok(())).collect()
        };
        // (pair, lease id) of the leases to copy from and end after the copy.
        let mut open: Vec<(usize, u64)> = Vec::with_capacity(pending.len());
        let mut items: Vec<(usize, usize)> = Vec::with_capacity(pending.len());
        for (&(k, id, _, addr, _), v) in pending.iter().zip(verdicts) {
            match v {
                Ok(()) => {
                    open.push((k, id));
                    items.push((k, addr));
                }
                Err((end, why)) => {
                    out[k] = Err(why);
                    early.push(end);
                }
            }
        }
        // Failed leases end (damaged blocks are dropped) before the copy; their answers do not
        // matter (those pairs failed already).
        if !early.is_empty() {
            if let Err(e) = c.end_leases(&early) {
                fail_open(&mut out, open.iter().map(|o| o.0), &e);
                return Some(out);
            }
        }
        copy_leg(&mut out, &items, copy);
        if open.is_empty() {
            self.pool(c);
            return Some(out);
        }
        let ends: Vec<LeaseEnd> = open.iter().map(|&(_, id)| LeaseEnd::Done(id)).collect();
        match c.end_leases(&ends) {
            Ok(answers) => {
                for (&(k, _), answer) in open.iter().zip(&answers) {
                    if *answer != ItemAnswer::Done && out[k].is_ok() {
                        out[k] = Err(format!("node end of lease: {answer:?}"));
                    }
                }
                self.pool(c);
            }
            // After a break the lease may have ended while the copy ran: the bytes are not
            // trusted.
            Err(e) => fail_open(&mut out, open.iter().map(|o| o.0), &e),
        }
        Some(out)
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
