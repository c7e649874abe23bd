"""schedules/gpu/attention_prefill.py: the tensor-core ragged prefill kernel that replaces TVM's under precision f16.

Structure only here (no GPU): TVM's signature (the cache calls it positionally), tiles that fit static shared
memory, the CUDA it compiles to (WMMA, static shared memory, a handful of barriers a step), and the swap around the
cache's build. The numbers are checked on the H200: `scripts/device_check.py attention` against float64 on ragged
batches (benchmarks/results/h200/2026-12-01-attention.md), and whole models through device_check's oracle.
"""

from __future__ import annotations

import re

import pytest
from luce_schedules.gpu.attention_prefill import (
    PrefillTile,
    default_tile,
    pv_width,
    ragged_prefill,
    shared_bytes,
    supports,
)
from luce_schedules.gpu.tensor_gemm import DEFAULT_SHARED_BYTES
from tvm import IRModule
from tvm.relax.frontend.nn.llm import _prefill_kernels, kv_cache
from tvm.target import Target

from luce_compile.codegen.gpu_toolchain import cuda_source
from luce_compile.lower.relax_model import tensor_core_prefill_attention
from tests.schedules._signature import assert_same_signature

CUDA = Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024, "thread_warp_size": 32})


@pytest.mark.unit
@pytest.mark.parametrize("d,want", [(64, (4, 64)), (128, (4, 32)), (256, (2, 32))])
def test_the_largest_tile_that_fits_static_shared_memory(d, want):
    tile = default_tile(d, d)
    assert (tile.warps, tile.keys) == want
    assert shared_bytes(tile, d, d) <= DEFAULT_SHARED_BYTES
    assert shared_bytes(PrefillTile(4, 64), 128, 128) > DEFAULT_SHARED_BYTES


@pytest.mark.unit
@pytest.mark.parametrize("d,width", [(64, 64), (128, 64), (256, 64), (96, 48), (80, 16), (48, 48)])
def test_pv_passes_cover_every_column(d, width):
    tile = default_tile(d, d)
    assert pv_width(tile.keys, d) == width and d % width == 0


@pytest.mark.unit
def test_head_dims_without_a_tile_are_left_to_tvm():
    assert not supports(72, 72, "float32")  # not a multiple of 16
    assert not supports(576, 512, "float32") and not supports(320, 320, "float32")  # O would not fit registers
    assert supports(96, 96, "float32") and not supports(64, 64, "bfloat16")


@pytest.mark.unit
def test_signature_is_tvms():
    ours = ragged_prefill(8, 32, 64, 64, "float32", tile=default_tile(64, 64), sm_count=132)
    theirs = _prefill_kernels._attention_prefill_ragged(8, 32, 64, 64, "float32", {}, CUDA)
    assert_same_signature(ours, theirs)


@pytest.mark.unit
@pytest.mark.parametrize("h_kv,h_q,d", [(3, 9, 64), (8, 16, 128), (1, 4, 256)])
def test_cuda_uses_wmma_static_shared_memory_and_few_barriers(h_kv, h_q, d):
    tile = default_tile(d, d)
    func = ragged_prefill(h_kv, h_q, d, d, "float32", tile=tile, sm_count=132)
    src = cuda_source(IRModule({"batch_prefill_ragged_kv": func}), CUDA)
    assert "nvcuda::wmma::mma_sync" in src and "wmma::col_major" in src  # Kᵀ read as a column-major B
    # dynamic shared memory would make TVM's sync planner put a barrier between any two accesses
    assert "extern __shared__" not in src
    static = sum(int(n) * (2 if t == "half" else 4)
                 for t, n in re.findall(r"__shared__ alignas\(\d+\) (half|float) \w+\[(\d+)\];", src))
    assert static == shared_bytes(tile, d, d) <= DEFAULT_SHARED_BYTES
    # the planner's barriers, each one written in the kernel: two a Q chunk, four a key step and two a P·V pass, one
    # after the tile (7 at head dim 64, 11 at 128, 13 at 256); a barrier in a per-element loop would add thousands
    chunks, passes = -(-tile.rows // tile.keys), d // pv_width(tile.keys, d)
    assert src.count("__syncthreads()") == 2 * chunks - 1 + 3 + 2 * passes + 1


@pytest.mark.unit
def test_swapped_only_for_cuda_f16_and_restored():
    original = kv_cache._attention_prefill_ragged
    with tensor_core_prefill_attention(CUDA, "f16", "wmma"):
        func = kv_cache._attention_prefill_ragged(8, 32, 64, 64, "float32", {}, CUDA)
        assert kv_cache._attention_prefill_ragged is not original
        assert "wmma.matrix_a" in func.script()
        # a head dim WMMA cannot tile keeps TVM's kernel
        assert "wmma" not in kv_cache._attention_prefill_ragged(2, 2, 72, 72, "float32", {}, CUDA).script()
    assert kv_cache._attention_prefill_ragged is original
    for target, precision in ((CUDA, "f32"), (Target("llvm"), "f16")):
        with tensor_core_prefill_attention(target, precision):
            assert kv_cache._attention_prefill_ragged is original
