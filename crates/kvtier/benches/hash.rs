//! Sequence hashing throughput (bytes of token ids per second) against baselines on the same
//! bytes: a plain copy and one-shot xxh3-128 over the whole token buffer.
use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::tokens::TokenBlockSequence;
use xxhash_rust::xxh3::xxh3_128_with_seed;

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
    let mut g = c.benchmark_group("hash_32k_tokens");
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.bench_function("baseline_memcpy", |b| {
        let mut dst = vec![0u8; bytes.len()];
        b.iter(|| {
            dst.copy_from_slice(black_box(&bytes));
            black_box(&dst);
        })
    });
    g.bench_function("baseline_xxh3_128_one_shot", |b| {
        b.iter(|| black_box(xxh3_128_with_seed(black_box(&bytes), salt.0)))
    });
    // Baseline: xxh3-128 of each block's 80 bytes (parent + 16 tokens) from a prepared buffer,
    // i.e. the hash function alone with no chaining or copying.
    let blocks80: Vec<u8> = bytes
        .chunks_exact(64)
        .flat_map(|c| [0u8; 16].into_iter().chain(c.iter().copied()))
        .collect();
    g.bench_function("baseline_xxh3_128_per_block16_prepared", |b| {
        b.iter(|| {
            let mut acc = 0u128;
            for blk in blocks80.chunks_exact(80) {
                acc ^= xxh3_128_with_seed(black_box(blk), salt.0);
            }
            black_box(acc)
        })
    });
    for bs in [16usize, 32, 64] {
        g.bench_function(format!("sequence_hashes_block{bs}"), |b| {
            b.iter(|| black_box(sequence_hashes(salt, black_box(&toks), bs)))
        });
    }
    g.bench_function("token_block_sequence_append_16_per_call_block16", |b| {
        let bs = NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN);
        b.iter(|| {
            let mut s = TokenBlockSequence::new(salt, bs);
            for c in toks.chunks(16) {
                black_box(s.append(c));
            }
            black_box(s.num_full_blocks())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
