//! Transfer room: the engine's registered KV memory ([`memory`], over a [`layout`]) and the
//! [`TransferEngine`](crate::TransferEngine) that moves blocks between it and the storage tiers:
//! the CPU copy path (`device`), CUDA copies ([`cuda`]) and the staged (bounce-buffer) paths.
//!
//! Invariant: nothing here contains an `unsafe` block; copies through raw addresses go through
//! `sys`'s wrappers, whose contracts the registration of an
//! [`EngineMemory`](crate::EngineMemory) establishes.
pub mod cuda;
pub(crate) mod device;
pub(crate) mod engine;
pub mod layout;
pub mod memory;
