"""What stays refused under TensorRT-LLM is refused at engine start (the scheduler's and every
worker's constructor, before the model's KV cache exists), naming the model's layer kind and the
setting (issue 25, item 4).

Sliding-window layers: TensorRT-LLM reads the window from ``kv_cache_config.max_attention_window``
or, unset, from the checkpoint's ``config.json`` (``sliding_window``, ``layer_types``); a window
shorter than ``max_seq_len`` frees the blocks it passed and reports them as ``-1`` page ids
(``connectors/kv_cache_connector.py`` ``RequestData.new_block_ids_by_layer_group``: "A block that is
out of window ... appears as BAD_PAGE_INDEX"), one layer group per window under VSWA
(``update_state_after_alloc_by_layer_group``). kvtier serves that on KVCacheManagerV2 with one rank
(tests/test_trtllm_vswa.py); on the V1 manager (whose connector path reports one flat page list and
raises for several windows: ``resource_manager.py`` ``KVCacheManager.get_cache_indices``) and with
TP > 1 such a model is refused before it loads, naming its layers and the setting.
"""

from __future__ import annotations

import json

import pytest

import kvtier
from kvtier import trtllm
from trtllm_driver import LlmArgs
from trtllm_scenarios import GEO1, engine

pytestmark = pytest.mark.skipif(not hasattr(kvtier._native, "Worker"), reason="native connector not built")


@pytest.fixture
def host_only(kvtier_env):
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "64")
    return kvtier_env


def checkpoint(tmp_path, **cfg) -> str:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


GEMMA2_LIKE = {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 2}
GEMMA3_LIKE = {"text_config": {"sliding_window": 64, "sliding_window_pattern": 6}}
MISTRAL_LIKE = {"sliding_window": 64}


@pytest.mark.parametrize("cfg, fragments", [
    (GEMMA2_LIKE, ["2 full_attention, 2 sliding_attention", "sliding_window=64", "max_seq_len"]),
    (GEMMA3_LIKE, ["5 of every 6 layers (sliding_window_pattern)", "sliding_window=64"]),
    (MISTRAL_LIKE, ["every layer", "sliding_window=64"]),
])
def test_a_sliding_window_model_is_refused_at_start_naming_its_layers(host_only, tmp_path, cfg, fragments):
    model = checkpoint(tmp_path, **cfg)

    def configure(a):
        a.model = model

    with pytest.raises(kvtier.ConfigError, match="sliding-window attention .*layers") as e:
        engine(geo=GEO1, configure=configure)
    for f in fragments + ["V1 KV cache manager", "use_kv_cache_manager_v2=true"]:
        assert f in str(e.value), str(e.value)
    # The worker alone refuses as well (every rank, at construction).
    args = LlmArgs(16, 1, 0, model)
    with pytest.raises(kvtier.ConfigError, match="sliding-window attention .*layers"):
        trtllm.KvtierConnectorWorker(args)
    # KVCacheManagerV2 is served with the host tier, with one rank or two (tests/test_trtllm_vswa.py runs both).
    args.kv_cache_config.use_kv_cache_manager_v2 = True
    trtllm.KvtierConnectorWorker(args)
    tp2 = LlmArgs(16, 2, 0, model)
    tp2.kv_cache_config.use_kv_cache_manager_v2 = True
    trtllm.KvtierConnectorWorker(tp2)
    # A tier whose loads can fail is refused at any TP size: the recompute would land on -1 pages.
    host_only.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "64")
    for a in (args, tp2):
        with pytest.raises(kvtier.ConfigError, match="with a disk tier: .*host tier alone") as e:
            trtllm.KvtierConnectorWorker(a)
        # The reason is TensorRT-LLM's, not kvtier's bookkeeping (issue 25): a recompute lands on -1 pages.
        for f in ["_stale_block_range", "without a page"]:
            assert f in str(e.value), str(e.value)


@pytest.mark.parametrize("cfg", [
    {"sliding_window": None},
    {"sliding_window": 4096, "use_sliding_window": False},  # Qwen2: declared, not used
    {"sliding_window": 8192, "layer_types": ["sliding_attention", "full_attention"]},  # >= max_seq_len
    {"layer_types": ["full_attention"] * 4, "sliding_window": 64},
])
def test_full_attention_checkpoints_run(host_only, tmp_path, cfg):
    model = checkpoint(tmp_path, **cfg)

    def configure(a):
        a.model = model

    e = engine(geo=GEO1, configure=configure)
    r = e.add_request(list(range(40)), 2)
    e.run()
    assert len(r.get_tokens(0)) == 42


def test_a_window_shorter_than_max_seq_len_is_served_once_max_seq_len_fits(host_only, tmp_path):
    model = checkpoint(tmp_path, **GEMMA2_LIKE)

    def configure(a):
        a.model = model
        a.max_seq_len = 64

    engine(geo=GEO1, configure=configure)


def test_vswa_setting_is_refused_on_the_v1_manager_naming_the_windows(host_only):
    def configure(a):
        a.kv_cache_config.max_attention_window = [64, 4096]

    with pytest.raises(kvtier.ConfigError, match=r"max_attention_window=\[64, 4096\]: variable sliding-window "
                                                 r"attention \(VSWA\) layers \(windows \[64\] tokens, "
                                                 r"max_seq_len=4096\) on the V1 KV cache manager"):
        engine(geo=GEO1, configure=configure)


def test_a_kv_cache_layout_whose_windows_differ_from_the_settings_is_refused(host_only):
    """KVCacheManagerV2 with windows configured: the layout must have one group per window."""
    def configure(a):
        a.kv_cache_config.max_attention_window = [64, 4096]
        a.kv_cache_config.use_kv_cache_manager_v2 = True

    with pytest.raises(kvtier.ConfigError, match=r"layer groups with windows \[None\]; kvtier expected one group "
                                                 r"per window \[None, 64\]"):
        engine(geo=GEO1, manager="v2", configure=configure)


def test_a_multi_group_kv_cache_layout_names_its_windows(host_only):
    class Group:
        def __init__(self, w):
            self.window_size, self.regions, self.replicated_regions = w, [], ()

    class Layout:
        tokens_per_block = 16
        groups = [Group(64), Group(None)]

    w = trtllm.KvtierConnectorWorker(LlmArgs(16, 1, 0))
    with pytest.raises(kvtier.ConfigError, match=r"2 layer groups \(window_size per group: \[64, None\]"):
        w.register_kv_cache_layout(Layout())


def test_a_hub_model_is_read_from_the_hugging_face_cache_offline(host_only, tmp_path):
    pytest.importorskip("huggingface_hub")
    snap = tmp_path / "hub" / "models--org--swa-model" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(GEMMA2_LIKE))
    (tmp_path / "hub" / "models--org--swa-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--swa-model" / "refs" / "main").write_text("abc123")
    host_only.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    host_only.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    host_only.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def configure(a):
        a.model = "org/swa-model"

    with pytest.raises(kvtier.ConfigError,
                       match=r"the model org/swa-model \(layer_types: .*sliding-window attention .*layers .*V1 KV"):
        engine(geo=GEO1, configure=configure)


@pytest.mark.parametrize("cfg, fragment", [
    ({"layer_types": ["linear_attention", "linear_attention", "full_attention"]}, "2 linear_attention"),
    ({"hybrid_override_pattern": "M-M*-M-"}, "3 Mamba layers (hybrid_override_pattern=M-M*-M-)"),
    ({"layers_block_type": ["mamba", "attention", "mamba"]}, "2 Mamba layers (layers_block_type)"),
    ({"model_type": "mamba2"}, "Mamba layers (model_type=mamba2)"),
    ({"text_config": {"attention_chunk_size": 1024}}, "chunked local attention (attention_chunk_size=1024"),
])
def test_stateful_or_chunked_layers_are_refused_at_start_by_kind(host_only, tmp_path, cfg, fragment):
    """Recurrent (Mamba, linear-attention) layers keep a per-request state outside the KV blocks, so a
    prefix hit would skip building it; chunked local attention frees blocks as a window does."""
    model = checkpoint(tmp_path, **cfg)

    def configure(a):
        a.model = model

    with pytest.raises(kvtier.ConfigError, match="has layers kvtier cannot serve") as e:
        engine(geo=GEO1, configure=configure)
    assert fragment in str(e.value), str(e.value)


def test_chunked_attention_longer_than_max_seq_len_runs(host_only, tmp_path):
    model = checkpoint(tmp_path, attention_chunk_size=8192)

    def configure(a):
        a.model = model

    engine(geo=GEO1, configure=configure)
