"""TensorRT-LLM with TP > 1 and every tier (issue 25, item 5): a load that fails on one rank only
is decided alike on every rank before any rank computes on it.

Modelled (tests/trtllm_driver.py, tests/trtllm_model.py ``_RankManager``, from
``connectors/kv_cache_connector.py`` ``KvCacheConnectorManager.get_finished``): each rank's worker
is asked every iteration; a parked request resumes only when every rank reported it (allgather +
intersection); a request one rank never reports stays parked on every rank for good (it stays in
``local_finished_async_requests`` on the others; ``py_executor.py`` ``_check_kv_transfer_timeout``
times out only the cache transceiver's transfers, those with a ``py_kv_transfer_start_time``), so
withholding a failed load would leave it stuck. Each rank holds its own ``LlmRequest`` objects in ``pending_async_requests``.

Faults: one rank's disk files only are corrupted (every block's checksum fails on that rank), so
rank 0 loads every block and rank 1 none; the driver checks every position each rank's forward
reads against the model, so a rank computing on a block its load failed to fill fails the run.
"""

from __future__ import annotations

import pytest

import kvtier
from trtllm_driver import Geometry
from trtllm_scenarios import engine, flush, reference_tokens, stats, tokens, workload

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")


@pytest.fixture
def tiers(kvtier_env):
    """A tiny host tier and a disk tier written through: second runs load from disk."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "2")
    kvtier_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "512")
    kvtier_env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    return kvtier_env


def corrupt_rank_disk(disk_dir, rank: int) -> int:
    """Flip bytes all over one rank's kvtier disk files (``<dir>/kvtier-g3/rank<r>*``)."""
    files = [p for p in disk_dir.rglob("*") if p.is_file() and p.stat().st_size > 0
             and any(part.startswith(f"rank{rank}") for part in p.relative_to(disk_dir).parts)]
    assert files, f"no rank {rank} cache files under {disk_dir}: {sorted(disk_dir.rglob('*'))}"
    for f in files:
        data = bytearray(f.read_bytes())
        for off in range(0, len(data), 256):
            data[off] ^= 0x5A
        f.write_bytes(bytes(data))
    return len(files)


def run_with_faults(world: int, bad_rank: int, tmp_path, loop: str = "overlap", **kw) -> tuple:
    prompts = workload(seed=31, n_docs=3, per_doc=2)
    want = reference_tokens(prompts, 4)
    e = engine(geo=Geometry(world_size=world, kv_heads=2 * world), num_device_blocks=40, loop=loop, **kw)
    first = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert tokens(first) == want
    flush(e)
    for w in e.workers.values():
        w.native.wait_idle()
    e.relay_reports()
    corrupt_rank_disk(tmp_path / "disk", bad_rank)
    bystanders = [e.add_request([7] * 5 + list(range(i, i + 40)), 4) for i in range(3)]
    again = [e.add_request(p, 4) for p in prompts]
    e.run()  # the driver checks every position every rank reads
    assert tokens(again) == want
    assert tokens(bystanders) == reference_tokens([r.get_tokens(0)[:45] for r in bystanders], 4)
    return e, stats(e)


@pytest.mark.parametrize("loop, kw", [("overlap", {}), ("plain", {}), ("overlap", {"manager": "v2", "alloc_delay": 1})])
def test_tp2_disk_fault_on_one_rank_is_recomputed_on_every_rank(tiers, tmp_path, loop, kw):
    e, s = run_with_faults(2, 1, tmp_path, loop, **kw)
    assert e.stats.async_matches > 0 and s["onboard_failed"] > 0, s
    # Every rank rewound its own request to the leader's token, rank 0 whose loads all succeeded too.
    assert all(w.recomputed_loads > 0 for w in e.workers.values()), [w.recomputed_loads for w in e.workers.values()]
    assert len({w.recomputed_loads for w in e.workers.values()}) == 1
    assert all(w.unrecoverable_loads == 0 for w in e.workers.values())
    assert not e.loading and not e.running and not e.saving


def test_tp4_disk_fault_on_rank_2_only(tiers, tmp_path):
    e, s = run_with_faults(4, 2, tmp_path)
    assert s["onboard_failed"] > 0, s
    assert len({w.recomputed_loads for w in e.workers.values()}) == 1 and e.workers[0].recomputed_loads > 0


def test_tp2_disk_loads_without_faults_are_served(tiers):
    """Every tier under TP=2: disk hits load on both ranks and are reported loaded by verdict."""
    prompts = workload(seed=5, n_docs=3, per_doc=2)
    want = reference_tokens(prompts, 4)
    e = engine(geo=Geometry(world_size=2), num_device_blocks=40)
    first = [e.add_request(p, 4) for p in prompts]
    e.run()
    flush(e)
    again = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert tokens(first) == want and tokens(again) == want
    s = stats(e)
    assert s["onboard_disk_blocks"] > 0 and s["onboard_failed"] == 0, s
    assert all(w.recomputed_loads == 0 for w in e.workers.values())


def test_tp2_remote_tier_with_corrupt_values_on_either_rank(kvtier_env, tmp_path):
    """The remote tier under TP=2 (``dir://``, one value per block and rank): every other stored
    value corrupted, so each rank fails some blocks and loads others; every rank resumes from the
    lowest block any rank failed."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "2")
    kvtier_env.setenv("KVTIER_REMOTE_URL", f"dir://{tmp_path / 'remote'}")
    prompts = workload(seed=31, n_docs=3, per_doc=2)
    want = reference_tokens(prompts, 4)
    e = engine(geo=Geometry(world_size=2), num_device_blocks=40)
    first = [e.add_request(p, 4) for p in prompts]
    e.run()
    flush(e)
    for w in e.workers.values():
        w.native.wait_idle()
    files = sorted(p for p in (tmp_path / "remote").rglob("*") if p.is_file())
    assert len(files) >= 4
    for f in files[::2]:
        data = bytearray(f.read_bytes())
        for off in range(0, len(data), 64):
            data[off] ^= 0x5A
        f.write_bytes(bytes(data))
    again = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert tokens(first) == want and tokens(again) == want
    s = stats(e)
    assert s["onboard_failed"] > 0, s
    assert len({w.recomputed_loads for w in e.workers.values()}) == 1 and e.workers[0].recomputed_loads > 0


def test_tp2_requests_cancelled_while_a_failing_load_waits_for_its_verdict(tiers, tmp_path):
    """Loads start late (the worker's test delay), rank 1's disk is corrupted, and two of the
    requests are cancelled right after their loads started: their blocks stay held until every
    rank's copies ended (the driver fails the run otherwise), nothing is left parked, and the
    others' tokens are exact."""
    tiers.setenv("TRTLLM_KVTIER_TEST_LOAD_DELAY_MS", "20")
    prompts = workload(seed=31, n_docs=3, per_doc=2)
    e = engine(geo=Geometry(world_size=2), num_device_blocks=40)
    first = [e.add_request(p, 3) for p in prompts]
    e.run()
    flush(e)
    for w in e.workers.values():
        w.native.wait_idle()
    e.relay_reports()
    corrupt_rank_disk(tmp_path / "disk", 1)
    victims = [e.add_request(p, 3) for p in prompts]
    e.abort_requested = {r.request_id for r in victims[:2]}
    e.step()
    assert e.stats.async_matches >= 2 and not e.abort_requested
    e.run()
    assert not e.tables and not e.saving and not e.loading
    assert tokens(first) == reference_tokens(prompts, 3)
    assert tokens(victims[2:]) == reference_tokens(prompts[2:], 3)
