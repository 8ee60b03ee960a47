"""Per-step connector overhead of kvtier.trtllm under TensorRT-LLM's call sequence.

Runs the TensorRT-LLM stand-in (tests/trtllm_driver.py) with N concurrent requests (prefill, then
decode steps) and times every connector call: the scheduler's ``build_connector_meta`` (plus the
matching/alloc/finish calls) and each rank's worker hooks (bind, start_load, per-layer
wait/save, forward-pass callable, wait_for_save, get_finished). The baseline is a no-op connector
with the same methods, driven identically in the same run. KV compute is skipped: only the
connector's own cost is measured (transfers run on kvtier's threads and overlap the next step).

    python tests/bench_trtllm_overhead.py --pool numpy --requests 64
    python tests/bench_trtllm_overhead.py --pool torch-cuda --requests 64 --layers 32 --heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))

from trtllm_driver import VOCAB, FakeTrtllmEngine, Geometry  # noqa: E402

SCHED = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished"}
WORKER = {"bind_connector_meta", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
          "get_finished"}


class Timed:
    """Forwards every call to ``inner`` and adds its duration to ``acc[step_kind]``."""

    def __init__(self, inner, names, acc):
        self._inner, self._names, self._acc = inner, names, acc

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name == "register_forward_pass_callable":
            def reg():
                cb = attr()
                if cb is None:
                    return None

                def timed_cb():
                    t = time.perf_counter()
                    cb()
                    self._acc["current"] += time.perf_counter() - t
                return timed_cb
            return reg
        if name not in self._names or not callable(attr):
            return attr

        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                self._acc["current"] += dt
                self._acc["by:" + name] += dt
        return call


class NoopScheduler:
    def __init__(self, llm_args):
        pass

    def wait_for_initialization(self):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids):
        pass

    def build_connector_meta(self, scheduler_output):
        return b""

    def request_finished(self, request, cache_block_ids):
        return False


class NoopWorker:
    def __init__(self, llm_args):
        self.native = None

    def register_kv_caches(self, kv_cache_tensor):
        pass

    def requires_layerwise_transfer_hooks(self):
        return False

    def bind_connector_meta(self, metadata):
        pass

    def start_load_kv(self, stream):
        pass

    def wait_for_layer_load(self, layer_idx, stream):
        pass

    def save_kv_layer(self, layer_idx, stream):
        pass

    def wait_for_save(self, stream):
        pass

    def register_forward_pass_callable(self):
        return lambda: None

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        return [], []


def run(label, sched_cls, worker_cls, args, prompts):
    acc = defaultdict(float)
    per_step = []

    def wrap_s(cls):
        return lambda llm_args: Timed(cls(llm_args), SCHED, acc)

    def wrap_w(cls):
        return lambda llm_args: Timed(cls(llm_args), WORKER, acc)

    geo = Geometry(num_layers=args.layers, kv_heads=args.heads * args.tp, head_dim=args.head_dim,
                   tokens_per_block=args.block, world_size=args.tp)
    stream = None
    if args.pool == "torch-cuda":
        import torch

        stream = lambda: torch.cuda.current_stream()  # noqa: E731
    blocks_per_req = -(-(args.prompt + args.decode) // args.block)
    e = FakeTrtllmEngine(wrap_s(sched_cls), wrap_w(worker_cls), geo=geo,
                         num_device_blocks=blocks_per_req * args.requests + 8, chunk_size=args.prompt,
                         max_batch_tokens=args.prompt * args.requests + args.requests,
                         max_num_requests=args.requests, pool_kind=args.pool, stream_factory=stream,
                         verify=False, compute=False)
    for p in prompts:
        e.add_request(p, args.decode)
    kinds = []
    while True:
        acc["current"] = 0.0
        prefill = any(r.context_remaining_length > 0 for r in e.running + e.waiting)
        more = e.step()
        per_step.append(acc["current"])
        kinds.append("prefill" if prefill else "decode")
        if not more:
            break
    if args.pool == "torch-cuda":
        import torch

        torch.cuda.synchronize()
    dec = [t for t, k in zip(per_step, kinds) if k == "decode"]
    pre = [t for t, k in zip(per_step, kinds) if k == "prefill"]
    stats = e.scheduler.leader.stats() if hasattr(e.scheduler, "leader") else {}
    by_call = {k[3:]: round(1e6 * v / len(per_step), 1) for k, v in acc.items() if k.startswith("by:")}
    out = {
        "label": label,
        "steps": len(per_step),
        "decode_steps": len(dec),
        "decode_us_mean": 1e6 * statistics.mean(dec) if dec else 0.0,
        "decode_us_p50": 1e6 * statistics.median(dec) if dec else 0.0,
        "decode_us_p99": 1e6 * sorted(dec)[int(0.99 * (len(dec) - 1))] if dec else 0.0,
        "prefill_steps": len(pre),
        "prefill_us_mean": 1e6 * statistics.mean(pre) if pre else 0.0,
        "offload_blocks": stats.get("offload_blocks", 0),
        "offload_confirmed": stats.get("offload_confirmed", 0),
        "us_per_step_by_call": by_call,
    }
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", default="numpy", choices=["numpy", "torch-cpu", "torch-cuda"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2, help="KV heads per rank")
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--host-blocks", type=int, default=0, help="0 = enough for every block")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kvtier import trtllm

    rnd = random.Random(0)
    prompts = [[rnd.randrange(VOCAB) for _ in range(args.prompt)] for _ in range(args.requests)]
    blocks = args.requests * -(-(args.prompt + args.decode) // args.block)
    os.environ["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] = str(args.host_blocks or blocks + 16)
    os.environ.setdefault("DYN_KVBM_DISK_CACHE_DIR", tempfile.mkdtemp())
    results = [
        run("no-op connector (baseline)", NoopScheduler, NoopWorker, args, prompts),
        run("kvtier", trtllm.KvtierConnectorScheduler, trtllm.KvtierConnectorWorker, args, prompts),
    ]
    base, kv = results
    summary = {
        "args": vars(args),
        "results": results,
        "decode_overhead_us_per_step": kv["decode_us_mean"] - base["decode_us_mean"],
        "decode_ratio_vs_noop": kv["decode_us_mean"] / base["decode_us_mean"] if base["decode_us_mean"] else None,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
