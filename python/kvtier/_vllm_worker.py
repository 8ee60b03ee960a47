"""The worker half of :mod:`kvtier.vllm` (one per vLLM model-runner process): hands vLLM's per-layer tensors to
kvtier's Rust worker, relays its completions, and carries its job reports back to the scheduler side in the worker
metadata. It only translates; the rules live in the Rust worker.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from . import _native
from ._vllm_meta import KvtierConnectorMetadata, KvtierWorkerMetadata
from ._vllm_util import _backend, _trace

logger = logging.getLogger("kvtier.vllm")

# Worker sides by vLLM engine id, for a scheduler side of the same engine in the same process (vLLM's uniproc
# executor, its default with one GPU: the engine core's thread schedules a step and then runs it). Weak: a worker
# side's life is its connector's.
_PEERS: "weakref.WeakValueDictionary[str, _WorkerSide]" = weakref.WeakValueDictionary()


def peer(engine_id: str | None) -> "_WorkerSide | None":
    """The worker side registered for ``engine_id`` in this process, if any."""
    return _PEERS.get(engine_id) if engine_id else None


class _WorkerSide:
    """Translation of the worker's calls: hands vLLM's per-layer tensors to kvtier's worker, relays its
    completions, and carries its job reports back to the scheduler side in the worker metadata. Requests whose
    load the scheduler side had to refuse are failed here, exactly like failed transfers."""

    def __init__(self, settings: "dict[str, Any] | list[dict[str, Any]]", block_size: int,
                 group_layers: list[list[str]] | None = None) -> None:
        # One kvtier worker per KV cache group (vLLM's hybrid KV cache manager), each over its group's layers.
        self._group_settings = settings if isinstance(settings, list) else [settings]
        self._settings = self._group_settings[0]
        self._group_layers = group_layers if group_layers and len(group_layers) > 1 else None
        self._block_size = block_size
        self._worker: Any = None
        self._workers: list[Any] = []
        self._errors = 0
        # Which requests vLLM hears of in finished_sending / finished_recving and which blocks failed to load: the
        # Rust books (kvtier::connector::Completions), over every group's worker.
        self._books = _native.Completions()
        self._last_stats: dict[str, float] = {}
        # The engine's current CUDA stream, as a raw handle (set in register when the KV cache is on a GPU).
        self._current_stream: Any = None
        # Layer name -> (group, index among its group worker's registered layers); a step's layered loads.
        self._layer_index: dict[str, tuple[int, int]] = {}
        self.layered_step = False
        # Several KV cache groups load layer by layer only when asked (`layered_group_loads`, vLLM's extra config;
        # read from the worker, which checked it as a boolean): exact on the H200 and no faster there.
        self._layered_groups = False
        # Early sync loads (`early_sync_loads`): the thread and the stream of the engine's last step, whether a step
        # is bound now (start_step .. forward_done), the step whose loads started early, and whether vLLM zeroes
        # newly allocated blocks on its stream (then never early: the zeroing would land over the loaded bytes).
        self._early_ok = False
        self._engine_thread: int | None = None
        self._engine_stream: int | None = None
        self._in_step = False
        self._early_step: int | None = None
        self._early_steps = 0
        self.zeroes_new_blocks = False

    def _all(self) -> list[Any]:
        """The kvtier workers, one per KV cache group (``_worker`` is group 0's)."""
        if len(self._workers) > 1:
            return self._workers
        return [self._worker] if self._worker is not None else []

    def _error(self, what: str, e: BaseException) -> None:
        self._errors += 1
        logger.error("kvtier: %s failed: %s", what, e, exc_info=True)

    def _stream(self) -> int | None:
        """The engine's current CUDA stream handle when its KV cache is on a GPU, else None (the CPU forward pass
        is synchronous)."""
        return None if self._current_stream is None else int(self._current_stream())

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Layer order is the model's (vLLM's dict preserves it); a (layer, block)'s bytes are opaque to kvtier.
        core = _backend(self._settings)
        describe = getattr(core, "describe", None)
        if describe is None:
            from kvtier import describe
        if self._group_layers is None:
            tensors = [(name, describe(t)) for name, t in kv_caches.items()]
            self._workers = [core.Worker(self._settings, tensors)]
            self._layer_index = {name: (0, i) for i, name in enumerate(kv_caches)}
        else:
            # A group's layers in vLLM's order (kv_cache_config.kv_cache_groups[g].layer_names); the groups' tensors
            # share memory (vLLM's kv_cache_tensors), each group addressing its own block ids in it.
            self._workers = [core.Worker(s, [(name, describe(kv_caches[name])) for name in layers])
                             for s, layers in zip(self._group_settings, self._group_layers)]
            if len(self._workers) > 1:
                # An asynchronous load's failure goes out by request (failed_recving); only a load inside the
                # step goes out by its blocks (connector::Completions).
                for w in self._workers:
                    w.report_sync_load_errors_only()
            self._layer_index = {name: (g, i) for g, layers in enumerate(self._group_layers)
                                 for i, name in enumerate(layers)}
        self._adopt(self._workers)
        # Decided once: asking torch whether CUDA is there costs more than the rest of a decode step's hooks.
        cuda = [t for t in kv_caches.values() if getattr(t, "is_cuda", False)]
        if cuda:
            idx = cuda[0].device.index
            dev = int(idx) if idx is not None else int(torch.cuda.current_device())
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton launches on; no Stream object
            self._current_stream = (lambda: raw(dev)) if raw is not None else \
                (lambda: torch.cuda.current_stream(dev).cuda_stream)

    def _adopt(self, workers: list[Any]) -> None:
        """Take the registered workers, one per KV cache group: the books count their groups, and whether several
        groups layer their loads is their setting (checked as a boolean in Rust)."""
        self._workers = workers
        self._worker = workers[0]
        layered = getattr(self._worker, "layered_group_loads", None)
        self._layered_groups = bool(layered()) if layered is not None else False
        early = getattr(self._worker, "early_sync_loads", None)
        self._early_ok = bool(early()) if early is not None else False
        self._books.set_groups(len(workers))

    def register_peer(self, engine_id: str | None) -> None:
        """Let a scheduler side of engine ``engine_id`` in this process start steps' sync loads early."""
        if engine_id and self._early_ok:
            _PEERS[engine_id] = self

    def start_early(self, meta: KvtierConnectorMetadata) -> bool:
        """Start the step's sync loads now, as the scheduler builds the step, in the engine's thread: vLLM then
        prepares the step's inputs (V2 runner: add_requests, block tables, attention metadata; 4.3 ms at 32K on
        the H100) while the copies run. Only where that is the same as starting them in ``start_load_kv``: the
        caller is the thread that ran the engine's last step, on the same current stream (so the fence recorded
        now follows every forward pass already enqueued, the asynchronously scheduled one included), no step is
        bound, one KV cache group, and vLLM does not zero new blocks. The forward pass's per-layer waits (or, in
        a step without layer hooks, one wait for every layer in ``start_load_kv``) stay where they were."""
        if (not self._early_ok or self._in_step or len(self._all()) != 1
                or self.zeroes_new_blocks or self._engine_thread != threading.get_ident()
                or self._stream() != self._engine_stream or not meta.step):
            return False
        _trace("early_load")
        self.preempt(meta)
        self.start_step(meta, layer_hooks=True)
        self._early_step = meta.step
        self._early_steps += 1
        return True

    def started_early(self, meta: KvtierConnectorMetadata) -> bool:
        """Whether this step's loads were started by :meth:`start_early` (vLLM now hands the step over)."""
        return self._early_step is not None and getattr(meta, "step", 0) == self._early_step

    def finish_early(self, layer_hooks: bool) -> None:
        """``start_load_kv`` of a step started early: without per-layer hooks in this step (a full CUDA graph), the
        engine's stream waits for every layer of its layered loads now."""
        self._early_step = None
        if self.layered_step and not layer_hooks:
            for worker in self._all():
                try:
                    worker.wait_for_layer_load(None, self._stream())
                except Exception as e:
                    self._error("wait_for_layer_load", e)
            self.layered_step = False

    def preempt(self, meta: KvtierConnectorMetadata) -> None:
        """Before the step writes any device block: wait for the jobs of the requests whose blocks it reuses."""
        if meta.fence_all:
            self.drain_all()
        elif meta.preempted or meta.fence:
            self.drain(list(meta.preempted) + list(meta.fence))

    def start_step(self, meta: KvtierConnectorMetadata, layer_hooks: bool = False) -> None:
        self._in_step = True
        if self._early_ok:  # what start_early compares with; nothing to record otherwise
            self._engine_thread = threading.get_ident()
            self._engine_stream = self._stream()
        self._books.begin_step(list(meta.delayed_frees), dict(getattr(meta, "delayed_groups", {})),
                               dict(getattr(meta, "recv_groups", {})), dict(meta.failed_loads),
                               set(meta.failed_loads_async))
        plans = [meta.plan, *getattr(meta, "group_plans", [])]
        self.layered_step = False
        # Several KV cache groups: loads inside the step are ordered on the stream whole unless `layered_group_loads`
        # (each attention layer waits for its own group's copies: wait_for_layer).
        hooks = layer_hooks and (len(self._workers) == 1 or self._layered_groups)
        for worker, plan in zip(self._all(), plans):
            if plan:
                self._start(worker, plan, meta.sync_loads, hooks)

    def _start(self, worker: Any, plan: bytes, sync_loads: bool, layer_hooks: bool) -> None:
        _trace("start_load")
        try:
            worker.bind(plan)
            # Layered only where vLLM calls wait_for_layer_load before every attention layer (layer_hooks);
            # the worker decides whether the step has loads to layer (its `layered_sync_loads` setting).
            worker.start_load(self._stream(), bool(sync_loads and layer_hooks))
            layered = bool(worker.has_layered_loads())
            self.layered_step = self.layered_step or layered
        except Exception as e:
            self._error("start_load", e)
            return
        if sync_loads and not layered:
            # vLLM calls start_load_kv before the forward pass only when the step has sync loads: complete them
            # here, every layer at once. A failed load raises TransferError; its blocks are then reported by
            # get_block_ids_with_load_errors and vLLM recomputes them, so it is not an adapter error.
            try:
                worker.wait_for_layer_load(0, self._stream())
            except Exception as e:
                if type(e).__name__ == "TransferError":
                    logger.warning("kvtier: a load failed; vLLM recomputes its blocks: %s", e)
                else:
                    self._error("wait_for_layer_load", e)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: the engine's stream waits for that layer's copies (a name the
        registered layout does not know waits for every layer)."""
        workers = self._all()
        loc = self._layer_index.get(layer_name)
        # The layer's group's worker, at the layer's index among its group's layers; unknown: every layer of all.
        targets = [(w, None) for w in workers] if loc is None else [(workers[loc[0]], loc[1])]
        for worker, index in targets:
            try:
                worker.wait_for_layer_load(index, self._stream())
            except Exception as e:
                self._error("wait_for_layer_load", e)

    def forward_done(self) -> None:
        self.layered_step = False
        self._in_step = False
        self._early_step = None
        for worker in self._all():
            try:
                worker.forward_done(self._stream())
            except Exception as e:
                self._error("forward_done", e)

    def drain(self, request_ids: list[str]) -> None:
        """Wait for the jobs of the preempted and the fenced requests only: their device blocks are reused by this
        step; other requests' copies keep running."""
        # Every group's: a block one group's request gave back may be handed out in any group.
        for worker in self._all():
            try:
                wait = getattr(worker, "wait_for_requests", None)
                if wait is not None:
                    wait(list(request_ids))
                else:  # a backend without per-request waits
                    worker.wait_idle()
            except Exception as e:
                self._error("wait_for_requests", e)

    def drain_all(self) -> None:
        """Wait for every request's jobs (the scheduler side lost a step's fence): any device block may be reused."""
        for worker in self._all():
            try:
                worker.wait_for_all_requests()
            except Exception as e:
                self._error("wait_for_all_requests", e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._finish(finished_req_ids)
        return sending, recving

    def transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's ``KVConnectorTransferResults``: with several KV cache groups a failed load is named by its request in
        ``failed_recving`` (vLLM recomputes it whole; ``Scheduler._handle_invalid_blocks`` raises on block ids then)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving, failed = self._finish(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=set(failed))

    def _finish(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None, set[str]]:
        reports: list[Any] = []
        for worker in self._all():
            try:
                saved, loaded, load_failed = worker.get_finished(sorted(finished_req_ids))
            except Exception as e:
                self._error("get_finished", e)
                reports.append(None)
                continue
            for r in loaded:
                _trace("loaded", r)
            reports.append((list(saved), list(loaded), list(load_failed)))
        # Delayed frees once saved, loads once over (failed ones too), per group as the metadata named them.
        return self._books.finish(reports)

    def take_load_errors(self) -> set[int]:
        errs: list[int] = []
        for worker in self._all():
            try:
                errs.extend(int(b) for b in worker.take_load_errors())
            except Exception as e:
                self._error("take_load_errors", e)
        return self._books.take_load_errors(errs)

    def take_reports(self) -> KvtierWorkerMetadata | None:
        reports: list[bytes] = []
        groups: list[int] = []
        for g, worker in enumerate(self._all()):
            try:
                blob = bytes(worker.take_reports())
            except Exception as e:
                self._error("take_reports", e)
                continue
            if blob:
                reports.append(blob)
                groups.append(g)
        return KvtierWorkerMetadata(reports=reports, groups=groups) if reports else None

    def cumulative_stats(self) -> dict[str, float]:
        s: dict[str, float] = {}
        for worker in self._all():
            try:
                for k, v in dict(worker.stats()).items():
                    s[f"worker_{k}"] = s.get(f"worker_{k}", 0) + v
            except Exception as e:
                self._error("stats", e)
        s["adapter_errors"] = s.get("adapter_errors", 0) + self._errors
        s["early_sync_steps"] = s.get("early_sync_steps", 0) + self._early_steps
        return s

    def take_stats_delta(self) -> dict[str, float]:
        # The worker's own numbers are gauges; its failures are the one counter vLLM should aggregate.
        delta = self._errors - self._last_stats.get("adapter_errors", 0)
        self._last_stats["adapter_errors"] = self._errors
        return {"adapter_errors": delta} if delta else {}

    def shutdown(self) -> None:
        for worker in self._all():
            try:
                worker.shutdown()
            except Exception as e:
                self._error("shutdown", e)
