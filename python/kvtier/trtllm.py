"""kvtier as a TensorRT-LLM KV cache connector (PyTorch backend, TensorRT-LLM 1.2.0rc2 to 1.4.x).

Use it the way the original's ``--connector kvbm`` flag does::

    from tensorrt_llm import LLM
    from kvtier.trtllm import build_llm_kwargs

    llm = LLM(model, **build_llm_kwargs("kvtier"))

or, for ``trtllm-serve``, write the YAML block that ``python -m kvtier.trtllm config --connector kvtier``
prints into the file passed as ``--extra_llm_api_options`` (``--role decode`` prints the decode
worker's block of a disaggregated deployment: no connector, see below).

Role of this module: translate TensorRT-LLM's objects (``LlmRequest``, ``SchedulerOutput`` /
``RequestData``, the pool tensor or V2 ``KvCacheLayout``, CUDA streams) into the engine-neutral
calls of ``kvtier._native.Leader`` / ``Worker`` and back. It keeps no cache state and no rules:
the recompute token of a failed load, which failed loads are rewound or withheld and their counts,
and what a ``-1`` page id means are the Rust leader's and worker's (docs/arch/trtllm.md, "Where the
books are"); this module finds TensorRT-LLM's request objects and sets the token on them. How the
executor drives a connector is in docs/arch/trtllm.md (from TensorRT-LLM's py_executor.py and
connectors/kv_cache_connector.py); every modelled
behaviour cites the TensorRT-LLM file it comes from.

Invariants kept here:

* engine start: the forward-pass callable and every worker hook are no-ops until
  ``register_kv_caches`` / ``register_kv_cache_layout`` (KV-cache estimation and warmup forwards
  call the callable first: ``py_executor_creator.py``, ``model_engine.py``);
* a load depends on a layer hook only where every forward runs the hooks (``loads_go_layer_by_layer``:
  no CUDA graph, no ``torch.compile``, the V1 pool); elsewhere ``start_load_kv`` returns once the
  step's sync loads are in device memory, so CUDA-graph replay, which skips the hooks, reads them;
* nothing raises inside an executor hook because of a failed load (``_handle_errors`` would fail
  every active request, and on TP > 1 the other ranks would hang in collectives); configurations
  whose failed loads cannot be recomputed are refused at construction instead (``_refusals``);
* every key carries the model identity (the engine salt, :func:`engine_salt`) and the request's
  cache salt, LoRA adapter and multimodal hashes (:func:`request_key`); a request kvtier cannot key
  is uncacheable, never served another request's KV;
* ``get_num_new_matched_tokens`` never returns ``(0, True)`` and returns ``(0, False)`` for
  generation-only requests (``is_generation_only_request`` is a property on the C++ ``LlmRequest``
  and a method on KVCacheManagerV2's Python one);
* request ids cross into Rust as ``str(request_id)`` and come back as ``int``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _native
from ._native import ConfigError, ConnectorError
from ._tensors import current_stream_handle, describe, stream_handle
from ._trtllm_engine import Engine
from . import _trtllm_groups as _groups
from . import _trtllm_layout as _layout
from ._trtllm_refusals import _get

__all__ = [
    "KvtierConnectorScheduler",
    "KvtierConnectorWorker",
    "build_kv_connector_config",
    "build_llm_kwargs",
    "connector_yaml",
    "engine_salt",
    "request_key",
    "CONNECTOR_NAMES",
    "MIN_TRTLLM_VERSION",
]

#: Where TensorRT-LLM keeps the connector base classes (newest first: moved in 1.3.0rc14).
_BASE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)

from ._trtllm_config import RANK_SETTINGS_ENV  # noqa: E402


def _load_bases() -> tuple[type, type, Optional[str]]:
    for name in _BASE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        return mod.KvCacheConnectorScheduler, mod.KvCacheConnectorWorker, name
    return object, object, None


_SchedulerBase, _WorkerBase, TRTLLM_BASE_MODULE = _load_bases()

logger = logging.getLogger("kvtier.trtllm")
_warned: set = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _trtllm_version() -> str:
    try:
        import tensorrt_llm

        return str(getattr(tensorrt_llm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


# --------------------------------------------------------------------------------------------
# Settings that reach every rank


def _import_rank_settings() -> None:
    """On a rank: apply ``TRTLLM_KVTIER_SETTINGS`` (variables set in this process win)."""
    blob = os.environ.get(RANK_SETTINGS_ENV)
    if not blob:
        return
    try:
        env = json.loads(blob)
    except ValueError as e:
        raise ConfigError(f"{RANK_SETTINGS_ENV} is not a JSON object: {e}") from None
    if not isinstance(env, dict):
        raise ConfigError(f"{RANK_SETTINGS_ENV} is not a JSON object")
    for k, v in env.items():
        if str(k).startswith(("KVTIER_", "DYN_KVBM_")):
            os.environ.setdefault(str(k), str(v))


# --------------------------------------------------------------------------------------------
# Reading llm_args


def _tokens_per_block(llm_args: Any) -> int:
    tpb = _get(llm_args, "kv_cache_config", "tokens_per_block")
    if tpb is None:
        raise ConfigError("llm_args.kv_cache_config.tokens_per_block is missing")
    return int(tpb)


def _mapping(llm_args: Any) -> Any:
    to_mapping = _get(llm_args, "parallel_config", "to_mapping")
    return to_mapping() if callable(to_mapping) else None


def _world_size(llm_args: Any) -> int:
    m = _mapping(llm_args)
    return int(getattr(m, "world_size", 1) or 1) if m is not None else 1


def _rank(llm_args: Any) -> int:
    """This process's rank: MPI's when TensorRT-LLM is present, else the mapping's (tests), else 0."""
    if TRTLLM_BASE_MODULE is not None:
        try:
            from tensorrt_llm._utils import mpi_rank

            return int(mpi_rank())
        except ImportError:
            pass
    m = _mapping(llm_args)
    return int(getattr(m, "rank", 0) or 0) if m is not None else 0


def _name(v: Any) -> str:
    return str(getattr(v, "name", v))


def engine_salt(llm_args: Any) -> str:
    """The model identity every kvtier key of this engine is hashed with: everything that makes
    two engines' KV bytes of one token prefix differ (model and revision, dtypes, quantisation,
    tokens per block, tensor-parallel sharding, the KV cache manager's layout). Two engines share
    blocks (e.g. through one ``remote.url``) only if these are equal."""
    kv = getattr(llm_args, "kv_cache_config", None)
    quant = getattr(llm_args, "quant_config", None)
    v2 = getattr(llm_args, "use_kv_cache_manager_v2", None)
    if v2 is None:
        v2 = getattr(kv, "use_kv_cache_manager_v2", False)
    parts = [
        "trtllm",
        f"model={_get(llm_args, 'model', default='')}",
        f"revision={_get(llm_args, 'revision', default='')}",
        f"dtype={_name(_get(llm_args, 'dtype', default='auto'))}",
        f"kv_dtype={_name(_get(kv, 'dtype', default='auto'))}",
        f"quant={_name(_get(quant, 'quant_algo', default=''))}",
        f"kv_quant={_name(_get(quant, 'kv_cache_quant_algo', default=''))}",
        f"tokens_per_block={_tokens_per_block(llm_args)}",
        f"tp={_world_size(llm_args)}",
        f"kv_manager_v2={v2}",
    ]
    windows = _groups.engine_windows(llm_args)
    if windows is not None:
        # A layer's KV depends on every earlier layer's window, so the windows are model identity.
        parts.append(f"windows={windows}")
    return "\x1f".join(parts)


def request_key(request: Any) -> tuple[Optional[str], bool, str]:
    """``(identity, cacheable, reason)`` of one ``LlmRequest``: the tenant cache salt
    (``cache_salt`` in 1.4, ``cache_salt_id`` in 1.3: ``RequestData`` in
    ``connectors/kv_cache_connector.py`` says connectors MUST mix it into their keys) and the
    multimodal hashes with their positions. LoRA requests and prompt-embedding tables cannot be
    keyed from what the request carries (a task id is not an adapter identity across engines):
    uncacheable. A multimodal request without hashes: uncacheable."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt is not None and str(salt) != "":
        parts.append(f"salt={salt}")
    salt_id = getattr(request, "cache_salt_id", None)
    if salt_id is not None:
        parts.append(f"salt_id={int(salt_id)}")
    if getattr(request, "lora_task_id", None) is not None:
        return None, False, "LoRA adapter requests (lora_task_id) are not cached by kvtier"
    if getattr(request, "prompt_embedding_table", None) is not None:
        return None, False, "requests with a prompt embedding table are not cached by kvtier"
    positions = getattr(request, "multimodal_positions", None)
    if positions:
        hashes = getattr(request, "multimodal_hashes", None)
        if not hashes or len(hashes) != len(positions):
            return None, False, "multimodal requests without multimodal_hashes are not cached by kvtier"
        lengths = getattr(request, "multimodal_lengths", None) or [0] * len(positions)
        mm = ",".join(
            f"{'-'.join(str(int(x)) for x in (h if isinstance(h, (list, tuple)) else [h]))}@{int(p)}+{int(n)}"
            for h, p, n in zip(hashes, positions, lengths)
        )
        parts.append(f"mm={mm}")
    return ("\x1f".join(parts) if parts else None), True, ""


def _is_generation_only(request: Any) -> bool:
    """``is_generation_only_request``: a property on the C++ ``LlmRequest``, a method on V2's
    Python ``LlmRequest`` (``pyexecutor/llm_request.py``); a bound method is truthy."""
    v = getattr(request, "is_generation_only_request", False)
    return bool(v() if callable(v) else v)


from ._trtllm_refusals import _check, _refusals  # noqa: E402,F401  (engine-start refusals)


# Engine-wide state shared by rank 0's scheduler and worker (one process, one channel).
_Engine = Engine


def _channel() -> str:
    return f"trtllm-{os.getpid()}"


#: Whether ranks live in separate processes (None: TensorRT-LLM present and world_size > 1). Tests
#: running ranks as processes without TensorRT-LLM set it to True.
RANKS_IN_PROCESSES: Optional[bool] = None


def _ranks_in_processes(llm_args: Any) -> bool:
    if RANKS_IN_PROCESSES is not None:
        return RANKS_IN_PROCESSES
    return TRTLLM_BASE_MODULE is not None and _world_size(llm_args) > 1


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``tensorrt_llm._utils.mpi_broadcast``; tests replace it)."""
    from tensorrt_llm._utils import mpi_broadcast

    return mpi_broadcast(obj, root=0)


def _free_endpoints(n: int) -> list[str]:
    """``n`` distinct free local ports (each held until all are chosen, so no two are the same)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in held]
    finally:
        for s in held:
            s.close()


def _configured_endpoint() -> Optional[str]:
    return os.environ.get("KVTIER_ZMQ_ENDPOINT") or None


def _settings(llm_args: Any, **extra: Any) -> dict[str, Any]:
    """The engine-supplied settings (the rest comes from KVTIER_* / DYN_KVBM_* / KVTIER_CONFIG)."""
    s: dict[str, Any] = {
        "block_size": _tokens_per_block(llm_args),
        "world_size": _world_size(llm_args),
        # Async loads (a failed one is recomputed) unless configured; host hits in the step where
        "async_loads_default": True,  # they go layer by layer (eager engines)
        "sync_host_loads_default": loads_go_layer_by_layer(llm_args),
        "channel": _channel(),
        "salt": engine_salt(llm_args),
    }
    s.update(extra)
    return s


# --------------------------------------------------------------------------------------------
# Scheduler (leader), MPI rank 0 only


class KvtierConnectorScheduler(_SchedulerBase):  # type: ignore[misc, valid-type]
    """TensorRT-LLM ``KvCacheConnectorScheduler`` backed by ``kvtier._native.Leader``."""

    def __init__(self, llm_args: Any):
        if _SchedulerBase is not object:
            super().__init__(llm_args)
        _import_rank_settings()
        self._llm_args = llm_args
        self._tpb = _tokens_per_block(llm_args)
        settings = _settings(llm_args)
        _check(llm_args, settings)
        self._engine = _Engine.of(_channel())
        windows = _groups.engine_windows(llm_args)
        if windows is not None and len(windows) > 1 and _configured_endpoint():
            raise ConfigError("KVTIER_ZMQ_ENDPOINT names one endpoint; this model has one layer group per "
                              f"attention window {windows}: leave it unset")
        endpoints = None
        if _ranks_in_processes(llm_args) or _configured_endpoint():
            # Two engines on one host never share a port: a free one per layer group's leader unless
            # configured; rank 0's worker broadcasts them to the other ranks at registration.
            configured = _configured_endpoint()
            endpoints = [configured] if configured else _free_endpoints(len(windows or [None]))
            settings.update(link="zmq", zmq_endpoint=endpoints[0])
            self._engine.endpoints = endpoints
        # Sliding windows (KVCacheManagerV2, the host tier; _refusals): one leader per window.
        self._groups = None
        if windows is not None:
            self._groups = _groups.SchedulerGroups(_groups.group_settings(settings, windows, endpoints),
                                                   self._engine)
            self._leader = self._groups.leaders[0]
        else:
            self._leader = _native.Leader(settings)
        for leader in self.leaders:
            # Every rank reports an async load only by the leader's verdict (its recompute token if failed);
            leader.enable_load_verdicts()
            leader.load_remote_hits_async()  # and a failed sync load has none: node hits load async too
            # Page ids may carry -1 (V2 padding, a window kvtier was not told of): the leader
            # trims, takes as holes (window groups) or stops caching the request.
            leader.enable_unpaged_exclusion()
            # KVCacheManagerV2 matches and allocates apart (kv_cache_manager_v2.py; cancel_load exists for
            # it): the host and disk blocks a match offers are held until the allocation, so the stores
            # planned in between cannot evict them and fail a load the match promised. With windows the holds
            # never time out: a failed load in any group rewinds the request, which a window group cannot recompute.
            leader.enable_match_holds(expire=windows is None)
        self._engine.leader = self._leader
        self._engine.leaders = self.leaders
        self._engine.endpoint_set.set()

    @property
    def leader(self) -> Any:
        """The native leader (for metrics and tests; with several layer groups, the first's)."""
        return self._leader

    @property
    def leaders(self) -> list:
        """The native leaders, one per layer group in kvtier's order (full attention, then windows
        ascending)."""
        return list(self._groups.leaders) if self._groups is not None else [self._leader]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if _is_generation_only(request):
            # Its KV arrives through the cache transceiver; loading it too would race.
            return 0, False
        identity, cacheable, why = request_key(request)
        if not cacheable:
            _warn_once(why, "kvtier: %s", why)
        rid = str(request.request_id)
        if self._groups is not None:
            # A hit only where every layer group supplies its part (its window of the hit's end).
            n = self._groups.match(rid, request.get_tokens(0), int(num_computed_tokens), identity, cacheable)
        else:
            n = int(
                self._leader.get_num_new_matched_tokens(
                    rid, request.get_tokens(0), int(num_computed_tokens), identity=identity, cacheable=cacheable
                )
            )
        # Per request, as the leader decided at the match (asynchronous unless `connector.sync_host_loads` loads a
        # host-tier hit in the step): TensorRT-LLM takes the flag per request (kv_cache_connector.py
        # `get_num_new_matched_tokens -> (num_tokens, load_kv_async)`).
        return n, n > 0 and bool(self._leader.load_is_async(rid))

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """KVCacheManagerV2: the engine will not consume tokens ``[start, end)`` of the offer
        (``kv_cache_manager_v2.py``; matching and allocation can be iterations apart). kvtier then
        loads nothing for the request (the engine recomputes), which is always correct for a tail
        cut; a head cut leaves a suffix the engine counts as loaded, so the request is matched again
        from ``end`` at allocation (the leader's rule: ``Leader.allocate_offer``)."""
        for leader in self.leaders:
            leader.cancel_load(str(request.request_id), int(start), int(end))

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        if self._groups is not None:
            # One sliding-window group: the flat list carries -1 for blocks the window passed.
            self.update_state_after_alloc_by_layer_group(request, [block_ids])
            return
        rid = str(request.request_id)
        # The raw page ids, -1 included (V2 pads the first chunk's pages with -1; a -1 before valid
        # pages stops the request being cached): the leader's rule (Leader.allocate_offer). The last
        # offer less the engine's cut; an asynchronous load parks the request.
        start = self._leader.allocate_offer(rid, [int(b) for b in block_ids])
        if start is not None:
            with self._engine.lock:
                self._engine.loads[rid] = request

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: Sequence[Sequence[int]]
                                                ) -> None:
        """1.4, several layer groups (VSWA; ``connectors/kv_cache_connector.py``): page ids per layer group,
        ``-1`` where a block has no page in that group (kvtier's hole: never loaded)."""
        if self._groups is None:
            if len(block_ids_by_layer_group) != 1:
                raise ConfigError(f"TensorRT-LLM reported {len(block_ids_by_layer_group)} layer groups for a model "
                                  "kvtier was configured for as full attention (kv_cache_config.max_attention_window)")
            self.update_state_after_alloc(request, block_ids_by_layer_group[0])
            return
        rid = str(request.request_id)
        start = self._groups.allocate(rid, block_ids_by_layer_group)
        if start is not None:
            with self._engine.lock:
                self._engine.loads[rid] = request

    def build_connector_meta(self, scheduler_output: Any) -> bytes:
        # Records as tuples (request_id, new_tokens, new_block_ids, num_computed, num_scheduled,
        # num_draft, is_new): the cheapest form to hand to Rust every step.
        if self._groups is not None:
            return self._groups.build_output(scheduler_output)
        records = []
        for is_new, group in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for rd in group:
                scheduled = getattr(rd, "num_scheduled_tokens", None)
                if scheduled is None:
                    raise ConnectorError(
                        f"TensorRT-LLM {_trtllm_version()} reports no num_scheduled_tokens for request "
                        f"{rd.request_id}: kvtier needs TensorRT-LLM >= {MIN_TRTLLM_VERSION}"
                    )
                rid = str(rd.request_id)
                # Raw page ids: a record with a -1 stops its request being cached (the leader drops
                # its records from then on: Leader.build_step).
                blocks = list(rd.new_block_ids)
                prio = getattr(rd, "priorities", None)  # 1.3+: retention priority per new block
                if prio:
                    records.append((rid, rd.new_tokens, blocks, rd.computed_position, scheduled, 0, is_new, False,
                                    [int(x) for x in prio]))
                else:
                    records.append((rid, rd.new_tokens, blocks, rd.computed_position, scheduled, 0, is_new))
        return self._leader.build_step(records)

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: Sequence[Sequence[int]]
                                        ) -> bool:
        """1.4, several layer groups: as :meth:`request_finished` (kvtier keeps its own tables)."""
        return self.request_finished(request, [])

    def request_finished(self, request: Any, cache_block_ids: Sequence[int]) -> bool:
        # True keeps the request's device blocks until every rank reports it (stores, and loads
        # still in flight for a cancelled request: a late copy must not land in reused blocks).
        rid = str(request.request_id)
        with self._engine.lock:
            # Parked for an async load not yet reported loaded: the workers report it saved once
            # their copies into its blocks are done (older TensorRT-LLM frees blocks at once).
            loading = self._engine.loads.pop(rid, None) is not None
        if self._groups is not None:
            return self._groups.finished(rid) or loading
        return bool(self._leader.request_finished(rid)) or loading

    def request_reset(self, request: Any) -> None:
        """KVCacheManagerV2 reset a request to run it again from scratch: its device table is gone."""
        rid = str(request.request_id)
        with self._engine.lock:
            self._engine.loads.pop(rid, None)
        for leader in self.leaders:
            try:
                leader.request_preempted(rid)
            except ConnectorError:
                pass  # never matched: nothing to forget

    def wait_for_initialization(self) -> None:
        return None


# --------------------------------------------------------------------------------------------
# Worker, one per rank


class KvtierConnectorWorker(_WorkerBase):  # type: ignore[misc, valid-type]
    """TensorRT-LLM ``KvCacheConnectorWorker`` backed by ``kvtier._native.Worker``."""

    def __init__(self, llm_args: Any):
        if _WorkerBase is not object:
            super().__init__(llm_args)
        _import_rank_settings()
        self._llm_args = llm_args
        self._metadata: Any = None
        self._rank = _rank(llm_args)
        self._tpb = _tokens_per_block(llm_args)
        tiers = _check(llm_args, _settings(llm_args))
        # Failed async loads become recomputes by the leader's verdicts (any TP size): every rank
        # rewinds its own copy of the request to the verdict's token (_get_finished_by_verdict).
        self._engine = _Engine.of(_channel())
        self._worker: Any = None
        #: Sliding windows: one native worker per layer group (``_trtllm_groups.WorkerGroups``).
        self._windows = _groups.engine_windows(llm_args)
        self._groups: Any = None
        #: Sync loads go layer by layer on the forward's stream where every forward runs the layer
        #: hooks (one layer group): layer l computes while later layers are copied.
        self._layered = loads_go_layer_by_layer(llm_args) and (tiers["sync_host_loads"] or not tiers["async_loads"])
        self._layered_step = False  # the bound step's loads go layer by layer

    @property
    def native(self) -> Any:
        """The native worker (for metrics and tests); None before registration."""
        return self._worker

    def _recovery(self) -> tuple:
        books = self._groups or self._worker
        return tuple(books.load_recovery()) if books is not None else (0, 0)

    @property
    def recomputed_loads(self) -> int:
        """Asynchronous loads that failed and were handed back to TensorRT-LLM for recompute."""
        return int(self._recovery()[0])

    @property
    def unrecoverable_loads(self) -> int:
        """Failed loads whose request could not be rewound (withheld, never reported loaded)."""
        return int(self._recovery()[1])

    @property
    def natives(self) -> list:
        """Every native worker of this rank (one per layer group with sliding windows)."""
        if self._groups is not None:
            return list(self._groups.workers)
        return [self._worker] if self._worker is not None else []

    def requires_layerwise_transfer_hooks(self) -> bool:
        # 1.4 (connectors/kv_cache_connector.py): hooks only where loads go layer by layer.
        return self._layered

    # ----- registration ------------------------------------------------------------------------

    def _link(self) -> tuple[str, Optional[list]]:
        """How this rank's workers reach the leaders, and the leaders' ZeroMQ endpoints (one per layer
        group, kvtier's order) where they are in other processes."""
        if _ranks_in_processes(self._llm_args) or _configured_endpoint():
            endpoint = _configured_endpoint()
            if endpoint is not None:
                return "zmq", [endpoint]
            # The scheduler (rank 0, this process) chose free ports; every rank learns them here.
            endpoints = None
            if self._rank == 0:
                self._engine.endpoint_set.wait(120)
                endpoints = self._engine.endpoints
            endpoints = _broadcast(endpoints)  # every rank takes part, whatever rank 0 has
            if not endpoints:
                raise ConfigError("kvtier: rank 0's connector scheduler chose no leader endpoint within 120 s "
                                  "(it was not built in rank 0's process, or failed first: see its log)")
            return "zmq", list(endpoints)
        if self._rank == 0:
            return "in_process", None
        # No TensorRT-LLM, all ranks in one process: the caller carries this rank's reports,
        # worker.native.take_reports() -> the group's scheduler leader's apply_reports().
        return "engine", None

    def _register(self, tensors: Any, layout: str, windows: Optional[list] = None) -> Any:
        link, endpoints = self._link()
        settings = _settings(
            self._llm_args,
            rank=self._rank,
            link=link,
            layout=layout,
            # TensorRT-LLM passes get_finished only requests whose request_finished returned True.
            finished_ids_are_saving=True,
            # Eager engines: sync loads ordered on the forward's stream, layer by layer.
            ordered_sync_loads=self._layered,
            layered_sync_loads=self._layered,
        )
        if endpoints:
            settings["zmq_endpoint"] = endpoints[0]
        delay = os.environ.get("TRTLLM_KVTIER_TEST_LOAD_DELAY_MS")
        if delay:
            settings["test_load_delay_ms"] = int(delay)  # tests: loads start late (see worker.rs)
        if windows is not None:
            # One worker per layer group, each on its group's channel and leader (_trtllm_groups.group_settings).
            per_group = _groups.group_settings(settings, windows, endpoints)
            workers = [_native.Worker(s, t) for s, t in zip(per_group, tensors)]
            for w in workers:
                w.enable_load_verdicts()
            return workers
        self._worker = _native.Worker(settings, tensors)
        self._worker.enable_load_verdicts()

    def register_kv_caches(self, kv_cache_tensor: Any, secondary_kv_cache_tensor: Any = None) -> None:
        """V1 manager: the primary pool ``[num_blocks, num_layers, kv_factor, ...]``."""
        self._register(describe(kv_cache_tensor), "trtllm_pool")

    def register_kv_cache_layout(self, layout: Any) -> None:
        """KVCacheManagerV2 (``connectors/kv_cache_layout.py``): one full-attention layer group with
        shard-specific regions, or one layer group per window (``_trtllm_layout``)."""
        self._layered = False  # whole loads: regions need not be one per decoder layer
        if self._windows is not None:
            # One native worker per group, in kvtier's order.
            tensors, order = _layout.group_tensors(layout, self._windows, self._tpb)
            workers = self._register(tensors, "vllm_mla", self._windows)
            self._groups = _groups.WorkerGroups(workers)
            self._worker = workers[0]
            if self._rank == 0:
                self._engine.group_order = order
            return
        self._register(_layout.single_group_tensors(layout, self._tpb), "vllm_mla")

    # ----- per step ----------------------------------------------------------------------------

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata
        if self._worker is None:
            if metadata:
                logger.error("kvtier: connector metadata arrived before register_kv_caches; ignored")
            return
        if self._groups is not None:
            self._groups.bind(metadata)
            return
        self._worker.bind(metadata)

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def start_load_kv(self, stream: Any) -> None:
        """Starts the step's loads: layer by layer where every forward runs the layer hooks, else
        returns once they are in device memory (ordered: once the stream waits for them), so the
        forward reads them whichever hooks run (CUDA-graph replay runs none)."""
        w = self._worker
        self._layered_step = False
        if w is None:
            return
        handle = stream_handle(stream)
        if self._groups is not None:
            self._groups.start_load(handle)
        else:
            w.start_load(handle, self._layered)
            self._layered_step = self._layered and bool(w.has_layered_loads())
            if not self._layered_step:
                w.wait_for_layer_load(0, handle)
        self._collect_errors()

    def _collect_errors(self) -> None:
        """Logs the device blocks whose loads failed. A failed async load is recomputed by its
        verdict (get_finished); a failed sync load (host tier only: a CUDA error, and then the
        engine's own next CUDA call fails too) drops the request's stores in the core. Nothing is
        raised here (it would fail every request)."""
        failed = sorted(int(b) for b in (self._groups or self._worker).take_load_errors())
        if failed:
            logger.warning("kvtier: loads into device blocks %s failed on rank %d", failed, self._rank)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Layered step: the stream waits for layer ``layer_idx``'s copies (the pool's layer: PP and
        layers without KV are refused). Otherwise the loads completed in start_load_kv."""
        if not self._layered_step or self._worker is None:
            return
        try:
            self._worker.wait_for_layer_load(int(layer_idx), stream_handle(stream))
        except Exception as e:  # never raise in a hook (_handle_errors would fail every request)
            logger.error("kvtier: wait_for_layer_load(%s) failed on rank %d: %s", layer_idx, self._rank, e)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        return None  # whole blocks across layers, issued at the end of the forward pass

    def wait_for_save(self, stream: Any) -> None:
        self._layered_step = False
        if self._groups is not None:
            self._groups.forward_done(stream_handle(stream))
        elif self._worker is not None:
            self._worker.forward_done(stream_handle(stream))

    def register_forward_pass_callable(self) -> Callable[[], None]:
        """Called on the forward stream after every forward (eager or graph replay), from engine
        start on: before registration (KV-cache estimation, warmup) it does nothing."""

        def forward_pass_done() -> None:
            self._layered_step = False
            w = self._groups or self._worker
            if w is not None:
                w.forward_done(current_stream_handle())

        return forward_pass_done

    def get_finished(
        self, finished_gen_req_ids: Sequence[int], started_loading_req_ids: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        if self._worker is None:
            return [], []
        # TensorRT-LLM's KvCacheConnectorManager.get_finished (connectors/kv_cache_connector.py)
        # calls this right after moving the new async loads into pending_async_requests.
        manager = sys._getframe(1).f_locals.get("self")
        return self._get_finished_by_verdict(finished_gen_req_ids, started_loading_req_ids, manager)

    def _share_verdicts(self) -> list:
        """Rank 0's leaders' new load verdicts, on every rank in the same ``get_finished`` round, as
        one tuple of blobs (one per layer group, kvtier's order) per round that had any: every rank
        calls ``get_finished`` once per executor iteration (the manager allgathers the answers right
        after: ``KvCacheConnectorManager.get_finished``), so a broadcast from here is matched on
        every rank."""
        eng = self._engine
        mine = None
        if self._rank == 0 and eng.leaders:
            blobs = tuple(bytes(leader.take_load_verdicts()) for leader in eng.leaders)
            mine = blobs if any(blobs) else None
        if _ranks_in_processes(self._llm_args):
            got = _broadcast(mine if self._rank == 0 else None)
            return [got] if got else []
        # All ranks in this process (one rank, or tests): rank 0's verdicts in order, once each.
        return eng.verdicts_in_process(self._rank, mine, _world_size(self._llm_args))

    def _parked(self, manager: Any) -> dict:
        """This rank's parked ``LlmRequest`` objects by request id (str): the connector manager's
        ``pending_async_requests.loading`` (the caller of ``get_finished``); with one rank also the
        scheduler's (same process), for a manager without it."""
        parked: dict = {}
        if _world_size(self._llm_args) == 1:
            with self._engine.lock:
                parked.update(self._engine.loads)
        loading = getattr(getattr(manager, "pending_async_requests", None), "loading", None)
        if isinstance(loading, dict):
            parked.update((str(k), v) for k, v in loading.items())
        elif not parked:
            _warn_once("no-parked", "kvtier: get_finished was called by %r, which holds no pending_async_requests: "
                       "a failed asynchronous load cannot be rewound and is never reported loaded",
                       type(manager).__name__)
        return parked

    def _get_finished_by_verdict(self, finished: Sequence[int], started: Sequence[int],
                                 manager: Any) -> tuple[list[int], list[int]]:
        """A parked request is reported loaded only once the leader's verdict on its load arrived,
        and the same verdict reaches every rank in the same round; a failed load is rewound on this
        rank's own copy of the request to the verdict's token before it is reported, so when
        TensorRT-LLM resumes it (once every rank reported it) every rank recomputes from the same
        token, at or before any block any rank failed to fill. Which failed loads are handed back
        (those whose request this rank can rewind) and which withheld is the worker's rule
        (``Worker.get_finished_by_verdict``, ``kvtier::connector::LoadRecovery``)."""
        parked = self._parked(manager)
        done, started_ids = _ids(finished), _ids(started)
        verdicts = self._share_verdicts()
        if self._groups is not None:
            saved, loaded, recompute = self._groups.get_finished_by_verdict(verdicts, done, started_ids, set(parked))
        else:
            w = self._worker
            for blobs in verdicts:
                w.apply_load_verdicts(blobs[0])
            saved, loaded, recompute = w.get_finished_by_verdict(done, started_ids, rewindable=set(parked))
        self._collect_errors()
        out = [int(r) for r in loaded]
        for rid, pos in recompute:
            self._rewind(parked[str(rid)], int(pos))
            out.append(int(rid))
        with self._engine.lock:
            for rid in out:
                self._engine.loads.pop(str(rid), None)
        return [int(x) for x in saved], out

    @staticmethod
    def _rewind(request: Any, token: int) -> None:
        """TensorRT-LLM computes the request from ``token`` on (never forward)."""
        if token < int(request.context_current_position):
            request.context_current_position = token


def _ids(xs: Iterable[Any]) -> list[str]:
    return [str(int(x)) for x in xs]


# --------------------------------------------------------------------------------------------
# Configuration (kvtier/_trtllm_config.py)

from ._trtllm_config import (  # noqa: E402,F401  (public API of kvtier.trtllm)
    CONNECTOR_NAMES,
    MIN_TRTLLM_VERSION,
    build_kv_connector_config,
    build_llm_kwargs,
    connector_yaml,
    cli,
    export_settings_for_ranks,
    layer_hooks_always_run,
    llm_options,
    loads_go_layer_by_layer,
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli(argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
