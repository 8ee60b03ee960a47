//! The small value types of the pool API: priorities, block states, events and errors.
//!
//! Invariant: every error names the tier and the block (or the amounts) it concerns, so a caller
//! can act on it without guessing.
use serde::{Deserialize, Serialize};

use crate::hash::SequenceHash;
use crate::ids::{BlockId, Tier};

use super::pin::Reserved;

/// Retention priority of a registered block. Lower priorities are evicted first; within one
/// priority the least recently used block goes first. TensorRT-LLM's retention priorities
/// (0..=100, default 35) map directly; engines without priorities use `Priority::default()` (0).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Priority(pub u32);

/// The state of one pool block. `Free` and `Writing` blocks are never in the registry;
/// a `Registered` block with no pins is evictable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum BlockState {
    /// Holds nothing; on the free list.
    Free,
    /// Handed out by `allocate` (pinned, contents being written) and not yet registered.
    Writing,
    /// Published under its sequence hash; evictable when its pin count is zero.
    Registered,
}

/// What changed in a pool's content registry, pulled with `BlockPool::take_events`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolEvent {
    /// `hash` became available in `tier`.
    Stored {
        /// The sequence hash.
        hash: SequenceHash,
        /// The pool's tier.
        tier: Tier,
    },
    /// `hash` is no longer available in `tier` (evicted or invalidated).
    Removed {
        /// The sequence hash.
        hash: SequenceHash,
        /// The pool's tier.
        tier: Tier,
    },
}

/// What [`BlockPool::reserve`](super::BlockPool::reserve) did with one hash.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an `Allocated` reservation carries the writer's pin: confirm or abort it"]
pub enum Reservation {
    /// The hash is registered in this block (nothing was pinned or changed).
    Registered(BlockId),
    /// The hash is already reserved by a write in flight to this block (nothing changed).
    Writing(BlockId),
    /// A block was allocated for the hash: pinned once (the token is the writer's pin),
    /// `Writing`, the hash reserved (hidden from lookups until `confirm`; `abort` frees it).
    Allocated(Reserved),
    /// Nothing changed: no block was free or evictable.
    NoSpace,
}

/// Why a pool operation was refused; the pool is unchanged.
///
/// Misuse the token types make a compile error has no variant: releasing a pin twice, releasing
/// a pin one does not hold, confirming a block that holds no reservation (or twice), and
/// registering a block nobody pinned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// `allocate` asked for more blocks than are free or evictable; nothing was allocated.
    #[error(
        "{tier:?} pool exhausted: requested {requested} blocks, {available} free or evictable"
    )]
    Exhausted {
        /// The pool's tier.
        tier: Tier,
        /// Blocks asked for.
        requested: usize,
        /// Blocks free or evictable.
        available: usize,
    },
    /// The block id is not below the pool's capacity.
    #[error("{tier:?} pool: block {block:?} out of range (capacity {capacity})")]
    UnknownBlock {
        /// The pool's tier.
        tier: Tier,
        /// The block.
        block: BlockId,
        /// Blocks of the pool.
        capacity: usize,
    },
    /// The operation needs a block that is allocated or registered, and this one is free.
    #[error("{tier:?} pool: block {block:?} is free")]
    BlockFree {
        /// The pool's tier.
        tier: Tier,
        /// The block.
        block: BlockId,
    },
    /// A token ([`Pinned`](super::Pinned) or [`Reserved`]) made by another pool (of `from`):
    /// this pool is unchanged; a consumed token's pin stays in the pool that made it.
    #[error("{tier:?} pool: the token for block {block:?} was made by another pool ({from:?})")]
    ForeignPin {
        /// The pool's tier.
        tier: Tier,
        /// The block the token names.
        block: BlockId,
        /// The tier of the pool that made it.
        from: Tier,
    },
    /// `register` on a block that is already registered under another hash.
    #[error("{tier:?} pool: block {block:?} is already registered as {existing:032x}, not {requested:032x}")]
    AlreadyRegistered {
        /// The pool's tier.
        tier: Tier,
        /// The block.
        block: BlockId,
        /// The hash it holds.
        existing: u128,
        /// The hash asked for.
        requested: u128,
    },
    /// `register` of a hash that a write in flight to another block has reserved, or `pin` of a
    /// reserved block (its [`Reserved`] token is its only pin).
    #[error(
        "{tier:?} pool: hash {hash:032x} is reserved by block {block:?}, whose write is in flight"
    )]
    Reserved {
        /// The pool's tier.
        tier: Tier,
        /// The block whose write reserved it.
        block: BlockId,
        /// The hash.
        hash: u128,
    },
    /// A pool cannot hold this many blocks (ids are 32-bit).
    #[error("{tier:?} pool: capacity {requested} exceeds the maximum of {max} blocks")]
    CapacityTooLarge {
        /// The pool's tier.
        tier: Tier,
        /// Blocks asked for.
        requested: usize,
        /// The most a pool holds.
        max: usize,
    },
    /// The pool's own books (block records and registry) do not fit in memory: more than the
    /// memory available now, or the allocation was refused.
    #[error(
        "{tier:?} pool of {requested} blocks needs {bytes} bytes of bookkeeping memory, {available}; \
         lower the tier's num_blocks (or gb)"
    )]
    OutOfMemory {
        /// The pool's tier.
        tier: Tier,
        /// Blocks asked for.
        requested: usize,
        /// Bytes of bookkeeping they need.
        bytes: usize,
        /// What was known about free memory ("only N bytes available" or "allocation refused").
        available: String,
    },
}
