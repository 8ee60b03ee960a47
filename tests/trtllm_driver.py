"""A stand-in for TensorRT-LLM's PyTorch executor (1.4 sources; 1.2/1.3 where they differ) that drives
a KV connector as rudely as the real one, over KV pools checked byte for byte.

Modelled (file: tensorrt_llm/_torch/pyexecutor/...):

* bring-up (``py_executor_creator.py``): scheduler (rank 0) and every rank's worker constructed
  concurrently in threads; ``register_forward_pass_callable()`` right after construction; the
  callable then runs after *every* forward, including ``warmup_forwards`` KV-cache estimation /
  warmup forwards that run before ``register_kv_caches`` (``model_engine.py``); then
  ``register_kv_caches(pool)`` (V1) or ``register_kv_cache_layout(layout)`` (KVCacheManagerV2,
  ``connectors/kv_cache_layout.py``) on every rank in parallel, then ``wait_for_initialization``;
* layer hooks (``connectors/kv_cache_connector.py`` ``layer_pre_hook``/``layer_post_hook``) only
  where they run: ``layer_hooks="eager"`` every forward (``cuda_graph_config=None``: no CUDA
  graph); ``"graphs"`` (default, TorchLlmArgs' default ``CudaGraphConfig``) not under CUDA-graph
  replay of decode-only batches nor for a batch whose context chunks are one token each
  (``model_engine.py`` ``_make_single_token_context_graph_batch``); ``"none"`` never (1.4 installs
  none when ``requires_layerwise_transfer_hooks()`` is False). ``start_load_kv`` runs only when
  metadata was bound (1.4 ``start_worker_batch``);
* both executor loops (``py_executor.py``): ``loop="plain"`` (``_executor_loop``) and
  ``loop="overlap"`` (``_executor_loop_overlap``, default): batch N+1 is scheduled, allocated and its
  metadata built before N's sampled tokens are written back (generation ``RequestData`` lag one
  token) and ``request_finished`` for a request that ended at N comes after N+1 (which still ran
  it) was launched;
* blocks (``resource_manager.py``): V1 allocates all prompt blocks at ``add_sequence`` and reports
  them to ``update_state_after_alloc``; generation blocks one at a time, reported later as
  ``new_block_ids``; device prefix reuse (salted by ``cache_salt``) gives ``num_computed_tokens`` > 0
  and shared blocks. ``external_loads`` is cleared at every ``build_scheduler_output``, so an
  async-loaded request's first record already counts the loaded tokens. V2 (``manager="v2"``):
  Python ``LlmRequest`` with ``is_generation_only_request()`` a method, first-chunk-only allocation,
  matching and allocation one iteration apart (``alloc_delay``) with ``cancel_load`` when the device
  cache overtook the offer, ``request_reset``;
* the manager (``connectors/kv_cache_connector.py`` ``KvCacheConnectorManager``): matching runs on
  rank 0 and is broadcast; ``(0, True)`` and generation-only requests raise as upstream does;
  async-loading requests are parked; metadata broadcast (pickled) to every rank; ``get_finished``
  ids acted on only once every rank reported them (allgather + intersection); a worker may only
  return ids it was given; ``request_finished`` True keeps the blocks until saved;
* ranks: all in this process (``Comm``) or one per process (``PipeComm``, ZeroMQ between them), each
  with its own ``LlmRequest`` objects then; every rank runs the same batch each step (checked across
  processes: the forward's collectives pair the ranks' work up).

Checks: before each layer's compute every position a scheduled request reads holds exactly what the
model writes, on every rank; new blocks are filled with garbage; blocks are never freed while a load
into them may be in flight (a connector must answer ``request_finished`` True then); kvtier never
offers a request blocks no request of its tenant (cache salt) and model computed (``produced``).
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from trtllm_model import (  # noqa: F401  (re-exported for tests)
    CONTEXT_STATES,
    BlockManager,
    Comm,
    PipeComm,
    _RankManager,
    DEFAULT_MODEL_SEED,
    VOCAB,
    Geometry,
    LegacyRequestData,
    LlmArgs,
    LlmRequest,
    LlmRequestState,
    LlmRequestV2,
    RequestData,
    RequestData13,
    SchedulerOutput,
    _mix,
    expected_kv,
    make_pool,
    next_token,
    prefix_hashes,
)


@dataclass
class EngineStats:
    steps: int = 0
    matched_tokens: int = 0
    sync_matches: int = 0
    async_matches: int = 0
    hook_free_forwards: int = 0
    cancel_loads: int = 0
    device_and_connector: int = 0  # matches on top of a device prefix (num_computed_tokens > 0)


def drain(engine: Any, settle: Callable[[], None], max_steps: int, min_seconds: float) -> None:
    """Step ``engine`` until a step has nothing left to do, then ``settle`` (wait for kvtier's copies) and relay the
    ranks' reports. A real executor iterates as fast as it can while loads complete, so a step count alone is not a
    bound on a loaded machine (10,000 idle steps take ~0.1 s; one slow disk read outlasts them): the engine is
    declared stuck only once it used ``max_steps`` steps *and* ``min_seconds`` of wall time."""
    start = time.monotonic()
    steps = 0
    while steps < max_steps or time.monotonic() - start < min_seconds:
        steps += 1
        if not engine.step():
            settle()
            engine.relay_reports()
            return
    raise AssertionError(f"engine did not drain in {steps} steps and {time.monotonic() - start:.1f} s")


class FakeTrtllmEngine:
    """One TensorRT-LLM executor (the ranks in ``comm.local`` live in this process)."""

    def __init__(self, scheduler_cls: Optional[type], worker_cls: Optional[type], *,
                 geo: Geometry = Geometry(), num_device_blocks: int = 40, chunk_size: int = 32,
                 max_batch_tokens: int = 256, max_num_requests: int = 8, pool_kind: str = "numpy",
                 role: str = "agg", api: str = "1.4", manager: str = "v1", loop: str = "overlap",
                 layer_hooks: str = "graphs", warmup_forwards: int = 2, alloc_delay: int = 0,
                 stream_factory: Optional[Callable[[], Any]] = None, verify: bool = True, compute: bool = True,
                 comm: Any = None, model: str = "test-model", model_seed: int = DEFAULT_MODEL_SEED,
                 produced: Optional[set] = None, configure: Optional[Callable[[LlmArgs], None]] = None):
        assert role in ("agg", "prefill", "decode") and api in ("1.4", "1.3", "1.2", "legacy")
        assert manager in ("v1", "v2") and loop in ("plain", "overlap") and layer_hooks in ("eager", "graphs", "none")
        self.geo, self.role, self.api, self.manager, self.loop = geo, role, api, manager, loop
        self.layer_hooks, self.alloc_delay = layer_hooks, alloc_delay
        self.chunk_size, self.max_batch_tokens, self.max_num_requests = chunk_size, max_batch_tokens, max_num_requests
        self.verify, self.compute = verify, compute
        self.model, self.seed = model, model_seed
        self.produced = produced if produced is not None else set()
        self.stream_factory = stream_factory or (lambda: None)
        self.comm = comm or Comm(geo.world_size)
        local = self.comm.local
        self.args = {r: LlmArgs(geo.tokens_per_block, geo.world_size, r, model) for r in local}
        for a in self.args.values():
            if layer_hooks == "eager":
                a.cuda_graph_config = None  # no CUDA graph: every forward runs the layer hooks
            if configure is not None:
                configure(a)
        self.pools = self._make_pools(pool_kind, num_device_blocks)
        if pool_kind == "numpy" or pool_kind == "torch-cpu":
            self._layout_device = "cpu"
        else:
            self._layout_device = "cuda"
        self.blocks = self._make_blocks(num_device_blocks)
        self.workers: dict = {}
        self.scheduler = None
        self._bring_up(scheduler_cls, worker_cls, warmup_forwards)
        self.managers = {r: _RankManager(w) for r, w in self.workers.items()}
        self.waiting: list = []
        self.running: list = []
        self.loading: dict = {}
        self.new_loading: list = []
        self.saving: dict = {}
        self.new_saving: list = []
        self.matched_pending: list = []  # V2: matched, allocated next iteration
        self.tables: dict = {}
        self.reported: dict = {}
        self.external_loads: dict = {}
        self.finished: dict = {}
        self.aborted: set = set()
        self.transceiver_out: dict = {}
        self.next_id = 1
        self.stats = EngineStats()
        self.async_save_seen = 0
        self.expected_cache: dict = {}
        self._reported_before: set = set()
        self._gen_checked: set = set()
        self._previous: Optional[list] = None  # overlap: requests whose tokens await write-back
        self._allocated = 0
        self.abort_requested: set = set()

    # ----- bring-up ----------------------------------------------------------------------------

    def _make_pools(self, pool_kind: str, num_device_blocks: int) -> dict:
        return {r: make_pool(pool_kind, num_device_blocks, self.geo) for r in self.comm.local}

    def _make_blocks(self, num_device_blocks: int) -> Any:
        return BlockManager(num_device_blocks, list(self.pools.values()))

    def _layout(self, rank: int) -> Any:
        return self.pools[rank].layout()

    def _after_bind(self) -> None:
        """Hook: the step's metadata is bound on every rank (nothing the forward writes landed yet)."""

    def _bring_up(self, scheduler_cls: Optional[type], worker_cls: Optional[type], warmup: int) -> None:
        built: dict = {}

        def build(key: Any, fn: Callable[[], Any]) -> None:
            try:
                built[key] = fn()
            except BaseException as e:  # re-raised below on the engine's thread
                built[key] = e

        threads = []
        if worker_cls is not None:
            for r in self.comm.local:
                threads.append(threading.Thread(target=build, args=(r, lambda r=r: worker_cls(self.args[r]))))
        if scheduler_cls is not None and 0 in self.comm.local:
            threads.append(threading.Thread(target=build, args=("s", lambda: scheduler_cls(self.args[0]))))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for v in built.values():
            if isinstance(v, BaseException):
                raise v
        self.scheduler = built.get("s")
        self.workers = {r: built[r] for r in self.comm.local if r in built}
        self.forward_callables = {}
        for r, w in self.workers.items():
            cb = getattr(w, "register_forward_pass_callable", None)
            self.forward_callables[r] = cb() if cb else None
        # KV-cache estimation and warmup forwards: the callable runs, nothing is registered yet.
        for _ in range(warmup):
            for cb in self.forward_callables.values():
                if cb is not None:
                    cb()
        errors: list = []

        def register(w: Any, r: int) -> None:
            try:
                if self.manager == "v2":
                    layout = self._layout(r)
                    object.__setattr__(layout, "device", self._layout_device)
                    w.register_kv_cache_layout(layout)
                else:
                    w.register_kv_caches(self.pools[r].tensor)
            except BaseException as e:
                errors.append(e)

        reg = [threading.Thread(target=register, args=(w, r)) for r, w in self.workers.items()]
        for t in reg:
            t.start()
        for t in reg:
            t.join()
        if errors:
            raise errors[0]
        if self.scheduler is not None:
            self.scheduler.wait_for_initialization()
        self.layerwise = all(getattr(w, "requires_layerwise_transfer_hooks", lambda: True)() is not False
                             for w in self.workers.values())

    # ----- requests ----------------------------------------------------------------------------

    def _request_cls(self) -> type:
        return LlmRequestV2 if self.manager == "v2" else LlmRequest

    def add_request(self, prompt: list, max_new_tokens: int, *, request_id: Optional[int] = None,
                    **kw: Any) -> LlmRequest:
        rid = self.next_id if request_id is None else request_id
        self.next_id = max(self.next_id, rid) + 1
        req = self._request_cls()(rid, prompt, max_new_tokens, chunk_size=self.chunk_size,
                                  context_only=self.role == "prefill", **kw)
        req.visible = len(prompt)
        req.kv_len = 0
        self.waiting.append(req)
        return req

    def add_generation_only_request(self, request_id: int, tokens: list, prompt_len: int, max_new_tokens: int,
                                    kv: dict) -> LlmRequest:
        """Decode role: prompt KV (one snapshot per rank) and first token came from a prefill worker."""
        req = self._request_cls()(request_id, tokens, max_new_tokens, chunk_size=self.chunk_size,
                                  generation_only=True, prompt_len=prompt_len)
        req.context_current_position = prompt_len
        req.visible = len(tokens)
        req.kv_len = prompt_len
        req._kv = kv
        self.waiting.append(req)
        return req

    def _salt_of(self, req: LlmRequest) -> Any:
        return (req.cache_salt, req.cache_salt_id, req.lora_task_id)

    def _block_keys(self, req: LlmRequest, tokens: list) -> list:
        tpb = self.geo.tokens_per_block
        hs = prefix_hashes(tokens, self.seed ^ (hash(self._salt_of(req)) & 0xFFFF_FFFF))
        return [hs[(i + 1) * tpb - 1] for i in range(len(tokens) // tpb)]

    def _reserved(self) -> int:
        tpb = self.geo.tokens_per_block
        out = 0
        for req in list(self.running) + list(self.loading.values()) + [m[0] for m in self.matched_pending]:
            total = -(-(req.prompt_len + req.max_new_tokens + 1) // tpb)
            out += max(0, total - len(self.tables[req.request_id]))
        return out

    # ----- admission (add_sequence / prepare_resources) ---------------------------------------

    def _match(self, req: LlmRequest, num_computed: int) -> tuple:
        """``KvCacheConnectorManager.get_num_new_matched_tokens``: rank 0 asks, everyone learns."""
        if req.is_generation_only_request if self.manager == "v1" else req.is_generation_only_request():
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        res = None
        if self.scheduler is not None:
            res = self.scheduler.get_num_new_matched_tokens(req, num_computed)
        n, is_async = self.comm.bcast(res)
        assert isinstance(n, int) and isinstance(is_async, bool), (n, is_async)
        if n == 0 and is_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        tpb = self.geo.tokens_per_block
        assert n % tpb == 0 and num_computed + n < req.prompt_len, (n, num_computed, req.prompt_len)
        # The connector offers only blocks this tenant and model computed somewhere.
        keys = self._block_keys(req, req.get_tokens(0))
        for i in range(num_computed // tpb, (num_computed + n) // tpb):
            assert (self.model, self._salt_of(req), keys[i]) in self.produced, (
                f"connector offered request {req.request_id} block {i}, which no request of its tenant "
                f"{self._salt_of(req)} and model {self.model} computed")
        return n, is_async

    def _admit(self) -> None:
        tpb = self.geo.tokens_per_block
        if self.manager == "v2" and self.alloc_delay:
            pending, self.matched_pending = self.matched_pending, []
            for item in pending:
                self._allocate(*item)
        while self.waiting and len(self.running) + len(self.loading) + len(self.matched_pending) < self.max_num_requests:
            req = self.waiting[0]
            tokens = req.get_tokens(0)
            total_blocks = -(-(req.prompt_len + req.max_new_tokens + 1) // tpb)
            if req._generation_only:
                if self.scheduler is not None:
                    self._match(req, req.prompt_len)  # upstream raises here
                if self.blocks.available() - self._reserved() < total_blocks:
                    break
                self.waiting.pop(0)
                table = self.blocks.allocate(-(-len(tokens) // tpb))
                n_kv = -(-req.prompt_len // tpb)
                for r, pool in self.pools.items():
                    pool.restore(table[:n_kv], req._kv[r])
                self.tables[req.request_id] = table
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                self.running.append(req)
                continue
            keys = self._block_keys(req, tokens)
            device = self.blocks.match(keys[: (req.prompt_len - 1) // tpb])
            unshared = sum(1 for b in device if self.blocks.refs[b] == 0)
            if self.blocks.available() - unshared - self._reserved() < total_blocks - len(device):
                break
            num_computed = len(device) * tpb
            n, is_async = self._match(req, num_computed) if self.workers else (0, False)
            self.waiting.pop(0)
            if self.manager == "v2" and self.alloc_delay:
                self.matched_pending.append((req, num_computed, n, is_async))
                self.tables[req.request_id] = []
                continue
            self._allocate(req, num_computed, n, is_async)

    def _allocate(self, req: LlmRequest, num_computed: int, n: int, is_async: bool) -> None:
        tpb = self.geo.tokens_per_block
        tokens = req.get_tokens(0)
        keys = self._block_keys(req, tokens)
        device = self.blocks.match(keys[: (req.prompt_len - 1) // tpb])
        now = len(device) * tpb
        if now > num_computed:
            # V2: the device cache overtook the offer between matching and allocation.
            end = min(num_computed + n, now)
            if n and self.scheduler is not None:
                self.scheduler.cancel_load(req, num_computed, end)
                self.stats.cancel_loads += 1
            n = max(0, num_computed + n - now)
            is_async = is_async and n > 0
            num_computed = now
        else:
            device = device[: num_computed // tpb]
        self._allocated += 1
        self.blocks.take(device)
        if self.manager == "v2":
            # First-chunk-only allocation: the rest arrives chunk by chunk as new_block_ids.
            first = num_computed + n + min(self.chunk_size, req.prompt_len - num_computed - n)
            want = -(-first // tpb)
        else:
            want = -(-req.prompt_len // tpb)
        table = device + self.blocks.allocate(want - len(device))
        self.tables[req.request_id] = table
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(req, list(table))
        req.context_current_position = num_computed + n
        req.kv_len = req.context_current_position
        req.py_num_connector_matched_tokens = n
        self.external_loads[req.request_id] = n
        self.stats.matched_tokens += n
        if n and num_computed:
            self.stats.device_and_connector += 1
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

    # ----- scheduling --------------------------------------------------------------------------

    def _schedule(self) -> tuple:
        budget = self.max_batch_tokens
        context, generation = [], []
        for req in self.running:
            if req.state == LlmRequestState.GENERATION_IN_PROGRESS:
                generation.append((req, 1))
                budget -= 1
        for req in self.running:
            if req.state == LlmRequestState.CONTEXT_INIT and budget > 0:
                n = min(req.context_remaining_length, req.context_chunk_size, budget)
                context.append((req, n))
                budget -= n
        return context, generation

    def _ensure_blocks(self, req: LlmRequest, upto_positions: int) -> None:
        """Blocks for positions < upto_positions (generation: one block at a time)."""
        table = self.tables[req.request_id]
        need = -(-upto_positions // self.geo.tokens_per_block)
        if need > len(table):
            table.extend(self.blocks.allocate(need - len(table)))

    def _request_data(self, req: LlmRequest, n_sched: int) -> Any:
        tokens = req.get_tokens(0)[: req.visible]
        table = self.tables[req.request_id]
        n_tok, n_blk = self.reported.get(req.request_id, (0, 0))
        self.reported[req.request_id] = (len(tokens), len(table))
        if req.state in CONTEXT_STATES:
            computed = req.context_current_position
        else:
            computed = len(tokens) - 1
        if req.request_id in self.external_loads:
            computed -= self.external_loads[req.request_id]
        args = (req.request_id, tokens[n_tok:], table[n_blk:], computed)
        # Priorities only with a retention config (get_priority_by_block_id per new block).
        prio = None
        if req.kv_cache_retention_config is not None:
            prio = [int(req.kv_cache_retention_config)] * len(table[n_blk:])
        if self.api == "legacy":
            return LegacyRequestData(*args)
        if self.api == "1.3":
            return RequestData13(*args, n_sched, priorities=prio, cache_salt_id=req.cache_salt_id)
        if self.api == "1.2":
            return RequestData13(*args, n_sched)
        return RequestData(*args, n_sched, priorities=prio, cache_salt=req.cache_salt)

    # ----- the forward pass --------------------------------------------------------------------

    def _expected(self, req: LlmRequest, layer: int, plane: int, n: int) -> np.ndarray:
        key = (req.request_id, layer, plane)
        cached = self.expected_cache.get(key)
        if cached is None or cached.shape[0] < n:
            hs = np.array(prefix_hashes(req._tokens, self.seed), dtype=np.uint64)
            cached = expected_kv(hs, layer, plane, self.geo)
            self.expected_cache[key] = cached
        return cached[:n]

    def _check_prefix(self, rank: int, req: LlmRequest, layer: int, n: int, what: str) -> None:
        if n == 0 or not self.verify:
            return
        g = self.geo
        sl = slice(rank * g.heads_per_rank * g.head_dim, (rank + 1) * g.heads_per_rank * g.head_dim)
        table = self.tables[req.request_id]
        for plane in (0, 1):
            got = self.pools[rank].read_positions(table, layer, plane, n)
            want = self._expected(req, layer, plane, n)[:, sl]
            if not np.array_equal(got, want):
                bad = np.nonzero((got != want).any(axis=1))[0]
                pos = int(bad[0])
                raise AssertionError(
                    f"{what}: request {req.request_id} rank {rank} layer {layer} plane {plane}: KV of "
                    f"{len(bad)} of {n} positions differs from the model, first at position {pos} "
                    f"(device block {table[pos // g.tokens_per_block]})")

    def _compute(self, rank: int, req: LlmRequest, layer: int, start: int, n: int) -> None:
        if not self.compute:
            return
        g = self.geo
        tpb = g.tokens_per_block
        sl = slice(rank * g.heads_per_rank * g.head_dim, (rank + 1) * g.heads_per_rank * g.head_dim)
        table = self.tables[req.request_id]
        for plane in (0, 1):
            vals = self._expected(req, layer, plane, start + n)[start:start + n, sl]
            p = start
            while p < start + n:
                b, s0 = divmod(p, tpb)
                k = min(tpb - s0, start + n - p)
                self.pools[rank].write(table[b], layer, plane, s0, vals[p - start:p - start + k])
                p += k

    def _forward(self, work: list, metadata_bound: bool, graph: bool) -> None:
        """``work``: (request, first position, n positions, check the prefix?)."""
        hooks = self.layerwise and self.layer_hooks != "none" and not graph
        if not hooks:
            self.stats.hook_free_forwards += 1
        for rank in self.comm.local:
            w = self.workers.get(rank)
            stream = self.stream_factory()
            if w is not None and metadata_bound:
                w.start_load_kv(stream)
            for layer in range(self.geo.num_layers):
                if w is not None and hooks:
                    w.wait_for_layer_load(layer, stream)
                for req, start, n, check in work:
                    if check:
                        self._check_prefix(rank, req, layer, start, "forward reads its prefix")
                    self._compute(rank, req, layer, start, n)
                if w is not None and hooks:
                    w.save_kv_layer(layer, stream)
            if w is not None:
                cb = self.forward_callables.get(rank)
                if cb is not None:
                    cb()
                w.wait_for_save(stream)

    def relay_reports(self) -> None:
        """Carry the job reports of in-process ranks > 0 to the leader (link "engine")."""
        if self.scheduler is None:
            return
        for r, w in self.workers.items():
            native = getattr(w, "native", None)
            if r > 0 and native is not None:
                blob = native.take_reports()
                if blob:
                    self.scheduler.leader.apply_reports(blob)

    def step(self) -> bool:
        """One executor iteration. Returns False when nothing is left to do."""
        self.stats.steps += 1
        self.relay_reports()
        self._allocated = 0
        self._admit()
        context, generation = self._schedule()
        work = []
        for req, n in context:
            if self.manager == "v2":
                self._ensure_blocks(req, req.context_current_position + n)
            work.append((req, req.context_current_position, n, True))
        for req, _ in generation:
            pos = len(req._tokens) - 1  # the newest token (overlap: sampled, not yet written back)
            self._ensure_blocks(req, pos + 1)
            work.append((req, pos, 1, req.request_id not in self._gen_checked))
        if len(self.comm.local) < self.geo.world_size:
            # Every rank runs one batch: the forward's collectives (all-reduce per layer) pair up
            # the ranks' work, so ranks that scheduled different tokens would hang or mix data.
            mine = [(req.request_id, start, n) for req, start, n, _ in work]
            batches = self.comm.allgather({r: mine for r in self.comm.local})
            assert all(b == batches[0] for b in batches), f"ranks scheduled different batches: {batches}"
        so = SchedulerOutput()
        for req, n in context:
            rd = self._request_data(req, n)
            (so.new_requests if req.request_id not in self._reported_before else so.cached_requests).append(rd)
            self._reported_before.add(req.request_id)
        for req, n in generation:
            so.cached_requests.append(self._request_data(req, n))
            self._reported_before.add(req.request_id)
        self.external_loads = {}
        bound = False
        # Requests parked for async loads were scheduled before being taken out: metadata goes out.
        if self.workers and (context or generation or self._allocated):
            meta = self.scheduler.build_connector_meta(so) if self.scheduler is not None else None
            blob = self.comm.bcast(pickle.dumps(meta) if self.scheduler is not None else None)
            for w in self.workers.values():
                w.bind_connector_meta(pickle.loads(blob))
            bound = True
        self._after_bind()
        graph = not context or all(n == 1 for _, n in context)
        if context or generation:
            self._forward(work, bound, graph and self.layer_hooks == "graphs")
        elif bound:
            for r, w in self.workers.items():  # an empty batch: loads start, no forward runs
                w.start_load_kv(self.stream_factory())
        # Clients cancelling requests whose loads were just started (tests set abort_requested).
        for rid in sorted(self.abort_requested):
            self.abort(rid)
        self.abort_requested.clear()
        for req, _ in generation:
            self._gen_checked.add(req.request_id)
        # Sampling: the true token sequence grows now; the host sees it at write-back.
        batch = []
        for req, n in context:
            req.context_current_position += n
            req.kv_len = req.context_current_position
            self._produced(req)
            if req.context_remaining_length == 0:
                self._register_full_blocks(req)
                self._sample(req)
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                batch.append(req)
        for req, _ in generation:
            req.kv_len = len(req._tokens)
            self._register_full_blocks(req)
            self._sample(req)
            batch.append(req)
        if self.loop == "overlap":
            previous, self._previous = self._previous, batch
            self._write_back(previous or [])
        else:
            self._write_back(batch)
        self._get_finished()
        return bool(context or generation or self.waiting or self.running or self.loading or self.saving
                    or self.matched_pending or self._previous)

    def _sample(self, req: LlmRequest) -> None:
        h = prefix_hashes(req._tokens, self.seed)[-1]
        req._tokens.append(next_token(h))

    def _write_back(self, batch: list) -> None:
        """The host learns the tokens sampled for ``batch``; finished requests are finished."""
        done = []
        for req in batch:
            if req not in self.running:
                continue  # finished (or cancelled) at the previous write-back
            req.visible += 1
            finished = req.is_context_only_request or len(req._tokens[:req.visible]) - req.prompt_len >= req.max_new_tokens
            if finished:
                done.append(req)
        for req in done:
            del req._tokens[req.visible:]  # an overlap step that ran past the end is discarded
            req.kv_len = min(req.kv_len, len(req._tokens) - 1)
            self._finish(req)

    def _produced(self, req: LlmRequest) -> None:
        for k in self._block_keys(req, req._tokens[: req.kv_len]):
            self.produced.add((self.model, self._salt_of(req), k))

    def _register_full_blocks(self, req: LlmRequest) -> None:
        keys = self._block_keys(req, req._tokens[: req.kv_len])
        table = self.tables[req.request_id]
        for i, k in enumerate(keys):
            self.blocks.register(table[i], k)
        self._produced(req)

    def _finish(self, req: LlmRequest) -> None:
        req.state = LlmRequestState.GENERATION_COMPLETE
        self.running.remove(req)
        table = self.tables[req.request_id]
        if self.verify:
            for rank in self.comm.local:
                for layer in range(self.geo.num_layers):
                    self._check_prefix(rank, req, layer, req.kv_len, "finished request's KV")
        if self.role == "prefill":
            prompt_blocks = table[: -(-req.prompt_len // self.geo.tokens_per_block)]
            self.transceiver_out[req.request_id] = (req, {r: p.snapshot(prompt_blocks) for r, p in self.pools.items()})
        self.finished[req.request_id] = req
        self._request_finished(req, loading=False)

    def _request_finished(self, req: LlmRequest, loading: bool) -> None:
        table = self.tables[req.request_id]
        res = self.scheduler.request_finished(req, list(table)) if self.scheduler is not None else False
        in_flight = self.comm.bcast(res) if self.workers else False
        assert isinstance(in_flight, bool)
        if loading and not in_flight:
            raise AssertionError(f"request {req.request_id} was cancelled with its load in flight and the connector "
                                 "let its blocks go (request_finished returned False): a late copy could land in "
                                 "blocks given to another request")
        if in_flight:
            self.async_save_seen += 1
            req.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
            self.saving[req.request_id] = (req, table)
            self.new_saving.append(req.request_id)
        else:
            self._free(req.request_id)

    def abort(self, rid: int) -> None:
        """The client cancelled request ``rid`` (``py_executor.py`` ``_terminate_request``)."""
        if rid in self.loading:
            req = self.loading.pop(rid)
            self.aborted.add(rid)
            req.state = LlmRequestState.GENERATION_COMPLETE
            self._request_finished(req, loading=True)
            return
        for req in list(self.running):
            if req.request_id == rid:
                self.aborted.add(rid)
                self.running.remove(req)
                req.state = LlmRequestState.GENERATION_COMPLETE
                self._request_finished(req, loading=False)

    def reset(self, rid: int) -> None:
        """KVCacheManagerV2 resets a running request: its blocks go, it runs again from scratch."""
        req = next(r for r in self.running if r.request_id == rid)
        self.running.remove(req)
        if self.scheduler is not None:
            self.scheduler.request_reset(req)
        self._free(rid, keep_expected=True)
        self.reported.pop(rid, None)
        self._reported_before.discard(rid)
        self._gen_checked.discard(rid)
        del req._tokens[req.prompt_len:]
        req.visible, req.kv_len, req.context_current_position = req.prompt_len, 0, 0
        req.state = LlmRequestState.CONTEXT_INIT
        self.waiting.insert(0, req)

    def _free(self, rid: int, keep_expected: bool = False) -> None:
        table = self.tables.pop(rid)
        self.blocks.release(table)
        if not keep_expected:
            self.expected_cache = {k: v for k, v in self.expected_cache.items() if k[0] != rid}

    def _get_finished(self) -> None:
        if not self.managers:
            return
        new_saving, new_loading = self.new_saving, self.new_loading
        self.new_saving, self.new_loading = [], []
        local = {r: m.get_finished(new_saving, new_loading, self.loading) for r, m in self.managers.items()}
        results = self.comm.allgather(local)  # mpi_allgather
        saving = set.intersection(*[r[0] for r in results])
        loading = set.intersection(*[r[1] for r in results])
        for m in self.managers.values():
            m.acted_on(saving, loading)
        for rid in sorted(loading):
            req = self.loading.pop(rid, None)
            if req is None:
                continue  # cancelled meanwhile (1.4 logs "reported IDs that are not pending")
            req.state = LlmRequestState.CONTEXT_INIT
            req.kv_len = req.context_current_position
            self.running.append(req)
        for rid in sorted(saving):
            self.saving.pop(rid)
            self._free(rid)

    def run(self, max_steps: int = 10_000, min_seconds: float = 60.0) -> None:
        def settle() -> None:
            for w in self.workers.values():
                if getattr(w, "native", None) is not None:
                    w.native.wait_idle()

        drain(self, settle, max_steps, min_seconds)
