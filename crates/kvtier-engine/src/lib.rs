//! kvtier-engine: kvtier's reference engine, a small Llama-architecture decoder on CPU that drives
//! kvtier exactly the way TensorRT-LLM's executor drives a KV connector.
//!
//! - Model: RMSNorm, RoPE, grouped-query attention over a paged KV cache, SwiGLU; f32 with
//!   hand-written fixed-order kernels, so results are batch-invariant and deterministic. Weights
//!   come from a Hugging Face Llama safetensors directory or a built-in seeded random model.
//! - Scheduler: continuous batching, chunked prefill under a token budget, its own G1 prefix
//!   cache keyed by kvtier sequence hashes, recompute-style preemption.
//! - Roles: aggregated, prefill (prompt + first token, KV published through kvtier) and decode.
//!
//! ```
//! use kvtier_engine::{EngineConfig, EngineHandle, GenerateRequest};
//! let engine = EngineHandle::start(EngineConfig::builtin(0)).unwrap();
//! let prompt = engine.tokenizer().encode("Hello");
//! let mut req = GenerateRequest::new(prompt, 4);
//! req.ignore_eos = true;
//! let (tokens, _reason) = engine.generate_blocking(req).unwrap();
//! assert_eq!(tokens.len(), 4);
//! engine.shutdown();
//! ```
#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

mod api;
mod block_pool;
pub mod connector;
mod core;
mod handle;
pub mod kernels;
pub mod kv_cache;
mod kvtier_connector;
pub mod model;
mod request;
pub mod tokenizer;

pub use api::{
    EngineConfig, EngineError, EngineMetrics, FinishReason, GenerateEvent, GenerateRequest,
    ModelSource, Prefilled, Role, Usage,
};
pub use connector::ConnectorSetup;
pub use handle::EngineHandle;
pub use tokenizer::Tokenizer;
