"""kvtier.trtllm's CUDA path on a GPU (run by tests/gpu_trtllm.sh): a torch pool shaped like
TensorRT-LLM's primary pool, loads through the adapter, and a decode step captured as a CUDA graph
that reads and writes the pool. The graph replays with no layer hook (as TensorRT-LLM's CUDA-graph
decode does: ``model_engine.py``), right after ``start_load_kv``; every byte it reads must be the
model's. Loads are delayed 5 ms in the transfer engine (``test_load_delay_ms``) so a load that only
races the replay would lose. Prints one JSON object (also written to ``--out``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trtllm_driver import Geometry, LlmRequest, RequestData, SchedulerOutput, expected_kv, prefix_hashes  # noqa: E402
from trtllm_scenarios import engine, flush, reference_tokens, tokens, workload  # noqa: E402

#: "cuda" on the GPU machine; "cpu" runs the same steps eagerly (no graph) to check this script.
DEV = os.environ.get("KVTIER_GPU_TEST_DEVICE", "cuda")
POOL = "torch-cuda" if DEV == "cuda" else "torch-cpu"


def driver_runs(out: dict) -> None:
    """The 1.4 driver over a CUDA pool: both loops, sync and async loads, no layer hooks."""
    geo = Geometry(world_size=1, kv_heads=4, head_dim=32, num_layers=4, tokens_per_block=32)
    for loop in ("overlap", "plain"):
        for mode in ("false", "true"):
            os.environ["KVTIER_ASYNC_LOADS"] = mode
            e = engine(POOL, geo=geo, num_device_blocks=48, layer_hooks="none", loop=loop)
            prompts = workload(seed=3, n_docs=4, per_doc=2, lo=100, hi=300)
            first = [e.add_request(p, 24) for p in prompts]
            e.run()
            flush(e, n=10)
            second = [e.add_request(p, 24) for p in prompts]
            t = time.perf_counter()
            e.run()
            dt = time.perf_counter() - t
            want = reference_tokens(prompts, 24)
            ok = tokens(first) == want and tokens(second) == want
            st = e.scheduler.leader.stats()
            out[f"driver_{loop}_async_{mode}"] = {
                "tokens_exact": ok, "onboard_host_blocks": st["onboard_host_blocks"],
                "matched_tokens": e.stats.matched_tokens, "second_round_s": round(dt, 3)}
            assert ok and st["onboard_host_blocks"] > 0, out
    os.environ.pop("KVTIER_ASYNC_LOADS")


def graph_runs(out: dict, n_requests: int, worker_cls=None, key: str = "graph") -> None:
    geo = Geometry(world_size=1, kv_heads=8, head_dim=128, num_layers=8, tokens_per_block=32)
    tpb = geo.tokens_per_block
    os.environ["KVTIER_ASYNC_LOADS"] = "false"
    os.environ["TRTLLM_KVTIER_TEST_LOAD_DELAY_MS"] = "5"
    e = engine(POOL, geo=geo, num_device_blocks=96, layer_hooks="none", worker=worker_cls)
    # Whole blocks plus 5 tokens: kvtier offers every whole block, the last 5 tokens are computed.
    prompts = [p[: (len(p) // tpb) * tpb] + [1, 2, 3, 4, 5]
               for p in workload(seed=5, n_docs=n_requests, per_doc=1, lo=200, hi=400)]
    [e.add_request(p, 2) for p in prompts]
    e.run()
    flush(e, n=16)
    pool = e.pools[0].i16  # [blocks, layers, 2, inner] int16 view of the bf16 pool
    sched, worker, cb = e.scheduler, e.workers[0], e.forward_callables[0]
    max_blocks = max(len(p) // tpb for p in prompts)
    idx = torch.zeros(max_blocks, dtype=torch.long, device=DEV)
    read = torch.zeros((max_blocks,) + tuple(pool.shape[1:]), dtype=torch.int16, device=DEV)
    wblk = torch.zeros(1, dtype=torch.long, device=DEV)
    wsrc = torch.zeros((1,) + tuple(pool.shape[1:]), dtype=torch.int16, device=DEV)
    def decode_step() -> None:
        # The decode step: attention reads the request's KV blocks, the new token's KV is written.
        read.copy_(pool.index_select(0, idx))
        pool.index_copy_(0, wblk, wsrc)

    if DEV == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture
            decode_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_step()
        replay = graph.replay
    else:
        replay = decode_step
    load_s, replay_s, bad = [], [], 0
    for i, p in enumerate(prompts):
        rid = 50_000 + i
        req = LlmRequest(rid, p, 2, chunk_size=4096)
        n, is_async = sched.get_num_new_matched_tokens(req, 0)
        assert n == (len(p) // tpb) * tpb and not is_async, (n, is_async, len(p))
        blocks = e.blocks.allocate(-(-len(p) // tpb))  # garbage-filled
        sched.update_state_after_alloc(req, blocks)
        meta = sched.build_connector_meta(SchedulerOutput(new_requests=[RequestData(rid, list(p), list(blocks), 0,
                                                                                    len(p) - n)]))
        worker.bind_connector_meta(meta)
        nb = n // tpb
        idx.copy_(torch.tensor(blocks[:nb] + [blocks[0]] * (max_blocks - nb), device=DEV))
        # The new token's block (position n) with the model's KV at position n.
        hs = np.array(prefix_hashes(p), dtype=np.uint64)
        blk = pool[blocks[nb]].cpu().numpy().view(np.uint16).copy()
        for layer in range(geo.num_layers):
            for plane in (0, 1):
                v = expected_kv(hs[n:n + 1], layer, plane, geo).reshape(geo.kv_heads, geo.head_dim)
                blk[layer, plane].reshape(geo.kv_heads, tpb, geo.head_dim)[:, 0, :] = v
        wblk.fill_(blocks[nb])
        wsrc.copy_(torch.from_numpy(blk.view(np.int16)).unsqueeze(0))
        stream = torch.cuda.current_stream() if DEV == "cuda" else None
        t = time.perf_counter()
        worker.start_load_kv(stream)  # returns with the sync loads in device memory
        load_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        replay()  # no wait_for_layer_load, no save_kv_layer
        cb()
        worker.wait_for_save(stream)
        if DEV == "cuda":
            torch.cuda.synchronize()
        replay_s.append(time.perf_counter() - t)
        got = read[:nb].cpu().numpy().view(np.uint16)
        for layer in range(geo.num_layers):
            for plane in (0, 1):
                x = got[:, layer, plane].reshape(nb, geo.kv_heads, tpb, geo.head_dim).transpose(0, 2, 1, 3)
                want = expected_kv(hs[:n], layer, plane, geo)
                bad += int((x.reshape(n, -1) != want).any(axis=1).sum())
        after = pool[blocks[nb]].cpu().numpy().view(np.uint16)
        bad += int((after != blk).any())
        if sched.request_finished(req, blocks):
            for _ in range(500):  # held until the workers report it
                if worker.get_finished([rid], [])[0]:
                    break
                time.sleep(0.01)
        e.blocks.release(blocks)
    out[key] = {
        "requests": len(prompts), "blocks_loaded": sum(len(p) // tpb for p in prompts),
        "bytes_per_block": worker.native.bytes_per_block, "mismatched_positions": bad,
        "start_load_kv_ms_median": round(1e3 * statistics.median(load_s), 3),
        "replay_ms_median": round(1e3 * statistics.median(replay_s), 3),
        "test_load_delay_ms": 5,
    }
    if worker_cls is None:
        assert bad == 0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args()
    os.environ.setdefault("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "2048")
    os.environ.setdefault("DYN_KVBM_DISK_CACHE_DIR", tempfile.mkdtemp())
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"}
    driver_runs(out)
    graph_runs(out, args.requests)
    # The planted bug of tests/test_trtllm_mutants.py (loads completed only in wait_for_layer_load):
    # the replay must read wrong bytes, or this check proves nothing.
    from test_trtllm_mutants import WorkerLoadsInLayerHook

    graph_runs(out, max(4, args.requests // 4), WorkerLoadsInLayerHook, "graph_planted_bug_layer_hook_loads")
    assert out["graph_planted_bug_layer_hook_loads"]["mismatched_positions"] > 0, out
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
