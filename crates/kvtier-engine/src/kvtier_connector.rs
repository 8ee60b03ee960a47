//! The adapter from the engine's connector hooks to kvtier's connector core: one `Leader`
//! (scheduler side) and one in-process `Worker` (rank 0 of 1) over kvtier-io's `TransferEngine`,
//! with the engine's KV pool registered as a TensorRT-LLM pool layout in CPU memory.
//!
//! Invariants:
//! - this module only translates; the cache logic is the leader's;
//! - loads are asynchronous (the request waits in the engine's loading set until `get_finished`
//!   reports it): a failed load is then known before any forward pass reads that KV or any store
//!   copies blocks computed from it (a failed *sync* load would already have fed the same step's
//!   forward pass and its gated stores);
//! - prefill role with a remote tier: a request is reported saved only once its prompt's full
//!   blocks are in the remote store (or a deadline passed), so a decode engine that starts after
//!   `Done` finds them.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::connector::messages::ClusterLayout;
use kvtier::connector::{BlockReuse, Leader, SchedulerStep, Worker, WorkerLink};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::layout::{self, DType, DeviceLayout, TensorDesc};
use kvtier::transfer::{BlockTransfer, RemoteStore};
use kvtier::{DeviceBlockId, RequestId};
use kvtier_io::compose::{Composition, EngineIdentity, HostMemory, ServingRole};
use kvtier_io::metrics_http::StatsPublisher;
use kvtier_io::{EngineMemory, PinMode};

use crate::api::{EngineConfig, EngineError, Role};
use crate::connector::{ConnectorSetup, ConnectorStats, EngineConnector, RequestView};
use crate::kv_cache::KvCache;

/// How long a prefill-role request waits for its blocks to reach the remote store.
const REMOTE_PUBLISH_DEADLINE: Duration = Duration::from_secs(10);

fn cerr(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Connector(format!("{what}: {e}"))
}

pub(crate) struct KvtierConnector {
    leader: Leader,
    worker: Worker,
    remote: Option<Arc<dyn RemoteStore>>,
    block_size: usize,
    salt: HashSalt,
    wait_for_remote: bool,
    /// Prefill role: the prompt hashes of requests whose KV must reach the remote store.
    prompt_hashes: HashMap<RequestId, Vec<kvtier::hash::SequenceHash>>,
    /// Saved on this rank, waiting for the remote store (hashes, deadline).
    publishing: HashMap<RequestId, Instant>,
    /// Stats snapshots for the process's metrics endpoint (`metrics.enabled`).
    metrics: Option<StatsPublisher>,
}

/// Build the connector for an engine whose G1 is `kv`. `kv`'s memory must outlive the connector.
/// Everything is wired by [`Composition`], exactly as under vLLM and TensorRT-LLM.
pub(crate) fn build(
    setup: &ConnectorSetup,
    cfg: &EngineConfig,
    model_name: &str,
    kv: &KvCache,
) -> Result<Box<dyn EngineConnector>, EngineError> {
    let bs = cfg.block_size;
    let bytes_per_block = kv.bytes_per_block();
    // Register G1 exactly as TensorRT-LLM does: one pool tensor [blocks, layers, 2, bs*kv_dim].
    let desc = TensorDesc::contiguous(
        "kv_pool",
        kv.pool().base().get(),
        kv.shape().to_vec(),
        4,
        layout::DeviceKind::Cpu,
    );
    let dl = DeviceLayout::trtllm(&desc, bs, DType::F32).map_err(|e| cerr("kv layout", e))?;
    if dl.bytes_per_block() != bytes_per_block {
        return Err(EngineError::Connector(format!(
            "layout has {} bytes per block, the cache {}",
            dl.bytes_per_block(),
            bytes_per_block
        )));
    }
    let num_blocks = u32::try_from(kv.shape().first().copied().unwrap_or(0))
        .map_err(|_| EngineError::Config("too many device blocks".into()))?;
    let cluster = ClusterLayout {
        block_size: bs as u32,
        num_device_blocks: num_blocks,
        bytes_per_block: vec![bytes_per_block as u64],
    };
    let identity = EngineIdentity {
        model: model_name.to_owned(),
        revision: None,
        dtype: Some("f32".into()),
        kv_layout: Some(format!(
            "trtllm_pool{:?}",
            kv.shape().get(1..).unwrap_or(&[])
        )),
    };
    let role = match cfg.role {
        Role::Aggregated => ServingRole::Aggregated,
        Role::Prefill => ServingRole::Prefill,
        Role::Decode => ServingRole::Decode,
    };
    let plan = Composition::new(&setup.config, identity, cluster, role).map_err(|e| match e {
        kvtier_io::compose::ComposeError::Config(c) => EngineError::Config(c.to_string()),
        other => cerr("kvtier", other),
    })?;
    if plan.config().connector.async_loads == Some(false) {
        // A failed synchronous load would already have fed this step's forward pass and the
        // stores gated on it; the reference engine therefore only loads asynchronously.
        return Err(EngineError::Config(
            "connector.async_loads = false: the reference engine loads asynchronously only".into(),
        ));
    }
    let remote = plan.remote_store().map_err(|e| cerr("kvtier", e))?;
    let host = HostMemory {
        pin: PinMode::Never,
        touch_threads: 1,
        ..HostMemory::default()
    };
    // Checked against the pool's bounds; the transfer engine keeps the pool's allocation alive.
    let memory = EngineMemory::from_cpu_pool(dl, kv.pool()).map_err(|e| cerr("kv memory", e))?;
    let tiers = plan
        .transfer(0, memory, host, remote.clone())
        .map_err(|e| cerr("kvtier", e))?;
    let mut transfer: Arc<dyn BlockTransfer> = Arc::new(tiers.engine);
    if let Some(w) = &setup.wrap_transfer {
        transfer = w(transfer);
    }
    let leader = plan
        .leader(remote.clone(), true)
        .map_err(|e| cerr("kvtier", e))?;
    let metrics = plan.metrics().map_err(|e| cerr("kvtier", e))?;
    let worker = Worker::new(
        transfer,
        WorkerLink::in_process(0, 1, leader.report_sender()),
    );
    let caps = plan.capacities();
    tracing::info!(
        host_blocks = caps.host_blocks,
        disk_blocks = caps.disk_blocks,
        remote = remote.is_some(),
        namespace = plan.namespace(),
        bytes_per_block,
        "kvtier connector ready"
    );
    Ok(Box::new(KvtierConnector {
        leader,
        worker,
        wait_for_remote: remote.is_some() && cfg.role == Role::Prefill,
        remote,
        block_size: bs,
        salt: plan.salt(),
        prompt_hashes: HashMap::new(),
        publishing: HashMap::new(),
        metrics,
    }))
}

impl KvtierConnector {
    /// Keep background work (spills, remote puts) moving even when no request is scheduled.
    fn tick(&mut self) {
        if let Some(p) = &self.metrics {
            p.publish(self.leader.stats());
        }
        let (meta, errs) = self.leader.build_step_lenient(&SchedulerStep::default());
        for e in errs {
            tracing::warn!(error = %e, "kvtier: empty step");
        }
        self.worker.bind(&meta);
        self.worker.start_load(None);
    }

    fn published(&self, id: &RequestId) -> bool {
        let (Some(remote), Some(hashes)) = (self.remote.as_ref(), self.prompt_hashes.get(id))
        else {
            return true;
        };
        if hashes.is_empty() {
            return true;
        }
        match remote.contains(hashes) {
            Ok(v) => v.iter().all(|b| *b),
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "remote contains failed");
                false
            }
        }
    }
}

impl EngineConnector for KvtierConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: RequestView<'_>,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool), String> {
        if self.wait_for_remote && !self.prompt_hashes.contains_key(req.id) {
            let hs = sequence_hashes(self.salt, req.tokens, self.block_size);
            self.prompt_hashes.insert(req.id.clone(), hs);
        }
        let n = self
            .leader
            .get_num_new_matched_tokens(req.id, req.tokens, num_computed_tokens)
            .map_err(|e| e.to_string())?;
        Ok((n, n > 0 && self.leader.loads_are_async()))
    }

    fn update_state_after_alloc(
        &mut self,
        req: RequestView<'_>,
        block_ids: &[DeviceBlockId],
        num_external_tokens: usize,
    ) {
        if let Err(e) =
            self.leader
                .update_state_after_alloc(req.id, block_ids, Some(num_external_tokens))
        {
            tracing::error!(request = %req.id, error = %e, "kvtier update_state_after_alloc");
        }
    }

    fn build_connector_meta(&mut self, step: &SchedulerStep) -> Result<(), String> {
        let (meta, errs) = self.leader.build_step_lenient(step);
        self.worker.bind(&meta);
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; "))
        }
    }

    fn request_finished(&mut self, id: &RequestId, _block_ids: &[DeviceBlockId]) -> BlockReuse {
        match self.leader.request_finished(id) {
            Ok(BlockReuse::Now) if self.wait_for_remote => {
                // Nothing to wait for on this rank, but the remote puts may still be queued.
                self.publishing
                    .insert(id.clone(), Instant::now() + REMOTE_PUBLISH_DEADLINE);
                BlockReuse::AfterSaved
            }
            Ok(reuse) => reuse,
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "kvtier request_finished");
                BlockReuse::Now
            }
        }
    }

    fn start_load_kv(&mut self) {
        self.worker.start_load(None);
    }

    fn wait_for_layer_load(&mut self, layer: usize) {
        self.worker.wait_for_layer_load(layer);
    }

    fn save_kv_layer(&mut self, _layer: usize) {
        // Stores are gated on the end of the forward pass (`forward_done`).
    }

    fn forward_done(&mut self) {
        self.worker.forward_done(None);
    }

    fn get_finished(
        &mut self,
        finished_gen_req_ids: &[RequestId],
        started_loading_req_ids: &[RequestId],
    ) -> (Vec<RequestId>, Vec<RequestId>) {
        self.tick();
        let r = self
            .worker
            .get_finished(finished_gen_req_ids, Some(started_loading_req_ids));
        let mut loaded = r.loaded;
        loaded.extend(r.load_failed);
        let mut saved = Vec::new();
        for id in r.saved {
            if self.wait_for_remote {
                self.publishing
                    .entry(id)
                    .or_insert_with(|| Instant::now() + REMOTE_PUBLISH_DEADLINE);
            } else {
                saved.push(id);
            }
        }
        if !self.publishing.is_empty() {
            let now = Instant::now();
            let ids: Vec<(RequestId, Instant)> = self
                .publishing
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            for (id, deadline) in ids {
                let done = self.published(&id);
                if done || now >= deadline {
                    if !done {
                        tracing::warn!(request = %id, "prefill KV not confirmed in the remote store in time");
                    }
                    self.publishing.remove(&id);
                    self.prompt_hashes.remove(&id);
                    saved.push(id);
                }
            }
        }
        (saved, loaded)
    }

    fn get_block_ids_with_load_errors(&mut self) -> Vec<DeviceBlockId> {
        self.worker.take_load_errors()
    }

    fn handle_preemptions(&mut self, preempted: &[RequestId]) {
        self.worker.wait_idle();
        for id in preempted {
            if let Err(e) = self.leader.request_preempted(id) {
                tracing::warn!(request = %id, error = %e, "kvtier request_preempted");
            }
        }
    }

    fn request_reset(&mut self, id: &RequestId) {
        if let Err(e) = self.leader.request_preempted(id) {
            tracing::warn!(request = %id, error = %e, "kvtier reset after a failed load");
        }
    }

    fn has_pending(&self) -> bool {
        self.worker.jobs_in_flight() > 0
            || self.leader.stats().jobs_in_flight > 0
            || !self.publishing.is_empty()
    }

    fn stats(&self) -> ConnectorStats {
        let s = self.leader.stats();
        let v = |key: &str| kvtier::metrics::value(&s, key).unwrap_or(0);
        let bs = self.block_size as u64;
        ConnectorStats {
            offloaded_blocks: s.offload_confirmed,
            onboarded_blocks: s.onboard_host_blocks
                + s.onboard_disk_blocks
                + s.onboard_remote_blocks,
            matched_tokens_host: s.onboard_host_blocks * bs,
            matched_tokens_disk: s.onboard_disk_blocks * bs,
            matched_tokens_remote: s.onboard_remote_blocks * bs,
            jobs_in_flight: s.jobs_in_flight as u64,
            spilled_disk_blocks: s.spill_disk_blocks,
            remote_put_blocks: s.remote_put_blocks,
            offloaded_remote_blocks: v("offloaded_remote_blocks"),
            offloaded_host_blocks: v("offloaded_host_blocks"),
            offloaded_disk_blocks: v("offloaded_disk_blocks"),
            kvtier: s,
        }
    }
}

impl Drop for KvtierConnector {
    fn drop(&mut self) {
        // Every job touching the engine's memory finishes before that memory can be freed.
        // The disk tier's file set stays (reclaimed or, with `disk.persist`, served by the next
        // engine on the directory).
        self.worker.wait_idle();
    }
}
