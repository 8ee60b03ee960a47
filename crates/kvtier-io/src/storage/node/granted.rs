//! Stores into slots granted ahead: a direct store whose connection holds enough granted slots
//! (`Request::Grant`, slots the node hands out before their keys are known) copies the blocks
//! into them at once and publishes them (`PutEnd::Publish`) in one round trip, instead of the
//! two of `Reserve` .. `Finish`. After each direct store the connection asks for slots to top
//! its pool up again, to twice its largest such job: that request's answer is read when it has
//! arrived or is needed, so the node grants while the engine computes or copies, and a store
//! never waits for the grants the store before it asked for (measured: docs/bench/node.md).
//!
//! Invariants:
//! - a granted slot is copied into only after the node's `Granted` naming it was read on this
//!   connection (its offset checked inside the arena), by the one job that took it from the
//!   pool, and published only after its copy returned; a slot whose copy failed goes back to
//!   the pool unpublished (the next copy into it writes the whole block);
//! - a pair counts done only when the node answered its publish `Done` (published, or the key
//!   held already); a connection that breaks fails every pair not answered done and is not
//!   pooled again (the node then frees its grants);
//! - the answer to a `Grant` is read before any later answer on its connection
//!   (`Conn::recv` reads what it owes first), so answers are never taken for another request's;
//! - bounded: only jobs of at most [`JOB_MAX`] pairs use grants; a pool holds at most twice the
//!   largest such job seen on the connection per block size, and the node caps what one client
//!   and all clients hold (`MAX_GRANTS`, `GRANT_SHARE` in `books.rs`);
//! - idle grants go back: a connection left in the store's pool for `grants_idle` gives every
//!   slot it holds back to the node (`Finish` of aborts, [`return_idle_grants`]), taken out of
//!   the pool meanwhile so no store copies into a slot being given back; an engine that stops
//!   storing holds no arena space beyond that. The pools' sizes are kept: the next store
//!   reserves by key and asks for its grants again.
use std::collections::VecDeque;
use std::time::Duration;

use kvtier::transfer::RemoteError;

use super::batch::{copy_leg, ended, fail_open, PairResult};
use super::client::Conn;
use super::pipeline::{part_len, PartLeg};
use super::protocol::{PutEnd, Reply, Request};
use crate::sys::shm::Arena;

/// Largest direct store (pairs) that goes through granted slots; a connection keeps at most
/// twice this many per block size.
pub(super) const JOB_MAX: usize = 256;

/// The granted slots of one block size.
#[derive(Debug)]
struct Pool {
    bytes: u64,
    /// `(grant id, arena offset)`, unused yet.
    slots: Vec<(u64, u64)>,
    /// Twice the largest job (of at most [`JOB_MAX`] pairs) stored with blocks of this size.
    want: usize,
}

/// A connection's granted slots and the `Grant` answers it still has to read.
#[derive(Debug, Default)]
pub(super) struct Granted {
    /// Bytes of the node's arena (a grant must lie inside it).
    pub(super) arena_bytes: u64,
    pools: Vec<Pool>,
    /// `(bytes, count)` of each `Grant` sent and not answered yet, oldest first.
    owed: VecDeque<(u64, u32)>,
}

impl Granted {
    fn pool(&mut self, bytes: u64) -> &mut Pool {
        let i = match self.pools.iter().position(|p| p.bytes == bytes) {
            Some(i) => i,
            None => {
                self.pools.push(Pool {
                    bytes,
                    slots: Vec::new(),
                    want: 0,
                });
                self.pools.len() - 1
            }
        };
        &mut self.pools[i]
    }

    /// Whether a `Grant`'s answer is still to be read.
    pub(super) fn owes(&self) -> bool {
        !self.owed.is_empty()
    }

    /// Slots of `bytes` asked for and not answered yet.
    fn asked(&self, bytes: u64) -> usize {
        let of = self.owed.iter().filter(|(b, _)| *b == bytes);
        of.map(|(_, n)| *n as usize).sum()
    }

    /// Take `reply`, the answer to the oldest `Grant` still owed: its slots join the pool.
    /// False when it is not a `Granted` of at most the slots asked for, each inside the arena
    /// (the connection must end).
    pub(super) fn take_reply(&mut self, reply: &mut Reply) -> bool {
        let Some((bytes, count)) = self.owed.pop_front() else {
            return false;
        };
        let arena = self.arena_bytes;
        let inside =
            |&(_, off): &(u64, u64)| off.checked_add(bytes).is_some_and(|end| end <= arena);
        match reply {
            Reply::Granted(v) if v.len() <= count as usize && v.iter().all(inside) => {
                self.pool(bytes).slots.append(v);
                true
            }
            _ => false,
        }
    }

    /// Whether the pool of `bytes` holds `n` slots.
    fn has(&self, bytes: u64, n: usize) -> bool {
        self.pools
            .iter()
            .any(|p| p.bytes == bytes && p.slots.len() >= n)
    }

    /// `n` granted slots of `bytes`, if the pool holds that many.
    pub(super) fn take(&mut self, bytes: u64, n: usize) -> Option<Vec<(u64, u64)>> {
        let p = self.pools.iter_mut().find(|p| p.bytes == bytes)?;
        let at = p.slots.len().checked_sub(n)?;
        Some(p.slots.split_off(at))
    }

    /// The request that tops the pool of `bytes` up after a store of `n` pairs, if it needs
    /// any (the answer is then owed).
    pub(super) fn refill(&mut self, bytes: u64, n: usize) -> Option<Request> {
        let asked = self.asked(bytes);
        let p = self.pool(bytes);
        if n <= JOB_MAX {
            p.want = p.want.max(2 * n);
        }
        let count = p
            .want
            .checked_sub(p.slots.len() + asked)
            .filter(|&c| c > 0)?;
        let count = u32::try_from(count).ok()?;
        self.owed.push_back((bytes, count));
        Some(Request::Grant { bytes, count })
    }

    /// Slots of `bytes` taken and not published (their copies failed): back to the pool.
    fn give_back(&mut self, bytes: u64, slots: Vec<(u64, u64)>) {
        self.pool(bytes).slots.extend(slots);
    }

    /// Whether any pool holds a slot, or a `Grant` is still to be answered.
    pub(super) fn holds_any(&self) -> bool {
        self.owes() || self.pools.iter().any(|p| !p.slots.is_empty())
    }

    /// Every unused slot's grant id, taken out of the pools (their sizes kept).
    fn drain(&mut self) -> Vec<u64> {
        let slots = self.pools.iter_mut().flat_map(|p| p.slots.drain(..));
        slots.map(|(id, _)| id).collect()
    }
}

/// Give back the grants of the connections of `idle` (a store's pool of at most `cap`) left
/// there for at least `after`: each is taken out of the pool while it does, and pooled again
/// unless it broke or the pool filled up meanwhile.
pub(super) fn return_idle_grants(idle: &std::sync::Mutex<Vec<Conn>>, after: Duration, cap: usize) {
    let lock = || idle.lock().unwrap_or_else(|p| p.into_inner());
    let stale: Vec<Conn> = {
        let mut pool = lock();
        let (stale, fresh) = std::mem::take(&mut *pool)
            .into_iter()
            .partition(|c| c.granted.holds_any() && c.pooled_at.elapsed() >= after);
        *pool = fresh;
        stale
    };
    for mut c in stale {
        match c.return_grants() {
            Ok(()) => {
                let mut pool = lock();
                if pool.len() < cap {
                    pool.push(c);
                }
            }
            Err(e) => tracing::debug!("node connection dropped while giving grants back: {e}"),
        }
    }
}

/// The thread that gives idle connections' grants back (pool of at most `cap`), every `after / 2`
/// (at least 10 ms, at most 1 s), until its store is dropped (the returned sender with it).
pub(super) fn spawn_returns(
    idle: std::sync::Weak<std::sync::Mutex<Vec<Conn>>>,
    after: Duration,
    cap: usize,
) -> Option<std::sync::mpsc::Sender<()>> {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let tick = (after / 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let spawned = std::thread::Builder::new()
        .name("kvtier-node-grants".into())
        .spawn(move || loop {
            if !matches!(
                stopped.recv_timeout(tick),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout)
            ) {
                return;
            }
            let Some(idle) = idle.upgrade() else { return };
            return_idle_grants(&idle, after, cap);
        });
    match spawned {
        Ok(_) => Some(stop),
        Err(e) => {
            tracing::warn!("no thread to give idle node grants back ({e}); they go back when connections close");
            None
        }
    }
}

impl Conn {
    /// Give every slot granted to this connection back to the node, once the `Grant` answers
    /// owed are read. `Err`: the connection broke (the node frees its grants as it ends).
    pub(super) fn return_grants(&mut self) -> Result<(), RemoteError> {
        self.settle()?;
        let ends: Vec<PutEnd> = self
            .granted
            .drain()
            .into_iter()
            .map(PutEnd::Abort)
            .collect();
        if !ends.is_empty() {
            self.finish(&ends)?;
        }
        Ok(())
    }

    /// A granted slot of `bytes` per pair of a direct store of `n` pairs, reading the `Grant`
    /// answers still owed when the pool is short; `None` when the store reserves by key instead
    /// (longer than [`JOB_MAX`], or too few slots granted). `Err`: the connection broke.
    pub(super) fn granted_slots(
        &mut self,
        bytes: u64,
        n: usize,
    ) -> Result<Option<Vec<(u64, u64)>>, RemoteError> {
        if n > JOB_MAX {
            return Ok(None);
        }
        if !self.granted.has(bytes, n) && self.granted.owes() {
            self.settle()?;
        }
        Ok(self.granted.take(bytes, n))
    }
}

/// A `Finish` sent and not answered yet: the pairs it publishes, in order.
struct Publishing {
    pairs: Vec<usize>,
    /// Items sent (the publishes, then early aborts, which have no pair).
    ends: usize,
}

/// Device -> arena for `keys` into `slots` (one granted slot per key, taken from `c`'s pool),
/// in parts: each part's publishes are sent as soon as its copy returned, the answers read at
/// the end. `Err` when the connection broke (every pair not answered done failed).
pub(super) fn store_granted(
    c: &mut Conn,
    arena: &Arena,
    keys: &[u128],
    bytes: usize,
    slots: Vec<(u64, u64)>,
    out: &mut [PairResult],
    copy: &mut PartLeg<'_>,
) -> Result<(), ()> {
    let n = keys.len();
    let len = part_len(n);
    let mut back = Vec::new();
    let mut sent: Vec<Publishing> = Vec::new();
    // Every pair but those of the first `answered` publishes sent fails: the connection broke.
    let broke = |out: &mut [PairResult], sent: &[Publishing], answered: usize, e: RemoteError| {
        let done: Vec<usize> = sent[..answered]
            .iter()
            .flat_map(|p| p.pairs.clone())
            .collect();
        fail_open(out, (0..n).filter(|k| !done.contains(k)), &e);
    };
    for (i, chunk) in slots.chunks(len).enumerate() {
        let base = i * len;
        let mut items = Vec::with_capacity(chunk.len());
        let mut aborts = Vec::new();
        for (j, &(id, offset)) in chunk.iter().enumerate() {
            match arena.addr(offset, bytes) {
                Ok(a) => items.push((base + j, a)),
                Err(e) => {
                    out[base + j] = Err(format!("node slot: {e}"));
                    aborts.push(PutEnd::Abort(id));
                }
            }
        }
        copy_leg(out, &items, &mut *copy);
        let mut pairs = Vec::with_capacity(chunk.len());
        let mut ends = Vec::with_capacity(chunk.len());
        for (j, &(id, offset)) in chunk.iter().enumerate() {
            let k = base + j;
            match &out[k] {
                Ok(()) => {
                    pairs.push(k);
                    ends.push(PutEnd::Publish {
                        id,
                        key: keys[k],
                        checksum: None,
                    });
                }
                Err(_) if !aborts.contains(&PutEnd::Abort(id)) => back.push((id, offset)),
                Err(_) => {}
            }
        }
        ends.extend(aborts);
        if ends.is_empty() {
            continue;
        }
        let count = ends.len();
        if let Err(e) = c.send(&Request::Finish(ends)) {
            broke(out, &sent, 0, e);
            return Err(());
        }
        sent.push(Publishing { pairs, ends: count });
    }
    for (i, p) in sent.iter().enumerate() {
        if let Err(e) = read_published(c, p, out) {
            broke(out, &sent, i, e);
            return Err(());
        }
    }
    c.granted.give_back(bytes as u64, back);
    Ok(())
}

/// Read the answer to `p`'s `Finish` and fail each of its pairs not answered `Done`.
fn read_published(c: &mut Conn, p: &Publishing, out: &mut [PairResult]) -> Result<(), RemoteError> {
    let answers = c.recv_items("node publish", p.ends, |r| match r {
        Reply::Items(v) => Some(std::mem::take(v)),
        _ => None,
    })?;
    ended(&answers, &p.pairs, out, "node publish refused");
    Ok(())
}

#[cfg(test)]
#[path = "granted_tests.rs"]
mod tests;
