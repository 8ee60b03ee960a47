"""kvtier settings through every source the Python adapters see, observed in the built native components (#16).

Sources: the TOML file named by ``KVTIER_CONFIG``, ``KVTIER_*`` variables, the original ``DYN_KVBM_*`` aliases,
vLLM's ``kv_connector_extra_config`` (nested, typed: what ``kvtier.vllm`` copies into the settings dict) and the
TensorRT-LLM adapter's settings dict (dotted keys, string values). Each case builds ``_native.Leader(settings)``
exactly as the adapters do and checks the effect: pool sizes, the leader/worker start-up timeout, the ZeroMQ
endpoint the leader binds, the load mode. The other keys' effects (disk files, filter, remote namespace, metrics
endpoint) are observed on the same composition root in crates/kvtier-io/tests/compose_settings.rs, which also
checks that this file names connector.leader_worker_timeout_secs, connector.zmq_endpoint and
connector.async_loads.
"""

from __future__ import annotations

import socket
import time

import pytest

import kvtier
from kvtier import _native

BS = 16
SOURCES = ["toml", "env", "alias", "vllm", "trtllm"]

# key -> (KVTIER_* name, DYN_KVBM_* alias or None)
ENV = {
    "host.num_blocks": ("KVTIER_HOST_NUM_BLOCKS", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"),
    "disk.num_blocks": ("KVTIER_DISK_NUM_BLOCKS", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"),
    "connector.leader_worker_timeout_secs": ("KVTIER_LEADER_WORKER_TIMEOUT_SECS",
                                             "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"),
    "connector.zmq_endpoint": ("KVTIER_ZMQ_ENDPOINT", None),
    "connector.async_loads": ("KVTIER_ASYNC_LOADS", None),
    "connector.sync_host_loads": ("KVTIER_SYNC_HOST_LOADS", None),
}


def _nest(key: str, value):
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return f'"{v}"'


def make_leader(env, tmp_path, source: str, key: str, value, **adapter):
    """``_native.Leader`` with ``key = value`` given through ``source`` (a host tier comes from the TOML file)."""
    toml = {"host.num_blocks": 8}
    settings = {"block_size": BS, **adapter}
    if source == "toml":
        toml[key] = value
    elif source == "env":
        env.setenv(ENV[key][0], str(value).lower() if isinstance(value, bool) else str(value))
    elif source == "alias":
        if ENV[key][1] is None:
            pytest.skip(f"{key} has no DYN_KVBM_* alias")
        env.setenv(ENV[key][1], str(value))
    elif source == "vllm":
        settings.update(_nest(key, value))
    elif source == "trtllm":
        settings[key] = str(value).lower() if isinstance(value, bool) else str(value)
    path = tmp_path / f"kvtier-{source}.toml"
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in toml.items()))
    env.setenv("KVTIER_CONFIG", str(path))
    return _native.Leader(settings)


@pytest.mark.parametrize("source", SOURCES)
def test_tier_sizes(kvtier_env, tmp_path, source):
    st = make_leader(kvtier_env, tmp_path, source, "host.num_blocks", 5, bytes_per_block=4096).stats()
    assert st["host_capacity"] == 5
    st = make_leader(kvtier_env, tmp_path, source, "disk.num_blocks", 7, bytes_per_block=4096).stats()
    assert st["disk_capacity"] == 7


@pytest.mark.parametrize("source", SOURCES)
def test_leader_worker_timeout(kvtier_env, tmp_path, source):
    # No bytes_per_block: the leader waits for rank 0's worker of this process, for the configured time.
    ld = make_leader(kvtier_env, tmp_path, source, "connector.leader_worker_timeout_secs", 1,
                     channel=f"nobody-{source}")
    t = time.monotonic()
    with pytest.raises(kvtier.ConnectorError, match=r"within 1s"):
        ld.stats()
    assert 0.9 < time.monotonic() - t < 10


@pytest.mark.parametrize("source", [s for s in SOURCES if s != "alias"])
def test_zmq_endpoint(kvtier_env, tmp_path, source):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ld = make_leader(kvtier_env, tmp_path, source, "connector.zmq_endpoint", f"tcp://127.0.0.1:{port}",
                     link="zmq", bytes_per_block=4096)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the leader listens where the setting says
    finally:
        ld.shutdown()


@pytest.mark.parametrize("source", [s for s in SOURCES if s != "alias"])
def test_async_loads(kvtier_env, tmp_path, source):
    ld = make_leader(kvtier_env, tmp_path, source, "connector.async_loads", True, bytes_per_block=4096,
                     async_loads_default=False)
    assert ld.loads_are_async is True


@pytest.mark.parametrize("source", [s for s in SOURCES if s != "alias"])
def test_sync_host_loads(kvtier_env, tmp_path, source):
    """Issue 27: whether host-tier hits load in the step, from every source over the adapter's default (its effect
    per request is tested in Rust: connector_flow.rs `host_hits_load_in_the_step_disk_hits_asynchronously`)."""
    ld = make_leader(kvtier_env, tmp_path, source, "connector.sync_host_loads", False, bytes_per_block=4096,
                     sync_host_loads_default=True)
    assert ld.sync_host_loads is False
    ld.shutdown()


def test_sync_host_loads_default_is_the_adapters(kvtier_env, tmp_path):
    assert make_leader(kvtier_env, tmp_path, "toml", "host.num_blocks", 4, bytes_per_block=4096).sync_host_loads is False
    assert make_leader(kvtier_env, tmp_path, "toml", "host.num_blocks", 4, bytes_per_block=4096,
                       sync_host_loads_default=True).sync_host_loads is True


def test_stats_keys_are_the_counter_table(kvtier_env, tmp_path):
    st = make_leader(kvtier_env, tmp_path, "toml", "host.num_blocks", 5, bytes_per_block=4096).stats()
    table = _native.metrics_table()
    # The stats dict is the core's one counter table, the same rows the Prometheus endpoint exports.
    assert set(st) == {m["key"] for m in table}
    names = {(m["key"], m["name"], tuple(map(tuple, m["labels"]))) for m in table}
    assert ("offloaded_host_blocks", "kvtier_blocks_total", (("direction", "offload"), ("tier", "host"))) in names
    assert st["host_capacity"] == 5


def test_invalid_values_name_setting_and_source(kvtier_env, tmp_path):
    with pytest.raises(kvtier.ConfigError, match=r"KVTIER_HOST_NUM_BLOCKS \(environment variable\)"):
        make_leader(kvtier_env, tmp_path, "env", "host.num_blocks", "lots", bytes_per_block=4096)
    kvtier_env.delenv("KVTIER_HOST_NUM_BLOCKS")
    with pytest.raises(kvtier.ConfigError, match=r"host.num_blocks \(engine settings\)"):
        make_leader(kvtier_env, tmp_path, "trtllm", "host.num_blocks", "lots", bytes_per_block=4096)
    with pytest.raises(kvtier.ConfigError, match=r"host.num_blocks \(in .*kvtier-toml.toml\)"):
        make_leader(kvtier_env, tmp_path, "toml", "host.num_blocks", "lots", bytes_per_block=4096)
    with pytest.raises(kvtier.ConfigError, match=r"remote.url .*TLS"):
        make_leader(kvtier_env, tmp_path, "vllm", "remote.url", "rediss://10.0.0.1:6379", bytes_per_block=4096)


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def test_metrics_endpoint_in_process(kvtier_env, tmp_path):
    """TensorRT-LLM's (and vLLM's) leader serves kvtier's metrics from inside the engine process (DYN_KVBM_METRICS,
    DYN_KVBM_METRICS_PORT); a second leader of the process joins the one endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kvtier_env.setenv("DYN_KVBM_METRICS", "1")
    kvtier_env.setenv("DYN_KVBM_METRICS_PORT", str(port))
    first = make_leader(kvtier_env, tmp_path, "trtllm", "host.num_blocks", 8, bytes_per_block=4096)
    tokens = list(range(40))
    first.get_num_new_matched_tokens("1", tokens, 0)
    first.update_state_after_alloc("1", [3, 4, 5])
    first.build_step([_native.StepRecord("1", tokens, [3, 4, 5], 0, 40, is_new=True)])
    st = first.stats()
    scraped = _scrape(port)
    assert scraped['kvtier_pool_capacity_blocks{tier="host"}'] == st["host_capacity"] == 8
    assert scraped['kvtier_dispatched_blocks_total{direction="offload",from="device"}'] == st["offload_blocks"] == 2
    second = make_leader(kvtier_env, tmp_path, "vllm", "host.num_blocks", 4, bytes_per_block=4096)
    second.stats()
    assert _scrape(port)['kvtier_pool_capacity_blocks{tier="host"}'] == 12
    second.shutdown()
    first.stats()
    assert _scrape(port)['kvtier_pool_capacity_blocks{tier="host"}'] == 8
