//! Layered sync loads (`Worker::set_layered_sync_loads`, `Worker::start_load_layered`,
//! `BlockTransfer::execute_layered`, `Worker::wait_for_layer`).
//!
//! vLLM calls `wait_for_layer_load(layer_name)` right before each attention layer reads its KV,
//! when the connector says `has_connector_metadata()` (vllm/model_executor/layers/attention/
//! kv_transfer_utils.py, `maybe_transfer_kv_layer`), and skips those hooks in a step replayed as
//! one full CUDA graph (vllm/distributed/kv_transfer/kv_connector/v1/base.py,
//! `requires_piecewise_for_cudagraph`: "cannot be captured in CUDA graphs and will be skipped
//! during replay"). What must hold:
//! - each layer's wait orders the engine's stream after that layer's copies only, and returns
//!   before the copies completed;
//! - a layered load with a layer the engine never waited for before its forward pass ended is
//!   reported failed at once (its blocks in `take_load_errors` in the same step: vLLM reads them
//!   right after `wait_for_save`) and the request's stores of the step are dropped;
//! - a gate that cannot order the stream fails the load the same way;
//! - without the worker setting, or in a step not started layered, loads are ordered whole.
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvtier::connector::messages::{RequestLoad, RequestStore, StepMetadata, WorkerReport};
use kvtier::connector::{Worker, WorkerLink};
use kvtier::transfer::{
    BlockTransfer, Blocks, Fence, LayerGate, TransferError, TransferJob, TransferOutcome,
};
use kvtier::{BlockId, DeviceBlockId, JobId, RequestId, Tier};

const LAYERS: usize = 4;
/// A gate asked to order this layer fails (as a CUDA error would).
const BAD_LAYER: usize = 1;

#[derive(Default)]
struct Held {
    open: Mutex<bool>,
    cv: Condvar,
    /// (layer, stream) per `wait_layer`, in call order.
    waits: Mutex<Vec<(usize, u64)>>,
    /// Jobs run whole-ordered / layered.
    whole: Mutex<Vec<u64>>,
    layered: Mutex<Vec<u64>>,
    fail_layer: Mutex<bool>,
    /// How long a layered job takes before it hands over its gate (an executor thread still
    /// enqueueing when the forward pass ends).
    enqueue_delay: Mutex<Duration>,
}

impl Held {
    fn open(&self) {
        if let Ok(mut g) = self.open.lock() {
            *g = true;
        }
        self.cv.notify_all();
    }
    fn hold(&self) {
        let mut g = self.open.lock().expect("gate");
        while !*g {
            g = self.cv.wait(g).expect("gate");
        }
    }
    fn waits(&self) -> Vec<(usize, u64)> {
        self.waits.lock().expect("waits").clone()
    }
}

struct Gate(Arc<Held>);

impl LayerGate for Gate {
    fn layers(&self) -> usize {
        LAYERS
    }
    fn wait_layer(&self, layer: usize, engine_stream: u64) -> Result<(), TransferError> {
        assert!(
            layer < LAYERS,
            "layer {layer} asked of a {LAYERS}-layer gate"
        );
        if layer == BAD_LAYER && *self.0.fail_layer.lock().expect("fail") {
            return Err(TransferError::Cuda("cuStreamWaitEvent failed".into()));
        }
        self.0
            .waits
            .lock()
            .expect("waits")
            .push((layer, engine_stream));
        Ok(())
    }
}

struct Transfer(Arc<Held>);

impl BlockTransfer for Transfer {
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
        TransferOutcome::Ok
    }
    fn execute_ordered(
        &self,
        job: &TransferJob,
        _fence: &Fence,
        _engine_stream: u64,
        enqueued: &mut dyn FnMut(),
    ) -> TransferOutcome {
        self.0.whole.lock().expect("whole").push(job.id.0);
        enqueued();
        self.0.hold();
        TransferOutcome::Ok
    }
    fn execute_layered(
        &self,
        job: &TransferJob,
        _fence: &Fence,
        _engine_stream: u64,
        enqueued: &mut dyn FnMut(Option<Arc<dyn LayerGate>>),
    ) -> TransferOutcome {
        self.0.layered.lock().expect("layered").push(job.id.0);
        std::thread::sleep(*self.0.enqueue_delay.lock().expect("delay"));
        enqueued(Some(Arc::new(Gate(Arc::clone(&self.0)))));
        self.0.hold();
        TransferOutcome::Ok
    }
}

/// A job between the device and the host tier, by block number.
fn job(id: u64, src: Tier, dst: Tier, pairs: &[(u32, u32)]) -> TransferJob {
    let side = |tier: Tier, n: Vec<u32>| match tier {
        Tier::Device => Blocks::Device(n.into_iter().map(DeviceBlockId).collect()),
        _ => Blocks::Host(n.into_iter().map(BlockId).collect()),
    };
    let (s, d): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
    TransferJob::new(JobId(id), side(src, s), side(dst, d)).expect("equal sides")
}

/// Request `r`: a sync load of host blocks 1, 2 into device blocks 10, 11, and a store of
/// device block 12 computed over it in the same step.
fn step() -> StepMetadata {
    StepMetadata {
        version: kvtier::connector::messages::PROTOCOL_VERSION,
        step: 1,
        loads: vec![RequestLoad {
            request: RequestId::from("r"),
            sync: true,
            jobs: vec![job(1, Tier::Host, Tier::Device, &[(1, 10), (2, 11)])],
            failed_devices: Vec::new(),
        }],
        stores: vec![RequestStore {
            request: RequestId::from("r"),
            job: job(2, Tier::Device, Tier::Host, &[(12, 5)]),
        }],
        ..Default::default()
    }
}

fn worker(layered: bool) -> (Worker, Arc<Held>, Receiver<WorkerReport>) {
    let held = Arc::new(Held::default());
    let (tx, rx) = channel();
    let mut w = Worker::new(
        Arc::new(Transfer(Arc::clone(&held))),
        WorkerLink::in_process(0, 1, tx),
    );
    w.set_ordered_sync_loads(true);
    w.set_layered_sync_loads(layered);
    (w, held, rx)
}

/// Opens the gate after `after` (a test that hangs would otherwise never end).
fn watchdog(h: &Arc<Held>, after: Duration) -> std::thread::JoinHandle<()> {
    let h = Arc::clone(h);
    std::thread::spawn(move || {
        std::thread::sleep(after);
        h.open();
    })
}

fn store_failed(rx: &Receiver<WorkerReport>) -> bool {
    rx.try_iter()
        .any(|r| r.job == JobId(2) && !r.outcome.failed_pairs().is_empty())
}

#[test]
fn each_layer_is_ordered_when_its_attention_asks_and_not_before() {
    let (mut w, held, rx) = worker(true);
    let dog = watchdog(&held, Duration::from_secs(5));
    let started = Instant::now();
    w.bind(&step());
    w.start_load_layered(Some(7), true);
    assert!(
        w.has_layered_loads(),
        "vLLM must be told to call the per-layer hooks"
    );
    for l in 0..LAYERS {
        w.wait_for_layer(Some(l), Some(7));
        let want: Vec<(usize, u64)> = (0..=l).map(|k| (k, 7)).collect();
        assert_eq!(held.waits(), want, "after the wait for layer {l}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "a layer's wait waited for the copies"
    );
    // The load (in flight until its copies complete) and the step's store (bound).
    assert_eq!(w.jobs_in_flight(), 2, "the load must stay in flight");
    w.forward_done(Some(7));
    assert!(w.take_load_errors().is_empty());
    held.open();
    w.wait_idle();
    assert!(w.take_load_errors().is_empty());
    assert!(
        !store_failed(&rx),
        "the store over a complete load was dropped"
    );
    assert!(!w.has_layered_loads());
    assert_eq!(*held.layered.lock().expect("layered"), vec![1]);
    drop(dog); // it opens a gate nobody waits on any more
}

#[test]
fn a_layer_never_waited_for_fails_the_load_in_the_same_step() {
    let (mut w, held, rx) = worker(true);
    let dog = watchdog(&held, Duration::from_secs(5));
    w.bind(&step());
    w.start_load_layered(Some(7), true);
    for l in [0, 1, 3] {
        w.wait_for_layer(Some(l), Some(7));
    }
    w.forward_done(Some(7));
    let mut errs = w.take_load_errors();
    errs.sort();
    // The copies are still held: the errors come from the missing wait, not from an outcome.
    assert_eq!(w.jobs_in_flight(), 1);
    assert_eq!(errs, vec![DeviceBlockId(10), DeviceBlockId(11)]);
    assert!(
        store_failed(&rx),
        "the store computed over the unordered layer was kept"
    );
    held.open();
    w.wait_idle();
    assert!(
        w.take_load_errors().is_empty(),
        "the blocks were reported twice"
    );
    drop(dog); // it opens a gate nobody waits on any more
}

#[test]
fn a_gate_that_cannot_order_the_stream_fails_the_load() {
    let (mut w, held, rx) = worker(true);
    *held.fail_layer.lock().expect("fail") = true;
    let dog = watchdog(&held, Duration::from_secs(5));
    w.bind(&step());
    w.start_load_layered(Some(7), true);
    for l in 0..LAYERS {
        w.wait_for_layer(Some(l), Some(7));
    }
    let mut errs = w.take_load_errors();
    errs.sort();
    assert_eq!(errs, vec![DeviceBlockId(10), DeviceBlockId(11)]);
    w.forward_done(Some(7));
    assert!(store_failed(&rx));
    held.open();
    w.wait_idle();
    assert!(w.take_load_errors().is_empty());
    drop(dog); // it opens a gate nobody waits on any more
}

#[test]
fn an_unknown_layer_or_none_orders_every_layer() {
    for layer in [None, Some(LAYERS + 3)] {
        let (mut w, held, rx) = worker(true);
        let dog = watchdog(&held, Duration::from_secs(5));
        w.bind(&step());
        w.start_load_layered(Some(3), true);
        w.wait_for_layer(layer, Some(3));
        let want: Vec<(usize, u64)> = (0..LAYERS).map(|k| (k, 3)).collect();
        assert_eq!(held.waits(), want, "layer {layer:?}");
        w.forward_done(Some(3));
        assert!(w.take_load_errors().is_empty());
        held.open();
        w.wait_idle();
        assert!(!store_failed(&rx));
        drop(dog); // it opens a gate nobody waits on any more
    }
}

#[test]
fn loads_are_ordered_whole_without_the_setting_or_outside_a_layered_step() {
    for (setting, step_layered) in [(false, true), (true, false)] {
        let (mut w, held, rx) = worker(setting);
        let dog = watchdog(&held, Duration::from_secs(5));
        w.bind(&step());
        w.start_load_layered(Some(7), step_layered);
        assert!(!w.has_layered_loads());
        w.wait_for_layer_load(0);
        assert_eq!(*held.whole.lock().expect("whole"), vec![1]);
        assert!(held.layered.lock().expect("layered").is_empty());
        w.forward_done(Some(7));
        held.open();
        w.wait_idle();
        assert!(w.take_load_errors().is_empty());
        assert!(!store_failed(&rx));
        drop(dog); // it opens a gate nobody waits on any more
    }
}

#[test]
fn an_engine_that_skipped_every_layer_hook_gets_the_load_failed() {
    // A step replayed as one full CUDA graph runs no hook at all: forward_done must still see
    // the gate (it may not have arrived yet) and fail the load in that step.
    let (mut w, held, rx) = worker(true);
    *held.enqueue_delay.lock().expect("delay") = Duration::from_millis(200);
    let dog = watchdog(&held, Duration::from_secs(5));
    w.bind(&step());
    w.start_load_layered(Some(7), true);
    w.forward_done(Some(7));
    let mut errs = w.take_load_errors();
    errs.sort();
    assert_eq!(errs, vec![DeviceBlockId(10), DeviceBlockId(11)]);
    assert!(
        store_failed(&rx),
        "the store computed over unordered layers was kept"
    );
    held.open();
    w.wait_idle();
    assert!(
        w.take_load_errors().is_empty(),
        "the blocks were reported twice"
    );
    drop(dog); // it opens a gate nobody waits on any more
}
