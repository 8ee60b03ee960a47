"""kvtier.trtllm under TensorRT-LLM's call sequence (tests/trtllm_driver.py): TP=2 in one process,
each rank with its own KV pool shaped like TensorRT-LLM's primary pool, metadata pickled from rank 0
to both ranks, per-layer hooks, get_finished acted on only when both ranks report, chunked prefill,
async loads, requests finishing with saves in flight, disaggregated prefill and decode - under
eviction pressure (tiny G1, small host tier) that forces loads from host and from disk. Every
onboarded byte is checked against what the model would have written.

Pools: numpy arrays by default; torch CPU tensors where torch is installed; CUDA tensors where a
GPU is present (skipped cleanly otherwise).
"""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest

import kvtier
from kvtier import trtllm
from trtllm_driver import VOCAB, FakeTrtllmEngine, Geometry, LlmRequest

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _cuda_available() -> bool:
    if not HAVE_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


POOL_KINDS = [
    "numpy",
    pytest.param("torch-cpu", marks=pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")),
    pytest.param("torch-cuda", marks=pytest.mark.skipif(not _cuda_available(), reason="no CUDA device")),
]

HOST_BLOCKS = 48
DISK_BLOCKS = 512


@pytest.fixture
def tiers(kvtier_env, tmp_path):
    """Tiny host tier, larger disk tier, disk written through (no frequency filter)."""
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", str(HOST_BLOCKS))
    kvtier_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", str(DISK_BLOCKS))
    kvtier_env.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    return kvtier_env


def _stream_factory(pool_kind):
    if pool_kind != "torch-cuda":
        return None
    import torch

    return lambda: torch.cuda.current_stream()


def _engine(pool_kind="numpy", **kw):
    return FakeTrtllmEngine(
        trtllm.KvtierConnectorScheduler,
        trtllm.KvtierConnectorWorker,
        pool_kind=pool_kind,
        stream_factory=_stream_factory(pool_kind),
        **kw,
    )


def _workload(seed=7, n_docs=6, per_doc=3):
    """Prompts sharing document prefixes (2-7 blocks each) with unique tails."""
    rnd = random.Random(seed)
    docs = [[rnd.randrange(VOCAB) for _ in range(rnd.randrange(40, 110))] for _ in range(n_docs)]
    return [d + [rnd.randrange(VOCAB) for _ in range(rnd.randrange(1, 20))] for d in docs for _ in range(per_doc)]


def _flush(engine, seed=99, n=6):
    """Unrelated requests that push everything else out of the tiny G1."""
    rnd = random.Random(seed)
    for _ in range(n):
        engine.add_request([rnd.randrange(VOCAB) for _ in range(90)], 2)
    engine.run()


def _reference_tokens(prompts, max_new):
    ref = FakeTrtllmEngine(None, None, num_device_blocks=64)
    reqs = [ref.add_request(p, max_new) for p in prompts]
    ref.run()
    return [r.get_tokens(0) for r in reqs]


def _stats(engine) -> dict:
    return dict(engine.scheduler.leader.stats())


@pytest.mark.parametrize("pool_kind", POOL_KINDS)
def test_tp2_offload_then_onboard_from_host_and_disk(tiers, pool_kind):
    prompts = _workload()
    want = _reference_tokens(prompts, 6)
    e = _engine(pool_kind, num_device_blocks=40, chunk_size=32)
    first = [e.add_request(p, 6) for p in prompts]
    e.run()
    _flush(e)
    before = _stats(e)
    assert before["offload_confirmed"] > HOST_BLOCKS, before  # more than the host tier holds
    # Phase 2: the same prompts again, now served from kvtier's tiers.
    second = [e.add_request(p, 6) for p in prompts]
    e.run()
    after = _stats(e)
    assert [r.get_tokens(0) for r in first] == want
    assert [r.get_tokens(0) for r in second] == want
    assert e.stats.matched_tokens > 0
    assert after["onboard_host_blocks"] > before["onboard_host_blocks"], after
    assert after["onboard_disk_blocks"] > before["onboard_disk_blocks"], after
    assert after["onboard_failed"] == 0 and after["offload_failed"] == 0, after
    # Requests whose stores were still in flight at finish kept their blocks until both ranks
    # reported them saved; nothing is left parked.
    assert not e.saving and not e.loading
    for w in e.workers:
        assert w.native is not None


def test_saves_in_flight_keep_blocks_until_every_rank_reports(tiers):
    # prompt_len + max_new - 1 is a multiple of 16: each request's last forward pass completes a
    # block, whose store rank 1 confirms only a step later (its reports travel between "processes").
    rnd = random.Random(3)
    prompts = [[rnd.randrange(VOCAB) for _ in range(16 * k + 1)] for k in (3, 4, 5, 6)]
    want = _reference_tokens(prompts, 16)
    e = _engine(num_device_blocks=40)
    reqs = [e.add_request(p, 16) for p in prompts]
    e.run()
    assert e.async_save_seen == len(prompts)
    assert not e.saving and not e.tables, "blocks not released after every rank reported the saves"
    assert [r.get_tokens(0) for r in reqs] == want
    st = _stats(e)
    assert st["offload_confirmed"] == st["offload_blocks"] and st["offload_failed"] == 0, st
    # The stored blocks are intact: serve the prompts again from kvtier only.
    _flush(e)
    again = [e.add_request(p, 16) for p in prompts]
    e.run()
    assert [r.get_tokens(0) for r in again] == want
    assert _stats(e)["onboard_host_blocks"] + _stats(e)["onboard_disk_blocks"] > 0


def test_chunked_prefill_with_small_chunks(tiers):
    prompts = _workload(seed=11, n_docs=3, per_doc=2)
    want = _reference_tokens(prompts, 3)
    e = _engine(num_device_blocks=48, chunk_size=8, max_batch_tokens=24)
    reqs = [e.add_request(p, 3) for p in prompts]
    e.run()
    _flush(e, n=8)
    again = [e.add_request(p, 3) for p in prompts]
    e.run()
    assert [r.get_tokens(0) for r in reqs] == want
    assert [r.get_tokens(0) for r in again] == want
    assert _stats(e)["onboard_host_blocks"] + _stats(e)["onboard_disk_blocks"] > 0


def test_async_loads(tiers):
    tiers.setenv("KVTIER_ASYNC_LOADS", "true")
    prompts = _workload(seed=5, n_docs=4, per_doc=2)
    want = _reference_tokens(prompts, 4)
    e = _engine(num_device_blocks=40)
    [e.add_request(p, 4) for p in prompts]
    e.run()
    _flush(e)
    again = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert e.stats.async_matches > 0 and e.stats.sync_matches == 0
    assert [r.get_tokens(0) for r in again] == want


def test_never_returns_zero_true(tiers):
    tiers.setenv("KVTIER_ASYNC_LOADS", "true")
    e = _engine(num_device_blocks=40)
    req = LlmRequest(12345, list(range(100)), 2, chunk_size=32)
    assert e.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)


def test_disaggregated_prefill_and_decode(tiers, tmp_path):
    prompts = _workload(seed=21, n_docs=4, per_doc=3)
    want = _reference_tokens(prompts, 8)
    tiers.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path / "prefill"))
    (tmp_path / "prefill").mkdir()
    pre = _engine(num_device_blocks=40, role="prefill")
    tiers.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path / "decode"))
    (tmp_path / "decode").mkdir()
    dec = _engine(num_device_blocks=64, role="decode")
    sent = [pre.add_request(p, 8) for p in prompts]
    pre.run()
    _flush(pre)
    resent = [pre.add_request(p, 8) for p in prompts]  # prefill hits from kvtier
    pre.run()
    for rid, (req, kv) in sorted(pre.transceiver_out.items()):
        dec.add_generation_only_request(rid, req.get_tokens(0), req.prompt_len, 8, kv)
    dec.run()
    got = [dec.finished[r.request_id].get_tokens(0) for r in sent + resent]
    assert got == want + want
    ps, ds = _stats(pre), _stats(dec)
    assert ps["onboard_host_blocks"] + ps["onboard_disk_blocks"] > 0, ps
    # The decode worker stores the blocks its generation completes, never loads (KV came by transceiver).
    assert ds["offload_confirmed"] > 0, ds
    assert ds["onboard_host_blocks"] + ds["onboard_disk_blocks"] == 0, ds


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_over_zeromq(tiers):
    """Both ranks reach the leader over conn's ZeroMQ channel (as ranks in other processes do)."""
    tiers.setenv("KVTIER_ZMQ_ENDPOINT", f"tcp://127.0.0.1:{_free_port()}")
    tiers.setenv("KVTIER_LEADER_WORKER_TIMEOUT_SECS", "20")
    prompts = _workload(seed=13, n_docs=4, per_doc=2)
    want = _reference_tokens(prompts, 4)
    e = _engine(num_device_blocks=40)
    first = [e.add_request(p, 4) for p in prompts]
    e.run()
    _flush(e)
    again = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert [r.get_tokens(0) for r in first] == want
    assert [r.get_tokens(0) for r in again] == want
    st = _stats(e)
    assert st["offload_confirmed"] > 0 and st["onboard_host_blocks"] + st["onboard_disk_blocks"] > 0, st
    assert all(w.native.take_reports() == b"" for w in e.workers)  # reports went over the socket


def test_missing_num_scheduled_tokens_names_minimum_version(tiers):
    e = _engine(num_device_blocks=40, legacy_request_data=True)
    e.add_request(list(range(50)), 2)
    with pytest.raises(kvtier.ConnectorError, match=r"TensorRT-LLM >= 1\.2\.0rc2"):
        e.step()


def test_bad_pool_tensors_raise_value_error(tiers):
    geo = Geometry()
    args = FakeTrtllmEngine(None, None).args[0]
    w = trtllm.KvtierConnectorWorker(args)
    trtllm.KvtierConnectorScheduler(args)
    bad = [
        (np.zeros((8, geo.num_layers, 3, geo.inner), np.float16), "kv_factor"),
        (np.zeros((8, geo.num_layers, 2, 250), np.float16), "16 tokens"),
        (np.lib.stride_tricks.as_strided(np.zeros((1, geo.num_layers, 2, geo.inner), np.float16),
                                         (8, geo.num_layers, 2, geo.inner),
                                         (0, 2 * geo.inner * 2, geo.inner * 2, 2), writeable=True), "overlaps"),
        (np.zeros((8, geo.num_layers * 2 * geo.inner), np.float16), "dimensions"),
    ]
    for tensor, fragment in bad:
        with pytest.raises(ValueError, match=fragment):
            w.register_kv_caches(tensor)
    with pytest.raises(TypeError):
        w.register_kv_caches("not a tensor")
    # Nothing was registered: the hooks say so instead of failing later.
    with pytest.raises(kvtier.ConnectorError, match="register_kv_caches"):
        w.start_load_kv(None)


def _corrupt_disk_tier(disk_dir):
    """Flip bytes all over every kvtier cache file: every block's checksum fails on read."""
    files = [p for p in disk_dir.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert files, f"no cache files under {disk_dir}"
    for f in files:
        data = bytearray(f.read_bytes())
        for off in range(0, len(data), 256):
            data[off] ^= 0x5A
        f.write_bytes(bytes(data))


def _disk_only_repeats(tiers, tmp_path, world_size, async_loads):
    """An engine whose repeated prompts can only come from a corrupted disk tier."""
    tiers.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "2")
    tiers.setenv("KVTIER_ASYNC_LOADS", "true" if async_loads else "false")
    prompts = _workload(seed=31, n_docs=3, per_doc=2)
    want = _reference_tokens(prompts, 4)
    e = _engine(geo=Geometry(world_size=world_size), num_device_blocks=40)
    first = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert [r.get_tokens(0) for r in first] == want
    _flush(e)
    for w in e.workers:
        w.native.wait_idle()
    _corrupt_disk_tier(tmp_path / "disk")
    return e, prompts, want


def test_failed_async_loads_are_recomputed(tiers, tmp_path):
    e, prompts, want = _disk_only_repeats(tiers, tmp_path, world_size=1, async_loads=True)
    again = [e.add_request(p, 4) for p in prompts]
    e.run()  # the driver checks every position a request reads: a bad block would fail here
    assert [r.get_tokens(0) for r in again] == want
    s = _stats(e)
    assert e.stats.async_matches > 0 and s["onboard_failed"] > 0, s
    assert e.workers[0].recomputed_loads > 0
    # Again after a flush: blocks not read before may still fail (and are recomputed), the output holds.
    _flush(e)
    third = [e.add_request(p, 4) for p in prompts]
    e.run()
    assert [r.get_tokens(0) for r in third] == want


def test_failed_sync_load_fails_the_pass_never_runs_on_it(tiers, tmp_path):
    e, prompts, _ = _disk_only_repeats(tiers, tmp_path, world_size=1, async_loads=False)
    [e.add_request(p, 4) for p in prompts]
    with pytest.raises(kvtier.TransferError, match="refusing to run the forward pass"):
        e.run()
    assert _stats(e)["onboard_failed"] > 0


def test_failed_async_load_on_two_ranks_is_an_error_not_a_load(tiers, tmp_path):
    # No rank can rewind the other ranks' copies of the request: the failure stops the engine loudly.
    e, prompts, _ = _disk_only_repeats(tiers, tmp_path, world_size=2, async_loads=True)
    [e.add_request(p, 4) for p in prompts]
    with pytest.raises(kvtier.TransferError, match="could not load"):
        e.run()
    assert e.stats.async_matches > 0
