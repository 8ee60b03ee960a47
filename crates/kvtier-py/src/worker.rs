//! `kvtier._native.Worker`: one rank's worker, a thin shell around [`kvtier::connector::Worker`]
//! over kvtier-io's `TransferEngine` (the engine's KV memory, the host tier, the disk tier).
//!
//! Invariants: constructing a Worker validates the engine's tensors into a `DeviceLayout` before
//! anything is allocated (a bad tensor is a `LayoutError`, nothing is left behind), and registers
//! them only through kvtier-io's checked `EngineMemory::from_tensors`: every region of the layout
//! lies inside one described tensor, and the tensors' owners (the objects `kvtier.describe` was
//! given) stay referenced while the transfer engine lives; the host and
//! disk tiers hold exactly the block counts the Leader computes from the same settings (equal
//! shards: `bytes_per_block * world_size`, or the `bytes_per_block` setting); job reports go to
//! the in-process Leader (`link = "in_process"`) or into a buffer drained by `take_reports`
//! (`link = "engine"`). Blocking calls release the GIL. One mutex guards the connector worker.
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvtier::connector::messages::{
    ClusterLayout, LoadVerdicts, RankLayout, StepMetadata, WorkerReport,
};
use kvtier::connector::worker::{FinishedReport, ReportSink, Worker, WorkerLink};
use kvtier::connector::zmq::WorkerChannel;
use kvtier::connector::ConnectorError;
use kvtier::connector::LoadRecovery;
use kvtier::ids::RequestId;
use kvtier::layout::{self, DeviceLayout, EngineLayoutKind};
use kvtier::transfer::BlockTransfer;
use kvtier_io::compose::HostMemory;
use kvtier_io::transfer::memory::{EngineMemory, TensorMemory};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::{extract_opt_arg, timeout_arg, BridgeError, BridgeResult, Family};
use crate::leader::encode_reports;
use crate::rendezvous::Rendezvous;
use crate::seq::{extract_opt_seq, extract_seq};
use crate::settings::Settings;
use crate::tensor::TensorDesc;

/// Reports kept for the engine's own worker -> scheduler channel.
#[derive(Default)]
struct BufferSink(Mutex<Vec<WorkerReport>>);

impl ReportSink for BufferSink {
    fn send(&self, report: WorkerReport) -> Result<(), ConnectorError> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(report);
        Ok(())
    }
}

/// `tensors`: one TensorDesc, a sequence of them, or a sequence of (name, TensorDesc).
fn tensors_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(String, TensorDesc)>> {
    if let Ok(d) = obj.cast::<TensorDesc>() {
        return Ok(vec![("kv_cache_tensor".into(), d.get().clone())]);
    }
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        if let Ok(d) = item.cast::<TensorDesc>() {
            out.push((format!("layer {i}"), d.get().clone()));
        } else if let Ok(t) = item.cast::<PyTuple>() {
            let name: String = t.get_item(0)?.str()?.to_string();
            let d = t.get_item(1)?;
            let d = d.cast::<TensorDesc>().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "tensor {name}: expected a TensorDesc (use kvtier.describe)"
                ))
            })?;
            out.push((name, d.get().clone()));
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "tensors must be TensorDesc objects or (name, TensorDesc) pairs (use kvtier.describe)",
            ));
        }
    }
    Ok(out)
}

fn layout_kind(
    settings: &Settings,
    tensors: &[layout::TensorDesc],
    block_size: usize,
) -> BridgeResult<EngineLayoutKind> {
    let first = tensors
        .first()
        .ok_or_else(|| BridgeError::local(Family::Layout, "no KV cache tensors were given"))?;
    let name = match settings.layout().map_err(BridgeError::from)? {
        Some(n) => n,
        None if tensors.len() == 1
            && first.shape.len() == 4
            && settings.role().map_err(BridgeError::from)?.is_none() =>
        {
            "trtllm_pool".into()
        }
        None => "vllm".into(),
    };
    // vLLM's logical block count tells kernel-block splitting apart (its views then have more rows).
    let vllm_blocks = settings
        .num_device_blocks_usize()
        .map_err(BridgeError::from)?;
    Ok(match name.as_str() {
        "trtllm_pool" => EngineLayoutKind::TrtllmPool {
            tokens_per_block: block_size,
        },
        // Any vLLM release: 4-D views (>= 0.32, every KVCacheLayout), 5-D K/V tensors, MLA.
        "vllm" | "vllm_cuda" | "auto" => EngineLayoutKind::detect_vllm(first, vllm_blocks)?,
        "vllm_paged" => match EngineLayoutKind::detect_vllm(first, vllm_blocks)? {
            k @ EngineLayoutKind::VllmPaged { .. } => k,
            _ => EngineLayoutKind::VllmPaged { kernel_blocks: 1 },
        },
        "vllm_cuda_kv_first" => EngineLayoutKind::VllmCudaKvFirst,
        "vllm_cuda_block_first" => EngineLayoutKind::VllmCudaBlockFirst,
        "vllm_mla" => EngineLayoutKind::VllmMla,
        "vllm_cpu" => EngineLayoutKind::VllmCpu,
        other => {
            return Err(BridgeError::local(
                Family::Config,
                format!(
                    "layout: {other:?} is not one of vllm (detected from the tensors), vllm_paged, \
                     trtllm_pool, vllm_cuda_kv_first, vllm_cuda_block_first, vllm_mla, vllm_cpu"
                ),
            ))
        }
    })
}

/// Test hook (`test_load_delay_ms` setting): loads into device memory start this much later, so
/// a test driver can tell a connector that waits for its loads from one that merely races them.
struct DelayedLoads {
    inner: Arc<dyn BlockTransfer>,
    delay: std::time::Duration,
}

impl BlockTransfer for DelayedLoads {
    fn bytes_per_block(&self) -> usize {
        self.inner.bytes_per_block()
    }
    fn has_tier(&self, tier: kvtier::ids::Tier) -> bool {
        self.inner.has_tier(tier)
    }
    fn fence(
        &self,
        engine_stream: Option<u64>,
    ) -> Result<kvtier::transfer::Fence, kvtier::transfer::TransferError> {
        self.inner.fence(engine_stream)
    }
    fn execute(
        &self,
        job: &kvtier::transfer::TransferJob,
        fence: &kvtier::transfer::Fence,
    ) -> kvtier::transfer::TransferOutcome {
        self.delay_load(job);
        self.inner.execute(job, fence)
    }
    fn execute_ordered(
        &self,
        job: &kvtier::transfer::TransferJob,
        fence: &kvtier::transfer::Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(),
    ) -> kvtier::transfer::TransferOutcome {
        self.delay_load(job);
        self.inner
            .execute_ordered(job, fence, engine_stream, enqueued)
    }
    fn execute_layered(
        &self,
        job: &kvtier::transfer::TransferJob,
        fence: &kvtier::transfer::Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(Option<Arc<dyn kvtier::transfer::LayerGate>>),
    ) -> kvtier::transfer::TransferOutcome {
        self.delay_load(job);
        self.inner
            .execute_layered(job, fence, engine_stream, enqueued)
    }
}

impl DelayedLoads {
    fn delay_load(&self, job: &kvtier::transfer::TransferJob) {
        if job.dst_tier() == kvtier::ids::Tier::Device {
            std::thread::sleep(self.delay);
        }
    }
}

struct Inner {
    worker: Option<Worker>,
    buffer: Option<Arc<BufferSink>>,
    /// Kept open for the worker's lifetime (link "zmq"); closed after the worker.
    zmq: Option<WorkerChannel>,
    /// Failed asynchronous loads handed back for recompute or withheld (`get_finished_by_verdict`).
    recovery: LoadRecovery,
}

/// One rank's worker (see `_native.pyi`).
#[pyclass(name = "Worker", module = "kvtier._native")]
pub(crate) struct PyWorker {
    inner: Mutex<Inner>,
    rank: u32,
    bytes_per_block: usize,
    num_device_blocks: usize,
    host_blocks: usize,
    disk_blocks: usize,
    /// `layered_group_loads`, checked as a boolean when the worker is built.
    layered_group_loads: bool,
    /// `early_sync_loads`, checked as a boolean when the worker is built.
    early_sync_loads: bool,
}

impl PyWorker {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The worker's `get_finished` over the engine's string ids.
    fn finished_report(
        &self,
        finished: Vec<String>,
        started_loading: Option<Vec<String>>,
    ) -> PyResult<FinishedReport> {
        let finished: Vec<RequestId> = finished.into_iter().map(RequestId::from).collect();
        let started: Option<Vec<RequestId>> =
            started_loading.map(|v| v.into_iter().map(RequestId::from).collect());
        let mut g = self.lock();
        Ok(g.worker
            .as_mut()
            .ok_or_else(gone)?
            .get_finished(&finished, started.as_deref()))
    }

    fn build(
        py: Python<'_>,
        settings: &Settings,
        tensors: Vec<(String, TensorDesc)>,
    ) -> BridgeResult<Self> {
        let block_size = settings.block_size().map_err(BridgeError::from)?;
        let world_size = settings.world_size().map_err(BridgeError::from)?;
        let rank = u32::try_from(settings.rank().map_err(BridgeError::from)?.unwrap_or(0))
            .map_err(|_| BridgeError::local(Family::Config, "rank: too large"))?;
        if rank >= world_size {
            return Err(BridgeError::local(
                Family::Config,
                format!("rank: {rank} is not below world_size {world_size}"),
            ));
        }
        let mut core = Vec::with_capacity(tensors.len());
        for (name, d) in &tensors {
            core.push(d.to_core(name)?);
        }
        let first = tensors
            .first()
            .ok_or_else(|| BridgeError::local(Family::Layout, "no KV cache tensors were given"))?;
        let dtype = first
            .1
            .dtype(settings.dtype().map_err(BridgeError::from)?.as_deref())?;
        let kind = layout_kind(settings, &core, block_size)?;
        let dl = DeviceLayout::new(kind, &core, dtype)?;
        let bpb = dl.bytes_per_block();
        let num_blocks = dl.num_blocks();
        let device = dl.device();
        // The tensors' bytes and owners; a region outside them is refused (a LayoutError).
        let mut owned = Vec::with_capacity(core.len());
        for ((_, d), c) in tensors.iter().zip(&core) {
            owned.push(
                TensorMemory::of(c, d.owner.as_ref().map(|o| o.keep_alive()))
                    .map_err(|e| BridgeError::local(Family::Layout, e.to_string()))?,
            );
        }
        let memory = EngineMemory::from_tensors(dl, owned)
            .map_err(|e| BridgeError::local(Family::Layout, e.to_string()))?;
        let link_name = settings
            .link()
            .map_err(BridgeError::from)?
            .unwrap_or_else(|| "engine".to_string());
        let me = RankLayout {
            rank,
            world_size,
            block_size: block_size as u32,
            bytes_per_block: bpb as u64,
            num_device_blocks: u32::try_from(num_blocks).map_err(|_| {
                BridgeError::local(
                    Family::Layout,
                    format!("{num_blocks} device blocks is too many"),
                )
            })?,
        };
        let mut zmq = None;
        let cluster = if link_name == "zmq" {
            let endpoint = settings.zmq_endpoint_or_default()?;
            let timeout = settings.timeout();
            let hello = me.clone();
            // Waits until every rank said hello and the leader agreed on the layout.
            let ch = py
                .detach(|| WorkerChannel::connect(&endpoint, hello, timeout))
                .map_err(BridgeError::from)?;
            let layout = ch.layout().clone();
            zmq = Some(ch);
            layout
        } else {
            // Equal shards: the `bytes_per_block` setting is over all ranks, as the leader reads it.
            let per_rank = match settings.bytes_per_block().map_err(BridgeError::from)? {
                Some(t) if t > 0 => (t / world_size as usize) as u64,
                _ => bpb as u64,
            };
            ClusterLayout {
                block_size: block_size as u32,
                num_device_blocks: me.num_device_blocks,
                bytes_per_block: vec![per_rank; world_size as usize],
            }
        };
        // Host and disk tiers sized like the leader's pools, by the same composition root.
        let plan = crate::vllm_support::composition(settings, cluster)?;
        let caps = plan.capacities();
        let host = HostMemory {
            cuda_device: match device {
                layout::DeviceKind::Cpu => 0,
                layout::DeviceKind::Cuda(i) => i as i32,
            },
            ..HostMemory::default()
        };
        let remote = plan.remote_store().map_err(crate::vllm_support::bridge)?;
        let tiers = plan
            .transfer(rank, memory, host, remote)
            .map_err(crate::vllm_support::bridge)?;
        let mut engine: Arc<dyn BlockTransfer> = Arc::new(tiers.engine);
        if let Some(ms) = settings.test_load_delay_ms().map_err(BridgeError::from)? {
            engine = Arc::new(DelayedLoads {
                inner: engine,
                delay: std::time::Duration::from_millis(ms as u64),
            });
        }
        let (link, buffer) = match link_name.as_str() {
            "engine" => {
                let buf = Arc::new(BufferSink::default());
                (
                    WorkerLink::new(rank, world_size, Arc::clone(&buf) as Arc<dyn ReportSink>),
                    Some(buf),
                )
            }
            "zmq" => match &zmq {
                Some(ch) => (WorkerLink::new(rank, world_size, ch.sink()), None),
                None => {
                    return Err(BridgeError::local(
                        Family::Connector,
                        "ZeroMQ channel missing",
                    ))
                }
            },
            "in_process" => {
                let rv =
                    Rendezvous::for_worker(&settings.channel().map_err(BridgeError::from)?, rank);
                rv.register(me);
                (
                    WorkerLink::new(rank, world_size, Arc::new(rv.report_sender())),
                    None,
                )
            }
            other => {
                return Err(BridgeError::local(
                    Family::Config,
                    format!("link: {other:?} is not \"engine\", \"in_process\" or \"zmq\""),
                ))
            }
        };
        tracing::info!(
            rank,
            world_size,
            bytes_per_block = bpb,
            num_device_blocks = num_blocks,
            host_blocks = caps.host_blocks,
            disk_blocks = caps.disk_blocks,
            link = %link_name,
            "kvtier worker registered its KV cache"
        );
        let mut worker = Worker::new(engine, link);
        // TensorRT-LLM passes get_finished only the requests request_finished answered True for.
        worker.set_finished_ids_are_saving(
            settings
                .finished_ids_are_saving()
                .map_err(BridgeError::from)?,
        );
        // Opt-in (`ordered_sync_loads`, vLLM's extra config): sync loads ordered on the device
        // ahead of the engine's forward pass (kvtier::connector::Worker::set_ordered_sync_loads).
        worker.set_ordered_sync_loads(settings.ordered_sync_loads().map_err(BridgeError::from)?);
        // Opt-in (`layered_sync_loads`, vLLM's extra config): ordered sync loads layer by layer
        // in steps the adapter starts layered (kvtier::connector::Worker::set_layered_sync_loads).
        worker.set_layered_sync_loads(settings.layered_sync_loads().map_err(BridgeError::from)?);
        let layered_group_loads = settings.layered_group_loads().map_err(BridgeError::from)?;
        let early_sync_loads = settings.early_sync_loads().map_err(BridgeError::from)?;
        Ok(PyWorker {
            inner: Mutex::new(Inner {
                worker: Some(worker),
                buffer,
                zmq,
                recovery: LoadRecovery::default(),
            }),
            rank,
            bytes_per_block: bpb,
            num_device_blocks: num_blocks,
            host_blocks: caps.host_blocks,
            disk_blocks: caps.disk_blocks,
            layered_group_loads,
            early_sync_loads,
        })
    }
}

/// Waits for the worker's jobs, then stops its threads, within `timeout` in all; false when
/// time ran out (the error is in the log; threads still running end on their own).
fn shut(py: Python<'_>, inner: &mut Inner, timeout: Duration) -> bool {
    let clean = match inner.worker.take() {
        Some(mut w) => py.detach(move || {
            let deadline = Instant::now() + timeout;
            let idle = w.wait_idle_within(timeout);
            match w.shutdown(deadline.saturating_duration_since(Instant::now())) {
                Ok(()) => idle,
                Err(e) => {
                    tracing::error!(error = %e, "kvtier worker shutdown");
                    false
                }
            }
        }),
        None => true,
    };
    inner.zmq = None;
    // The disk tier's file set stays: the next worker of this rank on the directory takes it
    // over (and, with `disk.persist`, serves its blocks).
    clean
}

/// Which tiers and load mode `settings` configure, without building anything: the TensorRT-LLM
/// adapter refuses at construction the configurations whose failed loads it cannot recompute.
/// Keys: `disk` and `remote` (configured at a non-zero size / with a URL), `async_loads`.
#[pyfunction]
#[pyo3(signature = (settings = None))]
pub(crate) fn configured_tiers(
    py: Python<'_>,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<Py<PyDict>> {
    use kvtier::config::TierSize;
    let settings = Settings::from_py(settings)?;
    let nonzero = |s: &Option<TierSize>| match s {
        Some(TierSize::Gb(g)) => *g > 0.0,
        Some(TierSize::Blocks(n)) => *n > 0,
        None => false,
    };
    let d = PyDict::new(py);
    d.set_item("host", nonzero(&settings.config.host.size))?;
    d.set_item("disk", nonzero(&settings.config.disk.size))?;
    d.set_item("remote", settings.config.remote.is_some())?;
    d.set_item(
        "async_loads",
        settings.async_loads().map_err(BridgeError::from)?,
    )?;
    d.set_item(
        "sync_host_loads",
        settings.sync_host_loads().map_err(BridgeError::from)?,
    )?;
    Ok(d.unbind())
}

fn gone() -> PyErr {
    crate::errors::new_err(Family::Connector, "the worker was shut down")
}

/// `(saved, loaded, [(request, recompute_from)])` of `get_finished_by_verdict`.
type ByVerdict = (Vec<String>, Vec<String>, Vec<(String, u64)>);

/// `get_finished`'s request ids, read with a bound ([`crate::seq`]).
type FinishedArgs = (Vec<String>, Option<Vec<String>>);

fn finished_args(
    finished: &Bound<'_, PyAny>,
    started_loading: Option<&Bound<'_, PyAny>>,
) -> PyResult<FinishedArgs> {
    let c = Family::Connector;
    Ok((
        extract_seq(c, "finished", finished)?,
        extract_opt_seq(c, "started_loading", started_loading)?,
    ))
}

fn ids(v: Vec<RequestId>) -> Vec<String> {
    v.into_iter().map(|r| r.to_string()).collect()
}

#[pymethods]
impl PyWorker {
    #[new]
    #[pyo3(signature = (settings, tensors))]
    fn py_new(
        py: Python<'_>,
        settings: Option<&Bound<'_, PyDict>>,
        tensors: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let tensors = tensors_from_py(tensors)?;
        let settings = Settings::from_py(settings)?;
        Ok(PyWorker::build(py, &settings, tensors)?)
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }
    #[getter]
    fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }
    #[getter]
    fn num_device_blocks(&self) -> usize {
        self.num_device_blocks
    }

    fn bind(&self, metadata: &[u8]) -> PyResult<()> {
        let meta = StepMetadata::from_bytes(metadata).map_err(BridgeError::from)?;
        let mut g = self.lock();
        g.worker.as_mut().ok_or_else(gone)?.bind(&meta);
        Ok(())
    }

    /// Start the bound step's loads; `layered`: the step's ordered sync loads may go layer by
    /// layer (the engine then calls `wait_for_layer_load` before every layer's attention).
    #[pyo3(signature = (stream = None, layered = false))]
    fn start_load(&self, stream: Option<&Bound<'_, PyAny>>, layered: bool) -> PyResult<()> {
        let stream: Option<u64> = extract_opt_arg(Family::Connector, "stream", stream)?;
        let mut g = self.lock();
        g.worker
            .as_mut()
            .ok_or_else(gone)?
            .start_load_layered(stream, layered);
        Ok(())
    }

    /// Whether a hybrid model's ordered loads may go layer by layer (`layered_group_loads`).
    fn layered_group_loads(&self) -> bool {
        self.layered_group_loads
    }

    /// Whether the adapter may start a step's sync loads when its scheduler builds the step
    /// (`early_sync_loads`: vLLM's scheduler and worker in one thread).
    fn early_sync_loads(&self) -> bool {
        self.early_sync_loads
    }

    /// Whether the bound step has layered loads (the engine must call the per-layer hooks).
    fn has_layered_loads(&self) -> PyResult<bool> {
        let g = self.lock();
        Ok(g.worker.as_ref().ok_or_else(gone)?.has_layered_loads())
    }

    /// Before the engine reads `layer` (`None`: every layer) on `stream`: see
    /// `kvtier::connector::Worker::wait_for_layer`.
    #[pyo3(signature = (layer, stream = None))]
    fn wait_for_layer_load(
        &self,
        py: Python<'_>,
        layer: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let layer: Option<usize> = extract_opt_arg(Family::Connector, "layer", layer)?;
        let stream: Option<u64> = extract_opt_arg(Family::Connector, "stream", stream)?;
        py.detach(|| {
            let mut g = self.lock();
            g.worker
                .as_mut()
                .ok_or_else(gone)?
                .wait_for_layer(layer, stream);
            Ok(())
        })
    }

    #[pyo3(signature = (stream = None))]
    fn forward_done(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream: Option<u64> = extract_opt_arg(Family::Connector, "stream", stream)?;
        let mut g = self.lock();
        g.worker.as_mut().ok_or_else(gone)?.forward_done(stream);
        Ok(())
    }

    #[pyo3(signature = (finished, started_loading = None))]
    fn get_finished(
        &self,
        finished: &Bound<'_, PyAny>,
        started_loading: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<String>, Vec<String>, Vec<String>)> {
        let (finished, started_loading) = finished_args(finished, started_loading)?;
        let r = self.finished_report(finished, started_loading)?;
        Ok((ids(r.saved), ids(r.loaded), ids(r.load_failed)))
    }

    /// Report asynchronous loads only by the leader's verdicts (TensorRT-LLM, TP > 1;
    /// `Worker::set_load_verdicts`).
    fn enable_load_verdicts(&self) -> PyResult<()> {
        let mut g = self.lock();
        g.worker.as_mut().ok_or_else(gone)?.set_load_verdicts(true);
        Ok(())
    }

    /// Hand out only the blocks of failed loads inside the step (one KV cache group of several
    /// under vLLM; `Worker::set_sync_load_errors_only`).
    fn report_sync_load_errors_only(&self) -> PyResult<()> {
        let mut g = self.lock();
        g.worker
            .as_mut()
            .ok_or_else(gone)?
            .set_sync_load_errors_only(true);
        Ok(())
    }

    /// Apply the leader's verdicts (`Leader.take_load_verdicts` bytes; empty bytes: none).
    fn apply_load_verdicts(&self, blob: &[u8]) -> PyResult<()> {
        if blob.is_empty() {
            return Ok(());
        }
        let v = LoadVerdicts::from_bytes(blob).map_err(BridgeError::from)?;
        let mut g = self.lock();
        g.worker
            .as_mut()
            .ok_or_else(gone)?
            .apply_load_verdicts(&v.verdicts);
        Ok(())
    }

    /// `get_finished` with load verdicts on: `(saved, loaded, [(request, recompute_from)])`.
    /// `rewindable`: the requests whose engine object the adapter can rewind; given, a failed
    /// load of any other request is withheld (never reported) and every failed load is counted
    /// (`LoadRecovery::settle`, `load_recovery`). `None`: the verdicts' answer as it is.
    #[pyo3(signature = (finished, started_loading = None, rewindable = None))]
    fn get_finished_by_verdict(
        &self,
        finished: &Bound<'_, PyAny>,
        started_loading: Option<&Bound<'_, PyAny>>,
        rewindable: Option<std::collections::HashSet<String>>,
    ) -> PyResult<ByVerdict> {
        let (finished, started_loading) = finished_args(finished, started_loading)?;
        let mut r = self.finished_report(finished, started_loading)?;
        if let Some(can) = rewindable {
            self.lock()
                .recovery
                .settle(&mut r, self.rank, |q| can.contains(q.as_str()));
        }
        let recompute = r
            .recompute
            .into_iter()
            .map(|(q, t)| (q.to_string(), t))
            .collect();
        Ok((ids(r.saved), ids(r.loaded), recompute))
    }

    /// `(recomputed, unrecoverable)`: failed asynchronous loads handed back with a recompute
    /// token, and those withheld because their request could not be rewound.
    fn load_recovery(&self) -> (u64, u64) {
        let r = self.lock().recovery;
        (r.recomputed, r.unrecoverable)
    }

    fn take_load_errors(&self) -> PyResult<Vec<u32>> {
        let mut g = self.lock();
        Ok(g.worker
            .as_mut()
            .ok_or_else(gone)?
            .take_load_errors()
            .into_iter()
            .map(|b| b.0)
            .collect())
    }

    fn take_reports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let reports = {
            let g = self.lock();
            match &g.buffer {
                Some(b) => std::mem::take(&mut *b.0.lock().unwrap_or_else(|p| p.into_inner())),
                None => Vec::new(),
            }
        };
        if reports.is_empty() {
            return Ok(PyBytes::new(py, b""));
        }
        Ok(PyBytes::new(py, &encode_reports(&reports)?))
    }

    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let mut g = self.lock();
            g.worker.as_mut().ok_or_else(gone)?.wait_idle();
            Ok(())
        })
    }

    /// Wait for the jobs of these requests only (vLLM's handle_preemptions: their device blocks
    /// are about to be reused); other requests' copies keep running.
    fn wait_for_requests(&self, py: Python<'_>, request_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_ids: Vec<String> = extract_seq(Family::Connector, "request_ids", request_ids)?;
        let reqs: Vec<RequestId> = request_ids.into_iter().map(RequestId::from).collect();
        py.detach(|| {
            let mut g = self.lock();
            g.worker.as_mut().ok_or_else(gone)?.wait_for_requests(&reqs);
            Ok(())
        })
    }

    /// Wait for every request's jobs: the adapter lost a step's fence (an adapter error) and the
    /// engine may reuse any device block a copy still reads or writes.
    fn wait_for_all_requests(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let mut g = self.lock();
            g.worker.as_mut().ok_or_else(gone)?.wait_for_all_requests();
            Ok(())
        })
    }

    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let jobs = self
            .lock()
            .worker
            .as_ref()
            .map_or(0, |w| w.jobs_in_flight());
        let d = PyDict::new(py);
        d.set_item("rank", self.rank)?;
        d.set_item("jobs_in_flight", jobs)?;
        d.set_item("bytes_per_block", self.bytes_per_block)?;
        d.set_item("num_device_blocks", self.num_device_blocks)?;
        d.set_item("host_blocks", self.host_blocks)?;
        d.set_item("disk_blocks", self.disk_blocks)?;
        Ok(d.unbind())
    }

    /// Waits for in-flight jobs and stops the executor threads, `timeout` seconds at most in
    /// all; returns False when time ran out (the threads still running end on their own).
    #[pyo3(signature = (timeout = 60.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = timeout_arg(Family::Connector, "timeout", timeout)?;
        let mut g = self.lock();
        Ok(shut(py, &mut g, timeout))
    }
}
