"""GPU schedule for the batched fused dequantize + matmul (prefill, batched decode, verify) of lower/quant_matmul.py.

dlight's Matmul rule accepts our functions as written (a spatial "dequantize" block feeding the matmul): it tiles
the output over thread blocks, stages tiles of x and of the dequantized W in shared memory (the dequantization
runs once per tile, so W is never materialized in global memory) and accumulates in registers. This rule claims
exactly our quantized matmuls with a symbolic or > 1 batch and hands them to it, so they are scheduled as matmuls
even where another rule earlier in the list would also match; its knobs arrive with tuning (the tile sizes of
dlight's config), none are exposed yet.
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.cpu.quant_matmul import match_matmul
from luce_schedules.gpu.base import GPURule
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target


class QuantGEMM(GPURule):
    name = "gpu.quant_gemm"
    DEFAULTS: ClassVar[dict[str, int]] = {}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {}

    def apply(self, func: tirx.PrimFunc, target: Target, knobs=None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name not in ("cuda", "rocm"):
            return None
        blocks = match_matmul(s_tir.Schedule(func))
        if blocks is None or (isinstance(blocks.batch, int) and blocks.batch == 1):
            return None
        self.knobs(knobs)
        with target:
            sch = dl.gpu.Matmul().apply(func, target, False)
        return sch if isinstance(sch, s_tir.Schedule) else None
