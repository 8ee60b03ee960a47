//! Storage room: the tiers a block is stored in below the engine's memory: pinned host memory
//! ([`HostStorage`](crate::HostStorage), G2), the local disk ([`disk`], G3), the remote stores
//! ([`remote`], G4) and the per-node shared tier ([`node`]).
//!
//! Invariant: nothing here contains `unsafe`; every raw operation (syscalls, pointer copies,
//! shared memory, socket credentials) is a call into `sys`'s safe wrappers or, where the
//! caller must uphold a contract, into an `unsafe fn` there through a safe wrapper of `sys`.
pub mod disk;
pub(crate) mod host;
pub mod node;
pub mod remote;
