//! vLLM >= 0.32's paged views through kvtier-io's CPU device path: for every `KVCacheLayout`
//! (strides as vllm/v1/kv_cache_interface.py builds them), a block offloaded to the host tier
//! and onboarded into another device block is element-for-element the original, and no other
//! block's byte changes. (The CUDA path moves the same chunks; CI has no GPU.)
#![allow(clippy::unwrap_used)]
mod common;

use std::sync::Arc;

use common::job;
use kvtier::layout::{DType, DeviceKind as LayoutDevice, DeviceLayout, TensorDesc};
use kvtier::transfer::{BlockTransfer, TransferOutcome};
use kvtier::Tier;
use kvtier_io::*;

const LAYOUTS: [(&str, [usize; 5]); 6] = [
    ("LBHNC", [0, 1, 2, 3, 4]),
    ("LBNHC", [0, 1, 3, 2, 4]),
    ("LHBNC", [0, 2, 1, 3, 4]),
    ("BLHNC", [1, 0, 2, 3, 4]),
    ("BLNHC", [1, 0, 3, 2, 4]),
    ("BHLNC", [1, 2, 0, 3, 4]),
];

/// [L, B, H, N, C(bytes)] and the byte strides of `order` (innermost first, vLLM's rule).
fn strides(order: [usize; 5], shape: [usize; 5]) -> [usize; 5] {
    let mut s = [0usize; 5];
    let mut cur = 1;
    for &d in order.iter().rev() {
        s[d] = cur;
        cur *= shape[d];
    }
    s
}

#[test]
fn every_layout_round_trips_through_the_host_tier() {
    let shape = [3usize, 6, 2, 4, 32]; // 3 layers, 6 blocks, 2 heads, 4 tokens, 32 content bytes (bf16)
    for (name, order) in LAYOUTS {
        let s = strides(order, shape);
        let total: usize = shape.iter().product();
        let mut mem: Vec<u8> = (0..total).map(|i| (i * 7 + i / 251) as u8).collect();
        let base = mem.as_mut_ptr() as u64;
        let views: Vec<TensorDesc> = (0..shape[0])
            .map(|l| TensorDesc {
                name: format!("layer{l}"),
                data_ptr: base + (l * s[0]) as u64,
                shape: vec![shape[1], shape[2], shape[3], shape[4] / 2],
                strides: vec![s[1] / 2, s[2] / 2, s[3] / 2, 1],
                elem_size: 2,
                device: LayoutDevice::Cpu,
            })
            .collect();
        let layout = DeviceLayout::vllm_paged(&views, 1, DType::BF16).unwrap();
        let bpb = layout.bytes_per_block();
        let logical = |b: usize| -> Vec<usize> {
            let mut v = Vec::new();
            for l in 0..shape[0] {
                for h in 0..shape[2] {
                    for n in 0..shape[3] {
                        for c in 0..shape[4] {
                            v.push(l * s[0] + b * s[1] + h * s[2] + n * s[3] + c * s[4]);
                        }
                    }
                }
            }
            v
        };
        let mut o = HostOptions::new(4, bpb);
        o.pin = PinMode::Never;
        let host = Arc::new(HostStorage::new(&o).unwrap());
        // The safe registration: each layer's regions lie inside its own view of `mem`.
        let owned = views
            .iter()
            .map(|v| TensorMemory::of(v, None).unwrap())
            .collect();
        let e = TransferEngine::builder()
            .device(EngineMemory::from_tensors(layout, owned).unwrap())
            .host(host)
            .build()
            .unwrap();
        let f = e.fence(None).unwrap();
        let src: Vec<u8> = logical(4).iter().map(|&i| mem[i]).collect();
        let others: Vec<(usize, Vec<u8>)> = [0usize, 1, 3, 5]
            .iter()
            .map(|&b| (b, logical(b).iter().map(|&i| mem[i]).collect()))
            .collect();
        assert_eq!(
            e.execute(&job(Tier::Device, Tier::Host, &[(4, 2)]), &f),
            TransferOutcome::Ok,
            "{name}"
        );
        for &i in &logical(2) {
            mem[i] = 0xEE;
        }
        assert_eq!(
            e.execute(&job(Tier::Host, Tier::Device, &[(2, 2)]), &f),
            TransferOutcome::Ok,
            "{name}"
        );
        let back: Vec<u8> = logical(2).iter().map(|&i| mem[i]).collect();
        assert_eq!(
            back, src,
            "{name}: block 4 -> host -> block 2 is byte-exact"
        );
        for (b, want) in others {
            let now: Vec<u8> = logical(b).iter().map(|&i| mem[i]).collect();
            assert_eq!(now, want, "{name}: block {b} was touched");
        }
    }
}
