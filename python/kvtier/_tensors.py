"""Tensor descriptors: turn an engine's KV-cache tensor into a :class:`kvtier._native.TensorDesc`.

Accepted inputs, tried in this order:

* a ``TensorDesc`` (returned as is);
* a torch tensor, or anything torch-like: ``data_ptr()``, ``shape``, ``stride()`` (in elements),
  ``element_size()``, ``dtype`` and ``device`` (``.type`` "cpu" or "cuda", ``.index``);
* an object with ``__cuda_array_interface__`` (CuPy, Numba, ...), taken to live on CUDA device 0
  unless it has a ``device`` attribute with an ``index``;
* an object with ``__array_interface__`` (numpy arrays, memoryview-backed arrays).

The descriptor holds the object it describes (its ``owner``): a Worker registered over it keeps the
tensor referenced, so its memory stays allocated while kvtier copies into it (kvtier checks every
block's bytes against the described tensors; that the description matches the object is what
``describe`` guarantees). No tensor library is imported here.
"""

from __future__ import annotations

import sys
from typing import Any

from ._native import LayoutError, TensorDesc

__all__ = ["current_stream_handle", "describe", "stream_handle"]

# numpy-style type strings -> dtype names (kind, size).
_TYPESTR_NAMES = {
    ("f", 2): "float16",
    ("f", 4): "float32",
    ("f", 8): "float64",
    ("i", 1): "int8",
    ("i", 2): "int16",
    ("i", 4): "int32",
    ("i", 8): "int64",
    ("u", 1): "uint8",
    ("u", 2): "uint16",
    ("u", 4): "uint32",
    ("u", 8): "uint64",
    ("b", 1): "bool",
}


def _typestr_dtype(typestr: str) -> tuple[str, int]:
    if len(typestr) < 3:
        raise LayoutError(f"unsupported array typestr {typestr!r}")
    kind, size = typestr[1], int(typestr[2:])
    if typestr[0] == ">" and size > 1:
        raise LayoutError(f"big-endian arrays are not supported (typestr {typestr!r})")
    # Opaque element types (e.g. bfloat16 through ml_dtypes shows as 'V2') are still plain bytes.
    return _TYPESTR_NAMES.get((kind, size), f"{kind}{size}"), size


def _from_array_interface(iface: dict, device: str, device_index: int, owner: Any) -> TensorDesc:
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise LayoutError("array interface without a (pointer, read_only) data tuple is not supported")
    ptr, read_only = data
    if read_only:
        raise LayoutError("the KV-cache array is read-only; kvtier writes loaded blocks into it")
    shape = [int(d) for d in iface["shape"]]
    dtype, itemsize = _typestr_dtype(iface["typestr"])
    strides = iface.get("strides")
    if strides is None:
        strides = TensorDesc.contiguous_strides(shape, itemsize)
    return TensorDesc(int(ptr or 0), shape, [int(s) for s in strides], itemsize, dtype, device, device_index, owner)


def describe(obj: Any) -> TensorDesc:
    """Describe ``obj`` (see the module docstring). Raises ``TypeError`` for objects that are not
    tensors and :class:`kvtier.LayoutError` (a ``ValueError``) for tensors kvtier cannot use."""
    if isinstance(obj, TensorDesc):
        return obj
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "stride", None)):
        dev = getattr(obj, "device", None)
        kind = getattr(dev, "type", "cpu") if dev is not None else "cpu"
        if kind not in ("cpu", "cuda"):
            raise LayoutError(f"tensor on device {dev} is not supported (expected cpu or cuda)")
        index = getattr(dev, "index", None)
        if index is None:
            index = 0
            if kind == "cuda":
                import torch  # only reachable with a torch CUDA tensor

                index = torch.cuda.current_device()
        itemsize = int(obj.element_size())
        dtype = str(obj.dtype)
        if dtype.startswith("torch."):
            dtype = dtype[len("torch.") :]
        shape = [int(d) for d in obj.shape]
        strides = [int(s) * itemsize for s in obj.stride()]
        return TensorDesc(int(obj.data_ptr()), shape, strides, itemsize, dtype, kind, int(index), obj)
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        index = getattr(getattr(obj, "device", None), "index", None) or 0
        return _from_array_interface(iface, "cuda", int(index), obj)
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        return _from_array_interface(iface, "cpu", 0, obj)
    raise TypeError(
        f"{type(obj).__name__} is not a tensor: expected a torch tensor, a TensorDesc, or an object "
        "with __array_interface__ / __cuda_array_interface__"
    )


def stream_handle(stream: Any) -> int | None:
    """The raw CUDA stream handle of ``stream`` (a ``torch.cuda.Stream``, an int, or None).

    None means "no stream" (CPU engines): kvtier then orders transfers by the call sequence alone.
    The legacy default stream is handle 0, which is a valid stream, not None.
    """
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = getattr(stream, "handle", None)
    if handle is None:
        raise TypeError(f"{type(stream).__name__} is not a CUDA stream (no cuda_stream attribute)")
    return int(handle)


def current_stream_handle() -> int | None:
    """torch's current CUDA stream handle, or None where torch or CUDA is absent or not initialised (torch is not
    imported here: only a process that already did has one)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_stream().cuda_stream)
