//! The seam between the HTTP/bench layers and an inference engine.
//!
//! Invariant: everything above this module talks to an engine only through [`Backend`]; the one real
//! implementation wraps `kvtier_engine::EngineHandle` (see [`crate::engine_backend`]), and unit tests use a
//! deterministic fake. A backend never panics on user input: a request it cannot take is a [`SubmitError`].

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;

/// One generation request, already tokenized and validated by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Maximum number of tokens to generate (>= 1).
    pub max_tokens: u32,
    /// Keep generating after the end-of-sequence token.
    pub ignore_eos: bool,
    /// Decode role: the first token, already computed by a prefill server. The engine emits it as the
    /// first `Token` event and continues from the prompt's KV (loaded from the shared tier).
    pub prefilled: Option<u32>,
}

/// Why a generation stopped: the reference engine's vocabulary (one enum, one OpenAI spelling).
pub use kvtier_engine::FinishReason;

/// One event of a running generation, in order: zero or more `Token`, then exactly one `Done` or `Error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GenEvent {
    /// A newly generated token.
    Token(u32),
    /// Generation finished normally.
    Done(Finished),
    /// Generation failed; no further events follow.
    Error(String),
}

/// How a generation ended: its reason and its token counts (OpenAI's `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Prompt tokens the engine did not compute because they came from a cache (any tier).
    pub cached_tokens: u32,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The engine's queue is full: retry later (HTTP 503).
    #[error("engine overloaded: {0}")]
    Overloaded(String),
    /// The request can never be served (HTTP 400).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The engine has stopped (HTTP 503).
    #[error("engine unavailable: {0}")]
    Unavailable(String),
}

/// The kind of a metric sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleKind {
    /// Monotonic since engine start.
    Counter,
    /// A current value.
    Gauge,
}

/// One metric sample of an engine snapshot, already named in the `kvtier_` namespace.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The Prometheus family name (`kvtier_*`).
    pub name: &'static str,
    /// Label names and values of this series.
    pub labels: Vec<(&'static str, String)>,
    /// Counter or gauge.
    pub kind: SampleKind,
    /// The value.
    pub value: f64,
    /// The `# HELP` text.
    pub help: &'static str,
}

/// Counters the bench needs directly (a subset of the samples, typed; monotonic since engine start).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CacheCounters {
    /// Prompt tokens served from the engine's own G1 prefix cache.
    pub device_hit_tokens: u64,
    /// Prompt tokens matched (and loaded) from each offload tier.
    pub hit_tokens: TierCounts,
    /// Blocks offloaded into each tier.
    pub offload_blocks: TierCounts,
    /// Blocks onboarded from each tier into G1.
    pub onboard_blocks: TierCounts,
}

/// A count per offload tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierCounts {
    /// Host (G2) tier.
    pub host: u64,
    /// Disk (G3) tier.
    pub disk: u64,
    /// Remote (G4) tier.
    pub remote: u64,
}

impl TierCounts {
    /// Element-wise saturating difference (`self - earlier`).
    pub fn since(self, earlier: TierCounts) -> TierCounts {
        TierCounts {
            host: self.host.saturating_sub(earlier.host),
            disk: self.disk.saturating_sub(earlier.disk),
            remote: self.remote.saturating_sub(earlier.remote),
        }
    }

    /// Sum over tiers.
    pub fn total(self) -> u64 {
        self.host + self.disk + self.remote
    }
}

impl CacheCounters {
    /// Counter deltas between two snapshots of the same engine.
    pub fn since(self, earlier: CacheCounters) -> CacheCounters {
        CacheCounters {
            device_hit_tokens: self
                .device_hit_tokens
                .saturating_sub(earlier.device_hit_tokens),
            hit_tokens: self.hit_tokens.since(earlier.hit_tokens),
            offload_blocks: self.offload_blocks.since(earlier.offload_blocks),
            onboard_blocks: self.onboard_blocks.since(earlier.onboard_blocks),
        }
    }
}

/// A tokenizer as the HTTP layer needs it.
pub trait TextCodec: Send + Sync {
    /// Text to token ids.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Token ids to text (lossy for partial UTF-8 sequences).
    fn decode(&self, tokens: &[u32]) -> String;
}

/// An inference engine, as seen by `serve` and `bench`.
pub trait Backend: Send + Sync + 'static {
    /// The model name served under `/v1/models`.
    fn model_name(&self) -> String;
    /// Maximum prompt + generated tokens per request.
    fn max_model_len(&self) -> usize;
    /// Size of the vocabulary: valid token ids are `0..vocab_size`.
    fn vocab_size(&self) -> u32;
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// The tokenizer.
    fn codec(&self) -> Arc<dyn TextCodec>;
    /// Queues a request; events arrive on the returned channel.
    fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError>;
    /// The engine's metric snapshot, as `kvtier_*` samples.
    fn samples(&self) -> Vec<Sample>;
    /// The cache counters the bench reports.
    fn cache_counters(&self) -> CacheCounters;
    /// Drops the engine's own G1 prefix cache (blocks in offload tiers stay).
    fn reset_prefix_cache(&self);
    /// Stops the engine; later submits fail with [`SubmitError::Unavailable`].
    fn shutdown(&self);
}

#[cfg(test)]
pub(crate) mod fake {
    //! A deterministic fake engine for HTTP-layer unit tests.
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// Byte tokenizer: token id = byte value; ids >= 256 decode to nothing.
    pub(crate) struct ByteCodec;

    impl TextCodec for ByteCodec {
        fn encode(&self, text: &str) -> Vec<u32> {
            text.bytes().map(u32::from).collect()
        }
        fn decode(&self, tokens: &[u32]) -> String {
            let bytes: Vec<u8> = tokens
                .iter()
                .filter_map(|&t| u8::try_from(t).ok())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    /// Generates `next = 'a' + (sum of context) % 26`; token 0 is EOS. Refuses when `overloaded` is set.
    pub(crate) struct FakeBackend {
        pub overloaded: AtomicBool,
        pub submitted: AtomicU64,
        pub eos_after: Option<u32>,
        /// Behave like a prefill-role engine: stop after the first token with `Prefilled`.
        pub prefill_role: bool,
        /// Never finish: send the first token, then keep the request open (its sender is kept).
        pub hang: bool,
        pub held: std::sync::Mutex<Vec<tokio::sync::mpsc::UnboundedSender<GenEvent>>>,
    }

    impl FakeBackend {
        pub(crate) fn new() -> Self {
            FakeBackend {
                overloaded: AtomicBool::new(false),
                submitted: AtomicU64::new(0),
                eos_after: None,
                prefill_role: false,
                hang: false,
                held: Default::default(),
            }
        }
    }

    impl Backend for FakeBackend {
        fn model_name(&self) -> String {
            "fake-model".into()
        }
        fn max_model_len(&self) -> usize {
            64
        }
        fn vocab_size(&self) -> u32 {
            256
        }
        fn block_size(&self) -> usize {
            4
        }
        fn codec(&self) -> Arc<dyn TextCodec> {
            Arc::new(ByteCodec)
        }
        fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError> {
            if self.overloaded.load(Ordering::SeqCst) {
                return Err(SubmitError::Overloaded("queue full".into()));
            }
            self.submitted.fetch_add(1, Ordering::SeqCst);
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let mut ctx = req.prompt.clone();
            let mut n = 0u32;
            let mut reason = FinishReason::Length;
            let emit = |t: u32, n: &mut u32, ctx: &mut Vec<u32>| {
                ctx.push(t);
                *n += 1;
                let _ = tx.send(GenEvent::Token(t));
                t == 0 && !req.ignore_eos
            };
            let mut stopped = match req.prefilled {
                Some(t0) => emit(t0, &mut n, &mut ctx),
                None => false,
            };
            let limit = if self.prefill_role {
                req.max_tokens.min(1)
            } else {
                req.max_tokens
            };
            while !stopped && n < limit {
                let sum: u64 = ctx.iter().map(|&t| u64::from(t)).sum();
                let mut next = u32::from(b'a') + (sum % 26) as u32;
                if self.eos_after == Some(n) {
                    next = 0;
                }
                stopped = emit(next, &mut n, &mut ctx);
            }
            if stopped {
                reason = FinishReason::Stop;
            } else if self.prefill_role && req.max_tokens > 1 {
                reason = FinishReason::Prefilled;
            }
            if self.hang {
                self.held.lock().unwrap_or_else(|p| p.into_inner()).push(tx);
                return Ok(rx);
            }
            let _ = tx.send(GenEvent::Done(Finished {
                finish_reason: reason,
                prompt_tokens: req.prompt.len() as u32,
                completion_tokens: n,
                cached_tokens: 0,
            }));
            Ok(rx)
        }
        fn samples(&self) -> Vec<Sample> {
            vec![Sample {
                name: "kvtier_engine_requests_total",
                labels: vec![],
                kind: SampleKind::Counter,
                value: self.submitted.load(Ordering::SeqCst) as f64,
                help: "requests",
            }]
        }
        fn cache_counters(&self) -> CacheCounters {
            CacheCounters::default()
        }
        fn reset_prefix_cache(&self) {}
        fn shutdown(&self) {}
    }
}
