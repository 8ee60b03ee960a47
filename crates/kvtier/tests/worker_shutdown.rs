//! `Worker::shutdown(timeout)` and `Worker::wait_idle_within(timeout)` are bounded: a worker whose
//! transfer never returns gives up at the deadline (shutdown with an error naming the threads
//! still running); an idle one stops at once.
#![allow(clippy::unwrap_used)]

use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier::connector::{Leader, LeaderConfig, SchedulerStep, StepRecord, Worker, WorkerLink};
use kvtier::hash::HashSalt;
use kvtier::ids::{DeviceBlockId, Tier};
use kvtier::transfer::{BlockTransfer, Fence, TransferError, TransferJob, TransferOutcome};

/// A transfer whose `execute` blocks until the gate opens (a sender is dropped or sends).
struct Gated(Mutex<Receiver<()>>);

impl BlockTransfer for Gated {
    fn bytes_per_block(&self) -> usize {
        64
    }
    fn has_tier(&self, _tier: Tier) -> bool {
        true
    }
    fn fence(&self, _engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        Ok(Fence::none())
    }
    fn execute(&self, _job: &TransferJob, _fence: &Fence) -> TransferOutcome {
        let _ = self.0.lock().unwrap().recv();
        TransferOutcome::Ok
    }
}

/// A worker of one executor thread that was handed one store job.
fn worker_with_a_store(transfer: Arc<dyn BlockTransfer>) -> Worker {
    let mut leader = Leader::new(LeaderConfig::new(4, HashSalt(3), 16)).unwrap();
    let meta = leader
        .build_step(&SchedulerStep {
            records: vec![StepRecord {
                request_id: "a".into(),
                new_tokens: (0..8).collect(),
                new_block_ids: vec![DeviceBlockId(0), DeviceBlockId(1)],
                num_scheduled_tokens: 8,
                is_new: true,
                ..Default::default()
            }],
            finished: vec![],
        })
        .unwrap();
    assert_eq!(meta.stores.len(), 1);
    let link = WorkerLink::in_process(0, 1, leader.report_sender());
    let mut w = Worker::with_threads(transfer, link, 1);
    w.bind(&meta);
    w.forward_done(None);
    w
}

#[test]
fn shutdown_gives_up_at_its_deadline_and_names_the_stuck_thread() {
    let (gate, rx) = channel::<()>();
    let w = worker_with_a_store(Arc::new(Gated(Mutex::new(rx))));
    let started = Instant::now();
    let err = w.shutdown(Duration::from_millis(100)).unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(
        (err.rank, err.threads.as_slice()),
        (0, &["kvtier-w0-0".to_string()][..])
    );
    drop(gate); // the stuck transfer returns; its thread ends on its own
}

#[test]
fn shutdown_of_a_worker_whose_jobs_end_joins_every_thread() {
    let (gate, rx) = channel::<()>();
    let w = worker_with_a_store(Arc::new(Gated(Mutex::new(rx))));
    gate.send(()).unwrap();
    w.shutdown(Duration::from_secs(10)).unwrap();
}

#[test]
fn wait_idle_within_gives_up_at_its_deadline_and_succeeds_once_jobs_end() {
    let (gate, rx) = channel::<()>();
    let mut w = worker_with_a_store(Arc::new(Gated(Mutex::new(rx))));
    let started = Instant::now();
    assert!(!w.wait_idle_within(Duration::from_millis(100)));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(w.jobs_in_flight(), 1);
    gate.send(()).unwrap();
    assert!(w.wait_idle_within(Duration::from_secs(10)));
    assert_eq!(w.jobs_in_flight(), 0);
    w.shutdown(Duration::from_secs(10)).unwrap();
}
