"""schedules/gpu/moe.py: the expert sort and the gathered expert GEMV for GPUs.

Here (no GPU): both compile to device code for CUDA (the sort for ROCm too), the sort as one block of a thread per
expert, the GEMV with the rows' experts and tokens read through the gather. On a CUDA GPU the same kernels run
against numpy: the sort against a stable argsort (the CPU sort's order), the GEMV against gguf-py's dequantized
weights in float64; the whole model is checked there by scripts/device_check.py on tiny-qwen3moe.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gguf import GGMLQuantizationType
from luce_schedules.gpu.moe import SORT_TILE, ExpertGEMV, expert_sort
from tvm.target import Target

from luce_compile.codegen.device_binaries import device_sources
from luce_compile.codegen.gpu_toolchain import gpu_toolchain
from luce_compile.lower.moe import expert_matmul
from luce_compile.lower.quant_matmul import quant_matmul
from luce_compile.targets import get_target
from tests.codegen.test_gpu_device import cuda_device_count

CUDA = get_target("sm_90").tvm_target()
ROCM = get_target("gfx1201").tvm_target()
T = GGMLQuantizationType
on_gpu = pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU")


def _source(func, target: Target) -> str:
    info = get_target("sm_90" if target.kind.name == "cuda" else "gfx1201")
    with gpu_toolchain(info.kind, info.archs or (info.name,), info.name), target:
        ex = tvm.compile(tvm.IRModule({"main": func}), target=target)
    ((_, source),) = device_sources(ex)
    return source


@pytest.mark.unit
@pytest.mark.parametrize("n_expert", [8, 96, 128])
def test_sort_is_one_block_of_a_thread_per_expert(n_expert):
    source = _source(expert_sort(n_expert, 8, "moe_sort"), CUDA)
    threads = -(-n_expert // 32) * 32
    assert f"__launch_bounds__({threads})" in source
    assert "atomic" not in source  # the order is the CPU sort's: each expert's thread places its own rows
    assert source.count("__syncthreads()") == 5  # a tile in, a tile read, twice; the counts before the starts


@pytest.mark.unit
def test_sort_refuses_more_experts_than_a_block_has_threads():
    with pytest.raises(ValueError, match="1024 threads"):
        expert_sort(1025, 8, "moe_sort")


@pytest.mark.unit
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4, T.IQ4_XS])
@pytest.mark.parametrize("gather", [True, False])
def test_expert_matmul_is_the_gathered_gemv(qtype, gather):
    func = expert_matmul(qtype, 8, 64, 256, gather, "em")
    with CUDA:
        sch = ExpertGEMV().apply(func, CUDA)
    assert sch is not None
    source = _source(sch.mod["main"], CUDA)
    assert "experts_ptr[" in source and ("tokens_ptr[" in source) == gather
    assert "__shfl" in source  # a warp's lanes share a row's K, summed by shuffles


@pytest.mark.unit
def test_expert_gemv_takes_only_expert_matmuls():
    assert ExpertGEMV().apply(quant_matmul("Q4_K", 64, 256, batch=1), CUDA) is None
    func = expert_matmul(T.Q4_K, 8, 64, 256, True, "em")
    assert ExpertGEMV().apply(func, Target("llvm")) is None  # the CPU's is schedules/cpu/moe.py


@pytest.mark.unit
def test_rocm_builds_the_sort_and_leaves_the_gemv_to_dlight():
    assert "moe_sort" in _source(expert_sort(32, 4, "moe_sort"), ROCM)
    with ROCM:  # the warp sum over int64 rows fails LLVM's verifier there (schedules/gpu/moe.py)
        assert ExpertGEMV().apply(expert_matmul(T.Q4_K, 8, 64, 256, True, "em"), ROCM) is None


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("rows", [6, 64, 3 * SORT_TILE + 5])
def test_sort_on_the_gpu_equals_a_stable_sort(rows):
    n_expert, used = 96, 8
    rng = np.random.default_rng(rows)
    ids = rng.integers(0, n_expert, rows, dtype=np.int32)
    dev = tvm.cuda(0)
    with gpu_toolchain("cuda", ("sm_90",), "sm_90"), CUDA:
        lib = tvm.compile(tvm.IRModule({"main": expert_sort(n_expert, used, "moe_sort")}), target=CUDA)
    outs = [tvm.runtime.tensor(np.zeros(rows, np.int32), dev) for _ in range(3)]
    lib["main"](tvm.runtime.tensor(ids, dev), *outs)
    experts, tokens, inverse = (o.numpy() for o in outs)
    order = np.argsort(ids, kind="stable")
    np.testing.assert_array_equal(experts, ids[order])
    np.testing.assert_array_equal(tokens, order // used)
    np.testing.assert_array_equal(inverse[order], np.arange(rows))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0])
def test_expert_gemv_on_the_gpu_equals_the_dequantized_rows(qtype):
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from luce_compile.lower.quant_layout import repack

    n_expert, n_out, n_in, tokens, used = 4, 64, 256, 5, 2
    rng = np.random.default_rng(7)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_expert * n_out, n_in // block * size), dtype=np.uint8)
    scales = 4 if qtype == T.Q4_K else 2  # the blocks' leading f16 scales finite and small
    raw.reshape(n_expert * n_out, -1, size)[..., :scales] = np.tile(
        np.frombuffer(np.float16(0.01).tobytes(), np.uint8), scales // 2)
    w = dequantize(raw, qtype).astype(np.float64).reshape(n_expert, n_out, n_in)
    experts = np.sort(rng.integers(0, n_expert, tokens * used)).astype(np.int32)
    rows = rng.integers(0, tokens, tokens * used).astype(np.int32)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)
    func = expert_matmul(qtype, n_expert, n_out, n_in, True, "em")
    with CUDA:
        sch = ExpertGEMV().apply(func, CUDA)
    with gpu_toolchain("cuda", ("sm_90",), "sm_90"), CUDA:
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    dev = tvm.cuda(0)
    args = [x, experts, rows, *repack(raw, qtype).values(), np.zeros((tokens * used, n_out), np.float32)]
    args = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*args)
    want = np.einsum("pk,pnk->pn", x[rows].astype(np.float64), w[experts])
    np.testing.assert_allclose(args[-1].numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
