"""TensorRT-LLM's objects as a connector sees them, a deterministic "model" and KV pools, for
tests/trtllm_driver.py. Field names and semantics follow TensorRT-LLM 1.4's
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (``RequestData``,
``SchedulerOutput``), ``bindings`` ``LlmRequest`` (C++: ``is_generation_only_request`` is a property)
and ``pyexecutor/llm_request.py`` (KVCacheManagerV2's Python ``LlmRequest``: a method), and
``connectors/kv_cache_layout.py`` (``KvCacheLayout``).

The model: token t+1 and the KV of position p are functions of the prefix hash at p, seeded by the
model (two models with identically shaped KV write different bytes), so a block served from the
wrong model, position or request cannot pass a byte-exact check.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

M64 = (1 << 64) - 1
VOCAB = 32000
GARBAGE = 0xA5A5
DEFAULT_MODEL_SEED = 0x5EED


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
    """1.4's RequestData (``cache_salt: Optional[str]``, ``priorities``, ``block_hashes``)."""

    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: Optional[List[int]] = None
    priorities: Optional[List[int]] = None
    cache_salt: Optional[str] = None
    # New page ids per layer group (VSWA: the flat list is then empty; -1 where a block has no page in
    # the group): connectors/kv_cache_connector.py RequestData.new_block_ids_by_layer_group.
    new_block_ids_by_layer_group: List[List[int]] = field(default_factory=list)


@dataclass
class RequestData13:
    """1.3's RequestData: ``cache_salt_id: Optional[int]``."""

    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int
    num_scheduled_tokens: int
    priorities: Optional[List[int]] = None
    cache_salt_id: Optional[int] = None


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
    """The C++ ``LlmRequest`` (V1 manager): ``is_generation_only_request`` is a property."""

    def __init__(self, request_id: int, tokens: list, max_new_tokens: int, *, chunk_size: int,
                 context_only: bool = False, generation_only: bool = False, prompt_len: Optional[int] = None,
                 cache_salt: Optional[str] = None, cache_salt_id: Optional[int] = None,
                 lora_task_id: Optional[int] = None, multimodal: Optional[tuple] = None,
                 retention_priority: Optional[int] = None):
        self.request_id = request_id
        self.py_request_id = request_id
        self._tokens = list(tokens)
        self.prompt_len = len(tokens) if prompt_len is None else prompt_len
        self.max_new_tokens = max_new_tokens
        self.context_chunk_size = chunk_size
        self.context_current_position = 0
        self.is_context_only_request = context_only
        self._generation_only = generation_only
        self.cache_salt = cache_salt
        self.cache_salt_id = cache_salt_id
        self.lora_task_id = lora_task_id
        self.prompt_embedding_table = None
        # Stands in for KvCacheRetentionConfig: the priority every block of the request gets.
        self.kv_cache_retention_config = retention_priority
        self.multimodal_hashes, self.multimodal_positions, self.multimodal_lengths = multimodal or (None, None, None)
        self.py_num_connector_matched_tokens = 0
        self.state = LlmRequestState.DISAGG_GENERATION_INIT if generation_only else LlmRequestState.CONTEXT_INIT
        self.pending_token: Optional[int] = None  # overlap loop: sampled, not yet written back

    @property
    def is_generation_only_request(self) -> bool:
        return self._generation_only

    def get_tokens(self, beam: int) -> list:
        assert beam == 0
        return list(self._tokens)

    def get_num_tokens(self, beam: int) -> int:
        return len(self._tokens)

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def generated(self) -> list:
        return self._tokens[self.prompt_len:]


class LlmRequestV2(LlmRequest):
    """KVCacheManagerV2's Python ``LlmRequest``: ``is_generation_only_request()`` is a method."""

    def is_generation_only_request(self) -> bool:  # type: ignore[override]
        return self._generation_only


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
        self.enable_block_reuse = True
        self.host_cache_size = 0
        self.max_attention_window = None
        self.dtype = "auto"


class LlmArgs:
    """The parts of ``TorchLlmArgs`` (``llmapi/llm_args.py``) a connector reads."""

    def __init__(self, tokens_per_block: int, world_size: int, rank: int, model: str = "test-model"):
        self.model = model
        self.revision = None
        self.dtype = "bfloat16"
        self.max_seq_len = 4096
        self.max_beam_width = 1
        self.speculative_config = None
        self.enable_attention_dp = False
        self.quant_config = None
        self.scheduler_config = None
        self.kv_cache_config = _KvCacheConfig(tokens_per_block)
        self.parallel_config = _ParallelConfig(world_size, rank)
        # TorchLlmArgs' defaults: CUDA graphs on (``Field(default_factory=CudaGraphConfig)``), no
        # torch.compile. An engine that runs every forward eagerly has ``cuda_graph_config=None``.
        self.cuda_graph_config: Any = _CudaGraphConfig()
        self.torch_compile_config = None


class _CudaGraphConfig:
    """``CudaGraphConfig`` (``llmapi/llm_args.py``): graphs of decode-only batches."""

    def __init__(self) -> None:
        self.batch_sizes = None
        self.enable_padding = False


@dataclass(frozen=True)
class KvCacheRegion:
    base: int
    size: int
    stride: int
    num_slots: int
    buffers: Tuple = ()


@dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    layer_group_id: int
    layer_ids: Tuple[int, ...]
    window_size: Optional[int]
    regions: Tuple[KvCacheRegion, ...]
    replicated_regions: Tuple[KvCacheRegion, ...] = ()


@dataclass(frozen=True)
class KvCacheLayout:
    tokens_per_block: int
    groups: Tuple[KvCacheLayerGroupLayout, ...]
    gpu_pool_mapping_bytes: Optional[int] = None


# --------------------------------------------------------------------------------------------
# The "model"


def _mix(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def prefix_hashes(tokens: list, seed: int = DEFAULT_MODEL_SEED) -> list:
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
# ``[num_blocks, num_layers, 2, tokens_per_block * kv_heads * head_dim]``


class NumpyPool:
    def __init__(self, num_blocks: int, geo: Geometry):
        self.geo = geo
        self.tensor = np.full((num_blocks, geo.num_layers, 2, geo.inner), 0, dtype=np.float16)
        self.u16 = self.tensor.view(np.uint16)
        self.u16[...] = GARBAGE

    def data_ptr(self) -> int:
        return int(self.tensor.__array_interface__["data"][0])

    def layout(self) -> KvCacheLayout:
        """This pool as KVCacheManagerV2 describes it: one layer group, one region per page slot."""
        n, g = self.tensor.shape[0], self.geo
        per = g.num_layers * 2 * g.inner * 2
        region = KvCacheRegion(base=self.data_ptr(), size=per, stride=per, num_slots=n)
        group = KvCacheLayerGroupLayout(0, tuple(range(g.num_layers)), None, (region,))
        return KvCacheLayout(g.tokens_per_block, (group,))

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

    def data_ptr(self) -> int:
        return int(self.tensor.data_ptr())

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
# The engine's block manager, collectives and per-rank connector-manager bookkeeping


class BlockManager:
    """Device blocks of one engine (identical ids on every rank). Full blocks of finished requests
    stay reusable by their (salted) prefix key until evicted (LRU); allocation fills garbage."""

    def __init__(self, num_blocks: int, pools: list):
        self.num_blocks = num_blocks
        self.pools = pools
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.cached: "OrderedDict[int, int]" = OrderedDict()
        self.key_of: dict = {}
        self.by_key: dict = {}

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


class Comm:
    """Every rank in this process: collectives are local."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.local = list(range(world_size))

    def bcast(self, obj: Any) -> Any:
        return obj

    def allgather(self, per_rank: dict) -> list:
        return [per_rank[r] for r in range(self.world_size)]


class PipeComm:
    """One rank of two in this process; the other is at the end of ``conn`` (mpi4py's role)."""

    def __init__(self, rank: int, conn: Any):
        self.world_size = 2
        self.rank = rank
        self.local = [rank]
        self.conn = conn

    def bcast(self, obj: Any) -> Any:
        if self.rank == 0:
            self.conn.send(obj)
            return obj
        return self.conn.recv()

    def allgather(self, per_rank: dict) -> list:
        mine = per_rank[self.rank]
        self.conn.send(mine)
        other = self.conn.recv()
        return [mine, other] if self.rank == 0 else [other, mine]


class _AsyncRequests:
    """``AsyncRequests`` (``connectors/kv_cache_connector.py``): this rank's request objects by id."""

    def __init__(self) -> None:
        self.saving: dict = {}
        self.loading: dict = {}


class _RankManager:
    """One rank's ``KvCacheConnectorManager`` async bookkeeping (``connectors/kv_cache_connector.py``).
    Like upstream's ``get_finished``, it moves the new async loads (this rank's own request objects)
    into ``pending_async_requests`` before calling ``worker.get_finished`` and takes the ones the
    worker reported out of it afterwards (``extract_by_id``)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.pending_saving: set = set()
        self.pending_loading: set = set()
        self.local_saving: set = set()
        self.local_loading: set = set()
        self.passed_saving: set = set()
        self.passed_loading: set = set()
        self.pending_async_requests = _AsyncRequests()

    def get_finished(self, new_saving: list, new_loading: list, requests: Optional[dict] = None) -> tuple:
        self.pending_saving |= set(new_saving)
        self.pending_loading |= set(new_loading)
        self.passed_saving |= set(new_saving)
        self.passed_loading |= set(new_loading)
        for rid in new_loading:  # pending_async_requests.add_from(new_async_requests)
            if requests is not None and rid in requests:
                self.pending_async_requests.loading[rid] = requests[rid]
        saved, loaded = self.worker.get_finished(list(new_saving), list(new_loading))
        for rid in loaded:  # extract_by_id
            self.pending_async_requests.loading.pop(rid, None)
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
