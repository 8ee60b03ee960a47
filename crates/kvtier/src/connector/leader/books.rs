//! The books of every job in flight: which ranks reported it, which pairs failed, and what the
//! job does to the pools once every rank has reported (`JobBooks`, completed by the file of its
//! concept: `stores`, `loads`, `spills`).
//!
//! Invariants: a job completes exactly once, when the last of the `world` ranks reports it; a
//! second report of one rank, a report from a rank beyond the world size and a report of an
//! unknown job change nothing. A pair counts as failed if any rank failed it.
use std::collections::BTreeSet;

use crate::connector::leader::loads::LoadBooks;
use crate::connector::leader::spills::{PutBooks, SpillBooks};
use crate::connector::leader::stores::{RemoteStoreBooks, StoreBooks};
use crate::connector::leader::Leader;
use crate::connector::messages::WorkerReport;
use crate::connector::slot::SlotState;
use crate::ids::{JobId, RequestId};
use crate::transfer::TransferOutcome;

/// What one in-flight job will do to the books when every rank has reported it.
#[derive(Debug)]
pub(super) enum JobBooks {
    /// Device -> host or disk.
    Store(StoreBooks),
    /// Host, disk or remote -> device.
    Load(LoadBooks),
    /// Host -> disk, in the background.
    SpillDisk(SpillBooks),
    /// Host -> remote, in the background.
    PutRemote(PutBooks),
    /// Device -> remote (no host tier: the node tier is the engine's G2).
    StoreRemote(RemoteStoreBooks),
}

/// Which in-flight count of a request a completed job decrements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RequestJob {
    /// A device -> tier store.
    Store,
    /// A tier -> device load.
    Load,
}

/// The ranks that reported a job: one bit per rank, inline for the first 64 (no allocation in
/// the common case).
#[derive(Debug)]
struct RankSet {
    low: u64,
    high: Vec<bool>,
}

impl RankSet {
    fn new(world: u32) -> Self {
        RankSet {
            low: 0,
            high: vec![false; world.saturating_sub(64) as usize],
        }
    }

    /// Mark `rank` (below the world size); false if it was marked already.
    fn insert(&mut self, rank: u32) -> bool {
        if rank < 64 {
            let bit = 1u64 << rank;
            let fresh = self.low & bit == 0;
            self.low |= bit;
            fresh
        } else {
            match self.high.get_mut(rank as usize - 64) {
                Some(seen) => !std::mem::replace(seen, true),
                None => false,
            }
        }
    }
}

/// One job in flight and the reports it has had.
#[derive(Debug)]
pub(super) struct PendingJob {
    books: JobBooks,
    reported: RankSet,
    /// Ranks that have not reported yet.
    waiting: u32,
    /// Indices of the pairs some rank failed.
    pub(super) failed: BTreeSet<usize>,
}

impl Leader {
    /// Open the books of a new job; it completes when all `world` ranks reported it.
    pub(super) fn track(&mut self, books: JobBooks) -> JobId {
        let id = self.jobs.claim();
        self.jobs.insert(
            id,
            PendingJob {
                books,
                reported: RankSet::new(self.world),
                waiting: self.world,
                failed: BTreeSet::new(),
            },
        );
        id
    }

    /// A `kind` job of `req` completed: one lookup updates the count and drops a finished slot
    /// with nothing left in flight.
    pub(super) fn job_done(&mut self, req: &RequestId, kind: RequestJob) {
        let drop = match self.slots.get_mut(req) {
            Some(e) => {
                let n = match kind {
                    RequestJob::Store => &mut e.stores_in_flight,
                    RequestJob::Load => &mut e.loads_in_flight,
                };
                *n = n.saturating_sub(1);
                e.slot.state() == SlotState::Finished
                    && e.stores_in_flight == 0
                    && e.loads_in_flight == 0
            }
            None => false,
        };
        if drop {
            self.slots.remove(req);
            self.fences.release(req);
        }
    }

    /// Drop `req`'s slot if it finished and has no job in flight.
    pub(super) fn maybe_drop_slot(&mut self, req: &RequestId) {
        let drop = self.slots.get(req).is_some_and(|e| {
            e.slot.state() == SlotState::Finished
                && e.stores_in_flight == 0
                && e.loads_in_flight == 0
        });
        if drop {
            self.slots.remove(req);
            self.fences.release(req);
        }
    }

    /// Apply every report that arrived since the last call. Matching, `build_step`,
    /// `request_finished` and `take_events` call it first; allocation does not (between matching
    /// and allocation the pools must not change).
    pub fn poll_reports(&mut self) {
        while let Ok(r) = self.reports_rx.try_recv() {
            self.apply_report(r);
        }
    }

    /// Apply one worker report (also usable directly by a channel that is not an mpsc).
    pub fn apply_report(&mut self, r: WorkerReport) {
        let Some(job) = self.jobs.get_mut(r.job) else {
            tracing::warn!(job = r.job.0, rank = r.rank, "report for an unknown job");
            return;
        };
        if r.rank >= self.world {
            tracing::warn!(
                job = r.job.0,
                rank = r.rank,
                "report from a rank beyond the world size"
            );
            return;
        }
        if !job.reported.insert(r.rank) {
            tracing::warn!(job = r.job.0, rank = r.rank, "duplicate report");
            return;
        }
        job.waiting = job.waiting.saturating_sub(1);
        if let TransferOutcome::Failed(f) = &r.outcome {
            for b in f {
                crate::warn_limited!(job = r.job.0, rank = r.rank, pair = b.pair_index, reason = %b.reason, "transfer pair failed");
                job.failed.insert(b.pair_index);
            }
        }
        if job.waiting == 0 {
            if let Some(done) = self.jobs.remove(r.job) {
                self.complete(done);
            }
        }
    }

    /// Apply a job every rank has reported (or one withdrawn before it was sent).
    pub(super) fn complete(&mut self, job: PendingJob) {
        let failed = &job.failed;
        match job.books {
            JobBooks::Store(b) => self.complete_store(b, failed),
            JobBooks::Load(b) => self.complete_load(b, failed),
            JobBooks::SpillDisk(b) => self.complete_spill(b, failed),
            JobBooks::PutRemote(b) => self.complete_put(b, failed),
            JobBooks::StoreRemote(b) => self.complete_remote_store(b, failed),
        }
    }
}
