//! Operation sequences on a `BlockPool` against a minimal model: no operation panics, capacity
//! is conserved (free + pinned == capacity, with evictable blocks counted as free), a block we
//! pin is never handed out again, and a lookup only ever returns a block registered under that
//! hash. Pins are `Pinned` tokens (`pool/pin.rs`): the model holds the tokens and releases
//! exactly the ones it holds. (The full reference model is `crates/kvtier/tests/pool_model.rs`,
//! under proptest.)
#![no_main]
use std::collections::HashMap;

use kvtier::hash::SequenceHash;
use kvtier::pool::{BlockPool, Pinned, Priority};
use kvtier::{BlockId, Tier};
use libfuzzer_sys::fuzz_target;

const N: usize = 16;

/// Pins held per block, from the tokens in `held`.
fn pins_per_block(held: &[Pinned]) -> HashMap<u32, u32> {
    let mut m = HashMap::new();
    for p in held {
        *m.entry(p.block().0).or_default() += 1;
    }
    m
}

fuzz_target!(|data: &[u8]| {
    let Ok(mut pool) = BlockPool::new(Tier::Host, N) else {
        return;
    };
    let mut held: Vec<Pinned> = Vec::new();
    for op in data.chunks(3) {
        let [code, a, b] = [op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0)];
        let hash = SequenceHash(u128::from(a % 24));
        let block = BlockId(u32::from(b) % (N as u32 + 2));
        match code % 7 {
            0 => {
                if let Ok(got) = pool.allocate(usize::from(a % 5)) {
                    let pinned = pins_per_block(&held);
                    for g in &got {
                        assert!(
                            !pinned.contains_key(&g.block().0),
                            "a block we hold was handed out again"
                        );
                    }
                    held.extend(got);
                }
            }
            1 if !held.is_empty() => {
                let i = usize::from(b) % held.len();
                if let Ok(holder) = pool.register(&mut held[i], hash, Priority(u32::from(b % 3))) {
                    assert_eq!(pool.lookup(hash), Some(holder));
                    assert_eq!(held[i].block(), holder, "the pin moved to the holder");
                }
            }
            2 if !held.is_empty() => {
                let i = usize::from(b) % held.len();
                let pin = held.swap_remove(i);
                assert!(
                    pool.release(pin).is_ok(),
                    "releasing a token we hold failed"
                );
            }
            3 => {
                if let Ok(p) = pool.pin(block) {
                    held.push(p);
                }
            }
            4 => {
                let _ = pool.invalidate(block);
            }
            5 => {
                for g in pool.match_prefix(&[hash]) {
                    assert_eq!(pool.hash_of(g.block()), Some(hash));
                    held.push(g);
                }
            }
            _ => {
                if let Some(b) = pool.lookup(hash) {
                    assert_eq!(pool.hash_of(b), Some(hash), "lookup returned another block");
                }
            }
        }
        let blocks = pins_per_block(&held).len();
        assert_eq!(
            pool.num_pinned(),
            blocks,
            "pinned blocks differ from the model"
        );
        assert_eq!(pool.num_free() + blocks, N, "capacity not conserved");
        let _ = pool.take_events();
    }
    for p in held {
        assert!(pool.release(p).is_ok());
    }
    assert_eq!(pool.num_free(), N);
});
