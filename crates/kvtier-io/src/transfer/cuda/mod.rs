//! CUDA copies between the engine's GPU blocks (scattered chunks) and the pinned host tier
//! (contiguous blocks), on kvtier's own low-priority streams, ordered after the engine's work
//! by events.
//!
//! Three ways to move a batch, chosen per job ([`CudaCopyMethod`]):
//! - `PerChunk`: one `cuMemcpyAsync` per (coalesced) chunk: best when chunks are large (the
//!   TensorRT-LLM pool: one 2 MiB chunk per block);
//! - `Batch`: the same copies through one `cuMemcpyBatchAsync` call;
//! - `Kernel`: a gather (offload) or scatter (onboard) kernel, compiled at run time with NVRTC,
//!   packs scattered chunks into a device staging buffer, and the copy engine moves whole
//!   blocks over PCIe; two staging halves pipeline kernel and copy. The kernel touches only
//!   device memory, so it occupies the SMs for microseconds per batch, not for the transfer.
//!
//! Invariants: every job first makes both kvtier streams wait for the job's fence (an event
//! recorded on the engine's stream), so engine memory is read or written only after the engine's
//! earlier work; `copy` returns only after all its copies completed (or failed); a staging half
//! and its descriptors are reused only after the event closing their previous use completed (on
//! the CPU; for an ordered load, by a stream wait on the device, with every round's descriptors
//! in one buffer written before the first round and reused only by a later job); with an
//! `Order` (a synchronous load), the engine's stream waits for the job's completion event
//! before the caller is told to go on; per-direction state is guarded by its own mutex, so
//! offload and onboard run concurrently.
use std::sync::{Arc, Mutex};

use kvtier::transfer::{Fence, TransferError};

use crate::transfer::device::{CopyDir, Order};

mod direct2d;
mod gate;
mod layered;
mod probe;
mod staged;
use crate::error::IoError;
use crate::storage::host::HostStorage;
use crate::sys::cuda::{
    self as cu, CuResult, DeviceAlloc, Driver, Event, Kernel, PinnedAlloc, Stream,
};
use crate::sys::job;
use crate::transfer::layout::{BlockChunks, Chunk};
pub use layered::LayeredCopy;
#[cfg(any(test, feature = "testing"))]
pub use staged::PlanInput;

/// How scattered chunks are moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CudaCopyMethod {
    /// Per job: `PerChunk` for large chunks, else `Kernel` (if NVRTC is available), else
    /// `Batch` (if the driver has it), else `PerChunk`. Overridden by `KVTIER_CUDA_COPY`
    /// (`chunk`, `batch`, `kernel`).
    #[default]
    Auto,
    /// One `cuMemcpyAsync` per coalesced chunk.
    PerChunk,
    /// The chunks' copies through `cuMemcpyBatchAsync` (CUDA 12.8+ drivers).
    Batch,
    /// The gather/scatter kernel through the device staging halves.
    Kernel,
}

impl CudaCopyMethod {
    /// The method named `auto`, `chunk` (or `per-chunk`), `batch` or `kernel`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "chunk" | "per-chunk" => Some(Self::PerChunk),
            "batch" => Some(Self::Batch),
            "kernel" => Some(Self::Kernel),
            _ => None,
        }
    }
}

/// Chunks at least this large (on average) go straight through the copy engine.
const LARGE_CHUNK: usize = 512 * 1024;
/// Blocks per staging half, unless `KVTIER_STAGING_HALF_BLOCKS` names another count (1 to
/// [`MAX_HALF_BLOCKS`], for measurements: each round of an ordered load costs the copy engine
/// stream waits, so larger halves mean fewer rounds for the same bytes).
const HALF_BLOCKS: usize = 8;
/// The largest staging half `KVTIER_STAGING_HALF_BLOCKS` may ask for (512 MiB per half for
/// Llama-3.1-8B's 2 MiB blocks).
const MAX_HALF_BLOCKS: usize = 256;

/// The blocks per staging half: `KVTIER_STAGING_HALF_BLOCKS` when it names 1 to
/// [`MAX_HALF_BLOCKS`], else [`HALF_BLOCKS`] (a value out of range is reported and ignored).
fn half_blocks_from_env() -> usize {
    let Ok(v) = std::env::var("KVTIER_STAGING_HALF_BLOCKS") else {
        return HALF_BLOCKS;
    };
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_HALF_BLOCKS).contains(&n) => n,
        _ => {
            tracing::warn!(value = %v, max = MAX_HALF_BLOCKS, "KVTIER_STAGING_HALF_BLOCKS is not a block count in range: ignored");
            HALF_BLOCKS
        }
    }
}
const THREADS: u32 = 256;

const KERNEL_SRC: &str = r#"
struct Desc { unsigned long long src, dst, len; };
extern "C" __global__ void kvtier_copy_chunks(const Desc* __restrict__ d, unsigned int n) {
    for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
        const Desc x = d[i];
        const uint4* __restrict__ s = (const uint4*)x.src;
        uint4* __restrict__ t = (uint4*)x.dst;
        const unsigned long long n16 = x.len / 16;
        unsigned long long k = threadIdx.x;
        for (; k + 3 * blockDim.x < n16; k += 4 * blockDim.x) {
            uint4 a = s[k], b = s[k + blockDim.x], c = s[k + 2 * blockDim.x], e = s[k + 3 * blockDim.x];
            t[k] = a; t[k + blockDim.x] = b; t[k + 2 * blockDim.x] = c; t[k + 3 * blockDim.x] = e;
        }
        for (; k < n16; k += blockDim.x) t[k] = s[k];
        const unsigned char* sb = (const unsigned char*)x.src;
        unsigned char* tb = (unsigned char*)x.dst;
        for (unsigned long long j = n16 * 16 + threadIdx.x; j < x.len; j += blockDim.x) tb[j] = sb[j];
    }
}
"#;

/// Event recorded on the engine's stream by `fence`.
struct CudaFence(Event);

/// One copy of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Copy {
    src: u64,
    dst: u64,
    len: usize,
}

/// Per-direction resources (one in-flight job per direction).
struct Dir {
    copy: Stream,
    kernel: Stream,
    /// Kernel path: device staging (2 halves of `half_blocks` blocks) and pinned descriptors.
    staging: Option<(DeviceAlloc, [PinnedAlloc; 2])>,
    /// Kernel path, ordered jobs: every round's descriptors of the current job (pinned,
    /// device-mapped; grown on demand, reused only by a later job).
    job_descs: Option<PinnedAlloc>,
    half_done: [Event; 2],
    handoff: [Event; 2],
    done: Event,
}

impl Dir {
    /// Write every round's descriptors, in order, into the job descriptor buffer (grown on
    /// demand) and return its device-mapped address. Callers hold the direction's lock, and the
    /// job that used the buffer last completed: every job waits for its `done` before it lets
    /// the lock go.
    fn fill_job_descs<'a>(
        &mut self,
        rounds: impl Iterator<Item = &'a [u64]> + Clone,
    ) -> CuResult<u64> {
        let bytes: usize = rounds.clone().map(|d| d.len() * 8).sum();
        if self.job_descs.as_ref().is_none_or(|b| b.len() < bytes) {
            self.job_descs = Some(PinnedAlloc::new(bytes.next_power_of_two().max(64))?);
        }
        let Some(buf) = self.job_descs.as_ref() else {
            return Err("descriptor buffer missing".into());
        };
        // `buf` is our pinned buffer of at least `bytes` bytes, and no kernel reads it (above).
        let mut at = 0;
        for d in rounds {
            job::fill_pinned_words(buf, at, d)?;
            at += d.len() * 8;
        }
        Ok(buf.addr() as u64)
    }
}

/// The probe's rates (`probe.rs`) where `Auto` layered loads could take the kernel-read way;
/// `None` where they cannot or the probe failed (reported: the size cut then stays).
fn probe_host_reads(
    kernel: Option<&Kernel>,
    host_pointers: bool,
    layered: LayeredCopy,
    h2d: &Mutex<Dir>,
) -> Option<probe::HostReadRates> {
    let kernel = kernel.filter(|_| host_pointers && layered == LayeredCopy::Auto)?;
    let dir = h2d.lock().ok()?;
    match probe::host_read_rates(kernel, &dir) {
        Ok(r) => {
            tracing::info!(
                kernel_gb_s = r.kernel_gb_s,
                copy_gb_s = r.copy_gb_s,
                kernel_way = r.kernel_reads_fast(),
                "host reads probed: layered loads take the kernel way only where its rate is near the copy engine's"
            );
            Some(r)
        }
        Err(e) => {
            tracing::warn!("host-read probe failed ({e}); layered loads keep the size cut");
            None
        }
    }
}

/// Launch the copy kernel on `stream` over the `n` descriptors from number `first` of the
/// pinned, device-mapped buffer at `base`, on at most `max_grid` thread blocks. The descriptors
/// name memory the job holds (its staging, the host blocks or arena slots it leased, the
/// engine's registered chunks).
fn launch_descs(
    kernel: &Kernel,
    stream: &Stream,
    base: u64,
    first: u64,
    n: usize,
    max_grid: usize,
) -> CuResult<()> {
    if n == 0 {
        return Ok(());
    }
    let grid = u32::try_from(n.min(max_grid)).unwrap_or(1);
    let count = u32::try_from(n).map_err(|e| e.to_string())?;
    job::launch_copy_kernel(kernel, grid, THREADS, stream, base + first * 24, count)
}

pub(crate) struct CudaMover {
    driver: Arc<Driver>,
    bytes_per_block: usize,
    /// Blocks per staging half ([`half_blocks_from_env`]).
    half_blocks: usize,
    method: CudaCopyMethod,
    kernel: Option<Kernel>,
    batch_available: bool,
    /// Kernels may read pinned, registered host memory at its host addresses (unified addressing
    /// and `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`): layered loads, whose source must also be
    /// such memory ([`crate::transfer::device::Ordering::readable`]).
    host_pointers: bool,
    /// How layered loads move their bytes (`KVTIER_LAYERED_COPY`).
    layered_copy: LayeredCopy,
    /// `Auto` layered loads up to this many bytes take the kernel-read way (`probe.rs`).
    kernel_max_bytes: usize,
    d2h: Mutex<Dir>,
    h2d: Mutex<Dir>,
}

impl CudaMover {
    pub(crate) fn new(
        ordinal: i32,
        layout: &dyn BlockChunks,
        host: Option<&HostStorage>,
        method: CudaCopyMethod,
        layered: LayeredCopy,
    ) -> Result<Self, IoError> {
        let driver = Driver::open(ordinal).map_err(IoError::Cuda)?;
        let method = match std::env::var("KVTIER_CUDA_COPY")
            .ok()
            .as_deref()
            .and_then(CudaCopyMethod::parse)
        {
            Some(m) => m,
            None => method,
        };
        if let Some(h) = host {
            if !h.is_pinned() {
                tracing::warn!(
                    "host tier is not pinned: CUDA copies will be slow (pageable memory)"
                );
            }
        }
        let bytes_per_block = layout.bytes_per_block();
        let kernel = if matches!(method, CudaCopyMethod::Auto | CudaCopyMethod::Kernel) {
            match compile_kernel() {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(
                        "gather/scatter kernel unavailable ({e}); using copy-engine copies only"
                    );
                    None
                }
            }
        } else {
            None
        };
        if method == CudaCopyMethod::Kernel && kernel.is_none() {
            return Err(IoError::Cuda(
                "copy method `kernel` asked for but NVRTC could not build it".into(),
            ));
        }
        let batch_available = cu::has_symbol("cuMemcpyBatchAsync_v2");
        if method == CudaCopyMethod::Batch && !batch_available {
            return Err(IoError::Cuda(
                "copy method `batch` needs a CUDA 12.8+ driver".into(),
            ));
        }
        let descs = initial_job_descs(layout);
        let half_blocks = half_blocks_from_env();
        let dir = |with_staging: bool| -> CuResult<Dir> {
            let staging = if with_staging {
                let dev = (DeviceAlloc::new(2 * half_blocks * bytes_per_block))?;
                let nd = half_blocks * max_chunks(layout) * 24;
                Some((dev, [(PinnedAlloc::new(nd))?, (PinnedAlloc::new(nd))?]))
            } else {
                None
            };
            Ok(Dir {
                copy: (Stream::new(false))?,
                kernel: (Stream::new(true))?,
                // Sized up front: growing it later frees the old buffer, and cuMemFreeHost
                // waits for the whole device, in the middle of a step.
                job_descs: if with_staging {
                    Some(PinnedAlloc::new(descs)?)
                } else {
                    None
                },
                staging,
                half_done: [(Event::new(false))?, (Event::new(false))?],
                handoff: [(Event::new(false))?, (Event::new(false))?],
                done: (Event::new(false))?,
            })
        };
        let d2h = Mutex::new(dir(kernel.is_some()).map_err(IoError::Cuda)?);
        let h2d = Mutex::new(dir(kernel.is_some()).map_err(IoError::Cuda)?);
        tracing::info!(
            ordinal,
            ?method,
            kernel = kernel.is_some(),
            batch = batch_available,
            half_blocks,
            "CUDA transfers ready"
        );
        let host_pointers = driver.host_pointers_usable();
        let layered_copy = LayeredCopy::from_env().unwrap_or(layered);
        let kernel_max_bytes = probe::kernel_cut(
            probe_host_reads(kernel.as_ref(), host_pointers, layered_copy, &h2d),
            layered::KERNEL_MAX_BYTES,
        );
        Ok(CudaMover {
            driver,
            bytes_per_block,
            half_blocks,
            method,
            kernel,
            batch_available,
            host_pointers,
            layered_copy,
            kernel_max_bytes,
            d2h,
            h2d,
        })
    }

    pub(crate) fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        let Some(s) = engine_stream else {
            return Ok(Fence::none());
        };
        self.driver.make_current().map_err(TransferError::Cuda)?;
        let ev = Event::new(false).map_err(TransferError::Cuda)?;
        // The engine hands its current stream of this device's primary context (or 0, the
        // legacy default stream), live while it issues the job.
        job::record_on_engine_stream(&ev, s).map_err(TransferError::Cuda)?;
        Ok(Fence(Some(Box::new(CudaFence(ev)))))
    }

    /// Copy `items[k] = (pair index, chunks of the device block, host block address)`;
    /// returns the failed pairs (all of them if a CUDA call failed: CUDA errors are not
    /// attributable to one block). With `order`, the engine's stream is made to wait for the
    /// copies and the caller is told so before this waits for their completion.
    pub(crate) fn copy(
        &self,
        items: &[(usize, Vec<Chunk>, usize)],
        way: CopyDir,
        fence: &Fence,
        order: Order<'_>,
    ) -> Vec<(usize, String)> {
        if items.is_empty() {
            return Vec::new();
        }
        match self.copy_inner(items, way, fence, order) {
            Ok(()) => Vec::new(),
            Err(e) => {
                self.quiesce(way.to_host());
                items
                    .iter()
                    .map(|(i, _, _)| (*i, format!("CUDA: {e}")))
                    .collect()
            }
        }
    }

    /// After a job failed part way: wait for what it had already enqueued on the direction's
    /// streams, so none of its copies lands after the failure is reported (the engine then
    /// recomputes into those blocks, or reuses them).
    pub(crate) fn quiesce(&self, to_host: bool) {
        let _ = self.driver.make_current();
        let dir = if to_host { &self.d2h } else { &self.h2d };
        if let Ok(d) = dir.lock() {
            let _ = d.copy.synchronize();
            let _ = d.kernel.synchronize();
        }
    }

    /// The method a job with these chunks uses.
    pub(crate) fn pick(&self, items: &[(usize, Vec<Chunk>, usize)]) -> CudaCopyMethod {
        let (n, total) = items
            .iter()
            .flat_map(|(_, c, _)| c)
            .fold((0usize, 0usize), |a, c| (a.0 + 1, a.1 + c.len));
        let aligned = items
            .iter()
            .all(|(_, c, h)| h % 16 == 0 && c.iter().all(|c| c.addr % 16 == 0 && c.len % 16 == 0));
        match self.method {
            CudaCopyMethod::Auto => {
                if n == 0 || total / n >= LARGE_CHUNK {
                    CudaCopyMethod::PerChunk
                } else if self.kernel.is_some() && aligned {
                    CudaCopyMethod::Kernel
                } else if self.batch_available {
                    CudaCopyMethod::Batch
                } else {
                    CudaCopyMethod::PerChunk
                }
            }
            CudaCopyMethod::Kernel if !aligned => CudaCopyMethod::PerChunk,
            m => m,
        }
    }

    fn copy_inner(
        &self,
        items: &[(usize, Vec<Chunk>, usize)],
        way: CopyDir,
        fence: &Fence,
        order: Order<'_>,
    ) -> CuResult<()> {
        let to_host = way.to_host();
        let entered = std::time::Instant::now();
        self.driver.make_current()?;
        let dir_lock = if to_host { &self.d2h } else { &self.h2d };
        let mut dir = dir_lock
            .lock()
            .map_err(|_| "transfer state poisoned by an earlier panic".to_string())?;
        if let Some(f) = fence.0.as_ref().and_then(|b| b.downcast_ref::<CudaFence>()) {
            if order.is_none() {
                // The engine's work before the fence (for a store, its whole forward pass) is
                // waited for asleep; once it completed, work enqueued below runs after it, so
                // the copy streams need no wait on it. The copies' own waits are short.
                f.0.wait_asleep()?;
            } else {
                // An ordered load must return once enqueued: the streams alone order it.
                dir.copy.wait(&f.0)?;
                dir.kernel.wait(&f.0)?;
            }
        }
        let method = self.pick(items);
        if tracing::enabled!(tracing::Level::DEBUG) {
            // Profiling aid: the copy's method and the CPU time spent before its first copy.
            let chunks: usize = items.iter().map(|(_, c, _)| c.len()).sum();
            let before_first_copy_us = entered.elapsed().as_micros() as u64;
            tracing::debug!(
                ?method,
                blocks = items.len(),
                chunks,
                to_host,
                before_first_copy_us,
                "CUDA copy"
            );
        }
        let last = match method {
            CudaCopyMethod::Kernel => {
                let paced = order.is_none();
                self.run_kernel(&mut dir, items, way, paced)?;
                if paced {
                    // The paced loop waited for both halves: the copies are complete.
                    return Ok(());
                }
                // A gather round ends with its copies, a scatter round with its kernel.
                if to_host {
                    &dir.copy
                } else {
                    &dir.kernel
                }
            }
            m => {
                let copies = coalesce(flatten(items, way));
                if m == CudaCopyMethod::Batch {
                    let mut d: Vec<u64> = copies.iter().map(|c| c.dst).collect();
                    let mut s: Vec<u64> = copies.iter().map(|c| c.src).collect();
                    let mut z: Vec<usize> = copies.iter().map(|c| c.len).collect();
                    for ((d, s), z) in d
                        .chunks_mut(4096)
                        .zip(s.chunks_mut(4096))
                        .zip(z.chunks_mut(4096))
                    {
                        // Device chunks come from the engine's registered layout and host
                        // addresses are whole blocks of the host tier owned by this job;
                        // `done.wait()` below waits for completion before returning.
                        job::memcpy_batch_async(d, s, z, to_host, self.driver.ordinal, &dir.copy)?;
                    }
                } else {
                    for c in &copies {
                        // As above.
                        job::memcpy_async(c.dst, c.src, c.len, &dir.copy)?;
                    }
                }
                &dir.copy
            }
        };
        dir.done.record(last)?;
        if let Some(o) = order {
            // The engine passed the stream its next work (the forward pass) runs on, a live
            // stream of this device's primary context, or 0 (`execute_ordered`).
            job::engine_stream_wait(&dir.done, o.stream)?;
            // Profiling aid: how long the engine's forward pass waited for the ordered load.
            tracing::debug!(
                enqueue_us = entered.elapsed().as_micros() as u64,
                "ordered load enqueued"
            );
            (o.enqueued)(None);
        }
        // The host blocks stay held by the job until the copies completed.
        dir.done.wait()
    }

    /// Gather/scatter through the staging halves (see the module comment).
    ///
    /// `paced` (every job but an ordered load): before a round refills a half's descriptors and
    /// reuses it, the CPU waits for that half's previous round, and at the end for both halves
    /// (the loop validated on the H200). Not paced (an ordered load, whose caller returns to the
    /// engine once everything is enqueued): every round is enqueued at once, a half's reuse is
    /// ordered on the device (a stream waits for its previous round's event), and all rounds'
    /// descriptors are written to one buffer before the first round.
    fn run_kernel(
        &self,
        dir: &mut Dir,
        items: &[(usize, Vec<Chunk>, usize)],
        way: CopyDir,
        paced: bool,
    ) -> CuResult<()> {
        let to_host = way.to_host();
        let (Some(kernel), Some((stage, _))) = (&self.kernel, &dir.staging) else {
            return Err("kernel path not set up".into());
        };
        let bpb = self.bytes_per_block;
        let base = stage.addr();
        let rounds: Vec<(Vec<u64>, Vec<Copy>)> = items
            .chunks(self.half_blocks)
            .enumerate()
            .map(|(r, group)| {
                let half = base + ((r % 2) * self.half_blocks * bpb) as u64;
                round(group, half, bpb, way)
            })
            .collect();
        if !paced {
            dir.fill_job_descs(rounds.iter().map(|(d, _)| d.as_slice()))?;
        }
        let (Some((_, descs)), dir) = (&dir.staging, &*dir) else {
            return Err("kernel path not set up".into());
        };
        let mut first = 0u64; // not paced: this round's first descriptor in `job_descs`
        let mut last = [false; 2];
        for (r, (d, copies)) in rounds.iter().enumerate() {
            let h = r % 2;
            let nd = d.len() / 3;
            let dptr = if paced {
                // The half's previous round (kernel and copies) is complete: staging and
                // descriptors are free.
                dir.half_done[h].wait()?;
                let dbuf = &descs[h];
                // `dbuf` is our pinned buffer (its size checked by the call), and the GPU is
                // done with it (`half_done[h]` synchronised above).
                job::fill_pinned_words(dbuf, 0, d)?;
                dbuf.addr() as u64
            } else {
                // The half's previous round finished with it before this round refills it: its
                // copies out (gather) or its scatter kernel (scatter).
                if to_host {
                    dir.kernel.wait(&dir.half_done[h])?;
                } else {
                    dir.copy.wait(&dir.half_done[h])?;
                }
                let buf = dir.job_descs.as_ref().map_or(0, |b| b.addr() as u64);
                let p = buf + first * 24;
                first += nd as u64;
                p
            };
            let grid = u32::try_from(nd.min(65535)).unwrap_or(65535);
            let n = u32::try_from(nd).map_err(|e| e.to_string())?;
            if to_host {
                // Descriptors name engine chunks (registered) and our staging half; the pinned
                // descriptor buffer is device-mapped (unified addressing).
                job::launch_copy_kernel(kernel, grid, THREADS, &dir.kernel, dptr, n)?;
                dir.handoff[h].record(&dir.kernel)?;
                dir.copy.wait(&dir.handoff[h])?;
                for c in copies {
                    // Staging half (ours) to whole host blocks owned by this job.
                    job::memcpy_async(c.dst, c.src, c.len, &dir.copy)?;
                }
                dir.half_done[h].record(&dir.copy)?;
            } else {
                for c in copies {
                    // Whole host blocks held by this job to our staging half.
                    job::memcpy_async(c.dst, c.src, c.len, &dir.copy)?;
                }
                dir.handoff[h].record(&dir.copy)?;
                dir.kernel.wait(&dir.handoff[h])?;
                // As for the gather, with the direction reversed.
                job::launch_copy_kernel(kernel, grid, THREADS, &dir.kernel, dptr, n)?;
                dir.half_done[h].record(&dir.kernel)?;
            }
            last[h] = true;
        }
        if paced {
            for (used, ev) in last.iter().zip(&dir.half_done) {
                if *used {
                    ev.wait()?;
                }
            }
        }
        Ok(())
    }
}

/// One staging round of the kernel path: the kernel's descriptors (src, dst, len per chunk,
/// between the engine's chunks and the blocks' slots of the staging half at `half`) and the
/// copy engine's copies of whole blocks between that half and the host tier.
fn round(
    group: &[(usize, Vec<Chunk>, usize)],
    half: u64,
    bpb: usize,
    way: CopyDir,
) -> (Vec<u64>, Vec<Copy>) {
    let to_host = way.to_host();
    let mut d: Vec<u64> = Vec::with_capacity(group.len() * 64 * 3);
    let mut copies = Vec::with_capacity(group.len());
    for (k, (_, chunks, host)) in group.iter().enumerate() {
        let slot = half + (k * bpb) as u64;
        let mut off = 0u64;
        for c in chunks {
            let (s, t) = if to_host {
                (c.addr, slot + off)
            } else {
                (slot + off, c.addr)
            };
            d.extend_from_slice(&[s, t, c.len as u64]);
            off += c.len as u64;
        }
        let (src, dst) = if to_host {
            (slot, *host as u64)
        } else {
            (*host as u64, slot)
        };
        copies.push(Copy { src, dst, len: bpb });
    }
    (d, coalesce(copies))
}

/// The kernel paths' job descriptor buffer allocated when the engine is built: room for the
/// descriptors of a job of every device block, or of 4 GiB of blocks if that is fewer (a 32K
/// prompt of an 8B model), each block cut into at most its chunks plus its layers (24 bytes a
/// descriptor); at least 64 KiB, at most 16 MiB. A larger job grows it then.
fn initial_job_descs(layout: &dyn BlockChunks) -> usize {
    const MOST: usize = 16 << 20;
    let bpb = layout.bytes_per_block().max(1);
    let blocks = (layout.num_blocks() as usize)
        .min((4usize << 30) / bpb)
        .max(1);
    let per_block = (max_chunks(layout) + layout.layers().unwrap_or(0)) * 24;
    blocks
        .saturating_mul(per_block)
        .next_power_of_two()
        .clamp(64 << 10, MOST)
}

fn max_chunks(layout: &dyn BlockChunks) -> usize {
    let mut v = Vec::new();
    let _ = layout.chunks(0, &mut v);
    v.len().max(1)
}

fn flatten(items: &[(usize, Vec<Chunk>, usize)], way: CopyDir) -> Vec<Copy> {
    let to_host = way.to_host();
    let mut out = Vec::new();
    for (_, chunks, host) in items {
        let mut off = 0u64;
        for c in chunks {
            let h = *host as u64 + off;
            out.push(if to_host {
                Copy {
                    src: c.addr,
                    dst: h,
                    len: c.len,
                }
            } else {
                Copy {
                    src: h,
                    dst: c.addr,
                    len: c.len,
                }
            });
            off += c.len as u64;
        }
    }
    out
}

/// Merge copies whose source and destination both continue the previous one.
fn coalesce(copies: Vec<Copy>) -> Vec<Copy> {
    let mut out: Vec<Copy> = Vec::with_capacity(copies.len());
    for c in copies {
        if let Some(p) = out.last_mut() {
            if p.src + p.len as u64 == c.src && p.dst + p.len as u64 == c.dst {
                p.len += c.len;
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// NVRTC's output for [`KERNEL_SRC`] (CUDA 13.0, sm_75 PTX), used where NVRTC is not
/// installed; the driver still compiles it for the actual GPU when it is loaded.
const KERNEL_PTX: &str = include_str!("copy_kernel.ptx");

fn compile_kernel() -> CuResult<Kernel> {
    if cu::nvrtc_present() {
        match cudarc::nvrtc::compile_ptx(KERNEL_SRC) {
            Ok(ptx) => match Kernel::load(&ptx.to_src(), "kvtier_copy_chunks") {
                Ok(k) => return Ok(k),
                Err(e) => tracing::warn!("loading NVRTC output: {e}; using the embedded PTX"),
            },
            Err(e) => tracing::warn!("NVRTC: {e:?}; using the embedded PTX"),
        }
    } else {
        tracing::info!("NVRTC not installed; using the embedded PTX of the copy kernel");
    }
    Kernel::load(KERNEL_PTX, "kvtier_copy_chunks")
}

#[cfg(test)]
pub(crate) mod gpu_tests;

#[cfg(test)]
mod tests;
