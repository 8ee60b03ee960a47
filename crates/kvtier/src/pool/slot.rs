//! The per-block record of a pool: everything the books hold about one block, in one 40-byte
//! struct, so an operation on a block touches one cache line (plus its LRU neighbours').
//!
//! Invariants: `prev`/`next` are meaningful only while the block is linked in a list (an LRU
//! list when `Registered` with no pins, the free list when `Free`); `NIL` ends a list.
//! `reserved` is set only while the block is `Writing` and its hash is in the registry.
use crate::hash::SequenceHash;

use super::types::{BlockState, Priority};

/// Ends a list; block ids are always below it.
pub(crate) const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    /// The sequence hash, split so the struct is 8-byte aligned (a `u128` would make it 48).
    hash_lo: u64,
    hash_hi: u64,
    pub(crate) prev: u32,
    pub(crate) next: u32,
    pub(crate) pins: u32,
    pub(crate) priority: Priority,
    pub(crate) state: BlockState,
    /// A `Writing` block whose hash is already in the registry (a reservation, see
    /// `BlockPool::reserve`): lookups skip it, `confirm` publishes it.
    pub(crate) reserved: bool,
}

impl Slot {
    pub(crate) const FREE: Slot = Slot {
        hash_lo: 0,
        hash_hi: 0,
        prev: NIL,
        next: NIL,
        pins: 0,
        priority: Priority(0),
        state: BlockState::Free,
        reserved: false,
    };

    #[inline]
    pub(crate) fn hash(&self) -> SequenceHash {
        SequenceHash(((self.hash_hi as u128) << 64) | self.hash_lo as u128)
    }

    #[inline]
    pub(crate) fn set_hash(&mut self, h: SequenceHash) {
        self.hash_lo = h.0 as u64;
        self.hash_hi = (h.0 >> 64) as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_is_40_bytes_and_round_trips_hashes() {
        assert_eq!(std::mem::size_of::<Slot>(), 40);
        let mut s = Slot::FREE;
        let h = SequenceHash(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
        s.set_hash(h);
        assert_eq!(s.hash(), h);
    }
}
