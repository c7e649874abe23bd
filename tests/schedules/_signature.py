"""One check shared by the kernels that stand in for TVM's inside its PagedKVCache (GPU and CPU attention)."""

from __future__ import annotations


def assert_same_signature(ours, theirs) -> None:
    """Our PrimFunc takes TVM's arguments: the same names in order, buffers of the same dtype and rank, scalars of
    the same type, and a free element offset wherever TVM's has one."""
    assert [p.name for p in ours.params] == [p.name for p in theirs.params]
    for mine, their in zip(ours.params, theirs.params, strict=True):
        a, b = mine.ty, their.ty  # a buffer parameter's type is its buffer (TVM 0.27)
        if hasattr(b, "shape"):
            assert a.dtype == b.dtype and len(a.shape) == len(b.shape), their.name
            # the cache passes views into its aux arrays: a zero-offset declaration would reject them
            assert (str(a.elem_offset) == "0") == (str(b.elem_offset) == "0"), their.name
        else:
            assert str(a) == str(b), their.name
