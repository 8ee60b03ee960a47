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

/// Allocate one block per hash, register it, release it. Returns the block ids.
fn fill(p: &mut BlockPool, hashes: &[SequenceHash], prio: Priority) -> Vec<BlockId> {
    let blocks = p.allocate(hashes.len()).unwrap();
    let mut out = Vec::new();
    for (b, hh) in blocks.iter().zip(hashes) {
        let got = p.register(*b, *hh, prio).unwrap();
        p.release(got).unwrap();
        out.push(got);
    }
    out
}

#[test]
fn fresh_pool_hands_out_ids_in_order_all_or_nothing() {
    let mut p = BlockPool::new(Tier::Host, 4).unwrap();
    assert_eq!(p.capacity(), 4);
    assert_eq!(p.num_free(), 4);
    assert_eq!(p.allocate(3).unwrap(), ids(&[0, 1, 2]));
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
    let b = p.allocate(1).unwrap()[0];
    assert_eq!(p.lookup(h(1)), None);
    assert_eq!(p.register(b, h(1), Priority(3)).unwrap(), b);
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
    p.release(b).unwrap();
    assert_eq!(p.num_evictable(), 1);
    assert_eq!(p.num_free(), 4);
    // Registering again under the same hash is idempotent; another hash is an error.
    p.pin(b).unwrap();
    assert_eq!(p.register(b, h(1), Priority(0)).unwrap(), b);
    assert!(matches!(
        p.register(b, h(2), Priority(0)),
        Err(PoolError::AlreadyRegistered { .. })
    ));
}

#[test]
fn duplicate_hash_moves_the_pin_and_frees_the_new_block() {
    let mut p = BlockPool::new(Tier::Host, 4).unwrap();
    let first = fill(&mut p, &[h(7)], Priority(1))[0];
    p.take_events();
    let dup = p.allocate(1).unwrap()[0];
    assert_ne!(dup, first);
    let got = p.register(dup, h(7), Priority(5)).unwrap();
    assert_eq!(got, first);
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
    p.release(first).unwrap();
    assert_eq!(p.num_free(), 4);
}

#[test]
fn free_blocks_go_before_registered_ones_then_priority_then_lru() {
    let mut p = BlockPool::new(Tier::Host, 5).unwrap();
    // Blocks 0..4 registered: 0 (prio 2), 1 (prio 1), 2 (prio 2), 3 (prio 1); 4 stays free.
    let blocks = p.allocate(4).unwrap();
    let prios = [2, 1, 2, 1];
    for (i, b) in blocks.iter().enumerate() {
        p.register(*b, h(i as u128), Priority(prios[i])).unwrap();
    }
    // Release in the order 3, 0, 1, 2: last use order.
    for b in [3, 0, 1, 2] {
        p.release(BlockId(b)).unwrap();
    }
    p.take_events();
    assert_eq!(p.eviction_order(), ids(&[3, 1, 0, 2]));
    // First allocation takes the never-registered free block 4.
    assert_eq!(p.allocate(1).unwrap(), ids(&[4]));
    assert!(p.take_events().is_empty());
    // Then (priority, last use): 3, 1, 0.
    assert_eq!(p.allocate(3).unwrap(), ids(&[3, 1, 0]));
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
    assert_eq!(p.allocate(4).unwrap(), ids(&[0, 2, 3, 5]));
    // Then the adopted blocks are evicted, oldest first.
    assert_eq!(p.allocate(1).unwrap(), ids(&[4]));
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
    assert_eq!(m, blocks[..2].to_vec());
    assert_eq!(p.pin_count(blocks[0]), Some(1));
    assert_eq!(p.pin_count(blocks[3]), Some(0));
    // Pinned blocks cannot be evicted: only 2 are available.
    assert_eq!(p.num_free(), 2);
    assert!(p.allocate(3).is_err());
    // Released matched blocks become the most recently used.
    for b in &m {
        p.release(*b).unwrap();
    }
    assert_eq!(p.eviction_order(), ids(&[2, 3, 0, 1]));
}

#[test]
fn pins_are_counted() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    let b = fill(&mut p, &[h(1)], Priority(0))[0];
    p.pin(b).unwrap();
    p.pin(b).unwrap();
    p.release(b).unwrap();
    assert_eq!(
        p.allocate(2).unwrap_err(),
        PoolError::Exhausted {
            tier: Tier::Host,
            requested: 2,
            available: 1
        }
    );
    p.release(b).unwrap();
    assert_eq!(
        p.release(b),
        Err(PoolError::NotPinned {
            tier: Tier::Host,
            block: b
        })
    );
    assert_eq!(p.allocate(2).unwrap().len(), 2);
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
    assert_eq!(
        p.register(BlockId(1), h(1), Priority(0)),
        Err(PoolError::NotWritable {
            tier: Tier::Host,
            block: BlockId(1)
        })
    );
    assert_eq!(p.hash_of(BlockId(9)), None);
    let msg = PoolError::NotPinned {
        tier: Tier::Disk,
        block: BlockId(3),
    }
    .to_string();
    assert!(msg.contains("Disk") && msg.contains("BlockId(3)"), "{msg}");
}

#[test]
fn unregistered_release_frees() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    let b = p.allocate(1).unwrap()[0];
    p.release(b).unwrap();
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
    p.pin(blocks[1]).unwrap();
    p.invalidate(blocks[1]).unwrap();
    assert_eq!(p.lookup(h(2)), None);
    assert_eq!(p.state(blocks[1]), Some(BlockState::Writing));
    assert_eq!(p.num_free(), 2);
    p.release(blocks[1]).unwrap();
    assert_eq!(p.state(blocks[1]), Some(BlockState::Free));
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.num_registered(), 0);
}

#[test]
fn events_can_be_turned_off() {
    let mut p = BlockPool::new(Tier::Host, 2).unwrap();
    p.set_record_events(false);
    fill(&mut p, &[h(1), h(2)], Priority(0));
    p.allocate(1).unwrap();
    assert!(p.take_events().is_empty());
    p.set_record_events(true);
    p.allocate(1).unwrap();
    assert_eq!(p.take_events().len(), 1);
}

#[test]
fn reserve_dedups_hides_and_confirm_publishes() {
    let mut p = BlockPool::new(Tier::Host, 3).unwrap();
    let old = fill(&mut p, &[h(1)], Priority(0))[0];
    p.take_events();
    let mut r = Vec::new();
    p.reserve(&[h(1), h(2), h(2), h(3), h(4)], &mut r);
    let (b2, b3) = match (r[1], r[3]) {
        (Reservation::Allocated(a), Reservation::Allocated(b)) => (a, b),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        r,
        vec![
            Reservation::Registered(old),
            Reservation::Allocated(b2),
            Reservation::Writing(b2),
            Reservation::Allocated(b3),
            // The only evictable block is h(1)'s, and h(4) takes it.
            Reservation::Allocated(old),
        ]
    );
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
    // Confirm publishes without a second store; a failed write frees its block.
    p.confirm(b2, Priority(4)).unwrap();
    assert_eq!(p.lookup(h(2)), Some(b2));
    assert_eq!(p.priority_of(b2), Some(Priority(4)));
    assert_eq!(
        p.take_events(),
        vec![PoolEvent::Stored {
            hash: h(2),
            tier: Tier::Host
        }]
    );
    assert_eq!(
        p.confirm(b2, Priority(0)),
        Err(PoolError::NotReserved {
            tier: Tier::Host,
            block: b2
        })
    );
    p.release(b3).unwrap();
    assert_eq!(p.state(b3), Some(BlockState::Free));
    assert_eq!(p.reserved_block(h(3)), None);
    assert!(
        p.take_events().is_empty(),
        "an unconfirmed write was never stored"
    );
    // `register` cannot take a reserved hash, and registers a reservation as `confirm`.
    let other = p.allocate(1).unwrap()[0];
    assert!(matches!(
        p.register(other, h(4), Priority(0)),
        Err(PoolError::Reserved { .. })
    ));
    assert_eq!(p.register(old, h(4), Priority(0)), Ok(old));
    assert_eq!(p.lookup(h(4)), Some(old));
    assert_eq!(p.num_reserved(), 0);
}

#[test]
fn zero_capacity_pool() {
    let mut p = BlockPool::new(Tier::Remote, 0).unwrap();
    assert_eq!(p.allocate(0).unwrap(), Vec::<BlockId>::new());
    assert!(p.allocate(1).is_err());
    assert_eq!(p.peek_prefix(&[h(1)]), 0);
}
