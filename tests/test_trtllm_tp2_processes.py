"""TP=2 with one rank per process, as TensorRT-LLM runs them: rank 0 holds the scheduler and its
worker, rank 1 only a worker; matching results and metadata are broadcast, get_finished results
allgathered (a pipe plays MPI), and kvtier's ranks reach the leader over ZeroMQ at a port the
scheduler chose and rank 0's worker broadcast (no configured endpoint, no default port)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest

import kvtier

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")


def _rank_main(rank: int, conn, env: dict, out) -> None:
    try:
        os.environ.update(env)
        sys.path.insert(0, os.path.dirname(__file__))
        from kvtier import trtllm
        from trtllm_driver import Geometry, PipeComm
        from trtllm_scenarios import engine, flush, tokens, workload

        comm = PipeComm(rank, conn)
        trtllm.RANKS_IN_PROCESSES = True
        trtllm._broadcast = comm.bcast
        e = engine(geo=Geometry(world_size=2), num_device_blocks=40, comm=comm)
        prompts = workload(seed=13, n_docs=4, per_doc=2)
        first = [e.add_request(p, 6) for p in prompts]
        e.run()
        flush(e)
        again = [e.add_request(p, 6) for p in prompts]
        e.run()
        st = e.scheduler.leader.stats() if e.scheduler is not None else {}
        out.put((rank, "ok", tokens(first), tokens(again), dict(st), e.stats.matched_tokens))
    except BaseException as ex:  # reported to the test
        import traceback

        out.put((rank, "error", traceback.format_exc(), None, None, None))


def test_tp2_in_two_processes_over_zeromq(kvtier_env, tmp_path):
    from trtllm_scenarios import reference_tokens, workload

    env = {k: v for k, v in os.environ.items() if k.startswith(("KVTIER_", "DYN_KVBM_"))}
    env.update({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "256", "KVTIER_LEADER_WORKER_TIMEOUT_SECS": "30"})
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, c, env, out)) for r, c in ((0, a), (1, b))]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, status, *rest = out.get(timeout=120)
        results[rank] = (status, rest)
    for p in procs:
        p.join(timeout=30)
    for rank, (status, rest) in results.items():
        assert status == "ok", f"rank {rank}:\n{rest[0]}"
    want = reference_tokens(workload(seed=13, n_docs=4, per_doc=2), 6)
    for rank in (0, 1):
        first, again = results[rank][1][0], results[rank][1][1]
        assert first == want and again == want
    st, matched = results[0][1][2], results[0][1][3]
    assert matched > 0 and st["onboard_host_blocks"] > 0 and st["offload_confirmed"] > 0, st
