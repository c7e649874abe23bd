"""Integer dot-product matmuls (decode, verify, prefill), with llama.cpp's arithmetic (ggml-cpu's vec_dot_q4_0_q8_0,
q4_1_q8_1, q5_0_q8_0, q5_1_q8_1, q8_0_q8_0, iq4_nl_q8_0, mxfp4_q8_0, q2_K_q8_K … q6_K_q8_K, iq4_xs_q8_K): the
activations are quantized to 8 bits once per matmul input, then each block of a weight row is an exact integer dot
product with the activation block.
- 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4): each block's integer dot is scaled by one float FMA
  with d_w·d_x (and, for Q4_1/Q5_1, plus the min term m_w·s_x). Q4_0/Q5_0 dot the centred quants (q − 8, q − 16);
  IQ4_NL and MXFP4 the signed codebook values of their 4-bit indices (kvalues_iq4nl; e2m1 doubled, the E8M0 scale
  halved to match: GGML_E8M0_TO_FP32_HALF).
- K-quants and IQ4_XS (256-value super-blocks): the integer dots of the sub-blocks (32 values for Q4_K/Q5_K/IQ4_XS,
  16 for Q2_K/Q3_K/Q6_K) are weighted by their integer sub-block scales into one int32 per super-block, scaled by
  d_w·d_x; Q4_K/Q5_K/Q2_K subtract dmin_w·d_x·Σ_j mn_j·(sum of sub-block j's activation quants), the sums taken from
  Q8_K's bsums as ggml does; Q6_K and Q3_K dot the centred quants (q − 32, q − 4) as
  ggml_vec_dot_q6_K_q8_K_generic and q3_K's do; IQ4_XS dots codebook values under signed 6-bit scales (ls − 32).

Activation formats (ggml's x86 quantize_row_q8_0 / q8_1 per 32 values, quantize_row_q8_K_ref per 256):
  Q8_0/Q8_1: d = amax/127 (float32, stored rounded to fp16), q = rint(x · 127/amax), and for Q8_1 s = fp16(d · Σq)
  from the float32 d. `xd`/`xs` hold those fp16 values widened to float32 (exact), so the kernels need no fp16
  conversion.
  Q8_K: `max` = the value of largest magnitude (the first one), iscale = −127/max, q = min(127, rint(iscale · x)),
  d = 1/iscale (float32, not rounded to fp16), and `xb` the 16 sums of q per 16 consecutive values (bsums, int32
  here where ggml keeps int16: the sums fit either).
Which one a weight type pairs with is ggml's type_traits_cpu[].vec_dot_type.

Order of the quantized activations inside each 32 values: a Q4/Q5/Q6 weight's `qs` plane (quant_layout) puts
elements 2j and 2j+1 of a 32-value group in the low and high nibble of its byte j, so 16 bytes masked with 0x0F are
the even elements and shifted right by 4 the odd ones. The activations are stored in that order ("nibbles": the 16
even elements, then the 16 odd ones) so that the kernel multiplies the 32 unpacked nibbles against 32 consecutive
bytes, with no shuffle in the inner loop. Q8_0 weights keep the natural order. A dot product does not depend on the
order in which its terms are paired, so the results are those of the natural order; Q8_K's bsums are sums of
natural runs (what the sub-block scales and mins apply to), whatever the order of q.

This module is target-independent: `quantize_q8` and `int8_matmul` are plain TE definitions (correct, and slow,
unscheduled). On x86 the schedule rule schedules/cpu/int8_gemv.py replaces the matmul with its kernel, built for
the target's byte dot (`int8_isa`: AVX512-VNNI or AVX-VNNI vpdpbusd, else AVX2's vpmaddubsw + vpmaddwd, as ggml's
mul_sum_us8_pairs_float falls back); `resolve_precision` only picks this path where that rule applies.
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
from luce_compile.lower.quant_matmul import e8m0_half, stored_quant, weight_planes
from luce_compile.targets import sm_version

log = logging.getLogger(__name__)

QK8 = 32  # values per activation block (QK8_0 = QK8_1 in ggml-common.h); also the unit of the "nibbles" order
QK_K = 256  # values per Q8_K block and per K-quant super-block
BSUM = 16  # values per Q8_K block sum (bsums)
INT8_GEMV_ATTR = "luce.int8_gemv"  # marks int8_matmul's PrimFuncs for the schedule rule: value = weight type name
PRECISIONS = ("auto", "int8", "f16", "f32")
Rows = int | tirx.Expr  # rows of activations: 1 (decode1's GEMVs), or the batch of the batched decode (a Var)


@dataclass(frozen=True)
class Q8Format:
    """How one weight type wants its activations: ggml's vec_dot_type, and the order of values in 32."""

    name: str  # "Q8_0", "Q8_1" or "Q8_K"
    order: str  # "natural" or "nibbles" (see the module docstring)
    # Q8_0 activations: also Σq per block (`xi`, int32), so that the kernel dots the stored unsigned quants (Q4_0,
    # Q5_0; Q8_0's w + 128 in the many-row body) and subtracts offset·Σq (the same integer as ggml's Σ(q − offset)·x)
    # instead of moving w's sign onto x per row
    with_isum: bool = False

    @property
    def with_sum(self) -> bool:
        """Q8_1: s = fp16(d·Σq) per block (`xs`)."""
        return self.name == "Q8_1"

    @property
    def with_bsums(self) -> bool:
        """Q8_K: the sums of q per 16 values (`xb`)."""
        return self.name == "Q8_K"

    @property
    def block(self) -> int:
        """Values per scale d."""
        return QK_K if self.name == "Q8_K" else QK8

    def position_element(self, p: tirx.Expr | int) -> tirx.Expr | int:
        """The element (0..31) of a group of 32 that position p (0..31) of the quantized group holds."""
        return p if self.order == "natural" else 2 * (p % 16) + p // 16

    def element_position(self, e: tirx.Expr | int) -> tirx.Expr | int:
        """The inverse: the position (0..31) that element e (0..31) of a group of 32 is stored at."""
        return e if self.order == "natural" else (e % 2) * 16 + e // 2

    def specs(self, n_in: int, rows: Rows = 1) -> dict[str, tuple[tuple[Rows, int], str]]:
        """Name → (shape, dtype) of the quantized tensors xq, xd [, xs] [, xb] of `rows` input rows (one per row,
        as ggml quantizes them): int8_matmul's first arguments."""
        nb = n_in // self.block
        specs = {"xq": ((rows, n_in), "int8"), "xd": ((rows, nb), "float32")}
        if self.with_sum:
            specs["xs"] = ((rows, nb), "float32")
        if self.with_bsums:
            specs["xb"] = ((rows, n_in // BSUM), "int32")
        if self.with_isum:
            specs["xi"] = ((rows, nb), "int32")
        return specs


INT8_FORMATS: dict[GGMLQuantizationType, Q8Format] = {
    GGMLQuantizationType.Q4_0: Q8Format("Q8_0", "nibbles", with_isum=True),
    GGMLQuantizationType.Q4_1: Q8Format("Q8_1", "nibbles"),
    GGMLQuantizationType.Q5_0: Q8Format("Q8_0", "nibbles", with_isum=True),
    GGMLQuantizationType.Q5_1: Q8Format("Q8_1", "nibbles"),
    # Q8_0 also takes Σq (`xi`): the many-row kernel dots w + 128 as its unsigned operand and subtracts 128·Σq
    GGMLQuantizationType.Q8_0: Q8Format("Q8_0", "natural", with_isum=True),
    GGMLQuantizationType.Q4_K: Q8Format("Q8_K", "nibbles"),
    GGMLQuantizationType.Q5_K: Q8Format("Q8_K", "nibbles"),
    GGMLQuantizationType.Q6_K: Q8Format("Q8_K", "nibbles"),
    GGMLQuantizationType.Q2_K: Q8Format("Q8_K", "nibbles"),
    GGMLQuantizationType.Q3_K: Q8Format("Q8_K", "nibbles"),
    GGMLQuantizationType.IQ4_XS: Q8Format("Q8_K", "nibbles"),
    # the codebook types dot signed values (stored_quant gives them) as Q8_0 does, Σq for the many-row body's w + 128
    GGMLQuantizationType.IQ4_NL: Q8Format("Q8_0", "nibbles", with_isum=True),
    GGMLQuantizationType.MXFP4: Q8Format("Q8_0", "nibbles", with_isum=True),
}
# What the integer dot multiplies: the stored quant minus this (ggml's centring of the signed types)
QUANT_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q3_K": 4}
# K-quants whose integer sub-block scale covers 16 values (else 32)
SIXTEENS = ("Q6_K", "Q3_K", "Q2_K")


def superblocked(kind: str) -> bool:
    """Whether a weight type's integer kernel works in 256-value super-blocks (its activations are Q8_K: the
    K-quants and IQ4_XS), else in blocks of 32."""
    return INT8_FORMATS[GGMLQuantizationType[kind]].name == "Q8_K"


def block_scale(kind: str, planes, n: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
    """A weight block's (or super-block's) float32 scale: its fp16 `d`, or MXFP4's E8M0 exponent (halved, as
    GGML_E8M0_TO_FP32_HALF: the codebook holds e2m1 values doubled)."""
    if kind == "MXFP4":
        return e8m0_half(planes["e"][n, b])
    return planes["d"][n, b].astype("float32")


def int8_format(ggml_type: GGMLQuantizationType | str) -> Q8Format | None:
    """The activation format of a weight type with an integer kernel, else None (that type keeps float32)."""
    return INT8_FORMATS.get(as_ggml_type(ggml_type))


# the byte dot products schedules/cpu/int8_gemv.py can emit, best first, with the LLVM features each needs (every
# one also needs AVX2's 256-bit integer ops, FMA and F16C for the fp16 scales)
INT8_ISAS = {
    "avx512vnni": ("avx512vnni", "avx512vl", "avx512bw"),  # vpdpbusd ymm (EVEX): Zen 4, Ice Lake and later Xeons
    "avxvnni": ("avxvnni",),  # the same vpdpbusd, VEX-encoded: Alder Lake and later client cores, Zen 5
    "avx2": (),  # vpmaddubsw + vpmaddwd: Haswell, Zen 1-3
}
BASE_FEATURES = ("avx2", "fma", "f16c")


def int8_isa(target: Target) -> str | None:
    """The best byte dot of INT8_ISAS the llvm target has, or None (no integer kernels there)."""
    if target.kind.name != "llvm" or not codegen.target_has_features(list(BASE_FEATURES), target):
        return None
    return next(isa for isa, features in INT8_ISAS.items()
                if not features or codegen.target_has_features(list(features), target))


def has_tensor_cores(target: Target) -> bool:
    """CUDA sm_70 and later: the WMMA half-precision tensor-core GEMM of schedules/gpu/tensor_gemm.py."""
    return (sm_version(target) or 0) >= 70


def resolve_precision(precision: str, target: Target) -> str:
    """The matmuls' arithmetic. 'auto' → 'int8' on CPUs the integer decode kernels are built for (llama.cpp's 8-bit
    activations), 'f16' on CUDA GPUs with tensor cores (matmuls of more than LOW_BATCH rows take float16 operands,
    float32 sums: prefill, verify, big batches), else 'f32' (exact float32 everywhere, the mode checks use)."""
    if precision not in PRECISIONS:
        raise UnsupportedError(f"lower: precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "int8" and int8_isa(target) is None:
        raise UnsupportedError(
            f"lower: precision int8 needs an x86 CPU target with AVX2, FMA and F16C (AVX-VNNI or AVX512-VNNI "
            f"are faster); {target.kind.name} {target.attrs.get('mcpu', '')} has none. Use "
            "--precision auto or f32."
        )
    if precision == "f16" and not has_tensor_cores(target):
        raise UnsupportedError(f"lower: precision f16 needs a CUDA target with tensor cores (sm_70 or later); "
                               f"{target.kind.name} {target.attrs.get('arch', '')} has none. Use --precision auto "
                               "or f32.")
    if precision != "auto":
        return precision
    isa = int8_isa(target)
    chosen = "int8" if isa else "f16" if has_tensor_cores(target) else "f32"
    log.info("precision auto → %s for %s (int8: x86 with AVX2 or VNNI, here %s; f16: CUDA sm_70+)", chosen,
             target.kind.name, isa)
    return chosen


def _i64(*dims: int | tirx.Expr) -> tuple[tirx.Expr, ...]:
    """Shapes in int64, as Relax writes them (a symbolic row count stays as it is)."""
    return tuple(tirx.IntImm("int64", d) if isinstance(d, int) else d for d in dims)


def _rows(batch: int | str) -> Rows:
    """1, or an int64 Var for a batch known only at run time ("dynamic")."""
    if batch == "dynamic":
        return tirx.Var("rows", "int64")
    if batch != 1:
        raise UnsupportedError(f"lower: int8 kernels take batch 1 or 'dynamic', got {batch!r}")
    return 1


def _f16_round(value: tirx.Expr) -> tirx.Expr:
    """float32 → fp16 → float32: ggml stores d and s as fp16 (round to nearest even, as numpy's astype)."""
    return value.astype("float16").astype("float32")


def _check_n_in(n_in: int, fmt: Q8Format) -> None:
    if n_in <= 0 or n_in % fmt.block:
        raise UnsupportedError(
            f"lower: {fmt.name} activations need n_in a positive multiple of {fmt.block}, got {n_in}"
        )


def _quantize_q8_k(x: te.Tensor, rows: Rows, n_in: int, fmt: Q8Format) -> list[te.Tensor]:
    """quantize_row_q8_K_ref per row: xq (R, n_in) int8 in `fmt.order`, xd (R, n_in/256) float32, xb (R, n_in/16)
    int32."""
    nb = n_in // QK_K
    i = te.reduce_axis(_i64(0, QK_K), name="i")
    amax = te.compute(_i64(rows, nb), lambda r, b: te.max(tirx.abs(x[r, b * QK_K + i]), axis=i), name="amax")
    # ggml keeps the first value of largest magnitude (`if (ax > amax)`), sign included: its index, then its value
    j = te.reduce_axis(_i64(0, QK_K), name="j")
    first = te.compute(
        _i64(rows, nb),
        lambda r, b: te.min(
            tirx.Select(tirx.abs(x[r, b * QK_K + j]) == amax[r, b], j, tirx.IntImm("int64", QK_K)), axis=j
        ),
        name="first",
    )
    iscale = te.compute(
        _i64(rows, nb),
        lambda r, b: tirx.Select(
            amax[r, b] > 0, tirx.const(-127.0, "float32") / x[r, b * QK_K + first[r, b]], tirx.const(0.0, "float32")
        ),
        name="iscale",
    )
    qn = te.compute(
        _i64(rows, n_in),
        lambda r, k: tirx.min(tirx.nearbyint(iscale[r, k // QK_K] * x[r, k]), tirx.const(127.0, "float32")).astype(
            "int8"
        ),
        name="q",
    )
    xq = te.compute(_i64(rows, n_in), lambda r, k: qn[r, k // QK8 * QK8 + fmt.position_element(k % QK8)], name="xq")
    xd = te.compute(
        _i64(rows, nb),
        lambda r, b: tirx.Select(amax[r, b] > 0, tirx.const(1.0, "float32") / iscale[r, b], tirx.const(0.0, "float32")),
        name="xd",
    )
    h = te.reduce_axis(_i64(0, BSUM), name="h")
    xb = te.compute(
        _i64(rows, n_in // BSUM), lambda r, g: te.sum(qn[r, g * BSUM + h].astype("int32"), axis=h), name="xb"
    )
    return [xq, xd, xb]


def quantize_q8(n_in: int, fmt: Q8Format, *, batch: int | str = 1, name: str | None = None) -> tirx.PrimFunc:
    """x (R, n_in) float32 → the tensors of `fmt.specs`, each row on its own: xq (R, n_in) int8 in `fmt.order`,
    xd (R, n_in/block) float32 [, xs (R, n_in/32) float32] [, xb (R, n_in/16) int32]. R = 1 or "dynamic"."""
    _check_n_in(n_in, fmt)
    rows = _rows(batch)
    x = te.placeholder(_i64(rows, n_in), "float32", name="x")
    symbol = name or f"quantize_{fmt.name.lower()}_{fmt.order}_{n_in}" + ("" if rows == 1 else "_batch")
    if fmt.with_bsums:
        return te.create_prim_func([x, *_quantize_q8_k(x, rows, n_in, fmt)]).with_attr("global_symbol", symbol)
    nb = n_in // QK8
    i = te.reduce_axis(_i64(0, QK8), name="i")
    amax = te.compute(_i64(rows, nb), lambda r, b: te.max(tirx.abs(x[r, b * QK8 + i]), axis=i), name="amax")

    def quant(r: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
        b = k // QK8
        a = amax[r, b]
        inv = tirx.Select(a > 0, tirx.const(127.0, "float32") / a, tirx.const(0.0, "float32"))
        return tirx.nearbyint(x[r, b * QK8 + fmt.position_element(k % QK8)] * inv).astype("int8")

    xq = te.compute(_i64(rows, n_in), quant, name="xq")
    xd = te.compute(_i64(rows, nb), lambda r, b: _f16_round(amax[r, b] / tirx.const(127.0, "float32")), name="xd")
    outs = [xq, xd]
    j = te.reduce_axis(_i64(0, QK8), name="j")
    qsum = te.compute(_i64(rows, nb), lambda r, b: te.sum(xq[r, b * QK8 + j].astype("int32"), axis=j), name="xi")
    if fmt.with_sum:
        d32 = lambda r, b: amax[r, b] / tirx.const(127.0, "float32")  # noqa: E731  (s uses the float32 d)
        outs.append(
            te.compute(_i64(rows, nb), lambda r, b: _f16_round(d32(r, b) * qsum[r, b].astype("float32")), name="xs")
        )
    if fmt.with_isum:
        outs.append(qsum)
    return te.create_prim_func([x, *outs]).with_attr("global_symbol", symbol)


def _f32(value: tirx.Expr) -> tirx.Expr:
    return value.astype("float32")


def int8_matmul(
    ggml_type: GGMLQuantizationType | str, n_out: int, n_in: int, *, batch: int | str = 1, name: str | None = None
) -> tirx.PrimFunc:
    """y (R, n_out) = llama.cpp's vec_dot of each weight row with each row of quantized activations (module
    docstring): PrimFunc(xq, xd, [xs], [xb], *planes, y); R = batch, 1 or "dynamic".

    Reductions: "block_dot" (int32 per 32 values, 16 for Q6_K); for the K-quants "superblock_dot" (int32, the
    sub-block scales) and, for Q4_K/Q5_K, "superblock_min" (int32, the mins times the bsums); then "scale_sum"
    (float32 over the blocks or super-blocks)."""
    qtype, fmt = checked_int8_type(ggml_type, n_in)
    rows = _rows(batch)
    acts = {
        name: te.placeholder(_i64(*shape), dtype, name=name) for name, (shape, dtype) in fmt.specs(n_in, rows).items()
    }
    planes = weight_planes(qtype, n_out, n_in)
    y = int8_dot(qtype, acts, planes, rows, n_out, n_in)
    args = [*acts.values(), *planes.values(), y]
    kind = "gemv" if rows == 1 else "gemm"
    symbol = name or f"int8_{kind}_{qtype.name.lower()}_{n_out}x{n_in}"
    return te.create_prim_func(args).with_attr("global_symbol", symbol).with_attr(INT8_GEMV_ATTR, qtype.name)


def checked_int8_type(ggml_type: GGMLQuantizationType | str, n_in: int) -> tuple[GGMLQuantizationType, Q8Format]:
    qtype = as_ggml_type(ggml_type)
    fmt = int8_format(qtype)
    if fmt is None:
        raise UnsupportedError(f"lower: no integer kernel for {qtype.name}; types: {[t.name for t in INT8_FORMATS]}")
    _check_n_in(n_in, fmt)
    return qtype, fmt


def _activation_row(r: tirx.Expr) -> tirx.Expr:
    return r


def _weight_row(r: tirx.Expr, n: tirx.Expr) -> tirx.Expr:
    return n


def int8_dot(qtype: GGMLQuantizationType, acts: dict[str, te.Tensor], planes: dict[str, te.Tensor], rows: Rows,
             n_out: int, n_in: int, xrow: Callable = _activation_row, wrow: Callable = _weight_row) -> te.Tensor:
    """The TE stages of int8_matmul, y (rows, n_out): output row r dots activation row xrow(r) with weight row
    wrow(r, n) (the identities for a matmul; lower/moe.py's expert matmuls gather rows by the router's choice)."""
    fmt = int8_format(qtype)
    xq, xd = acts["xq"], acts["xd"]
    offset = QUANT_OFFSET.get(qtype.name, 0)
    dot = BSUM if qtype.name in SIXTEENS else QK8  # values per integer dot (per sub-block scale for K-quants)

    def position(k: tirx.Expr) -> tirx.Expr:
        return k // QK8 * QK8 + fmt.element_position(k % QK8)

    centred = 0
    if fmt.with_isum:  # Σ q·x − offset·Σx: the integer of Σ (q − offset)·x (Q8_0: offset 0)
        centred, offset = offset, 0
    i = te.reduce_axis(_i64(0, dot), name="i")
    isum = te.compute(
        _i64(rows, n_out, n_in // dot),
        lambda r, n, b: te.sum(
            (stored_quant(qtype, planes, wrow(r, n), b * dot + i) - offset)
            * xq[xrow(r), position(b * dot + i)].astype("int32"),
            axis=i,
        ),
        name="block_dot",
    )
    if centred:
        isum = te.compute(
            _i64(rows, n_out, n_in // dot),
            lambda r, n, b: isum[r, n, b] - centred * acts["xi"][xrow(r), b],
            name="centred_dot",
        )
    if fmt.with_bsums:
        per = QK_K // dot
        j = te.reduce_axis(_i64(0, per), name="j")
        isum = te.compute(
            _i64(rows, n_out, n_in // QK_K),
            lambda r, n, s: te.sum(planes["sc"][wrow(r, n), s * per + j].astype("int32") * isum[r, n, s * per + j],
                                   axis=j),
            name="superblock_dot",
        )
    if "mn" in planes:  # Σ_j mn_j · Σ q_x over sub-block j (32 values: two bsums; Q2_K's 16: one)
        xb, per_min = acts["xb"], QK_K // dot
        j = te.reduce_axis(_i64(0, per_min), name="jm")

        def bsum(r: tirx.Expr, g: tirx.Expr) -> tirx.Expr:
            return xb[xrow(r), g] if dot == BSUM else xb[xrow(r), 2 * g] + xb[xrow(r), 2 * g + 1]

        imin = te.compute(
            _i64(rows, n_out, n_in // QK_K),
            lambda r, n, s: te.sum(
                planes["mn"][wrow(r, n), s * per_min + j].astype("int32") * bsum(r, s * per_min + j), axis=j
            ),
            name="superblock_min",
        )

    def term(r: tirx.Expr, n: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
        w, x = wrow(r, n), xrow(r)
        value = xd[x, b] * block_scale(qtype.name, planes, w, b) * _f32(isum[r, n, b])
        if fmt.with_sum:
            return value + _f32(planes["m"][w, b]) * acts["xs"][x, b]
        if "mn" in planes:
            return value - xd[x, b] * _f32(planes["dmin"][w, b]) * _f32(imin[r, n, b])
        return value

    j = te.reduce_axis(_i64(0, n_in // fmt.block), name="j")
    return te.compute(_i64(rows, n_out), lambda r, n: te.sum(term(r, n, j), axis=j), name="scale_sum")


class _Module(Protocol):
    """What `int8_linear` needs of relax_model.GraphModule (not imported: relax_model imports this module)."""

    graph: Any

    def _kernel(self, key: tuple, make: Callable[[], tirx.PrimFunc]) -> tirx.PrimFunc: ...

    def _planes(self, tensor: str) -> list[nn.Tensor]: ...


def _int8_rows(x: nn.Tensor) -> Rows | None:
    """The rows of an input whose leading dims are all 1 but at most one, that one (static or a Var), else None
    (the float32 kernels): decode1's static 1, decode's batch B of (B, 1, K), prefill's and verify's token count S
    of (1, S, K), and the LM head's (N, K) (prefill's logit rows, or decode's B). Since issue 13's prefill part,
    prefill takes the int8 kernels too, as llama.cpp's prompt processing quantizes its activations to 8 bits."""
    lead = x.shape[:-1]
    wide = [d for d in lead if not (isinstance(d, int) and d == 1)]
    if not wide:
        return 1
    if len(wide) == 1 and isinstance(wide[0], (tirx.Var, int)):
        return wide[0]
    return None


def int8_linear(m: _Module, x: nn.Tensor, tensor: str, cache: dict) -> nn.Tensor | None:
    """x (..., K) float32 @ Wᵀ → (..., N) with 8-bit activations, or None where this path does not apply: the input
    has more than one wide leading dim (`_int8_rows`; decode, prefill and verify all take it), or the weight type has
    no integer kernel. A lone and a batched sequence get the same arithmetic: each row is quantized on its own and
    the batched kernel runs the GEMV's sums row by row. `cache` maps an input already quantized in a
    format to its quantized tensors, so the Q/K/V (and gate/up) matmuls of one input quantize it once; it is keyed
    by the input tensor, and each value keeps that tensor alive so that its id cannot be taken by another tensor
    meanwhile."""
    info = m.graph.weights[tensor]
    fmt = int8_format(info.ggml_type)
    n, k = info.shape
    rows = _int8_rows(x) if fmt is not None and x.dtype == "float32" else None
    if rows is None:
        return None
    batch = 1 if rows == 1 else "dynamic"
    key = (id(x), fmt)
    if key not in cache:
        quantize = m._kernel(("q8", fmt, k, batch), lambda: quantize_q8(k, fmt, batch=batch))
        outs = [nn.Tensor.placeholder(shape, dtype) for shape, dtype in fmt.specs(k, rows).values()]
        x2 = op.reshape(x, (rows, k))
        cache[key] = (x, op.tensor_ir_op(quantize, quantize.attrs["global_symbol"], [x2], outs))
    quantized = list(cache[key][1])
    func = m._kernel(("int8mm", info.ggml_type, n, k, batch), lambda: int8_matmul(info.ggml_type, n, k, batch=batch))
    out = nn.Tensor.placeholder((rows, n), "float32")
    y = op.tensor_ir_op(func, func.attrs["global_symbol"], [*quantized, *m._planes(tensor)], out)
    return op.reshape(y, (*x.shape[:-1], n))
