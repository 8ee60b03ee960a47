//! KV layouts: the geometry of a KV cache and the engines' tensor shapes, turned into byte ranges.
//!
//! kvtier's own block format (host memory, disk files, remote values) is one contiguous buffer of
//! `bytes_per_block` bytes per block, in canonical order: layer-major, then plane (K before V),
//! each piece holding the engine's bytes for that (layer, plane) of the block as they are laid
//! out on the device. Engine block contents are opaque: kvtier never interprets them, it only
//! moves them between identical layouts.
//!
//! A [`DeviceLayout`] is built from the engine's tensors ([`TensorDesc`], as the engine reports
//! them: pointer, shape, strides in elements, element size, device) and one [`EngineLayoutKind`]:
//! - `TrtllmPool`: TensorRT-LLM's single pool tensor
//!   `[num_blocks, num_layers, kv_factor, tokens_per_block * kv_heads * head_dim]`, block-major
//!   across layers (kv_factor 2, or 1 for MLA): a block is one contiguous range;
//! - `VllmCudaKvFirst`: one tensor per layer `[2, num_blocks, block_size, heads, head_dim]`;
//! - `VllmCudaBlockFirst`: one tensor per layer `[num_blocks, 2, block_size, heads, head_dim]`;
//! - `VllmMla`: one tensor per layer `[num_blocks, block_size, head_size]` (one plane);
//! - `VllmCpu`: one tensor per layer `[num_blocks, kv_heads, block_size, 2 * head_size]`, where
//!   each (layer, block) is one opaque chunk holding both planes in the engine's own order;
//! - `VllmPaged`: vLLM >= 0.32's per-layer 4-D views `[num_blocks, num_kv_heads, block_size,
//!   content]` of one backing buffer in any `KVCacheLayout` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC,
//!   BHLNC), MLA and FP8 included: every (layer, block) region is placed from the strides, as
//!   one or several strided pieces (module `paged`).
//!
//! The dimensions inside a chunk may have any stride order (vLLM can permute them, e.g. HND) as
//! long as they cover a dense range: a chunk is always one contiguous range of bytes.
//!
//! Invariants of a built `DeviceLayout` (checked by `DeviceLayout::new`, which otherwise returns
//! a [`LayoutError`] naming the tensor and the mismatch):
//! - every layer tensor has the same shape, strides, element size and device;
//! - chunks of distinct (block, plane) in one tensor never overlap;
//! - every address computation `base + offset` fits in `u64` for every valid block;
//! - the chunks of a block, in canonical order, sum to `bytes_per_block()`.
//!
//! ```
//! use kvtier::layout::{DType, DeviceKind, DeviceLayout, TensorDesc};
//! use kvtier::DeviceBlockId;
//!
//! // TensorRT-LLM: 100 blocks, 32 layers, K/V, 32 tokens x 8 KV heads x 128 dims, bf16.
//! let pool = TensorDesc::contiguous("kv_pool", 0x7f00_0000_0000, vec![100, 32, 2, 32 * 8 * 128], 2, DeviceKind::Cuda(0));
//! let layout = DeviceLayout::trtllm(&pool, 32, DType::BF16)?;
//! assert_eq!(layout.bytes_per_block(), 32 * 2 * 32 * 8 * 128 * 2); // 4 MiB
//! let chunks = layout.chunks(DeviceBlockId(3))?;
//! assert_eq!(chunks.len(), 1); // a TensorRT-LLM block is one contiguous range
//! assert_eq!(chunks[0].addr, 0x7f00_0000_0000 + 3 * layout.bytes_per_block() as u64);
//! # Ok::<(), kvtier::layout::LayoutError>(())
//! ```
use serde::{Deserialize, Serialize};

use crate::ids::DeviceBlockId;

mod desc;
mod paged;

pub use desc::{Chunk, DType, DeviceKind, DeviceRegion, EngineLayoutKind, KvGeometry, TensorDesc};
pub use paged::MAX_PIECES;

/// Why engine tensors do not make a layout, or a layout query is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A tensor does not have the shape, strides or type the layout needs.
    #[error("tensor {tensor}: {reason}")]
    Mismatch {
        /// The tensor's name.
        tensor: String,
        /// What does not fit.
        reason: String,
    },
    /// The layout got no tensors, or a number the kind does not accept.
    #[error("{0}")]
    Tensors(String),
    /// A device block id beyond `num_blocks`.
    #[error("device block {block} out of range ({num_blocks} blocks)")]
    BlockOutOfRange {
        /// The block asked for.
        block: u32,
        /// Blocks of the layout.
        num_blocks: usize,
    },
    /// A layer index beyond `num_layers`.
    #[error("layer {layer} out of range ({num_layers} layers)")]
    LayerOutOfRange {
        /// The layer asked for.
        layer: usize,
        /// Layers of the layout.
        num_layers: usize,
    },
}
/// The engine's KV cache as kvtier sees it: for each device block, the byte ranges that make it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLayout {
    kind: EngineLayoutKind,
    geometry: KvGeometry,
    num_blocks: usize,
    device: DeviceKind,
    /// Canonical order: layer-major, then plane (one region per layer for `VllmCpu`).
    regions: Vec<DeviceRegion>,
    /// Regions per layer (planes, or 1 when a chunk holds both planes; pieces for `VllmPaged`).
    regions_per_layer: usize,
    /// `regions` are layer-major (layer `l`'s at `l * regions_per_layer`); false only for paged
    /// layouts whose physical order interleaves the layers inside a block (BHLNC).
    #[serde(default = "layer_major_default")]
    layer_major: bool,
}

fn layer_major_default() -> bool {
    true
}

/// The roles of a tensor's dimensions for one layout kind.
struct Dims {
    block: usize,
    layer: Option<usize>,
    plane: Option<usize>,
    /// Dimensions that make up one chunk.
    inner: std::ops::Range<usize>,
    rank: usize,
}

impl DeviceLayout {
    /// Validate `tensors` against `kind` and build the layout. Per-layer kinds take one tensor
    /// per layer, in layer order; `TrtllmPool` takes exactly one tensor.
    pub fn new(
        kind: EngineLayoutKind,
        tensors: &[TensorDesc],
        dtype: DType,
    ) -> Result<Self, LayoutError> {
        let Some(first) = tensors.first() else {
            return Err(LayoutError::Tensors(format!(
                "{kind:?}: no KV cache tensors were given"
            )));
        };
        if let EngineLayoutKind::VllmPaged { kernel_blocks } = kind {
            return paged::build(tensors, kernel_blocks, dtype);
        }
        let dims = match kind {
            EngineLayoutKind::TrtllmPool { .. } => {
                if tensors.len() != 1 {
                    return Err(LayoutError::Tensors(format!(
                        "TrtllmPool takes exactly one pool tensor, got {}",
                        tensors.len()
                    )));
                }
                Dims {
                    block: 0,
                    layer: Some(1),
                    plane: Some(2),
                    inner: 3..4,
                    rank: 4,
                }
            }
            EngineLayoutKind::VllmCudaKvFirst => Dims {
                block: 1,
                layer: None,
                plane: Some(0),
                inner: 2..5,
                rank: 5,
            },
            EngineLayoutKind::VllmCudaBlockFirst => Dims {
                block: 0,
                layer: None,
                plane: Some(1),
                inner: 2..5,
                rank: 5,
            },
            EngineLayoutKind::VllmMla => Dims {
                block: 0,
                layer: None,
                plane: None,
                inner: 1..3,
                rank: 3,
            },
            EngineLayoutKind::VllmCpu => Dims {
                block: 0,
                layer: None,
                plane: None,
                inner: 1..4,
                rank: 4,
            },
            EngineLayoutKind::VllmPaged { .. } => unreachable_paged()?,
        };
        for t in tensors {
            check_tensor(t, &dims, dtype)?;
        }
        // Every layer tensor must agree with the first one.
        for t in &tensors[1..] {
            t.check_same_as(first, dims.block)?;
        }
        let shape = &first.shape;
        let elem = first.elem_size;
        let num_blocks = shape[dims.block];
        let kv_planes = match (kind, dims.plane) {
            (EngineLayoutKind::VllmCpu, _) => 2,
            (_, Some(p)) => shape[p],
            (_, None) => 1,
        };
        let num_layers = match dims.layer {
            Some(l) => shape[l],
            None => tensors.len(),
        };
        let tokens_per_block = match kind {
            EngineLayoutKind::TrtllmPool { tokens_per_block } => tokens_per_block,
            EngineLayoutKind::VllmCudaKvFirst | EngineLayoutKind::VllmCudaBlockFirst => shape[2],
            EngineLayoutKind::VllmMla => shape[1],
            EngineLayoutKind::VllmCpu | EngineLayoutKind::VllmPaged { .. } => shape[2],
        };
        if num_blocks == 0 {
            return Err(first.mismatch(format!("shape {shape:?} has no blocks")));
        }
        if num_layers == 0 {
            return Err(first.mismatch(format!("shape {shape:?} has no layers")));
        }
        match (kind, kv_planes) {
            (EngineLayoutKind::TrtllmPool { .. }, 1 | 2) => {}
            (EngineLayoutKind::TrtllmPool { .. }, k) => {
                return Err(first.mismatch(format!(
                    "kv_factor (dim 2) is {k}; TensorRT-LLM uses 2, or 1 for MLA"
                )))
            }
            (_, 1 | 2) if dims.plane.is_none() => {}
            (_, 2) => {}
            (_, k) => {
                return Err(first.mismatch(format!(
                    "K/V dimension {} has size {k}, expected 2",
                    dims.plane.unwrap_or(0)
                )))
            }
        }
        if tokens_per_block == 0 {
            return Err(first.mismatch("tokens per block is 0"));
        }
        let inner_elems: usize = shape[dims.inner.clone()].iter().product();
        let chunk_bytes = inner_elems
            .checked_mul(elem)
            .ok_or_else(|| first.mismatch("chunk size overflows"))?;
        // Bytes per (layer, plane) piece; the CPU layout's chunk holds both planes.
        let planes_in_chunk = if kind == EngineLayoutKind::VllmCpu {
            2
        } else {
            1
        };
        let piece_bytes = chunk_bytes / planes_in_chunk;
        if piece_bytes * planes_in_chunk != chunk_bytes || piece_bytes % tokens_per_block != 0 {
            return Err(first.mismatch(format!(
                "a block's chunk of {chunk_bytes} bytes is not {planes_in_chunk} plane(s) of \
                 {tokens_per_block} tokens"
            )));
        }
        let geometry = KvGeometry {
            num_layers,
            kv_planes,
            tokens_per_block,
            bytes_per_token_plane: piece_bytes / tokens_per_block,
            dtype,
        };
        let bytes = |t: &TensorDesc, d: usize| -> Result<u64, LayoutError> {
            (t.strides[d] as u64)
                .checked_mul(elem as u64)
                .ok_or_else(|| t.mismatch(format!("stride of dim {d} overflows")))
        };
        let regions_per_layer = if dims.plane.is_some() { kv_planes } else { 1 };
        let mut regions = Vec::with_capacity(num_layers * regions_per_layer);
        for layer in 0..num_layers {
            let t = match dims.layer {
                Some(_) => first,
                None => tensors.get(layer).unwrap_or(first),
            };
            let layer_off = match dims.layer {
                Some(d) => bytes(t, d)?.checked_mul(layer as u64),
                None => Some(0),
            }
            .ok_or_else(|| t.mismatch("layer offset overflows"))?;
            let block_stride = bytes(t, dims.block)?;
            for plane in 0..regions_per_layer {
                let plane_off = match dims.plane {
                    Some(d) => bytes(t, d)?.checked_mul(plane as u64),
                    None => Some(0),
                }
                .ok_or_else(|| t.mismatch("plane offset overflows"))?;
                let base = t
                    .data_ptr
                    .checked_add(layer_off)
                    .and_then(|v| v.checked_add(plane_off))
                    .ok_or_else(|| t.mismatch("address overflows"))?;
                // The last byte of the last block must be addressable.
                block_stride
                    .checked_mul(num_blocks as u64 - 1)
                    .and_then(|v| v.checked_add(base))
                    .and_then(|v| v.checked_add(chunk_bytes as u64))
                    .ok_or_else(|| t.mismatch("address of the last block overflows"))?;
                regions.push(DeviceRegion {
                    base,
                    block_stride,
                    len: chunk_bytes,
                });
            }
        }
        Ok(DeviceLayout {
            kind,
            geometry,
            num_blocks,
            device: first.device,
            regions,
            regions_per_layer,
            layer_major: true,
        })
    }

    /// TensorRT-LLM's pool tensor (`register_kv_caches`).
    pub fn trtllm(
        pool: &TensorDesc,
        tokens_per_block: usize,
        dtype: DType,
    ) -> Result<Self, LayoutError> {
        Self::new(
            EngineLayoutKind::TrtllmPool { tokens_per_block },
            std::slice::from_ref(pool),
            dtype,
        )
    }

    /// vLLM's per-layer CUDA tensors, in layer order; the K/V order is detected from the shape.
    pub fn vllm_cuda(layers: &[TensorDesc], dtype: DType) -> Result<Self, LayoutError> {
        let Some(first) = layers.first() else {
            return Err(LayoutError::Tensors(
                "vLLM: no KV cache tensors were given".into(),
            ));
        };
        Self::new(EngineLayoutKind::detect_vllm_cuda(first)?, layers, dtype)
    }

    /// vLLM >= 0.32's per-layer 4-D views in any `KVCacheLayout` (see `paged`).
    pub fn vllm_paged(
        layers: &[TensorDesc],
        kernel_blocks: usize,
        dtype: DType,
    ) -> Result<Self, LayoutError> {
        paged::build(layers, kernel_blocks, dtype)
    }

    /// The number of layers when a block's canonical bytes hold them one after the other, each
    /// the same size (every layout but the paged ones whose blocks interleave the layers).
    pub fn layers_in_canonical_order(&self) -> Option<usize> {
        let n = self.geometry.num_layers;
        (self.layer_major && n > 0 && self.bytes_per_block().is_multiple_of(n)).then_some(n)
    }

    /// Whether a block's chunks are one contiguous range (the fastest copy: one range per block).
    pub fn block_is_contiguous(&self) -> bool {
        let mut v = Vec::new();
        self.push_chunks(DeviceBlockId(0), &self.regions, &mut v)
            .is_ok()
            && v.len() == 1
    }

    /// vLLM's per-layer CPU tensors `[num_blocks, kv_heads, block_size, 2 * head_size]`.
    pub fn vllm_cpu(layers: &[TensorDesc], dtype: DType) -> Result<Self, LayoutError> {
        Self::new(EngineLayoutKind::VllmCpu, layers, dtype)
    }

    /// The engine convention the tensors follow.
    pub fn kind(&self) -> EngineLayoutKind {
        self.kind
    }

    /// The shape of one block's KV.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// Device blocks of the layout.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Where the tensors live.
    pub fn device(&self) -> DeviceKind {
        self.device
    }

    /// Bytes of one block on this rank; the size of a host/disk block.
    pub fn bytes_per_block(&self) -> usize {
        self.geometry.bytes_per_block()
    }

    /// The strided regions, canonical order, before coalescing.
    pub fn regions(&self) -> &[DeviceRegion] {
        &self.regions
    }

    /// Append `block`'s chunks, coalesced, in canonical order to `out`. Their concatenation is
    /// the block in kvtier's host/disk format.
    pub fn chunks_into(
        &self,
        block: DeviceBlockId,
        out: &mut Vec<Chunk>,
    ) -> Result<(), LayoutError> {
        self.push_chunks(block, &self.regions, out)
    }

    /// `block`'s chunks, coalesced, in canonical order.
    pub fn chunks(&self, block: DeviceBlockId) -> Result<Vec<Chunk>, LayoutError> {
        let mut out = Vec::new();
        self.chunks_into(block, &mut out)?;
        Ok(out)
    }

    /// The chunks of one layer of `block` (for layer-wise loads and saves), coalesced. They
    /// correspond to bytes `[canonical_offset(layer, 0), + kv_planes * bytes_per_piece)` of
    /// the host block.
    pub fn layer_chunks(
        &self,
        block: DeviceBlockId,
        layer: usize,
    ) -> Result<Vec<Chunk>, LayoutError> {
        if layer >= self.geometry.num_layers {
            return Err(LayoutError::LayerOutOfRange {
                layer,
                num_layers: self.geometry.num_layers,
            });
        }
        if !self.layer_major {
            return Err(LayoutError::Tensors(format!(
                "{:?}: a block is stored in physical order across layers; layer-wise chunks are not available",
                self.kind
            )));
        }
        let start = layer * self.regions_per_layer;
        let mut out = Vec::new();
        self.push_chunks(
            block,
            &self.regions[start..start + self.regions_per_layer],
            &mut out,
        )?;
        Ok(out)
    }

    fn push_chunks(
        &self,
        block: DeviceBlockId,
        regions: &[DeviceRegion],
        out: &mut Vec<Chunk>,
    ) -> Result<(), LayoutError> {
        let b = block.0 as u64;
        if block.0 as usize >= self.num_blocks {
            return Err(LayoutError::BlockOutOfRange {
                block: block.0,
                num_blocks: self.num_blocks,
            });
        }
        let mut pending: Option<Chunk> = None;
        for r in regions {
            // Cannot overflow: checked for the last block in `new`.
            let addr = r.base + b * r.block_stride;
            match &mut pending {
                Some(c) if c.addr + c.len as u64 == addr => c.len += r.len,
                _ => {
                    if let Some(c) = pending.take() {
                        out.push(c);
                    }
                    pending = Some(Chunk { addr, len: r.len });
                }
            }
        }
        if let Some(c) = pending {
            out.push(c);
        }
        Ok(())
    }
}

fn unreachable_paged() -> Result<Dims, LayoutError> {
    Err(LayoutError::Tensors(
        "internal: VllmPaged is built by layout::paged".into(),
    ))
}

/// The checks every layout kind makes of a tensor whose rank is right: strides match the shape,
/// the element size matches `dtype`, a non-null pointer, no empty dimension.
pub(crate) fn check_basics(t: &TensorDesc, dtype: DType) -> Result<(), LayoutError> {
    if t.strides.len() != t.shape.len() {
        return Err(t.mismatch(format!(
            "strides {:?} do not match shape {:?}",
            t.strides, t.shape
        )));
    }
    if t.elem_size != dtype.size() {
        return Err(t.mismatch(format!(
            "element size {} does not match dtype {dtype:?} ({} bytes)",
            t.elem_size,
            dtype.size()
        )));
    }
    if t.data_ptr == 0 {
        return Err(t.mismatch("null data pointer"));
    }
    if t.shape.contains(&0) {
        return Err(t.mismatch(format!("shape {:?} has an empty dimension", t.shape)));
    }
    Ok(())
}

/// Shape, stride and type checks of one tensor against the dimension roles of its layout kind.
fn check_tensor(t: &TensorDesc, dims: &Dims, dtype: DType) -> Result<(), LayoutError> {
    if t.shape.len() != dims.rank {
        return Err(t.mismatch(format!(
            "expected {} dimensions, got shape {:?}",
            dims.rank, t.shape
        )));
    }
    check_basics(t, dtype)?;
    // The inner dimensions must cover a dense range in some order.
    let mut inner: Vec<(usize, usize)> = dims
        .inner
        .clone()
        .map(|d| (t.strides[d], t.shape[d]))
        .filter(|(_, n)| *n > 1)
        .collect();
    inner.sort_unstable();
    let mut extent = 1usize;
    for (s, n) in &inner {
        if *s != extent {
            return Err(t.mismatch(format!(
                "strides {:?}: dimensions {:?} of a block are not dense (expected a stride of {extent}, found {s})",
                t.strides, dims.inner
            )));
        }
        extent = extent.saturating_mul(*n);
    }
    // Pieces of distinct (block, layer, plane) must not overlap.
    let mut outer: Vec<(usize, usize, usize)> = [Some(dims.block), dims.layer, dims.plane]
        .into_iter()
        .flatten()
        .map(|d| (t.strides[d], t.shape[d], d))
        .filter(|(_, n, _)| *n > 1)
        .collect();
    outer.sort_unstable();
    for (s, n, d) in outer {
        if s < extent {
            return Err(t.mismatch(format!(
                "strides {:?}: dimension {d} (stride {s}) overlaps a block's {extent} elements",
                t.strides
            )));
        }
        extent = s.saturating_mul(n - 1).saturating_add(extent);
    }
    Ok(())
}
