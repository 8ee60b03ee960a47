//! Layered loads at the copy engine's rate (issue 27): for each group of consecutive layers, the
//! copy engine moves that group's slice of every host block (contiguous bytes of the canonical
//! layer-major block) into a device staging half, and the scatter kernel writes the half into
//! the engine's chunks (device to device); a group's layers' events are recorded after the
//! scatter of its last round, so the engine's stream, waiting on layer `l` before layer `l`'s
//! attention, runs early layers while later groups are still on the link. The kernel-read
//! layered path (`layered.rs`) reads host memory with the SMs at 43.7 GB/s on the H200; the
//! copy engine runs at 53-55 GB/s (docs/bench/vllm.md), which the 32K replay target needs.
//!
//! Invariants: rounds alternate between the two staging halves, and a round refills a half only
//! after the stream that copies into it waited for that half's previous scatter (`half_done`);
//! the copies of a round and its scatter are ordered by the half's `handoff` event; layer `l`'s
//! event is recorded after the scatter of the last round of `l`'s group, and every byte of layer
//! `l` of every block is written by a round of that group ([`staged_rounds`] plans it; its CPU
//! test replays the plan on bytes); the descriptors of every round are written before the first
//! round and untouched until the job's `done` event completed (the direction's lock is held).
use std::ops::Range;

use kvtier::transfer::Fence;

use super::layered::KERNEL_ALIGN;
use super::{coalesce, launch_descs, Copy, CudaMover};
use crate::sys::cuda::{CuResult, Stream};
use crate::sys::job;
use crate::transfer::device::Ordering;
use crate::transfer::layout::Chunk;
use crate::transfer::layout::{cut_chunks, Piece};

/// A layer group's slice of a host block is at least this many bytes where the block allows
/// (whole-block copies run at 53-55 GB/s, 1 MiB ones at 48 GB/s, 256 KiB ones at 34 GB/s one by
/// one: measured on the H200; batched copies do better for small slices). `KVTIER_LAYERED_COPY=
/// staged:KIB` sets another floor for measurements.
pub(crate) const MIN_SLICE: usize = 512 << 10;

/// The layers per group: the smallest divisor `g` of `layers` whose slice (`g * layer_bytes`)
/// is at least `min_slice` bytes (all layers when none is), never a slice larger than
/// `half_bytes` (a staging half). `None` when not even one layer fits a half.
pub(crate) fn group_layers(
    layers: usize,
    layer_bytes: usize,
    min_slice: usize,
    half_bytes: usize,
) -> Option<usize> {
    if layers == 0 || layer_bytes == 0 || layer_bytes > half_bytes {
        return None;
    }
    let fits = |g: usize| g * layer_bytes <= half_bytes;
    let divisors = (1..=layers).filter(|g| layers.is_multiple_of(*g) && fits(*g));
    let mut best = None;
    for g in divisors {
        best = Some(g);
        if g * layer_bytes >= min_slice {
            break;
        }
    }
    best
}

/// One round of a staged layered load: the copy engine's copies (host slices -> a staging
/// half), the scatter kernel's descriptors (`src, dst, len` from that half to engine chunks),
/// and the layers whose last round this is (their events are recorded after its scatter).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct StagedRound {
    copies: Vec<Copy>,
    descs: Vec<u64>,
    ends: Option<Range<usize>>,
}

/// The rounds of a staged layered load of `items[k] = (pair, chunks of the device block, host
/// block address)`: group by group (`g` layers each, slice `g * bytes_per_block / layers`
/// bytes at canonical offset `group * slice` of every host block), at most `half_bytes /
/// slice` blocks per round, round `r` staging into the half at `halves[r % 2]`. `None` when
/// the block does not split into equal layers or a piece is not 16-byte aligned (the kernel's
/// wide copies).
pub(crate) fn staged_rounds(
    items: &[(usize, Vec<Chunk>, usize)],
    bytes_per_block: usize,
    layers: usize,
    g: usize,
    half_bytes: usize,
    halves: [u64; 2],
) -> Option<Vec<StagedRound>> {
    if layers == 0 || g == 0 || !layers.is_multiple_of(g) {
        return None;
    }
    if !bytes_per_block.is_multiple_of(layers) {
        return None;
    }
    let slice = bytes_per_block / layers * g;
    if slice == 0 || !slice.is_multiple_of(16) || slice > half_bytes {
        return None;
    }
    let per_round = half_bytes / slice;
    // Each block's chunks cut at the group boundaries, checked once.
    let mut pieces: Vec<Vec<Piece>> = Vec::with_capacity(items.len());
    for (_, chunks, host) in items {
        pieces.push(cut_chunks(
            chunks,
            *host,
            bytes_per_block,
            slice,
            KERNEL_ALIGN,
        )?);
    }
    let groups = layers / g;
    // `cut_chunks` gives each block's pieces in canonical order, so by unit: group `u`'s pieces
    // of block `i` start where group `u - 1`'s ended (`next[i]`).
    let mut next = vec![0usize; items.len()];
    let mut rounds = Vec::new();
    for group in 0..groups {
        let batches = items.len().div_ceil(per_round);
        for (b, batch) in items.chunks(per_round).enumerate() {
            let half = halves[rounds.len() % 2];
            let mut copies = Vec::with_capacity(batch.len());
            let mut descs = Vec::new();
            for (k, (_, _, host)) in batch.iter().enumerate() {
                let slot = half + (k * slice) as u64;
                copies.push(Copy {
                    src: (*host + group * slice) as u64,
                    dst: slot,
                    len: slice,
                });
                let i = b * per_round + k;
                let from = next[i];
                let ours = pieces[i][from..].iter().take_while(|p| p.unit == group);
                for p in ours {
                    let src = slot + (p.at - group * slice) as u64;
                    descs.extend_from_slice(&[src, p.addr, p.len as u64]);
                    next[i] += 1;
                }
            }
            let ends = (b + 1 == batches).then(|| group * g..(group + 1) * g);
            rounds.push(StagedRound {
                copies: coalesce(copies),
                descs,
                ends,
            });
        }
    }
    Some(rounds)
}

impl CudaMover {
    /// Enqueue `rounds` (see the module comment) after `fence`, hand the engine the layer gate
    /// and wait for the whole job's completion.
    pub(crate) fn staged_inner(
        &self,
        rounds: &[StagedRound],
        layers: usize,
        fence: &Fence,
        order: Ordering<'_>,
        two_d: bool,
    ) -> CuResult<()> {
        self.layered_job(fence, true, layers, order, |kernel, dir, events| {
            let base = dir.fill_job_descs(rounds.iter().map(|r| r.descs.as_slice()))?;
            let mut first = 0u64;
            for (r, round) in rounds.iter().enumerate() {
                let h = r % 2;
                // The half's previous scatter read it out before these copies refill it.
                dir.copy.wait(&dir.half_done[h])?;
                if two_d {
                    stage_runs_2d(&round.copies, &dir.copy)?;
                } else {
                    self.stage_copies(&round.copies, &dir.copy)?;
                }
                dir.handoff[h].record(&dir.copy)?;
                dir.kernel.wait(&dir.handoff[h])?;
                // From our staging half into chunks of the engine's registered blocks.
                let n = round.descs.len() / 3;
                launch_descs(kernel, &dir.kernel, base, first, n, 65535)?;
                first += n as u64;
                dir.half_done[h].record(&dir.kernel)?;
                if let Some(ends) = &round.ends {
                    for l in ends.clone() {
                        events.record(l, &dir.kernel)?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Enqueue a round's host -> staging copies on `stream`: one batched call where the driver
    /// has it, else one copy each.
    fn stage_copies(&self, copies: &[Copy], stream: &Stream) -> CuResult<()> {
        if self.batch_available && copies.len() > 1 {
            let mut d: Vec<u64> = copies.iter().map(|c| c.dst).collect();
            let mut s: Vec<u64> = copies.iter().map(|c| c.src).collect();
            let mut z: Vec<usize> = copies.iter().map(|c| c.len).collect();
            // Host slices of blocks this job holds, into our staging half; the job waits for
            // `done` before it gives the blocks back.
            job::memcpy_batch_async(&mut d, &mut s, &mut z, false, self.driver.ordinal, stream)
        } else {
            for c in copies {
                // As above.
                job::memcpy_async(c.dst, c.src, c.len, stream)?;
            }
            Ok(())
        }
    }
}

/// A staged layered load's input for the `layered_plan` benchmark: `blocks` loaded blocks of
/// `layers` layers in vLLM's per-layer layout (a K and a V chunk of `chunk` bytes per layer,
/// each in its own plane of device blocks), host slots in order. Feature `testing`.
#[cfg(any(test, feature = "testing"))]
pub struct PlanInput {
    items: Vec<(usize, Vec<Chunk>, usize)>,
    bytes_per_block: usize,
    layers: usize,
}

#[cfg(any(test, feature = "testing"))]
impl PlanInput {
    /// See the type.
    pub fn per_layer(blocks: usize, layers: usize, chunk: usize) -> Self {
        let planes = 2 * layers;
        let items = (0..blocks)
            .map(|b| {
                let chunks = (0..planes)
                    .map(|p| Chunk {
                        addr: (1u64 << 40) + ((p * blocks + b) * chunk) as u64,
                        len: chunk,
                    })
                    .collect();
                (b, chunks, (1usize << 36) + b * planes * chunk)
            })
            .collect();
        PlanInput {
            items,
            bytes_per_block: planes * chunk,
            layers,
        }
    }

    /// The rounds of its staged load, `g` layers per group, halves of `half` bytes: how many,
    /// and their copies and descriptors in all (`None`: not plannable).
    pub fn plan(&self, g: usize, half: usize) -> Option<(usize, usize, usize)> {
        let halves = [1u64 << 44, (1u64 << 44) + half as u64];
        let r = staged_rounds(
            &self.items,
            self.bytes_per_block,
            self.layers,
            g,
            half,
            halves,
        )?;
        let copies = r.iter().map(|r| r.copies.len()).sum();
        let descs = r.iter().map(|r| r.descs.len() / 3).sum();
        Some((r.len(), copies, descs))
    }
}

/// Copies at a constant source stride into contiguous destination bytes: `height` rows of
/// `width` bytes, row `i` from `src + i * spitch` to `dst + i * width`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run2d {
    src: u64,
    dst: u64,
    width: usize,
    spitch: usize,
    height: usize,
}

/// `copies` (in order) as 2D runs: a copy joins the run before it when it has the run's width,
/// lands right after the run's last row, and starts the run's stride (set by its second row, at
/// least the width: rows never overlap) after the run's last row's source.
pub(crate) fn runs_2d(copies: &[Copy]) -> Vec<Run2d> {
    let mut out: Vec<Run2d> = Vec::new();
    for c in copies {
        if let Some(r) = out.last_mut() {
            let next_dst = r.dst + (r.height * r.width) as u64;
            let last_src = r.src + ((r.height - 1) * r.spitch) as u64;
            let stride = c.src.checked_sub(last_src).map(|s| s as usize);
            let fits = c.len == r.width && c.dst == next_dst;
            match stride {
                Some(s) if fits && r.height == 1 && s >= r.width => {
                    r.spitch = s;
                    r.height = 2;
                    continue;
                }
                Some(s) if fits && r.height > 1 && s == r.spitch => {
                    r.height += 1;
                    continue;
                }
                _ => {}
            }
        }
        out.push(Run2d {
            src: c.src,
            dst: c.dst,
            width: c.len,
            spitch: c.len,
            height: 1,
        });
    }
    out
}

/// Enqueue `copies` on `stream` as 2D runs ([`runs_2d`]): one call per run.
fn stage_runs_2d(copies: &[Copy], stream: &Stream) -> CuResult<()> {
    for r in runs_2d(copies) {
        // Host slices of blocks this job holds, into our staging half; the job waits for
        // `done` before it gives the blocks back.
        if r.height == 1 {
            job::memcpy_async(r.dst, r.src, r.width, stream)?;
        } else {
            job::memcpy_2d_async(r.dst, r.width, r.src, r.spitch, (r.width, r.height), stream)?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "staged_tests.rs"]
mod tests;
