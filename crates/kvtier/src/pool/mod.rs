//! Pools, one per tier: block ids, a content-addressed registry, reference-counted pins,
//! priority-aware LRU eviction, capacity accounting. Data structures with no clock and no I/O
//! beyond one read of `/proc/meminfo` in `BlockPool::new` (a pool larger than memory is refused).
//!
//! API (the connector codes against it):
//! - `BlockPool::new(tier, capacity_blocks) -> Result<BlockPool, PoolError>`
//! - `peek_prefix(&self, &[SequenceHash]) -> usize`: side-effect free longest contiguous prefix
//! - `match_prefix(&mut self, &[SequenceHash]) -> Vec<BlockId>`: pins each matched block (the
//!   caller releases each one later); the release makes it the most recently used
//! - `allocate(&mut self, n) -> Result<Vec<BlockId>, PoolError>`: all-or-nothing, each block pinned
//!   once and in state `Writing`; takes free blocks first, then evicts unpinned registered blocks
//!   in (priority, last use) order, emitting `Removed` for each
//! - `register(&mut self, block, hash, priority) -> Result<BlockId, PoolError>`: publish a written
//!   (pinned, `Writing`) block. If `hash` is already registered elsewhere, the caller's pin moves
//!   to the existing block (which is returned), the given block loses that pin (and becomes free
//!   when it has no other), and the existing block keeps the higher of the two priorities
//! - `reserve(&mut self, &[SequenceHash], &mut Vec<Reservation>)`: the batched store path. Per
//!   hash, in order (exactly as a sequence of `reserve_one`): `Registered(block)` or
//!   `Writing(block)` if the pool already holds or is writing it; else `Allocated(block)`, a block
//!   allocated (free first, then evicting) and pinned once, whose hash is entered in the registry
//!   at once but hidden from lookups; `NoSpace` if nothing was free or evictable. One registry
//!   probe per hash both deduplicates and reserves
//! - `confirm(&mut self, block, priority) -> Result<SequenceHash, PoolError>`: publish a reserved
//!   block under the hash it reserved, which it returns (no registry probe; emits `Stored`; the
//!   caller keeps its pin); `confirm_and_release` also drops the caller's pin in the same pass. Releasing a reserved block to
//!   zero pins without confirming it (a failed write) frees it and drops the reservation
//! - `pin(&mut self, block) -> Result<(), PoolError>`, `release(&mut self, block) -> Result<(), PoolError>`:
//!   pin count +1 / -1. A registered block at 0 pins becomes evictable; an unregistered one free
//! - `invalidate(&mut self, block) -> Result<(), PoolError>`: unpublish (e.g. its bytes were lost)
//! - `lookup(&self, hash) -> Option<BlockId>`, `hash_of(&self, block) -> Option<SequenceHash>`,
//!   `state(&self, block)`, `pin_count(&self, block)`
//! - `capacity()`, `num_free()` (free + evictable), `num_evictable()`, `num_registered()`,
//!   `num_pinned()`, `priority_of(block)`, `eviction_order()`, `heap_bytes()`
//! - `take_events() -> Vec<PoolEvent>` (`Stored`/`Removed`), `drain_events()` (keeps the
//!   buffer); `set_record_events(false)` for an owner that never takes them
//!
//! Invariants (checked by the property tests in `tests/pool_model.rs`):
//! - every block is in exactly one state; a `Free` block is on the free list and in no registry;
//! - a block with pins is never evicted or handed out by `allocate`;
//! - `num_free() + (pinned blocks) == capacity()`;
//! - one hash names at most one block (registered or reserved).
//!
//! ```
//! use kvtier::hash::{sequence_hashes, HashSalt};
//! use kvtier::pool::{BlockPool, PoolEvent, Priority};
//! use kvtier::Tier;
//!
//! let salt = HashSalt::new("my-model", None, None);
//! let hashes = sequence_hashes(salt, &(0..64).collect::<Vec<u32>>(), 16);
//! let mut host = BlockPool::new(Tier::Host, 8)?;
//! // Offload: allocate, (copy the bytes), register, release.
//! for (block, hash) in host.allocate(4)?.into_iter().zip(&hashes) {
//!     let holder = host.register(block, *hash, Priority::default())?;
//!     host.release(holder)?;
//! }
//! assert_eq!(host.take_events().len(), 4); // four `Stored`
//! // Onboard: match the prefix (pins), (copy the bytes back), release.
//! assert_eq!(host.peek_prefix(&hashes), 4);
//! let pinned = host.match_prefix(&hashes[..3]);
//! assert_eq!(pinned.len(), 3);
//! for b in pinned {
//!     host.release(b)?;
//! }
//! # Ok::<(), kvtier::pool::PoolError>(())
//! ```
mod block_pool;
mod lru;
mod memory;
mod registry;
mod slot;
mod types;

pub use block_pool::BlockPool;
pub use types::{BlockState, PoolError, PoolEvent, Priority, Reservation};
