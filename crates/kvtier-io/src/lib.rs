//! kvtier-io: host memory, disk, remote and node tiers, CUDA copies and the transfer engine, in
//! three rooms:
//! - [`storage`]: the tiers below the engine's memory (host, [`storage::disk`],
//!   [`storage::remote`], [`storage::node`]);
//! - [`transfer`]: the engine's registered memory ([`transfer::memory`], [`transfer::layout`]),
//!   the [`TransferEngine`] and its CPU, staged and CUDA ([`transfer::cuda`]) copy paths;
//! - `sys` (private): every `unsafe` of kvtier. Each raw operation (syscalls, FFI, pointer
//!   copies) is a safe wrapper there, or an `unsafe fn` whose `# Safety` section names the
//!   caller's contract and whose callers are in `sys` too; each `unsafe` block has a
//!   `// SAFETY:` note. The one exception by design is the public `unsafe fn`
//!   [`EngineMemory::new`], declared in [`transfer::memory`] for callers that register memory
//!   kvtier cannot check. The other crates forbid `unsafe` code.
//!
//! [`compose`] builds a worker's engine from kvtier's configuration, [`error`] holds the typed
//! errors of the crate's seams and [`metrics_http`] serves the stats.
//!
//! A worker builds one [`TransferEngine`] from the engine's registered KV memory (an
//! [`EngineMemory`]: a [`BlockChunks`] layout, CUDA or CPU, registered through the `unsafe fn`
//! [`EngineMemory::new`] or a checked safe constructor, module [`transfer::memory`]), an optional [`HostStorage`], an optional
//! [`DiskStorage`] and an optional remote store, and hands it to the connector as its
//! `kvtier::transfer::BlockTransfer`. Every job completes with `Ok` or with the exact pairs that
//! failed.
//!
//! ```
//! use std::sync::Arc;
//! use kvtier::transfer::{BlockTransfer, TransferJob};
//! use kvtier::{BlockId, DeviceBlockId, JobId};
//! use kvtier_io::{
//!     DeviceKind, DevicePtr, EngineMemory, HostOptions, HostStorage, PinMode, StridedLayout,
//!     TransferEngine,
//! };
//!
//! // A CPU "engine" cache of 4 blocks of 256 bytes.
//! let mut kv = vec![0u8; 4 * 256];
//! kv[256..512].fill(7);
//! let base = DevicePtr::from_host(kv.as_ptr()).ok_or("null")?;
//! let layout = StridedLayout::contiguous(base, 4, 256)?;
//! // SAFETY: `kv` stays allocated, unmoved and untouched until `engine` drops below.
//! let memory = unsafe { EngineMemory::new(Arc::new(layout), DeviceKind::Cpu) };
//! let mut opts = HostOptions::new(8, 256);
//! opts.pin = PinMode::Never;
//! let host = Arc::new(HostStorage::new(&opts)?);
//! let engine = TransferEngine::builder()
//!     .device(memory)
//!     .host(host.clone())
//!     .build()?;
//! // Device block 1 -> host block 5.
//! let job = TransferJob::from_pairs(JobId(1), [(DeviceBlockId(1), BlockId(5))]);
//! let fence = engine.fence(None)?;
//! assert!(engine.execute(&job, &fence).is_ok());
//! let mut out = vec![0u8; 256];
//! host.read_block(5, &mut out)?;
//! assert!(out.iter().all(|&b| b == 7));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
/// The transfer benchmark behind `kvtier bench transfer` (feature `transfer-bench`; not part of
/// the storage and transfer API).
#[cfg(feature = "transfer-bench")]
#[doc(hidden)]
pub mod bench;
pub mod compose;
pub mod error;
pub mod metrics_http;
pub mod storage;
mod sys;
pub mod transfer;

pub use error::{BlockIoError, IoError};
pub use storage::disk::{
    DirectMode, DiskIoMode, DiskOptions, DiskStorage, Fault, FaultInjector, FaultOp,
    HEADER_KEY_OFFSET, SUBDIR,
};
pub use storage::host::{HostOptions, HostStorage, PinMode};
pub use transfer::cuda::{CudaCopyMethod, LayeredCopy};
pub use transfer::device::DeviceKind;
pub use transfer::engine::{TransferEngine, TransferEngineBuilder};
pub use transfer::layout::{BlockChunks, Chunk, DeviceLayout, Region, StridedLayout};
pub use transfer::memory::{CpuKvPool, DevicePtr, EngineMemory, MemoryError, TensorMemory};
