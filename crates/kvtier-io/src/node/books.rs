//! The node tier's books: which slot of the shared arena holds which block, who is writing or
//! reading which slot, and who gets evicted when the arena is full. Pure data structures: no I/O,
//! no clock (ticks are counted here), no unsafe.
//!
//! Definitions:
//! - a *client* is one attached engine process (one connection); it stores blocks under one
//!   *namespace* (the model identity) and one block size;
//! - the arena is carved into slots lazily, bump-allocated per block size (a *class*); a freed
//!   slot returns to its class's free list and is reused only by that class;
//! - a *reservation* is a slot a client is writing (`begin_put` .. `commit_put`); a *lease* is a
//!   slot a client is reading (`begin_get` .. `end_get`).
//!
//! Invariants (checked by the tests and the property test below):
//! - a block is visible (`contains`, `begin_get`) only after its writer committed it: a client
//!   that disconnects mid-write (`detach`) leaves nothing visible and its slot is free again;
//! - a leased or reserved slot is never evicted nor handed to anyone else; a client's leases and
//!   reservations end when it detaches (a crashed engine leaks nothing);
//! - keys live in their namespace: a lookup in one namespace never sees another's blocks;
//! - eviction takes the least recently used unpinned block of the needed class, preferring the
//!   namespace that holds the most bytes above its fair share (capacity * its weight / the
//!   weights of the namespaces attached; [`SharePolicy`], equal weights by default), so one
//!   engine filling the node cannot push out another's blocks below its share;
//! - slots never overlap and never exceed the arena (`offset + class bytes <= capacity`).
use std::collections::{BTreeMap, HashMap};

use super::share::SharePolicy;

/// One attached client (connection).
pub type ClientId = u64;

/// Why a put could not start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutRefused {
    /// The block is already stored (or being written) in this namespace: nothing to do.
    Present,
    /// No free, bumpable or evictable slot of this size: the put is skipped (a miss later).
    Full,
}

/// A slot handed out for reading or writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotGrant {
    /// The grant's id, named again by the commit, abort or end of lease.
    pub id: u64,
    /// Where the block's bytes start in the arena.
    pub offset: u64,
    /// Bytes of the block.
    pub bytes: u64,
    /// The checksum its writer committed (0 in a put grant, not yet known).
    pub checksum: u64,
}

#[derive(Clone, Debug)]
struct Block {
    ns: u32,
    key: u128,
    offset: u64,
    bytes: u64,
    checksum: u64,
    /// Readers holding the slot.
    leases: u32,
    tick: u64,
}

#[derive(Clone, Debug)]
struct Reservation {
    client: ClientId,
    ns: u32,
    key: u128,
    offset: u64,
    bytes: u64,
}

#[derive(Clone, Debug)]
struct Client {
    ns: u32,
    bytes: u64,
    leases: Vec<u64>,
    reservations: Vec<u64>,
}

/// A committed block as the node's disk tier needs it (evicted, or left at shutdown).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    /// The namespace (model identity) it was stored under.
    pub namespace: String,
    /// The block's content key (its sequence hash).
    pub key: u128,
    /// Where its bytes are in the arena.
    pub offset: u64,
    /// Bytes of the block.
    pub bytes: u64,
    /// The checksum its writer committed.
    pub checksum: u64,
}

/// Counters of the node (reported by `kvtier node` and its stats request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Connections attached now.
    pub clients: u64,
    /// Blocks held in the arena now (committed or being written).
    pub blocks: u64,
    /// Arena bytes those blocks use.
    pub bytes_used: u64,
    /// Arena bytes in all.
    pub capacity: u64,
    /// Puts committed.
    pub puts: u64,
    /// Puts skipped because nothing was free or evictable.
    pub puts_full: u64,
    /// Gets asked for.
    pub gets: u64,
    /// Of those, keys the node did not hold.
    pub get_misses: u64,
    /// Committed blocks evicted to make room.
    pub evictions: u64,
    /// Puts begun and never committed (aborted, or their client detached).
    pub abandoned_puts: u64,
    /// Blocks the node's disk tier holds.
    pub disk_blocks: u64,
    /// Blocks spilled from the arena to the disk tier.
    pub disk_spills: u64,
    /// Gets served from the disk tier.
    pub disk_hits: u64,
}

/// The books of one node tier (see the module docs).
#[derive(Debug)]
pub struct Books {
    capacity: u64,
    bump: u64,
    free: HashMap<u64, Vec<u64>>,
    namespaces: Vec<String>,
    /// Weight of each namespace (by index), from `policy`.
    weights: Vec<u32>,
    policy: SharePolicy,
    /// (namespace, key) -> block id (committed blocks only).
    index: HashMap<(u32, u128), u64>,
    blocks: HashMap<u64, Block>,
    /// LRU order of committed blocks: (tick, block id).
    lru: BTreeMap<(u64, u64), ()>,
    reservations: HashMap<u64, Reservation>,
    /// Keys being written, so a second writer of the same key is told `Present`.
    writing: HashMap<(u32, u128), u64>,
    /// Bytes of committed blocks per namespace.
    ns_bytes: HashMap<u32, u64>,
    clients: HashMap<ClientId, Client>,
    next_id: u64,
    tick: u64,
    stats: NodeStats,
    /// With a disk tier behind the arena: blocks evicted since the last `take_evicted` (their
    /// slots are not handed to a writer before the server copied them out, under the lock).
    keep_evicted: bool,
    evicted: Vec<BlockCopy>,
}

impl Books {
    /// Books over an arena of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        Self::with_policy(capacity, SharePolicy::Equal)
    }

    /// Books whose fair shares follow `policy`.
    pub fn with_policy(capacity: u64, policy: SharePolicy) -> Self {
        Books {
            capacity,
            bump: 0,
            free: HashMap::new(),
            namespaces: Vec::new(),
            weights: Vec::new(),
            policy,
            index: HashMap::new(),
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            reservations: HashMap::new(),
            writing: HashMap::new(),
            ns_bytes: HashMap::new(),
            clients: HashMap::new(),
            next_id: 1,
            tick: 0,
            stats: NodeStats {
                capacity,
                ..NodeStats::default()
            },
            keep_evicted: false,
            evicted: Vec::new(),
        }
    }

    /// Keep each evicted block's place for [`Books::take_evicted`] (a disk tier spills them).
    pub fn set_keep_evicted(&mut self, on: bool) {
        self.keep_evicted = on;
    }

    /// Blocks evicted since the last call. Their slots may already be reserved by the put that
    /// evicted them: copy their bytes out before that put's writer is told its slot.
    pub fn take_evicted(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.evicted)
    }

    /// Every committed block (the disk tier keeps them at shutdown).
    pub fn committed(&self) -> Vec<BlockCopy> {
        self.blocks.values().map(|b| self.copy_of(b)).collect()
    }

    /// The namespace `client` attached with.
    pub fn namespace_of(&self, client: ClientId) -> Option<&str> {
        let ns = self.clients.get(&client)?.ns;
        self.namespaces.get(ns as usize).map(String::as_str)
    }

    fn copy_of(&self, b: &Block) -> BlockCopy {
        BlockCopy {
            namespace: self
                .namespaces
                .get(b.ns as usize)
                .cloned()
                .unwrap_or_default(),
            key: b.key,
            offset: b.offset,
            bytes: b.bytes,
            checksum: b.checksum,
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// A client attached under `namespace`; returns its id.
    pub fn attach(&mut self, namespace: &str) -> ClientId {
        let ns = match self.namespaces.iter().position(|n| n == namespace) {
            Some(i) => i as u32,
            None => {
                self.namespaces.push(namespace.to_owned());
                self.weights.push(self.policy.weight(namespace));
                (self.namespaces.len() - 1) as u32
            }
        };
        let id = self.id();
        self.clients.insert(
            id,
            Client {
                ns,
                bytes: 0,
                leases: Vec::new(),
                reservations: Vec::new(),
            },
        );
        self.stats.clients = self.clients.len() as u64;
        id
    }

    /// The client is gone (clean close or crash): its reservations are dropped (never
    /// visible), its leases released. Its committed blocks stay: other engines may use them.
    pub fn detach(&mut self, client: ClientId) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        for r in c.reservations {
            if let Some(res) = self.reservations.remove(&r) {
                self.writing.remove(&(res.ns, res.key));
                self.free.entry(res.bytes).or_default().push(res.offset);
                self.stats.abandoned_puts += 1;
            }
        }
        for l in c.leases {
            if let Some(b) = self.blocks.get_mut(&l) {
                b.leases = b.leases.saturating_sub(1);
            }
        }
        self.stats.clients = self.clients.len() as u64;
    }

    /// Which of `keys` are stored (committed) in the client's namespace.
    pub fn contains(&self, client: ClientId, keys: &[u128]) -> Vec<bool> {
        let Some(ns) = self.clients.get(&client).map(|c| c.ns) else {
            return vec![false; keys.len()];
        };
        keys.iter()
            .map(|k| self.index.contains_key(&(ns, *k)))
            .collect()
    }

    /// Start writing `key` (`bytes` long): a slot reserved for the client, invisible until
    /// [`Books::commit_put`].
    pub fn begin_put(
        &mut self,
        client: ClientId,
        key: u128,
        bytes: u64,
    ) -> Result<SlotGrant, PutRefused> {
        let Some(ns) = self.clients.get(&client).map(|c| c.ns) else {
            return Err(PutRefused::Full);
        };
        if bytes == 0 {
            return Err(PutRefused::Full);
        }
        if self.index.contains_key(&(ns, key)) || self.writing.contains_key(&(ns, key)) {
            return Err(PutRefused::Present);
        }
        let Some(offset) = self.take_slot(ns, bytes) else {
            self.stats.puts_full += 1;
            return Err(PutRefused::Full);
        };
        let id = self.id();
        self.reservations.insert(
            id,
            Reservation {
                client,
                ns,
                key,
                offset,
                bytes,
            },
        );
        self.writing.insert((ns, key), id);
        if let Some(c) = self.clients.get_mut(&client) {
            c.reservations.push(id);
        }
        Ok(SlotGrant {
            id,
            offset,
            bytes,
            checksum: 0,
        })
    }

    /// The client finished writing reservation `id`, whose bytes hash to `checksum`: the block
    /// becomes visible. Returns false for an unknown reservation (or another client's).
    pub fn commit_put(&mut self, client: ClientId, id: u64, checksum: u64) -> bool {
        match self.reservations.get(&id) {
            Some(r) if r.client == client => {}
            _ => return false,
        }
        let Some(r) = self.reservations.remove(&id) else {
            return false;
        };
        self.writing.remove(&(r.ns, r.key));
        if let Some(c) = self.clients.get_mut(&client) {
            c.reservations.retain(|x| *x != id);
            c.bytes += r.bytes;
        }
        self.tick += 1;
        let block = Block {
            ns: r.ns,
            key: r.key,
            offset: r.offset,
            bytes: r.bytes,
            checksum,
            leases: 0,
            tick: self.tick,
        };
        self.lru.insert((self.tick, id), ());
        self.index.insert((r.ns, r.key), id);
        *self.ns_bytes.entry(r.ns).or_default() += r.bytes;
        self.blocks.insert(id, block);
        self.stats.puts += 1;
        self.stats.blocks = self.blocks.len() as u64;
        self.stats.bytes_used += r.bytes;
        true
    }

    /// The reservation `id` will not be committed (the writer failed): its slot is free again.
    pub fn abort_put(&mut self, client: ClientId, id: u64) {
        if let Some(r) = self.reservations.get(&id) {
            if r.client != client {
                return;
            }
        }
        if let Some(r) = self.reservations.remove(&id) {
            self.writing.remove(&(r.ns, r.key));
            self.free.entry(r.bytes).or_default().push(r.offset);
            if let Some(c) = self.clients.get_mut(&client) {
                c.reservations.retain(|x| *x != id);
            }
        }
    }

    /// Lease the block of `key` for reading: it cannot be evicted until [`Books::end_get`].
    pub fn begin_get(&mut self, client: ClientId, key: u128) -> Option<SlotGrant> {
        let ns = self.clients.get(&client)?.ns;
        self.stats.gets += 1;
        let Some(&id) = self.index.get(&(ns, key)) else {
            self.stats.get_misses += 1;
            return None;
        };
        self.tick += 1;
        let tick = self.tick;
        let b = self.blocks.get_mut(&id)?;
        self.lru.remove(&(b.tick, id));
        b.tick = tick;
        b.leases += 1;
        self.lru.insert((tick, id), ());
        let grant = SlotGrant {
            id,
            offset: b.offset,
            bytes: b.bytes,
            checksum: b.checksum,
        };
        if let Some(c) = self.clients.get_mut(&client) {
            c.leases.push(id);
        }
        Some(grant)
    }

    /// The client finished reading lease `id`.
    pub fn end_get(&mut self, client: ClientId, id: u64) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        let Some(pos) = c.leases.iter().position(|x| *x == id) else {
            return;
        };
        c.leases.swap_remove(pos);
        if let Some(b) = self.blocks.get_mut(&id) {
            b.leases = b.leases.saturating_sub(1);
        }
    }

    /// The block whose bytes were found damaged by a reader: removed (never served again).
    pub fn drop_block(&mut self, client: ClientId, id: u64) {
        self.end_get(client, id);
        if self.blocks.get(&id).is_some_and(|b| b.leases == 0) {
            self.remove_block(id);
        }
    }

    /// The counters now.
    pub fn stats(&self) -> NodeStats {
        self.stats
    }

    fn take_slot(&mut self, ns: u32, bytes: u64) -> Option<u64> {
        if let Some(off) = self.free.get_mut(&bytes).and_then(Vec::pop) {
            return Some(off);
        }
        if self.bump.checked_add(bytes)? <= self.capacity {
            let off = self.bump;
            self.bump += bytes;
            return Some(off);
        }
        let victim = self.victim(ns, bytes)?;
        let b = self.blocks.get(&victim)?;
        let off = b.offset;
        if self.keep_evicted {
            let c = self.copy_of(b);
            self.evicted.push(c);
        }
        self.remove_block(victim);
        self.stats.evictions += 1;
        // The victim's slot went to the free list; take it back for this put.
        if let Some(list) = self.free.get_mut(&bytes) {
            if let Some(pos) = list.iter().position(|o| *o == off) {
                list.swap_remove(pos);
            }
        }
        Some(off)
    }

    /// The least recently used unleased block of size `bytes`, from the namespace most above
    /// its fair share (the requesting namespace counts as attached even when it holds nothing).
    fn victim(&self, requester: u32, bytes: u64) -> Option<u64> {
        let mut active: Vec<u32> = self.clients.values().map(|c| c.ns).collect();
        active.push(requester);
        active.sort_unstable();
        active.dedup();
        let weight = |ns: u32| self.weights.get(ns as usize).copied().unwrap_or(1) as u128;
        let total: u128 = active.iter().map(|&n| weight(n)).sum::<u128>().max(1);
        let over = |ns: u32| -> i128 {
            let share = (self.capacity as u128 * weight(ns) / total) as i128;
            let used = self.ns_bytes.get(&ns).copied().unwrap_or(0) as i128;
            used - share
        };
        let candidates = self.lru.keys().filter_map(|(_, id)| {
            let b = self.blocks.get(id)?;
            (b.bytes == bytes && b.leases == 0).then_some((b.ns, *id))
        });
        // First candidate per namespace is that namespace's LRU block. The walk stops once every
        // namespace holding blocks has its first (eviction runs under the books' lock on every full
        // put); with a namespace holding none of this size it reads the whole LRU, as before.
        let holders: Vec<u32> = self
            .ns_bytes
            .iter()
            .filter(|(_, b)| **b > 0)
            .map(|(n, _)| *n)
            .collect();
        let mut firsts: Vec<(u32, u64)> = Vec::new();
        for (ns, id) in candidates {
            if !firsts.iter().any(|(n, _)| *n == ns) {
                firsts.push((ns, id));
                if holders.iter().all(|h| firsts.iter().any(|(n, _)| n == h)) {
                    break;
                }
            }
        }
        let (ns, id) = firsts.iter().copied().max_by_key(|(ns, _)| over(*ns))?;
        // A namespace at or below its share is only evicted for its own puts.
        if ns != requester && over(ns) <= 0 {
            return firsts
                .iter()
                .find(|(n, _)| *n == requester)
                .map(|(_, id)| *id);
        }
        Some(id)
    }

    fn remove_block(&mut self, id: u64) {
        let Some(b) = self.blocks.remove(&id) else {
            return;
        };
        self.lru.remove(&(b.tick, id));
        self.index.remove(&(b.ns, b.key));
        if let Some(n) = self.ns_bytes.get_mut(&b.ns) {
            *n = n.saturating_sub(b.bytes);
        }
        self.free.entry(b.bytes).or_default().push(b.offset);
        self.stats.blocks = self.blocks.len() as u64;
        self.stats.bytes_used = self.stats.bytes_used.saturating_sub(b.bytes);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn put(b: &mut Books, c: ClientId, key: u128, bytes: u64) -> Result<u64, PutRefused> {
        let g = b.begin_put(c, key, bytes)?;
        assert!(b.commit_put(c, g.id, key as u64));
        Ok(g.offset)
    }

    #[test]
    fn a_block_is_invisible_until_committed_and_an_abandoned_write_frees_its_slot() {
        let mut b = Books::new(4 * 100);
        let w = b.attach("m");
        let r = b.attach("m");
        let g = b.begin_put(w, 7, 100).unwrap();
        assert_eq!(b.contains(r, &[7]), vec![false]);
        assert!(b.begin_get(r, 7).is_none());
        assert_eq!(b.begin_put(r, 7, 100), Err(PutRefused::Present));
        b.detach(w); // the writer crashed mid-write
        assert_eq!(b.contains(r, &[7]), vec![false]);
        assert_eq!(b.stats().abandoned_puts, 1);
        // Its slot is reused, not leaked.
        assert_eq!(put(&mut b, r, 7, 100), Ok(g.offset));
        assert!(
            !b.commit_put(w, g.id, 0),
            "a detached client commits nothing"
        );
    }

    #[test]
    fn namespaces_never_see_each_other() {
        let mut b = Books::new(1000);
        let a = b.attach("model-a");
        let q = b.attach("model-b");
        put(&mut b, a, 1, 10).unwrap();
        assert_eq!(b.contains(q, &[1]), vec![false]);
        assert!(b.begin_get(q, 1).is_none());
        let a2 = b.attach("model-a");
        assert_eq!(b.contains(a2, &[1]), vec![true]);
    }

    #[test]
    fn leased_blocks_are_not_evicted_and_a_full_node_refuses() {
        let mut b = Books::new(2 * 10);
        let c = b.attach("m");
        put(&mut b, c, 1, 10).unwrap();
        put(&mut b, c, 2, 10).unwrap();
        let l1 = b.begin_get(c, 1).unwrap();
        let l2 = b.begin_get(c, 2).unwrap();
        assert_eq!(b.begin_put(c, 3, 10), Err(PutRefused::Full));
        b.end_get(c, l1.id);
        assert!(put(&mut b, c, 3, 10).is_ok(), "1 is unleased now");
        assert_eq!(b.contains(c, &[1, 2, 3]), vec![false, true, true]);
        b.detach(c); // leases end with the client
        let d = b.attach("m");
        assert!(put(&mut b, d, 4, 10).is_ok());
        let _ = l2;
    }

    #[test]
    fn one_engine_filling_the_node_cannot_push_another_below_its_share() {
        let mut b = Books::new(10 * 10);
        let a = b.attach("a");
        let q = b.attach("b");
        for k in 0..3 {
            put(&mut b, q, 1000 + k, 10).unwrap();
        }
        for k in 0..50 {
            put(&mut b, a, k, 10).unwrap();
        }
        // b holds 30 of its 50-byte share: all of its blocks survive a's flood.
        assert_eq!(b.contains(q, &[1000, 1001, 1002]), vec![true; 3]);
        assert!(b.stats().evictions > 0);
    }

    #[test]
    fn weighted_shares_protect_the_heavier_namespace() {
        // 10 slots; a weighs 3, b 1: a's share is 7.5 slots, b's 2.5.
        let p = SharePolicy::parse("weighted:a=3").unwrap();
        let mut b = Books::with_policy(10 * 10, p);
        let a = b.attach("a-0000000000000000");
        let q = b.attach("b-0000000000000000");
        for k in 0..7 {
            put(&mut b, a, k, 10).unwrap();
        }
        for k in 0..50 {
            put(&mut b, q, 1000 + k, 10).unwrap();
        }
        // b's flood never takes a's 7 slots (below its share), only its own.
        assert_eq!(b.contains(a, &[0, 1, 2, 3, 4, 5, 6]), vec![true; 7]);
        assert_eq!(
            b.stats().puts_full,
            0,
            "a full node evicts, it does not refuse"
        );
        // With equal weights a's 7 slots are above its share of 5: b's flood takes 2 of them.
        let mut e = Books::new(10 * 10);
        let a = e.attach("a-0000000000000000");
        let q = e.attach("b-0000000000000000");
        for k in 0..7 {
            put(&mut e, a, k, 10).unwrap();
        }
        for k in 0..50 {
            put(&mut e, q, 1000 + k, 10).unwrap();
        }
        let kept = e
            .contains(a, &[0, 1, 2, 3, 4, 5, 6])
            .iter()
            .filter(|x| **x)
            .count();
        assert_eq!(kept, 5, "equal shares: a keeps exactly its share");
    }

    #[derive(Clone, Debug)]
    enum Op {
        Attach(u8),
        Detach(u8),
        BeginPut(u8, u8, u8),
        Commit(u8),
        Abort(u8),
        Get(u8, u8),
        EndGet(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..2).prop_map(Op::Attach),
            (0u8..4).prop_map(Op::Detach),
            (0u8..4, 0u8..6, 1u8..3).prop_map(|(c, k, s)| Op::BeginPut(c, k, s)),
            (0u8..8).prop_map(Op::Commit),
            (0u8..8).prop_map(Op::Abort),
            (0u8..4, 0u8..6).prop_map(|(c, k)| Op::Get(c, k)),
            (0u8..8).prop_map(Op::EndGet),
        ]
    }

    proptest! {
        /// Slots never overlap among live blocks, reservations and leases; leased blocks stay;
        /// nothing exceeds the arena.
        #[test]
        fn slots_never_overlap_and_leases_pin(ops in proptest::collection::vec(op(), 1..200)) {
            let mut b = Books::new(64);
            let mut clients: Vec<ClientId> = Vec::new();
            let mut puts: Vec<(ClientId, u64)> = Vec::new();
            let mut leases: Vec<(ClientId, u64, u128)> = Vec::new();
            for o in ops {
                match o {
                    Op::Attach(ns) => clients.push(b.attach(if ns == 0 { "a" } else { "b" })),
                    Op::Detach(i) => if let Some(&c) = clients.get(i as usize) {
                        b.detach(c);
                        clients.retain(|x| *x != c);
                        leases.retain(|l| l.0 != c);
                    },
                    Op::BeginPut(i, k, s) => if let Some(&c) = clients.get(i as usize) {
                        if let Ok(g) = b.begin_put(c, k as u128, 8 * s as u64) { puts.push((c, g.id)); }
                    },
                    Op::Commit(i) => if !puts.is_empty() {
                        let (c, id) = puts.remove(i as usize % puts.len());
                        b.commit_put(c, id, 0);
                    },
                    Op::Abort(i) => if !puts.is_empty() {
                        let (c, id) = puts.remove(i as usize % puts.len());
                        b.abort_put(c, id);
                    },
                    Op::Get(i, k) => if let Some(&c) = clients.get(i as usize) {
                        if let Some(g) = b.begin_get(c, k as u128) { leases.push((c, g.id, k as u128)); }
                    },
                    Op::EndGet(i) => if !leases.is_empty() {
                        let (c, id, _) = leases.remove(i as usize % leases.len());
                        b.end_get(c, id);
                    },
                }
                // Leased blocks are still indexed.
                for (c, id, _) in &leases {
                    prop_assert!(b.blocks.contains_key(id), "leased block {id} of {c} evicted");
                }
                let mut ranges: Vec<(u64, u64)> = b.blocks.values().map(|x| (x.offset, x.bytes))
                    .chain(b.reservations.values().map(|r| (r.offset, r.bytes)))
                    .collect();
                ranges.sort_unstable();
                for w in ranges.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                if let Some(last) = ranges.last() {
                    prop_assert!(last.0 + last.1 <= 64);
                }
            }
        }
    }
}
