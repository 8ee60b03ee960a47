//! Background copies of confirmed G2 blocks: host -> disk (per the disk policy) and host ->
//! remote (on a block's first store, when `remote_put`).
//!
//! Invariants: the host block a spill or put reads is pinned until every rank reported it; a
//! disk block is registered only once its spill was written by every rank (a failed one is
//! freed); at most one spill of a hash is in flight (`spilling`); a hash already in G3 or with
//! no free G3 block is not spilled; a fresh put of a hash makes it matchable again after a
//! failed remote load.
use std::collections::BTreeSet;

use crate::connector::leader::books::JobBooks;
use crate::connector::leader::{DiskPolicy, Leader};
use crate::hash::SequenceHash;
use crate::ids::{BlockId, Tier};
use crate::transfer::{BlockPair, TransferJob};

/// What a completed spill does to the books: `(host block read, disk block written, hash)` per
/// pair.
#[derive(Debug)]
pub(super) struct SpillBooks {
    blocks: Vec<(BlockId, BlockId, SequenceHash)>,
}

/// What a completed remote put does to the books: the host blocks read.
#[derive(Debug)]
pub(super) struct PutBooks {
    host_blocks: Vec<BlockId>,
}

impl Leader {
    /// Blocks found again in G2 count as sightings for the disk filter.
    pub(super) fn spill_seen_again(&mut self, seen: &[(BlockId, SequenceHash)]) {
        if self.tiers.disk.is_none() || self.disk_policy == DiskPolicy::Never {
            return;
        }
        for &(blk, hash) in seen {
            // A later block of the same batch may have evicted it since it was found.
            if self.tiers.host.as_ref().and_then(|h| h.hash_of(blk)) == Some(hash) {
                self.plan_spills(blk, hash, false);
            }
        }
    }

    /// `hash` was stored in, or found again in, G2 as `host_block`: plan its copy to G3 (per the
    /// disk policy) and, on its first store, to G4.
    pub(super) fn plan_spills(
        &mut self,
        host_block: BlockId,
        hash: SequenceHash,
        first_store: bool,
    ) {
        let wanted = self.tiers.disk.is_some()
            && match self.disk_policy {
                DiskPolicy::Never => false,
                DiskPolicy::WriteThrough => true,
                DiskPolicy::Filter(_) => {
                    let now = self.started.elapsed();
                    self.disk_filter
                        .as_mut()
                        .is_some_and(|f| f.observe(hash, now))
                }
            };
        let to_disk = wanted
            && !self.spilling.contains(&hash)
            && self
                .tiers
                .disk
                .as_ref()
                .is_some_and(|d| d.lookup(hash).is_none() && d.num_free() > 0);
        if to_disk {
            let got = self.tiers.disk.as_mut().map(|d| d.allocate(1));
            if let Some(Ok(v)) = got {
                if let Some(&dblk) = v.first() {
                    self.pin_host(host_block);
                    self.spilling.insert(hash);
                    self.stats.spill_disk_blocks += 1;
                    let id = self.track(JobBooks::SpillDisk(SpillBooks {
                        blocks: vec![(host_block, dblk, hash)],
                    }));
                    self.outbox.background.push(TransferJob {
                        id,
                        src: Tier::Host,
                        dst: Tier::Disk,
                        pairs: vec![BlockPair {
                            src: host_block.0,
                            dst: dblk.0,
                        }],
                        remote_keys: vec![hash.0],
                    });
                }
            }
        }
        if first_store && self.remote_put() {
            // A fresh value replaces whatever failed to load under this hash.
            self.remote_failed.remove(&hash);
            self.pin_host(host_block);
            self.stats.remote_put_blocks += 1;
            let id = self.track(JobBooks::PutRemote(PutBooks {
                host_blocks: vec![host_block],
            }));
            self.outbox.background.push(TransferJob {
                id,
                src: Tier::Host,
                dst: Tier::Remote,
                pairs: vec![BlockPair {
                    src: host_block.0,
                    dst: 0,
                }],
                remote_keys: vec![hash.0],
            });
        }
    }

    /// One more pin of a confirmed host block, held by the background copy that reads it.
    fn pin_host(&mut self, host_block: BlockId) {
        if let Some(h) = self.tiers.host.as_mut() {
            let _ = h.pin(host_block);
        }
    }

    /// Every rank reported the spill `b`: release the host blocks, register the written disk
    /// blocks, free the failed ones.
    pub(super) fn complete_spill(&mut self, b: SpillBooks, failed: &BTreeSet<usize>) {
        for (i, (hblk, dblk, hash)) in b.blocks.into_iter().enumerate() {
            self.spilling.remove(&hash);
            self.tiers.release(Tier::Host, hblk);
            if failed.contains(&i) {
                self.stats.spill_disk_failed += 1;
                self.tiers.release(Tier::Disk, dblk);
                continue;
            }
            if let Some(d) = self.tiers.disk.as_mut() {
                match d.register(dblk, hash, self.priority) {
                    Ok(c) => {
                        self.stats.spill_disk_confirmed += 1;
                        let _ = d.release(c);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "registering a spilled block failed")
                    }
                }
            }
        }
    }

    /// Every rank reported the put `b`: count it and release the host blocks it read.
    pub(super) fn complete_put(&mut self, b: PutBooks, failed: &BTreeSet<usize>) {
        let bad = failed.iter().filter(|&&i| i < b.host_blocks.len()).count();
        self.stats.remote_put_failed += bad as u64;
        self.stats.remote_put_confirmed += (b.host_blocks.len() - bad) as u64;
        for blk in b.host_blocks {
            self.tiers.release(Tier::Host, blk);
        }
    }
}
