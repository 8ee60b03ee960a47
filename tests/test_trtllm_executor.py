"""The executor shapes of TensorRT-LLM 1.2-1.4 (docs/arch/trtllm.md, read from their py_executor.py) and what kvtier keys by:
bring-up order, hook-free forwards, device prefix reuse, KVCacheManagerV2 (layout registration,
first-chunk-only allocation, matching and allocation apart with cancel_load, request_reset, the
method is_generation_only_request), cache salts, model identity, LoRA / multimodal requests,
cancellation with loads in flight, ports and settings for spawned ranks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

import kvtier
from kvtier import trtllm
from trtllm_driver import VOCAB, LlmRequest
from trtllm_scenarios import GEO1, engine, flush, reference_tokens, run_twice, stats, tokens, workload

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")


@pytest.fixture
def host_only(kvtier_env):
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "256")
    return kvtier_env


def test_engine_start_runs_the_forward_callable_before_registration(host_only):
    # Five KV-cache estimation / warmup forwards before register_kv_caches: nothing raises.
    e = engine(geo=GEO1, warmup_forwards=5)
    assert all(w.native is not None for w in e.workers.values())
    assert e.layerwise is False  # 1.4 installs no layer hooks for kvtier


def test_single_token_context_chunk_runs_in_the_decode_graph(host_only):
    """A prompt of 16k+1 tokens whose k blocks kvtier loads leaves one context token: TensorRT-LLM
    promotes it into the decode CUDA graph (no layer hooks); a sync load must be complete anyway."""
    host_only.setenv("KVTIER_ASYNC_LOADS", "false")
    rnd = random.Random(4)
    prompts = [[rnd.randrange(VOCAB) for _ in range(16 * k + 1)] for k in (2, 3, 4)]
    e = engine(geo=GEO1, num_device_blocks=24, layer_hooks="graphs", loop="plain")
    e.layerwise = True  # an engine that would run hooks where it can
    first, second = run_twice(e, prompts, 3)
    assert tokens(second) == reference_tokens(prompts, 3)
    assert e.stats.sync_matches > 0 and e.stats.hook_free_forwards > 0


def test_device_prefix_reuse_plus_kvtier_blocks(host_only):
    rnd = random.Random(8)
    doc = [rnd.randrange(VOCAB) for _ in range(64)]
    tails = [[rnd.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
    e = engine(geo=GEO1, num_device_blocks=30)
    e.add_request(doc + tails[0] + tails[1], 2)
    e.run()
    flush(e, n=6)
    e.add_request(doc, 2)  # brings the document's blocks back onto the device
    e.run()
    # Device reuse covers the document (num_computed_tokens > 0), kvtier the first tail.
    r = e.add_request(doc + tails[0] + tails[2], 2)
    e.run()
    assert r.get_tokens(0) == reference_tokens([doc + tails[0] + tails[2]], 2)[0]
    assert e.stats.device_and_connector > 0 and stats(e)["onboard_host_blocks"] > 0


@pytest.mark.parametrize("loop", ["overlap", "plain"])
@pytest.mark.parametrize("api", ["1.4", "1.3", "1.2"])
def test_kv_cache_manager_v2(host_only, loop, api):
    prompts = workload(seed=17, n_docs=4, per_doc=3)
    want = reference_tokens(prompts, 18)
    e = engine(manager="v2", alloc_delay=1, chunk_size=16, num_device_blocks=64, loop=loop, api=api)
    first, second = run_twice(e, prompts, 18)
    assert tokens(first) == want and tokens(second) == want
    assert e.stats.matched_tokens > 0  # is_generation_only_request() is a method here


@pytest.mark.parametrize("shared", [48, 80])
def test_v2_cancel_load_when_the_device_cache_overtakes_an_offer(host_only, shared):
    """Matching and allocation one iteration apart: another request registers part (48 tokens) or
    all (80) of the offered prefix on the device in between, and the engine cancels that part."""
    rnd = random.Random(47)
    doc = [rnd.randrange(VOCAB) for _ in range(80)]
    tail = lambda: [rnd.randrange(VOCAB) for _ in range(10)]  # noqa: E731
    e = engine(geo=GEO1, manager="v2", alloc_delay=1, chunk_size=256, num_device_blocks=24, loop="plain")
    e.add_request(doc + tail(), 2)
    e.run()
    flush(e, n=8)
    a = e.add_request(doc[:shared] + tail(), 2)
    while a not in e.running:
        e.step()  # a matched, allocated, loaded; it computes its context next
    b = e.add_request(doc + tail(), 2)
    e.step()  # b matched before a's blocks are registered on the device
    e.run()
    assert e.stats.cancel_loads == 1
    assert tokens([a, b]) == reference_tokens([a.get_tokens(0)[:a.prompt_len], b.get_tokens(0)[:b.prompt_len]], 2)


def test_request_reset_on_v2(host_only):
    prompts = workload(seed=19, n_docs=2, per_doc=2)
    e = engine(geo=GEO1, manager="v2", chunk_size=16, num_device_blocks=64)
    [e.add_request(p, 4) for p in prompts]
    e.run()
    flush(e, n=6)
    reqs = [e.add_request(p, 4) for p in prompts]
    for _ in range(3):
        e.step()
    running = [r for r in e.running if r.state.name == "CONTEXT_INIT"]
    for r in running:
        e.reset(r.request_id)
    e.run()
    assert tokens(reqs) == reference_tokens(prompts, 4)


@pytest.mark.parametrize("api", ["1.4", "1.3"])
def test_tenants_with_different_salts_share_nothing(host_only, api):
    prompts = workload(seed=23, n_docs=3, per_doc=1)
    e = engine(geo=GEO1, num_device_blocks=40, api=api)
    salt = (lambda t: {"cache_salt": t}) if api == "1.4" else (lambda t: {"cache_salt_id": hash(t) & 0xFFFF})
    a = [e.add_request(p, 3, **salt("tenant-a")) for p in prompts]
    e.run()
    flush(e)
    b = [e.add_request(p, 3, **salt("tenant-b")) for p in prompts]
    e.run()
    assert e.stats.matched_tokens == 0  # the driver also checks every offer against the tenant
    flush(e)
    a2 = [e.add_request(p, 3, **salt("tenant-a")) for p in prompts]
    e.run()
    assert e.stats.matched_tokens > 0
    assert tokens(a) == tokens(b) == tokens(a2) == reference_tokens(prompts, 3)


def test_two_models_sharing_one_remote_store_never_read_each_other(host_only, tmp_path):
    host_only.setenv("KVTIER_REMOTE_URL", f"dir://{tmp_path / 'remote'}")
    host_only.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")
    prompts = workload(seed=29, n_docs=3, per_doc=1)
    produced: set = set()
    a = engine(geo=GEO1, num_device_blocks=40, model="model-a", model_seed=1, produced=produced)
    [a.add_request(p, 3) for p in prompts]
    a.run()
    assert stats(a)["remote_put_confirmed"] > 0
    # Identical KV shapes, another model: nothing matches (a match would fail the byte checks).
    b = engine(geo=GEO1, num_device_blocks=40, model="model-b", model_seed=2, produced=produced)
    got = [b.add_request(p, 3) for p in prompts]
    b.run()
    assert b.stats.matched_tokens == 0
    assert tokens(got) == reference_tokens(prompts, 3, seed=2)
    # The same model in a fresh engine reads model-a's blocks from the store.
    c = engine(geo=GEO1, num_device_blocks=40, model="model-a", model_seed=1, produced=produced)
    again = [c.add_request(p, 3) for p in prompts]
    c.run()
    assert c.stats.matched_tokens > 0 and stats(c)["onboard_remote_blocks"] > 0
    assert tokens(again) == reference_tokens(prompts, 3, seed=1)


def test_lora_requests_are_uncacheable(host_only):
    prompts = workload(seed=37, n_docs=2, per_doc=1)
    e = engine(geo=GEO1, num_device_blocks=40)
    [e.add_request(p, 2, lora_task_id=3) for p in prompts]
    e.run()
    assert stats(e)["offload_blocks"] == 0
    flush(e)
    again = [e.add_request(p, 2, lora_task_id=3) for p in prompts]
    e.run()
    assert e.stats.matched_tokens == 0
    assert tokens(again) == reference_tokens(prompts, 2)


def test_multimodal_requests_are_keyed_by_their_hashes(host_only):
    prompts = workload(seed=41, n_docs=2, per_doc=1)
    e = engine(geo=GEO1, num_device_blocks=40)
    mm = lambda h: {"multimodal": ([[h, h + 1]], [4], [8])}  # noqa: E731
    run_twice(e, prompts, 2, **mm(10))
    assert e.stats.matched_tokens > 0
    before = e.stats.matched_tokens
    flush(e)
    [e.add_request(p, 2, **mm(20)) for p in prompts]  # same tokens, another image
    e.run()
    assert e.stats.matched_tokens == before
    # Without hashes kvtier cannot key it: uncacheable.
    key = trtllm.request_key(LlmRequest(1, [1, 2], 1, chunk_size=8, multimodal=(None, [0], [4])))
    assert key[1] is False


def test_cancelled_request_keeps_its_blocks_while_its_load_is_in_flight(host_only):
    prompts = workload(seed=43, n_docs=4, per_doc=1)
    e = engine(num_device_blocks=40)
    [e.add_request(p, 3) for p in prompts]
    e.run()
    flush(e)
    victims = [e.add_request(p, 3) for p in prompts]
    # Cancelled right after their loads started; the driver fails the run if the blocks were let go.
    e.abort_requested = {r.request_id for r in victims[:2]}
    e.step()
    assert e.stats.async_matches >= 2 and not e.abort_requested
    others = [e.add_request(p, 3) for p in workload(seed=44, n_docs=3, per_doc=1)]
    e.run()
    assert not e.tables and not e.saving
    assert tokens(others) == reference_tokens(workload(seed=44, n_docs=3, per_doc=1), 3)
    assert tokens(victims[2:]) == reference_tokens(prompts[2:], 3)


def test_two_engines_on_one_host_get_their_own_ports(host_only, monkeypatch):
    args = engine(geo=GEO1).args[0]
    monkeypatch.setattr(trtllm, "RANKS_IN_PROCESSES", True)
    monkeypatch.setattr(trtllm, "_channel", lambda: "port-test-a")
    a = trtllm.KvtierConnectorScheduler(args)
    monkeypatch.setattr(trtllm, "_channel", lambda: "port-test-b")
    b = trtllm.KvtierConnectorScheduler(args)
    ea, eb = trtllm._Engine.of("port-test-a").endpoints[0], trtllm._Engine.of("port-test-b").endpoints[0]
    assert ea and eb and ea != eb and "56119" not in ea + eb
    a.leader.shutdown()
    b.leader.shutdown()


def test_settings_reach_spawned_ranks_through_a_trtllm_variable(kvtier_env):
    kvtier_env.setenv("KVTIER_ASYNC_LOADS", "false")
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_GB", "3")
    kvtier_env.setenv(trtllm.RANK_SETTINGS_ENV, "")  # restored (removed) after the test
    trtllm.build_kv_connector_config("kvtier")
    blob = os.environ[trtllm.RANK_SETTINGS_ENV]
    # A spawned rank: only TRTLLM*/TLLM* variables survive.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "DYN_KVBM_"))}
    code = ("import os, kvtier.trtllm as t; t._import_rank_settings(); "
            "print(os.environ.get('KVTIER_ASYNC_LOADS'), os.environ.get('DYN_KVBM_CPU_CACHE_GB'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["false", "3"]
    assert json.loads(blob)["KVTIER_ASYNC_LOADS"] == "false"


@pytest.mark.parametrize(
    "setting, value, fragment",
    [
        ("max_beam_width", 2, "max_beam_width"),
        ("speculative_config", object(), "speculative_config"),
        ("enable_attention_dp", True, "enable_attention_dp"),
        ("kv_cache_config.max_attention_window", [64, 4096], "max_attention_window"),
        ("kv_cache_config.host_cache_size", 1 << 30, "host_cache_size"),
        ("kv_cache_config.enable_partial_reuse", True, "enable_partial_reuse"),
        ("scheduler_config", type("S", (), {"capacity_scheduler_policy": "MAX_UTILIZATION"})(), "GUARANTEED_NO_EVICT"),
        ("parallel_config._m.pp_size", 2, "pipeline_parallel_size"),
    ],
)
def test_unsupported_settings_are_refused_at_construction(host_only, setting, value, fragment):
    def configure(a):
        obj, *path = [a] + setting.split(".")
        for p in path[:-1]:
            obj = getattr(obj, p)
        setattr(obj, path[-1], value)

    with pytest.raises(kvtier.ConfigError, match=fragment):
        engine(geo=GEO1, configure=configure)


@pytest.mark.parametrize("priority", [None, 90])
def test_retention_priorities_reach_the_pools_eviction(kvtier_env, priority):
    """RequestData.priorities: a high-priority request's stored blocks outlive a flood of default
    ones in a small host tier; without a priority LRU evicts them first."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "16")
    rnd = random.Random(53)
    keep = [rnd.randrange(VOCAB) for _ in range(70)]
    e = engine(geo=GEO1, num_device_blocks=24)
    e.add_request(keep, 2, retention_priority=priority)
    e.run()
    # 8 x 100 tokens, far more blocks than the host tier holds, one request at a time: a priority orders
    # eviction among evictable blocks, and blocks still being written are not evictable, so a flood of
    # concurrent stores on a slow machine may leave a priority block the only candidate (seen under load).
    for _ in range(8):
        flush(e, n=1)
    before = e.stats.matched_tokens
    again = e.add_request(keep, 2)
    e.run()
    assert again.get_tokens(0) == reference_tokens([keep], 2)[0]
    assert (e.stats.matched_tokens > before) == (priority is not None)
