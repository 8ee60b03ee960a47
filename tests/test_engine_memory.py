"""Engine memory registration (issue #15 item 6): a Worker registers the engine's tensors through
kvtier-io's checked ``EngineMemory::from_tensors`` and keeps the objects ``kvtier.describe`` was given
referenced while its transfer engine lives, so a KV cache dropped by the caller is not freed under
kvtier's copies."""

from __future__ import annotations

import gc
import sys
import weakref

import numpy as np

from kvtier import _native, describe

BS = 16


def test_described_tensors_hold_their_object():
    a = np.zeros((8, 2, 2, BS * 2 * 8), np.float16)
    before = sys.getrefcount(a)
    d = describe(a)
    assert d.has_owner
    assert sys.getrefcount(a) == before + 1
    raw = _native.TensorDesc(d.data_ptr, d.shape, d.strides, d.itemsize, d.dtype)
    assert not raw.has_owner
    del d
    assert sys.getrefcount(a) == before


def test_a_worker_keeps_the_kv_cache_alive_until_it_is_gone(kvtier_env):
    pool = np.zeros((8, 2, 2, BS * 2 * 8), np.float16)
    alive = weakref.ref(pool)
    s = {"block_size": BS, "host.num_blocks": 4, "link": "engine"}
    w = _native.Worker(s, describe(pool))
    del pool
    gc.collect()
    # Only the worker's transfer engine references the array now.
    assert alive() is not None
    w.shutdown()
    del w
    gc.collect()
    # Released once the engine dropped (a decref deferred past a GIL-free drop is applied at the
    # next call into the extension).
    _native.TensorDesc.contiguous_strides([1], 1)
    gc.collect()
    assert alive() is None
