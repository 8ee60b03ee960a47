"""Summaries of bench_vllm_gpu.py's profiles, small enough to read in a terminal (the traces are hundreds of MB).

    python scripts/profile_summary.py steps LOGDIR/<engine>.steps [--batch 4]
        Decode steps only (every scheduled request at one token): p50 period between step starts, p50 time inside
        the step call, and the mean time per step inside each wrapped hook (scheduler and connector), so two
        engines' decode steps split into vLLM's work and the connector's.
    python scripts/profile_summary.py chrome LOGDIR/<engine>-decode.json
        A torch.profiler Chrome trace: per thread, the time in CUDA runtime/driver calls and the most frequent
        ones; per CUDA stream, kernel and copy counts and busy time; the longest CPU ops. Another thread's driver
        calls during the forward pass (kvtier's executors) show up here.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict


def steps(path: str, batch: int) -> None:
    ev = sorted((json.loads(line) for line in open(path) if line.strip()), key=lambda e: e["t"])
    outer = [e for e in ev if e["ev"] in ("step", "step_with_batch_queue")]
    inner = [e for e in ev if e["ev"] not in ("step", "step_with_batch_queue")]
    j = 0
    rows = []
    for s in outer:
        t0, t1 = s["t"], s["t"] + s["dt"]
        hooks: dict[str, float] = defaultdict(float)
        tok = None
        while j < len(inner) and inner[j]["t"] < t0:
            j += 1
        k = j
        while k < len(inner) and inner[k]["t"] <= t1:
            h = inner[k]
            hooks[h["ev"]] += h["dt"]
            if h["ev"] == "schedule":
                tok = (h.get("total"), len(h.get("tokens", {})))
            k += 1
        rows.append((t0, s["dt"], tok, hooks))
    # A decode step: `batch` requests, one token each (async scheduling: the step that schedules it).
    dec = [i for i, r in enumerate(rows) if r[2] == (batch, batch)]
    periods = [rows[i + 1][0] - rows[i][0] for i in dec if i + 1 < len(rows) and rows[i + 1][2] == (batch, batch)]
    if not dec:
        print(f"{path}: no decode steps of batch {batch}")
        return
    tot: dict[str, float] = defaultdict(float)
    for i in dec:
        for k, v in rows[i][3].items():
            tot[k] += v
    print(f"{path}: {len(dec)} decode steps; period p50 {1000 * statistics.median(periods):.3f} ms, "
          f"in step p50 {1000 * statistics.median(rows[i][1] for i in dec):.3f} ms")
    for k, v in sorted(tot.items(), key=lambda x: -x[1]):
        print(f"  {k:32s} {1000 * v / len(dec):8.3f} ms/step")


def chrome(path: str, top: int) -> None:
    with open(path) as f:
        tr = json.load(f)
    ev = [e for e in tr.get("traceEvents", []) if e.get("ph") == "X"]
    if not ev:
        print(f"{path}: no events")
        return
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] + e.get("dur", 0) for e in ev)
    print(f"{path}: {len(ev)} events over {(t1 - t0) / 1000:.1f} ms")
    api = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_tid: dict[object, list] = defaultdict(list)
    for e in api:
        by_tid[e.get("tid")].append(e)
    for tid, es in sorted(by_tid.items(), key=lambda x: -len(x[1])):
        names = Counter(e["name"] for e in es)
        dur = sum(e.get("dur", 0) for e in es) / 1000
        common = ", ".join(f"{n} x{c}" for n, c in names.most_common(5))
        print(f"  thread {tid}: {len(es)} CUDA API calls, {dur:.1f} ms: {common}")
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream: dict[object, list] = defaultdict(list)
    for e in gpu:
        by_stream[(e.get("args", {}).get("stream"), e.get("cat"))].append(e)
    for (stream, cat), es in sorted(by_stream.items(), key=lambda x: -len(x[1])):
        busy = sum(e.get("dur", 0) for e in es) / 1000
        print(f"  stream {stream} {cat}: {len(es)} ops, busy {busy:.1f} ms")
    ops: dict[str, list] = defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops[e["name"]].append(e.get("dur", 0))
    print(f"  longest CPU ops (total ms, count):")
    for n, ds in sorted(ops.items(), key=lambda x: -sum(x[1]))[:top]:
        print(f"    {sum(ds) / 1000:9.1f} {len(ds):7d}  {n[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("steps")
    s.add_argument("path")
    s.add_argument("--batch", type=int, default=4)
    c = sub.add_parser("chrome")
    c.add_argument("path")
    c.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    if a.kind == "steps":
        steps(a.path, a.batch)
    else:
        chrome(a.path, a.top)


if __name__ == "__main__":
    main()
