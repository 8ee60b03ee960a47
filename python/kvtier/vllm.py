"""kvtier as a vLLM KV connector (``KVConnectorBase_V1``, checked against vLLM 0.32.0).

Configure vLLM with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host.gb": 4, "disk.gb": 100, "disk.dir": "/nvme/kvtier"}}'

``kv_connector_extra_config`` takes kvtier's configuration keys (docs/CONFIG.md, nested or dotted); ``async_loads``
(kvtier's ``connector.async_loads``, default true here) may also be given at its top. With asynchronous loads a
matched request waits in ``WAITING_FOR_REMOTE_KVS`` while kvtier loads it, except a hit held wholly by the host tier
(``connector.sync_host_loads``, default true here), which loads in the step that first computes it, as every hit does
with ``false``; with ``"ordered_sync_loads"`` (default true here; GPU only) such a load is ordered ahead of the
forward pass on the GPU (vLLM's stream waits on kvtier's copies) instead of on the CPU. The leader decides per request.
Settings not given there come from ``KVTIER_*`` environment variables (then the ``DYN_KVBM_*`` aliases). Roles: ``kv_both``
(aggregated), ``kv_producer`` (prefill) and ``kv_consumer`` (decode); with ``remote.url`` set (``dir:///shared`` or
``redis://...``) every full block goes through to the shared tier and every process matches from it, which is how
a producer hands its KV to a consumer.

This module is an adapter: it translates vLLM's objects into kvtier's engine-neutral step contract and back. It
holds no cache logic; matching, pools, offload policy and transfers live in kvtier's Rust core (docs/arch/vllm.md).

Invariants:
- matching (``get_num_new_matched_tokens``) has no side effects on kvtier's tiers: vLLM calls it repeatedly; only
  ``update_state_after_alloc`` commits a load;
- a load that kvtier could not complete is never reported as loaded: its device block ids go to
  ``get_block_ids_with_load_errors`` (an async load's request also to finished-receiving), so vLLM recomputes them
  (policy ``recompute``, which the connector sets if it was left at vLLM's default ``fail``); kvtier's leader drops
  the failed blocks from matching;
- a request matched again after its allocation but before it ever ran (vLLM freed it after its async load failed at
  the first block) loses its device table in kvtier and is offered no external tokens again: it is recomputed, so
  it can never cycle load -> fail -> match in vLLM's queue of block-holding requests (which vLLM drains before any
  other waiting request);
- nothing raised inside kvtier escapes into vLLM: every failure becomes a logged error, a cache miss or a failed
  load, and is counted (``adapter_errors``);
- each device block id enters kvtier's block table once per request and KV cache group: new requests bring their
  table, cached requests append ``new_block_ids``, resumed requests replace it (a sliding-window group's ids the
  window left are forgotten by its leader, and vLLM's null block is a hole);
- with vLLM's hybrid KV cache manager every group has its own leader and workers, keys and share of the tiers, and a
  hit is offered only when every group supplies its part (``kvtier._native.match_groups``);
- vLLM hears of a finished request in ``finished_sending`` only if ``request_finished`` kept its blocks.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

from . import _native
from ._vllm_meta import KvtierConnectorMetadata, KvtierConnectorStats, KvtierWorkerMetadata
from ._vllm_util import (_COUNTERS, _NULL_BLOCK, _PER_REQUEST_COUNTERS, _backend, _embeds_digest, _group_ids,
                         _group_settings, _identity, _kv_groups, _record, _require_async_loads_with_groups,
                         _required_layout, _resolved_layout, _trace, _trace_dump, _vllm_events)
from ._vllm_util import _first_group, _publishes_kv_events, _recompute_failed_loads  # noqa: F401  (tests reach them)
from ._vllm_worker import _WorkerSide, peer

logger = logging.getLogger("kvtier.vllm")

_ROLES = {"kv_both": "both", "kv_producer": "producer", "kv_consumer": "consumer"}

# Seconds between two reads of the leader's counters for vLLM's stats (vLLM logs them every few seconds).
_STATS_EVERY = 0.25

# Live connectors of this process, for process_stats() (tests, benchmarks).
_LIVE: "weakref.WeakSet[KvtierConnector]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def process_stats() -> dict[str, float]:
    """kvtier's cumulative counters, summed over the connectors alive in this process (scheduler and worker)."""
    total: dict[str, float] = {}
    with _LIVE_LOCK:
        conns = list(_LIVE)
    for c in conns:
        for k, v in c.cumulative_stats().items():
            total[k] = total.get(k, 0) + v
    return total


def _runs_layer_hooks(forward_context: Any) -> bool:
    """Whether vLLM runs its per-layer hooks (``wait_for_layer_load``) in this step: not in a step replayed as one
    full CUDA graph, which skips them ("cannot be captured in CUDA graphs and will be skipped during replay",
    ``requires_piecewise_for_cudagraph`` in vllm/distributed/kv_transfer/kv_connector/v1/base.py); eager and
    piecewise steps run attention, and its hooks, outside the graphs. The mode is the forward context's
    ``cudagraph_runtime_mode`` (set before ``start_load_kv``: vllm/v1/worker/gpu_model_runner.py)."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) in ("NONE", "PIECEWISE")


def _settings(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> dict[str, Any]:
    """kvtier's settings for this engine: ``kv_connector_extra_config`` (kvtier configuration keys, nested or
    dotted, e.g. ``{"host.num_blocks": 4096, "disk.dir": "/nvme/kvtier"}``) plus what vLLM itself fixes: block
    size, load mode, hash salt, bytes per block. Whatever is unset comes from ``KVTIER_*`` (or ``DYN_KVBM_*``)
    variables, resolved by kvtier's configuration (docs/CONFIG.md)."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    role = str(getattr(ktc, "kv_role", "kv_both"))
    if role not in _ROLES:
        raise ValueError(f"kvtier: kv_role must be one of {sorted(_ROLES)}, got {role!r}")
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    # kv_consumer stores nothing, kv_producer and kv_both store everything (kvtier's ServingRole::from_vllm).
    extra["role"] = role
    extra["block_size"] = int(cache.block_size)
    # Asynchronous loads unless configured otherwise (kvtier's `connector.async_loads`: TOML, KVTIER_ASYNC_LOADS,
    # or "async_loads" here): vLLM parks the request in WAITING_FOR_REMOTE_KVS while kvtier loads it, and
    # recomputes whatever failed to load (docs/arch/vllm.md).
    if extra.get("async_loads") is None:
        extra.pop("async_loads", None)
    extra["async_loads_default"] = True
    # A hit held wholly by the host tier loads inside the step, ordered ahead of the forward pass on the GPU
    # (kvtier's `connector.sync_host_loads`, Leader::set_sync_host_loads; issue 27: an asynchronous load costs vLLM
    # extra scheduler steps). Disk and remote hits stay asynchronous.
    extra["sync_host_loads_default"] = True
    # A hit that starts in the host tier and ends with at most this many blocks only on disk (or a remote store)
    # offers just its host part, loaded in the step, and vLLM recomputes the few others in that same step, instead
    # of the whole hit waiting for an asynchronous load (Leader::set_recompute_tail; issue 27: on the H200 an
    # asynchronous load cost 15.7 ms at 8K, recomputing 8 blocks of 16 tokens at the end of a long prompt a few).
    extra["recompute_tail_blocks_default"] = 8
    extra.setdefault("ordered_sync_loads", True)
    # ... and layer by layer where vLLM calls its per-layer hooks (eager and piecewise CUDA-graph steps): the forward
    # pass of layer l runs while layer l + 1 is copied (Worker::set_layered_sync_loads; issue 27).
    extra.setdefault("layered_sync_loads", True)
    # Sync loads may start as the scheduler builds the step where the worker runs in the scheduler's own thread
    # (vLLM's uniproc executor; `"early_sync_loads": true`). Opt-in: on the H100 it gained 1-2.5 ms on vLLM 0.33 but
    # cost 6-16 ms at 2K/8K on vLLM 0.32 (docs/bench/vllm.md, 2026-12-06).
    extra.setdefault("early_sync_loads", False)
    # The salt separates caches of different models and KV dtypes sharing a tier (disk, remote): every process
    # of one model (producer and consumer alike) must compute the same hashes.
    # Every vLLM release's tensors, detected by kvtier (4-D views in any KVCacheLayout, 5-D, MLA); never the
    # TensorRT-LLM pool, even for a one-layer model.
    extra.setdefault("layout", "vllm")
    # The layout kvtier asks vLLM for is the adapter's (get_required_kvcache_layout), not a kvtier setting.
    extra.pop("kv_cache_layout", None)
    # The resolved KVCacheLayout (vllm/v1/attention/backends/utils.py resolve_kv_cache_layout, recorded before the
    # scheduler is built) fixes the order of a block's bytes in kvtier's tiers: engines of different layouts
    # must never share blocks, so it is part of the salt.
    layout = _resolved_layout(vllm_config, kv_cache_config)
    extra.setdefault("salt", f"vllm|{model.model}|{cache.cache_dtype}|{model.dtype}|{model.revision or ''}"
                             + (f"|{layout}" if layout else ""))
    par = vllm_config.parallel_config
    extra.setdefault("world_size", int(par.tensor_parallel_size) * int(par.pipeline_parallel_size))
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        group = kv_cache_config.kv_cache_groups[0]
        per_rank = int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        extra.setdefault("bytes_per_block", per_rank * int(extra["world_size"]))
        extra.setdefault("num_device_blocks", int(kv_cache_config.num_blocks))
    return extra


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's vLLM connector: the scheduler half (role SCHEDULER) or the worker half (role WORKER). It supports
    vLLM's hybrid KV cache manager (``SupportsHMA``): one kvtier leader per KV cache group (full attention, sliding
    window), each group storing and loading what its attention reads."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Refused at start, naming the layer kind and the setting: a layer kind kvtier would not reproduce exactly
        # (issue 25: a sliding-window model served as if it were full attention generated other tokens).
        groups = _kv_groups(kv_cache_config, vllm_config.cache_config.block_size) if kv_cache_config else []
        if any(g["window"] for g in groups) and getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
            # A block a window left is fenced only in handle_preemptions, which the V2 model runner calls after it
            # zeroes the step's new blocks: a store could read a zeroed block (vllm/v1/kv_cache_interface.py
            # KVCacheConfig.needs_kv_cache_zeroing: Mamba layers or a mixed-precision KV cache).
            raise ValueError("kvtier: this model's sliding-window layers share a KV cache that vLLM zeroes on "
                             "allocation (a mixed-precision KV cache); kvtier does not serve sliding-window groups "
                             "then. Start vLLM with --disable-hybrid-kv-cache-manager or one kv_cache_dtype")
        if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
            # vLLM 0.33 asks supports_sleep_mode first; 0.32 has no such check, so refuse here too.
            raise ValueError("kvtier: sleep mode is not supported (a weight update while asleep would leave kvtier's "
                             "tiers holding KV of the old weights); start vLLM without enable_sleep_mode")
        _init_logging()
        self._settings = _settings(vllm_config, kv_cache_config)
        group_settings = _group_settings(self._settings, groups)
        self._block_size = int(vllm_config.cache_config.block_size)
        # Both halves of one engine in one process find each other by it (early sync loads).
        self._engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(vllm_config)
            # With several groups a finished request's blocks are held until its stores are done: a block one group
            # gives back may be handed out in another group, which that group's fences would not see.
            fence = _fence_reuse(kv_cache_config) and len(group_settings) == 1
            self._sched = _SchedulerSide(group_settings, self._block_size, fence, _publishes_kv_events(vllm_config),
                                         self._engine_id)
        else:
            rank = _rank()
            for s in group_settings:
                s.setdefault("rank", rank)
            self._settings.setdefault("rank", rank)
            self._worker = _WorkerSide(group_settings, self._block_size, [g["layers"] for g in groups])
            self._worker.zeroes_new_blocks = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is a future cache miss, never wrong output: preempted requests finish normally.
        return False

    def cumulative_stats(self) -> dict[str, float]:
        side = self._sched or self._worker
        return side.cumulative_stats() if side is not None else {}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)
        self._worker.register_peer(self._engine_id)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this before the step writes any device block: before the V1 runner's _update_states and the
        # forward pass; the V2 runner's pre_forward runs after its block zeroing, which kvtier rules out by keeping
        # delayed frees when the KV cache needs zeroing (_SchedulerSide).
        assert self._worker is not None
        meta = kv_connector_metadata
        if isinstance(meta, KvtierConnectorMetadata) and not self._worker.started_early(meta):
            self._worker.preempt(meta)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata):
            return
        if self._worker.started_early(meta):
            self._worker.finish_early(_runs_layer_hooks(forward_context))
        else:
            self._worker.start_step(meta, _runs_layer_hooks(forward_context))

    def has_connector_metadata(self) -> bool:
        # vLLM asks this only to guard its per-layer hooks (`maybe_transfer_kv_layer` around every attention layer,
        # vllm/model_executor/layers/attention/kv_transfer_utils.py). kvtier needs them only in a step with layered
        # loads; saying "nothing bound" otherwise skips two calls per layer per step. kvtier's own hooks read the
        # bound metadata directly.
        return self._worker is not None and self._worker.layered_step

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layered sync loads: the engine's stream waits for this layer's copies. Otherwise sync loads are ordered
        # (or complete) when start_load_kv returns, and async ones are never read before get_finished.
        if self._worker is not None and self._worker.layered_step:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        # Stores are issued once per step in wait_for_save, after the whole forward pass wrote the blocks.
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if isinstance(self._connector_metadata, KvtierConnectorMetadata):
            self._worker.forward_done()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        assert self._worker is not None  # several KV cache groups: failed loads by request (failed_recving)
        return self._worker.transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        return self._worker.take_reports()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both halves each step and aggregates: the scheduler half reports the leader's counters.
        side = self._worker or self._sched
        if side is None:
            return None
        delta = side.take_stats_delta()
        return KvtierConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        for side in (self._worker, self._sched):
            if side is not None:
                side.shutdown()
        _trace_dump()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        n = self._sched.lookup(request, num_computed_tokens)
        return n, n > 0 and self._sched.load_is_async(request.request_id)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.on_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._sched is not None
        self._sched.update_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this instead of request_finished for a SupportsHMA connector (scheduler.py `_connector_finished`).
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        assert self._sched is not None
        return self._sched.take_events()

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        """The tiers that supply this request's external tokens (vLLM's per-source hit metrics): host memory
        is HOST, the disk tier DISK, the shared remote tier EXTERNAL_UNSPECIFIED (vLLM has no member for it)."""
        assert self._sched is not None
        return self._sched.hit_sources(request.request_id, int(num_external_tokens))

    def reset_cache(self) -> bool | None:
        """vLLM's prefix-cache reset (``LLM.reset_prefix_cache``): kvtier forgets its host and disk blocks too,
        so nothing computed before the reset is served after it (the shared remote tier is other engines' too
        and is left alone)."""
        if self._sched is None:
            return None
        return self._sched.reset()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        try:
            from vllm.platforms import current_platform

            on_cuda = bool(current_platform.is_cuda())
        except Exception:
            on_cuda = False
        return _required_layout(extra, on_cuda)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # See __init__: kvtier's tiers would outlive a weight update made while asleep.
        return False

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM stepping while kvtier has jobs in flight, e.g. a producer's copies to the shared tier that
        # are dispatched with the step metadata after its last request finished.
        return self._sched is not None and self._sched.has_jobs_in_flight()



def _rank() -> int:
    """This worker's rank among the engine's tensor- and pipeline-parallel workers."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank, get_tp_group

        return int(get_pp_group().rank_in_group) * int(get_tp_group().world_size) + int(get_tensor_model_parallel_rank())
    except Exception:  # no parallel state (single process)
        return 0


_LOGGING_DONE = False


def _init_logging() -> None:
    """Route kvtier's Rust logs (``tracing``) to stderr once per process (``KVTIER_LOG`` filters them)."""
    global _LOGGING_DONE
    if _LOGGING_DONE:
        return
    _LOGGING_DONE = True
    try:
        import kvtier

        kvtier.init_logging()
    except Exception:  # an engine without kvtier's logs still runs
        pass


def _fence_reuse(kv_cache_config: "KVCacheConfig | None") -> bool:
    """Whether a finished request's device blocks go back to vLLM at once while kvtier's stores still read them,
    fenced (the workers wait for those stores in ``handle_preemptions`` of the step that reuses one), instead of
    being held until the stores are done. vLLM admits a request only when its whole prompt fits in the free blocks
    (``scheduler_reserve_full_isl``, default since 0.32): holding them delays the next long prompt by the copy.
    Not when vLLM zeroes newly allocated blocks (Mamba layers or a mixed-precision KV cache,
    ``KVCacheConfig.needs_kv_cache_zeroing``): the V2 model runner zeroes them before ``handle_preemptions``."""
    return not bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))


class _SchedulerSide:
    """Translation of the scheduler's calls into kvtier's leader. Keeps only what vLLM does not hand back later:
    the live Request objects (their token lists grow in place), how many of each request's tokens kvtier has
    seen, and which requests it has matched. Preemptions, refused loads, whole-block matches and hit sources are
    the leader's rules (docs/arch/vllm.md)."""

    def __init__(self, settings: "dict[str, Any] | list[dict[str, Any]]", block_size: int, fence_reuse: bool = True,
                 publish_events: bool = True, engine_id: str | None = None) -> None:
        group_settings = settings if isinstance(settings, list) else [settings]
        backend = _backend(group_settings[0])
        # One leader per KV cache group (vLLM's hybrid KV cache manager), in vLLM's group order; group 0's answers
        # (load mode, hit sources) stand for all: kvtier's match_groups makes every group record the same match.
        self._leaders = [backend.Leader(s) for s in group_settings]
        self._leader = self._leaders[0]
        self._windows = [int(s.get("sliding_window") or 0) for s in group_settings]
        self._match_groups = getattr(backend, "match_groups", None) if len(self._leaders) > 1 else None
        self._block_size = block_size
        self._fence_reuse = fence_reuse
        # Without a publisher the leader's events are drained unbuilt (a backend without discard_events builds them).
        self._discard_events = None if publish_events else getattr(self._leader, "discard_events", None)
        # Resolved by kvtier's configuration (engine setting > environment > TOML > this adapter's default).
        self.async_loads = bool(getattr(self._leader, "loads_are_async", False))
        _require_async_loads_with_groups(len(self._leaders), self.async_loads)
        self._requests: dict[str, "Request"] = {}
        self._tokens_sent: dict[str, int] = {}
        # A request matched again after it ran was preempted, one matched again after its allocation but before it
        # ran was restarted after a failed load: both are the leader's to recognise (it counts them).
        self._matched: set[str] = set()
        # vLLM expects exactly one finished_recving for each request it let load asynchronously (the scheduler
        # asserts the request is still known: vllm/v1/core/sched/scheduler.py `_update_from_kv_xfer_finished`);
        # which it is owed, and what the next metadata carries to the workers (failed loads, delayed frees, the
        # groups each request waits for): the Rust books (kvtier::connector::Promises).
        self._books = _native.Promises()
        # An adapter error lost track of blocks that stores still read: the next metadata fences every job.
        self._fence_all = False
        self._last_stats: dict[str, float] = {}
        self._stats_at = float("-inf")
        self._errors = 0
        # Per request: its identity (built once: vLLM matches a request repeatedly).
        self._identities: dict[str, tuple[str | None, bool]] = {}
        self._uncacheable_logged: set[str] = set()
        # This engine's id (its worker side in this process, if any, starts steps' sync loads early) and the step
        # number each metadata carries.
        self._engine_id = engine_id
        self._step = 0

    def _error(self, what: str, e: BaseException) -> None:
        self._errors += 1
        logger.error("kvtier: %s failed: %s", what, e, exc_info=True)

    def _key(self, request: "Request") -> tuple[str | None, bool]:
        rid = request.request_id
        key = self._identities.get(rid)
        if key is None:
            identity, cacheable, reason = _identity(request, _embeds_digest)
            if not cacheable and reason not in self._uncacheable_logged:
                self._uncacheable_logged.add(reason)
                logger.warning("kvtier: requests with %s are not cached by kvtier (neither matched nor stored)", reason)
            key = (identity, cacheable)
            self._identities[rid] = key
        return key

    def hit_sources(self, rid: str, num_external_tokens: int) -> dict:
        if num_external_tokens <= 0:
            return {}
        try:
            split = self._books.take_hit_sources(rid)
            if split is None:
                split = self._leader.take_hit_sources(rid, int(num_external_tokens))
        except Exception as e:
            self._error("take_hit_sources", e)
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        members = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                   "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}
        out: dict = {}
        for tier, n in split:
            member = members[tier]
            out[member] = out.get(member, 0) + int(n)
        return out

    def reset(self) -> bool:
        try:
            n = sum(int(leader.clear_tiers()) for leader in self._leaders)
        except Exception as e:
            self._error("clear_tiers", e)
            return False
        logger.info("kvtier: prefix cache reset: %d blocks forgotten in kvtier's tiers", n)
        return True

    def lookup(self, request: "Request", num_computed_tokens: int) -> int:
        rid = request.request_id
        self._matched.add(rid)
        try:
            identity, cacheable = self._key(request)
            kw: dict[str, Any] = {}
            if identity is not None or not cacheable:
                kw.update(identity=identity, cacheable=cacheable)
            # Prompt logprobs, pooling or the user's wish: the request computes its whole prompt, as vLLM's own
            # OffloadingConnector does (offloading/scheduler.py `get_num_new_matched_tokens`); it is still stored.
            if getattr(request, "skip_reading_prefix_cache", False):
                kw["read"] = False
            if self._match_groups is not None:
                # Every group must supply its part of a hit (kvtier::connector::groups::match_groups).
                n = int(self._match_groups(self._leaders, rid, list(request.all_token_ids), int(num_computed_tokens),
                                           **kw))
            else:
                n = int(self._leader.get_num_new_matched_tokens(rid, list(request.all_token_ids),
                                                                int(num_computed_tokens), **kw))
        except Exception as e:
            self._error("get_num_new_matched_tokens", e)
            return 0
        # Whole blocks within the prompt, at least one token left to compute: the leader's rule.
        _trace("match", rid, n)
        return n

    def on_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        group_ids = blocks.get_block_ids()
        # vLLM calls this again with 0 once an async load finished; kvtier recognises ids it already has.
        n = max(0, int(num_external_tokens))
        is_async = n > 0 and self.load_is_async(rid)
        if n > 0:
            _trace("alloc", rid, n)
        failed: list[int] = []
        loading: list[int] = []
        hit_sources = None
        complete = True
        for g, leader in enumerate(self._leaders):
            try:
                # A refused allocation names the promised blocks vLLM must recompute (the leader offers this
                # request no external tokens again: a refusal would repeat).
                f, refusal = leader.allocate(rid, _group_ids(group_ids, g), n)
                if n > 0 and len(self._leaders) > 1:
                    # Whether this group's leader planned a load; group 0's answer is kept for vLLM's metrics.
                    split = [(str(t), int(k)) for t, k in leader.take_hit_sources(rid, n)]
                    if g == 0:
                        hit_sources = split
                    if split:
                        loading.append(g)
            except Exception as e:
                self._error("update_state_after_alloc", e)
                if g == 0 or n == 0:
                    complete = False
                    break
                # Another group already planned its load: vLLM must recompute this group's promised blocks.
                f, refusal = [b for b in _group_ids(group_ids, g) if b != _NULL_BLOCK], None
            if refusal is not None:
                self._errors += 1
                logger.error("kvtier: update_state_after_alloc failed: %s", refusal)
            failed.extend(int(b) for b in f)
        try:
            self._books.allocated(rid, n, is_async, len(self._leaders), complete, loading, failed, hit_sources)
        except Exception as e:
            self._error("update_state_after_alloc", e)

    def load_is_async(self, rid: str) -> bool:
        """Whether the leader loads this request's last match asynchronously (per request: a host-tier hit loads
        in the step with sync_host_loads)."""
        try:
            return bool(self._leader.load_is_async(rid))
        except Exception as e:
            self._error("load_is_async", e)
            return self.async_loads

    def build_meta(self, so: "SchedulerOutput") -> KvtierConnectorMetadata:
        # Preemptions first: a request's device table is gone before any record of this step could rebuild it.
        preempted = sorted(so.preempted_req_ids or ())
        for rid in preempted:
            try:
                # Left alone by the leader if it was found preempted when matched again.
                for leader in self._leaders:
                    leader.request_preempted_if_running(rid)
            except Exception as e:
                self._error("request_preempted", e)
        # Per KV cache group: the same requests and tokens, each group's own block ids.
        records: list[list[tuple]] = [[] for _ in self._leaders]
        spec = so.scheduled_spec_decode_tokens or {}
        for r in so.scheduled_new_reqs:
            rid = r.req_id
            req = self._requests.get(rid)
            tokens = list(req.all_token_ids) if req is not None else list(r.prompt_token_ids or [])
            self._tokens_sent[rid] = len(tokens)
            for g, recs in enumerate(records):
                recs.append(_record(rid, tokens, _group_ids(r.block_ids, g), r.num_computed_tokens,
                                    so.num_scheduled_tokens.get(rid, 0), len(spec.get(rid, ())), True, False))
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            req = self._requests.get(rid)
            resumed = rid in c.resumed_req_ids
            new_tokens: list[int] = []
            if req is not None:
                all_tokens = req.all_token_ids
                sent = 0 if resumed else self._tokens_sent.get(rid, 0)
                new_tokens = list(all_tokens[sent:])
                self._tokens_sent[rid] = len(all_tokens)
            for g, recs in enumerate(records):
                recs.append(_record(rid, new_tokens, _group_ids(c.new_block_ids[i], g), c.num_computed_tokens[i],
                                    so.num_scheduled_tokens.get(rid, 0), len(spec.get(rid, ())), False, resumed))
        finished = sorted(so.finished_req_ids)
        for rid in finished:
            self._tokens_sent.pop(rid, None)
        plan = b""
        plans: list[bytes] = []
        fence: list[str] = []
        try:
            for g, leader in enumerate(self._leaders):
                raw, f = leader.build_step_with_fences(records[g], finished)
                plans.append(bytes(raw))
                fence.extend(r for r in f if r not in fence)
            plan = plans[0]
            built = True
        except Exception as e:
            built = False
            self._error("build_step", e)
            # This step may hand out blocks that stores still read, and its fence is lost with it.
            self._fence_all = True
        fence_all, self._fence_all = self._fence_all, False
        # The loads planned since the last step travel in a built plan (each of their requests now gets one
        # finished_recving from every worker, loaded or failed; a failed build keeps them queued), asynchronous
        # loads refused here are failed by the workers themselves.
        sync, delayed, failed, failed_async, recv_groups, delayed_groups = self._books.take_step(built)
        _trace("meta", "", [len(records[0]), len(plan)])
        self._step += 1
        meta = KvtierConnectorMetadata(plan=plan, sync_loads=sync, preempted=preempted, delayed_frees=delayed,
                                       failed_loads=failed, failed_loads_async=failed_async, fence=fence,
                                       fence_all=fence_all, group_plans=plans[1:], recv_groups=recv_groups,
                                       delayed_groups=delayed_groups, step=self._step)
        if sync and plan and len(plans) == 1:
            # The worker of this engine in this thread (vLLM's uniproc executor) starts the loads now, while vLLM
            # prepares the step's inputs; it refuses where that would not equal starting them in start_load_kv.
            worker = peer(self._engine_id)
            if worker is not None:
                try:
                    worker.start_early(meta)
                except Exception as e:
                    self._error("start_early", e)
        return meta

    def update_output(self, out: "KVConnectorOutput") -> None:
        # vLLM calls this just before it acts on the same output's finished sets.
        self._books.received(list(out.finished_recving or ()))
        meta = out.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMetadata):
            for i, blob in enumerate(meta.reports):
                g = meta.groups[i] if i < len(meta.groups) else 0
                try:
                    self._leaders[g].apply_reports(blob)
                except Exception as e:
                    self._error("apply_reports", e)

    def request_finished(self, request: "Request", block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        _trace("finished", rid)
        known = rid in self._requests or rid in self._matched
        self._requests.pop(rid, None)
        self._matched.discard(rid)
        self._identities.pop(rid, None)
        # A load promised but not yet sent is withdrawn (the books, and the leader below): no worker will report it.
        # vLLM still waits for this request's finished_recving (an asynchronous load was sent; the client went away
        # meanwhile): that report is the one that frees its blocks, once every worker's load of it has landed.
        # vLLM must keep the request until then and hear of it only there, never in finished_sending as well: it
        # frees a finished request on its first report and asserts on a second (scheduler.py 0.32 and 0.33).
        awaiting_recv = self._books.request_finished(rid)
        if not known:  # aborted before kvtier ever saw it: nothing of it is stored
            return awaiting_recv, None
        delaying: list[int] = []
        for g, leader in enumerate(self._leaders):
            try:
                # True while copies still use the request's device blocks: vLLM keeps them until the workers report
                # the request in finished_sending. With fenced reuse only in-flight loads keep them; blocks that
                # stores still read are freed now and fenced in the step that reuses them.
                if leader.request_finished(rid, fence_reuse=self._fence_reuse):
                    delaying.append(g)
            except Exception as e:
                self._error("request_finished", e)
                # vLLM frees the blocks now and the leader cannot fence them: the next step waits for every job.
                self._fence_all = True
        if self._fence_all and not delaying:
            return awaiting_recv, None
        delay = bool(delaying)
        if awaiting_recv:
            # The workers report it saved as well once its load lands (the leader declared it saving): they drop that
            # report, since only requests named in delayed_frees are reported in finished_sending.
            return True, None
        if delay:
            self._books.delay_free(rid, delaying, len(self._leaders) > 1)
        return delay, None

    def take_events(self) -> list:
        if self._discard_events is not None:
            for leader in self._leaders:
                try:
                    leader.discard_events()  # bounded in the leader either way; keeps it from counting them as dropped
                except Exception as e:
                    self._error("discard_events", e)
            return []
        raw: list = []
        for leader in self._leaders:
            try:
                raw.extend(leader.take_events())
            except Exception as e:
                self._error("take_events", e)
        return _vllm_events(raw, self._block_size)

    def has_jobs_in_flight(self) -> bool:
        try:
            return any(int(leader.stats().get("jobs_in_flight", 0)) > 0 for leader in self._leaders)
        except Exception as e:
            self._error("stats", e)
            return False

    def cumulative_stats(self) -> dict[str, float]:
        s: dict[str, float] = {}
        # Summed over the groups' leaders (each counts its own group's blocks and bytes).
        per_group: list[dict[str, float]] = []
        for leader in self._leaders:
            try:
                per_group.append(dict(leader.stats()))
            except Exception as e:
                self._error("stats", e)
                per_group.append({})
        for st in per_group:
            for k, v in st.items():
                s[k] = s.get(k, 0) + v
        if len(per_group) > 1:
            # Counters of requests and steps count once (every group saw the same ones): group 0's. Per group
            # (``g<index>.<key>``, not aggregated by vLLM): what it loaded, and its window (0: full attention).
            s.update({k: per_group[0].get(k, 0) for k in _PER_REQUEST_COUNTERS if k in s})
            for g, st in enumerate(per_group):
                s[f"g{g}.window"] = self._windows[g]
                s.update({f"g{g}.{k}": v for k, v in st.items() if k.startswith("onboard_")})
        s["adapter_errors"] = s.get("adapter_errors", 0) + self._errors
        return s

    def take_stats_delta(self) -> dict[str, float]:
        # vLLM asks every step and sums the deltas into its logging interval (seconds): reading the leader's whole
        # table at most every _STATS_EVERY keeps it off the decode step (the counts wait in the leader, none lost).
        t = time.monotonic()
        if t - self._stats_at < _STATS_EVERY:
            return {}
        self._stats_at = t
        now = {k: v for k, v in self.cumulative_stats().items() if k in _COUNTERS}
        delta = {k: v - self._last_stats.get(k, 0) for k, v in now.items() if v != self._last_stats.get(k, 0)}
        self._last_stats = now
        return delta

    def shutdown(self) -> None:
        for leader in self._leaders:
            try:
                leader.shutdown()
            except Exception as e:
                self._error("shutdown", e)
