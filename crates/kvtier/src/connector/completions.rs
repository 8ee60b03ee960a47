//! The books an engine's worker process keeps over its kvtier workers (one per KV cache group) to
//! answer the engine's "what finished" questions: which requests it hears of as saved (delayed
//! frees), which as received (asynchronous loads, loaded or failed), and which device blocks it
//! hears failed to load. The workers report per group; the scheduler side's metadata says which
//! groups each request waits for and which loads it had to fail itself. vLLM's contract
//! (`KVConnectorBase_V1.get_finished`, `get_block_ids_with_load_errors`) is what this serves.
//!
//! Invariants:
//! - a delayed free (a request the engine keeps until it is saved) is reported in `sending` once,
//!   when every group named for it reported it saved (one group: when its worker did); a saved
//!   request that was not a delayed free is never reported (the engine freed it already);
//! - a request whose asynchronous load the scheduler side failed is reported in `recving` once, at
//!   the next [`Completions::finish`], unless it also waits for groups to report it: then it is
//!   reported with them (the engine waits for it either way and must hear of it exactly once);
//! - with one group every request a worker reports loaded or load-failed is reported in `recving`;
//!   with several, a request is reported once every group named for it reported it, once;
//! - device blocks of failed loads (the scheduler side's and the workers') are handed out by
//!   [`Completions::take_load_errors`] once each; with several groups only those of loads inside
//!   the step (the workers hand out no others: `Worker::set_sync_load_errors_only`): block ids are
//!   per group and name no request (vLLM 0.32/0.33 raise on them, `Scheduler._handle_invalid_blocks`),
//!   so a failed asynchronous load is reported by request instead, in [`Finished::failed`], when it
//!   is reported in `recving` (vLLM's `KVConnectorTransferResults.failed_recving`: the engine
//!   recomputes the request whole), and a failed load inside the step, which has no such path
//!   (every group loads in the step only from the host tier: it fails only with the device), goes
//!   out by its blocks, on which vLLM stops instead of computing on them.
//!
//! [`AllGroups`] is TensorRT-LLM's counterpart over its window groups (every group reports every
//! request; see its invariants).
//!
//! No lock: the owner (the adapter's worker side, one engine thread) holds it exclusively.
use std::collections::BTreeSet;

use crate::connector::fasthash::{FastMap, FastSet};
use crate::connector::worker::FinishedReport;
use crate::connector::ConnectorError;
use crate::ids::{DeviceBlockId, RequestId};

/// The most KV cache groups the books take. An engine runs a handful (vLLM's hybrid KV cache
/// manager: one per attention kind, e.g. full and sliding window; TensorRT-LLM: one per distinct
/// attention window), each one kvtier worker and one pass over every report; 64 is far above any
/// model's, and a count past it is a caller's bug (e.g. a token or byte count passed as a count).
pub const MAX_GROUPS: usize = 64;

/// `n` groups as the books keep them (at least one), or the refusal of more than [`MAX_GROUPS`].
fn checked_groups(n: usize) -> Result<usize, ConnectorError> {
    if n > MAX_GROUPS {
        return Err(ConnectorError::Config(format!(
            "{n} KV cache groups is more than kvtier takes (at most {MAX_GROUPS})"
        )));
    }
    Ok(n.max(1))
}

/// A load the scheduler side promised the engine and then failed itself (no worker loads it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedLoad {
    /// The request.
    pub request: RequestId,
    /// The device blocks the engine must recompute.
    pub blocks: Vec<DeviceBlockId>,
    /// Asynchronous: the engine waits for the request in `recving`; a synchronous load is failed
    /// by its blocks alone.
    pub is_async: bool,
}

/// What the scheduler side's metadata of one step tells the worker process's books.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepNotice {
    /// Finished requests whose blocks the engine keeps until they are reported saved.
    pub delayed_frees: Vec<RequestId>,
    /// Several groups: per delayed free, the groups whose stores it waits for.
    pub delayed_groups: Vec<(RequestId, Vec<usize>)>,
    /// Several groups: per asynchronous load, the groups that load it.
    pub recv_groups: Vec<(RequestId, Vec<usize>)>,
    /// Loads the scheduler side failed.
    pub failed_loads: Vec<FailedLoad>,
}

/// The engine's answer to "what finished": request ids, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    /// Delayed frees now saved: the engine frees their blocks.
    pub sending: Vec<RequestId>,
    /// Asynchronous loads now over (loaded or failed).
    pub recving: Vec<RequestId>,
    /// Several groups: the loads of `recving` that failed in any group (or that the scheduler
    /// side failed); the engine recomputes them whole. Empty with one group (its failed blocks
    /// go out by [`Completions::take_load_errors`]).
    pub failed: Vec<RequestId>,
}

/// The worker process's books (see the module documentation).
#[derive(Debug, Default)]
pub struct Completions {
    /// Delayed frees not yet reported.
    awaiting_save: FastSet<RequestId>,
    /// Several groups: the groups whose stores a request still waits for.
    save_wait: FastMap<RequestId, BTreeSet<usize>>,
    /// Several groups: the groups whose loads a request still waits for.
    recv_wait: FastMap<RequestId, BTreeSet<usize>>,
    /// Asynchronous loads the scheduler side failed, reported at the next `finish`.
    failed_recv: FastSet<RequestId>,
    /// Device blocks of loads the scheduler side failed, handed out by `take_load_errors`.
    failed_blocks: FastSet<DeviceBlockId>,
    /// Several groups: requests whose load failed in a group (or at the scheduler side) and that
    /// still wait for other groups: reported in `failed` with their `recving`.
    recv_failed: FastSet<RequestId>,
    /// KV cache groups the engine runs (`set_groups`; 1 until told).
    groups: usize,
}

impl Completions {
    /// Empty books for one KV cache group.
    pub fn new() -> Self {
        Self {
            groups: 1,
            ..Self::default()
        }
    }

    /// The engine runs `n` KV cache groups (one worker each); more than [`MAX_GROUPS`] is
    /// refused, the books unchanged.
    pub fn set_groups(&mut self, n: usize) -> Result<(), ConnectorError> {
        self.groups = checked_groups(n)?;
        Ok(())
    }

    /// Take one step's metadata (before its loads start).
    pub fn begin_step(&mut self, step: StepNotice) {
        self.awaiting_save.extend(step.delayed_frees);
        for (request, groups) in step.delayed_groups {
            self.save_wait.insert(request, groups.into_iter().collect());
        }
        for (request, groups) in step.recv_groups {
            self.recv_wait.insert(request, groups.into_iter().collect());
        }
        for f in step.failed_loads {
            // A request still waiting for groups is reported once they reported it.
            let waits = self
                .recv_wait
                .get(&f.request)
                .is_some_and(|g| !g.is_empty());
            if f.is_async && !waits {
                self.failed_recv.insert(f.request);
            } else if f.is_async {
                self.recv_failed.insert(f.request);
            }
            if self.groups == 1 || !f.is_async {
                self.failed_blocks.extend(f.blocks);
            }
        }
    }

    /// The engine asks what finished: `reports[g]` is group `g`'s worker's `get_finished` answer,
    /// `None` where that worker could not answer (it is asked again next time).
    pub fn finish(&mut self, reports: &[Option<FinishedReport>]) -> Finished {
        let mut sending = BTreeSet::new();
        let mut recving = BTreeSet::new();
        if reports.len() <= 1 {
            for r in reports.iter().flatten() {
                for q in &r.saved {
                    if self.awaiting_save.remove(q) {
                        sending.insert(q.clone());
                    }
                }
                recving.extend(r.loaded.iter().cloned());
                recving.extend(r.load_failed.iter().cloned());
            }
        } else {
            for (g, r) in reports.iter().enumerate() {
                let Some(r) = r else { continue };
                for q in &r.saved {
                    if let Some(left) = self.save_wait.get_mut(q) {
                        left.remove(&g);
                    }
                }
                for q in r.loaded.iter().chain(&r.load_failed) {
                    if let Some(left) = self.recv_wait.get_mut(q) {
                        left.remove(&g);
                    }
                }
                for q in &r.load_failed {
                    if self.recv_wait.contains_key(q) {
                        self.recv_failed.insert(q.clone());
                    }
                }
            }
            let awaiting = &mut self.awaiting_save;
            self.save_wait.retain(|q, left| {
                if left.is_empty() && awaiting.remove(q) {
                    sending.insert(q.clone());
                }
                !left.is_empty()
            });
            self.recv_wait.retain(|q, left| {
                if left.is_empty() {
                    recving.insert(q.clone());
                }
                !left.is_empty()
            });
        }
        let mut failed = BTreeSet::new();
        if self.groups > 1 {
            let recv_failed = &mut self.recv_failed;
            failed.extend(recving.iter().filter(|q| recv_failed.remove(*q)).cloned());
            failed.extend(self.failed_recv.iter().cloned());
        }
        recving.extend(self.failed_recv.drain());
        Finished {
            sending: sending.into_iter().collect(),
            recving: recving.into_iter().collect(),
            failed: failed.into_iter().collect(),
        }
    }

    /// Device blocks whose loads failed since the last call: the scheduler side's and
    /// `from_workers` (the workers' own `take_load_errors`), sorted, each once. With several
    /// groups only loads inside the step have any (asynchronous ones go out by request, in
    /// [`Finished::failed`]).
    pub fn take_load_errors(
        &mut self,
        from_workers: impl IntoIterator<Item = DeviceBlockId>,
    ) -> Vec<DeviceBlockId> {
        let mut out: BTreeSet<DeviceBlockId> = self.failed_blocks.drain().collect();
        out.extend(from_workers);
        out.into_iter().collect()
    }
}

/// TensorRT-LLM's layer groups (one kvtier worker per attention window, `_trtllm_groups.py`):
/// TensorRT-LLM learns a request id once, so a request is reported saved, or its load over, once
/// every group's worker reported it; a load is failed when any group's worker failed it.
///
/// Invariants: each request is reported once per kind; a group reporting the same request twice
/// counts once (the groups are a set, not a count); a load reported failed by one group and
/// loaded by the others is reported failed; with load verdicts, a load some group's verdict
/// names a recompute token for is reported in `recompute` with the lowest token any group named
/// (at or before every group's first failed block), never in `loaded`.
#[derive(Debug)]
pub struct AllGroups {
    groups: usize,
    saved: FastMap<RequestId, BTreeSet<usize>>,
    over: FastMap<RequestId, BTreeSet<usize>>,
    failed: FastSet<RequestId>,
    /// The lowest recompute token any group's verdict named so far.
    recompute: FastMap<RequestId, u64>,
}

impl AllGroups {
    /// Books over `groups` workers (at least one); more than [`MAX_GROUPS`] is refused.
    pub fn new(groups: usize) -> Result<Self, ConnectorError> {
        Ok(AllGroups {
            groups: checked_groups(groups)?,
            saved: FastMap::default(),
            over: FastMap::default(),
            failed: FastSet::default(),
            recompute: FastMap::default(),
        })
    }

    /// `reports[g]`: group `g`'s worker's `get_finished` answer (`None`: it could not answer).
    /// Answers the requests every group has now reported: `saved`, `loaded`, `load_failed` and
    /// `recompute`, sorted.
    pub fn finish(&mut self, reports: &[Option<FinishedReport>]) -> FinishedReport {
        for (g, r) in reports.iter().enumerate().filter(|(g, _)| *g < self.groups) {
            let Some(r) = r else { continue };
            for q in &r.saved {
                self.saved.entry(q.clone()).or_default().insert(g);
            }
            for q in r.loaded.iter().chain(&r.load_failed) {
                self.over.entry(q.clone()).or_default().insert(g);
            }
            self.failed.extend(r.load_failed.iter().cloned());
            for (q, token) in &r.recompute {
                self.over.entry(q.clone()).or_default().insert(g);
                let t = self.recompute.entry(q.clone()).or_insert(*token);
                *t = (*t).min(*token);
            }
        }
        let n = self.groups;
        let mut saved = BTreeSet::new();
        self.saved.retain(|q, g| {
            let all = g.len() >= n;
            if all {
                saved.insert(q.clone());
            }
            !all
        });
        let (mut loaded, mut load_failed) = (BTreeSet::new(), BTreeSet::new());
        let mut recompute = std::collections::BTreeMap::new();
        let (failed, tokens) = (&mut self.failed, &mut self.recompute);
        self.over.retain(|q, g| {
            let all = g.len() >= n;
            if all {
                let token = tokens.remove(q);
                if failed.remove(q) {
                    load_failed.insert(q.clone());
                } else if let Some(t) = token {
                    recompute.insert(q.clone(), t);
                } else {
                    loaded.insert(q.clone());
                }
            }
            !all
        });
        FinishedReport {
            saved: saved.into_iter().collect(),
            loaded: loaded.into_iter().collect(),
            load_failed: load_failed.into_iter().collect(),
            recompute: recompute.into_iter().collect(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<RequestId> {
        v.iter().map(|s| RequestId::from(*s)).collect()
    }

    fn report(saved: &[&str], loaded: &[&str], failed: &[&str]) -> Option<FinishedReport> {
        Some(FinishedReport {
            saved: ids(saved),
            loaded: ids(loaded),
            load_failed: ids(failed),
            recompute: Vec::new(),
        })
    }

    fn finished(sending: &[&str], recving: &[&str]) -> Finished {
        failing(sending, recving, &[])
    }

    fn failing(sending: &[&str], recving: &[&str], failed: &[&str]) -> Finished {
        Finished {
            sending: ids(sending),
            recving: ids(recving),
            failed: ids(failed),
        }
    }

    fn groups(n: usize) -> Completions {
        let mut c = Completions::new();
        c.set_groups(n).unwrap();
        c
    }

    fn failed(request: &str, blocks: &[u32], is_async: bool) -> FailedLoad {
        FailedLoad {
            request: request.into(),
            blocks: blocks.iter().map(|b| DeviceBlockId(*b)).collect(),
            is_async,
        }
    }

    #[test]
    fn a_delayed_free_is_reported_once_saved_and_other_saved_requests_never() {
        let mut c = Completions::new();
        c.begin_step(StepNotice {
            delayed_frees: ids(&["d"]),
            ..StepNotice::default()
        });
        assert_eq!(c.finish(&[report(&[], &[], &[])]), finished(&[], &[]));
        // "x" was freed by the engine at once: it must not hear of it again.
        assert_eq!(
            c.finish(&[report(&["d", "x"], &[], &[])]),
            finished(&["d"], &[])
        );
        assert_eq!(c.finish(&[report(&["d"], &[], &[])]), finished(&[], &[]));
    }

    #[test]
    fn one_group_reports_every_load_loaded_or_failed() {
        let mut c = Completions::new();
        assert_eq!(
            c.finish(&[report(&[], &["a"], &["b"])]),
            finished(&[], &["a", "b"])
        );
        assert_eq!(c.finish(&[None]), finished(&[], &[]));
    }

    #[test]
    fn an_async_load_the_scheduler_failed_is_reported_once_and_its_blocks_once() {
        let mut c = Completions::new();
        c.begin_step(StepNotice {
            failed_loads: vec![failed("a", &[3, 4], true), failed("s", &[7], false)],
            ..StepNotice::default()
        });
        // Reported even when no worker answers (none loads it), and only once.
        assert_eq!(c.finish(&[None]), finished(&[], &["a"]));
        assert_eq!(c.finish(&[report(&[], &[], &[])]), finished(&[], &[]));
        // A synchronous failure is reported by its blocks alone; worker errors join them.
        let got = c.take_load_errors([DeviceBlockId(9), DeviceBlockId(3)]);
        assert_eq!(got, [3, 4, 7, 9].map(DeviceBlockId));
        assert!(c.take_load_errors([]).is_empty());
    }

    #[test]
    fn several_groups_report_a_request_once_every_named_group_has() {
        let mut c = groups(2);
        c.begin_step(StepNotice {
            delayed_frees: ids(&["s"]),
            delayed_groups: vec![("s".into(), vec![0, 1])],
            recv_groups: vec![("r".into(), vec![0, 1])],
            ..StepNotice::default()
        });
        let none = report(&[], &[], &[]);
        assert_eq!(
            c.finish(&[report(&["s"], &["r"], &[]), none.clone()]),
            finished(&[], &[])
        );
        // A group whose worker could not answer discharges nothing.
        assert_eq!(c.finish(&[None, report(&[], &[], &[])]), finished(&[], &[]));
        // A failed load counts as reported, and is named failed (the engine recomputes it whole).
        assert_eq!(
            c.finish(&[none.clone(), report(&["s"], &[], &["r"])]),
            failing(&["s"], &["r"], &["r"])
        );
        assert_eq!(
            c.finish(&[report(&["s"], &["r"], &[]), report(&["s"], &["r"], &[])]),
            finished(&[], &[])
        );
    }

    #[test]
    fn several_groups_report_only_named_requests_and_empty_waits_at_once() {
        let mut c = groups(2);
        c.begin_step(StepNotice {
            // "n": asynchronous, but no group planned a load of it.
            recv_groups: vec![("n".into(), vec![])],
            // "k": saved by every group but not a delayed free (the engine freed it).
            delayed_groups: vec![("k".into(), vec![0])],
            ..StepNotice::default()
        });
        let got = c.finish(&[report(&["k"], &["u"], &[]), None]);
        assert_eq!(got, finished(&[], &["n"]));
        assert_eq!(c.finish(&[None, None]), finished(&[], &[]));
    }

    #[test]
    fn several_groups_a_failed_load_still_waited_for_is_reported_with_the_groups() {
        let mut c = groups(2);
        c.begin_step(StepNotice {
            recv_groups: vec![("r".into(), vec![0, 1]), ("e".into(), vec![])],
            failed_loads: vec![failed("r", &[5], true), failed("e", &[6], true)],
            ..StepNotice::default()
        });
        // "e" waits for no group: reported at once; "r" only with its groups, once; both failed.
        assert_eq!(c.finish(&[None, None]), failing(&[], &["e"], &["e"]));
        assert_eq!(
            c.finish(&[report(&[], &["r"], &[]), report(&[], &["r"], &[])]),
            failing(&[], &["r"], &["r"])
        );
        assert_eq!(c.finish(&[None, None]), finished(&[], &[]));
        // Block ids are per group: vLLM raises on them with several groups, so an asynchronous
        // load's go out by request only; a load inside the step has no other path.
        assert!(c.take_load_errors([]).is_empty());
        c.begin_step(StepNotice {
            failed_loads: vec![failed("s", &[7], false)],
            ..StepNotice::default()
        });
        assert_eq!(c.take_load_errors([]), [DeviceBlockId(7)]);
    }

    /// vLLM 0.32/0.33 with several KV cache groups take no failed block ids
    /// (`Scheduler._handle_invalid_blocks` raises) but failed requests
    /// (`KVConnectorTransferResults.failed_recving`, `_handle_failed_recving`): a load one group's
    /// worker failed is named failed when every group reported it, a loaded one never.
    #[test]
    fn several_groups_name_a_request_failed_in_any_group_and_no_blocks() {
        let mut c = groups(3);
        c.begin_step(StepNotice {
            recv_groups: vec![
                ("bad".into(), vec![0, 1, 2]),
                ("good".into(), vec![0, 1, 2]),
            ],
            ..StepNotice::default()
        });
        assert_eq!(
            c.finish(&[
                report(&[], &["good"], &["bad"]),
                report(&[], &["good", "bad"], &[]),
                None
            ]),
            finished(&[], &[])
        );
        assert_eq!(
            c.finish(&[None, None, report(&[], &["good", "bad"], &[])]),
            failing(&[], &["bad", "good"], &["bad"])
        );
        // The workers hand out no block of an asynchronous load with several groups.
        assert!(c.take_load_errors([]).is_empty());
        // One group keeps block-level errors (vLLM recomputes from the first failed block).
        let mut one = Completions::new();
        assert_eq!(
            one.finish(&[report(&[], &[], &["x"])]),
            finished(&[], &["x"])
        );
        assert_eq!(one.take_load_errors([DeviceBlockId(4)]), [DeviceBlockId(4)]);
    }

    /// TensorRT-LLM hears of a request once every window group reported it; one group's failure
    /// fails the load; a group repeating itself does not stand in for another.
    #[test]
    fn all_groups_report_once_every_group_did_and_any_failure_fails() {
        let mut a = AllGroups::new(2).unwrap();
        assert_eq!(
            a.finish(&[report(&["s"], &["l"], &["f"]), None]),
            FinishedReport::default()
        );
        // Group 0 again: still waiting for group 1.
        assert_eq!(
            a.finish(&[report(&["s"], &["l"], &[]), report(&[], &[], &[])]),
            FinishedReport::default()
        );
        let got = a.finish(&[None, report(&["s"], &["l", "f"], &[])]);
        assert_eq!(got.saved, ids(&["s"]));
        assert_eq!(got.loaded, ids(&["l"]));
        assert_eq!(got.load_failed, ids(&["f"]));
        assert_eq!(
            a.finish(&[report(&["s"], &[], &[]), report(&["s"], &[], &[])])
                .saved,
            ids(&["s"]),
            "a later save of the same id is a new report"
        );
        assert_eq!(a.finish(&[None, None]), FinishedReport::default());
    }

    /// With load verdicts, a load any group failed is reported once every group reported it,
    /// in `recompute` with the lowest token any group named, never as loaded.
    #[test]
    fn all_groups_recompute_from_the_lowest_token_any_group_named() {
        let mut a = AllGroups::new(3).unwrap();
        let with = |loaded: &[&str], recompute: &[(&str, u64)]| {
            Some(FinishedReport {
                loaded: ids(loaded),
                recompute: recompute.iter().map(|(q, t)| ((*q).into(), *t)).collect(),
                ..FinishedReport::default()
            })
        };
        let got = a.finish(&[with(&["l"], &[("r", 32)]), with(&["l"], &[("r", 16)]), None]);
        assert_eq!(got, FinishedReport::default(), "group 2 has not reported");
        let got = a.finish(&[None, None, with(&["l", "r"], &[])]);
        assert_eq!(got.loaded, ids(&["l"]));
        assert_eq!(got.recompute, vec![(RequestId::from("r"), 16)]);
        assert_eq!(
            a.finish(&[None, None, None]),
            FinishedReport::default(),
            "reported once"
        );
    }

    #[test]
    fn more_groups_than_the_bound_are_refused() {
        assert!(AllGroups::new(MAX_GROUPS).is_ok());
        assert!(AllGroups::new(MAX_GROUPS + 1).is_err());
        let mut c = Completions::new();
        assert!(c.set_groups(1 << 40).is_err());
        assert!(c.set_groups(MAX_GROUPS).is_ok());
    }
}
