//! `BlockPool`: the books of one tier's blocks (ids, registry, pins, eviction order, events).
//!
//! Each block has one 40-byte [`Slot`] record (hash, pins, priority, state, list links); free
//! blocks form an intrusive stack through the same links. With the registry's 5 bytes per
//! bucket (a control byte and a block id, at most half the buckets in use) a pool costs about
//! 50 bytes per block (see `heap_bytes`, measured by `tests/pool_memory.rs`).
//!
//! Invariants:
//! - `state == Free`  <=> the block is on the free stack (exactly once) <=> pins 0 and not in
//!   the registry;
//! - `state == Writing` => pins > 0; it is in the registry exactly when `reserved` (a store in
//!   flight reserved its hash with `reserve`), and lookups never return it;
//! - `state == Registered` <=> the registry maps its hash to it; it is in the LRU lists exactly
//!   when its pin count is 0;
//! - `free_len + lru.len() + (blocks with pins) == capacity`.
//!
//! Not thread-safe by itself: the owner (the connector's leader) serialises access.
use crate::hash::SequenceHash;
use crate::ids::{BlockId, Tier};

use super::lru::PriorityLru;
use super::registry::Registry;
use super::slot::{Slot, NIL};
use super::types::{BlockState, PoolError, PoolEvent, Priority, Reservation};

/// The largest capacity a pool accepts (block ids are `u32`, and `u32::MAX` marks list ends).
pub const MAX_POOL_BLOCKS: usize = (u32::MAX - 1) as usize;

/// The block pool of one tier. See the module docs of [`crate::pool`] for the API contract.
#[derive(Debug)]
pub struct BlockPool {
    tier: Tier,
    slots: Vec<Slot>,
    /// Top of the free stack (the most recently freed block is reused first); `NIL` if empty.
    free_head: u32,
    free_len: usize,
    lru: PriorityLru,
    registry: Registry,
    /// Registry entries that are reservations (`Writing` blocks), not registered blocks.
    reserved: usize,
    events: Vec<PoolEvent>,
    record_events: bool,
}

impl BlockPool {
    /// A pool of `capacity_blocks` free blocks, ids `0..capacity_blocks`.
    pub fn new(tier: Tier, capacity_blocks: usize) -> Result<Self, PoolError> {
        if capacity_blocks > MAX_POOL_BLOCKS {
            return Err(PoolError::CapacityTooLarge {
                tier,
                requested: capacity_blocks,
                max: MAX_POOL_BLOCKS,
            });
        }
        let n = capacity_blocks;
        // The books are allocated fallibly and checked against free memory first: a huge
        // capacity is a typed error, never an abort or an OOM kill while initialising them.
        let oom = |available: &str| PoolError::OutOfMemory {
            tier,
            requested: n,
            bytes: Self::heap_bytes_for(n),
            available: available.to_owned(),
        };
        super::memory::check(tier, n, Self::heap_bytes_for(n))?;
        let mut slots: Vec<Slot> = Vec::new();
        slots
            .try_reserve_exact(n)
            .map_err(|_| oom("allocation refused"))?;
        let registry = Registry::try_new(n).map_err(|_| oom("allocation refused"))?;
        // Free stack 0 -> 1 -> 2 ...: a fresh pool hands out 0, 1, 2, ...
        slots.extend((0..n).map(|i| {
            let mut s = Slot::FREE;
            s.next = if i + 1 < n { i as u32 + 1 } else { NIL };
            s
        }));
        Ok(BlockPool {
            tier,
            slots,
            free_head: if n > 0 { 0 } else { NIL },
            free_len: n,
            lru: PriorityLru::default(),
            registry,
            reserved: 0,
            events: Vec::new(),
            record_events: true,
        })
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Heap bytes the books of a pool of `capacity_blocks` take (block records and registry).
    pub fn heap_bytes_for(capacity_blocks: usize) -> usize {
        capacity_blocks
            .saturating_mul(std::mem::size_of::<Slot>())
            .saturating_add(Registry::bytes_for(capacity_blocks))
    }

    /// Total number of blocks.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Blocks `allocate` can hand out now: free plus evictable (registered, unpinned).
    pub fn num_free(&self) -> usize {
        self.free_len + self.lru.len()
    }

    /// Registered blocks with no pins.
    pub fn num_evictable(&self) -> usize {
        self.lru.len()
    }

    /// Blocks published in the registry (pinned or not).
    pub fn num_registered(&self) -> usize {
        self.registry.len() - self.reserved
    }

    /// Blocks allocated by `reserve` whose hash is reserved and not yet confirmed.
    pub fn num_reserved(&self) -> usize {
        self.reserved
    }

    /// Blocks with at least one pin.
    pub fn num_pinned(&self) -> usize {
        self.capacity() - self.num_free()
    }

    /// Heap bytes held by this pool's books (not counting queued events).
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.lru.heap_bytes()
            + self.registry.heap_bytes()
    }

    fn index(&self, block: BlockId) -> Result<usize, PoolError> {
        let b = block.0 as usize;
        if b < self.slots.len() {
            Ok(b)
        } else {
            Err(PoolError::UnknownBlock {
                tier: self.tier,
                block,
                capacity: self.slots.len(),
            })
        }
    }

    /// The block `hash` names in the registry: registered, or reserved (`Writing`).
    #[inline]
    fn find(&self, hash: SequenceHash) -> Option<u32> {
        let slots = &self.slots;
        self.registry.find(hash, |b| slots[b as usize].hash())
    }

    #[inline]
    fn find_registered(&self, hash: SequenceHash) -> Option<u32> {
        self.find(hash)
            .filter(|&b| self.slots[b as usize].state == BlockState::Registered)
    }

    /// The registered block holding `hash` (a reservation is not a registration).
    pub fn lookup(&self, hash: SequenceHash) -> Option<BlockId> {
        self.find_registered(hash).map(BlockId)
    }

    /// The block whose write reserved `hash` (see `reserve`), if that write is not yet confirmed.
    pub fn reserved_block(&self, hash: SequenceHash) -> Option<BlockId> {
        self.find(hash)
            .filter(|&b| self.slots[b as usize].reserved)
            .map(BlockId)
    }

    /// The hash `block` is registered under (None unless it is `Registered`).
    pub fn hash_of(&self, block: BlockId) -> Option<SequenceHash> {
        match self.slots.get(block.0 as usize) {
            Some(s) if s.state == BlockState::Registered => Some(s.hash()),
            _ => None,
        }
    }

    /// The state of `block` (None if out of range).
    pub fn state(&self, block: BlockId) -> Option<BlockState> {
        self.slots.get(block.0 as usize).map(|s| s.state)
    }

    /// The pin count of `block` (None if out of range).
    pub fn pin_count(&self, block: BlockId) -> Option<u32> {
        self.slots.get(block.0 as usize).map(|s| s.pins)
    }

    /// The priority `block` is registered with (None unless it is `Registered`).
    pub fn priority_of(&self, block: BlockId) -> Option<Priority> {
        match self.slots.get(block.0 as usize) {
            Some(s) if s.state == BlockState::Registered => Some(s.priority),
            _ => None,
        }
    }

    /// Call `f` with the block of each hash of the longest registered prefix of `hashes`, in
    /// order; returns the prefix length.
    #[inline]
    fn for_each_prefix_block(&self, hashes: &[SequenceHash], mut f: impl FnMut(u32)) -> usize {
        let mut n = 0;
        for h in hashes {
            match self.find_registered(*h) {
                Some(b) => {
                    f(b);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Length of the longest prefix of `hashes` whose every block is registered. No side effects.
    pub fn peek_prefix(&self, hashes: &[SequenceHash]) -> usize {
        self.for_each_prefix_block(hashes, |_| {})
    }

    /// Pin the blocks of the longest registered prefix of `hashes` and return them in order.
    /// The caller owns one pin on each and must `release` it.
    #[must_use = "each returned block carries a pin the caller must release"]
    pub fn match_prefix(&mut self, hashes: &[SequenceHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        self.for_each_prefix_block(hashes, |b| out.push(BlockId(b)));
        for b in &out {
            self.pin_index(b.0 as usize);
        }
        out
    }

    /// Every evictable block, next victim first. No side effects.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        self.lru
            .eviction_order(&self.slots)
            .into_iter()
            .map(BlockId)
            .collect()
    }

    fn pop_free(&mut self) -> Option<u32> {
        let b = self.free_head;
        if b == NIL {
            return None;
        }
        self.free_head = self.slots[b as usize].next;
        self.slots[b as usize].next = NIL;
        self.free_len -= 1;
        Some(b)
    }

    fn push_free(&mut self, i: usize) {
        let s = &mut self.slots[i];
        s.state = BlockState::Free;
        s.prev = NIL;
        s.next = self.free_head;
        self.free_head = i as u32;
        self.free_len += 1;
    }

    /// Hand out `n` pinned blocks in state `Writing`, or none at all.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        let available = self.num_free();
        if n > available {
            return Err(PoolError::Exhausted {
                tier: self.tier,
                requested: n,
                available,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(b) = self.take_block() else {
                // Unreachable: `n <= free + evictable` was checked above.
                debug_assert!(false, "pool accounting broken");
                break;
            };
            out.push(BlockId(b));
        }
        Ok(out)
    }

    /// One block for a writer: the top of the free stack, else the next victim (unpublished,
    /// `Removed` emitted). It comes back `Writing` with one pin and no reservation.
    #[inline]
    fn take_block(&mut self) -> Option<u32> {
        let b = match self.pop_free() {
            Some(b) => b,
            None => {
                let victim = self.lru.pop_victim(&mut self.slots)?;
                self.unpublish(victim as usize);
                victim
            }
        };
        let s = &mut self.slots[b as usize];
        s.state = BlockState::Writing;
        s.pins = 1;
        s.reserved = false;
        Some(b)
    }

    /// The store path in one registry probe per hash; see [`BlockPool::reserve`].
    pub fn reserve_one(&mut self, hash: SequenceHash) -> Reservation {
        if let Some(b) = self.find(hash) {
            return if self.slots[b as usize].state == BlockState::Registered {
                Reservation::Registered(BlockId(b))
            } else {
                Reservation::Writing(BlockId(b))
            };
        }
        let Some(b) = self.take_block() else {
            return Reservation::NoSpace;
        };
        let s = &mut self.slots[b as usize];
        s.set_hash(hash);
        s.reserved = true;
        // Inserted only after `take_block`: an eviction may reshape the probe run of `hash`.
        let slots = &self.slots;
        self.registry.insert(b, hash, |x| slots[x as usize].hash());
        self.reserved += 1;
        Reservation::Allocated(BlockId(b))
    }

    /// Reserve blocks for storing `hashes`; appends one [`Reservation`] per hash to `out`, in
    /// order. Exactly the same as calling [`BlockPool::reserve_one`] on each hash in turn:
    /// a hash the pool holds or is writing is left alone, any other gets a block (free first,
    /// then evicting, `Removed` emitted), pinned once and `Writing`, whose hash goes into the
    /// registry at once, hidden from lookups and matching until [`BlockPool::confirm`]. A later
    /// copy of a hash in the same batch sees the earlier one's reservation (`Writing`).
    pub fn reserve(&mut self, hashes: &[SequenceHash], out: &mut Vec<Reservation>) {
        out.reserve(hashes.len());
        for h in hashes {
            out.push(self.reserve_one(*h));
        }
    }

    /// [`BlockPool::confirm`], then drop the writer's pin (`release`) in the same pass: the
    /// store path's last two steps for a block nobody reads right away.
    pub fn confirm_and_release(
        &mut self,
        block: BlockId,
        priority: Priority,
    ) -> Result<SequenceHash, PoolError> {
        let hash = self.confirm(block, priority)?;
        self.unpin_index(block.0 as usize); // confirm checked the index; Writing blocks have a pin
        Ok(hash)
    }

    /// Publish the reserved block `block` under the hash it reserved, with `priority`: no
    /// registry probe (the entry exists); emits `Stored` and returns the hash. The caller keeps
    /// its pin.
    pub fn confirm(
        &mut self,
        block: BlockId,
        priority: Priority,
    ) -> Result<SequenceHash, PoolError> {
        let i = self.index(block)?;
        let s = &mut self.slots[i];
        if !s.reserved {
            return Err(PoolError::NotReserved {
                tier: self.tier,
                block,
            });
        }
        debug_assert_eq!(s.state, BlockState::Writing);
        s.reserved = false;
        s.state = BlockState::Registered;
        s.priority = priority;
        let hash = s.hash();
        self.reserved -= 1;
        self.emit(PoolEvent::Stored {
            hash,
            tier: self.tier,
        });
        Ok(hash)
    }

    /// Remove block `i` (registered) from the registry and emit `Removed`. Leaves its state to
    /// the caller.
    fn unpublish(&mut self, i: usize) {
        let hash = self.slots[i].hash();
        let removed = self.registry.remove_block(hash, i as u32);
        debug_assert!(removed);
        self.emit(PoolEvent::Removed {
            hash,
            tier: self.tier,
        });
    }

    /// Publish the written block `block` under `hash`. Returns the block that now holds `hash`
    /// and carries the caller's pin: `block` itself, or the block already registered under
    /// `hash` (then `block` loses the caller's pin; see the module docs).
    pub fn register(
        &mut self,
        block: BlockId,
        hash: SequenceHash,
        priority: Priority,
    ) -> Result<BlockId, PoolError> {
        let i = self.index(block)?;
        match self.slots[i].state {
            BlockState::Free => {
                return Err(PoolError::NotWritable {
                    tier: self.tier,
                    block,
                })
            }
            BlockState::Registered => {
                let existing = self.slots[i].hash();
                if existing == hash {
                    return Ok(block);
                }
                return Err(PoolError::AlreadyRegistered {
                    tier: self.tier,
                    block,
                    existing: existing.0,
                    requested: hash.0,
                });
            }
            BlockState::Writing if self.slots[i].reserved => {
                if self.slots[i].hash() == hash {
                    self.confirm(block, priority)?;
                    return Ok(block);
                }
                return Err(PoolError::Reserved {
                    tier: self.tier,
                    block,
                    hash: self.slots[i].hash().0,
                });
            }
            BlockState::Writing => {}
        }
        if let Some(existing) = self.find(hash) {
            let e = existing as usize;
            if self.slots[e].reserved {
                return Err(PoolError::Reserved {
                    tier: self.tier,
                    block: BlockId(existing),
                    hash: hash.0,
                });
            }
            // Pinning first takes it off the LRU lists, so its priority may change.
            self.pin_index(e);
            if priority > self.slots[e].priority {
                self.slots[e].priority = priority;
            }
            self.unpin_index(i);
            return Ok(BlockId(existing));
        }
        let s = &mut self.slots[i];
        s.set_hash(hash);
        s.priority = priority;
        s.state = BlockState::Registered;
        let slots = &self.slots;
        self.registry
            .insert(i as u32, hash, |x| slots[x as usize].hash());
        self.emit(PoolEvent::Stored {
            hash,
            tier: self.tier,
        });
        Ok(block)
    }

    /// Register blocks that already hold data when the pool starts (a disk tier's blocks kept
    /// from an earlier run): each `(hash, block)` whose block is free and whose hash is not yet
    /// in the registry becomes `Registered` with `priority`, unpinned (evictable, oldest first in
    /// list order); others are skipped. Emits `Stored` for each. Returns how many were adopted.
    /// One pass over the pool to rebuild the free stack (meant for start-up).
    pub fn adopt(&mut self, blocks: &[(SequenceHash, BlockId)], priority: Priority) -> usize {
        let mut n = 0;
        for &(hash, block) in blocks {
            let i = block.0 as usize;
            if i >= self.slots.len()
                || self.slots[i].state != BlockState::Free
                || self.find(hash).is_some()
            {
                continue;
            }
            // Off the free stack below; `Writing` with the caller's pin, as `register` expects.
            self.slots[i].state = BlockState::Writing;
            self.slots[i].pins = 1;
            if self.register(block, hash, priority).is_ok() {
                n += 1;
            }
            self.unpin_index(i);
        }
        if n > 0 {
            // Rebuild the free stack from the blocks still free, lowest id on top.
            self.free_head = NIL;
            self.free_len = 0;
            for i in (0..self.slots.len()).rev() {
                if self.slots[i].state == BlockState::Free {
                    self.push_free(i);
                }
            }
        }
        n
    }

    /// Add a pin to a `Writing` or `Registered` block.
    pub fn pin(&mut self, block: BlockId) -> Result<(), PoolError> {
        let i = self.index(block)?;
        if self.slots[i].state == BlockState::Free {
            return Err(PoolError::BlockFree {
                tier: self.tier,
                block,
            });
        }
        self.pin_index(i);
        Ok(())
    }

    /// Drop one pin. At zero pins a registered block becomes the most recently used evictable
    /// block of its priority; an unregistered one becomes free.
    pub fn release(&mut self, block: BlockId) -> Result<(), PoolError> {
        let i = self.index(block)?;
        if self.slots[i].pins == 0 {
            return Err(PoolError::NotPinned {
                tier: self.tier,
                block,
            });
        }
        self.unpin_index(i);
        Ok(())
    }

    /// Unpublish `block` (e.g. its bytes were found corrupt or a write failed after
    /// registration): it leaves the registry at once (`Removed` is emitted); it becomes free
    /// now if unpinned, otherwise when its last pin is released. A free or `Writing` block
    /// (reserved or not) is left as it is.
    pub fn invalidate(&mut self, block: BlockId) -> Result<(), PoolError> {
        let i = self.index(block)?;
        if self.slots[i].state != BlockState::Registered {
            return Ok(());
        }
        if self.slots[i].pins == 0 {
            self.lru.remove(&mut self.slots, i as u32);
            self.unpublish(i);
            self.push_free(i);
        } else {
            self.unpublish(i);
            self.slots[i].state = BlockState::Writing;
        }
        Ok(())
    }

    /// Events since the last call, oldest first. Events queue up until taken: an owner that
    /// never takes them should turn recording off.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        // The next buffer starts at this one's size: a steady stream reallocates nothing.
        let size = self.events.len();
        std::mem::replace(&mut self.events, Vec::with_capacity(size))
    }

    /// Events queued and not yet taken.
    pub fn num_events(&self) -> usize {
        self.events.len()
    }

    /// Like `take_events`, but keeps the buffer for the next events (no allocation per call).
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, PoolEvent> {
        self.events.drain(..)
    }

    /// Record `Stored`/`Removed` events (on by default). Turning it off drops queued events.
    pub fn set_record_events(&mut self, on: bool) {
        self.record_events = on;
        if !on {
            self.events = Vec::new();
        }
    }

    fn emit(&mut self, event: PoolEvent) {
        if self.record_events {
            self.events.push(event);
        }
    }

    #[inline]
    fn pin_index(&mut self, i: usize) {
        let s = self.slots[i];
        if s.pins == 0 && s.state == BlockState::Registered {
            self.lru.remove(&mut self.slots, i as u32);
        }
        self.slots[i].pins = s.pins.saturating_add(1);
    }

    #[inline]
    fn unpin_index(&mut self, i: usize) {
        let s = &mut self.slots[i];
        debug_assert!(s.pins > 0);
        s.pins = s.pins.saturating_sub(1);
        if s.pins > 0 {
            return;
        }
        match s.state {
            BlockState::Registered => self.lru.push_back(&mut self.slots, i as u32),
            BlockState::Writing => {
                if s.reserved {
                    // A write that never confirmed: drop its reservation.
                    s.reserved = false;
                    let hash = s.hash();
                    let removed = self.registry.remove_block(hash, i as u32);
                    debug_assert!(removed);
                    self.reserved -= 1;
                }
                self.push_free(i)
            }
            BlockState::Free => debug_assert!(false, "free block had pins"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn h(i: u128) -> SequenceHash {
        SequenceHash(0xA5A5_0000_0000_0000_0000_0000_0000_0000 | i)
    }

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().copied().map(BlockId).collect()
    }

    /// Allocate one block per hash, register it, release it. Returns the block ids.
    fn fill(p: &mut BlockPool, hashes: &[SequenceHash], prio: Priority) -> Vec<BlockId> {
        let blocks = p.allocate(hashes.len()).unwrap();
        let mut out = Vec::new();
        for (b, hh) in blocks.iter().zip(hashes) {
            let got = p.register(*b, *hh, prio).unwrap();
            p.release(got).unwrap();
            out.push(got);
        }
        out
    }

    #[test]
    fn fresh_pool_hands_out_ids_in_order_all_or_nothing() {
        let mut p = BlockPool::new(Tier::Host, 4).unwrap();
        assert_eq!(p.capacity(), 4);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.allocate(3).unwrap(), ids(&[0, 1, 2]));
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.num_pinned(), 3);
        let err = p.allocate(2).unwrap_err();
        assert_eq!(
            err,
            PoolError::Exhausted {
                tier: Tier::Host,
                requested: 2,
                available: 1
            }
        );
        assert_eq!(p.num_free(), 1, "a failed allocate changes nothing");
        for b in 0..3 {
            assert_eq!(p.state(BlockId(b)), Some(BlockState::Writing));
            assert_eq!(p.pin_count(BlockId(b)), Some(1));
        }
    }

    /// Regression (#13, aborts): a pool of the largest accepted capacity (and
    /// `Leader({"host.num_blocks": 5e8})` on a small machine) aborted the process on a failed
    /// allocation of its books; it is a typed error before anything is touched.
    #[test]
    fn pool_larger_than_memory_is_a_typed_error_not_an_abort() {
        let err = BlockPool::new(Tier::Host, MAX_POOL_BLOCKS).unwrap_err();
        match err {
            PoolError::OutOfMemory {
                tier: Tier::Host,
                requested,
                bytes,
                ..
            } => {
                assert_eq!(requested, MAX_POOL_BLOCKS);
                assert!(bytes > 40 * MAX_POOL_BLOCKS, "{bytes}");
            }
            other => panic!("{other:?}"),
        }
        assert!(err_text(Tier::Host, MAX_POOL_BLOCKS).contains("lower the tier's num_blocks"));
    }

    fn err_text(tier: Tier, n: usize) -> String {
        BlockPool::new(tier, n).unwrap_err().to_string()
    }

    #[test]
    fn heap_bytes_for_matches_a_real_pool() {
        let p = BlockPool::new(Tier::Host, 1000).unwrap();
        let est = BlockPool::heap_bytes_for(1000);
        let real = p.heap_bytes();
        assert!(
            est >= real * 9 / 10 && est <= real * 11 / 10,
            "{est} vs {real}"
        );
    }

    #[test]
    fn capacity_limit_is_an_error() {
        let err = BlockPool::new(Tier::Disk, MAX_POOL_BLOCKS + 1).unwrap_err();
        assert!(matches!(
            err,
            PoolError::CapacityTooLarge {
                tier: Tier::Disk,
                ..
            }
        ));
    }

    #[test]
    fn register_publishes_and_emits_stored() {
        let mut p = BlockPool::new(Tier::Host, 4).unwrap();
        let b = p.allocate(1).unwrap()[0];
        assert_eq!(p.lookup(h(1)), None);
        assert_eq!(p.register(b, h(1), Priority(3)).unwrap(), b);
        assert_eq!(p.lookup(h(1)), Some(b));
        assert_eq!(p.hash_of(b), Some(h(1)));
        assert_eq!(p.priority_of(b), Some(Priority(3)));
        assert_eq!(p.num_registered(), 1);
        assert_eq!(
            p.take_events(),
            vec![PoolEvent::Stored {
                hash: h(1),
                tier: Tier::Host
            }]
        );
        assert!(p.take_events().is_empty());
        // Still pinned by the writer: not evictable.
        assert_eq!(p.num_evictable(), 0);
        p.release(b).unwrap();
        assert_eq!(p.num_evictable(), 1);
        assert_eq!(p.num_free(), 4);
        // Registering again under the same hash is idempotent; another hash is an error.
        p.pin(b).unwrap();
        assert_eq!(p.register(b, h(1), Priority(0)).unwrap(), b);
        assert!(matches!(
            p.register(b, h(2), Priority(0)),
            Err(PoolError::AlreadyRegistered { .. })
        ));
    }

    #[test]
    fn duplicate_hash_moves_the_pin_and_frees_the_new_block() {
        let mut p = BlockPool::new(Tier::Host, 4).unwrap();
        let first = fill(&mut p, &[h(7)], Priority(1))[0];
        p.take_events();
        let dup = p.allocate(1).unwrap()[0];
        assert_ne!(dup, first);
        let got = p.register(dup, h(7), Priority(5)).unwrap();
        assert_eq!(got, first);
        assert_eq!(p.pin_count(first), Some(1));
        assert_eq!(p.state(dup), Some(BlockState::Free));
        assert_eq!(p.pin_count(dup), Some(0));
        assert_eq!(
            p.priority_of(first),
            Some(Priority(5)),
            "higher priority wins"
        );
        assert_eq!(p.num_registered(), 1);
        assert!(p.take_events().is_empty(), "no Stored for a duplicate");
        p.release(first).unwrap();
        assert_eq!(p.num_free(), 4);
    }

    #[test]
    fn free_blocks_go_before_registered_ones_then_priority_then_lru() {
        let mut p = BlockPool::new(Tier::Host, 5).unwrap();
        // Blocks 0..4 registered: 0 (prio 2), 1 (prio 1), 2 (prio 2), 3 (prio 1); 4 stays free.
        let blocks = p.allocate(4).unwrap();
        let prios = [2, 1, 2, 1];
        for (i, b) in blocks.iter().enumerate() {
            p.register(*b, h(i as u128), Priority(prios[i])).unwrap();
        }
        // Release in the order 3, 0, 1, 2: last use order.
        for b in [3, 0, 1, 2] {
            p.release(BlockId(b)).unwrap();
        }
        p.take_events();
        assert_eq!(p.eviction_order(), ids(&[3, 1, 0, 2]));
        // First allocation takes the never-registered free block 4.
        assert_eq!(p.allocate(1).unwrap(), ids(&[4]));
        assert!(p.take_events().is_empty());
        // Then (priority, last use): 3, 1, 0.
        assert_eq!(p.allocate(3).unwrap(), ids(&[3, 1, 0]));
        assert_eq!(
            p.take_events(),
            vec![
                PoolEvent::Removed {
                    hash: h(3),
                    tier: Tier::Host
                },
                PoolEvent::Removed {
                    hash: h(1),
                    tier: Tier::Host
                },
                PoolEvent::Removed {
                    hash: h(0),
                    tier: Tier::Host
                },
            ]
        );
        assert_eq!(p.lookup(h(3)), None);
        assert_eq!(p.lookup(h(2)), Some(BlockId(2)));
        assert_eq!(p.num_registered(), 1);
        assert_eq!(p.num_free(), 1);
    }

    /// A warm restart's blocks: adopted into a fresh pool, registered and evictable; free
    /// blocks keep coming lowest first; taken blocks and known hashes are skipped.
    #[test]
    fn adopt_registers_kept_blocks() {
        let mut p = BlockPool::new(Tier::Disk, 6).unwrap();
        let n = p.adopt(
            &[
                (h(1), BlockId(4)),
                (h(2), BlockId(1)),
                (h(1), BlockId(2)),
                (h(3), BlockId(4)),
                (h(4), BlockId(6)),
            ],
            Priority(0),
        );
        assert_eq!(n, 2);
        assert_eq!(p.lookup(h(1)), Some(BlockId(4)));
        assert_eq!(p.lookup(h(2)), Some(BlockId(1)));
        assert_eq!(
            (p.num_registered(), p.num_evictable(), p.num_pinned()),
            (2, 2, 0)
        );
        assert_eq!(p.num_free(), 6);
        assert_eq!(p.eviction_order(), ids(&[4, 1]));
        assert_eq!(
            p.take_events(),
            vec![
                PoolEvent::Stored {
                    hash: h(1),
                    tier: Tier::Disk
                },
                PoolEvent::Stored {
                    hash: h(2),
                    tier: Tier::Disk
                },
            ]
        );
        assert_eq!(p.allocate(4).unwrap(), ids(&[0, 2, 3, 5]));
        // Then the adopted blocks are evicted, oldest first.
        assert_eq!(p.allocate(1).unwrap(), ids(&[4]));
        assert_eq!(p.lookup(h(1)), None);
    }

    #[test]
    fn match_prefix_pins_and_touches() {
        let mut p = BlockPool::new(Tier::Disk, 4).unwrap();
        let blocks = fill(&mut p, &[h(0), h(1), h(2), h(3)], Priority(0));
        assert_eq!(p.peek_prefix(&[h(0), h(1), h(9), h(3)]), 2);
        assert_eq!(p.peek_prefix(&[h(9), h(0)]), 0);
        assert_eq!(p.peek_prefix(&[]), 0);
        let m = p.match_prefix(&[h(0), h(1), h(9), h(3)]);
        assert_eq!(m, blocks[..2].to_vec());
        assert_eq!(p.pin_count(blocks[0]), Some(1));
        assert_eq!(p.pin_count(blocks[3]), Some(0));
        // Pinned blocks cannot be evicted: only 2 are available.
        assert_eq!(p.num_free(), 2);
        assert!(p.allocate(3).is_err());
        // Released matched blocks become the most recently used.
        for b in &m {
            p.release(*b).unwrap();
        }
        assert_eq!(p.eviction_order(), ids(&[2, 3, 0, 1]));
    }

    #[test]
    fn pins_are_counted() {
        let mut p = BlockPool::new(Tier::Host, 2).unwrap();
        let b = fill(&mut p, &[h(1)], Priority(0))[0];
        p.pin(b).unwrap();
        p.pin(b).unwrap();
        p.release(b).unwrap();
        assert_eq!(
            p.allocate(2).unwrap_err(),
            PoolError::Exhausted {
                tier: Tier::Host,
                requested: 2,
                available: 1
            }
        );
        p.release(b).unwrap();
        assert_eq!(
            p.release(b),
            Err(PoolError::NotPinned {
                tier: Tier::Host,
                block: b
            })
        );
        assert_eq!(p.allocate(2).unwrap().len(), 2);
    }

    #[test]
    fn errors_name_the_block() {
        let mut p = BlockPool::new(Tier::Host, 2).unwrap();
        assert_eq!(
            p.pin(BlockId(5)),
            Err(PoolError::UnknownBlock {
                tier: Tier::Host,
                block: BlockId(5),
                capacity: 2
            })
        );
        assert_eq!(
            p.pin(BlockId(1)),
            Err(PoolError::BlockFree {
                tier: Tier::Host,
                block: BlockId(1)
            })
        );
        assert_eq!(
            p.register(BlockId(1), h(1), Priority(0)),
            Err(PoolError::NotWritable {
                tier: Tier::Host,
                block: BlockId(1)
            })
        );
        assert_eq!(p.hash_of(BlockId(9)), None);
        let msg = PoolError::NotPinned {
            tier: Tier::Disk,
            block: BlockId(3),
        }
        .to_string();
        assert!(msg.contains("Disk") && msg.contains("BlockId(3)"), "{msg}");
    }

    #[test]
    fn unregistered_release_frees() {
        let mut p = BlockPool::new(Tier::Host, 2).unwrap();
        let b = p.allocate(1).unwrap()[0];
        p.release(b).unwrap();
        assert_eq!(p.state(b), Some(BlockState::Free));
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.num_registered(), 0);
    }

    #[test]
    fn invalidate_unpublishes() {
        let mut p = BlockPool::new(Tier::Disk, 3).unwrap();
        let blocks = fill(&mut p, &[h(1), h(2)], Priority(0));
        p.take_events();
        p.invalidate(blocks[0]).unwrap();
        assert_eq!(p.lookup(h(1)), None);
        assert_eq!(p.state(blocks[0]), Some(BlockState::Free));
        assert_eq!(
            p.take_events(),
            vec![PoolEvent::Removed {
                hash: h(1),
                tier: Tier::Disk
            }]
        );
        // Pinned: stays out of the free list until released.
        p.pin(blocks[1]).unwrap();
        p.invalidate(blocks[1]).unwrap();
        assert_eq!(p.lookup(h(2)), None);
        assert_eq!(p.state(blocks[1]), Some(BlockState::Writing));
        assert_eq!(p.num_free(), 2);
        p.release(blocks[1]).unwrap();
        assert_eq!(p.state(blocks[1]), Some(BlockState::Free));
        assert_eq!(p.num_free(), 3);
        assert_eq!(p.num_registered(), 0);
    }

    #[test]
    fn events_can_be_turned_off() {
        let mut p = BlockPool::new(Tier::Host, 2).unwrap();
        p.set_record_events(false);
        fill(&mut p, &[h(1), h(2)], Priority(0));
        p.allocate(1).unwrap();
        assert!(p.take_events().is_empty());
        p.set_record_events(true);
        p.allocate(1).unwrap();
        assert_eq!(p.take_events().len(), 1);
    }

    #[test]
    fn reserve_dedups_hides_and_confirm_publishes() {
        let mut p = BlockPool::new(Tier::Host, 3).unwrap();
        let old = fill(&mut p, &[h(1)], Priority(0))[0];
        p.take_events();
        let mut r = Vec::new();
        p.reserve(&[h(1), h(2), h(2), h(3), h(4)], &mut r);
        let (b2, b3) = match (r[1], r[3]) {
            (Reservation::Allocated(a), Reservation::Allocated(b)) => (a, b),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            r,
            vec![
                Reservation::Registered(old),
                Reservation::Allocated(b2),
                Reservation::Writing(b2),
                Reservation::Allocated(b3),
                // The only evictable block is h(1)'s, and h(4) takes it.
                Reservation::Allocated(old),
            ]
        );
        assert_eq!(p.num_reserved(), 3);
        assert_eq!(p.num_registered(), 0);
        assert_eq!(p.lookup(h(2)), None, "a reservation is not a registration");
        assert_eq!(p.peek_prefix(&[h(2)]), 0);
        assert_eq!(p.reserved_block(h(2)), Some(b2));
        assert_eq!(
            p.take_events(),
            vec![PoolEvent::Removed {
                hash: h(1),
                tier: Tier::Host
            }]
        );
        // Nothing is left to allocate; another hash gets no space.
        assert_eq!(p.reserve_one(h(5)), Reservation::NoSpace);
        // Confirm publishes without a second store; a failed write frees its block.
        p.confirm(b2, Priority(4)).unwrap();
        assert_eq!(p.lookup(h(2)), Some(b2));
        assert_eq!(p.priority_of(b2), Some(Priority(4)));
        assert_eq!(
            p.take_events(),
            vec![PoolEvent::Stored {
                hash: h(2),
                tier: Tier::Host
            }]
        );
        assert_eq!(
            p.confirm(b2, Priority(0)),
            Err(PoolError::NotReserved {
                tier: Tier::Host,
                block: b2
            })
        );
        p.release(b3).unwrap();
        assert_eq!(p.state(b3), Some(BlockState::Free));
        assert_eq!(p.reserved_block(h(3)), None);
        assert!(
            p.take_events().is_empty(),
            "an unconfirmed write was never stored"
        );
        // `register` cannot take a reserved hash, and registers a reservation as `confirm`.
        let other = p.allocate(1).unwrap()[0];
        assert!(matches!(
            p.register(other, h(4), Priority(0)),
            Err(PoolError::Reserved { .. })
        ));
        assert_eq!(p.register(old, h(4), Priority(0)), Ok(old));
        assert_eq!(p.lookup(h(4)), Some(old));
        assert_eq!(p.num_reserved(), 0);
    }

    #[test]
    fn zero_capacity_pool() {
        let mut p = BlockPool::new(Tier::Remote, 0).unwrap();
        assert_eq!(p.allocate(0).unwrap(), Vec::<BlockId>::new());
        assert!(p.allocate(1).is_err());
        assert_eq!(p.peek_prefix(&[h(1)]), 0);
    }
}
