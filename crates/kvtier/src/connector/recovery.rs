//! Failed asynchronous loads turned into recomputes, for engines that recover a failed load only
//! by rewinding the request itself (TensorRT-LLM: a 1.4 connector has no load-error channel, so
//! the adapter sets the parked request's `context_current_position` to the recompute token and
//! reports it loaded). The token comes from the leader's load verdict (`leader/verdicts.rs`: the
//! first token of the lowest block any rank failed, or where the load began); this module decides,
//! per failed load, whether it is handed back for that rewind or withheld, and counts both.
//!
//! Invariants:
//! - a load in a report's `recompute` stays there (with its token, unchanged) only if the adapter
//!   can rewind that request (`can_rewind`); otherwise it is withheld: removed from the report, so
//!   never reported loaded, logged once (each verdict is reported once) and counted unrecoverable;
//! - a load reported failed without a token (`load_failed`: verdicts were off) names no rewind
//!   point, so it is withheld alike;
//! - `loaded` and `saved` are left as they are; every load counted is counted exactly once.
use crate::connector::worker::FinishedReport;
use crate::ids::RequestId;

/// The counts of [`LoadRecovery::settle`]: loads handed back for recompute, loads withheld.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadRecovery {
    /// Failed asynchronous loads handed back to the engine with their recompute token.
    pub recomputed: u64,
    /// Failed asynchronous loads the engine's request could not be rewound for: never reported.
    pub unrecoverable: u64,
}

impl LoadRecovery {
    /// Keep in `report.recompute` the loads whose request `can_rewind`; withhold the rest and
    /// every `load_failed` (see the module invariants). `rank` is only logged.
    pub fn settle(
        &mut self,
        report: &mut FinishedReport,
        rank: u32,
        can_rewind: impl Fn(&RequestId) -> bool,
    ) {
        let mut kept = Vec::with_capacity(report.recompute.len());
        for (r, token) in std::mem::take(&mut report.recompute) {
            if can_rewind(&r) {
                self.recomputed += 1;
                tracing::warn!(request = %r, rank, token, "an asynchronous load failed; the engine recomputes from this token");
                kept.push((r, token));
            } else {
                self.withhold(&r, rank, "its request cannot be rewound");
            }
        }
        report.recompute = kept;
        for r in std::mem::take(&mut report.load_failed) {
            self.withhold(&r, rank, "no recompute token (load verdicts are off)");
        }
    }

    fn withhold(&mut self, r: &RequestId, rank: u32, why: &str) {
        self.unrecoverable += 1;
        tracing::error!(request = %r, rank, why, "an asynchronous load failed and cannot be recomputed; the request is never reported loaded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> FinishedReport {
        FinishedReport {
            saved: vec!["s".into()],
            loaded: vec!["ok".into()],
            load_failed: vec!["nov".into()],
            recompute: vec![("a".into(), 16), ("b".into(), 0)],
        }
    }

    #[test]
    fn a_rewindable_load_keeps_its_token_and_an_unreachable_one_is_withheld() {
        let mut rec = LoadRecovery::default();
        let mut r = report();
        rec.settle(&mut r, 0, |q| q.as_str() == "a");
        assert_eq!(r.recompute, vec![(RequestId::from("a"), 16)]);
        // Withheld: never in any list the engine acts on.
        assert!(r.load_failed.is_empty());
        assert_eq!(r.loaded, vec![RequestId::from("ok")]);
        assert_eq!(r.saved, vec![RequestId::from("s")]);
        assert_eq!(
            rec,
            LoadRecovery {
                recomputed: 1,
                unrecoverable: 2
            }
        );
        // Settling an empty report counts nothing more.
        rec.settle(&mut FinishedReport::default(), 0, |_| true);
        assert_eq!((rec.recomputed, rec.unrecoverable), (1, 2));
    }

    #[test]
    fn every_rewindable_load_is_handed_back() {
        let mut rec = LoadRecovery::default();
        let mut r = report();
        rec.settle(&mut r, 1, |_| true);
        assert_eq!(
            r.recompute,
            vec![(RequestId::from("a"), 16), (RequestId::from("b"), 0)]
        );
        assert_eq!((rec.recomputed, rec.unrecoverable), (2, 1));
    }
}
