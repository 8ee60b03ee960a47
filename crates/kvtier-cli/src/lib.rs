//! kvtier-cli: the `kvtier` binary's library — an OpenAI-compatible server over the reference engine
//! (`serve`), workload benchmarks comparing no cache / G1 prefix cache / kvtier tiers (`bench`), and
//! `inspect`.
//!
//! Layering: [`api`] validates OpenAI bodies into engine requests; [`server`] routes and streams;
//! [`disagg`] adds the decode-mode prefill hop; [`prom`] renders Prometheus text; [`backend`] is the one
//! seam to the engine. Nothing here panics on what a client sends.

#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod api;
pub mod backend;
pub mod bench;
pub mod cmd;
pub mod detok;
pub mod disagg;
pub mod engine_backend;
pub mod http_client;
pub mod listener;
pub mod prom;
pub mod server;
pub mod settings;
