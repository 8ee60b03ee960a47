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

use crate::errors::{BridgeError, Family};
use crate::seq::{extract_seq, extract_seq_map, extract_triples};

/// One group's `Worker.get_finished` answer: `(saved, loaded, load_failed)`.
type Report = (Vec<String>, Vec<String>, Vec<String>);

/// `(finished_sending, finished_recving, failed_recving)` as the engine hears them.
type Engine = (
    Option<HashSet<String>>,
    Option<HashSet<String>>,
    HashSet<String>,
);

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
    fn py_new(groups: &Bound<'_, PyAny>) -> PyResult<Self> {
        let groups: usize = crate::errors::extract_arg(Family::Connector, "groups", groups)?;
        Ok(Self {
            books: AllGroups::new(groups).map_err(BridgeError::from)?,
            recovery: LoadRecovery::default(),
        })
    }

    /// `(saved, loaded, load_failed)` that every group has now reported, from each group's
    /// `Worker.get_finished` answer (`None` where it could not answer).
    fn finish(&mut self, reports: &Bound<'_, PyAny>) -> PyResult<Report> {
        let reports: Vec<Option<Report>> = extract_triples(Family::Connector, "reports", reports)?;
        let reports: Vec<Option<FinishedReport>> =
            reports.into_iter().map(|r| r.map(report)).collect();
        let f = self.books.finish(&reports);
        Ok((strings(f.saved), strings(f.loaded), strings(f.load_failed)))
    }

    /// Load verdicts on: `(saved, loaded, [(request, recompute_from)])` that every group has now
    /// reported, from each group's `Worker.get_finished_by_verdict` answer; a load any group
    /// failed recomputes from the lowest token any group named, and is withheld (never reported,
    /// counted in `load_recovery`) unless its request is in `rewindable`.
    fn finish_by_verdict(
        &mut self,
        reports: &Bound<'_, PyAny>,
        rewindable: HashSet<String>,
    ) -> PyResult<VerdictReport> {
        let reports: Vec<Option<VerdictReport>> =
            extract_triples(Family::Connector, "reports", reports)?;
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
        Ok((strings(f.saved), strings(f.loaded), recompute))
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
    fn set_groups(&mut self, n: &Bound<'_, PyAny>) -> PyResult<()> {
        let n: usize = crate::errors::extract_arg(Family::Connector, "n", n)?;
        Ok(self.books.set_groups(n).map_err(BridgeError::from)?)
    }

    /// One step's metadata, before its loads start.
    #[pyo3(signature = (delayed_frees, delayed_groups, recv_groups, failed_loads, failed_async))]
    fn begin_step(
        &mut self,
        delayed_frees: &Bound<'_, PyAny>,
        delayed_groups: &Bound<'_, PyAny>,
        recv_groups: &Bound<'_, PyAny>,
        failed_loads: &Bound<'_, PyAny>,
        failed_async: HashSet<String>,
    ) -> PyResult<()> {
        let c = Family::Connector;
        let delayed_frees: Vec<String> = extract_seq(c, "delayed_frees", delayed_frees)?;
        let delayed_groups = extract_seq_map(c, "delayed_groups", delayed_groups)?;
        let recv_groups = extract_seq_map(c, "recv_groups", recv_groups)?;
        let failed_loads: HashMap<String, Vec<u32>> =
            extract_seq_map(c, "failed_loads", failed_loads)?;
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
        Ok(())
    }

    /// `(finished_sending, finished_recving, failed_recving)`, the first two `None` when empty,
    /// from every group's worker's answer (`None` where it could not answer); `failed_recving`
    /// (several groups only) names the loads of `finished_recving` that failed.
    fn finish(&mut self, reports: &Bound<'_, PyAny>) -> PyResult<Engine> {
        let reports: Vec<Option<Report>> = extract_triples(Family::Connector, "reports", reports)?;
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
        Ok((set(f.sending), set(f.recving), failed))
    }

    /// Device blocks whose loads failed since the last call: the scheduler side's and
    /// `from_workers` (the workers' own `take_load_errors`).
    fn take_load_errors(&mut self, from_workers: &Bound<'_, PyAny>) -> PyResult<HashSet<u32>> {
        let from_workers: Vec<u32> = extract_seq(Family::Connector, "from_workers", from_workers)?;
        Ok(self
            .books
            .take_load_errors(from_workers.into_iter().map(DeviceBlockId))
            .into_iter()
            .map(|b| b.0)
            .collect())
    }
}
