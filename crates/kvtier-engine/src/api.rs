//! The engine's public request/response types, configuration and errors.
//!
//! Invariant: a request's event stream is zero or more `Token`s followed by exactly one `Done` or
//! one `Error`, after which the sender is dropped.
use std::path::PathBuf;

use crate::connector::ConnectorSetup;

/// Where the model comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// The built-in seeded random Llama (hidden 128, 2 layers, 4 heads, 2 KV heads, byte vocab).
    BuiltIn {
        /// Seed of the random weights.
        seed: u64,
    },
    /// A Hugging Face Llama directory: `config.json` + `model.safetensors` (or sharded + index).
    Dir(PathBuf),
}

/// Disaggregation role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    /// Prefill and decode in one engine.
    #[default]
    Aggregated,
    /// Compute the prompt and the first token, publish the KV through kvtier, finish with
    /// `FinishReason::Prefilled` once the KV is saved.
    Prefill,
    /// Continue requests that carry `prefilled`: their KV comes through kvtier (recomputed where
    /// missing), the first token is not recomputed.
    Decode,
}

/// How to build an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Where the model comes from.
    pub model: ModelSource,
    /// Tokens per KV block (G1 and every kvtier tier).
    pub block_size: usize,
    /// G1 capacity in blocks.
    pub num_device_blocks: usize,
    /// Most requests running (or loading KV) at once.
    pub max_num_seqs: usize,
    /// Token budget of one forward pass (the chunked-prefill chunk budget).
    pub max_batch_tokens: usize,
    /// Most requests waiting for admission; beyond it `submit` returns `EngineError::Overloaded`.
    pub max_waiting: usize,
    /// Aggregated, prefill or decode.
    pub role: Role,
    /// The engine's own G1 prefix cache. `false`: computed blocks are never shared or reused
    /// across requests (each prompt is computed in full, or loaded through the connector); the
    /// generated tokens are the same either way.
    pub enable_prefix_cache: bool,
    /// kvtier on (`Some`) or off (`None`).
    pub connector: Option<ConnectorSetup>,
}

impl EngineConfig {
    /// Built-in model, block 16, 256 G1 blocks, 16 sequences, 256 tokens per step, prefix cache
    /// on, no connector.
    pub fn builtin(seed: u64) -> Self {
        EngineConfig {
            model: ModelSource::BuiltIn { seed },
            block_size: 16,
            num_device_blocks: 256,
            max_num_seqs: 16,
            max_batch_tokens: 256,
            max_waiting: 1024,
            role: Role::Aggregated,
            enable_prefix_cache: true,
            connector: None,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), EngineError> {
        let bad = |s: &str| Err(EngineError::Config(s.to_owned()));
        if self.block_size == 0 || self.block_size > 64 {
            return bad("block_size must be in 1..=64");
        }
        if self.num_device_blocks == 0 {
            return bad("num_device_blocks must be > 0");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be > 0");
        }
        if self.max_batch_tokens == 0 {
            return bad("max_batch_tokens must be > 0");
        }
        Ok(())
    }
}

/// What a decode-role engine receives from the prefill engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefilled {
    /// The token the prefill engine generated from the prompt.
    pub first_token: u32,
}

/// One generation to run.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Most generated tokens (the first token of a prefilled request counts).
    pub max_tokens: usize,
    /// Keep generating past an end-of-sequence token (up to `max_tokens`).
    pub ignore_eos: bool,
    /// Set on requests continued by a decode engine.
    pub prefilled: Option<Prefilled>,
}

impl GenerateRequest {
    /// A request for `prompt`, at most `max_tokens` generated, stopping at EOS.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_tokens,
            ignore_eos: false,
            prefilled: None,
        }
    }
}

/// Why a generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated.
    Stop,
    /// `max_tokens` or the model's maximum length was reached.
    Length,
    /// Prefill role: the first token is computed and the prompt's KV is published to the shared
    /// tier; a decode engine continues the request.
    Prefilled,
    /// The client went away mid-generation: the request ended early, counted in
    /// `EngineMetrics::requests_aborted`, not as finished (#28).
    Aborted,
}

impl EngineMetrics {
    /// Counts a request that ended (not failed) with `reason`: finished, or aborted.
    pub(crate) fn count_end(&mut self, reason: FinishReason) {
        match reason {
            FinishReason::Aborted => self.requests_aborted += 1,
            _ => self.requests_finished += 1,
        }
    }
}

impl FinishReason {
    /// The OpenAI spelling (`finish_reason`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Prefilled => "prefilled",
            FinishReason::Aborted => "abort",
        }
    }

    /// Parses the OpenAI spelling ([`FinishReason::as_str`]'s inverse).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "stop" => Some(FinishReason::Stop),
            "length" => Some(FinishReason::Length),
            "prefilled" => Some(FinishReason::Prefilled),
            "abort" => Some(FinishReason::Aborted),
            _ => None,
        }
    }
}

/// Token counts of one finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens not computed by this request's first admission (G1 prefix hit + kvtier match).
    pub cached_tokens: usize,
}

/// One event of a running generation: tokens, then one `Done` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerateEvent {
    /// A newly generated token.
    Token(u32),
    /// The request finished.
    Done {
        /// Why it stopped.
        finish_reason: FinishReason,
        /// Its token counts.
        usage: Usage,
    },
    /// The request failed: the reason.
    Error(String),
}

/// Counters since start (monotonic) and gauges (current).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineMetrics {
    /// Requests accepted by `submit`.
    pub requests_submitted: u64,
    /// Requests that finished.
    pub requests_finished: u64,
    /// Requests whose client went away before they finished.
    pub requests_aborted: u64,
    /// Requests that ended with an error.
    pub requests_failed: u64,
    /// Requests refused (overloaded or invalid).
    pub requests_rejected: u64,
    /// Prompt tokens of accepted requests.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Tokens run through the forward pass (prefill chunks + decode tokens, recomputation included).
    pub computed_tokens: u64,
    /// Prompt tokens served from the engine's own G1 prefix cache.
    pub g1_prefix_hit_tokens: u64,
    /// Tokens matched by kvtier (loaded instead of computed), all tiers.
    pub kvtier_matched_tokens: u64,
    /// Of those, from the host tier.
    pub kvtier_matched_tokens_host: u64,
    /// Of those, from the disk tier.
    pub kvtier_matched_tokens_disk: u64,
    /// Of those, from the remote tier.
    pub kvtier_matched_tokens_remote: u64,
    /// Blocks copied out of G1 / into G1 by kvtier (as reported by the connector).
    pub offloaded_blocks: u64,
    /// Blocks copied into G1 by kvtier.
    pub onboarded_blocks: u64,
    /// Blocks copied host -> disk and host -> remote by kvtier.
    pub spilled_disk_blocks: u64,
    /// Blocks put host -> remote (dispatched).
    pub remote_put_blocks: u64,
    /// Blocks kvtier wrote into its host tier / its disk tier (spills from host included).
    pub offloaded_host_blocks: u64,
    /// Blocks kvtier wrote into its disk tier.
    pub offloaded_disk_blocks: u64,
    /// Blocks kvtier wrote into its remote tier (puts confirmed; `remote_put_blocks` counts dispatched ones).
    pub offloaded_remote_blocks: u64,
    /// Device blocks whose kvtier load failed (their tokens were recomputed).
    pub load_failures: u64,
    /// Tokens computed again because their KV could not be loaded.
    pub recomputed_tokens: u64,
    /// Running requests preempted to free device blocks.
    pub preemptions: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Gauges.
    pub queue_depth: u64,
    /// Requests running now.
    pub running: u64,
    /// Device blocks free now.
    pub free_device_blocks: u64,
    /// kvtier transfer jobs not yet confirmed.
    pub kvtier_jobs_in_flight: u64,
    /// The kvtier leader's snapshot (every counter of `kvtier::metrics::METRICS`).
    pub kvtier: kvtier::connector::LeaderStats,
}

/// Why the engine refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// Too many requests are waiting: how many.
    #[error("engine overloaded: {0} requests waiting")]
    Overloaded(usize),
    /// The request cannot run (empty prompt, too long, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine configuration is unusable.
    #[error("invalid engine config: {0}")]
    Config(String),
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// kvtier could not be set up or failed.
    #[error("connector: {0}")]
    Connector(String),
    /// The engine has shut down.
    #[error("engine is shut down")]
    ShutDown,
}
