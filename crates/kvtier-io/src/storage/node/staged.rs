//! The node client's staged paths, used by the transfer engine's bounce-buffer legs when a
//! device <-> node job does not go direct (`batch.rs`: a verifying connection, or a CUDA arena
//! not registered): a slice of blocks in private host memory (the engine's bounce buffer) is
//! put with one `Reserve`, each block copied into its slot (and hashed, on a verifying
//! connection) in parallel, one `Finish`; it is got with one `Lease`, each leased slot copied
//! out (and the copy hashed) in parallel, one `EndLeases`.
//!
//! Invariants:
//! - every checksum is taken of private memory: a put's of its source before it is copied into
//!   the slot, a get's of the copy it made. Any process that maps the arena (a client of its
//!   uid; memory damage alike) may write any slot at any time; hashing a slot and then moving its
//!   bytes would check one set of bytes and move another. Here a put's checksum is of the bytes
//!   the engine computed, and the node re-hashes the slot at `Finish` against it (a write by
//!   anyone else in between: `Mismatch`, never published); a get's bytes that reach the device
//!   are the ones checked;
//! - a get that fails its check ends its lease `Damaged` (the node drops the block at once) and
//!   is failed; its private copy is never handed on (the engine copies only pairs reported done);
//! - a pair counts done only as in `batch.rs`: the node answered its commit or end of lease
//!   `Done` on the connection that holds it; a connection that breaks fails every open pair.
use std::sync::atomic::Ordering;

use kvtier::hash::SequenceHash;
use kvtier::transfer::RemoteError;

use super::batch::PairResult;
use super::client::NodeStore;
use super::hash::par_map;
use super::protocol::{block_checksum, LeaseEnd, PutEnd};
use crate::sys::job::{with_bytes, with_bytes_mut};

impl NodeStore {
    /// Puts `keys[i]` from `srcs[i]`, a private host block of `bytes` the caller holds
    /// read-only until the call returns. One result per pair (see the module docs).
    pub(crate) fn put_staged(
        &self,
        keys: &[u128],
        srcs: &[usize],
        bytes: usize,
    ) -> Vec<PairResult> {
        let (mut c, arena) = match self.job_conn(keys.len()) {
            Ok(x) => x,
            Err(all) => return all,
        };
        let mut out: Vec<PairResult> = vec![Ok(()); keys.len()];
        let mut aborts = Vec::new();
        let Ok(grants) = Self::reserve_slots(&mut c, &arena, keys, bytes, &mut out, &mut aborts)
        else {
            return out;
        };
        let verify = c.verify;
        let work: Vec<(usize, u64, usize)> = grants
            .iter()
            .filter_map(|&((k, _, offset), _)| Some((k, offset, *srcs.get(k)?)))
            .collect();
        let done = par_map(&work, work.len() * bytes, |&(k, offset, src)| {
            with_bytes(src, bytes, |b| {
                // The checksum of the source, before anyone else can see its bytes.
                let sum = verify.then(|| block_checksum(keys[k], b));
                arena.write(offset, b).map(|()| sum)
            })
        });
        if verify {
            self.hashed.fetch_add(work.len() as u64, Ordering::Relaxed);
        }
        let mut sums: Vec<Option<Option<u64>>> = vec![None; keys.len()];
        for (&(k, _, _), r) in work.iter().zip(done) {
            match r {
                Ok(sum) => sums[k] = Some(sum),
                Err(e) => out[k] = Err(format!("node slot: {e}")),
            }
        }
        let pairs: Vec<usize> = grants.iter().map(|g| g.0 .0).collect();
        let mut ends: Vec<PutEnd> = Vec::with_capacity(grants.len() + aborts.len());
        for &((k, id, _), _) in &grants {
            let end = match (out[k].is_ok(), sums[k]) {
                (true, Some(checksum)) => PutEnd::Commit { id, checksum },
                (true, None) => {
                    out[k] = Err("internal: no source block for the pair".into());
                    PutEnd::Abort(id)
                }
                (false, _) => PutEnd::Abort(id),
            };
            ends.push(end);
        }
        ends.extend(aborts);
        self.finish_job(c, &ends, &pairs, &mut out);
        out
    }

    /// Gets `keys[i]` into `dsts[i]`, a private host block of `bytes` the caller owns
    /// exclusively until the call returns; a failed pair's block holds unspecified bytes. One
    /// result per pair (see the module docs).
    pub(crate) fn get_staged(
        &self,
        keys: &[u128],
        dsts: &[usize],
        bytes: usize,
    ) -> Vec<PairResult> {
        let (mut c, arena) = match self.job_conn(keys.len()) {
            Ok(x) => x,
            Err(all) => return all,
        };
        let mut out: Vec<PairResult> = vec![Ok(()); keys.len()];
        let mut early = Vec::new();
        let Ok(leased) = Self::lease_slots(&mut c, &arena, keys, bytes, &mut out, &mut early)
        else {
            return out;
        };
        let verify = c.verify;
        let work: Vec<(usize, u64, usize)> = leased
            .iter()
            .filter_map(|&((k, _, offset), _, _)| Some((k, offset, *dsts.get(k)?)))
            .collect();
        let done = par_map(&work, work.len() * bytes, |&(k, offset, dst)| {
            with_bytes_mut(dst, bytes, |b| {
                arena.read(offset, b)?;
                // The checksum of the private copy: the bytes that go on to the device.
                Ok(verify.then(|| block_checksum(keys[k], b)))
            })
        });
        if verify {
            self.hashed.fetch_add(work.len() as u64, Ordering::Relaxed);
        }
        let mut got: Vec<Option<std::io::Result<Option<u64>>>> =
            (0..keys.len()).map(|_| None).collect();
        for (&(k, _, _), r) in work.iter().zip(done) {
            got[k] = Some(r);
        }
        let pairs: Vec<usize> = leased.iter().map(|l| l.0 .0).collect();
        let mut ends: Vec<LeaseEnd> = Vec::with_capacity(pairs.len() + early.len());
        for &((k, id, _), _, want) in &leased {
            let corrupt = |why: &str| {
                RemoteError::Corrupt {
                    key: SequenceHash(keys[k]),
                    reason: why.into(),
                }
                .to_string()
            };
            let (end, verdict) = match (got[k].take(), want) {
                (Some(Ok(None)), _) => (LeaseEnd::Done(id), Ok(())),
                (Some(Ok(Some(g))), Some(w)) if g == w => (LeaseEnd::Done(id), Ok(())),
                (Some(Ok(Some(_))), Some(_)) => (
                    LeaseEnd::Damaged(id),
                    Err(corrupt("the node's copy does not match its checksum")),
                ),
                (Some(Ok(Some(_))), None) => (
                    LeaseEnd::Done(id),
                    Err(corrupt("the node committed it without a checksum")),
                ),
                (Some(Err(e)), _) => (LeaseEnd::Done(id), Err(format!("node slot: {e}"))),
                (None, _) => (
                    LeaseEnd::Done(id),
                    Err("internal: no destination block for the pair".into()),
                ),
            };
            if let Err(why) = verdict {
                out[k] = Err(why);
            }
            ends.push(end);
        }
        ends.extend(early);
        self.end_job(c, &ends, &pairs, &mut out);
        out
    }
}

#[cfg(test)]
#[path = "staged_tests.rs"]
mod tests;
