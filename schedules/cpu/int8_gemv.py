"""CPU rule for the int8 GEMVs of luce_compile.lower.cpu_int8: AVX512-VNNI vpdpbusd kernels, llama.cpp's x86 loop.

`int8_matmul` defines the arithmetic as two TE reductions; this rule replaces a function marked with
INT8_GEMV_ATTR by a hand-vectorized kernel of the same signature that computes the same sums:
  per row and 32-value block: 32 weight quants as unsigned bytes · 32 activation bytes → vpdpbusd.256 → 8 int32
  partial sums (exact) → float32, one FMA with the broadcast d_w·d_x into 8 float32 lanes; Q4_1 adds m_w·s_x.
  The 8 lanes are summed once per row, at the end (no horizontal sum per block).
- Q4_1: the nibbles are the unsigned operand as they are (0..15).
- Q4_0 (q − 8) and Q8_0 are signed: the sign trick of llama.cpp's mul_sum_i8_pairs, |w| as the unsigned operand
  and x with w's sign moved onto it (|w|·sign(w)x = w·x; w = −128 gives |w| = 128 as an unsigned byte, still exact).
- `rows` rows share each activation load; parallel tasks take `chunk` groups of rows (each task allocates its
  accumulators once: TVM turns allocations inside a parallel loop into workspace calls); `unroll` blocks are one
  expression (an FMA chain), so the accumulator goes through its buffer once per `unroll` blocks. Buffers and
  scalar bindings are what LLVM failed to keep in registers inside the model's whole module (it could not prove
  they alias no argument there; the same kernel alone was fine): with one buffer round trip per 8 blocks and `let`
  bindings the kernel runs as fast in the model as alone (SmolLM2 1536x576: 169 → 69 µs in the model build).
256-bit vectors as llama.cpp uses them (a block is 32 bytes). vpdpbusd's i8 operands are `<32 x i8>` in LLVM 22
(the wheel's LLVM); TVM 0.27's own dot_16x4_vnni intrinsic passes int32 vectors, which LLVM 22 rejects.

This replaces instead of scheduling: tensorizing the TE definition is a later step (the issue's step 2 wants
repacked tiles too). DEFAULTS, on this 2-core AMD EPYC (znver4) at SmolLM2-135M's shapes, weights streamed from
memory (copies rotated past L3, medians of 7), measured before `unroll` existed: rows 1 was best or tied for Q4_1
576→1536 and 1536→576 and 2.8x faster than rows 2 for the Q8_0 LM head (576→49152; not yet understood); chunk 1
pays ~0.3 µs per task (workspace allocations), chunk 16 keeps ≥ 36 tasks for two threads. unroll 8 is not tuned.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from luce_schedules.knobs import KnobbedRule, Knobs, fit
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.target import Target

from luce_compile.lower.cpu_int8 import INT8_GEMV_ATTR, QK8, has_vnni, int8_matmul

log = logging.getLogger(__name__)
LANES = 8  # int32 / float32 lanes of one 256-bit vector


def _vpdpbusd(unsigned: tirx.Expr, signed: tirx.Expr) -> tirx.Expr:
    """8 int32 sums of 4 byte products each, from zero: both operands int8x32 as LLVM 22 types them."""
    zero = T.Broadcast(T.int32(0), LANES)
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", zero, unsigned, signed)


def _nibbles(qs_bytes: tirx.Buffer, n: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
    """A Q4 block's 16 bytes → 32 unsigned quants: the 16 low nibbles (even elements), then the 16 high ones."""
    raw = qs_bytes[n, T.Ramp(b * 16, 1, 16)]
    mask = T.Broadcast(T.uint8(15), 16)
    return T.Shuffle([raw & mask, (raw >> T.Broadcast(T.uint8(4), 16)) & mask], list(range(32)))


def _signed_dot(w: tirx.Expr, x: tirx.Expr) -> tirx.Expr:
    """Σ w·x per 4 bytes for signed w (int8x32) by the sign trick."""
    negative = w < T.Broadcast(T.int8(0), 32)
    return _vpdpbusd(T.abs(w), T.Select(negative, T.Broadcast(T.int8(0), 32) - x, x))


def _block_dot(kind: str, qs: tirx.Buffer, n: tirx.Expr, b: tirx.Expr, x: tirx.Expr) -> tirx.Expr:
    """int32x8 partial sums of one row's block b against the activation block x (int8x32)."""
    if kind == "Q8_0":
        return _signed_dot(qs[n, T.Ramp(b * QK8, 1, QK8)], x)
    quants = _nibbles(qs, n, b)
    if kind == "Q4_1":
        return _vpdpbusd(T.reinterpret("int8x32", quants), x)
    return _signed_dot(T.reinterpret("int8x32", quants) - T.Broadcast(T.int8(8), 32), x)


def _acc_chain(kind: str, bufs: tuple, n: tirx.Expr, blocks: list, acc: tirx.Expr) -> tirx.Expr:
    """acc (float32x8) after `blocks` of row n as one unrolled expression, so that it stays in a register: LLVM
    does not promote TVM's per-task accumulator buffers when it cannot prove that they alias no argument (it could
    not in the model's whole module: the same kernel ran 2.3x slower there than compiled alone)."""
    xq, xd, _, d, _, qs = bufs
    for b in blocks:
        scale = T.Broadcast(T.Cast("float32", d[n, b]) * xd[0, b], LANES)
        dot = _block_dot(kind, qs, n, b, xq[0, T.Ramp(b * QK8, 1, QK8)])
        acc = T.fma(scale, T.Cast("float32x8", dot), acc)
    return acc


def _min_chain(bufs: tuple, n: tirx.Expr, blocks: list, total: tirx.Expr) -> tirx.Expr:
    """Q4_1's Σ m_w·s_x over `blocks` of row n, added to total."""
    _, _, xs, _, m, _ = bufs
    for b in blocks:
        total = T.fma(T.Cast("float32", m[n, b]), xs[0, b], total)
    return total


def vnni_gemv(kind: str, n_out: int, n_in: int, rows: int, chunk: int, unroll: int) -> tirx.PrimFunc:
    """The kernel for one weight type and shape; same arguments as cpu_int8.int8_matmul(kind, n_out, n_in)."""
    nb = n_in // QK8
    tasks = n_out // (rows * chunk)
    has_min = kind == "Q4_1"
    q_dtype, q_cols = ("int8", n_in) if kind == "Q8_0" else ("uint8", n_in // 2)  # Q4 qs: uint32 words as bytes

    def blocks(b0: tirx.Expr) -> list:
        return [b0 * unroll + j for j in range(unroll)]

    @T.macro
    def body(xq, xd, xs, d, m, qs, y):
        for c in T.parallel(tasks):
            acc = T.decl_buffer((rows, LANES), "float32", scope="local")
            mins = T.decl_buffer((rows,), "float32", scope="local")
            for g in range(chunk):
                for r in T.unroll(rows):
                    acc[r, T.Ramp(0, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                    mins[r] = T.float32(0)
                for b0 in range(nb // unroll):
                    for r in T.unroll(rows):
                        n: T.let[T.int32] = (c * chunk + g) * rows + r
                        acc[r, T.Ramp(0, 1, LANES)] = _acc_chain(
                            kind, (xq, xd, xs, d, m, qs), n, blocks(b0), acc[r, T.Ramp(0, 1, LANES)])
                        if has_min:
                            mins[r] = _min_chain((xq, xd, xs, d, m, qs), n, blocks(b0), mins[r])
                for r in T.unroll(rows):
                    y[0, (c * chunk + g) * rows + r] = _lane_sum(acc, r, mins[r])

    if kind == "Q4_1":

        @T.prim_func(s_tir=True)
        def q4_1(xq: T.Buffer((1, n_in), "int8"), xd: T.Buffer((1, nb), "float32"), xs: T.Buffer((1, nb), "float32"),
                 d: T.Buffer((n_out, nb), "float16"), m: T.Buffer((n_out, nb), "float16"),
                 qs: T.Buffer((n_out, n_in // 8), "uint32"), y: T.Buffer((1, n_out), "float32")):
            T.func_attr({"tirx.noalias": True})
            qs_bytes = T.decl_buffer((n_out, q_cols), q_dtype, data=qs.data)
            body(xq, xd, xs, d, m, qs_bytes, y)

        return q4_1
    if kind == "Q4_0":

        @T.prim_func(s_tir=True)
        def q4_0(xq: T.Buffer((1, n_in), "int8"), xd: T.Buffer((1, nb), "float32"),
                 d: T.Buffer((n_out, nb), "float16"), qs: T.Buffer((n_out, n_in // 8), "uint32"),
                 y: T.Buffer((1, n_out), "float32")):
            T.func_attr({"tirx.noalias": True})
            qs_bytes = T.decl_buffer((n_out, q_cols), q_dtype, data=qs.data)
            body(xq, xd, None, d, None, qs_bytes, y)

        return q4_0

    @T.prim_func(s_tir=True)
    def q8_0(xq: T.Buffer((1, n_in), "int8"), xd: T.Buffer((1, nb), "float32"),
             d: T.Buffer((n_out, nb), "float16"), qs: T.Buffer((n_out, n_in), "int8"),
             y: T.Buffer((1, n_out), "float32")):
        T.func_attr({"tirx.noalias": True})
        body(xq, xd, None, d, None, qs, y)

    return q8_0


def _lane_sum(acc: tirx.Buffer, r: tirx.Expr, start: tirx.Expr) -> tirx.Expr:
    """start + the 8 lanes of acc[r], in lane order."""
    total = start
    for lane in range(LANES):
        total = total + acc[r, lane]
    return total


def _signature(func: tirx.PrimFunc) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every buffer argument, the part of a signature the Relax call depends on."""
    return [(tuple(int(s) for s in p.shape), str(p.dtype)) for p in func.params]


class Int8GEMV(KnobbedRule):
    """cpu_int8.int8_matmul functions → the vpdpbusd kernel, on llvm targets with AVX512-VNNI."""

    name = "cpu.int8_gemv"
    DEFAULTS: ClassVar[dict[str, int]] = {"rows": 1, "chunk": 16, "unroll": 8}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"rows": (1, 2, 4), "chunk": (1, 4, 16, 64), "unroll": (1, 4, 8, 16)}

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or INT8_GEMV_ATTR not in func.attrs:
            return None
        if not has_vnni(target):
            return None
        kind = str(func.attrs[INT8_GEMV_ATTR])
        n_out, n_in = int(func.params[-1].shape[1]), int(func.params[0].shape[1])  # y (1, n_out), xq (1, n_in)
        k = self.knobs(knobs)
        rows = fit(n_out, k["rows"])
        kernel = vnni_gemv(kind, n_out, n_in, rows, fit(n_out // rows, k["chunk"]), fit(n_in // QK8, k["unroll"]))
        if _signature(kernel) != _signature(int8_matmul(kind, n_out, n_in)) or _signature(kernel) != _signature(func):
            log.warning("%s declined %s: its arguments are not int8_matmul's", self.name, func.attrs["global_symbol"])
            return None
        kernel = kernel.with_attr("global_symbol", func.attrs["global_symbol"])
        return s_tir.Schedule(kernel)
