//! kvtier-io: host memory, disk, CUDA and the transfer engine. All `unsafe` of kvtier lives in
//! this crate: every raw operation (syscalls, FFI, pointer copies) is an `unsafe fn` or a safe
//! wrapper in the private `sys` modules; the callers that must uphold such a function's
//! precondition (the transfer engine, the host, disk and CUDA copies, `EngineMemory`, the copy
//! benchmarks and GPU tests) call it in an `unsafe` block with a `// SAFETY:` note saying why it
//! holds. The other crates forbid `unsafe` code.
//!
//! A worker builds one [`TransferEngine`] from the engine's registered KV memory (an
//! [`EngineMemory`]: a [`BlockChunks`] layout, CUDA or CPU, registered through the `unsafe fn`
//! [`EngineMemory::new`] or a checked safe constructor, module [`memory`]), an optional [`HostStorage`], an optional
//! [`DiskStorage`] and an optional remote store, and hands it to the connector as its
//! `kvtier::transfer::BlockTransfer`. Every job completes with `Ok` or with the exact pairs that
//! failed.
//!
//! ```
//! use std::sync::Arc;
//! use kvtier::transfer::{BlockPair, BlockTransfer, TransferJob};
//! use kvtier::{JobId, Tier};
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
//! let job = TransferJob { id: JobId(1), src: Tier::Device, dst: Tier::Host,
//!     pairs: vec![BlockPair { src: 1, dst: 5 }], remote_keys: vec![] };
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
pub mod cuda;
mod device;
pub mod disk;
mod engine;
pub mod error;
mod host;
pub mod layout;
pub mod memory;
pub mod metrics_http;
pub mod node;
pub mod remote;
mod sys;

pub use cuda::CudaCopyMethod;
pub use device::DeviceKind;
pub use disk::{
    DirectMode, DiskIoMode, DiskOptions, DiskStorage, Fault, FaultInjector, FaultOp,
    HEADER_KEY_OFFSET, SUBDIR,
};
pub use engine::{TransferEngine, TransferEngineBuilder};
pub use error::{BlockIoError, IoError};
pub use host::{HostOptions, HostStorage, PinMode};
pub use layout::{BlockChunks, Chunk, DeviceLayout, Region, StridedLayout};
pub use memory::{CpuKvPool, DevicePtr, EngineMemory, MemoryError, TensorMemory};
