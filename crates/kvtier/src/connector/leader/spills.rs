//! Background copies of confirmed G2 blocks: host -> disk (per the disk policy) and host ->
//! remote (on a block's first store, when `remote_put`).
//!
//! Invariants: the host block a spill or put reads is pinned until every rank reported it; a
//! spill's disk block is reserved at dispatch as a store's is (`pool::Reservation`: pinned, its
//! hash in the registry but hidden from matching) and registered (`confirm`) only once every rank
//! wrote it, a failed one is freed (`abort`); so at most one spill of a hash is in flight, and a
//! hash already in G3, being written to it, or with no free or evictable G3 block is not
//! spilled; a fresh put of a hash makes it matchable again after a failed remote load.
use std::collections::BTreeSet;

use crate::connector::leader::books::JobBooks;
use crate::connector::leader::{DiskPolicy, Leader};
use crate::hash::SequenceHash;
use crate::ids::{BlockId, RequestId};
use crate::pool::{Pinned, Reservation, Reserved};
use crate::transfer::{DiskBlock, TransferJob};

/// What a completed spill does to the books: `(pin of the host block read, writer's reservation
/// of the disk block written)` per pair; the books own both until every rank reported the spill,
/// which confirms or aborts the reservation.
#[derive(Debug)]
pub(super) struct SpillBooks {
    blocks: Vec<(Pinned, Reserved)>,
}

/// What a completed remote put does to the books: the pins of the host blocks read. (Nothing is
/// reserved: the leader keeps no pool of the remote store, which makes a value visible only once
/// written.)
#[derive(Debug)]
pub(super) struct PutBooks {
    host_blocks: Vec<Pinned>,
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

    /// The first `blocks` blocks of `req`'s prefix were reused (the engine's hit and kvtier's
    /// loads): each one G2 holds counts as a sighting for the disk filter. Nothing is looked up
    /// unless a filtered disk tier is configured.
    pub(super) fn reuse_seen(&mut self, req: &RequestId, blocks: usize) {
        if self.tiers.disk.is_none() || !matches!(self.disk_policy, DiskPolicy::Filter(_)) {
            return;
        }
        let (Some(e), Some(host)) = (self.slots.get(req), self.tiers.host.as_ref()) else {
            return;
        };
        let seen: Vec<(BlockId, SequenceHash)> = e
            .slot
            .hashes()
            .iter()
            .take(blocks)
            .filter_map(|&h| Some((host.lookup(h)?, h)))
            .collect();
        self.spill_seen_again(&seen);
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
        // The store path's reservation: nothing for a hash G3 holds or is writing, nor without
        // a free or evictable block.
        let reserved = match self.tiers.disk.as_mut().filter(|_| wanted) {
            Some(d) => d.reserve_one(hash),
            None => Reservation::NoSpace,
        };
        if let Reservation::Allocated(res) = reserved {
            match self.pin_host(host_block) {
                Some(hpin) => self.spill_to_disk(hpin, res, hash),
                // Unreachable (the caller holds or just checked the host block): the disk
                // block goes back, its reservation dropped.
                None => self.tiers.abort(res),
            }
        }
        if first_store && self.remote_put() {
            let Some(hpin) = self.pin_host(host_block) else {
                return;
            };
            // A fresh value replaces whatever failed to load under this hash.
            self.remote_failed.remove(&hash);
            self.stats.remote_put_blocks += 1;
            let id = self.track(JobBooks::PutRemote(PutBooks {
                host_blocks: vec![hpin],
            }));
            self.outbox
                .background
                .push(TransferJob::from_pairs(id, [(host_block, hash)]));
        }
    }

    /// Queue the copy of the host block `hpin` holds to the disk block reserved for `hash`; the
    /// job's books keep the pin and the reservation until every rank reported it.
    fn spill_to_disk(&mut self, hpin: Pinned, res: Reserved, hash: SequenceHash) {
        let pair = (
            hpin.block(),
            DiskBlock {
                slot: res.block(),
                key: hash,
            },
        );
        self.stats.spill_disk_blocks += 1;
        let id = self.track(JobBooks::SpillDisk(SpillBooks {
            blocks: vec![(hpin, res)],
        }));
        self.outbox
            .background
            .push(TransferJob::from_pairs(id, [pair]));
    }

    /// One more pin of a confirmed host block, held by the background copy that reads it
    /// (`None`, logged, if it cannot be pinned: then nothing may read it).
    fn pin_host(&mut self, host_block: BlockId) -> Option<Pinned> {
        match self.tiers.host.as_mut()?.pin(host_block) {
            Ok(pin) => Some(pin),
            Err(e) => {
                tracing::error!(error = %e, "pinning a host block to copy it failed");
                None
            }
        }
    }

    /// Every rank reported the spill `b`: release the host blocks, confirm the written disk
    /// blocks (published under the hash they reserved), abort the failed ones (freed).
    pub(super) fn complete_spill(&mut self, b: SpillBooks, failed: &BTreeSet<usize>) {
        for (i, (hpin, res)) in b.blocks.into_iter().enumerate() {
            self.tiers.release(hpin);
            if failed.contains(&i) {
                self.stats.spill_disk_failed += 1;
                self.tiers.abort(res);
                continue;
            }
            let Some(pool) = self.tiers.get_mut(res.tier()) else {
                // Unreachable: a reservation comes from a pool the leader keeps.
                tracing::error!("a spill's reservation of a tier with no pool");
                continue;
            };
            // The writer's pin goes in the same call.
            match pool.confirm_and_release(res, self.priority) {
                Ok(_) => self.stats.spill_disk_confirmed += 1,
                Err(e) => tracing::error!(error = %e, "confirming a spilled block failed"),
            }
        }
    }

    /// Every rank reported the put `b`: count it and release the host blocks it read.
    pub(super) fn complete_put(&mut self, b: PutBooks, failed: &BTreeSet<usize>) {
        let bad = failed.iter().filter(|&&i| i < b.host_blocks.len()).count();
        self.stats.remote_put_failed += bad as u64;
        self.stats.remote_put_confirmed += (b.host_blocks.len() - bad) as u64;
        for pin in b.host_blocks {
            self.tiers.release(pin);
        }
    }
}
