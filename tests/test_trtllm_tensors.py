"""Tensor descriptors and the checks on TensorRT-LLM's pool tensor: numpy arrays, torch tensors
(CPU, and CUDA where present) and anything exposing the array interface."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier import describe

TPB = 16


def pool(num_blocks=8, layers=3, kv=2, heads=2, head_dim=8, dtype=np.float16):
    return np.zeros((num_blocks, layers, kv, TPB * heads * head_dim), dtype=dtype)


def test_numpy_descriptor_matches_the_array():
    a = pool()
    d = describe(a)
    assert d.data_ptr == a.ctypes.data
    assert d.shape == list(a.shape)
    assert d.strides == list(a.strides)
    assert (d.itemsize, d.dtype, d.device, d.device_index) == (2, "float16", "cpu", 0)
    assert d.nbytes == a.nbytes
    g = d.trtllm_pool_geometry(TPB, 3)
    assert g == {
        "num_blocks": 8,
        "num_layers": 3,
        "kv_factor": 2,
        "bytes_per_plane": TPB * 2 * 8 * 2,
        "bytes_per_block": TPB * 2 * 8 * 2 * 2 * 3,
    }


def test_mla_pool_has_one_plane():
    g = describe(pool(kv=1)).trtllm_pool_geometry(TPB)
    assert g["kv_factor"] == 1


def _overlapping():
    base = np.zeros((1, 3, 2, TPB * 16), np.float16)
    return np.lib.stride_tricks.as_strided(base, (8, 3, 2, TPB * 16), (0,) + base.strides[1:], writeable=True)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: np.zeros((8, 3, 4, 256), np.float16), "kv_factor (dim 2) is 4"),
        (lambda: np.zeros((8, 3, 2, 250), np.float16), "not 1 plane(s) of 16 tokens"),
        (lambda: np.zeros((8, 3, 512), np.float16), "expected 4 dimensions"),
        (lambda: np.zeros((0, 3, 2, 256), np.float16), "empty dimension"),
        (_overlapping, "overlaps"),
        (lambda: np.zeros((8, 3, 2, 256), np.complex64), "not a KV cache type"),
    ],
)
def test_bad_pool_tensors_raise_value_error_naming_the_mismatch(make, fragment):
    with pytest.raises(ValueError) as e:
        describe(make()).trtllm_pool_geometry(TPB)
    assert fragment in str(e.value)
    assert isinstance(e.value, kvtier.LayoutError)


def test_strided_pools_are_addressed_not_rejected():
    # Every other block of a bigger pool, and a layer-major pool: blocks are still disjoint ranges.
    full = pool(num_blocks=16)
    g = describe(full[::2]).trtllm_pool_geometry(TPB)
    assert g["num_blocks"] == 8 and g["bytes_per_block"] == describe(full).trtllm_pool_geometry(TPB)["bytes_per_block"]
    layer_major = np.zeros((3, 8, 2, TPB * 16), np.float16).transpose(1, 0, 2, 3)
    assert describe(layer_major).trtllm_pool_geometry(TPB, 3)["num_blocks"] == 8


def test_layer_count_mismatch_is_named():
    with pytest.raises(kvtier.LayoutError, match="num_layers \\(dim 1\\) is 3 but the model has 4 layers"):
        describe(pool()).trtllm_pool_geometry(TPB, 4)


def test_read_only_array_is_rejected():
    a = pool()
    a.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        describe(a)


def test_non_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="not a tensor"):
        describe([1, 2, 3])


def test_array_interface_object():
    a = pool()

    class Foreign:
        __array_interface__ = a.__array_interface__

    d = describe(Foreign())
    assert d.data_ptr == a.ctypes.data and d.shape == list(a.shape)


def test_descriptor_validates_its_own_fields():
    with pytest.raises(ValueError, match="shape has 2 dimensions but strides has 1"):
        kvtier.TensorDesc(0x1000, [2, 2], [2], 2, "float16")
    with pytest.raises(ValueError, match="device \"tpu\""):
        kvtier.TensorDesc(0x1000, [2], [2], 2, "float16", "tpu")
    with pytest.raises(ValueError, match="null"):
        kvtier.TensorDesc(0, [2], [2], 2, "float16")


def test_torch_tensors_cpu_and_cuda():
    torch = pytest.importorskip("torch")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        t = torch.zeros((8, 3, 2, TPB * 16), dtype=torch.bfloat16, device=dev)
        d = describe(t)
        assert d.data_ptr == t.data_ptr()
        assert d.strides == [s * 2 for s in t.stride()]
        assert (d.dtype, d.device, d.itemsize) == ("bfloat16", dev, 2)
        assert d.trtllm_pool_geometry(TPB, 3)["bytes_per_block"] == TPB * 16 * 2 * 2 * 3
        with pytest.raises(ValueError, match="kv_factor"):
            describe(torch.zeros((8, 3, 3, TPB * 16), dtype=torch.bfloat16, device=dev)).trtllm_pool_geometry(TPB)
        with pytest.raises(ValueError, match="not 1 plane"):
            describe(t[:, :, :, :100]).trtllm_pool_geometry(TPB)


def test_stream_handles():
    from kvtier._tensors import stream_handle

    assert stream_handle(None) is None
    assert stream_handle(0) == 0

    class S:
        cuda_stream = 1234

    assert stream_handle(S()) == 1234
    with pytest.raises(TypeError):
        stream_handle("x")
