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
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::config::RemoteTarget;
use kvtier::connector::{
    Capacity, DiskPolicy, Leader, LeaderConfig, SchedulerStep, Worker, WorkerLink,
};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::layout::{self, DType, DeviceLayout, TensorDesc};
use kvtier::policy::FilterParams;
use kvtier::pool::Priority;
use kvtier::transfer::{BlockTransfer, RemoteStore};
use kvtier::{DeviceBlockId, RequestId};
use kvtier_io::{DiskOptions, DiskStorage, HostOptions, HostStorage, PinMode, TransferEngine};

use crate::api::{EngineConfig, EngineError, Role};
use crate::connector::{ConnectorSetup, ConnectorStats, EngineConnector, RequestView};
use crate::kv_cache::KvCache;

/// How long a prefill-role request waits for its blocks to reach the remote store.
const REMOTE_PUBLISH_DEADLINE: Duration = Duration::from_secs(10);

fn cerr(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Connector(format!("{what}: {e}"))
}

/// Remote namespaces allow `[A-Za-z0-9_.-]`, 1..=64 characters, not starting with '.'.
fn namespace_for(model: &str) -> String {
    let mut s: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if s.is_empty() || s.starts_with('.') {
        s.insert(0, 'm');
        s.truncate(64);
    }
    s
}

pub(crate) struct KvtierConnector {
    leader: Leader,
    worker: Worker,
    remote: Option<Arc<dyn RemoteStore>>,
    block_size: usize,
    salt: HashSalt,
    /// G1 stores go to the host tier (else straight to disk).
    has_host: bool,
    wait_for_remote: bool,
    /// Prefill role: the prompt hashes of requests whose KV must reach the remote store.
    prompt_hashes: HashMap<RequestId, Vec<u128>>,
    /// Saved on this rank, waiting for the remote store (hashes, deadline).
    publishing: HashMap<RequestId, Instant>,
}

/// Build the connector for an engine whose G1 is `kv`. `kv`'s memory must outlive the connector.
pub(crate) fn build(
    setup: &ConnectorSetup,
    cfg: &EngineConfig,
    model_name: &str,
    kv: &KvCache,
) -> Result<Box<dyn EngineConnector>, EngineError> {
    let c = &setup.config;
    let bs = cfg.block_size;
    if let Some(b) = c.connector.block_size.filter(|b| *b != bs) {
        return Err(EngineError::Config(format!(
            "kvtier block size {b} differs from the engine's block size {bs}"
        )));
    }
    let bytes_per_block = kv.bytes_per_block();
    let caps = c
        .resolve_capacity(bytes_per_block)
        .map_err(|e| cerr("kvtier config", e))?;
    // Register G1 exactly as TensorRT-LLM does: one pool tensor [blocks, layers, 2, bs*kv_dim].
    let ptr = kv.as_slice().as_ptr() as usize as u64;
    let desc = TensorDesc::contiguous(
        "kv_pool",
        ptr,
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
    // Device <-> disk/remote jobs go through the transfer engine's own bounce buffers.
    let mut tb = TransferEngine::builder().device(Arc::new(dl), layout::DeviceKind::Cpu);
    if caps.host_blocks > 0 {
        let mut o = HostOptions::new(caps.host_blocks as u32, bytes_per_block);
        o.pin = PinMode::Never;
        o.touch_threads = 1;
        tb = tb.host(Arc::new(
            HostStorage::new(&o).map_err(|e| cerr("host tier", e))?,
        ));
    }
    let mut recovered = Vec::new();
    if caps.disk_blocks > 0 {
        let mut o = DiskOptions::new(c.disk.dir.clone(), caps.disk_blocks as u32, bytes_per_block);
        // A stable name: a restart re-opens (with `disk.persist`, serves) the same file set; a
        // second live engine on the directory gets its own (`engine.1`, ...).
        o.name = "engine".into();
        o.persist = c.disk.persist;
        if !c.disk.use_o_direct {
            o.direct = kvtier_io::DirectMode::Off;
        }
        o.io = match c.disk.io_backend {
            kvtier::config::IoBackend::Auto => kvtier_io::DiskIoMode::Auto,
            kvtier::config::IoBackend::Uring => kvtier_io::DiskIoMode::Uring,
            kvtier::config::IoBackend::Pread => kvtier_io::DiskIoMode::Sync,
        };
        let disk = Arc::new(DiskStorage::create(&o).map_err(|e| cerr("disk tier", e))?);
        recovered = disk.recovered().to_vec();
        tb = tb.disk(disk);
    }
    let model_id = c
        .hashing
        .model
        .clone()
        .unwrap_or_else(|| model_name.to_owned());
    let remote = match &c.remote {
        None => None,
        Some(t) => {
            let url = match t {
                RemoteTarget::Redis(u) => u.clone(),
                RemoteTarget::Dir(p) => format!("dir://{}", Path::new(p).display()),
            };
            let r = kvtier_io::remote::from_url(&url, &namespace_for(&model_id))
                .map_err(|e| cerr("remote tier", e))?;
            tb = tb.remote(r.clone());
            Some(r)
        }
    };
    let engine = tb.build().map_err(|e| cerr("transfer engine", e))?;
    let mut transfer: Arc<dyn BlockTransfer> = Arc::new(engine);
    if let Some(w) = &setup.wrap_transfer {
        transfer = w(transfer);
    }
    let salt = HashSalt::new(&model_id, None, c.hashing.salt.as_deref());
    let mut leader = Leader::new(LeaderConfig {
        block_size: bs,
        salt,
        layout: None,
        host: Capacity::Blocks(caps.host_blocks),
        disk: Capacity::Blocks(caps.disk_blocks),
        disk_policy: if caps.disk_blocks == 0 {
            DiskPolicy::Never
        } else if c.policy.disk_filter.enabled {
            DiskPolicy::Filter(FilterParams {
                window: Duration::from_secs(c.policy.disk_filter.window_secs),
                max_tracked: c.policy.disk_filter.max_tracked,
            })
        } else {
            DiskPolicy::WriteThrough
        },
        remote: remote.clone(),
        remote_put: remote.is_some() && cfg.role != Role::Decode,
        async_loads: true,
        priority: Priority::default(),
    })
    .map_err(|e| cerr("leader", e))?;
    // Warm restart: the blocks the disk tier kept are hits from the first request on.
    leader.adopt_disk_blocks(&recovered);
    let worker = Worker::new(
        transfer,
        WorkerLink::in_process(0, 1, leader.report_sender()),
    );
    tracing::info!(
        host_blocks = caps.host_blocks,
        disk_blocks = caps.disk_blocks,
        remote = remote.is_some(),
        bytes_per_block,
        "kvtier connector ready"
    );
    Ok(Box::new(KvtierConnector {
        leader,
        worker,
        wait_for_remote: remote.is_some() && cfg.role == Role::Prefill,
        remote,
        block_size: bs,
        salt,
        has_host: caps.host_blocks > 0,
        prompt_hashes: HashMap::new(),
        publishing: HashMap::new(),
    }))
}

impl KvtierConnector {
    /// Keep background work (spills, remote puts) moving even when no request is scheduled.
    fn tick(&mut self) {
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
            let hs = sequence_hashes(self.salt, req.tokens, self.block_size)
                .into_iter()
                .map(|h| h.0)
                .collect();
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

    fn request_finished(&mut self, id: &RequestId, _block_ids: &[DeviceBlockId]) -> bool {
        match self.leader.request_finished(id) {
            Ok(in_flight) => {
                if self.wait_for_remote && !in_flight {
                    // Nothing to wait for on this rank, but the remote puts may still be queued.
                    self.publishing
                        .insert(id.clone(), Instant::now() + REMOTE_PUBLISH_DEADLINE);
                    return true;
                }
                in_flight
            }
            Err(e) => {
                tracing::warn!(request = %id, error = %e, "kvtier request_finished");
                false
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
            offloaded_remote_blocks: s.remote_put_confirmed,
            offloaded_host_blocks: if self.has_host {
                s.offload_confirmed
            } else {
                0
            },
            // Spills count once written and registered, not while in flight.
            offloaded_disk_blocks: s.spill_disk_confirmed
                + if self.has_host {
                    0
                } else {
                    s.offload_confirmed
                },
        }
    }
}

impl Drop for KvtierConnector {
    fn drop(&mut self) {
        // Every job touching the engine's memory finishes before that memory can be freed.
        self.worker.wait_idle();
    }
}
