"""Layer-by-layer loads under TensorRT-LLM (issue 27 item 1): where every forward runs the decoder
layers' hooks (no CUDA graph, no ``torch.compile``: ``kvtier.trtllm.layer_hooks_always_run``), a
step's synchronous loads go layer by layer and ``wait_for_layer_load(l)`` makes the forward wait
for layer ``l``'s copies only; wherever a forward may replay a graph, loads stay whole and complete
in ``start_load_kv`` (1.4 then installs no hooks: ``requires_layerwise_transfer_hooks()`` False).

The driver (tests/trtllm_driver.py) checks every position a forward reads before each layer's
compute; kvtier's copies start 150 ms late here (``TRTLLM_KVTIER_TEST_LOAD_DELAY_MS``), so a forward
that reads a layer before waiting for it reads the garbage its new blocks were filled with. On a
numpy pool the engine's "stream" is the engine thread (handle 0): the CPU copy path hands over a
gate whose ``wait_layer`` blocks until that layer is in; on a CUDA pool the stream waits on events.
"""

from __future__ import annotations

import logging
import random

import pytest

import kvtier
from kvtier import trtllm
from trtllm_driver import VOCAB
from trtllm_scenarios import GEO1, cuda_available, engine, flush, reference_tokens, run_twice, tokens

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")

POOLS = ["numpy", pytest.param("torch-cuda", marks=pytest.mark.skipif(not cuda_available(), reason="no CUDA"))]


@pytest.fixture
def sync_host(kvtier_env):
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "256")
    kvtier_env.setenv("KVTIER_ASYNC_LOADS", "false")
    kvtier_env.setenv("TRTLLM_KVTIER_TEST_LOAD_DELAY_MS", "150")
    return kvtier_env


def counting_worker() -> type:
    """The adapter's worker, counting the steps it started layered."""

    class Counting(trtllm.KvtierConnectorWorker):
        layered_steps = 0

        def start_load_kv(self, stream):
            super().start_load_kv(stream)
            type(self).layered_steps += int(self._layered_step)

    return Counting


def prompts(seed: int, one_token_tail: bool) -> list:
    """Prompts of 2-5 blocks; with ``one_token_tail`` each replay leaves one context token (which
    TensorRT-LLM runs in the decode CUDA graph: ``_make_single_token_context_graph_batch``)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(16 * k + (1 if one_token_tail else rnd.randrange(2, 15)))]
            for k in (2, 3, 4, 5)]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_an_eager_engine_loads_layer_by_layer_and_every_forward_reads_loaded_kv(sync_host, pool, loop, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier.trtllm")
    worker = counting_worker()
    ps = prompts(3, one_token_tail=False) + prompts(4, one_token_tail=True)
    e = engine(pool, geo=GEO1, num_device_blocks=40, layer_hooks="eager", loop=loop, worker=worker,
               stream_factory=None if pool != "numpy" else (lambda: 0))
    assert e.layerwise is True  # requires_layerwise_transfer_hooks(): the hooks are installed
    _, second = run_twice(e, ps, 3)
    assert tokens(second) == reference_tokens(ps, 3)
    assert e.stats.sync_matches > 0
    assert worker.layered_steps > 0, "no step loaded layer by layer"
    # A layer never waited for fails its load (kvtier's worker: the forward may have read it early).
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    for w in e.workers.values():
        assert not w.native.take_load_errors()


@pytest.mark.parametrize("sync_host_loads", [None, "false"])
def test_an_eager_engine_loads_host_hits_in_the_step_by_default(kvtier_env, sync_host_loads):
    """Default settings (asynchronous loads): an eager engine loads host-tier hits in the step, layer by layer;
    with ``connector.sync_host_loads`` off every hit loads asynchronously and no layer hook is asked for."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "256")
    kvtier_env.setenv("TRTLLM_KVTIER_TEST_LOAD_DELAY_MS", "150")
    if sync_host_loads is not None:
        kvtier_env.setenv("KVTIER_SYNC_HOST_LOADS", sync_host_loads)
    worker = counting_worker()
    ps = prompts(7, one_token_tail=False)
    e = engine(geo=GEO1, num_device_blocks=40, layer_hooks="eager", loop="overlap", worker=worker,
               stream_factory=lambda: 0)
    _, second = run_twice(e, ps, 3)
    assert tokens(second) == reference_tokens(ps, 3)
    if sync_host_loads is None:
        assert e.layerwise is True and worker.layered_steps > 0
        assert e.stats.sync_matches > 0 and e.stats.async_matches == 0, e.stats
    else:
        assert e.layerwise is False and worker.layered_steps == 0
        assert e.stats.sync_matches == 0 and e.stats.async_matches > 0, e.stats


@pytest.mark.parametrize("pool", POOLS)
def test_an_engine_with_cuda_graphs_loads_whole_before_the_forward(sync_host, pool):
    """Replays leave one context token: those batches run in the decode graph, without hooks."""
    worker = counting_worker()
    ps = prompts(5, one_token_tail=True)
    e = engine(pool, geo=GEO1, num_device_blocks=40, layer_hooks="graphs", loop="plain", worker=worker,
               stream_factory=None if pool != "numpy" else (lambda: 0))
    assert e.layerwise is False  # 1.4 installs no hooks
    e.layerwise = True  # an engine (1.2/1.3) that installs them anyway and skips them in graphs
    _, second = run_twice(e, ps, 3)
    assert tokens(second) == reference_tokens(ps, 3)
    assert e.stats.sync_matches > 0 and e.stats.hook_free_forwards > 0
    assert worker.layered_steps == 0


@pytest.mark.parametrize("args, runs", [
    ({}, False),  # TorchLlmArgs' default CudaGraphConfig
    ({"cuda_graph_config": None}, True),
    ({"cuda_graph_config": None, "torch_compile_config": object()}, False),
    ({"cuda_graph_config": None, "prefill_cuda_graph_backend": "breakable"}, False),
    ({"cuda_graph_config": None, "prefill_cuda_graph_backend": "disabled"}, True),
])
def test_layer_hooks_always_run_only_without_graphs_or_compile(args, runs):
    from trtllm_model import LlmArgs

    a = LlmArgs(32, 1, 0)
    for k, v in args.items():
        setattr(a, k, v)
    assert trtllm.layer_hooks_always_run(a) is runs


def test_kv_cache_manager_v2_loads_whole_even_when_eager(sync_host):
    """A V2 ``KvCacheLayout``'s regions need not be one per decoder layer (the index
    ``wait_for_layer_load`` gets): its loads stay whole and complete in ``start_load_kv``."""
    worker = counting_worker()
    ps = prompts(6, one_token_tail=False)
    e = engine(geo=GEO1, num_device_blocks=40, layer_hooks="eager", loop="plain", manager="v2", worker=worker,
               stream_factory=lambda: 0)
    _, second = run_twice(e, ps, 3)
    assert tokens(second) == reference_tokens(ps, 3)
    assert e.stats.sync_matches > 0
    assert worker.layered_steps == 0


@pytest.mark.parametrize("world", [1, 2])
def test_requests_cancelled_during_a_layered_step_keep_their_blocks_until_the_copies_end(sync_host, world):
    """Two requests are cancelled right after the step that loaded them layer by layer (TensorRT-LLM terminates a
    cancelled request between iterations: ``py_executor.py``): nothing is left held or parked and the others'
    tokens are exact, at TP=1 and TP=2 (every rank layered). A regression check of the cancel path only: by then
    every layer was waited for, so no copy into the freed blocks can still run (a planted ``request_finished``
    that frees at once passes it too)."""
    from trtllm_driver import Geometry

    worker = counting_worker()
    ps = prompts(8, one_token_tail=False)
    e = engine(geo=Geometry(world_size=world, kv_heads=2 * world), num_device_blocks=40, layer_hooks="eager",
               worker=worker, stream_factory=lambda: 0)
    first = [e.add_request(p, 3) for p in ps]
    e.run()
    flush(e)
    for w in e.workers.values():
        w.native.wait_idle()
    e.relay_reports()
    victims = [e.add_request(p, 3) for p in ps]
    e.step()
    assert worker.layered_steps > 0
    for r in victims[:2]:
        e.abort(r.request_id)
    e.run()
    assert not e.tables and not e.saving and not e.loading
    assert tokens(first) == reference_tokens(ps, 3)
    assert tokens(victims[2:]) == reference_tokens(ps[2:], 3)


def test_an_eager_engine_with_a_disk_tier_layers_host_hits_and_parks_disk_hits(kvtier_env):
    """Host hits load in the step layer by layer; hits that reach the disk tier load asynchronously (a disk read
    can fail, and TensorRT-LLM cannot recompute a failed synchronous load); every token exact."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "100")
    kvtier_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "512")
    kvtier_env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    kvtier_env.setenv("TRTLLM_KVTIER_TEST_LOAD_DELAY_MS", "50")
    worker = counting_worker()
    old, new = prompts(9, one_token_tail=False), prompts(10, one_token_tail=False)
    e = engine(geo=GEO1, num_device_blocks=40, layer_hooks="eager", loop="overlap", worker=worker,
               stream_factory=lambda: 0)
    for batch in (old, new):  # each pushed out of G1 by unrelated requests; `old` then out of the host tier too
        [e.add_request(p, 3) for p in batch]
        e.run()
        flush(e)
    back = new + old  # the host tier's hits first (loading `old` from disk evicts host blocks)
    second = [e.add_request(p, 3) for p in back]
    e.run()
    assert tokens(second) == reference_tokens(back, 3)
    assert e.stats.sync_matches > 0 and e.stats.async_matches > 0, e.stats
    assert worker.layered_steps > 0
