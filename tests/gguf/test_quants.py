"""luce_compile.gguf.quants: bit-exact dequantization against gguf-py, and quantize round-trip error bounds.

NaN and inf are compared too: random bytes make NaN/inf fp16 scales (and inf * 0 = NaN), and the results are
compared as uint32 bit patterns, so our NaNs must carry the same sign and payload as gguf-py's. They do,
because both evaluate the same float32 operations in the same order (the C order of ggml-quants.c).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.quants import DEQUANTIZERS, dequantize, quantize

T = GGMLQuantizationType
TYPES = list(DEQUANTIZERS)
QUANTIZED = [t for t in TYPES if t not in (T.F32, T.F16, T.BF16)]


def _reference(raw: np.ndarray, t: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf_quants.dequantize(raw, t)


def _assert_bits_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    diff = ours.view(np.uint32) != np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32)
    assert not diff.any(), f"{diff.sum()} of {diff.size} elements differ, first at {np.argwhere(diff)[0]}"


@pytest.mark.unit
def test_every_supported_type_has_a_dequantizer():
    from luce_compile.gguf.reader import SUPPORTED_TYPES

    assert set(TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.unit
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_dequantize_random_bytes_bit_exact(t, data):
    block, type_size = GGML_QUANT_SIZES[t]
    rows = data.draw(st.integers(1, 3), label="rows")
    blocks_per_row = data.draw(st.integers(1, 4), label="blocks per row")
    raw = np.frombuffer(data.draw(st.binary(min_size=rows * blocks_per_row * type_size,
                                            max_size=rows * blocks_per_row * type_size)), dtype=np.uint8)
    raw = raw.reshape(rows, blocks_per_row * type_size)
    ours = dequantize(raw, t)
    assert ours.shape == (rows, blocks_per_row * block)
    _assert_bits_equal(ours, _reference(raw, t))


@pytest.mark.unit
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_many_random_blocks_bit_exact(t):
    """A larger sweep than hypothesis draws, including the chunked path (more than 2**16 blocks for small types)."""
    block, type_size = GGML_QUANT_SIZES[t]
    n_blocks = 70_000 if type_size <= 4 else 3000
    raw = np.random.default_rng(int(t)).integers(0, 256, size=(10, n_blocks // 10 * type_size), dtype=np.uint8)
    _assert_bits_equal(dequantize(raw, t), _reference(raw, t))


@pytest.mark.slow
def test_dequantize_real_model_tensors_bit_exact(smollm2_path, gemma3_path):
    """Blocks written by llama.cpp's own quantizer: the first 64 rows of one tensor of each type in the real
    models (F32, Q8_0, Q4_1, Q5_0, Q4_K, Q6_K)."""
    from luce_compile.gguf.reader import read_gguf

    seen = set()
    for path in (smollm2_path, gemma3_path):
        gguf = read_gguf(path)
        for info in gguf:
            if info.ggml_type not in seen:
                seen.add(info.ggml_type)
                raw = gguf.raw(info.name)[:64]
                _assert_bits_equal(dequantize(raw, info.ggml_type), _reference(raw, info.ggml_type))
    assert seen == {T.F32, T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q6_K}


@pytest.mark.unit
def test_dequantize_keeps_leading_dims():
    raw = np.random.default_rng(1).integers(0, 256, size=(2, 3, 2 * 34), dtype=np.uint8)
    assert dequantize(raw, T.Q8_0).shape == (2, 3, 64)


@pytest.mark.unit
@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_dequantize_rejects_partial_blocks(t):
    _, type_size = GGML_QUANT_SIZES[t]
    raw = np.zeros((2, type_size + 1), dtype=np.uint8)
    with pytest.raises(GGUFError, match=f"{t.name}.*whole {type_size}-byte blocks"):
        dequantize(raw, t)


@pytest.mark.unit
def test_dequantize_rejects_float_input_and_unknown_types():
    with pytest.raises(GGUFError, match="uint8"):
        dequantize(np.ones((1, 34), dtype=np.float32), T.Q8_0)
    with pytest.raises(UnsupportedError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), dtype=np.uint8), T.IQ2_XXS)


# ------------------------------------------------------------------------------------------------ quantize

# Worst-case |x - dequantize(quantize(x))| as a fraction of the block's max |x|, from how each quantizer picks
# its scales: rounding is half a step; gguf-py's Q4_0/Q5_0 map the signed extreme to -8/-16, so the opposite
# side can clip by one step; fp16 scales add ~2**-11 relative. Ours (K-quants) round scales up and never clip.
# Small blocks have subnormal fp16 scales, whose rounding (≤ 2**-25 absolute, times |q| ≤ 128) adds FP16_ABS.
MAX_ERROR_FRACTION = {
    T.Q8_0: 0.56 / 127, T.Q4_0: 1.01 / 8, T.Q5_0: 1.01 / 16,
    T.Q4_1: 0.52 * 2 / 15 + 2**-10, T.Q5_1: 0.52 * 2 / 31 + 2**-10,
    T.Q4_K: 1.05 * 2 / 15, T.Q5_K: 1.05 * 2 / 31, T.Q6_K: 0.51 / 31,
    # Q2_K: half a step of the range over 3 levels, its 4-bit scale and min rounded up (16/15, 31/30 of it)
    T.Q2_K: 0.5 * (16 / 15) * (31 / 15) / 3 + 2**-10, T.Q3_K: 0.5 * (32 / 31) / 3 + 2**-10,
    # the codebooks: kvalues_iq4nl's top is 113 where the extreme maps to −127 (14 of 127 clip on the other side);
    # IQ4_XS's sub-block scales add half a step of d = max/(127·32) to that; MXFP4's power-of-two scale leaves the
    # top quarter of the range to its largest value 12 (gguf-py's quantizer)
    T.IQ4_NL: 14.1 / 127 + 2**-10, T.IQ4_XS: 14 / 127 + 64 / (127 * 32) + 2**-10, T.MXFP4: 0.25 + 2**-10,
}
FP16_ABS = 128 * 2.0**-25
# RMS error on standard-normal weights, measured (seed 0, 16 × 4096) × 1.25: a regression guard.
MAX_RMS_ERROR = {
    T.F32: 0.0, T.F16: 2.6e-4, T.BF16: 2.1e-3, T.Q8_0: 6.8e-3, T.Q4_0: 0.109, T.Q4_1: 0.098, T.Q5_0: 0.053,
    T.Q5_1: 0.049, T.Q4_K: 0.102, T.Q5_K: 0.050, T.Q6_K: 0.025, T.Q2_K: 0.446, T.Q3_K: 0.255, T.IQ4_NL: 0.100,
    T.IQ4_XS: 0.100, T.MXFP4: 0.144,
}


def _block_max(x: np.ndarray, block: int) -> np.ndarray:
    return np.repeat(np.abs(x.reshape(-1, block)).max(axis=-1), block).reshape(x.shape)


@pytest.mark.unit
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_quantize_round_trip_rms(t):
    x = np.random.default_rng(0).standard_normal((16, 4096)).astype(np.float32)
    raw = quantize(x, t)
    block, type_size = GGML_QUANT_SIZES[t]
    assert raw.dtype == np.uint8 and raw.shape == (16, 4096 // block * type_size)
    rms = float(np.sqrt(np.mean((dequantize(raw, t) - x) ** 2)))
    assert rms <= MAX_RMS_ERROR[t]
    if t != T.F32:
        assert rms > 0.2 * MAX_RMS_ERROR[t]  # the table is not stale: the error is of the measured size


@pytest.mark.unit
@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-3, 1e3), offset=st.floats(-2.0, 2.0),
       heavy_tail=st.booleans())
def test_quantize_error_bound(t, seed, scale, offset, heavy_tail):
    """Random rows of varied scale, offset and tails stay within the per-block bound, and the blocks decode
    identically with gguf-py (so they are valid GGUF)."""
    block, _ = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_t(2, (4, 512)), -50, 50) if heavy_tail else rng.standard_normal((4, 512))
    x = ((x + offset) * scale).astype(np.float32)
    raw = quantize(x, t)
    y = dequantize(raw, t)
    _assert_bits_equal(y, _reference(raw, t))
    bound = MAX_ERROR_FRACTION[t] * _block_max(x, block) + 1e-6 * np.abs(x) + FP16_ABS
    assert (np.abs(y - x) <= bound).all(), float((np.abs(y - x) / _block_max(x, block)).max())


@pytest.mark.unit
@pytest.mark.parametrize("t", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_own_k_quantizer_never_clips(t):
    """Every element is within half a step of its input, the step being the block's own d * sc."""
    x = np.random.default_rng(3).standard_normal((8, 1024)).astype(np.float32) * 0.02 - 0.01
    raw = quantize(x, t).reshape(-1, GGML_QUANT_SIZES[t][1])
    if t == T.Q6_K:
        d = raw[:, 208:210].copy().view(np.float16).astype(np.float32)
        step = np.repeat(d * raw[:, 192:208].view(np.int8).astype(np.float32), 16, axis=1)
    else:
        from luce_compile.gguf.quants import _scale_min_k4

        sc, _ = _scale_min_k4(raw[:, 4:16])
        step = np.repeat(raw[:, 0:2].copy().view(np.float16).astype(np.float32) * sc, 32, axis=1)
    err = np.abs(dequantize(raw, t) - x.reshape(-1, 256))
    assert (err <= 0.5 * step * (1 + 1e-5) + 1e-9).all()
    assert err.max() > 0.3 * step.max() / 2  # the bound is not vacuous


@pytest.mark.unit
@pytest.mark.parametrize("t", QUANTIZED, ids=lambda t: t.name)
def test_quantize_constant_and_zero_blocks(t):
    block, _ = GGML_QUANT_SIZES[t]
    x = np.zeros((2, 512), dtype=np.float32)
    x[1] = -0.75  # a constant negative row: min-only blocks
    y = dequantize(quantize(x, t), t)
    assert (y[0] == 0).all()
    assert np.abs(y[1] + 0.75).max() <= 0.75 * MAX_ERROR_FRACTION[t] + 1e-6


@pytest.mark.unit
def test_quantize_rejects_bad_rows_and_values():
    with pytest.raises(GGUFError, match="Q4_K.*256"):
        quantize(np.ones((2, 64), dtype=np.float32), T.Q4_K)
    with pytest.raises(GGUFError, match="finite"):
        quantize(np.full((1, 32), np.nan, dtype=np.float32), T.Q8_0)
    with pytest.raises(GGUFError, match="fp16"):
        quantize(np.full((1, 32), 1e6, dtype=np.float32), T.Q8_0)
    assert quantize(np.full((1, 32), 1e6, dtype=np.float32), T.F32).shape == (1, 128)


@pytest.mark.unit
def test_quantize_matches_gguf_py_for_legacy_types():
    """Where gguf-py quantizes, we use it as is: the bytes equal ggml's reference quantizers'."""
    x = np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32)
    for t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16):
        assert np.array_equal(quantize(x, t), np.asarray(gguf_quants.quantize(x, t)).view(np.uint8))
