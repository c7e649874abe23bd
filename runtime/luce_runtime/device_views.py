"""Weights as tensors that share memory instead of copying it.

`mapped_tensor`: on the CPU a weight is a view of the artifact's mapped weights.bin (llama.cpp's default mmap), not
a copy: loading costs no time and no memory of its own (gpt-oss-20b's 12 GB artifact took 41 s to load, 30 of them
in the kernel's 3.1 million page faults of the copies), the pages are read on first use and shared by every process
serving the same file, and the OS can drop them under memory pressure and read them again.

`layer_views`: one layer of a stacked device tensor as a tensor of its own, sharing the memory: the megakernel's
stacked weights (a leading layer axis) are also the per-op kernels' per-layer weights, so a GPU holds the weights
once, not twice.

TVM's own view (Tensor._create_view) records the offset in DLTensor.byte_offset, and every kernel TVM generates
refuses an argument whose byte_offset is not 0 ("Invalid a.byte_offset ... expected 0"). A DLPack export of the
stacked tensor whose data pointer is moved to the layer instead (shape and strides without the leading axis) is a
plain tensor to the kernels; its DLPack deleter keeps the stacked tensor alive for as long as the view lives. TVM
takes only 64-byte-aligned data (FromDLPack refuses the rest), so a layer whose bytes are not a multiple of 64 gets
no view (`layer_views` leaves it out: the caller copies it, as before).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import tvm

log = logging.getLogger(__name__)
ALIGNMENT = 64  # bytes: what TVM's FromDLPack requires of a tensor's data (its kAllocAlignment)


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):  # dlpack.h's DLTensor
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _ManagedTensor(ctypes.Structure):  # dlpack.h's DLManagedTensor (the unversioned capsule, "dltensor")
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _past_first(ptr):  # an int64 array pointer moved past its first element (the layer axis)
    return ctypes.cast(ctypes.addressof(ptr.contents) + 8, ctypes.POINTER(ctypes.c_int64))


def layer_bytes(stacked) -> int:
    """The bytes of one layer of a stacked tensor (everything but its leading axis)."""
    return int(np.prod(stacked.shape[1:], dtype=np.int64)) * np.dtype(str(stacked.dtype)).itemsize


def layer_view(stacked, layer: int):
    """stacked[layer] as a tensor of its own on the same memory (byte_offset 0), or None where its data would not
    be 64-byte aligned."""
    offset = layer * layer_bytes(stacked)
    if offset % ALIGNMENT or len(stacked.shape) < 2 or not 0 <= layer < stacked.shape[0]:
        return None
    capsule = stacked._to_dlpack()
    t = _ManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor
    if t.byte_offset:  # a view of a view: not what the engine stacks
        return None
    t.data = t.data + offset
    t.shape = _past_first(t.shape)  # the arrays the export owns, which live as long as the view
    if t.strides:
        t.strides = _past_first(t.strides)
    t.ndim -= 1
    return tvm.runtime.from_dlpack(capsule)


def layer_views(stacked, names) -> dict:
    """name → its layer's view for each of `names` (the stacked tensor's layers in order), or {} where any layer
    would be unaligned (the caller keeps its own copies)."""
    if layer_bytes(stacked) % ALIGNMENT:
        return {}
    try:
        views = {name: layer_view(stacked, i) for i, name in enumerate(names)}
    except (RuntimeError, ValueError, TypeError) as e:  # a DLPack export this TVM does not take back: copies
        log.warning("device views: no shared weights (%s); the per-op kernels keep their own copies", e)
        return {}
    return views if all(v is not None for v in views.values()) else {}


def mapped_tensor(array: np.ndarray, device):
    """A CPU tensor on `array`'s own memory (Artifact.weights' private map), or a copy where TVM will not take it
    as it is (data not 64-byte aligned, not contiguous) or `device` is not the CPU. The tensor keeps the array, and
    so the map, alive; the kernels only read their weights, so the map's pages stay the file's."""
    if str(device).startswith("cpu") and array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0:
        try:
            return tvm.runtime.from_dlpack(array)
        except (RuntimeError, ValueError, TypeError, BufferError) as e:  # a DLPack export this TVM does not take
            log.debug("device views: copying a weight (%s)", e)
    return tvm.runtime.tensor(np.ascontiguousarray(array), device)
