//! Disk -> device loads through a private host bounce buffer, for transfer engines that move
//! disk blocks only to and from host memory.
//!
//! The connector core plans a block found only on disk as one `Disk -> Device` job. kvtier-io's
//! `TransferEngine` copies disk <-> host and host <-> device; this wrapper runs such a job as
//! `Disk -> bounce` then `bounce -> Device` with a second `TransferEngine` over the same device
//! layout and disk files and a small host buffer of its own (never part of the host pool), in
//! slices of the buffer's size. Every other job goes to the main engine unchanged.
//!
//! Invariants: a pair is reported copied only if both legs copied it; a pair whose disk leg
//! failed is not copied to the device; the device leg waits on the caller's fence (the engine's
//! progress) like any load; one mutex serialises users of the bounce buffer.
use std::sync::{Arc, Mutex};

use kvtier::transfer::{
    BlockFailure, BlockPair, BlockTransfer, Fence, TransferError, TransferJob, TransferOutcome,
};
use kvtier::Tier;

pub struct StagedTransfer {
    main: Arc<dyn BlockTransfer>,
    bounce: Option<(Mutex<()>, Arc<dyn BlockTransfer>, u32)>,
}

impl StagedTransfer {
    /// `bounce`: an engine with the device layout, the disk tier and a host buffer of
    /// `bounce_blocks` blocks (None when there is no disk tier).
    pub fn new(
        main: Arc<dyn BlockTransfer>,
        bounce: Option<(Arc<dyn BlockTransfer>, u32)>,
    ) -> Self {
        StagedTransfer {
            main,
            bounce: bounce.map(|(e, n)| (Mutex::new(()), e, n.max(1))),
        }
    }

    fn disk_to_device(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        let Some((lock, engine, cap)) = &self.bounce else {
            return self.main.execute(job, fence);
        };
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut failures = Vec::new();
        for (chunk_no, chunk) in job.pairs.chunks(*cap as usize).enumerate() {
            let base = chunk_no * *cap as usize;
            let leg1 = TransferJob {
                id: job.id,
                src: Tier::Disk,
                dst: Tier::Host,
                pairs: chunk
                    .iter()
                    .enumerate()
                    .map(|(i, p)| BlockPair {
                        src: p.src,
                        dst: i as u32,
                    })
                    .collect(),
                remote_keys: Vec::new(),
            };
            let failed1 = match engine.execute(&leg1, &Fence::none()) {
                TransferOutcome::Ok => Vec::new(),
                TransferOutcome::Failed(f) => f,
            };
            let mut leg2 = Vec::new();
            let mut index = Vec::new();
            for (i, p) in chunk.iter().enumerate() {
                if let Some(f) = failed1.iter().find(|f| f.pair_index == i) {
                    failures.push(BlockFailure {
                        pair_index: base + i,
                        reason: format!("disk read: {}", f.reason),
                    });
                } else {
                    leg2.push(BlockPair {
                        src: i as u32,
                        dst: p.dst,
                    });
                    index.push(base + i);
                }
            }
            if leg2.is_empty() {
                continue;
            }
            let job2 = TransferJob {
                id: job.id,
                src: Tier::Host,
                dst: Tier::Device,
                pairs: leg2,
                remote_keys: Vec::new(),
            };
            if let TransferOutcome::Failed(f) = engine.execute(&job2, fence) {
                for b in f {
                    if let Some(&pair_index) = index.get(b.pair_index) {
                        failures.push(BlockFailure {
                            pair_index,
                            reason: format!("device write: {}", b.reason),
                        });
                    }
                }
            }
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
        self.main.bytes_per_block()
    }
    fn has_tier(&self, tier: Tier) -> bool {
        self.main.has_tier(tier)
    }
    fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        self.main.fence(engine_stream)
    }
    fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        if job.src == Tier::Disk && job.dst == Tier::Device {
            self.disk_to_device(job, fence)
        } else {
            self.main.execute(job, fence)
        }
    }
}
