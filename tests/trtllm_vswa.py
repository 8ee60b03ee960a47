"""The 1.4 executor driver (``trtllm_driver.FakeTrtllmEngine``) with sliding-window and variable
sliding-window attention (VSWA) on KVCacheManagerV2, one rank or several.

Modelled (TensorRT-LLM 1.4, ``tensorrt_llm/_torch/pyexecutor/...``):

* layer groups: one per distinct attention window, with its own page pool and page-id space
  (``connectors/kv_cache_layout.py`` ``KvCacheLayerGroupLayout``: ``layer_group_id``, ``layer_ids``,
  ``window_size`` None for full attention; ``KvCacheConnectorWorker.register_kv_cache_layout``); an
  entry of ``max_attention_window`` equal to ``max_seq_len`` is full attention
  (``kv_cache/kv_cache_manager_v2.py``, as its tests configure ``[window, max_seq_len]``). The group
  order is TensorRT-LLM's (``group_order`` picks first-layer order or its reverse, so an adapter that
  assumes one order is caught);
* pages a window passed: a group with window ``w`` holds no page for block ordinals below
  ``(history + 1 - w) // tokens_per_block`` (``kv_cache_manager_v2.py`` ``_stale_block_range``); they
  are reported ``-1`` (``BAD_PAGE_INDEX``) in place and the page goes back to the pool while the
  request runs (the docs' "What a connector can persist under a sliding window"), where the next
  allocation may take it. A connector hit's allocation starts at the served end, so the window group
  has pages only for the window of the hit's end (``_resize_for_connector_prefix`` sets
  ``history_length`` to it);
* callbacks: with several groups ``update_state_after_alloc_by_layer_group`` /
  ``request_finished_by_layer_group`` and ``RequestData.new_block_ids_by_layer_group`` (append deltas by
  ordinal, ``update_and_build_data``), the flat lists empty; with one group the flat forms
  (``connectors/kv_cache_connector.py`` ``KvCacheConnectorManager.request_finished`` /
  ``KvCacheConnectorSchedulerOutputRequest.update_and_build_data``); V2's first-chunk-only allocation;
* a reused page holds what it held until a forward writes it: garbage lands after the step's
  metadata is bound (``_after_bind``), not at allocation, so a connector's store still reading a
  page the window released is caught only if it is not fenced.

Tensor parallelism: every rank has the same layer groups and page ids, and its share of the KV heads
(``KvCacheLayout`` per rank); ranks > 0 in this process report to each group's leader through the
driver (link "engine"), or over ZeroMQ when they are processes.

Not modelled: device prefix reuse across requests (``num_computed_tokens`` is always 0),
attention sinks (``num_sink_tokens`` is None in 1.4's configurations).

Checks: a sliding layer's forward reads exactly the positions its window reaches
(``[start + 1 - w, start)``), each holding what the model wrote; a full layer reads its whole prefix.
"""

from __future__ import annotations

from typing import Any, Optional

from trtllm_driver import FakeTrtllmEngine, drain
from trtllm_model import (CONTEXT_STATES, BlockManager, Geometry, KvCacheLayerGroupLayout, KvCacheLayout,
                          KvCacheRegion, LlmRequestState, RequestData, make_pool)

BAD_PAGE_INDEX = -1


class VswaEngine(FakeTrtllmEngine):
    """``windows``: one entry per layer, the window in tokens or None for full attention."""

    def __init__(self, scheduler_cls: Optional[type], worker_cls: Optional[type], *, windows: list,
                 geo: Geometry, group_order: str = "first-layer", max_seq_len: int = 4096, **kw: Any):
        assert len(windows) == geo.num_layers
        groups: list = []
        for w in windows:
            if w not in groups:
                groups.append(w)
        if group_order == "reversed":
            groups.reverse()
        self.group_windows = groups
        self.group_layers = [[i for i, w in enumerate(windows) if w == gw] for gw in groups]
        self.where = {layer: (g, k) for g, ls in enumerate(self.group_layers) for k, layer in enumerate(ls)}
        self.pending_garbage: list = []
        self.reported_groups: dict = {}
        user = kw.pop("configure", None)

        def configure(a: Any) -> None:
            a.max_seq_len = max_seq_len
            a.kv_cache_config.max_attention_window = [max_seq_len if w is None else w for w in windows]
            a.kv_cache_config.use_kv_cache_manager_v2 = True
            if user is not None:
                user(a)

        super().__init__(scheduler_cls, worker_cls, geo=geo, manager="v2", configure=configure, **kw)

    # ----- pools, one per layer group -------------------------------------------------------------

    def _make_pools(self, pool_kind: str, num_device_blocks: int) -> dict:
        self.group_geo = [Geometry(num_layers=len(ls), kv_heads=self.geo.kv_heads, head_dim=self.geo.head_dim,
                                   tokens_per_block=self.geo.tokens_per_block, world_size=self.geo.world_size)
                          for ls in self.group_layers]
        return {r: [make_pool(pool_kind, num_device_blocks, g) for g in self.group_geo] for r in self.comm.local}

    def _make_blocks(self, num_device_blocks: int) -> Any:
        # No garbage at allocation: a reused page changes when a forward writes it (_after_bind).
        return [BlockManager(num_device_blocks, []) for _ in self.group_layers]

    def _layout(self, rank: int) -> Any:
        groups = []
        for g, pool in enumerate(self.pools[rank]):
            one = pool.layout().groups[0]
            groups.append(KvCacheLayerGroupLayout(g, tuple(self.group_layers[g]), self.group_windows[g], one.regions))
        return KvCacheLayout(self.geo.tokens_per_block, tuple(groups))

    def relay_reports(self) -> None:
        """Ranks > 0 in this process (link "engine"): each group's worker reports to its group's leader."""
        if self.scheduler is None:
            return
        for r, w in self.workers.items():
            if r > 0:
                for leader, native in zip(self.scheduler.leaders, getattr(w, "natives", [])):
                    blob = native.take_reports()
                    if blob:
                        leader.apply_reports(blob)

    def _columns(self, rank: int) -> slice:
        """This rank's share of the model's heads (tensor parallelism splits the KV heads)."""
        g = self.geo
        return slice(rank * g.heads_per_rank * g.head_dim, (rank + 1) * g.heads_per_rank * g.head_dim)

    def _after_bind(self) -> None:
        for g, pages in self.pending_garbage:
            for pools in self.pools.values():
                pools[g].fill_garbage(pages)
        self.pending_garbage = []

    def _take(self, g: int, n: int) -> list:
        pages = self.blocks[g].allocate(n)
        self.pending_garbage.append((g, pages))
        return pages

    def _stale_end(self, g: int, history: int) -> int:
        """``_stale_block_range``: ordinals below this have no page in group ``g``."""
        w = self.group_windows[g]
        return 0 if w is None else max(0, (history + 1 - w) // self.geo.tokens_per_block)

    # ----- admission and allocation ---------------------------------------------------------------

    def _release_stale(self) -> None:
        """The window passed these pages: -1 in place, the page back to the pool."""
        for req in self.running:
            hist = req.context_current_position if req.state in CONTEXT_STATES else len(req._tokens) - 1
            for g, table in enumerate(self.tables[req.request_id]):
                end = min(self._stale_end(g, hist), len(table))
                gone = [b for b in table[:end] if b != BAD_PAGE_INDEX]
                if gone:
                    table[:end] = [BAD_PAGE_INDEX] * end
                    self.blocks[g].release(gone)

    def _reserved_in(self, g: int) -> int:
        tpb = self.geo.tokens_per_block
        out = 0
        pending = [m[0] for m in self.matched_pending]
        for req in list(self.running) + list(self.loading.values()) + pending:
            total = -(-(req.prompt_len + req.max_new_tokens + 1) // tpb)
            out += max(0, total - len(self.tables[req.request_id][g]))
        return out

    def _admit(self) -> None:
        self._release_stale()
        tpb = self.geo.tokens_per_block
        if self.alloc_delay:
            # V2 matches and allocates apart (``alloc_delay``): last iteration's matches first.
            pending, self.matched_pending = self.matched_pending, []
            for item in pending:
                self._allocate(*item)
        while self.waiting and len(self.running) + len(self.loading) + len(self.matched_pending) < \
                self.max_num_requests:
            req = self.waiting[0]
            total = -(-(req.prompt_len + req.max_new_tokens + 1) // tpb)
            if any(bm.available() - self._reserved_in(g) < total for g, bm in enumerate(self.blocks)):
                break
            n, is_async = self._match(req, 0) if self.workers else (0, False)
            self.waiting.pop(0)
            if self.alloc_delay:
                self.matched_pending.append((req, 0, n, is_async))
                self.tables[req.request_id] = [[] for _ in self.group_layers]
                continue
            self._allocate(req, 0, n, is_async)

    def _allocate(self, req: Any, num_computed: int, n: int, is_async: bool) -> None:
        tpb = self.geo.tokens_per_block
        first = n + min(self.chunk_size, req.prompt_len - n)  # V2: the first chunk after the served prefix
        want = -(-first // tpb)
        tables = []
        for g in range(len(self.group_layers)):
            stale = min(self._stale_end(g, n), want)
            tables.append([BAD_PAGE_INDEX] * stale + self._take(g, want - stale))
        self.tables[req.request_id] = tables
        self._allocated += 1
        if self.scheduler is not None:
            if len(tables) > 1:
                self.scheduler.update_state_after_alloc_by_layer_group(req, [list(t) for t in tables])
            else:
                self.scheduler.update_state_after_alloc(req, list(tables[0]))
        req.context_current_position = n
        req.kv_len = n
        req.py_num_connector_matched_tokens = n
        self.external_loads[req.request_id] = n
        self.stats.matched_tokens += n
        if n:
            if is_async:
                self.stats.async_matches += 1
            else:
                self.stats.sync_matches += 1
        if is_async:
            req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
            self.loading[req.request_id] = req
            self.new_loading.append(req.request_id)
        else:
            self.running.append(req)

    def _ensure_blocks(self, req: Any, upto_positions: int) -> None:
        need = -(-upto_positions // self.geo.tokens_per_block)
        for g, table in enumerate(self.tables[req.request_id]):
            if need > len(table):
                table.extend(self._take(g, need - len(table)))

    def _request_data(self, req: Any, n_sched: int) -> Any:
        tokens = req.get_tokens(0)[: req.visible]
        tables = self.tables[req.request_id]
        n_tok, _ = self.reported.get(req.request_id, (0, 0))
        seen = self.reported_groups.get(req.request_id, [0] * len(tables))
        self.reported[req.request_id] = (len(tokens), 0)
        self.reported_groups[req.request_id] = [len(t) for t in tables]
        computed = req.context_current_position if req.state in CONTEXT_STATES else len(tokens) - 1
        computed -= self.external_loads.get(req.request_id, 0)
        by_group = [list(t[s:]) for t, s in zip(tables, seen)]
        flat = by_group[0] if len(by_group) == 1 else []
        return RequestData(req.request_id, tokens[n_tok:], flat, computed, n_sched, cache_salt=req.cache_salt,
                           new_block_ids_by_layer_group=by_group)

    # ----- the forward pass --------------------------------------------------------------------

    def _check_prefix(self, rank: int, req: Any, layer: int, n: int, what: str) -> None:
        if n == 0 or not self.verify:
            return
        g, local = self.where[layer]
        w = self.group_windows[g]
        lo = 0 if w is None else max(0, n + 1 - w)
        table = self.tables[req.request_id][g]
        tpb = self.geo.tokens_per_block
        assert all(b != BAD_PAGE_INDEX for b in table[lo // tpb: -(-n // tpb)]), (
            f"{what}: request {req.request_id} layer {layer}: the window reads a block without a page: {table}")
        for plane in (0, 1):
            got = self.pools[rank][g].read_positions(table, local, plane, n)[lo:]
            want = self._expected(req, layer, plane, n)[lo:, self._columns(rank)]
            if not (got == want).all():
                bad = [i for i in range(len(got)) if not (got[i] == want[i]).all()]
                pos = lo + bad[0]
                raise AssertionError(
                    f"{what}: request {req.request_id} rank {rank} layer {layer} (window {w}) plane {plane}: KV of "
                f"{len(bad)} of "
                    f"{n - lo} positions differs from the model, first at position {pos} "
                    f"(page {table[pos // tpb]} of group {g})")

    def _compute(self, rank: int, req: Any, layer: int, start: int, n: int) -> None:
        if not self.compute:
            return
        g, local = self.where[layer]
        tpb = self.geo.tokens_per_block
        table = self.tables[req.request_id][g]
        for plane in (0, 1):
            vals = self._expected(req, layer, plane, start + n)[start:start + n, self._columns(rank)]
            p = start
            while p < start + n:
                b, s0 = divmod(p, tpb)
                k = min(tpb - s0, start + n - p)
                assert table[b] != BAD_PAGE_INDEX, (
                    f"request {req.request_id} layer {layer} (window {self.group_windows[g]}) writes position {p} "
                    f"into a block without a page (-1 in group {g}): {table}")
                self.pools[rank][g].write(table[b], local, plane, s0, vals[p - start:p - start + k])
                p += k

    def _register_full_blocks(self, req: Any) -> None:
        self._produced(req)  # no device prefix reuse modelled

    # ----- finishing ---------------------------------------------------------------------------

    def _request_finished(self, req: Any, loading: bool) -> None:
        tables = self.tables[req.request_id]
        res = False
        if self.scheduler is not None:
            if len(tables) > 1:
                res = self.scheduler.request_finished_by_layer_group(req, [list(t) for t in tables])
            else:
                res = self.scheduler.request_finished(req, list(tables[0]))
        in_flight = self.comm.bcast(res) if self.workers else False
        assert isinstance(in_flight, bool)
        if loading and not in_flight:
            raise AssertionError(f"request {req.request_id} was cancelled with its load in flight and the connector "
                                 "let its pages go")
        if in_flight:
            self.async_save_seen += 1
            req.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
            self.saving[req.request_id] = (req, tables)
            self.new_saving.append(req.request_id)
        else:
            self._free(req.request_id)

    def _free(self, rid: int, keep_expected: bool = False) -> None:
        for g, table in enumerate(self.tables.pop(rid)):
            self.blocks[g].release([b for b in table if b != BAD_PAGE_INDEX])
        self.reported_groups.pop(rid, None)
        if not keep_expected:
            self.expected_cache = {k: v for k, v in self.expected_cache.items() if k[0] != rid}

    def run(self, max_steps: int = 10_000, min_seconds: float = 60.0) -> None:
        def settle() -> None:
            for w in self.workers.values():
                for native in getattr(w, "natives", []):
                    native.wait_idle()

        drain(self, settle, max_steps, min_seconds)
