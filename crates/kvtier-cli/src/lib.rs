//! kvtier-cli: the `kvtier` binary's library — an OpenAI-compatible server over the reference engine
//! ([`serve`]), workload and transfer benchmarks ([`mod@bench`]), [`inspect`] and the [`node`] tier.
//!
//! Layering: [`settings`] and [`backend`] (the one seam to the engine, implemented by
//! [`engine_backend`]) are used by [`serve`] and [`mod@bench`]; neither of those uses the other, and
//! no module imports one that imports it back.

#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod backend;
pub mod bench;
pub mod engine_backend;
pub mod inspect;
pub mod node;
pub mod serve;
pub mod settings;
