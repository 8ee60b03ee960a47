"""TensorRT-LLM's ``KvCacheLayout`` (KVCacheManagerV2, ``connectors/kv_cache_layout.py``) as the
tensors kvtier's workers register: page slot ``i`` of a region lives at ``base + stride * i`` for
``size`` bytes, and each region becomes a ``[num_slots, tokens_per_block, bytes]`` tensor of 2-byte
units. One full-attention layer group gives one worker's tensors; with sliding windows (one layer
group per window, page ids scoped to their group) each group gives its worker's, in kvtier's group
order (``_trtllm_groups``). Used by :class:`kvtier.trtllm.KvtierConnectorWorker`.

What kvtier does not serve is refused here, naming the setting that helps: several layer groups
where the engine's settings declare none, a lone sliding-window group, replicated regions (side
caches), a region that is not whole tokens of 2-byte units, a group without regions.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _native
from . import _trtllm_groups as _groups
from ._native import ConfigError

__all__ = ["group_tensors", "region_tensors", "single_group_tensors"]


def _current_device() -> tuple[str, int]:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return "cuda", int(torch.cuda.current_device())
    return "cpu", 0


def region_tensors(layout: Any, g: Any, tokens_per_block: int) -> list:
    """Each region of layer group ``g`` as a ``[num_slots, tokens_per_block, bytes]`` tensor."""
    tpb = int(getattr(layout, "tokens_per_block", tokens_per_block))
    device, index = _current_device()
    device = str(getattr(layout, "device", device))  # test pools in host memory say "cpu"
    tensors = []
    for i, r in enumerate(g.regions):
        size, stride = int(r.size), int(r.stride)
        if size % (tpb * 2):
            raise ConfigError(f"KvCacheLayout region {i}: {size} bytes are not {tpb} tokens of 2-byte units")
        inner = size // (tpb * 2)
        desc = _native.TensorDesc(int(r.base), [int(r.num_slots), tpb, inner], [stride, inner * 2, 2], 2,
                                  "float16", device, index)
        tensors.append((f"region {i}", desc))
    if not tensors:
        raise ConfigError("KvCacheLayout has no regions")
    return tensors


def _no_side_caches(g: Any) -> None:
    if getattr(g, "replicated_regions", ()):
        raise ConfigError("KvCacheLayout has replicated regions (side caches): not supported by kvtier")


def single_group_tensors(layout: Any, tokens_per_block: int) -> list:
    """The one full-attention layer group's tensors (the engine's settings declare no windows)."""
    groups = list(getattr(layout, "groups", ()))
    windows = [getattr(g, "window_size", None) for g in groups]
    if len(groups) != 1:
        raise ConfigError(f"KvCacheLayout has {len(groups)} layer groups (window_size per group: {windows}; "
                          "variable sliding-window or hybrid attention): kvtier serves one full-attention "
                          "layer group only (kv_cache_config.max_attention_window)")
    g = groups[0]
    if windows[0] is not None:
        raise ConfigError(f"KvCacheLayout's layer group is sliding-window attention (window_size={windows[0]}): "
                          "kvtier serves full-attention layers only (kv_cache_config.max_attention_window)")
    _no_side_caches(g)
    return region_tensors(layout, g, tokens_per_block)


def group_tensors(layout: Any, windows: list, tokens_per_block: int) -> tuple[list, list]:
    """Sliding windows: ``(tensors, order)``, each group's tensors at kvtier's index of the group
    (``windows``: kvtier's order), and kvtier's index of each of the layout's groups."""
    order = _groups.layout_groups(layout, windows)
    tensors: list = [None] * len(windows)
    for g, k in zip(layout.groups, order):
        _no_side_caches(g)
        tensors[k] = region_tensors(layout, g, tokens_per_block)
    return tensors, order
