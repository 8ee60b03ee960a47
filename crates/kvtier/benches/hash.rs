//! Sequence hashing throughput (bytes of token ids per second) against baselines on the same
//! bytes: a plain copy, one-shot xxh3-128 over the whole buffer, and xxh3-128 of each block's
//! bytes prepared in advance (the hash function alone, without chaining).
// `criterion_main!` generates an undocumented `pub fn main`.
#![allow(missing_docs)]
use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::tokens::TokenBlockSequence;
use xxhash_rust::xxh3::xxh3_128_with_seed;

#[path = "support/mod.rs"]
mod clock;

fn tokens(n: usize) -> Vec<u32> {
    let mut x = 0x9E37_79B9u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 128_256
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let n = 32 * 1024;
    let toks = tokens(n);
    let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
    let salt = HashSalt::new("meta-llama/Llama-3.1-8B-Instruct", None, None);
    let mut g = c.benchmark_group(clock::group_name("hash_32k_tokens"));
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.bench_function("baseline_memcpy", |b| {
        let mut dst = vec![0u8; bytes.len()];
        b.iter_custom(|it| {
            clock::time(it, || {
                dst.copy_from_slice(black_box(&bytes));
                black_box(&dst);
            })
        })
    });
    g.bench_function("baseline_xxh3_128_one_shot", |b| {
        b.iter_custom(|it| {
            clock::time(it, || {
                black_box(xxh3_128_with_seed(black_box(&bytes), salt.0));
            })
        })
    });
    for bs in [16usize, 32, 64] {
        // Each block's bytes as the scheme hashes them (16-byte parent + tokens), prepared.
        let prepared: Vec<u8> = bytes
            .chunks_exact(4 * bs)
            .flat_map(|c| [0u8; 16].into_iter().chain(c.iter().copied()))
            .collect();
        let len = 16 + 4 * bs;
        g.bench_function(format!("baseline_xxh3_128_per_block{bs}_prepared"), |b| {
            b.iter_custom(|it| {
                clock::time(it, || {
                    let mut acc = 0u128;
                    for blk in prepared.chunks_exact(len) {
                        acc ^= xxh3_128_with_seed(black_box(blk), salt.0);
                    }
                    black_box(acc);
                })
            })
        });
        g.bench_function(format!("sequence_hashes_block{bs}"), |b| {
            b.iter_custom(|it| {
                clock::time(it, || {
                    black_box(sequence_hashes(salt, black_box(&toks), bs));
                })
            })
        });
    }
    g.bench_function("token_block_sequence_append_16_per_call_block16", |b| {
        let bs = NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN);
        b.iter_custom(|it| {
            clock::time(it, || {
                let mut s = TokenBlockSequence::new(salt, bs);
                for c in toks.chunks(16) {
                    black_box(s.append(c));
                }
                black_box(s.num_full_blocks());
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
