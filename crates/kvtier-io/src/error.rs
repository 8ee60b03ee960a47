//! Errors of the I/O crate: setting a tier up (whole-tier errors, each saying what to change) and
//! moving one block (per-block errors, reported as `BlockFailure` reasons, never as data).
use std::path::PathBuf;

/// A tier or the transfer engine could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The host tier's memory could not be allocated.
    #[error("host tier: cannot allocate {bytes} bytes: {source}; {hint}")]
    HostAlloc {
        /// Bytes asked for.
        bytes: usize,
        /// The allocator's error.
        #[source]
        source: std::io::Error,
        /// What to change.
        hint: &'static str,
    },
    /// The host tier's memory could not be pinned (`PinMode::Require`, or registration failed).
    #[error("host tier: cannot pin {bytes} bytes for CUDA: {reason}; {hint}")]
    HostPin {
        /// Bytes asked for.
        bytes: usize,
        /// Why CUDA refused.
        reason: String,
        /// What to change.
        hint: &'static str,
    },
    /// The disk tier's directory or files could not be set up.
    #[error("disk tier at {path}: {what}: {source}")]
    Disk {
        /// The directory or file concerned.
        path: PathBuf,
        /// The step that failed (e.g. "create directory").
        what: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The CUDA driver or a CUDA call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The tiers do not fit together (e.g. different bytes per block).
    #[error("invalid transfer configuration: {0}")]
    Config(String),
    /// Engine memory that a safe constructor of `EngineMemory` refused (out of its owners'
    /// bounds, another device, no bytes).
    #[error(transparent)]
    Memory(#[from] crate::transfer::memory::MemoryError),
}

/// Why one block could not be read or written. Turned into `BlockFailure::reason` strings.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BlockIoError {
    /// The slot is past the end of the tier.
    #[error("block {0} is out of range")]
    OutOfRange(u32),
    /// The slot holds no valid data (never written, or its last write failed).
    #[error("disk block {0} holds no valid data (never written, or its last write failed)")]
    NotWritten(u32),
    /// The slot's header or payload does not verify (`what` says how).
    #[error("disk block {slot}: {what}")]
    Corrupt {
        /// The slot.
        slot: u32,
        /// What does not verify.
        what: String,
    },
    /// A read or write moved fewer bytes than the block has.
    #[error("disk block {slot}: short {op}: {got} of {want} bytes (file truncated?)")]
    Short {
        /// The slot.
        slot: u32,
        /// "read" or "write".
        op: &'static str,
        /// Bytes moved.
        got: usize,
        /// Bytes of the block.
        want: usize,
    },
    /// The cache file holding the slot was deleted under the store.
    #[error("disk block {slot}: cache file {path} was deleted")]
    FileDeleted {
        /// The slot.
        slot: u32,
        /// The deleted file.
        path: PathBuf,
    },
    /// A read or write failed.
    #[error("disk block {slot}: {op} failed: {source}")]
    Io {
        /// The slot.
        slot: u32,
        /// "read" or "write".
        op: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// Anything else (a buffer that could not be allocated, an operation not run).
    #[error("{0}")]
    Other(String),
}
