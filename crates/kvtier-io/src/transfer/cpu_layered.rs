//! Layered loads into an engine's CPU memory (a KV cache in host memory whose engine still waits
//! layer by layer: TensorRT-LLM's executor model in CI, CPU builds): the job's executor thread
//! hands the engine a [`CpuLayerGate`] first, then copies layer 0 of every block of the job,
//! then layer 1, and so on; the engine's `wait_layer(l)` blocks the engine's thread until layer
//! `l` is in. The CPU counterpart of a CUDA stream waiting for a layer's event: copies of later
//! layers run beside the engine's compute of earlier ones.
//!
//! Invariants: every byte of layer `l` of every block of the job is written and fenced before
//! `wait_layer(l)` returns `Ok`; a copy that stops before its last layer (a panic unwinding
//! through it) marks the gate broken, so a waiter is never left hanging (it gets an error, and
//! the worker fails the load); the copies run on the job's executor thread, which holds the job,
//! and with it its host blocks, until the last layer is in; a job whose blocks do not split into
//! equal layers is copied whole before the engine may go on (the gate is then `None`).
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use kvtier::transfer::{LayerGate, TransferError};

use crate::sys::{job, mem};
use crate::transfer::device::{copy_whole, Ordering};
use crate::transfer::layout::{split_layers, Chunk};

/// How far a layered CPU load has come.
#[derive(Default)]
struct Copied {
    /// Layers `0..layers_in` are written and fenced.
    layers_in: usize,
    /// The copy stopped before its last layer.
    broken: bool,
}

#[derive(Default)]
struct Progress {
    copied: Mutex<Copied>,
    advanced: Condvar,
}

impl Progress {
    fn lock(&self) -> MutexGuard<'_, Copied> {
        // A panic while holding this lock leaves plain counters behind: still meaningful.
        self.copied.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The gate of a layered CPU load: `wait_layer(l)` returns once layer `l` is in.
pub(crate) struct CpuLayerGate {
    progress: Arc<Progress>,
    layers: usize,
}

impl LayerGate for CpuLayerGate {
    fn layers(&self) -> usize {
        self.layers
    }

    /// Blocks the calling (engine) thread until layer `layer` is copied; the stream handle means
    /// nothing for CPU memory.
    fn wait_layer(&self, layer: usize, _engine_stream: u64) -> Result<(), TransferError> {
        if layer >= self.layers {
            return Err(TransferError::Other(format!(
                "layer {layer} is out of range ({} layers)",
                self.layers
            )));
        }
        let mut c = self.progress.lock();
        while c.layers_in <= layer && !c.broken {
            c = self
                .progress
                .advanced
                .wait(c)
                .unwrap_or_else(|e| e.into_inner());
        }
        if c.layers_in <= layer {
            return Err(TransferError::Other(format!(
                "the layered copy stopped before layer {layer}"
            )));
        }
        Ok(())
    }
}

/// Marks the gate broken if dropped before every layer is in (a panic in a copy).
struct Advance<'a> {
    progress: &'a Progress,
    layers: usize,
}

impl Advance<'_> {
    fn layer_in(&self) {
        self.progress.lock().layers_in += 1;
        self.progress.advanced.notify_all();
    }
}

impl Drop for Advance<'_> {
    fn drop(&mut self) {
        let mut c = self.progress.lock();
        if c.layers_in < self.layers {
            c.broken = true;
        }
        drop(c);
        self.progress.advanced.notify_all();
    }
}

/// Copy `resolved[k] = (pair, chunks of the device block, host block address)` from the host
/// blocks into the device blocks layer by layer, the engine told to go on (with the gate) before
/// the first copy. Blocks that do not split into `layers` equal layers are copied whole first,
/// and the engine is then told to go on without a gate.
pub(crate) fn load_layered(
    resolved: &[(usize, Vec<Chunk>, usize)],
    bytes_per_block: usize,
    layers: usize,
    order: Ordering<'_>,
) {
    let Some(per_layer) = plan(resolved, bytes_per_block, layers) else {
        copy_whole(resolved, false);
        (order.enqueued)(None);
        return;
    };
    let progress = Arc::new(Progress::default());
    (order.enqueued)(Some(Arc::new(CpuLayerGate {
        progress: Arc::clone(&progress),
        layers,
    })));
    let advance = Advance {
        progress: &progress,
        layers,
    };
    for pieces in per_layer {
        for (src, dst, len) in pieces {
            // `dst` lies in a chunk of a device block of the engine's CPU memory (held by the
            // device side for its life), `src` inside the job's host block (chunks sum to the
            // block size, checked by `plan`); the job owns the destination, and the engine reads
            // this layer only after `wait_layer` saw it in.
            job::copy_stream(src, dst, len);
        }
        mem::store_fence();
        advance.layer_in();
    }
}

/// Each layer's copies `(src, dst, len)` (`layout::split_layers`). `None` when the blocks do not
/// split into equal layers.
fn plan(
    resolved: &[(usize, Vec<Chunk>, usize)],
    bytes_per_block: usize,
    layers: usize,
) -> Option<Vec<Vec<(usize, usize, usize)>>> {
    let empty = Vec::with_capacity(resolved.len());
    split_layers(
        resolved,
        bytes_per_block,
        layers,
        1,
        empty,
        |v, host, dev, len| {
            v.push((host, dev as usize, len));
        },
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "cpu_layered_tests.rs"]
mod tests;
