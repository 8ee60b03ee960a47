"""Planted bugs: each defect an audit found in kvtier's TensorRT-LLM adapter (or one a connector
could have) is planted into a copy of the connector, and the scenario that guards against it must
fail; the unmodified connector must pass the same scenario. This is what makes the driver's checks
(tests/trtllm_driver.py) evidence rather than decoration."""

from __future__ import annotations

import random
import shutil

import pytest

import kvtier
from kvtier import trtllm
from kvtier._tensors import stream_handle
from trtllm_driver import VOCAB
from trtllm_scenarios import GEO1, engine, flush, reference_tokens, run_twice, tokens, workload

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")


# ----- scenarios (return normally for a correct connector) -------------------------------------


def scenario_engine_start(env, tmp, S, W):
    engine(geo=GEO1, warmup_forwards=3, scheduler=S, worker=W)


def scenario_single_token_context_graph(env, tmp, S, W):
    env.setenv("KVTIER_ASYNC_LOADS", "false")
    env.setenv("TRTLLM_KVTIER_TEST_LOAD_DELAY_MS", "20")  # a load that merely races the forward loses
    rnd = random.Random(4)
    prompts = [[rnd.randrange(VOCAB) for _ in range(16 * k + 1)] for k in (2, 3, 4)]
    e = engine(geo=GEO1, num_device_blocks=24, layer_hooks="graphs", loop="plain", scheduler=S, worker=W)
    e.layerwise = True
    _, second = run_twice(e, prompts, 3)
    assert e.stats.sync_matches > 0 and tokens(second) == reference_tokens(prompts, 3)


def scenario_tenants(env, tmp, S, W):
    prompts = workload(seed=23, n_docs=3, per_doc=1)
    e = engine(geo=GEO1, num_device_blocks=40, scheduler=S, worker=W)
    [e.add_request(p, 3, cache_salt="a") for p in prompts]
    e.run()
    flush(e)
    [e.add_request(p, 3, cache_salt="b") for p in prompts]
    e.run()  # the driver fails an offer of blocks tenant "b" never computed
    assert e.stats.matched_tokens == 0


def scenario_two_models(env, tmp, S, W):
    env.setenv("KVTIER_REMOTE_URL", f"dir://{tmp / 'remote'}")
    env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    prompts = workload(seed=29, n_docs=3, per_doc=1)
    produced: set = set()
    a = engine(geo=GEO1, model="model-a", model_seed=1, produced=produced, scheduler=S, worker=W)
    [a.add_request(p, 3) for p in prompts]
    a.run()
    b = engine(geo=GEO1, model="model-b", model_seed=2, produced=produced, scheduler=S, worker=W)
    got = [b.add_request(p, 3) for p in prompts]
    b.run()
    assert tokens(got) == reference_tokens(prompts, 3, seed=2)


def scenario_v2_matches(env, tmp, S, W):
    prompts = workload(seed=17, n_docs=3, per_doc=2)
    e = engine(geo=GEO1, manager="v2", chunk_size=16, num_device_blocks=64, scheduler=S, worker=W)
    _, second = run_twice(e, prompts, 4)
    assert e.stats.matched_tokens > 0 and tokens(second) == reference_tokens(prompts, 4)


def scenario_cancel_while_loading(env, tmp, S, W):
    prompts = workload(seed=43, n_docs=4, per_doc=1)
    e = engine(num_device_blocks=40, scheduler=S, worker=W)
    [e.add_request(p, 3) for p in prompts]
    e.run()
    flush(e)
    victims = [e.add_request(p, 3) for p in prompts]
    e.abort_requested = {r.request_id for r in victims[:2]}
    e.run()


def scenario_failed_load(env, tmp, S, W):
    env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "2")
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "512")
    env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    prompts = workload(seed=31, n_docs=3, per_doc=2)
    e = engine(geo=GEO1, num_device_blocks=40, scheduler=S, worker=W)
    [e.add_request(p, 4) for p in prompts]
    e.run()
    flush(e)
    for w in e.workers.values():
        w.native.wait_idle()
    for f in (tmp / "disk").rglob("*"):
        if f.is_file() and f.stat().st_size:
            data = bytearray(f.read_bytes())
            for off in range(0, len(data), 256):
                data[off] ^= 0x5A
            f.write_bytes(bytes(data))
    again = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert tokens(again) == reference_tokens(prompts, 4)


def scenario_tp2_disk_fault_on_rank_1(env, tmp, S, W):
    """TP=2 with a disk tier, rank 1's disk files corrupted (tests/test_trtllm_tp_loads.py)."""
    from test_trtllm_tp_loads import corrupt_rank_disk
    from trtllm_driver import Geometry

    env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "2")
    env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "512")
    env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    prompts = workload(seed=31, n_docs=3, per_doc=2)
    e = engine(geo=Geometry(world_size=2), num_device_blocks=40, scheduler=S, worker=W)
    [e.add_request(p, 4) for p in prompts]
    e.run()
    flush(e)
    for w in e.workers.values():
        w.native.wait_idle()
    e.relay_reports()
    corrupt_rank_disk(tmp / "disk", 1)
    again = [e.add_request(p, 4) for p in prompts]
    e.run(max_steps=400, min_seconds=10.0)
    assert tokens(again) == reference_tokens(prompts, 4)


def scenario_two_engines_ports(env, tmp, S, W):
    args = engine(geo=GEO1).args[0]
    env.setattr(trtllm, "RANKS_IN_PROCESSES", True)
    scheds = []
    for name in ("mutant-port-a", "mutant-port-b"):
        env.setattr(trtllm, "_channel", lambda name=name: name)
        scheds.append(S(args))
    for s in scheds:
        s.leader.shutdown()


# ----- mutants ---------------------------------------------------------------------------------


class WorkerRaisesBeforeRegistration(trtllm.KvtierConnectorWorker):
    def register_forward_pass_callable(self):
        def cb():
            if self._worker is None:
                raise kvtier.ConnectorError("the kvtier worker was used before register_kv_caches")
            self._worker.forward_done(None)

        return cb


class WorkerLoadsInLayerHook(trtllm.KvtierConnectorWorker):
    def start_load_kv(self, stream):
        if self._worker is not None:
            self._worker.start_load(stream_handle(stream))

    def wait_for_layer_load(self, layer_idx, stream):
        if self._worker is not None and layer_idx == 0:
            self._worker.wait_for_layer_load(0, None)


class SchedulerFreesWhileLoading(trtllm.KvtierConnectorScheduler):
    def request_finished(self, request, cache_block_ids):
        super().request_finished(request, cache_block_ids)
        return False


class WorkerRaisesOnFailedLoad(trtllm.KvtierConnectorWorker):
    def _rewind(self, request, token):
        raise kvtier.TransferError(f"kvtier could not load the KV of request {request.request_id}")


class WorkerSkipsTheRewind(trtllm.KvtierConnectorWorker):
    """One rank: a failed load is reported loaded without rewinding the request to the verdict's token."""

    def _rewind(self, request, token):
        return None


class WorkerTakesAVerdictForSuccess(trtllm.KvtierConnectorWorker):
    """TP > 1: reports a load some rank failed as loaded, without rewinding to the verdict's token."""

    def _get_finished_by_verdict(self, finished, started, manager):
        w = self._worker
        for blobs in self._share_verdicts():
            w.apply_load_verdicts(blobs[0])
        saved, loaded, recompute = w.get_finished_by_verdict(trtllm._ids(finished), trtllm._ids(started))
        return [int(x) for x in saved], [int(r) for r in loaded] + [int(r) for r, _ in recompute]


class WorkerWithholdsFailedLoads(trtllm.KvtierConnectorWorker):
    """TP > 1 as before issue 25: a load some rank failed is never reported loaded."""

    def _get_finished_by_verdict(self, finished, started, manager):
        w = self._worker
        for blobs in self._share_verdicts():
            w.apply_load_verdicts(blobs[0])
        saved, loaded, _ = w.get_finished_by_verdict(trtllm._ids(finished), trtllm._ids(started))
        return [int(x) for x in saved], [int(r) for r in loaded]


def _no_cache_salt(request):
    return None, True, ""


def _truthy_generation_only(request):
    return bool(getattr(request, "is_generation_only_request", False))


S0, W0 = trtllm.KvtierConnectorScheduler, trtllm.KvtierConnectorWorker

MUTANTS = {
    # id: (scenario, scheduler, worker, module patches, expected failure)
    "forward_callable_raises_before_registration": (scenario_engine_start, S0, WorkerRaisesBeforeRegistration, {},
                                                   kvtier.ConnectorError),
    "sync_load_completed_only_in_layer_hook": (scenario_single_token_context_graph, S0, WorkerLoadsInLayerHook, {},
                                               AssertionError),
    "cache_salt_ignored": (scenario_tenants, S0, W0, {"request_key": _no_cache_salt}, AssertionError),
    "no_model_identity_in_salt": (scenario_two_models, S0, W0, {"engine_salt": lambda a: "trtllm"}, AssertionError),
    "generation_only_method_taken_as_truthy": (scenario_v2_matches, S0, W0,
                                               {"_is_generation_only": _truthy_generation_only}, AssertionError),
    "blocks_let_go_while_loading": (scenario_cancel_while_loading, SchedulerFreesWhileLoading, W0, {}, AssertionError),
    "failed_load_raises_in_a_hook": (scenario_failed_load, S0, WorkerRaisesOnFailedLoad, {}, kvtier.TransferError),
    "failed_load_not_rewound": (scenario_failed_load, S0, WorkerSkipsTheRewind, {}, AssertionError),
    "tp_failed_load_taken_for_success": (scenario_tp2_disk_fault_on_rank_1, S0, WorkerTakesAVerdictForSuccess, {},
                                         AssertionError),
    "tp_failed_load_withheld": (scenario_tp2_disk_fault_on_rank_1, S0, WorkerWithholdsFailedLoads, {}, AssertionError),
    "fixed_default_port": (scenario_two_engines_ports, S0, W0,
                           {"_free_endpoints": lambda n: ["tcp://127.0.0.1:56119"] * n}, kvtier.KvtierError),
}


@pytest.fixture
def env(kvtier_env):
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "256")
    return kvtier_env


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_correct_connector_passes(env, tmp_path, name):
    scenario = MUTANTS[name][0]
    scenario(env, tmp_path, S0, W0)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_planted_bug_is_caught(env, tmp_path, name):
    scenario, S, W, patches, expected = MUTANTS[name]
    for attr, fn in patches.items():
        env.setattr(trtllm, attr, fn)
    try:
        with pytest.raises(expected):
            scenario(env, tmp_path, S, W)
    finally:
        shutil.rmtree(tmp_path / "remote", ignore_errors=True)
