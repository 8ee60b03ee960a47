//! Errors of the I/O crate: setting a tier up (whole-tier errors, each saying what to change) and
//! moving one block (per-block errors, reported as `BlockFailure` reasons, never as data).
use std::path::PathBuf;

/// A tier or the transfer engine could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    #[error("host tier: cannot allocate {bytes} bytes: {source}; {hint}")]
    HostAlloc {
        bytes: usize,
        #[source]
        source: std::io::Error,
        hint: &'static str,
    },
    #[error("host tier: cannot pin {bytes} bytes for CUDA: {reason}; {hint}")]
    HostPin {
        bytes: usize,
        reason: String,
        hint: &'static str,
    },
    #[error("disk tier at {path}: {what}: {source}")]
    Disk {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("invalid transfer configuration: {0}")]
    Config(String),
}

/// Why one block could not be read or written. Turned into `BlockFailure::reason` strings.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BlockIoError {
    #[error("block {0} is out of range")]
    OutOfRange(u32),
    #[error("disk block {0} holds no valid data (never written, or its last write failed)")]
    NotWritten(u32),
    #[error("disk block {slot}: {what}")]
    Corrupt { slot: u32, what: String },
    #[error("disk block {slot}: short {op}: {got} of {want} bytes (file truncated?)")]
    Short {
        slot: u32,
        op: &'static str,
        got: usize,
        want: usize,
    },
    #[error("disk block {slot}: cache file {path} was deleted")]
    FileDeleted { slot: u32, path: PathBuf },
    #[error("disk block {slot}: {op} failed: {source}")]
    Io {
        slot: u32,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}
