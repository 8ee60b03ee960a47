"""A stand-in for TensorRT-LLM's executor that drives a KV connector exactly as TensorRT-LLM's
PyTorch backend (>= 1.2.0rc2) does, over KV pools whose contents are a deterministic function of
(prefix, position, layer, plane, head).

What is reproduced (REFERENCE.md sections 2 and 8; TensorRT-LLM's ``KvCacheConnectorManager``):

* objects: ``LlmRequest`` (``request_id`` int, ``get_tokens(0)``, ``state``,
  ``context_current_position``, ``context_chunk_size``, ``context_remaining_length``,
  ``is_generation_only_request``), ``SchedulerOutput`` / ``RequestData`` (``new_tokens``,
  ``new_block_ids`` as deltas since the last report, ``computed_position``,
  ``num_scheduled_tokens``), ``llm_args`` (``kv_cache_config.tokens_per_block``,
  ``parallel_config.to_mapping()``);
* construction order: each rank's worker first, then rank 0's scheduler, then
  ``register_kv_caches(pool)`` with one pool tensor per rank
  ``[num_blocks, num_layers, 2, tokens_per_block * kv_heads * head_dim]``;
* per step: admission with the engine's own G1 prefix cache, ``get_num_new_matched_tokens``
  (``(0, True)`` is an error), block allocation, ``update_state_after_alloc`` (all prompt blocks),
  async-loading requests parked (state DISAGG_GENERATION_TRANS_IN_PROGRESS) and skipped in the
  scheduler output, connector-matched tokens subtracted from the first ``computed_position``,
  ``build_connector_meta`` on rank 0, the metadata pickled and unpickled for every rank,
  ``bind_connector_meta``, ``start_load_kv``, per layer ``wait_for_layer_load`` / compute /
  ``save_kv_layer``, the forward-pass callable, ``wait_for_save``; then ``request_finished`` for
  finished requests (True parks the request in DISAGG_CONTEXT_TRANS_IN_PROGRESS with its blocks
  kept) and ``get_finished`` on every rank with the ids acted on only when every rank reported
  them (set intersection); ids a worker returns must have been passed in before;
* chunked prefill; generation requests report ``computed_position = len(tokens) - 1`` and one
  scheduled token, and always travel in ``cached_requests`` (also on first sight, which is how
  generation-only requests reach the connector on a disaggregated decode worker);
* roles: "agg", "prefill" (context-only requests, finished after their first token; their KV goes
  to the decode side through a stand-in for the cache transceiver) and "decode"
  (generation-only requests whose prompt KV arrives through that transceiver).

Correctness checks: before a layer's compute, every position a scheduled request reads (its prefix,
including blocks onboarded by the connector) must hold exactly what the model writes for it, on
every rank; freshly allocated and reallocated blocks are filled with garbage first, so stale,
missing or early-freed data cannot pass.
"""

from __future__ import annotations

import enum
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

M64 = (1 << 64) - 1
VOCAB = 32000
GARBAGE = 0xA5A5


# --------------------------------------------------------------------------------------------
# TensorRT-LLM objects


class LlmRequestState(enum.Enum):
    CONTEXT_INIT = "CONTEXT_INIT"
    GENERATION_IN_PROGRESS = "GENERATION_IN_PROGRESS"
    GENERATION_COMPLETE = "GENERATION_COMPLETE"
    DISAGG_GENERATION_INIT = "DISAGG_GENERATION_INIT"
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"


CONTEXT_STATES = (LlmRequestState.CONTEXT_INIT, LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS)


@dataclass
class RequestData:
    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class LegacyRequestData:
    """RequestData of TensorRT-LLM < 1.2.0rc2: no num_scheduled_tokens."""

    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int


@dataclass
class SchedulerOutput:
    new_requests: list = field(default_factory=list)
    cached_requests: list = field(default_factory=list)


class LlmRequest:
    def __init__(self, request_id: int, tokens: list, max_new_tokens: int, *, chunk_size: int,
                 context_only: bool = False, generation_only: bool = False, prompt_len: Optional[int] = None):
        self.request_id = request_id
        self.py_request_id = request_id
        self._tokens = list(tokens)
        self.prompt_len = len(tokens) if prompt_len is None else prompt_len
        self.max_new_tokens = max_new_tokens
        self.context_chunk_size = chunk_size
        self.context_current_position = 0
        self.is_context_only_request = context_only
        self.is_generation_only_request = generation_only
        self.state = LlmRequestState.DISAGG_GENERATION_INIT if generation_only else LlmRequestState.CONTEXT_INIT

    def get_tokens(self, beam: int) -> list:
        assert beam == 0
        return list(self._tokens)

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def generated(self) -> list:
        return self._tokens[self.prompt_len:]


class _Mapping:
    def __init__(self, world_size: int, rank: int):
        self.world_size = world_size
        self.tp_size = world_size
        self.pp_size = 1
        self.rank = rank


class _ParallelConfig:
    def __init__(self, world_size: int, rank: int):
        self._m = _Mapping(world_size, rank)

    def to_mapping(self) -> _Mapping:
        return self._m


class _KvCacheConfig:
    def __init__(self, tokens_per_block: int):
        self.tokens_per_block = tokens_per_block
        self.enable_partial_reuse = False


class LlmArgs:
    """The parts of TorchLlmArgs connectors read."""

    def __init__(self, tokens_per_block: int, world_size: int, rank: int):
        self.kv_cache_config = _KvCacheConfig(tokens_per_block)
        self.parallel_config = _ParallelConfig(world_size, rank)


# --------------------------------------------------------------------------------------------
# The "model": tokens and KV as deterministic functions of the prefix


def _mix(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def prefix_hashes(tokens: list, seed: int = 0x5EED) -> list:
    out, h = [], seed
    for t in tokens:
        h = _mix(h ^ ((t + 1) * 0x9E3779B97F4A7C15))
        out.append(h)
    return out


def next_token(prefix_hash: int) -> int:
    return _mix(prefix_hash ^ 0x70C0) % VOCAB


def _mix_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 4
    kv_heads: int = 4  # over all ranks
    head_dim: int = 8
    tokens_per_block: int = 16
    world_size: int = 2

    @property
    def heads_per_rank(self) -> int:
        return self.kv_heads // self.world_size

    @property
    def inner(self) -> int:
        return self.tokens_per_block * self.heads_per_rank * self.head_dim


def expected_kv(hashes: np.ndarray, layer: int, plane: int, geo: Geometry) -> np.ndarray:
    """uint16 [n_positions, kv_heads * head_dim]: what the model writes for these positions."""
    width = geo.kv_heads * geo.head_dim
    with np.errstate(over="ignore"):
        base = hashes ^ np.uint64(((layer + 1) * 0x9E3779B97F4A7C15 + (plane + 1) * 0xC2B2AE3D27D4EB4F) & M64)
        x = base[:, None] + np.arange(width, dtype=np.uint64)[None, :] * np.uint64(0xD6E8FEB86659FD93)
        return (_mix_np(x) >> np.uint64(48)).astype(np.uint16)


# --------------------------------------------------------------------------------------------
# KV pools: numpy arrays or torch tensors (CPU or CUDA), shaped like TensorRT-LLM's primary pool


class NumpyPool:
    def __init__(self, num_blocks: int, geo: Geometry):
        self.geo = geo
        self.tensor = np.full((num_blocks, geo.num_layers, 2, geo.inner), 0, dtype=np.float16)
        self.u16 = self.tensor.view(np.uint16)
        self.u16[...] = GARBAGE

    def fill_garbage(self, blocks: list) -> None:
        if blocks:
            self.u16[np.asarray(blocks)] = GARBAGE

    def write(self, block: int, layer: int, plane: int, s0: int, vals: np.ndarray) -> None:
        g = self.geo
        view = self.u16[block, layer, plane].reshape(g.heads_per_rank, g.tokens_per_block, g.head_dim)
        view[:, s0:s0 + vals.shape[0], :] = vals.reshape(vals.shape[0], g.heads_per_rank, g.head_dim).transpose(1, 0, 2)

    def read_positions(self, table: list, layer: int, plane: int, n: int) -> np.ndarray:
        """uint16 [n, heads_per_rank * head_dim] for positions 0..n of a request."""
        g = self.geo
        nb = -(-n // g.tokens_per_block)
        x = self.u16[np.asarray(table[:nb]), layer, plane].reshape(nb, g.heads_per_rank, g.tokens_per_block, g.head_dim)
        return x.transpose(0, 2, 1, 3).reshape(nb * g.tokens_per_block, -1)[:n]

    def snapshot(self, blocks: list) -> Any:
        return self.u16[np.asarray(blocks)].copy()

    def restore(self, blocks: list, data: Any) -> None:
        self.u16[np.asarray(blocks)] = data


class TorchPool(NumpyPool):
    def __init__(self, num_blocks: int, geo: Geometry, device: str):
        import torch

        self.torch = torch
        self.geo = geo
        self.tensor = torch.zeros((num_blocks, geo.num_layers, 2, geo.inner), dtype=torch.bfloat16, device=device)
        self.i16 = self.tensor.view(torch.int16)
        self.i16.fill_(np.uint16(GARBAGE).view(np.int16).item())

    def fill_garbage(self, blocks: list) -> None:
        if blocks:
            idx = self.torch.as_tensor(blocks, device=self.tensor.device)
            self.i16[idx] = np.uint16(GARBAGE).view(np.int16).item()

    def write(self, block: int, layer: int, plane: int, s0: int, vals: np.ndarray) -> None:
        g = self.geo
        v = vals.reshape(vals.shape[0], g.heads_per_rank, g.head_dim).transpose(1, 0, 2).view(np.int16)
        src = self.torch.from_numpy(np.ascontiguousarray(v)).to(self.tensor.device)
        view = self.i16[block, layer, plane].view(g.heads_per_rank, g.tokens_per_block, g.head_dim)
        view[:, s0:s0 + vals.shape[0], :] = src

    def read_positions(self, table: list, layer: int, plane: int, n: int) -> np.ndarray:
        g = self.geo
        nb = -(-n // g.tokens_per_block)
        idx = self.torch.as_tensor(table[:nb], device=self.tensor.device)
        x = self.i16[idx, layer, plane].reshape(nb, g.heads_per_rank, g.tokens_per_block, g.head_dim)
        x = x.permute(0, 2, 1, 3).reshape(nb * g.tokens_per_block, -1)[:n]
        return x.cpu().numpy().view(np.uint16)

    def snapshot(self, blocks: list) -> Any:
        return self.i16[self.torch.as_tensor(blocks, device=self.tensor.device)].clone()

    def restore(self, blocks: list, data: Any) -> None:
        self.i16[self.torch.as_tensor(blocks, device=self.tensor.device)] = data.to(self.tensor.device)


def make_pool(kind: str, num_blocks: int, geo: Geometry) -> NumpyPool:
    if kind == "numpy":
        return NumpyPool(num_blocks, geo)
    if kind in ("torch-cpu", "torch-cuda"):
        return TorchPool(num_blocks, geo, "cpu" if kind == "torch-cpu" else "cuda")
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# The engine's own block manager (G1) with TensorRT-LLM-style prefix reuse


class BlockManager:
    """Device blocks of one engine (identical ids on every rank). Full blocks of finished requests
    stay reusable by their prefix key until evicted (LRU); allocation overwrites with garbage."""

    def __init__(self, num_blocks: int, pools: list):
        self.num_blocks = num_blocks
        self.pools = pools
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.cached: "OrderedDict[int, int]" = OrderedDict()  # key -> block, refcount 0 only
        self.key_of: dict = {}  # block -> key of registered full blocks
        self.by_key: dict = {}  # key -> block

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def match(self, keys: list) -> list:
        out = []
        for k in keys:
            b = self.by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list) -> None:
        for b in blocks:
            if self.refs[b] == 0:
                self.cached.pop(self.key_of[b], None)
            self.refs[b] += 1

    def allocate(self, n: int) -> list:
        assert n <= self.available(), "caller checks capacity"
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop(0)
            else:
                key, b = self.cached.popitem(last=False)
                del self.by_key[key]
                del self.key_of[b]
            self.refs[b] = 1
            out.append(b)
        for p in self.pools:
            p.fill_garbage(out)
        return out

    def register(self, block: int, key: int) -> None:
        if block not in self.key_of and key not in self.by_key:
            self.key_of[block] = key
            self.by_key[key] = block

    def release(self, blocks: list) -> None:
        for b in blocks:
            self.refs[b] -= 1
            assert self.refs[b] >= 0
            if self.refs[b] == 0:
                key = self.key_of.get(b)
                if key is None:
                    self.free.append(b)
                    for p in self.pools:
                        p.fill_garbage([b])
                else:
                    self.cached[key] = b


# --------------------------------------------------------------------------------------------
# The per-rank connector manager (TensorRT-LLM's KvCacheConnectorManager bookkeeping)


class _RankManager:
    def __init__(self, worker: Any):
        self.worker = worker
        self.pending_saving: set = set()
        self.pending_loading: set = set()
        self.local_saving: set = set()
        self.local_loading: set = set()
        self.passed_saving: set = set()
        self.passed_loading: set = set()

    def get_finished(self, new_saving: list, new_loading: list) -> tuple:
        self.pending_saving |= set(new_saving)
        self.pending_loading |= set(new_loading)
        self.passed_saving |= set(new_saving)
        self.passed_loading |= set(new_loading)
        saved, loaded = self.worker.get_finished(list(new_saving), list(new_loading))
        assert set(saved) <= self.passed_saving, f"worker reported saves it was never given: {set(saved) - self.passed_saving}"
        assert set(loaded) <= self.passed_loading, f"worker reported loads it was never given: {set(loaded) - self.passed_loading}"
        for r in saved:
            if r in self.pending_saving:
                self.pending_saving.discard(r)
                self.local_saving.add(r)
        for r in loaded:
            if r in self.pending_loading:
                self.pending_loading.discard(r)
                self.local_loading.add(r)
        return set(self.local_saving), set(self.local_loading)

    def acted_on(self, saving: set, loading: set) -> None:
        self.local_saving -= saving
        self.local_loading -= loading
        self.passed_saving -= saving
        self.passed_loading -= loading


# --------------------------------------------------------------------------------------------
# The engine


@dataclass
class EngineStats:
    steps: int = 0
    matched_tokens: int = 0
    sync_matches: int = 0
    async_matches: int = 0


class FakeTrtllmEngine:
    """One TensorRT-LLM executor (``world_size`` ranks in this process)."""

    def __init__(
        self,
        scheduler_cls: Optional[type],
        worker_cls: Optional[type],
        *,
        geo: Geometry = Geometry(),
        num_device_blocks: int = 40,
        chunk_size: int = 32,
        max_batch_tokens: int = 256,
        max_num_requests: int = 8,
        pool_kind: str = "numpy",
        role: str = "agg",
        legacy_request_data: bool = False,
        stream_factory: Optional[Callable[[], Any]] = None,
        verify: bool = True,
        compute: bool = True,
    ):
        assert role in ("agg", "prefill", "decode")
        self.geo = geo
        self.role = role
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_requests = max_num_requests
        self.legacy = legacy_request_data
        self.verify = verify
        self.compute = compute  # False: skip writing KV (benchmarks of the connector alone)
        self.stream_factory = stream_factory or (lambda: None)
        self.args = [LlmArgs(geo.tokens_per_block, geo.world_size, r) for r in range(geo.world_size)]
        self.pools = [make_pool(pool_kind, num_device_blocks, geo) for _ in range(geo.world_size)]
        self.blocks = BlockManager(num_device_blocks, self.pools)
        # TensorRT-LLM's order: every rank's worker, then rank 0's scheduler, then the pools.
        self.workers = [worker_cls(a) for a in self.args] if worker_cls else []
        self.scheduler = scheduler_cls(self.args[0]) if scheduler_cls else None
        # Ranks register in parallel, as separate processes would (a ZeroMQ handshake needs them all).
        errors: list = []

        def register(w: Any, p: Any) -> None:
            try:
                w.register_kv_caches(p.tensor)
            except BaseException as e:  # re-raised below on the engine's thread
                errors.append(e)

        threads = [threading.Thread(target=register, args=(w, p)) for w, p in zip(self.workers, self.pools)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.forward_callables = []
        for w in self.workers:
            cb = getattr(w, "register_forward_pass_callable", None)
            self.forward_callables.append(cb() if cb else None)
        self.managers = [_RankManager(w) for w in self.workers]
        self.waiting: list = []
        self.running: list = []  # admitted, in CONTEXT_INIT / GENERATION_IN_PROGRESS
        self.loading: dict = {}  # async loads: id -> request
        self.new_loading: list = []
        self.saving: dict = {}  # finished with saves in flight: id -> (request, blocks)
        self.new_saving: list = []
        self.tables: dict = {}
        self.hashes: dict = {}
        self.reported: dict = {}  # id -> (n tokens reported, n blocks reported)
        self.external_loads: dict = {}
        self.finished: dict = {}  # id -> request
        self.transceiver_out: dict = {}  # prefill role: id -> (pool snapshot source blocks)
        self.next_id = 1
        self.stats = EngineStats()
        self.async_save_seen = 0
        self.expected_cache: dict = {}
        self._reported_before: set = set()  # ids that already appeared in a scheduler output
        self._gen_checked: set = set()

    # ----- requests ----------------------------------------------------------------------------

    def add_request(self, prompt: list, max_new_tokens: int, *, request_id: Optional[int] = None) -> LlmRequest:
        rid = self.next_id if request_id is None else request_id
        self.next_id = max(self.next_id, rid) + 1
        req = LlmRequest(rid, prompt, max_new_tokens, chunk_size=self.chunk_size,
                         context_only=self.role == "prefill")
        self.waiting.append(req)
        return req

    def add_generation_only_request(self, request_id: int, tokens: list, prompt_len: int, max_new_tokens: int,
                                    kv: list) -> LlmRequest:
        """Decode role: a request whose prompt KV (``kv``: one snapshot per rank of the prompt's
        blocks, from the prefill worker's cache transceiver) and first token came from a prefill worker."""
        req = LlmRequest(request_id, tokens, max_new_tokens, chunk_size=self.chunk_size,
                         generation_only=True, prompt_len=prompt_len)
        req.context_current_position = prompt_len
        req._kv = kv
        self.waiting.append(req)
        return req

    def _reserved(self) -> int:
        tpb = self.geo.tokens_per_block
        out = 0
        for req in list(self.running) + list(self.loading.values()):
            total = -(-(req.prompt_len + req.max_new_tokens) // tpb)
            out += max(0, total - len(self.tables[req.request_id]))
        return out

    def _block_keys(self, tokens: list) -> list:
        tpb = self.geo.tokens_per_block
        hs = prefix_hashes(tokens)
        return [hs[(i + 1) * tpb - 1] for i in range(len(tokens) // tpb)]

    # ----- one executor iteration --------------------------------------------------------------

    def _admit(self) -> list:
        """Admission + allocation (TensorRT-LLM's add_sequence path). Returns newly admitted requests."""
        tpb = self.geo.tokens_per_block
        admitted = []
        while self.waiting and len(self.running) + len(self.loading) < self.max_num_requests:
            req = self.waiting[0]
            tokens = req.get_tokens(0)
            total_blocks = -(-(req.prompt_len + req.max_new_tokens) // tpb)
            if req.is_generation_only_request:
                need = -(-len(tokens) // tpb)
                if self.blocks.available() - self._reserved() < total_blocks:
                    break
                self.waiting.pop(0)
                table = self.blocks.allocate(need)
                # The cache transceiver delivers the prompt KV from the prefill worker.
                n_kv = -(-req.prompt_len // tpb)
                for pool, snap in zip(self.pools, req._kv):
                    pool.restore(table[:n_kv], snap)
                self.tables[req.request_id] = table
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                self.running.append(req)
                admitted.append(req)
                continue
            keys = self._block_keys(tokens)
            # The engine computes at least one token: at most (prompt_len - 1) // tpb blocks reused.
            device = self.blocks.match(keys[: (req.prompt_len - 1) // tpb])
            unshared = sum(1 for b in device if self.blocks.refs[b] == 0)
            if self.blocks.available() - unshared - self._reserved() < total_blocks - len(device):
                break
            num_computed = len(device) * tpb
            n, is_async = (0, False)
            if self.scheduler is not None:
                n, is_async = self.scheduler.get_num_new_matched_tokens(req, num_computed)
                if n == 0 and is_async:
                    raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
                assert isinstance(n, int) and isinstance(is_async, bool)
                assert n % tpb == 0 and num_computed + n < req.prompt_len, (n, num_computed, req.prompt_len)
            self.waiting.pop(0)
            self.blocks.take(device)
            fresh = self.blocks.allocate(-(-req.prompt_len // tpb) - len(device))
            table = device + fresh
            self.tables[req.request_id] = table
            if self.scheduler is not None:
                self.scheduler.update_state_after_alloc(req, list(table))
            req.context_current_position = num_computed + n
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
            admitted.append(req)
        return admitted

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

    def _ensure_generation_block(self, req: LlmRequest) -> None:
        tpb = self.geo.tokens_per_block
        table = self.tables[req.request_id]
        need = -(-len(req.get_tokens(0)) // tpb)
        if need > len(table):
            table.extend(self.blocks.allocate(need - len(table)))

    def _request_data(self, req: LlmRequest, n_sched: int) -> Any:
        tokens = req.get_tokens(0)
        table = self.tables[req.request_id]
        n_tok, n_blk = self.reported.get(req.request_id, (0, 0))
        self.reported[req.request_id] = (len(tokens), len(table))
        if req.state in CONTEXT_STATES:
            computed = req.context_current_position
        else:
            computed = len(tokens) - 1
        if req.request_id in self.external_loads:
            computed -= self.external_loads[req.request_id]
        if self.legacy:
            return LegacyRequestData(req.request_id, tokens[n_tok:], table[n_blk:], computed)
        return RequestData(req.request_id, tokens[n_tok:], table[n_blk:], computed, n_sched)

    def _expected(self, req: LlmRequest, layer: int, plane: int, n: int) -> np.ndarray:
        key = (req.request_id, layer, plane)
        cached = self.expected_cache.get(key)
        if cached is None or cached.shape[0] < n:
            hs = np.array(prefix_hashes(req.get_tokens(0)), dtype=np.uint64)
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
                    f"(device block {table[pos // g.tokens_per_block]})"
                )

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

    def relay_reports(self) -> None:
        """Carry the job reports of ranks > 0 to the leader, as the channel between processes
        would, one step late."""
        for w in self.workers[1:]:
            native = getattr(w, "native", None)
            if native is not None and self.scheduler is not None:
                blob = native.take_reports()
                if blob:
                    self.scheduler.leader.apply_reports(blob)

    def step(self) -> bool:
        """One executor iteration. Returns False when nothing is left to do."""
        self.stats.steps += 1
        self.relay_reports()
        self._admit()
        context, generation = self._schedule()
        for req, _ in generation:
            self._ensure_generation_block(req)
        # Scheduler output (requests parked for async loads were never scheduled here).
        so = SchedulerOutput()
        for req, n in context:
            rd = self._request_data(req, n)
            (so.new_requests if rd.request_id not in self._reported_before else so.cached_requests).append(rd)
            self._reported_before.add(rd.request_id)
        for req, n in generation:
            so.cached_requests.append(self._request_data(req, n))
            self._reported_before.add(req.request_id)
        self.external_loads = {}
        work = bool(context or generation)
        if self.scheduler is not None:
            meta = self.scheduler.build_connector_meta(so)
            blob = pickle.dumps(meta)  # mpi_broadcast from rank 0
            for w in self.workers:
                w.bind_connector_meta(pickle.loads(blob))
        # Forward pass on every rank.
        for rank, w in enumerate(self.workers or [None] * self.geo.world_size):
            stream = self.stream_factory()
            if w is not None:
                w.start_load_kv(stream)
            for layer in range(self.geo.num_layers):
                if w is not None:
                    w.wait_for_layer_load(layer, stream)
                for req, n in context:
                    start = req.context_current_position
                    self._check_prefix(rank, req, layer, start, "context chunk reads its prefix")
                    self._compute(rank, req, layer, start, n)
                for req, _ in generation:
                    pos = len(req.get_tokens(0)) - 1
                    if req.request_id not in self._gen_checked:
                        self._check_prefix(rank, req, layer, pos, "first generation step reads its prefix")
                    self._compute(rank, req, layer, pos, 1)
                if w is not None:
                    w.save_kv_layer(layer, stream)
            if w is not None:
                cb = self.forward_callables[rank]
                if cb is not None:
                    cb()
                w.wait_for_save(stream)
        for req, _ in generation:
            self._gen_checked.add(req.request_id)
        # Sampling and request updates.
        done = []
        for req, n in context:
            req.context_current_position += n
            if req.context_remaining_length == 0:
                self._register_full_blocks(req)
                self._append_token(req)
                if req.is_context_only_request:
                    done.append(req)
                else:
                    req.state = LlmRequestState.GENERATION_IN_PROGRESS
                    if len(req.generated) >= req.max_new_tokens:
                        done.append(req)
        for req, _ in generation:
            self._append_token(req)
            self._register_full_blocks(req)
            if len(req.generated) >= req.max_new_tokens:
                done.append(req)
        for req in done:
            self._finish(req)
        self._get_finished()
        return work or bool(self.waiting or self.running or self.loading or self.saving)

    def _append_token(self, req: LlmRequest) -> None:
        h = getattr(req, "_last_hash", None)
        if h is None or getattr(req, "_hashed_len", -1) != len(req._tokens):
            h = prefix_hashes(req.get_tokens(0))[-1]
        tok = next_token(h)
        req._tokens.append(tok)
        req._last_hash = _mix(h ^ ((tok + 1) * 0x9E3779B97F4A7C15))
        req._hashed_len = len(req._tokens)

    def _register_full_blocks(self, req: LlmRequest) -> None:
        tokens = req.get_tokens(0)
        computed = req.context_current_position if req.state in CONTEXT_STATES else len(tokens) - 1
        keys = self._block_keys(tokens[:computed])
        table = self.tables[req.request_id]
        for i, k in enumerate(keys):
            self.blocks.register(table[i], k)

    def _finish(self, req: LlmRequest) -> None:
        req.state = LlmRequestState.GENERATION_COMPLETE
        self.running.remove(req)
        table = self.tables[req.request_id]
        if self.verify:
            n = len(req.get_tokens(0)) - 1
            for rank in range(self.geo.world_size):
                for layer in range(self.geo.num_layers):
                    self._check_prefix(rank, req, layer, n, "finished request's KV")
        if self.role == "prefill":
            # The cache transceiver ships the prompt KV to the decode worker (here: a snapshot).
            prompt_blocks = table[: -(-req.prompt_len // self.geo.tokens_per_block)]
            self.transceiver_out[req.request_id] = (req, [p.snapshot(prompt_blocks) for p in self.pools])
        self.finished[req.request_id] = req
        in_flight = False
        if self.scheduler is not None:
            in_flight = self.scheduler.request_finished(req, list(table))
            assert isinstance(in_flight, bool)
        if in_flight:
            self.async_save_seen += 1
            req.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
            self.saving[req.request_id] = (req, table)
            self.new_saving.append(req.request_id)
        else:
            self._free(req.request_id)

    def _free(self, rid: int) -> None:
        table = self.tables.pop(rid)
        self.blocks.release(table)
        self.expected_cache = {k: v for k, v in self.expected_cache.items() if k[0] != rid}

    def _get_finished(self) -> None:
        if not self.managers:
            return
        new_saving, new_loading = self.new_saving, self.new_loading
        self.new_saving, self.new_loading = [], []
        results = [m.get_finished(new_saving, new_loading) for m in self.managers]  # mpi_allgather
        saving = set.intersection(*[r[0] for r in results])
        loading = set.intersection(*[r[1] for r in results])
        for m in self.managers:
            m.acted_on(saving, loading)
        for rid in loading:
            req = self.loading.pop(rid)
            req.state = LlmRequestState.CONTEXT_INIT
            self.running.append(req)
        for rid in saving:
            self.saving.pop(rid)
            self._free(rid)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                for w in self.workers:
                    if getattr(w, "native", None) is not None:
                        w.native.wait_idle()
                self.relay_reports()
                return
        raise AssertionError(f"engine did not drain in {max_steps} steps")
