//! The host tier (G2): one large allocation of `num_blocks` contiguous blocks, pinned for CUDA
//! when a driver is present (mmap + parallel first touch + `cuMemHostRegister`, much faster than
//! one giant `cudaHostAlloc`), plain memory otherwise.
//!
//! Invariants: block `i` occupies `[base + i*block_bytes, base + (i+1)*block_bytes)`; the memory
//! lives (and stays registered) as long as the `HostStorage`; at most one job writes a block at
//! a time and nobody reads a block while it is written (the pool's handles guarantee this).
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{BlockIoError, IoError};
use crate::sys::cuda::Driver;
use crate::sys::job;
use crate::sys::mem::{self, Mapping};

/// The hint of a host tier that does not fit: names the settings that size it.
const HOST_SIZE_HINT: &str =
    "lower host.gb or host.num_blocks (KVTIER_HOST_GB, KVTIER_HOST_NUM_BLOCKS) or free memory";

/// Whether to pin the host tier for CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PinMode {
    /// Pin if a CUDA driver and device are present; plain memory otherwise.
    #[default]
    Auto,
    /// Never pin (CPU engines).
    Never,
    /// Pin or fail.
    Require,
}

/// How to build a [`HostStorage`].
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// Blocks of the host tier.
    pub num_blocks: u32,
    /// Bytes of one block.
    pub block_bytes: usize,
    /// Whether to pin the memory with CUDA.
    pub pin: PinMode,
    /// CUDA device whose primary context registers the memory.
    pub cuda_device: i32,
    /// Threads for the first touch (0 = available parallelism).
    pub touch_threads: usize,
}

impl HostOptions {
    /// Options for `num_blocks` blocks of `block_bytes`; pinning `Auto`, CUDA device 0.
    pub fn new(num_blocks: u32, block_bytes: usize) -> Self {
        HostOptions {
            num_blocks,
            block_bytes,
            pin: PinMode::Auto,
            cuda_device: 0,
            touch_threads: 0,
        }
    }
}

/// The host tier's memory.
pub struct HostStorage {
    map: Mapping,
    num_blocks: u32,
    block_bytes: usize,
    pinned: Option<Arc<Driver>>,
    setup_time: Duration,
}

impl std::fmt::Debug for HostStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStorage")
            .field("num_blocks", &self.num_blocks)
            .field("block_bytes", &self.block_bytes)
            .field("pinned", &self.pinned.is_some())
            .finish()
    }
}

impl HostStorage {
    /// Allocate (and pin, per `opts.pin`) the host tier. An allocation or pinning failure is an
    /// error that says what to change; callers leave the tier out rather than crash.
    pub fn new(opts: &HostOptions) -> Result<Self, IoError> {
        let t0 = Instant::now();
        if opts.num_blocks == 0 || opts.block_bytes == 0 {
            return Err(IoError::Config(
                "host tier needs at least one non-empty block".into(),
            ));
        }
        let bytes = (opts.num_blocks as usize)
            .checked_mul(opts.block_bytes)
            .ok_or_else(|| IoError::Config("host tier size overflows the address space".into()))?;
        // The mapping is MAP_NORESERVE, so the kernel accepts sizes far beyond memory and the first
        // touch below would then be OOM-killed: refuse them here, as a typed error.
        if let Some(avail) = mem::available_bytes() {
            if bytes > avail {
                return Err(IoError::HostAlloc {
                    bytes,
                    source: std::io::Error::new(
                        std::io::ErrorKind::OutOfMemory,
                        format!("only {avail} bytes of memory available"),
                    ),
                    hint: HOST_SIZE_HINT,
                });
            }
        }
        let map = Mapping::new(bytes).map_err(|source| IoError::HostAlloc {
            bytes,
            source,
            hint: HOST_SIZE_HINT,
        })?;
        let threads = if opts.touch_threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(4)
                .min(32)
        } else {
            opts.touch_threads
        };
        map.touch_parallel(threads);
        let pinned = match opts.pin {
            PinMode::Never => None,
            PinMode::Auto | PinMode::Require => match Driver::open(opts.cuda_device) {
                Ok(d) => match d.host_register(map.addr(), map.len()) {
                    Ok(()) => Some(d),
                    Err(reason) => {
                        return Err(IoError::HostPin {
                            bytes,
                            reason,
                            hint: "raise the locked-memory limit (`ulimit -l unlimited`, \
                                   LimitMEMLOCK=infinity, docker --ulimit memlock=-1) or lower \
                                   host.gb / host.num_blocks",
                        })
                    }
                },
                Err(e) if opts.pin == PinMode::Require => {
                    return Err(IoError::HostPin {
                        bytes,
                        reason: e,
                        hint: "install the NVIDIA driver, or ask for PinMode::Never (CPU engines)",
                    })
                }
                Err(e) => {
                    tracing::info!("host tier not pinned: {e}");
                    None
                }
            },
        };
        let setup_time = t0.elapsed();
        tracing::info!(
            bytes,
            pinned = pinned.is_some(),
            secs = setup_time.as_secs_f64(),
            "host tier ready"
        );
        Ok(HostStorage {
            map,
            num_blocks: opts.num_blocks,
            block_bytes: opts.block_bytes,
            pinned,
            setup_time,
        })
    }

    /// Blocks of the host tier.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    /// True if the memory is registered with CUDA (page-locked).
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }
    /// How long allocation, first touch and pinning took.
    pub fn setup_time(&self) -> Duration {
        self.setup_time
    }

    /// Address of block `id`.
    pub(crate) fn block_addr(&self, id: u32) -> Result<usize, BlockIoError> {
        if id >= self.num_blocks {
            return Err(BlockIoError::OutOfRange(id));
        }
        Ok(self.map.addr() + id as usize * self.block_bytes)
    }

    /// Copy `data` (exactly one block) into block `id`. The caller owns block `id` exclusively.
    pub fn write_block(&self, id: u32, data: &[u8]) -> Result<(), BlockIoError> {
        self.check_len(data.len())?;
        let dst = self.block_addr(id)?;
        // `dst` is block `id` inside our mapping, `data` a distinct caller slice of the same
        // length, and the pool gives the caller exclusive use of block `id`.
        job::write_from_slice(dst, data);
        Ok(())
    }

    /// Copy block `id` into `out` (exactly one block). Nobody may write block `id` meanwhile.
    pub fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), BlockIoError> {
        self.check_len(out.len())?;
        let src = self.block_addr(id)?;
        // As in `write_block`, with the roles swapped; `out` is exclusively borrowed.
        job::read_into_slice(src, out);
        Ok(())
    }

    fn check_len(&self, len: usize) -> Result<(), BlockIoError> {
        if len != self.block_bytes {
            return Err(BlockIoError::Other(format!(
                "buffer of {len} bytes for a block of {} bytes",
                self.block_bytes
            )));
        }
        Ok(())
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        if let Some(d) = &self.pinned {
            if let Err(e) = d.host_unregister(self.map.addr()) {
                tracing::warn!("unpinning the host tier: {e}");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip() {
        let mut o = HostOptions::new(5, 3000);
        o.pin = PinMode::Never;
        let h = HostStorage::new(&o).unwrap();
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 1) as u8).collect();
        h.write_block(4, &data).unwrap();
        let mut out = vec![0u8; 3000];
        h.read_block(4, &mut out).unwrap();
        assert_eq!(out, data);
        h.read_block(3, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        assert!(matches!(
            h.read_block(5, &mut out),
            Err(BlockIoError::OutOfRange(5))
        ));
        assert!(h.write_block(0, &data[..10]).is_err());
    }

    #[test]
    fn impossible_size_is_an_error_with_a_hint() {
        let mut o = HostOptions::new(u32::MAX, 1 << 30);
        o.pin = PinMode::Never;
        let e = HostStorage::new(&o).unwrap_err();
        let msg = e.to_string();
        // Regression (#13, unclear errors): the hint named `host_bytes`, which is no setting.
        assert!(msg.contains("host.gb or host.num_blocks"), "{msg}");
        assert!(!msg.contains("host_bytes"), "{msg}");
    }

    /// Regression (#13, aborts): a host tier larger than memory but within the address space
    /// (`host.num_blocks` 5e8 of 64 KiB) was mapped (MAP_NORESERVE) and then OOM-killed during the
    /// first touch; it is refused before mapping.
    #[test]
    fn host_tier_larger_than_memory_is_refused_before_touching() {
        let Some(avail) = mem::available_bytes() else {
            eprintln!("no /proc/meminfo: skipped");
            return;
        };
        let block = 64 << 10;
        let blocks = u32::try_from((avail / block).saturating_mul(2) + 1).unwrap_or(u32::MAX);
        let mut o = HostOptions::new(blocks, block);
        o.pin = PinMode::Never;
        let t0 = Instant::now();
        match HostStorage::new(&o) {
            Err(IoError::HostAlloc { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::OutOfMemory);
                assert!(source.to_string().contains("available"), "{source}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "touched memory first"
        );
    }

    #[test]
    fn require_pinning_without_cuda_fails_cleanly() {
        if crate::sys::cuda::library_present() {
            eprintln!("CUDA present: skipping the no-driver check");
            return;
        }
        let mut o = HostOptions::new(1, 4096);
        o.pin = PinMode::Require;
        assert!(matches!(HostStorage::new(&o), Err(IoError::HostPin { .. })));
    }
}
