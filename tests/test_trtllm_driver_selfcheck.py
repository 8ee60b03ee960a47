"""The TensorRT-LLM stand-in itself, without a connector: its checks must pass on a correct run and
fail on corrupted KV, otherwise the connector tests built on it prove nothing."""

from __future__ import annotations

import random

import pytest

from trtllm_driver import VOCAB, FakeTrtllmEngine, Geometry, expected_kv, prefix_hashes


def _prompts(n, seed=1):
    rnd = random.Random(seed)
    docs = [[rnd.randrange(VOCAB) for _ in range(rnd.randrange(40, 120))] for _ in range(5)]
    return [docs[i % 5] + [rnd.randrange(VOCAB) for _ in range(rnd.randrange(3, 30))] for i in range(n)]


def test_aggregated_run_passes_its_own_checks_and_reuses_device_blocks():
    e = FakeTrtllmEngine(None, None, num_device_blocks=40)
    reqs = [e.add_request(p, 8) for p in _prompts(16)]
    e.run()
    assert all(len(r.generated) == 8 for r in reqs)
    assert len(e.blocks.by_key) > 0


def test_disaggregated_tokens_equal_aggregated():
    prompts = _prompts(12)
    agg = FakeTrtllmEngine(None, None, num_device_blocks=40)
    ref = [agg.add_request(p, 6) for p in prompts]
    agg.run()
    pre = FakeTrtllmEngine(None, None, num_device_blocks=40, role="prefill")
    sent = [pre.add_request(p, 6) for p in prompts]
    pre.run()
    dec = FakeTrtllmEngine(None, None, num_device_blocks=40, role="decode")
    for rid, (req, kv) in pre.transceiver_out.items():
        dec.add_generation_only_request(rid, req.get_tokens(0), req.prompt_len, 6, kv)
    dec.run()
    assert [dec.finished[r.request_id].get_tokens(0) for r in sent] == [r.get_tokens(0) for r in ref]


def test_corrupted_cached_block_is_detected():
    prompts = _prompts(2)
    e = FakeTrtllmEngine(None, None, num_device_blocks=40)
    e.add_request(prompts[0], 2)
    e.run()
    # Flip one element of a reusable (cached) block, then reuse that prefix.
    block = next(iter(e.blocks.by_key.values()))
    e.pools[1].u16[block, 2, 1, 5] ^= 1
    e.add_request(prompts[0][:-1] + [7, 8, 9], 2)
    with pytest.raises(AssertionError, match="rank 1 layer 2 plane 1"):
        e.run()


def test_model_kv_depends_on_prefix_layer_and_plane():
    geo = Geometry()
    h = __import__("numpy").array(prefix_hashes([1, 2, 3]), dtype="uint64")
    a = expected_kv(h, 0, 0, geo)
    assert a.shape == (3, geo.kv_heads * geo.head_dim)
    assert (a != expected_kv(h, 1, 0, geo)).any() and (a != expected_kv(h, 0, 1, geo)).any()
    h2 = __import__("numpy").array(prefix_hashes([9, 2, 3]), dtype="uint64")
    assert (expected_kv(h2, 0, 0, geo)[2] != a[2]).any()
