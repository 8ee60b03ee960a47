//! Registry memory: a pool of 1M registered blocks holds at most 64 bytes per block, measured
//! with a counting global allocator (every heap byte the pool keeps, not an estimate).
//! One test per binary, so no other test allocates while it measures.
#![allow(clippy::unwrap_used)]
use std::alloc::System;

use kvtier::hash::SequenceHash;
use kvtier::pool::{BlockPool, Priority};
use kvtier::Tier;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn one_million_registered_blocks_use_at_most_64_bytes_each() {
    let n = 1usize << 20;
    let region = Region::new(GLOBAL);
    let mut pool = BlockPool::new(Tier::Host, n).unwrap();
    pool.set_record_events(false);
    {
        let pins = pool.allocate(n).unwrap();
        for (i, mut pin) in pins.into_iter().enumerate() {
            let h = SequenceHash(
                (i as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1,
            );
            pool.register(&mut pin, h, Priority((i % 3) as u32))
                .unwrap();
            pool.release(pin).unwrap();
        }
    }
    assert_eq!(pool.num_registered(), n);
    let s = region.change();
    let live = s.bytes_allocated as i64 + s.bytes_reallocated as i64 - s.bytes_deallocated as i64;
    let per_block = live as f64 / n as f64;
    println!("{live} live heap bytes for {n} registered blocks = {per_block:.2} bytes/block (heap_bytes() says {})", pool.heap_bytes());
    assert!(live > 0);
    assert!(live <= 64 * n as i64, "{per_block:.2} bytes per block");
    // The pool's own accounting agrees with the allocator within 1%.
    let acc = pool.heap_bytes() as f64;
    assert!(
        (acc - live as f64).abs() / (live as f64) < 0.01,
        "heap_bytes {acc} vs measured {live}"
    );
}
