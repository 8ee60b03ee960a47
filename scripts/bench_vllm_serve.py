"""``vllm serve`` under a prefix-repetition load: no connector vs kvtier, in the same run (issue 27, item 0).

The workload is the shape of ``vllm bench serve --dataset-name prefix_repetition`` (vllm/benchmarks/datasets/
datasets.py, PrefixRepetitionRandomDataset: P prefixes of L tokens, each followed by S random suffix tokens, N
prompts in all, shuffled): by default 6 prefixes of 384 tokens, 64-token suffixes, 36 prompts, 2 clients at once,
128 output tokens (that dataset's default), greedy with ``ignore_eos``. The model is a 4-layer fp32 tiny Llama
(scripts/make_tiny_llama.py), token-id prompts (no tokenizer). Each configuration gets its own server; the rounds
alternate (none, kvtier, none, kvtier, ...) so that load on a shared machine hits both alike. Every kvtier output
must equal the no-connector output of the same prompt (the script exits 1 otherwise).

Reported per configuration: TTFT p50 and mean (first streamed token), request throughput, the share of prompt tokens
kvtier supplied (blocks onboarded, ``kvtier_blocks_total``), blocks written to disk (``kvtier_spill_confirmed_blocks_total``).

Usage (repository root, in the vLLM venv with kvtier installed):
    python scripts/bench_vllm_serve.py [--rounds 2] [--host-gb 0.006] [--disk-gb 0.1] [--filter on|off|both]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_support import connector_config, make_model  # noqa: E402
from vllm_support.serve import Server, free_port, scrape  # noqa: E402

BLOCK = 32
LAYERS = 4
# fp32, 2 KV heads of dim 32 (make_tiny_llama.py defaults), K and V.
BYTES_PER_BLOCK = LAYERS * 2 * 2 * BLOCK * 32 * 4


def workload(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(a.seed)
    out = []
    for _ in range(a.prefixes):
        prefix = [rng.randrange(3, 2048) for _ in range(a.prefix_len)]
        for _ in range(a.prompts // a.prefixes):
            out.append(prefix + [rng.randrange(3, 2048) for _ in range(a.suffix_len)])
    rng.shuffle(out)
    return out


async def one(session, url: str, model: str, prompt: list[int], out_len: int,
              leave: float | None) -> tuple[float, float, list[int] | None]:
    """One streamed request: (TTFT, latency, tokens); a client that leaves (after ``leave`` seconds, or after its
    first tokens when ``leave`` is 0) returns tokens None."""
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft = None
    toks: list[int] = []
    try:
        async with asyncio.timeout(leave if leave else None):
            async with session.post(url, json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if not line.startswith(b"data:") or b"[DONE]" in line:
                        continue
                    ch = json.loads(line[5:])["choices"][0]
                    ids = ch.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.perf_counter() - t0
                    toks += ids
                    if leave == 0 and len(toks) >= 2:
                        r.close()
                        return float("nan"), float("nan"), None
    except TimeoutError:
        return float("nan"), float("nan"), None
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, toks


async def drive(srv: Server, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{srv.port}/v1/completions"
    sem = asyncio.Semaphore(a.concurrency)
    res: list = [None] * len(prompts)
    rng = random.Random(a.seed + 1)
    leave = [None if rng.random() >= a.disconnect else (0 if rng.random() < 0.5 else rng.uniform(0, 0.2))
             for _ in prompts]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def run(i: int) -> None:
            async with sem:
                res[i] = await one(session, url, srv.name, prompts[i], a.output_len, leave[i])
        t0 = time.perf_counter()
        await asyncio.gather(*(run(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    done = [r for r in res if r[2] is not None]
    ttfts = sorted(r[0] * 1e3 for r in done)
    return {"ttft_p50_ms": statistics.median(ttfts), "ttft_mean_ms": statistics.fmean(ttfts),
            "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))], "req_per_s": len(done) / wall,
            "left": float(len(res) - len(done)), "outputs": [r[2] for r in res]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=36)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--g1-blocks", type=int, default=48)
    p.add_argument("--host-gb", type=float, default=0.006)
    p.add_argument("--disk-gb", type=float, default=0.1)
    p.add_argument("--filter", choices=["on", "off", "both"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="one more kvtier setting for every kvtier server (repeatable), e.g. --set host.gb=1")
    p.add_argument("--no-disk", action="store_true", help="kvtier with the host tier only")
    p.add_argument("--null", action="store_true",
                   help="also vLLM with a connector that does nothing (tests/vllm_support/null_connector.py)")
    p.add_argument("--disconnect", type=float, default=0.0,
                   help="share of clients that go away (half after their first tokens, half 0-200 ms after sending)")
    p.add_argument("--native-gb", type=float, default=0.0,
                   help="also vLLM's native offloading (--kv-offloading-backend native) with this many GB")
    p.add_argument("--llama8b", action="store_true",
                   help="a Llama-3.1-8B-shaped model with random weights (load_format dummy; for the GPU)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-"))
    bytes_per_block = BYTES_PER_BLOCK
    extra_args: list[str] = []
    if a.llama8b:
        from bench_vllm_gpu import KV_BYTES_PER_TOKEN, write_config

        model = write_config(work / "llama-8b-shape")
        bytes_per_block = KV_BYTES_PER_TOKEN * BLOCK
        extra_args = ["--load-format", "dummy"]
    else:
        model = make_model(work / "model", seed=0, extra=["--layers", str(LAYERS), "--dtype", "float32"])
    prompts = workload(a)
    configs: list[tuple[str, dict | None]] = [("none", None)]
    if a.null:
        configs.append(("null connector", {}))
    if a.native_gb:
        configs.append(("native", {"native": a.native_gb}))
    for f in (["on", "off"] if a.filter == "both" else [a.filter]):
        st = {"host.gb": a.host_gb, "disk.gb": a.disk_gb, "disk.dir": str(work / f"disk-{f}-{{round}}"),
              "policy.disk_filter.enabled": f == "on"}
        if a.no_disk:
            st = {"host.gb": a.host_gb}
        st.update({k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)})
        configs.append((f"kvtier filter {f}" if not a.no_disk else "kvtier host only", st))
        if a.no_disk:
            break
    results: dict[str, list[dict]] = {name: [] for name, _ in configs}
    want = None
    bad: dict[str, int] = {name: 0 for name, _ in configs}
    for rnd in range(a.rounds):
        for name, settings in configs:
            mport = free_port()
            ktc = None
            args = list(extra_args)
            if settings == {}:
                ktc = {"kv_connector": "NullConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "vllm_support.null_connector"}
            elif settings is not None and "native" in settings:
                args += ["--kv-offloading-size", str(settings["native"]), "--kv-offloading-backend", "native"]
            elif settings is not None:
                # A fresh disk directory per server: every round starts cold.
                if "disk.dir" in settings:
                    settings = dict(settings, **{"disk.dir": settings["disk.dir"].replace("{round}", str(rnd))})
                    Path(settings["disk.dir"]).mkdir(parents=True, exist_ok=True)
                ktc = connector_config(settings=dict(settings, **{"metrics.enabled": True, "metrics.port": mport}))
            srv = Server(model, work / f"{name.replace(' ', '-')}-{rnd}.log", ktc, a.g1_blocks * bytes_per_block,
                         block_size=BLOCK, max_model_len=a.prefix_len + a.suffix_len + a.output_len + 64,
                         max_num_seqs=a.concurrency, extra_args=args)
            try:
                r = asyncio.run(drive(srv, prompts, a))
                if ktc and "metrics.port" in ktc.get("kv_connector_extra_config", {}):
                    # Once idle, nothing may stay in flight or pinned (clients that left included).
                    deadline = time.time() + 60
                    while True:
                        m = scrape(mport)
                        held = {k: v for k, v in m.items() if v and k.startswith(
                            ("kvtier_jobs_in_flight", "kvtier_pinned_blocks", "kvtier_active_requests"))}
                        if not held or time.time() > deadline:
                            break
                        time.sleep(0.5)
                    r["held_after_idle"] = float(sum(held.values()))
                    r["alive"] = float(srv.alive())
                    # Blocks kvtier loaded (kvtier_matched_tokens_total counts every match query, and vLLM asks
                    # again for a request it could not schedule yet).
                    matched = BLOCK * sum(v for k, v in m.items()
                                          if k.startswith("kvtier_blocks_total") and 'direction="onboard"' in k)
                    r["kvtier_token_share"] = matched / sum(len(x) for x in prompts)
                    r["disk_blocks_written"] = m.get("kvtier_spill_confirmed_blocks_total", 0.0)
            finally:
                srv.close()
            outs = r.pop("outputs")
            if want is None:
                want = outs
            else:
                bad[name] += sum(o != w for o, w in zip(outs, want) if o is not None and w is not None)
            results[name].append(r)
            print(f"round {rnd} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    base = results["none"]
    print("\n| configuration | TTFT p50 ms | vs none | TTFT p90 ms | req/s | vs none | kvtier share of prompt tokens | "
          "disk blocks written | clients gone | held after idle |\n|---|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    t0 = med(r["ttft_p50_ms"] for r in base)
    q0 = med(r["req_per_s"] for r in base)
    for name, rs in results.items():
        t, q = med(r["ttft_p50_ms"] for r in rs), med(r["req_per_s"] for r in rs)
        print(f"| {name} | {t:.1f} | {t / t0:.2f}x | {med(r['ttft_p90_ms'] for r in rs):.1f} | {q:.2f} | {q / q0:.2f}x | "
              f"{med(r.get('kvtier_token_share', 0.0) for r in rs):.0%} | "
              f"{med(r.get('disk_blocks_written', 0.0) for r in rs):.0f} | {sum(r['left'] for r in rs):.0f} | "
              f"{max(r.get('held_after_idle', 0.0) for r in rs):.0f} |")
    print(f"\noutputs differing from no connector's, per configuration: {bad}")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
