//! The engine's G1 block allocator with its own prefix cache, content-addressed by kvtier's
//! sequence hashes.
//!
//! Invariants:
//! - a block with `ref_count > 0` is never handed out by `allocate` nor evicted;
//! - a registered hash maps to exactly one block and that block records the same hash;
//! - a free block is either in `free_plain` (no hash) or in `free_cached` (hash, ordered by the
//!   tick of its release: least recently released is evicted first);
//! - `allocate` is all-or-nothing.
use std::collections::{BTreeMap, HashMap};

use kvtier::hash::SequenceHash;

#[derive(Clone, Debug, Default)]
struct Meta {
    ref_count: u32,
    hash: Option<SequenceHash>,
    /// Key in `free_cached` while free and registered.
    free_tick: Option<u64>,
}

pub(crate) struct BlockPool {
    meta: Vec<Meta>,
    free_plain: Vec<u32>,
    free_cached: BTreeMap<u64, u32>,
    registry: HashMap<SequenceHash, u32>,
    tick: u64,
}

impl BlockPool {
    pub(crate) fn new(num_blocks: usize) -> Self {
        BlockPool {
            meta: vec![Meta::default(); num_blocks],
            free_plain: (0..num_blocks as u32).rev().collect(),
            free_cached: BTreeMap::new(),
            registry: HashMap::new(),
            tick: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.meta.len()
    }

    /// Blocks `allocate` could hand out now (free, including evictable cached ones).
    pub(crate) fn num_free(&self) -> usize {
        self.free_plain.len() + self.free_cached.len()
    }

    #[cfg(test)]
    fn num_cached(&self) -> usize {
        self.registry.len()
    }

    /// Longest prefix of `hashes` that is cached; each matched block gains a reference.
    pub(crate) fn match_prefix(&mut self, hashes: &[SequenceHash]) -> Vec<u32> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.registry.get(h) else {
                break;
            };
            self.acquire(b);
            out.push(b);
        }
        out
    }

    fn acquire(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        if let Some(t) = m.free_tick.take() {
            self.free_cached.remove(&t);
        }
        m.ref_count += 1;
    }

    /// `n` blocks, each with one reference; plain free blocks first, then the least recently
    /// released cached ones (their hashes are dropped). `None` if fewer than `n` are free.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.num_free() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let b = if let Some(b) = self.free_plain.pop() {
                b
            } else {
                let (_, b) = self.free_cached.pop_first()?;
                let m = &mut self.meta[b as usize];
                m.free_tick = None;
                if let Some(h) = m.hash.take() {
                    self.registry.remove(&h);
                }
                b
            };
            self.meta[b as usize].ref_count = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Publish a full, computed block under `hash`. If another block already holds the hash, the
    /// registry keeps that one and `block` stays unregistered.
    pub(crate) fn register(&mut self, block: u32, hash: SequenceHash) {
        let m = &self.meta[block as usize];
        if m.hash.is_some() || self.registry.contains_key(&hash) {
            return;
        }
        self.meta[block as usize].hash = Some(hash);
        self.registry.insert(hash, block);
    }

    /// Drop one reference of each block; blocks reaching zero become free (cached ones stay
    /// matchable until evicted). Blocks are released in reverse so a sequence's tail is evicted first.
    pub(crate) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let Some(m) = self.meta.get_mut(b as usize) else {
                continue;
            };
            debug_assert!(m.ref_count > 0, "double release of block {b}");
            if m.ref_count == 0 {
                continue;
            }
            m.ref_count -= 1;
            if m.ref_count == 0 {
                if m.hash.is_some() {
                    self.tick += 1;
                    m.free_tick = Some(self.tick);
                    self.free_cached.insert(self.tick, b);
                } else {
                    self.free_plain.push(b);
                }
            }
        }
    }

    /// Forget every hash (the "reset prefix cache" of an engine). Blocks in use stay valid for
    /// their owners; free cached blocks become plain free blocks.
    pub(crate) fn reset_prefix_cache(&mut self) {
        self.registry.clear();
        for (_, b) in std::mem::take(&mut self.free_cached) {
            self.free_plain.push(b);
        }
        for m in &mut self.meta {
            m.hash = None;
            m.free_tick = None;
        }
    }

    #[cfg(test)]
    fn ref_count(&self, b: u32) -> u32 {
        self.meta[b as usize].ref_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u128) -> SequenceHash {
        SequenceHash(v)
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut p = BlockPool::new(3);
        assert!(p.allocate(4).is_none());
        assert_eq!(p.num_free(), 3);
        let a = p.allocate(3).unwrap();
        assert_eq!(a.len(), 3);
        assert!(p.allocate(1).is_none());
    }

    #[test]
    fn cached_blocks_match_until_evicted_lru() {
        let mut p = BlockPool::new(3);
        let a = p.allocate(2).unwrap();
        p.register(a[0], h(1));
        p.register(a[1], h(2));
        p.release(&a);
        assert_eq!(p.num_free(), 3);
        let m = p.match_prefix(&[h(1), h(2), h(3)]);
        assert_eq!(m, a);
        assert_eq!(p.ref_count(a[0]), 1);
        p.release(&m);
        // released in reverse: block of h(2) first, so it is evicted first after the plain one.
        let x = p.allocate(2).unwrap();
        assert!(x.contains(&a[1]));
        assert_eq!(p.match_prefix(&[h(1)]), vec![a[0]]);
        assert!(p.match_prefix(&[h(2)]).is_empty());
    }

    #[test]
    fn blocks_in_use_are_never_allocated() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(1).unwrap();
        p.register(a[0], h(9));
        let m = p.match_prefix(&[h(9)]);
        assert_eq!(m, a);
        p.release(&a);
        // still referenced once by `m`
        let b = p.allocate(1).unwrap();
        assert_ne!(b, a);
        assert!(p.allocate(1).is_none());
    }

    #[test]
    fn duplicate_registration_keeps_first() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(2).unwrap();
        p.register(a[0], h(5));
        p.register(a[1], h(5));
        p.release(&a);
        assert_eq!(p.match_prefix(&[h(5)]), vec![a[0]]);
    }

    #[test]
    fn reset_forgets_hashes() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(1).unwrap();
        p.register(a[0], h(5));
        p.release(&a);
        p.reset_prefix_cache();
        assert!(p.match_prefix(&[h(5)]).is_empty());
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.num_cached(), 0);
    }
}
