//! The node tier on a CUDA machine (skips cleanly without a driver): blocks of a GPU KV cache
//! in vLLM's per-layer layout are stored through the node (device -> arena slot by DMA, the
//! arena registered with `cuMemHostRegister`) and loaded back (arena -> device) into other
//! blocks, compared bit-exact with the GPU's own bytes, and timed against a plain pinned host
//! tier (device <-> `HostStorage`, pinned) moving the same blocks in the same run; once by an
//! engine that trusts its own uid's arena (direct DMA, no hashing) and once by one that verifies
//! every block (`verify`, as toward a node of another uid: staged, hashed).
//!
//! Run on a GPU machine: `scripts/gpu-node.sh` (the lib test binary, built with `--release`).
//! `KVTIER_NODE_GPU_BLOCKS` (default 256 blocks of 2 MiB) sets the size; the figures are
//! printed and, with `KVTIER_NODE_GPU_REPORT=FILE`, written there as markdown.
#![allow(clippy::unwrap_used)]
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::transfer::{BlockTransfer, TransferJob};
use kvtier::{JobId, Tier};

use super::{NodeClientOptions, NodeOptions, NodeServer, NodeStore, GRANT_SHARE};
use crate::storage::host::{HostOptions, HostStorage, PinMode};
use crate::sys::cuda::{self as cu, DeviceAlloc, Driver};
use crate::sys::job;
use crate::transfer::cuda::gpu_tests::{load_layered_and_check, print_layered_rates};
use crate::transfer::device::DeviceKind;
use crate::transfer::engine::TransferEngine;
use crate::transfer::layout::{BlockChunks, StridedLayout};
use crate::transfer::memory::DevicePtr;

pub(crate) const LAYERS: usize = 32;
pub(crate) const CHUNK: usize = 32 << 10;
pub(crate) const BPB: usize = LAYERS * 2 * CHUNK; // 2 MiB, Llama-3.1-8B bf16
const PER_JOB: usize = 64;

/// Pairs per job: `KVTIER_NODE_GPU_JOB` when set (a vLLM prefill step of 8,192 tokens stores 512
/// blocks of 16 tokens at once), else [`PER_JOB`].
fn per_job() -> usize {
    std::env::var("KVTIER_NODE_GPU_JOB")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(PER_JOB)
}
/// Each store and load is timed this many times (`KVTIER_NODE_GPU_REPS`, default 3; stores under
/// fresh keys each time, so none is deduplicated), the median reported, for the node and the
/// host tier alike.
fn reps() -> usize {
    std::env::var("KVTIER_NODE_GPU_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(3)
}

/// The median of `times` (the upper one of an even count).
fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

/// `keys` as rep `r` stores them (rep 0: as given).
fn rep_keys(keys: &[u128], r: usize) -> Vec<u128> {
    keys.iter().map(|k| k ^ ((r as u128) << 96)).collect()
}

/// The key of the one block the first (attaching) job stores.
const WARM_KEY: u128 = u128::MAX - 7;

fn fill(mem: &DeviceAlloc, seed: u64) {
    let step = 64 << 20;
    let mut buf = vec![0u8; step];
    let mut off = 0;
    while off < mem.len() {
        let n = step.min(mem.len() - off);
        let mut x = seed.wrapping_add(off as u64) | 1;
        for b in buf[..n].iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        mem.upload(off, &buf[..n]).unwrap();
        off += n;
    }
}

/// A device KV cache of `total` 2 MiB blocks in vLLM's per-layer layout (K and V planes of each
/// layer, 32 KiB per block each), filled with seeded random bytes.
pub(crate) fn per_layer_cache(total: u32, seed: u64) -> (DeviceAlloc, StridedLayout) {
    let mem = DeviceAlloc::new(total as usize * BPB).unwrap();
    fill(&mem, seed);
    let lb = 2 * total as usize * CHUNK;
    let bases: Vec<DevicePtr> = (0..LAYERS)
        .map(|l| DevicePtr::new(mem.addr() + (l * lb) as u64).unwrap())
        .collect();
    let layout = StridedLayout::kv_per_layer(&bases, total, CHUNK).unwrap();
    (mem, layout)
}

/// A block of 2 MiB in canonical order, read from `mem` (`layout` describes `mem`).
pub(crate) fn block(mem: &DeviceAlloc, layout: &StridedLayout, b: u32) -> Vec<u8> {
    let mut chunks = Vec::new();
    layout.chunks(b, &mut chunks).unwrap();
    let mut out = vec![0u8; BPB];
    let mut o = 0;
    for c in chunks {
        mem.download((c.addr - mem.addr()) as usize, &mut out[o..o + c.len])
            .unwrap();
        o += c.len;
    }
    out
}

/// Jobs of [`per_job`] pairs; a remote block's key is `keys[n]`, `n` the device block of its pair.
fn jobs(pairs: &[(u32, u32)], src: Tier, dst: Tier, keys: &[u128]) -> Vec<TransferJob> {
    let key = |n: u32| keys[n as usize];
    pairs
        .chunks(per_job())
        .enumerate()
        .map(|(j, c)| {
            // The remote side is numbered as its device block (the key's index).
            let c: Vec<(u32, u32)> = c
                .iter()
                .map(|&(s, d)| match (src, dst) {
                    (Tier::Device, Tier::Remote) => (s, s),
                    (Tier::Remote, Tier::Device) => (d, d),
                    _ => (s, d),
                })
                .collect();
            crate::transfer::numbered_job(JobId(j as u64), src, dst, &c, key)
        })
        .collect()
}

fn timed(e: &TransferEngine, jobs: &[TransferJob]) -> Duration {
    let t = Instant::now();
    for j in jobs {
        let f = e.fence(None).unwrap();
        let out = e.execute(j, &f);
        assert!(
            out.is_ok(),
            "job {:?} -> {:?}: {out:?}",
            j.src_tier(),
            j.dst_tier()
        );
    }
    t.elapsed()
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// A node of `n` blocks (and a few spare) with its socket in `dir` and its arena in
/// `KVTIER_NODE_SHM_DIR` when set (`KVTIER_NODE_HUGE=1 scripts/gpu-node.sh`: a tmpfs mounted `huge=always`,
/// so the arena is backed by 2 MiB pages), else `/dev/shm`, else `dir`; with
/// `KVTIER_NODE_HUGE_COLLAPSE=1` the node collapses its arena into 2 MiB pages at start
/// (`--huge-pages collapse`).
fn node_options(dir: &std::path::Path, n: u32) -> NodeOptions {
    // Room for `n` blocks (and a few spare) beside the grants the node may hand out (at most
    // `capacity / GRANT_SHARE`): without it the slots granted ahead evict the first blocks of
    // the last rep before they are loaded.
    let blocks = (n as u64 + 8) * GRANT_SHARE / (GRANT_SHARE - 1) + 1;
    let mut o = NodeOptions::new(dir.join("node.sock"), blocks * BPB as u64);
    // The node's poll window (`kvtier node --poll-us`), for measurements.
    if let Some(us) = std::env::var("KVTIER_NODE_POLL_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        o.poll = Duration::from_micros(us);
    }
    if std::env::var("KVTIER_NODE_HUGE_COLLAPSE").is_ok_and(|v| v == "1") {
        o.huge_pages = crate::storage::node::HugePages::Collapse;
    }
    if let Some(shm) = std::env::var_os("KVTIER_NODE_SHM_DIR") {
        o.shm_dir = shm.into();
    } else if !std::path::Path::new("/dev/shm").is_dir() {
        o.shm_dir = dir.to_path_buf();
    }
    o
}

/// Figures of one node: store, load and repeated (deduplicated) store times, blocks hashed by
/// the engine's client and by the node.
struct NodeRun {
    attach: Duration,
    store: Duration,
    load: Duration,
    /// Round-trip time inside the store and the load.
    store_rtt: Duration,
    load_rtt: Duration,
    dedup: Duration,
    client_hashes: u64,
    node_hashes: u64,
    /// Store jobs through slots granted ahead (one round trip each).
    granted: u64,
}

/// Blocks 0..n stored through a fresh node by an engine whose client trusts its own uid's arena,
/// or (`verify`) checks every block (`node://...?verify=1`, as toward a node of another uid) and loaded back into blocks n..2n, block n + i
/// getting block `from(i)`; checked bit-exact.
fn node_run(
    mem: &DeviceAlloc,
    layout: &StridedLayout,
    keys: &[u128],
    n: u32,
    verify: bool,
    from: impl Fn(u32) -> u32,
) -> NodeRun {
    let dir = tempfile::tempdir().unwrap();
    let o = node_options(dir.path(), n);
    let node = NodeServer::start(&o).unwrap();
    let opts = NodeClientOptions {
        verify,
        ..NodeClientOptions::default()
    };
    let store = Arc::new(NodeStore::connect(node.socket(), "gpu-test", opts).unwrap());
    let e = TransferEngine::builder()
        .device(
            // The test's device allocation outlives the engine; only its jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), DeviceKind::Cuda(0)),
        )
        .remote(store.clone())
        .build()
        .unwrap();
    // The first job attaches: it maps the arena and registers it with CUDA (once per engine
    // and node, as the pinned host tier pins its memory when the engine is built), so it is
    // timed apart from the store (one block under a key of its own).
    let t_attach = timed(
        &e,
        &jobs(&[(0, 0)], Tier::Device, Tier::Remote, &[WARM_KEY]),
    );
    // Store: device blocks 0..n -> the node, `reps()` times under fresh keys (the node evicts
    // earlier reps' blocks as it fills); the last rep's keys are loaded.
    let st: Vec<(u32, u32)> = (0..n).map(|b| (b, 0)).collect();
    let reps = reps();
    let rtt0 = store.round_trip_time();
    let mut stores = Vec::new();
    let mut last = keys.to_vec();
    for r in 0..reps {
        last = rep_keys(keys, r);
        stores.push(timed(&e, &jobs(&st, Tier::Device, Tier::Remote, &last)));
    }
    let keys = last.as_slice();
    let store_rtt = (store.round_trip_time() - rtt0) / reps as u32;
    let t_store = median(stores);
    // A verifying client's jobs are staged (checksums of private copies only): its arena is
    // not registered.
    assert_eq!(
        e.node_arena_registered(),
        !verify,
        "the arena's CUDA registration (see the log)"
    );
    let direct = if verify {
        0
    } else {
        1 + reps * st.len().div_ceil(per_job())
    };
    assert_eq!(e.node_direct_jobs() as usize, direct, "verify: {verify}");
    // A direct store of at most 256 blocks goes through granted slots once the connection holds
    // them (from the second job on); a verifying client's stores are staged, by key.
    let granted = store.stores_granted();
    if verify || per_job() > 256 {
        assert_eq!(granted, 0, "verify: {verify}");
    } else {
        assert!(granted > 0, "no store went through grants");
    }
    assert_eq!(node.stats().puts, (reps * n as usize) as u64 + 1);
    let ld: Vec<(u32, u32)> = (0..n).map(|i| (0, n + i)).collect();
    let mut ld_keys = keys.to_vec();
    for i in 0..n {
        ld_keys[(n + i) as usize] = keys[from(i) as usize];
    }
    let rtt0 = store.round_trip_time();
    let loads: Vec<Duration> = (0..reps)
        .map(|_| timed(&e, &jobs(&ld, Tier::Remote, Tier::Device, &ld_keys)))
        .collect();
    let load_rtt = (store.round_trip_time() - rtt0) / reps as u32;
    let t_load = median(loads);
    for i in (0..n).step_by((n as usize / 32).max(1)) {
        assert_eq!(
            block(mem, layout, n + i),
            block(mem, layout, from(i)),
            "device block {} after the node round trip (verify: {verify})",
            n + i
        );
    }
    // A second store of the same blocks is deduplicated (nothing published).
    let t_dedup = timed(&e, &jobs(&st, Tier::Device, Tier::Remote, keys));
    NodeRun {
        attach: t_attach,
        store: t_store,
        load: t_load,
        store_rtt,
        load_rtt,
        dedup: t_dedup,
        granted: store.stores_granted(),
        client_hashes: store.blocks_hashed(),
        node_hashes: node.stats().verified,
    }
}

#[test]
fn node_gpu_store_and_load_are_bit_exact_and_direct() {
    if !cu::library_present() {
        eprintln!("no CUDA driver: node GPU test skipped");
        return;
    }
    let n: u32 = std::env::var("KVTIER_NODE_GPU_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let _driver = Driver::open(0).unwrap();
    // Source blocks 0..n, destination blocks n..2n of one per-layer cache.
    let total = 2 * n;
    let (mem, layout) = per_layer_cache(total, 7);
    let kind = DeviceKind::Cuda(0);
    let keys: Vec<u128> = (0..total)
        .map(|b| (0x6e6f6465u128 << 64) | b as u128)
        .collect();
    let bytes = n as usize * BPB;

    // A trusting client (no hashing), loaded reversed; then a verifying one (every block hashed
    // by the engine and the node), loaded in order, so each run writes other bytes.
    let private = node_run(&mem, &layout, &keys, n, false, |i| n - 1 - i);
    assert_eq!((private.client_hashes, private.node_hashes), (0, 0));
    let shared = node_run(&mem, &layout, &keys, n, true, |i| i);
    // The engine hashes each block it stores (the attach block and n per rep) and each it loads
    // (n per rep: the attach block is never loaded); the node verifies each commit.
    let r = reps() as u64;
    assert_eq!(
        (shared.client_hashes, shared.node_hashes),
        (2 * r * n as u64 + 1, r * n as u64 + 1)
    );

    // Baseline in the same run: a pinned host tier of n blocks, same layout, same jobs.
    let mut ho = HostOptions::new(n, BPB);
    ho.pin = PinMode::Require;
    let host = Arc::new(HostStorage::new(&ho).unwrap());
    let h = TransferEngine::builder()
        .device(
            // The test's device allocation outlives the engine; only its jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), kind),
        )
        .host(host)
        .build()
        .unwrap();
    let hs: Vec<(u32, u32)> = (0..n).map(|b| (b, b)).collect();
    let hjobs = jobs(&hs, Tier::Device, Tier::Host, &keys);
    let t_hstore = median((0..reps()).map(|_| timed(&h, &hjobs)).collect());
    let hl: Vec<(u32, u32)> = (0..n).map(|i| (n - 1 - i, n + i)).collect();
    let hjobs = jobs(&hl, Tier::Host, Tier::Device, &keys);
    let t_hload = median((0..reps()).map(|_| timed(&h, &hjobs)).collect());
    for i in (0..n).step_by((n as usize / 32).max(1)) {
        assert_eq!(block(&mem, &layout, n + i), block(&mem, &layout, n - 1 - i));
    }
    let (hsb, hlb) = (gbps(bytes, t_hstore), gbps(bytes, t_hload));
    let row = |what: &str, r: &NodeRun| {
        let (s, l) = (gbps(bytes, r.store), gbps(bytes, r.load));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "| {what} | {s:.1} GB/s | {:.2} | {l:.1} GB/s | {:.2} | {:.1} ms | {:.0} ms | {:.2} / {:.2} ms | {:.2} / {:.2} |\n",
            s / hsb,
            l / hlb,
            ms(r.dedup),
            ms(r.attach),
            ms(r.store_rtt),
            ms(r.load_rtt),
            gbps(bytes, r.store.saturating_sub(r.store_rtt)) / hsb,
            gbps(bytes, r.load.saturating_sub(r.load_rtt)) / hlb,
        )
    };
    let report = format!(
        "| tier | store (D2H) | ratio | load (H2D) | ratio | repeated store | first job (attach) | round trips in store / load | ratios without them |\n\
         |---|---|---|---|---|---|---|---|---|\n\
         | pinned host tier | {hsb:.1} GB/s | 1.00 | {hlb:.1} GB/s | 1.00 | | | | |\n\
         {}{}\n{n} blocks of 2 MiB (vLLM per-layer layout, 64 chunks of 32 KiB), jobs of \
         {}, node protocol {}, median of {} timings of each store and load (stores under fresh keys); \
         direct jobs of 256 blocks or more go in parts whose round trips run beside other parts' copies. Node, own uid: direct \
         DMA between device and arena, no hashing; verifying client (`verify=1`, as toward a node \
         of another uid): staged through the engine's pinned bounce buffer, the engine hashing each block's private bytes \
         (a store's source, a load's copy) and the node re-hashing at commit, in parallel. A repeated \
         store is deduplicated (nothing published; no copy where it reserves by key, a copy into its \
         granted slots where a connection stores through grants, jobs of at most 256). From the second \
         job of at most 256 blocks on, a direct store copies into slots the node granted ahead and \
         publishes them in one round trip. The first job (one block) maps the node's arena and registers \
         it with CUDA, timed apart (the host tier pins its memory when the engine is built). Round trips: \
         the engine's time waiting for the node's answers inside the timed store and load; the last \
         column's ratios leave them out (what the copies and checksums alone ran at).\n",
        row("node, own uid", &private),
        row("node, verifying client", &shared),
        per_job(),
        super::NODE_PROTOCOL_VERSION,
        reps(),
    );
    let report = format!(
        "{report}Store jobs through granted slots (one round trip): {} (node, own uid), {} (verifying).\n",
        private.granted, shared.granted
    );
    println!("{report}");
    if let Ok(p) = std::env::var("KVTIER_NODE_GPU_REPORT") {
        std::fs::write(p, &report).unwrap();
    }
}

/// Synchronous loads from the node go like host tier loads (issue 26: a node replay within
/// 1.1x of a host tier replay): `execute_layered` on a node job hands the engine a layer gate
/// (the scatter kernel reads the leased arena slots), and for each layer in turn the "engine"
/// waits on the gate for that layer only, then copies that layer's chunks of every destination
/// block on its own stream: every byte it read must be the stored one. A job with a missing
/// block is not ordered (`enqueued` is never called; the pair is reported failed). Prints the
/// rates of the same load whole-ordered and layered.
#[test]
fn node_loads_are_ordered_and_layered() {
    if !cu::library_present() {
        eprintln!("no CUDA driver: node layered-load GPU test skipped");
        return;
    }
    let _driver = Driver::open(0).unwrap();
    let n: u32 = 256;
    let total = 2 * n;
    let (mem, layout) = per_layer_cache(total, 13);
    let dir = tempfile::tempdir().unwrap();
    let o = node_options(dir.path(), n);
    let _node = NodeServer::start(&o).unwrap();
    let store = Arc::new(
        NodeStore::connect(_node.socket(), "gpu-layered", NodeClientOptions::default()).unwrap(),
    );
    let e = TransferEngine::builder()
        .device(
            // The test's device allocation outlives the engine; only its jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), DeviceKind::Cuda(0)),
        )
        .remote(store)
        .build()
        .unwrap();
    let keys: Vec<u128> = (0..total).map(|b| (0x6c61u128 << 64) | b as u128).collect();
    let st: Vec<(u32, u32)> = (0..n).map(|b| (b, 0)).collect();
    timed(&e, &jobs(&st, Tier::Device, Tier::Remote, &keys));
    assert!(
        e.node_arena_registered(),
        "arena not registered (see the log)"
    );
    let expected: Vec<Vec<u8>> = (0..n).map(|i| block(&mem, &layout, i)).collect();
    // One job of all n blocks: block i -> device block 2n-1-i.
    let pairs: Vec<(u32, u32)> = (0..n).map(|i| (i, 2 * n - 1 - i)).collect();
    let load = crate::transfer::numbered_job(JobId(900), Tier::Remote, Tier::Device, &pairs, |i| {
        keys[i as usize]
    });
    let dsts: Vec<u32> = pairs.iter().map(|p| p.1).collect();
    load_layered_and_check(&e, &load, &layout, &dsts, &expected, "node");
    // A job naming a block the node does not hold: not ordered, the pair reported failed.
    let missing =
        crate::transfer::numbered_job(JobId(901), Tier::Remote, Tier::Device, &pairs, |i| {
            if i == 3 {
                u128::MAX - 1
            } else {
                keys[i as usize]
            }
        });
    let engine = cu::Stream::new(false).unwrap();
    let f = e.fence(Some(engine.raw() as u64)).unwrap();
    let mut called = false;
    let out = e.execute_layered(&missing, &f, engine.raw() as u64, &mut |_| called = true);
    assert!(!called, "a node load with a missing block was ordered");
    assert_eq!(out.failed_pairs(), vec![3]);
    print_layered_rates(&e, &load, "node");
}
