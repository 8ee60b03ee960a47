//! How fast this GPU's SMs read pinned host memory against its copy engine, measured once when
//! the CUDA mover starts; `LayeredCopy::Auto` takes the kernel-read way only where that rate is
//! close to the copy engine's ([`kernel_cut`]).
//!
//! Why: the same scatter kernel read host memory at 43.7 GB/s on the H200 but 29.5-32.1 GB/s on
//! the H100 machines (both PCIe Gen5, copy engine 55 GB/s on both). In vLLM 0.33 (Llama-3.1-8B
//! shape) the kernel-read layered replay beat the staged one on the H200 (40.7 vs 47.1 ms at 8K,
//! 23.6 vs 27.0 at 2K, 2026-12-05) and lost badly on the H100 (49.1 vs 30.2 ms at 8K,
//! 2026-12-06): a fixed cut by size cannot be right on both (docs/bench/vllm.md).
//!
//! Invariants: the probe touches only its own buffers (a pinned host buffer and a device buffer
//! it allocates and frees), on the mover's own streams before any job ran; it waits for its
//! copies before it returns; a failed probe changes nothing (the size cut stays).

use super::layered::{KERNEL_ALIGN, MAX_GRID};
use super::{launch_descs, Dir};
use crate::sys::cuda::{CuResult, DeviceAlloc, Event, Kernel, PinnedAlloc};
use crate::sys::job;

/// Bytes each probe moves: long enough that launch costs vanish (~1.2 ms at the link rate),
/// short enough to cost the engine's start nothing it would notice.
const PROBE_BYTES: usize = 64 << 20;

/// The kernel's pieces in the probe: one vLLM row (a (layer, block)'s K or V of Llama-3.1-8B,
/// 16 tokens x 8 heads x 128 x 2 bytes), as a replay's layered load copies them.
const PROBE_PIECE: usize = 32 << 10;

/// The kernel-read way is `Auto`'s below the size cut only where the kernel reads host memory
/// at least this fraction of the copy engine's rate (H200: 43.7 / 55 = 0.79, kernel faster in
/// vLLM; H100: 30 / 55 = 0.55, staged faster).
pub(crate) const KERNEL_MIN_SHARE: f64 = 0.7;

/// What the probe measured, in GB/s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HostReadRates {
    pub(crate) kernel_gb_s: f64,
    pub(crate) copy_gb_s: f64,
}

/// Up to how many bytes `Auto` loads take the kernel-read way: `size_cut` where the kernel reads
/// host memory at [`KERNEL_MIN_SHARE`] of the copy engine's rate or faster, none where it is
/// slower; `size_cut` where nothing was measured.
pub(crate) fn kernel_cut(rates: Option<HostReadRates>, size_cut: usize) -> usize {
    if rates.is_some_and(|r| !r.kernel_reads_fast()) {
        0
    } else {
        size_cut
    }
}

impl HostReadRates {
    /// Whether the kernel read at [`KERNEL_MIN_SHARE`] of the copy engine's rate or faster (a
    /// probe that timed no copy decides nothing: fast).
    pub(crate) fn kernel_reads_fast(self) -> bool {
        self.copy_gb_s <= 0.0 || self.kernel_gb_s >= KERNEL_MIN_SHARE * self.copy_gb_s
    }
}

/// Time `PROBE_BYTES` from pinned host memory into device memory, once by the scatter kernel
/// reading host addresses (pieces of [`PROBE_PIECE`]) and once by one copy-engine copy, each
/// after one untimed warm-up; on `dir`'s streams (the host-to-device direction, idle: the mover
/// is being built).
pub(crate) fn host_read_rates(kernel: &Kernel, dir: &Dir) -> CuResult<HostReadRates> {
    let host = PinnedAlloc::new(PROBE_BYTES)?;
    let dev = DeviceAlloc::new(PROBE_BYTES)?;
    let n = PROBE_BYTES / PROBE_PIECE;
    const _: () = assert!(PROBE_PIECE.is_multiple_of(KERNEL_ALIGN));
    let mut words = Vec::with_capacity(n * 3);
    for i in 0..n {
        let off = (i * PROBE_PIECE) as u64;
        words.extend_from_slice(&[
            host.addr() as u64 + off,
            dev.addr() + off,
            PROBE_PIECE as u64,
        ]);
    }
    let descs = PinnedAlloc::new(words.len() * 8)?;
    job::fill_pinned_words(&descs, 0, &words)?;
    let (start, end) = (Event::new(true)?, Event::new(true)?);
    let timed =
        |run: &dyn Fn() -> CuResult<()>, stream: &crate::sys::cuda::Stream| -> CuResult<f64> {
            run()?; // warm-up: first-touch of the pages' mappings, the kernel's first launch
            start.record(stream)?;
            run()?;
            end.record(stream)?;
            end.synchronize()?;
            let ms = f64::from(Event::elapsed_ms(&start, &end)?);
            Ok(if ms > 0.0 {
                PROBE_BYTES as f64 / ms / 1e6
            } else {
                0.0
            })
        };
    let kernel_gb_s = timed(
        &|| launch_descs(kernel, &dir.kernel, descs.addr() as u64, 0, n, MAX_GRID),
        &dir.kernel,
    )?;
    let copy_gb_s = timed(
        &|| job::memcpy_async(dev.addr(), host.addr() as u64, PROBE_BYTES, &dir.copy),
        &dir.copy,
    )?;
    Ok(HostReadRates {
        kernel_gb_s,
        copy_gb_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a CUDA machine (skipped without a driver): both ways move the probe's bytes at a
    /// plausible rate, and the mover's cut is what its own probe's rates decide.
    /// `kvtier_io_test --exact transfer::cuda::probe::tests::the_probe_measures_both_ways_on_a_gpu --nocapture`
    #[test]
    #[allow(clippy::unwrap_used)]
    fn the_probe_measures_both_ways_on_a_gpu() {
        use super::super::{CudaCopyMethod, CudaMover, LayeredCopy};
        use crate::sys::cuda::{self as cu, Driver};
        if !cu::library_present() || Driver::open(0).is_err() {
            eprintln!("no CUDA device: skipped");
            return;
        }
        let l =
            crate::StridedLayout::contiguous(crate::DevicePtr::new(4096).unwrap(), 2, 64).unwrap();
        let m = CudaMover::new(0, &l, None, CudaCopyMethod::Auto, LayeredCopy::Auto).unwrap();
        let Some(kernel) = m.kernel.as_ref() else {
            eprintln!("no NVRTC: skipped");
            return;
        };
        let r = host_read_rates(kernel, &m.h2d.lock().unwrap()).unwrap();
        eprintln!(
            "host reads: kernel {:.1} GB/s, copy engine {:.1} GB/s; the mover's kernel cut {} bytes",
            r.kernel_gb_s, r.copy_gb_s, m.kernel_max_bytes
        );
        assert!(r.kernel_gb_s > 1.0 && r.copy_gb_s > 1.0, "{r:?}");
        assert!(
            m.kernel_max_bytes == 0
                || m.kernel_max_bytes == super::super::layered::KERNEL_MAX_BYTES
        );
    }

    #[test]
    fn the_kernel_way_needs_a_host_read_rate_near_the_copy_engines() {
        let cut = 2 << 30;
        let h200 = HostReadRates {
            kernel_gb_s: 43.7,
            copy_gb_s: 55.3,
        };
        let h100 = HostReadRates {
            kernel_gb_s: 29.9,
            copy_gb_s: 54.8,
        };
        assert_eq!(kernel_cut(Some(h200), cut), cut);
        assert_eq!(kernel_cut(Some(h100), cut), 0);
        assert_eq!(kernel_cut(None, cut), cut, "unmeasured: the size cut");
        let nothing = HostReadRates {
            kernel_gb_s: 0.0,
            copy_gb_s: 0.0,
        };
        assert_eq!(
            kernel_cut(Some(nothing), cut),
            cut,
            "a probe that timed nothing decides nothing"
        );
        let at = HostReadRates {
            kernel_gb_s: KERNEL_MIN_SHARE * 50.0,
            copy_gb_s: 50.0,
        };
        assert_eq!(kernel_cut(Some(at), cut), cut, "the share itself is enough");
    }
}
