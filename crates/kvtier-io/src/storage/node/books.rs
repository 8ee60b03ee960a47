//! The node tier's books: which slot of the shared arena holds which block, who is writing or
//! reading which slot, and who gets evicted when the arena is full. Pure data structures: no I/O,
//! no clock (ticks are counted here), no unsafe.
//!
//! Definitions:
//! - a *client* is one attached engine process (one connection); it stores blocks under one
//!   *namespace*: the model identity it declared, qualified by its owner (the uid the node read
//!   from the connection's `SO_PEERCRED`), so tenants of different uids never share one;
//! - the arena is carved into slots by byte range ([`Extents`]): a range freed by blocks of
//!   one size is reused by blocks of any size;
//! - a *reservation* is a slot a client is writing (`begin_put` .. `commit_put`); a *lease* is a
//!   slot a client is reading (`begin_get` .. `end_get`);
//! - a *grant* is a reservation taken before its key is known (`grant`), so a client can copy
//!   a block into it and publish it in one round trip (`name_grant`, then `commit_put`); an
//!   unnamed grant is invisible, cannot be committed, and counts against the client's
//!   [`MAX_GRANTS`] and the node's [`GRANT_SHARE`] of the arena (idle clients' grants hold at
//!   most that much of the cache).
//!
//! Invariants (checked by the tests and the property test below):
//! - a block is visible (`contains`, `begin_get`) only after its writer committed it: a client
//!   that disconnects mid-write (`detach`) leaves nothing visible and its slot is free again;
//! - a leased or reserved slot is never evicted nor handed to anyone else; a client's leases,
//!   reservations and grants end when it detaches (a crashed engine leaks nothing);
//! - keys live in their namespace: a lookup in one namespace never sees another's blocks; a
//!   namespace with no client and no block is forgotten, and at most `max_namespaces` exist;
//! - a block reported damaged is invisible at once (leases held on it keep its slot, which is
//!   freed when the last one ends);
//! - eviction takes the least recently used unpinned block (of the needed size first), preferring the
//!   namespace that holds the most bytes above its fair share (capacity * its weight / the
//!   weights of the namespaces attached; [`SharePolicy`], equal weights by default), so one
//!   engine filling the node cannot push out another's blocks below its share;
//! - slots never overlap and never exceed the arena (`offset + class bytes <= capacity`).
use std::collections::BTreeMap;

// Fast, per-process seeded hashing: the keys are sequence hashes a client sends, and a tenant's
// books are its own (`tenants.rs`), so a client that chose colliding keys would slow its own uid.
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};

use super::alloc::Extents;
use super::share::SharePolicy;

/// One attached client (connection).
pub type ClientId = u64;

/// A namespace's number in the books (never reused while a block or client names it).
type NsId = u64;

/// Why a client could not attach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttachRefused {
    /// The node holds its maximum number of namespaces (in use: they have clients or blocks).
    #[error("the node holds its maximum of {0} namespaces")]
    TooManyNamespaces(usize),
}

/// Default cap on namespaces the books hold at once.
pub const MAX_NAMESPACES: usize = 1024;

/// Most unnamed grants one client holds at once.
pub const MAX_GRANTS: u32 = 1024;

/// Unnamed grants of all clients together hold at most `capacity / GRANT_SHARE` bytes.
pub const GRANT_SHARE: u64 = 8;

#[derive(Clone, Debug)]
struct Namespace {
    /// `<owner uid>/<declared name>`.
    name: String,
    weight: u32,
    clients: u32,
}

/// Why a put could not start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutRefused {
    /// The block is already stored (or being written) in this namespace: nothing to do.
    Present,
    /// No free, bumpable or evictable slot of this size: the put is skipped (a miss later).
    Full,
}

/// What naming a grant did ([`Books::name_grant`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    /// The grant now reserves its key: commit or abort it as any reservation.
    Reserved,
    /// The key is stored (or being written) in the client's namespace already: the grant is
    /// given back (its slot freed) and there is nothing to commit.
    Present,
    /// The client holds no unnamed grant of that id: nothing changed.
    Unknown,
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
    /// The checksum its writer committed (`None` in a put grant, and for a block committed
    /// without one on a private node).
    pub checksum: Option<u64>,
}

#[derive(Clone, Debug)]
struct Block {
    ns: NsId,
    key: u128,
    offset: u64,
    bytes: u64,
    checksum: Option<u64>,
    /// Readers holding the slot.
    leases: u32,
    tick: u64,
    /// Reported damaged: out of the index and the LRU, freed when the last lease ends.
    dead: bool,
}

#[derive(Clone, Debug)]
struct Reservation {
    client: ClientId,
    ns: NsId,
    /// `None` while an unnamed grant.
    key: Option<u128>,
    offset: u64,
    bytes: u64,
}

#[derive(Clone, Debug)]
struct Client {
    ns: NsId,
    bytes: u64,
    /// Lease ids (block ids) it holds, with how many times (a block may be leased twice).
    leases: HashMap<u64, u32>,
    reservations: HashSet<u64>,
    /// Of those, unnamed grants.
    grants: u32,
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
    /// The checksum its writer committed (`None`: committed unhashed on a private node).
    pub checksum: Option<u64>,
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
    /// Requests served after `Hello` (round trips; counted by the server).
    pub requests: u64,
    /// Commits whose slot the node hashed against the committed checksum (counted by the
    /// server).
    pub verified: u64,
    /// Arena bytes held by unnamed grants now (slots clients hold for their next stores).
    pub bytes_granted: u64,
}

/// The books of one node tier (see the module docs).
#[derive(Debug)]
pub struct Books {
    capacity: u64,
    space: Extents,
    namespaces: HashMap<NsId, Namespace>,
    ns_by_name: HashMap<String, NsId>,
    next_ns: NsId,
    max_namespaces: usize,
    policy: SharePolicy,
    /// (namespace, key) -> block id (committed, undamaged blocks only).
    index: HashMap<(NsId, u128), u64>,
    blocks: HashMap<u64, Block>,
    /// LRU order of committed blocks: (tick, block id).
    lru: BTreeMap<(u64, u64), ()>,
    reservations: HashMap<u64, Reservation>,
    /// Keys being written, so a second writer of the same key is told `Present`.
    writing: HashMap<(NsId, u128), u64>,
    /// Bytes of committed blocks per namespace.
    ns_bytes: HashMap<NsId, u64>,
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
            space: Extents::new(capacity),
            namespaces: HashMap::new(),
            ns_by_name: HashMap::new(),
            next_ns: 0,
            max_namespaces: MAX_NAMESPACES,
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

    /// At most `n` namespaces at once (default [`MAX_NAMESPACES`]).
    pub fn set_max_namespaces(&mut self, n: usize) {
        self.max_namespaces = n;
    }

    /// Namespaces held now (with a client or a block).
    pub fn namespace_count(&self) -> usize {
        self.namespaces.len()
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
        self.blocks
            .values()
            .filter(|b| !b.dead)
            .map(|b| self.copy_of(b))
            .collect()
    }

    /// The (owner-qualified) namespace `client` attached with.
    pub fn namespace_of(&self, client: ClientId) -> Option<&str> {
        let ns = self.clients.get(&client)?.ns;
        self.namespaces.get(&ns).map(|n| n.name.as_str())
    }

    fn copy_of(&self, b: &Block) -> BlockCopy {
        BlockCopy {
            namespace: self
                .namespaces
                .get(&b.ns)
                .map(|n| n.name.clone())
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

    /// A client of user `owner` attached under `namespace` (its namespace is `owner/namespace`:
    /// another user's clients never share it); returns its id.
    pub fn attach(&mut self, owner: u32, namespace: &str) -> Result<ClientId, AttachRefused> {
        let name = format!("{owner}/{namespace}");
        let ns = match self.ns_by_name.get(&name) {
            Some(&ns) => ns,
            None => {
                if self.namespaces.len() >= self.max_namespaces {
                    return Err(AttachRefused::TooManyNamespaces(self.max_namespaces));
                }
                let ns = self.next_ns;
                self.next_ns += 1;
                let weight = self.policy.weight(namespace);
                self.ns_by_name.insert(name.clone(), ns);
                self.namespaces.insert(
                    ns,
                    Namespace {
                        name,
                        weight,
                        clients: 0,
                    },
                );
                ns
            }
        };
        if let Some(n) = self.namespaces.get_mut(&ns) {
            n.clients += 1;
        }
        let id = self.id();
        self.clients.insert(
            id,
            Client {
                ns,
                bytes: 0,
                leases: HashMap::new(),
                reservations: HashSet::new(),
                grants: 0,
            },
        );
        self.stats.clients = self.clients.len() as u64;
        Ok(id)
    }

    /// Forget namespace `ns` if no client and no block names it.
    fn forget_if_unused(&mut self, ns: NsId) {
        let unused = self.namespaces.get(&ns).is_some_and(|n| n.clients == 0)
            // Damaged blocks still leased count here until freed.
            && self.ns_bytes.get(&ns).copied().unwrap_or(0) == 0;
        if unused {
            if let Some(n) = self.namespaces.remove(&ns) {
                self.ns_by_name.remove(&n.name);
            }
            self.ns_bytes.remove(&ns);
        }
    }

    /// One lease on block `id` ended: a damaged block whose last lease this was is freed.
    fn release_lease(&mut self, id: u64) {
        let Some(b) = self.blocks.get_mut(&id) else {
            return;
        };
        b.leases = b.leases.saturating_sub(1);
        if b.dead && b.leases == 0 {
            self.remove_block(id);
        }
    }

    /// The client is gone (clean close or crash): its reservations are dropped (never
    /// visible), its leases released. Its committed blocks stay: other engines may use them.
    pub fn detach(&mut self, client: ClientId) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        for r in c.reservations {
            if let Some(res) = self.reservations.remove(&r) {
                self.space.give(res.offset, res.bytes);
                match res.key {
                    Some(key) => {
                        self.writing.remove(&(res.ns, key));
                        self.stats.abandoned_puts += 1;
                    }
                    // The client's own count went with it.
                    None => self.ungrant(client, res.bytes),
                }
            }
        }
        for (l, n) in c.leases {
            for _ in 0..n {
                self.release_lease(l);
            }
        }
        if let Some(n) = self.namespaces.get_mut(&c.ns) {
            n.clients = n.clients.saturating_sub(1);
        }
        self.forget_if_unused(c.ns);
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
        let g = self.reserve(client, ns, Some(key), offset, bytes);
        self.writing.insert((ns, key), g.id);
        Ok(g)
    }

    /// A reservation of `offset`, `bytes` for `client`, of `key` (`None`: a grant).
    fn reserve(
        &mut self,
        client: ClientId,
        ns: NsId,
        key: Option<u128>,
        offset: u64,
        bytes: u64,
    ) -> SlotGrant {
        let id = self.id();
        let r = Reservation {
            client,
            ns,
            key,
            offset,
            bytes,
        };
        self.reservations.insert(id, r);
        if let Some(c) = self.clients.get_mut(&client) {
            c.reservations.insert(id);
        }
        SlotGrant {
            id,
            offset,
            bytes,
            checksum: None,
        }
    }

    /// The client finished writing reservation `id`, whose bytes hash to `checksum` (`None`:
    /// not hashed, a private node's trusted writer): the block becomes visible. Returns false
    /// for an unknown reservation (or another client's).
    pub fn commit_put(&mut self, client: ClientId, id: u64, checksum: Option<u64>) -> bool {
        let key = match self.reservations.get(&id) {
            Some(r) if r.client == client => match r.key {
                Some(key) => key,
                None => return false, // an unnamed grant: nothing to publish it under
            },
            _ => return false,
        };
        let Some(r) = self.reservations.remove(&id) else {
            return false;
        };
        self.writing.remove(&(r.ns, key));
        if let Some(c) = self.clients.get_mut(&client) {
            c.reservations.remove(&id);
            c.bytes += r.bytes;
        }
        self.tick += 1;
        let block = Block {
            ns: r.ns,
            key,
            offset: r.offset,
            bytes: r.bytes,
            checksum,
            leases: 0,
            tick: self.tick,
            dead: false,
        };
        self.lru.insert((self.tick, id), ());
        self.index.insert((r.ns, key), id);
        *self.ns_bytes.entry(r.ns).or_default() += r.bytes;
        self.blocks.insert(id, block);
        self.stats.puts += 1;
        self.stats.blocks = self.blocks.len() as u64;
        self.stats.bytes_used += r.bytes;
        true
    }

    /// `(key, offset, bytes)` of reservation `id` if `client` holds it (named: an unnamed
    /// grant has no key to commit under).
    pub fn reservation(&self, client: ClientId, id: u64) -> Option<(u128, u64, u64)> {
        let r = self.reservations.get(&id)?;
        (r.client == client).then_some((r.key?, r.offset, r.bytes))
    }

    /// The reservation `id` will not be committed (the writer failed): its slot is free again.
    /// `false`, and nothing changed, when `client` holds no reservation `id` (another
    /// client's, one ended already, or none ever).
    pub fn abort_put(&mut self, client: ClientId, id: u64) -> bool {
        if self
            .reservations
            .get(&id)
            .is_none_or(|r| r.client != client)
        {
            return false;
        }
        let Some(r) = self.reservations.remove(&id) else {
            return false;
        };
        self.space.give(r.offset, r.bytes);
        match r.key {
            Some(key) => {
                self.writing.remove(&(r.ns, key));
            }
            None => self.ungrant(client, r.bytes),
        }
        if let Some(c) = self.clients.get_mut(&client) {
            c.reservations.remove(&id);
        }
        true
    }

    /// One unnamed grant of `bytes` of `client` is one no more (named, aborted, or its client
    /// detached).
    fn ungrant(&mut self, client: ClientId, bytes: u64) {
        self.stats.bytes_granted -= bytes;
        if let Some(c) = self.clients.get_mut(&client) {
            c.grants = c.grants.saturating_sub(1);
        }
    }

    /// A slot of `bytes` for the client's next put, before its key is known (an unnamed
    /// grant: invisible, never evicted, freed by `abort_put` or when the client detaches).
    /// `Full` when the client holds [`MAX_GRANTS`] already, when granting it would take the
    /// node's grants beyond `capacity / GRANT_SHARE`, or when no slot can be freed.
    pub fn grant(&mut self, client: ClientId, bytes: u64) -> Result<SlotGrant, PutRefused> {
        let Some(c) = self.clients.get(&client) else {
            return Err(PutRefused::Full);
        };
        let ns = c.ns;
        let room = self.capacity / GRANT_SHARE;
        let over = self
            .stats
            .bytes_granted
            .checked_add(bytes)
            .is_none_or(|t| t > room);
        if bytes == 0 || c.grants >= MAX_GRANTS || over {
            return Err(PutRefused::Full);
        }
        let Some(offset) = self.take_slot(ns, bytes) else {
            return Err(PutRefused::Full);
        };
        let g = self.reserve(client, ns, None, offset, bytes);
        self.stats.bytes_granted += bytes;
        if let Some(c) = self.clients.get_mut(&client) {
            c.grants += 1;
        }
        Ok(g)
    }

    /// Name the client's unnamed grant `id` with `key`: it becomes a reservation of that key
    /// (commit it with [`Books::commit_put`]), unless the key is stored or being written in the
    /// client's namespace already, when the grant is given back.
    pub fn name_grant(&mut self, client: ClientId, id: u64, key: u128) -> Named {
        let (ns, bytes) = match self.reservations.get(&id) {
            Some(r) if r.client == client && r.key.is_none() => (r.ns, r.bytes),
            _ => return Named::Unknown,
        };
        if self.index.contains_key(&(ns, key)) || self.writing.contains_key(&(ns, key)) {
            self.abort_put(client, id);
            return Named::Present;
        }
        if let Some(r) = self.reservations.get_mut(&id) {
            r.key = Some(key);
        }
        self.writing.insert((ns, key), id);
        self.ungrant(client, bytes);
        Named::Reserved
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
            *c.leases.entry(id).or_default() += 1;
        }
        Some(grant)
    }

    /// The client finished reading lease `id`. Returns false when `client` holds no such lease
    /// (nothing changes).
    pub fn end_get(&mut self, client: ClientId, id: u64) -> bool {
        let Some(c) = self.clients.get_mut(&client) else {
            return false;
        };
        let Some(n) = c.leases.get_mut(&id) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            c.leases.remove(&id);
        }
        self.release_lease(id);
        true
    }

    /// The block of lease `id` was found damaged by its reader (a lease `client` holds): it is
    /// invisible at once (never served again); its slot is freed when the last lease on it
    /// ends. Returns false when `client` holds no such lease.
    pub fn drop_block(&mut self, client: ClientId, id: u64) -> bool {
        if !self
            .clients
            .get(&client)
            .is_some_and(|c| c.leases.contains_key(&id))
        {
            return false;
        }
        self.hide_block(id);
        self.end_get(client, id);
        true
    }

    /// Block `id` leaves the index and the LRU (invisible, never evicted); freed when unleased.
    fn hide_block(&mut self, id: u64) {
        let Some(b) = self.blocks.get_mut(&id) else {
            return;
        };
        if b.dead {
            return;
        }
        b.dead = true;
        let (ns, key, tick, leases) = (b.ns, b.key, b.tick, b.leases);
        self.lru.remove(&(tick, id));
        if self.index.get(&(ns, key)) == Some(&id) {
            self.index.remove(&(ns, key));
        }
        if leases == 0 {
            self.remove_block(id);
        }
    }

    /// The counters now.
    pub fn stats(&self) -> NodeStats {
        self.stats
    }

    /// A free range of `bytes`, evicting to make one: first a victim of the same size (its
    /// range fits), then victims of any size until their freed ranges merge into one that fits.
    fn take_slot(&mut self, ns: NsId, bytes: u64) -> Option<u64> {
        if bytes > self.capacity {
            return None;
        }
        loop {
            if let Some(off) = self.space.take(bytes) {
                return Some(off);
            }
            let victim = self
                .victim(ns, Some(bytes))
                .or_else(|| self.victim(ns, None))?;
            let b = self.blocks.get(&victim)?;
            if self.keep_evicted {
                let c = self.copy_of(b);
                self.evicted.push(c);
            }
            self.remove_block(victim);
            self.stats.evictions += 1;
        }
    }

    /// The least recently used unleased block (of size `bytes` when given), from the namespace
    /// most above its fair share (the requesting namespace counts as attached even when it
    /// holds nothing).
    fn victim(&self, requester: NsId, bytes: Option<u64>) -> Option<u64> {
        let mut active: Vec<NsId> = self.clients.values().map(|c| c.ns).collect();
        active.push(requester);
        active.sort_unstable();
        active.dedup();
        let weight = |ns: NsId| self.namespaces.get(&ns).map_or(1, |n| n.weight) as u128;
        let total: u128 = active.iter().map(|&n| weight(n)).sum::<u128>().max(1);
        let over = |ns: NsId| -> i128 {
            let share = (self.capacity as u128 * weight(ns) / total) as i128;
            let used = self.ns_bytes.get(&ns).copied().unwrap_or(0) as i128;
            used - share
        };
        let candidates = self.lru.keys().filter_map(|(_, id)| {
            let b = self.blocks.get(id)?;
            (bytes.is_none_or(|n| b.bytes == n) && b.leases == 0).then_some((b.ns, *id))
        });
        // First candidate per namespace is that namespace's LRU block. The walk stops once every
        // namespace holding blocks has its first (eviction runs under the books' lock on every full
        // put); with a namespace holding none of this size it reads the whole LRU, as before.
        let holders: Vec<NsId> = self
            .ns_bytes
            .iter()
            .filter(|(_, b)| **b > 0)
            .map(|(n, _)| *n)
            .collect();
        let mut firsts: Vec<(NsId, u64)> = Vec::new();
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
        if self.index.get(&(b.ns, b.key)) == Some(&id) {
            self.index.remove(&(b.ns, b.key));
        }
        if let Some(n) = self.ns_bytes.get_mut(&b.ns) {
            *n = n.saturating_sub(b.bytes);
        }
        self.space.give(b.offset, b.bytes);
        self.stats.blocks = self.blocks.len() as u64;
        self.stats.bytes_used = self.stats.bytes_used.saturating_sub(b.bytes);
        self.forget_if_unused(b.ns);
    }
}

#[cfg(any(test, feature = "testing"))]
#[path = "books_check.rs"]
mod check;

#[cfg(test)]
#[path = "books_tests.rs"]
mod tests;
