"""Multi-round chat on the real vLLM engine (CPU build): vLLM alone vs vLLM + kvtier, in the same run.

Workload: C conversations share a system prompt; in each round every conversation appends a user turn to its
history and asks for the next reply (round-robin over conversations, so by the time a conversation speaks again
its history has been pushed out of vLLM's small device cache, G1). The assistant's reply is appended as fixed
tokens (the cache sees the same prefixes either way). Each request is measured alone, with max_tokens=1: its
latency is the time to first token (TTFT), i.e. the prefill. Both engines get the same G1 size; kvtier adds a host
tier big enough for every history. Both engines run at the same time, each request going to one then the other
in alternating order, so that load changes on a shared machine hit both alike. Throughput is prompt tokens over
the summed request latencies. kvtier's first tokens must equal those of vLLM with a G1 big enough to keep every
history (greedy decoding; vLLM's CPU kernels are not batch-invariant, so vLLM's own full recompute may differ from
prefix reuse in near-ties, and the script reports how often).

Usage (from the repository root, in the vLLM venv with kvtier installed):
    python scripts/bench_vllm.py [--model small|tiny] [--conversations 16] [--rounds 8] [--g1-blocks 72] [--out F]
Prints a Markdown table (the one in docs/bench/vllm.md) and writes the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_support import Engine, connector_config  # noqa: E402

# Model geometry (make_tiny_llama.py flags): prefill must cost real compute for TTFT to mean anything.
# Model presets: (layers, hidden, heads, kv_heads, head_dim, intermediate). "small" (the default) has about 8x the
# compute per token of "tiny" (the first runs' model): closer to a real model, whose prefill dwarfs vLLM's fixed
# per-request overhead on CPU.
MODELS = {"tiny": (4, 512, 8, 4, 64, 1536), "small": (8, 1024, 16, 8, 64, 3072)}
BLOCK = 32
MODEL_ARGS: list[str] = []
BYTES_PER_BLOCK = 0


def use_model(preset: str) -> None:
    """Set the model flags for make_tiny_llama.py and the KV bytes per block (layers * K/V * kv_heads * tokens *
    head_dim * bf16)."""
    global MODEL_ARGS, BYTES_PER_BLOCK
    layers, hidden, heads, kv_heads, head_dim, inter = MODELS[preset]
    MODEL_ARGS = ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads), "--kv-heads",
                  str(kv_heads), "--head-dim", str(head_dim), "--intermediate", str(inter), "--vocab", "4096"]
    BYTES_PER_BLOCK = layers * 2 * kv_heads * BLOCK * head_dim * 2


def workload(conversations: int, rounds: int, system: int, user: int, reply: int, seed: int) -> list[list[int]]:
    """Requests in arrival order: round by round, conversation by conversation."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 4096) for _ in range(n)]  # noqa: E731
    sys_prompt = tok(system)
    histories = [list(sys_prompt) for _ in range(conversations)]
    out = []
    for _ in range(rounds):
        for h in histories:
            h.extend(tok(user))
            out.append(list(h))
            h.extend(tok(reply))
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))
    return s[k]


def summarize(name: str, ttft: list[float], first: list[int], requests: list[list[int]], wall: float,
              conversations: int, stats: dict, start: float) -> dict:
    later = ttft[conversations:]  # rounds with history (round 1 is cold for every engine)
    prompt_tokens = sum(len(r) for r in requests)
    busy = sum(ttft)
    return {
        "name": name, "engine_start_s": start, "requests": len(requests), "busy_s": busy, "wall_s": wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": 1e3 * pct(ttft, 90),
        "ttft_p50_history_ms": 1e3 * statistics.median(later), "ttft_p90_history_ms": 1e3 * pct(later, 90),
        "requests_per_s": len(requests) / busy, "prompt_tokens_per_s": prompt_tokens / busy,
        "prompt_tokens": prompt_tokens, "first_tokens": first, "ttft_s": ttft, "kvtier": stats,
    }


def run_both(model: Path, requests: list[list[int]], g1_blocks: int, kv: dict, logs: Path,
             conversations: int) -> tuple[dict, dict]:
    """Both engines alive at once; each request goes to vLLM alone, then to vLLM + kvtier, so that load changes
    on a shared machine hit both alike."""
    spec = dict(kv_cache_blocks=g1_blocks, bytes_per_block=BYTES_PER_BLOCK, max_model_len=2048,
                max_num_batched_tokens=2048)
    with Engine(model, logs / "vllm.log", **spec) as base, \
            Engine(model, logs / "vllm+kvtier.log", kv_transfer_config=kv, **spec) as kvt:
        for e in (base, kvt):  # warm-up on unrelated tokens: first-call overheads
            e.ttft([[7] * 64, [9] * 64])
        times: dict[str, list[float]] = {"vllm": [], "kvtier": []}
        firsts: dict[str, list[int]] = {"vllm": [], "kvtier": []}
        t = time.time()
        for i, r in enumerate(requests):
            order = (("vllm", base), ("kvtier", kvt))
            for key, e in (order if i % 2 == 0 else order[::-1]):  # alternate who goes first
                res = e.call("ttft", prompts=[r])
                times[key] += res["seconds"]
                firsts[key] += res["first_tokens"]
        wall = time.time() - t
        stats = kvt.stats()["stats"]
        return (summarize("vllm", times["vllm"], firsts["vllm"], requests, wall, conversations, {},
                          base.start_seconds),
                summarize("vllm+kvtier", times["kvtier"], firsts["kvtier"], requests, wall, conversations, stats,
                          kvt.start_seconds))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--system", type=int, default=128)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--g1-blocks", type=int, default=72)
    ap.add_argument("--host-blocks", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--work", default=str(REPO / "bench-out" / "vllm"))
    ap.add_argument("--out", default=str(REPO / "bench-out" / "vllm.json"))
    a = ap.parse_args()
    use_model(a.model)

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{a.model}"
    if not (model / "model.safetensors").exists():
        import subprocess

        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model), *MODEL_ARGS],
                       check=True, stdout=subprocess.DEVNULL)
    reqs = workload(a.conversations, a.rounds, a.system, a.user, a.reply, a.seed)
    history_tokens = a.conversations * (a.system + a.rounds * (a.user + a.reply))
    kv = connector_config(settings={"host.num_blocks": a.host_blocks})
    base, kvt = run_both(model, reqs, a.g1_blocks, kv, work, a.conversations)
    # Reference for the tokens: vLLM alone with a G1 that keeps every history (its own prefix-cache hits). vLLM's
    # CPU kernels are not batch-invariant: a full recompute (vLLM alone, small G1) may differ from prefix reuse in
    # a near-tie, and kvtier's loads are prefix reuse.
    with Engine(model, work / "reference.log", kv_cache_blocks=4 * a.g1_blocks + history_tokens // BLOCK,
                bytes_per_block=BYTES_PER_BLOCK, max_model_len=2048, max_num_batched_tokens=2048) as ref:
        ref.ttft([[7] * 64, [9] * 64])  # the same warm-up as the measured engines
        ref_res = ref.call("ttft", prompts=reqs)
        ref_first = ref_res["first_tokens"]
    ideal = summarize("vllm, G1 holds every history", ref_res["seconds"], ref_first, reqs, sum(ref_res["seconds"]),
                      a.conversations, {}, 0.0)
    same = kvt["first_tokens"] == ref_first
    base_diff = [i for i, (x, y) in enumerate(zip(base["first_tokens"], ref_first)) if x != y]
    ks = kvt["kvtier"]
    onboard = ks.get("onboard_host_blocks", 0) + ks.get("onboard_disk_blocks", 0) + ks.get("onboard_remote_blocks", 0)
    hit_rate = onboard * BLOCK / max(1, kvt["prompt_tokens"])
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "args": vars(a), "history_tokens": history_tokens, "g1_tokens": a.g1_blocks * BLOCK,
        "kvtier_first_tokens_equal_prefix_cache_reference": same,
        "vllm_small_g1_first_token_differences_vs_reference": base_diff, "kvtier_hit_rate": hit_rate,
        "ttft_p50_ratio": base["ttft_p50_ms"] / kvt["ttft_p50_ms"],
        "ttft_p50_history_ratio": base["ttft_p50_history_ms"] / kvt["ttft_p50_history_ms"],
        "throughput_ratio": kvt["prompt_tokens_per_s"] / base["prompt_tokens_per_s"],
        "ideal_ttft_p50_ratio": base["ttft_p50_ms"] / ideal["ttft_p50_ms"],
        "kvtier_vs_ideal_ttft_p50": kvt["ttft_p50_ms"] / ideal["ttft_p50_ms"],
        "runs": [base, kvt, ideal],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))

    print(f"| engine | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p50, rounds 2+ (ms) | requests/s | prompt tokens/s | "
          f"kvtier hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r, hr in ((base, "-"), (kvt, f"{100 * hit_rate:.0f}%"), (ideal, "(own prefix cache)")):
        print(f"| {r['name']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['ttft_p50_history_ms']:.1f} | "
              f"{r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | {hr} |")
    print(f"\nTTFT p50 ratio (vLLM / vLLM+kvtier): {result['ttft_p50_ratio']:.2f}x; rounds 2+: "
          f"{result['ttft_p50_history_ratio']:.2f}x; throughput ratio {result['throughput_ratio']:.2f}x")
    print(f"upper bound (vLLM with a G1 that holds every history, measured after the pair): TTFT p50 ratio "
          f"{result['ideal_ttft_p50_ratio']:.2f}x; kvtier's TTFT p50 is {result['kvtier_vs_ideal_ttft_p50']:.2f}x "
          f"the upper bound's")
    print(f"first tokens: vLLM+kvtier equal to the prefix-cache reference: {same}; vLLM alone (full recompute) "
          f"differs from it in {len(base_diff)} of {len(reqs)} requests")
    print(f"history {history_tokens} tokens vs G1 {a.g1_blocks * BLOCK} tokens; kvtier: "
          f"{ks.get('onboard_host_blocks', 0)} blocks onboarded from host, {ks.get('offload_confirmed', 0)} offloaded")
    if not same:
        sys.exit("vLLM+kvtier's first tokens differ from vLLM's own prefix-cache reference")


if __name__ == "__main__":
    main()
