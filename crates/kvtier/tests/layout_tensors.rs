//! Engine tensor layouts: shapes and strides of TensorRT-LLM and vLLM tensors to byte ranges.
#![allow(clippy::unwrap_used)]
use kvtier::layout::*;
use kvtier::DeviceBlockId;

const BASE: u64 = 0x1000_0000;

fn ids(b: u32) -> DeviceBlockId {
    DeviceBlockId(b)
}

#[test]
fn trtllm_block_is_one_contiguous_range() {
    // 10 blocks, 3 layers, K/V, 16 tokens * 2 heads * 8 dim, bf16.
    let inner = 16 * 2 * 8;
    let t = TensorDesc::contiguous("pool", BASE, vec![10, 3, 2, inner], 2, DeviceKind::Cuda(0));
    let l = DeviceLayout::trtllm(&t, 16, DType::BF16).unwrap();
    let g = l.geometry();
    assert_eq!((g.num_layers, g.kv_planes, g.tokens_per_block), (3, 2, 16));
    assert_eq!(g.bytes_per_token_plane, 2 * 8 * 2);
    let bpb = 3 * 2 * inner * 2;
    assert_eq!(l.bytes_per_block(), bpb);
    assert_eq!(l.num_blocks(), 10);
    assert_eq!(
        l.chunks(ids(4)).unwrap(),
        vec![Chunk {
            addr: BASE + 4 * bpb as u64,
            len: bpb
        }]
    );
    // A layer's chunk: K and V of layer 1 together.
    assert_eq!(
        l.layer_chunks(ids(4), 1).unwrap(),
        vec![Chunk {
            addr: BASE + 4 * bpb as u64 + (2 * inner * 2) as u64,
            len: 2 * inner * 2
        }]
    );
    assert_eq!(g.canonical_offset(1, 0), 2 * inner * 2);
    assert_eq!(
        l.chunks(ids(10)),
        Err(LayoutError::BlockOutOfRange {
            block: 10,
            num_blocks: 10
        })
    );
}

#[test]
fn trtllm_mla_has_one_plane() {
    let t = TensorDesc::contiguous(
        "pool",
        BASE,
        vec![4, 2, 1, 32 * 576],
        2,
        DeviceKind::Cuda(1),
    );
    let l = DeviceLayout::trtllm(&t, 32, DType::BF16).unwrap();
    assert_eq!(l.geometry().kv_planes, 1);
    assert_eq!(l.bytes_per_block(), 2 * 32 * 576 * 2);
    assert_eq!(l.device(), DeviceKind::Cuda(1));
}

#[test]
fn trtllm_rejects_bad_tokens_per_block_and_kv_factor() {
    let t = TensorDesc::contiguous("pool", BASE, vec![4, 2, 2, 100], 2, DeviceKind::Cuda(0));
    let e = DeviceLayout::trtllm(&t, 16, DType::BF16).unwrap_err();
    assert!(
        matches!(&e, LayoutError::Mismatch { tensor, .. } if tensor == "pool"),
        "{e}"
    );
    let t = TensorDesc::contiguous("pool", BASE, vec![4, 2, 3, 64], 2, DeviceKind::Cuda(0));
    let e = DeviceLayout::trtllm(&t, 16, DType::BF16).unwrap_err();
    assert!(e.to_string().contains("kv_factor"), "{e}");
}

fn vllm_layers(n: usize, shape: &[usize]) -> Vec<TensorDesc> {
    (0..n)
        .map(|i| {
            TensorDesc::contiguous(
                format!("model.layers.{i}.self_attn.attn"),
                BASE + (i as u64) * 0x100_0000,
                shape.to_vec(),
                2,
                DeviceKind::Cuda(0),
            )
        })
        .collect()
}

#[test]
fn vllm_cuda_kv_first_chunks_in_layer_then_plane_order() {
    // [2, num_blocks=8, block_size=16, heads=2, head_dim=4], f16.
    let layers = vllm_layers(2, &[2, 8, 16, 2, 4]);
    let l = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap();
    assert_eq!(l.kind(), EngineLayoutKind::VllmCudaKvFirst);
    let piece = 16 * 2 * 4 * 2;
    assert_eq!(l.geometry().bytes_per_piece(), piece);
    assert_eq!(l.bytes_per_block(), 2 * 2 * piece);
    let plane = (8 * piece) as u64;
    let c = l.chunks(ids(3)).unwrap();
    let want: Vec<Chunk> = [0u64, 1]
        .iter()
        .flat_map(|layer| {
            let base = BASE + layer * 0x100_0000 + 3 * piece as u64;
            [
                Chunk {
                    addr: base,
                    len: piece,
                },
                Chunk {
                    addr: base + plane,
                    len: piece,
                },
            ]
        })
        .collect();
    assert_eq!(c, want);
}

#[test]
fn vllm_cuda_block_first_coalesces_k_and_v() {
    let layers = vllm_layers(3, &[8, 2, 16, 2, 4]);
    let l = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap();
    assert_eq!(l.kind(), EngineLayoutKind::VllmCudaBlockFirst);
    let piece = 16 * 2 * 4 * 2;
    let c = l.chunks(ids(5)).unwrap();
    assert_eq!(c.len(), 3, "K and V of a layer are adjacent");
    for (i, ch) in c.iter().enumerate() {
        assert_eq!(
            ch.addr,
            BASE + (i as u64) * 0x100_0000 + 5 * 2 * piece as u64
        );
        assert_eq!(ch.len, 2 * piece);
    }
    assert_eq!(c.iter().map(|c| c.len).sum::<usize>(), l.bytes_per_block());
}

#[test]
fn layers_adjacent_in_memory_coalesce_across_layers() {
    // Two layers of a block-major shared buffer: layer 1's piece follows layer 0's.
    let piece_elems = 16 * 2 * 4;
    let mut layers = vllm_layers(2, &[8, 2, 16, 2, 4]);
    for (i, t) in layers.iter_mut().enumerate() {
        t.strides[0] = 2 * 2 * piece_elems; // block stride spans both layers
        t.data_ptr = BASE + (i * 2 * piece_elems * 2) as u64;
    }
    let l = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap();
    assert_eq!(
        l.chunks(ids(2)).unwrap(),
        vec![Chunk {
            addr: BASE + (2 * 4 * piece_elems * 2) as u64,
            len: l.bytes_per_block()
        }]
    );
}

#[test]
fn permuted_inner_dims_are_accepted() {
    // HND: [2, blocks, block_size, heads, dim] viewed with heads outermost in memory.
    let mut layers = vllm_layers(1, &[2, 8, 16, 2, 4]);
    layers[0].strides = vec![8 * 128, 128, 4, 64, 1];
    let l = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap();
    assert_eq!(l.geometry().bytes_per_piece(), 128 * 2);
    // Not dense: a gap between heads.
    layers[0].strides = vec![8 * 256, 256, 4, 128, 1];
    let e = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap_err();
    assert!(e.to_string().contains("not dense"), "{e}");
}

#[test]
fn vllm_cpu_layer_block_is_one_opaque_chunk() {
    // [num_blocks=4, kv_heads=2, block_size=32, 2*head_size=2*8], f32.
    let layers: Vec<TensorDesc> = (0..2)
        .map(|i| {
            TensorDesc::contiguous(
                format!("l{i}"),
                BASE + i * 0x10_0000,
                vec![4, 2, 32, 16],
                4,
                DeviceKind::Cpu,
            )
        })
        .collect();
    let l = DeviceLayout::vllm_cpu(&layers, DType::F32).unwrap();
    let g = l.geometry();
    assert_eq!((g.num_layers, g.kv_planes, g.tokens_per_block), (2, 2, 32));
    assert_eq!(g.bytes_per_token_plane, 2 * 8 * 4);
    let chunk = 2 * 32 * 16 * 4;
    assert_eq!(
        l.chunks(ids(1)).unwrap(),
        vec![
            Chunk {
                addr: BASE + chunk as u64,
                len: chunk
            },
            Chunk {
                addr: BASE + 0x10_0000 + chunk as u64,
                len: chunk
            }
        ]
    );
    assert_eq!(l.bytes_per_block(), 2 * chunk);
}

#[test]
fn vllm_mla_per_layer() {
    let layers: Vec<TensorDesc> = (0..3)
        .map(|i| {
            TensorDesc::contiguous(
                format!("l{i}"),
                BASE + i * 0x10_0000,
                vec![6, 16, 576],
                2,
                DeviceKind::Cuda(0),
            )
        })
        .collect();
    let l = DeviceLayout::new(EngineLayoutKind::VllmMla, &layers, DType::BF16).unwrap();
    assert_eq!(l.geometry().kv_planes, 1);
    assert_eq!(l.bytes_per_block(), 3 * 16 * 576 * 2);
    assert_eq!(l.chunks(ids(0)).unwrap().len(), 3);
}

#[test]
fn inconsistent_layers_are_named() {
    let mut layers = vllm_layers(3, &[2, 8, 16, 2, 4]);
    layers[2].shape[1] = 7;
    layers[2].strides =
        TensorDesc::contiguous("x", 1, layers[2].shape.clone(), 2, DeviceKind::Cpu).strides;
    let e = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap_err();
    match &e {
        LayoutError::Mismatch { tensor, reason } => {
            assert_eq!(tensor, "model.layers.2.self_attn.attn");
            assert!(reason.contains("block counts do not match"), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let mut layers = vllm_layers(2, &[2, 8, 16, 2, 4]);
    layers[1].device = DeviceKind::Cuda(1);
    let e = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap_err();
    assert!(
        e.to_string().contains("model.layers.1") && e.to_string().contains("device"),
        "{e}"
    );
    let mut layers = vllm_layers(2, &[2, 8, 16, 2, 4]);
    layers[1].strides[1] *= 2;
    let e = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap_err();
    assert!(e.to_string().contains("strides"), "{e}");
}

#[test]
fn overlapping_strides_are_rejected() {
    let mut layers = vllm_layers(1, &[2, 8, 16, 2, 4]);
    layers[0].strides[1] = 64; // block stride smaller than a block's 128 elements
    let e = DeviceLayout::vllm_cuda(&layers, DType::F16).unwrap_err();
    assert!(e.to_string().contains("overlaps"), "{e}");
}

#[test]
fn wrong_rank_dtype_and_ambiguity_are_errors() {
    let layers = vllm_layers(1, &[2, 8, 16, 8]);
    assert!(DeviceLayout::vllm_cuda(&layers, DType::F16).is_err());
    let layers = vllm_layers(1, &[2, 8, 16, 2, 4]);
    let e = DeviceLayout::vllm_cuda(&layers, DType::F32).unwrap_err();
    assert!(e.to_string().contains("element size"), "{e}");
    let layers = vllm_layers(1, &[2, 2, 16, 2, 4]);
    assert!(DeviceLayout::vllm_cuda(&layers, DType::F16)
        .unwrap_err()
        .to_string()
        .contains("ambiguous"));
    // ...but explicit kinds work.
    assert!(DeviceLayout::new(EngineLayoutKind::VllmCudaKvFirst, &layers, DType::F16).is_ok());
    assert!(DeviceLayout::vllm_cuda(&[], DType::F16).is_err());
    assert_eq!(DType::parse("torch.bfloat16"), Some(DType::BF16));
    assert_eq!(DType::parse("half"), Some(DType::F16));
    assert_eq!(DType::parse("complex64"), None);
}

#[test]
fn address_overflow_is_an_error() {
    let t = TensorDesc::contiguous(
        "pool",
        u64::MAX - 100,
        vec![4, 2, 2, 64],
        2,
        DeviceKind::Cuda(0),
    );
    let e = DeviceLayout::trtllm(&t, 16, DType::BF16).unwrap_err();
    assert!(e.to_string().contains("overflow"), "{e}");
}

/// Simulated device memory: gather a block's chunks from a byte buffer and compare with
/// the tensor's elements read by multi-index, (layer, plane) in canonical order.
#[test]
fn gathered_bytes_equal_the_tensor_elements_in_canonical_order() {
    let mem: Vec<u8> = (0..40_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let read = |t: &TensorDesc, idx: &[usize]| -> u8 {
        let off: usize = idx.iter().zip(&t.strides).map(|(i, s)| i * s).sum();
        mem[t.data_ptr as usize + off]
    };
    let gather = |l: &DeviceLayout, b: u32| -> Vec<u8> {
        l.chunks(ids(b))
            .unwrap()
            .iter()
            .flat_map(|c| mem[c.addr as usize..c.addr as usize + c.len].to_vec())
            .collect()
    };
    // vLLM KV-first, HND-permuted inner dims, 2 layers: [2, 5, 4(tokens), 3(heads), 2(dim)].
    let mut layers: Vec<TensorDesc> = (0..2)
        .map(|i| {
            TensorDesc::contiguous(
                format!("l{i}"),
                8 + i * 1000,
                vec![2, 5, 4, 3, 2],
                1,
                DeviceKind::Cpu,
            )
        })
        .collect();
    for t in &mut layers {
        t.strides = vec![5 * 24, 24, 2, 8, 1];
    }
    let l = DeviceLayout::vllm_cuda(&layers, DType::U8).unwrap();
    for b in 0..5u32 {
        let got = gather(&l, b);
        assert_eq!(got.len(), l.bytes_per_block());
        // Expected: per layer, per plane, the piece's bytes in memory order (the engine's
        // own order inside a piece), which is heads, tokens, dim for HND.
        let mut want = Vec::new();
        for t in &layers {
            for plane in 0..2 {
                for h in 0..3 {
                    for tok in 0..4 {
                        for d in 0..2 {
                            want.push(read(t, &[plane, b as usize, tok, h, d]));
                        }
                    }
                }
            }
        }
        assert_eq!(got, want, "block {b}");
    }
    // TensorRT-LLM pool: [3 blocks, 2 layers, 2, 4 tokens * 6].
    let t = TensorDesc::contiguous("pool", 20_000, vec![3, 2, 2, 24], 1, DeviceKind::Cpu);
    let l = DeviceLayout::trtllm(&t, 4, DType::U8).unwrap();
    for b in 0..3u32 {
        let mut want = Vec::new();
        for layer in 0..2 {
            for plane in 0..2 {
                for x in 0..24 {
                    want.push(read(&t, &[b as usize, layer, plane, x]));
                }
            }
        }
        assert_eq!(gather(&l, b), want);
    }
}
