//! Reuse fences: the device blocks of requests that finished with stores still reading them,
//! handed back to the engine at once (`Leader::request_finished_fenced`) instead of being held
//! until the stores are confirmed.
//!
//! vLLM's scheduler admits a request only when its whole prompt fits in the free device blocks
//! (`scheduler_reserve_full_isl`, on by default since 0.32): holding a finished request's blocks
//! until its last stores land delays the next long prompt by that copy (10-20 ms at 32K on the
//! H200). vLLM hands the connector every block it allocates (the step's records and the loads'
//! destinations) and calls `handle_preemptions` before anything of the step writes one, so the
//! wait can move to the one step that reuses such a block, and is most often never needed.
//!
//! Invariant: while a fenced request has a store in flight (not yet confirmed by every rank),
//! every step whose records or loads give one of its device blocks to a request names it in
//! `StepMetadata::fence`; a block is forgotten only when its request's last store is confirmed
//! or when a later fenced request gave it back again (that one then owns the block).
use std::collections::HashMap;

use crate::connector::messages::StepMetadata;
use crate::connector::step::StepRecord;
use crate::ids::{DeviceBlockId, RequestId};
use crate::transfer::Blocks;

/// Fenced blocks and the request whose stores may still read each of them.
#[derive(Debug, Default)]
pub(super) struct ReuseFences {
    owner: HashMap<DeviceBlockId, RequestId>,
    blocks: HashMap<RequestId, Vec<DeviceBlockId>>,
}

impl ReuseFences {
    /// `req` finished with stores in flight and gave `table` back to the engine.
    pub(super) fn add(&mut self, req: &RequestId, table: &[DeviceBlockId]) {
        for b in table {
            self.owner.insert(*b, req.clone());
        }
        self.blocks
            .entry(req.clone())
            .or_default()
            .extend_from_slice(table);
    }

    /// Every store of `req` is confirmed: its blocks need no fence any more (unless a later
    /// fenced request owns them now).
    pub(super) fn release(&mut self, req: &RequestId) {
        let Some(table) = self.blocks.remove(req) else {
            return;
        };
        for b in table {
            if self.owner.get(&b) == Some(req) {
                self.owner.remove(&b);
            }
        }
    }

    /// Name in `meta.fence` every fenced request one of whose blocks this step hands out: the
    /// blocks a record adds beyond what its request had computed (a new or resumed request's
    /// table starts with its prefix-cache hits and its loaded blocks, which are read, not
    /// written; loaded blocks are checked through the loads) and every load's destinations.
    pub(super) fn collect(
        &self,
        records: &[StepRecord],
        block_size: usize,
        meta: &mut StepMetadata,
    ) {
        if self.owner.is_empty() {
            return;
        }
        let hit = |b: &DeviceBlockId, fence: &mut Vec<RequestId>| {
            if let Some(r) = self.owner.get(b) {
                if !fence.contains(r) {
                    fence.push(r.clone());
                }
            }
        };
        for rec in records {
            let skip = if rec.is_new || rec.resumed_from_preemption {
                rec.num_computed_tokens / block_size.max(1)
            } else {
                0
            };
            for b in rec.new_block_ids.iter().skip(skip) {
                hit(b, &mut meta.fence);
            }
        }
        for load in &meta.loads {
            for job in &load.jobs {
                if let Blocks::Device(dsts) = job.dst() {
                    for d in dsts {
                        hit(d, &mut meta.fence);
                    }
                }
            }
        }
    }

    /// How many blocks are fenced (stats and tests).
    pub(super) fn len(&self) -> usize {
        self.owner.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, blocks: std::ops::Range<u32>, computed: usize, new: bool) -> StepRecord {
        StepRecord {
            request_id: id.into(),
            new_block_ids: blocks.map(DeviceBlockId).collect(),
            num_computed_tokens: computed,
            is_new: new,
            ..Default::default()
        }
    }

    #[test]
    fn a_reused_block_names_its_request_once_and_prefix_hits_do_not() {
        let mut f = ReuseFences::default();
        let a: RequestId = "a".into();
        f.add(&a, &(0..4).map(DeviceBlockId).collect::<Vec<_>>());
        let mut meta = StepMetadata::default();
        // A new request whose first two blocks are prefix-cache hits on a's blocks: read only.
        f.collect(&[rec("b", 0..2, 32, true)], 16, &mut meta);
        assert!(meta.fence.is_empty());
        // Fresh blocks 2 and 3 (and one never fenced): a once.
        f.collect(
            &[rec("c", 2..5, 0, true), rec("d", 3..4, 0, false)],
            16,
            &mut meta,
        );
        assert_eq!(meta.fence, vec![a.clone()]);
        f.release(&a);
        let mut meta = StepMetadata::default();
        f.collect(&[rec("c", 0..4, 0, true)], 16, &mut meta);
        assert!(meta.fence.is_empty());
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn a_block_given_back_again_belongs_to_its_latest_request() {
        let mut f = ReuseFences::default();
        let (a, b): (RequestId, RequestId) = ("a".into(), "b".into());
        f.add(&a, &[DeviceBlockId(7), DeviceBlockId(8)]);
        f.add(&b, &[DeviceBlockId(8)]);
        f.release(&a);
        let mut meta = StepMetadata::default();
        f.collect(&[rec("c", 7..9, 0, false)], 16, &mut meta);
        assert_eq!(meta.fence, vec![b]);
        assert_eq!(f.len(), 1);
    }
}
