//! The host (G2) and disk (G3) pools, and the one place that chooses between them.
//!
//! Invariants: a tier that is not configured has no pool (`None`), and every host-or-disk
//! decision of the leader goes through [`Tiers::get_mut`] (by tier) or [`Tiers::store_target`]
//! (device stores go to G2 when there is one, else to G3).
use crate::connector::leader::Leader;
use crate::hash::SequenceHash;
use crate::ids::{BlockId, Tier};
use crate::pool::{BlockPool, Pinned, PoolError, Priority, Reserved};

/// The leader's local pools.
#[derive(Debug)]
pub(super) struct Tiers {
    pub(super) host: Option<BlockPool>,
    pub(super) disk: Option<BlockPool>,
}

impl Tiers {
    /// Pools of `host_blocks` and `disk_blocks` blocks; a size of 0 leaves that tier out.
    pub(super) fn new(host_blocks: usize, disk_blocks: usize) -> Result<Tiers, PoolError> {
        Ok(Tiers {
            host: (host_blocks > 0)
                .then(|| BlockPool::new(Tier::Host, host_blocks))
                .transpose()?,
            disk: (disk_blocks > 0)
                .then(|| BlockPool::new(Tier::Disk, disk_blocks))
                .transpose()?,
        })
    }

    /// The pool of `tier`; `None` for the device and remote tiers and for a tier not configured.
    pub(super) fn get_mut(&mut self, tier: Tier) -> Option<&mut BlockPool> {
        match tier {
            Tier::Host => self.host.as_mut(),
            Tier::Disk => self.disk.as_mut(),
            _ => None,
        }
    }

    /// Where device blocks are stored: G2 if configured, else G3; `None` without either.
    pub(super) fn store_target(&mut self) -> Option<(Tier, &mut BlockPool)> {
        match (self.host.as_mut(), self.disk.as_mut()) {
            (Some(p), _) => Some((Tier::Host, p)),
            (None, Some(p)) => Some((Tier::Disk, p)),
            (None, None) => None,
        }
    }

    /// Both pools that exist, host first.
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut BlockPool> {
        [self.host.as_mut(), self.disk.as_mut()]
            .into_iter()
            .flatten()
    }

    /// Give back `pin` to the pool of its tier (a failure is a bookkeeping bug: logged, not
    /// raised).
    pub(super) fn release(&mut self, pin: Pinned) {
        let tier = pin.tier();
        match self.get_mut(tier) {
            Some(p) => {
                if let Err(e) = p.release(pin) {
                    tracing::error!(error = %e, "releasing a pool block failed");
                }
            }
            None => tracing::error!(?tier, "a pin of a tier with no pool"),
        }
    }

    /// Give back the writer's pin of a store that failed (the block is freed and its
    /// reservation dropped); a failure is logged as in [`Tiers::release`].
    pub(super) fn abort(&mut self, reserved: Reserved) {
        let tier = reserved.tier();
        match self.get_mut(tier) {
            Some(p) => {
                if let Err(e) = p.abort(reserved) {
                    tracing::error!(error = %e, "aborting a pool reservation failed");
                }
            }
            None => tracing::error!(?tier, "a reservation of a tier with no pool"),
        }
    }
}

impl Leader {
    /// Forget every block of the host and disk tiers (the engine's prefix-cache reset, e.g.
    /// vLLM's `reset_cache`): registered blocks leave matching at once (pinned ones are freed
    /// when their loads release them). Stores still in flight register when they complete, so
    /// an engine clears everything by calling this with no request running (vLLM resets its
    /// prefix cache only then). The shared remote tier is left alone: other engines own its
    /// values. Returns the number of blocks forgotten.
    pub fn clear_tiers(&mut self) -> usize {
        let mut n = 0;
        for pool in self.tiers.iter_mut() {
            let before = pool.num_registered();
            for b in 0..pool.capacity() {
                // Ids below capacity are always valid.
                let _ = pool.invalidate(BlockId(b as u32));
            }
            n += before - pool.num_registered();
        }
        tracing::info!(blocks = n, "kvtier tiers cleared (prefix cache reset)");
        n
    }

    /// Register blocks the disk tier already holds at start (a warm restart: the disk store's
    /// `recovered()` list), so later requests match them. Call before the first step; a block
    /// whose slot is out of range or in use, or whose hash is already known, is skipped.
    /// Returns how many were registered. The disk tier still verifies each block (key and
    /// checksum) when it is loaded: one that fails is a failed load, recomputed and invalidated.
    pub fn adopt_disk_blocks(&mut self, blocks: &[(SequenceHash, BlockId)]) -> usize {
        let Some(d) = self.tiers.disk.as_mut() else {
            return 0;
        };
        let n = d.adopt(blocks, Priority::default());
        if n > 0 {
            tracing::info!(
                blocks = n,
                "disk tier: registered blocks kept from an earlier run"
            );
        }
        n
    }
}
