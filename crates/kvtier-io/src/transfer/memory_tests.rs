//! Tests of the registration boundary: the safe constructors' bound checks and keep-alives.
#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use kvtier::layout::{DType, DeviceKind, DeviceLayout, TensorDesc};
use kvtier::transfer::{BlockTransfer, TransferJob};
use kvtier::{BlockId, DeviceBlockId, JobId};

use super::*;
use crate::{HostOptions, HostStorage, PinMode, TransferEngine};

/// TensorRT-LLM pool shape `[blocks, 2 layers, 2, 4 tokens * 8]` of f32: 512 bytes per block.
fn pool_desc(ptr: u64, blocks: usize, device: DeviceKind) -> TensorDesc {
    TensorDesc::contiguous("kv_pool", ptr, vec![blocks, 2, 2, 32], 4, device)
}

fn pool_layout(ptr: u64, blocks: usize) -> DeviceLayout {
    DeviceLayout::trtllm(&pool_desc(ptr, blocks, DeviceKind::Cpu), 4, DType::F32).unwrap()
}

/// Real memory of this process for the bounds tests (registration also checks that a CPU
/// tensor's bytes are mapped): 4 MiB and its 64 KiB-aligned base.
fn heap() -> (Vec<u8>, u64) {
    let v = vec![0u8; 4 << 20];
    let base = (v.as_ptr() as u64).next_multiple_of(64 << 10);
    (v, base)
}

#[test]
fn an_unmapped_cpu_tensor_is_refused() {
    let base = 0x1000u64;
    let t = TensorMemory::of(&pool_desc(base, 4, DeviceKind::Cpu), None).unwrap();
    assert!(matches!(
        EngineMemory::from_tensors(pool_layout(base, 4), vec![t]),
        Err(MemoryError::Unmapped { start: 0x1000, .. })
    ));
}

#[test]
fn device_ptr_is_never_null() {
    assert_eq!(DevicePtr::new(0), None);
    assert_eq!(DevicePtr::new(0x1000).unwrap().get(), 0x1000);
    assert_eq!(DevicePtr::from_host(std::ptr::null::<u8>()), None);
    assert_eq!(DevicePtr::new(u64::MAX).unwrap().checked_add(1), None);
    assert_eq!(
        DevicePtr::new(0x1000).unwrap().checked_add(16),
        DevicePtr::new(0x1010)
    );
}

#[test]
fn tensor_extent_follows_shape_and_strides() {
    // [2, 3] with element strides [4, 1] (a padded row), 2-byte elements: the last element is at
    // element 4 + 2 = 6, so the tensor spans 7 elements = 14 bytes.
    let d = TensorDesc {
        name: "t".into(),
        data_ptr: 0x1000,
        shape: vec![2, 3],
        strides: vec![4, 1],
        elem_size: 2,
        device: DeviceKind::Cpu,
    };
    let t = TensorMemory::of(&d, None).unwrap();
    assert!(t.contains(0x1000, 0x1000 + 14));
    assert!(!t.contains(0x1000, 0x1000 + 15));
    assert!(!t.contains(0xfff, 0x1000));
    // Permuted strides (HND-like): same extent whatever the order of the dimensions.
    let p = TensorDesc {
        strides: vec![1, 2],
        shape: vec![2, 3],
        ..d.clone()
    };
    assert_eq!(TensorMemory::of(&p, None).unwrap().len, 6 * 2);
    for bad in [
        TensorDesc {
            data_ptr: 0,
            ..d.clone()
        },
        TensorDesc {
            shape: vec![2, 0],
            ..d.clone()
        },
        TensorDesc {
            data_ptr: u64::MAX - 4,
            ..d.clone()
        },
    ] {
        assert!(matches!(
            TensorMemory::of(&bad, None),
            Err(MemoryError::Invalid(_))
        ));
    }
}

#[test]
fn a_region_past_the_tensor_is_refused() {
    let (_mem, base) = heap();
    // The layout claims 4 blocks, the tensor that owns the memory has 3.
    let layout = pool_layout(base, 4);
    let owner = TensorMemory::of(&pool_desc(base, 3, DeviceKind::Cpu), None).unwrap();
    let err = EngineMemory::from_tensors(layout.clone(), vec![owner]).unwrap_err();
    assert_eq!(
        err,
        MemoryError::OutOfBounds {
            region: 0,
            start: base,
            // Layer 0's K: 128 bytes per block, the last block's 3 * 512 bytes in.
            end: base + 3 * 512 + 128,
        }
    );
    // Exactly the tensor's bytes: accepted.
    let exact = TensorMemory::of(&pool_desc(base, 4, DeviceKind::Cpu), None).unwrap();
    assert!(EngineMemory::from_tensors(layout.clone(), vec![exact]).is_ok());
    // A tensor starting one byte late does not hold block 0's first byte.
    let late = TensorMemory::of(&pool_desc(base + 1, 4, DeviceKind::Cpu), None).unwrap();
    assert!(matches!(
        EngineMemory::from_tensors(layout, vec![late]),
        Err(MemoryError::OutOfBounds { region: 0, .. })
    ));
}

#[test]
fn every_per_layer_region_needs_its_own_tensor() {
    // vLLM CPU-style per-layer tensors [blocks, heads, tokens, 2 * head]: one region per layer.
    let (_mem, base) = heap();
    let desc = |i: u64| {
        TensorDesc::contiguous(
            "layer",
            base + 0x10_0000 * i,
            vec![3, 1, 4, 16],
            4,
            DeviceKind::Cpu,
        )
    };
    let layout = DeviceLayout::vllm_cpu(&[desc(0), desc(1), desc(2)], DType::F32).unwrap();
    let all: Vec<TensorMemory> = (0..3)
        .map(|i| TensorMemory::of(&desc(i), None).unwrap())
        .collect();
    assert!(EngineMemory::from_tensors(layout.clone(), all.clone()).is_ok());
    let without_last = all[..2].to_vec();
    assert!(matches!(
        EngineMemory::from_tensors(layout, without_last),
        Err(MemoryError::OutOfBounds { region: 2, .. })
    ));
}

#[test]
fn a_region_in_memory_of_another_device_is_refused() {
    let base = 0x10_0000u64;
    let cuda = TensorMemory::of(&pool_desc(base, 4, DeviceKind::Cuda(0)), None).unwrap();
    assert_eq!(
        EngineMemory::from_tensors(pool_layout(base, 4), vec![cuda]).unwrap_err(),
        MemoryError::WrongDevice {
            region: 0,
            layout: DeviceKind::Cpu,
            tensor: DeviceKind::Cuda(0),
        }
    );
}

#[test]
fn tensor_owners_are_held_while_the_memory_lives() {
    let (_mem, base) = heap();
    let owner = Arc::new(String::from("the engine's tensor"));
    let t = TensorMemory::of(
        &pool_desc(base, 4, DeviceKind::Cpu),
        Some(owner.clone() as KeepAlive),
    )
    .unwrap();
    let mem = EngineMemory::from_tensors(pool_layout(base, 4), vec![t]).unwrap();
    assert_eq!(Arc::strong_count(&owner), 2);
    drop(mem);
    assert_eq!(Arc::strong_count(&owner), 1);
}

#[test]
fn cpu_pool_checks_bounds_and_outlives_its_handle() {
    let mut pool = CpuKvPool::<f32>::zeroed(4 * 128).unwrap();
    assert_eq!(pool.base().get() % 64, 0);
    let base = pool.base().get();
    // One block more than the pool holds.
    assert!(matches!(
        EngineMemory::from_cpu_pool(pool_layout(base, 5), &pool),
        Err(MemoryError::OutOfBounds { region: 0, .. })
    ));
    assert_eq!(pool.holders(), 1);
    let mem = EngineMemory::from_cpu_pool(pool_layout(base, 4), &pool).unwrap();
    assert_eq!(pool.holders(), 2);
    // Block 2 holds a pattern; the engine over the pool copies it after the handle dropped.
    let want: Vec<f32> = (0..128).map(|i| i as f32 + 0.5).collect();
    pool[256..384].copy_from_slice(&want);
    assert!(pool[0..128].iter().all(|v| *v == 0.0));
    let mut opts = HostOptions::new(4, 512);
    opts.pin = PinMode::Never;
    let host = Arc::new(HostStorage::new(&opts).unwrap());
    let engine = TransferEngine::builder()
        .device(mem)
        .host(host.clone())
        .build()
        .unwrap();
    // The engine holds the allocation (its EngineMemory), the handle can go.
    assert_eq!(pool.holders(), 2);
    drop(pool);
    let job = TransferJob::from_pairs(JobId(1), [(DeviceBlockId(2), BlockId(1))]);
    assert!(engine.execute(&job, &engine.fence(None).unwrap()).is_ok());
    let mut out = vec![0u8; 512];
    host.read_block(1, &mut out).unwrap();
    let got: Vec<f32> = out
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(got, want);
}

#[test]
#[should_panic(expected = "out of a CPU KV pool")]
fn cpu_pool_ranges_are_checked() {
    let pool = CpuKvPool::<u16>::zeroed(8).unwrap();
    let _ = &pool[4..9];
}

#[test]
fn cpu_pool_refuses_zero_elements() {
    assert!(matches!(
        CpuKvPool::<u8>::zeroed(0),
        Err(MemoryError::Invalid(_))
    ));
}
