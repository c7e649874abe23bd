"""GPU schedule for the batched fused dequantize + matmul (prefill, batched decode, verify) of lower/quant_matmul.py.

One function serves every batch size (the batch is symbolic), and no single schedule suits both ends:
- Large batches (prefill): dlight's Matmul rule tiles the output over thread blocks, stages tiles of x and of the
  dequantized W in shared memory (the dequantization runs once per tile, so W is never materialized in global
  memory) and accumulates in registers.
- Small batches (batched decode, a few sequences): Matmul's tiles are mostly padding there, and the Nsight profile
  of 2026-11-30 (benchmarks/results/h200-2026-11-30-decode-profile.md) put a batch-8 decode step of the Llama-1B
  body at 18 ms, 10× the batch-1 step. dlight's LowBatchGEMV is a GEMV that dequantizes each weight into registers
  once and uses it for a bucket of rows (the batch padded to the bucket), so W is read once per bucket.
So the function branches on the batch at run time, as MLC-LLM's low-batch specialization does: batch ≤ 2 →
LowBatchGEMV(2), ≤ 8 → LowBatchGEMV(4), else Matmul. The condition is thread-invariant, and TVM hoists it out of the
kernels (tirx.HoistIfThenElseExprWithBlock): each branch is its own kernel, chosen on the host. A static batch > 1
(none is lowered today) keeps Matmul: LowBatchGEMV takes only a symbolic batch.

Tensor cores (precision f16, CUDA): the function carries a float16 twin (quant_matmul.TENSOR_CORE_TWIN); above the
buckets the twin's computation runs on tensor cores instead of the float32 SIMT Matmul: by default the hand
mma.sync kernel of mma_gemm.py (knob kernel=1, its tile the knobs tile_m × tile_n, 0 = chosen from the shape), or
the twin scheduled by tensor_gemm.TensorCoreGEMM at dlight's tile (kernel=0, WMMA), kept as the measured baseline and
for K that mma_gemm does not take. The buckets keep float32, so decoding a few sequences together stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import tvm_ffi.structural
from luce_schedules.cpu.quant_matmul import match_matmul
from luce_schedules.gpu import mma_gemm, mmq_gemm
from luce_schedules.gpu.base import GPURule, sm_count
from luce_schedules.gpu.tensor_gemm import TensorCoreGEMM
from tvm import IRModule, ir, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from luce_compile.lower.q8_gemm import Q8_GEMM_ATTR
from luce_compile.lower.quant_matmul import GGML_TYPE_ATTR, TENSOR_CORE_TWIN

# (largest batch, LowBatchGEMV bucket), smallest first; a batch above the last goes to Matmul
LOW_BATCH: tuple[tuple[int, int], ...] = ((2, 2), (8, 4))


@dataclass(frozen=True)
class Dispatched:
    """A function already scheduled branch by branch; dlight's ApplyDefaultSchedule reads only `.mod["main"]`."""

    mod: IRModule


class QuantGEMM(GPURule):
    name = "gpu.quant_gemm"
    # the tensor-core kernel and its tile, for functions with a float16 twin (others have nothing to tune yet):
    # kernel 1 = mma_gemm (tile 0 = mma_gemm.default_tile), 0 = dlight's WMMA tile (TensorCoreGEMM's defaults)
    DEFAULTS: ClassVar[dict[str, int]] = {"kernel": 1, "tile_m": 0, "tile_n": 0, "tile_k": 0}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"kernel": (0, 1), "tile_m": mma_gemm.TILE_M,
                                                   "tile_n": mma_gemm.TILE_N, "tile_k": mma_gemm.TILE_K[1:]}

    # A tuned tile runs up to this multiple of the rows it was measured at, the default tile above: tiles tuned at
    # 512 rows won 1.09-1.25x there and lost 0.89-0.90x at 2048 on the H200 (results/h200/2026-12-01-tuned-vs-
    # untuned.md), where dlight's 128x128 tile fills the GPU without help. 2x: halfway, on a log scale.
    TRUSTED_ROWS = 2

    def apply_measured(self, func: tirx.PrimFunc, target: Target, knobs, measured_at: dict[str, int]):
        """apply() with a tuning record's knobs, which hold only near the extent the record was measured at."""
        rows = max(measured_at.values(), default=0)
        return self.apply(func, target, knobs, tuned_up_to=self.TRUSTED_ROWS * rows if rows else None)

    def apply(self, func: tirx.PrimFunc, target: Target, knobs=None, *, tuned_up_to: int | None = None):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name not in ("cuda", "rocm"):
            return None
        blocks = match_matmul(s_tir.Schedule(func))
        if blocks is None or (isinstance(blocks.batch, int) and blocks.batch == 1):
            return None
        tile = self.knobs(knobs)
        # low-batch branches for a symbolic batch on CUDA only: on ROCm LowBatchGEMV's blocks exceed the 256 threads
        # our gfx targets allow (the build's thread check would refuse them), and nothing was measured there
        dispatch = isinstance(blocks.batch, tirx.Var) and target.kind.name == "cuda"
        twin = func.attrs.get(TENSOR_CORE_TWIN) if func.attrs else None
        func = func.without_attr(TENSOR_CORE_TWIN) if twin is not None else func
        with target:
            gemm = tensor_core_gemm(func, twin, target, tile) if twin is not None and dispatch else None
            # a tuned tile with a row limit: the default tile takes the rows above it
            above = (tensor_core_gemm(func, twin, target, self.knobs())
                     if gemm is not None and tuned_up_to and tile != self.knobs() else None)
            gemm = gemm or dl.gpu.Matmul().apply(func, target, False)
            low = {limit: dl.gpu.LowBatchGEMV(bucket).apply(func, target, False)
                   for limit, bucket in (LOW_BATCH if dispatch else ())}
        low = {limit: sch for limit, sch in low.items() if isinstance(sch, s_tir.Schedule)}
        if above is not None and low and tuned_up_to > max(low):
            low, gemm = {**low, tuned_up_to: gemm}, above
        gemm = gemm if isinstance(gemm, s_tir.Schedule | Dispatched) else None
        if gemm is None or not low:
            return [gemm] if isinstance(gemm, Dispatched) else gemm
        # a one-element list: dlight's ApplyDefaultSchedule wraps a bare Schedule, and takes other results as a list
        return [Dispatched(IRModule({"main": dispatch_on_batch(func, blocks.batch, low, gemm)}))]


def tensor_core_gemm(func: tirx.PrimFunc, twin: tirx.PrimFunc, target: Target,
                     knobs: dict[str, int]) -> Dispatched | None:
    """The twin's computation on tensor cores, with func's parameters (the same signature), so that
    dispatch_on_batch can put it beside schedules of func itself: mma_gemm's kernel (knobs["kernel"] 1) or the twin
    scheduled by TensorCoreGEMM (0, or a K mma_gemm does not take); None where neither applies. A twin marked
    Q8_GEMM_ATTR (--prefill-gemm q8) takes mmq_gemm's 8-bit kernel at knob kernel 1 and nothing else: its
    arithmetic is the build's choice, not a tuning candidate's."""
    n_in, n_out = (int(twin.params[i].shape[1]) for i in (0, -1))
    qtype = str(twin.attrs[GGML_TYPE_ATTR]) if GGML_TYPE_ATTR in twin.attrs else None
    if Q8_GEMM_ATTR in twin.attrs:
        return _q8_gemm(func, twin, qtype, n_out, n_in, target, knobs)
    if knobs.get("kernel", 1) == 1 and qtype is not None and mma_gemm.supports(qtype, n_in):
        tile_m, tile_n, tile_k = mma_gemm.default_tile(n_out, sm_count(target, 132))
        x_dtype, out_dtype = (str(twin.params[i].dtype) for i in (0, -1))
        kernel = mma_gemm.mma_gemm(qtype, n_out, n_in, x_dtype=x_dtype, out_dtype=out_dtype,
                                   tile_m=knobs.get("tile_m") or tile_m, tile_n=knobs.get("tile_n") or tile_n,
                                   tile_k=knobs.get("tile_k") or tile_k)
        return Dispatched(IRModule({"main": func.with_body(rebound(kernel, func))}))
    sch = TensorCoreGEMM().apply(twin, target, TensorCoreGEMM.DEFAULTS)
    if sch is None:
        return None
    return Dispatched(IRModule({"main": func.with_body(rebound(sch.mod["main"], func))}))


def _q8_gemm(func: tirx.PrimFunc, twin: tirx.PrimFunc, qtype: str | None, n_out: int, n_in: int, target: Target,
             knobs: dict[str, int]) -> Dispatched:
    x_dtype = str(twin.params[0].dtype)
    if knobs.get("kernel", 1) != 1 or qtype is None or not mmq_gemm.supports(qtype, n_in, x_dtype):
        raise ValueError(f"gpu.quant_gemm: a --prefill-gemm q8 function ({qtype}, K={n_in}, x {x_dtype}) runs only "
                         f"mmq_gemm's kernel (knob kernel 1), got knobs {knobs}")
    tile_m, tile_n, tile_k = mmq_gemm.default_tile(n_out, sm_count(target, 132))
    kernel = mmq_gemm.mmq_gemm(qtype, n_out, n_in, tile_m=knobs.get("tile_m") or tile_m,
                               tile_n=knobs.get("tile_n") or tile_n, tile_k=knobs.get("tile_k") or tile_k)
    return Dispatched(IRModule({"main": func.with_body(rebound(kernel, func))}))


def rebound(other: tirx.PrimFunc, func: tirx.PrimFunc) -> tirx.Stmt:
    """other's body over func's parameters and shape variables (the two have the same signature)."""
    pairs = list(zip(other.params, func.params, strict=True))
    pairs += [(a, b) for p, q in pairs for a, b in zip(p.shape, q.shape, strict=True) if isinstance(a, tirx.Var)]

    def rebind(var: ir.expr.Var) -> ir.expr.Var:
        return next((new for old, new in pairs if var.same_as(old)), var)

    return tvm_ffi.structural.structural_map(other.body, (ir.expr.Var, rebind))


def dispatch_on_batch(func: tirx.PrimFunc, batch: tirx.Var, low: dict[int, s_tir.Schedule | Dispatched],
                      gemm: s_tir.Schedule | Dispatched) -> tirx.PrimFunc:
    """func whose body runs low[limit]'s schedule for the smallest limit ≥ batch, else gemm's. Every schedule was
    made from func itself (or rebound to it: tensor_core_gemm), so all bodies refer to func's own parameters."""
    body = gemm.mod["main"].body
    for limit, sch in sorted(low.items(), reverse=True):
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(batch <= limit), sch.mod["main"].body, body)
    body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return func.with_body(body).with_attr("tirx.HoistIfThenElseExprWithBlock", 1)
