//! Safe entry points for the raw copies of a transfer job, so that `storage/` and `transfer/`
//! hold no `unsafe`: each wraps one `unsafe fn` of `mem`, `file` or `cuda` and states, in its
//! `// SAFETY:` note, that the job contract below is what makes the call sound.
//!
//! The job contract (upheld by every caller in this crate, by construction of kvtier's books and
//! registrations, and not checkable here; that is why these functions are crate-private):
//! - every address is inside memory kvtier registered or owns: a block of a host tier's mapping,
//!   a chunk of an [`EngineMemory`](crate::EngineMemory) (whose registration, `unsafe` or
//!   checked, guarantees it stays allocated), or one of kvtier's own buffers (staging, pinned
//!   descriptors, disk headers), and it stays allocated until the copy has completed (for an
//!   asynchronous copy: until the job has waited for its stream or event);
//! - the job owns each destination range exclusively and holds each source range read-only,
//!   per kvtier's books (a host or disk slot is given to one job at a time; the engine writes a
//!   block only while no job holds it);
//! - a raw stream handle is a live stream of the current CUDA context that the engine passed to
//!   the job, or 0 (the legacy default stream).
//!
//! Invariant: the functions add no behaviour to what they wrap (same calls, same order); the
//! slice wrappers only add a length check where a slice is involved.
use std::io;

use super::cuda::{self as cu, CuResult, Event, Kernel, PinnedAlloc, Stream};
use super::file::{self, IoReq};
use super::mem;
use super::uring::Ring;

/// Copy `len` bytes from `src` to `dst` (non-overlapping), under the job contract.
pub(crate) fn copy(src: usize, dst: usize, len: usize) {
    // SAFETY: the job contract (module docs): both ranges are registered or kvtier's own and
    // allocated for the call, `dst` is the job's exclusively, `src` held read-only.
    unsafe { mem::copy(src, dst, len) }
}

/// [`copy`] with non-temporal stores for long copies; [`mem::store_fence`] before another thread
/// reads the destination.
pub(crate) fn copy_stream(src: usize, dst: usize, len: usize) {
    // SAFETY: as in `copy`.
    unsafe { mem::copy_stream(src, dst, len) }
}

/// Copy `data` to `dst`, a range of `data.len()` bytes the job owns exclusively.
pub(crate) fn write_from_slice(dst: usize, data: &[u8]) {
    // SAFETY: `data` is a live borrowed slice, distinct from `dst`'s range (kvtier never hands
    // out slices of its registered memory beyond `with_bytes*`'s closures); `dst` is the job's
    // exclusively (contract).
    unsafe { mem::copy(data.as_ptr() as usize, dst, data.len()) }
}

/// Copy `out.len()` bytes at `src`, a range held read-only by the job, into `out`.
pub(crate) fn read_into_slice(src: usize, out: &mut [u8]) {
    // SAFETY: `out` is exclusively borrowed and distinct from `src`'s range; `src` is held
    // read-only (contract).
    unsafe { mem::copy(src, out.as_mut_ptr() as usize, out.len()) }
}

/// Run `f` over the `len` bytes at `addr`, a range held read-only by the job.
pub(crate) fn with_bytes<R>(addr: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
    // SAFETY: the range is initialised (registered or kvtier's own) and nobody writes it while
    // the job holds it (contract); the slice does not outlive the closure.
    f(unsafe { mem::slice(addr, len) })
}

/// Run `f` over the `len` bytes at `addr`, a range the job owns exclusively.
pub(crate) fn with_bytes_mut<R>(addr: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    // SAFETY: nobody else reads or writes the range while the job owns it (contract); the slice
    // does not outlive the closure.
    f(unsafe { mem::slice_mut(addr, len) })
}

/// Run every file request: on `ring` (io_uring) when given, else one by one with
/// `preadv`/`pwritev`. `results[i]` is the byte count of `reqs[i]` or its error.
pub(crate) fn run_requests(ring: Option<&mut Ring>, reqs: &[IoReq]) -> Vec<io::Result<usize>> {
    match ring {
        // SAFETY: every segment is a header/staging buffer owned by an `Op` that lives until the
        // caller has consumed the results, or a block of the job's (contract), valid for the
        // whole call; descriptors are open files of the disk tier.
        Some(ring) => unsafe { ring.run(reqs) },
        // SAFETY: as above.
        None => reqs.iter().map(|r| unsafe { file::run_sync(r) }).collect(),
    }
}

/// Copy `words` (in the device's byte order: little-endian, as x86-64 and aarch64 hosts store
/// them) into the pinned buffer `buf` at byte offset `at`, which no kernel reads meanwhile (the
/// job that used it last completed). One memory copy: no byte-by-byte conversion (that was 22 ms
/// of CPU for a 4 GiB load's 3 MiB of descriptors, on the critical path of a replay).
pub(crate) fn fill_pinned_words(buf: &PinnedAlloc, at: usize, words: &[u64]) -> CuResult<()> {
    const _: () = assert!(
        cfg!(target_endian = "little"),
        "descriptors are little-endian"
    );
    let len = std::mem::size_of_val(words);
    if at.checked_add(len).is_none_or(|end| end > buf.len()) {
        return Err("pinned buffer too small".into());
    }
    // SAFETY: `buf` is our pinned allocation of at least `at + len` bytes (checked), idle on the
    // device (the caller waited for its last use), distinct from `words`; a little-endian host
    // lays `words` out as the bytes the kernel reads.
    unsafe { mem::copy(words.as_ptr() as usize, buf.addr() + at, len) };
    Ok(())
}

/// Record `ev` on the engine's stream `stream` (a raw handle, 0 = legacy default stream).
pub(crate) fn record_on_engine_stream(ev: &Event, stream: u64) -> CuResult<()> {
    // SAFETY: `stream` is the engine's live stream of the current context, or 0 (contract).
    unsafe { ev.record_raw(stream) }
}

/// Make the engine's stream `stream` (raw handle, 0 = legacy default) wait for `ev`'s latest
/// record.
pub(crate) fn engine_stream_wait(ev: &Event, stream: u64) -> CuResult<()> {
    // SAFETY: as in `record_on_engine_stream`.
    unsafe { ev.make_raw_stream_wait(stream) }
}

/// Enqueue a copy of `len` bytes on `stream`; the job waits for the stream before it gives the
/// ranges back.
pub(crate) fn memcpy_async(dst: u64, src: u64, len: usize, stream: &Stream) -> CuResult<()> {
    // SAFETY: both ranges are registered or kvtier's own and stay valid and untouched until the
    // stream has run the copy (contract).
    unsafe { cu::memcpy_async(dst, src, len, stream) }
}

/// Enqueue `height` rows of `width` bytes, row `i` from `src + i * spitch` to
/// `dst + i * dpitch`, in one call (`cuMemcpy2DAsync`), as [`memcpy_async`] each row.
pub(crate) fn memcpy_2d_async(
    dst: u64,
    dpitch: usize,
    src: u64,
    spitch: usize,
    shape: (usize, usize),
    stream: &Stream,
) -> CuResult<()> {
    // SAFETY: as in `memcpy_async`, for every row.
    unsafe { cu::memcpy_2d_async(dst, dpitch, src, spitch, shape, stream) }
}

/// Enqueue many copies in one call (`cuMemcpyBatchAsync`), as [`memcpy_async`] each.
pub(crate) fn memcpy_batch_async(
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    device_is_src: bool,
    ordinal: i32,
    stream: &Stream,
) -> CuResult<()> {
    // SAFETY: as in `memcpy_async`, for every triple.
    unsafe { cu::memcpy_batch_async(dsts, srcs, sizes, device_is_src, ordinal, stream) }
}

/// Launch the copy kernel over `n` descriptors at `descs` (a pinned, device-mapped buffer of
/// kvtier's) naming registered chunks and kvtier's own staging or host blocks.
pub(crate) fn launch_copy_kernel(
    kernel: &Kernel,
    grid: u32,
    block: u32,
    stream: &Stream,
    descs: u64,
    n: u32,
) -> CuResult<()> {
    // SAFETY: `descs` holds `n` descriptors readable by the device until the job waits for the
    // kernel, naming memory valid and owned by the job as the contract states.
    unsafe { kernel.launch(grid, block, stream, descs, n) }
}

/// Register memory the caller allocated itself (the benchmark's and GPU tests' buffers) as
/// engine memory, without the checks of the safe constructors. Only for those callers: the
/// memory `layout` names is theirs, outlives every engine built from the result and is touched
/// only by its jobs meanwhile.
#[cfg(any(test, feature = "transfer-bench"))]
pub(crate) fn register_own_memory(
    layout: std::sync::Arc<dyn crate::BlockChunks>,
    kind: crate::DeviceKind,
) -> crate::EngineMemory {
    // SAFETY: the callers (benchmark, GPU tests) allocate the memory `layout` names themselves
    // and keep it allocated and otherwise untouched until every engine over it dropped.
    unsafe { crate::EngineMemory::new(layout, kind) }
}
