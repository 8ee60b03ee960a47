//! Where a device (G1) block's bytes are: for each block, a list of `(address, len)` chunks in
//! canonical order; concatenated they form kvtier's contiguous host/disk block format.
//!
//! Invariants: every block of a layout has the same chunks lengths in the same order, summing to
//! `bytes_per_block`; chunks of different blocks never overlap; addresses are borrowed from the
//! engine (kvtier never frees them) and reach a `TransferEngine` only inside an
//! [`EngineMemory`](crate::EngineMemory) (the `unsafe` boundary, module [`crate::transfer::memory`]).
use kvtier::ids::DeviceBlockId;
pub use kvtier::layout::{Chunk, DeviceLayout};

use crate::error::IoError;
use crate::transfer::memory::DevicePtr;

/// The mapping from a device block id to its chunks. Implemented by the core crate's
/// [`DeviceLayout`] (what engines register) and by [`StridedLayout`] (tests and benchmarks).
pub trait BlockChunks: Send + Sync {
    /// Bytes of one block (the sum of its chunk lengths).
    fn bytes_per_block(&self) -> usize;
    /// Number of device blocks.
    fn num_blocks(&self) -> u32;
    /// Append the chunks of `block` to `out`, in canonical order. Errors for an unknown block.
    fn chunks(&self, block: u32, out: &mut Vec<Chunk>) -> Result<(), String>;
    /// The number of layers when a block's canonical bytes are layer-major with every layer the
    /// same size (layer `l` is bytes `[l * b / n, (l + 1) * b / n)` of the host block): layered
    /// loads split the copies there. `None` (the default) when the layout does not say.
    fn layers(&self) -> Option<usize> {
        None
    }
}

/// A region of device memory holding one chunk of every block: block `b`'s chunk starts at
/// `base + b * block_stride` and is `len` bytes long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Address of block 0's chunk.
    pub base: DevicePtr,
    /// Bytes from one block's chunk to the next one's.
    pub block_stride: u64,
    /// Bytes of the chunk.
    pub len: usize,
}

/// A layout made of strided regions; covers TensorRT-LLM's pool (one region per pool, or per
/// layer inside the pool) and vLLM's per-layer tensors (a K and a V region per layer).
#[derive(Clone, Debug)]
pub struct StridedLayout {
    regions: Vec<Region>,
    num_blocks: u32,
    bytes_per_block: usize,
    /// Layers, for a layout built per layer ([`StridedLayout::kv_per_layer`]).
    layers: Option<usize>,
}

impl StridedLayout {
    /// Validate and build. Each region needs `len <= block_stride` (blocks do not overlap) and
    /// a non-empty chunk; `num_blocks > 0`.
    pub fn new(num_blocks: u32, regions: Vec<Region>) -> Result<Self, IoError> {
        if num_blocks == 0 || regions.is_empty() {
            return Err(IoError::Config(
                "a device layout needs blocks and regions".into(),
            ));
        }
        for (i, r) in regions.iter().enumerate() {
            if r.len == 0 {
                return Err(IoError::Config(format!("region {i}: empty chunk")));
            }
            if num_blocks > 1 && (r.len as u64) > r.block_stride {
                return Err(IoError::Config(format!(
                    "region {i}: chunk of {} bytes is longer than its block stride {}",
                    r.len, r.block_stride
                )));
            }
            let end = r
                .block_stride
                .checked_mul(u64::from(num_blocks - 1))
                .and_then(|v| v.checked_add(r.base.get()))
                .and_then(|v| v.checked_add(r.len as u64));
            if end.is_none() {
                return Err(IoError::Config(format!("region {i}: address overflow")));
            }
        }
        let bytes_per_block = regions.iter().map(|r| r.len).sum();
        Ok(StridedLayout {
            regions,
            num_blocks,
            bytes_per_block,
            layers: None,
        })
    }

    /// TensorRT-LLM's pool layout: one buffer `[num_blocks, layers, 2, tokens*heads*dim]`, so a
    /// block is one contiguous chunk.
    pub fn contiguous(
        base: DevicePtr,
        num_blocks: u32,
        bytes_per_block: usize,
    ) -> Result<Self, IoError> {
        Self::new(
            num_blocks,
            vec![Region {
                base,
                block_stride: bytes_per_block as u64,
                len: bytes_per_block,
            }],
        )
    }

    /// vLLM's per-layer layout: one tensor per layer shaped `[2, num_blocks, chunk]` (K plane,
    /// then V plane); `layer_bases[l]` is the tensor's address, `chunk` the bytes of one block's
    /// K (or V) in one layer. Canonical order: layer 0 K, layer 0 V, layer 1 K, ...
    pub fn kv_per_layer(
        layer_bases: &[DevicePtr],
        num_blocks: u32,
        chunk: usize,
    ) -> Result<Self, IoError> {
        let plane = chunk as u64 * u64::from(num_blocks);
        let mut regions = Vec::with_capacity(2 * layer_bases.len());
        for (l, &b) in layer_bases.iter().enumerate() {
            let v = b
                .checked_add(plane)
                .ok_or_else(|| IoError::Config(format!("layer {l}: address overflow")))?;
            for base in [b, v] {
                regions.push(Region {
                    base,
                    block_stride: chunk as u64,
                    len: chunk,
                });
            }
        }
        let mut l = Self::new(num_blocks, regions)?;
        l.layers = Some(layer_bases.len());
        Ok(l)
    }

    /// The regions, in each block's canonical chunk order.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }
}

impl BlockChunks for StridedLayout {
    fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    fn chunks(&self, block: u32, out: &mut Vec<Chunk>) -> Result<(), String> {
        if block >= self.num_blocks {
            return Err(format!(
                "device block {block} is out of range ({} blocks)",
                self.num_blocks
            ));
        }
        out.extend(self.regions.iter().map(|r| Chunk {
            addr: r.base.get() + u64::from(block) * r.block_stride,
            len: r.len,
        }));
        Ok(())
    }
    fn layers(&self) -> Option<usize> {
        self.layers
    }
}

impl BlockChunks for DeviceLayout {
    fn bytes_per_block(&self) -> usize {
        DeviceLayout::bytes_per_block(self)
    }
    fn num_blocks(&self) -> u32 {
        u32::try_from(DeviceLayout::num_blocks(self)).unwrap_or(u32::MAX)
    }
    fn chunks(&self, block: u32, out: &mut Vec<Chunk>) -> Result<(), String> {
        self.chunks_into(DeviceBlockId(block), out)
            .map_err(|e| e.to_string())
    }
    fn layers(&self) -> Option<usize> {
        self.layers_in_canonical_order()
    }
}

/// A piece of a device block's chunk within one `unit` of the canonical block.
pub(crate) struct Piece {
    /// Which unit (layer, group of layers) of the block.
    pub(crate) unit: usize,
    /// Canonical offset of its first byte in the block.
    pub(crate) at: usize,
    /// Its device address.
    pub(crate) addr: u64,
    pub(crate) len: usize,
}

/// The `chunks` of one device block (host block at `host`) cut at every multiple of `unit`
/// bytes of the canonical block, in order. `None` when the host block, a chunk's address or
/// length is not a multiple of `align` (the CUDA kernel's wide copies need 16; a memcpy 1), or
/// the chunks do not add up to `bytes_per_block`.
pub(crate) fn cut_chunks(
    chunks: &[Chunk],
    host: usize,
    bytes_per_block: usize,
    unit: usize,
    align: usize,
) -> Option<Vec<Piece>> {
    if align == 0 || !host.is_multiple_of(align) || unit == 0 {
        return None;
    }
    let mut out = Vec::with_capacity(chunks.len());
    let mut off = 0usize; // canonical offset of the chunk's first byte
    for c in chunks {
        if !c.addr.is_multiple_of(align as u64) || !c.len.is_multiple_of(align) {
            return None;
        }
        let mut done = 0usize;
        while done < c.len {
            let at = off + done;
            let k = at / unit;
            let len = (c.len - done).min((k + 1) * unit - at);
            out.push(Piece {
                unit: k,
                at,
                addr: c.addr + done as u64,
                len,
            });
            done += len;
        }
        off += c.len;
    }
    (off == bytes_per_block).then_some(out)
}

/// Each block of `items` (`(pair, chunks of the device block, host block address)`) cut into
/// `layers` equal layers of its canonical bytes (layer `l` is bytes `[l * s, (l + 1) * s)`,
/// `s = bytes_per_block / layers`): `push(&mut out[l], host address, device address, len)` for
/// every piece, in order, starting from `empty` per layer. `None` when the blocks do not split
/// into equal layers with every piece a multiple of `align`.
pub(crate) fn split_layers<T: Clone>(
    items: &[(usize, Vec<Chunk>, usize)],
    bytes_per_block: usize,
    layers: usize,
    align: usize,
    empty: T,
    mut push: impl FnMut(&mut T, usize, u64, usize),
) -> Option<Vec<T>> {
    if layers == 0 || align == 0 || !bytes_per_block.is_multiple_of(layers) {
        return None;
    }
    let s = bytes_per_block / layers;
    if !s.is_multiple_of(align) {
        return None;
    }
    let mut out = vec![empty; layers];
    for (_, chunks, host) in items {
        for p in cut_chunks(chunks, *host, bytes_per_block, s, align)? {
            push(out.get_mut(p.unit)?, host + p.at, p.addr, p.len);
        }
    }
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn per_layer_chunks_are_in_canonical_order() {
        let p = |a| DevicePtr::new(a).unwrap();
        let l = StridedLayout::kv_per_layer(&[p(1000), p(9000)], 4, 10).unwrap();
        assert_eq!(l.bytes_per_block(), 40);
        let mut c = Vec::new();
        l.chunks(2, &mut c).unwrap();
        let addrs: Vec<u64> = c.iter().map(|c| c.addr).collect();
        assert_eq!(addrs, vec![1020, 1060, 9020, 9060]);
        assert!(l.chunks(4, &mut c).is_err());
    }

    #[test]
    fn overlapping_regions_are_rejected() {
        let r = Region {
            base: DevicePtr::new(64).unwrap(),
            block_stride: 8,
            len: 16,
        };
        assert!(StridedLayout::new(3, vec![r]).is_err());
    }
}
