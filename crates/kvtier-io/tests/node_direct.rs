//! The node tier as an engine's only host tier (node-only): device <-> arena jobs of the
//! `TransferEngine` on CPU device memory (the same code path a CUDA engine takes once its arena
//! mapping is registered): bit-exact round trips between two engines, per-pair failures (a
//! missing key, a slot patched in the arena, a bad device block, a full node) that leave every
//! other pair intact, never touch a failed pair's device block and never leave a half-written
//! block visible or a lease behind.
#![allow(clippy::unwrap_used)]
mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{pattern, PerLayerCache};
use kvtier::hash::SequenceHash;
use kvtier::transfer::{BlockTransfer, RemoteStore, TransferJob, TransferOutcome};
use kvtier::{DeviceBlockId, JobId, Tier};
use kvtier_io::storage::node::{NodeClientOptions, NodeOptions, NodeServer, NodeStore};
use kvtier_io::*;

const LAYERS: usize = 2;
const CHUNK: usize = 1024;
const BPB: usize = LAYERS * 2 * CHUNK;
const BLOCKS: u32 = 10;

fn node(dir: &Path, blocks: u64) -> NodeServer {
    let mut o = NodeOptions::new(dir.join("node.sock"), blocks * BPB as u64);
    o.shm_dir = dir.to_path_buf();
    NodeServer::start(&o).unwrap()
}

fn store(n: &NodeServer) -> Arc<NodeStore> {
    store_with(n, false)
}

/// A client of `n`; `verify`: one that checks every block (`node://...?verify=1`).
fn store_with(n: &NodeServer, verify: bool) -> Arc<NodeStore> {
    let opts = NodeClientOptions {
        verify,
        // These tests count the node's requests and granted bytes: idle grants stay (only
        // `a_connection_left_idle_gives_its_grants_back` has them given back).
        grants_idle: std::time::Duration::from_secs(3600),
        ..NodeClientOptions::default()
    };
    Arc::new(NodeStore::connect(n.socket(), "m", opts).unwrap())
}

fn engine(cache: &PerLayerCache, node: Arc<NodeStore>) -> TransferEngine {
    engine_with(cache, node, 2)
}

/// An engine whose bounce buffers hold `bounce` blocks (a staged job goes in slices of half).
fn engine_with(cache: &PerLayerCache, node: Arc<NodeStore>, bounce: u32) -> TransferEngine {
    TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
        )
        .remote(node)
        .bounce_blocks(bounce)
        .build()
        .unwrap()
}

/// Device blocks `devs[k]` <-> keys `keys[k]`.
fn job(src: Tier, dst: Tier, devs: &[u32], keys: &[u128]) -> TransferJob {
    assert_eq!(devs.len(), keys.len(), "one key per device block");
    let pairs = devs
        .iter()
        .zip(keys)
        .map(|(&d, &k)| (DeviceBlockId(d), SequenceHash(k)));
    match (src, dst) {
        (Tier::Device, Tier::Remote) => TransferJob::from_pairs(JobId(1), pairs),
        (Tier::Remote, Tier::Device) => {
            TransferJob::from_pairs(JobId(1), pairs.map(|(d, k)| (k, d)))
        }
        _ => panic!("node jobs are device <-> remote"),
    }
}

fn run(e: &TransferEngine, j: &TransferJob) -> TransferOutcome {
    let f = e.fence(None).unwrap();
    e.execute(j, &f)
}

fn key(b: u32) -> u128 {
    (0xABCD_u128 << 64) | b as u128
}

#[test]
fn blocks_go_device_to_arena_and_back_to_another_engine_bit_exact() {
    for verify in [false, true] {
        round_trip(verify);
    }
}

/// The node's requests since `since` once they reach `expected` (a direct store's `Grant` is
/// sent after the store returns and counted when the node serves it), and a moment later: no
/// more came.
fn requests_since(n: &NodeServer, since: u64, expected: u64) -> u64 {
    let t = std::time::Instant::now();
    while n.stats().requests - since < expected && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    n.stats().requests - since
}

/// One round trip per phase per job (the node counts requests): a store is `Reserve` +
/// `Finish`, a load `Lease` + `EndLeases`, a deduplicated store `Reserve` alone; a direct store
/// then asks for grants (`Grant`, one request more; this arena of 32 blocks grants 4, too few for
/// the next store of 10 to go through them). A private node
/// takes the direct path and hashes nothing; a verifying connection's jobs are staged (one slice
/// here: bounce halves of a whole job), hashed by the writer before its copy, by the node at
/// commit and by the reader over its private copy.
fn round_trip(verify: bool) {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 32);
    let mut a_cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        a_cache.write(b, &pattern(b, BPB));
    }
    let a_node = store_with(&n, verify);
    let a = engine_with(&a_cache, a_node.clone(), 2 * BLOCKS);
    let devs: Vec<u32> = (0..BLOCKS).collect();
    let direct = u64::from(!verify);
    let keys: Vec<u128> = devs.iter().map(|&b| key(b)).collect();
    let rt = n.stats().requests;
    assert_eq!(
        run(&a, &job(Tier::Device, Tier::Remote, &devs, &keys)),
        TransferOutcome::Ok
    );
    assert_eq!(
        requests_since(&n, rt, 2 + direct),
        2 + direct,
        "round trips of a store job"
    );
    assert_eq!(a.node_direct_jobs(), direct, "verify: {verify}");
    assert_eq!(n.stats().puts, BLOCKS as u64);
    let hashes = if verify { BLOCKS as u64 } else { 0 };
    assert_eq!(a_node.blocks_hashed(), hashes, "verify: {verify}");
    assert_eq!(n.stats().verified, hashes, "verify: {verify}");
    // The arena holds the exact bytes (read by a plain client, verified against its checksum).
    let probe = store(&n);
    let mut buf = vec![0u8; BPB];
    for b in 0..BLOCKS {
        probe.get(SequenceHash(key(b)), &mut buf).unwrap();
        assert_eq!(buf, pattern(b, BPB), "arena block {b}");
    }
    // Storing again is deduplicated by the node (no second write).
    let rt = n.stats().requests;
    assert!(run(&a, &job(Tier::Device, Tier::Remote, &devs, &keys)).is_ok());
    assert_eq!(n.stats().puts, BLOCKS as u64);
    assert_eq!(
        requests_since(&n, rt, 1 + direct),
        1 + direct,
        "a deduplicated store: Reserve only"
    );
    // Another engine loads them reversed into its own blocks.
    let mut b_cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        b_cache.write(b, &[0x5A; BPB]);
    }
    let b_node = store_with(&n, verify);
    let e2 = engine_with(&b_cache, b_node.clone(), 2 * BLOCKS);
    let rev: Vec<u32> = (0..BLOCKS).rev().collect();
    let rt = n.stats().requests;
    assert_eq!(
        run(&e2, &job(Tier::Remote, Tier::Device, &rev, &keys)),
        TransferOutcome::Ok
    );
    assert_eq!(n.stats().requests - rt, 2, "round trips of a load job");
    assert_eq!(b_node.blocks_hashed(), hashes, "verify: {verify}");
    for (k, &d) in rev.iter().enumerate() {
        assert_eq!(b_cache.read(d), pattern(k as u32, BPB), "device block {d}");
    }
    assert_eq!(e2.node_direct_jobs(), direct, "verify: {verify}");
    // Every lease ended: the whole arena can be evicted for another namespace's puts.
    let other = NodeStore::connect(n.socket(), "other", NodeClientOptions::default()).unwrap();
    for k in 0..32u128 {
        other
            .put(SequenceHash(1000 + k), &pattern(k as u32, BPB))
            .unwrap();
    }
    assert_eq!(n.stats().puts_full, 0, "a lease leaked: {:?}", n.stats());
}

#[test]
fn failed_pairs_fail_alone_and_never_touch_their_device_block() {
    // A verifying engine: the patched block below is caught by the reader's check (a reader
    // that does not verify trusts its own uid's bytes: see node_tier.rs).
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 16);
    let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        cache.write(b, &pattern(b + 7, BPB));
    }
    let e = engine(&cache, store_with(&n, true));
    // Store 0..6; device block 99 does not exist: that pair fails and nothing becomes visible.
    let devs = [0, 1, 2, 3, 4, 99];
    let keys: Vec<u128> = (0..6).map(key).collect();
    let out = run(&e, &job(Tier::Device, Tier::Remote, &devs, &keys));
    assert_eq!(out.failed_pairs(), vec![5], "{out:?}");
    let probe = store(&n);
    assert_eq!(
        probe
            .contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())
            .unwrap(),
        vec![true, true, true, true, true, false],
        "a failed store's block is visible"
    );
    assert_eq!(n.stats().blocks, 5, "the aborted slot is not a block");
    // Patch block 2's slot in the arena (a rogue writer): its load fails the checksum before any
    // byte reaches the device and the node drops it.
    {
        let lease = NodeStore::connect(n.socket(), "m", NodeClientOptions::default()).unwrap();
        let mut buf = vec![0u8; BPB];
        lease.get(SequenceHash(key(2)), &mut buf).unwrap();
        // The slot of block 2 is where its bytes are in the arena file.
        let arena = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().ends_with(".arena"))
            .unwrap()
            .path();
        let all = std::fs::read(&arena).unwrap();
        let at = all.windows(BPB).position(|w| w == buf.as_slice()).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&arena)
            .unwrap();
        f.write_all_at(&[buf[100] ^ 0xFF], (at + 100) as u64)
            .unwrap();
    }
    for b in 0..BLOCKS {
        cache.write(b, &[0xC3; BPB]);
    }
    // Load keys 0..5 (key 5 was never stored) into device blocks 0..5.
    let devs = [0, 1, 2, 3, 4, 5];
    let out = run(&e, &job(Tier::Remote, Tier::Device, &devs, &keys));
    assert_eq!(out.failed_pairs(), vec![2, 5], "{out:?}");
    let TransferOutcome::Failed(f) = &out else {
        unreachable!()
    };
    assert!(f[0].reason.contains("corrupt"), "{out:?}");
    assert!(f[1].reason.contains("not present"), "{out:?}");
    for b in [0u32, 1, 3, 4] {
        assert_eq!(cache.read(b), pattern(b + 7, BPB), "device block {b}");
    }
    for b in [2u32, 5] {
        assert_eq!(cache.read(b), vec![0xC3; BPB], "failed pair touched device");
    }
    assert_eq!(
        probe.contains(&[SequenceHash(key(2))]).unwrap(),
        vec![false],
        "the damaged block is dropped"
    );
}

#[test]
fn a_full_node_fails_the_stores_it_cannot_take_and_the_rest_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 3);
    let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        cache.write(b, &pattern(b + 3, BPB));
    }
    let e = engine(&cache, store(&n));
    // A reader holds leases on all 3 slots' blocks: nothing can be evicted.
    let first: Vec<u128> = (0..3).map(key).collect();
    assert!(run(&e, &job(Tier::Device, Tier::Remote, &[0, 1, 2], &first)).is_ok());
    let mut raw = std::os::unix::net::UnixStream::connect(n.socket()).unwrap();
    use kvtier_io::storage::node::{GetAnswer, Reply, Request, NODE_PROTOCOL_VERSION};
    let mut call = |r: &Request| -> Reply {
        use std::io::{Read, Write};
        let body = postcard::to_stdvec(r).unwrap();
        raw.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        raw.write_all(&body).unwrap();
        let mut len = [0u8; 4];
        raw.read_exact(&mut len).unwrap();
        let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
        raw.read_exact(&mut buf).unwrap();
        let reply: Reply = postcard::from_bytes(&buf).unwrap();
        if matches!(reply, Reply::Welcome { .. }) {
            // The byte that carries the arena's descriptor (closed unread here).
            raw.read_exact(&mut [0u8; 1]).unwrap();
        }
        reply
    };
    call(&Request::Hello {
        version: NODE_PROTOCOL_VERSION,
        namespace: "m".into(),
    });
    let leased = call(&Request::Lease(first.clone()));
    let Reply::Leased(v) = leased else {
        panic!("{leased:?}")
    };
    assert!(v.iter().all(|a| matches!(a, GetAnswer::Lease { .. })));
    let more: Vec<u128> = (3..6).map(key).collect();
    let out = run(&e, &job(Tier::Device, Tier::Remote, &[3, 4, 5], &more));
    assert_eq!(out.failed_pairs(), vec![0, 1, 2], "{out:?}");
    assert!(n.stats().puts_full >= 3);
    // The reader goes away (its leases end with its connection): the stores succeed now.
    drop(raw);
    let mut ok = false;
    for _ in 0..200 {
        if run(&e, &job(Tier::Device, Tier::Remote, &[3, 4, 5], &more)).is_ok() {
            ok = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(ok, "leases of a closed connection were not released");
}

/// A synchronous load from the node is ordered like a host tier load (`execute_ordered`): the
/// engine is told it may go on (`enqueued`) once every pair's bytes are in its blocks, so it
/// computes on them at once; a job with a pair already failed (a missing block) is never
/// ordered: the engine waits for the outcome, which names that pair alone. Stores are never
/// ordered.
#[test]
fn sync_node_loads_are_ordered_only_when_every_pair_is_leased() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 32);
    let mut a_cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        a_cache.write(b, &pattern(b, BPB));
    }
    let a = engine(&a_cache, store(&n));
    let devs: Vec<u32> = (0..BLOCKS).collect();
    let keys: Vec<u128> = devs.iter().map(|&b| key(b)).collect();
    let mut called = false;
    let f = a.fence(None).unwrap();
    let out = a.execute_ordered(
        &job(Tier::Device, Tier::Remote, &devs, &keys),
        &f,
        0,
        &mut || called = true,
    );
    assert_eq!(out, TransferOutcome::Ok);
    assert!(!called, "a store was ordered");
    let mut b_cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        b_cache.write(b, &[0x5A; BPB]);
    }
    let b = engine(&b_cache, store(&n));
    let rev: Vec<u32> = (0..BLOCKS).rev().collect();
    // Every pair present: `enqueued` is called, after the bytes landed (CPU: the copy is done).
    let mut seen_at_enqueue = Vec::new();
    let f = b.fence(None).unwrap();
    let out = b.execute_ordered(
        &job(Tier::Remote, Tier::Device, &rev, &keys),
        &f,
        0,
        &mut || seen_at_enqueue = rev.iter().map(|&d| b_cache.read(d)).collect(),
    );
    assert_eq!(out, TransferOutcome::Ok);
    assert_eq!(
        seen_at_enqueue.len(),
        BLOCKS as usize,
        "a full node load was not ordered"
    );
    for (k, got) in seen_at_enqueue.iter().enumerate() {
        assert_eq!(
            got,
            &pattern(k as u32, BPB),
            "device block {} at enqueue",
            rev[k]
        );
    }
    assert_eq!(b.node_direct_jobs(), 1);
    // One block missing: never ordered; only that pair failed.
    let mut gone = keys.clone();
    gone[4] = key(999);
    let mut called = false;
    let f = b.fence(None).unwrap();
    let out = b.execute_layered(
        &job(Tier::Remote, Tier::Device, &rev, &gone),
        &f,
        0,
        &mut |_| called = true,
    );
    assert!(!called, "a node load with a missing block was ordered");
    assert_eq!(out.failed_pairs(), vec![4]);
}

/// A host tier in front of the node: the leader's host -> remote and remote -> host jobs are
/// batched by the staged paths (one round trip per phase per job, not per block), bit-exact.
#[test]
fn host_tier_jobs_to_and_from_the_node_take_one_round_trip_per_phase() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 32);
    let host = Arc::new(HostStorage::new(&HostOptions::new(2 * BLOCKS, BPB)).unwrap());
    for b in 0..BLOCKS {
        host.write_block(b, &pattern(b + 3, BPB)).unwrap();
    }
    let e = TransferEngine::builder()
        .host(host.clone())
        .remote(store(&n))
        .build()
        .unwrap();
    let out: Vec<(u32, u32)> = (0..BLOCKS).map(|b| (b, b)).collect();
    let rt = n.stats().requests;
    let j = common::keyed_by(Tier::Host, Tier::Remote, &out, key);
    assert_eq!(run(&e, &j), TransferOutcome::Ok);
    assert_eq!(
        n.stats().requests - rt,
        2,
        "Reserve + Finish for the whole job"
    );
    assert_eq!(n.stats().puts, BLOCKS as u64);
    // Back into other host blocks, reversed.
    let back: Vec<(u32, u32)> = (0..BLOCKS).map(|b| (b, 2 * BLOCKS - 1 - b)).collect();
    let rt = n.stats().requests;
    let j = common::keyed_by(Tier::Remote, Tier::Host, &back, key);
    assert_eq!(run(&e, &j), TransferOutcome::Ok);
    assert_eq!(
        n.stats().requests - rt,
        2,
        "Lease + EndLeases for the whole job"
    );
    let mut buf = vec![0u8; BPB];
    for b in 0..BLOCKS {
        host.read_block(2 * BLOCKS - 1 - b, &mut buf).unwrap();
        assert_eq!(
            buf,
            pattern(b + 3, BPB),
            "host block {}",
            2 * BLOCKS - 1 - b
        );
    }
}
