"""GPU tensor-core schedule for the half-precision fused dequantize + matmul (lower/quant_matmul.py with
compute_dtype="float16"): prefill, verify and batches above the low-batch buckets.

The function has three blocks: "x_half" (x cast to float16), "dequantize" (W to float16) and "matmul" (float32
sums of float16 products). The schedule is dlight's MatmulTensorization (s_tir/dlight/gpu/matmul.py) with its
fixed choices turned into knobs, because its one tile (128×128×64, 16 warps) is a poor fit for narrow models: a
576-wide SmolLM2 projection at 512 tokens makes 4×5 = 20 blocks for 132 SMs.
- the output is tiled in blocks of (warps_m·frags_m·16) × (warps_n·frags_n·16), each warp owning frags_m × frags_n
  WMMA 16×16 accumulators (float32);
- k advances k_frags·16 at a time: each step stages a tile of x (cast on the way) and of W (dequantized on the
  way: the only copy of W in half precision is that shared-memory tile) in dynamic shared memory, two steps in
  flight (software pipeline), then every warp runs its WMMA products from shared memory;
- the rows (the symbolic batch) are padded up to the tile; the padded rows are computed and never stored.

Precision: x and the dequantized W are rounded to float16 (11-bit significands) before float32 accumulation, the
rounding cuBLAS-based and MMQ-less llama.cpp prefill also has. The error this adds is the rounding of two
operands, ≈ 2⁻¹¹ relative per product, averaged over k. scripts/device_check.py holds these kernels to 1e-5 of
float64 numpy with exactly that rounding emulated (`gemm`: 1.2e-5 at most on the H200, k = 8192) and whole models to
1e-2 of an oracle that emulates it (REL_TOL_F16 says why no tighter bound holds for a model); `--precision f32`
keeps the float32 SIMT GEMM and the tight model checks.
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.gpu.base import GPURule, max_threads, warp_size
from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (
    auto_inline_consumer_chain,
    auto_inline_producers,
    get_index_map,
    get_reduction_blocks,
)
from tvm.target import Target

from luce_compile.targets import facts_for

FRAGMENT = 16  # WMMA m16n16k16
DEFAULT_SHARED_BYTES = 48 * 1024  # a block's shared memory without the opt-in attribute, static and dynamic together
STATIC_SHARED_BYTES = 40 * 1024  # static tiles stay well under the 48 KiB static limit
OPT_IN_SHARED_BYTES = 99 * 1024  # a block's opted-in shared memory where the registry has no figure (the least)


def max_shared_bytes(target: Target) -> int:
    """A block's shared memory with the opt-in: the target registry's fact (227 KiB on sm_90, 99 KiB on sm_86/120)."""
    return int(facts_for(target).get("max_shared_memory_opt_in", OPT_IN_SHARED_BYTES))


def is_half_matmul(sch: s_tir.Schedule) -> bool:
    """The float16 form of lower/quant_matmul.py: an "x_half" block, a "dequantize" block to float16, "matmul"."""
    try:
        x_half, dequant, matmul = (sch.get(sch.get_sblock(n)) for n in ("x_half", "dequantize", "matmul"))
    except (s_tir.ScheduleError, ValueError):
        return False
    return x_half.writes[0].source.dtype == "float16" and dequant.writes[0].source.dtype == "float16" and \
        matmul.writes[0].source.dtype == "float32"


def shared_bytes(tile_m: int, tile_n: int, tile_k: int) -> tuple[int, int]:
    """(input tiles, accumulator tile) in bytes: two pipeline stages of float16 x and W tiles, rows padded by 8
    halves (storage_align), and the float32 output tile, rows padded by 4."""
    return 2 * (tile_m + tile_n) * (tile_k + 8) * 2, tile_m * (tile_n + 4) * 4


def accumulator_scope(tile_m: int, tile_n: int, tile_k: int) -> str:
    """Where the accumulators leave through. In the dynamic pool with the float16 input tiles, TVM 0.27's
    shared-memory merge hands WMMA's store a float16 pointer for some tile shapes (LowerIntrin: "tvm_access_ptr
    element type must match the source buffer"), so the float32 tile goes to static shared memory where it may.
    TVM's launcher opts a kernel into more than 48 KiB only for a dynamic part of 48 KiB or more: a static tile on
    top of a smaller dynamic one must fit the 48 KiB together, or the launch fails (CUDA_ERROR_INVALID_VALUE,
    measured on the H200)."""
    inputs, acc = shared_bytes(tile_m, tile_n, tile_k)
    fits = acc <= STATIC_SHARED_BYTES and (inputs >= DEFAULT_SHARED_BYTES or inputs + acc <= DEFAULT_SHARED_BYTES)
    return "shared" if fits else "shared.dyn"


class TensorCoreGEMM(GPURule):
    name = "gpu.tensor_gemm"
    # dlight's own tile (128×128×64, 16 warps), the measured default until tuning records say otherwise
    DEFAULTS: ClassVar[dict[str, int]] = {"warps_m": 4, "warps_n": 4, "frags_m": 2, "frags_n": 2, "k_frags": 4,
                                          "vector": 4}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {
        "warps_m": (1, 2, 4),
        "warps_n": (1, 2, 4),
        "frags_m": (1, 2, 4),
        "frags_n": (1, 2, 4),
        "k_frags": (2, 4),
        "vector": (2, 4),  # 8 would need float8 loads of x, which CUDA lacks (the build fails)
    }

    def schedule(self, sch: s_tir.Schedule, target: Target, knobs: dict[str, int]) -> bool:
        if target.kind.name != "cuda" or not is_half_matmul(sch):
            return False
        warps = knobs["warps_m"] * knobs["warps_n"]
        if warps * warp_size(target) > max_threads(target):
            return False
        tile_m, tile_n = (knobs[f"warps_{a}"] * knobs[f"frags_{a}"] * FRAGMENT for a in "mn")
        if sum(shared_bytes(tile_m, tile_n, knobs["k_frags"] * FRAGMENT)) > max_shared_bytes(target):
            return False  # would not launch
        blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if blocks is None or len(blocks) != 1:
            return False
        schedule_wmma(sch, blocks[0], knobs, warp_size(target))
        return True


def schedule_wmma(sch: s_tir.Schedule, main_block: s_tir.schedule.SBlockRV, knobs: dict[str, int],
                  warp: int) -> None:
    """dlight's MatmulTensorization steps with knobbed factors (the comments there name each step)."""
    from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group

    warps_m, warps_n, frags_m, frags_n = knobs["warps_m"], knobs["warps_n"], knobs["frags_m"], knobs["frags_n"]
    k_frags, vector = knobs["k_frags"], knobs["vector"]
    num_ty = warps_m * warps_n

    # normalize to C[S, I, J] += A[S, I, K] * B[S, J, K]
    reindex_a = sch.reindex(main_block, ("read", 0))
    reindex_b = sch.reindex(main_block, ("read", 1))
    reindex_c = sch.reindex(main_block, ("write", 0))
    matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main_block))
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main_block, matmul_map)
    sch.pad_einsum(main_block, [1, FRAGMENT * warps_m * frags_m, FRAGMENT * warps_n * frags_n,
                                FRAGMENT * k_frags])

    batch, i, j, k = sch.get_loops(main_block)
    i, i_inner = sch.split(i, factors=[None, FRAGMENT])
    j, j_inner = sch.split(j, factors=[None, FRAGMENT])
    k, k_inner = sch.split(k, factors=[None, FRAGMENT])
    sch.reorder(i, j, k, i_inner, j_inner, k_inner)
    block_inner = main_block
    block_outer = sch.blockize(i_inner)

    i0, i1, i2, i3 = sch.split(i, factors=[None, 1, warps_m, frags_m])
    j0, j1, j2, j3 = sch.split(j, factors=[1, None, warps_n, frags_n])
    k0, k1 = sch.split(k, [None, k_frags])
    # two k steps in flight: the shared-memory fills of step t+1 overlap the WMMA products of step t
    sch.annotate(k0, "software_pipeline_order", [0, 3, 1, 4, 5, 2, 6])
    sch.annotate(k0, "software_pipeline_stage", [0, 0, 0, 0, 0, 1, 1])
    sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
    sch.reorder(i0, j0, i1, j1, j2, i2, k0, k1, i3, j3)
    sch.bind(batch, "blockIdx.z")
    sch.bind(sch.fuse(i0, j0), "blockIdx.x")
    sch.bind(sch.fuse(i1, j1), "blockIdx.y")
    thread_idy = sch.fuse(j2, i2)
    sch.bind(thread_idy, "threadIdx.y")

    def fetch_to_shared(index: int) -> s_tir.schedule.SBlockRV:
        block_read = sch.cache_read(block_outer, index, "shared.dyn")
        sch.compute_at(block_read, k0)
        fused = sch.fuse(*sch.get_loops(block_read)[-2:])
        _, f_1, f_2, f_3 = sch.split(fused, factors=[None, num_ty, warp, vector])
        sch.bind(f_2, "threadIdx.x")
        sch.bind(f_1, "threadIdx.y")
        sch.vectorize(f_3)
        sch.storage_align(block_read, 0, axis=-2, factor=16, offset=8)  # rows 8 halves apart: no bank conflicts
        sch.annotate(block_read, "tirx.manifest_shared_memory_local_stage", 1)
        sch.annotate(block_read, "double_buffer_scope", 0)
        return block_read

    a_g2s, b_g2s = fetch_to_shared(0), fetch_to_shared(1)
    auto_inline_producers(sch, a_g2s)  # x's cast to float16 happens on the way into shared memory
    auto_inline_producers(sch, b_g2s)  # and W's dequantization

    a_frag = sch.cache_read(block_outer, 0, "wmma.matrix_a")
    b_frag = sch.cache_read(block_outer, 1, "wmma.matrix_b")
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)
    acc_scope = accumulator_scope(warps_m * frags_m * FRAGMENT, warps_n * frags_n * FRAGMENT, k_frags * FRAGMENT)
    acc_shared = sch.cache_write(block_outer, 0, acc_scope)
    sch.storage_align(acc_shared, 0, -2, 16, 4)
    store = sch.cache_write(block_outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(store, thread_idy)
    sch.reverse_compute_at(acc_shared, thread_idy)
    si, sj = sch.get_loops(store)[-2:]
    si0, si1 = sch.split(si, factors=[None, FRAGMENT])
    sj0, sj1 = sch.split(sj, factors=[None, FRAGMENT])
    sch.reorder(si0, sj0, si1, sj1)
    block_init = sch.get_child_blocks(sch.decompose_reduction(block_outer, k0))[0]

    intrin = get_wmma_intrin_group(load_scope="shared.dyn", store_scope=acc_scope, in_dtype="float16",
                                   out_dtype="float32", trans_b=True)
    for frag, name in ((a_frag, "load_a"), (b_frag, "load_b")):
        fi, fj = sch.get_loops(frag)[-2:]
        fi0, fi1 = sch.split(fi, factors=[None, FRAGMENT])
        fj0, fj1 = sch.split(fj, factors=[None, FRAGMENT])
        sch.reorder(fi0, fj0, fi1, fj1)
        sch.unroll(fi0)
        sch.unroll(fj0)
        sch.tensorize(fi1, intrin[name])
    sch.tensorize(sch.get_loops(block_init)[-2], intrin["init"])
    sch.tensorize(sch.get_loops(store)[-2], intrin["store"])
    sch.tensorize(sch.get_loops(block_inner)[-3], intrin["compute"])
    auto_inline_consumer_chain(sch, acc_shared)
    _, f1, f2 = sch.split(sch.fuse(*sch.get_loops(acc_shared)[-2:]), factors=[None, warp, vector])
    sch.bind(f1, "threadIdx.x")
    sch.vectorize(f2)
