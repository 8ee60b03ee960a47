//! Load verdicts on the worker side (TensorRT-LLM with TP > 1; the leader's side is
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
    /// the same on every rank: TensorRT-LLM with TP > 1. Off by default.
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
