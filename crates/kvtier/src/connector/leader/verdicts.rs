//! Load verdicts: one answer per asynchronous load that every rank acts on alike. TensorRT-LLM
//! with TP > 1 resumes a parked request only once every rank reported it loaded (its connector
//! manager intersects the ranks' `get_finished` answers), and each rank then computes on its own
//! copy of the request; so each rank must know, before it reports, whether the load succeeded on
//! *every* rank and, if not, from which token every rank recomputes. The leader is the one place
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
    /// Issue a [`LoadVerdict`] for every asynchronous load (TensorRT-LLM with TP > 1, where the
    /// adapter gives every rank the same verdicts). Off by default: nothing is kept for engines
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
        self.verdicts.as_mut().map(std::mem::take).unwrap_or_default()
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
