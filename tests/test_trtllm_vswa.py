"""kvtier.trtllm under sliding-window and variable sliding-window attention (VSWA) on TensorRT-LLM
1.4's KVCacheManagerV2 (tests/trtllm_vswa.py: one page pool and page-id space per window, -1 page ids
for blocks a window passed, pages released while the request runs): the KV every forward reads is
the model's, byte for byte, with replay hits loaded from kvtier under eviction pressure (a small G1),
and a window group loads only the window of each hit's end.

Guards (each planted and caught, see the commit that added this file): a window group loading the
whole prefix (the leader not told its window), -1 page ids not taken as holes, a hit claimed from one
group's answer only, TensorRT-LLM's group ids assumed to be kvtier's order.
"""

from __future__ import annotations

import pytest

import kvtier
from kvtier import ConfigError
from kvtier import trtllm
from trtllm_model import Geometry
from trtllm_scenarios import flush, reference_tokens, tokens, workload
from trtllm_vswa import VswaEngine

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")

GEO = Geometry(num_layers=4, world_size=1, kv_heads=2)
TPB = GEO.tokens_per_block
ALTERNATING = [48, None, 48, None]  # Gemma-3 / gpt-oss shape: window and full layers alternate


@pytest.fixture
def host_only(kvtier_env):
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "512")
    return kvtier_env


def vswa_engine(windows: list, **kw) -> VswaEngine:
    return VswaEngine(trtllm.KvtierConnectorScheduler, trtllm.KvtierConnectorWorker, windows=windows, geo=GEO,
                      **kw)


def window_blocks(n: int, w) -> int:
    """Blocks a hit of ``n`` tokens loads in a group with window ``w`` (None: the whole prefix)."""
    return n // TPB - (0 if w is None else max(0, (n + 1 - w) // TPB))


def replay(e: VswaEngine, prompts: list, n: int) -> tuple:
    first = [e.add_request(p, n) for p in prompts]
    e.run()
    flush(e)
    second = [e.add_request(p, n) for p in prompts]
    e.run()
    return first, second


@pytest.mark.parametrize("windows", [ALTERNATING, [32, 64, None, 32], [48] * 4],
                         ids=["window+full", "two-windows+full", "one-window"])
@pytest.mark.parametrize("group_order", ["first-layer", "reversed"])
@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_replays_hit_and_every_forward_reads_the_models_kv(host_only, windows, group_order, loop):
    prompts = workload()
    want = reference_tokens(prompts, 20)
    # A small G1: pages released by the window are handed to the next allocation at once.
    e = vswa_engine(windows, group_order=group_order, loop=loop, num_device_blocks=24, chunk_size=32)
    first, second = replay(e, prompts, 20)
    assert tokens(first) == want and tokens(second) == want
    hits = [r.py_num_connector_matched_tokens for r in second]
    assert sum(hits) >= len(prompts) * TPB, hits  # the replays were served by kvtier


def test_a_window_group_loads_only_the_window_of_each_hits_end(host_only):
    prompts = workload(lo=80, hi=140)
    e = vswa_engine(ALTERNATING, num_device_blocks=24, chunk_size=32)
    _, second = replay(e, prompts, 4)
    assert tokens(second) == reference_tokens(prompts, 4)
    hits = [r.py_num_connector_matched_tokens for r in e.finished.values()]  # every run's hits
    windows = [None, 48]  # kvtier's order: full attention, then windows ascending
    leaders = e.scheduler.leaders
    natives = e.workers[0].natives
    full_blocks = sum(window_blocks(n, None) for n in hits)
    win_blocks = sum(window_blocks(n, 48) for n in hits)
    # Some hit reached past the window, so the window group loads less than the full one (how many hits and how long
    # depends on which stores landed before each match: not asserted); exact per group below.
    assert any(n + 1 - 48 >= TPB for n in hits) and win_blocks < full_blocks, (hits, win_blocks, full_blocks)
    for g, w in enumerate(windows):
        st = leaders[g].stats()
        loaded = st["onboard_host_blocks"] + st.get("onboard_disk_blocks", 0)
        assert loaded == sum(window_blocks(n, w) for n in hits), (w, loaded, hits)
        assert st["onboard_host_bytes"] == st["onboard_host_blocks"] * natives[g].bytes_per_block


def test_the_flat_form_carries_holes_for_one_sliding_window(host_only):
    """One window on every layer: one layer group, the flat callbacks, -1 for the pages the window
    passed (``test_a_sliding_single_group_reports_sentinels_in_the_flat_list`` upstream)."""
    prompts = workload(lo=80, hi=140)
    e = vswa_engine([48] * 4, num_device_blocks=24)
    _, second = replay(e, prompts, 8)
    assert tokens(second) == reference_tokens(prompts, 8)
    st = e.scheduler.leader.stats()
    hits = [r.py_num_connector_matched_tokens for r in e.finished.values()]
    assert st["onboard_host_blocks"] == sum(window_blocks(n, 48) for n in hits) > 0


@pytest.mark.parametrize("windows", [ALTERNATING, [32, 64, None, 32], [48] * 4],
                         ids=["window+full", "two-windows+full", "one-window"])
def test_tensor_parallel_ranks_each_read_their_share_of_the_models_kv(host_only, windows):
    """TP=2 with the host tier (TensorRT-LLM runs Gemma-3-class models this way): every rank's forward
    reads its own heads' KV, window by window, exactly as the model wrote it, with replay hits; each
    group's leader loads its window's share, and rank 1's reports reach each group's leader."""
    geo = Geometry(num_layers=4, world_size=2, kv_heads=4)
    prompts = workload(lo=80, hi=140)
    want = reference_tokens(prompts, 12)
    e = VswaEngine(trtllm.KvtierConnectorScheduler, trtllm.KvtierConnectorWorker, windows=windows, geo=geo,
                   num_device_blocks=24, chunk_size=32)
    first, second = replay(e, prompts, 12)
    assert tokens(first) == want and tokens(second) == want
    hits = [r.py_num_connector_matched_tokens for r in e.finished.values()]
    assert sum(r.py_num_connector_matched_tokens for r in second) >= len(prompts) * TPB, hits
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # kvtier's order
    for g, w in enumerate(kinds):
        st = e.scheduler.leaders[g].stats()
        assert st["onboard_host_blocks"] == sum(window_blocks(n, w) for n in hits) > 0, (w, st, hits)
    assert all(w.unrecoverable_loads == 0 and w.recomputed_loads == 0 for w in e.workers.values())


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("windows", [ALTERNATING, [32, 64, None, 32]], ids=["window+full", "two-windows+full"])
def test_a_match_allocated_a_pass_later_keeps_its_host_blocks(kvtier_env, windows, world):
    """KVCacheManagerV2 matches and allocates apart (the driver's ``alloc_delay``): replays run beside new
    prompts whose stores, planned between a replay's match and its allocation, evict host blocks (a small
    host tier), so a load the match promised would fail, and under a window its recompute writes into (or
    reads) blocks without a page: without holds the driver stops on exactly that. Each leader holds a
    match's host blocks until the allocation (``Leader.enable_match_holds``): every load is whole, every
    forward reads the model's KV, and no hold outlives its allocation."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "24")
    prompts = workload(seed=5, n_docs=8, per_doc=3, lo=80, hi=140)
    fresh = workload(seed=99, n_docs=8, per_doc=3, lo=80, hi=140)
    mixed = [x for pair in zip(fresh, prompts) for x in pair]
    geo = Geometry(num_layers=4, world_size=world, kv_heads=2 * world)
    e = VswaEngine(trtllm.KvtierConnectorScheduler, trtllm.KvtierConnectorWorker, windows=windows, geo=geo,
                   num_device_blocks=48, chunk_size=32, alloc_delay=1)
    first = [e.add_request(p, 8) for p in prompts]
    e.run()
    flush(e)
    second = [e.add_request(p, 8) for p in mixed]
    e.run()
    assert tokens(first) == reference_tokens(prompts, 8) and tokens(second) == reference_tokens(mixed, 8)
    assert sum(r.py_num_connector_matched_tokens for r in second) > 0
    for leader in e.scheduler.leaders:
        st = leader.stats()
        assert st["onboard_failed"] == 0 and st["onboard_host_blocks"] > 0, st
        assert leader.held_blocks() == 0
        # Under windows a hold never times out (a failed load in any group rewinds the request; the Rust test
        # a_hold_without_expiry_outlives_max_hold_steps shows what that keeps).
        assert leader.match_holds_expire() is False


@pytest.mark.parametrize("windows", [ALTERNATING, [48] * 4], ids=["window+full", "one-window"])
def test_host_hits_load_in_the_step_when_asked(host_only, windows):
    """``connector.sync_host_loads``: every group's part of a hit lies in the host tier (the only tier served under a
    window), so every group loads it inside the step (answered ``(n, False)``; the groups' modes are joined by
    ``match_groups``), exactly, and V2's match and allocation a pass apart changes nothing (match holds)."""
    host_only.setenv("KVTIER_SYNC_HOST_LOADS", "true")
    prompts = workload(lo=80, hi=140)
    want = reference_tokens(prompts, 8)
    e = vswa_engine(windows, num_device_blocks=24, chunk_size=32, alloc_delay=1)
    first, second = replay(e, prompts, 8)
    assert tokens(first) == want and tokens(second) == want
    assert e.stats.sync_matches > 0 and e.stats.async_matches == 0, e.stats
    assert all(l.stats()["onboard_failed"] == 0 for l in e.scheduler.leaders)


def test_a_disk_tier_under_a_window_is_refused_at_start(kvtier_env, tmp_path):
    """A failed disk (or remote) load is recovered by recomputing the request from where kvtier's offer began, but
    KVCacheManagerV2 gave the window group no page (-1) for the blocks behind the window of the served end
    (kv_cache_manager_v2.py _stale_block_range / _resize_for_connector_prefix), so that recompute would write into
    blocks without a page: found in this driver with every disk block corrupted (the forward wrote position 0 of a
    window layer into a -1 page). Such a tier is refused at engine start, naming the reason and the setting; the
    host tier alone is served (the other tests here)."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "24")
    kvtier_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "512")
    with pytest.raises(ConfigError) as err:
        vswa_engine(ALTERNATING, num_device_blocks=40, chunk_size=32)
    msg = str(err.value)
    assert "with a disk tier" in msg and "_stale_block_range" in msg and "host tier alone" in msg, msg
