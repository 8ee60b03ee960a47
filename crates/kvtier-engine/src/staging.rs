//! Loads from disk (G3) or the remote store (G4) straight into the engine's cache, staged
//! through a few host blocks of the engine's own: the leader plans `Disk -> Device` and
//! `Remote -> Device` jobs, while kvtier-io's `TransferEngine` moves device blocks only to and
//! from host memory. Every other direction goes to the transfer engine unchanged.
//!
//! Invariants: a staged pair is reported Ok only if both of its hops copied the whole block; a
//! staging block is used by one pair at a time (taken from `free` under its mutex, returned after
//! the second hop); failure indices refer to the caller's job.
use std::sync::{Arc, Condvar, Mutex};

use kvtier::transfer::{
    BlockFailure, BlockPair, BlockTransfer, Fence, TransferError, TransferJob, TransferOutcome,
};
use kvtier::Tier;

/// Staging blocks taken by one job at a time (at most).
const BATCH: usize = 8;

pub(crate) struct StagedTransfer {
    direct: Arc<dyn BlockTransfer>,
    /// The same device, disk and remote as `direct`, with a private host tier as staging area.
    stager: Arc<dyn BlockTransfer>,
    free: Mutex<Vec<u32>>,
    cv: Condvar,
}

impl StagedTransfer {
    /// `stager` must share `direct`'s device, disk and remote, and own `staging_blocks` host
    /// blocks that nothing else uses.
    pub(crate) fn new(
        direct: Arc<dyn BlockTransfer>,
        stager: Arc<dyn BlockTransfer>,
        staging_blocks: u32,
    ) -> Self {
        StagedTransfer {
            direct,
            stager,
            free: Mutex::new((0..staging_blocks).collect()),
            cv: Condvar::new(),
        }
    }

    fn take(&self, n: usize) -> Vec<u32> {
        let Ok(mut g) = self.free.lock() else {
            return Vec::new();
        };
        while g.len() < n {
            g = match self.cv.wait(g) {
                Ok(g) => g,
                Err(_) => return Vec::new(),
            };
        }
        let at = g.len() - n;
        g.split_off(at)
    }

    fn give(&self, slots: Vec<u32>) {
        if let Ok(mut g) = self.free.lock() {
            g.extend(slots);
        }
        self.cv.notify_all();
    }

    fn staged(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        let capacity = self
            .free
            .lock()
            .map(|g| g.len())
            .unwrap_or(0)
            .clamp(1, BATCH);
        let mut failures = Vec::new();
        let idx: Vec<usize> = (0..job.pairs.len()).collect();
        for chunk in idx.chunks(capacity) {
            let slots = self.take(chunk.len());
            if slots.len() != chunk.len() {
                for &i in chunk {
                    failures.push(BlockFailure {
                        pair_index: i,
                        reason: "no staging block".into(),
                    });
                }
                continue;
            }
            let hop1 = TransferJob {
                id: job.id,
                src: job.src,
                dst: Tier::Host,
                pairs: chunk
                    .iter()
                    .zip(&slots)
                    .map(|(&i, &s)| BlockPair {
                        src: job.pairs[i].src,
                        dst: s,
                    })
                    .collect(),
                remote_keys: job.remote_keys.clone(),
            };
            let failed1 = self.stager.execute(&hop1, &Fence::none());
            let mut bad = vec![false; chunk.len()];
            if let TransferOutcome::Failed(f) = failed1 {
                for b in f {
                    if let Some(&i) = chunk.get(b.pair_index) {
                        bad[b.pair_index] = true;
                        failures.push(BlockFailure {
                            pair_index: i,
                            reason: b.reason,
                        });
                    }
                }
            }
            let second: Vec<(usize, u32)> = chunk
                .iter()
                .zip(&slots)
                .enumerate()
                .filter(|(k, _)| !bad[*k])
                .map(|(_, (&i, &s))| (i, s))
                .collect();
            if !second.is_empty() {
                let hop2 = TransferJob {
                    id: job.id,
                    src: Tier::Host,
                    dst: Tier::Device,
                    pairs: second
                        .iter()
                        .map(|&(i, s)| BlockPair {
                            src: s,
                            dst: job.pairs[i].dst,
                        })
                        .collect(),
                    remote_keys: Vec::new(),
                };
                if let TransferOutcome::Failed(f) = self.stager.execute(&hop2, fence) {
                    for b in f {
                        if let Some(&(i, _)) = second.get(b.pair_index) {
                            failures.push(BlockFailure {
                                pair_index: i,
                                reason: b.reason,
                            });
                        }
                    }
                }
            }
            self.give(slots);
        }
        if failures.is_empty() {
            TransferOutcome::Ok
        } else {
            failures.sort_by_key(|f| f.pair_index);
            TransferOutcome::Failed(failures)
        }
    }
}

impl BlockTransfer for StagedTransfer {
    fn bytes_per_block(&self) -> usize {
        self.direct.bytes_per_block()
    }
    fn has_tier(&self, tier: Tier) -> bool {
        self.direct.has_tier(tier)
    }
    fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        self.direct.fence(engine_stream)
    }
    fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        match (job.src, job.dst) {
            (Tier::Disk | Tier::Remote, Tier::Device) => self.staged(job, fence),
            _ => self.direct.execute(job, fence),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier::connector::testing::MemoryTransfer;

    /// Stands in for kvtier-io's engine: device <-> host and host <-> disk only.
    struct HostOnly(MemoryTransfer);
    impl BlockTransfer for HostOnly {
        fn bytes_per_block(&self) -> usize {
            self.0.bytes_per_block()
        }
        fn has_tier(&self, t: Tier) -> bool {
            self.0.has_tier(t)
        }
        fn fence(&self, s: Option<u64>) -> Result<Fence, TransferError> {
            self.0.fence(s)
        }
        fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
            if job.src != Tier::Host && job.dst != Tier::Host {
                return TransferOutcome::Failed(
                    (0..job.pairs.len())
                        .map(|i| BlockFailure {
                            pair_index: i,
                            reason: "unsupported".into(),
                        })
                        .collect(),
                );
            }
            self.0.execute(job, fence)
        }
    }

    #[test]
    fn disk_to_device_goes_through_staging_and_maps_failures() {
        let mem = Arc::new(HostOnly(MemoryTransfer::new(8, 4, 2, 4)));
        for b in 0..4u32 {
            mem.0.write_block(Tier::Disk, b, &[b as u8 + 1; 8]).unwrap();
        }
        let staged = StagedTransfer::new(mem.clone(), mem.clone(), 2);
        let job = TransferJob {
            id: kvtier::JobId(1),
            src: Tier::Disk,
            dst: Tier::Device,
            pairs: vec![
                BlockPair { src: 3, dst: 0 },
                BlockPair { src: 9, dst: 1 },
                BlockPair { src: 1, dst: 2 },
            ],
            remote_keys: Vec::new(),
        };
        let out = staged.execute(&job, &Fence::none());
        assert_eq!(out.failed_pairs(), vec![1]);
        assert_eq!(mem.0.read_block(Tier::Device, 0).unwrap(), vec![4u8; 8]);
        assert_eq!(mem.0.read_block(Tier::Device, 2).unwrap(), vec![2u8; 8]);
        assert_eq!(mem.0.read_block(Tier::Device, 1).unwrap(), vec![0u8; 8]);
        assert_eq!(staged.free.lock().unwrap().len(), 2);
    }
}
