//! Round trips through every tier are bit-exact for both device layouts (contiguous pool and
//! per-layer K/V planes), aligned and unaligned block sizes, io_uring and pread/pwrite, direct
//! and buffered I/O.
#![allow(clippy::unwrap_used)]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{job, pattern, PerLayerCache};
use kvtier::hash::SequenceHash;
use kvtier::transfer::{BlockTransfer, RemoteStore, TransferError, TransferJob, TransferOutcome};
use kvtier::{BlockId, JobId, Tier};
use kvtier_io::*;

fn host(blocks: u32, bytes: usize) -> Arc<HostStorage> {
    let mut o = HostOptions::new(blocks, bytes);
    o.pin = PinMode::Never;
    Arc::new(HostStorage::new(&o).unwrap())
}

fn disk(
    dir: &std::path::Path,
    blocks: u32,
    bytes: usize,
    io: DiskIoMode,
    direct: DirectMode,
) -> Arc<DiskStorage> {
    let mut o = DiskOptions::new(dir, blocks, bytes);
    o.io = io;
    o.direct = direct;
    o.blocks_per_file = 3; // several files
    Arc::new(DiskStorage::create(&o).unwrap())
}

fn run(e: &TransferEngine, j: kvtier::transfer::TransferJob) -> TransferOutcome {
    let f = e.fence(None).unwrap();
    e.execute(&j, &f)
}

fn full_cycle(chunk: usize, io: DiskIoMode, direct: DirectMode) {
    let (layers, blocks) = (3, 6u32);
    let mut cache = PerLayerCache::new(layers, blocks, chunk);
    let bpb = layers * 2 * chunk;
    for b in 0..blocks {
        cache.write(b, &pattern(b, bpb));
    }
    let tmp = tempfile::tempdir().unwrap();
    let h = host(8, bpb);
    let d = disk(&tmp.path().join("cache"), 8, bpb, io, direct);
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
        )
        .host(h.clone())
        .disk(d.clone())
        .build()
        .unwrap();
    // device -> host (blocks 0..6 to host 7..2), host -> disk, host -> host.
    let d2h: Vec<(u32, u32)> = (0..blocks).map(|b| (b, 7 - b)).collect();
    assert_eq!(
        run(&e, job(Tier::Device, Tier::Host, &d2h)),
        TransferOutcome::Ok
    );
    let h2d: Vec<(u32, u32)> = (0..blocks).map(|b| (7 - b, b + 1)).collect();
    assert_eq!(
        run(&e, job(Tier::Host, Tier::Disk, &h2d)),
        TransferOutcome::Ok
    );
    // wipe host and device, then bring everything back from disk.
    for b in 0..8 {
        h.write_block(b, &vec![0xAA; bpb]).unwrap();
    }
    for b in 0..blocks {
        cache.write(b, &vec![0x55; bpb]);
    }
    let back: Vec<(u32, u32)> = (0..blocks).map(|b| (b + 1, b)).collect();
    assert_eq!(
        run(&e, job(Tier::Disk, Tier::Host, &back)),
        TransferOutcome::Ok
    );
    assert_eq!(
        run(&e, job(Tier::Host, Tier::Host, &[(0, 7)])),
        TransferOutcome::Ok
    );
    // device block b gets original block (blocks-1-b) via host block b.
    let up: Vec<(u32, u32)> = (0..blocks).map(|b| (b, blocks - 1 - b)).collect();
    assert_eq!(
        run(&e, job(Tier::Host, Tier::Device, &up)),
        TransferOutcome::Ok
    );
    for b in 0..blocks {
        assert_eq!(cache.read(blocks - 1 - b), pattern(b, bpb), "block {b}");
    }
    let mut out = vec![0u8; bpb];
    h.read_block(7, &mut out).unwrap();
    assert_eq!(out, pattern(0, bpb), "host-to-host copy");
}

#[test]
fn per_layer_aligned_uring_direct() {
    full_cycle(4096, DiskIoMode::Uring, DirectMode::Auto);
}

#[test]
fn per_layer_aligned_sync_direct() {
    full_cycle(8192, DiskIoMode::Sync, DirectMode::Auto);
}

#[test]
fn per_layer_unaligned_uring() {
    full_cycle(1000, DiskIoMode::Uring, DirectMode::Auto);
}

#[test]
fn per_layer_unaligned_buffered_sync() {
    full_cycle(777, DiskIoMode::Sync, DirectMode::Off);
}

#[test]
fn contiguous_pool_layout_round_trip() {
    let (blocks, bpb) = (5u32, 3 * 4096 + 100);
    let mut pool: Vec<u8> = (0..blocks).flat_map(|b| pattern(b + 100, bpb)).collect();
    let layout = StridedLayout::contiguous(
        DevicePtr::from_host(pool.as_mut_ptr()).unwrap(),
        blocks,
        bpb,
    )
    .unwrap();
    let h = host(5, bpb);
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(layout), DeviceKind::Cpu) },
        )
        .host(h.clone())
        .build()
        .unwrap();
    assert!(run(
        &e,
        job(
            Tier::Device,
            Tier::Host,
            &[(0, 4), (1, 3), (2, 2), (3, 1), (4, 0)]
        )
    )
    .is_ok());
    pool.iter_mut().for_each(|b| *b = 0);
    assert!(run(
        &e,
        job(
            Tier::Host,
            Tier::Device,
            &[(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
        )
    )
    .is_ok());
    for b in 0..blocks as usize {
        assert_eq!(
            &pool[b * bpb..(b + 1) * bpb],
            &pattern(4 - b as u32 + 100, bpb)[..]
        );
    }
}

#[test]
fn bad_ids_fail_only_their_pairs() {
    let mut pool = vec![1u8; 4 * 512];
    let layout =
        StridedLayout::contiguous(DevicePtr::from_host(pool.as_mut_ptr()).unwrap(), 4, 512)
            .unwrap();
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(layout), DeviceKind::Cpu) },
        )
        .host(host(2, 512))
        .build()
        .unwrap();
    let out = run(
        &e,
        job(Tier::Device, Tier::Host, &[(0, 0), (9, 1), (1, 5), (2, 1)]),
    );
    assert_eq!(out.failed_pairs(), vec![1, 2]);
    // A tier that is not configured fails every pair.
    let out = run(&e, job(Tier::Host, Tier::Disk, &[(0, 0), (1, 1)]));
    assert_eq!(out.failed_pairs(), vec![0, 1]);
    assert!(!e.has_tier(Tier::Disk));
}

#[test]
fn mismatched_block_sizes_are_rejected() {
    let mut pool = vec![0u8; 1024];
    let layout =
        StridedLayout::contiguous(DevicePtr::from_host(pool.as_mut_ptr()).unwrap(), 2, 512)
            .unwrap();
    let r = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(layout), DeviceKind::Cpu) },
        )
        .host(host(2, 256))
        .build();
    assert!(matches!(r, Err(IoError::Config(_))));
}

#[derive(Default)]
struct MemRemote {
    map: Mutex<HashMap<SequenceHash, Vec<u8>>>,
}

impl RemoteStore for MemRemote {
    fn put(&self, key: SequenceHash, data: &[u8]) -> Result<(), TransferError> {
        self.map.lock().unwrap().insert(key, data.to_vec());
        Ok(())
    }
    fn get(&self, key: SequenceHash, out: &mut [u8]) -> Result<(), TransferError> {
        let m = self.map.lock().unwrap();
        let v = m
            .get(&key)
            .ok_or_else(|| TransferError::Other(format!("key {:x} missing", key.0)))?;
        if v.len() != out.len() {
            return Err(TransferError::Other("wrong length".into()));
        }
        out.copy_from_slice(v);
        Ok(())
    }
    fn contains(&self, keys: &[SequenceHash]) -> Result<Vec<bool>, TransferError> {
        let m = self.map.lock().unwrap();
        Ok(keys.iter().map(|k| m.contains_key(k)).collect())
    }
}

#[test]
fn host_remote_round_trip_and_missing_key() {
    let h = host(4, 300);
    let remote = Arc::new(MemRemote::default());
    let e = TransferEngine::builder()
        .host(h.clone())
        .remote(remote.clone())
        .build()
        .unwrap();
    h.write_block(0, &pattern(1, 300)).unwrap();
    h.write_block(1, &pattern(2, 300)).unwrap();
    let put = TransferJob::from_pairs(
        JobId(1),
        [
            (BlockId(0), SequenceHash(0xAB)),
            (BlockId(1), SequenceHash(0xCD)),
        ],
    );
    assert!(run(&e, put).is_ok());
    let get = TransferJob::from_pairs(
        JobId(2),
        [(0xCD, 2), (0xAB, 3), (0xEF, 0)].map(|(k, b)| (SequenceHash(k), BlockId(b))),
    );
    assert_eq!(run(&e, get).failed_pairs(), vec![2]);
    let mut out = vec![0u8; 300];
    h.read_block(2, &mut out).unwrap();
    assert_eq!(out, pattern(2, 300));
    h.read_block(3, &mut out).unwrap();
    assert_eq!(out, pattern(1, 300));
}

#[test]
fn concurrent_jobs_on_disjoint_blocks() {
    let bpb = 64 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let h = host(32, bpb);
    let d = disk(tmp.path(), 32, bpb, DiskIoMode::Auto, DirectMode::Auto);
    let e = Arc::new(
        TransferEngine::builder()
            .host(h.clone())
            .disk(d)
            .build()
            .unwrap(),
    );
    for b in 0..32 {
        h.write_block(b, &pattern(b, bpb)).unwrap();
    }
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let e = e.clone();
            s.spawn(move || {
                let pairs: Vec<(u32, u32)> = (t * 8..t * 8 + 8).map(|b| (b, 31 - b)).collect();
                assert!(run(&e, job(Tier::Host, Tier::Disk, &pairs)).is_ok());
            });
        }
    });
    for b in 0..32 {
        h.write_block(b, &vec![0; bpb]).unwrap();
    }
    let pairs: Vec<(u32, u32)> = (0..32).map(|b| (b, b)).collect();
    assert!(run(&e, job(Tier::Disk, Tier::Host, &pairs)).is_ok());
    let mut out = vec![0u8; bpb];
    for b in 0..32 {
        h.read_block(b, &mut out).unwrap();
        assert_eq!(out, pattern(31 - b, bpb));
    }
}

/// The core crate's `DeviceLayout` (what engines register) drives the engine directly: vLLM's
/// CPU layout and TensorRT-LLM's pool, both bit-exact through host and back.
#[test]
fn core_device_layouts_round_trip() {
    use kvtier::layout::{DType, DeviceLayout, TensorDesc};
    let (blocks, heads, bs, hd) = (5usize, 2usize, 4usize, 8usize);
    // vLLM CPU: per layer [num_blocks, kv_heads, block_size, 2 * head_size] f32.
    let mut layers: Vec<Vec<f32>> = (0..3)
        .map(|_| vec![0f32; blocks * heads * bs * 2 * hd])
        .collect();
    for (l, t) in layers.iter_mut().enumerate() {
        for (i, v) in t.iter_mut().enumerate() {
            *v = (l * 100000 + i) as f32;
        }
    }
    let orig = layers.clone();
    let descs: Vec<TensorDesc> = layers
        .iter()
        .enumerate()
        .map(|(l, t)| {
            TensorDesc::contiguous(
                format!("l{l}"),
                t.as_ptr() as u64,
                vec![blocks, heads, bs, 2 * hd],
                4,
                DeviceKind::Cpu,
            )
        })
        .collect();
    let layout = DeviceLayout::vllm_cpu(&descs, DType::F32).unwrap();
    let bpb = layout.bytes_per_block();
    let h = host(blocks as u32, bpb);
    // The safe registration: every region checked against the tensors (the test owns them and
    // keeps them past the engine).
    let owned = descs
        .iter()
        .map(|d| TensorMemory::of(d, None).unwrap())
        .collect();
    let e = TransferEngine::builder()
        .device(EngineMemory::from_tensors(layout, owned).unwrap())
        .host(h.clone())
        .build()
        .unwrap();
    assert_eq!(e.device_kind(), Some(DeviceKind::Cpu));
    let pairs: Vec<(u32, u32)> = (0..blocks as u32).map(|b| (b, b)).collect();
    assert!(run(&e, job(Tier::Device, Tier::Host, &pairs)).is_ok());
    for t in layers.iter_mut() {
        t.iter_mut().for_each(|v| *v = -1.0);
    }
    assert!(run(&e, job(Tier::Host, Tier::Device, &pairs)).is_ok());
    assert_eq!(layers, orig);

    // TensorRT-LLM pool: [num_blocks, layers, 2, tokens*heads*dim] bf16 (as u16).
    let (nl, inner) = (4usize, bs * heads * hd);
    let mut pool: Vec<u16> = (0..blocks * nl * 2 * inner)
        .map(|i| (i * 7 % 65521) as u16)
        .collect();
    let orig = pool.clone();
    let d = TensorDesc::contiguous(
        "pool",
        pool.as_mut_ptr() as u64,
        vec![blocks, nl, 2, inner],
        2,
        DeviceKind::Cpu,
    );
    let layout = DeviceLayout::trtllm(&d, bs, DType::BF16).unwrap();
    let h = host(blocks as u32, layout.bytes_per_block());
    let owned = vec![TensorMemory::of(&d, None).unwrap()];
    let e = TransferEngine::builder()
        .device(EngineMemory::from_tensors(layout, owned).unwrap())
        .host(h)
        .build()
        .unwrap();
    assert!(run(&e, job(Tier::Device, Tier::Host, &[(0, 4), (4, 0), (2, 2)])).is_ok());
    pool.iter_mut().for_each(|v| *v = 0);
    assert!(run(&e, job(Tier::Host, Tier::Device, &[(4, 0), (0, 4), (2, 2)])).is_ok());
    for b in [0usize, 2, 4] {
        let r = b * nl * 2 * inner..(b + 1) * nl * 2 * inner;
        assert_eq!(pool[r.clone()], orig[r]);
    }
}

/// A tier that cannot be set up is left out with its reason; the engine still works.
#[test]
fn failing_tiers_are_left_out_not_fatal() {
    let mut ho = HostOptions::new(u32::MAX, 1 << 30);
    ho.pin = PinMode::Never;
    let file = tempfile::NamedTempFile::new().unwrap();
    // A regular file where the cache directory should be.
    let d = DiskOptions::new(file.path().join("sub"), 4, 4096);
    let mut pool = vec![0u8; 4 * 4096];
    let layout =
        StridedLayout::contiguous(DevicePtr::from_host(pool.as_mut_ptr()).unwrap(), 4, 4096)
            .unwrap();
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(layout), DeviceKind::Cpu) },
        )
        .host_from(&ho)
        .disk_from(&d)
        .build()
        .unwrap();
    assert!(!e.has_tier(Tier::Host) && !e.has_tier(Tier::Disk) && e.has_tier(Tier::Device));
    assert_eq!(e.setup_errors().len(), 2);
    assert!(
        e.setup_errors()[0].contains("lower host.gb or host.num_blocks"),
        "{:?}",
        e.setup_errors()
    );
    assert_eq!(
        run(&e, job(Tier::Device, Tier::Host, &[(0, 0)])).failed_pairs(),
        vec![0]
    );
}

/// `execute_ordered` (synchronous loads): a host -> device load tells the caller it may go on
/// exactly once, and only with every pair good; its bytes are in place when it does (CPU: the
/// copies are done); a load with a failed pair, or a job in any other direction, never tells.
#[test]
fn ordered_loads_signal_once_and_only_when_every_pair_is_good() {
    let (layers, blocks, chunk) = (2, 4u32, 256);
    let cache = PerLayerCache::new(layers, blocks, chunk);
    let bpb = layers * 2 * chunk;
    let h = host(4, bpb);
    for b in 0..4 {
        h.write_block(b, &pattern(b + 40, bpb)).unwrap();
    }
    let e = TransferEngine::builder()
        .device(
            // SAFETY: the cache outlives the engine; the test touches it only between jobs.
            unsafe { EngineMemory::new(Arc::new(cache.layout()), DeviceKind::Cpu) },
        )
        .host(h.clone())
        .build()
        .unwrap();
    let ordered = |j: kvtier::transfer::TransferJob, cache: &PerLayerCache| {
        let f = e.fence(None).unwrap();
        let mut seen = Vec::new();
        let out = e.execute_ordered(&j, &f, 0, &mut || {
            seen.push((0..blocks).map(|b| cache.read(b)).collect::<Vec<_>>())
        });
        (out, seen)
    };
    let (out, seen) = ordered(job(Tier::Host, Tier::Device, &[(0, 3), (1, 2)]), &cache);
    assert_eq!(out, TransferOutcome::Ok);
    assert_eq!(seen.len(), 1, "told once");
    assert_eq!(seen[0][3], pattern(40, bpb), "bytes in place when told");
    assert_eq!(seen[0][2], pattern(41, bpb));
    // A host block out of range fails its pair before anything is copied: not told.
    let (out, seen) = ordered(job(Tier::Host, Tier::Device, &[(2, 0), (99, 1)]), &cache);
    assert_eq!(out.failed_pairs(), vec![1]);
    assert!(
        seen.is_empty(),
        "a load with a failed pair must not let the engine go on"
    );
    // Stores are never ordered.
    let (out, seen) = ordered(job(Tier::Device, Tier::Host, &[(3, 3)]), &cache);
    assert_eq!(out, TransferOutcome::Ok);
    assert!(seen.is_empty());
}
