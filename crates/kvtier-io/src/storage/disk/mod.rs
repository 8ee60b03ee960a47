//! The disk tier (G3): a locked file set of preallocated cache files in kvtier's own
//! subdirectory, O_DIRECT through io_uring, a checksummed header per block binding it to its
//! key, an optional journal for warm restarts, and a fault injector for tests.
mod dir;
mod fault;
mod files;
mod format;
/// The crate-private decoders, for the fuzz targets and tests (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod fuzz;
mod index;
mod io;
mod store;

pub use dir::SUBDIR;
pub use fault::{Fault, FaultInjector, FaultOp};
pub use format::KEY_OFFSET as HEADER_KEY_OFFSET;
pub use store::{
    recoverable_blocks, slot_bytes, DirectMode, DiskIoMode, DiskOptions, DiskStorage, FLUSH_AGE,
    FLUSH_RECORDS,
};
