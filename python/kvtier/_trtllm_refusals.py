"""What kvtier refuses to run under TensorRT-LLM, checked at engine start (the scheduler's and every
worker's constructor), each refusal naming the setting, and for the model's layers the layer kind
(issue 25, item 4). Re-exported by :mod:`kvtier.trtllm`."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from . import _native
from ._native import ConfigError


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for p in path:
        obj = getattr(obj, p, None)
        if obj is None:
            return default
    return obj


def _name(v: Any) -> str:
    return str(getattr(v, "name", v))


def _mapping(llm_args: Any) -> Any:
    to_mapping = _get(llm_args, "parallel_config", "to_mapping")
    return to_mapping() if callable(to_mapping) else None


def _config_path(llm_args: Any) -> Optional[str]:
    """Where the model's ``config.json`` is on this machine: in ``llm_args.model`` if that is a
    checkpoint directory, else in the Hugging Face cache for a hub name (read offline, never
    fetched: ``huggingface_hub.try_to_load_from_cache``), else None."""
    model = getattr(llm_args, "model", None)
    if not isinstance(model, (str, os.PathLike)):
        return None
    if os.path.isdir(model):
        return os.path.join(model, "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(model), "config.json", revision=getattr(llm_args, "revision", None))
    except Exception:  # not a repo id, or no huggingface_hub: nothing to read
        return None
    return found if isinstance(found, str) else None


def _model_config(llm_args: Any) -> dict:
    """The model's ``config.json`` (TensorRT-LLM builds the model from the same file); ``{}`` where it
    is not on this machine or unreadable."""
    path = _config_path(llm_args)
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    text = cfg.get("text_config")  # multimodal checkpoints (Gemma 3, Llama 4) nest the decoder's
    return text if isinstance(text, dict) else cfg


def _windowed_layers(llm_args: Any) -> Optional[str]:
    """The model's sliding-window layers as its ``config.json`` names them (``layer_types`` with
    ``sliding_window``, Gemma 3's ``sliding_window_pattern``, Qwen2's ``use_sliding_window``,
    Mistral's ``sliding_window``), or None for a full-attention model (or one not read here)."""
    cfg = _model_config(llm_args)
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if cfg.get("use_sliding_window") is False:
        return None  # Qwen2: the window is declared but not used
    seq = getattr(llm_args, "max_seq_len", None)
    if seq is not None and window >= int(seq):
        return None  # the window never passes a block of a request this engine admits
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and kinds:
        counts: dict = {}
        for k in kinds:
            counts[str(k)] = counts.get(str(k), 0) + 1
        if not any("sliding" in k for k in counts):
            return None
        shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        return f"layer_types: {shown}; sliding_window={window}"
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        return f"sliding-window attention on {pattern - 1} of every {pattern} layers (sliding_window_pattern); " \
               f"sliding_window={window}"
    return f"sliding-window attention on every layer; sliding_window={window}"


def _config_windows(llm_args: Any) -> Optional[set]:
    """The attention windows the model's ``config.json`` declares (None: full attention), as
    TensorRT-LLM's KV cache will group its layers; None for a full-attention model (or one not read
    here)."""
    if _windowed_layers(llm_args) is None:
        return None
    cfg = _model_config(llm_args)
    window = int(cfg["sliding_window"])
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return {window if "sliding" in str(k) else None for k in kinds}
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        return {window, None}
    return {window}


def uses_kv_cache_manager_v2(llm_args: Any) -> bool:
    v2 = getattr(llm_args, "use_kv_cache_manager_v2", None)
    if v2 is None:
        v2 = getattr(getattr(llm_args, "kv_cache_config", None), "use_kv_cache_manager_v2", False)
    return bool(v2)


def engine_windows(llm_args: Any) -> Optional[list]:
    """The distinct attention windows of the engine's KV cache layer groups in kvtier's order (None,
    full attention, first; then windows ascending), from ``kv_cache_config.max_attention_window`` (an
    entry at least ``max_seq_len`` is full attention: KVCacheManagerV2 normalizes it to None) or else
    the model's ``config.json``; None when every layer attends its whole prefix."""
    seq = getattr(llm_args, "max_seq_len", None)
    window = getattr(getattr(llm_args, "kv_cache_config", None), "max_attention_window", None)
    if window:
        found = {None if seq is not None and int(w) >= int(seq) else int(w) for w in window}
    else:
        found = _config_windows(llm_args)
    if not found or found == {None}:
        return None
    return sorted(found, key=lambda w: (w is not None, w or 0))


def _window_refusals(llm_args: Any, windows: list, tiers: dict) -> list:
    """Sliding windows are served on KVCacheManagerV2 with the host tier, at any TP size
    (``_trtllm_groups``); the rest is refused, naming the layer kind and the setting."""
    kv = getattr(llm_args, "kv_cache_config", None)
    setting = getattr(kv, "max_attention_window", None)
    seq = getattr(llm_args, "max_seq_len", None)
    sliding = [w for w in windows if w is not None]
    kind = "variable sliding-window attention (VSWA)" if len(windows) > 1 else "sliding-window attention"
    where = (f"kv_cache_config.max_attention_window={list(setting)}" if setting else
             f"the model {getattr(llm_args, 'model', '')} ({_windowed_layers(llm_args)}; config.json)")
    what = f"{where}: {kind} layers (windows {sliding} tokens, max_seq_len={seq})"
    out = []
    if not uses_kv_cache_manager_v2(llm_args):
        # resource_manager.py KVCacheManager.get_cache_indices raises "window_size must be provided for
        # VSWA" when called without a window, as connectors/kv_cache_connector.py
        # KvCacheConnectorSchedulerOutputRequest.update_and_build_data calls it on the V1 manager; with
        # one window V1's per-window page list was not checked against kvtier.
        out.append(f"{what} on the V1 KV cache manager: its connector path reports one flat page list "
                   "(and raises for several windows); set kv_cache_config.use_kv_cache_manager_v2=true, "
                   "whose per-layer-group page ids kvtier serves")
    # Tensor parallelism is served with the host tier alone, as one rank is: every rank's host copy
    # of a block is written before the leader lists it (stores confirmed by every rank), and a load
    # from pinned host memory fails only with the device, so no rank ever rewinds a request under a
    # window. What makes a window unsafe is a load that can fail (below), at any TP size.
    fallible = [n for n in ("disk", "remote") if tiers.get(n)]
    if fallible and len(windows) > 0 and any(w is not None for w in windows):
        # A load from the disk or remote tier can fail (a damaged or vanished block); kvtier then has the
        # request recomputed from where its offer began. Under a window kv_cache_manager_v2.py gave the
        # window's layer group no page (-1) for the blocks behind the window of the served end
        # (_stale_block_range after _resize_for_connector_prefix), so that recompute would write and read
        # blocks without a page (tests/test_trtllm_vswa.py reproduces it in the driver). Host-tier loads do
        # not fail that way: a matched host block is held from the match to the allocation of one
        # scheduling pass, and a copy between pinned host memory and the GPU fails only with the device.
        out.append(f"{what} with a {' and '.join(fallible)} tier: a failed {'/'.join(fallible)} load is recovered "
                   "by recomputing the request from where kvtier's offer began, and KVCacheManagerV2 gives a "
                   "window's layer group no page for the blocks behind the window of the loaded prefix "
                   "(_stale_block_range), so that recompute would write into blocks without a page; use the "
                   "host tier alone with this model (unset the disk and remote settings)")
    if setting and seq is None:
        out.append(f"{what}: set max_seq_len (an entry equal to it is full attention, which kvtier must know "
                   "to group the layers as TensorRT-LLM does)")
    return out


#: ``layer_types`` entries kvtier serves (everything else names a layer kind it refuses).
_ATTENTION_KINDS = ("full_attention", "sliding_attention")


def _stateful_or_chunked_layers(llm_args: Any) -> Optional[str]:
    """Layers whose state is not whole-prefix KV blocks, as ``config.json`` names them: recurrent /
    linear-attention layers (``layer_types`` other than full or sliding attention, Nemotron-H's
    ``hybrid_override_pattern`` with ``M``, Jamba's ``layers_block_type`` with ``mamba``, Mamba's
    ``model_type``) keep a per-request state kvtier never stores, so a prefix hit would skip building
    it; chunked local attention (Llama 4's ``attention_chunk_size`` below ``max_seq_len``) frees the
    blocks a chunk passed, as a window does. None when there are none (or the file is not here)."""
    cfg = _model_config(llm_args)
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list):
        other: dict = {}
        for k in kinds:
            if str(k) not in _ATTENTION_KINDS:
                other[str(k)] = other.get(str(k), 0) + 1
        if other:
            return "layer_types: " + ", ".join(f"{n} {k}" for k, n in sorted(other.items()))
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:
        return f"{pattern.count('M')} Mamba layers (hybrid_override_pattern={pattern})"
    blocks = cfg.get("layers_block_type")
    if isinstance(blocks, list) and any("mamba" in str(b).lower() for b in blocks):
        n = sum(1 for b in blocks if "mamba" in str(b).lower())
        return f"{n} Mamba layers (layers_block_type)"
    model_type = str(cfg.get("model_type", ""))
    if "mamba" in model_type.lower():
        return f"Mamba layers (model_type={model_type})"
    chunk = cfg.get("attention_chunk_size")
    seq = getattr(llm_args, "max_seq_len", None)
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 and (seq is None or chunk < int(seq)):
        return f"chunked local attention (attention_chunk_size={chunk}, max_seq_len={seq})"
    return None


def _refusals(llm_args: Any, tiers: dict) -> list[str]:
    """Configurations kvtier cannot serve correctly, each named by its setting."""
    out = []
    kv = getattr(llm_args, "kv_cache_config", None)
    if getattr(kv, "enable_partial_reuse", False):
        out.append("kv_cache_config.enable_partial_reuse must be false (partial block reuse lets the engine "
                   "write into blocks kvtier has stored)")
    if int(getattr(kv, "host_cache_size", 0) or 0) > 0:
        out.append("kv_cache_config.host_cache_size: TensorRT-LLM's native host tier moves blocks kvtier "
                   "tracks; use kvtier's host tier instead (DYN_KVBM_CPU_CACHE_GB)")
    windows = engine_windows(llm_args)
    if windows is not None:
        out += _window_refusals(llm_args, windows, tiers)
    other = _stateful_or_chunked_layers(llm_args)
    if other is not None:
        out.append(f"the model {getattr(llm_args, 'model', '')} has layers kvtier cannot serve ({other}; "
                   "config.json): kvtier stores and loads whole-prefix KV blocks of attention layers only, so a "
                   "prefix hit would skip building their state or read blocks TensorRT-LLM freed; run this model "
                   "without kvtier")
    if int(getattr(llm_args, "max_beam_width", 1) or 1) > 1:
        out.append("max_beam_width > 1: beams share and fork blocks the connector API does not report")
    if getattr(llm_args, "speculative_config", None) is not None:
        out.append("speculative_config: rejected draft tokens shrink the page list without telling the "
                   "connector, so kvtier could store KV of rejected drafts")
    if getattr(llm_args, "enable_attention_dp", False):
        out.append("enable_attention_dp: each attention-DP rank schedules its own requests; kvtier's "
                   "classes do not set supports_attention_dp")
    m = _mapping(llm_args)
    if int(getattr(m, "pp_size", 1) or 1) > 1:
        out.append("pipeline_parallel_size > 1: TensorRT-LLM's connector API does not support it")
    policy = _get(llm_args, "scheduler_config", "capacity_scheduler_policy")
    if policy is not None and not _name(policy).upper().endswith("GUARANTEED_NO_EVICT"):
        out.append(f"scheduler_config.capacity_scheduler_policy={_name(policy)}: kvtier needs GUARANTEED_NO_EVICT "
                   "(a request evicted mid-flight would lose blocks with copies in flight)")
    fallible = [n for n in ("disk", "remote") if tiers.get(n)]
    if fallible and not tiers.get("async_loads"):
        out.append(f"async_loads=false with a {' and '.join(fallible)} tier: a failed synchronous load cannot be "
                   "recomputed once the batch is scheduled; leave KVTIER_ASYNC_LOADS unset (true)")
    return out


def _check(llm_args: Any, settings: dict) -> dict:
    """Refuse what kvtier cannot serve; the configured tiers and load modes otherwise."""
    tiers = dict(_native.configured_tiers(settings))
    problems = _refusals(llm_args, tiers)
    if problems:
        raise ConfigError("kvtier cannot run with this TensorRT-LLM configuration: " + "; ".join(problems))
    return tiers


