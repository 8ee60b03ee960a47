//! The content-addressed registry of one pool: `SequenceHash -> BlockId`.
//!
//! A `hashbrown` table of 4-byte block ids, sized at construction for 1.5x the pool's blocks,
//! so it never grows, runs at most ~60% full, and its deletions almost always leave empty
//! (not tombstoned) buckets: in-place rehashes, which would cost one step a full pass, are
//! rare. Its SIMD control bytes (one per bucket) answer most misses without touching an entry;
//! the full keys live in the pool's block records, reached through the `key_of` accessor, and
//! are read only to confirm a control-byte match. (An open-addressing table of 8-byte buckets
//! with 32-bit tags, kept until Nov 2026, cost the connector's step ~40% more: its misses
//! touched an 8-byte bucket in a table twice the size.)
//!
//! Invariants: a key appears at most once (the pool never inserts a key that is present);
//! `key_of(b)` of every entry `b` is the key it was inserted under until it is removed.
use hashbrown::HashTable;

use crate::hash::SequenceHash;

#[derive(Debug)]
pub(crate) struct Registry {
    table: HashTable<u32>,
}

/// The table's 64-bit hash of a key (sequence hashes are already uniform: fold the halves).
#[inline]
fn h64(hash: SequenceHash) -> u64 {
    (hash.0 as u64) ^ ((hash.0 >> 64) as u64)
}

impl Registry {
    #[cfg(test)]
    pub(crate) fn new(capacity: usize) -> Self {
        Registry {
            table: HashTable::with_capacity(capacity + capacity / 2),
        }
    }

    /// As `new`, but a refused allocation is an error instead of an abort.
    pub(crate) fn try_new(capacity: usize) -> Result<Self, hashbrown::TryReserveError> {
        let mut table = HashTable::new();
        table.try_reserve(capacity + capacity / 2, |&b: &u32| u64::from(b))?;
        Ok(Registry { table })
    }

    /// Bytes `try_new(capacity)` allocates, approximately (buckets are a power of two, 4-byte
    /// entries plus one control byte each).
    pub(crate) fn bytes_for(capacity: usize) -> usize {
        let want = capacity.saturating_add(capacity / 2);
        // hashbrown keeps buckets at most 7/8 full.
        let buckets = want
            .saturating_mul(8)
            .div_ceil(7)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX);
        buckets.saturating_mul(std::mem::size_of::<u32>() + 1)
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
    }

    #[inline]
    pub(crate) fn find(
        &self,
        hash: SequenceHash,
        key_of: impl Fn(u32) -> SequenceHash,
    ) -> Option<u32> {
        self.table.find(h64(hash), |&b| key_of(b) == hash).copied()
    }

    /// Insert `block` under `hash` (absent; `key_of(block) == hash` already holds).
    pub(crate) fn insert(
        &mut self,
        block: u32,
        hash: SequenceHash,
        key_of: impl Fn(u32) -> SequenceHash,
    ) {
        self.table
            .insert_unique(h64(hash), block, |&b| h64(key_of(b)));
    }

    /// Remove the entry of `block`, which was inserted under `hash`: matched by block id, so
    /// no other block's record is read. Returns whether it was there.
    pub(crate) fn remove_block(&mut self, hash: SequenceHash, block: u32) -> bool {
        match self.table.find_entry(h64(hash), |&b| b == block) {
            Ok(e) => {
                e.remove();
                true
            }
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn random_ops_agree_with_a_hashmap() {
        // Tiny table, keys with equal tags (same folded value) and different ones: exercises
        // wrap-around, tag collisions and backward shifts.
        let n = 24usize;
        let keys: Vec<SequenceHash> = (0..n as u128)
            .map(|i| {
                if i % 4 == 0 {
                    SequenceHash((i << 64) | i) // folded = 0 for all of these: same tag
                } else {
                    SequenceHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
                }
            })
            .collect();
        let key_of = |b: u32| keys[b as usize];
        let mut r = Registry::new(n);
        let mut model: HashSet<u32> = HashSet::new();
        let mut x = 12345u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = (x % n as u64) as u32;
            if model.remove(&b) {
                assert!(r.remove_block(keys[b as usize], b));
            } else {
                assert_eq!(r.find(keys[b as usize], key_of), None);
                r.insert(b, keys[b as usize], key_of);
                model.insert(b);
            }
            assert_eq!(r.len(), model.len());
            for c in 0..n as u32 {
                let want = model.contains(&c).then_some(c);
                assert_eq!(r.find(keys[c as usize], key_of), want);
            }
        }
    }

    #[test]
    fn capacity_zero_terminates() {
        let r = Registry::new(0);
        assert_eq!(r.find(SequenceHash(7), |_| SequenceHash(0)), None);
    }
}
