//! Redis/Valkey Cluster routing on kvtier's own RESP client ([`super::wire`]): which node owns a
//! key (CRC16 slot, `{hash tag}`), the slot map learnt from `CLUSTER SLOTS`, and the redirects
//! (`MOVED`, `ASK`) a node answers while slots move or after a failover.
//!
//! Invariants:
//! - every exchange of one operation (refreshing the slot map, connecting to a node, its
//!   handshake, the request, each redirect) runs under the operation's one [`Deadline`], so
//!   cluster mode keeps the single server's bound (`min(connect, t) + 2t` with the store's one
//!   retry), however many nodes an operation touches or redirects it follows;
//! - a key goes to the node the map names for its slot; `MOVED` updates that slot's entry and is
//!   followed at most [`MAX_REDIRECTS`] times per key; `ASK` sends `ASKING` first and changes no
//!   entry;
//! - after a failed exchange with a node, its connection is dropped; when the node itself failed
//!   (not an error reply), the map is refreshed before the next operation (it may have failed
//!   over);
//! - replies are read with the same bounds as a single server's (a `GET` reply's length is
//!   checked before its bytes are read; `CLUSTER SLOTS` through the bounded `read_value`);
//! - each node has its own circuit breaker ([`super::breaker`], the store's settings): a dead
//!   master fails the operations on its slots fast while the other nodes' keys keep working (one
//!   breaker for the whole cluster stopped every key once one node was down);
//! - the map lock and the breaker table's lock are never held across network I/O.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use super::breaker::{Breaker, BreakerState, BreakerStats, Failure, Ticket};
use super::wire::{push_cmd, Addr, Deadline, Value, WireConn, WireError};

/// Hash slots of a Redis Cluster.
pub(crate) const SLOTS: usize = 16384;
/// Redirects followed per key and operation.
pub(crate) const MAX_REDIRECTS: usize = 3;
/// Marks a slot no node serves in [`SlotMap::owner`].
const NOBODY: u16 = u16::MAX;

/// The slot of `key`: CRC16 (XMODEM) of the key, or of its first non-empty `{hash tag}`, modulo
/// 16384 (the Redis Cluster specification, "Keys distribution model").
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&len| len > 0)
            .map(|len| &rest[..len])
    });
    let hashed = tagged.unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(hashed) % SLOTS as u16
}

/// Which node serves each slot.
#[derive(Clone, Debug)]
struct SlotMap {
    nodes: Vec<Addr>,
    owner: Box<[u16]>,
}

impl SlotMap {
    /// The map of a `CLUSTER SLOTS` reply received from `asked` (an empty or `?` endpoint means
    /// "the host you asked", per the command's documentation).
    fn parse(reply: &Value, asked: &Addr) -> Result<SlotMap, WireError> {
        let bad = |what: &str| WireError::Protocol(format!("CLUSTER SLOTS: {what}"));
        let Value::Array(ranges) = reply else {
            return Err(bad("not an array"));
        };
        let mut map = SlotMap {
            nodes: Vec::new(),
            owner: vec![NOBODY; SLOTS].into_boxed_slice(),
        };
        for range in ranges {
            let Value::Array(r) = range else {
                return Err(bad("a range is not an array"));
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return Err(bad("a range lacks start, end or master"));
            };
            let slot = |v: i64| usize::try_from(v).ok().filter(|&s| s < SLOTS);
            let (Some(start), Some(end)) = (slot(*start), slot(*end)) else {
                return Err(bad("slot out of range"));
            };
            let (Some(Value::Bytes(host)), Some(Value::Int(port))) =
                (master.first(), master.get(1))
            else {
                return Err(bad("a master lacks host or port"));
            };
            let port = u16::try_from(*port).map_err(|_| bad("port out of range"))?;
            let host = String::from_utf8_lossy(host).into_owned();
            let addr = match (host.as_str(), asked) {
                ("" | "?", Addr::Tcp(h, _)) => Addr::Tcp(h.clone(), port),
                ("" | "?", Addr::Unix(_)) => return Err(bad("no endpoint for a node")),
                _ => Addr::Tcp(host, port),
            };
            let idx = match map.nodes.iter().position(|n| *n == addr) {
                Some(i) => i,
                None => {
                    map.nodes.push(addr);
                    map.nodes.len() - 1
                }
            };
            let idx = u16::try_from(idx).map_err(|_| bad("too many nodes"))?;
            for s in map.owner.get_mut(start..=end).into_iter().flatten() {
                *s = idx;
            }
        }
        Ok(map)
    }

    fn owner(&self, slot: u16) -> Option<&Addr> {
        let i = *self.owner.get(usize::from(slot))?;
        self.nodes.get(usize::from(i))
    }

    fn set_owner(&mut self, slot: u16, addr: Addr) {
        let idx = match self.nodes.iter().position(|n| *n == addr) {
            Some(i) => i,
            None => {
                self.nodes.push(addr);
                self.nodes.len() - 1
            }
        };
        if let (Ok(idx), Some(s)) = (u16::try_from(idx), self.owner.get_mut(usize::from(slot))) {
            *s = idx;
        }
    }
}

/// A redirect a node answered instead of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Redirect {
    /// The slot lives on `to` from now on.
    Moved { slot: u16, to: Addr },
    /// Ask `to`, once, after `ASKING` (the slot is migrating).
    Ask { slot: u16, to: Addr },
}

impl Redirect {
    /// The redirect in an error reply's text (`MOVED 3999 127.0.0.1:6381`), if it is one.
    pub(crate) fn parse(msg: &str) -> Option<Redirect> {
        let mut parts = msg.split_ascii_whitespace();
        let kind = parts.next()?;
        let slot: u16 = parts
            .next()?
            .parse()
            .ok()
            .filter(|&s| usize::from(s) < SLOTS)?;
        let (host, port) = parts.next()?.rsplit_once(':')?;
        let to = Addr::Tcp(
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port.parse().ok()?,
        );
        match kind {
            "MOVED" => Some(Redirect::Moved { slot, to }),
            "ASK" => Some(Redirect::Ask { slot, to }),
            _ => None,
        }
    }
}

/// The per-node breakers' settings: `(backoff, max_backoff, trip_after)` as in
/// [`super::RedisOptions`].
pub(crate) type BreakerSettings = (Duration, Duration, u32);

/// The cluster a store talks to: its seed nodes, the credentials every node takes, the slot map
/// its connections share, and one breaker per node.
pub(crate) struct Router {
    seeds: Vec<Addr>,
    auth: Option<(Option<String>, String)>,
    connect_timeout: Duration,
    /// `None`: unknown or stale, refreshed by the next operation.
    map: RwLock<Option<SlotMap>>,
    /// The nodes of the last map learnt (asked first when the map is refreshed).
    known: RwLock<Vec<Addr>>,
    breaker_settings: BreakerSettings,
    breakers: Mutex<HashMap<Addr, Arc<Breaker>>>,
}

/// How a failed exchange with a node counts for its breaker: `None` when the node answered
/// (an error reply, a value of the wrong size), else the failure and its text.
pub(crate) type NodeFailure = Option<(Failure, String)>;

/// [`NodeFailure`] of a wire error.
pub(crate) fn wire_failure(e: &WireError) -> NodeFailure {
    match e {
        WireError::Server(_) | WireError::NodeDown(_) => None,
        WireError::Refused(_) => Some((Failure::Refused, e.to_string())),
        _ => Some((Failure::Failed, e.to_string())),
    }
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("seeds", &self.seeds)
            .finish_non_exhaustive()
    }
}

impl Router {
    pub(crate) fn new(
        seeds: Vec<Addr>,
        auth: Option<(Option<String>, String)>,
        connect_timeout: Duration,
        breaker_settings: BreakerSettings,
    ) -> Self {
        Router {
            seeds,
            auth,
            connect_timeout,
            map: RwLock::new(None),
            known: RwLock::new(Vec::new()),
            breaker_settings,
            breakers: Mutex::new(HashMap::new()),
        }
    }

    /// The breaker of node `addr`.
    fn breaker(&self, addr: &Addr) -> Arc<Breaker> {
        let mut g = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        let (backoff, max_backoff, trip_after) = self.breaker_settings;
        Arc::clone(
            g.entry(addr.clone())
                .or_insert_with(|| Arc::new(Breaker::new(backoff, max_backoff, trip_after))),
        )
    }

    /// The nodes' breakers as one: open when any node's is not closed, counters summed.
    pub(crate) fn breaker_stats(&self) -> BreakerStats {
        let g = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = BreakerStats {
            state: BreakerState::Closed,
            attempted: 0,
            failed: 0,
            short_circuited: 0,
            opened: 0,
            probes: 0,
        };
        for b in g.values() {
            let s = b.stats();
            if s.state != BreakerState::Closed && out.state != BreakerState::Open {
                out.state = s.state;
            }
            out.attempted += s.attempted;
            out.failed += s.failed;
            out.short_circuited += s.short_circuited;
            out.opened += s.opened;
            out.probes += s.probes;
        }
        out
    }

    fn invalidate(&self) {
        if let Ok(mut m) = self.map.write() {
            *m = None;
        }
    }

    fn owner(&self, slot: u16) -> Option<Option<Addr>> {
        let m = self.map.read().ok()?;
        m.as_ref().map(|m| m.owner(slot).cloned())
    }

    /// The positions of `slots` grouped by the node serving them, under one read of the map;
    /// `Err(slot)` for the first slot no node serves (or when the map is unknown).
    fn group_by_owner(&self, slots: &[u16]) -> Result<Vec<(Addr, Vec<usize>)>, u16> {
        let first = slots.first().copied().unwrap_or(0);
        let m = self.map.read().map_err(|_| first)?;
        let m = m.as_ref().ok_or(first)?;
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); m.nodes.len()];
        for (i, &slot) in slots.iter().enumerate() {
            match m.owner.get(usize::from(slot)).map(|&k| usize::from(k)) {
                Some(k) if k < groups.len() => groups[k].push(i),
                _ => return Err(slot),
            }
        }
        Ok(m.nodes
            .iter()
            .cloned()
            .zip(groups)
            .filter(|(_, g)| !g.is_empty())
            .collect())
    }

    /// Nodes to ask for the map: the ones the last map knew, then the seeds; nodes whose breaker
    /// is open last (a dead host must not eat the refresh's deadline first).
    fn candidates(&self) -> Vec<Addr> {
        let mut out: Vec<Addr> = self.known.read().map(|k| k.clone()).unwrap_or_default();
        for s in &self.seeds {
            if !out.contains(s) {
                out.push(s.clone());
            }
        }
        let down = |a: &Addr| {
            let g = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
            g.get(a)
                .is_some_and(|b| b.stats().state != BreakerState::Closed)
        };
        out.sort_by_key(|a| down(a));
        out
    }

    fn moved(&self, slot: u16, to: Addr) {
        if let Ok(mut m) = self.map.write() {
            if let Some(m) = m.as_mut() {
                m.set_owner(slot, to);
            }
        }
    }
}

/// One pooled connection set: at most one connection per node, and a reusable command buffer.
#[derive(Default)]
pub(crate) struct ClusterConn {
    conns: HashMap<Addr, WireConn>,
    pub(crate) buf: Vec<u8>,
}

impl ClusterConn {
    /// The connection to `addr`, connecting (and authenticating) under `dl` if there is none.
    fn node(
        &mut self,
        router: &Router,
        addr: &Addr,
        dl: &Deadline,
    ) -> Result<&mut WireConn, WireError> {
        if !self.conns.contains_key(addr) {
            let mut conn = WireConn::connect(addr, router.connect_timeout, dl)?;
            if let Some((user, pass)) = &router.auth {
                let mut cmd = Vec::new();
                match user {
                    Some(u) => push_cmd(&mut cmd, &[b"AUTH", u.as_bytes(), pass.as_bytes()]),
                    None => push_cmd(&mut cmd, &[b"AUTH", pass.as_bytes()]),
                }
                conn.send(&cmd, dl)?;
                conn.read_status(dl)?;
            }
            self.conns.insert(addr.clone(), conn);
        }
        self.conns
            .get_mut(addr)
            .ok_or_else(|| WireError::Protocol("connection vanished".into()))
    }

    /// Settles an exchange with `addr`: `Ok` (a reply or a redirect, which is one whole line)
    /// keeps the connection; an error drops it (it may hold an unread reply), and when the node
    /// itself failed (`Some` failure) also the map (the node may be gone), counting against its
    /// breaker.
    fn settle(
        &mut self,
        router: &Router,
        addr: &Addr,
        ticket: Ticket<'_>,
        outcome: Result<(), NodeFailure>,
    ) {
        match outcome {
            Ok(()) => ticket.success(),
            Err(None) => {
                self.conns.remove(addr);
                ticket.success();
            }
            Err(Some((how, reason))) => {
                self.conns.remove(addr);
                router.invalidate();
                ticket.failure(reason, how);
            }
        }
    }

    /// Learns the slot map from the first node that answers, under `dl`.
    /// Each node asked gets at most half the time left while others remain to be asked (a hung
    /// node must not take the whole deadline), and a node that failed counts against its
    /// breaker, so the next refresh asks it last.
    fn refresh(&mut self, router: &Router, dl: &Deadline) -> Result<(), WireError> {
        let mut last = WireError::Protocol("no seed node".into());
        let candidates = router.candidates();
        for (i, addr) in candidates.iter().enumerate() {
            let addr = addr.clone();
            let share = if i + 1 < candidates.len() {
                dl.half()
            } else {
                *dl
            };
            let got = self.node(router, &addr, &share).and_then(|c| {
                let mut cmd = Vec::new();
                push_cmd(&mut cmd, &[b"CLUSTER", b"SLOTS"]);
                c.send(&cmd, &share)?;
                c.read_value(&share)
            });
            if let Some((how, reason)) = got.as_ref().err().and_then(wire_failure) {
                if let Ok(t) = router.breaker(&addr).admit() {
                    t.failure(reason, how);
                }
            }
            match got.and_then(|v| SlotMap::parse(&v, &addr)) {
                Ok(map) => {
                    if let Ok(mut k) = router.known.write() {
                        k.clone_from(&map.nodes);
                    }
                    if let Ok(mut m) = router.map.write() {
                        *m = Some(map);
                    }
                    return Ok(());
                }
                Err(e) => {
                    // The next node, while the operation's deadline leaves time.
                    self.conns.remove(&addr);
                    let timed_out = e.is_timeout();
                    last = e;
                    if timed_out && dl.expired() {
                        break;
                    }
                }
            }
        }
        Err(last)
    }

    /// The node serving `slot`, refreshing the map first if it is unknown.
    fn owner_of(&mut self, router: &Router, slot: u16, dl: &Deadline) -> Result<Addr, WireError> {
        if router.owner(slot).is_none() {
            self.refresh(router, dl)?;
        }
        router
            .owner(slot)
            .flatten()
            .ok_or_else(|| WireError::Server(format!("CLUSTERDOWN hash slot {slot} is not served")))
    }

    /// One command on the key of `slot`: `exchange` sends it on the connection it is given (after
    /// `ASKING` when asked to) and reads the reply; a redirect in the reply is followed (see the
    /// module invariants). Any error is returned as `exchange` produced it, after the failed
    /// node's connection was dropped.
    #[allow(clippy::too_many_arguments)] // each closure is one question about the reply
    pub(crate) fn single<T, E>(
        &mut self,
        router: &Router,
        slot: u16,
        dl: &Deadline,
        mut exchange: impl FnMut(&mut WireConn, &mut Vec<u8>, &Deadline) -> Result<T, E>,
        redirect_of: impl Fn(&E) -> Option<Redirect>,
        failure_of: impl Fn(&E) -> NodeFailure,
    ) -> Result<T, E>
    where
        E: From<WireError>,
    {
        let mut to = self.owner_of(router, slot, dl)?;
        let mut asking = false;
        for _ in 0..=MAX_REDIRECTS {
            let breaker = router.breaker(&to);
            let ticket = breaker
                .admit()
                .map_err(|r| E::from(WireError::NodeDown(r.0)))?;
            let mut buf = std::mem::take(&mut self.buf);
            let r = self.node(router, &to, dl).map_err(E::from).and_then(|c| {
                if asking {
                    let mut cmd = Vec::new();
                    push_cmd(&mut cmd, &[b"ASKING"]);
                    c.send(&cmd, dl)?;
                    c.read_status(dl)?;
                }
                exchange(c, &mut buf, dl)
            });
            self.buf = buf;
            let outcome = match r.as_ref().err() {
                Some(e) if redirect_of(e).is_none() => Err(failure_of(e)),
                _ => Ok(()),
            };
            self.settle(router, &to, ticket, outcome);
            match r {
                Ok(v) => return Ok(v),
                Err(e) => match redirect_of(&e) {
                    Some(Redirect::Moved { slot: s, to: next }) => {
                        router.moved(s, next.clone());
                        to = next;
                        asking = false;
                    }
                    Some(Redirect::Ask { to: next, .. }) => {
                        to = next;
                        asking = true;
                    }
                    None => return Err(e),
                },
            }
        }
        Err(E::from(WireError::Protocol(format!(
            "more than {MAX_REDIRECTS} redirects for hash slot {slot}"
        ))))
    }

    /// `EXISTS` for every key of `names` (one pipeline per node, all under `dl`): whether each
    /// exists. Keys whose node redirected are asked again one by one through [`Self::single`].
    pub(crate) fn exists(
        &mut self,
        router: &Router,
        names: &[String],
        dl: &Deadline,
    ) -> Result<Vec<bool>, WireError> {
        let slots: Vec<u16> = names.iter().map(|n| key_slot(n.as_bytes())).collect();
        if let Some(&slot) = slots.first() {
            self.owner_of(router, slot, dl)?; // refreshes an unknown map
        }
        let by_node = router.group_by_owner(&slots).map_err(|slot| {
            WireError::Server(format!("CLUSTERDOWN hash slot {slot} is not served"))
        })?;
        let mut found = vec![false; names.len()];
        let mut again = Vec::new();
        for (addr, idx) in by_node {
            let breaker = router.breaker(&addr);
            let ticket = breaker.admit().map_err(|r| WireError::NodeDown(r.0))?;
            let r = self.node(router, &addr, dl).and_then(|c| {
                let mut cmd = Vec::new();
                for &i in &idx {
                    push_cmd(&mut cmd, &[b"EXISTS", names[i].as_bytes()]);
                }
                c.send(&cmd, dl)?;
                for &i in &idx {
                    // An error reply is one whole line: the pipeline stays in step.
                    match c.read_int(dl) {
                        Ok(n) => found[i] = n > 0,
                        Err(WireError::Server(m)) if Redirect::parse(&m).is_some() => again.push(i),
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            });
            let outcome = r.as_ref().map(|_| ()).map_err(wire_failure);
            self.settle(router, &addr, ticket, outcome);
            r?;
        }
        for i in again {
            found[i] = self.single(
                router,
                slots[i],
                dl,
                |c, buf, dl| {
                    buf.clear();
                    push_cmd(buf, &[b"EXISTS", names[i].as_bytes()]);
                    c.send(buf, dl)?;
                    c.read_int(dl)
                },
                |e: &WireError| match e {
                    WireError::Server(m) => Redirect::parse(m),
                    _ => None,
                },
                wire_failure,
            )? > 0;
        }
        Ok(found)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_specification() {
        // The specification's example: "123456789" hashes to 0x31C3 under CRC16-XMODEM.
        assert_eq!(
            crc16::State::<crc16::XMODEM>::calculate(b"123456789"),
            0x31C3
        );
        assert_eq!(key_slot(b"123456789"), 0x31C3); // below 16384 already
                                                    // Hash tags: only the first non-empty `{...}` counts.
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }

    #[test]
    fn redirects_parse() {
        assert_eq!(
            Redirect::parse("MOVED 3999 127.0.0.1:6381"),
            Some(Redirect::Moved {
                slot: 3999,
                to: Addr::Tcp("127.0.0.1".into(), 6381)
            })
        );
        assert_eq!(
            Redirect::parse("ASK 1 ::1:7000"),
            Some(Redirect::Ask {
                slot: 1,
                to: Addr::Tcp("::1".into(), 7000)
            })
        );
        assert_eq!(Redirect::parse("MOVED 16384 h:1"), None);
        assert_eq!(Redirect::parse("ERR wrong type"), None);
        assert_eq!(Redirect::parse("MOVED 1 nohost"), None);
    }

    #[test]
    fn slot_map_parses_and_fills_unknown_hosts() {
        let node = |h: &str, p: i64| Value::Array(vec![Value::Bytes(h.into()), Value::Int(p)]);
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(8000),
                node("10.0.0.1", 7000),
            ]),
            Value::Array(vec![Value::Int(8001), Value::Int(16383), node("", 7001)]),
        ]);
        let asked = Addr::Tcp("seed".into(), 1);
        let m = SlotMap::parse(&reply, &asked).unwrap();
        assert_eq!(m.owner(0), Some(&Addr::Tcp("10.0.0.1".into(), 7000)));
        assert_eq!(m.owner(8001), Some(&Addr::Tcp("seed".into(), 7001)));
        let bad = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(20000),
            node("h", 1),
        ])]);
        assert!(SlotMap::parse(&bad, &asked).is_err());
        let partial = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(10),
            node("h", 1),
        ])]);
        assert_eq!(SlotMap::parse(&partial, &asked).unwrap().owner(11), None);
    }
}
