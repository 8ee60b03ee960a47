//! The disk tier (G3): preallocated cache files, O_DIRECT through io_uring, a checksummed header
//! per block, and a fault injector for tests.
mod fault;
mod format;
mod store;

pub use fault::{Fault, FaultInjector, FaultOp};
pub use store::{DirectMode, DiskIoMode, DiskOptions, DiskStorage};
