//! vLLM's paged per-layer views (vLLM >= 0.32): every layer hands over a 4-D view
//! `[B, H, N, C]` (kernel blocks, KV heads, tokens of a kernel block, content: K and V packed,
//! or MLA's latent) of one backing buffer, whose physical order comes from a `KVCacheLayout`
//! (`vllm/v1/kv_cache_layout.py`: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) and whose strides
//! are built by `compute_layout_strides` / `create_kv_cache_views`
//! (`vllm/v1/kv_cache_interface.py`). The shape says nothing about where bytes are; only the
//! strides do, so every (layer, block) region is placed from them:
//!
//! - the dimensions of one block (kernel-block split, H, N, C) are sorted by stride; the
//!   innermost ones that tile densely form a *run* (one contiguous piece);
//! - the remaining dimensions (e.g. H under LHBNC and BHLNC, which sit outside the block or
//!   the layer) enumerate the block's pieces, in address order;
//! - a layer contributes one region per piece; with layers at a uniform address step (one
//!   backing buffer, as vLLM allocates it), the canonical order of a block is the physical
//!   order of its regions (sorted by address), so that block-outermost layouts (BLHNC, BLNHC,
//!   BHLNC) make a whole block one contiguous range; otherwise it is layer-major.
//!
//! The canonical (host/disk) format of a block is therefore a function of the layout and the
//! shapes alone, the same in every process that has them; blocks of different layouts are kept
//! apart by the hash salt (the adapter puts the resolved layout's name into it).
//!
//! Kernel-block splitting (`kernel_blocks > 1`): vLLM's view then has `num_blocks *
//! kernel_blocks` rows; logical block `b` is rows `b * kernel_blocks ..`, one more dimension of
//! the block.
//!
//! Refused, with a [`LayoutError`] naming the tensor: any other rank, a row count that is not a
//! multiple of `kernel_blocks`, dimensions that overlap (the view is not injective), blocks
//! split into more than [`MAX_PIECES`] pieces, layers that disagree on shape, strides, element
//! size or device.
use super::{
    DType, DeviceLayout, DeviceRegion, EngineLayoutKind, KvGeometry, LayoutError, TensorDesc,
};

/// Pieces of one block over all layers beyond which a layout is refused: copying it would be
/// a gather of tiny pieces, and the descriptors of one block would not fit the copy paths.
pub const MAX_PIECES: usize = 1 << 16;

/// How one layer's block is cut: a contiguous run of `run` bytes, repeated at the offsets of
/// `pieces` (address order, relative to the block's first byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BlockCut {
    pub run: usize,
    pub pieces: Vec<u64>,
    pub block_stride: u64,
}

/// Cut a `[B, H, N, C]` view (strides in elements) into pieces per logical block.
pub(super) fn cut(
    t: &TensorDesc,
    kernel_blocks: usize,
    dtype: DType,
) -> Result<(usize, BlockCut), LayoutError> {
    if t.shape.len() != 4 {
        return Err(t.mismatch(format!(
            "a vLLM paged view has 4 dimensions [num_blocks, num_kv_heads, block_size, content], \
             got shape {:?}",
            t.shape
        )));
    }
    super::check_basics(t, dtype)?;
    let kb = kernel_blocks.max(1);
    let rows = t.shape[0];
    if !rows.is_multiple_of(kb) {
        return Err(t.mismatch(format!(
            "{rows} kernel blocks is not a multiple of {kb} kernel blocks per block"
        )));
    }
    let num_blocks = rows / kb;
    let e = t.elem_size as u64;
    let bytes = |s: usize| -> Result<u64, LayoutError> {
        (s as u64)
            .checked_mul(e)
            .ok_or_else(|| t.mismatch("a stride overflows"))
    };
    let row_stride = bytes(t.strides[0])?;
    let block_stride = row_stride
        .checked_mul(kb as u64)
        .ok_or_else(|| t.mismatch("the block stride overflows"))?;
    // The dimensions of one logical block, in bytes: (size, stride).
    let mut inner: Vec<(usize, u64)> = vec![(kb, row_stride)];
    for d in 1..4 {
        inner.push((t.shape[d], bytes(t.strides[d])?));
    }
    inner.retain(|(n, _)| *n > 1);
    inner.sort_unstable_by_key(|(n, s)| (*s, *n));
    // Injective: sorted by stride, each dimension starts beyond the extent of the smaller ones
    // (the block dimension included, so blocks never overlap each other).
    let mut all = inner.clone();
    if num_blocks > 1 {
        all.push((num_blocks, block_stride));
        all.sort_unstable_by_key(|(n, s)| (*s, *n));
    }
    let mut extent = e;
    for (n, s) in &all {
        if *s < extent {
            return Err(t.mismatch(format!(
                "strides {:?} (shape {:?}): a dimension of stride {} elements overlaps the {} bytes \
                 below it; kvtier cannot place this layout's blocks",
                t.strides,
                t.shape,
                s / e,
                extent
            )));
        }
        extent = s
            .checked_mul(*n as u64 - 1)
            .and_then(|v| v.checked_add(extent))
            .ok_or_else(|| t.mismatch("the tensor's extent overflows"))?;
    }
    // The innermost dimensions that tile densely make one run.
    let mut run = e;
    let mut k = 0;
    while k < inner.len() && inner[k].1 == run {
        run *= inner[k].0 as u64;
        k += 1;
    }
    let outer = &inner[k..];
    let count: usize = outer.iter().map(|(n, _)| *n).product();
    if count > MAX_PIECES {
        return Err(t.mismatch(format!(
            "strides {:?}: a block is {count} separate pieces of {run} bytes; kvtier refuses layouts \
             of more than {MAX_PIECES} pieces per block",
            t.strides
        )));
    }
    // Offsets in address order: the largest stride varies slowest.
    let mut pieces = vec![0u64];
    for (n, s) in outer.iter().rev() {
        let mut next = Vec::with_capacity(pieces.len() * n);
        for p in &pieces {
            for i in 0..*n as u64 {
                next.push(p + i * s);
            }
        }
        pieces = next;
    }
    pieces.sort_unstable();
    Ok((
        num_blocks,
        BlockCut {
            run: usize::try_from(run).map_err(|_| t.mismatch("a block's run overflows"))?,
            pieces,
            block_stride,
        },
    ))
}

/// Build the layout of vLLM's paged views (see the module docs).
pub(super) fn build(
    tensors: &[TensorDesc],
    kernel_blocks: usize,
    dtype: DType,
) -> Result<DeviceLayout, LayoutError> {
    let Some(first) = tensors.first() else {
        return Err(LayoutError::Tensors(
            "vLLM paged layout: no KV cache tensors were given".into(),
        ));
    };
    let (num_blocks, c) = cut(first, kernel_blocks, dtype)?;
    for t in &tensors[1..] {
        // Dimension 0 of a paged view counts (kernel) blocks.
        t.check_same_as(first, 0)?;
        if t.data_ptr == 0 {
            return Err(t.mismatch("null data pointer"));
        }
    }
    if c.pieces.len().saturating_mul(tensors.len()) > MAX_PIECES {
        return Err(first.mismatch(format!(
            "{} layers of {} pieces per block: more than {MAX_PIECES} pieces per block",
            tensors.len(),
            c.pieces.len()
        )));
    }
    let last_block = c.block_stride.checked_mul(num_blocks as u64 - 1);
    let mut regions = Vec::with_capacity(tensors.len() * c.pieces.len());
    for t in tensors {
        for p in &c.pieces {
            let base = t
                .data_ptr
                .checked_add(*p)
                .ok_or_else(|| t.mismatch("address overflows"))?;
            last_block
                .and_then(|v| v.checked_add(base))
                .and_then(|v| v.checked_add(c.run as u64))
                .ok_or_else(|| t.mismatch("address of the last block overflows"))?;
            regions.push(DeviceRegion {
                base,
                block_stride: c.block_stride,
                len: c.run,
            });
        }
    }
    // One backing buffer at a uniform layer step: physical order is a function of the layout
    // alone, and makes block-outermost layouts one range per block.
    let mut layer_major = true;
    if uniform_step(tensors) {
        let before = regions.clone();
        regions.sort_by_key(|r| r.base);
        layer_major = before == regions;
    }
    let bytes_per_layer = c.run * c.pieces.len();
    let tokens_per_block = first.shape[2] * kernel_blocks.max(1);
    if bytes_per_layer % tokens_per_block != 0 {
        return Err(first.mismatch(format!(
            "a block's {bytes_per_layer} bytes per layer are not {tokens_per_block} equal tokens"
        )));
    }
    let geometry = KvGeometry {
        num_layers: tensors.len(),
        // K and V (or MLA's latent) stay packed as the engine keeps them: one opaque plane.
        kv_planes: 1,
        tokens_per_block,
        bytes_per_token_plane: bytes_per_layer / tokens_per_block,
        dtype,
    };
    Ok(DeviceLayout {
        kind: EngineLayoutKind::VllmPaged {
            kernel_blocks: kernel_blocks.max(1),
        },
        geometry,
        num_blocks,
        device: first.device,
        regions_per_layer: c.pieces.len(),
        regions,
        layer_major,
    })
}

/// Whether the layers' addresses are `first + l * step` for one step (any sign).
fn uniform_step(tensors: &[TensorDesc]) -> bool {
    if tensors.len() < 2 {
        return true;
    }
    let step = tensors[1].data_ptr.wrapping_sub(tensors[0].data_ptr);
    step != 0
        && tensors
            .windows(2)
            .all(|w| w[1].data_ptr.wrapping_sub(w[0].data_ptr) == step)
}
