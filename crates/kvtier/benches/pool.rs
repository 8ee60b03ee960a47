//! Pool operations at scale: prefix matching of a 32K-token prompt (2,048 blocks of 16) against
//! a pool of 1M registered blocks, and the allocate + register + evict cycle per block (and the
//! same cycle through the batched `reserve` + `confirm` store path).
//! Baseline in the same run: the same 2,048 lookups in a `std::collections::HashMap<u128, u32>`.
// `criterion_main!` generates an undocumented `pub fn main`.
#![allow(missing_docs)]
use std::collections::HashMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvtier::hash::SequenceHash;
use kvtier::pool::{BlockPool, Priority, Reservation};
use kvtier::Tier;

#[path = "support/mod.rs"]
mod clock;

const N: usize = 1 << 20;
const PROMPT: usize = 2048;

fn key(i: u64) -> SequenceHash {
    // splitmix64, twice: well-spread 128-bit keys.
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    SequenceHash(((mix(i) as u128) << 64) | mix(i ^ 0xDEAD_BEEF) as u128)
}

/// A pool of N blocks, each registered under key(i) and released (evictable).
fn full_pool() -> BlockPool {
    let mut p = match BlockPool::new(Tier::Host, N) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let pins = p.allocate(N).unwrap_or_default();
    for (i, mut pin) in pins.into_iter().enumerate() {
        let _ = p.register(&mut pin, key(i as u64), Priority(0));
        let _ = p.release(pin);
    }
    let _ = p.take_events();
    p
}

fn bench(c: &mut Criterion) {
    let mut pool = full_pool();
    eprintln!(
        "pool of {} registered blocks: {} heap bytes = {:.1} bytes/block",
        pool.num_registered(),
        pool.heap_bytes(),
        pool.heap_bytes() as f64 / N as f64
    );
    // A prompt whose blocks were registered at scattered times (stride 397 through the pool).
    let prompt: Vec<SequenceHash> = (0..PROMPT as u64)
        .map(|i| key((i * 397) % N as u64))
        .collect();
    let std_map: HashMap<u128, u32> = (0..N as u64).map(|i| (key(i).0, i as u32)).collect();

    let mut g = c.benchmark_group(clock::group_name("pool_1M"));
    g.throughput(Throughput::Elements(PROMPT as u64));
    g.bench_function("baseline_std_hashmap_2048_lookups", |b| {
        b.iter_custom(|it| {
            clock::time(it, || {
                black_box(
                    prompt
                        .iter()
                        .take_while(|h| std_map.contains_key(&h.0))
                        .count(),
                );
            })
        })
    });
    g.bench_function("peek_prefix_2048", |b| {
        b.iter_custom(|it| {
            clock::time(it, || {
                black_box(pool.peek_prefix(black_box(&prompt)));
            })
        })
    });
    g.bench_function("match_prefix_2048_and_release", |b| {
        b.iter_custom(|it| {
            clock::time(it, || {
                let m = pool.match_prefix(black_box(&prompt));
                black_box(m.len());
                for pin in m {
                    let _ = pool.release(pin);
                }
            })
        })
    });
    // Allocate 64 blocks (evicting the least recently used), register them under fresh keys,
    // release them: the steady state of a full tier.
    const BATCH: usize = 64;
    g.throughput(Throughput::Elements(BATCH as u64));
    let mut next = N as u64 + 1;
    g.bench_function("allocate_register_evict_64", |b| {
        b.iter_custom(|iters| {
            let d = clock::time(iters, || {
                let pins = pool.allocate(BATCH).unwrap_or_default();
                for mut pin in pins {
                    let _ = pool.register(&mut pin, key(next), Priority(0));
                    let _ = pool.release(pin);
                    next += 1;
                }
            });
            let _ = pool.take_events();
            d
        })
    });
    // The same cycle through the batched store path: one `reserve` call for the 64 hashes (one
    // registry probe each dedups and reserves), then `confirm` + release (the reservations are
    // drained from the reused buffer: each token is used up once).
    let mut res = Vec::with_capacity(BATCH);
    let mut hashes = Vec::with_capacity(BATCH);
    g.bench_function("reserve_confirm_evict_64", |b| {
        b.iter_custom(|iters| {
            let d = clock::time(iters, || {
                hashes.clear();
                hashes.extend((0..BATCH as u64).map(|k| key(next + k)));
                next += BATCH as u64;
                res.clear();
                pool.reserve(&hashes, &mut res);
                for r in res.drain(..) {
                    if let Reservation::Allocated(reserved) = r {
                        if let Ok((pin, _)) = pool.confirm(reserved, Priority(0)) {
                            let _ = pool.release(pin);
                        }
                    }
                }
            });
            let _ = pool.take_events();
            d
        })
    });
    g.finish();
    black_box(pool.num_registered());
}

criterion_group!(benches, bench);
criterion_main!(benches);
