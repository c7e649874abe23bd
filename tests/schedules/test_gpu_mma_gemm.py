"""schedules/gpu/mma_gemm.py: the hand tensor-core prefill GEMM, structure only (no GPU here).

What is checked here: every weight type and tile generates CUDA with the instructions the design says (ldmatrix.x4
into mma.sync.m16n8k16, one barrier a step), each granule's words loaded once, and the signature of the float16
twin. The values are checked on the GPU machine against float64 numpy with the float16 operand rounding emulated
(scripts/device_check.py gemm --all; results in benchmarks/results/h200/*-gemm.md).
"""

from __future__ import annotations

import re

import pytest
import tvm
from luce_schedules.gpu import mma_gemm
from tvm.target import Target

from luce_compile.codegen.gpu_toolchain import cuda_source
from luce_compile.lower.quant_layout import SUPPORTED_TYPES
from luce_compile.lower.quant_matmul import quant_matmul

TARGET = Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                 "max_threads_per_block": 1024, "thread_warp_size": 32})
TYPES = [t.name for t in SUPPORTED_TYPES]


def _source(func) -> str:
    return cuda_source(tvm.IRModule({"main": func.with_attr("tirx.is_scheduled", True)}), TARGET)


def _kernel_body(source: str) -> str:
    return source[source.rindex("__global__"):]


@pytest.mark.unit
@pytest.mark.parametrize("qtype", TYPES)
def test_every_weight_type_generates_the_mma_kernel(qtype):
    tile_k = 32
    func = mma_gemm.mma_gemm(qtype, 1000, 512, tile_m=64, tile_n=64, tile_k=tile_k)
    twin = quant_matmul(qtype, 1000, 512, compute_dtype="float16")
    # the twin's signature: the same parameters in the same order, shapes and dtypes (the output's name aside)
    assert [(str(p.dtype), [str(d) for d in p.shape]) for p in func.params] == \
        [(str(p.dtype), [str(d) for d in p.shape]) for p in twin.params]
    assert [p.name for p in func.params][:-1] == [p.name for p in twin.params][:-1]
    body = _kernel_body(_source(func))
    assert "__launch_bounds__(256)" in body
    steps_unrolled = 2  # the loop's body and the last step after it
    k16_per_step = tile_k // 16
    frags = (64 // mma_gemm.WARPS_M // 16) * (64 // mma_gemm.WARPS_N // 8)
    assert body.count("tvm_builtin_ptx_mma_sync") == steps_unrolled * k16_per_step * frags
    ldmatrix_a, ldmatrix_b = 64 // mma_gemm.WARPS_M // 16, 64 // mma_gemm.WARPS_N // 16
    assert body.count("ldmatrix_sync_aligned_m8n8_x4") == steps_unrolled * k16_per_step * (ldmatrix_a + ldmatrix_b)
    assert body.count("__syncthreads()") == 2  # after the first step's stores, and once a step in the loop
    assert "int64_t" not in body.split("{", 1)[1]  # int32 indexing (the batch is converted once)


@pytest.mark.unit
def test_a_q4_1_granule_is_three_loads():
    """One 8-value granule of Q4_1: its quant word, d and m, each loaded once (WMMA's schedule gathered 12)."""
    body = _kernel_body(_source(mma_gemm.mma_gemm("Q4_1", 2048, 2048, tile_m=128, tile_n=128, tile_k=32)))
    granules = 128 * 32 // mma_gemm.GRANULE // mma_gemm.THREADS  # a thread's granules of W a step
    loop = body[body.index("for (int v"):]
    for plane in ("qs_ptr[", "d_ptr[", "m_ptr["):
        assert loop.count(plane) == granules, plane
    # x: two 16-byte loads per granule of 8 float32 values
    assert len(re.findall(r"\(uint4\*\)\(\(\(uint\*\)x_ptr\)", loop)) == 2 * granules


@pytest.mark.unit
@pytest.mark.parametrize("tile_m", mma_gemm.TILE_M)
@pytest.mark.parametrize("tile_n", mma_gemm.TILE_N)
@pytest.mark.parametrize("tile_k", mma_gemm.TILE_K)
def test_every_tile_of_the_space_builds(tile_m, tile_n, tile_k):
    body = _kernel_body(_source(mma_gemm.mma_gemm("Q4_K", 576, 1536, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k)))
    assert body.count("tvm_builtin_ptx_mma_sync") == 2 * (tile_k // 16) * (tile_m // 32) * (tile_n // 32)
    want = 2 * (tile_m + tile_n) * mma_gemm.row_words(tile_k) * 4  # two buffers of padded rows
    static = sum(int(n) for n in re.findall(r"__shared__ alignas\(\d+\) uint \w+\[(\d+)\]", body)) * 4
    if want <= mma_gemm.STATIC_SHARED:  # less the padding after each buffer's last row (never addressed)
        assert want - 2 * 16 <= static <= want
    else:  # above 48 KiB the buffers are dynamic shared memory (the launch opts in)
        assert static == 0 and "extern __shared__" in body


@pytest.mark.unit
def test_the_k_step_is_the_largest_that_divides_k():
    assert mma_gemm.step_for(1536, 128) == 128 and mma_gemm.step_for(576, 128) == 64  # 576 = 9 × 64
    assert mma_gemm.step_for(96, 128) == 32 and mma_gemm.step_for(48, 128) == 0
    body = _kernel_body(_source(mma_gemm.mma_gemm("Q8_0", 256, 576, tile_m=64, tile_n=64, tile_k=128)))
    assert body.count("tvm_builtin_ptx_mma_sync") == 2 * (64 // 16) * 2 * 2  # steps of 64: 4 k16 a step


@pytest.mark.unit
def test_default_tile_fills_the_gpu_where_it_can():
    assert mma_gemm.default_tile(8192, 132) == (128, 128, 128)  # 4 × 64 = 256 blocks at 512 rows
    assert mma_gemm.default_tile(2048, 132) == (64, 64, 128)  # 128 × 128 gives 64 blocks, 64 × 128 and 128 × 64 128
    assert mma_gemm.default_tile(512, 132) == (64, 64, 128)  # the k/v projection: nothing fills 132 SMs


@pytest.mark.unit
def test_k_that_fills_no_step_is_left_to_the_wmma_schedule():
    assert not mma_gemm.supports("BF16", 48) and mma_gemm.supports("BF16", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        mma_gemm.mma_gemm("BF16", 64, 48)
