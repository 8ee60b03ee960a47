//! Property test: for random vLLM CUDA tensors (either K/V order, any stride order of the
//! dimensions inside a block, padded block strides, several layers), the gathered chunks of a
//! block are exactly the tensor's elements in canonical order (layer, plane, then the piece's
//! memory order), and they never overlap another block's.
#![allow(clippy::unwrap_used)]
use kvtier::layout::{DType, DeviceKind, DeviceLayout, EngineLayoutKind, TensorDesc};
use kvtier::DeviceBlockId;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn gathered_chunks_are_the_block_bytes(
        kv_first in any::<bool>(),
        blocks in 1usize..5,
        tokens in 1usize..5,
        heads in 1usize..4,
        dim in 1usize..4,
        perm in Just([0usize, 1, 2]).prop_shuffle(),
        pad in 0usize..3,
        layers in 1usize..4,
        block in 0usize..5,
    ) {
        let block = block % blocks;
        let inner = [tokens, heads, dim];
        // Dense strides for the inner dims in the order `perm` (last = fastest).
        let mut inner_strides = [0usize; 3];
        let mut acc = 1;
        for &d in perm.iter().rev() {
            inner_strides[d] = acc;
            acc *= inner[d];
        }
        let piece = acc;
        let (shape, strides) = if kv_first {
            let bstride = piece + pad;
            (vec![2, blocks, tokens, heads, dim],
             vec![blocks * bstride, bstride, inner_strides[0], inner_strides[1], inner_strides[2]])
        } else {
            let bstride = 2 * piece + pad;
            (vec![blocks, 2, tokens, heads, dim],
             vec![bstride, piece, inner_strides[0], inner_strides[1], inner_strides[2]])
        };
        let span = shape.iter().zip(&strides).map(|(n, s)| (n - 1) * s).sum::<usize>() + 1;
        let mem: Vec<u8> = (0..layers * (span + 7) + 8).map(|i| (i * 31 % 251) as u8).collect();
        let tensors: Vec<TensorDesc> = (0..layers)
            .map(|l| TensorDesc {
                name: format!("layer{l}"),
                data_ptr: (8 + l * (span + 7)) as u64,
                shape: shape.clone(),
                strides: strides.clone(),
                elem_size: 1,
                device: DeviceKind::Cpu,
            })
            .collect();
        let kind = if kv_first { EngineLayoutKind::VllmCudaKvFirst } else { EngineLayoutKind::VllmCudaBlockFirst };
        let layout = DeviceLayout::new(kind, &tensors, DType::U8).unwrap();
        prop_assert_eq!(layout.bytes_per_block(), layers * 2 * piece);
        let gathered: Vec<u8> = layout
            .chunks(DeviceBlockId(block as u32))
            .unwrap()
            .iter()
            .flat_map(|c| mem[c.addr as usize..c.addr as usize + c.len].to_vec())
            .collect();
        // Expected: for each layer and plane, the piece's elements in memory order.
        let mut want = Vec::new();
        for t in &tensors {
            for plane in 0..2 {
                let mut elems: Vec<(usize, u8)> = Vec::new();
                for a in 0..tokens {
                    for b in 0..heads {
                        for c in 0..dim {
                            let idx = if kv_first { [plane, block, a, b, c] } else { [block, plane, a, b, c] };
                            let off: usize = idx.iter().zip(&t.strides).map(|(i, s)| i * s).sum();
                            let addr = t.data_ptr as usize + off;
                            elems.push((addr, mem[addr]));
                        }
                    }
                }
                elems.sort();
                want.extend(elems.into_iter().map(|(_, v)| v));
            }
        }
        prop_assert_eq!(gathered, want);
        // No overlap with any other block's chunks.
        let mine = layout.chunks(DeviceBlockId(block as u32)).unwrap();
        for other in 0..blocks {
            if other == block { continue; }
            for c in layout.chunks(DeviceBlockId(other as u32)).unwrap() {
                for m in &mine {
                    prop_assert!(c.addr + c.len as u64 <= m.addr || m.addr + m.len as u64 <= c.addr);
                }
            }
        }
    }
}
