"""CPU rule for the expert matmuls of luce_compile.lower.moe (functions marked EXPERT_ATTR): y[q, n] over the rows
q that the router chose, each row gathering its expert's weight rows.

- int8 (a target with a byte dot, cpu_int8.int8_isa): `expert_gemv`, int8_gemv.py's decode body with the weight row
  experts[q]·n_out + n and the activation row tokens[q]: a parallel task per (row, `chunk` columns), each output the
  int8 GEMV's value for its token and expert row, bit for bit.
- float32 (and int8 without a byte dot): from the TE, the output's (row, column) loops fused over `chunk` columns in
  parallel, every producer stage computed at the column, so an intermediate is one output's few values instead of
  TVM's default (rows, n_out, n_in/32) arrays (800 MB for 512 tokens of a Qwen3-30B-A3B expert); bit-identical to
  the unscheduled function.
Rows arrive grouped by expert (moe.sort_func), so a prompt's consecutive rows read one expert's weights from cache.
Measured on this 2-core Zen 3 (shared: load 6-7 during the runs, so only the large changes mean anything), a 4-layer
MoE of n_embd 1024, 32 experts of 512, 4 used, Q4_K/Q6_K, int8, 2026-12-06: a 128-token prefill 3.5-3.9 s with
TVM's default build, 2.5 s with the TE schedule, 0.9-1.0 s with the vector body; decode 48-71 → 34-42 ms a token
(its LM head, 49152 × 1024 Q6_K, is twice the experts' work on this shape).
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.cpu import int8_gemm
from luce_schedules.cpu.int8_gemv import (
    GROUPS,
    LANES,
    ROW_TILE,
    _byte_view,
    _lane_sum,
    _stage_weights,
    _unit_terms,
    _unroll,
    block_group,
)
from luce_schedules.knobs import KnobbedRule, Knobs, fit
from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.target import Target
from tvm.tirx.script.builder import ir as T

from luce_compile.lower.cpu_int8 import QK8, QK_K, int8_isa, superblocked
from luce_compile.lower.moe import EXPERT_ATTR

# rows an expert on average (rows / n_expert) past which a call takes expert_gemm_body: a prompt's (gpt-oss-20b's 512
# tokens: 64), not a decode step's (8 sequences: 1)
GEMM_ROWS_PER_EXPERT = 4


class ExpertMatmul(KnobbedRule):
    name = "cpu.moe_expert"
    DEFAULTS: ClassVar[dict[str, int]] = {"chunk": 16, "block_rows": 64}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"chunk": (4, 16, 64), "block_rows": (32, 64, 128)}

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or EXPERT_ATTR not in func.attrs:
            return None
        if target.kind.name != "llvm":
            return None
        isa = int8_isa(target)
        if "xq" in [p.name for p in func.params] and isa is not None:  # int8: the GEMV's vector body, gathered
            knobs = self.knobs(knobs)
            kernel = expert_gemv(func, isa, knobs["chunk"], block_rows=knobs["block_rows"])
            return s_tir.Schedule(kernel.with_attr("global_symbol", func.attrs["global_symbol"]))
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


def expert_gemv(func: tirx.PrimFunc, isa: str, chunk: int, unroll_blocks: int = 8, block_rows: int = 64
                ) -> tirx.PrimFunc:
    """lower/moe.int8_expert_matmul's function (same arguments) with int8_gemv.py's decode body: a parallel task per
    (sorted row q, `chunk` output columns); row q dots its token's quantized activations with weight rows
    experts[q]·n_out + n, unpacked into registers unit by unit (`_unit_terms`: the GEMV's integer dots and scales,
    so each output is the GEMV's value for that row). Past GEMM_ROWS_PER_EXPERT rows an expert on average (a
    prompt's), `expert_gemm_body` instead: each expert's strip of weights unpacked once for all its rows."""
    kind = str(func.attrs[EXPERT_ATTR])
    y_param = func.params[-1]
    n_out = int(y_param.shape[1])
    n_in = int(func.params[0].shape[1])
    n_expert = int(func.params[-2].shape[0]) // n_out  # the last plane's rows: n_expert · n_out
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("main")
        T.func_attr({"tirx.noalias": True})
        bufs = {b.name: T.arg(b.name, T.buffer(tuple(b.shape), b.dtype, layout=None)) for b in func.params}
        y = bufs[y_param.name]
        for name in ("qs", "qh"):
            if name in bufs and bufs[name].dtype == "uint32":
                bufs[name] = _byte_view(bufs[name])
        if not int8_gemm.supports(n_out):
            _gemv_body(isa, kind, bufs, y, n_out, n_in, chunk, unroll_blocks)
        else:
            with T.If(T.Cast("int32", y.shape[0]) > GEMM_ROWS_PER_EXPERT * n_expert):
                with T.Then():
                    expert_gemm_body(isa, kind, bufs, y, n_out, n_in, block_rows)
                with T.Else():
                    _gemv_body(isa, kind, bufs, y, n_out, n_in, chunk, unroll_blocks)
    return builder.get()


def _gemv_body(isa: str, kind: str, bufs: dict, y: tirx.Buffer, n_out: int, n_in: int, chunk: int,
               unroll_blocks: int) -> None:
    experts, tokens = bufs["experts"], bufs.get("tokens")
    k_quant = superblocked(kind)
    lanes = LANES if k_quant else block_group(n_in)
    per_unit = GROUPS if k_quant else lanes
    units = n_in // QK_K if k_quant else n_in // QK8 // lanes
    unit = QK_K if k_quant else QK8 * lanes
    unroll = _unroll(units, max(1, unroll_blocks * QK8 // unit))
    chunk = fit(n_out, chunk)
    tasks = n_out // chunk
    with T.parallel(0, T.Cast("int32", y.shape[0]) * tasks) as c:
        acc = T.decl_buffer((1, lanes), "float32", scope="local")
        every = T.Ramp(0, 1, lanes) if lanes > 1 else 0
        zero = T.Broadcast(T.float32(0), lanes) if lanes > 1 else T.float32(0)
        q = T.Bind(c // tasks)
        a = T.Bind(tokens[q] if tokens is not None else q)
        with T.serial(0, chunk) as g:
            col = T.Bind((c % tasks) * chunk + g)
            n = T.Bind(experts[q] * n_out + col)
            T.buffer_store(acc, zero, [0, every])
            with T.serial(0, units // unroll) as u0:
                weights = _stage_weights(isa, kind, bufs, n, u0 * unroll * per_unit, None)
                total = acc[0, every]
                for j in range(unroll):
                    total = _unit_terms(isa, kind, bufs, a, n, u0 * unroll + j, total, weights)
                T.buffer_store(acc, total, [0, every])
            T.buffer_store(y, _lane_sum(acc, 0, lanes), [q, col])


def expert_gemm_body(isa: str, kind: str, bufs: dict, y: tirx.Buffer, n_out: int, n_in: int, block_rows: int
                     ) -> None:
    """int8_gemm.py's output-lane body over the sorted rows: a parallel task per (strip of 8·V output columns,
    `block_rows` consecutive rows); the task's rows of one expert (a run: moe.sort_func groups the rows by expert)
    share one unpacking of that expert's strip (int8_gemm.Staged), each row then its vpdpbusd per 4-byte quad. The
    integers are the GEMV's; the float sums go in the dense GEMM's order."""
    experts, tokens = bufs["experts"], bufs.get("tokens")
    strip = int8_gemm.Strip(isa, kind, bufs, y, n_out, n_in)
    strips = n_out // strip.width
    total = T.Bind(T.Cast("int32", y.shape[0]))
    x_row = (lambda r: tokens[r]) if tokens is not None else (lambda r: r)  # the row's token (gate/up) or itself
    with T.parallel(0, strips * ((total + block_rows - 1) // block_rows)) as task:
        col = T.Bind(task % strips * strip.width)
        first = T.Bind(task // strips * block_rows)
        end = T.Bind(T.min(first + block_rows, total))
        strip.start(ROW_TILE)
        run = T.decl_buffer((2,), "int32", scope="local")  # the run's first row, and one past its last
        T.buffer_store(run, first, [0])
        with T.While(run[0] < end):
            expert = T.Bind(experts[run[0]])
            T.buffer_store(run, run[0] + 1, [1])
            with T.While(T.And(run[1] < end, experts[T.min(run[1], end - 1)] == expert)):
                T.buffer_store(run, run[1] + 1, [1])
            strip.st.stage(bufs, expert * n_out + col)
            strip.run(col, run[0], run[1], ROW_TILE, x_row)
            T.buffer_store(run, run[1], [0])
