//! Every interleaving (loom) of two executors sharing one task queue with the worker that feeds
//! it: each job runs and is reported exactly once, to the leader and to the worker; dropping the
//! queue's sender ends both executors (no lost wakeup, no deadlock). Run by
//! scripts/check-concurrency.sh (`cargo test -p kvtier --features loom --lib loom_tests`).
use super::*;
use crate::connector::worker::ReportSink;
use crate::connector::ConnectorError;
use crate::ids::Tier;
use loom::sync::mpsc as lmpsc;

use loom::sync::{Arc as LArc, Condvar, Mutex as LMutex};
use std::collections::VecDeque;

/// std's mpsc channel as the executors use it, over loom's primitives (loom's own mpsc does
/// not model a sender's drop): `recv` blocks until a task arrives or every sender is gone.
struct Chan {
    state: LMutex<(VecDeque<Task>, usize)>,
    cv: Condvar,
}
struct TaskTx(LArc<Chan>);
struct TaskRx(LArc<Chan>);

fn task_channel() -> (TaskTx, TaskRx) {
    let c = LArc::new(Chan {
        state: LMutex::new((VecDeque::new(), 1)),
        cv: Condvar::new(),
    });
    (TaskTx(c.clone()), TaskRx(c))
}

impl TaskTx {
    fn send(&self, t: Task) {
        if let Ok(mut g) = self.0.state.lock() {
            g.0.push_back(t);
        }
        self.0.cv.notify_one();
    }
}

impl Drop for TaskTx {
    fn drop(&mut self) {
        if let Ok(mut g) = self.0.state.lock() {
            g.1 -= 1;
        }
        self.0.cv.notify_all();
    }
}

impl TaskRx {
    fn recv(&self) -> Option<Task> {
        let mut g = self.0.state.lock().ok()?;
        loop {
            if let Some(t) = g.0.pop_front() {
                return Some(t);
            }
            if g.1 == 0 {
                return None;
            }
            g = self.0.cv.wait(g).ok()?;
        }
    }
}

// The production shape: executors share the receiver behind a mutex and block in `recv`
// while holding it.
impl TaskSource for LArc<LMutex<TaskRx>> {
    fn next_task(&self) -> Option<Task> {
        let guard = self.lock().ok()?;
        guard.recv()
    }
}

impl DoneSink for lmpsc::Sender<Done> {
    fn job_done(&self, done: Done) -> bool {
        self.send(done).is_ok()
    }
    fn job_enqueued(
        &self,
        _job: JobId,
        _gate: Option<std::sync::Arc<dyn crate::transfer::LayerGate>>,
    ) {
    }
}

struct Instant1;
impl BlockTransfer for Instant1 {
    fn bytes_per_block(&self) -> usize {
        1
    }
    fn has_tier(&self, _tier: Tier) -> bool {
        true
    }
    fn fence(&self, _s: Option<u64>) -> Result<Fence, crate::transfer::TransferError> {
        Ok(Fence::none())
    }
    fn execute(&self, _job: &TransferJob, _fence: &Fence) -> TransferOutcome {
        TransferOutcome::Ok
    }
}

struct Reports(std::sync::Mutex<Vec<u64>>);
impl ReportSink for Reports {
    fn send(&self, report: WorkerReport) -> Result<(), ConnectorError> {
        self.0
            .lock()
            .map_err(|_| ConnectorError::Channel("poisoned".into()))?
            .push(report.job.0);
        Ok(())
    }
}

fn job(id: u64) -> TransferJob {
    TransferJob::from_pairs(
        JobId(id),
        [(crate::ids::BlockId(0), crate::ids::DeviceBlockId(0))],
    )
}

#[test]
fn two_executors_run_every_job_once_and_stop_when_the_queue_closes() {
    loom::model(|| {
        let (task_tx, task_rx) = task_channel();
        let task_rx = LArc::new(LMutex::new(task_rx));
        let (done_tx, done_rx) = lmpsc::channel::<Done>();
        let reports = Arc::new(Reports(std::sync::Mutex::new(Vec::new())));
        let link = WorkerLink {
            rank: 0,
            world_size: 1,
            sink: reports.clone(),
        };
        let transfer: Arc<dyn BlockTransfer> = Arc::new(Instant1);
        let mut threads = Vec::new();
        for _ in 0..2 {
            let (rx, done, t, l) = (
                task_rx.clone(),
                done_tx.clone(),
                transfer.clone(),
                link.clone(),
            );
            threads.push(loom::thread::spawn(move || executor(rx, done, t, l)));
        }
        drop(done_tx);
        for id in [1u64, 2] {
            let task = Task {
                jobs: vec![job(id)],
                fence: Fence::none(),
                order: None,
                queued: std::time::Instant::now(),
            };
            task_tx.send(task);
        }
        drop(task_tx);
        for t in threads {
            t.join().expect("executor panicked");
        }
        let mut seen: Vec<u64> = Vec::new();
        while let Ok(d) = done_rx.try_recv() {
            seen.push(d.job.id.0);
        }
        seen.sort_unstable();
        assert_eq!(seen, vec![1, 2]);
        let mut reported = reports.0.lock().map(|v| v.clone()).unwrap_or_default();
        reported.sort_unstable();
        assert_eq!(reported, vec![1, 2]);
    });
}
