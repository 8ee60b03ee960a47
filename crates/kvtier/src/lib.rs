//! kvtier: a tiered KV-cache block manager for LLM inference.
//!
//! Data flows down the layers, completions flow up:
//! `hash`/`tokens` (sequence hashes) -> `layout` (KV geometry, engine tensors -> byte ranges)
//! -> `pool` (one per tier: ids, registry, ref-counts, eviction) -> `policy` (what goes where)
//! -> `connector` (per-request slots, leader, workers) -> `transfer` (the trait the I/O crate implements).
//!
//! Invariant of this crate: it contains no `unsafe` and moves no KV bytes of its own: memory and
//! data movement are reached only through the traits in [`transfer`]. Its only I/O is the
//! optional ZeroMQ leader<->worker channel (`connector::zmq`, feature `zmq`) and reading the
//! TOML file named by `KVTIER_CONFIG`.
#![forbid(unsafe_code)]
pub mod config;
pub mod connector;
pub mod error;
pub mod hash;
pub mod ids;
pub mod layout;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod ratelimit;
pub mod tokens;
pub mod transfer;

pub use error::Error;
pub use ids::{BlockId, DeviceBlockId, JobId, RequestId, Tier};
