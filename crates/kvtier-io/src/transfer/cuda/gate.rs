//! The per-layer events of one layered load and the gate the engine's stream waits on, handed
//! to the engine before the job has enqueued its copies: a 4 GiB staged load enqueues 256 rounds,
//! and the driver's launch queue makes that take ~70 ms of its ~85 (H100, 2026-12-06); handing
//! the gate over only then held vLLM's thread, so it could not enqueue the forward pass of the
//! layers already loaded (docs/bench/vllm.md).
//!
//! Invariants: layer `l`'s event is recorded at most once, by the job, on the stream after the
//! last write of layer `l`; the engine's stream waits for it only once it is recorded (a CPU
//! wait until then: waiting on a never-recorded event would not wait at all); once the job
//! closes the events (done, failed or dropped), a wait for a layer never recorded is an error,
//! never a wait that passes.
use std::sync::{Arc, Condvar, Mutex};

use kvtier::transfer::{LayerGate, TransferError};

use crate::sys::cuda::{CuResult, Driver, Event, Stream};
use crate::sys::job;

/// Which layers' events the job has recorded, and whether it will record more.
struct Recorded {
    layers: Vec<bool>,
    closed: bool,
}

/// One layered load's events, shared by the job (which records them) and the engine's gate.
pub(crate) struct LayerEvents {
    events: Vec<Event>,
    recorded: Mutex<Recorded>,
    cv: Condvar,
}

impl LayerEvents {
    /// `layers` fresh events, none recorded.
    pub(crate) fn new(layers: usize) -> CuResult<Arc<Self>> {
        let events = (0..layers)
            .map(|_| Event::new(false))
            .collect::<CuResult<Vec<_>>>()?;
        Ok(Arc::new(LayerEvents {
            events,
            recorded: Mutex::new(Recorded {
                layers: vec![false; layers],
                closed: false,
            }),
            cv: Condvar::new(),
        }))
    }

    pub(crate) fn layers(&self) -> usize {
        self.events.len()
    }

    /// Record layer `l`'s event on `stream` (after the last write of layer `l` was enqueued
    /// there) and let the engine's waits for that layer go on. A layer is recorded once.
    pub(crate) fn record(&self, l: usize, stream: &Stream) -> CuResult<()> {
        let ev = self.events.get(l).ok_or("layer out of range")?;
        let poisoned = || "layer events poisoned".to_string();
        {
            let r = self.recorded.lock().map_err(|_| poisoned())?;
            if r.closed || r.layers[l] {
                return Err(format!("layer {l} recorded twice or after the job closed"));
            }
        }
        // Outside the lock: with the driver's launch queue full this call waits for the GPU.
        // Only the job records, so the check above still holds.
        ev.record(stream)?;
        self.recorded.lock().map_err(|_| poisoned())?.layers[l] = true;
        self.cv.notify_all();
        Ok(())
    }

    /// The job records no more layers: waits for a layer not recorded by now fail.
    pub(crate) fn close(&self) {
        if let Ok(mut r) = self.recorded.lock() {
            r.closed = true;
        }
        self.cv.notify_all();
    }

    /// Block until layer `l`'s event is recorded (or the job closed without recording it).
    fn recorded_event(&self, l: usize) -> Result<&Event, TransferError> {
        let ev = self.events.get(l).ok_or_else(|| {
            TransferError::Other(format!(
                "layer {l} is out of range ({} layers)",
                self.events.len()
            ))
        })?;
        let poisoned = || TransferError::Other("layer events poisoned".into());
        let mut r = self.recorded.lock().map_err(|_| poisoned())?;
        while !r.layers[l] && !r.closed {
            r = self.cv.wait(r).map_err(|_| poisoned())?;
        }
        if !r.layers[l] {
            return Err(TransferError::Other(format!(
                "layer {l} of a layered load was never enqueued (the load failed)"
            )));
        }
        Ok(ev)
    }
}

/// Closes the events when the job's enqueueing ends, however it ends.
pub(crate) struct CloseOnDrop(pub(crate) Arc<LayerEvents>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The gate of one layered load: the engine's stream waits for one layer's event at a time.
pub(crate) struct CudaLayerGate {
    driver: Arc<Driver>,
    events: Arc<LayerEvents>,
}

impl CudaLayerGate {
    pub(crate) fn new(driver: Arc<Driver>, events: Arc<LayerEvents>) -> Self {
        CudaLayerGate { driver, events }
    }
}

impl LayerGate for CudaLayerGate {
    fn layers(&self) -> usize {
        self.events.layers()
    }

    fn wait_layer(&self, layer: usize, engine_stream: u64) -> Result<(), TransferError> {
        let ev = self.events.recorded_event(layer)?;
        self.driver.make_current().map_err(TransferError::Cuda)?;
        // The engine passes the stream its forward pass runs on, a live stream of this device's
        // primary context, or 0 (`BlockTransfer::execute_layered`).
        job::engine_stream_wait(ev, engine_stream).map_err(TransferError::Cuda)
    }
}
