//! Ordered sync loads (`Worker::set_ordered_sync_loads`, `BlockTransfer::execute_ordered`).
//!
//! vLLM starts a step's sync loads in `start_load_kv` and launches the forward pass right after
//! it on the same stream (vllm/v1/worker/kv_connector_model_runner_mixin.py: `start_load_kv`
//! before the `yield` when `scheduler_output.has_sync_kv_loads`). With ordering on,
//! `wait_for_layer_load` returns as soon as the transfer has made that stream wait for the
//! load's copies (its `enqueued` call), not when the copies completed; what must still hold:
//! - the load's job stays in flight (its source blocks held) until it completed;
//! - a load that failed before it could be ordered is waited for on the CPU, and its blocks are
//!   load errors before the forward pass runs;
//! - only sync loads with an engine stream are ordered: async loads, stores, and sync loads of
//!   a worker without ordering (or of a synchronous engine, no stream) run as before.
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtier::connector::messages::{RequestLoad, StepMetadata};
use kvtier::connector::{Worker, WorkerLink};
use kvtier::transfer::{
    BlockFailure, BlockTransfer, Fence, TransferError, TransferJob, TransferOutcome,
};
use kvtier::{BlockId, DeviceBlockId, JobId, RequestId, Tier};

/// Host blocks numbered this fail (as a vanished source would) before anything is enqueued.
const BAD_SRC: u32 = 666;

/// A transfer whose ordered jobs call `enqueued` and then hold until the test opens the gate
/// (the copies "run" on the device); other jobs finish at once.
#[derive(Default)]
struct Gated {
    open: Mutex<bool>,
    cv: Condvar,
    ordered: Mutex<Vec<(u64, u64)>>,
    plain: Mutex<Vec<u64>>,
}

impl Gated {
    fn open(&self) {
        if let Ok(mut g) = self.open.lock() {
            *g = true;
        }
        self.cv.notify_all();
    }
}

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
    fn execute(&self, job: &TransferJob, _fence: &Fence) -> TransferOutcome {
        self.plain.lock().expect("plain").push(job.id.0);
        TransferOutcome::Ok
    }
    fn execute_ordered(
        &self,
        job: &TransferJob,
        _fence: &Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(),
    ) -> TransferOutcome {
        self.ordered
            .lock()
            .expect("ordered")
            .push((job.id.0, engine_stream));
        let bad: Vec<BlockFailure> = job
            .pairs()
            .enumerate()
            .filter(|(_, (src, _))| src.number() == Some(BAD_SRC))
            .map(|(i, _)| BlockFailure {
                pair_index: i,
                reason: "source vanished".into(),
            })
            .collect();
        if !bad.is_empty() {
            return TransferOutcome::Failed(bad);
        }
        enqueued();
        let mut g = self.open.lock().expect("gate");
        while !*g {
            g = self.cv.wait(g).expect("gate");
        }
        TransferOutcome::Ok
    }
}

fn load(req: &str, sync: bool, id: u64, srcs: &[u32]) -> RequestLoad {
    RequestLoad {
        request: RequestId::from(req),
        sync,
        jobs: vec![TransferJob::from_pairs(
            JobId(id),
            srcs.iter()
                .enumerate()
                .map(|(i, &s)| (BlockId(s), DeviceBlockId(10 + i as u32))),
        )],
        failed_devices: Vec::new(),
    }
}

fn worker(t: &Arc<Gated>, ordered: bool) -> (Worker, Receiver<kvtier::connector::WorkerReport>) {
    let (tx, rx): (Sender<_>, _) = channel();
    let mut w = Worker::new(t.clone(), WorkerLink::in_process(0, 1, tx));
    w.set_ordered_sync_loads(ordered);
    (w, rx)
}

fn step(loads: Vec<RequestLoad>) -> StepMetadata {
    StepMetadata {
        version: kvtier::connector::messages::PROTOCOL_VERSION,
        step: 1,
        loads,
        ..Default::default()
    }
}

/// Opens the gate after `after` unless the test opened it first; returns when it opened it.
fn watchdog(t: &Arc<Gated>, after: Duration) -> std::thread::JoinHandle<Instant> {
    let t = t.clone();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        t.open();
        Instant::now()
    })
}

#[test]
fn an_ordered_sync_load_lets_the_engine_go_on_before_its_copies_complete() {
    let t = Arc::new(Gated::default());
    let (mut w, _rx) = worker(&t, true);
    w.bind(&step(vec![load("r", true, 1, &[1, 2])]));
    let dog = watchdog(&t, Duration::from_secs(3));
    let started = Instant::now();
    w.start_load(Some(77));
    w.wait_for_layer_load(0);
    // The gate is still shut: the wait did not wait for the copies.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "wait_for_layer_load waited for completion"
    );
    assert_eq!(
        w.jobs_in_flight(),
        1,
        "the job must stay in flight until it completed"
    );
    assert_eq!(*t.ordered.lock().expect("ordered"), vec![(1, 77)]);
    assert!(t.plain.lock().expect("plain").is_empty());
    t.open();
    w.forward_done(Some(77));
    w.wait_idle();
    assert_eq!(w.jobs_in_flight(), 0);
    assert!(w.take_load_errors().is_empty());
    let _ = dog.join();
}

#[test]
fn a_sync_load_that_failed_before_ordering_is_waited_for_and_its_blocks_are_errors() {
    let t = Arc::new(Gated::default());
    let (mut w, _rx) = worker(&t, true);
    w.bind(&step(vec![load("r", true, 1, &[1, BAD_SRC, 3])]));
    w.start_load(Some(5));
    w.wait_for_layer_load(0);
    // Completed (failed) before the wait returned: the forward pass can be told at once.
    assert_eq!(w.jobs_in_flight(), 0);
    assert_eq!(w.take_load_errors(), vec![DeviceBlockId(11)]);
}

#[test]
fn async_loads_and_unordered_workers_are_not_ordered() {
    // Same step: one sync and one async load; only the sync one is ordered.
    let t = Arc::new(Gated::default());
    let (mut w, _rx) = worker(&t, true);
    w.bind(&step(vec![
        load("s", true, 1, &[1]),
        load("a", false, 2, &[2]),
    ]));
    let dog = watchdog(&t, Duration::from_secs(3));
    w.start_load(Some(9));
    w.wait_for_layer_load(0);
    t.open();
    w.wait_idle();
    let _ = dog.join();
    assert_eq!(*t.ordered.lock().expect("ordered"), vec![(1, 9)]);
    assert_eq!(*t.plain.lock().expect("plain"), vec![2]);

    // Ordering off, or no engine stream (a synchronous engine): every load runs as `execute`.
    for (ordered, stream) in [(false, Some(9)), (true, None)] {
        let t = Arc::new(Gated::default());
        let (mut w, _rx) = worker(&t, ordered);
        w.bind(&step(vec![load("s", true, 3, &[1])]));
        w.start_load(stream);
        w.wait_for_layer_load(0);
        assert_eq!(
            w.jobs_in_flight(),
            0,
            "an unordered sync load completes first"
        );
        assert!(t.ordered.lock().expect("ordered").is_empty());
        assert_eq!(*t.plain.lock().expect("plain"), vec![3]);
    }
}
