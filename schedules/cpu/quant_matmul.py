"""CPU (llvm) schedule rules for the fused dequantize + matmul PrimFuncs of luce_compile.lower.quant_matmul.

Both rules vectorize along the reduction axis k: the planes store consecutive k of one row next to each other, so
one uint32 word broadcast and a lane-wise shift give `vector` dequantized elements, and x[k:k+vector] is one
contiguous load. Each lane keeps a partial sum (rfactor over the vector lanes), reduced across lanes once per row
at the end. Independent accumulators (several rows, and in the GEMM several rows of x) hide the FMA latency.

- QuantGEMV (batch 1, decode): the dequantization is inlined, so W is read once in its packed form and no float
  copy of it exists; `rows` output rows share each load of x; the outer row loop is parallel, `chunk` groups of
  rows per task (each task allocates its partial sums once: TVM turns allocations inside parallel loops into
  workspace calls).
- QuantGEMM (batch > 1 or symbolic, prefill/verify): each parallel task dequantizes a strip of `rows` rows of W
  (rows × n_in float32, small enough for L1/L2) once and reuses it for every row of x, `batch_tile` rows of x at
  a time. x is padded to a multiple of `batch_tile` (pad_einsum) so the inner loops carry no bounds checks.

`apply(func, target, knobs)` follows dlight's ScheduleRule contract (None when the function is not its kind), so
the rules also run inside `dlight.ApplyDefaultSchedule`, where `knobs` arrives as dlight's `tunable` flag and the
defaults apply. DEFAULTS were picked on a 2-core AMD EPYC (znver3, AVX2) with SmolLM2-135M's shapes; SPACE is what
luce_compile/tune searches per target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from luce_schedules.knobs import KnobbedRule, Knobs, fit
from tvm import s_tir, tirx
from tvm.target import Target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatmulBlocks:
    """The blocks of a y[b, n] = Σ_k x[b, k] · W[n, k] function: the reduction, and W's producer if any."""

    matmul: s_tir.schedule.SBlockRV
    dequant: s_tir.schedule.SBlockRV | None
    epilogue: s_tir.schedule.SBlockRV | None
    batch: int | tirx.Expr
    n_out: int
    n_in: int


def _access_vars(region: tirx.BufferRegion) -> tuple[tirx.Var, ...] | None:
    """The block vars indexing a point access (each index a bare var), else None."""
    if any(not isinstance(r.min, tirx.Var) or not _is_one(r.extent) for r in region.region):
        return None
    return tuple(r.min for r in region.region)


def _is_one(value: tirx.Expr) -> bool:
    return isinstance(value, tirx.IntImm) and value.value == 1


def _is_matmul(block: s_tir.SBlock) -> bool:
    """Exactly one write y[b, n] and reads x[b, k], W[n, k] (W possibly a dequantized intermediate)."""
    if len(block.iter_vars) != 3 or len(block.writes) != 1 or block.init is None:
        return False
    b, n, k = (iv.var for iv in block.iter_vars)
    out = block.writes[0].source
    reads = {_access_vars(r) for r in block.reads if not r.source.same_as(out)}
    return _access_vars(block.writes[0]) == (b, n) and reads == {(b, k), (n, k)}


def _kinds(block: s_tir.SBlock) -> str:
    """'S' per data-parallel iter, 'R' per reduction iter, 'O' for anything else (e.g. 'SSR' for a matmul)."""
    kinds = {tirx.IterVar.DataPar: "S", tirx.IterVar.CommReduce: "R"}
    return "".join(kinds.get(iv.iter_type, "O") for iv in block.iter_vars)


def match_matmul(sch: s_tir.Schedule) -> MatmulBlocks | None:
    """Recognize [W producer] → matmul (S, S, R) → [elementwise epilogue] at the root; None for anything else."""
    try:
        children = sch.get_child_blocks(sch.get_sblock("root"))
    except (s_tir.ScheduleError, ValueError):
        return None
    stmts = [sch.get(c) for c in children]
    kinds = [_kinds(s) for s in stmts]
    reductions = [i for i, k in enumerate(kinds) if "R" in k]
    if len(reductions) != 1 or reductions[0] > 1 or len(stmts) - reductions[0] > 2:
        return None
    at = reductions[0]
    others = [k for i, k in enumerate(kinds) if i != at]
    if kinds[at] != "SSR" or any(set(k) != {"S"} for k in others) or not _is_matmul(stmts[at]):
        return None
    if len(sch.get_loops(children[at])) != 3 or (at == 1 and kinds[0] != "SS"):
        return None
    batch, n_out, n_in = (_const(iv.dom.extent) for iv in stmts[at].iter_vars)
    if not isinstance(n_out, int) or not isinstance(n_in, int):
        return None
    dequant = children[0] if at == 1 else None
    epilogue = children[at + 1] if len(children) > at + 1 else None
    return MatmulBlocks(children[at], dequant, epilogue, batch, n_out, n_in)


def _const(value: tirx.Expr) -> int | tirx.Expr:
    return int(value) if isinstance(value, tirx.IntImm) else value




class _QuantMatmulRule(KnobbedRule):
    """Shared guard clauses; subclasses say which batch they take and how to schedule."""

    def takes_batch(self, batch: int | tirx.Expr) -> bool:
        raise NotImplementedError

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        blocks = match_matmul(sch)
        if blocks is None or not self.takes_batch(blocks.batch):
            return None
        try:
            self.schedule(sch, blocks, self.knobs(knobs))
        except s_tir.ScheduleError as err:  # the shape matched but a primitive refused: leave it to the next rule
            log.warning("%s declined %s after matching it: %s", self.name, func.attrs.get("global_symbol"), err)
            return None
        return sch

    def schedule(self, sch: s_tir.Schedule, blocks: MatmulBlocks, knobs: dict[str, int]) -> None:
        raise NotImplementedError


def _split_k_lanes(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, vector: int) -> s_tir.schedule.SBlockRV:
    """Split k into (k/vector, vector) and rfactor the lanes: returns the per-lane partial-sum block."""
    k = sch.get_loops(block)[-1]
    _, lanes = sch.split(k, [None, vector])
    return sch.rfactor(lanes, factor_axis=2)


class QuantGEMV(_QuantMatmulRule):
    """Batch-1 dequantize + matmul (decode): W streamed once in packed form, vectorized along k."""

    name = "cpu.quant_gemv"
    DEFAULTS: ClassVar[dict[str, int]] = {"rows": 4, "vector": 8, "unroll": 4, "chunk": 1}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {
        "rows": (1, 2, 4, 8),
        "vector": (4, 8, 16),
        "unroll": (1, 2, 4, 8),
        "chunk": (1, 4, 16),
    }

    def takes_batch(self, batch: int | tirx.Expr) -> bool:
        return isinstance(batch, int) and batch == 1

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        # The 8-bit-activation GEMVs (lower/cpu_int8.py) go to their own rule. Temporary: that rule belongs in
        # luce_schedules.cpu.RULES (ahead of this one); until it is listed there, this GEMV rule hands them over.
        from luce_schedules.cpu.int8_gemv import Int8GEMV

        int8 = Int8GEMV().apply(func, target)
        return int8 if int8 is not None else super().apply(func, target, knobs)

    def schedule(self, sch: s_tir.Schedule, blocks: MatmulBlocks, knobs: dict[str, int]) -> None:
        vector = fit(blocks.n_in, knobs["vector"])
        rows = fit(blocks.n_out, knobs["rows"])
        unroll = fit(blocks.n_in // vector, knobs["unroll"])
        if blocks.dequant is not None:
            sch.compute_inline(blocks.dequant)
        chunk = fit(blocks.n_out // rows, knobs["chunk"])
        rf = _split_k_lanes(sch, blocks.matmul, vector)
        b, n, k, lanes = sch.get_loops(rf)
        n_tasks, n_groups, n_rows = sch.split(n, [None, chunk, rows])
        k_steps, k_unroll = sch.split(k, [None, unroll])
        sch.reorder(b, n_tasks, n_groups, k_steps, k_unroll, n_rows, lanes)
        sch.parallel(sch.fuse(b, n_tasks))
        sch.unroll(k_unroll)
        sch.unroll(n_rows)
        sch.vectorize(lanes)
        sch.set_scope(rf, 0, "local")
        sch.reverse_compute_at(blocks.matmul, n_groups)
        if blocks.epilogue is not None:
            sch.set_scope(blocks.matmul, 0, "local")
            sch.reverse_compute_at(blocks.epilogue, n_groups)
        sch.decompose_reduction(rf, k_steps)


class QuantGEMM(_QuantMatmulRule):
    """Batched dequantize + matmul (prefill/verify): a dequantized strip of W per task, reused by every x row."""

    name = "cpu.quant_gemm"
    DEFAULTS: ClassVar[dict[str, int]] = {"rows": 4, "batch_tile": 2, "vector": 8, "unroll": 2}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {
        "rows": (1, 2, 3, 4, 6, 8),
        "batch_tile": (1, 2, 3, 4),
        "vector": (8, 16),
        "unroll": (1, 2, 4),
    }

    def takes_batch(self, batch: int | tirx.Expr) -> bool:
        return not isinstance(batch, int) or batch > 1

    def schedule(self, sch: s_tir.Schedule, blocks: MatmulBlocks, knobs: dict[str, int]) -> None:
        vector = fit(blocks.n_in, knobs["vector"])
        rows = fit(blocks.n_out, knobs["rows"])
        unroll = fit(blocks.n_in // vector, knobs["unroll"])
        tile = max(1, knobs["batch_tile"])
        x_pad, out = _pad_batch(sch, blocks, tile)
        rf = _split_k_lanes(sch, blocks.matmul, vector)
        b, n, k, lanes = sch.get_loops(rf)
        n_tasks, n_rows = sch.split(n, [None, rows])
        b_tiles, b_rows = sch.split(b, [None, tile])
        k_steps, k_unroll = sch.split(k, [None, unroll])
        sch.reorder(n_tasks, b_tiles, k_steps, k_unroll, b_rows, n_rows, lanes)
        sch.parallel(n_tasks)
        for loop in (k_unroll, b_rows, n_rows):
            sch.unroll(loop)
        sch.vectorize(lanes)
        sch.set_scope(rf, 0, "local")
        sch.reverse_compute_at(blocks.matmul, b_tiles)
        sch.reverse_compute_at(out, b_tiles)
        sch.decompose_reduction(rf, k_steps)
        if blocks.dequant is not None:
            _dequant_strip(sch, blocks.dequant, n_tasks, vector)
        if x_pad is not None:
            sch.vectorize(sch.split(sch.get_loops(x_pad)[-1], [None, vector])[-1])


def _pad_batch(
    sch: s_tir.Schedule, blocks: MatmulBlocks, tile: int
) -> tuple[s_tir.schedule.SBlockRV | None, s_tir.schedule.SBlockRV]:
    """Pad the batch to a multiple of `tile` and give the matmul a local accumulator.

    Returns (the block that pads x, or None when no padding was needed; the block that stores y). The store
    carries the only bounds check, outside the k loop; the epilogue (a cast) is folded into it.
    """
    pad_x = None
    if tile > 1 and not (isinstance(blocks.batch, int) and blocks.batch % tile == 0):
        sch.pad_einsum(blocks.matmul, [tile, 1, 1])
        weight = sch.get(blocks.dequant).name_hint if blocks.dequant is not None else None
        pad_x = next(p for p in sch.get_producers(blocks.matmul) if sch.get(p).name_hint != weight)
    consumers = sch.get_consumers(blocks.matmul)
    if not consumers:
        return pad_x, sch.cache_write(blocks.matmul, 0, "local")
    out = consumers[0]
    sch.set_scope(blocks.matmul, 0, "local")
    if pad_x is not None and blocks.epilogue is not None:
        sch.reverse_compute_inline(blocks.epilogue)
    return pad_x, out


def _dequant_strip(
    sch: s_tir.Schedule, dequant: s_tir.schedule.SBlockRV, task: s_tir.schedule.LoopRV, vector: int
) -> None:
    """Dequantize each task's rows of W once, before its batch loop, vectorized along k like the matmul."""
    sch.compute_at(dequant, task)
    k = sch.get_loops(dequant)[-1]
    sch.vectorize(sch.split(k, [None, vector])[-1])
