//! Property tests: random operation sequences on `BlockPool` against a plain reference model.
//!
//! Checked after every operation: each block's state and pin count equal the model's; no block
//! is both free and registered; the registry maps exactly the model's hashes; capacity is
//! conserved (free + evictable + pinned == capacity); the eviction order is (priority, last use);
//! allocation takes never-registered free blocks first and evicts exactly the lowest
//! (priority, last use) unpinned blocks; pinned blocks are never evicted; events match.
#![allow(clippy::unwrap_used)]
use std::collections::{BTreeMap, HashMap};

use kvtier::hash::SequenceHash;
use kvtier::pool::{BlockPool, BlockState, PoolError, PoolEvent, Priority};
use kvtier::{BlockId, Tier};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
enum MState {
    Free,
    Writing,
    Registered { hash: u128, prio: u32 },
}

struct Model {
    state: Vec<MState>,
    pins: Vec<u32>,
    last_use: Vec<u64>,
    tick: u64,
    by_hash: HashMap<u128, u32>,
}

impl Model {
    fn new(n: usize) -> Self {
        Model {
            state: vec![MState::Free; n],
            pins: vec![0; n],
            last_use: vec![0; n],
            tick: 0,
            by_hash: HashMap::new(),
        }
    }
    fn free_count(&self) -> usize {
        self.state.iter().filter(|s| **s == MState::Free).count()
    }
    /// Evictable blocks sorted by (priority, last use).
    fn evictable(&self) -> Vec<u32> {
        let mut v: Vec<(u32, u64, u32)> = (0..self.state.len())
            .filter_map(|b| match self.state[b] {
                MState::Registered { prio, .. } if self.pins[b] == 0 => {
                    Some((prio, self.last_use[b], b as u32))
                }
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, _, b)| b).collect()
    }
    fn unpin(&mut self, b: usize) {
        self.pins[b] -= 1;
        if self.pins[b] == 0 {
            match self.state[b] {
                MState::Writing => self.state[b] = MState::Free,
                MState::Registered { .. } => {
                    self.tick += 1;
                    self.last_use[b] = self.tick;
                }
                MState::Free => unreachable!(),
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Register { pick: usize, hash: u128, prio: u32 },
    Release(usize),
    Pin(usize),
    Match(Vec<u128>),
    Invalidate(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..5).prop_map(Op::Allocate),
        4 => (any::<usize>(), 0u128..12, 0u32..3).prop_map(|(pick, hash, prio)| Op::Register { pick, hash, prio }),
        4 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Pin),
        2 => proptest::collection::vec(0u128..12, 0..6).prop_map(Op::Match),
        1 => any::<usize>().prop_map(Op::Invalidate),
    ]
}

fn key(h: u128) -> SequenceHash {
    // Spread the small ids over the whole key space; keep them distinct.
    SequenceHash(h.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ 0x1234)
}

fn check(pool: &BlockPool, m: &Model) -> Result<(), TestCaseError> {
    let n = m.state.len();
    let mut registered = 0;
    for b in 0..n {
        let id = BlockId(b as u32);
        let st = pool.state(id).unwrap();
        prop_assert_eq!(pool.pin_count(id), Some(m.pins[b]), "pins of {}", b);
        match m.state[b] {
            MState::Free => {
                prop_assert_eq!(st, BlockState::Free);
                prop_assert_eq!(pool.hash_of(id), None);
            }
            MState::Writing => {
                prop_assert_eq!(st, BlockState::Writing);
                prop_assert!(m.pins[b] > 0);
                prop_assert_eq!(pool.hash_of(id), None);
            }
            MState::Registered { hash, prio } => {
                registered += 1;
                prop_assert_eq!(st, BlockState::Registered);
                prop_assert_eq!(pool.hash_of(id), Some(key(hash)));
                prop_assert_eq!(pool.lookup(key(hash)), Some(id));
                prop_assert_eq!(pool.priority_of(id), Some(Priority(prio)));
            }
        }
    }
    for h in 0u128..12 {
        let expect = m.by_hash.get(&h).map(|b| BlockId(*b));
        prop_assert_eq!(pool.lookup(key(h)), expect);
    }
    prop_assert_eq!(pool.num_registered(), registered);
    let evictable = m.evictable();
    prop_assert_eq!(pool.num_free(), m.free_count() + evictable.len());
    prop_assert_eq!(pool.num_evictable(), evictable.len());
    let pinned = m.pins.iter().filter(|p| **p > 0).count();
    prop_assert_eq!(pool.num_free() + pinned, pool.capacity());
    let order: Vec<u32> = pool.eviction_order().iter().map(|b| b.0).collect();
    prop_assert_eq!(order, evictable);
    Ok(())
}

fn run(capacity: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut pool = BlockPool::new(Tier::Host, capacity).unwrap();
    let mut m = Model::new(capacity);
    for op in ops {
        let mut expected_events = Vec::new();
        match op {
            Op::Allocate(k) => {
                let free = m.free_count();
                let evictable = m.evictable();
                match pool.allocate(k) {
                    Ok(blocks) => {
                        prop_assert!(k <= free + evictable.len());
                        prop_assert_eq!(blocks.len(), k);
                        let evict_n = k.saturating_sub(free);
                        let mut evicted: Vec<u32> = Vec::new();
                        for b in &blocks {
                            let i = b.0 as usize;
                            match m.state[i] {
                                MState::Free => {}
                                MState::Registered { hash, .. } if m.pins[i] == 0 => {
                                    evicted.push(b.0);
                                    m.by_hash.remove(&hash);
                                    expected_events.push(PoolEvent::Removed {
                                        hash: key(hash),
                                        tier: Tier::Host,
                                    });
                                }
                                other => prop_assert!(
                                    false,
                                    "allocated a busy block {} ({:?})",
                                    i,
                                    other
                                ),
                            }
                            m.state[i] = MState::Writing;
                            m.pins[i] = 1;
                        }
                        prop_assert_eq!(evicted, evictable[..evict_n].to_vec(), "eviction order");
                    }
                    Err(e) => {
                        prop_assert!(k > free + evictable.len());
                        let is_exhausted = matches!(e, PoolError::Exhausted { .. });
                        prop_assert!(is_exhausted);
                    }
                }
            }
            Op::Register { pick, hash, prio } => {
                let writing: Vec<usize> = (0..capacity)
                    .filter(|b| m.state[*b] == MState::Writing)
                    .collect();
                if writing.is_empty() {
                    continue;
                }
                let b = writing[pick % writing.len()];
                let got = pool
                    .register(BlockId(b as u32), key(hash), Priority(prio))
                    .unwrap();
                match m.by_hash.get(&hash).copied() {
                    Some(e) => {
                        prop_assert_eq!(got, BlockId(e));
                        let ei = e as usize;
                        m.pins[ei] += 1;
                        if let MState::Registered { prio: p, .. } = &mut m.state[ei] {
                            *p = (*p).max(prio);
                        }
                        m.unpin(b);
                    }
                    None => {
                        prop_assert_eq!(got, BlockId(b as u32));
                        m.state[b] = MState::Registered { hash, prio };
                        m.by_hash.insert(hash, b as u32);
                        expected_events.push(PoolEvent::Stored {
                            hash: key(hash),
                            tier: Tier::Host,
                        });
                    }
                }
            }
            Op::Release(pick) => {
                let b = pick % capacity.max(1);
                let r = pool.release(BlockId(b as u32));
                if capacity == 0 {
                    prop_assert!(r.is_err());
                } else if m.pins[b] == 0 {
                    prop_assert_eq!(
                        r,
                        Err(PoolError::NotPinned {
                            tier: Tier::Host,
                            block: BlockId(b as u32)
                        })
                    );
                } else {
                    prop_assert!(r.is_ok());
                    m.unpin(b);
                }
            }
            Op::Pin(pick) => {
                let b = pick % capacity.max(1);
                let r = pool.pin(BlockId(b as u32));
                if capacity == 0 || m.state[b] == MState::Free {
                    prop_assert!(r.is_err());
                } else {
                    prop_assert!(r.is_ok());
                    m.pins[b] += 1;
                }
            }
            Op::Match(hs) => {
                let keys: Vec<SequenceHash> = hs.iter().map(|h| key(*h)).collect();
                let peek = pool.peek_prefix(&keys);
                let got = pool.match_prefix(&keys);
                let mut expect = Vec::new();
                for h in &hs {
                    match m.by_hash.get(h) {
                        Some(b) => expect.push(BlockId(*b)),
                        None => break,
                    }
                }
                prop_assert_eq!(peek, expect.len());
                prop_assert_eq!(&got, &expect);
                for b in got {
                    m.pins[b.0 as usize] += 1;
                }
            }
            Op::Invalidate(pick) => {
                let b = pick % capacity.max(1);
                let r = pool.invalidate(BlockId(b as u32));
                if capacity == 0 {
                    prop_assert!(r.is_err());
                    continue;
                }
                prop_assert!(r.is_ok());
                if let MState::Registered { hash, .. } = m.state[b] {
                    m.by_hash.remove(&hash);
                    expected_events.push(PoolEvent::Removed {
                        hash: key(hash),
                        tier: Tier::Host,
                    });
                    m.state[b] = if m.pins[b] == 0 {
                        MState::Free
                    } else {
                        MState::Writing
                    };
                }
            }
        }
        prop_assert_eq!(pool.take_events(), expected_events);
        check(&pool, &m)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn pool_matches_reference_model(capacity in 0usize..10, ops in proptest::collection::vec(op(), 0..120)) {
        run(capacity, ops)?;
    }
}

/// Pinned blocks survive any amount of allocation pressure.
#[test]
fn pinned_blocks_survive_pressure() {
    let mut pool = BlockPool::new(Tier::Disk, 8).unwrap();
    let blocks = pool.allocate(8).unwrap();
    for (i, b) in blocks.iter().enumerate() {
        pool.register(*b, key(i as u128), Priority(0)).unwrap();
    }
    // Keep blocks 0 and 5 pinned; release the rest.
    for (i, b) in blocks.iter().enumerate() {
        if i != 0 && i != 5 {
            pool.release(*b).unwrap();
        }
    }
    let mut seen = BTreeMap::new();
    for round in 0..50 {
        let got = pool.allocate(6).unwrap();
        for b in &got {
            assert_ne!(*b, blocks[0]);
            assert_ne!(*b, blocks[5]);
            *seen.entry(b.0).or_insert(0) += 1;
            pool.release(*b).unwrap();
        }
        assert_eq!(pool.lookup(key(0)), Some(blocks[0]), "round {round}");
        assert_eq!(pool.lookup(key(5)), Some(blocks[5]));
    }
    assert_eq!(seen.len(), 6);
}
