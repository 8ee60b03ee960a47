//! Operation sequences on a `BlockPool` against a minimal model: no operation panics, capacity
//! is conserved (free + pinned == capacity, with evictable blocks counted as free), a pinned
//! block is never handed out again, and a lookup only ever returns a block registered under that
//! hash. (The full reference model is `crates/kvtier/tests/pool_model.rs`, under proptest.)
#![no_main]
use std::collections::HashMap;

use kvtier::hash::SequenceHash;
use kvtier::pool::{BlockPool, Priority};
use kvtier::{BlockId, Tier};
use libfuzzer_sys::fuzz_target;

const N: usize = 16;

fuzz_target!(|data: &[u8]| {
    let Ok(mut pool) = BlockPool::new(Tier::Host, N) else {
        return;
    };
    // block -> pins we hold on it
    let mut pins: HashMap<u32, u32> = HashMap::new();
    for op in data.chunks(3) {
        let [code, a, b] = [op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0)];
        let hash = SequenceHash(u128::from(a % 24));
        let block = BlockId(u32::from(b) % (N as u32 + 2));
        match code % 7 {
            0 => {
                if let Ok(got) = pool.allocate(usize::from(a % 5)) {
                    for g in got {
                        let p = pins.entry(g.0).or_default();
                        assert_eq!(*p, 0, "a block we hold was handed out again");
                        *p = 1;
                    }
                }
            }
            1 => {
                if let Ok(holder) = pool.register(block, hash, Priority(u32::from(b % 3))) {
                    assert_eq!(pool.lookup(hash), Some(holder));
                    if holder != block {
                        // The caller's pin moved from `block` to the block that holds `hash`.
                        if let Some(p) = pins.get_mut(&block.0) {
                            *p -= 1;
                            if *p == 0 {
                                pins.remove(&block.0);
                            }
                        }
                        *pins.entry(holder.0).or_default() += 1;
                    }
                }
            }
            2 => {
                if pool.release(block).is_ok() {
                    let p = pins.get_mut(&block.0).expect("released a block nobody held");
                    *p -= 1;
                    if *p == 0 {
                        pins.remove(&block.0);
                    }
                }
            }
            3 => {
                if pool.pin(block).is_ok() {
                    *pins.entry(block.0).or_default() += 1;
                }
            }
            4 => {
                let _ = pool.invalidate(block);
            }
            5 => {
                let got = pool.match_prefix(&[hash]);
                for g in got {
                    *pins.entry(g.0).or_default() += 1;
                    assert_eq!(pool.hash_of(g), Some(hash));
                }
            }
            _ => {
                if let Some(b) = pool.lookup(hash) {
                    assert_eq!(pool.hash_of(b), Some(hash), "lookup returned another block");
                }
            }
        }
        let held = pins.len();
        assert_eq!(pool.num_pinned(), held, "pinned blocks differ from the model");
        assert_eq!(pool.num_free() + held, N, "capacity not conserved");
        let _ = pool.take_events();
    }
});
