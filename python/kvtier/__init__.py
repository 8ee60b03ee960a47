"""kvtier: a tiered KV-cache block manager for LLM inference (Rust core, thin Python adapters).

Engine adapters:

* ``kvtier.trtllm`` - TensorRT-LLM's KV connector (scheduler + worker classes,
  ``build_kv_connector_config``; ``python -m kvtier.trtllm config`` prints the YAML block);
* ``kvtier.vllm`` - vLLM's ``KVConnectorBase_V1``.

Every error kvtier raises derives from :class:`KvtierError`; :class:`LayoutError` is also a
``ValueError``.
"""

from ._native import (
    ConfigError,
    ConnectorError,
    KvtierError,
    LayoutError,
    PoolError,
    TensorDesc,
    TransferError,
    __version__,
    init_logging,
)
from ._tensors import describe

__all__ = [
    "ConfigError",
    "ConnectorError",
    "KvtierError",
    "LayoutError",
    "PoolError",
    "TensorDesc",
    "TransferError",
    "__version__",
    "describe",
    "init_logging",
]
