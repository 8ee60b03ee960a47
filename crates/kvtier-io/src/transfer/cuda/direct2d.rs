//! Layered loads straight from host slices into the engine's chunks (issue 27, the 32K replay at
//! the link rate; `LayeredCopy::Direct2d`, opt-in): no staging and no kernel. Layer by layer,
//! the copy engine moves each layer's pieces of every host block (canonical layer-major order)
//! into the engine's device chunks, one `cuMemcpy2DAsync` per run of pieces whose host addresses
//! advance by one constant pitch (host slots at a constant stride: `bytes_per_block` for
//! consecutive slots) and whose device addresses advance by another (consecutive device blocks
//! of a per-layer plane: the chunk size), with equal widths; a run of one piece is a plain
//! `cuMemcpyAsync`. Measured alone on the H200 (`scripts/gpu/layer_copies.cu`, 64 KiB rows, 2 MiB
//! blocks): one 2D copy per layer of 2048 blocks ran at 55.3 GB/s, runs of 64 blocks at 53.4, of
//! 16 at 48.3, one copy per row at 16.3. vLLM's K and V planes make two 2D copies of 32 KiB
//! rows per layer here instead: 49.0 GB/s (H100, against 54.8 for one copy). In vLLM a replay's
//! device ids descend while its host slots ascend (vLLM frees a request's blocks in reverse), so
//! its runs are short and the bound below sends it the other way: opt-in.
//!
//! Invariants: [`direct2d_plan`] emits, for each layer `l` in turn, copies that together write
//! every byte of layer `l` of every block of the job (the pieces `cut_chunks` gives, each exactly
//! once) and nothing outside the job's chunks, then `LayerDone(l)`; every layer gets exactly one
//! `LayerDone`, after its last copy (the CPU test replays plans on bytes and checks this). Rows
//! of a 2D copy never overlap (both pitches at least the width) and no pitch exceeds
//! [`MAX_PITCH`]. On the GPU every step runs in plan order on the direction's copy stream,
//! layer `l`'s event recorded there at `LayerDone(l)`; the kernel stream (where `layered_job`
//! records the job's `done`) waits for the last copy.
use kvtier::transfer::Fence;

use super::CudaMover;
use crate::sys::cuda::CuResult;
use crate::sys::job;
use crate::transfer::device::Ordering;
use crate::transfer::layout::{cut_chunks, Chunk};

/// The largest pitch a 2D copy gets: the driver refuses pitches above the device's
/// `CU_DEVICE_ATTRIBUTE_MAX_PITCH` (2^31 - 1 on current GPUs); rows further apart are not joined.
pub(crate) const MAX_PITCH: usize = i32::MAX as usize;

/// Copies per layer a job may plan before it falls back to the kernel mode: `2 * 64` (a K and a
/// V plane, runs of 32 rows on average for a 2048-block, 32K-token job). A guess to be measured:
/// 2D runs of 16 blocks ran at 48.3 GB/s against the kernel's 43.7 on the H200, single rows at
/// 16.3. It is a count, not a mean, so a small job (a few hundred blocks) of scattered ids stays
/// under it with short runs; a floor on the mean bytes per copy (about 1 MiB, the same bound at
/// 4 GiB) may be the better rule once measured.
const COPIES_PER_LAYER: usize = 2 * 64;

/// `height` rows of `width` bytes, row `i` from `src + i * spitch` to `dst + i * dpitch`
/// (`height == 1`: one plain copy, pitches unused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Copy2d {
    pub(crate) src: u64,
    pub(crate) spitch: usize,
    pub(crate) dst: u64,
    pub(crate) dpitch: usize,
    pub(crate) width: usize,
    pub(crate) height: usize,
}

/// One step of a direct layered load, run in order on the copy stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Copy(Copy2d),
    /// Every byte of this layer is written by the copies before: record its event.
    LayerDone(usize),
}

/// A direct layered load's steps.
#[derive(Debug)]
pub(crate) struct Direct2dPlan {
    pub(crate) steps: Vec<Step>,
    /// The `Copy` steps among them.
    pub(crate) copies: usize,
}

impl Direct2dPlan {
    /// Whether the job goes this way: at most [`COPIES_PER_LAYER`] copies per layer (else the
    /// copy engine's per-call cost outweighs the link rate; the caller falls back to the kernel).
    pub(crate) fn within_bound(&self, layers: usize) -> bool {
        self.copies <= layers.saturating_mul(COPIES_PER_LAYER)
    }
}

/// One row of a run: host source, device destination, bytes.
type Row = (u64, u64, usize);

/// The plan of a direct layered load of `items[k] = (pair, chunks of the device block, host
/// block address)`: layer `l` is bytes `[l * s, (l + 1) * s)` of every host block (`s =
/// bytes_per_block / layers`), a chunk spanning a layer boundary cut there. Within a layer, the
/// `j`-th piece of every block forms lane `j` (vLLM's per-layer layout: lane 0 the K plane, lane 1
/// the V plane), and each lane, in job order, is cut into runs ([`lane_runs`]). `None` when the
/// blocks do not split into equal layers (the caller falls back to the kernel mode).
pub(crate) fn direct2d_plan(
    items: &[(usize, Vec<Chunk>, usize)],
    bytes_per_block: usize,
    layers: usize,
) -> Option<Direct2dPlan> {
    if layers == 0 || !bytes_per_block.is_multiple_of(layers) {
        return None;
    }
    let s = bytes_per_block / layers;
    if s == 0 {
        return None;
    }
    let mut pieces = Vec::with_capacity(items.len());
    for (_, chunks, host) in items {
        // Copies need no alignment (the copy engine moves any byte range).
        pieces.push(cut_chunks(chunks, *host, bytes_per_block, s, 1)?);
    }
    let mut next = vec![0usize; items.len()];
    let mut lanes: Vec<Vec<Row>> = Vec::new();
    let mut steps = Vec::new();
    let mut copies = 0;
    for l in 0..layers {
        lanes.iter_mut().for_each(Vec::clear);
        for (i, (_, _, host)) in items.iter().enumerate() {
            let ours = pieces[i][next[i]..].iter().take_while(|p| p.unit == l);
            for (j, p) in ours.enumerate() {
                if lanes.len() <= j {
                    lanes.push(Vec::with_capacity(items.len()));
                }
                lanes[j].push(((host + p.at) as u64, p.addr, p.len));
                next[i] += 1;
            }
        }
        for lane in &lanes {
            for c in lane_runs(lane) {
                steps.push(Step::Copy(c));
                copies += 1;
            }
        }
        steps.push(Step::LayerDone(l));
    }
    // Every piece is in some layer's copies (units run 0..layers in canonical order).
    if next.iter().zip(&pieces).any(|(n, p)| *n != p.len()) {
        return None;
    }
    Some(Direct2dPlan { steps, copies })
}

/// `rows` (in order) as 2D copies: a row joins the run before it when it has the run's width and
/// its host and device addresses step from the run's last row by the run's pitches (set by the
/// run's second row: both steps at least the width and at most [`MAX_PITCH`], both forward or
/// both backward; a backward run is emitted from its last row, forward).
pub(crate) fn lane_runs(rows: &[Row]) -> Vec<Copy2d> {
    struct Open {
        first: (u64, u64),
        last: (u64, u64),
        width: usize,
        height: usize,
        step: (i128, i128),
    }
    let close = |r: &Open| -> Copy2d {
        let (ds, dd) = r.step;
        let (at, ds, dd) = if ds < 0 {
            (r.last, -ds, -dd)
        } else {
            (r.first, ds, dd)
        };
        let pitch = |d: i128| usize::try_from(d).unwrap_or(r.width).max(r.width);
        Copy2d {
            src: at.0,
            spitch: pitch(ds),
            dst: at.1,
            dpitch: pitch(dd),
            width: r.width,
            height: r.height,
        }
    };
    let pitch_ok =
        |d: i128, w: usize| d.unsigned_abs() >= w as u128 && d.unsigned_abs() <= MAX_PITCH as u128;
    let mut out = Vec::new();
    let mut open: Option<Open> = None;
    for &(src, dst, len) in rows {
        if let Some(r) = open.as_mut() {
            let ds = i128::from(src) - i128::from(r.last.0);
            let dd = i128::from(dst) - i128::from(r.last.1);
            let joins = len == r.width
                && if r.height == 1 {
                    (ds > 0) == (dd > 0) && pitch_ok(ds, len) && pitch_ok(dd, len)
                } else {
                    (ds, dd) == r.step
                };
            if joins {
                r.step = (ds, dd);
                r.last = (src, dst);
                r.height += 1;
                continue;
            }
            out.push(close(r));
        }
        open = Some(Open {
            first: (src, dst),
            last: (src, dst),
            width: len,
            height: 1,
            step: (0, 0),
        });
    }
    if let Some(r) = &open {
        out.push(close(r));
    }
    out
}

impl CudaMover {
    /// The direct plan of `items`, or `None` when the job does not go this way: no kernel (the
    /// layered job's machinery and the fallback need it), layers that do not split evenly, or
    /// more copies than the bound ([`Direct2dPlan::within_bound`]).
    pub(crate) fn direct2d_job_plan(
        &self,
        items: &[(usize, Vec<Chunk>, usize)],
        layers: usize,
    ) -> Option<Direct2dPlan> {
        self.kernel.as_ref()?;
        let plan = direct2d_plan(items, self.bytes_per_block, layers)?;
        if !plan.within_bound(layers) {
            tracing::debug!(
                copies = plan.copies,
                layers,
                blocks = items.len(),
                "direct2d layered load: too many short runs; the kernel mode instead"
            );
            return None;
        }
        Some(plan)
    }

    /// Enqueue `plan` (see the module comment) after `fence`, hand the engine the layer gate and
    /// wait for the whole job's completion.
    pub(crate) fn direct2d_inner(
        &self,
        plan: &Direct2dPlan,
        layers: usize,
        fence: &Fence,
        order: Ordering<'_>,
    ) -> CuResult<()> {
        self.layered_job(fence, true, layers, order, |_, dir, events| {
            for step in &plan.steps {
                match *step {
                    // Pieces of host blocks (or arena slots) this job holds, into chunks of the
                    // engine's registered blocks; the job waits for `done` before it gives the
                    // blocks back.
                    Step::Copy(c) if c.height == 1 => {
                        job::memcpy_async(c.dst, c.src, c.width, &dir.copy)?;
                    }
                    Step::Copy(c) => {
                        let shape = (c.width, c.height);
                        job::memcpy_2d_async(c.dst, c.dpitch, c.src, c.spitch, shape, &dir.copy)?;
                    }
                    Step::LayerDone(l) => events.record(l, &dir.copy)?,
                }
            }
            // `done` is recorded on the kernel stream: it follows the last copy.
            dir.handoff[0].record(&dir.copy)?;
            dir.kernel.wait(&dir.handoff[0])?;
            Ok(())
        })
    }
}

#[cfg(test)]
#[path = "direct2d_tests.rs"]
mod tests;
