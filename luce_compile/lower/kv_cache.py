"""The KV cache's element type (`compile --kv-cache`), as the lowering gives it to TVM's PagedKVCache.

"auto" (the default) is f16 in a GPU's fast build (precision f16, its default), as llama.cpp's default -ctk/-ctv;
f32 in the exact build (--precision f32: its checks hold to 1e-3 of the oracle) and on the CPU, whose attention
kernels widen every float16 load (not measured faster there: benchmarks/README.md, long context on the CPU). "f32"
is the cache in the activations' float32. "f16" halves a token's bytes: queries, keys and values are rounded to
float16 on their way into the cache's attention, its output widened back to float32 (relax_model._attention); on the
CPU the attention kernels widen each float16 load and sum in float32 (schedules/cpu/attention_*.py), and the oracle
emulates the rounding (graph/kv_rounding.round_kv). llama.cpp's q8_0 and q4_0 (KV_CACHE_BLOCK_TYPES) need a page
layout with per-block scales: TVM 0.27's PagedKVCache allocates each layer's pages as one (pages, 2, kv heads, page
size, head dim) tensor whose dtype must also be that of the queries and of the attention output (paged_kv_cache.cc
checks qkv.dtype == o.dtype == pages.dtype), so they need a cache layout of their own, not a dtype.
"""

from __future__ import annotations

from luce_compile.errors import UnsupportedError

KV_CACHE_DTYPES = {"f32": "float32", "f16": "float16"}  # --kv-cache → the pages' dtype
KV_CACHE_BLOCK_TYPES = ("q8_0", "q4_0")  # llama.cpp's, refused with the reason (module docstring)
KV_CACHE_TYPES = ("auto", *KV_CACHE_DTYPES, *KV_CACHE_BLOCK_TYPES)
GPU_KV_CACHE = "f16"  # auto's choice in a GPU's fast build: at depth the attention reads the cache, half of f32's


def resolve_kv_cache(kv_cache: str, fast_gpu: bool) -> str:
    """--kv-cache as built: "auto" is f16 in a GPU's fast build (precision f16) and f32 elsewhere (the CPU, and the
    exact build, --precision f32, whose checks hold to 1e-3 of the float64 oracle); any other type as given."""
    return (GPU_KV_CACHE if fast_gpu else "f32") if kv_cache == "auto" else kv_cache


def kv_cache_dtype(kv_cache: str) -> str:
    """The pages' dtype for --kv-cache, refused with the reason for llama.cpp's block types (not built yet)."""
    if kv_cache in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache]
    if kv_cache in KV_CACHE_BLOCK_TYPES:
        raise NotImplementedError(
            f"lower: --kv-cache {kv_cache} is not built yet: TVM 0.27's PagedKVCache allocates each layer's pages as "
            "one (pages, 2, kv heads, page size, head dim) tensor of the queries' own dtype, so a block type's "
            "per-32-value scales have no place in it; use --kv-cache f16 (half of f32's bytes).")
    raise UnsupportedError(f"lower: --kv-cache {kv_cache!r} is not a KV cache type; use one of "
                           f"{', '.join(KV_CACHE_TYPES)}.")
