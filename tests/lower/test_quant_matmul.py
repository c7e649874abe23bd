"""The repacked weight layout is lossless and the dequantize expressions equal gguf-py's dequantizer bit for bit.

Inputs are random raw GGUF blocks drawn fresh on every run (seed printed, so a failure can be replayed): random
bytes cover every bit pattern of the quants and the 6-bit scales, with finite random fp16 scale fields. The
schedules' numeric checks (GEMV/GEMM against a float64 reference) live in tests/schedules/test_cpu_quant_matmul.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.lower.quant_layout import SUPPORTED_TYPES, plane_specs, repack
from luce_compile.lower.quant_matmul import (
    TENSOR_CORE_TWIN,
    dequant_expr,
    exact_int_to_float,
    quant_embedding,
    quant_matmul,
    weight_planes,
    with_tensor_core_twin,
)

TYPES = [t.name for t in SUPPORTED_TYPES]
# Byte offsets of the fp16 scale fields in each block (ggml-common.h): random bytes there could be inf/NaN.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}
FP16_FIELDS |= {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,),
                "IQ4_XS": (0,), "MXFP4": ()}  # MXFP4's E8M0 byte: E8M0_FIELD


def random_raw(name: str, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw GGUF rows (uint8, (n_out, row_bytes)) of type `name` with finite, varied fp16 scales."""
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((n_out, n_in)).astype(np.float32)
        if name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16 if name == "F16" else np.float32).view(np.uint8)
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, (n_out, n_in // block, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        scales = (rng.uniform(-1, 1, raw.shape[:2]) * 2.0 ** rng.integers(-10, -2, raw.shape[:2])).astype(np.float16)
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    if name == "MXFP4":  # every E8M0 byte is a finite scale, but one past 2^100 overflows a dot: 2^-10 .. 2^-3 here
        raw[..., 0] = rng.integers(118, 126, raw.shape[:2])
    return raw.reshape(n_out, -1)


def reference_dequant(raw: np.ndarray, name: str) -> np.ndarray:
    """gguf-py's dequantizer (independent of ours) as float32 (n_out, n_in); BF16 as the top half of a float32."""
    if name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return gguf_quants.dequantize(raw, GGMLQuantizationType[name]).reshape(raw.shape[0], -1)


def run_func(func: tvm.tirx.PrimFunc, *arrays: np.ndarray, out_shape: tuple[int, ...], out_dtype: str) -> np.ndarray:
    """Compile `func` for the plain llvm target and call it on numpy arrays; returns the output array."""
    ex = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype))
    ex["main"](*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays), out)
    return out.numpy()


# ---- the layout ---------------------------------------------------------------------------------------------------


def _words_to_fields(words: np.ndarray, bits: int) -> np.ndarray:
    """(n_out, W) uint32 → (n_out, W*32/bits) uint8: field i of each word at bits bits*i (the planes' order)."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8).reshape(words.shape[0], -1)


def _runs_to_bytes(values: np.ndarray, span: int) -> np.ndarray:
    """Inverse of GGUF's nibble runs: per 2*span elements, byte l = element l | element (l + span) << 4."""
    runs = values.reshape(*values.shape[:-1], -1, 2, span)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*values.shape[:-1], -1)


def _bits_to_bytes(values: np.ndarray, span: int, bits: int) -> np.ndarray:
    """Inverse of the K-quant high bits: byte l of a run holds element l + span*i at bits [bits*i, bits*(i+1))."""
    runs = values.reshape(*values.shape[:-1], -1, 8 // bits, span).astype(np.uint8)
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1)
    return np.bitwise_or.reduce(runs << shifts, axis=-2).reshape(*values.shape[:-1], -1)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of get_scale_min_k4: 8 six-bit scales and 8 mins → the 12 packed bytes."""
    lo_d = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    lo_m = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    return np.concatenate([lo_d, lo_m, (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], axis=-1)


def _two_bit_elements(slots: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K `qs` slots → element order: per group of 32, byte j's field f (slot 4j + f) is the kernels' position
    8f + j, which holds element 2·(p % 16) + p // 16."""
    by_byte = slots.reshape(*slots.shape[:-1], -1, 8, 4)  # (..., group, j, f)
    positions = np.swapaxes(by_byte, -1, -2).reshape(*slots.shape[:-1], -1, 32)  # (..., group, p = 8f + j)
    elements = np.empty_like(positions)
    elements[..., [2 * (p % 16) + p // 16 for p in range(32)]] = positions
    return elements.reshape(slots.shape)


def raw_from_planes(planes: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Rebuild the raw GGUF rows from the planes, written from ggml-common.h independently of `repack`."""
    if name in ("F32", "F16", "BF16"):
        return planes["w"].view(np.uint8)
    n_out, n_blocks = planes["e" if name == "MXFP4" else "d"].shape

    def as_bytes(key: str) -> np.ndarray:  # a plane's bytes per block, (n_out, n_blocks, bytes)
        return np.ascontiguousarray(planes[key]).view(np.uint8).reshape(n_out, n_blocks, -1)

    def fields(key: str, bits: int) -> np.ndarray:  # a packed plane's elements per block, (n_out, n_blocks, E)
        return _words_to_fields(planes[key], bits).reshape(n_out, n_blocks, -1)

    if name == "Q8_0":
        parts = [as_bytes("d"), as_bytes("qs")]
    elif name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # d, [m], [qh], qs
        parts = [as_bytes(k) for k in ("d", "m", "qh") if k in planes] + [_runs_to_bytes(fields("qs", 4), 16)]
    elif name in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], [qh[32]], qs[128]
        sc, mn = (planes[k].reshape(n_out, n_blocks, 8) for k in ("sc", "mn"))
        parts = [as_bytes("d"), as_bytes("dmin"), _k_scale_bytes(sc, mn)]
        if "qh" in planes:
            parts.append(_bits_to_bytes(fields("qh", 1), 32, 1))
        parts.append(_runs_to_bytes(fields("qs", 4), 32))
    elif name == "Q6_K":  # ql[128], qh[64], scales[16], d
        ql, qh = _runs_to_bytes(fields("qs", 4), 64), _bits_to_bytes(fields("qh", 2), 32, 2)
        parts = [ql, qh, as_bytes("sc"), as_bytes("d")]
    elif name == "Q2_K":  # scales[16] (scale | min << 4), qs[64] (2 bits in 32-byte runs), d, dmin
        scales = planes["sc"].reshape(n_out, n_blocks, 16) | (planes["mn"].reshape(n_out, n_blocks, 16) << 4)
        parts = [scales, _bits_to_bytes(_two_bit_elements(fields("qs", 2)), 32, 2), as_bytes("d"), as_bytes("dmin")]
    elif name == "Q3_K":  # hmask[32], qs[64], scales[12], d
        u = (planes["sc"].reshape(n_out, n_blocks, 16).astype(np.int16) + 32).astype(np.uint8)  # 6-bit scales
        low = (u[..., 0:8] & 0x0F) | ((u[..., 8:16] & 0x0F) << 4)
        high = np.bitwise_or.reduce((u >> 4).reshape(n_out, n_blocks, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[
            :, None], axis=-2)  # byte 8 + m: bits 2i of scale 4i + m
        parts = [_bits_to_bytes(fields("qh", 1), 32, 1), _bits_to_bytes(_two_bit_elements(fields("qs", 2)), 32, 2),
                 low, high, as_bytes("d")]
    elif name == "IQ4_XS":  # d, scales_h (u16: 2 bits per sub-block), scales_l[4] (nibbles), qs[128]
        u = (planes["sc"].reshape(n_out, n_blocks, 8).astype(np.int16) + 32).astype(np.uint16)
        h = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1).astype("<u2")
        low = ((u[..., 0::2] & 0x0F) | ((u[..., 1::2] & 0x0F) << 4)).astype(np.uint8)
        parts = [as_bytes("d"), h[..., None].view(np.uint8), low, _runs_to_bytes(fields("qs", 4), 16)]
    else:  # IQ4_NL (d, qs[16]) and MXFP4 (e, qs[16])
        parts = [as_bytes("e" if name == "MXFP4" else "d"), _runs_to_bytes(fields("qs", 4), 16)]
    return np.concatenate(parts, axis=-1).reshape(n_out, -1)


@pytest.mark.unit
@pytest.mark.parametrize("name", TYPES)
def test_repack_matches_plane_specs_and_is_lossless(name: str, rng: np.random.Generator):
    n_out, n_in = 24, 512
    raw = random_raw(name, n_out, n_in, rng)
    planes = repack(raw, name)
    specs = plane_specs(name, n_out, n_in)
    assert list(planes) == list(specs)
    for key, (shape, dtype) in specs.items():
        assert planes[key].shape == shape and planes[key].dtype == np.dtype(dtype), key
    assert np.array_equal(raw_from_planes(planes, name), raw)


@pytest.mark.unit
@pytest.mark.parametrize("name", TYPES)
def test_planes_hold_the_quantized_bits_not_floats(name: str):
    """The planes are the raw bytes moved around: same size, except packed sub-block scales unpacked to bytes."""
    n_out, n_in = 8, 512
    raw_bytes = n_out * n_in // GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    raw_bytes *= GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    plane_bytes = sum(np.prod(shape) * np.dtype(dt).itemsize for shape, dt in plane_specs(name, n_out, n_in).values())
    # bytes per super-block the unpacking adds: Q4_K/Q5_K's and Q3_K's 12 packed bytes → 16, Q2_K's 16 scale/min
    # bytes → 16 + 16, IQ4_XS's 6 bytes (scales_h, scales_l) → 8
    extra = {"Q4_K": 4, "Q5_K": 4, "Q3_K": 4, "Q2_K": 16, "IQ4_XS": 2}.get(name, 0)
    unpacked_scales = extra * n_out * n_in // 256
    assert plane_bytes == raw_bytes + unpacked_scales


@pytest.mark.unit
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_expression_is_bit_exact(name: str, rng: np.random.Generator):
    """The embedding gather runs each type's dequant expression; it must equal gguf-py's float32 exactly.

    Exact, not approximately equal: every dequantized value is an fp16 scale times small integers (Q6_K's
    d·sc·(q−32) needs 11+7+6 = 24 significant bits), so each product is exact in float32 and contracting
    d·q + m into an FMA cannot change the rounding.
    """
    n_vocab, n_embd = 40, 512
    raw = random_raw(name, n_vocab, n_embd, rng)
    planes = repack(raw, name)
    ids = rng.permutation(n_vocab)[:17].astype(np.int32)
    got = run_func(
        quant_embedding(name, n_vocab, n_embd), ids, *planes.values(), out_shape=(17, n_embd), out_dtype="float32"
    )
    assert np.array_equal(got, reference_dequant(raw, name)[ids])


@pytest.mark.unit
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_with_the_exact_int_to_float_is_the_same(name: str, rng: np.random.Generator):
    """The GPU kernels' integer → float conversion (bits of 1.5·2**23, then a float subtraction) gives the same
    values as the conversion instruction, for every quant and scale field of every type."""
    from tvm import te

    n_out, n_in = 12, 512
    raw = random_raw(name, n_out, n_in, rng)
    planes = repack(raw, name)
    tensors = weight_planes(name, n_out, n_in)
    w = te.compute((n_out, n_in), lambda n, k: dequant_expr(name, tensors, n, k, exact_int_to_float), name="w")
    func = te.create_prim_func([*tensors.values(), w])
    got = run_func(func, *planes.values(), out_shape=(n_out, n_in), out_dtype="float32")
    assert np.array_equal(got, reference_dequant(raw, name))


@pytest.mark.unit
def test_unscheduled_matmul_is_the_reference_product(rng: np.random.Generator):
    """The compute definition alone (no schedule), for one type of each family, against float64 numpy."""
    for name in ("Q4_1", "Q6_K", "BF16"):
        raw = random_raw(name, 16, 256, rng)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        func = quant_matmul(name, 16, 256, batch=3)
        got = run_func(func, x, *repack(raw, name).values(), out_shape=(3, 16), out_dtype="float32")
        want = x.astype(np.float64) @ reference_dequant(raw, name).astype(np.float64).T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name


@pytest.mark.unit
def test_half_compute_rounds_both_operands_then_sums_in_float32(rng: np.random.Generator):
    """compute_dtype="float16" (the tensor cores' form) is the product of x and the dequantized W each rounded to
    float16, exactly what scripts/device_check.py's oracle emulates; and it differs from the float32 form, so the
    rounding is really there (a test that cannot fail would not show it)."""
    for name in ("Q4_1", "Q8_0", "BF16"):
        raw = random_raw(name, 16, 256, rng)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        func = quant_matmul(name, 16, 256, batch=3, compute_dtype="float16")
        got = run_func(func, x, *repack(raw, name).values(), out_shape=(3, 16), out_dtype="float32")
        w = reference_dequant(raw, name)
        want = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
        exact = x.astype(np.float64) @ w.astype(np.float64).T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name
        assert np.abs(got - exact).max() > 1e-5 * np.abs(exact).max(), name


@pytest.mark.unit
def test_tensor_core_twin_has_the_same_signature():
    func = quant_matmul("Q4_K", 64, 512)
    twin = with_tensor_core_twin(func, "Q4_K", 64, 512).attrs[TENSOR_CORE_TWIN]
    assert [(p.name, p.dtype, len(p.shape)) for p in twin.params] == \
        [(p.name, p.dtype, len(p.shape)) for p in func.params]
    assert twin.attrs["global_symbol"] == func.attrs["global_symbol"] + "_half"


@pytest.mark.unit
def test_signature_is_x_planes_y_with_a_symbolic_batch():
    func = quant_matmul("Q4_K", 64, 512, x_dtype="float16", out_dtype="float16")
    assert [p.name for p in func.params] == ["x", "d", "dmin", "sc", "mn", "qs", "cast"]
    x = func.params[0]
    assert isinstance(x.shape[0], tvm.tirx.Var) and str(x.shape[0].ty) == "int64" and x.dtype == "float16"
    assert func.attrs["global_symbol"] == "quant_matmul_q4_k_64x512_gemm"
    assert quant_matmul("Q8_0", 64, 512, batch=1).attrs["global_symbol"].endswith("_gemv")


@pytest.mark.unit
def test_unsupported_types_and_bad_shapes_are_refused_with_a_reason():
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        plane_specs("IQ2_XXS", 8, 256)
    with pytest.raises(UnsupportedError, match="unknown GGML type"):
        quant_matmul("Q4_7", 8, 256)
    with pytest.raises(GGUFError, match="multiple of 256"):
        plane_specs("Q4_K", 8, 320)
    with pytest.raises(GGUFError, match="uint8"):
        repack(np.zeros((4, 20), np.float32), "Q4_1")
    with pytest.raises(UnsupportedError, match="x_dtype"):
        quant_matmul("Q4_1", 8, 256, x_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "tensor"),
    [
        ("smollm2", "blk.0.ffn_down.weight"),
        ("smollm2", "token_embd.weight"),
        ("gemma3", "blk.0.attn_output.weight"),
        ("gemma3", "blk.0.ffn_down.weight"),
        ("gemma3", "blk.0.attn_q.weight"),
    ],
)
def test_real_tensors_repack_losslessly(model: str, tensor: str, request: pytest.FixtureRequest):
    """Q4_1, Q8_0 (SmolLM2) and Q4_K, Q6_K, Q5_0 (Gemma 3) as the real files store them."""
    from luce_compile.gguf.reader import read_gguf

    gguf = read_gguf(request.getfixturevalue(f"{model}_path"))
    info = gguf.tensors[tensor]
    raw = np.asarray(gguf.raw(tensor))[:512]  # the first rows: enough blocks, fast
    assert np.array_equal(raw_from_planes(repack(raw, info.ggml_type), info.ggml_type.name), raw)


@pytest.mark.unit
def test_mxfp4_every_exponent_is_bit_exact(rng: np.random.Generator):
    """MXFP4's E8M0 scale by its bits, for all 256 exponents: the subnormal 2^-128, 2^-127 (e < 2) and the largest
    (random_raw keeps to 2^-10 .. 2^-3 so that dot products stay finite)."""
    raw = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    planes = repack(raw, "MXFP4")
    got = run_func(quant_embedding("MXFP4", 256, 32), np.arange(256, dtype=np.int32), *planes.values(),
                   out_shape=(256, 32), out_dtype="float32")
    assert np.array_equal(got.view(np.uint32), reference_dequant(raw, "MXFP4").view(np.uint32))
