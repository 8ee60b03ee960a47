//! vLLM >= 0.32's paged 4-D views, in every `KVCacheLayout`, built the way vLLM builds them
//! (`compute_layout_strides` and `create_kv_cache_views` in vllm/v1/kv_cache_interface.py:
//! strides in the logical order [L, B, H, N, C], the layout's stride order from
//! vllm/v1/kv_cache_layout.py, fixed layer and block strides, padded pages, kernel-block
//! splitting, then `.view(dtype)` of the byte content). For each: the chunks of a block cover
//! exactly the bytes of its (layer, head, token, content) elements, blocks never share a byte,
//! and a round trip through kvtier's canonical format (gather one block, scatter into another)
//! is byte-exact element by element. Also the copy shape of each layout (one range per block
//! for block-outermost layouts) and the refusals.
#![allow(clippy::unwrap_used)]
use kvtier::layout::*;
use kvtier::DeviceBlockId;
use proptest::prelude::*;

/// vLLM's `KVCacheLayout` members: name and stride order over logical [L, B, H, N, C].
const LAYOUTS: [(&str, [usize; 5]); 6] = [
    ("LBHNC", [0, 1, 2, 3, 4]),
    ("LBNHC", [0, 1, 3, 2, 4]),
    ("LHBNC", [0, 2, 1, 3, 4]),
    ("BLHNC", [1, 0, 2, 3, 4]),
    ("BLNHC", [1, 0, 3, 2, 4]),
    ("BHLNC", [1, 2, 0, 3, 4]),
];

/// One vLLM KV cache group: the logical geometry and the backing bytes.
#[derive(Clone, Debug)]
struct Cache {
    layers: usize,
    blocks: usize,
    /// Kernel blocks per logical block.
    split: usize,
    heads: usize,
    tokens: usize,
    /// Content bytes per (head, token): 2 * head_size * elem for attention, MLA's latent.
    content: usize,
    elem: usize,
    /// Byte strides over [L, B(kernel), H, N, C].
    strides: [usize; 5],
    mem: Vec<u8>,
}

impl Cache {
    /// Allocate like vLLM: strides from the stride order, innermost first, with an optional
    /// padded page (the stride of the innermost of L/B is rounded up to `pad_to`).
    // The geometry vLLM's allocator takes, one argument per dimension.
    #[allow(clippy::too_many_arguments)]
    fn new(
        order: [usize; 5],
        layers: usize,
        blocks: usize,
        split: usize,
        heads: usize,
        tokens: usize,
        content: usize,
        elem: usize,
        pad: usize,
    ) -> Self {
        let shape = [layers, blocks * split, heads, tokens, content];
        let mut strides = [0usize; 5];
        let mut cur = 1usize;
        let page_end = order
            .iter()
            .position(|&d| d == 0)
            .unwrap()
            .max(order.iter().position(|&d| d == 1).unwrap());
        for (phys, &dim) in order.iter().enumerate().rev() {
            if phys == page_end && pad > 0 {
                cur += pad; // a padded page (page_size_padded)
            }
            strides[dim] = cur;
            cur = strides[dim] * shape[dim];
        }
        let mem: Vec<u8> = (0..cur + 64)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        Cache {
            layers,
            blocks,
            split,
            heads,
            tokens,
            content,
            elem,
            strides,
            mem,
        }
    }

    fn base(&self) -> u64 {
        // 64-byte aligned start inside `mem`, like a CUDA allocation.
        let p = self.mem.as_ptr() as u64;
        p + (64 - p % 64) % 64
    }

    /// The per-layer 4-D views vLLM registers, strides in elements.
    fn views(&self) -> Vec<TensorDesc> {
        let e = self.elem;
        (0..self.layers)
            .map(|l| TensorDesc {
                name: format!("model.layers.{l}.self_attn.attn"),
                data_ptr: self.base() + (l * self.strides[0]) as u64,
                shape: vec![
                    self.blocks * self.split,
                    self.heads,
                    self.tokens,
                    self.content / e,
                ],
                strides: vec![
                    self.strides[1] / e,
                    self.strides[2] / e,
                    self.strides[3] / e,
                    1,
                ],
                elem_size: e,
                device: DeviceKind::Cpu,
            })
            .collect()
    }

    /// Byte offsets (from `base`) of logical block `b`, in logical order (l, kernel block, h, n, c).
    fn logical(&self, b: usize) -> Vec<usize> {
        let s = self.strides;
        let mut v = Vec::new();
        for l in 0..self.layers {
            for k in 0..self.split {
                for h in 0..self.heads {
                    for n in 0..self.tokens {
                        for c in 0..self.content {
                            v.push(
                                l * s[0]
                                    + (b * self.split + k) * s[1]
                                    + h * s[2]
                                    + n * s[3]
                                    + c * s[4],
                            );
                        }
                    }
                }
            }
        }
        v
    }

    fn off(&self, c: &Chunk) -> usize {
        (c.addr - self.base()) as usize
    }
}

fn dtype(elem: usize) -> DType {
    match elem {
        1 => DType::F8E4M3,
        2 => DType::BF16,
        _ => DType::F32,
    }
}

/// Every check of one cache: coverage, disjointness, and a byte-exact canonical round trip.
fn check(mut cache: Cache) -> DeviceLayout {
    let views = cache.views();
    let kind = EngineLayoutKind::detect_vllm(&views[0], Some(cache.blocks)).unwrap();
    assert_eq!(
        kind,
        EngineLayoutKind::VllmPaged {
            kernel_blocks: cache.split
        }
    );
    let layout = DeviceLayout::new(kind, &views, dtype(cache.elem)).unwrap();
    let bpb = cache.layers * cache.split * cache.heads * cache.tokens * cache.content;
    assert_eq!(layout.bytes_per_block(), bpb);
    assert_eq!(layout.num_blocks(), cache.blocks);
    let g = layout.geometry();
    assert_eq!(g.tokens_per_block, cache.tokens * cache.split);
    assert_eq!(g.bytes_per_block(), bpb);
    let mut seen = std::collections::HashSet::new();
    for b in 0..cache.blocks {
        let chunks = layout.chunks(DeviceBlockId(b as u32)).unwrap();
        let mut covered: Vec<usize> = chunks
            .iter()
            .flat_map(|c| cache.off(c)..cache.off(c) + c.len)
            .collect();
        assert_eq!(
            covered.len(),
            bpb,
            "block {b}: chunks sum to the block size"
        );
        covered.sort_unstable();
        let mut want = cache.logical(b);
        want.sort_unstable();
        assert_eq!(
            covered, want,
            "block {b}: chunks are exactly the block's bytes"
        );
        for o in covered {
            assert!(seen.insert(o), "byte {o} belongs to two blocks");
        }
    }
    // Round trip: gather block `src` into the canonical format, scatter it into block `dst`;
    // then every logical element of `dst` equals the same element of `src`.
    if cache.blocks >= 2 {
        let (src, dst) = (cache.blocks - 1, 0);
        let before = {
            let base = cache.base() as usize - cache.mem.as_ptr() as usize;
            cache
                .logical(src)
                .iter()
                .map(|o| cache.mem[base + o])
                .collect::<Vec<u8>>()
        };
        let host: Vec<u8> = layout
            .chunks(DeviceBlockId(src as u32))
            .unwrap()
            .iter()
            .flat_map(|c| {
                let o = c.addr as usize - cache.mem.as_ptr() as usize;
                cache.mem[o..o + c.len].to_vec()
            })
            .collect();
        assert_eq!(host.len(), bpb);
        let mut at = 0;
        for c in layout.chunks(DeviceBlockId(dst as u32)).unwrap() {
            let o = c.addr as usize - cache.mem.as_ptr() as usize;
            cache.mem[o..o + c.len].copy_from_slice(&host[at..at + c.len]);
            at += c.len;
        }
        let base = cache.base() as usize - cache.mem.as_ptr() as usize;
        let after: Vec<u8> = cache
            .logical(dst)
            .iter()
            .map(|o| cache.mem[base + o])
            .collect();
        assert_eq!(
            after, before,
            "round trip through the canonical format is byte-exact"
        );
    }
    layout
}

#[test]
fn every_kv_cache_layout_round_trips() {
    // Llama-like: 3 layers, 5 blocks, 2 KV heads, 4 tokens, 2 * head_size(8) bf16 = 32 bytes.
    for (name, order) in LAYOUTS {
        let layout = check(Cache::new(order, 3, 5, 1, 2, 4, 32, 2, 0));
        let chunks = layout.chunks(DeviceBlockId(2)).unwrap();
        let want = match name {
            // Block outermost: a block's bytes over all layers are one range.
            "BLHNC" | "BLNHC" | "BHLNC" => 1,
            // Layer outermost, block next: one range per layer.
            "LBHNC" | "LBNHC" => 3,
            // Heads outside the block: one range per (layer, head).
            "LHBNC" => 6,
            _ => unreachable!(),
        };
        assert_eq!(chunks.len(), want, "{name}: chunks per block");
        assert_eq!(layout.block_is_contiguous(), want == 1, "{name}");
    }
}

#[test]
fn mla_fp8_padded_and_split_layouts_round_trip() {
    for (name, order) in LAYOUTS {
        // MLA: one head, 576-element latent, FP8 (1 byte).
        check(Cache::new(order, 2, 4, 1, 1, 4, 576, 1, 0));
        // FP8 attention KV.
        check(Cache::new(order, 2, 4, 1, 2, 4, 16, 1, 0));
        // fp32 and 3 layers, to vary the element size.
        check(Cache::new(order, 3, 3, 1, 2, 2, 16, 4, 0));
        // A padded page (page_size_padded) where the layout allows it (only L/B outside the page).
        if matches!(name, "LBHNC" | "LBNHC" | "BLHNC" | "BLNHC") {
            check(Cache::new(order, 2, 4, 1, 2, 4, 32, 2, 24));
        }
        // Kernel-block splitting: 2 kernel blocks per logical block (needs dense pages).
        if matches!(name, "LBHNC" | "LBNHC") {
            let l = check(Cache::new(order, 2, 3, 2, 2, 4, 32, 2, 0));
            assert_eq!(l.chunks(DeviceBlockId(1)).unwrap().len(), 2);
        }
    }
}

#[test]
fn physical_order_is_deterministic_and_layer_major_where_possible() {
    // Two allocations of the same layout at different addresses: same chunk lengths and
    // offsets relative to the block's first byte (the canonical format depends on the layout).
    for (name, order) in LAYOUTS {
        let a = Cache::new(order, 3, 4, 1, 2, 4, 32, 2, 0);
        let b = Cache::new(order, 3, 4, 1, 2, 4, 32, 2, 0);
        let rel = |c: &Cache| {
            let l = DeviceLayout::vllm_paged(&c.views(), 1, DType::BF16).unwrap();
            l.chunks(DeviceBlockId(1))
                .unwrap()
                .iter()
                .map(|x| (c.off(x), x.len))
                .collect::<Vec<_>>()
        };
        assert_eq!(rel(&a), rel(&b), "{name}");
        let l = DeviceLayout::vllm_paged(&a.views(), 1, DType::BF16).unwrap();
        // BHLNC interleaves layers inside a block: no layer-wise chunks; the others have them.
        assert_eq!(
            l.layer_chunks(DeviceBlockId(1), 1).is_ok(),
            name != "BHLNC",
            "{name}"
        );
    }
}

#[test]
fn refusals_name_the_tensor_and_the_problem() {
    let c = Cache::new(LAYOUTS[0].1, 2, 4, 1, 2, 4, 32, 2, 0);
    let mut v = c.views();
    // Overlapping dimensions: heads stride equal to the token stride.
    v[0].strides[1] = v[0].strides[2];
    v[1].strides[1] = v[1].strides[2];
    let e = DeviceLayout::vllm_paged(&v, 1, DType::BF16).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("model.layers.0.self_attn.attn") && msg.contains("overlaps"),
        "{msg}"
    );
    // Layers that disagree.
    let mut v = c.views();
    v[1].strides[0] += 1;
    let msg = DeviceLayout::vllm_paged(&v, 1, DType::BF16)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("model.layers.1") && msg.contains("strides"),
        "{msg}"
    );
    // A row count that is not a multiple of the kernel split.
    let msg = DeviceLayout::vllm_paged(&c.views(), 3, DType::BF16)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("not a multiple"), "{msg}");
    // Wrong element size for the dtype.
    assert!(DeviceLayout::vllm_paged(&c.views(), 1, DType::F32).is_err());
    // A shape of no vLLM release.
    let t = TensorDesc::contiguous("odd", 4096, vec![4, 2], 2, DeviceKind::Cpu);
    let msg = EngineLayoutKind::detect_vllm(&t, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("odd") && msg.contains("4-D view"), "{msg}");
    // Too many pieces per block: 1-byte pieces (content stride 2 with 1-element content).
    let t = TensorDesc {
        name: "frag".into(),
        data_ptr: 4096,
        shape: vec![2, 300, 300, 1],
        strides: vec![300 * 300 * 2, 300 * 2, 2, 1],
        elem_size: 1,
        device: DeviceKind::Cpu,
    };
    let msg = DeviceLayout::vllm_paged(&[t], 1, DType::U8)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("pieces"), "{msg}");
}

#[test]
fn detection_by_rank() {
    let c = Cache::new(LAYOUTS[1].1, 2, 8, 1, 2, 4, 32, 2, 0);
    let v = c.views();
    assert_eq!(
        EngineLayoutKind::detect_vllm(&v[0], None).unwrap(),
        EngineLayoutKind::VllmPaged { kernel_blocks: 1 }
    );
    assert_eq!(
        EngineLayoutKind::detect_vllm(&v[0], Some(4)).unwrap(),
        EngineLayoutKind::VllmPaged { kernel_blocks: 2 }
    );
    // A block count that does not divide the rows is no split.
    assert_eq!(
        EngineLayoutKind::detect_vllm(&v[0], Some(3)).unwrap(),
        EngineLayoutKind::VllmPaged { kernel_blocks: 1 }
    );
    let old = TensorDesc::contiguous("old", 4096, vec![2, 10, 16, 2, 8], 2, DeviceKind::Cuda(0));
    assert_eq!(
        EngineLayoutKind::detect_vllm(&old, None).unwrap(),
        EngineLayoutKind::VllmCudaKvFirst
    );
    let mla = TensorDesc::contiguous("mla", 4096, vec![10, 16, 576], 2, DeviceKind::Cuda(0));
    assert_eq!(
        EngineLayoutKind::detect_vllm(&mla, None).unwrap(),
        EngineLayoutKind::VllmMla
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn random_geometries_round_trip(
        which in 0usize..6,
        layers in 1usize..4,
        blocks in 1usize..5,
        heads in 1usize..4,
        tokens in 1usize..5,
        content in 1usize..5,
        elem in prop::sample::select(vec![1usize, 2, 4]),
        pad in 0usize..3,
    ) {
        let (name, order) = LAYOUTS[which];
        let pad = if matches!(name, "LHBNC" | "BHLNC") { 0 } else { pad * elem };
        check(Cache::new(order, layers, blocks, 1, heads, tokens, content * elem, elem, pad));
    }
}
