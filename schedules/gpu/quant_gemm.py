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
buckets the twin runs, scheduled by tensor_gemm.TensorCoreGEMM with this rule's knobs (its tile), instead of the
float32 SIMT Matmul. The buckets keep float32, so decoding a few sequences together stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import tvm_ffi.structural
from luce_schedules.cpu.quant_matmul import match_matmul
from luce_schedules.gpu.base import GPURule
from luce_schedules.gpu.tensor_gemm import TensorCoreGEMM
from tvm import IRModule, ir, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from luce_compile.lower.quant_matmul import TENSOR_CORE_TWIN

# (largest batch, LowBatchGEMV bucket), smallest first; a batch above the last goes to Matmul
LOW_BATCH: tuple[tuple[int, int], ...] = ((2, 2), (8, 4))


@dataclass(frozen=True)
class Dispatched:
    """A function already scheduled branch by branch; dlight's ApplyDefaultSchedule reads only `.mod["main"]`."""

    mod: IRModule


class QuantGEMM(GPURule):
    name = "gpu.quant_gemm"
    # the tensor-core tile, for functions with a float16 twin (others have nothing to tune yet)
    DEFAULTS: ClassVar[dict[str, int]] = dict(TensorCoreGEMM.DEFAULTS)
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = dict(TensorCoreGEMM.SPACE)

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
                     tile: dict[str, int]) -> Dispatched | None:
    """The twin scheduled on tensor cores, its body rebound to func's parameters (the same signature), so that
    dispatch_on_batch can put it beside schedules of func itself; None where the tile does not apply."""
    sch = TensorCoreGEMM().apply(twin, target, tile)
    if sch is None:
        return None
    pairs = list(zip(twin.params, func.params, strict=True))
    pairs += [(a, b) for p, q in pairs for a, b in zip(p.shape, q.shape, strict=True) if isinstance(a, tirx.Var)]

    def rebind(var: ir.expr.Var) -> ir.expr.Var:
        return next((new for old, new in pairs if var.same_as(old)), var)

    body = tvm_ffi.structural.structural_map(sch.mod["main"].body, (ir.expr.Var, rebind))
    return Dispatched(IRModule({"main": func.with_body(body)}))


def dispatch_on_batch(func: tirx.PrimFunc, batch: tirx.Var, low: dict[int, s_tir.Schedule | Dispatched],
                      gemm: s_tir.Schedule | Dispatched) -> tirx.PrimFunc:
    """func whose body runs low[limit]'s schedule for the smallest limit ≥ batch, else gemm's. Every schedule was
    made from func itself (or rebound to it: tensor_core_gemm), so all bodies refer to func's own parameters."""
    body = gemm.mod["main"].body
    for limit, sch in sorted(low.items(), reverse=True):
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(batch <= limit), sch.mod["main"].body, body)
    body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return func.with_body(body).with_attr("tirx.HoistIfThenElseExprWithBlock", 1)
