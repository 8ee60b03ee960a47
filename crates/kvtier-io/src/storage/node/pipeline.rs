//! Direct jobs in parts (stores, and loads the engine does not order): the node's round trips
//! of one part run while the device copies another. A job of `n` pairs is cut into parts of
//! [`part_len`] pairs; on its one connection the client sends part `i + 1`'s opening request
//! (`Reserve` or `Lease`) before it copies part `i`, and part `i`'s closing request (`Finish` or
//! `EndLeases`) right after that copy, reading each answer only when it needs it. The node
//! answers a connection's requests in order, so the answers arrive as
//! `open 0, open 1, close 0, open 2, close 1, ...`, and the engine waits on the node only for the
//! first part's opening and the last part's closing (measured on the H100 and H200:
//! docs/bench/node.md).
//!
//! Invariants: as for one-part jobs (`batch.rs`): a pair counts done only when the node answered
//! it (`Present` to its reservation, `Done` to its commit or end of lease); a request or answer
//! that fails ends the connection (not pooled) and fails every pair not answered done yet, those
//! of the part being closed and of every later part; a slot is copied only after its grant was
//! read, and ended only after its copy returned.
use super::batch::{copy_leg, ended, fail_open, Grant, PairResult};
use super::client::{Conn, NodeStore};
use super::granted::store_granted;
use super::protocol::{LeaseEnd, PutEnd, Reply, Request, MAX_BATCH};
use crate::sys::shm::Arena;
use kvtier::transfer::RemoteError;

/// A device leg called once per part: `(pair, arena address)` items in, failed pairs out.
pub(crate) type PartLeg<'a> = dyn FnMut(&[(usize, usize)]) -> Vec<(usize, String)> + 'a;

/// Jobs shorter than twice this many pairs go in one part (each part costs the device copy a
/// fixed few tens of microseconds).
const MIN_PART: usize = 128;
/// At most this many parts per job.
const PARTS: usize = 4;

/// Pairs per part of a job of `n` pairs: one part below `2 * MIN_PART`, else `n / PARTS`
/// (rounded up) but at least `MIN_PART`; never more than one request's [`MAX_BATCH`].
pub(super) fn part_len(n: usize) -> usize {
    let len = if n < 2 * MIN_PART {
        n
    } else {
        n.div_ceil(PARTS).max(MIN_PART)
    };
    len.clamp(1, MAX_BATCH)
}

/// What one kind of direct job (stores or loads) sends and reads in each phase.
trait Phases {
    /// How a slot is ended (commit or abort; end of lease).
    type End;
    /// The opening request of `keys`.
    fn open(&self, keys: &[u128]) -> Request;
    /// The slots of an opening answered `reply` for `keys` (the first is pair `base`): the
    /// slots to copy `(grant, address)`; pairs failed or done at once are set in `out`, slots
    /// to end without a copy pushed to `early`.
    fn opened(
        &self,
        c: &mut Conn,
        arena: &Arena,
        keys: &[u128],
        base: usize,
        out: &mut [PairResult],
        early: &mut Vec<Self::End>,
    ) -> Result<Vec<(Grant, usize)>, RemoteError>;
    /// How slot `id` ends once its pair's copy succeeded (`ok`) or failed.
    fn end(&self, id: u64, ok: bool) -> Self::End;
    /// The closing request of `ends`.
    fn close(&self, ends: Vec<Self::End>) -> Request;
    /// What a failed end is called in the pair's reason.
    const REFUSED: &'static str;
}

/// Stores: `Reserve`, the copy into the slots, `Finish` (commit each copied slot).
struct Stores {
    bytes: usize,
}

impl Phases for Stores {
    type End = PutEnd;
    const REFUSED: &'static str = "node commit refused";

    fn open(&self, keys: &[u128]) -> Request {
        Request::Reserve {
            bytes: self.bytes as u64,
            keys: keys.to_vec(),
        }
    }

    fn opened(
        &self,
        c: &mut Conn,
        arena: &Arena,
        keys: &[u128],
        base: usize,
        out: &mut [PairResult],
        early: &mut Vec<PutEnd>,
    ) -> Result<Vec<(Grant, usize)>, RemoteError> {
        let answers = c.recv_items("reserve", keys.len(), |r| match r {
            Reply::Reserved(v) => Some(std::mem::take(v)),
            _ => None,
        })?;
        Ok(NodeStore::reserved_slots(
            answers, arena, self.bytes, base, out, early,
        ))
    }

    fn end(&self, id: u64, ok: bool) -> PutEnd {
        if ok {
            PutEnd::Commit { id, checksum: None }
        } else {
            PutEnd::Abort(id)
        }
    }

    fn close(&self, ends: Vec<PutEnd>) -> Request {
        Request::Finish(ends)
    }
}

/// Loads: `Lease`, the copy out of the slots, `EndLeases` (a pair counts once its end is `Done`).
struct Loads {
    bytes: usize,
}

impl Phases for Loads {
    type End = LeaseEnd;
    const REFUSED: &'static str = "node end of lease";

    fn open(&self, keys: &[u128]) -> Request {
        Request::Lease(keys.to_vec())
    }

    fn opened(
        &self,
        c: &mut Conn,
        arena: &Arena,
        keys: &[u128],
        base: usize,
        out: &mut [PairResult],
        early: &mut Vec<LeaseEnd>,
    ) -> Result<Vec<(Grant, usize)>, RemoteError> {
        let answers = c.recv_items("lease", keys.len(), |r| match r {
            Reply::Leased(v) => Some(std::mem::take(v)),
            _ => None,
        })?;
        let leased = NodeStore::leased_slots(answers, arena, keys, self.bytes, base, out, early);
        Ok(leased.into_iter().map(|(g, a, _)| (g, a)).collect())
    }

    fn end(&self, id: u64, _ok: bool) -> LeaseEnd {
        LeaseEnd::Done(id)
    }

    fn close(&self, ends: Vec<LeaseEnd>) -> Request {
        Request::EndLeases(ends)
    }
}

/// A part closed and not yet answered: its ends' requests were sent for `pairs` (one per
/// copied or failed slot, in order; the early ends after them have no pair).
struct Closing {
    pairs: Vec<usize>,
    /// Ends sent (the pairs' and the early ones).
    ends: usize,
}

impl NodeStore {
    /// Device -> arena for `keys` (blocks of `bytes`), in parts (see the module docs): reserve
    /// a slot per key, let `copy` fill the slots, commit each slot copied or abort it. `None`
    /// when the direct path cannot serve this job (`batch.rs`, `direct_conn`): the caller stages
    /// it. A key the node holds already is done without a copy; a full node fails the pair.
    ///
    /// A connection that holds a granted slot per key copies into those and publishes them in
    /// one round trip (`granted.rs`); after the store it asks the node to top its grants up.
    pub(crate) fn store_direct(
        &self,
        keys: &[u128],
        bytes: usize,
        need_cuda: bool,
        copy: &mut PartLeg<'_>,
    ) -> Option<Vec<PairResult>> {
        let (mut c, arena) = match self.parts_conn(keys.len(), need_cuda) {
            Ok(x) => x,
            Err(early) => return early,
        };
        let mut out: Vec<PairResult> = vec![Ok(()); keys.len()];
        let granted = match c.granted_slots(bytes as u64, keys.len()) {
            Ok(g) => g,
            Err(e) => {
                // Not pooled: the connection broke (nothing of this job was sent).
                fail_open(&mut out, 0..keys.len(), &e);
                return Some(out);
            }
        };
        let done = match granted {
            Some(slots) => {
                self.stores_granted
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                store_granted(&mut c, &arena, keys, bytes, slots, &mut out, copy)
            }
            None => run_parts(
                &Stores { bytes },
                &mut c,
                &arena,
                &parts(keys),
                &mut out,
                copy,
            ),
        };
        // A broken connection is not pooled (the node detached it: its grants vanished).
        if done.is_ok() {
            let refill = c.granted.refill(bytes as u64, keys.len());
            if refill.is_none_or(|r| c.send(&r).is_ok()) {
                self.pool(c);
            }
        }
        Some(out)
    }

    /// Arena -> device for `keys` in parts (a load the engine does not order; an ordered one
    /// takes `load_direct`, every lease before its one copy): lease each block, check its size,
    /// let `copy` move the leased slots, end the leases. A pair counts only when its lease was
    /// still held when its copy finished (the node answered its end `Done`).
    pub(crate) fn load_in_parts(
        &self,
        keys: &[u128],
        bytes: usize,
        need_cuda: bool,
        copy: &mut PartLeg<'_>,
    ) -> Option<Vec<PairResult>> {
        self.in_parts(&Loads { bytes }, keys, need_cuda, copy)
    }

    /// As `direct_conn` for a job of `n` pairs; a job of none is answered at once.
    fn parts_conn(
        &self,
        n: usize,
        need_cuda: bool,
    ) -> Result<(Conn, std::sync::Arc<Arena>), Option<Vec<PairResult>>> {
        let (c, arena) = self.direct_conn(n, need_cuda)?;
        if n == 0 {
            self.pool(c);
            return Err(Some(Vec::new()));
        }
        Ok((c, arena))
    }

    fn in_parts<P: Phases>(
        &self,
        job: &P,
        keys: &[u128],
        need_cuda: bool,
        copy: &mut PartLeg<'_>,
    ) -> Option<Vec<PairResult>> {
        let (mut c, arena) = match self.parts_conn(keys.len(), need_cuda) {
            Ok(x) => x,
            Err(early) => return early,
        };
        let mut out: Vec<PairResult> = vec![Ok(()); keys.len()];
        // A broken connection is not pooled: the node detached it (its reservations and
        // leases vanished with it); every pair still open failed in `run_parts`.
        if run_parts(job, &mut c, &arena, &parts(keys), &mut out, copy).is_ok() {
            self.pool(c);
        }
        Some(out)
    }
}

/// `keys` cut into parts of [`part_len`] keys: `(index of the first, the part's keys)`.
fn parts(keys: &[u128]) -> Vec<(usize, &[u128])> {
    let len = part_len(keys.len());
    keys.chunks(len)
        .enumerate()
        .map(|(i, k)| (i * len, k))
        .collect()
}

/// The parts of a job in turn on `c` (see the module docs); `Err` when the connection broke
/// (every pair still open failed).
fn run_parts<P: Phases>(
    job: &P,
    c: &mut Conn,
    arena: &Arena,
    parts: &[(usize, &[u128])],
    out: &mut [PairResult],
    copy: &mut PartLeg<'_>,
) -> Result<(), ()> {
    let n = out.len();
    // Every pair not answered done yet: `closing`'s, and from `from` on.
    let broke = |out: &mut [PairResult], closing: &Option<Closing>, from: usize, e: RemoteError| {
        let open = closing.iter().flat_map(|cl| cl.pairs.iter().copied());
        fail_open(out, open.chain(from..n), &e);
    };
    let mut closing: Option<Closing> = None;
    if let Err(e) = c.send(&job.open(parts[0].1)) {
        broke(out, &closing, 0, e);
        return Err(());
    }
    for (i, &(base, keys)) in parts.iter().enumerate() {
        let mut early = Vec::new();
        let slots = match job.opened(c, arena, keys, base, out, &mut early) {
            Ok(s) => s,
            Err(e) => {
                broke(out, &closing, base, e);
                return Err(());
            }
        };
        // The node works on the next part's slots while this part's copy runs.
        if let Some(&(_, keys)) = parts.get(i + 1) {
            if let Err(e) = c.send(&job.open(keys)) {
                broke(out, &closing, base, e);
                return Err(());
            }
        }
        let items: Vec<(usize, usize)> = slots.iter().map(|&((k, _, _), a)| (k, a)).collect();
        copy_leg(out, &items, &mut *copy);
        // The previous part's ends were answered meanwhile.
        if let Some(cl) = closing.take() {
            if let Err(e) = read_ends::<P>(c, &cl, out) {
                broke(out, &Some(cl), base, e);
                return Err(());
            }
        }
        let pairs: Vec<usize> = slots.iter().map(|g| g.0 .0).collect();
        let mut ends: Vec<P::End> = slots
            .iter()
            .map(|&((k, id, _), _)| job.end(id, out[k].is_ok()))
            .collect();
        ends.extend(early);
        if ends.is_empty() {
            continue;
        }
        let this = Closing {
            pairs,
            ends: ends.len(),
        };
        if let Err(e) = c.send(&job.close(ends)) {
            broke(out, &Some(this), base + keys.len(), e);
            return Err(());
        }
        closing = Some(this);
    }
    if let Some(cl) = closing.take() {
        if let Err(e) = read_ends::<P>(c, &cl, out) {
            broke(out, &Some(cl), n, e);
            return Err(());
        }
    }
    Ok(())
}

/// Read the answer to `cl`'s closing request (one answer per end sent) and fail each of its
/// pairs not ended `Done`.
fn read_ends<P: Phases>(
    c: &mut Conn,
    cl: &Closing,
    out: &mut [PairResult],
) -> Result<(), RemoteError> {
    let answers = c.recv_items(P::REFUSED, cl.ends, |r| match r {
        Reply::Items(v) => Some(std::mem::take(v)),
        _ => None,
    })?;
    ended(&answers, &cl.pairs, out, P::REFUSED);
    Ok(())
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
mod tests;
