//! Pools, one per tier: block ids, a content-addressed registry, reference-counted pins,
//! priority-aware LRU eviction, capacity accounting. Data structures with no clock and no I/O
//! beyond one read of `/proc/meminfo` in `BlockPool::new` (a pool larger than memory is refused).
//!
//! Ownership is in the types: every pin the pool hands out is a token, [`Pinned`] (one pin on
//! one block) or [`Reserved`] (the writer's pin on a block whose hash a store reserved). Neither
//! is `Clone` or `Copy`; the calls that give a pin back take its token by value, so releasing a
//! pin twice, releasing one the caller does not hold, or confirming a reservation twice does not
//! compile. A token carries its pool's process-unique id; another pool refuses it
//! (`PoolError::ForeignPin`). Dropping a token without giving it back is the one misuse left
//! (it leaks the pin): creation is `#[must_use]`, and an owner that stores pins across steps
//! stores the tokens themselves.
//!
//! API (the connector codes against it):
//! - `BlockPool::new(tier, capacity_blocks) -> Result<BlockPool, PoolError>`
//! - `peek_prefix(&self, &[SequenceHash]) -> usize`: side-effect free longest contiguous prefix
//! - `match_prefix(&mut self, &[SequenceHash]) -> Vec<Pinned>`: pins each matched block (the
//!   caller releases each pin later); the release makes it the most recently used
//! - `allocate(&mut self, n) -> Result<Vec<Pinned>, PoolError>`: all-or-nothing, each block
//!   pinned once (the writer's pin) and in state `Writing`; takes free blocks first, then evicts
//!   unpinned registered blocks in (priority, last use) order, emitting `Removed` for each
//! - `register(&mut self, &mut Pinned, hash, priority) -> Result<BlockId, PoolError>`: publish
//!   the written (`Writing`) block the pin holds. If `hash` is already registered elsewhere, the
//!   pin moves to the existing block (which is returned), the written block loses it (and
//!   becomes free when it has no other pin), and the existing block keeps the higher of the two
//!   priorities
//! - `reserve(&mut self, &[SequenceHash], &mut Vec<Reservation>)`: the batched store path. Per
//!   hash, in order (exactly as a sequence of `reserve_one`): `Registered(block)` or
//!   `Writing(block)` if the pool already holds or is writing it; else `Allocated(Reserved)`, a
//!   block allocated (free first, then evicting) and pinned once, whose hash is entered in the
//!   registry at once but hidden from lookups; `NoSpace` if nothing was free or evictable. One
//!   registry probe per hash both deduplicates and reserves
//! - `confirm(&mut self, Reserved, priority) -> Result<(Pinned, SequenceHash), PoolError>`:
//!   publish a reservation under its hash (no registry probe; emits `Stored`); the writer's pin
//!   comes back as a `Pinned`. `confirm_and_release(Reserved, priority)` also gives that pin
//!   back in the same pass; `abort(Reserved)` gives it back unconfirmed (a failed write): the
//!   block is freed and the reservation dropped. The token is the block's only pin
//! - `pin(&mut self, BlockId) -> Result<Pinned, PoolError>` (a `Registered` or unreserved
//!   `Writing` block; a reserved one is refused, `Reserved`),
//!   `release(&mut self, Pinned) -> Result<(), PoolError>`: pin count +1 / -1. A registered
//!   block at 0 pins becomes evictable; an unregistered one free
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
//! - one hash names at most one block (registered or reserved);
//! - a block's pin count is the number of live tokens naming it (the property tests hold every
//!   token and check it after every operation).
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
//! for (mut pin, hash) in host.allocate(4)?.into_iter().zip(&hashes) {
//!     host.register(&mut pin, *hash, Priority::default())?;
//!     host.release(pin)?;
//! }
//! assert_eq!(host.take_events().len(), 4); // four `Stored`
//! // Onboard: match the prefix (pins), (copy the bytes back), release.
//! assert_eq!(host.peek_prefix(&hashes), 4);
//! let pinned = host.match_prefix(&hashes[..3]);
//! assert_eq!(pinned.len(), 3);
//! for pin in pinned {
//!     host.release(pin)?;
//! }
//! assert_eq!(host.num_pinned(), 0);
//! # Ok::<(), kvtier::pool::PoolError>(())
//! ```
mod block_pool;
mod lru;
mod memory;
mod pin;
mod registry;
mod slot;
mod types;

pub use block_pool::BlockPool;
pub use pin::{Pinned, Reserved};
pub use types::{BlockState, PoolError, PoolEvent, Priority, Reservation};
