//! Unit tests of [`super::BlockPool`]: pin counts, registration, eviction order and the
//! states a block can be in.
#![allow(clippy::unwrap_used)]
use super::*;

fn h(i: u128) -> SequenceHash {
    SequenceHash(0xA5A5_0000_0000_0000_0000_0000_0000_0000 | i)
}

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().copied().map(BlockId).collect()
}

/// The blocks the pins name, in order.
fn blocks_of(pins: &[Pinned]) -> Vec<BlockId> {
    pins.iter().map(Pinned::block).collect()
}

/// Give back every pin.
fn release_all(p: &mut BlockPool, pins: Vec<Pinned>) {
    for pin in pins {
        p.release(pin).unwrap();
    }
}

/// The `Reserved` token of an `Allocated` reservation.
fn allocated(r: Reservation) -> Reserved {
    match r {
        Reservation::Allocated(res) => res,
        other => panic!("{other:?}"),
    }
}

/// Allocate one block per hash, register it, release it. Returns the block ids.
fn fill(p: &mut BlockPool, hashes: &[SequenceHash], prio: Priority) -> Vec<BlockId> {
    let pins = p.allocate(hashes.len()).unwrap();
    let mut out = Vec::new();
    for (mut pin, hh) in pins.into_iter().zip(hashes) {
        let got = p.register(&mut pin, *hh, prio).unwrap();
        assert_eq!(got, pin.block());
        p.release(pin).unwrap();
        out.push(got);
    }
    out
}

#[test]
fn fresh_pool_hands_out_ids_in_order_all_or_nothing() {
    let mut p = BlockPool::new(Tier::Host, 4).unwrap();
    assert_eq!(p.capacity(), 4);
    assert_eq!(p.num_free(), 4);
    let pins = p.allocate(3).unwrap();
    assert_eq!(blocks_of(&pins), ids(&[0, 1, 2]));
    assert!(pins.iter().all(|pin| pin.tier() == Tier::Host));
    assert_eq!(p.num_free(), 1);
    assert_eq!(p.num_pinned(), 3);
    let err = p.allocate(2).unwrap_err();
    assert_eq!(
        err,
        PoolError::Exhausted {
            tier: Tier::Host,
            requested: 2,
            available: 1
        }
    );
    assert_eq!(p.num_free(), 1, "a failed allocate changes nothing");
    for b in 0..3 {
        assert_eq!(p.state(BlockId(b)), Some(BlockState::Writing));
        assert_eq!(p.pin_count(BlockId(b)), Some(1));
    }
    release_all(&mut p, pins);
    assert_eq!(p.num_free(), 4);
}

/// Regression (#13, aborts): a pool of the largest accepted capacity (and
/// `Leader({"host.num_blocks": 5e8})` on a small machine) aborted the process on a failed
/// allocation of its books; it is a typed error before anything is touched.
#[test]
fn pool_larger_than_memory_is_a_typed_error_not_an_abort() {
    let err = BlockPool::new(Tier::Host, MAX_POOL_BLOCKS).unwrap_err();
    match err {
        PoolError::OutOfMemory {
            tier: Tier::Host,
            requested,
            bytes,
            ..
        } => {
            assert_eq!(requested, MAX_POOL_BLOCKS);
            assert!(bytes > 40 * MAX_POOL_BLOCKS, "{bytes}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err_text(Tier::Host, MAX_POOL_BLOCKS).contains("lower the tier's num_blocks"));
}

fn err_text(tier: Tier, n: usize) -> String {
    BlockPool::new(tier, n).unwrap_err().to_string()
}

#[test]
fn heap_bytes_for_matches_a_real_pool() {
    let p = BlockPool::new(Tier::Host, 1000).unwrap();
    let est = BlockPool::heap_bytes_for(1000);
    let real = p.heap_bytes();
    assert!(
        est >= real * 9 / 10 && est <= real * 11 / 10,
        "{est} vs {real}"
    );
}

#[test]
fn capacity_limit_is_an_error() {
    let err = BlockPool::new(Tier::Disk, MAX_POOL_BLOCKS + 1).unwrap_err();
    assert!(matches!(
        err,
        PoolError::CapacityTooLarge {
            tier: Tier::Disk,
            ..
        }
    ));
}

#[test]
fn register_publishes_and_emits_stored() {
    let mut p = BlockPool::new(Tier::Host, 4).unwrap();
    let mut pin = p.allocate(1).unwrap().remove(0);
    let b = pin.block();
    assert_eq!(p.lookup(h(1)), None);
    assert_eq!(p.register(&mut pin, h(1), Priority(3)).unwrap(), b);
    assert_eq!(pin.block(), b);
    assert_eq!(p.lookup(h(1)), Some(b));
    assert_eq!(p.hash_of(b), Some(h(1)));
    assert_eq!(p.priority_of(b), Some(Priority(3)));
    assert_eq!(p.num_registered(), 1);
    assert_eq!(
        p.take_events(),
        vec![PoolEvent::Stored {
            hash: h(1),
            tier: Tier::Host
        }]
    );
    assert!(p.take_events().is_empty());
    // Still pinned by the writer: not evictable.
    assert_eq!(p.num_evictable(), 0);
    p.release(pin).unwrap();
    assert_eq!(p.num_evictable(), 1);
    assert_eq!(p.num_free(), 4);
    // Registering again under the same hash is idempotent; another hash is an error.
    let mut pin = p.pin(b).unwrap();
    assert_eq!(p.register(&mut pin, h(1), Priority(0)).unwrap(), b);
    assert!(matches!(
        p.register(&mut pin, h(2), Priority(0)),
        Err(PoolError::AlreadyRegistered { .. })
    ));
    assert_eq!(
        pin.block(),
        b,
        "a refused register leaves the pin where it was"
    );
    p.release(pin).unwrap();
    assert_eq!(p.num_pinned(), 0);
}

#[test]
fn duplicate_hash_moves_the_pin_and_frees_the_new_block() {
    let mut p = BlockPool::new(Tier::Host, 4).unwrap();
    let first = fill(&mut p, &[h(7)], Priority(1))[0];
    p.take_events();
    let mut pin = p.allocate(1).unwrap().remove(0);
    let dup = pin.block();
    assert_ne!(dup, first);
    let got = p.register(&mut pin, h(7), Priority(5)).unwrap();
    assert_eq!(got, first);
    assert_eq!(pin.block(), first, "the pin moved to the registered block");
    assert_eq!(p.pin_count(first), Some(1));
    assert_eq!(p.state(dup), Some(BlockState::Free));
    assert_eq!(p.pin_count(dup), Some(0));
    assert_eq!(
        p.priority_of(first),
        Some(Priority(5)),
        "higher priority wins"
    );
    assert_eq!(p.num_registered(), 1);
    assert!(p.take_events().is_empty(), "no Stored for a duplicate");
    p.release(pin).unwrap();
    assert_eq!(p.num_free(), 4);
}

#[test]
fn free_blocks_go_before_registered_ones_then_priority_then_lru() {
    let mut p = BlockPool::new(Tier::Host, 5).unwrap();
    // Blocks 0..4 registered: 0 (prio 2), 1 (prio 1), 2 (prio 2), 3 (prio 1); 4 stays free.
    let mut pins: Vec<Option<Pinned>> = p.allocate(4).unwrap().into_iter().map(Some).collect();
    let prios = [2, 1, 2, 1];
    for (i, pin) in pins.iter_mut().enumerate() {
        let pin = pin.as_mut().unwrap();
        p.register(pin, h(i as u128), Priority(prios[i])).unwrap();
    }
    // Release in the order 3, 0, 1, 2: last use order.
    for b in [3, 0, 1, 2] {
        p.release(pins[b].take().unwrap()).unwrap();
    }
    p.take_events();
    assert_eq!(p.eviction_order(), ids(&[3, 1, 0, 2]));
    // First allocation takes the never-registered free block 4.
    assert_eq!(blocks_of(&p.allocate(1).unwrap()), ids(&[4]));
    assert!(p.take_events().is_empty());
    // Then (priority, last use): 3, 1, 0.
    assert_eq!(blocks_of(&p.allocate(3).unwrap()), ids(&[3, 1, 0]));
    assert_eq!(
        p.take_events(),
        vec![
            PoolEvent::Removed {
                hash: h(3),
                tier: Tier::Host
            },
            PoolEvent::Removed {
                hash: h(1),
                tier: Tier::Host
            },
            PoolEvent::Removed {
                hash: h(0),
                tier: Tier::Host
            },
        ]
    );
    assert_eq!(p.lookup(h(3)), None);
    assert_eq!(p.lookup(h(2)), Some(BlockId(2)));
    assert_eq!(p.num_registered(), 1);
    assert_eq!(p.num_free(), 1);
}

/// A warm restart's blocks: adopted into a fresh pool, registered and evictable; free
/// blocks keep coming lowest first; taken blocks and known hashes are skipped.
#[test]
fn adopt_registers_kept_blocks() {
    let mut p = BlockPool::new(Tier::Disk, 6).unwrap();
    let n = p.adopt(
        &[
            (h(1), BlockId(4)),
            (h(2), BlockId(1)),
            (h(1), BlockId(2)),
            (h(3), BlockId(4)),
            (h(4), BlockId(6)),
        ],
        Priority(0),
    );
    assert_eq!(n, 2);
    assert_eq!(p.lookup(h(1)), Some(BlockId(4)));
    assert_eq!(p.lookup(h(2)), Some(BlockId(1)));
    assert_eq!(
        (p.num_registered(), p.num_evictable(), p.num_pinned()),
        (2, 2, 0)
    );
    assert_eq!(p.num_free(), 6);
    assert_eq!(p.eviction_order(), ids(&[4, 1]));
    assert_eq!(
        p.take_events(),
        vec![
            PoolEvent::Stored {
                hash: h(1),
                tier: Tier::Disk
            },
            PoolEvent::Stored {
                hash: h(2),
                tier: Tier::Disk
            },
        ]
    );
    assert_eq!(blocks_of(&p.allocate(4).unwrap()), ids(&[0, 2, 3, 5]));
    // Then the adopted blocks are evicted, oldest first.
    assert_eq!(blocks_of(&p.allocate(1).unwrap()), ids(&[4]));
    assert_eq!(p.lookup(h(1)), None);
}

#[test]
fn match_prefix_pins_and_touches() {
    let mut p = BlockPool::new(Tier::Disk, 4).unwrap();
    let blocks = fill(&mut p, &[h(0), h(1), h(2), h(3)], Priority(0));
    assert_eq!(p.peek_prefix(&[h(0), h(1), h(9), h(3)]), 2);
    assert_eq!(p.peek_prefix(&[h(9), h(0)]), 0);
    assert_eq!(p.peek_prefix(&[]), 0);
    let m = p.match_prefix(&[h(0), h(1), h(9), h(3)]);
    assert_eq!(blocks_of(&m), blocks[..2].to_vec());
    assert_eq!(p.pin_count(blocks[0]), Some(1));
    assert_eq!(p.pin_count(blocks[3]), Some(0));
    // Pinned blocks cannot be evicted: only 2 are available.
    assert_eq!(p.num_free(), 2);
    assert!(p.allocate(3).is_err());
    // Released matched blocks become the most recently used.
    release_all(&mut p, m);
    assert_eq!(p.eviction_order(), ids(&[2, 3, 0, 1]));
}

#[test]
fn pins_are_counted() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    let b = fill(&mut p, &[h(1)], Priority(0))[0];
    let first = p.pin(b).unwrap();
    let second = p.pin(b).unwrap();
    assert_eq!(p.pin_count(b), Some(2));
    p.release(first).unwrap();
    assert_eq!(
        p.allocate(2).unwrap_err(),
        PoolError::Exhausted {
            tier: Tier::Host,
            requested: 2,
            available: 1
        }
    );
    p.release(second).unwrap();
    assert_eq!(p.pin_count(b), Some(0));
    assert_eq!(p.allocate(2).unwrap().len(), 2);
}

/// A pool refuses another pool's token, even one naming a block it has, and is unchanged; the
/// token's own pool takes it back. A pool of the same tier is still another pool.
#[test]
fn foreign_tokens_are_refused() {
    let mut host = BlockPool::new(Tier::Host, 2).unwrap();
    let mut host2 = BlockPool::new(Tier::Host, 2).unwrap();
    let mut disk = BlockPool::new(Tier::Disk, 2).unwrap();
    let b = fill(&mut host, &[h(1)], Priority(0))[0];
    let _held = fill(&mut host2, &[h(1)], Priority(0));
    let pin = host.pin(b).unwrap();
    let before = format!("{:?}", (host2.eviction_order(), host2.pin_count(b)));
    assert_eq!(
        host2.release(pin),
        Err(PoolError::ForeignPin {
            tier: Tier::Host,
            block: b,
            from: Tier::Host
        })
    );
    assert_eq!(
        format!("{:?}", (host2.eviction_order(), host2.pin_count(b))),
        before
    );
    // The consumed token's pin stays in its own pool (the leak the error reports).
    assert_eq!(host.pin_count(b), Some(1));
    let mut pin = host.pin(b).unwrap();
    assert!(matches!(
        disk.register(&mut pin, h(2), Priority(0)),
        Err(PoolError::ForeignPin {
            tier: Tier::Disk,
            from: Tier::Host,
            ..
        })
    ));
    host.release(pin).unwrap();
    let res = allocated(host.reserve_one(h(3)));
    assert!(matches!(
        disk.confirm(res, Priority(0)),
        Err(PoolError::ForeignPin { .. })
    ));
    assert_eq!(disk.num_registered(), 0);
    assert!(disk.take_events().is_empty());
    assert_eq!(host.num_reserved(), 1, "still reserved in its own pool");
}

#[test]
fn errors_name_the_block() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    assert_eq!(
        p.pin(BlockId(5)),
        Err(PoolError::UnknownBlock {
            tier: Tier::Host,
            block: BlockId(5),
            capacity: 2
        })
    );
    assert_eq!(
        p.pin(BlockId(1)),
        Err(PoolError::BlockFree {
            tier: Tier::Host,
            block: BlockId(1)
        })
    );
    assert_eq!(p.hash_of(BlockId(9)), None);
    let msg = PoolError::ForeignPin {
        tier: Tier::Disk,
        block: BlockId(3),
        from: Tier::Host,
    }
    .to_string();
    assert!(
        msg.contains("Disk") && msg.contains("BlockId(3)") && msg.contains("Host"),
        "{msg}"
    );
}

#[test]
fn unregistered_release_frees() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    let pin = p.allocate(1).unwrap().remove(0);
    let b = pin.block();
    p.release(pin).unwrap();
    assert_eq!(p.state(b), Some(BlockState::Free));
    assert_eq!(p.num_free(), 2);
    assert_eq!(p.num_registered(), 0);
}

#[test]
fn invalidate_unpublishes() {
    let mut p = BlockPool::new(Tier::Disk, 3).unwrap();
    let blocks = fill(&mut p, &[h(1), h(2)], Priority(0));
    p.take_events();
    p.invalidate(blocks[0]).unwrap();
    assert_eq!(p.lookup(h(1)), None);
    assert_eq!(p.state(blocks[0]), Some(BlockState::Free));
    assert_eq!(
        p.take_events(),
        vec![PoolEvent::Removed {
            hash: h(1),
            tier: Tier::Disk
        }]
    );
    // Pinned: stays out of the free list until released.
    let pin = p.pin(blocks[1]).unwrap();
    p.invalidate(blocks[1]).unwrap();
    assert_eq!(p.lookup(h(2)), None);
    assert_eq!(p.state(blocks[1]), Some(BlockState::Writing));
    assert_eq!(p.num_free(), 2);
    p.release(pin).unwrap();
    assert_eq!(p.state(blocks[1]), Some(BlockState::Free));
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.num_registered(), 0);
}

#[test]
fn events_can_be_turned_off() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    p.set_record_events(false);
    fill(&mut p, &[h(1), h(2)], Priority(0));
    let a = p.allocate(1).unwrap();
    assert!(p.take_events().is_empty());
    p.set_record_events(true);
    let b = p.allocate(1).unwrap();
    assert_eq!(p.take_events().len(), 1);
    release_all(&mut p, a);
    release_all(&mut p, b);
}

#[test]
fn reserve_dedups_hides_and_confirm_publishes() {
    let mut p = BlockPool::new(Tier::Host, 3).unwrap();
    let old = fill(&mut p, &[h(1)], Priority(0))[0];
    p.take_events();
    let mut r = Vec::new();
    p.reserve(&[h(1), h(2), h(2), h(3), h(4)], &mut r);
    let mut r = r.into_iter();
    assert_eq!(r.next(), Some(Reservation::Registered(old)));
    let r2 = allocated(r.next().unwrap());
    let b2 = r2.block();
    assert_eq!(r.next(), Some(Reservation::Writing(b2)));
    let r3 = allocated(r.next().unwrap());
    let b3 = r3.block();
    // The only evictable block is h(1)'s, and h(4) takes it.
    let r4 = allocated(r.next().unwrap());
    assert_eq!(r4.block(), old);
    assert_eq!(r.next(), None);
    assert_eq!(p.num_reserved(), 3);
    assert_eq!(p.num_registered(), 0);
    assert_eq!(p.lookup(h(2)), None, "a reservation is not a registration");
    assert_eq!(p.peek_prefix(&[h(2)]), 0);
    assert_eq!(p.reserved_block(h(2)), Some(b2));
    assert_eq!(
        p.take_events(),
        vec![PoolEvent::Removed {
            hash: h(1),
            tier: Tier::Host
        }]
    );
    // Nothing is left to allocate; another hash gets no space.
    assert_eq!(p.reserve_one(h(5)), Reservation::NoSpace);
    // Confirm publishes without a second store and hands back the pin; a failed write frees
    // its block.
    let (pin2, hash) = p.confirm(r2, Priority(4)).unwrap();
    assert_eq!((pin2.block(), hash), (b2, h(2)));
    assert_eq!(p.lookup(h(2)), Some(b2));
    assert_eq!(p.priority_of(b2), Some(Priority(4)));
    assert_eq!(p.pin_count(b2), Some(1), "the writer keeps its pin");
    assert_eq!(
        p.take_events(),
        vec![PoolEvent::Stored {
            hash: h(2),
            tier: Tier::Host
        }]
    );
    p.release(pin2).unwrap();
    assert_eq!(p.num_evictable(), 1);
    p.abort(r3).unwrap();
    assert_eq!(p.state(b3), Some(BlockState::Free));
    assert_eq!(p.reserved_block(h(3)), None);
    assert!(
        p.take_events().is_empty(),
        "an unconfirmed write was never stored"
    );
    // `register` cannot take a reserved hash, and a reserved block takes no other pin: its
    // token is its only one.
    let mut other = p.allocate(1).unwrap().remove(0);
    assert!(matches!(
        p.register(&mut other, h(4), Priority(0)),
        Err(PoolError::Reserved { .. })
    ));
    p.release(other).unwrap();
    assert_eq!(
        p.pin(old),
        Err(PoolError::Reserved {
            tier: Tier::Host,
            block: old,
            hash: h(4).0
        })
    );
    assert_eq!((p.pin_count(old), p.num_reserved()), (Some(1), 1));
    p.abort(r4).unwrap();
    assert_eq!(p.reserved_block(h(4)), None);
    assert_eq!(p.state(old), Some(BlockState::Free));
    assert_eq!(p.num_reserved(), 0);
    // `confirm_and_release` publishes and gives the pin back in one call.
    let r5 = allocated(p.reserve_one(h(5)));
    let b5 = r5.block();
    assert_eq!(p.confirm_and_release(r5, Priority(1)), Ok(h(5)));
    assert_eq!((p.lookup(h(5)), p.pin_count(b5)), (Some(b5), Some(0)));
    assert_eq!(p.num_pinned(), 0);
}

#[test]
fn zero_capacity_pool() {
    let mut p = BlockPool::new(Tier::Remote, 0).unwrap();
    assert!(p.allocate(0).unwrap().is_empty());
    assert!(p.allocate(1).is_err());
    assert_eq!(p.peek_prefix(&[h(1)]), 0);
}
