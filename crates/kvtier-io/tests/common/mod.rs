//! Helpers shared by the integration tests: deterministic block contents and job builders.
#![allow(clippy::unwrap_used)]
#![allow(dead_code)]
use kvtier::transfer::TransferJob;
use kvtier::{JobId, Tier};
use kvtier_io::{DevicePtr, StridedLayout};

/// Bytes of a block that depend on a seed, so any misplaced chunk changes the result.
pub(crate) fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345) as u64 | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A job of block numbers (disk slots unkeyed, remote blocks under key 0).
pub(crate) fn job(src: Tier, dst: Tier, pairs: &[(u32, u32)]) -> TransferJob {
    kvtier_io::transfer::numbered_job(JobId(1), src, dst, pairs, |_| 0)
}

/// A job of block numbers whose disk or remote block `n` has the key `key(n)`.
pub(crate) fn keyed_by(
    src: Tier,
    dst: Tier,
    pairs: &[(u32, u32)],
    key: impl Fn(u32) -> u128 + Copy,
) -> TransferJob {
    kvtier_io::transfer::numbered_job(JobId(1), src, dst, pairs, key)
}

/// A CPU "engine" KV cache in the per-layer layout: `layers` tensors of `[2, blocks, chunk]`.
pub(crate) struct PerLayerCache {
    layers: Vec<Vec<u8>>,
    blocks: u32,
    chunk: usize,
}

impl PerLayerCache {
    pub(crate) fn new(layers: usize, blocks: u32, chunk: usize) -> Self {
        PerLayerCache {
            layers: (0..layers)
                .map(|_| vec![0u8; 2 * blocks as usize * chunk])
                .collect(),
            blocks,
            chunk,
        }
    }
    pub(crate) fn layout(&self) -> StridedLayout {
        let bases: Vec<DevicePtr> = self
            .layers
            .iter()
            .map(|l| DevicePtr::from_host(l.as_ptr()).unwrap())
            .collect();
        StridedLayout::kv_per_layer(&bases, self.blocks, self.chunk).unwrap()
    }
    /// The block in kvtier's canonical order (layer 0 K, layer 0 V, layer 1 K, ...).
    pub(crate) fn read(&self, b: u32) -> Vec<u8> {
        let mut out = Vec::new();
        for l in &self.layers {
            for plane in 0..2 {
                let o = (plane * self.blocks as usize + b as usize) * self.chunk;
                out.extend_from_slice(&l[o..o + self.chunk]);
            }
        }
        out
    }
    pub(crate) fn write(&mut self, b: u32, data: &[u8]) {
        let mut it = data.chunks(self.chunk);
        let (blocks, chunk) = (self.blocks as usize, self.chunk);
        for l in &mut self.layers {
            for plane in 0..2 {
                let o = (plane * blocks + b as usize) * chunk;
                l[o..o + chunk].copy_from_slice(it.next().unwrap());
            }
        }
    }
}
