"""Type stubs for kvtier._native, the Rust extension (PyO3, abi3). See docs/arch/py.md.

Conventions: request ids are ``str`` (adapters convert engine ids with ``str(id)``); device block
ids are the engine's block indices (``int`` >= 0); CUDA streams are raw handles (``int``, 0 = the
legacy default stream) or ``None`` for engines without streams (CPU). Every error is a
``KvtierError`` subclass; nothing here aborts the process.
"""

from typing import Optional, Sequence

__version__: str

class KvtierError(Exception): ...
class ConfigError(KvtierError): ...
class LayoutError(KvtierError, ValueError): ...
class PoolError(KvtierError): ...
class ConnectorError(KvtierError): ...
class TransferError(KvtierError): ...

def init_logging(filter: Optional[str] = None) -> bool:
    """Install a tracing subscriber on stderr (filter like "kvtier=debug", else $KVTIER_LOG, else "warn")."""

class TensorDesc:
    """A plain description of an engine tensor; build it with ``kvtier.describe(obj)``."""

    data_ptr: int
    shape: list[int]
    strides: list[int]  # bytes
    itemsize: int
    dtype: str
    device: str  # "cpu" | "cuda"
    device_index: int
    nbytes: int
    def __init__(
        self,
        data_ptr: int,
        shape: Sequence[int],
        strides: Sequence[int],
        itemsize: int,
        dtype: str,
        device: str = "cpu",
        device_index: int = 0,
    ) -> None: ...
    @staticmethod
    def contiguous_strides(shape: Sequence[int], itemsize: int) -> list[int]: ...

class Config:
    """kvtier's typed configuration (defaults < $KVTIER_CONFIG TOML < KVTIER_* / DYN_KVBM_* env < overrides)."""

    @staticmethod
    def from_env(overrides: Optional[dict[str, object]] = None) -> "Config":
        """Raises ConfigError naming the setting on invalid input. ``overrides`` keys are the TOML keys."""
    def to_json(self) -> str: ...

class StepRecord:
    """One scheduled request in one engine step (the engine-neutral step contract)."""

    request_id: str
    new_tokens: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_draft_tokens: int
    is_new: bool
    resumed_from_preemption: bool
    def __init__(
        self,
        request_id: str,
        new_tokens: Sequence[int],
        new_block_ids: Sequence[int],
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        *,
        num_draft_tokens: int = 0,
        is_new: bool = False,
        resumed_from_preemption: bool = False,
    ) -> None: ...

class Leader:
    """Scheduler side: per-request slots, pools, matching. One per engine (rank 0)."""

    def __init__(self, config: Config, *, block_size: int, world_size: int = 1) -> None: ...
    @property
    def endpoint(self) -> Optional[str]:
        """ZeroMQ endpoint other ranks' workers connect to (None while world_size == 1)."""
    def get_num_new_matched_tokens(
        self, request_id: str, tokens: Sequence[int], num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens kvtier can load beyond the device prefix and whether the load is async.
        Never (0, True). Side-effect free apart from remembering the match for the request."""
    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: Optional[int] = None
    ) -> None:
        """The engine allocated ``block_ids`` for the request. ``num_external_tokens`` None = the
        count of the last match (TensorRT-LLM); vLLM passes its own (0 after an async load)."""
    def build_connector_meta(self, records: Sequence[StepRecord], finished: Sequence[str] = ()) -> bytes:
        """Consume one step; returns the picklable metadata every worker's ``bind_metadata`` gets."""
    def request_finished(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """True while any store of the request is unconfirmed (keep its blocks until workers report it saved)."""
    def stats(self) -> dict[str, int]:
        """Counters: offloaded/onboarded blocks per tier, matches, hits (see docs/arch/py.md)."""

class Worker:
    """Worker side, one per rank: owns the tier memory, executes the leader's transfers."""

    def __init__(
        self,
        config: Config,
        *,
        rank: int = 0,
        world_size: int = 1,
        leader: Optional[Leader] = None,
        leader_endpoint: Optional[str] = None,
    ) -> None:
        """``leader``: in-process channel (rank 0). Otherwise ZeroMQ to ``leader_endpoint`` or
        $KVTIER_LEADER_ENDPOINT."""
    def register_trtllm_pool(self, tensor: TensorDesc, tokens_per_block: int, num_layers: Optional[int] = None) -> None:
        """TensorRT-LLM's pool ``[num_blocks, num_layers, kv_factor, tokens_per_block*heads*head_dim]``.
        LayoutError (a ValueError) naming the dimension that does not fit."""
    def register_layer_tensors(self, tensors: Sequence[TensorDesc], tokens_per_block: int, block_dim: int) -> None:
        """One tensor per layer (layer order), all of one shape; ``block_dim`` indexes blocks. The
        dims before it are separate planes (e.g. K/V in ``[2, num_blocks, ...]``), the dims after it
        must be contiguous. Each (layer, plane, block) is opaque bytes."""
    def bind_metadata(self, metadata: bytes) -> None: ...
    def start_load(self, stream: Optional[int]) -> None: ...
    def wait_for_layer_load(self, layer: int, stream: Optional[int]) -> None: ...
    def save_kv_layer(self, layer: int, stream: Optional[int]) -> None: ...
    def wait_for_save(self, stream: Optional[int]) -> None: ...
    def forward_pass_done(self, stream: Optional[int]) -> None:
        """End of the forward pass on ``stream``: this step's stores may now read device blocks."""
    def get_finished(
        self, finished: Sequence[str], started_loading: Sequence[str]
    ) -> tuple[list[str], list[str]]:
        """(saved, loaded) request ids; each only after it was passed in here."""
    def take_load_errors(self) -> list[int]:
        """Device block ids whose load failed since the last call (their requests are never reported loaded)."""
    def shutdown(self, timeout_s: float = 10.0) -> None: ...
