"""The worker half of :mod:`kvtier.vllm` (one per vLLM model-runner process): hands vLLM's per-layer tensors to
kvtier's Rust worker, relays its completions, and carries its job reports back to the scheduler side in the worker
metadata. It only translates; the rules live in the Rust worker.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ._vllm_meta import KvtierConnectorMetadata, KvtierWorkerMetadata
from ._vllm_util import _backend, _trace

logger = logging.getLogger("kvtier.vllm")


class _WorkerSide:
    """Translation of the worker's calls: hands vLLM's per-layer tensors to kvtier's worker, relays its
    completions, and carries its job reports back to the scheduler side in the worker metadata. Requests whose
    load the scheduler side had to refuse are failed here, exactly like failed transfers."""

    def __init__(self, settings: dict[str, Any], block_size: int) -> None:
        self._settings = settings
        self._block_size = block_size
        self._worker: Any = None
        self._errors = 0
        self._failed_recv: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._awaiting_save: set[str] = set()
        self._last_stats: dict[str, float] = {}
        # The engine's current CUDA stream, as a raw handle (set in register when the KV cache is on a GPU).
        self._current_stream: Any = None
        # Layer name -> index in the registered layout (vLLM's kv_caches order); a step's layered loads.
        self._layer_index: dict[str, int] = {}
        self.layered_step = False

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
        tensors = [(name, describe(t)) for name, t in kv_caches.items()]
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._worker = core.Worker(self._settings, tensors)
        # Decided once: asking torch whether CUDA is there costs more than the rest of a decode step's hooks.
        cuda = [t for t in kv_caches.values() if getattr(t, "is_cuda", False)]
        if cuda:
            idx = cuda[0].device.index
            dev = int(idx) if idx is not None else int(torch.cuda.current_device())
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton launches on; no Stream object
            self._current_stream = (lambda: raw(dev)) if raw is not None else \
                (lambda: torch.cuda.current_stream(dev).cuda_stream)

    def start_step(self, meta: KvtierConnectorMetadata, layer_hooks: bool = False) -> None:
        self._awaiting_save.update(meta.delayed_frees)
        for rid, blocks in meta.failed_loads.items():
            if rid in meta.failed_loads_async:
                # vLLM waits for the request in finished_recving; a sync load is only failed by its blocks.
                self._failed_recv.add(rid)
            self._failed_blocks.update(blocks)
        if self._worker is None or not meta.plan:
            return
        _trace("start_load")
        try:
            self._worker.bind(meta.plan)
            # Layered only where vLLM calls wait_for_layer_load before every attention layer (layer_hooks);
            # the worker decides whether the step has loads to layer (its `layered_sync_loads` setting).
            self._worker.start_load(self._stream(), bool(meta.sync_loads and layer_hooks))
            self.layered_step = bool(self._worker.has_layered_loads())
        except Exception as e:
            self._error("start_load", e)
            return
        if meta.sync_loads and not self.layered_step:
            # vLLM calls start_load_kv before the forward pass only when the step has sync loads: complete them
            # here, every layer at once. A failed load raises TransferError; its blocks are then reported by
            # get_block_ids_with_load_errors and vLLM recomputes them, so it is not an adapter error.
            try:
                self._worker.wait_for_layer_load(0, self._stream())
            except Exception as e:
                if type(e).__name__ == "TransferError":
                    logger.warning("kvtier: a load failed; vLLM recomputes its blocks: %s", e)
                else:
                    self._error("wait_for_layer_load", e)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: the engine's stream waits for that layer's copies (a name the
        registered layout does not know waits for every layer)."""
        if self._worker is None:
            return
        try:
            self._worker.wait_for_layer_load(self._layer_index.get(layer_name), self._stream())
        except Exception as e:
            self._error("wait_for_layer_load", e)

    def forward_done(self) -> None:
        self.layered_step = False
        if self._worker is None:
            return
        try:
            self._worker.forward_done(self._stream())
        except Exception as e:
            self._error("forward_done", e)

    def drain(self, request_ids: list[str]) -> None:
        """Wait for the jobs of the preempted and the fenced requests only: their device blocks are reused by this
        step; other requests' copies keep running."""
        if self._worker is None:
            return
        try:
            wait = getattr(self._worker, "wait_for_requests", None)
            if wait is not None:
                wait(list(request_ids))
            else:  # a backend without per-request waits
                self._worker.wait_idle()
        except Exception as e:
            self._error("wait_for_requests", e)

    def drain_all(self) -> None:
        """Wait for every request's jobs (the scheduler side lost a step's fence): any device block may be reused."""
        if self._worker is None:
            return
        try:
            self._worker.wait_for_all_requests()
        except Exception as e:
            self._error("wait_for_all_requests", e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        if self._worker is not None:
            try:
                saved, loaded, load_failed = self._worker.get_finished(sorted(finished_req_ids))
                # vLLM frees a request's blocks at once unless request_finished said True, and then must not
                # hear of it again.
                done = self._awaiting_save.intersection(saved)
                self._awaiting_save -= done
                sending.update(done)
                # A failed load is reported finished too; its blocks are in get_block_ids_with_load_errors.
                recving.update(loaded)
                recving.update(load_failed)
                for r in loaded:
                    _trace("loaded", r)
            except Exception as e:
                self._error("get_finished", e)
        if self._failed_recv:
            recving |= self._failed_recv
            self._failed_recv = set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        errs = set(self._failed_blocks)
        self._failed_blocks = set()
        if self._worker is not None:
            try:
                errs.update(int(b) for b in self._worker.take_load_errors())
            except Exception as e:
                self._error("take_load_errors", e)
        return errs

    def take_reports(self) -> KvtierWorkerMetadata | None:
        if self._worker is None:
            return None
        try:
            blob = bytes(self._worker.take_reports())
        except Exception as e:
            self._error("take_reports", e)
            return None
        return KvtierWorkerMetadata(reports=[blob]) if blob else None

    def cumulative_stats(self) -> dict[str, float]:
        s: dict[str, float] = {}
        if self._worker is not None:
            try:
                s = {f"worker_{k}": v for k, v in dict(self._worker.stats()).items()}
            except Exception as e:
                self._error("stats", e)
        s["adapter_errors"] = s.get("adapter_errors", 0) + self._errors
        return s

    def take_stats_delta(self) -> dict[str, float]:
        # The worker's own numbers are gauges; its failures are the one counter vLLM should aggregate.
        delta = self._errors - self._last_stats.get("adapter_errors", 0)
        self._last_stats["adapter_errors"] = self._errors
        return {"adapter_errors": delta} if delta else {}

    def shutdown(self) -> None:
        if self._worker is not None:
            try:
                self._worker.shutdown()
            except Exception as e:
                self._error("shutdown", e)
