//! Ordered loads on a CUDA machine (skip cleanly without a driver): a host -> device load run
//! through `execute_ordered` is seen, bit-exact, by work the "engine" enqueues on its own stream
//! right after `enqueued` — the stream waits for kvtier's copies on the device, the CPU does not —
//! for the gather/scatter kernel path (vLLM's per-layer layout: 64 chunks of 32 KiB per block;
//! its staging rounds enqueued at once) and the per-chunk path (whole 2 MiB blocks). The same
//! loads without ordering are checked too.
//!
//! Run on a GPU machine with the lib test binary:
//! `kvtier_io-<hash> --exact cuda::gpu_tests::ordered_loads_are_seen_by_the_engine_stream --nocapture`.
#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use kvtier::transfer::{BlockTransfer, TransferJob};
use kvtier::{JobId, Tier};

use crate::storage::host::{HostOptions, HostStorage, PinMode};
use crate::storage::node::gpu_tests::{block, per_layer_cache, BPB, CHUNK, LAYERS};
use crate::sys::cuda::{self as cu, DeviceAlloc, Driver, Stream};
use crate::sys::job;
use crate::transfer::cuda::LayeredCopy;
use crate::transfer::device::DeviceKind;
use crate::transfer::engine::TransferEngine;
use crate::transfer::layout::{BlockChunks, StridedLayout};
use crate::transfer::memory::DevicePtr;

/// Blocks per load: 6 staging rounds of 8 on the kernel path.
const N: u32 = 48;

fn fill(mem: &DeviceAlloc, seed: u64) {
    let mut buf = vec![0u8; mem.len()];
    let mut x = seed | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    mem.upload(0, &buf).unwrap();
}

fn job(src: Tier, dst: Tier, pairs: impl Iterator<Item = (u32, u32)>) -> TransferJob {
    let pairs: Vec<(u32, u32)> = pairs.collect();
    crate::transfer::numbered_job(JobId(1), src, dst, &pairs, |_| 0)
}

/// Store device blocks 0..N to host 0..N, then load host i into device block 2N-1-i, ordered
/// on `engine`: in `enqueued`, the engine copies every destination block to `seen` on its own
/// stream. `seen` must then hold exactly the stored blocks.
/// A transfer engine over `layout` (device 0) with a pinned host tier of `host_blocks`.
fn pinned_engine(layout: &StridedLayout, host_blocks: u32) -> TransferEngine {
    pinned_engine_with(layout, host_blocks, LayeredCopy::Auto)
}

/// As [`pinned_engine`], layered loads moved the way `layered` says.
fn pinned_engine_with(
    layout: &StridedLayout,
    host_blocks: u32,
    layered: LayeredCopy,
) -> TransferEngine {
    let host = {
        let mut o = HostOptions::new(host_blocks, BPB);
        o.pin = PinMode::Require;
        Arc::new(HostStorage::new(&o).unwrap())
    };
    TransferEngine::builder()
        .device(
            // The test's device allocation outlives the engine; only its jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), DeviceKind::Cuda(0)),
        )
        .host(host)
        .layered_copy(layered)
        .build()
        .unwrap()
}

fn check(name: &str, layout: StridedLayout, mem: &DeviceAlloc) {
    let e = pinned_engine(&layout, N);
    let f = e.fence(None).unwrap();
    let out = e.execute(&job(Tier::Device, Tier::Host, (0..N).map(|b| (b, b))), &f);
    assert!(out.is_ok(), "{name}: store {out:?}");
    let expected: Vec<Vec<u8>> = (0..N).map(|i| block(mem, &layout, i)).collect();
    let engine = Stream::new(false).unwrap();
    let seen = DeviceAlloc::new(N as usize * BPB).unwrap();
    let mut told = 0;
    let load = job(Tier::Host, Tier::Device, (0..N).map(|i| (i, 2 * N - 1 - i)));
    let f = e.fence(Some(engine.raw() as u64)).unwrap();
    let out = e.execute_ordered(&load, &f, engine.raw() as u64, &mut || {
        told += 1;
        // The engine's next work, enqueued at once: it must run after the load's copies.
        let mut at = 0u64;
        for i in 0..N {
            let mut chunks = Vec::new();
            layout.chunks(2 * N - 1 - i, &mut chunks).unwrap();
            for c in chunks {
                // Both ranges are live device allocations of this test.
                job::memcpy_async(seen.addr() + at, c.addr, c.len, &engine).unwrap();
                at += c.len as u64;
            }
        }
    });
    assert!(out.is_ok(), "{name}: ordered load {out:?}");
    assert_eq!(told, 1, "{name}: told once");
    engine.synchronize().unwrap();
    let mut got = vec![0u8; BPB];
    for i in 0..N {
        seen.download(i as usize * BPB, &mut got).unwrap();
        assert!(
            got == expected[i as usize],
            "{name}: the engine's stream read block {} before the load into it finished",
            2 * N - 1 - i
        );
        assert!(block(mem, &layout, 2 * N - 1 - i) == expected[i as usize]);
    }
    // Unordered (CPU-paced), the same kind of load is complete when `execute` returns.
    fill(mem, 99);
    let f = e.fence(None).unwrap();
    let back = job(Tier::Host, Tier::Device, (0..N).map(|i| (i, N + i)));
    assert!(e.execute(&back, &f).is_ok());
    for i in 0..N {
        assert!(
            block(mem, &layout, N + i) == expected[i as usize],
            "{name}: unordered load of block {}",
            N + i
        );
    }
    println!("{name}: ordered and unordered loads bit-exact");
}

#[test]
fn ordered_loads_are_seen_by_the_engine_stream() {
    if !cu::library_present() {
        eprintln!("no CUDA driver: ordered-load GPU test skipped");
        return;
    }
    let _driver = Driver::open(0).unwrap();
    let total = 2 * N;
    // vLLM's per-layer layout: the kernel path.
    let mem = DeviceAlloc::new(total as usize * BPB).unwrap();
    fill(&mem, 7);
    let lb = 2 * total as usize * CHUNK;
    let bases: Vec<DevicePtr> = (0..LAYERS)
        .map(|l| DevicePtr::new(mem.addr() + (l * lb) as u64).unwrap())
        .collect();
    check(
        "kernel path",
        StridedLayout::kv_per_layer(&bases, total, CHUNK).unwrap(),
        &mem,
    );
    // Whole blocks: the per-chunk path.
    let mem = DeviceAlloc::new(total as usize * BPB).unwrap();
    fill(&mem, 8);
    check(
        "per-chunk path",
        StridedLayout::contiguous(DevicePtr::new(mem.addr()).unwrap(), total, BPB).unwrap(),
        &mem,
    );
}

/// Regression (#28): a CUDA tensor's data pointer was trusted until its first copy, where a bogus
/// one faults a copy kernel and poisons the engine's CUDA context. Registration now asks the
/// driver: device memory passes; an invented, a host and a freed address are refused.
#[test]
fn device_pointers_are_checked_with_the_driver() {
    if !cu::library_present() {
        eprintln!("no CUDA driver: device pointer check skipped");
        return;
    }
    let _driver = Driver::open(0).unwrap();
    let len = 8usize << 20;
    let mem = DeviceAlloc::new(len).unwrap();
    assert_eq!(
        cu::device_ranges_ok(0, &[(mem.addr(), len as u64), (mem.addr() + 4096, 4096)]),
        Some(Ok(()))
    );
    for (what, addr) in [
        ("invented", 0x1000u64),
        ("host", Box::into_raw(Box::new([0u8; 64])) as u64),
    ] {
        let r = cu::device_ranges_ok(0, &[(addr, 64)]);
        assert!(matches!(r, Some(Err(_))), "{what}: {r:?}");
    }
    let freed = {
        let m = DeviceAlloc::new(len).unwrap();
        m.addr()
    };
    if freed != mem.addr() {
        let r = cu::device_ranges_ok(0, &[(freed, 64)]);
        assert!(matches!(r, Some(Err(_))), "freed: {r:?}");
    }
    // A device that does not exist.
    assert!(matches!(
        cu::device_ranges_ok(4096, &[(mem.addr(), 64)]),
        Some(Err(_))
    ));
    println!("device pointer check: device memory passes, invented/host/freed refused");
}

/// Play the engine of a layered load: `execute_layered(load)` on a stream of its own; the gate
/// `enqueued` hands over goes to an "engine" thread (as the worker's note does: the gate comes
/// before the job enqueued its copies, and a wait blocks until that layer's are), which for each
/// layer in turn waits on the gate for that layer only, then copies that layer's chunks of every
/// destination block (`dsts[i]`, pair `i`) to a buffer on that stream.
/// Every byte read must be the stored one (`expected[i]`): a layer's event recorded before its
/// copies (or for the wrong layer), or a wait that passes before the event is recorded, lets the
/// engine read the old bytes. `what` names the source.
pub(crate) fn load_layered_and_check(
    e: &TransferEngine,
    load: &TransferJob,
    layout: &StridedLayout,
    dsts: &[u32],
    expected: &[Vec<u8>],
    what: &str,
) {
    let engine = Stream::new(false).unwrap();
    let seen = DeviceAlloc::new(dsts.len() * BPB).unwrap();
    let layer_bytes = BPB / LAYERS;
    let f = e.fence(Some(engine.raw() as u64)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Option<Arc<dyn kvtier::transfer::LayerGate>>>();
    let (engine_ref, seen_ref) = (&engine, &seen);
    let (out, layers_seen) = std::thread::scope(|sc| {
        let reader = sc.spawn(move || {
            let (engine, seen) = (engine_ref, seen_ref);
            let gate = rx
                .recv()
                .unwrap()
                .unwrap_or_else(|| panic!("a vLLM-shaped load from the {what} was not layered"));
            for l in 0..LAYERS {
                gate.wait_layer(l, engine.raw() as u64).unwrap();
                for (i, &d) in dsts.iter().enumerate() {
                    let mut chunks = Vec::new();
                    layout.chunks(d, &mut chunks).unwrap();
                    let mut at = (i * BPB + l * layer_bytes) as u64;
                    for c in &chunks[2 * l..2 * l + 2] {
                        // Both ranges are live device allocations of this test.
                        job::memcpy_async(seen.addr() + at, c.addr, c.len, engine).unwrap();
                        at += c.len as u64;
                    }
                }
            }
            gate.layers()
        });
        let out = e.execute_layered(load, &f, engine.raw() as u64, &mut |gate| {
            tx.send(gate).unwrap()
        });
        (out, reader.join().unwrap())
    });
    assert!(out.is_ok(), "layered load from the {what}: {out:?}");
    assert_eq!(layers_seen, LAYERS);
    engine.synchronize().unwrap();
    let mut got = vec![0u8; BPB];
    for (i, want) in expected.iter().enumerate() {
        seen.download(i * BPB, &mut got).unwrap();
        if &got != want {
            let l = (0..LAYERS)
                .find(|&l| {
                    got[l * layer_bytes..(l + 1) * layer_bytes]
                        != want[l * layer_bytes..(l + 1) * layer_bytes]
                })
                .unwrap_or(0);
            panic!(
                "the engine read layer {l} of block {} before its copies from the {what}",
                dsts[i]
            );
        }
    }
}

/// Rates (information, not asserted): `load` whole-ordered and layered, on a fresh stream, and
/// when the engine got the load back (the ordered return; for a layered load, when its first
/// and its last layer could be waited for, from an engine thread): an enqueue that blocks the
/// CPU (a full launch queue) holds the engine's forward pass back until then.
pub(crate) fn print_layered_rates(e: &TransferEngine, load: &TransferJob, what: &str) {
    let engine = Stream::new(false).unwrap();
    let bytes = load.len() * BPB;
    let ms = |d: Option<std::time::Duration>| d.map_or(f64::NAN, |h| h.as_secs_f64() * 1e3);
    for layered in [false, true] {
        let f = e.fence(Some(engine.raw() as u64)).unwrap();
        engine.synchronize().unwrap();
        let t = std::time::Instant::now();
        let mut handed = None;
        let mut last = None;
        let out = if layered {
            let (tx, rx) =
                std::sync::mpsc::channel::<Option<Arc<dyn kvtier::transfer::LayerGate>>>();
            let engine_ref = &engine;
            std::thread::scope(|sc| {
                let reader = sc.spawn(move || {
                    let engine = engine_ref;
                    let gate = rx.recv().ok().flatten()?;
                    gate.wait_layer(0, engine.raw() as u64).ok()?;
                    let first = t.elapsed();
                    gate.wait_layer(gate.layers() - 1, engine.raw() as u64)
                        .ok()?;
                    Some((first, t.elapsed()))
                });
                let out =
                    e.execute_layered(load, &f, engine.raw() as u64, &mut |g| tx.send(g).unwrap());
                if let Some((a, b)) = reader.join().unwrap() {
                    (handed, last) = (Some(a), Some(b));
                }
                out
            })
        } else {
            e.execute_ordered(load, &f, engine.raw() as u64, &mut || {
                handed = Some(t.elapsed())
            })
        };
        assert!(out.is_ok());
        let s = t.elapsed().as_secs_f64();
        println!(
            "{what}: {} load of {} MiB: {:.2} ms, {:.1} GB/s, handed to the engine after {:.2} ms{}",
            if layered { "layered" } else { "whole-ordered" },
            bytes >> 20,
            s * 1e3,
            bytes as f64 / s / 1e9,
            ms(handed),
            if layered { format!(" (last layer after {:.2} ms)", ms(last)) } else { String::new() }
        );
    }
}

/// Layered loads (issue 27): host i -> device block 2N-1-i through `execute_layered`; in
/// `enqueued`, for each layer in turn the "engine" waits on the gate for that layer only, then
/// copies that layer's chunks of every destination block on its own stream. Every byte it read
/// must be the stored one: a layer's event recorded before its copies (or for the wrong layer)
/// lets the engine read the old bytes. Checked for each way of moving a layered load (the
/// kernel reading host memory; the copy engine through staging (one copy per slice, and 2D runs
/// of slices with floors of 64 KiB and 512 KiB), with slice floors of 256 KiB,
/// 512 KiB and 1 MiB; host slices straight into the chunks by 2D copies, with a load in order
/// as well, since the reversed one falls back to the kernel), with the rate of a 1 GiB load whole and layered for each, and then of a
/// 4 GiB load (a 32K-token Llama-3.1-8B prompt; `KVTIER_LAYERED_GPU_BIG=0` skips it).
#[test]
fn layered_loads_are_seen_layer_by_layer() {
    if !cu::library_present() {
        eprintln!("no CUDA driver: layered-load GPU test skipped");
        return;
    }
    let _driver = Driver::open(0).unwrap();
    let modes = [
        LayeredCopy::Kernel,
        LayeredCopy::Staged(256 << 10),
        LayeredCopy::Staged(512 << 10),
        LayeredCopy::Staged(1 << 20),
        LayeredCopy::Staged2d(64 << 10),
        LayeredCopy::Staged2d(512 << 10),
        // This load's device ids run against its host slots (no 2D runs): it goes the kernel's
        // way; the in-order load below takes the direct path.
        LayeredCopy::Direct2d,
    ];
    let big = std::env::var("KVTIER_LAYERED_GPU_BIG").map_or(true, |v| v != "0");
    for n in [512u32, 2048].into_iter().filter(|&n| n == 512 || big) {
        let total = 2 * n;
        let (mem, layout) = per_layer_cache(total, 11);
        let expected: Vec<Vec<u8>> = (0..n).map(|i| block(&mem, &layout, i)).collect();
        let load = job(Tier::Host, Tier::Device, (0..n).map(|i| (i, 2 * n - 1 - i)));
        let dsts: Vec<u32> = (0..n).map(|i| 2 * n - 1 - i).collect();
        for mode in modes {
            let e = pinned_engine_with(&layout, n, mode);
            let f = e.fence(None).unwrap();
            assert!(e
                .execute(&job(Tier::Device, Tier::Host, (0..n).map(|b| (b, b))), &f)
                .is_ok());
            let what = format!("host tier, {mode:?}, {n} blocks");
            load_layered_and_check(&e, &load, &layout, &dsts, &expected, &what);
            print_layered_rates(&e, &load, &what);
            if mode == LayeredCopy::Direct2d {
                // Host i -> device block n + i: slots and ids both consecutive, one 2D copy per
                // plane and layer.
                let ids: Vec<u32> = (n..2 * n).collect();
                let direct = job(Tier::Host, Tier::Device, (0..n).map(|i| (i, n + i)));
                let what = format!("host tier, Direct2d in order, {n} blocks");
                load_layered_and_check(&e, &direct, &layout, &ids, &expected, &what);
                print_layered_rates(&e, &direct, &what);
            }
        }
    }
    println!("layered loads bit-exact, layer by layer, every mode");
}
