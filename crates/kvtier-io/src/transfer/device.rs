//! The engine's side (G1): copies between a device block's chunks and a contiguous host block.
//! CPU engines (vLLM's CPU build, kvtier's reference engine) register CPU memory: then a copy is
//! a memcpy per chunk (layer by layer for a layered load: [`crate::transfer::cpu_layered`]).
//! CUDA engines register GPU memory: then copies go through [`crate::transfer::cuda`].
//!
//! Invariant: device memory is borrowed from the engine, never freed here, and only touched
//! after the job's fence; the side holds the [`EngineMemory`] it was opened over (its owners
//! keep the memory allocated) for its whole life.
use std::sync::Arc;

use kvtier::transfer::{Fence, LayerGate, TransferError};

use crate::error::IoError;
use crate::storage::host::HostStorage;
use crate::sys::{job, mem};
use crate::transfer::cpu_layered;
use crate::transfer::layout::{BlockChunks, Chunk};
use crate::transfer::memory::EngineMemory;

/// What kind of memory the engine's KV cache is (CPU, or CUDA device by ordinal).
pub use kvtier::layout::DeviceKind;

enum Mover {
    Cpu,
    Cuda(Box<crate::transfer::cuda::CudaMover>),
}

/// Which way a device copy moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyDir {
    /// The engine's device blocks to kvtier's memory (a store).
    DeviceToHost,
    /// kvtier's memory to the engine's device blocks (a load).
    HostToDevice,
}

impl CopyDir {
    /// Whether the bytes leave the device.
    pub(crate) fn to_host(self) -> bool {
        self == CopyDir::DeviceToHost
    }
}

/// A synchronous load's ordering ([`kvtier::transfer::BlockTransfer::execute_ordered`] and
/// `execute_layered`): the engine's stream (raw handle), whether the load may go layer by layer,
/// whether kernels may read its source at its host addresses (pinned and registered memory: the
/// host tier's when pinned, the node's arena on the direct path: false until the path that
/// knows the source sets it), and the call that lets the engine go on (with the layer gate of a
/// layered load).
pub(crate) struct Ordering<'a> {
    pub(crate) stream: u64,
    pub(crate) layered: bool,
    pub(crate) readable: bool,
    pub(crate) enqueued: &'a mut dyn FnMut(Option<Arc<dyn LayerGate>>),
}

/// An optional [`Ordering`].
pub(crate) type Order<'a> = Option<Ordering<'a>>;

pub(crate) struct DeviceSide {
    layout: Arc<dyn BlockChunks>,
    kind: DeviceKind,
    mover: Mover,
    /// Held for the side's life: what keeps the chunks of `layout` allocated.
    _memory: EngineMemory,
}

impl DeviceSide {
    pub(crate) fn open(
        memory: EngineMemory,
        host: Option<&HostStorage>,
        method: crate::transfer::cuda::CudaCopyMethod,
        layered: crate::transfer::cuda::LayeredCopy,
    ) -> Result<Self, IoError> {
        let layout = Arc::clone(memory.layout());
        let kind = memory.kind();
        let mover = match kind {
            DeviceKind::Cpu => Mover::Cpu,
            DeviceKind::Cuda(ordinal) => {
                let ordinal = i32::try_from(ordinal)
                    .map_err(|_| IoError::Config(format!("CUDA device {ordinal}")))?;
                Mover::Cuda(Box::new(crate::transfer::cuda::CudaMover::new(
                    ordinal,
                    layout.as_ref(),
                    host,
                    method,
                    layered,
                )?))
            }
        };
        Ok(DeviceSide {
            layout,
            kind,
            mover,
            _memory: memory,
        })
    }

    pub(crate) fn kind(&self) -> DeviceKind {
        self.kind
    }

    pub(crate) fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        match &self.mover {
            Mover::Cpu => Ok(Fence::none()),
            Mover::Cuda(c) => c.fence(engine_stream),
        }
    }

    /// Copy `items[k] = (pair index, device block, host block address)` in the direction given;
    /// returns the failed pair indices with reasons. `order` (synchronous loads): the engine's
    /// stream and the call telling the caller it may go on, made only if no pair has failed by
    /// then (CUDA: once the stream waits for the copies; CPU: once they are done, or, for a
    /// layered load, with its gate before the first copy).
    pub(crate) fn copy(
        &self,
        items: &[(usize, u32, usize)],
        way: CopyDir,
        fence: &Fence,
        order: Order<'_>,
    ) -> Vec<(usize, String)> {
        let to_host = way.to_host();
        let prep = std::time::Instant::now();
        let mut failed = Vec::new();
        let mut resolved: Vec<(usize, Vec<Chunk>, usize)> = Vec::with_capacity(items.len());
        for &(i, block, host) in items {
            let mut chunks = Vec::new();
            match self.layout.chunks(block, &mut chunks) {
                Ok(()) => resolved.push((i, chunks, host)),
                Err(e) => failed.push((i, e)),
            }
        }
        // Profiling aid (`KVTIER_LOG=kvtier_timing=debug`): the CPU work before the first copy.
        tracing::debug!(
            target: "kvtier_timing",
            blocks = items.len(),
            to_host,
            resolve_us = prep.elapsed().as_micros() as u64,
            "device copy resolved"
        );
        let order = order.filter(|_| failed.is_empty());
        let layers = self.layout.layers().filter(|_| !to_host);
        match &self.mover {
            Mover::Cpu => match (order, layers) {
                (Some(o), Some(layers)) if o.layered => {
                    let bpb = self.layout.bytes_per_block();
                    cpu_layered::load_layered(&resolved, bpb, layers, o);
                }
                (order, _) => {
                    copy_whole(&resolved, to_host);
                    if let Some(o) = order {
                        (o.enqueued)(None);
                    }
                }
            },
            Mover::Cuda(c) => match (order, layers) {
                (Some(o), Some(layers)) if o.layered => {
                    failed.extend(c.copy_layered(&resolved, layers, fence, o));
                }
                (order, _) => failed.extend(c.copy(&resolved, way, fence, order)),
            },
        }
        failed
    }
}

/// Copy whole host blocks into device blocks (or the reverse, `to_host`), chunk by chunk.
pub(crate) fn copy_whole(resolved: &[(usize, Vec<Chunk>, usize)], to_host: bool) {
    for (_, chunks, host) in resolved {
        let mut off = 0usize;
        for c in chunks {
            let (src, dst) = if to_host {
                (c.addr as usize, host + off)
            } else {
                (host + off, c.addr as usize)
            };
            // `c` is a chunk of a device block of the `EngineMemory` the device side holds (CPU
            // memory, allocated while it lives: its `# Safety`, or its safe constructor's bound
            // check and owners), `host + off` lies inside one host block (chunks sum to the block
            // size, checked at build); the job owns the destination and holds the source
            // read-only.
            job::copy_stream(src, dst, c.len);
            off += c.len;
        }
    }
    mem::store_fence();
}
