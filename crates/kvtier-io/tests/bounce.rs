//! Device <-> disk and device <-> remote jobs without a host tier, through the TransferEngine's
//! own bounce buffers: bit-exact round trips on CPU device memory in the per-layer layout, jobs
//! several times larger than the buffer, and per-pair failures (a corrupted disk block, a missing
//! remote key, a bad device block id) that leave every other pair intact and never write a
//! failed pair's device block.
#![allow(clippy::unwrap_used)]
mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::Arc;

use common::{job, pattern, PerLayerCache};
use kvtier::transfer::{BlockTransfer, TransferJob, TransferOutcome};
use kvtier::Tier;
use kvtier_io::*;

const LAYERS: usize = 3;
const CHUNK: usize = 1000; // unaligned on purpose
const BPB: usize = LAYERS * 2 * CHUNK;
const BLOCKS: u32 = 11;
/// Smaller than every job below, so jobs run in several slices.
const BOUNCE: u32 = 3;

fn run(e: &TransferEngine, j: &TransferJob) -> TransferOutcome {
    let f = e.fence(None).unwrap();
    e.execute(j, &f)
}

fn reason(out: &TransferOutcome, pair: usize) -> String {
    match out {
        TransferOutcome::Failed(f) => f
            .iter()
            .find(|b| b.pair_index == pair)
            .unwrap()
            .reason
            .clone(),
        TransferOutcome::Ok => panic!("expected a failure"),
    }
}

fn disk(dir: &std::path::Path, io: DiskIoMode) -> Arc<DiskStorage> {
    let mut o = DiskOptions::new(dir, 16, BPB);
    o.io = io;
    o.blocks_per_file = 5;
    Arc::new(DiskStorage::create(&o).unwrap())
}

#[test]
fn device_disk_device_round_trip_without_host_tier() {
    // 1 block: the two legs alternate on one half; 3 blocks: two halves of 1 (the usual shape,
    // overlapped); 8 blocks: two halves of 4, the job in 3 slices.
    for (io, bounce) in [
        (DiskIoMode::Uring, BOUNCE),
        (DiskIoMode::Sync, BOUNCE),
        (DiskIoMode::Auto, 1),
        (DiskIoMode::Auto, 8),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
        for b in 0..BLOCKS {
            cache.write(b, &pattern(b, BPB));
        }
        let d = disk(tmp.path(), io);
        let e = TransferEngine::builder()
            .device(
                // SAFETY: the cache outlives the engine; the test touches it only between jobs.
                unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
            )
            .disk(d.clone())
            .bounce_blocks(bounce)
            .build()
            .unwrap();
        assert!(!e.has_tier(Tier::Host));
        assert_eq!(e.bounce_blocks(), Some(bounce as usize));
        assert_eq!(e.bounce_pinned(), Some(false));
        // Store all 11 device blocks (4 slices) to disk slots 15 - b.
        let store: Vec<(u32, u32)> = (0..BLOCKS).map(|b| (b, 15 - b)).collect();
        assert_eq!(
            run(&e, &job(Tier::Device, Tier::Disk, &store)),
            TransferOutcome::Ok
        );
        // The disk holds the exact bytes (read back through the disk API).
        let mut buf = vec![0u8; BPB];
        for b in 0..BLOCKS {
            d.read_block(15 - b, &mut buf).unwrap();
            assert_eq!(buf, pattern(b, BPB), "disk slot {}", 15 - b);
        }
        // Wipe the device, load back reversed: device block b gets original block 10 - b.
        for b in 0..BLOCKS {
            cache.write(b, &vec![0x5A; BPB]);
        }
        let load: Vec<(u32, u32)> = (0..BLOCKS).map(|b| (15 - (BLOCKS - 1 - b), b)).collect();
        assert_eq!(
            run(&e, &job(Tier::Disk, Tier::Device, &load)),
            TransferOutcome::Ok
        );
        for b in 0..BLOCKS {
            assert_eq!(
                cache.read(b),
                pattern(BLOCKS - 1 - b, BPB),
                "device block {b}"
            );
        }
    }
}

#[test]
fn corrupted_disk_block_fails_only_its_pair_and_leaves_its_device_block() {
    for bounce in [1, BOUNCE, 4] {
        corrupted_disk_block(bounce);
    }
}

fn corrupted_disk_block(bounce: u32) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        cache.write(b, &pattern(b + 50, BPB));
    }
    let d = disk(tmp.path(), DiskIoMode::Auto);
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
        )
        .disk(d.clone())
        .bounce_blocks(bounce)
        .build()
        .unwrap();
    let store: Vec<(u32, u32)> = (0..8).map(|b| (b, b)).collect();
    assert!(run(&e, &job(Tier::Device, Tier::Disk, &store)).is_ok());
    // Flip one payload byte of slot 4.
    let (f, off) = d.slot_position(4).unwrap();
    let path = d.file_paths()[f].clone();
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let at = off + 4096 + 123;
    let mut byte = [0u8; 1];
    file.seek(SeekFrom::Start(at)).unwrap();
    file.read_exact(&mut byte).unwrap();
    file.seek(SeekFrom::Start(at)).unwrap();
    file.write_all(&[byte[0] ^ 0x01]).unwrap();
    file.sync_all().unwrap();
    drop(file);
    // Sentinels in the device blocks to be loaded; slot 12 was never written.
    for b in 0..BLOCKS {
        cache.write(b, &vec![0xC3; BPB]);
    }
    // Pairs: slots 0..8 -> device 0..8, then never-written slot 12 -> device 9, bad slot 99 ->
    // device 10.
    let mut load: Vec<(u32, u32)> = (0..8).map(|b| (b, b)).collect();
    load.push((12, 9));
    load.push((99, 10));
    let out = run(&e, &job(Tier::Disk, Tier::Device, &load));
    assert_eq!(out.failed_pairs(), vec![4, 8, 9], "{out:?}");
    assert!(reason(&out, 4).contains("checksum"), "{out:?}");
    for b in 0..8u32 {
        if b == 4 {
            assert_eq!(cache.read(b), vec![0xC3; BPB], "failed pair touched device");
        } else {
            assert_eq!(cache.read(b), pattern(b + 50, BPB), "device block {b}");
        }
    }
    assert_eq!(cache.read(9), vec![0xC3; BPB]);
    assert_eq!(cache.read(10), vec![0xC3; BPB]);
}

#[test]
fn bad_device_ids_fail_only_their_pairs() {
    for bounce in [1, BOUNCE, 4] {
        bad_device_ids(bounce);
    }
}

fn bad_device_ids(bounce: u32) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        cache.write(b, &pattern(b + 7, BPB));
    }
    let d = disk(tmp.path(), DiskIoMode::Auto);
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
        )
        .disk(d.clone())
        .bounce_blocks(bounce)
        .build()
        .unwrap();
    // Device block 40 does not exist; disk slot 30 does not exist.
    let store = [(0, 0), (40, 1), (2, 2), (3, 30), (4, 4)];
    let out = run(&e, &job(Tier::Device, Tier::Disk, &store));
    assert_eq!(out.failed_pairs(), vec![1, 3], "{out:?}");
    assert!(reason(&out, 1).starts_with("device read"), "{out:?}");
    let mut buf = vec![0u8; BPB];
    for (b, slot) in [(0u32, 0u32), (2, 2), (4, 4)] {
        d.read_block(slot, &mut buf).unwrap();
        assert_eq!(buf, pattern(b + 7, BPB));
    }
    // Slot 1 got nothing: a load from it fails, and device block 40 in a load fails too.
    let out = run(
        &e,
        &job(Tier::Disk, Tier::Device, &[(1, 5), (2, 40), (4, 6)]),
    );
    assert_eq!(out.failed_pairs(), vec![0, 1], "{out:?}");
    assert!(reason(&out, 1).starts_with("device write"), "{out:?}");
    assert_eq!(cache.read(5), pattern(5 + 7, BPB));
    assert_eq!(cache.read(6), pattern(4 + 7, BPB));
}

/// A key no test stores.
const NEVER: u128 = 0xBEEF;

/// Each remote block's key is `keys[i]`, `i` its block number on the remote side; a number past
/// `keys` names [`NEVER`].
fn keyed(src: Tier, dst: Tier, pairs: &[(u32, u32)], keys: &[u128]) -> TransferJob {
    common::keyed_by(src, dst, pairs, |i| {
        keys.get(i as usize).copied().unwrap_or(NEVER)
    })
}

#[test]
fn device_remote_device_round_trip_and_missing_key() {
    for bounce in [1, BOUNCE, 4] {
        remote_round_trip(bounce);
    }
}

fn remote_round_trip(bounce: u32) {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("dir://{}", tmp.path().display());
    let mut producer = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        producer.write(b, &pattern(b + 300, BPB));
    }
    let keys: Vec<u128> = (0..BLOCKS as u128)
        .map(|k| 0xABCD_0000_0000_0000_0000_0000_0000_0000 + k * 977)
        .collect();
    {
        let e = TransferEngine::builder()
            .device(
                // SAFETY: the cache outlives the engine; the test touches it only between jobs.
                unsafe { EngineMemory::new(Arc::new(producer.layout()), DeviceKind::Cpu) },
            )
            .remote(kvtier_io::storage::remote::from_url(&url, "bounce-test").unwrap())
            .bounce_blocks(bounce)
            .build()
            .unwrap();
        // Device block b -> key b.
        let store: Vec<(u32, u32)> = (0..BLOCKS).map(|b| (b, b)).collect();
        assert_eq!(
            run(&e, &keyed(Tier::Device, Tier::Remote, &store, &keys)),
            TransferOutcome::Ok
        );
    }
    // A consumer with its own engine and store handle, as another process would open it.
    let mut consumer = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        consumer.write(b, &vec![0x11; BPB]);
    }
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(consumer.layout()), DeviceKind::Cpu) },
        )
        .remote(kvtier_io::storage::remote::from_url(&url, "bounce-test").unwrap())
        .bounce_blocks(bounce)
        .build()
        .unwrap();
    // Load keys reversed; key 11 (one past the stored ones) is a key never put, and so is the
    // last pair's (index 20: past the key list, `NEVER`).
    let mut load_keys = keys.clone();
    load_keys.push(0xDEAD);
    let mut load: Vec<(u32, u32)> = (0..8).map(|k| (k, 7 - k)).collect();
    load.push((11, 8));
    load.push((10, 10));
    load.push((20, 9));
    let out = run(&e, &keyed(Tier::Remote, Tier::Device, &load, &load_keys));
    assert_eq!(out.failed_pairs(), vec![8, 10], "{out:?}");
    assert!(reason(&out, 8).contains("not present"), "{out:?}");
    assert!(reason(&out, 10).contains("not present"), "{out:?}");
    for k in 0..8u32 {
        assert_eq!(
            consumer.read(7 - k),
            pattern(k + 300, BPB),
            "device block {}",
            7 - k
        );
    }
    assert_eq!(
        consumer.read(8),
        vec![0x11; BPB],
        "missing key touched device"
    );
    assert_eq!(consumer.read(9), vec![0x11; BPB]);
    assert_eq!(consumer.read(10), pattern(10 + 300, BPB));
}

/// Loads and stores on disjoint blocks from several threads at once share the two bounce
/// buffers correctly.
#[test]
fn concurrent_staged_jobs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cache = PerLayerCache::new(LAYERS, BLOCKS, CHUNK);
    for b in 0..BLOCKS {
        cache.write(b, &pattern(b + 900, BPB));
    }
    let d = disk(tmp.path(), DiskIoMode::Auto);
    let e = Arc::new(
        TransferEngine::builder()
            .device(
                // SAFETY: the cache outlives the engine; the test touches it only between jobs.
                unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
            )
            .disk(d)
            .bounce_blocks(2)
            .build()
            .unwrap(),
    );
    // Slots 0..5 hold blocks 0..5 first.
    let first: Vec<(u32, u32)> = (0..5).map(|b| (b, b)).collect();
    assert!(run(&e, &job(Tier::Device, Tier::Disk, &first)).is_ok());
    std::thread::scope(|s| {
        let e1 = e.clone();
        // Store device blocks 0..5 into slots 10..15 while loading slots 0..5 into device
        // blocks 5..10 (disjoint blocks, as the pools guarantee).
        s.spawn(move || {
            let p: Vec<(u32, u32)> = (0..5).map(|b| (b, 10 + b)).collect();
            assert!(run(&e1, &job(Tier::Device, Tier::Disk, &p)).is_ok());
        });
        let e2 = e.clone();
        s.spawn(move || {
            let p: Vec<(u32, u32)> = (0..5).map(|b| (4 - b, 5 + b)).collect();
            assert!(run(&e2, &job(Tier::Disk, Tier::Device, &p)).is_ok());
        });
    });
    for b in 0..5u32 {
        assert_eq!(cache.read(5 + b), pattern(4 - b + 900, BPB));
    }
    let back: Vec<(u32, u32)> = (0..5).map(|b| (10 + b, b)).collect();
    assert!(run(&e, &job(Tier::Disk, Tier::Device, &back)).is_ok());
    for b in 0..5u32 {
        assert_eq!(cache.read(b), pattern(b + 900, BPB));
    }
}
