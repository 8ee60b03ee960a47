//! Layered loads (host tier or node arena -> the engine's blocks, one layer at a time): the
//! scatter kernel reads each layer's bytes straight from pinned, registered host memory (the host
//! tier, or the node's arena slots a direct job leased; unified addressing, no staging) and
//! writes them into the engine's chunks, one launch per layer on the kvtier kernel stream, each
//! followed by that layer's event. The engine's stream waits for one layer's event right before
//! that layer's attention ([`CudaLayerGate`]), so copies of later layers run beside the forward
//! pass of earlier ones (vLLM's `wait_for_layer_load`).
//!
//! Which way a layered load goes is its [`LayeredCopy`] (`Auto`: this kernel up to
//! [`KERNEL_MAX_BYTES`] where the GPU's SMs read host memory near the copy engine's rate,
//! `probe.rs`; the copy engine through device staging otherwise, `staged.rs`).
//!
//! Invariants: the kernel-read way is used only when kernels may read the source at its host
//! addresses (pinned, registered, `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`) and every piece is
//! 16-byte aligned; a job no layered way can plan goes the whole-job ordered way (the gate handed
//! to the engine is then `None`); the kernels run after the job's fence (a stream wait, not a CPU
//! wait); layer `l`'s event is recorded after the launch that
//! writes every byte of layer `l` and of no later layer; each job has its own events, so a gate
//! handed to the engine is never re-recorded; the descriptors stay untouched until the job's
//! `done` event completed (the direction's lock is held until then).
use std::sync::Arc;

use kvtier::transfer::Fence;

use super::gate::{CloseOnDrop, CudaLayerGate, LayerEvents};
use super::{launch_descs, staged, CudaFence, CudaMover, Dir};
use crate::sys::cuda::{CuResult, Kernel};
use crate::transfer::device::Ordering;
use crate::transfer::layout::{split_layers, Chunk};

/// The kernel's wide copies need every piece, and its host and device addresses, on this boundary.
pub(crate) const KERNEL_ALIGN: usize = 16;

/// `Auto` loads larger than this go the staged way (copy engine into device staging, then the
/// scatter kernel) instead of the kernel's. The kernel's reads of host memory run below the copy
/// engine's rate (H200, PCIe Gen5: 43.7 GB/s for a 1 GiB layered load; H100s 29.5-51.1, against
/// 53-55 GB/s), which costs more than its quick start gains once a load is long. Since the gate
/// comes before the staged rounds are enqueued (`gate.rs`) and the loads start as vLLM builds
/// the step, the staged way won at 8K (1 GiB) on the H100 (vLLM 0.33, Llama-3.1-8B shape,
/// eager: 28.3 ms against 35.2 for the kernel, 2026-12-06) and lost at 2K (256 MiB); the cut
/// lies between (docs/bench/vllm.md). Before those changes the H200's crossover was near 2 GiB.
pub(crate) const KERNEL_MAX_BYTES: usize = 512 << 20;

/// At most this many thread blocks per layer's launch: enough reads in flight to fill the link
/// from host memory, few enough to leave the SMs to the forward pass.
pub(crate) const MAX_GRID: usize = 512;

/// How a layered load (a synchronous load the engine waits for layer by layer) moves its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LayeredCopy {
    /// `Kernel` for loads up to 512 MiB where the start-up probe found the kernel's host reads at
    /// 0.7x of the copy engine's rate or faster (`probe.rs`; the H200, not the H100), `Staged`
    /// (512 KiB slices) otherwise (measured on both; a job the staged way cannot plan goes whole). Overridden by
    /// `KVTIER_LAYERED_COPY` (`kernel`, `staged`, `staged2d`, `direct2d`, `whole`).
    #[default]
    Auto,
    /// The scatter kernel reads each layer from host memory (43.7 GB/s on the H200).
    Kernel,
    /// The copy engine moves each layer group's slices (at least this many bytes of a block
    /// where it allows) into device staging, the scatter kernel writes them out (`staged.rs`;
    /// `Auto`'s way above 512 MiB).
    Staged(usize),
    /// As `Staged`, each round's slices of host blocks at a constant stride moved by one 2D
    /// copy (`cuMemcpy2DAsync`: the copy engine walks the rows) instead of one copy each
    /// (`staged.rs`, `runs_2d`; opt-in, for measurements).
    Staged2d(usize),
    /// No staging, no kernel: each layer's pieces copied from host blocks straight into the
    /// engine's chunks, one 2D copy per run of host slots and device blocks at constant strides
    /// (`direct2d.rs`); a job of too many short runs (or that does not split into equal layers)
    /// goes the `Kernel` way. Opt-in: in vLLM a replay's device ids descend against its
    /// ascending host slots, so no runs form (measured on the H100, docs/bench/vllm.md).
    Direct2d,
    /// Not layered: the whole job ordered ahead of the forward pass (copy engine).
    Whole,
}

impl LayeredCopy {
    /// The mode named `auto`, `kernel`, `staged` (slices of at least 512 KiB), `staged:KIB`,
    /// `staged2d`, `staged2d:KIB`, `direct2d` or `whole`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "kernel" => Some(Self::Kernel),
            "staged" => Some(Self::Staged(staged::MIN_SLICE)),
            "staged2d" => Some(Self::Staged2d(staged::MIN_SLICE)),
            "direct2d" => Some(Self::Direct2d),
            "whole" => Some(Self::Whole),
            _ => {
                let (mode, kib): (fn(usize) -> Self, _) = match s.strip_prefix("staged2d:") {
                    Some(k) => (Self::Staged2d, k),
                    None => (Self::Staged, s.strip_prefix("staged:")?),
                };
                let kib = kib.parse::<usize>().ok().filter(|k| *k > 0)?;
                Some(mode(kib.saturating_mul(1024)))
            }
        }
    }

    /// The mode `KVTIER_LAYERED_COPY` names, if it is set (a value that names none is reported
    /// and ignored).
    pub(crate) fn from_env() -> Option<Self> {
        let v = std::env::var("KVTIER_LAYERED_COPY").ok()?;
        let m = Self::parse(&v);
        if m.is_none() {
            tracing::warn!(value = %v, "KVTIER_LAYERED_COPY is not auto|kernel|staged[2d][:KIB]|direct2d|whole: ignored");
        }
        m
    }

    /// The mode a load of `bytes` takes where `Auto` loads of up to `kernel_max` bytes go the
    /// kernel's way ([`KERNEL_MAX_BYTES`], or 0 where the probe found the kernel's host reads
    /// slow: `probe.rs`).
    pub(crate) fn for_bytes(self, bytes: usize, kernel_max: usize) -> Self {
        match self {
            Self::Auto if bytes <= kernel_max => Self::Kernel,
            Self::Auto => Self::Staged(staged::MIN_SLICE),
            m => m,
        }
    }
}

/// The kernel descriptors `(src, dst, len)` of each layer of a load: `items[k] = (pair, chunks of
/// the device block, host block address)`; layer `l` is bytes `[l * s, (l + 1) * s)` of every
/// host block (`s = bytes_per_block / layers`, canonical layer-major order), a chunk spanning a
/// layer boundary split there. `None` when the block does not split into equal 16-byte aligned
/// layers.
pub(crate) fn layer_descriptors(
    items: &[(usize, Vec<Chunk>, usize)],
    bytes_per_block: usize,
    layers: usize,
) -> Option<Vec<Vec<u64>>> {
    let empty = Vec::with_capacity(items.len() * 6);
    split_layers(
        items,
        bytes_per_block,
        layers,
        KERNEL_ALIGN,
        empty,
        |d, host, dev, len| {
            d.extend_from_slice(&[host as u64, dev, len as u64]);
        },
    )
}

/// Every pair of `items` failed with the CUDA error `e` (not attributable to one block), once
/// what the failed load had enqueued is done (`quiesce`).
fn failed_all(
    mover: &CudaMover,
    items: &[(usize, Vec<Chunk>, usize)],
    e: &str,
) -> Vec<(usize, String)> {
    mover.quiesce(false);
    items
        .iter()
        .map(|(i, _, _)| (*i, format!("CUDA: {e}")))
        .collect()
}

impl CudaMover {
    /// A synchronous load layer by layer (see the module comment); returns the failed pairs
    /// like `copy`. Falls back to the whole-job ordered copy when the job cannot be layered.
    pub(crate) fn copy_layered(
        &self,
        items: &[(usize, Vec<Chunk>, usize)],
        layers: usize,
        fence: &Fence,
        order: Ordering<'_>,
    ) -> Vec<(usize, String)> {
        if items.is_empty() {
            (order.enqueued)(None);
            return Vec::new();
        }
        let bytes = items.len().saturating_mul(self.bytes_per_block);
        let mut mode = self.layered_copy.for_bytes(bytes, self.kernel_max_bytes);
        if mode == LayeredCopy::Direct2d {
            // A job the direct way cannot take (or would take in too many short copies) goes the
            // kernel's way.
            match self.direct2d_job_plan(items, layers) {
                Some(plan) => {
                    return match self.direct2d_inner(&plan, layers, fence, order) {
                        Ok(()) => Vec::new(),
                        Err(e) => failed_all(self, items, &e),
                    };
                }
                None => mode = LayeredCopy::Kernel,
            }
        }
        let descs = match mode {
            m @ (LayeredCopy::Staged(min_slice) | LayeredCopy::Staged2d(min_slice)) => {
                match self.staged_plan(items, layers, min_slice) {
                    Some(rounds) => {
                        let two_d = matches!(m, LayeredCopy::Staged2d(_));
                        return match self.staged_inner(&rounds, layers, fence, order, two_d) {
                            Ok(()) => Vec::new(),
                            Err(e) => failed_all(self, items, &e),
                        };
                    }
                    None => None,
                }
            }
            LayeredCopy::Kernel => self
                .kernel
                .as_ref()
                .filter(|_| self.host_pointers && order.readable)
                .and_then(|_| layer_descriptors(items, self.bytes_per_block, layers)),
            LayeredCopy::Auto | LayeredCopy::Whole | LayeredCopy::Direct2d => None,
        };
        let Some(descs) = descs else {
            return self.copy(
                items,
                crate::transfer::device::CopyDir::HostToDevice,
                fence,
                Some(order),
            );
        };
        match self.layered_inner(&descs, fence, order) {
            Ok(()) => Vec::new(),
            Err(e) => failed_all(self, items, &e),
        }
    }

    /// The rounds of a staged layered load of `items`, or `None` when it cannot be staged (no
    /// kernel or staging, layers that do not split evenly, unaligned pieces).
    fn staged_plan(
        &self,
        items: &[(usize, Vec<Chunk>, usize)],
        layers: usize,
        min_slice: usize,
    ) -> Option<Vec<staged::StagedRound>> {
        self.kernel.as_ref()?;
        let base = self.h2d.lock().ok()?.staging.as_ref()?.0.addr();
        let half = self.half_blocks * self.bytes_per_block;
        let layer_bytes = self.bytes_per_block.checked_div(layers)?;
        let g = staged::group_layers(layers, layer_bytes, min_slice, half)?;
        staged::staged_rounds(
            items,
            self.bytes_per_block,
            layers,
            g,
            half,
            [base, base + half as u64],
        )
    }

    fn layered_inner(
        &self,
        descs: &[Vec<u64>],
        fence: &Fence,
        order: Ordering<'_>,
    ) -> CuResult<()> {
        self.layered_job(fence, false, descs.len(), order, |kernel, dir, events| {
            let base = dir.fill_job_descs(descs.iter().map(Vec::as_slice))?;
            let mut first = 0u64;
            for (l, d) in descs.iter().enumerate() {
                // Whole pieces of host tier blocks (or arena slots) held by this job, pinned and
                // readable by kernels at their host addresses (checked at construction), into
                // chunks of the engine's registered blocks.
                let n = d.len() / 3;
                launch_descs(kernel, &dir.kernel, base, first, n, MAX_GRID)?;
                first += n as u64;
                events.record(l, &dir.kernel)?;
            }
            Ok(())
        })
    }

    /// A layered load on the host-to-device direction, locked for the job: its kernel stream
    /// (and its copy stream with `copy_too`) waits for `fence`; the engine gets the gate of the
    /// job's `layers` events at once (`gate.rs`: a wait for a layer blocks until the job recorded
    /// it); `enqueue` enqueues the job, recording each layer's event after that layer's last
    /// write; the job's `done` follows on the kernel stream, and this waits for `done` (the
    /// job's host blocks stay held until then).
    pub(super) fn layered_job(
        &self,
        fence: &Fence,
        copy_too: bool,
        layers: usize,
        order: Ordering<'_>,
        enqueue: impl FnOnce(&Kernel, &mut Dir, &LayerEvents) -> CuResult<()>,
    ) -> CuResult<()> {
        let entered = std::time::Instant::now();
        self.driver.make_current()?;
        let Some(kernel) = &self.kernel else {
            return Err("kernel path not set up".into());
        };
        let mut guard = self
            .h2d
            .lock()
            .map_err(|_| "transfer state poisoned by an earlier panic".to_string())?;
        let dir: &mut Dir = &mut guard;
        if let Some(f) = fence.0.as_ref().and_then(|b| b.downcast_ref::<CudaFence>()) {
            if copy_too {
                dir.copy.wait(&f.0)?;
            }
            dir.kernel.wait(&f.0)?;
        }
        let events = LayerEvents::new(layers)?;
        let closing = CloseOnDrop(Arc::clone(&events));
        (order.enqueued)(Some(Arc::new(CudaLayerGate::new(
            Arc::clone(&self.driver),
            Arc::clone(&events),
        ))));
        enqueue(kernel, dir, &events)?;
        dir.done.record(&dir.kernel)?;
        drop(closing);
        // Profiling aid: how long the job's thread took to enqueue every layer.
        tracing::debug!(
            enqueue_us = entered.elapsed().as_micros() as u64,
            layers,
            "layered load enqueued"
        );
        dir.done.wait()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn chunk(addr: u64, len: usize) -> Chunk {
        Chunk { addr, len }
    }

    #[test]
    fn descriptors_split_by_layer_at_canonical_offsets() {
        // Two layers of 64 bytes (K, V of 32 each); block 0's K/V of layer 1 coalesced with
        // layer 0's V into one 96-byte chunk: it is split at the layer boundary.
        let items = vec![
            (0, vec![chunk(0x1000, 32), chunk(0x2000, 96)], 0x9000usize),
            (
                1,
                vec![chunk(0x3000, 32), chunk(0x4000, 32), chunk(0x5000, 64)],
                0xA000,
            ),
        ];
        let d = layer_descriptors(&items, 128, 2).unwrap();
        assert_eq!(
            d[0],
            vec![0x9000, 0x1000, 32, 0x9020, 0x2000, 32, 0xA000, 0x3000, 32, 0xA020, 0x4000, 32]
        );
        assert_eq!(d[1], vec![0x9040, 0x2020, 64, 0xA040, 0x5000, 64]);
    }

    #[test]
    fn layered_copy_modes_parse_and_pick_by_size() {
        assert_eq!(LayeredCopy::parse("kernel"), Some(LayeredCopy::Kernel));
        assert_eq!(LayeredCopy::parse("whole"), Some(LayeredCopy::Whole));
        assert_eq!(LayeredCopy::parse("auto"), Some(LayeredCopy::Auto));
        assert_eq!(
            LayeredCopy::parse("staged"),
            Some(LayeredCopy::Staged(512 << 10))
        );
        assert_eq!(
            LayeredCopy::parse("staged:256"),
            Some(LayeredCopy::Staged(256 << 10))
        );
        assert_eq!(
            LayeredCopy::parse("staged2d"),
            Some(LayeredCopy::Staged2d(512 << 10))
        );
        assert_eq!(
            LayeredCopy::parse("staged2d:64"),
            Some(LayeredCopy::Staged2d(64 << 10))
        );
        assert_eq!(LayeredCopy::parse("direct2d"), Some(LayeredCopy::Direct2d));
        for bad in [
            "staged:0",
            "staged:",
            "staged:x",
            "staged2d:0",
            "staged2:",
            "direct2d:64",
            "Kernel",
            "",
        ] {
            assert_eq!(LayeredCopy::parse(bad), None, "{bad:?}");
        }
        // Auto: the kernel up to the cut, the staged copy above; explicit modes stay.
        assert_eq!(
            LayeredCopy::Auto.for_bytes(KERNEL_MAX_BYTES, KERNEL_MAX_BYTES),
            LayeredCopy::Kernel
        );
        assert_eq!(
            LayeredCopy::Auto.for_bytes(KERNEL_MAX_BYTES + 1, KERNEL_MAX_BYTES),
            LayeredCopy::Staged(512 << 10)
        );
        assert_eq!(
            LayeredCopy::Staged(1).for_bytes(usize::MAX, KERNEL_MAX_BYTES),
            LayeredCopy::Staged(1)
        );
        assert_eq!(
            LayeredCopy::Direct2d.for_bytes(usize::MAX, KERNEL_MAX_BYTES),
            LayeredCopy::Direct2d
        );
        // Where the probe found the kernel's host reads slow, every `Auto` load goes staged.
        assert_eq!(
            LayeredCopy::Auto.for_bytes(1, 0),
            LayeredCopy::Staged(512 << 10)
        );
    }

    #[test]
    fn unaligned_or_unequal_layers_are_not_layered() {
        let items = vec![(0, vec![chunk(0x1000, 128)], 0x9000usize)];
        assert!(
            layer_descriptors(&items, 128, 3).is_none(),
            "unequal layers"
        );
        assert!(
            layer_descriptors(&items, 128, 16).is_none(),
            "8-byte layers"
        );
        let odd = vec![(0, vec![chunk(0x1008, 128)], 0x9000usize)];
        assert!(layer_descriptors(&odd, 128, 2).is_none(), "unaligned chunk");
        let short = vec![(0, vec![chunk(0x1000, 64)], 0x9000usize)];
        assert!(
            layer_descriptors(&short, 128, 2).is_none(),
            "chunks short of a block"
        );
    }
}
