"""CPU rule for the expert matmuls of luce_compile.lower.moe (functions marked EXPERT_ATTR): y[q, n] over the rows
q that the router chose, each row gathering its expert's weight rows.

The hand kernels (int8_gemv, quant_matmul) assume one weight matrix for every row, so these are scheduled from
their TE: the output's (row, column) loops are fused over `chunk` columns and run in parallel, and every producer
stage (int8: block_dot, centred_dot, superblock_dot, superblock_min) is computed at the column, so its
intermediate is one output's few values instead of a (rows, n_out, n_in/32) array (TVM's default materializes them
all: 800 MB for 512 tokens of a Qwen3-30B-A3B expert). Rows arrive grouped by expert (moe.sort_func), so a task's
consecutive rows mostly read the same weight rows from cache. The arithmetic of every output is unchanged (each
sum keeps its order): outputs are bit-identical to the unscheduled function's.
Measured on this 2-core Zen 3 (shared, so ±10%), a 4-layer MoE of n_embd 1024, 32 experts of 512, 4 used,
Q4_K/Q6_K, int8, 2026-12-06: decode 71.3 → 62.4 ms a token, a 128-token prefill 3.93 → 2.50 s. The dot products
stay scalar (the TE's bit extraction per element): the next step is the int8 GEMV's vector body (int8_gemv.py) with a
per-row weight offset, which this rule's grouping already suits.
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.knobs import KnobbedRule, Knobs, fit
from tvm import s_tir, tirx
from tvm.target import Target

EXPERT_ATTR = "luce.moe_expert"  # set by lower/moe.py on its expert matmuls (value: the weight type's name)


class ExpertMatmul(KnobbedRule):
    name = "cpu.moe_expert"
    DEFAULTS: ClassVar[dict[str, int]] = {"chunk": 16}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"chunk": (4, 16, 64)}

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or EXPERT_ATTR not in func.attrs:
            return None
        if target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        out, producers = blocks[-1], blocks[:-1]
        rows, cols = sch.get_loops(out)[:2]
        n_out = int(func.params[-1].shape[1])
        outer, inner = sch.split(cols, [None, fit(n_out, self.knobs(knobs)["chunk"])])
        sch.parallel(sch.fuse(rows, outer))
        for block in reversed(producers):  # the consumer nearest the output first
            sch.compute_at(block, inner)
        return sch
