"""kvtier.trtllm configuration: build_kv_connector_config and `python -m kvtier.trtllm config`,
the equivalent of the original's `--connector kvbm` flag."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import kvtier
from kvtier import trtllm

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
EXPECTED = {
    "connector_module": "kvtier.trtllm",
    "connector_scheduler_class": "KvtierConnectorScheduler",
    "connector_worker_class": "KvtierConnectorWorker",
}


@pytest.mark.parametrize("name", ["kvtier", "kvbm", "KVTIER"])
def test_build_config_names_the_connector_classes(name):
    cfg = trtllm.build_kv_connector_config(name)
    if HAVE_TRTLLM:
        assert {k: getattr(cfg, k) for k in EXPECTED} == EXPECTED
    else:
        assert cfg == EXPECTED
    # The classes it names exist in the module TensorRT-LLM will import.
    mod = importlib.import_module(EXPECTED["connector_module"])
    assert getattr(mod, EXPECTED["connector_scheduler_class"]) is trtllm.KvtierConnectorScheduler
    assert getattr(mod, EXPECTED["connector_worker_class"]) is trtllm.KvtierConnectorWorker


@pytest.mark.parametrize("name", [None, "none", "None"])
def test_build_config_none(name):
    assert trtllm.build_kv_connector_config(name) is None


def test_build_config_unknown_name_lists_valid_names():
    with pytest.raises(kvtier.ConfigError) as e:
        trtllm.build_kv_connector_config("lmcache")
    msg = str(e.value)
    assert "lmcache" in msg
    for valid in ("kvtier", "kvbm", "none"):
        assert valid in msg
    assert isinstance(e.value, kvtier.KvtierError)


def test_cli_prints_yaml_for_trtllm_serve():
    yaml = pytest.importorskip("yaml")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.trtllm", "config", "--connector", "kvtier"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    doc = yaml.safe_load(out)
    assert doc["kv_connector_config"] == EXPECTED
    assert doc == trtllm.llm_options("kvtier")
    # What kvtier needs of the rest of TorchLlmArgs (llmapi/llm_args.py field names, 1.2-1.4).
    assert doc["kv_cache_config"] == {"enable_partial_reuse": False, "host_cache_size": 0}
    assert doc["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    assert doc["enable_attention_dp"] is False and "cuda_graph_config" in doc
    # The `connector` preset field is never used: TensorRT-LLM's registry maps "kvbm" to Dynamo.
    assert "connector" not in doc["kv_connector_config"] and "Dynamo" in out


def test_cli_decode_role_prints_a_block_without_a_connector():
    yaml = pytest.importorskip("yaml")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.trtllm", "config", "--connector", "kvtier", "--role", "decode"],
        check=True, capture_output=True, text=True,
    ).stdout
    assert yaml.safe_load(out) is None and "generation-only" in out


def test_build_llm_kwargs_without_tensorrt_llm():
    kw = trtllm.build_llm_kwargs("kvtier")
    if not HAVE_TRTLLM:
        assert kw["kv_connector_config"] == EXPECTED
        assert kw["kv_cache_config"]["enable_partial_reuse"] is False
    assert trtllm.build_llm_kwargs("kvtier", role="decode") == {}


def test_cli_rejects_unknown_connector():
    p = subprocess.run(
        [sys.executable, "-m", "kvtier.trtllm", "config", "--connector", "bogus"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert "valid names are kvtier, kvbm, none" in p.stderr
    assert p.stdout == ""


def test_cli_none_prints_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.trtllm", "config", "--connector", "none"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out == ""


def test_generation_only_requests_property_or_method(kvtier_env):
    """A property on the C++ LlmRequest, a method on V2's Python one (a bound method is truthy)."""
    from trtllm_driver import LlmRequest, LlmRequestV2

    assert not getattr(trtllm.KvtierConnectorScheduler, "supports_generation_only_requests", False)
    for cls in (LlmRequest, LlmRequestV2):
        assert trtllm._is_generation_only(cls(1, [1] * 40, 2, chunk_size=16, generation_only=True))
        assert not trtllm._is_generation_only(cls(2, [1] * 40, 2, chunk_size=16))


def test_base_classes_follow_tensorrt_llm():
    if HAVE_TRTLLM:
        assert trtllm.TRTLLM_BASE_MODULE in (
            "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
            "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
        )
    else:
        assert trtllm.TRTLLM_BASE_MODULE is None
        assert trtllm.KvtierConnectorScheduler.__mro__[1] is object
        assert trtllm.KvtierConnectorWorker.__mro__[1] is object
