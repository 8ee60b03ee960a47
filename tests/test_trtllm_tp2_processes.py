"""TP=2 with one rank per process, as TensorRT-LLM runs them: rank 0 holds the scheduler and its
worker, rank 1 only a worker; matching results and metadata are broadcast, get_finished results
allgathered (a pipe plays MPI), and kvtier's ranks reach the leader over ZeroMQ at a port the
scheduler chose and rank 0's worker broadcast (no configured endpoint, no default port).

With a disk tier and rank 1's disk files corrupted (rank 0's intact), each process holds its own
``LlmRequest`` objects (as TensorRT-LLM's ranks do), the leader's load verdicts cross by the same
broadcast TensorRT-LLM's ranks share, and a rank that computed on a block its own load failed to
fill, or resumed from another token than the other rank, fails the driver's per-rank KV check."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Optional

import pytest

import kvtier

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")


def _rank_main(rank: int, conn, env: dict, out, fault_rank: int = -1, disk_dir: str = "",
               rank_env: Optional[dict] = None, windows: Optional[list] = None) -> None:
    try:
        os.environ.update(env)
        os.environ.update((rank_env or {}).get(rank, {}))
        sys.path.insert(0, os.path.dirname(__file__))
        import pathlib

        from kvtier import trtllm
        from test_trtllm_tp_loads import corrupt_rank_disk
        from trtllm_driver import Geometry, PipeComm
        from trtllm_scenarios import engine, flush, tokens, workload

        comm = PipeComm(rank, conn)
        trtllm.RANKS_IN_PROCESSES = True
        trtllm._broadcast = comm.bcast
        if windows is None:
            e = engine(geo=Geometry(world_size=2), num_device_blocks=40, comm=comm)
        else:
            from trtllm_vswa import VswaEngine

            e = VswaEngine(trtllm.KvtierConnectorScheduler, trtllm.KvtierConnectorWorker, windows=windows,
                           geo=Geometry(world_size=2), num_device_blocks=24, chunk_size=32, comm=comm)
        prompts = workload(seed=13, n_docs=4, per_doc=2)
        first = [e.add_request(p, 6) for p in prompts]
        e.run()
        flush(e)
        if fault_rank >= 0:
            e.workers[rank].native.wait_idle()
            comm.allgather({rank: None})  # both ranks' disk writes are done
            if rank == fault_rank:
                corrupt_rank_disk(pathlib.Path(disk_dir), rank)
            comm.allgather({rank: None})
        again = [e.add_request(p, 6) for p in prompts]
        e.run()
        st = [dict(x.stats()) for x in e.scheduler.leaders] if e.scheduler is not None else []
        w = e.workers[rank]
        out.put((rank, "ok", tokens(first), tokens(again), st, e.stats.matched_tokens,
                 (w.recomputed_loads, w.unrecoverable_loads)))
    except BaseException as ex:  # reported to the test
        import traceback

        out.put((rank, "error", traceback.format_exc(), None, None, None, None))


def _run_two_ranks(env: dict, fault_rank: int = -1, disk_dir: str = "", rank_env: Optional[dict] = None,
                   windows: Optional[list] = None) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, c, env, out, fault_rank, disk_dir, rank_env,
                                                             windows)) for r, c in ((0, a), (1, b))]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, status, *rest = out.get(timeout=120)
            results[rank] = (status, rest)
            # A rank that failed leaves the other waiting in a collective, as MPI would.
            assert status == "ok", f"rank {rank}:\n{rest[0]}"
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == len(procs) else 0.1)
            if p.is_alive():
                p.kill()
    for rank, (status, rest) in results.items():
        assert status == "ok", f"rank {rank}:\n{rest[0]}"
    return results


def test_tp2_in_two_processes_over_zeromq(kvtier_env, tmp_path):
    from trtllm_scenarios import reference_tokens, workload

    env = {k: v for k, v in os.environ.items() if k.startswith(("KVTIER_", "DYN_KVBM_"))}
    env.update({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "256", "KVTIER_LEADER_WORKER_TIMEOUT_SECS": "30"})
    results = _run_two_ranks(env)
    want = reference_tokens(workload(seed=13, n_docs=4, per_doc=2), 6)
    for rank in (0, 1):
        first, again = results[rank][1][0], results[rank][1][1]
        assert first == want and again == want
    st, matched = results[0][1][2][0], results[0][1][3]
    assert matched > 0 and st["onboard_host_blocks"] > 0 and st["offload_confirmed"] > 0, st


def test_tp2_disk_fault_on_rank_1_only_in_two_processes(kvtier_env, tmp_path):
    """Issue 25 item 5: the disk tier under TP=2, rank 1's disk corrupted: both ranks recompute
    from the leader's token (rank 0's own loads all succeeded), tokens exact, nothing stuck."""
    from trtllm_scenarios import reference_tokens, workload

    env = {k: v for k, v in os.environ.items() if k.startswith(("KVTIER_", "DYN_KVBM_"))}
    env.update({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "2", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "512",
                "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true", "KVTIER_LEADER_WORKER_TIMEOUT_SECS": "30"})
    # Rank 1's loads start late: rank 0's own loads are long done when the verdict comes, so a rank
    # 0 that reported them by its own outcome would resume from another token than rank 1.
    results = _run_two_ranks(env, fault_rank=1, disk_dir=str(tmp_path / "disk"),
                             rank_env={1: {"TRTLLM_KVTIER_TEST_LOAD_DELAY_MS": "30"}})
    want = reference_tokens(workload(seed=13, n_docs=4, per_doc=2), 6)
    for rank in (0, 1):
        assert results[rank][1][0] == want and results[rank][1][1] == want
    st = results[0][1][2][0]
    assert st["onboard_failed"] > 0, st
    recomputed = [results[r][1][4] for r in (0, 1)]
    assert recomputed[0] == recomputed[1] and recomputed[0][0] > 0 and recomputed[0][1] == 0, recomputed


def test_tp2_vswa_in_two_processes_over_zeromq(kvtier_env, tmp_path):
    """Issue 25: variable sliding-window attention (a window layer beside a full one) under TP=2 with
    the host tier, one rank per process: each layer group's leader has its own port (rank 0's worker
    broadcasts them), rank 0's leaders' load verdicts reach rank 1 group by group in the same
    get_finished round (TensorRT-LLM acts on a load only once every rank reported it), and each
    rank's forward reads its own share of the model's KV, window by window (tests/trtllm_vswa.py)."""
    from trtllm_scenarios import reference_tokens, workload

    env = {k: v for k, v in os.environ.items() if k.startswith(("KVTIER_", "DYN_KVBM_"))}
    env.update({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "512", "KVTIER_LEADER_WORKER_TIMEOUT_SECS": "30"})
    results = _run_two_ranks(env, windows=[48, None, 48, None])
    want = reference_tokens(workload(seed=13, n_docs=4, per_doc=2), 6)
    for rank in (0, 1):
        assert results[rank][1][0] == want and results[rank][1][1] == want
    groups, matched = results[0][1][2], results[0][1][3]
    assert matched > 0 and len(groups) == 2, groups
    # kvtier's order: full attention, then the window; each group loaded its share, the window less.
    full, window = groups[0]["onboard_host_blocks"], groups[1]["onboard_host_blocks"]
    assert full > window > 0 and all(g["offload_confirmed"] > 0 for g in groups), groups
