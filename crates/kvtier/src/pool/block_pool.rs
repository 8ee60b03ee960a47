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
//! - `free_len + lru.len() + (blocks with pins) == capacity`;
//! - a block's pin count is the number of live tokens naming it ([`Pinned`], and the
//!   [`Reserved`] of its store): only this pool makes them, each carries the pool's `id`, and
//!   each pin is given back by consuming its token, so a pin cannot be released twice nor by
//!   someone who does not hold it;
//! - a block is reserved exactly while its [`Reserved`] token lives, and that token is its only
//!   pin (`pin` refuses reserved blocks): `reserve` makes both, and only consuming the token
//!   ends the reservation (`confirm`, `confirm_and_release` publish it; `abort` frees the block).
//!
//! Not thread-safe by itself: the owner (the connector's leader) serialises access.
use crate::hash::SequenceHash;
use crate::ids::{BlockId, Tier};

use super::lru::PriorityLru;
use super::pin::{next_pool_id, Pinned, Reserved};
use super::registry::Registry;
use super::slot::{Slot, NIL};
use super::types::{BlockState, PoolError, PoolEvent, Priority, Reservation};

/// The largest capacity a pool accepts (block ids are `u32`, and `u32::MAX` marks list ends).
pub(super) const MAX_POOL_BLOCKS: usize = (u32::MAX - 1) as usize;

/// The block pool of one tier. See the module docs of [`crate::pool`] for the API contract.
#[derive(Debug)]
pub struct BlockPool {
    tier: Tier,
    /// Process-unique: the tokens this pool makes carry it, and it refuses any other.
    id: u32,
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
            id: next_pool_id(),
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

    /// The tier this pool serves.
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

    /// The index of `pin`'s block, if `pin` was made by this pool.
    fn own(&self, pin: &Pinned) -> Result<usize, PoolError> {
        if pin.pool() != self.id {
            return Err(PoolError::ForeignPin {
                tier: self.tier,
                block: pin.block(),
                from: pin.tier(),
            });
        }
        let i = pin.block().0 as usize;
        // A token of this pool holds a pin on a block below its capacity.
        debug_assert!(self.slots.get(i).is_some_and(|s| s.pins > 0));
        Ok(i)
    }

    fn token(&self, block: u32) -> Pinned {
        Pinned::new(self.id, self.tier, BlockId(block))
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

    /// Pin the blocks of the longest registered prefix of `hashes` and return the pins in
    /// order; the caller gives each back with `release`.
    #[must_use = "each returned pin must be given back with `release`"]
    pub fn match_prefix(&mut self, hashes: &[SequenceHash]) -> Vec<Pinned> {
        let mut found = Vec::new();
        self.for_each_prefix_block(hashes, |b| found.push(b));
        found
            .into_iter()
            .map(|b| {
                self.pin_index(b as usize);
                self.token(b)
            })
            .collect()
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

    /// Hand out `n` blocks in state `Writing`, each with the writer's pin, or none at all.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<Pinned>, PoolError> {
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
            out.push(self.token(b));
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
        Reservation::Allocated(Reserved::new(self.token(b)))
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

    /// [`BlockPool::confirm`], then give back the writer's pin in the same pass: the store
    /// path's last two steps for a block nobody reads right away. Returns the hash.
    pub fn confirm_and_release(
        &mut self,
        reserved: Reserved,
        priority: Priority,
    ) -> Result<SequenceHash, PoolError> {
        let i = self.own(reserved.pin())?;
        let hash = self.publish_reserved(i, priority);
        self.unpin_index(i);
        Ok(hash)
    }

    /// Publish the reserved block under the hash it reserved, with `priority`: no registry
    /// probe (the entry exists); emits `Stored`. Returns the writer's pin, now on a registered
    /// block, and the hash. The only error is a token of another pool.
    pub fn confirm(
        &mut self,
        reserved: Reserved,
        priority: Priority,
    ) -> Result<(Pinned, SequenceHash), PoolError> {
        let i = self.own(reserved.pin())?;
        let hash = self.publish_reserved(i, priority);
        Ok((reserved.into_pin(), hash))
    }

    /// A write failed: give back the writer's pin of `reserved`, its block's only pin: the
    /// block is freed and its reservation dropped (nothing was ever published).
    pub fn abort(&mut self, reserved: Reserved) -> Result<(), PoolError> {
        let i = self.own(reserved.pin())?;
        self.unpin_index(i);
        Ok(())
    }

    /// Block `i` holds a reservation (a live [`Reserved`] guarantees it): publish it.
    fn publish_reserved(&mut self, i: usize, priority: Priority) -> SequenceHash {
        let s = &mut self.slots[i];
        // Only the `Reserved` token's consumption publishes or drops a reservation.
        debug_assert!(s.reserved && s.state == BlockState::Writing);
        s.reserved = false;
        s.state = BlockState::Registered;
        s.priority = priority;
        let hash = s.hash();
        self.reserved -= 1;
        self.emit(PoolEvent::Stored {
            hash,
            tier: self.tier,
        });
        hash
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

    /// Publish the written block `pin` holds under `hash`. Returns the block that now holds
    /// `hash`, where `pin` now is: its own block, or the block already registered under `hash`
    /// (the pin moves there and its old block loses it; see the module docs). A pin on a
    /// reserved block is refused (`Reserved`): only `confirm` publishes a reservation.
    pub fn register(
        &mut self,
        pin: &mut Pinned,
        hash: SequenceHash,
        priority: Priority,
    ) -> Result<BlockId, PoolError> {
        let i = self.own(pin)?;
        let holder = BlockId(self.register_index(i, hash, priority)?);
        pin.move_to(holder);
        Ok(holder)
    }

    /// `register` of block `i`, which carries the caller's pin; returns the block that carries
    /// it afterwards.
    fn register_index(
        &mut self,
        i: usize,
        hash: SequenceHash,
        priority: Priority,
    ) -> Result<u32, PoolError> {
        let block = BlockId(i as u32);
        match self.slots[i].state {
            BlockState::Free => {
                // Unreachable: the caller's pin keeps the block out of the free stack.
                debug_assert!(false, "a pinned block is free");
                return Err(PoolError::BlockFree {
                    tier: self.tier,
                    block,
                });
            }
            BlockState::Registered => {
                let existing = self.slots[i].hash();
                if existing == hash {
                    return Ok(i as u32);
                }
                return Err(PoolError::AlreadyRegistered {
                    tier: self.tier,
                    block,
                    existing: existing.0,
                    requested: hash.0,
                });
            }
            BlockState::Writing if self.slots[i].reserved => {
                // Unreachable: a reserved block's only pin is its `Reserved` token (`pin`
                // refuses reserved blocks), so no `Pinned` names it.
                debug_assert!(false, "a Pinned on a reserved block");
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
            return Ok(existing);
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
        Ok(i as u32)
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
            let holder = match self.register_index(i, hash, priority) {
                Ok(holder) => {
                    n += 1;
                    holder as usize
                }
                Err(_) => i,
            };
            self.unpin_index(holder);
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

    /// Add a pin to a `Registered` or (unreserved) `Writing` block; the caller gives it back
    /// with `release`. A reserved block is refused (`Reserved`): its write's `Reserved` token is
    /// its only pin, so the write alone decides when the reservation ends.
    pub fn pin(&mut self, block: BlockId) -> Result<Pinned, PoolError> {
        let i = self.index(block)?;
        let s = &self.slots[i];
        if s.state == BlockState::Free {
            return Err(PoolError::BlockFree {
                tier: self.tier,
                block,
            });
        }
        if s.reserved {
            return Err(PoolError::Reserved {
                tier: self.tier,
                block,
                hash: s.hash().0,
            });
        }
        self.pin_index(i);
        Ok(self.token(block.0))
    }

    /// Give back one pin. At zero pins a registered block becomes the most recently used
    /// evictable block of its priority; an unregistered one becomes free (and a reservation it
    /// held is dropped). The only error is a token of another pool.
    pub fn release(&mut self, pin: Pinned) -> Result<(), PoolError> {
        let i = self.own(&pin)?;
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
mod tests;
