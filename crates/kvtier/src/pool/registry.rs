//! The content-addressed registry of one pool: `SequenceHash -> BlockId`.
//!
//! An open-addressing table (linear probing) of 8-byte buckets: the block id and a 32-bit tag
//! derived from the hash. The tag decides the home bucket (`tag * len >> 32`, which keeps the
//! order of tags, so runs behave as with a power-of-two table) and filters probes, so a lookup
//! reads the block's own record only to confirm a tag match, and deletion never reads records.
//! The full keys live in the pool's block records, reached through the `key_of` accessor.
//!
//! Invariants:
//! - `buckets.len()` is about 2x the capacity, fixed at construction, and larger than it, so an
//!   empty bucket always exists and every probe terminates (load <= 1/2: 16 bytes per block;
//!   at 2/3 a store's miss-probe, insert and an eviction's backward shift cost ~35% more);
//! - every occupied bucket is reachable from its home without crossing an empty bucket
//!   (backward-shift deletion keeps runs gap-free);
//! - a key appears at most once (the pool never inserts a key that is present).
use crate::hash::SequenceHash;

/// Marks an empty bucket. Block ids are always below it.
const EMPTY: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Bucket {
    block: u32,
    tag: u32,
}

const VACANT: Bucket = Bucket {
    block: EMPTY,
    tag: 0,
};

#[derive(Debug)]
pub(crate) struct Registry {
    buckets: Vec<Bucket>,
    len: usize,
}

#[inline]
fn tag_of(hash: SequenceHash) -> u32 {
    let folded = (hash.0 as u64) ^ ((hash.0 >> 64) as u64);
    (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

impl Registry {
    /// A registry able to hold `capacity` keys.
    pub(crate) fn new(capacity: usize) -> Self {
        let size = (2 * capacity + 1).max(2);
        Registry {
            buckets: vec![VACANT; size],
            len: 0,
        }
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((tag as u64 * self.buckets.len() as u64) >> 32) as usize
    }

    #[inline]
    fn step(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held by the table.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Bucket>()
    }

    /// Bucket index holding `hash`, if any.
    #[inline]
    fn position(&self, hash: SequenceHash, key_of: impl Fn(u32) -> SequenceHash) -> Option<usize> {
        let tag = tag_of(hash);
        let mut i = self.home(tag);
        loop {
            let b = self.buckets[i];
            if b.block == EMPTY {
                return None;
            }
            if b.tag == tag && key_of(b.block) == hash {
                return Some(i);
            }
            i = self.step(i);
        }
    }

    /// The block named by `hash`'s home bucket if that bucket's tag matches (a likely hit,
    /// to be confirmed against the block's key), else `EMPTY`. One independent load per call,
    /// so a batch of calls overlaps its cache misses.
    #[inline]
    pub(crate) fn first_candidate(&self, hash: SequenceHash) -> u32 {
        let tag = tag_of(hash);
        let b = self.buckets[self.home(tag)];
        if b.tag == tag {
            b.block
        } else {
            EMPTY
        }
    }

    /// The block registered under `hash`.
    #[inline]
    pub(crate) fn find(
        &self,
        hash: SequenceHash,
        key_of: impl Fn(u32) -> SequenceHash,
    ) -> Option<u32> {
        self.position(hash, key_of).map(|i| self.buckets[i].block)
    }

    /// Insert `block` under `hash`. The caller guarantees the key is absent and the pool's
    /// capacity bounds the number of keys.
    pub(crate) fn insert(&mut self, block: u32, hash: SequenceHash) {
        debug_assert!(self.len + 1 < self.buckets.len());
        let tag = tag_of(hash);
        let mut i = self.home(tag);
        while self.buckets[i].block != EMPTY {
            i = self.step(i);
        }
        self.buckets[i] = Bucket { block, tag };
        self.len += 1;
    }

    /// Remove the entry of `hash`; returns the block it named.
    pub(crate) fn remove(
        &mut self,
        hash: SequenceHash,
        key_of: impl Fn(u32) -> SequenceHash,
    ) -> Option<u32> {
        let mut hole = self.position(hash, key_of)?;
        let removed = self.buckets[hole].block;
        // Backward-shift deletion: pull later members of the run into the hole unless their
        // home lies cyclically in (hole, j].
        let mut j = hole;
        loop {
            j = self.step(j);
            let b = self.buckets[j];
            if b.block == EMPTY {
                break;
            }
            let k = self.home(b.tag);
            let stays = if hole <= j {
                hole < k && k <= j
            } else {
                hole < k || k <= j
            };
            if !stays {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = VACANT;
        self.len -= 1;
        Some(removed)
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
                assert_eq!(r.remove(keys[b as usize], key_of), Some(b));
            } else {
                assert_eq!(r.find(keys[b as usize], key_of), None);
                r.insert(b, keys[b as usize]);
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
