//! Transfer room: the engine's registered KV memory ([`memory`], over a [`layout`]) and the
//! [`TransferEngine`](crate::TransferEngine) that moves blocks between it and the storage tiers:
//! the CPU copy path (`device`), CUDA copies ([`cuda`]) and the staged (bounce-buffer) paths.
//!
//! Invariant: nothing here contains an `unsafe` block; copies through raw addresses go through
//! `sys`'s wrappers, whose contracts the registration of an
//! [`EngineMemory`](crate::EngineMemory) establishes.
pub(crate) mod cpu_layered;
pub mod cuda;
pub(crate) mod device;
pub(crate) mod engine;
pub mod layout;
pub mod memory;

/// A job of `pairs` of block numbers between `src` and `dst`, for tests and benchmarks that
/// plan by tier: a number is a device or host block id or a disk slot; `key(n)` is the key of
/// block `n` where its medium needs one (bound to its disk slot; its address in the remote
/// store, which ignores the number otherwise). `key(n) = 0` leaves a disk slot unkeyed.
#[cfg(any(test, feature = "testing", feature = "transfer-bench"))]
pub fn numbered_job(
    id: kvtier::JobId,
    src: kvtier::Tier,
    dst: kvtier::Tier,
    pairs: &[(u32, u32)],
    key: impl Fn(u32) -> u128 + Copy,
) -> kvtier::transfer::TransferJob {
    use kvtier::hash::SequenceHash;
    use kvtier::transfer::{DiskBlock, Medium, TransferJob};
    use kvtier::{BlockId, DeviceBlockId, Tier};
    fn with_src<S: Medium>(
        id: kvtier::JobId,
        src: impl Fn(u32) -> S,
        dst: Tier,
        pairs: &[(u32, u32)],
        key: impl Fn(u32) -> u128,
    ) -> TransferJob {
        let p = pairs.iter().map(|&(s, d)| (src(s), d));
        match dst {
            Tier::Device => TransferJob::from_pairs(id, p.map(|(s, d)| (s, DeviceBlockId(d)))),
            Tier::Host => TransferJob::from_pairs(id, p.map(|(s, d)| (s, BlockId(d)))),
            Tier::Disk => TransferJob::from_pairs(
                id,
                p.map(|(s, d)| {
                    let slot = BlockId(d);
                    (
                        s,
                        DiskBlock {
                            slot,
                            key: SequenceHash(key(d)),
                        },
                    )
                }),
            ),
            Tier::Remote => TransferJob::from_pairs(id, p.map(|(s, d)| (s, SequenceHash(key(d))))),
        }
    }
    match src {
        Tier::Device => with_src(id, DeviceBlockId, dst, pairs, key),
        Tier::Host => with_src(id, BlockId, dst, pairs, key),
        Tier::Disk => with_src(
            id,
            |s| DiskBlock {
                slot: BlockId(s),
                key: SequenceHash(key(s)),
            },
            dst,
            pairs,
            key,
        ),
        Tier::Remote => with_src(id, |s| SequenceHash(key(s)), dst, pairs, key),
    }
}
