//! The content-addressed registry of one pool: `SequenceHash -> BlockId`.
//!
//! It is an open-addressing table of 4-byte block indices; the keys themselves live in the
//! pool's per-block hash array, which the caller passes in. That keeps a bucket at 4 bytes, so
//! the registry costs 8 bytes per block of capacity (table load <= 1/2) on top of the pool's own
//! per-block arrays.
//!
//! Invariants:
//! - the table length is a power of two and at least `2 * capacity`, fixed at construction, so
//!   at least half the buckets are always empty and every probe terminates;
//! - linear probing with backward-shift deletion: every occupied bucket is reachable from its
//!   key's home bucket without crossing an empty bucket;
//! - a key appears at most once (the pool never inserts a key that is present).
use crate::hash::SequenceHash;

/// Marks an empty bucket. Block indices are always below it (pool capacity < `u32::MAX`).
const EMPTY: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct Registry {
    buckets: Vec<u32>,
    mask: usize,
    shift: u32,
    len: usize,
}

impl Registry {
    /// A registry able to hold `capacity` keys.
    pub(crate) fn new(capacity: usize) -> Self {
        let size = (capacity.max(1) * 2).next_power_of_two();
        let bits = size.trailing_zeros();
        Registry {
            buckets: vec![EMPTY; size],
            mask: size - 1,
            shift: 64 - bits.max(1),
            len: 0,
        }
    }

    #[inline]
    fn home(&self, hash: SequenceHash) -> usize {
        let folded = (hash.0 as u64) ^ ((hash.0 >> 64) as u64);
        (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize & self.mask
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held by the table.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<u32>()
    }

    /// The block registered under `hash`; `keys[b]` is block `b`'s hash.
    #[inline]
    pub(crate) fn find(&self, hash: SequenceHash, keys: &[SequenceHash]) -> Option<u32> {
        let mut i = self.home(hash);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return None;
            }
            if keys.get(b as usize) == Some(&hash) {
                return Some(b);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Insert `block` under `keys[block]`. The caller guarantees the key is absent.
    pub(crate) fn insert(&mut self, block: u32, keys: &[SequenceHash]) {
        let Some(&hash) = keys.get(block as usize) else {
            debug_assert!(false, "block {block} out of range");
            return;
        };
        debug_assert!(self.find(hash, keys).is_none());
        debug_assert!(self.len < self.buckets.len() / 2 || self.buckets.len() <= 2);
        let mut i = self.home(hash);
        while self.buckets[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.buckets[i] = block;
        self.len += 1;
    }

    /// Remove the entry of `hash`; returns the block it named.
    pub(crate) fn remove(&mut self, hash: SequenceHash, keys: &[SequenceHash]) -> Option<u32> {
        let mut i = self.home(hash);
        loop {
            let b = self.buckets[i];
            if b == EMPTY {
                return None;
            }
            if keys.get(b as usize) == Some(&hash) {
                break;
            }
            i = (i + 1) & self.mask;
        }
        let removed = self.buckets[i];
        // Backward-shift deletion: pull later members of the run into the hole when their home
        // is not cyclically inside (hole, j].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let b = self.buckets[j];
            if b == EMPTY {
                break;
            }
            let Some(&key) = keys.get(b as usize) else {
                debug_assert!(false, "block {b} out of range");
                break;
            };
            let k = self.home(key);
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
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        Some(removed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_with_colliding_homes() {
        // Keys that share low bits still land in distinct buckets and stay findable after
        // removals in the middle of a run.
        let n = 64usize;
        let keys: Vec<SequenceHash> = (0..n as u128).map(|i| SequenceHash(i << 70)).collect();
        let mut r = Registry::new(n);
        for b in 0..n as u32 {
            r.insert(b, &keys);
        }
        assert_eq!(r.len(), n);
        for b in 0..n as u32 {
            assert_eq!(r.find(keys[b as usize], &keys), Some(b));
        }
        for b in (0..n as u32).step_by(3) {
            assert_eq!(r.remove(keys[b as usize], &keys), Some(b));
        }
        for b in 0..n as u32 {
            let expect = if b % 3 == 0 { None } else { Some(b) };
            assert_eq!(r.find(keys[b as usize], &keys), expect, "block {b}");
        }
        assert_eq!(r.remove(SequenceHash(12345), &keys), None);
        assert_eq!(r.len(), n - n.div_ceil(3));
    }

    #[test]
    fn capacity_zero_terminates() {
        let r = Registry::new(0);
        assert_eq!(r.find(SequenceHash(7), &[]), None);
    }
}
