"""Fused dequantize + matmul PrimFuncs for every GGUF weight type, target-independent (schedules are separate rules).

`quant_matmul` computes y[b, n] = Σ_k x[b, k] · dequant(W)[n, k], i.e. y = x @ Wᵀ for W of shape (n_out, n_in):
exactly ggml_mul_mat(W, x). It reads the planes of `quant_layout.repack` and accumulates in float32.

The IR has two blocks, the shape MLC-LLM's quantized matmuls have and dlight's rules expect:
  "dequantize"  W[n, k] = <per-type expression of the planes>          (spatial, injective)
  "matmul"      y[b, n] += float32(x[b, k]) * W[n, k]                    (reduction over k; vector operand first)
  ["cast"       out[b, n] = out_dtype(y[b, n])]                          (only when out_dtype is not float32)
A schedule inlines "dequantize" into the reduction (GEMV: no float copy of W ever exists) or computes it per tile
(GEMM: one dequantized tile is reused by every row of x). Unscheduled, the function is correct but materializes W.

Each type's dequantization is written once (`_DEQUANT`) as a TIR expression of (planes, n, k), in the float32
operation order of gguf-py's dequantize_blocks (ggml's dequantize_row_*), and shared by the matmul and the
embedding gather.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from gguf import GGMLQuantizationType
from tvm import te, tirx

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.quants import KVALUES_IQ4NL, KVALUES_MXFP4
from luce_compile.lower.quant_layout import as_ggml_type, plane_specs

Planes = Mapping[str, te.Tensor]
IntToFloat = Callable[[tirx.Expr], tirx.Expr]
Dequant = Callable[[Planes, tirx.Expr, tirx.Expr, IntToFloat], tirx.Expr]
FLOAT_DTYPES = ("float32", "float16")
# attr of a float32 dynamic-batch matmul carrying its float16 twin (the same signature): the GPU schedule runs the
# twin on tensor cores above the low-batch buckets and the float32 function below (schedules/gpu/quant_gemm.py)
TENSOR_CORE_TWIN = "luce.tensor_core_twin"
# attr of the twin naming its GGML weight type: the hand tensor-core kernel (schedules/gpu/mma_gemm.py) is generated
# from the type, not from the twin's body
GGML_TYPE_ATTR = "luce.ggml_type"


def _f32(value: tirx.Expr) -> tirx.Expr:
    return value.astype("float32")


def exact_int_to_float(value: tirx.Expr) -> tirx.Expr:
    """float32(value) for a small integer (|value| < 2**22) without an int→float conversion instruction: the
    integer added to the bits of 1.5·2**23 is that float's mantissa, and subtracting 1.5·2**23 is exact. On GPUs
    the conversion runs at a quarter of the FMA rate and bounds a dequantizing GEMV's inner loop; this is an
    integer add and a float add, both full rate, and bit-identical."""
    return tirx.reinterpret("float32", value.astype("int32") + tirx.const(0x4B400000, "int32")) - tirx.const(
        12582912.0, "float32")


def _u32(value: int) -> tirx.Expr:
    return tirx.const(value, "uint32")


def _field(word: tirx.Expr, index: tirx.Expr, bits: int) -> tirx.Expr:
    """Field `index` of `bits` bits in a uint32 word, as int32 (the fields are small: int32 converts to float
    in one instruction where uint32 takes several on x86)."""
    shift = (index * bits).astype("uint32")
    return ((word >> shift) & _u32((1 << bits) - 1)).astype("int32")


def _q4(planes: Planes, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """The low 4 bits of element k (`qs`: 8 per word)."""
    return _field(planes["qs"][n, k // 8], k % 8, 4)


def _q5(planes: Planes, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """The 5-bit quant of element k: 4 bits from `qs`, the fifth from `qh` (32 per word)."""
    return _q4(planes, n, k) | (_field(planes["qh"][n, k // 32], k % 32, 1) << 4)


def _q6(planes: Planes, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """Q6_K's 6-bit quant of element k: 4 low bits from `qs`, 2 high bits from `qh` (16 per word)."""
    return _q4(planes, n, k) | (_field(planes["qh"][n, k // 16], k % 16, 2) << 4)


def _q2(planes: Planes, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """Q2_K's quant of element k, and Q3_K's low 2 bits: `qs` with 16 per word, in quant_layout's slot order (element
    e of a group of 32 is at position p = 16·(e % 2) + e // 2, in slot 4·(p % 8) + p // 8)."""
    e = k % 32
    p = (e % 2) * 16 + e // 2
    slot = (p % 8) * 4 + p // 8
    return _field(planes["qs"][n, k // 32 * 2 + slot // 16], slot % 16, 2)


def _q3(planes: Planes, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """Q3_K's stored 3-bit quant (the value plus 4): 2 low bits from `qs`, the third from `qh` (32 per word)."""
    return _q2(planes, n, k) | (_field(planes["qh"][n, k // 32], k % 32, 1) << 2)


def table_words(values: list[int]) -> list[int]:
    """16 int8 codebook values as four little-endian uint32 words (entry i in byte i % 4 of word i // 4)."""
    raw = bytes(v & 0xFF for v in values)
    return [int.from_bytes(raw[4 * w:4 * w + 4], "little") for w in range(4)]


# the codebooks of gguf/quants.py as words: a 16-entry lookup is two selects, a shift and a sign extension, in TIR
# that vectorizes (x86) and needs no table in memory (GPUs)
CODEBOOKS = {"IQ4_NL": [int(v) for v in KVALUES_IQ4NL], "IQ4_XS": [int(v) for v in KVALUES_IQ4NL],
             "MXFP4": [int(v) for v in KVALUES_MXFP4]}


def codebook_value(name: str, index: tirx.Expr) -> tirx.Expr:
    """The signed codebook entry (int32) at a 4-bit index (int32 0..15) of IQ4_NL/IQ4_XS/MXFP4."""
    words = [_u32(w) for w in table_words(CODEBOOKS[name])]
    half = index >> 3  # the 8 entries of words 0-1 or 2-3
    lo = tirx.Select(half == 0, words[0], words[2])
    hi = tirx.Select(half == 0, words[1], words[3])
    word = tirx.Select((index & 4) == 0, lo, hi)
    byte = (word >> ((index & 3) * 8).astype("uint32")) & _u32(0xFF)
    return byte.astype("uint8").astype("int8").astype("int32")


def codebook_word(name: str, word: tirx.Expr) -> tirx.Expr:
    """Four 4-bit indices, one in the low bits of each byte of a uint32, as the uint32 of their four signed codebook
    entries (a byte each, the first lowest): codebook_value a byte, where no byte permute does it at once."""
    out = _u32(0)
    for i in range(4):
        value = codebook_value(name, ((word >> _u32(8 * i)) & _u32(0xF)).astype("int32"))
        out = out | ((value.astype("uint32") & _u32(0xFF)) << _u32(8 * i))
    return out


def table16_bytes(indices, words, perm, mask):
    """The word whose byte i is entry `indices`' byte i (an index 0-15) of a 16-byte table held in four words (entry
    j in byte j % 4 of words[j // 4]), by three byte permutes, as llama.cpp's get_int_from_table_16: the indices'
    nibbles packed into a 16-bit selector, entries 0-7 and 8-15 permuted from their two words each, then each byte
    taken from the one its index's bit 3 picks. `perm(x, y, s)` is CUDA's __byte_perm (byte i of the result: byte
    s<4i+2:4i> of y:x); `mask(v)` a constant of the arithmetic's type. Written over operators alone, so that a
    test runs it on Python ints with an emulated permute."""
    packed = indices | (indices >> mask(4))  # byte 0: i0 | i1 << 4; byte 2: i2 | i3 << 4
    selector = (packed & mask(0xFF)) | ((packed >> mask(8)) & mask(0xFF00))
    low = perm(words[0], words[1], selector)
    high = perm(words[2], words[3], selector)
    return perm(low, high, mask(0x3210) | ((selector & mask(0x8888)) >> mask(1)))


def byte_perm(x: tirx.Expr, y: tirx.Expr, s: tirx.Expr) -> tirx.Expr:
    """CUDA's __byte_perm of uint32s (table16_bytes' permute; no other target has it: the megakernel's ROCm body and
    the CPU take codebook_word)."""
    return tirx.call_pure_extern("uint32", "__byte_perm", x, y, s)


def e8m0_half(e: tirx.Expr) -> tirx.Expr:
    """GGML_E8M0_TO_FP32_HALF of a uint8 exponent: 2^(e − 128) as float32 (subnormal for e < 2), by its bits."""
    e32 = e.astype("uint32")
    bits = tirx.Select(e32 < _u32(2), _u32(0x00200000) << e32, (e32 - _u32(1)) << _u32(23))
    return tirx.reinterpret("float32", bits)


def stored_quant(ggml_type: GGMLQuantizationType | str, planes: Planes, n: tirx.Expr, k: tirx.Expr) -> tirx.Expr:
    """The integer quant of element (n, k) as stored (int32; Q2..Q6 unsigned, before any offset, Q8_0 signed; the
    codebook types' signed codebook value): what the dequantizers scale and the integer dot products of
    lower/cpu_int8.py multiply."""
    name = as_ggml_type(ggml_type).name
    if name == "Q8_0":
        return planes["qs"][n, k].astype("int32")
    if name == "Q6_K":
        return _q6(planes, n, k)
    if name in ("Q2_K", "Q3_K"):
        return _q2(planes, n, k) if name == "Q2_K" else _q3(planes, n, k)
    if name in CODEBOOKS:  # the signed codebook value (what the dot products multiply), not the index
        return codebook_value(name, _q4(planes, n, k))
    return _q5(planes, n, k) if name.startswith("Q5") else _q4(planes, n, k)


def _dequant_q8_0(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return itof(p["qs"][n, k]) * _f32(p["d"][n, k // 32])


def _dequant_q4_0(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _f32(p["d"][n, k // 32]) * itof(_q4(p, n, k) - 8)


def _dequant_q4_1(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _f32(p["d"][n, k // 32]) * itof(_q4(p, n, k)) + _f32(p["m"][n, k // 32])


def _dequant_q5_0(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _f32(p["d"][n, k // 32]) * itof(_q5(p, n, k) - 16)


def _dequant_q5_1(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _f32(p["d"][n, k // 32]) * itof(_q5(p, n, k)) + _f32(p["m"][n, k // 32])


def _k_quant(p: Planes, n: tirx.Expr, k: tirx.Expr, q: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    """Q4_K/Q5_K: (d·sc) · q − dmin·mn, with sc/mn the 6-bit scale and min of k's 32-element sub-block."""
    scale = _f32(p["d"][n, k // 256]) * itof(p["sc"][n, k // 32])
    offset = _f32(p["dmin"][n, k // 256]) * itof(p["mn"][n, k // 32])
    return scale * itof(q) - offset


def _dequant_q4_k(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _k_quant(p, n, k, _q4(p, n, k), itof)


def _dequant_q5_k(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _k_quant(p, n, k, _q5(p, n, k), itof)


def _dequant_q6_k(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    """Q6_K: (d·sc) · (q − 32), q = 4 low bits from `qs` | 2 high bits from `qh` (16 per word), sc per 16."""
    return (_f32(p["d"][n, k // 256]) * itof(p["sc"][n, k // 16])) * itof(_q6(p, n, k) - 32)


def _dequant_q2_k(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    """Q2_K: (d·sc) · q − dmin·mn, with the 4-bit sc/mn of k's 16-element sub-block."""
    scale = _f32(p["d"][n, k // 256]) * itof(p["sc"][n, k // 16])
    offset = _f32(p["dmin"][n, k // 256]) * itof(p["mn"][n, k // 16])
    return scale * itof(_q2(p, n, k)) - offset


def _dequant_q3_k(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    """Q3_K: (d·(sc − 32)) · (q − 4); `sc` holds sc − 32 already."""
    return (_f32(p["d"][n, k // 256]) * itof(p["sc"][n, k // 16])) * itof(_q3(p, n, k) - 4)


def _dequant_iq4_nl(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return _f32(p["d"][n, k // 32]) * itof(codebook_value("IQ4_NL", _q4(p, n, k)))


def _dequant_iq4_xs(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    """IQ4_XS: (d·(ls − 32)) · kvalues_iq4nl[q]; `sc` holds ls − 32 per 32 values."""
    return (_f32(p["d"][n, k // 256]) * itof(p["sc"][n, k // 32])) * itof(codebook_value("IQ4_XS", _q4(p, n, k)))


def _dequant_mxfp4(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    return itof(codebook_value("MXFP4", _q4(p, n, k))) * e8m0_half(p["e"][n, k // 32])


def _dequant_bf16(p: Planes, n: tirx.Expr, k: tirx.Expr, itof: IntToFloat) -> tirx.Expr:
    """BF16 is the top half of a float32: shift the stored bits up and reinterpret."""
    return tirx.reinterpret("float32", p["w"][n, k].astype("uint32") << _u32(16))


_DEQUANT: dict[GGMLQuantizationType, Dequant] = {
    GGMLQuantizationType.F32: lambda p, n, k, itof: p["w"][n, k],
    GGMLQuantizationType.F16: lambda p, n, k, itof: _f32(p["w"][n, k]),
    GGMLQuantizationType.BF16: _dequant_bf16,
    GGMLQuantizationType.Q8_0: _dequant_q8_0,
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: _dequant_q4_1,
    GGMLQuantizationType.Q5_0: _dequant_q5_0,
    GGMLQuantizationType.Q5_1: _dequant_q5_1,
    GGMLQuantizationType.Q4_K: _dequant_q4_k,
    GGMLQuantizationType.Q5_K: _dequant_q5_k,
    GGMLQuantizationType.Q6_K: _dequant_q6_k,
    GGMLQuantizationType.Q2_K: _dequant_q2_k,
    GGMLQuantizationType.Q3_K: _dequant_q3_k,
    GGMLQuantizationType.IQ4_NL: _dequant_iq4_nl,
    GGMLQuantizationType.IQ4_XS: _dequant_iq4_xs,
    GGMLQuantizationType.MXFP4: _dequant_mxfp4,
}


def dequant_expr(ggml_type: GGMLQuantizationType | str, planes: Planes, n: tirx.Expr, k: tirx.Expr,
                 int_to_float: IntToFloat = _f32) -> tirx.Expr:
    """The float32 value of element (n, k) of a repacked weight, as a TIR expression of its planes;
    `int_to_float` converts the integer quants (exact_int_to_float on GPUs: the same values, fewer cycles)."""
    return _DEQUANT[as_ggml_type(ggml_type)](planes, n, k, int_to_float)


def _i64(*dims: int | tirx.Expr) -> tuple[tirx.Expr, ...]:
    """Shapes in int64, as Relax writes them: one index type in every buffer access (NarrowDataType narrows later)."""
    return tuple(tirx.IntImm("int64", d) if isinstance(d, int) else d for d in dims)


def weight_planes(ggml_type: GGMLQuantizationType | str, n_out: int, n_in: int) -> dict[str, te.Tensor]:
    """One placeholder per plane of `plane_specs`, named after the plane (the kernel's argument order)."""
    specs = plane_specs(ggml_type, n_out, n_in)
    return {name: te.placeholder(_i64(*shape), dtype, name=name) for name, (shape, dtype) in specs.items()}


def _check_dtype(role: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedError(f"lower: {role} must be one of {FLOAT_DTYPES}, got {dtype!r}")


def _extent(role: str, value: int | Literal["dynamic"]) -> tirx.Expr | int:
    """A fixed extent, or an int64 symbolic one (Relax binds shape variables as int64)."""
    if value == "dynamic":
        return tirx.Var(role, "int64")
    if not isinstance(value, int) or value <= 0:
        raise UnsupportedError(f"lower: {role} must be a positive int or 'dynamic', got {value!r}")
    return value


def quant_matmul(
    ggml_type: GGMLQuantizationType | str,
    n_out: int,
    n_in: int,
    *,
    batch: int | Literal["dynamic"] = "dynamic",
    x_dtype: str = "float32",
    out_dtype: str = "float32",
    compute_dtype: str = "float32",
    name: str | None = None,
    scratch: Mapping[str, tuple[tuple, str]] | None = None,
) -> tirx.PrimFunc:
    """y = x @ dequant(W)ᵀ: PrimFunc(x (batch, n_in), *planes, y (batch, n_out)); batch=1 is the GEMV (decode).

    compute_dtype="float16" rounds both operands to half precision before the float32 sums (an "x_half" block
    casts x; "dequantize" writes float16): the form tensor cores multiply (schedules/gpu/tensor_gemm.py).
    `scratch`: name → ((rows, columns), dtype) of more arguments after y that the computation does not use (a
    string rows is the batch), which a kernel scheduled for the function may write: the 8-bit GEMM's quantized input
    (lower/q8_gemm.py)."""
    qtype = as_ggml_type(ggml_type)
    _check_dtype("x_dtype", x_dtype)
    _check_dtype("out_dtype", out_dtype)
    _check_dtype("compute_dtype", compute_dtype)
    planes = weight_planes(qtype, n_out, n_in)
    rows = _extent("batch", batch)
    x = te.placeholder(_i64(rows, n_in), x_dtype, name="x")
    if compute_dtype == "float16":
        x_in = te.compute(_i64(rows, n_in), lambda b, k: x[b, k].astype("float16"), name="x_half")
        w = te.compute(_i64(n_out, n_in), lambda n, k: dequant_expr(qtype, planes, n, k).astype("float16"),
                       name="dequantize")
    else:
        x_in = x
        w = te.compute(_i64(n_out, n_in), lambda n, k: dequant_expr(qtype, planes, n, k), name="dequantize")
    k = te.reduce_axis(_i64(0, n_in), name="k")
    y = te.compute(_i64(rows, n_out), lambda b, n: te.sum(_f32(x_in[b, k]) * _f32(w[n, k]), axis=k), name="matmul")
    if out_dtype != "float32":
        y = te.compute(_i64(rows, n_out), lambda b, n: y[b, n].astype(out_dtype), name="cast")
    kind = "gemv" if batch == 1 else f"gemm{'' if batch == 'dynamic' else batch}"
    symbol = name or f"quant_matmul_{qtype.name.lower()}_{n_out}x{n_in}_{kind}"
    extra = [te.placeholder(_i64(rows if isinstance(r, str) else r, c), dtype, name=arg)
             for arg, ((r, c), dtype) in (scratch or {}).items()]
    return te.create_prim_func([x, *planes.values(), y, *extra]).with_attr("global_symbol", symbol)


def with_tensor_core_twin(func: tirx.PrimFunc, ggml_type: GGMLQuantizationType | str, n_out: int, n_in: int, *,
                          x_dtype: str = "float32", out_dtype: str = "float32") -> tirx.PrimFunc:
    """func (quant_matmul's dynamic-batch form) with its float16 twin attached as TENSOR_CORE_TWIN."""
    twin = quant_matmul(ggml_type, n_out, n_in, x_dtype=x_dtype, out_dtype=out_dtype, compute_dtype="float16",
                        name=f"{func.attrs['global_symbol']}_half")
    return func.with_attr(TENSOR_CORE_TWIN, twin.with_attr(GGML_TYPE_ATTR, as_ggml_type(ggml_type).name))


def quant_embedding(
    ggml_type: GGMLQuantizationType | str,
    n_vocab: int,
    n_embd: int,
    *,
    n_tokens: int | Literal["dynamic"] = "dynamic",
    out_dtype: str = "float32",
    name: str | None = None,
) -> tirx.PrimFunc:
    """Rows of a quantized (n_vocab, n_embd) table by token id: PrimFunc(ids (n_tokens,) int32, *planes, out)."""
    qtype = as_ggml_type(ggml_type)
    _check_dtype("out_dtype", out_dtype)
    planes = weight_planes(qtype, n_vocab, n_embd)
    tokens = _extent("n_tokens", n_tokens)
    ids = te.placeholder(_i64(tokens), "int32", name="ids")
    out = te.compute(
        _i64(tokens, n_embd),
        lambda t, k: dequant_expr(qtype, planes, ids[t].astype("int64"), k).astype(out_dtype),
        name="embedding",
    )
    symbol = name or f"quant_embedding_{qtype.name.lower()}_{n_vocab}x{n_embd}"
    return te.create_prim_func([ids, *planes.values(), out]).with_attr("global_symbol", symbol)
