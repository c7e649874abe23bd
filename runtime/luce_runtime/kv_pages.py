"""TVM's paged KV cache, opened to kernels of ours: each layer's page tensor and each sequence's page ids.

TVM 0.27's PagedKVCache owns its pages and hands them out in one place only: the `f_debug_get_kv` function it
was built with, which `vm.builtin.attention_kv_cache_debug_get_kv(cache, seq, start, end, k, v)` calls once per
layer with (that layer's pages, the positions' slots as page_id * page_size + offset, k, v, layer). The compiler
puts the global function KV_PAGES_PROBE in that slot (lower/relax_model.kv_pages_probe); this module registers
it, and it records what it is given instead of copying keys and values. So the megakernel decodes into the same
pages that prefill, per-op decode and verify use: one KV pool for every path (issue 11), no copies. DebugGetKV
refuses a cache whose first layer ids hold a sliding-window kind; a model with such layers (Gemma 3) is probed only
in the cache layout its megakernel build asks for (luce_compile/lower/kv_layers.py).

Page ids of a sequence only change when TVM allocates (a new page at a page boundary), forks (copy-on-write of a
shared last page) or pops; callers re-read them after those (Engine._mk_pages).
"""

from __future__ import annotations

import threading

import numpy as np
import tvm
import tvm_ffi

from luce_runtime.contract import KV_PAGES_PROBE
from luce_runtime.errors import LuceError


class _Capture:
    def __init__(self) -> None:
        self.layer_pages: dict[int, object] = {}
        self.positions: np.ndarray | None = None


_current = threading.local()


def _probe(pages, position_map, _k, _v, layer_id) -> None:  # noqa: ANN001  (TVM's f_debug_get_kv signature)
    capture = getattr(_current, "capture", None)
    if capture is None:  # a debug_get_kv call from elsewhere: there is nothing to copy into
        return
    capture.layer_pages[int(layer_id)] = pages
    if capture.positions is None:  # the same map comes with every layer
        capture.positions = position_map.numpy().copy()


tvm_ffi.register_global_func(KV_PAGES_PROBE, _probe, override=True)


class KVPages:
    """The page tensors and page ids of one engine's cache."""

    def __init__(self, cache: object, n_layers: int, kv_heads: int, head_dim: int, page_size: int,
                 max_context: int, dtype: str):
        self.cache, self.n_layers, self.page_size = cache, n_layers, page_size
        self._get = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_debug_get_kv")
        # debug_get_kv checks k and v against (layers, positions, kv heads, head dim); the probe never writes them,
        # so one host buffer of the largest shape (never touched, so never backed by memory) gives every view
        self._scratch = tvm.runtime.empty((n_layers, max_context + 1, kv_heads, head_dim), dtype, tvm.cpu())
        self._shape = (kv_heads, head_dim)
        self.layers: list | None = None  # each layer's page tensor (TVM's, fixed for the cache's life)
        self._kernel_args: tuple | None = None

    def slots(self, seq: int, start: int, end: int) -> np.ndarray:
        """page_id * page_size + offset of positions [start, end) of a sequence (end <= its length, counting
        tokens appended by a begun forward)."""
        view = self._scratch._create_view((self.n_layers, end - start, *self._shape), self._scratch.dtype, 0)
        capture = _Capture()
        _current.capture = capture
        try:
            self._get(self.cache, seq, start, end, view, view)
        finally:
            _current.capture = None
        if capture.positions is None or len(capture.layer_pages) != self.n_layers:
            raise LuceError("engine: the KV cache did not call the page probe; this artifact predates it: recompile "
                            "it with this luce-compile (`luce-compile compile MODEL --target T -o DIR --force`).")
        if self.layers is None:
            self.layers = [capture.layer_pages[i] for i in range(self.n_layers)]
        return capture.positions

    def page_ids(self, seq: int, length: int) -> list[int]:
        """The ids of the pages holding positions [0, length) of a sequence, in order."""
        return [int(s) // self.page_size for s in self.slots(seq, 0, length)[::self.page_size]]

    def layer_offsets(self) -> np.ndarray:
        """Each layer's pages, in elements from layer 0's start (int64; the allocations are separate)."""
        if self.layers is None:
            raise LuceError("engine: the KV pages are unknown until a sequence holds a token.")
        base = self.layers[0].data_ptr()
        size = np.dtype(str(self.layers[0].dtype)).itemsize
        offsets = [(t.data_ptr() - base) for t in self.layers]
        if any(o % 16 for o in offsets):  # the megakernel reads a key's row in 16-byte words
            raise LuceError("engine: the KV cache's layer pages are not 16-byte aligned to each other; build with "
                            "--no-megakernel.")
        return np.array([o // size for o in offsets], dtype=np.int64)

    def kernel_args(self, device) -> tuple:
        """(layer 0's pages flat, each layer's offset from it on the device): how a kernel of ours takes the pages
        of every layer (emit_cuda's `pages` and `kv_layer_offset`). Made once: the tensors never move."""
        if self._kernel_args is None:
            offsets = self.layer_offsets()  # refuses before any sequence holds a token
            first = self.layers[0]
            flat = first._create_view((int(np.prod(first.shape)),), first.dtype, 0)
            self._kernel_args = (flat, tvm.runtime.tensor(offsets, device))
        return self._kernel_args
