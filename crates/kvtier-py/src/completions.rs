//! `kvtier._native.Completions`: the books of an engine worker process over its kvtier workers
//! (one per KV cache group), a thin shell around [`kvtier::connector::Completions`]: which
//! requests the engine hears of as saved and as received, and which device blocks failed to load.
//!
//! Invariant: no rule lives here; arguments are converted, the core decides. No lock: PyO3's
//! borrow flag gives each call exclusive access.
use std::collections::{HashMap, HashSet};

use kvtier::connector::{
    AllGroups, Completions, FailedLoad, FinishedReport, LoadRecovery, StepNotice,
};
use kvtier::ids::{DeviceBlockId, RequestId};
use pyo3::prelude::*;

/// One group's `Worker.get_finished` answer: `(saved, loaded, load_failed)`.
type Report = (Vec<String>, Vec<String>, Vec<String>);

/// One group's `Worker.get_finished_by_verdict` answer: `(saved, loaded, recompute)`.
type VerdictReport = (Vec<String>, Vec<String>, Vec<(String, u64)>);

fn rids(v: Vec<String>) -> Vec<RequestId> {
    v.into_iter().map(RequestId::from).collect()
}

fn groups(m: HashMap<String, Vec<usize>>) -> Vec<(RequestId, Vec<usize>)> {
    m.into_iter()
        .map(|(q, g)| (RequestId::from(q), g))
        .collect()
}

fn report(r: Report) -> FinishedReport {
    let (saved, loaded, failed) = r;
    FinishedReport {
        saved: rids(saved),
        loaded: rids(loaded),
        load_failed: rids(failed),
        recompute: Vec::new(),
    }
}

fn strings(v: Vec<RequestId>) -> Vec<String> {
    v.into_iter().map(|q| q.to_string()).collect()
}

/// `kvtier._native.AllGroups`: TensorRT-LLM's window groups' reports joined (see
/// [`kvtier::connector::AllGroups`]).
#[pyclass(name = "AllGroups", module = "kvtier._native")]
pub(crate) struct PyAllGroups {
    books: AllGroups,
    recovery: LoadRecovery,
}

#[pymethods]
impl PyAllGroups {
    #[new]
    fn py_new(groups: usize) -> Self {
        Self {
            books: AllGroups::new(groups),
            recovery: LoadRecovery::default(),
        }
    }

    /// `(saved, loaded, load_failed)` that every group has now reported, from each group's
    /// `Worker.get_finished` answer (`None` where it could not answer).
    fn finish(&mut self, reports: Vec<Option<Report>>) -> (Vec<String>, Vec<String>, Vec<String>) {
        let reports: Vec<Option<FinishedReport>> =
            reports.into_iter().map(|r| r.map(report)).collect();
        let f = self.books.finish(&reports);
        (strings(f.saved), strings(f.loaded), strings(f.load_failed))
    }

    /// Load verdicts on: `(saved, loaded, [(request, recompute_from)])` that every group has now
    /// reported, from each group's `Worker.get_finished_by_verdict` answer; a load any group
    /// failed recomputes from the lowest token any group named, and is withheld (never reported,
    /// counted in `load_recovery`) unless its request is in `rewindable`.
    fn finish_by_verdict(
        &mut self,
        reports: Vec<Option<VerdictReport>>,
        rewindable: HashSet<String>,
    ) -> VerdictReport {
        let reports: Vec<Option<FinishedReport>> = reports
            .into_iter()
            .map(|r| {
                r.map(|(saved, loaded, recompute)| FinishedReport {
                    saved: rids(saved),
                    loaded: rids(loaded),
                    load_failed: Vec::new(),
                    recompute: recompute
                        .into_iter()
                        .map(|(q, t)| (RequestId::from(q), t))
                        .collect(),
                })
            })
            .collect();
        let mut f = self.books.finish(&reports);
        self.recovery
            .settle(&mut f, 0, |q| rewindable.contains(q.as_str()));
        let recompute = f
            .recompute
            .into_iter()
            .map(|(q, t)| (q.to_string(), t))
            .collect();
        (strings(f.saved), strings(f.loaded), recompute)
    }

    /// `(recomputed, unrecoverable)` of `finish_by_verdict` (see `Worker.load_recovery`).
    fn load_recovery(&self) -> (u64, u64) {
        (self.recovery.recomputed, self.recovery.unrecoverable)
    }
}

fn set(v: Vec<RequestId>) -> Option<HashSet<String>> {
    (!v.is_empty()).then(|| v.into_iter().map(|q| q.to_string()).collect())
}

/// The worker process's completion books (see `_native.pyi`).
#[pyclass(name = "Completions", module = "kvtier._native")]
pub(crate) struct PyCompletions {
    books: Completions,
}

#[pymethods]
impl PyCompletions {
    #[new]
    fn py_new() -> Self {
        Self {
            books: Completions::new(),
        }
    }

    /// The engine runs `n` KV cache groups (one kvtier worker each).
    fn set_groups(&mut self, n: usize) {
        self.books.set_groups(n);
    }

    /// One step's metadata, before its loads start.
    #[pyo3(signature = (delayed_frees, delayed_groups, recv_groups, failed_loads, failed_async))]
    fn begin_step(
        &mut self,
        delayed_frees: Vec<String>,
        delayed_groups: HashMap<String, Vec<usize>>,
        recv_groups: HashMap<String, Vec<usize>>,
        failed_loads: HashMap<String, Vec<u32>>,
        failed_async: HashSet<String>,
    ) {
        let failed_loads = failed_loads
            .into_iter()
            .map(|(q, blocks)| FailedLoad {
                is_async: failed_async.contains(&q),
                request: RequestId::from(q),
                blocks: blocks.into_iter().map(DeviceBlockId).collect(),
            })
            .collect();
        self.books.begin_step(StepNotice {
            delayed_frees: rids(delayed_frees),
            delayed_groups: groups(delayed_groups),
            recv_groups: groups(recv_groups),
            failed_loads,
        });
    }

    /// `(finished_sending, finished_recving, failed_recving)`, the first two `None` when empty,
    /// from every group's worker's answer (`None` where it could not answer); `failed_recving`
    /// (several groups only) names the loads of `finished_recving` that failed.
    fn finish(
        &mut self,
        reports: Vec<Option<Report>>,
    ) -> (
        Option<HashSet<String>>,
        Option<HashSet<String>>,
        HashSet<String>,
    ) {
        let reports: Vec<Option<FinishedReport>> = reports
            .into_iter()
            .map(|r| {
                r.map(|(saved, loaded, failed)| FinishedReport {
                    saved: rids(saved),
                    loaded: rids(loaded),
                    load_failed: rids(failed),
                    recompute: Vec::new(),
                })
            })
            .collect();
        let f = self.books.finish(&reports);
        let failed = f.failed.iter().map(|q| q.to_string()).collect();
        (set(f.sending), set(f.recving), failed)
    }

    /// Device blocks whose loads failed since the last call: the scheduler side's and
    /// `from_workers` (the workers' own `take_load_errors`).
    fn take_load_errors(&mut self, from_workers: Vec<u32>) -> HashSet<u32> {
        self.books
            .take_load_errors(from_workers.into_iter().map(DeviceBlockId))
            .into_iter()
            .map(|b| b.0)
            .collect()
    }
}
