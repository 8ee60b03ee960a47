//! `kvtier serve`: an OpenAI-compatible HTTP server over the reference engine.
//!
//! Layering (each module uses only those listed before it, and [`crate::backend`]):
//! [`http_client`] (a minimal HTTP/1 client), [`listener`] (accept loop, limits, graceful
//! shutdown), [`detok`] (streamed detokenisation), [`prom`] (Prometheus text), [`api`] (OpenAI
//! bodies -> engine requests, engine errors -> HTTP errors), [`disagg`] (the decode-mode prefill
//! hop), [`server`] (routes and streaming), [`command`] (the CLI command). Nothing here panics on
//! what a client sends.

pub mod api;
pub mod command;
pub mod detok;
pub mod disagg;
pub mod http_client;
pub mod listener;
pub mod prom;
pub mod server;
