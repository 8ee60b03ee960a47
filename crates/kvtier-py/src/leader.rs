//! `kvtier._native.Leader`: the scheduler side, a thin shell around
//! [`kvtier::connector::Leader`].
//!
//! Invariants: the Rust leader is built exactly once, with the ranks' layout: at construction
//! when the settings give `bytes_per_block`, otherwise at first use from the layout an
//! in-process Worker registered, or from the ZeroMQ handshake of every rank when a
//! `zmq_endpoint` is configured (waiting up to `connector.leader_worker_timeout_secs`, without
//! the GIL). Job reports are applied before every call: from the in-process channel, and from
//! `apply_reports` blobs. One mutex guards the whole state; engines call from one thread.
use std::sync::{Arc, Mutex, MutexGuard};

use kvtier::connector::leader::{promised_blocks, Leader, LeaderStats, RequestKey};
use kvtier::connector::messages::{ClusterLayout, LoadVerdicts, WorkerReport, PROTOCOL_VERSION};
use kvtier::connector::step::SchedulerStep;
use kvtier::connector::zmq::LeaderChannel;
use kvtier::ids::{DeviceBlockId, RequestId, Tier};
use kvtier::pool::PoolEvent;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::{extract_arg, extract_opt_arg, BridgeError, BridgeResult, Family};
use crate::records::{page_ids, record_from_py};
use crate::rendezvous::Rendezvous;
use crate::seq::{extract_opt_seq, extract_seq};
use crate::settings::Settings;

mod build;
use build::{Inner, Pending};

/// Encodes job reports for the engine's own worker -> scheduler channel (`link = "engine"`).
pub(crate) fn encode_reports(reports: &[WorkerReport]) -> BridgeResult<Vec<u8>> {
    postcard::to_stdvec(&(PROTOCOL_VERSION, reports))
        .map_err(|e| BridgeError::local(Family::Connector, format!("encoding job reports: {e}")))
}

fn decode_reports(blob: &[u8]) -> BridgeResult<Vec<WorkerReport>> {
    let (version, reports): (u32, Vec<WorkerReport>) = postcard::from_bytes(blob)
        .map_err(|e| BridgeError::local(Family::Connector, format!("decoding job reports: {e}")))?;
    if version != PROTOCOL_VERSION {
        return Err(BridgeError::local(
            Family::Connector,
            format!(
                "job reports have protocol version {version}, this build speaks {PROTOCOL_VERSION}"
            ),
        ));
    }
    Ok(reports)
}

/// The scheduler-side connector (see `_native.pyi`).
#[pyclass(name = "Leader", module = "kvtier._native")]
pub(crate) struct PyLeader {
    inner: Mutex<Inner>,
    block_size: usize,
    async_loads: bool,
    sync_host_loads: bool,
}

/// The stats dict: every series of the one counter table, by its key.
fn stats_dict(py: Python<'_>, s: &LeaderStats) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    for m in kvtier::metrics::METRICS {
        d.set_item(m.key, (m.value)(s))?;
    }
    Ok(d.unbind())
}

fn tier_name(t: Tier) -> &'static str {
    t.label()
}

impl PyLeader {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One engine step through the leader: the encoded metadata and its reuse fences.
    fn step_metadata<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
        finished: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<String>)> {
        let c = Family::Connector;
        let records: Vec<Bound<'py, PyAny>> = extract_seq(c, "records", records)?;
        let finished: Vec<String> = extract_opt_seq(c, "finished", finished)?.unwrap_or_default();
        let mut step = SchedulerStep {
            records: Vec::with_capacity(records.len()),
            finished: finished.into_iter().map(RequestId::from).collect(),
        };
        // Engine-supplied retention priorities per new block (TensorRT-LLM `RequestData.priorities`).
        let mut priorities: Vec<Option<Vec<u32>>> = Vec::with_capacity(records.len());
        for r in &records {
            step.records.push(record_from_py(r)?);
            let p = match r.cast::<PyTuple>() {
                Ok(t) if t.len() == 9 => extract_opt_seq(c, "priorities", Some(&t.get_item(8)?))?,
                _ => None,
            };
            priorities.push(p);
        }
        let mut g = self.lock();
        let leader = g.ready(py)?;
        // Records of requests whose page ids had a hole the leader cannot take are dropped
        // (`Leader::screen_record`), with their priorities.
        // (Nothing is allocated in a step that drops none: the per-step path.)
        let mut keep: Option<Vec<bool>> = None;
        for (i, r) in step.records.iter().enumerate() {
            if !leader.screen_record(r).map_err(BridgeError::from)? {
                keep.get_or_insert_with(|| vec![true; step.records.len()])[i] = false;
            }
        }
        if let Some(keep) = keep {
            let mut k = keep.iter();
            step.records.retain(|_| k.next().copied().unwrap_or(true));
            let mut k = keep.iter();
            priorities.retain(|_| k.next().copied().unwrap_or(true));
        }
        for (r, p) in step.records.iter().zip(&priorities) {
            if !r.new_block_ids.is_empty() {
                leader.set_block_priorities(&r.new_block_ids, p.as_deref());
            }
        }
        for r in &mut step.records {
            // TensorRT-LLM reports generation-only requests in cached_requests on first sight.
            if !r.is_new && leader.slot(&r.request_id).is_none() {
                r.is_new = true;
            }
        }
        let meta = leader.build_step(&step).map_err(BridgeError::from)?;
        let bytes = meta.to_bytes().map_err(BridgeError::from)?;
        let fence = meta.fence.iter().map(|r| r.as_str().to_owned()).collect();
        Ok((PyBytes::new(py, &bytes), fence))
    }
}

#[pymethods]
impl PyLeader {
    #[new]
    #[pyo3(signature = (settings = None))]
    fn py_new(settings: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let settings = Settings::from_py(settings)?;
        let block_size = settings.block_size().map_err(BridgeError::from)?;
        let world_size = settings.world_size().map_err(BridgeError::from)?;
        let async_loads = settings.async_loads().map_err(BridgeError::from)?;
        let sync_host_loads = settings.sync_host_loads().map_err(BridgeError::from)?;
        let recompute_tail = settings
            .recompute_tail_blocks()
            .map_err(BridgeError::from)?;
        let total = settings.bytes_per_block().map_err(BridgeError::from)?;
        let num_device_blocks = settings.num_device_blocks().map_err(BridgeError::from)?;
        let timeout = settings.timeout();
        let channel = settings.channel().map_err(BridgeError::from)?;
        // ZeroMQ only when the adapter asks for it (ranks in other processes).
        let zmq_endpoint = if settings.link().map_err(BridgeError::from)?.as_deref() == Some("zmq")
        {
            Some(settings.zmq_endpoint_or_default()?)
        } else {
            None
        };
        let mut inner = Inner {
            block_size,
            world_size,
            async_loads,
            sync_host_loads,
            recompute_tail,
            load_verdicts: false,
            unpaged_exclusion: false,
            match_holds: None,
            remote_hits_async: false,
            settings,
            pending: None,
            leader: None,
            reports: None,
            zmq: None,
            metrics: None,
            shut_down: false,
        };
        // Every leader owns a rendezvous, so in-process workers of its engine can reach it.
        let rv = Rendezvous::for_leader(&channel);
        if let Some(endpoint) = zmq_endpoint {
            let ch = Arc::new(LeaderChannel::bind(&endpoint).map_err(BridgeError::from)?);
            let (tx, rx) = std::sync::mpsc::channel();
            let hs = Arc::clone(&ch);
            let bs = block_size as u32;
            std::thread::Builder::new()
                .name("kvtier-handshake".into())
                .spawn(move || {
                    let _ = tx.send(hs.handshake(world_size, bs, timeout));
                })
                .map_err(|e| BridgeError::local(Family::Connector, format!("spawn: {e}")))?;
            inner.zmq = Some(ch);
            inner.pending = Some(Pending::Zmq {
                handshake: rx,
                timeout,
            });
            return Ok(PyLeader {
                inner: Mutex::new(inner),
                block_size,
                async_loads,
                sync_host_loads,
            });
        }
        match total {
            Some(total) if total > 0 => {
                let per_rank = (total as u64) / u64::from(world_size);
                let layout = ClusterLayout {
                    block_size: block_size as u32,
                    num_device_blocks: num_device_blocks.unwrap_or(u32::MAX),
                    bytes_per_block: vec![per_rank; world_size as usize],
                };
                inner.reports = rv.take_receiver();
                inner.build(layout)?;
            }
            _ => {
                inner.pending = Some(Pending::InProcess {
                    rendezvous: rv,
                    timeout,
                })
            }
        }
        Ok(PyLeader {
            inner: Mutex::new(inner),
            block_size,
            async_loads,
            sync_host_loads,
        })
    }

    #[getter]
    fn loads_are_async(&self) -> bool {
        self.async_loads
    }

    /// Whether host-tier hits load inside the step although loads are asynchronous (the resolved
    /// `connector.sync_host_loads`).
    #[getter]
    fn sync_host_loads(&self) -> bool {
        self.sync_host_loads
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether the load of `request_id`'s last match is asynchronous (a host-tier hit loads in
    /// the step with `sync_host_loads`; see `Leader::set_sync_host_loads`).
    fn load_is_async(&self, py: Python<'_>, request_id: String) -> PyResult<bool> {
        let mut g = self.lock();
        let leader = g.ready(py)?;
        Ok(leader.load_is_async(&RequestId::from(request_id)))
    }

    // Each argument is a Python keyword of the binding's signature.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, tokens, num_computed_tokens, identity = None, cacheable = true, read = true))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: String,
        tokens: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        identity: Option<String>,
        cacheable: bool,
        read: bool,
    ) -> PyResult<usize> {
        // Integers extracted here so that a negative one is a ConnectorError naming it (#13).
        let c = Family::Connector;
        let tokens: Vec<u32> = extract_seq(c, "tokens", tokens)?;
        let num_computed_tokens: usize =
            extract_arg(c, "num_computed_tokens", num_computed_tokens)?;
        let key = RequestKey {
            identity,
            cacheable,
            read,
        };
        let mut g = self.lock();
        let leader = g.ready(py)?;
        Ok(leader
            .get_num_new_matched_tokens_for(
                &RequestId::from(request_id),
                &tokens,
                num_computed_tokens,
                &key,
            )
            .map_err(BridgeError::from)?)
    }

    #[pyo3(signature = (request_id, block_ids, num_external_tokens = None))]
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request_id: String,
        block_ids: &Bound<'_, PyAny>,
        num_external_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let c = Family::Connector;
        let block_ids: Vec<u32> = extract_seq(c, "block_ids", block_ids)?;
        let num_external_tokens: Option<usize> =
            extract_opt_arg(c, "num_external_tokens", num_external_tokens)?;
        let ids: Vec<DeviceBlockId> = block_ids.into_iter().map(DeviceBlockId).collect();
        let mut g = self.lock();
        g.ready(py)?
            .update_state_after_alloc(&RequestId::from(request_id), &ids, num_external_tokens)
            .map_err(BridgeError::from)?;
        Ok(())
    }

    /// `update_state_after_alloc` for engines that must fail the promised loads of a refused
    /// allocation: returns `(failed_block_ids, refusal)`, the device blocks to report as failed
    /// loads and the leader's refusal as text (both empty when it accepted).
    fn allocate(
        &self,
        py: Python<'_>,
        request_id: String,
        block_ids: &Bound<'_, PyAny>,
        num_external_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<u32>, Option<String>)> {
        let c = Family::Connector;
        let block_ids: Vec<u32> = extract_seq(c, "block_ids", block_ids)?;
        let num_external_tokens: usize =
            extract_arg(c, "num_external_tokens", num_external_tokens)?;
        let ids: Vec<DeviceBlockId> = block_ids.into_iter().map(DeviceBlockId).collect();
        let mut g = self.lock();
        let leader = match g.ready(py) {
            Ok(leader) => leader,
            // No leader, no match: what the engine was promised (from its first block) fails.
            Err(e) => {
                let failed = promised_blocks(&ids, 0, num_external_tokens, self.block_size);
                return Ok((
                    failed.iter().map(|d| d.0).collect(),
                    Some(PyErr::from(e).to_string()),
                ));
            }
        };
        let a = leader.allocate(&RequestId::from(request_id), &ids, num_external_tokens);
        Ok((
            a.failed_devices.iter().map(|d| d.0).collect(),
            a.refused.map(|e| e.to_string()),
        ))
    }

    /// The engine will not consume tokens `[start, end)` of the request's last offer
    /// (TensorRT-LLM's `cancel_load`); applied at its allocation (`allocate_offer`).
    fn cancel_load(
        &self,
        py: Python<'_>,
        request_id: String,
        start: &Bound<'_, PyAny>,
        end: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let c = Family::Connector;
        let start: usize = extract_arg(c, "start", start)?;
        let end: usize = extract_arg(c, "end", end)?;
        let mut g = self.lock();
        Ok(g.ready(py)?
            .cancel_load(&RequestId::from(request_id), start, end)
            .map_err(BridgeError::from)?)
    }

    /// `update_state_after_alloc` taking the last offer less the engine's cut: returns the
    /// first token of the request's asynchronous load, or None when none was offered.
    fn allocate_offer(
        &self,
        py: Python<'_>,
        request_id: String,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        // `-1` (no page) is the leader's to judge (`Leader::screen_allocation`).
        let ids = page_ids(Family::Connector, "block_ids", block_ids)?;
        let id = RequestId::from(request_id);
        let mut g = self.lock();
        let leader = g.ready(py)?;
        let ids = leader
            .screen_allocation(&id, &ids)
            .map_err(BridgeError::from)?;
        Ok(leader
            .allocate_offer(&id, &ids)
            .map_err(BridgeError::from)?)
    }

    /// The tokens of the request's last allocation per source tier: `[(tier, tokens)]`, host
    /// before disk before remote, clipped to `num_external_tokens`; asked once.
    fn take_hit_sources(
        &self,
        py: Python<'_>,
        request_id: String,
        num_external_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(&'static str, usize)>> {
        let num_external_tokens: usize = extract_arg(
            Family::Connector,
            "num_external_tokens",
            num_external_tokens,
        )?;
        let mut g = self.lock();
        Ok(g.ready(py)?
            .take_hit_sources(&RequestId::from(request_id), num_external_tokens)
            .into_iter()
            .map(|(t, n)| (tier_name(t), n))
            .collect())
    }

    #[pyo3(signature = (records, finished = None))]
    fn build_step<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
        finished: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Ok(self.step_metadata(py, records, finished)?.0)
    }

    /// `build_step`, plus the step's reuse fences: the finished requests whose jobs the
    /// workers must wait for before anything of the step writes device blocks.
    #[pyo3(signature = (records, finished = None))]
    fn build_step_with_fences<'py>(
        &self,
        py: Python<'py>,
        records: &Bound<'py, PyAny>,
        finished: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<String>)> {
        self.step_metadata(py, records, finished)
    }

    #[pyo3(signature = (request_id, fence_reuse = false))]
    fn request_finished(
        &self,
        py: Python<'_>,
        request_id: String,
        fence_reuse: bool,
    ) -> PyResult<bool> {
        let mut g = self.lock();
        let leader = g.ready(py)?;
        let id = RequestId::from(request_id);
        leader.forget_exclusion(&id);
        let reuse = if fence_reuse {
            leader.request_finished_fenced(&id)
        } else {
            leader.request_finished(&id)
        };
        Ok(reuse.map_err(BridgeError::from)?.must_wait())
    }

    /// Forget every host and disk block (vLLM's reset_cache); returns how many.
    fn clear_tiers(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = self.lock();
        Ok(g.ready(py)?.clear_tiers())
    }

    fn request_preempted(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        let mut g = self.lock();
        g.ready(py)?
            .request_preempted(&RequestId::from(request_id))
            .map_err(BridgeError::from)?;
        Ok(())
    }

    /// The engine named the request among a step's preempted ones: it is preempted if it ran
    /// since it was last matched (unknown or already preempted: left alone). Returns whether.
    fn request_preempted_if_running(&self, py: Python<'_>, request_id: String) -> PyResult<bool> {
        let mut g = self.lock();
        Ok(g.ready(py)?
            .request_preempted_if_running(&RequestId::from(request_id))
            .map_err(BridgeError::from)?)
    }

    /// Issue one verdict per asynchronous load, the same for every rank (TensorRT-LLM, TP > 1;
    /// `Leader::set_load_verdicts`).
    fn enable_load_verdicts(&self) {
        let mut g = self.lock();
        g.load_verdicts = true;
        if let Some(l) = g.leader.as_mut() {
            l.set_load_verdicts(true);
        }
    }

    /// Hits that touch the remote tier load asynchronously even when it is the node tier (whose
    /// hits otherwise count as host hits with `sync_host_loads`): for an engine that cannot
    /// recompute a failed synchronous load (TensorRT-LLM), where a node that dies between the
    /// match and the load must cost a recompute, never a forward over unloaded blocks.
    fn load_remote_hits_async(&self) {
        let mut g = self.lock();
        g.remote_hits_async = true;
        if let Some(l) = g.leader.as_mut() {
            l.set_near_remote(false);
        }
    }

    /// A match holds the host and disk blocks it offers until the request's allocation
    /// (TensorRT-LLM's KVCacheManagerV2 allocates passes later; `Leader::enable_match_holds`);
    /// `expire=False` for a model with sliding-window layer groups (holds never time out).
    #[pyo3(signature = (expire = true))]
    fn enable_match_holds(&self, expire: bool) {
        let mut g = self.lock();
        g.match_holds = Some(expire);
        if let Some(l) = g.leader.as_mut() {
            l.enable_match_holds(expire);
        }
    }

    /// Whether match holds are on and time out: `None` off, `True` given back after
    /// `MAX_HOLD_STEPS` steps, `False` kept until the allocation (sliding-window models).
    fn match_holds_expire(&self) -> Option<bool> {
        self.lock().match_holds
    }

    /// Blocks held by matches not yet allocated (`Leader::held_blocks`).
    fn held_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = self.lock();
        Ok(g.ready(py)?.held_blocks())
    }

    /// Page ids may carry `-1` (TensorRT-LLM's `BAD_PAGE_INDEX`): trailing ones are pages not
    /// allocated yet, any other excludes the request from caching unless this leader serves a
    /// window group (`Leader::set_unpaged_exclusion`).
    fn enable_unpaged_exclusion(&self) {
        let mut g = self.lock();
        g.unpaged_exclusion = true;
        if let Some(l) = g.leader.as_mut() {
            l.set_unpaged_exclusion(true);
        }
    }

    /// Whether the request stopped being cached because its page ids had a `-1`.
    fn is_excluded(&self, py: Python<'_>, request_id: String) -> PyResult<bool> {
        let mut g = self.lock();
        Ok(g.ready(py)?.is_excluded(&RequestId::from(request_id)))
    }

    /// The load verdicts issued since the last call, encoded for `Worker.apply_load_verdicts`
    /// on every rank (empty bytes: none).
    fn take_load_verdicts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let verdicts = {
            let mut g = self.lock();
            g.ready(py)?.take_load_verdicts()
        };
        if verdicts.is_empty() {
            return Ok(PyBytes::new(py, b""));
        }
        let blob = LoadVerdicts {
            version: PROTOCOL_VERSION,
            verdicts,
        }
        .to_bytes()
        .map_err(BridgeError::from)?;
        Ok(PyBytes::new(py, &blob))
    }

    fn apply_reports(&self, py: Python<'_>, blob: &[u8]) -> PyResult<()> {
        if blob.is_empty() {
            return Ok(());
        }
        let reports = decode_reports(blob)?;
        let mut g = self.lock();
        let leader = g.ready(py)?;
        for r in reports {
            leader.apply_report(r);
        }
        Ok(())
    }

    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
        let events = {
            let mut g = self.lock();
            g.ready(py)?.take_events()
        };
        let mut out = Vec::with_capacity(events.len());
        for ev in events {
            let d = PyDict::new(py);
            let (kind, hash, tier) = match ev {
                PoolEvent::Stored { hash, tier } => ("stored", hash, tier),
                PoolEvent::Removed { hash, tier } => ("removed", hash, tier),
            };
            d.set_item("kind", kind)?;
            d.set_item("tier", tier_name(tier))?;
            d.set_item("hashes", vec![hash.0])?;
            out.push(d.unbind());
        }
        Ok(out)
    }

    /// Drop the tier events since the last call without building them (an engine that publishes
    /// no KV events); returns how many.
    fn discard_events(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = self.lock();
        Ok(g.ready(py)?.take_events().len())
    }

    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let mut g = self.lock();
        let leader = g.ready(py)?;
        // Reports that arrived since the last step count (ranks over ZeroMQ report asynchronously).
        leader.poll_reports();
        let s = leader.stats();
        stats_dict(py, &s)
    }

    fn shutdown(&self) {
        let mut g = self.lock();
        g.shut_down = true;
        g.leader = None;
        // Its series leave the process's metrics endpoint.
        g.metrics = None;
        g.pending = None;
        g.reports = None;
        if let Some(ch) = g.zmq.take() {
            if let Ok(ch) = Arc::try_unwrap(ch) {
                ch.shutdown();
            }
        }
    }
}

/// `kvtier._native.match_groups`: match one request in every KV cache group of an engine with
/// several (one `Leader` per group, in group order): the external tokens all groups can supply,
/// recorded by each (`kvtier::connector::groups::match_groups`).
#[pyfunction]
#[pyo3(signature = (leaders, request_id, tokens, num_computed_tokens, identity = None, cacheable = true, read = true))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn match_groups(
    py: Python<'_>,
    leaders: &Bound<'_, PyAny>,
    request_id: String,
    tokens: &Bound<'_, PyAny>,
    num_computed_tokens: &Bound<'_, PyAny>,
    identity: Option<String>,
    cacheable: bool,
    read: bool,
) -> PyResult<usize> {
    let c = Family::Connector;
    let leaders: Vec<PyRef<'_, PyLeader>> = extract_seq(c, "leaders", leaders)?;
    let tokens: Vec<u32> = extract_seq(c, "tokens", tokens)?;
    let num_computed_tokens: usize = extract_arg(c, "num_computed_tokens", num_computed_tokens)?;
    for (i, a) in leaders.iter().enumerate() {
        if leaders[..i].iter().any(|b| std::ptr::eq(&**a, &**b)) {
            return Err(BridgeError::local(c, "match_groups: a leader is listed twice").into());
        }
    }
    let key = RequestKey {
        identity,
        cacheable,
        read,
    };
    let mut guards: Vec<MutexGuard<'_, Inner>> = leaders.iter().map(|l| l.lock()).collect();
    let mut ready: Vec<&mut Leader> = Vec::with_capacity(guards.len());
    for g in guards.iter_mut() {
        ready.push(g.ready(py)?);
    }
    Ok(kvtier::connector::groups::match_groups(
        &mut ready,
        &RequestId::from(request_id),
        &tokens,
        num_computed_tokens,
        &key,
    )
    .map_err(BridgeError::from)?)
}
