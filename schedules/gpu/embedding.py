"""GPU schedule for the quantized embedding gather of lower/quant_matmul.py (`quant_embedding`).

out[t, k] = dequant(table)[ids[t], k]: one thread block per token row (`rows_per_block` tokens), `threads` threads
across the row, each dequantizing consecutive elements so a warp reads one contiguous run of the packed row.
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.gpu.base import GPURule, fit, max_threads, root_blocks
from tvm import s_tir, tirx
from tvm.target import Target


def _is_gather(block: s_tir.SBlock) -> bool:
    """Two spatial iters (token, element) and a read of a 1-D int32 id buffer."""
    spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)
    ids = [r for r in block.reads if len(r.source.shape) == 1 and str(r.source.dtype) == "int32"]
    return spatial and len(block.iter_vars) == 2 and len(ids) == 1


class QuantEmbedding(GPURule):
    name = "gpu.quant_embedding"
    DEFAULTS: ClassVar[dict[str, int]] = {"threads": 128}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"threads": (64, 128, 256)}

    def schedule(self, sch: s_tir.Schedule, target: Target, knobs: dict[str, int]) -> bool:
        blocks = root_blocks(sch)
        if not blocks or len(blocks) != 1 or not _is_gather(sch.get(blocks[0])):
            return False
        t, k = sch.get_loops(blocks[0])
        width = sch.get(k).extent
        if not isinstance(width, tirx.IntImm):
            return False
        threads = fit(int(width), min(knobs["threads"], max_threads(target)))
        k_steps, tx = sch.split(k, [None, threads])
        sch.reorder(t, tx, k_steps)
        sch.bind(t, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.unroll(k_steps)
        return True
