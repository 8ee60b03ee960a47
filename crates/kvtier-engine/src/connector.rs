//! The engine side of the KV connector: the hooks the scheduler and the forward pass call, in the
//! order TensorRT-LLM calls them (tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py and
//! py_executor.py; docs/arch/trtllm.md).
//!
//! Invariants the engine keeps towards any `EngineConnector`:
//! - `get_num_new_matched_tokens` is called before the request's blocks are allocated,
//!   `update_state_after_alloc` right after, with all of its blocks;
//! - `build_connector_meta` is called once per step with a record for every scheduled request
//!   (new exactly once, then cached), before `start_load_kv` and the forward pass;
//! - blocks of a finished request for which `request_finished` returned
//!   [`BlockReuse::AfterSaved`] are not reused until `get_finished` reports the request saved;
//! - blocks reported by `get_block_ids_with_load_errors` are recomputed, never trusted;
//! - `handle_preemptions` returns only when no transfer touches the preempted requests' blocks.
use std::sync::Arc;

use kvtier::config::KvtierConfig;
use kvtier::connector::{BlockReuse, SchedulerStep};
use kvtier::transfer::BlockTransfer;
use kvtier::{DeviceBlockId, RequestId};

/// What the engine tells a connector about one request.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    /// The request.
    pub id: &'a RequestId,
    /// Prompt plus generated tokens so far.
    pub tokens: &'a [u32],
}

/// Counters a connector reports (monotonic).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnectorStats {
    /// The leader's whole snapshot, read through `kvtier::metrics::METRICS` by exporters; the
    /// fields below are views of it the engine's own bookkeeping uses.
    pub kvtier: kvtier::connector::LeaderStats,
    /// Blocks copied out of G1.
    pub offloaded_blocks: u64,
    /// Blocks copied into G1.
    pub onboarded_blocks: u64,
    /// Tokens matched in the host tier.
    pub matched_tokens_host: u64,
    /// Tokens matched in the disk tier.
    pub matched_tokens_disk: u64,
    /// Tokens matched in the remote tier.
    pub matched_tokens_remote: u64,
    /// Gauge: transfer jobs not yet confirmed.
    pub jobs_in_flight: u64,
    /// Blocks copied host -> disk (dispatched).
    pub spilled_disk_blocks: u64,
    /// Blocks put host -> remote (dispatched).
    pub remote_put_blocks: u64,
    /// Blocks written into the host tier (G1 -> host stores).
    pub offloaded_host_blocks: u64,
    /// Blocks written into the disk tier: host -> disk spills, plus G1 -> disk stores when
    /// there is no host tier (failed copies excluded).
    pub offloaded_disk_blocks: u64,
    /// Blocks written into the remote tier (host -> remote puts every rank confirmed).
    pub offloaded_remote_blocks: u64,
}

/// The KV connector hooks, in the order TensorRT-LLM calls them (see the module docs).
pub trait EngineConnector: Send {
    // ---- scheduler side ----
    /// Tokens loadable beyond the `num_computed_tokens` the engine already holds, and whether
    /// the load is asynchronous (the request then waits for `get_finished`).
    fn get_num_new_matched_tokens(
        &mut self,
        req: RequestView<'_>,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool), String>;
    /// `num_external_tokens`: the matched tokens the engine accepted (0 if it ignored the match).
    fn update_state_after_alloc(
        &mut self,
        req: RequestView<'_>,
        block_ids: &[DeviceBlockId],
        num_external_tokens: usize,
    );
    /// The step's records: plan its loads and stores (TensorRT-LLM `build_connector_meta`).
    fn build_connector_meta(&mut self, step: &SchedulerStep) -> Result<(), String>;
    /// When the engine may reuse the finished request's blocks: now, or (saves in flight) only
    /// once `get_finished` reports the request saved.
    fn request_finished(&mut self, id: &RequestId, block_ids: &[DeviceBlockId]) -> BlockReuse;

    // ---- worker side ----
    /// Start this step's loads (before the forward pass).
    fn start_load_kv(&mut self);
    /// Block until the step's synchronous loads into `layer` are done.
    fn wait_for_layer_load(&mut self, layer: usize);
    /// `layer` of the forward pass is computed.
    fn save_kv_layer(&mut self, layer: usize);
    /// End of the forward pass: stores gated on it may start.
    fn forward_done(&mut self);
    /// (saved request ids, loaded request ids); only ids passed in now or earlier are reported.
    fn get_finished(
        &mut self,
        finished_gen_req_ids: &[RequestId],
        started_loading_req_ids: &[RequestId],
    ) -> (Vec<RequestId>, Vec<RequestId>);
    /// Device blocks whose load failed since the last call (the engine recomputes them).
    fn get_block_ids_with_load_errors(&mut self) -> Vec<DeviceBlockId>;
    /// Block until no transfer reads or writes the blocks of these requests; their device state
    /// is forgotten (they will be matched and allocated again).
    fn handle_preemptions(&mut self, preempted: &[RequestId]);
    /// A request's loaded KV is being recomputed from `num_computed_tokens` (a load failed):
    /// forget its device state; its next record is a full report (all blocks).
    fn request_reset(&mut self, id: &RequestId);
    /// Transfers are in flight or queued (the engine keeps stepping while true).
    fn has_pending(&self) -> bool;
    /// The connector's counters now.
    fn stats(&self) -> ConnectorStats;
}

/// Wraps the transfer engine before the connector uses it (tests inject faults this way).
pub type TransferWrapper =
    Arc<dyn Fn(Arc<dyn BlockTransfer>) -> Arc<dyn BlockTransfer> + Send + Sync>;

/// How to build the kvtier connector (kvtier on).
#[derive(Clone)]
pub struct ConnectorSetup {
    /// Tiers, sizes, remote store, hashing: kvtier's one configuration.
    pub config: KvtierConfig,
    /// Optional wrapper around kvtier-io's `TransferEngine` (fault injection in tests).
    pub wrap_transfer: Option<TransferWrapper>,
}

impl ConnectorSetup {
    /// kvtier on with `config`, the transfer engine unwrapped.
    pub fn new(config: KvtierConfig) -> Self {
        ConnectorSetup {
            config,
            wrap_transfer: None,
        }
    }
}

/// kvtier's built-in defaults, which configure no tier: `EngineHandle::start` then fails with
/// `EngineError::Connector`. Use [`ConnectorSetup::new`] with a built `KvtierConfig`.
impl Default for ConnectorSetup {
    fn default() -> Self {
        ConnectorSetup::new(KvtierConfig::default())
    }
}

impl std::fmt::Debug for ConnectorSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectorSetup")
            .field("config", &self.config)
            .field("wrap_transfer", &self.wrap_transfer.is_some())
            .finish()
    }
}
