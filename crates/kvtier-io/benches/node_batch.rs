//! The node tier's fixed cost per job: device <-> node jobs of small blocks (4 KiB, so the copy
//! is nearly free and the round trips are what is timed) against the same jobs to a host tier in
//! the same process (no round trips; the baseline), in jobs of 64 and 512 pairs (a vLLM prefill
//! step of 1K and 8K tokens of 16-token blocks). Ratio = node job / host tier job.
//!
//! `store/node, between steps` times the same stores with an untimed pause of [`STEP_GAP`]
//! after each, as an engine's stores come once per forward step: the node then has answered
//! the connection's `Grant` before the next store, which goes through granted slots in one
//! round trip (`storage/node/granted.rs`); back to back, each store also waits for the node to
//! serve the previous one's `Grant`.
//!
//! Run: `cargo bench -p kvtier-io --bench node_batch`.
// `criterion_main!` generates an undocumented `pub fn main`.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use common::{keyed_by, pattern, PerLayerCache};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier::transfer::BlockTransfer;
use kvtier::Tier;
use kvtier_io::storage::node::{NodeClientOptions, NodeOptions, NodeServer, NodeStore};
use kvtier_io::{DeviceKind, EngineMemory, TransferEngine};
use kvtier_io::{HostOptions, HostStorage};

const LAYERS: usize = 2;
const CHUNK: usize = 1024;
const BPB: usize = LAYERS * 2 * CHUNK;
const BLOCKS: u32 = 512;
/// Untimed pause after each store of `store/node, between steps`.
const STEP_GAP: std::time::Duration = std::time::Duration::from_micros(300);

fn device(cache: &PerLayerCache) -> EngineMemory {
    // SAFETY: the cache outlives the engine; only the engine's jobs touch it.
    unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) }
}

fn bench(c: &mut Criterion) {
    let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        cache.write(b, &pattern(b, BPB));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut o = NodeOptions::new(dir.path().join("node.sock"), 4 * BLOCKS as u64 * BPB as u64);
    o.shm_dir = dir.path().to_path_buf();
    let node = NodeServer::start(&o).unwrap();
    let store =
        Arc::new(NodeStore::connect(node.socket(), "bench", NodeClientOptions::default()).unwrap());
    let to_node = TransferEngine::builder()
        .device(device(&cache))
        .remote(store.clone())
        .build()
        .unwrap();
    let host = Arc::new(HostStorage::new(&HostOptions::new(BLOCKS, BPB)).unwrap());
    let to_host = TransferEngine::builder()
        .device(device(&cache))
        .host(host)
        .build()
        .unwrap();
    for per in [64u32, 512] {
        let mut g = c.benchmark_group(format!("node_job_{per}x4KiB"));
        g.throughput(Throughput::Elements(u64::from(per)));
        let pairs: Vec<(u32, u32)> = (0..per).map(|b| (b, b)).collect();
        // Stores of keys never seen (a repeated key is deduplicated by the node: no Finish).
        let mut round = 0u128;
        g.bench_function(BenchmarkId::new("store", "node"), |b| {
            b.iter(|| {
                round += 1;
                let j = keyed_by(Tier::Device, Tier::Remote, &pairs, |n| {
                    (round << 32) | u128::from(n)
                });
                let f = to_node.fence(None).unwrap();
                assert!(to_node.execute(&j, &f).is_ok());
            })
        });
        g.bench_function(BenchmarkId::new("store", "node, between steps"), |b| {
            b.iter_custom(|iters| {
                let mut timed = std::time::Duration::ZERO;
                for _ in 0..iters {
                    round += 1;
                    let j = keyed_by(Tier::Device, Tier::Remote, &pairs, |n| {
                        (round << 32) | u128::from(n)
                    });
                    let t = std::time::Instant::now();
                    let f = to_node.fence(None).unwrap();
                    assert!(to_node.execute(&j, &f).is_ok());
                    timed += t.elapsed();
                    std::thread::sleep(STEP_GAP);
                }
                timed
            })
        });
        g.bench_function(BenchmarkId::new("store", "host tier"), |b| {
            let j = keyed_by(Tier::Device, Tier::Host, &pairs, u128::from);
            b.iter(|| {
                let f = to_host.fence(None).unwrap();
                assert!(to_host.execute(&j, &f).is_ok());
            })
        });
        // Loads of the blocks the last store job wrote.
        let last = round;
        g.bench_function(BenchmarkId::new("load", "node"), |b| {
            let j = keyed_by(Tier::Remote, Tier::Device, &pairs, |n| {
                (last << 32) | u128::from(n)
            });
            b.iter(|| {
                let f = to_node.fence(None).unwrap();
                assert!(to_node.execute(&j, &f).is_ok());
            })
        });
        g.bench_function(BenchmarkId::new("load", "host tier"), |b| {
            let j = keyed_by(Tier::Host, Tier::Device, &pairs, u128::from);
            b.iter(|| {
                let f = to_host.fence(None).unwrap();
                assert!(to_host.execute(&j, &f).is_ok());
            })
        });
        g.finish();
    }
    let n = node.stats();
    eprintln!(
        "node: {} requests, round trips {:?} in all",
        n.requests,
        store.round_trip_time()
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
