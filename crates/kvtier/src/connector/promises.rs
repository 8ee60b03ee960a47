//! The books an engine's scheduler side keeps of what it promised the engine about loads, across
//! its leaders (one per KV cache group), and what the next step's metadata must carry to the
//! workers: asynchronous loads promised and not yet sent, sent and not yet reported, loads the
//! scheduler side failed itself, delayed frees, and per request the groups each waits for. The
//! leaders decide matches, loads and stores; these books only remember which answers the engine
//! is owed. vLLM's contract (`KVConnectorBase_V1`): a request it let load asynchronously is
//! reported in `finished_recving` exactly once, and one it keeps after `request_finished` is
//! reported there or in `finished_sending`, never both.
//!
//! Invariants:
//! - a request is *planned* from its asynchronous allocation until the step that carries its load
//!   is built (then *expected*), or until it finishes (withdrawn: no worker will report it);
//! - an asynchronous load the scheduler side failed is *expected* from the step that carries its
//!   failure (the workers report it) and never *planned*;
//! - a request leaves *expected* when the engine is told it was received, or when it finishes:
//!   [`Promises::request_finished`] then answers true, and the engine must keep the request
//!   until that one report (and must not hear of it in `finished_sending` as well);
//! - what a step carries ([`StepOutbox`]) is handed out once, by [`Promises::take_step`].
//!
//! No lock: the owner (the adapter's scheduler side, the engine's scheduler thread) holds it
//! exclusively.
use crate::connector::fasthash::{FastMap, FastSet};
use crate::ids::{DeviceBlockId, RequestId};

/// One tier's share of a request's external tokens, as the leader's `take_hit_sources` says.
pub type HitSplit = Vec<(String, u64)>;

/// What one allocation (vLLM's `update_state_after_alloc`) tells the books.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// The request.
    pub request: RequestId,
    /// External tokens the engine was promised (0: none, e.g. vLLM's call after an async load).
    pub external_tokens: u64,
    /// The load is asynchronous (the engine parks the request until it is reported received).
    pub is_async: bool,
    /// How many KV cache groups (leaders) the scheduler side runs.
    pub groups: usize,
    /// Every leader was asked (false: the first group's leader failed, or one failed with no
    /// external tokens; then only the promise is recorded, as the engine still counts on it).
    pub complete: bool,
    /// The groups whose leader planned a load of it (several groups only).
    pub loading: Vec<usize>,
    /// Device blocks the engine was promised and must recompute (refused or failed allocations).
    pub failed: Vec<DeviceBlockId>,
    /// Several groups: group 0's hit sources, taken at allocation (the leader hands them out once).
    pub hit_sources: Option<HitSplit>,
}

/// What one step's metadata carries to the workers, besides the leaders' plans.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepOutbox {
    /// Some request of the step loads synchronously (the loads complete before the forward).
    pub sync_loads: bool,
    /// Finished requests the engine keeps until they are reported saved, in finishing order.
    pub delayed_frees: Vec<RequestId>,
    /// Loads the scheduler side failed: the device blocks to recompute, sorted by request.
    pub failed_loads: Vec<(RequestId, Vec<DeviceBlockId>)>,
    /// Which of them were asynchronous, sorted.
    pub failed_async: Vec<RequestId>,
    /// Several groups: per asynchronous load, the groups that load it, sorted by request.
    pub recv_groups: Vec<(RequestId, Vec<usize>)>,
    /// Several groups: per delayed free, the groups whose stores it waits for, sorted by request.
    pub delayed_groups: Vec<(RequestId, Vec<usize>)>,
}

/// The scheduler side's books (see the module documentation).
#[derive(Debug, Default)]
pub struct Promises {
    /// Asynchronous loads promised, not yet carried by a built step.
    planned: FastSet<RequestId>,
    /// Asynchronous loads carried to the workers, not yet reported to the engine.
    expected: FastSet<RequestId>,
    /// Group 0's hit sources, taken at allocation (several groups).
    hit_sources: FastMap<RequestId, HitSplit>,
    /// The next step's outbox.
    sync_loads: bool,
    delayed_frees: Vec<RequestId>,
    failed_loads: FastMap<RequestId, Vec<DeviceBlockId>>,
    failed_async: FastSet<RequestId>,
    recv_groups: FastMap<RequestId, Vec<usize>>,
    delayed_groups: FastMap<RequestId, Vec<usize>>,
}

fn sorted<V>(m: FastMap<RequestId, V>) -> Vec<(RequestId, V)> {
    let mut v: Vec<_> = m.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

impl Promises {
    /// Empty books.
    pub fn new() -> Self {
        Self::default()
    }

    /// The engine allocated a request's blocks (and the leaders were asked to plan its load).
    pub fn allocated(&mut self, a: Allocation) {
        if a.external_tokens > 0 {
            if a.is_async {
                self.planned.insert(a.request.clone());
            } else {
                self.sync_loads = true;
            }
        }
        if let Some(split) = a.hit_sources {
            self.hit_sources.insert(a.request.clone(), split);
        }
        if !a.complete {
            return;
        }
        if a.is_async && a.groups > 1 {
            self.recv_groups.insert(a.request.clone(), a.loading);
        }
        if !a.failed.is_empty() {
            if a.is_async {
                self.failed_async.insert(a.request.clone());
            }
            self.failed_loads.insert(a.request, a.failed);
        }
    }

    /// Group 0's hit sources taken at the request's allocation, once (`None`: ask its leader).
    pub fn take_hit_sources(&mut self, request: &RequestId) -> Option<HitSplit> {
        self.hit_sources.remove(request)
    }

    /// The step's metadata is being built; `built`: the leaders' plans were (they carry the
    /// planned loads). Hands out what the step carries besides the plans.
    pub fn take_step(&mut self, built: bool) -> StepOutbox {
        if built {
            self.expected.extend(self.planned.drain());
        }
        // Failed asynchronous loads are reported by the workers themselves.
        for q in &self.failed_async {
            self.planned.remove(q);
            self.expected.insert(q.clone());
        }
        let mut failed_async: Vec<RequestId> =
            std::mem::take(&mut self.failed_async).into_iter().collect();
        failed_async.sort();
        StepOutbox {
            sync_loads: std::mem::take(&mut self.sync_loads),
            delayed_frees: std::mem::take(&mut self.delayed_frees),
            failed_loads: sorted(std::mem::take(&mut self.failed_loads)),
            failed_async,
            recv_groups: sorted(std::mem::take(&mut self.recv_groups)),
            delayed_groups: sorted(std::mem::take(&mut self.delayed_groups)),
        }
    }

    /// The engine is told these requests were received (vLLM's `update_connector_output`, just
    /// before it acts on them).
    pub fn received(&mut self, requests: &[RequestId]) {
        for q in requests {
            self.expected.remove(q);
        }
    }

    /// The request finished: a load promised but not yet sent is withdrawn (no worker will report
    /// it). True when the engine still waits for its `finished_recving` (a load was sent): that
    /// report is the one that frees it, and the engine must keep it until then.
    pub fn request_finished(&mut self, request: &RequestId) -> bool {
        self.planned.remove(request);
        self.failed_loads.remove(request);
        // Withdrawn with its blocks: kept, it would make the request expected forever at the next
        // step (no worker reports a request the engine freed).
        self.failed_async.remove(request);
        self.recv_groups.remove(request);
        self.hit_sources.remove(request);
        self.expected.remove(request)
    }

    /// The finished request's blocks stay with the engine until its stores are done: the workers
    /// report it in `finished_sending` (with several groups once every group in `groups` did).
    pub fn delay_free(&mut self, request: RequestId, groups: Vec<usize>, several: bool) {
        if several {
            self.delayed_groups.insert(request.clone(), groups);
        }
        self.delayed_frees.push(request);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(q: &str, n: u64, is_async: bool) -> Allocation {
        Allocation {
            request: q.into(),
            external_tokens: n,
            is_async,
            groups: 1,
            complete: true,
            ..Allocation::default()
        }
    }

    fn blocks(v: &[u32]) -> Vec<DeviceBlockId> {
        v.iter().map(|b| DeviceBlockId(*b)).collect()
    }

    #[test]
    fn an_async_load_is_expected_once_its_step_is_built_and_owed_until_received() {
        let mut p = Promises::new();
        p.allocated(alloc("a", 32, true));
        // Not yet sent: finishing withdraws it, the engine is owed nothing.
        let mut q = Promises::new();
        q.allocated(alloc("a", 32, true));
        assert!(!q.request_finished(&"a".into()));
        q.take_step(true);
        assert!(!q.request_finished(&"a".into()));
        // A failed build keeps it planned (finishing now withdraws it); the next built step sends it.
        let mut u = Promises::new();
        u.allocated(alloc("a", 32, true));
        u.take_step(false);
        assert!(!u.request_finished(&"a".into()));
        p.take_step(false);
        assert!(p.take_step(true).failed_async.is_empty());
        p.received(&["a".into()]);
        assert!(!p.request_finished(&"a".into()));
        let mut r = Promises::new();
        r.allocated(alloc("a", 32, true));
        r.take_step(true);
        assert!(r.request_finished(&"a".into()));
        assert!(!r.request_finished(&"a".into()), "owed once");
    }

    #[test]
    fn a_sync_load_only_marks_the_step() {
        let mut p = Promises::new();
        p.allocated(alloc("s", 16, false));
        p.allocated(alloc("z", 0, true));
        let out = p.take_step(true);
        assert!(out.sync_loads);
        assert!(!p.take_step(true).sync_loads);
        assert!(!p.request_finished(&"s".into()));
        assert!(!p.request_finished(&"z".into()));
    }

    #[test]
    fn a_failed_async_load_is_carried_once_and_expected_even_unbuilt() {
        let mut p = Promises::new();
        let mut a = alloc("f", 32, true);
        a.failed = blocks(&[4, 5]);
        p.allocated(a);
        let mut s = alloc("g", 16, false);
        s.failed = blocks(&[9]);
        p.allocated(s);
        let out = p.take_step(false);
        assert_eq!(
            out.failed_loads,
            vec![("f".into(), blocks(&[4, 5])), ("g".into(), blocks(&[9]))]
        );
        assert_eq!(out.failed_async, vec![RequestId::from("f")]);
        assert_eq!(p.take_step(true), StepOutbox::default());
        // The workers report it: the engine waits for that report.
        assert!(p.request_finished(&"f".into()));
        assert!(!p.request_finished(&"g".into()));
    }

    #[test]
    fn a_failed_load_withdrawn_before_its_step_is_not_carried() {
        let mut p = Promises::new();
        let mut a = alloc("f", 32, false);
        a.failed = blocks(&[4]);
        p.allocated(a);
        assert!(!p.request_finished(&"f".into()));
        assert!(p.take_step(true).failed_loads.is_empty());
    }

    #[test]
    fn a_failed_async_load_withdrawn_before_its_step_leaves_nothing_behind() {
        let mut p = Promises::new();
        let mut a = alloc("f", 32, true);
        a.failed = blocks(&[4]);
        p.allocated(a);
        assert!(!p.request_finished(&"f".into()));
        let out = p.take_step(true);
        assert!(
            out.failed_loads.is_empty() && out.failed_async.is_empty(),
            "{out:?}"
        );
        assert!(
            p.expected.is_empty(),
            "a finished request stays expected forever"
        );
        assert!(!p.request_finished(&"f".into()));
    }

    #[test]
    fn an_incomplete_allocation_records_only_the_promise() {
        let mut p = Promises::new();
        let mut a = alloc("i", 32, true);
        a.groups = 2;
        a.complete = false;
        a.loading = vec![0];
        a.failed = blocks(&[1]);
        p.allocated(a);
        let out = p.take_step(true);
        assert!(out.failed_loads.is_empty() && out.recv_groups.is_empty());
        assert!(p.request_finished(&"i".into()));
    }

    #[test]
    fn several_groups_carry_the_groups_each_request_waits_for() {
        let mut p = Promises::new();
        let mut a = alloc("r", 32, true);
        a.groups = 2;
        a.loading = vec![1];
        a.hit_sources = Some(vec![("disk".into(), 32)]);
        p.allocated(a);
        let mut s = alloc("s", 32, false);
        s.groups = 2;
        s.loading = vec![0, 1];
        p.allocated(s);
        p.delay_free("d".into(), vec![0], true);
        p.delay_free("e".into(), vec![], false);
        let out = p.take_step(true);
        assert_eq!(out.recv_groups, vec![("r".into(), vec![1])]);
        assert_eq!(out.delayed_groups, vec![("d".into(), vec![0])]);
        assert_eq!(out.delayed_frees, vec![RequestId::from("d"), "e".into()]);
        assert_eq!(p.take_step(true), StepOutbox::default());
        // Group 0's sources once; a finished request's are forgotten.
        assert_eq!(
            p.take_hit_sources(&"r".into()),
            Some(vec![("disk".into(), 32)])
        );
        assert_eq!(p.take_hit_sources(&"r".into()), None);
        let mut t = alloc("t", 32, true);
        t.hit_sources = Some(vec![("host".into(), 32)]);
        p.allocated(t);
        p.request_finished(&"t".into());
        assert_eq!(p.take_hit_sources(&"t".into()), None);
    }

    #[test]
    fn a_finished_request_takes_its_unsent_groups_and_failures_with_it() {
        let mut p = Promises::new();
        let mut a = alloc("r", 32, true);
        a.groups = 2;
        a.loading = vec![0, 1];
        p.allocated(a);
        p.request_finished(&"r".into());
        assert!(p.take_step(true).recv_groups.is_empty());
    }
}
