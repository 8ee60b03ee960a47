"""Workloads and helpers shared by the TensorRT-LLM connector tests (tests/test_trtllm_*.py)."""

from __future__ import annotations

import importlib.util
import itertools
import random
from typing import Any, Optional

from kvtier import trtllm
from trtllm_driver import DEFAULT_MODEL_SEED, VOCAB, FakeTrtllmEngine, Geometry, next_token, prefix_hashes

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def cuda_available() -> bool:
    if not HAVE_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


def stream_factory(pool_kind: str) -> Any:
    if pool_kind != "torch-cuda":
        return None
    import torch

    return lambda: torch.cuda.current_stream()


def engine(pool_kind: str = "numpy", scheduler: Optional[type] = None, worker: Optional[type] = None,
           **kw: Any) -> FakeTrtllmEngine:
    return FakeTrtllmEngine(
        scheduler or trtllm.KvtierConnectorScheduler,
        worker or trtllm.KvtierConnectorWorker,
        pool_kind=pool_kind,
        stream_factory=kw.pop("stream_factory", None) or stream_factory(pool_kind),
        **kw,
    )


def workload(seed: int = 7, n_docs: int = 6, per_doc: int = 3, lo: int = 40, hi: int = 110) -> list:
    """Prompts sharing document prefixes (2-7 blocks each) with unique tails."""
    rnd = random.Random(seed)
    docs = [[rnd.randrange(VOCAB) for _ in range(rnd.randrange(lo, hi))] for _ in range(n_docs)]
    return [d + [rnd.randrange(VOCAB) for _ in range(rnd.randrange(1, 20))] for d in docs for _ in range(per_doc)]


def reference_tokens(prompts: list, n: int, seed: int = DEFAULT_MODEL_SEED) -> list:
    """What the model generates: prompt + n greedy tokens."""
    out = []
    for p in prompts:
        toks = list(p)
        for _ in range(n):
            toks.append(next_token(prefix_hashes(toks, seed)[-1]))
        out.append(toks)
    return out


_FLUSH_SEEDS = itertools.count(1000)


def flush(e: FakeTrtllmEngine, n: int = 12) -> None:
    """Unrelated requests (never seen before) that push earlier blocks out of G1 (and out of a
    small host tier)."""
    rnd = random.Random(next(_FLUSH_SEEDS))
    for _ in range(n):
        e.add_request([rnd.randrange(VOCAB) for _ in range(100)], 2)
    e.run()


def stats(e: FakeTrtllmEngine) -> dict:
    return e.scheduler.leader.stats()


def run_twice(e: FakeTrtllmEngine, prompts: list, n: int, **kw: Any) -> tuple:
    """Run prompts, flush G1, run them again; returns (first, second) request lists."""
    first = [e.add_request(p, n, **kw) for p in prompts]
    e.run()
    flush(e)
    second = [e.add_request(p, n, **kw) for p in prompts]
    e.run()
    return first, second


def tokens(reqs: list) -> list:
    return [r.get_tokens(0) for r in reqs]


GEO1 = Geometry(world_size=1, kv_heads=2)
