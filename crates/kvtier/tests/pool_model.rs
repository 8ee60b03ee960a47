//! Property tests: random operation sequences on `BlockPool` against a plain reference model.
//!
//! Checked after every operation: each block's state and pin count equal the model's; no block
//! is both free and registered; the registry maps exactly the model's hashes; capacity is
//! conserved (free + evictable + pinned == capacity); the eviction order is (priority, last use);
//! allocation takes never-registered free blocks first and evicts exactly the lowest
//! (priority, last use) unpinned blocks; pinned blocks are never evicted; events match.
//! Reservations (`reserve`, `confirm`) are modelled as their own state: hidden from lookups,
//! published by `confirm`, dropped when aborted unconfirmed; a batch `reserve` behaves exactly
//! as the same hashes passed one by one to `reserve_one`.
//! The test holds every token the pool hands out (`Pinned`, `Reserved`) and gives pins back only
//! through them: after every operation each block's pin count equals the number of tokens held
//! on it, and once every token is given back nothing is pinned or reserved.
#![allow(clippy::unwrap_used)]
use std::collections::{BTreeMap, HashMap};

use kvtier::hash::SequenceHash;
use kvtier::pool::{
    BlockPool, BlockState, Pinned, PoolError, PoolEvent, Priority, Reservation, Reserved,
};
use kvtier::{BlockId, Tier};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
enum MState {
    Free,
    Writing,
    /// `Writing`, with its hash reserved.
    Reserved {
        hash: u128,
    },
    Registered {
        hash: u128,
        prio: u32,
    },
}

struct Model {
    state: Vec<MState>,
    pins: Vec<u32>,
    last_use: Vec<u64>,
    tick: u64,
    by_hash: HashMap<u128, u32>,
    reserved: HashMap<u128, u32>,
}

impl Model {
    fn new(n: usize) -> Self {
        Model {
            state: vec![MState::Free; n],
            pins: vec![0; n],
            last_use: vec![0; n],
            tick: 0,
            by_hash: HashMap::new(),
            reserved: HashMap::new(),
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
    /// The reservation of `hash` in block `b` becomes a registration; returns its event.
    fn publish(&mut self, b: usize, hash: u128, prio: u32) -> PoolEvent {
        self.reserved.remove(&hash);
        self.state[b] = MState::Registered { hash, prio };
        self.by_hash.insert(hash, b as u32);
        PoolEvent::Stored {
            hash: key(hash),
            tier: Tier::Host,
        }
    }
    fn unpin(&mut self, b: usize) {
        self.pins[b] -= 1;
        if self.pins[b] == 0 {
            match self.state[b] {
                MState::Writing => self.state[b] = MState::Free,
                MState::Reserved { hash } => {
                    self.reserved.remove(&hash);
                    self.state[b] = MState::Free;
                }
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
    /// `register` through the picked held pin.
    Register {
        pick: usize,
        hash: u128,
        prio: u32,
    },
    /// Give back the picked token: a held pin (`release`) or a reservation (`abort`).
    Release(usize),
    Pin(usize),
    Match(Vec<u128>),
    Invalidate(usize),
    /// `reserve` of the hashes (as one batch, or one by one with `reserve_one`).
    Reserve {
        hashes: Vec<u128>,
        batch: bool,
    },
    /// `confirm` of the picked reservation, or (`release`) `confirm_and_release`.
    Confirm {
        pick: usize,
        prio: u32,
        release: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..5).prop_map(Op::Allocate),
        4 => (any::<usize>(), 0u128..12, 0u32..3).prop_map(|(pick, hash, prio)| Op::Register { pick, hash, prio }),
        4 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Pin),
        2 => proptest::collection::vec(0u128..12, 0..6).prop_map(Op::Match),
        1 => any::<usize>().prop_map(Op::Invalidate),
        3 => (proptest::collection::vec(0u128..12, 0..20), any::<bool>())
            .prop_map(|(hashes, batch)| Op::Reserve { hashes, batch }),
        3 => (any::<usize>(), 0u32..3, any::<bool>())
            .prop_map(|(pick, prio, release)| Op::Confirm { pick, prio, release }),
    ]
}

fn key(h: u128) -> SequenceHash {
    // Spread the small ids over the whole key space; keep them distinct.
    SequenceHash(h.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ 0x1234)
}

/// Every token the test holds.
#[derive(Default)]
struct Tokens {
    pins: Vec<Pinned>,
    reservations: Vec<Reserved>,
}

impl Tokens {
    /// Tokens held on `b`.
    fn on(&self, b: BlockId) -> u32 {
        let p = self.pins.iter().filter(|t| t.block() == b).count();
        let r = self.reservations.iter().filter(|t| t.block() == b).count();
        (p + r) as u32
    }
    /// Give every token back; the pool must then have nothing pinned or reserved.
    fn give_back(self, pool: &mut BlockPool) -> Result<(), TestCaseError> {
        for pin in self.pins {
            prop_assert_eq!(pool.release(pin), Ok(()));
        }
        for r in self.reservations {
            prop_assert_eq!(pool.abort(r), Ok(()));
        }
        prop_assert_eq!(pool.num_pinned(), 0);
        prop_assert_eq!(pool.num_reserved(), 0);
        prop_assert_eq!(pool.num_free(), pool.capacity());
        Ok(())
    }
}

fn check(pool: &BlockPool, m: &Model, t: &Tokens) -> Result<(), TestCaseError> {
    let n = m.state.len();
    let mut registered = 0;
    for b in 0..n {
        let id = BlockId(b as u32);
        let st = pool.state(id).unwrap();
        prop_assert_eq!(pool.pin_count(id), Some(m.pins[b]), "pins of {}", b);
        prop_assert_eq!(t.on(id), m.pins[b], "tokens held on {}", b);
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
            MState::Reserved { hash } => {
                prop_assert_eq!(st, BlockState::Writing);
                prop_assert!(m.pins[b] > 0);
                prop_assert_eq!(pool.hash_of(id), None);
                prop_assert_eq!(pool.lookup(key(hash)), None);
                prop_assert_eq!(pool.reserved_block(key(hash)), Some(id));
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
    prop_assert_eq!(pool.num_reserved(), m.reserved.len());
    for h in 0u128..12 {
        let expect = m.reserved.get(&h).map(|b| BlockId(*b));
        prop_assert_eq!(pool.reserved_block(key(h)), expect);
    }
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
    let mut t = Tokens::default();
    for op in ops {
        let mut expected_events = Vec::new();
        match op {
            Op::Allocate(k) => {
                let free = m.free_count();
                let evictable = m.evictable();
                match pool.allocate(k) {
                    Ok(pins) => {
                        prop_assert!(k <= free + evictable.len());
                        prop_assert_eq!(pins.len(), k);
                        let evict_n = k.saturating_sub(free);
                        let mut evicted: Vec<u32> = Vec::new();
                        for pin in &pins {
                            let b = pin.block();
                            prop_assert_eq!(pin.tier(), Tier::Host);
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
                        t.pins.extend(pins);
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
                if t.pins.is_empty() {
                    continue;
                }
                let k = pick % t.pins.len();
                let b = t.pins[k].block().0 as usize;
                let r = pool.register(&mut t.pins[k], key(hash), Priority(prio));
                let me = BlockId(b as u32);
                let refused = |r: &Result<BlockId, PoolError>, e: PoolError| {
                    prop_assert_eq!(r, &Err(e));
                    Ok(())
                };
                match m.state[b] {
                    MState::Free => prop_assert!(false, "a held pin on a free block"),
                    // A reservation's token is its only pin: no `Pinned` names it.
                    MState::Reserved { .. } => prop_assert!(false, "a Pinned on a reserved block"),
                    MState::Registered { hash: held, .. } if held == hash => {
                        prop_assert_eq!(&r, &Ok(me));
                    }
                    MState::Registered { hash: held, .. } => refused(
                        &r,
                        PoolError::AlreadyRegistered {
                            tier: Tier::Host,
                            block: me,
                            existing: key(held).0,
                            requested: key(hash).0,
                        },
                    )?,
                    MState::Writing => {
                        if let Some(&owner) = m.reserved.get(&hash) {
                            refused(
                                &r,
                                PoolError::Reserved {
                                    tier: Tier::Host,
                                    block: BlockId(owner),
                                    hash: key(hash).0,
                                },
                            )?;
                        } else if let Some(e) = m.by_hash.get(&hash).copied() {
                            prop_assert_eq!(&r, &Ok(BlockId(e)));
                            let ei = e as usize;
                            m.pins[ei] += 1;
                            if let MState::Registered { prio: p, .. } = &mut m.state[ei] {
                                *p = (*p).max(prio);
                            }
                            m.unpin(b);
                        } else {
                            prop_assert_eq!(&r, &Ok(me));
                            m.state[b] = MState::Registered { hash, prio };
                            m.by_hash.insert(hash, b as u32);
                            expected_events.push(PoolEvent::Stored {
                                hash: key(hash),
                                tier: Tier::Host,
                            });
                        }
                    }
                }
                // The pin is where `register` said the hash now is (or stayed on refusal).
                let now = t.pins[k].block();
                prop_assert!(r.as_ref().map_or(now == me, |got| *got == now));
            }
            Op::Release(pick) => {
                let n = t.pins.len() + t.reservations.len();
                if n == 0 {
                    continue;
                }
                let k = pick % n;
                let (b, r) = if k < t.pins.len() {
                    let pin = t.pins.swap_remove(k);
                    (pin.block(), pool.release(pin))
                } else {
                    let res = t.reservations.swap_remove(k - t.pins.len());
                    (res.block(), pool.abort(res))
                };
                prop_assert_eq!(r, Ok(()));
                m.unpin(b.0 as usize);
            }
            Op::Pin(pick) => {
                let b = pick % capacity.max(1);
                let r = pool.pin(BlockId(b as u32));
                if capacity == 0 || m.state[b] == MState::Free {
                    prop_assert!(r.is_err());
                } else if let MState::Reserved { hash } = m.state[b] {
                    // A reservation's token is its block's only pin.
                    prop_assert_eq!(
                        r,
                        Err(PoolError::Reserved {
                            tier: Tier::Host,
                            block: BlockId(b as u32),
                            hash: key(hash).0
                        })
                    );
                } else {
                    let pin = r.unwrap();
                    prop_assert_eq!(pin.block(), BlockId(b as u32));
                    t.pins.push(pin);
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
                let blocks: Vec<BlockId> = got.iter().map(Pinned::block).collect();
                prop_assert_eq!(&blocks, &expect);
                for b in blocks {
                    m.pins[b.0 as usize] += 1;
                }
                t.pins.extend(got);
            }
            Op::Reserve { hashes, batch } => {
                let keys: Vec<SequenceHash> = hashes.iter().map(|h| key(*h)).collect();
                let got: Vec<Reservation> = if batch {
                    let mut out = vec![Reservation::NoSpace]; // `reserve` appends
                    pool.reserve(&keys, &mut out);
                    out.split_off(1)
                } else {
                    keys.iter().map(|k| pool.reserve_one(*k)).collect()
                };
                prop_assert_eq!(got.len(), hashes.len());
                for (h, r) in hashes.iter().zip(got) {
                    if let Some(&b) = m.by_hash.get(h) {
                        prop_assert_eq!(r, Reservation::Registered(BlockId(b)));
                        continue;
                    }
                    if let Some(&b) = m.reserved.get(h) {
                        prop_assert_eq!(r, Reservation::Writing(BlockId(b)));
                        continue;
                    }
                    let free = m.free_count();
                    let evictable = m.evictable();
                    let Reservation::Allocated(res) = r else {
                        prop_assert_eq!(r, Reservation::NoSpace);
                        prop_assert_eq!(free + evictable.len(), 0);
                        continue;
                    };
                    let blk = res.block();
                    t.reservations.push(res);
                    let i = blk.0 as usize;
                    if free > 0 {
                        prop_assert_eq!(m.state[i], MState::Free, "free blocks first");
                    } else {
                        prop_assert_eq!(blk.0, evictable[0], "eviction order");
                        let MState::Registered { hash: old, .. } = m.state[i] else {
                            unreachable!()
                        };
                        m.by_hash.remove(&old);
                        expected_events.push(PoolEvent::Removed {
                            hash: key(old),
                            tier: Tier::Host,
                        });
                    }
                    m.state[i] = MState::Reserved { hash: *h };
                    m.pins[i] = 1;
                    m.reserved.insert(*h, blk.0);
                }
            }
            Op::Confirm {
                pick,
                prio,
                release,
            } => {
                if t.reservations.is_empty() {
                    continue;
                }
                let res = t.reservations.swap_remove(pick % t.reservations.len());
                let b = res.block().0 as usize;
                let MState::Reserved { hash } = m.state[b] else {
                    prop_assert!(false, "a held reservation on {:?}", m.state[b]);
                    unreachable!()
                };
                if release {
                    let r = pool.confirm_and_release(res, Priority(prio));
                    prop_assert_eq!(r, Ok(key(hash)));
                } else {
                    let (pin, got) = pool.confirm(res, Priority(prio)).unwrap();
                    prop_assert_eq!(got, key(hash));
                    prop_assert_eq!(pin.block(), BlockId(b as u32));
                    t.pins.push(pin);
                }
                expected_events.push(m.publish(b, hash, prio));
                if release {
                    m.unpin(b);
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
        check(&pool, &m, &t)?;
    }
    t.give_back(&mut pool)
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
    let mut kept = Vec::new();
    for (i, mut pin) in pool.allocate(8).unwrap().into_iter().enumerate() {
        pool.register(&mut pin, key(i as u128), Priority(0))
            .unwrap();
        // Keep blocks 0 and 5 pinned; release the rest.
        if i == 0 || i == 5 {
            kept.push(pin);
        } else {
            pool.release(pin).unwrap();
        }
    }
    let mut seen = BTreeMap::new();
    for round in 0..50 {
        for pin in pool.allocate(6).unwrap() {
            assert_ne!(pin.block(), kept[0].block());
            assert_ne!(pin.block(), kept[1].block());
            *seen.entry(pin.block().0).or_insert(0) += 1;
            pool.release(pin).unwrap();
        }
        assert_eq!(pool.lookup(key(0)), Some(kept[0].block()), "round {round}");
        assert_eq!(pool.lookup(key(5)), Some(kept[1].block()));
    }
    assert_eq!(seen.len(), 6);
}

/// One pool and the tokens it handed out (the batch-equivalence test drives two of them).
struct Held {
    pool: BlockPool,
    tokens: Tokens,
}

/// What a reservation answered, by block (tokens of two pools differ in their pool id).
fn reservation_str(r: &Reservation) -> String {
    match r {
        Reservation::Allocated(res) => format!("Allocated({:?})", res.block()),
        other => format!("{other:?}"),
    }
}

/// Applies `op` to `h`, with every `reserve` done as one batch (`batch_all`) or hash by hash,
/// and returns everything the call answered.
fn apply_op(h: &mut Held, op: &Op, batch_all: bool) -> String {
    let Held { pool, tokens: t } = h;
    let cap = pool.capacity().max(1);
    let pick = |p: usize| BlockId((p % cap) as u32);
    match op {
        Op::Allocate(k) => match pool.allocate(*k) {
            Ok(pins) => {
                let s = format!("{:?}", pins.iter().map(Pinned::block).collect::<Vec<_>>());
                t.pins.extend(pins);
                s
            }
            Err(e) => format!("{e:?}"),
        },
        Op::Register {
            pick: p,
            hash,
            prio,
        } => match t.pins.len() {
            0 => String::new(),
            n => {
                let pin = &mut t.pins[p % n];
                let r = pool.register(pin, key(*hash), Priority(*prio));
                format!("{r:?} {:?}", pin.block())
            }
        },
        Op::Release(p) => {
            let n = t.pins.len() + t.reservations.len();
            if n == 0 {
                return String::new();
            }
            let k = p % n;
            if k < t.pins.len() {
                format!("{:?}", pool.release(t.pins.swap_remove(k)))
            } else {
                let res = t.reservations.swap_remove(k - t.pins.len());
                format!("{:?}", pool.abort(res))
            }
        }
        Op::Pin(p) => match pool.pin(pick(*p)) {
            Ok(pin) => {
                let s = format!("{:?}", pin.block());
                t.pins.push(pin);
                s
            }
            Err(e) => format!("{e:?}"),
        },
        Op::Match(hs) => {
            let keys: Vec<SequenceHash> = hs.iter().map(|h| key(*h)).collect();
            let got = pool.match_prefix(&keys);
            let s = format!("{:?}", got.iter().map(Pinned::block).collect::<Vec<_>>());
            t.pins.extend(got);
            s
        }
        Op::Invalidate(p) => format!("{:?}", pool.invalidate(pick(*p))),
        Op::Reserve { hashes, .. } => {
            let keys: Vec<SequenceHash> = hashes.iter().map(|h| key(*h)).collect();
            let got: Vec<Reservation> = if batch_all {
                let mut out = Vec::new();
                pool.reserve(&keys, &mut out);
                out
            } else {
                keys.iter().map(|k| pool.reserve_one(*k)).collect()
            };
            let s: Vec<String> = got.iter().map(reservation_str).collect();
            for r in got {
                if let Reservation::Allocated(res) = r {
                    t.reservations.push(res);
                }
            }
            format!("{s:?}")
        }
        Op::Confirm {
            pick: p,
            prio,
            release,
        } => {
            if t.reservations.is_empty() {
                return String::new();
            }
            let res = t.reservations.swap_remove(p % t.reservations.len());
            if *release {
                format!("{:?}", pool.confirm_and_release(res, Priority(*prio)))
            } else {
                match pool.confirm(res, Priority(*prio)) {
                    Ok((pin, hash)) => {
                        let s = format!("{:?} {hash:?}", pin.block());
                        t.pins.push(pin);
                        s
                    }
                    Err(e) => format!("{e:?}"),
                }
            }
        }
    }
}

/// Every observable fact about `pool`.
fn snapshot(pool: &mut BlockPool) -> String {
    let blocks: Vec<_> = (0..pool.capacity() as u32)
        .map(BlockId)
        .map(|b| {
            (
                pool.state(b),
                pool.pin_count(b),
                pool.hash_of(b),
                pool.priority_of(b),
            )
        })
        .collect();
    let reserved: Vec<_> = (0u128..12).map(|h| pool.reserved_block(key(h))).collect();
    format!(
        "{blocks:?} {reserved:?} {:?} {:?} {} {} {}",
        pool.eviction_order(),
        pool.take_events(),
        pool.num_free(),
        pool.num_registered(),
        pool.num_reserved()
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// `reserve` of a batch is exactly `reserve_one` of each hash in turn: same answers, same
    /// evictions, same events, same state afterwards.
    #[test]
    fn batch_reserve_equals_single_reserves(capacity in 0usize..10, ops in proptest::collection::vec(op(), 0..120)) {
        let held = || Held {
            pool: BlockPool::new(Tier::Host, capacity).unwrap(),
            tokens: Tokens::default(),
        };
        let (mut batch, mut single) = (held(), held());
        for op in &ops {
            let a = apply_op(&mut batch, op, true);
            let b = apply_op(&mut single, op, false);
            prop_assert_eq!(a, b, "{:?}", op);
            prop_assert_eq!(snapshot(&mut batch.pool), snapshot(&mut single.pool));
        }
        batch.tokens.give_back(&mut batch.pool)?;
        single.tokens.give_back(&mut single.pool)?;
    }
}
