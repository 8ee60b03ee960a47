//! Remote store throughput for 2 MiB blocks: kvtier's Redis backend vs raw redis-crate SET/GET of
//! the same bytes (no header, no checksum; the baseline) vs the shared-directory backend, all in one
//! run against one private local redis-server; and the keyed MAC's cost (`remote.mac_key_file`):
//! the tag pass alone (xxh3 vs keyed BLAKE3 over one block) and a keyed store's put/get beside the
//! unkeyed one.
//!
//! After the criterion groups, an interleaved A/B pass times the same operations round-robin
//! (baseline, kvtier redis, kvtier dir, repeated) and prints medians and the median per-round ratio:
//! on a shared, loaded machine this keeps load swings out of the ratios.
//!
//! Run: `cargo bench -p kvtier-io --bench remote`.
// `criterion_main!` generates an undocumented `pub fn main`.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used)]

#[path = "../tests/remote_support/mod.rs"]
mod remote_support;

use kvtier::hash::SequenceHash;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use kvtier::transfer::RemoteStore;
use kvtier_io::storage::remote::{from_url, FrameSeal, RedisOptions, RedisStore};
use remote_support::{block, RedisServer};

const BLOCK: usize = 2 << 20;
/// Distinct keys cycled through, so values are overwritten rather than accumulated.
const KEYS: u128 = 16;

fn bench(c: &mut Criterion) {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let redis_store = from_url(&srv.url(), "bench").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dir_store = from_url(&format!("dir://{}", dir.path().display()), "bench").unwrap();
    let mut raw = srv.raw().unwrap();
    let data = block(42, BLOCK);
    for k in 0..KEYS {
        redis_store.put(SequenceHash(k), &data).unwrap();
        dir_store.put(SequenceHash(k), &data).unwrap();
        let _: () = redis::cmd("SET")
            .arg(format!("raw:{k}"))
            .arg(&data[..])
            .query(&mut raw)
            .unwrap();
    }

    let mut g = c.benchmark_group("remote_put_2MiB");
    g.throughput(Throughput::Bytes(BLOCK as u64));
    let mut k = 0u128;
    g.bench_function(BenchmarkId::new("raw_redis_set", "baseline"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            let _: () = redis::cmd("SET")
                .arg(format!("raw:{k}"))
                .arg(&data[..])
                .query(&mut raw)
                .unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_redis", "put"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            redis_store.put(SequenceHash(k), &data).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_dir", "put"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            dir_store.put(SequenceHash(k), &data).unwrap();
        })
    });
    g.finish();

    let mut g = c.benchmark_group("remote_get_2MiB");
    g.throughput(Throughput::Bytes(BLOCK as u64));
    let mut out = vec![0u8; BLOCK];
    g.bench_function(BenchmarkId::new("raw_redis_get", "baseline"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            let v: Vec<u8> = redis::cmd("GET")
                .arg(format!("raw:{k}"))
                .query(&mut raw)
                .unwrap();
            assert_eq!(v.len(), BLOCK);
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_redis", "get"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            redis_store.get(SequenceHash(k), &mut out).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_dir", "get"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            dir_store.get(SequenceHash(k), &mut out).unwrap();
        })
    });
    g.finish();

    // The keyed MAC: the tag pass alone, then a keyed store beside the unkeyed one.
    let plain = FrameSeal::for_namespace("bench");
    let keyed = FrameSeal::keyed("bench", b"0123456789abcdef-bench-secret").unwrap();
    let mut g = c.benchmark_group("frame_tag_2MiB");
    g.throughput(Throughput::Bytes(BLOCK as u64));
    g.bench_function(BenchmarkId::new("xxh3", "unkeyed"), |b| {
        b.iter(|| plain.header(7, &data))
    });
    g.bench_function(BenchmarkId::new("blake3", "keyed"), |b| {
        b.iter(|| keyed.header(7, &data))
    });
    g.finish();
    let mac_store = RedisStore::open(&srv.url(), "bench-mac", RedisOptions::default())
        .unwrap()
        .with_mac_key(b"0123456789abcdef-bench-secret")
        .unwrap();
    for k in 0..KEYS {
        mac_store.put(SequenceHash(k), &data).unwrap();
    }
    let mut g = c.benchmark_group("remote_mac_2MiB");
    g.throughput(Throughput::Bytes(BLOCK as u64));
    g.bench_function(BenchmarkId::new("kvtier_redis", "put"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            redis_store.put(SequenceHash(k), &data).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_redis_mac", "put"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            mac_store.put(SequenceHash(k), &data).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_redis", "get"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            redis_store.get(SequenceHash(k), &mut out).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_redis_mac", "get"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            mac_store.get(SequenceHash(k), &mut out).unwrap();
        })
    });
    g.finish();

    let keys: Vec<u128> = (0..64).collect();
    let mut g = c.benchmark_group("remote_contains_64");
    g.bench_function("kvtier_redis", |b| {
        b.iter(|| {
            redis_store
                .contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())
                .unwrap()
        })
    });
    g.bench_function("kvtier_dir", |b| {
        b.iter(|| {
            dir_store
                .contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())
                .unwrap()
        })
    });
    g.finish();
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Round-robin A/B timing: each round runs every variant once, so all see the same load.
fn interleaved() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let redis_store = from_url(&srv.url(), "ab").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dir_store = from_url(&format!("dir://{}", dir.path().display()), "ab").unwrap();
    let mut raw = srv.raw().unwrap();
    let data = block(7, BLOCK);
    let mut out = vec![0u8; BLOCK];
    const ROUNDS: usize = 150;
    // [raw, kvtier redis, kvtier dir] x [put, get], in milliseconds.
    let mut t: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); 3]; 2];
    let time = |f: &mut dyn FnMut()| {
        let s = Instant::now();
        f();
        s.elapsed().as_secs_f64() * 1e3
    };
    for round in 0..ROUNDS + 5 {
        let k = (round as u128) % KEYS;
        let name = format!("raw:{k}");
        let ms = [
            time(&mut || {
                let _: () = redis::cmd("SET")
                    .arg(&name)
                    .arg(&data[..])
                    .query(&mut raw)
                    .unwrap();
            }),
            time(&mut || redis_store.put(SequenceHash(k), &data).unwrap()),
            time(&mut || dir_store.put(SequenceHash(k), &data).unwrap()),
        ];
        let gets = [
            time(&mut || {
                let v: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut raw).unwrap();
                assert_eq!(v.len(), BLOCK);
            }),
            time(&mut || redis_store.get(SequenceHash(k), &mut out).unwrap()),
            time(&mut || dir_store.get(SequenceHash(k), &mut out).unwrap()),
        ];
        if round >= 5 {
            for v in 0..3 {
                t[0][v].push(ms[v]);
                t[1][v].push(gets[v]);
            }
        }
    }
    println!("interleaved A/B, 2 MiB blocks, {ROUNDS} rounds (median ms, MiB/s, median per-round ratio vs raw):");
    for (op, row) in ["put", "get"].iter().zip(&t) {
        let base = row[0].clone();
        for (name, samples) in ["raw_redis", "kvtier_redis", "kvtier_dir"].iter().zip(row) {
            let mut ratios: Vec<f64> = base.iter().zip(samples).map(|(b, x)| b / x).collect();
            let mut s = samples.clone();
            let m = median(&mut s);
            println!(
                "  {op} {name:<13} {m:7.3} ms {:8.1} MiB/s  x{:.3} of raw throughput",
                2.0 / (m / 1e3),
                median(&mut ratios)
            );
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = bench
}

fn main() {
    benches();
    interleaved();
    Criterion::default().configure_from_args().final_summary();
}
