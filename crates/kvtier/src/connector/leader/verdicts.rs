//! Load verdicts: one answer per asynchronous load that every rank acts on alike. TensorRT-LLM
//! resumes a parked request only once every rank reported it loaded (its connector manager
//! intersects the ranks' `get_finished` answers), and each rank then computes on its own copy of
//! the request; so each rank must know, before it reports, whether the load succeeded on *every*
//! rank and, if not, from which token every rank recomputes. With one rank the verdict is the
//! same rule (the adapter rewinds the request to its token: `connector::recovery`). The leader is the one place
//! that hears every rank's job reports, so it decides; the adapter carries the decision to every
//! rank (`LoadVerdicts` bytes) and the workers report a load only once its verdict arrived
//! (`connector::worker`, `Worker::set_load_verdicts`).
//!
//! Invariants (with verdicts on):
//! - exactly one verdict per planned asynchronous load, issued once every rank reported every
//!   job of that load (at planning when no job was sent: every source had vanished), whether or
//!   not the request finished meanwhile;
//! - `recompute_from` is the first token of the lowest block any rank failed or whose source
//!   vanished, so no rank computes on a block its own load failed to fill; `None` only when every
//!   rank loaded every block;
//! - synchronous loads get no verdict (the engine schedules them in the step).
use crate::connector::leader::Leader;
use crate::connector::messages::LoadVerdict;
use crate::ids::RequestId;

/// An asynchronous load awaiting its verdict.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pending {
    /// The lowest block index (in the request's table) some rank failed so far.
    first_failed: Option<usize>,
}

impl Leader {
    /// Issue a [`LoadVerdict`] for every asynchronous load (TensorRT-LLM at any TP size, where
    /// the adapter gives every rank the same verdicts). Off by default: nothing is kept for engines
    /// that do not take them.
    pub fn set_load_verdicts(&mut self, on: bool) {
        self.verdicts = if on { Some(Vec::new()) } else { None };
    }

    /// Whether load verdicts are on.
    pub fn load_verdicts_on(&self) -> bool {
        self.verdicts.is_some()
    }

    /// Apply the reports that arrived, then hand out the verdicts issued since the last call,
    /// oldest first (empty when verdicts are off).
    pub fn take_load_verdicts(&mut self) -> Vec<LoadVerdict> {
        self.poll_reports();
        self.verdicts
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// An asynchronous load of `req` was planned with `jobs` jobs; `vanished` is the first block
    /// index whose source vanished before planning.
    pub(super) fn open_verdict(&mut self, req: &RequestId, jobs: usize, vanished: Option<usize>) {
        if self.verdicts.is_none() {
            return;
        }
        let Some(e) = self.slots.get_mut(req) else {
            return;
        };
        let mut p = e.verdict.take().unwrap_or_default();
        p.first_failed = min_opt(p.first_failed, vanished);
        if jobs == 0 && e.loads_in_flight == 0 {
            self.issue(req, p);
        } else if let Some(e) = self.slots.get_mut(req) {
            e.verdict = Some(p);
        }
    }

    /// Every rank reported one load job of `req` (`first_failed`: the lowest block index any rank
    /// failed in it). Called before the job's in-flight count is decremented: the last job issues
    /// the verdict.
    pub(super) fn load_job_verdict(&mut self, req: &RequestId, first_failed: Option<usize>) {
        if self.verdicts.is_none() {
            return;
        }
        let Some(e) = self.slots.get_mut(req) else {
            return;
        };
        let Some(mut p) = e.verdict.take() else {
            return; // a synchronous load
        };
        p.first_failed = min_opt(p.first_failed, first_failed);
        if e.loads_in_flight <= 1 {
            self.issue(req, p);
        } else {
            e.verdict = Some(p);
        }
    }

    fn issue(&mut self, req: &RequestId, p: Pending) {
        let bs = self.block_size as u64;
        if let Some(v) = self.verdicts.as_mut() {
            v.push(LoadVerdict {
                request: req.clone(),
                recompute_from: p.first_failed.map(|i| i as u64 * bs),
            });
        }
    }
}

fn min_opt(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::connector::leader::{Leader, LeaderConfig};
    use crate::connector::messages::{ClusterLayout, LoadVerdict, StepMetadata, WorkerReport};
    use crate::connector::step::{SchedulerStep, StepRecord};
    use crate::hash::HashSalt;
    use crate::ids::{DeviceBlockId, RequestId};
    use crate::transfer::{BlockFailure, TransferOutcome};

    fn record(id: &str, tokens: Vec<u32>, first_block: u32, is_new: bool) -> StepRecord {
        let blocks = (tokens.len() / 4) as u32;
        StepRecord {
            request_id: id.into(),
            num_scheduled_tokens: tokens.len(),
            new_tokens: tokens,
            new_block_ids: (first_block..first_block + blocks)
                .map(DeviceBlockId)
                .collect(),
            is_new,
            ..Default::default()
        }
    }

    fn report(l: &mut Leader, rank: u32, m: &StepMetadata, failed_pairs: &[usize]) {
        for job in m.loads.iter().flat_map(|x| &x.jobs).map(|j| j.id) {
            let outcome = if failed_pairs.is_empty() {
                TransferOutcome::Ok
            } else {
                TransferOutcome::Failed(
                    failed_pairs
                        .iter()
                        .map(|&pair_index| BlockFailure {
                            pair_index,
                            reason: "checksum".into(),
                        })
                        .collect(),
                )
            };
            l.apply_report(WorkerReport { rank, job, outcome });
        }
    }

    /// A TP=2 leader holding blocks of tokens 0..20 in its host tier, and request "r" of those
    /// tokens matched (16 tokens, blocks 0..4), allocated at device blocks 20.. and stepped: the
    /// metadata carries its asynchronous load.
    fn parked(verdicts: bool, async_loads: bool) -> (Leader, StepMetadata) {
        parked_on(2, verdicts, async_loads)
    }

    fn parked_on(ranks: u32, verdicts: bool, async_loads: bool) -> (Leader, StepMetadata) {
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 16);
        cfg.async_loads = async_loads;
        cfg.layout = Some(ClusterLayout {
            block_size: 4,
            num_device_blocks: 64,
            bytes_per_block: vec![64; ranks as usize],
        });
        let mut l = Leader::new(cfg).unwrap();
        l.set_load_verdicts(verdicts);
        let prompt: Vec<u32> = (0..20).collect();
        let m = l
            .build_step(&SchedulerStep {
                records: vec![record("fill", prompt.clone(), 0, true)],
                finished: vec!["fill".into()],
            })
            .unwrap();
        for job in m.stores.iter().map(|s| s.job.id).collect::<Vec<_>>() {
            for rank in 0..ranks {
                let outcome = TransferOutcome::Ok;
                l.apply_report(WorkerReport { rank, job, outcome });
            }
        }
        let r: RequestId = "r".into();
        assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 16);
        let devs: Vec<DeviceBlockId> = (20..25).map(DeviceBlockId).collect();
        l.update_state_after_alloc(&r, &devs, Some(16)).unwrap();
        let mut rec = record("r", prompt, 20, true);
        rec.num_scheduled_tokens = 4;
        let m = l
            .build_step(&SchedulerStep {
                records: vec![rec],
                finished: vec![],
            })
            .unwrap();
        assert_eq!(m.loads.len(), 1);
        assert_eq!(m.loads[0].jobs[0].len(), 4);
        (l, m)
    }

    #[test]
    fn the_verdict_waits_for_every_rank_and_takes_the_lowest_failed_block() {
        let (mut l, m) = parked(true, true);
        report(&mut l, 0, &m, &[3]);
        assert!(l.take_load_verdicts().is_empty(), "rank 1 has not reported");
        report(&mut l, 1, &m, &[1, 2]);
        let v = l.take_load_verdicts();
        // Block 1 (tokens 4..8) failed on rank 1: every rank recomputes from token 4.
        let want = LoadVerdict {
            request: "r".into(),
            recompute_from: Some(4),
        };
        assert_eq!(v, vec![want]);
        assert!(l.take_load_verdicts().is_empty(), "one verdict per load");
    }

    /// One rank (TensorRT-LLM TP = 1 takes the same rule): the verdict's token is the first
    /// token of the first block that failed, so the rewind never passes a block left unfilled.
    #[test]
    fn a_single_rank_recomputes_from_its_first_failed_block() {
        let (mut l, m) = parked_on(1, true, true);
        report(&mut l, 0, &m, &[3, 2]);
        let v = l.take_load_verdicts();
        let want = LoadVerdict {
            request: "r".into(),
            recompute_from: Some(8),
        };
        assert_eq!(v, vec![want]);
    }

    #[test]
    fn a_load_every_rank_filled_is_loaded() {
        let (mut l, m) = parked(true, true);
        report(&mut l, 1, &m, &[]);
        report(&mut l, 0, &m, &[]);
        let v = l.take_load_verdicts();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].recompute_from, None);
    }

    #[test]
    fn no_verdicts_when_off_or_for_synchronous_loads() {
        for (on, async_loads) in [(false, true), (true, false)] {
            let (mut l, m) = parked(on, async_loads);
            report(&mut l, 0, &m, &[0]);
            report(&mut l, 1, &m, &[]);
            assert!(l.take_load_verdicts().is_empty(), "{on} {async_loads}");
        }
    }
}
