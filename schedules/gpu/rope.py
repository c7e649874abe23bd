"""GPU schedule for the RoPE kernel of lower/rope.py: (x (B, S, H, D), positions (B, S)) → (B, S, H, D).

Elementwise: one thread block per token (B·S), `threads` threads over its H·D elements. Each element forms its
angle in float64 (lower/rope.py says why); that is the kernel's cost, not memory.
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.gpu.base import GPURule, fit, max_threads, root_blocks
from tvm import s_tir, tirx
from tvm.target import Target


def _is_rope(block: s_tir.SBlock) -> bool:
    """Four spatial iters and a 2-D int32 positions read (the shape lower/rope.py writes)."""
    spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)
    pos = [r for r in block.reads if len(r.source.shape) == 2 and str(r.source.dtype) == "int32"]
    return spatial and len(block.iter_vars) == 4 and len(pos) == 1


class Rope(GPURule):
    name = "gpu.rope"
    DEFAULTS: ClassVar[dict[str, int]] = {"threads": 256}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"threads": (64, 128, 256, 512)}

    def schedule(self, sch: s_tir.Schedule, target: Target, knobs: dict[str, int]) -> bool:
        blocks = root_blocks(sch)
        if not blocks or len(blocks) != 1 or not _is_rope(sch.get(blocks[0])):
            return False
        b, s, h, d = sch.get_loops(blocks[0])
        per_token = [sch.get(h).extent, sch.get(d).extent]
        if not all(isinstance(e, tirx.IntImm) for e in per_token):
            return False
        width = int(per_token[0]) * int(per_token[1])
        threads = fit(width, min(knobs["threads"], max_threads(target)))
        steps, tx = sch.split(sch.fuse(h, d), [None, threads])
        sch.reorder(tx, steps)
        sch.bind(sch.fuse(b, s), "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return True
