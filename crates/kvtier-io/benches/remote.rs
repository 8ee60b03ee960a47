//! Remote store throughput for 2 MiB blocks: kvtier's Redis backend vs raw redis-crate SET/GET of
//! the same bytes (no header, no checksum; the baseline) vs the shared-directory backend, all in one
//! run against one private local redis-server.
//!
//! Run: `cargo bench -p kvtier-io --bench remote`.
#![allow(clippy::unwrap_used)]

#[path = "../tests/remote_support/mod.rs"]
mod remote_support;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier_io::remote::from_url;
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
        redis_store.put(k, &data).unwrap();
        dir_store.put(k, &data).unwrap();
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
            redis_store.put(k, &data).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_dir", "put"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            dir_store.put(k, &data).unwrap();
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
            redis_store.get(k, &mut out).unwrap();
        })
    });
    g.bench_function(BenchmarkId::new("kvtier_dir", "get"), |b| {
        b.iter(|| {
            k = (k + 1) % KEYS;
            dir_store.get(k, &mut out).unwrap();
        })
    });
    g.finish();

    let keys: Vec<u128> = (0..64).collect();
    let mut g = c.benchmark_group("remote_contains_64");
    g.bench_function("kvtier_redis", |b| {
        b.iter(|| redis_store.contains(&keys).unwrap())
    });
    g.bench_function("kvtier_dir", |b| {
        b.iter(|| dir_store.contains(&keys).unwrap())
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = bench
}
criterion_main!(benches);
