"""device_views: a layer of a stacked tensor as a tensor of its own on the same memory, which TVM's generated
kernels accept as an argument (its byte_offset is 0), alive after the stacked tensor's last Python reference is
gone; an unaligned layer gets no view. Checked on the CPU device, where the same DLPack export applies."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import tvm
from luce_runtime.artifact import load_artifact
from luce_runtime.device_views import layer_view, layer_views, mapped_tensor
from tvm.script import tirx as T


@pytest.fixture(scope="module")
def plus_one():
    @T.prim_func
    def plus_one(a: T.Buffer((8, 16), "float32"), b: T.Buffer((8, 16), "float32")):
        for i, j in T.grid(8, 16):
            b[i, j] = a[i, j] + T.float32(1)

    return tvm.compile(plus_one, target="llvm")


def test_a_layer_view_is_the_layer_and_shares_its_memory(plus_one):
    rng = np.random.default_rng()
    host = rng.standard_normal((5, 8, 16)).astype(np.float32)
    stacked = tvm.runtime.tensor(host)
    views = layer_views(stacked, [f"w{i}" for i in range(5)])
    assert list(views) == [f"w{i}" for i in range(5)]
    out = tvm.runtime.tensor(np.zeros((8, 16), np.float32))
    for i, view in enumerate(views.values()):
        assert view.shape == (8, 16) and str(view.dtype) == "float32"
        plus_one(view, out)  # a generated kernel takes it (TVM's own _create_view is refused: byte_offset)
        np.testing.assert_array_equal(out.numpy(), host[i] + 1)
    changed = rng.standard_normal((5, 8, 16)).astype(np.float32)
    stacked.copyfrom(changed)  # the views see the stacked tensor's new values: no copy was made
    del stacked
    gc.collect()  # the views keep the memory alive
    for i, view in enumerate(views.values()):
        np.testing.assert_array_equal(view.numpy(), changed[i])


def test_unaligned_layers_get_no_view():
    stacked = tvm.runtime.tensor(np.arange(4 * 5, dtype=np.float32).reshape(4, 5))  # 20 bytes a layer
    assert layer_view(stacked, 0) is not None  # offset 0 is aligned
    assert layer_view(stacked, 1) is None
    assert layer_views(stacked, ["a", "b", "c", "d"]) == {}  # all or none: the caller copies the weight
    assert layer_view(stacked, 4) is None  # past the last layer


def test_mapped_tensor_is_the_artifacts_map_not_a_copy(tmp_path, plus_one):
    """A CPU weight is a tensor on the artifact's mapped weights.bin: same address, the file's bytes, taken by a
    generated kernel, alive after the artifact drops its map; an unaligned array or another device gets a copy."""
    from tests.artifact._build import make_artifact

    artifact = load_artifact(make_artifact(tmp_path), expect_target="cpu")
    weights = artifact.weights()
    for name, array in weights.items():
        tensor = mapped_tensor(array, tvm.cpu())
        np.testing.assert_array_equal(tensor.numpy(), array, err_msg=name)
        assert _data_pointer(tensor) == array.ctypes.data, name  # no copy
    host = np.zeros(8 * 16 + 17, np.float32)
    start = (-host.ctypes.data % 64) // 4 + 1  # one float past a 64-byte boundary
    unaligned = host[start : start + 8 * 16].reshape(8, 16)
    assert _data_pointer(mapped_tensor(unaligned, tvm.cpu())) != unaligned.ctypes.data
    square = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    kept = {"w": mapped_tensor(square, tvm.cpu())}
    del square
    gc.collect()
    out = tvm.runtime.tensor(np.zeros((8, 16), np.float32))
    plus_one(kept["w"], out)
    np.testing.assert_array_equal(out.numpy(), np.arange(8 * 16, dtype=np.float32).reshape(8, 16) + 1)
    first = next(iter(weights.values()))
    tensor = mapped_tensor(first, tvm.cpu())
    want = first.copy()
    del weights, first
    artifact.close()
    gc.collect()
    np.testing.assert_array_equal(tensor.numpy(), want)  # the tensor holds the map open


def _data_pointer(tensor) -> int:
    return np.from_dlpack(tensor).ctypes.data
