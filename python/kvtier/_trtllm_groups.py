"""Sliding-window and variable sliding-window attention (VSWA) under TensorRT-LLM 1.4's
KVCacheManagerV2: one kvtier leader and worker per attention window. Used by :mod:`kvtier.trtllm`.

TensorRT-LLM's contract (``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``,
``kv_cache_layout.py``, ``kv_cache/kv_cache_manager_v2.py`` and
``docs/source/features/kv-cache-connector.md``, "Running under VSWA" / "Blocks with no page"):

* the KV cache has one layer group per attention window (``KvCacheLayerGroupLayout.window_size``,
  None for full attention; a ``max_attention_window`` entry equal to ``max_seq_len`` is full
  attention) with its own pools, and a page index is scoped to its group;
* with several groups the scheduler gets ``update_state_after_alloc_by_layer_group`` and
  ``request_finished_by_layer_group`` and ``RequestData.new_block_ids_by_layer_group`` (the flat
  lists are empty); with one group the flat forms (a sliding window's flat list included);
* a block with no page in a group (``_stale_block_range``: blocks before
  ``(history + 1 - window) // tokens_per_block``) is ``-1`` (``BAD_PAGE_INDEX``) in place; the
  manager reclaims such a page while the request runs and may hand it to another request.

kvtier's side, as for vLLM's hybrid groups (``docs/arch/trtllm.md``, "Sliding windows"):

* one ``_native.Leader`` / ``_native.Worker`` per window, in kvtier's own order (full attention
  first, then windows ascending): with several, each has the group's index (keys salted by it, its
  share of the tiers, its own disk files) and a window group its window;
* page ids go to the leaders raw: ``-1`` is kvtier's slot hole (``HOLE``, the window group's null
  block): never loaded, never stored, and trailing ``-1`` of an allocation are pages not allocated
  yet (the leader's rule, ``unpaged.rs``); a hit is claimed only
  when every group supplies its part (``_native.match_groups``), and a window group loads and stores
  only the window of the hit's end (``Leader.set_window``: the same formula as ``_stale_block_range``);
* a failed asynchronous load is recomputed from the lowest token any group's load verdict names
  (``AllGroups.finish_by_verdict``); rank 0's leaders' verdicts reach every rank in the same
  ``get_finished`` round, one blob per group, and with ranks in other processes each group's
  leader has its own ZeroMQ endpoint;
* TensorRT-LLM's group ids are mapped to kvtier's groups by their window, from the layout rank 0's
  worker registered (the scheduler and rank 0's worker share a process).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from . import _native
from ._native import ConfigError
from ._trtllm_refusals import engine_windows

logger = logging.getLogger("kvtier.trtllm")

#: kvtier's slot hole (``crates/kvtier/src/connector/slot/table.rs`` ``HOLE``): a block with no page.
HOLE = 0xFFFF_FFFF

__all__ = ["HOLE", "engine_windows", "group_settings", "SchedulerGroups", "WorkerGroups"]


def _key(window: Optional[int]) -> str:
    return "full" if window is None else f"w{int(window)}"


def group_settings(base: dict, windows: list, endpoints: Optional[list] = None) -> list:
    """One kvtier leader's (and worker's) settings per window of ``windows`` (kvtier's order); with
    ranks in other processes each group's leader has its own ZeroMQ endpoint (``endpoints``, the
    same order)."""
    if endpoints is not None and len(endpoints) != len(windows):
        raise ConfigError(f"kvtier: {len(endpoints)} leader endpoints reached a rank with {len(windows)} layer "
                          f"groups (windows {windows}): rank 0 and this rank see different models")
    out = []
    for i, w in enumerate(windows):
        s = dict(base)
        if endpoints is not None:
            s["zmq_endpoint"] = endpoints[i]
        if len(windows) > 1:
            s["channel"] = f"{base['channel']}-{_key(w)}"
            s.update(kv_cache_group=i, kv_cache_groups=len(windows), kv_cache_group_kind=f"trtllm-attention:{w}")
            # Every group answers alike whether a hit loads asynchronously: in the step (connector.sync_host_loads)
            # only when every group's part lies in the host tier (kvtier::connector::groups::match_groups).
        if w is not None:
            s.update(sliding_window=int(w), null_block=HOLE)
        out.append(s)
    return out


class SchedulerGroups:
    """The scheduler's leaders, one per window."""

    def __init__(self, settings: list, engine: Any):
        self.windows = [s.get("sliding_window") for s in settings]
        self.leaders = [_native.Leader(s) for s in settings]
        self._engine = engine
        self._match = _native.match_groups if len(self.leaders) > 1 else None

    def _order(self, n: int) -> list:
        """kvtier's group index of each of TensorRT-LLM's ``n`` layer groups."""
        if n == 1 and len(self.leaders) == 1:
            return [0]
        order = self._engine.group_order
        if order is None or len(order) != n:
            raise ConfigError(f"TensorRT-LLM reported {n} layer groups, rank 0's worker registered "
                              f"{None if order is None else len(order)} (windows {self.windows})")
        return order

    def match(self, rid: str, tokens: Any, num_computed: int, identity: Optional[str], cacheable: bool) -> int:
        if self._match is None:
            return int(self.leaders[0].get_num_new_matched_tokens(rid, tokens, num_computed, identity=identity,
                                                                  cacheable=cacheable))
        return int(self._match(self.leaders, rid, list(tokens), num_computed, identity=identity,
                               cacheable=cacheable))

    def allocate(self, rid: str, by_group: Sequence[Sequence[int]]) -> Optional[int]:
        """Each group's table of the allocation; where the asynchronous load starts (the lowest)."""
        starts = []
        for g, ids in zip(self._order(len(by_group)), by_group):
            # Raw page ids: the leader drops trailing -1 (not allocated yet) and keeps earlier ones as holes.
            s = self.leaders[g].allocate_offer(rid, [int(b) for b in ids])
            if s is not None:
                starts.append(int(s))
        return min(starts) if starts else None

    def build(self, records: list) -> tuple:
        """``records``: (rid, tokens, by_group ids, computed, scheduled, is_new, priorities) per request; one
        metadata blob per group, in kvtier's order."""
        per = [[] for _ in self.leaders]
        for rid, tokens, by_group, computed, scheduled, is_new, prio in records:
            order = self._order(len(by_group)) if by_group else list(range(len(self.leaders)))
            ids = {g: [int(x) for x in b] for g, b in zip(order, by_group)} if by_group else {}
            for g in range(len(self.leaders)):
                rec = (rid, tokens, ids.get(g, []), computed, scheduled, 0, is_new)
                per[g].append(rec + (False, prio) if prio else rec)
        return tuple(bytes(l.build_step(r)) for l, r in zip(self.leaders, per))

    def build_output(self, scheduler_output: Any) -> tuple:
        """One metadata blob per layer group from TensorRT-LLM's ``SchedulerOutput``: each group's page ids
        (``new_block_ids_by_layer_group``; the flat ``new_block_ids`` with one sliding-window group), ``-1`` as
        holes."""
        records = []
        for is_new, group in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for rd in group:
                by_group = [list(g) for g in (getattr(rd, "new_block_ids_by_layer_group", None) or [])]
                if not by_group:
                    by_group = [list(rd.new_block_ids)]
                prio = getattr(rd, "priorities", None)
                records.append((str(rd.request_id), rd.new_tokens, by_group, rd.computed_position,
                                rd.num_scheduled_tokens, is_new, [int(x) for x in prio] if prio else None))
        return self.build(records)

    def finished(self, rid: str) -> bool:
        # Every group is told (each releases its own books); True while any group has copies in flight.
        return any([bool(l.request_finished(rid)) for l in self.leaders])

    def each(self, method: str, *args: Any) -> None:
        for l in self.leaders:
            getattr(l, method)(*args)


class WorkerGroups:
    """A rank's workers, one per window, and the request ids each reported (TensorRT-LLM learns an id
    only once every group reported it)."""

    def __init__(self, workers: list):
        self.workers = workers
        # Which requests every group reported (kvtier::connector::AllGroups).
        self._books = _native.AllGroups(len(workers))

    def bind(self, metadata: Any) -> None:
        if not isinstance(metadata, tuple) or len(metadata) != len(self.workers):
            raise ConfigError(f"kvtier: connector metadata for {len(metadata) if isinstance(metadata, tuple) else 1} "
                              f"layer groups reached {len(self.workers)} group workers")
        for w, blob in zip(self.workers, metadata):
            w.bind(blob)

    def start_load(self, stream: Optional[int]) -> None:
        for w in self.workers:
            w.start_load(stream)
        for w in self.workers:
            w.wait_for_layer_load(0, stream)

    def forward_done(self, stream: Optional[int]) -> None:
        for w in self.workers:
            w.forward_done(stream)

    def take_load_errors(self) -> list:
        return [b for w in self.workers for b in w.take_load_errors()]

    def get_finished_by_verdict(self, verdicts: list, finished: list, started: list, rewindable: set) -> tuple:
        """(saved, loaded, [(request, recompute_from)]) that every group reported: each group's worker
        applies its own leader's load verdicts (``verdicts``: rank 0's leaders' blobs, one tuple per
        round in kvtier's group order, the same on every rank), and a failed load recomputes from the
        lowest token any group named (``AllGroups.finish_by_verdict``, which also withholds loads of
        requests not in ``rewindable``)."""
        for blobs in verdicts:
            if len(blobs) != len(self.workers):
                raise ConfigError(f"kvtier: load verdicts of {len(blobs)} layer groups reached a rank with "
                                  f"{len(self.workers)}")
            for w, blob in zip(self.workers, blobs):
                w.apply_load_verdicts(blob)
        reports = []
        for w in self.workers:
            reports.append(tuple(list(x) for x in w.get_finished_by_verdict(finished, started)))
        return self._books.finish_by_verdict(reports, rewindable)

    def load_recovery(self) -> tuple:
        """(recomputed, unrecoverable) failed loads (``AllGroups.load_recovery``)."""
        return tuple(self._books.load_recovery())

    def wait_idle(self) -> None:
        for w in self.workers:
            w.wait_idle()


def layout_groups(layout: Any, windows: list) -> list:
    """kvtier's group index of each of the layout's layer groups (by window), checked against the
    windows the engine's settings declare."""
    got = [getattr(g, "window_size", None) for g in layout.groups]
    norm = [None if w is None else int(w) for w in got]
    if sorted(set(norm), key=lambda w: (w is not None, w or 0)) != windows or len(set(norm)) != len(norm):
        raise ConfigError(f"KvCacheLayout has layer groups with windows {got}; kvtier expected one group per "
                          f"window {windows} (kv_cache_config.max_attention_window / the model's config.json)")
    return [windows.index(w) for w in norm]


__all__ += ["layout_groups", "engine_windows"]
