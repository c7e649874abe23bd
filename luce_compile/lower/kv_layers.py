"""The layers of TVM's PagedKVCache for a model with sliding-window layers (Gemma 3, gpt-oss), and what TVM 0.27 does
with them (read in src/runtime/vm/paged_kv_cache.cc and relax/frontend/nn/llm/*.py of the 0.27 wheel, which carries
apache/tvm#20121; checked on the CPU build of tiny-gemma3).

The lowering gives the cache one attention kind per layer, "mha" or "mha_sliding", and the window
(`layer_sliding_window_size`). With any "mha_sliding" layer:
  - There is no ring of pages. The cache forces its sequence-level sliding window off (`support_sliding_window_` is
    false whatever create_kv_cache's `support_sliding_window` says), so SlideWindowForSequence never frees a page:
    every page of every sequence stays, as the global layers need anyway. The pool's size is what it would be
    without windows (the engine sizes it for whole contexts).
  - A sliding layer reads a suffix of the sequence's pages: the last ceil((offset + min(L, W)) / P) of them, with
    length_info (3, B) = (last page's length, offset = (L - W) mod P once L > W else 0, sink 0), so its kernels
    see exactly the window's min(L, W) keys. A global layer reads every page with length_info (B,).
  - The decode kernel windows only through that page table (it takes no window). The paged prefill kernel (a
    chunk's queries against the cached keys) also masks each query row to its own window
    (_causal_or_sliding_cross_mask, fixed by #20121 on CUDA; the CPU one is wrong, luce_schedules' replaces it).
    The ragged kernel (a chunk's queries against the chunk's own keys) applies no window: a prefill chunk may be
    at most W long (Engine.chunk_limit). The tree-attention kernels declare length_info (B,): no token trees on a
    sliding layer.
  - attention_kv_cache_enable_sliding_window_for_seq then only records the window on the sequence: its one effect
    is that ForkSequence refuses a fork past the sequence's attention sinks (0). PopN works at any depth (a rollback
    past the window was checked against the oracle on the CPU). A fork would be wrong anyway: a sliding layer's
    window is cut per block of the fork tree (each depth's suffix), so a forked child attends to too many keys.
  - DebugGetKV, the one door through which TVM hands out its page tensors and a sequence's slots (the runtime's
    page probe, luce_runtime/kv_pages.py), refuses a cache whose layer ids 0..n-1 hold an "mha_sliding" kind ("Only
    MHA is supported for DebugGetKV"). It indexes the kinds by the layer's id within the cache's layer partition,
    where attention indexes them by partition offset + id.

`cache_layers(probe=True)` lays the cache out so that the probe reads such a model: a list of 2n kinds, n "mha"
then the model's n kinds, with the model's layers as the partition [n, 2n). Attention on layer l calls the cache's
layer n + l and gets its real kind; DebugGetKV checks kinds 0..n-1 ("mha") and hands out pages_[0..n-1], the
model's layers in order. Pages are allocated for the partition's n layers only: no memory cost. If TVM ever indexes
DebugGetKV's check by the partition as attention does, the probe raises (never a silent misread).
"""

from __future__ import annotations

from dataclasses import dataclass

from luce_compile.gguf.config import ModelConfig


@dataclass(frozen=True)
class CacheLayers:
    kinds: tuple[str, ...]  # the cache's attention kind of every layer id, the partition's padding included
    first: int  # the cache's layer id of the model's layer 0 (the partition is [first, first + n_layer))


def cache_layers(config: ModelConfig, probe: bool = False) -> CacheLayers:
    """The cache's layers for a model: its own kinds at ids 0..n-1, or with `probe` and a sliding layer the layout
    that lets the runtime's page probe read it (module docstring)."""
    kinds = tuple("mha_sliding" if s else "mha" for s in (config.sliding or (False,) * config.n_layer))
    if not probe or "mha_sliding" not in kinds:
        return CacheLayers(kinds, 0)
    return CacheLayers(("mha",) * config.n_layer + kinds, config.n_layer)
