"""schedules/gpu/quant_gemm.py: a symbolic batch branches at run time between low-batch GEMVs and the tiled matmul.

Structure only here (no GPU): which schedule each batch range gets, and that every branch is a complete GPU
schedule. The numbers are checked on the GPU machine (scripts/device_check.py: 2, 5 and 8 sequences decoded together
equal each alone; the oracle through prefill), and every GPU build of tests/codegen compiles the dispatch for real.
"""

from __future__ import annotations

import re

import pytest
from luce_schedules.gpu.quant_gemm import LOW_BATCH, Dispatched, QuantGEMM
from luce_schedules.gpu.tensor_gemm import TensorCoreGEMM, accumulator_scope
from tvm import s_tir, tirx
from tvm.target import Target

from luce_compile.lower.q8_gemm import q8_gemm_matmul
from luce_compile.lower.quant_matmul import TENSOR_CORE_TWIN, quant_matmul, with_tensor_core_twin

TARGET = Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                 "max_threads_per_block": 1024, "thread_warp_size": 32})


def _branches(func: tirx.PrimFunc) -> list[tuple[int, str]]:
    """(batch limit, the branch's script) for each run-time test of the batch, outermost first, and the final else.
    TVMScript is the readable walk of the IR here: TVM 0.27's Python API has no statement visitor."""
    text = func.script()
    heads = list(re.finditer(r"if T\.tvm_thread_invariant\((\w+) <= T\.int64\((\d+)\)\):", text))
    cuts = [m.start() for m in heads] + [len(text)]
    return [(int(m.group(2)), text[m.end():cuts[i + 1]]) for i, m in enumerate(heads)]


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "BF16"])
def test_symbolic_batch_dispatches_on_the_batch(qtype):
    func = quant_matmul(qtype, 256, 512)
    out = QuantGEMM().apply(func, TARGET)
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], Dispatched)
    scheduled = out[0].mod["main"]
    assert int(scheduled.attrs["tirx.HoistIfThenElseExprWithBlock"]) == 1
    branches = _branches(scheduled)
    # outermost first: batch ≤ 2, then ≤ 8, then the tiled matmul
    assert [limit for limit, _ in branches] == [limit for limit, _ in LOW_BATCH]
    for _, text in branches:  # each branch is a whole GPU schedule: bound to blocks and threads
        assert 'thread="blockIdx.x"' in text and 'thread="threadIdx.x"' in text
    assert "shared" in branches[-1][1].split("else:")[-1]  # Matmul stages its tiles in shared memory
    # the params are func's own: every branch reads and writes the caller's buffers
    assert list(scheduled.params) == list(func.params)


@pytest.mark.unit
@pytest.mark.parametrize("batch", [2, 64])
def test_static_batch_keeps_the_tiled_matmul(batch):
    out = QuantGEMM().apply(quant_matmul("Q4_1", 256, 512, batch=batch), TARGET)
    assert isinstance(out, s_tir.Schedule)
    text = out.mod["main"].script()
    assert "tvm_thread_invariant" not in text and 'scope="shared' in text


@pytest.mark.unit
def test_batch_one_is_left_to_the_gemv_rule():
    assert QuantGEMM().apply(quant_matmul("Q4_1", 256, 512, batch=1), TARGET) is None


# ---- tensor cores (precision f16): the float16 twin above the low-batch buckets --------------------------------------
def _cuda_source(func: tirx.PrimFunc) -> str:
    """The CUDA TVM generates (captured before any compiler: the tests need no nvcc or NVRTC)."""
    import tvm

    from luce_compile.codegen.gpu_toolchain import cuda_source

    return cuda_source(tvm.IRModule({"main": func.with_attr("tirx.is_scheduled", True)}), TARGET)


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_1", "BF16"])
@pytest.mark.parametrize("kernel", [1, 0])
def test_twin_runs_on_tensor_cores_above_the_buckets(qtype, kernel):
    func = with_tensor_core_twin(quant_matmul(qtype, 256, 512), qtype, 256, 512)
    (out,) = QuantGEMM().apply(func, TARGET, {"kernel": kernel})
    scheduled = out.mod["main"]
    assert TENSOR_CORE_TWIN not in scheduled.attrs  # the twin is consumed: nothing downstream sees it
    assert list(scheduled.params) == list(func.params)  # the twin's body was rebound to func's own buffers
    branches = _branches(scheduled)
    assert [limit for limit, _ in branches] == [limit for limit, _ in LOW_BATCH]
    low, above = branches[-1][1].split("else:", 1)
    low_text = "".join(text for _, text in branches[:-1]) + low
    assert "wmma" not in low_text and "T.ptx" not in low_text  # the buckets stay float32 SIMT
    source = _cuda_source(scheduled)
    if kernel == 1:  # the hand kernel (mma_gemm.py): ldmatrix + mma.sync from padded shared rows
        assert "T.ptx.mma(" in above and "T.ptx.ldmatrix(" in above
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source and "nvcuda::wmma" not in source
    else:  # dlight's WMMA tile, the baseline
        assert "wmma.matrix_a" in above and "x_half" in above
        assert "nvcuda::wmma::mma_sync" in source
    kernels = re.findall(r"__global__[^;{]*\{", source)  # definitions (each is declared first too)
    assert len(kernels) == len(LOW_BATCH) + 1  # one kernel per branch, chosen on the host


@pytest.mark.unit
def test_a_tuned_tile_runs_up_to_twice_its_measured_rows_the_default_above():
    func = with_tensor_core_twin(quant_matmul("Q4_1", 256, 512), "Q4_1", 256, 512)
    tuned = {"kernel": 1, "tile_m": 32, "tile_n": 64}
    (out,) = QuantGEMM().apply_measured(func, TARGET, tuned, {"batch": 512})
    branches = _branches(out.mod["main"])
    assert [limit for limit, _ in branches] == [limit for limit, _ in LOW_BATCH] + [2 * 512]
    tuned_text, default_text = branches[-1][1].split("else:", 1)
    # the tuned tile (32 rows a block) below the limit, the default (64 × 64 for 256 features) above it
    assert "+ 31) // 32" in tuned_text and "+ 63) // 64" not in tuned_text
    assert "+ 63) // 64" in default_text and "+ 31) // 32" not in default_text
    # the rule's own defaults as a record, or a record measured nowhere: one tensor-core branch, as before
    for knobs, measured in ((QuantGEMM().knobs(), {"batch": 512}), (tuned, {})):
        (out,) = QuantGEMM().apply_measured(func, TARGET, knobs, measured)
        assert [limit for limit, _ in _branches(out.mod["main"])] == [limit for limit, _ in LOW_BATCH]


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_q8_function_runs_the_8_bit_kernel_above_the_buckets(qtype):
    """--prefill-gemm q8 (lower/q8_gemm.py): above the buckets the quantizer then mmq_gemm.py's integer mma.sync
    kernel, on the function's own parameters (its scratch included); the buckets stay float32 SIMT. Its arithmetic
    is the build's, not a tuning candidate's: knob kernel 0 (WMMA, float16 operands) is refused as invalid."""
    func = q8_gemm_matmul(qtype, 256, 512, name=f"gemm_{qtype.lower()}_256x512")
    (out,) = QuantGEMM().apply(func, TARGET)
    scheduled = out.mod["main"]
    assert list(scheduled.params) == list(func.params) and "xq" in [p.name for p in func.params]
    branches = _branches(scheduled)
    assert [limit for limit, _ in branches] == [limit for limit, _ in LOW_BATCH]
    low, above = branches[-1][1].split("else:", 1)
    assert "T.ptx" not in "".join(text for _, text in branches[:-1]) + low
    source = _cuda_source(scheduled)
    assert "mma_int_sync_aligned_m16n8k" in source and "m16n8k16_row_col_f32_f16" not in source
    kernels = re.findall(r"__global__[^;{]*\{", source)
    assert len(kernels) == len(LOW_BATCH) + 2  # the buckets', the quantizer, the GEMM
    tuned = QuantGEMM().apply(func, TARGET, {"kernel": 1, "tile_m": 32, "tile_n": 64, "tile_k": 64})
    assert "+ 31) // 32" in _branches(tuned[0].mod["main"])[-1][1].split("else:", 1)[1]
    with pytest.raises(ValueError, match="q8"):
        QuantGEMM().apply(func, TARGET, {"kernel": 0})


@pytest.mark.unit
def test_without_a_twin_the_simt_matmul_stays():
    (out,) = QuantGEMM().apply(quant_matmul("Q4_1", 256, 512), TARGET)
    assert "wmma" not in out.mod["main"].script()


@pytest.mark.unit
@pytest.mark.parametrize("knobs", [
    {},  # dlight's tile: 128×128×64, 16 warps
    {"warps_m": 2, "warps_n": 2, "k_frags": 2},  # accumulators in static shared memory (tensor_gemm: merge bug)
    {"warps_m": 1, "warps_n": 4, "frags_m": 4, "frags_n": 1, "k_frags": 2, "vector": 2},
])
def test_tensor_core_tiles_build(knobs):
    """Tiles of the search space compile to CUDA (a tile the build refuses would cost a tuning trial, not a crash:
    these are the shapes that once failed). The rows are padded to the tile, so any batch is taken."""
    twin = quant_matmul("Q4_K", 576, 1536, compute_dtype="float16")
    sch = TensorCoreGEMM().apply(twin, TARGET, knobs)
    assert sch is not None
    source = _cuda_source(sch.mod["main"])
    tile = TensorCoreGEMM().knobs(knobs)
    assert "nvcuda::wmma::mma_sync" in source
    assert f"__launch_bounds__({32 * tile['warps_m'] * tile['warps_n']})" in source


@pytest.mark.unit
def test_tiles_that_cannot_launch_are_refused():
    """A 256×256 tile needs 266 KiB of shared memory for its float32 output alone: refused (not my function),
    so a tuning trial records it as invalid instead of failing to launch on the GPU."""
    twin = quant_matmul("Q4_1", 576, 1536, compute_dtype="float16")
    big = {"warps_m": 4, "warps_n": 4, "frags_m": 4, "frags_n": 4}
    assert TensorCoreGEMM().apply(twin, TARGET, big) is None
    assert accumulator_scope(32, 32, 32) == "shared"  # both tiles fit the 48 KiB a launch gets without opting in
    assert accumulator_scope(128, 128, 64) == "shared.dyn"  # 67 KiB of accumulators: static memory cannot hold them
    assert accumulator_scope(128, 64, 64) == "shared"  # a 55 KiB dynamic part opts the launch in: 35 KiB static fits
    assert accumulator_scope(64, 128, 32) == "shared.dyn"  # 31 + 34 KiB: over 48 KiB with no opt-in


@pytest.mark.unit
def test_tensor_core_rule_takes_only_the_float16_form():
    assert TensorCoreGEMM().apply(quant_matmul("Q4_1", 256, 512), TARGET) is None  # float32 operands
    rocm = Target({"kind": "rocm", "mcpu": "gfx1201", "max_threads_per_block": 256})
    assert TensorCoreGEMM().apply(quant_matmul("Q4_1", 256, 512, compute_dtype="float16"), rocm) is None
