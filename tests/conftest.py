"""Shared pytest fixtures for kvtier's Python tests.

The kvtier package must be installed (``pip install .`` or ``maturin develop``); tests that need
torch, CUDA or TensorRT-LLM skip cleanly where those are missing.
"""

from __future__ import annotations

import os
import sys

import pytest

# Let tests import the shared helpers beside them (trtllm_driver.py) without a package.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-engine variants left out of the default run (KVTIER_FULL=1)")


@pytest.fixture
def kvtier_env(tmp_path, monkeypatch):
    """A clean kvtier environment: no inherited KVTIER_* / DYN_KVBM_* settings, disk tier in tmp."""
    for name in list(os.environ):
        if name.startswith(("KVTIER_", "DYN_KVBM_")):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path / "disk"))
    (tmp_path / "disk").mkdir()
    return monkeypatch
