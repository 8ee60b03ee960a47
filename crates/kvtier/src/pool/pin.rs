//! The ownership tokens of the pool API: a [`Pinned`] is one pin held on one block, a
//! [`Reserved`] is the writer's pin on a block whose hash a store reserved (`reserve`).
//!
//! Invariants: a token exists exactly as long as the pin it stands for; neither type is `Clone`
//! or `Copy`, and only the pool creates them, so the number of live tokens of a block equals
//! its pin count. Each token is used up by value by the pool call that gives its pin back
//! (`release`, `abort`, `confirm`, `confirm_and_release`), so a pin is released at most once
//! and only by whoever holds it: releasing twice, or using a block after its release, does not
//! compile. A token names the pool that made it (a process-unique id and the tier), so a pool
//! refuses another pool's token with [`PoolError::ForeignPin`](super::PoolError::ForeignPin).
//!
//! What the types cannot enforce (Rust has no linear types): a token dropped without being
//! given back leaks its pin until the pool itself is dropped. Creation is `#[must_use]`, and
//! the connector's tests assert that no pin is left once every job completed.
use std::sync::atomic::{AtomicU32, Ordering};

use crate::ids::{BlockId, Tier};

/// Ids of pools, unique within the process (wrapping after 2^32 pools).
static NEXT_POOL_ID: AtomicU32 = AtomicU32::new(0);

/// A fresh pool id.
pub(super) fn next_pool_id() -> u32 {
    NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed)
}

/// One pin on one block of one pool: while it lives, the block is neither evicted nor handed
/// out again. Given back with [`BlockPool::release`](super::BlockPool::release), which takes it
/// by value:
///
/// ```
/// # use kvtier::pool::BlockPool;
/// # use kvtier::Tier;
/// let mut pool = BlockPool::new(Tier::Host, 1)?;
/// let pin = pool.allocate(1)?.remove(0);
/// let block = pin.block();
/// assert_eq!(pool.pin_count(block), Some(1));
/// pool.release(pin)?;
/// assert_eq!(pool.pin_count(block), Some(0));
/// # Ok::<(), kvtier::pool::PoolError>(())
/// ```
///
/// so it cannot be released twice (each block below differs from the one above by its marked
/// line; stable rustdoc checks that it fails to compile, not the error code named):
///
/// ```compile_fail,E0382
/// # use kvtier::pool::BlockPool;
/// # use kvtier::Tier;
/// let mut pool = BlockPool::new(Tier::Host, 1)?;
/// let pin = pool.allocate(1)?.remove(0);
/// pool.release(pin)?;
/// pool.release(pin)?; // use after release: `pin` was moved
/// # Ok::<(), kvtier::pool::PoolError>(())
/// ```
///
/// nor copied so that two holders release it:
///
/// ```compile_fail,E0599
/// # use kvtier::pool::BlockPool;
/// # use kvtier::Tier;
/// let mut pool = BlockPool::new(Tier::Host, 1)?;
/// let pin = pool.allocate(1)?.remove(0);
/// let copy = pin.clone(); // `Pinned` is not `Clone`
/// pool.release(pin)?;
/// pool.release(copy)?;
/// # Ok::<(), kvtier::pool::PoolError>(())
/// ```
#[must_use = "a pin keeps its block from eviction until it is given back with `BlockPool::release`"]
#[derive(Debug, PartialEq, Eq)]
pub struct Pinned {
    pool: u32,
    tier: Tier,
    block: BlockId,
}

impl Pinned {
    pub(super) fn new(pool: u32, tier: Tier, block: BlockId) -> Self {
        Pinned { pool, tier, block }
    }

    /// The pinned block.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// The tier of the pool that pinned it.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    pub(super) fn pool(&self) -> u32 {
        self.pool
    }

    /// The pin moved to `block` (a `register` that found its hash in another block).
    pub(super) fn move_to(&mut self, block: BlockId) {
        self.block = block;
    }
}

/// The writer's pin on a block allocated for a store by `reserve`, whose hash is reserved
/// (hidden from lookups) until [`BlockPool::confirm`](super::BlockPool::confirm) publishes it.
/// Used up by `confirm` (which hands back the pin, now on a registered block),
/// `confirm_and_release`, or `abort` (a failed write: the block is freed and its reservation
/// dropped). It is its block's only pin (`pin` refuses a reserved block), and the block stays
/// reserved exactly while it lives: nothing else publishes or drops the reservation.
///
/// ```
/// # use kvtier::hash::SequenceHash;
/// # use kvtier::pool::{BlockPool, Priority, Reservation};
/// # use kvtier::Tier;
/// let mut pool = BlockPool::new(Tier::Host, 1)?;
/// let Reservation::Allocated(r) = pool.reserve_one(SequenceHash(7)) else { return Ok(()) };
/// let (pin, _hash) = pool.confirm(r, Priority(0))?;
/// pool.release(pin)?;
/// assert_eq!(pool.lookup(SequenceHash(7)), Some(kvtier::BlockId(0)));
/// # Ok::<(), kvtier::pool::PoolError>(())
/// ```
///
/// A reservation is used up at most once (the same code, its last call changed):
///
/// ```compile_fail,E0382
/// # use kvtier::hash::SequenceHash;
/// # use kvtier::pool::{BlockPool, Priority, Reservation};
/// # use kvtier::Tier;
/// let mut pool = BlockPool::new(Tier::Host, 1)?;
/// let Reservation::Allocated(r) = pool.reserve_one(SequenceHash(7)) else { return Ok(()) };
/// let (pin, _hash) = pool.confirm(r, Priority(0))?;
/// pool.abort(r)?; // use after confirm: `r` was moved
/// # Ok::<(), kvtier::pool::PoolError>(())
/// ```
#[must_use = "a reservation pins its block: `confirm` it, or `abort` it if the write failed"]
#[derive(Debug, PartialEq, Eq)]
pub struct Reserved(Pinned);

impl Reserved {
    pub(super) fn new(pin: Pinned) -> Self {
        Reserved(pin)
    }

    /// The block being written.
    pub fn block(&self) -> BlockId {
        self.0.block
    }

    /// The tier of the pool that reserved it.
    pub fn tier(&self) -> Tier {
        self.0.tier
    }

    pub(super) fn into_pin(self) -> Pinned {
        self.0
    }

    pub(super) fn pin(&self) -> &Pinned {
        &self.0
    }
}
