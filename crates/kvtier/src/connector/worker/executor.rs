//! The executor threads of a [`Worker`](super::Worker): each takes tasks (jobs behind one fence) from
//! the worker's queue, runs every job through the [`BlockTransfer`], and reports it to the leader and
//! then to the worker, in job order within a task.
//!
//! Invariants: every job of a task taken is run and reported exactly once, to both; a panic inside
//! a transfer is the failure of every pair of its job; an ordered job (a sync load with an engine
//! stream) tells the worker `Enqueued` before its `Done`, on the same channel; an executor ends
//! when the queue's sender is gone or the worker stopped listening.
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use super::WorkerLink;
use crate::connector::messages::{remote_key_for_rank, WorkerReport};
use crate::ids::JobId;
use crate::transfer::{
    BlockFailure, BlockTransfer, Fence, LayerGate, TransferJob, TransferOutcome,
};

pub(super) struct Task {
    pub(super) jobs: Vec<TransferJob>,
    pub(super) fence: Fence,
    /// Ordered sync loads: the engine stream that must wait for these jobs' copies.
    pub(super) order: Option<Order>,
    /// When the task was handed to the executor (profiling: `KVTIER_LOG=kvtier_timing=debug`).
    pub(super) queued: std::time::Instant,
}

/// How an ordered task's copies are put ahead of the engine's stream.
#[derive(Clone, Copy, Debug)]
pub(super) struct Order {
    /// The engine's stream (raw handle).
    pub(super) stream: u64,
    /// Layer by layer ([`BlockTransfer::execute_layered`]) rather than the whole job at once.
    pub(super) layered: bool,
}

pub(super) struct Done {
    pub(super) job: TransferJob,
    pub(super) outcome: TransferOutcome,
}

/// What executors tell the worker.
pub(super) enum Note {
    /// An ordered job's copies are enqueued and the engine's stream waits for them (`None`), or
    /// can be made to wait for them layer by layer (the gate).
    Enqueued(JobId, Option<Arc<dyn LayerGate>>),
    Done(Done),
}

pub(super) fn fail_all(job: &TransferJob, reason: &str) -> TransferOutcome {
    if job.is_empty() {
        return TransferOutcome::Ok;
    }
    TransferOutcome::Failed(
        (0..job.len())
            .map(|i| BlockFailure {
                pair_index: i,
                reason: reason.to_owned(),
            })
            .collect(),
    )
}

/// The executors' side of the task queue: the next task, or `None` once the worker dropped its
/// sender (the executor then ends). Several executors share one queue.
pub(super) trait TaskSource {
    fn next_task(&self) -> Option<Task>;
}

/// Where executors put finished jobs; false once the worker is gone (the executor then ends).
pub(super) trait DoneSink {
    fn job_done(&self, done: Done) -> bool;
    /// An ordered job's copies are enqueued ahead of the engine's stream (or, with a gate, can
    /// be put ahead of it layer by layer).
    fn job_enqueued(&self, job: JobId, gate: Option<Arc<dyn LayerGate>>);
}

impl TaskSource for Arc<Mutex<Receiver<Task>>> {
    fn next_task(&self) -> Option<Task> {
        let guard = self.lock().ok()?;
        guard.recv().ok()
    }
}

impl DoneSink for Sender<Note> {
    fn job_done(&self, done: Done) -> bool {
        self.send(Note::Done(done)).is_ok()
    }
    fn job_enqueued(&self, job: JobId, gate: Option<Arc<dyn LayerGate>>) {
        let _ = self.send(Note::Enqueued(job, gate));
    }
}

/// One executor thread: runs every job of every task it takes, reports each to the leader and
/// to the worker, in job order within a task. Generic over the queue so that the loom model
/// (`loom_tests`) runs this very function over loom's primitives.
pub(super) fn executor(
    rx: impl TaskSource,
    done: impl DoneSink,
    transfer: Arc<dyn BlockTransfer>,
    link: WorkerLink,
) {
    while let Some(task) = rx.next_task() {
        let waited = task.queued.elapsed();
        for job in task.jobs {
            let started = std::time::Instant::now();
            let mut run = job.clone();
            // Remote keys are per rank; disk keys stay sequence hashes (each rank has its own
            // disk files, and the leader re-registers recovered disk blocks by hash).
            run.map_remote_keys(|k| remote_key_for_rank(k, link.rank, link.world_size));
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match task.order {
                Some(Order {
                    stream,
                    layered: false,
                }) => {
                    let id = job.id;
                    transfer.execute_ordered(&run, &task.fence, stream, &mut || {
                        done.job_enqueued(id, None)
                    })
                }
                Some(Order {
                    stream,
                    layered: true,
                }) => {
                    let id = job.id;
                    transfer.execute_layered(&run, &task.fence, stream, &mut |gate| {
                        done.job_enqueued(id, gate)
                    })
                }
                None => transfer.execute(&run, &task.fence),
            }))
            .unwrap_or_else(|_| fail_all(&job, "transfer panicked"));
            // Profiling aid: where a job's time goes from the step that submitted it.
            tracing::debug!(
                target: "kvtier_timing",
                job = job.id.0,
                blocks = job.len(),
                src = job.src_tier().label(),
                dst = job.dst_tier().label(),
                task_waited_us = waited.as_micros() as u64,
                run_us = started.elapsed().as_micros() as u64,
                "executor ran a job"
            );
            if let Err(e) = link.sink.send(WorkerReport {
                rank: link.rank,
                job: job.id,
                outcome: outcome.clone(),
            }) {
                tracing::error!(error = %e, job = job.id.0, "could not report to the leader");
            }
            if !done.job_done(Done { job, outcome }) {
                return;
            }
        }
    }
}

/// Every interleaving (loom) of two executors sharing one task queue with the worker that feeds
/// it: each job runs and is reported exactly once, to the leader and to the worker; dropping the
/// queue's sender ends both executors (no lost wakeup, no deadlock). Run by
/// scripts/check-concurrency.sh (`cargo test -p kvtier --features loom --lib loom_tests`).
#[cfg(all(test, feature = "loom"))]
mod loom_tests;
