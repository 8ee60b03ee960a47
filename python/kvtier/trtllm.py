"""kvtier as a TensorRT-LLM KV cache connector (PyTorch backend, TensorRT-LLM >= 1.2.0rc2).

Use it the way the original's ``--connector kvbm`` flag does::

    from tensorrt_llm import LLM
    from kvtier.trtllm import build_kv_connector_config

    llm = LLM(model, kv_connector_config=build_kv_connector_config("kvtier"),
              kv_cache_config=KvCacheConfig(enable_partial_reuse=False))

or, for ``trtllm-serve``, write the YAML block that ``python -m kvtier.trtllm config --connector kvtier``
prints into the file passed as ``--extra_llm_api_options``.

Role of this module: translate TensorRT-LLM's objects (``LlmRequest``, ``SchedulerOutput`` /
``RequestData``, the pool tensor, CUDA streams) into the engine-neutral calls of
``kvtier._native.Leader`` / ``kvtier._native.Worker`` and back. It keeps no cache state: which
blocks match, load, store or are still in flight is decided in Rust.

Invariants kept here:

* ``get_num_new_matched_tokens`` never returns ``(0, True)`` (TensorRT-LLM treats it as an error);
* every ``RequestData`` must carry ``num_scheduled_tokens``; a TensorRT-LLM without it fails at the
  first step with a :class:`kvtier.ConnectorError` naming the minimum version, 1.2.0rc2;
* request ids cross into Rust as ``str(request_id)`` and come back as ``int``;
* rank 0's scheduler and worker (one process, same ``llm_args``) share the in-process channel;
  every other rank reaches the leader over ZeroMQ at the endpoint the leader publishes
  (``KVTIER_LEADER_ENDPOINT``, default chosen by the leader and exported to child processes);
* a load that failed is never reported loaded. TensorRT-LLM's connector API has no load-error
  path (``get_finished`` returns only saved and loaded ids), so: an asynchronous load that failed
  on a single-rank engine is recomputed from its first failed block (rank 0's worker rewinds the
  parked request's ``context_current_position`` before reporting it loaded, so TensorRT-LLM computes
  the rest itself); any other failed load raises :class:`kvtier.TransferError` naming the requests
  (a synchronous one before layer 0 reads the blocks). kvtier's leader drops the failed blocks
  from matching either way, so the same bad block is never offered again (docs/arch/py.md).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _native
from ._native import ConfigError, ConnectorError, TransferError
from ._tensors import describe, stream_handle

__all__ = [
    "KvtierConnectorScheduler",
    "KvtierConnectorWorker",
    "build_kv_connector_config",
    "connector_yaml",
    "CONNECTOR_NAMES",
    "MIN_TRTLLM_VERSION",
]

#: The oldest TensorRT-LLM whose ``RequestData`` carries ``num_scheduled_tokens``.
MIN_TRTLLM_VERSION = "1.2.0rc2"

#: Where TensorRT-LLM keeps the connector base classes (newest first: moved in 1.3.0rc14).
_BASE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)

SCHEDULER_CLASS = "KvtierConnectorScheduler"
WORKER_CLASS = "KvtierConnectorWorker"

#: Accepted ``--connector`` names: "kvtier", "kvbm" (the original's name, so configurations
#: migrate unchanged) and "none".
CONNECTOR_NAMES = ("kvtier", "kvbm", "none")


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


class _AsyncLoads:
    """Requests of one engine with an asynchronous load in flight: the scheduler records the
    ``LlmRequest`` and its device blocks, rank 0's worker (same process, same channel) uses them to
    turn a failed load into a recompute. Thread-safe; one instance per channel."""

    _all: "dict[str, _AsyncLoads]" = {}
    _all_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reqs: dict[str, tuple[Any, list[int]]] = {}

    @classmethod
    def of(cls, channel: str) -> "_AsyncLoads":
        with cls._all_lock:
            return cls._all.setdefault(channel, cls())

    def add(self, rid: str, request: Any, block_ids: list[int]) -> None:
        with self._lock:
            self._reqs[rid] = (request, block_ids)

    def pop(self, rid: str) -> Optional[tuple[Any, list[int]]]:
        with self._lock:
            return self._reqs.pop(rid, None)

    def blocks(self) -> set[int]:
        with self._lock:
            return {b for _, ids in self._reqs.values() for b in ids}


def _trtllm_version() -> str:
    try:
        import tensorrt_llm

        return str(getattr(tensorrt_llm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


# --------------------------------------------------------------------------------------------
# Reading llm_args


def _tokens_per_block(llm_args: Any) -> int:
    kv = getattr(llm_args, "kv_cache_config", None)
    tpb = getattr(kv, "tokens_per_block", None)
    if tpb is None:
        raise ConfigError("llm_args.kv_cache_config.tokens_per_block is missing")
    if getattr(kv, "enable_partial_reuse", False):
        raise ConfigError(
            "kvtier needs kv_cache_config.enable_partial_reuse: false (partial block reuse would let the "
            "engine write into blocks kvtier has already stored)"
        )
    return int(tpb)


def _mapping(llm_args: Any) -> Any:
    pc = getattr(llm_args, "parallel_config", None)
    to_mapping = getattr(pc, "to_mapping", None)
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


def _ids(xs: Iterable[Any]) -> list[str]:
    return [str(int(x)) for x in xs]


def _uses_zmq(llm_args: Any) -> bool:
    """Ranks reach the leader over ZeroMQ when they live in other processes (TensorRT-LLM with
    tensor parallelism) or when an endpoint is configured explicitly."""
    if os.environ.get("KVTIER_ZMQ_ENDPOINT"):
        return True
    return TRTLLM_BASE_MODULE is not None and _world_size(llm_args) > 1


def _settings_channel() -> str:
    """The in-process channel pairing an engine's scheduler with rank 0's worker."""
    return f"trtllm-{os.getpid()}"


def _settings(llm_args: Any, **extra: Any) -> dict[str, Any]:
    """The engine-supplied settings of this engine (the rest comes from KVTIER_* / DYN_KVBM_*)."""
    s: dict[str, Any] = {
        "block_size": _tokens_per_block(llm_args),
        "world_size": _world_size(llm_args),
        # Sync loads (they run before the forward pass reads layer 0) unless kvtier's configuration says
        # otherwise: `connector.async_loads` in the TOML, KVTIER_ASYNC_LOADS, or an `async_loads` setting.
        "async_loads_default": False,
        # Scheduler and rank-0 worker of one engine pair up in-process under this key.
        "channel": _settings_channel(),
    }
    s.update(extra)
    return s


# --------------------------------------------------------------------------------------------
# Scheduler (leader), MPI rank 0 only


class KvtierConnectorScheduler(_SchedulerBase):  # type: ignore[misc, valid-type]
    """TensorRT-LLM ``KvCacheConnectorScheduler`` backed by ``kvtier._native.Leader``."""

    #: kvtier serves decode workers too: generation-only requests (KV from the cache transceiver)
    #: are accepted; their prompt blocks are never loaded by kvtier, the blocks their generation
    #: completes are stored.
    supports_generation_only_requests = True

    def __init__(self, llm_args: Any):
        if _SchedulerBase is not object:
            super().__init__(llm_args)
        self._llm_args = llm_args
        extra = {"link": "zmq"} if _uses_zmq(llm_args) else {}
        settings = _settings(llm_args, **extra)
        self._leader = _native.Leader(settings)
        self._async = _AsyncLoads.of(str(settings["channel"]))
        # Requests answered (n, True) and not yet allocated.
        self._matched_async: dict[str, Any] = {}

    @property
    def leader(self) -> Any:
        """The native leader (for metrics and tests)."""
        return self._leader

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if getattr(request, "is_generation_only_request", False):
            # Its KV arrives through the engine's cache transceiver; loading it too would race.
            return 0, False
        n = int(
            self._leader.get_num_new_matched_tokens(
                str(request.request_id), request.get_tokens(0), int(num_computed_tokens)
            )
        )
        # (0, True) is an error to TensorRT-LLM.
        if n > 0 and self._leader.loads_are_async:
            self._matched_async[str(request.request_id)] = request
            return n, True
        self._matched_async.pop(str(request.request_id), None)
        return (n, False) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        # TensorRT-LLM passes no external-token count: the leader remembers its last match.
        rid = str(request.request_id)
        ids = [int(b) for b in block_ids]
        self._leader.update_state_after_alloc(rid, ids)
        if self._matched_async.pop(rid, None) is not None:
            self._async.add(rid, request, ids)

    def build_connector_meta(self, scheduler_output: Any) -> bytes:
        # Records as tuples (request_id, new_tokens, new_block_ids, num_computed, num_scheduled,
        # num_draft, is_new): the cheapest form to hand to Rust every step.
        records = []
        for is_new, group in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for rd in group:
                scheduled = getattr(rd, "num_scheduled_tokens", None)
                if scheduled is None:
                    raise ConnectorError(
                        f"TensorRT-LLM {_trtllm_version()} reports no num_scheduled_tokens for request "
                        f"{rd.request_id}: kvtier needs TensorRT-LLM >= {MIN_TRTLLM_VERSION}"
                    )
                records.append(
                    (str(rd.request_id), rd.new_tokens, rd.new_block_ids, rd.computed_position, scheduled, 0, is_new)
                )
        return self._leader.build_step(records)

    def request_finished(self, request: Any, cache_block_ids: Sequence[int]) -> bool:
        # The leader owns the request's block table; the ids TensorRT-LLM passes (with -1 for blocks
        # a sliding window has passed) add nothing.
        rid = str(request.request_id)
        self._matched_async.pop(rid, None)
        self._async.pop(rid)
        return bool(self._leader.request_finished(rid))

    def wait_for_initialization(self) -> None:
        return None


# --------------------------------------------------------------------------------------------
# Worker, one per rank


class KvtierConnectorWorker(_WorkerBase):  # type: ignore[misc, valid-type]
    """TensorRT-LLM ``KvCacheConnectorWorker`` backed by ``kvtier._native.Worker``."""

    def __init__(self, llm_args: Any):
        if _WorkerBase is not object:
            super().__init__(llm_args)
        self._llm_args = llm_args
        self._metadata = None
        self._rank = _rank(llm_args)
        self._tokens_per_block = _tokens_per_block(llm_args)
        # Failed async loads become recomputes only where rank 0's worker shares the process (and the
        # request objects) with the scheduler and no other rank runs the request.
        self._can_recompute = _world_size(llm_args) == 1 and not _uses_zmq(llm_args)
        self._async = _AsyncLoads.of(str(_settings_channel()))
        # Device blocks of async loads that failed, not yet matched to their request.
        self._async_errors: set[int] = set()
        #: Asynchronous loads that failed and were handed back to TensorRT-LLM for recompute.
        self.recomputed_loads = 0
        # Built at register_kv_caches (it needs the pool tensor).
        self._worker: Any = None

    @property
    def native(self) -> Any:
        """The native worker (for metrics and tests); None before register_kv_caches."""
        return self._worker

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        desc = describe(kv_cache_tensor)
        if _uses_zmq(self._llm_args):
            # Ranks in other processes (and, for uniformity, rank 0 too) talk to the leader over
            # ZeroMQ at KVTIER_ZMQ_ENDPOINT (default tcp://127.0.0.1:56119).
            link = "zmq"
        elif self._rank == 0:
            # The scheduler lives in rank 0's process: job reports go to it directly.
            link = "in_process"
        else:
            # No TensorRT-LLM (tests, custom drivers running all ranks in one process): the caller
            # carries this rank's reports, worker.native.take_reports() -> scheduler.leader.apply_reports().
            link = "engine"
        settings = _settings(
            self._llm_args,
            rank=self._rank,
            link=link,
            layout="trtllm_pool",
            # TensorRT-LLM passes get_finished only requests whose request_finished returned True.
            finished_ids_are_saving=True,
        )
        self._worker = _native.Worker(settings, desc)

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata
        self._require().bind(metadata)

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def _require(self) -> Any:
        if self._worker is None:
            raise ConnectorError("the kvtier worker was used before register_kv_caches")
        return self._worker

    def start_load_kv(self, stream: Any) -> None:
        self._require().start_load(stream_handle(stream))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        w = self._require()
        w.wait_for_layer_load(int(layer_idx), stream_handle(stream))
        if layer_idx == 0:
            failed = {int(b) for b in w.take_load_errors()}
            if self._can_recompute:
                # Blocks of parked async loads are settled in get_finished.
                parked = failed & self._async.blocks()
                self._async_errors |= parked
                failed -= parked
            if failed:
                # A synchronous load failed and this pass is about to read its blocks: TensorRT-LLM
                # cannot recompute them, so fail the pass rather than run on wrong KV.
                raise TransferError(
                    f"kvtier could not load device blocks {sorted(failed)}; refusing to run the forward pass "
                    "on them (on a single-rank engine, asynchronous loads - KVTIER_ASYNC_LOADS=true - are "
                    "recomputed instead)"
                )

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        # Stores are whole blocks across layers, issued at the end of the forward pass.
        self._require()

    def wait_for_save(self, stream: Any) -> None:
        self._require().forward_done(stream_handle(stream))

    def register_forward_pass_callable(self) -> Callable[[], None]:
        """A callable TensorRT-LLM runs on the forward stream at the end of each forward pass; it
        marks the point after which this step's stores may read the device blocks."""

        def forward_pass_done() -> None:
            self._require().forward_done(_current_stream_handle())

        return forward_pass_done

    def get_finished(
        self, finished_gen_req_ids: Sequence[int], started_loading_req_ids: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        w = self._require()
        saved, loaded, load_failed = w.get_finished(_ids(finished_gen_req_ids), _ids(started_loading_req_ids))
        loaded = list(loaded)
        for rid in loaded:
            self._async.pop(str(rid))
        # Errors of a load that finished after get_finished looked belong to a request reported on a
        # later call: remember them all until their request is reported.
        self._async_errors |= {int(b) for b in w.take_load_errors()}
        if load_failed:
            loaded += self._recompute(load_failed)
        return [int(x) for x in saved], [int(x) for x in loaded]

    def _recompute(self, load_failed: Sequence[str]) -> list[str]:
        """Rewind each failed request to its first failed block so TensorRT-LLM computes the rest, and
        return the ids to report loaded. Raises TransferError where that is impossible."""
        errors = self._async_errors
        if not self._can_recompute:
            raise TransferError(
                f"kvtier could not load the KV of requests {sorted(int(x) for x in load_failed)}; "
                "TensorRT-LLM's connector API cannot recompute them on a multi-rank engine"
            )
        out = []
        for rid in load_failed:
            entry = self._async.pop(str(rid))
            first = None
            if entry is not None:
                request, blocks = entry
                bad = [i for i, b in enumerate(blocks) if b in errors]
                first = min(bad) if bad else None
            if first is None:
                raise TransferError(
                    f"kvtier could not load the KV of request {rid} and cannot tell which blocks failed; "
                    "refusing to report it loaded"
                )
            pos = first * self._tokens_per_block
            if pos < int(request.context_current_position):
                request.context_current_position = pos
            self._async_errors -= set(blocks)
            self.recomputed_loads += 1
            logger.warning("kvtier: the load of request %s failed at block %d; TensorRT-LLM recomputes from token %d",
                           rid, first, pos)
            out.append(rid)
        return out


def _current_stream_handle() -> Optional[int]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_stream().cuda_stream)


# --------------------------------------------------------------------------------------------
# Configuration


def _connector_fields(connector: Optional[str]) -> Optional[dict[str, str]]:
    if connector is None:
        return None
    name = str(connector).strip().lower()
    if name == "none":
        return None
    if name not in ("kvtier", "kvbm"):
        raise ConfigError(f"unknown connector {connector!r}: valid names are {', '.join(CONNECTOR_NAMES)}")
    return {
        "connector_module": __name__ if __name__ != "__main__" else "kvtier.trtllm",
        "connector_scheduler_class": SCHEDULER_CLASS,
        "connector_worker_class": WORKER_CLASS,
    }


def build_kv_connector_config(connector: Optional[str]) -> Any:
    """TensorRT-LLM's ``KvCacheConnectorConfig`` for ``connector`` ("kvtier", its alias "kvbm", or
    "none"/None for no connector, which returns None). Without TensorRT-LLM installed the same three
    fields come back as a dict. Any other name raises :class:`kvtier.ConfigError` listing the valid
    names."""
    fields = _connector_fields(connector)
    if fields is None:
        return None
    try:
        from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
    except ImportError:
        return fields
    return KvCacheConnectorConfig(**fields)


def connector_yaml(connector: Optional[str]) -> str:
    """The YAML block for ``trtllm-serve --extra_llm_api_options`` (empty for "none")."""
    fields = _connector_fields(connector)
    if fields is None:
        return ""
    lines = ["kv_connector_config:"]
    lines += [f"  {k}: {v}" for k, v in fields.items()]
    lines += ["kv_cache_config:", "  enable_partial_reuse: false"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.trtllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="print the YAML block for trtllm-serve --extra_llm_api_options")
    cfg.add_argument("--connector", default="kvtier", help=f"one of {', '.join(CONNECTOR_NAMES)} (default kvtier)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(connector_yaml(args.connector))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
