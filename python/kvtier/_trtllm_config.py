"""Configuration of kvtier for TensorRT-LLM: ``KvCacheConnectorConfig``, ``LLM(...)`` keyword
arguments and the YAML block for ``trtllm-serve --extra_llm_api_options`` (one block for 1.2.0rc2
to 1.4.x: the fields used exist in every ``llmapi/llm_args.py`` of that range), and the variable
that carries kvtier's settings to spawned ranks. Re-exported by :mod:`kvtier.trtllm`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from ._native import ConfigError
from ._trtllm_refusals import engine_windows, uses_kv_cache_manager_v2

#: The oldest TensorRT-LLM whose ``RequestData`` carries ``num_scheduled_tokens``.
MIN_TRTLLM_VERSION = "1.2.0rc2"

SCHEDULER_CLASS = "KvtierConnectorScheduler"
WORKER_CLASS = "KvtierConnectorWorker"

#: Accepted ``--connector`` names. "kvbm" is kept so configurations written for the original migrate,
#: but only as *this* function's argument: in TensorRT-LLM's own ``kv_connector_config.connector``
#: preset field (``connectors/registry.py``) "kvbm" means Dynamo's ``kvbm.trtllm_integration``.
CONNECTOR_NAMES = ("kvtier", "kvbm", "none")

#: Environment variable carrying kvtier's settings to spawned MPI ranks: TensorRT-LLM's workers
#: inherit only TRTLLM*/TLLM* variables (docs/source/features/kv-cache-connector.md).
RANK_SETTINGS_ENV = "TRTLLM_KVTIER_SETTINGS"


def export_settings_for_ranks() -> None:
    """Copy this process's KVTIER_* / DYN_KVBM_* variables into ``TRTLLM_KVTIER_SETTINGS``, which
    TensorRT-LLM's spawned MPI ranks inherit (they inherit no other variable)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("KVTIER_", "DYN_KVBM_"))}
    if env:
        os.environ[RANK_SETTINGS_ENV] = json.dumps(env, sort_keys=True)


def _connector_fields(connector: Optional[str]) -> Optional[dict[str, str]]:
    if connector is None:
        return None
    name = str(connector).strip().lower()
    if name == "none":
        return None
    if name not in ("kvtier", "kvbm"):
        raise ConfigError(f"unknown connector {connector!r}: valid names are {', '.join(CONNECTOR_NAMES)}")
    return {
        "connector_module": "kvtier.trtllm",
        "connector_scheduler_class": SCHEDULER_CLASS,
        "connector_worker_class": WORKER_CLASS,
    }


def build_kv_connector_config(connector: Optional[str]) -> Any:
    """TensorRT-LLM's ``KvCacheConnectorConfig`` for ``connector`` ("kvtier", its alias "kvbm", or
    "none"/None for no connector, which returns None), naming kvtier's module and classes
    explicitly (never the ``connector`` preset field: TensorRT-LLM's registry maps "kvbm" to
    Dynamo). Also exports this process's kvtier settings for spawned ranks. Without TensorRT-LLM
    installed the fields come back as a dict."""
    fields = _connector_fields(connector)
    if fields is None:
        return None
    export_settings_for_ranks()
    try:
        from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
    except ImportError:
        return fields
    return KvCacheConnectorConfig(**fields)


def llm_options(connector: Optional[str], role: str = "agg") -> dict[str, Any]:
    """The ``LLM(...)`` / ``--extra_llm_api_options`` fields kvtier needs, as plain data. Roles:
    "agg" and "prefill" run the connector; "decode" (a disaggregated decode worker) runs without one:
    TensorRT-LLM's ``KvCacheConnectorManager.get_num_new_matched_tokens`` raises for
    generation-only requests whenever a connector is configured."""
    if role not in ("agg", "prefill", "decode"):
        raise ConfigError(f"unknown role {role!r}: agg, prefill or decode")
    fields = None if role == "decode" else _connector_fields(connector)
    if fields is None:
        return {}
    return {
        "kv_connector_config": dict(fields),
        # Partial reuse writes into stored blocks; the native host tier moves blocks kvtier tracks.
        "kv_cache_config": {"enable_partial_reuse": False, "host_cache_size": 0},
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
        # CUDA graphs are fine: kvtier completes loads in start_load_kv and needs no layer hook.
        "cuda_graph_config": {"enable_padding": True},
        "enable_attention_dp": False,
    }


def build_llm_kwargs(connector: Optional[str] = "kvtier", role: str = "agg") -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM`` (TensorRT-LLM's config classes where installed)."""
    opts = llm_options(connector, role)
    if not opts:
        return {}
    kw: dict[str, Any] = {"kv_connector_config": build_kv_connector_config(connector)}
    try:
        from tensorrt_llm.llmapi.llm_args import KvCacheConfig, SchedulerConfig
    except ImportError:
        kw.update({k: v for k, v in opts.items() if k != "kv_connector_config"})
        return kw
    kw["kv_cache_config"] = KvCacheConfig(**opts["kv_cache_config"])
    kw["scheduler_config"] = SchedulerConfig(capacity_scheduler_policy=opts["scheduler_config"]["capacity_scheduler_policy"])
    kw["enable_attention_dp"] = False
    return kw


def _yaml(d: dict, indent: int = 0) -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:")
            out += _yaml(v, indent + 2)
        else:
            out.append(" " * indent + f"{k}: {str(v).lower() if isinstance(v, bool) else v}")
    return out


def connector_yaml(connector: Optional[str], role: str = "agg") -> str:
    """The YAML block for ``trtllm-serve --extra_llm_api_options`` (empty for "none")."""
    opts = llm_options(connector, role)
    head = [
        f"# kvtier for TensorRT-LLM {MIN_TRTLLM_VERSION} .. 1.4.x, role {role}.",
        "# kv_connector_config names kvtier's module and classes; do not use the `connector: kvbm`",
        "# preset field: TensorRT-LLM's registry maps kvbm to Dynamo's kvbm.trtllm_integration.",
        f"# Spawned ranks inherit only TRTLLM*/TLLM* variables: export {RANK_SETTINGS_ENV}='{{\"KVTIER_...\": \"...\"}}'.",
    ]
    if role == "decode":
        head.append("# Decode worker: no connector (upstream raises for generation-only requests with one).")
    if not opts:
        return "\n".join(head) + "\n" if role == "decode" else ""
    return "\n".join(head + _yaml(opts)) + "\n"


def layer_hooks_always_run(llm_args: Any) -> bool:
    """Whether every forward of this engine runs its decoder layers' hooks (``wait_for_layer_load``
    before each layer): no CUDA graph of any kind and no ``torch.compile``. A captured graph replays
    without Python, so without the hooks (``model_engine.py``: decode batches, one-token context
    batches ``_make_single_token_context_graph_batch``, prefill graphs ``prefill_cuda_graph_backend``,
    ``torch_compile_config`` piecewise graphs); hooks are installed on every ``DecoderLayer``
    (``py_executor.py``) and, from 1.4, only if ``requires_layerwise_transfer_hooks()``."""
    if getattr(llm_args, "cuda_graph_config", None) is not None:
        return False
    if getattr(llm_args, "torch_compile_config", None) is not None:
        return False
    prefill = getattr(llm_args, "prefill_cuda_graph_backend", None)
    name = getattr(prefill, "value", prefill)
    return name is None or str(name).lower() in ("disabled", "none", "off")


def cli(argv: Optional[Sequence[str]], description: str) -> int:
    """``python -m kvtier.trtllm config``: print the YAML block for ``--extra_llm_api_options``."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.trtllm", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="print the YAML block for trtllm-serve --extra_llm_api_options")
    cfg.add_argument("--connector", default="kvtier", help=f"one of {', '.join(CONNECTOR_NAMES)} (default kvtier)")
    cfg.add_argument("--role", default="agg", help="agg (default), prefill or decode (disaggregated serving)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(connector_yaml(args.connector, args.role))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def loads_go_layer_by_layer(llm_args: Any) -> bool:
    """Whether this engine's synchronous loads go layer by layer (ordered on the forward's stream, each
    layer waited for in ``wait_for_layer_load``): every forward runs the layer hooks
    (:func:`layer_hooks_always_run`), on the V1 KV cache manager (its pool's layers are the decoder
    layers; a V2 ``KvCacheLayout``'s regions need not be) with one layer group (no sliding windows). Such
    an engine also loads host-tier hits in the step by default (``connector.sync_host_loads``): the
    executor thread does not wait for them, and the forward of each layer runs while later ones are
    copied, where an asynchronous load parks the request for at least one more iteration."""
    return (layer_hooks_always_run(llm_args) and not uses_kv_cache_manager_v2(llm_args)
            and engine_windows(llm_args) is None)
