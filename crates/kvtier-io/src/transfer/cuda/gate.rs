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

/// The recording side of a layered load's gate, without the events (tested on the CPU).
struct LayerProgress {
    recorded: Mutex<Recorded>,
    cv: Condvar,
}

impl LayerProgress {
    fn new(layers: usize) -> Self {
        LayerProgress {
            recorded: Mutex::new(Recorded {
                layers: vec![false; layers],
                closed: false,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Recorded> {
        // Plain flags behind the lock: still meaningful after a panic elsewhere.
        self.recorded.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether layer `l` may be recorded now: in range, not recorded, the job not closed.
    fn may_record(&self, l: usize) -> Result<(), String> {
        let r = self.lock();
        match r.layers.get(l) {
            None => Err(format!(
                "layer {l} is out of range ({} layers)",
                r.layers.len()
            )),
            Some(true) => Err(format!("layer {l} recorded twice")),
            Some(false) if r.closed => Err(format!("layer {l} recorded after the job closed")),
            Some(false) => Ok(()),
        }
    }

    /// Layer `l`'s event is recorded: its waiters go on.
    fn mark(&self, l: usize) {
        if let Some(x) = self.lock().layers.get_mut(l) {
            *x = true;
        }
        self.cv.notify_all();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.cv.notify_all();
    }

    /// Block until layer `l` is recorded; an error if it is out of range or the job closed
    /// without recording it.
    fn wait(&self, l: usize) -> Result<(), TransferError> {
        let mut r = self.lock();
        if l >= r.layers.len() {
            return Err(TransferError::Other(format!(
                "layer {l} is out of range ({} layers)",
                r.layers.len()
            )));
        }
        while !r.layers[l] && !r.closed {
            r = self.cv.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        if !r.layers[l] {
            return Err(TransferError::Other(format!(
                "layer {l} of a layered load was never enqueued (the load failed)"
            )));
        }
        Ok(())
    }
}

/// One layered load's events, shared by the job (which records them) and the engine's gate.
pub(crate) struct LayerEvents {
    events: Vec<Event>,
    progress: LayerProgress,
}

impl LayerEvents {
    /// `layers` fresh events, none recorded.
    pub(crate) fn new(layers: usize) -> CuResult<Arc<Self>> {
        let events = (0..layers)
            .map(|_| Event::new(false))
            .collect::<CuResult<Vec<_>>>()?;
        Ok(Arc::new(LayerEvents {
            events,
            progress: LayerProgress::new(layers),
        }))
    }

    pub(crate) fn layers(&self) -> usize {
        self.events.len()
    }

    /// Record layer `l`'s event on `stream` (after the last write of layer `l` was enqueued
    /// there) and let the engine's waits for that layer go on. A layer is recorded once.
    pub(crate) fn record(&self, l: usize, stream: &Stream) -> CuResult<()> {
        self.progress.may_record(l)?;
        let ev = self.events.get(l).ok_or("layer out of range")?;
        // Outside the lock: with the driver's launch queue full this call waits for the GPU.
        // Only the job records, so the check above still holds.
        ev.record(stream)?;
        self.progress.mark(l);
        Ok(())
    }

    /// The job records no more layers: waits for a layer not recorded by now fail.
    pub(crate) fn close(&self) {
        self.progress.close();
    }

    /// Block until layer `l`'s event is recorded (or the job closed without recording it).
    fn recorded_event(&self, l: usize) -> Result<&Event, TransferError> {
        self.progress.wait(l)?;
        self.events
            .get(l)
            .ok_or_else(|| TransferError::Other(format!("layer {l} is out of range")))
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_wait_blocks_until_its_layer_is_recorded_and_no_longer() {
        let p = Arc::new(LayerProgress::new(3));
        let waiter = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || p.wait(1))
        };
        p.mark(0);
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !waiter.is_finished(),
            "the wait for layer 1 passed before it was recorded"
        );
        p.mark(1);
        waiter.join().unwrap().unwrap();
        p.wait(0).unwrap();
    }

    #[test]
    fn a_closed_job_fails_the_waits_of_layers_it_never_recorded() {
        let p = Arc::new(LayerProgress::new(2));
        let waiter = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || p.wait(1))
        };
        p.mark(0);
        p.close();
        assert!(
            waiter.join().unwrap().is_err(),
            "a never-recorded layer's wait passed"
        );
        p.wait(0).unwrap();
        assert!(p.wait(2).is_err(), "out of range");
        assert!(p.may_record(1).is_err(), "recorded after the job closed");
    }

    #[test]
    fn a_layer_is_recorded_once() {
        let p = LayerProgress::new(2);
        p.may_record(0).unwrap();
        p.mark(0);
        assert!(p.may_record(0).is_err());
        assert!(p.may_record(2).is_err());
        p.may_record(1).unwrap();
    }
}
