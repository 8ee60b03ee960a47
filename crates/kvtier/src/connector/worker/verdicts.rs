//! Load verdicts on the worker side (TensorRT-LLM at any TP size; the leader's side is
//! `connector::leader::verdicts`): with verdicts on, an asynchronous load finished on this rank
//! is reported only once the leader's verdict for it arrived, and as the verdict says.
//!
//! Invariants (with verdicts on): a load is reported in `loaded` only if its verdict says every
//! rank loaded every block, in `recompute` (with the verdict's token) only if the verdict names a
//! failed block, and never before its verdict; a load this rank failed is never reported loaded
//! (a verdict saying otherwise contradicts this rank's own report: it is logged and the request is
//! withheld); verdicts for requests whose load this worker does not hold are dropped.
use crate::connector::messages::LoadVerdict;
use crate::connector::worker::{FinishedReport, Worker};
use crate::ids::RequestId;
use std::collections::HashMap;

impl Worker {
    /// Report asynchronous loads only by the leader's verdicts ([`Worker::apply_load_verdicts`]),
    /// the same on every rank: TensorRT-LLM. Off by default.
    pub fn set_load_verdicts(&mut self, on: bool) {
        self.verdicts = if on { Some(HashMap::new()) } else { None };
    }

    /// The leader's verdicts (every rank gets the same ones). Ignored when verdicts are off.
    pub fn apply_load_verdicts(&mut self, verdicts: &[LoadVerdict]) {
        self.drain();
        let Some(map) = self.verdicts.as_mut() else {
            return;
        };
        for v in verdicts {
            // Every verdict follows this rank's bind of the load (it needs this rank's report, or
            // was issued while the step that carries the load was built); a load this worker does
            // not hold was withdrawn unsent or is already reported.
            let held = self.loads.contains_key(&v.request)
                || self.loads_ready.iter().any(|(r, _)| r == &v.request);
            if held {
                map.insert(v.request.clone(), v.recompute_from);
            }
        }
    }

    /// Put the ready load of `r` (`failed` on this rank) into `out` by its verdict; false when
    /// it has none yet (the load stays ready).
    pub(super) fn report_by_verdict(
        &mut self,
        r: &RequestId,
        failed: bool,
        out: &mut FinishedReport,
    ) -> bool {
        let Some(map) = self.verdicts.as_mut() else {
            return false;
        };
        let Some(verdict) = map.remove(r) else {
            return false;
        };
        match verdict {
            Some(token) => out.recompute.push((r.clone(), token)),
            None if !failed => out.loaded.push(r.clone()),
            None => {
                tracing::error!(request = %r, rank = self.rank, "the leader's verdict says loaded, but this rank's load failed; the request is withheld");
            }
        }
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::mpsc::channel;

    use crate::connector::messages::{LoadVerdict, RequestLoad, StepMetadata, PROTOCOL_VERSION};
    use crate::connector::testing::FaultyTransfer;
    use crate::connector::worker::{Worker, WorkerLink};
    use crate::ids::{BlockId, DeviceBlockId, JobId, RequestId};
    use crate::transfer::TransferJob;

    /// A rank-1 worker with verdicts on that ran one async host -> device load of request "r"
    /// (host blocks 0 and 1 into device blocks 2 and 3), failing `fail` host blocks.
    fn loaded(fail: &[u32]) -> Worker {
        let faulty = FaultyTransfer::failing_host_reads(8, 4, 4, fail.iter().copied());
        let (tx, _rx) = channel();
        let mut w = Worker::new(faulty, WorkerLink::in_process(1, 2, tx));
        w.set_load_verdicts(true);
        w.bind(&StepMetadata {
            version: PROTOCOL_VERSION,
            step: 1,
            loads: vec![RequestLoad {
                request: "r".into(),
                sync: false,
                jobs: vec![TransferJob::from_pairs(
                    JobId(7),
                    [
                        (BlockId(0), DeviceBlockId(2)),
                        (BlockId(1), DeviceBlockId(3)),
                    ],
                )],
                failed_devices: vec![],
            }],
            ..Default::default()
        });
        w.start_load(None);
        w.wait_idle();
        w
    }

    fn verdict(token: Option<u64>) -> LoadVerdict {
        LoadVerdict {
            request: "r".into(),
            recompute_from: token,
        }
    }

    #[test]
    fn a_finished_load_waits_for_its_verdict() {
        let mut w = loaded(&[]);
        let started: Vec<RequestId> = vec!["r".into()];
        let f = w.get_finished(&[], Some(&started));
        assert!(f.loaded.is_empty() && f.recompute.is_empty() && f.load_failed.is_empty());
        w.apply_load_verdicts(&[verdict(None)]);
        let f = w.get_finished(&[], None);
        assert_eq!(f.loaded, vec![RequestId::from("r")]);
        assert!(w.get_finished(&[], None).loaded.is_empty(), "reported once");
    }

    #[test]
    fn a_load_another_rank_failed_is_recomputed_from_the_verdicts_token() {
        let mut w = loaded(&[]);
        w.apply_load_verdicts(&[verdict(Some(16))]);
        let f = w.get_finished(&[], Some(&["r".into()]));
        assert_eq!(f.recompute, vec![(RequestId::from("r"), 16)]);
        assert!(f.loaded.is_empty());
    }

    #[test]
    fn a_load_this_rank_failed_is_never_reported_loaded() {
        let mut w = loaded(&[1]);
        w.apply_load_verdicts(&[verdict(None)]);
        let f = w.get_finished(&[], Some(&["r".into()]));
        assert!(f.loaded.is_empty() && f.recompute.is_empty(), "{f:?}");
    }

    #[test]
    fn verdicts_for_loads_this_worker_does_not_hold_are_dropped() {
        let mut w = loaded(&[]);
        w.apply_load_verdicts(&[LoadVerdict {
            request: "other".into(),
            recompute_from: None,
        }]);
        assert_eq!(w.verdicts.as_ref().map(|m| m.len()), Some(0));
    }
}
