"""kvtier._native bindings used by the TensorRT-LLM adapter: settings, Leader, StepRecord, errors."""

from __future__ import annotations

import pickle

import pytest

import kvtier
from kvtier import _native

BS = 16


def leader(**extra):
    s = {"block_size": BS, "bytes_per_block": 4096, "num_device_blocks": 64, "host.num_blocks": 8}
    s.update(extra)
    return _native.Leader(s)


def test_leader_settings_and_stats(kvtier_env):
    ld = leader()
    assert ld.block_size == BS and ld.loads_are_async is False
    st = ld.stats()
    assert st["host_capacity"] == 8 and st["disk_capacity"] == 0
    assert leader(async_loads=True).loads_are_async is True
    assert leader(async_loads="true").loads_are_async is True


def test_async_loads_come_from_kvtier_configuration(kvtier_env, tmp_path):
    # Unset everywhere: the adapter's default.
    assert leader().loads_are_async is False
    assert leader(async_loads_default=True).loads_are_async is True
    # TOML < KVTIER_ASYNC_LOADS < engine-supplied (nested, dotted, or the adapter key `async_loads`).
    toml = tmp_path / "kvtier.toml"
    toml.write_text("[connector]\nasync_loads = true\n")
    kvtier_env.setenv("KVTIER_CONFIG", str(toml))
    assert leader().loads_are_async is True
    kvtier_env.setenv("KVTIER_ASYNC_LOADS", "false")
    assert leader(async_loads_default=True).loads_are_async is False
    assert leader(**{"connector.async_loads": True}).loads_are_async is True
    assert leader(connector={"async_loads": True}).loads_are_async is True
    assert leader(async_loads=True).loads_are_async is True
    kvtier_env.setenv("KVTIER_ASYNC_LOADS", "sometimes")
    with pytest.raises(kvtier.ConfigError, match="KVTIER_ASYNC_LOADS"):
        leader()


def test_environment_aliases_size_the_tiers(kvtier_env):
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "5")
    kvtier_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "7")
    st = _native.Leader({"block_size": BS, "bytes_per_block": 4096}).stats()
    assert (st["host_capacity"], st["disk_capacity"]) == (5, 7)
    # GB sizes are decimal and divided by the bytes of one block over all ranks.
    kvtier_env.delenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS")
    kvtier_env.setenv("DYN_KVBM_CPU_CACHE_GB", "0.001")
    st = _native.Leader({"block_size": BS, "bytes_per_block": 4000, "world_size": 2}).stats()
    assert st["host_capacity"] == 250


def test_bad_settings_are_config_errors(kvtier_env):
    with pytest.raises(kvtier.ConfigError, match="block_size"):
        _native.Leader({"host.num_blocks": 8, "bytes_per_block": 4096})
    with pytest.raises(kvtier.ConfigError, match="offload tier"):
        _native.Leader({"block_size": BS, "bytes_per_block": 4096})
    with pytest.raises(kvtier.ConfigError, match="world_size"):
        leader(world_size=0)
    with pytest.raises(kvtier.ConfigError, match="async_loads"):
        leader(async_loads="maybe")


def test_step_flow_and_metadata_bytes(kvtier_env):
    ld = leader()
    tokens = list(range(40))
    assert ld.get_num_new_matched_tokens("7", tokens, 0) == 0
    ld.update_state_after_alloc("7", [3, 4, 5])
    rec = _native.StepRecord("7", tokens, [3, 4, 5], 0, 40, is_new=True)
    assert (rec.request_id, rec.num_scheduled_tokens, rec.is_new, rec.new_block_ids) == ("7", 40, True, [3, 4, 5])
    meta = ld.build_step([rec])
    assert isinstance(meta, bytes) and len(meta) > 0
    assert pickle.loads(pickle.dumps(meta)) == meta
    # Two full blocks were computed: both stores are in flight, none confirmed (no worker ran them).
    assert ld.stats()["offload_blocks"] == 2
    assert ld.request_finished("7") is True
    # Dict records work too; a record of a request the leader never saw counts as new
    # (TensorRT-LLM's generation-only requests arrive in cached_requests).
    ld.build_step([{"request_id": "9", "new_tokens": tokens + [1], "new_block_ids": [10, 11, 12],
                    "num_computed_tokens": 40, "num_scheduled_tokens": 1}])
    assert ld.stats()["active_requests"] >= 1
    # Tuples: (request_id, new_tokens, new_block_ids, num_computed, num_scheduled[, drafts, is_new, resumed]).
    other = list(range(100, 120))
    assert ld.get_num_new_matched_tokens("11", other, 0) == 0
    ld.update_state_after_alloc("11", [20, 21])
    before = ld.stats()["offload_blocks"]
    ld.build_step([("11", other, [20, 21], 0, 20, 0, True)])
    assert ld.stats()["offload_blocks"] == before + 1
    with pytest.raises(TypeError, match="5 to 9 items"):
        ld.build_step([("11", [], [])])


def test_connector_errors_name_the_request(kvtier_env):
    ld = leader()
    with pytest.raises(kvtier.ConnectorError, match="request 42"):
        ld.request_finished("42")
    ld.update_state_after_alloc("5", [0, 1])
    with pytest.raises(kvtier.ConnectorError, match="num_scheduled_tokens"):
        ld.build_step([_native.StepRecord("5", list(range(40)), [0, 1], 0, 40, is_new=True)])
    with pytest.raises(kvtier.ConnectorError, match="job reports"):
        ld.apply_reports(b"\x05garbage")
    with pytest.raises(TypeError):
        ld.build_step([42])


def test_step_record_requires_ints():
    with pytest.raises(TypeError):
        _native.StepRecord("1", ["a"], [], 0, 1)
    # #13: a negative count is a kvtier error naming the argument, not a bare OverflowError.
    with pytest.raises(kvtier.ConnectorError, match="new_tokens"):
        _native.StepRecord("1", [-1], [], 0, 1)
    with pytest.raises(kvtier.ConnectorError, match="num_computed_tokens"):
        _native.StepRecord("1", [1], [], -5, 1)
