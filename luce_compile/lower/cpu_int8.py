"""Integer dot-product matmuls for decode, with llama.cpp's arithmetic (ggml-cpu's vec_dot_q4_0_q8_0, q4_1_q8_1,
q8_0_q8_0): the activation vector is quantized to 8 bits once per matmul input, then every 32-value block of a
weight row is an exact integer dot product with the activation block, scaled by one float FMA with d_w·d_x (and,
for Q4_1, plus the min term m_w·s_x).

Activation formats (ggml's x86 quantize_row_q8_0 / q8_1, per 32 values):
  d = amax/127 (float32, stored rounded to fp16), q = rint(x · 127/amax), and for Q8_1 s = fp16(d · Σq) from the
  float32 d. `xd`/`xs` hold those fp16 values widened to float32 (exact), so the kernels need no fp16 conversion.
Which one a weight type pairs with is ggml's type_traits_cpu[].vec_dot_type.

Order of the quantized activations inside a block: a Q4 weight's `qs` plane (quant_layout) puts elements 2j and
2j+1 of a block in the low and high nibble of its byte j, so 16 bytes masked with 0x0F are the even elements and
shifted right by 4 the odd ones. The activation block is stored in that order ("nibbles": the 16 even elements,
then the 16 odd ones) so that the kernel multiplies the 32 unpacked nibbles against 32 consecutive bytes, with no
shuffle in the inner loop. Q8_0 weights keep the natural order. A dot product does not depend on the order in
which its terms are paired, so the results are those of the natural order.

This module is target-independent: `quantize_q8` and `int8_matmul` are plain TE definitions (correct, and slow,
unscheduled). On x86 with AVX512-VNNI the schedule rule schedules/cpu/int8_gemv.py replaces the matmul with its
vpdpbusd kernel; `resolve_precision` only picks this path where that rule applies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gguf import GGMLQuantizationType
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target, codegen

from luce_compile.errors import UnsupportedError
from luce_compile.lower.quant_layout import as_ggml_type
from luce_compile.lower.quant_matmul import weight_planes

log = logging.getLogger(__name__)

QK8 = 32  # values per activation block (QK8_0 = QK8_1 in ggml-common.h)
INT8_GEMV_ATTR = "luce.int8_gemv"  # marks int8_matmul's PrimFuncs for the schedule rule: value = weight type name
PRECISIONS = ("auto", "int8", "f32")


@dataclass(frozen=True)
class Q8Format:
    """How one weight type wants its activations: ggml's vec_dot_type, and the order of values in a block."""

    name: str  # "Q8_0" or "Q8_1"
    order: str  # "natural" or "nibbles" (see the module docstring)

    @property
    def with_sum(self) -> bool:
        return self.name == "Q8_1"

    def position_element(self, p: tirx.Expr | int) -> tirx.Expr | int:
        """The element (0..31) of a block that position p of the quantized block holds."""
        return p if self.order == "natural" else 2 * (p % 16) + p // 16


INT8_FORMATS: dict[GGMLQuantizationType, Q8Format] = {
    GGMLQuantizationType.Q4_0: Q8Format("Q8_0", "nibbles"),
    GGMLQuantizationType.Q4_1: Q8Format("Q8_1", "nibbles"),
    GGMLQuantizationType.Q8_0: Q8Format("Q8_0", "natural"),
}


def int8_format(ggml_type: GGMLQuantizationType | str) -> Q8Format | None:
    """The activation format of a weight type with an integer kernel, else None (that type keeps float32)."""
    return INT8_FORMATS.get(as_ggml_type(ggml_type))


def has_vnni(target: Target) -> bool:
    """AVX512-VNNI with 256-bit vectors (vpdpbusd ymm needs avx512vl too), what schedules/cpu/int8_gemv.py emits."""
    if target.kind.name != "llvm":
        return False
    return bool(codegen.target_has_features(["avx512vnni", "avx512vl", "avx512bw"], target))


def resolve_precision(precision: str, target: Target) -> str:
    """'auto' → 'int8' on CPUs the integer kernels are built for, else 'f32'; 'int8' and 'f32' are kept."""
    if precision not in PRECISIONS:
        raise UnsupportedError(f"lower: precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "int8" and not has_vnni(target):
        raise UnsupportedError(f"lower: precision int8 needs a CPU target with AVX512-VNNI (avx512vnni, avx512vl, "
                               f"avx512bw); {target.kind.name} {target.attrs.get('mcpu', '')} has none. Use "
                               "--precision auto or f32.")
    if precision != "auto":
        return precision
    chosen = "int8" if has_vnni(target) else "f32"
    log.info("precision auto → %s for %s (int8 needs an llvm target with AVX512-VNNI)", chosen, target.kind.name)
    return chosen


def _i64(*dims: int) -> tuple[tirx.Expr, ...]:
    return tuple(tirx.IntImm("int64", d) for d in dims)


def _f16_round(value: tirx.Expr) -> tirx.Expr:
    """float32 → fp16 → float32: ggml stores d and s as fp16 (round to nearest even, as numpy's astype)."""
    return value.astype("float16").astype("float32")


def _check_n_in(n_in: int) -> None:
    if n_in <= 0 or n_in % QK8:
        raise UnsupportedError(f"lower: 8-bit activations need n_in a positive multiple of {QK8}, got {n_in}")


def quantize_q8(n_in: int, fmt: Q8Format, *, name: str | None = None) -> tirx.PrimFunc:
    """x (1, n_in) float32 → xq (1, n_in) int8 in `fmt.order`, xd (1, n_in/32) float32 [, xs (1, n_in/32) float32]."""
    _check_n_in(n_in)
    nb = n_in // QK8
    x = te.placeholder(_i64(1, n_in), "float32", name="x")
    i = te.reduce_axis(_i64(0, QK8), name="i")
    amax = te.compute(_i64(1, nb), lambda r, b: te.max(tirx.abs(x[r, b * QK8 + i]), axis=i), name="amax")

    def quant(r: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
        b = k // QK8
        a = amax[r, b]
        inv = tirx.Select(a > 0, tirx.const(127.0, "float32") / a, tirx.const(0.0, "float32"))
        return tirx.nearbyint(x[r, b * QK8 + fmt.position_element(k % QK8)] * inv).astype("int8")

    xq = te.compute(_i64(1, n_in), quant, name="xq")
    xd = te.compute(_i64(1, nb), lambda r, b: _f16_round(amax[r, b] / tirx.const(127.0, "float32")), name="xd")
    outs = [xq, xd]
    if fmt.with_sum:
        j = te.reduce_axis(_i64(0, QK8), name="j")
        qsum = te.compute(_i64(1, nb), lambda r, b: te.sum(xq[r, b * QK8 + j].astype("int32"), axis=j), name="qsum")
        d32 = lambda r, b: amax[r, b] / tirx.const(127.0, "float32")  # noqa: E731  (s uses the float32 d)
        outs.append(te.compute(_i64(1, nb), lambda r, b: _f16_round(d32(r, b) * qsum[r, b].astype("float32")),
                               name="xs"))
    symbol = name or f"quantize_{fmt.name.lower()}_{fmt.order}_{n_in}"
    return te.create_prim_func([x, *outs]).with_attr("global_symbol", symbol)


def _weight_quant(qtype: GGMLQuantizationType, planes: dict, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """The integer quant of element (n, k) as the dot product uses it: Q4_0 centred (q − 8), Q4_1 as stored."""
    if qtype == GGMLQuantizationType.Q8_0:
        return planes["qs"][n, k].astype("int32")
    word = planes["qs"][n, k // 8]
    nibble = ((word >> ((k % 8) * 4).astype("uint32")) & tirx.const(15, "uint32")).astype("int32")
    return nibble - 8 if qtype == GGMLQuantizationType.Q4_0 else nibble


def int8_matmul(ggml_type: GGMLQuantizationType | str, n_out: int, n_in: int, *,
                name: str | None = None) -> tirx.PrimFunc:
    """y (1, n_out) = Σ_blocks d_w·d_x·(Σ q_w·q_x) [+ m_w·s_x]: PrimFunc(xq, xd, [xs], *planes, y).

    Two reductions: "block_dot" (int32, 32 values) and "scale_sum" (float32 over the blocks)."""
    qtype = as_ggml_type(ggml_type)
    fmt = int8_format(qtype)
    if fmt is None:
        raise UnsupportedError(f"lower: no integer kernel for {qtype.name}; types: {[t.name for t in INT8_FORMATS]}")
    _check_n_in(n_in)
    nb = n_in // QK8
    xq = te.placeholder(_i64(1, n_in), "int8", name="xq")
    xd = te.placeholder(_i64(1, nb), "float32", name="xd")
    xs = te.placeholder(_i64(1, nb), "float32", name="xs") if fmt.with_sum else None
    planes = weight_planes(qtype, n_out, n_in)
    i = te.reduce_axis(_i64(0, QK8), name="i")
    isum = te.compute(_i64(n_out, nb), lambda n, b: te.sum(
        _weight_quant(qtype, planes, n, b * QK8 + fmt.position_element(i)) * xq[0, b * QK8 + i].astype("int32"),
        axis=i), name="block_dot")

    def term(n: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
        value = planes["d"][n, b].astype("float32") * xd[0, b] * isum[n, b].astype("float32")
        return value + planes["m"][n, b].astype("float32") * xs[0, b] if xs is not None else value

    j = te.reduce_axis(_i64(0, nb), name="j")
    y = te.compute(_i64(1, n_out), lambda r, n: te.sum(term(n, j), axis=j), name="scale_sum")
    args = [xq, xd, *([xs] if xs is not None else []), *planes.values(), y]
    symbol = name or f"int8_gemv_{qtype.name.lower()}_{n_out}x{n_in}"
    return te.create_prim_func(args).with_attr("global_symbol", symbol).with_attr(INT8_GEMV_ATTR, qtype.name)


class _Module(Protocol):
    """What `int8_linear` needs of relax_model.GraphModule (not imported: relax_model imports this module)."""

    graph: Any

    def _kernel(self, key: tuple, make: Callable[[], tirx.PrimFunc]) -> tirx.PrimFunc: ...

    def _planes(self, tensor: str) -> list[nn.Tensor]: ...


def int8_linear(m: _Module, x: nn.Tensor, tensor: str, cache: dict) -> nn.Tensor | None:
    """x (..., K) float32 @ Wᵀ → (..., N) with 8-bit activations, or None where this path does not apply: the rows
    are not a static 1 (only decode1's GEMVs take it), or the weight type has no integer kernel. `cache` maps an
    input already quantized in a format to its quantized tensors, so the Q/K/V (and gate/up) matmuls of one input
    quantize it once; it is keyed by the input tensor, and each value keeps that tensor alive so that its id cannot
    be taken by another tensor meanwhile."""
    info = m.graph.weights[tensor]
    fmt = int8_format(info.ggml_type)
    n, k = info.shape
    lead = x.shape[:-1]
    if fmt is None or x.dtype != "float32" or any(not isinstance(d, int) or d != 1 for d in lead):
        return None
    key = (id(x), fmt)
    if key not in cache:
        quantize = m._kernel(("q8", fmt, k), lambda: quantize_q8(k, fmt))
        outs = [nn.Tensor.placeholder((1, k), "int8"), nn.Tensor.placeholder((1, k // QK8), "float32")]
        outs += [nn.Tensor.placeholder((1, k // QK8), "float32")] * fmt.with_sum
        x2 = op.reshape(x, (1, k))
        cache[key] = (x, op.tensor_ir_op(quantize, quantize.attrs["global_symbol"], [x2], outs))
    quantized = list(cache[key][1])
    func = m._kernel(("int8mm", info.ggml_type, n, k), lambda: int8_matmul(info.ggml_type, n, k))
    out = nn.Tensor.placeholder((1, n), "float32")
    y = op.tensor_ir_op(func, func.attrs["global_symbol"], [*quantized, *m._planes(tensor)], out)
    return op.reshape(y, (*lead, n))
