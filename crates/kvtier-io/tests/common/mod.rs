//! Helpers shared by the integration tests: deterministic block contents and job builders.
#![allow(clippy::unwrap_used)]
#![allow(dead_code)]
use kvtier::transfer::{BlockPair, TransferJob};
use kvtier::{JobId, Tier};

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

pub(crate) fn job(src: Tier, dst: Tier, pairs: &[(u32, u32)]) -> TransferJob {
    TransferJob {
        id: JobId(1),
        src,
        dst,
        pairs: pairs
            .iter()
            .map(|&(s, d)| BlockPair { src: s, dst: d })
            .collect(),
        remote_keys: Vec::new(),
    }
}
