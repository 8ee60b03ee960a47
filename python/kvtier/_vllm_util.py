"""Helpers of :mod:`kvtier.vllm` (no vLLM import at module level, so they are testable without an engine): what
keys a request's KV, how a block is laid out, and the translation of step records and tier events.

- :func:`_identity`: a request's identity string for kvtier's leader (LoRA, multimodal inputs, cache salt, prompt
  embeddings), as vLLM's own block hash separates requests (vllm/v1/core/kv_cache_utils.py);
- :func:`_resolved_layout` / :func:`_required_layout`: the KVCacheLayout vLLM resolved, and the one kvtier asks for
  (vllm/v1/attention/backends/utils.py resolve_kv_cache_layout; vllm/v1/kv_cache_layout.py).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.vllm")


def _resolved_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> str | None:
    """The KVCacheLayout name vLLM resolved (0.32+), or None (earlier releases, or not resolved yet)."""
    for obj in (kv_cache_config, getattr(vllm_config, "cache_config", None)):
        name = getattr(obj, "kv_cache_layout", None) if obj is not None else None
        if name:
            return str(getattr(name, "name", name))
    return None


# The layout kvtier asks vLLM for (get_required_kvcache_layout). Measured on the H200 (docs/bench/vllm.md,
# 2026-12-01): kvtier's loads run at the link rate (50-55 GB/s) in vLLM's default LBNHC (64 KiB pieces through the
# gather/scatter kernel) as in the block-outermost BLNHC (one range per block), and replays were not faster with
# BLNHC (32K tokens: 139 ms against 119 ms), so by default kvtier keeps vLLM's choice; ``kv_cache_layout`` asks for
# another. vLLM uses it only if every attention backend supports it (else it warns and keeps its own).
_LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "NHD", "HND")


def _required_layout(extra: dict[str, Any], on_cuda: bool) -> str | None:
    """``kv_cache_layout`` in the extra config: ``"auto"`` or ``"none"`` (default: vLLM's choice), or a
    KVCacheLayout name to ask vLLM for (e.g. ``"BLNHC"``: a block's KV over all layers in one range)."""
    want = str(extra.get("kv_cache_layout", "auto") or "none")
    if want.lower() in ("auto", "none"):
        return None
    if want.upper() not in _LAYOUT_NAMES:
        raise ValueError(f"kvtier: kv_cache_layout must be auto, none or one of {_LAYOUT_NAMES}, got {want!r}")
    return want.upper()


def _identity(request: "Request", embeds_digest: Any) -> tuple[str | None, bool, str]:
    """What besides its token ids keys a request's KV, as vLLM's own block hash separates it
    (vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys): the LoRA adapter (name and path), the
    multimodal inputs (identifier at their offset, with their length), the tenant ``cache_salt``, and a digest of
    the prompt embeddings. Returns ``(identity, cacheable, reason)``: one canonical string (JSON, so no value can
    forge another's separator) or None for a plain request; ``cacheable=False`` with the reason when kvtier cannot
    key the request (it is then neither matched nor stored). Keying by the whole request is stricter than vLLM's
    per-block keys (a later image also separates earlier blocks): it may share less, never more."""
    import json

    parts: list[list[Any]] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        parts.append(["lora", str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "") or "")])
    for f in getattr(request, "mm_features", None) or ():
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if ident is None or pos is None:
            return None, False, "a multimodal input without an identifier or position"
        parts.append(["mm", str(ident), int(pos.offset), int(pos.length)])
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(["salt", str(salt)])
    if getattr(request, "prompt_embeds", None) is not None:
        digest = embeds_digest(request)
        if digest is None:
            return None, False, "prompt embeddings that could not be digested"
        parts.append(["embeds", digest])
    if not parts:
        return None, True, ""
    return json.dumps(parts, separators=(",", ":"), ensure_ascii=True), True, ""


def _embeds_digest(request: "Request") -> str | None:
    """SHA-256 of the request's prompt embeddings (dtype, shape and bytes), like vLLM's per-block digests."""
    import hashlib

    try:
        t = request.prompt_embeds.detach().contiguous().cpu()
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        import torch

        h.update(t.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    except Exception:
        logger.warning("kvtier: could not digest a request's prompt embeddings", exc_info=True)
        return None


# Layer kinds whose KV kvtier stores and loads exactly (vllm/v1/kv_cache_interface.py): full attention (every token's K
# and V, read by every later token: the whole prefix), MLA, and a sliding window under vLLM's hybrid KV cache manager
# (the window of the hit's end; vllm/v1/core/single_type_kv_cache_manager.py SlidingWindowManager). Subclasses are not
# accepted by inheritance: RSWASpec and SinkFullAttentionSpec derive from these but keep other rules.
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOW_SPECS = ("SlidingWindowSpec",)

# What to do about a layer kind kvtier refuses, by spec name.
_REFUSAL_HINTS = {
    "MambaSpec": "kvtier does not store Mamba / linear-attention state; run this model without kvtier "
                 "(kv_transfer_config unset; vLLM needs its hybrid KV cache manager for these layers)",
    "ChunkedLocalAttentionSpec": "kvtier does not serve chunked local attention by group; leave "
                                 "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE unset or start vLLM with "
                                 "--disable-hybrid-kv-cache-manager (vLLM then keeps every layer's whole prefix in one "
                                 "full-attention group, which kvtier serves exactly), or run without kvtier",
}
_DEFAULT_HINT = ("kvtier would not reproduce this layer kind exactly; start vLLM with --disable-hybrid-kv-cache-manager "
                 "(every layer then keeps its whole prefix, served exactly) or run this model without kvtier")


def _spec_kind(spec: Any) -> tuple[str, int | None]:
    """A layer spec's class name and its attention reach in tokens (sliding window plus the tokens vLLM retains
    beyond it, ``extra_retained_tokens``; None for other kinds)."""
    name = type(spec).__name__
    if name in _WINDOW_SPECS:
        return name, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return name, None


def _kv_groups(kv_cache_config: Any, block_size: int | None = None) -> list[dict[str, Any]]:
    """The KV cache groups kvtier serves, one dict per group of ``kv_cache_config.kv_cache_groups`` (vLLM's order):
    ``kind`` (spec class name), ``window`` (tokens a sliding-window group attends; None: full attention),
    ``layers`` and ``page_bytes`` (one layer's bytes per block). Raises ValueError at engine start for a layer kind
    kvtier would not serve exactly, naming it and the setting that helps (issue 25)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    out: list[dict[str, Any]] = []
    for g in groups:
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        specs = list(inner.values()) if isinstance(inner, dict) and inner else [spec]
        kinds = {_spec_kind(s) for s in specs}
        names = sorted({k for k, _ in kinds})
        bad = [n for n in names if n not in _FULL_SPECS + _WINDOW_SPECS]
        described = ", ".join(f"{n}(window={w})" if w else n for n, w in sorted(kinds, key=str))
        if bad:
            hint = _REFUSAL_HINTS.get(bad[0], _DEFAULT_HINT)
            raise ValueError(f"kvtier: this model's layers include {described} (KV cache group {len(out)} of "
                             f"{len(groups)}); {hint}")
        if len(kinds) > 1:
            raise ValueError(f"kvtier: KV cache group {len(out)} mixes layer kinds ({described}); {_DEFAULT_HINT}")
        (kind, window), = kinds
        bs = int(getattr(spec, "block_size", 0) or 0)
        if block_size is not None and bs and bs != int(block_size):
            raise ValueError(f"kvtier: KV cache group {len(out)} ({described}) has {bs} tokens per block, the engine "
                             f"{block_size}; kvtier serves groups of the engine's block size only. {_DEFAULT_HINT}")
        out.append({"kind": kind, "window": window, "layers": list(g.layer_names),
                    "page_bytes": int(spec.page_size_bytes)})
    return out


def _refuse_inexact_layers(kv_cache_config: Any, vllm_config: Any = None) -> None:
    """Raise ValueError at engine start for a model whose layers kvtier would not serve exactly (see
    :func:`_kv_groups`)."""
    bs = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    _kv_groups(kv_cache_config, bs)


# Counters of requests and steps: with several KV cache groups each group's leader counts the same ones.
_PER_REQUEST_COUNTERS = ("steps", "active_requests", "match_queries", "matched_tokens", "load_restarts",
                         "preempted_requests", "uncacheable_requests")

# vLLM's block id for a position without a block (a sliding-window group's blocks before the window): the block pool's
# first block (vllm/v1/core/block_pool.py BlockPool.__init__: ``self.null_block = self.free_block_queue.popleft()``).
_NULL_BLOCK = 0


def _group_settings(base: dict[str, Any], groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One kvtier leader's (and worker's) settings per KV cache group (``_kv_groups``): the group's bytes per block,
    its window and vLLM's null block; with several groups, the group's index and kind (kvtier keys its blocks by
    them and gives it its share of the tiers: docs/arch/vllm.md "Hybrid models")."""
    if not groups:
        return [base]
    world = int(base.get("world_size", 1))
    out = []
    for i, g in enumerate(groups):
        s = dict(base)
        if len(groups) > 1:
            s["bytes_per_block"] = g["page_bytes"] * len(g["layers"]) * world
            s.update(kv_cache_group=i, kv_cache_groups=len(groups), kv_cache_group_kind=f"{g['kind']}:{g['window']}")
            # Every group's leader answers vLLM alike whether a hit loads asynchronously: in the step only when every
            # group's part lies in the host tier alone (kvtier::connector::groups::match_groups). Opt-in for a hybrid
            # model (connector.sync_host_loads: true; on the H200 it wins at 8K and loses at 32K: docs/bench/vllm.md);
            # asynchronous by default.
            s["sync_host_loads_default"] = False
        if g["window"]:
            s.update(sliding_window=g["window"], null_block=_NULL_BLOCK)
        out.append(s)
    return out


def _require_async_loads_with_groups(groups: int, async_loads: bool) -> None:
    """vLLM takes a hybrid model's failed load only by request and only for an asynchronous load (``failed_recving``;
    ``Scheduler._handle_invalid_blocks`` raises on block ids with several KV cache groups), so synchronous loads of
    such a model could not fail safely: refused at start."""
    if groups > 1 and not async_loads:
        from ._native import ConfigError

        raise ConfigError(f"async_loads=false with {groups} KV cache groups (a hybrid model): vLLM can recompute a "
                          "failed load of such a model only when it is asynchronous; leave async_loads on "
                          "(connector.async_loads, KVTIER_ASYNC_LOADS)")


def _group_ids(block_ids: Any, group: int) -> list[int]:
    """Group ``group``'s block ids of vLLM's per-group tuple (one list per KV cache group; a bare list is group 0's;
    None or a missing group: none)."""
    if block_ids is None:
        return []
    if isinstance(block_ids, tuple):
        return [int(b) for b in block_ids[group]] if len(block_ids) > group else []
    return [int(b) for b in block_ids] if group == 0 else []


def _first_group(block_ids: Any) -> list[int]:
    """Group 0's block ids (see :func:`_group_ids`)."""
    return _group_ids(block_ids, 0)


def _record(rid: str, new_tokens: list[int], new_block_ids: list[int], num_computed: int, num_scheduled: int,
            num_draft: int, is_new: bool, resumed: bool) -> tuple:
    """One entry of kvtier's step contract (``StepRecord``), in its cheapest form: a tuple, the token list passed
    as vLLM holds it (ints; kvtier converts and checks them in one pass: a 32K-token prompt cost ~2 ms more through
    a per-token ``int()`` here, on the critical path of its first forward)."""
    return (rid, new_tokens, new_block_ids, int(num_computed), int(num_scheduled), int(num_draft), is_new, resumed)


_MEDIA = {"host": "CPU", "disk": "STORAGE", "remote": "STORAGE"}

# Counters (monotonic) are summed across vLLM's stats intervals; gauges are not. The leader's come from kvtier's one
# counter table (kvtier::metrics::METRICS, preempted_requests included); the adapter adds its own errors.
_ADAPTER_COUNTERS = frozenset(("adapter_errors",))


def _table_counters() -> frozenset:
    try:
        from kvtier import _native

        return frozenset(m["key"] for m in _native.metrics_table() if m["kind"] == "counter")
    except (ImportError, AttributeError):  # a development backend without the native module
        return frozenset()


_COUNTERS = _ADAPTER_COUNTERS | _table_counters()


def _key(h: Any) -> bytes:
    """A kvtier sequence hash (128-bit) as vLLM's ExternalBlockHash (bytes: msgpack ints stop at 64 bits)."""
    return int(h).to_bytes(16, "big")


def _vllm_events(raw: Iterable[Any], block_size: int) -> list:
    """kvtier's tier events as vLLM KV events (medium CPU for host memory, STORAGE for disk and remote)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out = []
    for ev in raw:
        kind = ev.get("kind")
        medium = _MEDIA.get(str(ev.get("tier", "")).lower(), "STORAGE")
        keys = [_key(h) for h in ev.get("hashes", ())]
        if not keys:
            continue
        if kind == "stored":
            parent = ev.get("parent")
            out.append(BlockStored(block_hashes=keys, parent_block_hash=_key(parent) if parent is not None else None,
                                   token_ids=[int(t) for t in ev.get("token_ids", ())], block_size=block_size,
                                   lora_id=None, medium=medium, lora_name=None))
        elif kind == "removed":
            out.append(BlockRemoved(block_hashes=keys, medium=medium))
    return out


# Profiling aid: with KVTIER_VLLM_TRACE=PATH every connector call of interest appends (perf_counter, event, request,
# detail) here, written to PATH at shutdown (one engine process: scheduler and worker share the clock).
_TRACE_PATH = os.environ.get("KVTIER_VLLM_TRACE")
_TRACE: list[tuple[float, str, str, Any]] = []


def _trace(event: str, rid: str = "", detail: Any = None) -> None:
    if _TRACE_PATH:
        _TRACE.append((time.perf_counter(), event, rid, detail))


def _trace_dump() -> None:
    if not _TRACE_PATH or not _TRACE:
        return
    import json

    with open(_TRACE_PATH, "a") as f:
        for t, ev, rid, detail in _TRACE:
            f.write(json.dumps({"t": t, "ev": ev, "rid": rid, "d": detail}) + "\n")
    _TRACE.clear()


def _backend(settings: dict[str, Any]) -> Any:
    """The module providing ``Leader`` and ``Worker``: kvtier's native core, or (for developing this adapter
    only) the module named by ``KVTIER_VLLM_BACKEND_MODULE``."""
    name = os.environ.get("KVTIER_VLLM_BACKEND_MODULE")
    if name:
        return importlib.import_module(name)
    from kvtier import _native

    return _native


def _publishes_kv_events(vllm_config: "VllmConfig") -> bool:
    """Whether vLLM publishes KV cache events: it asks the connector for them every step (``take_events`` in
    ``Scheduler.update_from_output``) and hands them to a publisher that drops them unless ``kv_events_config``
    enables one (vllm/distributed/kv_events.py ``EventPublisherFactory.create``). Without one, building an event
    per stored block is wasted on the step's critical path."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False)
                and getattr(cfg, "publisher", "null") != "null")


def _recompute_failed_loads(vllm_config: "VllmConfig") -> None:
    """kvtier reports failed loads so that vLLM recomputes them; vLLM's default policy ("fail") would abort the
    request instead. The scheduler reads the policy right after building its connector."""
    ktc = vllm_config.kv_transfer_config
    if getattr(ktc, "kv_load_failure_policy", "recompute") == "recompute":
        return
    try:
        ktc.kv_load_failure_policy = "recompute"
        logger.info("kvtier: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)")
    except Exception:  # frozen config: a failed load then fails its request, still never serves wrong KV
        logger.warning("kvtier: could not set kv_load_failure_policy='recompute'; failed loads will fail requests")
