//! Layered sync loads of a [`Worker`]: which layers of the bound step's layered loads the engine
//! has made its stream wait for, and the failure of a load with a layer it never waited for.
//!
//! Invariants: a layer is ordered at most once per load; a layered load whose gate could not
//! order a layer, or with a layer not waited for by the end of the forward pass, puts its device
//! blocks in `load_errors` at once (the engine reads them right after the step) and is counted
//! failed exactly once, whatever its copies later do; its request's stores of the step are dropped.
use std::sync::Arc;

use super::Worker;
use crate::ids::JobId;
use crate::ids::RequestId;
use crate::transfer::LayerGate;

/// A layered sync load of the bound step: which of its layers the engine's stream waits for.
pub(super) struct StepGate {
    pub(super) job: JobId,
    pub(super) request: RequestId,
    pub(super) gate: Arc<dyn LayerGate>,
    pub(super) awaited: Vec<bool>,
}

impl Worker {
    /// Let ordered sync loads go layer by layer in steps started with
    /// [`Self::start_load_layered`]: the engine's stream then waits for one layer's copies at a
    /// time ([`Self::wait_for_layer`], before that layer's attention), so copies of later layers
    /// run beside the forward pass of earlier ones. Needs ordered sync loads. Off by default.
    pub fn set_layered_sync_loads(&mut self, yes: bool) {
        self.layered_sync_loads = yes;
    }

    /// Whether the bound step has layered loads whose layers the engine must wait for one by
    /// one ([`Self::wait_for_layer`]); the engine may skip its per-layer hooks otherwise.
    pub fn has_layered_loads(&self) -> bool {
        !self.layered_dsts.is_empty() || !self.gates.is_empty()
    }

    /// Before the engine's forward pass reads `layer` (`None`: every layer) on `engine_stream`:
    /// block until the step's sync loads are done or ordered ahead of the stream; for a layered
    /// load, make the stream wait for that layer's copies (without a stream, or for a layer the
    /// load does not know, for all of them; a gate that cannot order the stream makes the load
    /// fail at once, its blocks recomputed).
    pub fn wait_for_layer(&mut self, layer: Option<usize>, engine_stream: Option<u64>) {
        if !self.bound_loads.is_empty() {
            self.start_load(None);
        }
        self.wait_enqueued();
        let mut cpu_wait = Vec::new();
        let mut failed = Vec::new();
        for g in &mut self.gates {
            let n = g.awaited.len();
            let range = match layer {
                Some(l) if l < n => l..l + 1,
                _ => 0..n,
            };
            for l in range {
                if g.awaited[l] {
                    continue;
                }
                g.awaited[l] = true;
                match engine_stream {
                    Some(s) => {
                        if let Err(e) = g.gate.wait_layer(l, s) {
                            kvtier_warn_gate(&e);
                            failed.push(g.job);
                        }
                    }
                    None => cpu_wait.push(g.job),
                }
            }
        }
        for job in failed {
            self.fail_layered_now(job);
        }
        for job in cpu_wait {
            while self.jobs.contains_key(&job) {
                match self.done_rx.recv() {
                    Ok(n) => self.on_note(n),
                    Err(_) => break,
                }
            }
        }
    }

    /// Block until every sync load of the step is done or ordered ahead of the engine's stream
    /// (its `Enqueued` note, with its gate, received).
    pub(super) fn wait_enqueued(&mut self) {
        while self.sync_pending > self.sync_enqueued.len() {
            match self.done_rx.recv() {
                Ok(n) => self.on_note(n),
                Err(_) => break,
            }
        }
    }

    /// Report a layered load failed before its copies finished (the engine's forward pass may
    /// have read a layer before its bytes arrived): its blocks go to `take_load_errors` now, its
    /// request's stores of this step are dropped, and the job's outcome becomes a failure.
    pub(super) fn fail_layered_now(&mut self, job: JobId) {
        let Some(dsts) = self.layered_dsts.remove(&job) else {
            return; // already reported
        };
        self.note_load_errors(dsts, true);
        if let Some(g) = self.gates.iter().find(|g| g.job == job) {
            self.poisoned.insert(g.request.clone());
        }
        if self.jobs.contains_key(&job) {
            self.failed_early.insert(job);
        }
    }
}

fn kvtier_warn_gate(e: &crate::transfer::TransferError) {
    crate::warn_limited!(error = %e, "a layered load could not order the engine's stream; reporting it failed");
}

pub(super) fn kvtier_warn_unawaited(job: JobId) {
    crate::warn_limited!(
        job = job.0,
        "a layered load had layers the engine never waited for before its forward pass; reporting it failed (vLLM recomputes it)"
    );
}
