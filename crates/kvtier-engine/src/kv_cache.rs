//! The paged KV cache (G1 of the reference engine): CPU memory the engine owns.
//!
//! Layout: the TensorRT-LLM pool shape `[num_blocks, num_layers, 2 (K, V), block_size * kv_heads *
//! head_dim]` of f32, so one block is contiguous across layers (`bytes_per_block` bytes) and a
//! (block, layer, plane) chunk is contiguous too. Inside a plane the order is `[slot][kv_head][dim]`.
//!
//! The buffer is a kvtier-io [`CpuKvPool`], so the kvtier connector registers it without `unsafe`
//! (`EngineMemory::from_cpu_pool` checks the layout against the pool and keeps the allocation
//! alive while its transfer engine lives). Every accessor borrows only the range it returns,
//! never the whole pool, so kvtier's copies of other blocks never overlap a live borrow.
//!
//! Invariant: the slice returned for (block, layer, plane, slot) always has exactly `kv_dim`
//! elements; callers index blocks they own through the block pool (the connector's books keep
//! kvtier's jobs off the blocks the engine touches).
use kvtier_io::CpuKvPool;

use crate::api::EngineError;
use crate::model::ModelConfig;

/// The engine's G1 KV pool: one f32 buffer, `[num_blocks, num_layers, 2, block_size * kv_dim]`.
pub struct KvCache {
    data: CpuKvPool<f32>,
    num_blocks: usize,
    num_layers: usize,
    block_size: usize,
    kv_dim: usize,
}

impl KvCache {
    /// A zeroed pool of `num_blocks` blocks of `block_size` tokens for `cfg`; a `Config` error
    /// when it holds no element or cannot be allocated.
    pub fn new(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let kv_dim = cfg.kv_dim();
        let len = [num_blocks, cfg.num_layers, 2, block_size, kv_dim]
            .iter()
            .try_fold(1usize, |a, &n| a.checked_mul(n))
            .ok_or_else(|| EngineError::Config("KV cache size overflows".into()))?;
        let data = CpuKvPool::zeroed(len).map_err(|e| EngineError::Config(e.to_string()))?;
        Ok(KvCache {
            data,
            num_blocks,
            num_layers: cfg.num_layers,
            block_size,
            kv_dim,
        })
    }

    /// Blocks of the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Layers of the model.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// f32 elements of one (block, layer, plane) chunk.
    pub fn plane_len(&self) -> usize {
        self.block_size * self.kv_dim
    }
    /// f32 elements of one whole block (all layers, K and V).
    pub fn block_len(&self) -> usize {
        self.num_layers * 2 * self.plane_len()
    }
    /// Bytes of one block.
    pub fn bytes_per_block(&self) -> usize {
        self.block_len() * 4
    }
    /// The pool tensor's shape, `[num_blocks, num_layers, 2, block_size * kv_dim]`.
    pub fn shape(&self) -> [usize; 4] {
        [self.num_blocks, self.num_layers, 2, self.plane_len()]
    }

    fn offset(&self, block: usize, layer: usize, plane: usize, slot: usize) -> usize {
        ((block * self.num_layers + layer) * 2 + plane) * self.plane_len() + slot * self.kv_dim
    }

    /// K (`plane` 0) or V (`plane` 1) of one token slot.
    pub fn token(&self, block: usize, layer: usize, plane: usize, slot: usize) -> &[f32] {
        let o = self.offset(block, layer, plane, slot);
        &self.data[o..o + self.kv_dim]
    }

    /// As [`KvCache::token`], writable.
    pub fn token_mut(
        &mut self,
        block: usize,
        layer: usize,
        plane: usize,
        slot: usize,
    ) -> &mut [f32] {
        let o = self.offset(block, layer, plane, slot);
        &mut self.data[o..o + self.kv_dim]
    }

    /// One whole block (all layers and planes), contiguous.
    pub fn block(&self, block: usize) -> &[f32] {
        let n = self.block_len();
        &self.data[block * n..(block + 1) * n]
    }

    /// As [`KvCache::block`], writable.
    pub fn block_mut(&mut self, block: usize) -> &mut [f32] {
        let n = self.block_len();
        &mut self.data[block * n..(block + 1) * n]
    }

    /// The pool itself (what gets registered with kvtier).
    pub fn pool(&self) -> &CpuKvPool<f32> {
        &self.data
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_contiguous_across_layers() {
        let cfg = ModelConfig::builtin();
        let mut kv = KvCache::new(&cfg, 3, 4).unwrap();
        assert_eq!(kv.shape(), [3, 2, 2, 4 * 64]);
        kv.token_mut(1, 1, 1, 3).fill(7.0);
        let b = kv.block(1);
        assert_eq!(b.iter().filter(|v| **v == 7.0).count(), 64);
        assert_eq!(b[b.len() - 1], 7.0);
        assert!(kv.block(0).iter().all(|v| *v == 0.0));
        assert!(kv.block(2).iter().all(|v| *v == 0.0));
    }
}
