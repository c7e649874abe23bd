"""CPU rule for the functions with no reduction (residual adds, SiLU·mul, RoPE, reshapes and concatenations that
copy): TVM's CPU pipeline leaves them as written, one thread and scalar code, and they were ~3 ms of SmolLM2's
9 ms decode step on the 2-core Zen 3 (benchmarks/profile_step.py: RoPE alone 14 µs a layer for 9 heads).

Injective: the blocks other than the last are inlined into it; then, in this order,
- a transcendental (exp, cos, sin, ...) whose arguments do not depend on one of the block's loops is hoisted out
  of it by moving that loop innermost (LLVM's LICM then computes it once per value of the outer loops: RoPE's
  angle depends on the position and the pair, not the head, so `heads` times fewer exp/cos/sin calls);
- otherwise the innermost loop, if its extent is a multiple of 8, is split by 8 and vectorized (256-bit lanes);
- the loops outside are fused and run in parallel when a static shape holds at least PARALLEL_MIN elements (a
  quarter of that where they call a transcendental), or for a symbolic shape (a prompt's tokens) where they call
  one (`_worth_parallel`).
Measured alone, 2 threads, Zen 3 (SmolLM2's functions): RoPE of 9 heads 13.6 → 3.6 µs for one token, 332 → 47 µs
for 37; SiLU·mul of 37 x 1536 319 → 157 µs; the adds and copies as fast as before or faster.
The arithmetic of every element is unchanged (no reduction is reordered): outputs are bit-identical to the
unscheduled function's, which tests/schedules/test_cpu_elementwise.py checks on every such function of a model.
"""

from __future__ import annotations

from typing import ClassVar

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target
from tvm_ffi.structural import structural_visit

LANES = 8  # float32 lanes of a 256-bit vector
# elements of a static shape below which one thread is faster than a pool wake-up (~1-2 µs); a quarter of it where
# each element calls a transcendental (SiLU's exp: ~5 ns an element; SmolLM2's 1536 ran 8.0 → 10.4 µs parallel in
# the model, though 7.4 → 3.7 alone)
PARALLEL_MIN = 16384
TRANSCENDENTAL = tuple(f"tirx.{name}" for name in ("exp", "exp2", "exp10", "sigmoid", "tanh", "erf", "log", "log2",
                                                    "log10", "pow", "cos", "sin", "tan", "atan", "cosh", "sinh"))


def _transcendental_vars(body: tirx.Stmt) -> tuple[bool, set[tirx.Var]]:
    """Whether the block's body calls a transcendental, and the variables their arguments read."""
    calls: list[tvm.ir.Call] = []
    used: set[tirx.Var] = set()

    def on_call(node: tvm.ir.Call, visitor) -> None:  # noqa: ANN001  (structural_visit's visitor)
        if getattr(node.op, "name", "") in TRANSCENDENTAL:
            calls.append(node)
        visitor.default_visit(node)

    def on_var(node: tirx.Var, visitor) -> None:  # noqa: ANN001
        used.add(node)

    structural_visit(body, [(tvm.ir.Call, on_call)])
    for call in calls:
        structural_visit(call, [(tirx.Var, on_var)])
    return bool(calls), used


class Injective:
    """Functions whose every block is spatial; see the module docstring."""

    name = "cpu.injective"
    DEFAULTS: ClassVar[dict[str, int]] = {}  # no knobs: nothing for the tuner to search
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {}

    def apply(self, func: tirx.PrimFunc, target: Target, _knobs: object = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(info.is_injective() for info in infos):
            return None
        try:
            for info in infos[:-1]:
                sch.compute_inline(info.block_rv)
        except s_tir.ScheduleError:  # a block that cannot be inlined (read by two others, say): left as it is
            return None
        block = infos[-1].block_rv
        loops = list(sch.get_loops(block))
        if not loops:
            return None
        calls, _ = _transcendental_vars(sch.get(block).body)
        inner = self._hoist_or_vectorize(sch, block, loops)
        loops = list(sch.get_loops(block))
        outer = loops[: len(loops) - inner]
        if outer and self._worth_parallel(sch, block, calls):
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch

    @staticmethod
    def _hoist_or_vectorize(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV,
                            loops: list[s_tir.schedule.LoopRV]) -> int:
        """Reorder or split the innermost loop; returns how many loops are left inside the parallel part (0 or 1)."""
        stmt = sch.get(block)
        calls, used = _transcendental_vars(stmt.body)
        if calls:
            # after normalize_prim_func each block var is bound to its own loop, in order
            free = [i for i, iv in enumerate(stmt.iter_vars)
                    if iv.var not in used and isinstance(sch.get(loops[i]).extent, tirx.IntImm)]
            if not free:
                return 0
            if free[-1] != len(loops) - 1:
                sch.reorder(*[loop for i, loop in enumerate(loops) if i != free[-1]], loops[free[-1]])
            return 1
        extent = sch.get(loops[-1]).extent
        if isinstance(extent, tirx.IntImm) and int(extent) % LANES == 0:
            _, vec = sch.split(loops[-1], [None, LANES])
            sch.vectorize(vec)
            return 1
        return 0

    @staticmethod
    def _worth_parallel(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, calls: bool) -> bool:
        """Static shapes: at least PARALLEL_MIN elements (a quarter of it with transcendentals). Symbolic ones (a
        prompt's tokens, a batch): only with transcendentals, since the same function runs for one decode token,
        where a pool wake-up (~1.5 µs) cost a 576-wide add five times its work (0.4 → 1.9 µs)."""
        total = 1
        for loop in sch.get_loops(block):
            extent = sch.get(loop).extent
            if not isinstance(extent, tirx.IntImm):
                return calls
            total *= int(extent)
        return total >= (PARALLEL_MIN // 4 if calls else PARALLEL_MIN)
