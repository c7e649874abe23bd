"""GGUF block formats ↔ float32, vectorized numpy: the reference that every generated kernel is checked against.

Written from the C spec, not from gguf-py: block layouts from `ggml/src/ggml-common.h` (block_q4_0 …
block_q6_K), element order and arithmetic from `dequantize_row_*` in `ggml/src/ggml-quants.c`. Each type is one
small function over a (n_blocks, type_size) uint8 array, registered by type code. The arithmetic is float32 in
the C order (e.g. Q4_K is `(d*sc)*q - (dmin*m)`), so results equal ggml's and gguf-py's bit for bit.

`quantize` is for writing synthetic models. The legacy formats and MXFP4 use gguf-py's quantizers (bit-exact with
ggml's `quantize_row_*_ref`). gguf-py cannot quantize K-quants or the IQ4 codebooks, so Q2_K…Q6_K, IQ4_NL and IQ4_XS
have simple quantizers of our own (IQ4_*: ggml's first guess of the scale, without its search). The K-quants'
scales come from each sub-block's range and are rounded *up*, so no value is ever clipped and every element is
within half a quantization step of its input (`quantize_row_q4_K_ref` instead searches for the scale with the least
weighted error, which is slower and not needed for random weights).

block_q2_K … block_iq4_xs and mxfp4 (issue 40) come from the same C files; checked bit for bit against gguf-py 0.19's
dequantizers, which have all five.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from luce_compile.errors import GGUFError, UnsupportedError

T = GGMLQuantizationType
QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32  # elements per legacy block (ggml-common.h)
QK_K = 256  # elements per K-quant super-block
K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in block_q4_K / block_q5_K
_FP16_SAFE_MAX = 60000.0  # below fp16's 65504, leaving room for scales rounded up
_CHUNK_BLOCKS = 1 << 16  # blocks dequantized at once: bounds the temporaries for large tensors

Dequantizer = Callable[[np.ndarray], np.ndarray]  # (n_blocks, type_size) uint8 → (n_blocks, block_size) float32
DEQUANTIZERS: dict[GGMLQuantizationType, Dequantizer] = {}


def _register(ggml_type: GGMLQuantizationType) -> Callable[[Dequantizer], Dequantizer]:
    def wrap(fn: Dequantizer) -> Dequantizer:
        DEQUANTIZERS[ggml_type] = fn
        return fn

    return wrap


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The ggml_half at byte `start` of each block, as float32 of shape (n_blocks, 1) (GGML_FP16_TO_FP32)."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy blocks store element j in the low nibble of qs[j] and element j + 16 in the high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh_bytes: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the little-endian uint32 qh is the 5th bit of element j, as 0 or 16."""
    return np.unpackbits(qh_bytes, axis=-1, bitorder="little") << 4


@_register(T.F32)
def _dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view("<f4")


@_register(T.F16)
def _dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view("<f2").astype(np.float32)


@_register(T.BF16)
def _dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an fp32 (ggml_compute_bf16_to_fp32)
    return (np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16).view(np.float32)


@_register(T.Q8_0)
def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:  # d:f16 | qs:int8[32]
    return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks, 0)


@_register(T.Q4_0)
def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:  # d:f16 | qs[16]
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - 8
    return q.astype(np.float32) * _f16(blocks, 0)


@_register(T.Q4_1)
def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:  # d:f16 | m:f16 | qs[16]
    q = _nibbles(blocks[:, 4:])
    return q.astype(np.float32) * _f16(blocks, 0) + _f16(blocks, 2)


@_register(T.Q5_0)
def _dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:  # d:f16 | qh[4] | qs[16]
    q = (_nibbles(blocks[:, 6:]) | _high_bits_32(blocks[:, 2:6])).astype(np.int8) - 16
    return q.astype(np.float32) * _f16(blocks, 0)


@_register(T.Q5_1)
def _dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:  # d:f16 | m:f16 | qh[4] | qs[16]
    q = _nibbles(blocks[:, 8:]) | _high_bits_32(blocks[:, 4:8])
    return q.astype(np.float32) * _f16(blocks, 0) + _f16(blocks, 2)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for all 8 sub-blocks at once: (n, 12) packed bytes → sc, m, each (n, 8) in 0..63.
    Sub-blocks 0..3 keep 6 bits in bytes 0..7; sub-blocks 4..7 take their low 4 bits from bytes 8..11 and
    their top 2 bits from the spare top bits of bytes 0..7."""
    lo_sc, lo_m, packed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (packed & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (packed >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, m


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: each 32 bytes of qs hold two sub-blocks of 32: the low nibbles, then the high nibbles.
    (n, 128) → (n, 8, 32)."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """y = (d * sc) * q - (dmin * m) per 32-element sub-block; q is (n, 8, 32)."""
    sc, m = _scale_min_k4(blocks[:, 4:4 + K_SCALE_SIZE])
    d1 = (_f16(blocks, 0) * sc.astype(np.float32))[..., None]
    m1 = (_f16(blocks, 2) * m.astype(np.float32))[..., None]
    return (d1 * q.astype(np.float32) - m1).reshape(-1, QK_K)


@_register(T.Q4_K)
def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:  # d:f16 | dmin:f16 | scales[12] | qs[128]
    return _k_affine(blocks, _k_low_nibbles(blocks[:, 16:]))


@_register(T.Q5_K)
def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:  # d:f16 | dmin:f16 | scales[12] | qh[32] | qs[128]
    qh = blocks[:, 16:48]  # bit s of qh[l] is the 5th bit of element l of sub-block s
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return _k_affine(blocks, _k_low_nibbles(blocks[:, 48:]) | (high << 4))


@_register(T.Q6_K)
def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:  # ql[128] | qh[64] | scales:int8[16] | d:f16
    # Each half of 128 elements uses 64 bytes of ql and 32 of qh. Its four 32-element quarters take
    # (low nibble of ql[0:32], ql[32:64], high nibble of ql[0:32], ql[32:64]) and qh bits (0-1, 2-3, 4-5, 6-7).
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 2, 32)  # (n, half, nibble, ql part, 32)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)) & 0x0F
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # (n, half, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # (n, half, quarter, 32)
    q = (low.reshape(-1, 2, 4, 32) | (high << 4)).astype(np.int8) - 32  # quarter = 2 * nibble + part
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # one scale per 16 elements
    d = _f16(blocks, 208) * sc  # (n, 16)
    return (d[:, :, None] * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


# Non-linear 4-bit codebooks (ggml-common.h): IQ4_NL/IQ4_XS's kvalues_iq4nl, and MXFP4's e2m1 values doubled
# (kvalues_mxfp4; its E8M0 scale is halved to match, GGML_E8M0_TO_FP32_HALF)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def _2bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: each 32 bytes of qs hold 128 elements, element 32j + l in bits 2j..2j+1 of byte l.
    (n, 64) → (n, 256) in 0..3."""
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(-1, QK_K)


@_register(T.Q2_K)
def _dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:  # scales[16] | qs[64] | d:f16 | dmin:f16
    # byte j of scales: the 4-bit scale (low) and min (high) of elements 16j..16j+15; y = (d·sc)·q − (dmin·m)
    sc = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (sc & 0x0F).astype(np.float32))[..., None]
    ml = (_f16(blocks, 82) * (sc >> 4).astype(np.float32))[..., None]
    q = _2bit_runs(blocks[:, 16:80]).reshape(-1, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(-1, QK_K)


def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes of packed 6-bit scales → the 16 scales minus 32, int8 (n, 16) in −32..31
    (dequantize_row_q3_K's kmask shuffle): scale i's low 4 bits are the low (i < 8) or high (i ≥ 8) nibble of byte
    i % 8, its top 2 bits bits 2·(i // 4)..+1 of byte 8 + i % 4."""
    low = np.concatenate([scales[:, 0:8] & 0x0F, scales[:, 0:8] >> 4], axis=-1)
    high = (scales[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3
    return (low | (high.reshape(-1, 16) << 4)).astype(np.int8) - np.int8(32)


def q3_k_quants(blocks: np.ndarray) -> np.ndarray:
    """Q3_K's signed 3-bit quants (n, 256) in −4..3: the 2 low bits (as Q2_K) minus 4 where the element's hmask
    bit is clear; bit 4h + j of hmask[l] belongs to element 128h + 32j + l."""
    hm = blocks[:, 0:32]
    high = (hm[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32): bit b of hmask[l]
    return _2bit_runs(blocks[:, 32:96]).astype(np.int8) - ((high.reshape(-1, QK_K) ^ 1) << 2).astype(np.int8)


@_register(T.Q3_K)
def _dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:  # hmask[32] | qs[64] | scales[12] | d:f16
    dl = _f16(blocks, 108) * q3_k_scales(blocks[:, 96:108]).astype(np.float32)  # (n, 16): d·(sc − 32)
    return (dl[..., None] * q3_k_quants(blocks).reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


@_register(T.IQ4_NL)
def _dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:  # d:f16 | qs[16] (indices into kvalues_iq4nl)
    return _f16(blocks, 0) * KVALUES_IQ4NL[_nibbles(blocks[:, 2:])].astype(np.float32)


def iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS's 8 sub-block scales minus 32, int8 (n, 8): 4 low bits from scales_l (nibble ib % 2 of byte ib / 2),
    2 high bits from the uint16 scales_h (bits 2ib..2ib+1)."""
    h = np.ascontiguousarray(blocks[:, 2:4]).view("<u2").astype(np.uint16)  # (n, 1)
    low = (blocks[:, 4:8][:, :, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
    high = (h >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)


@_register(T.IQ4_XS)
def _dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:  # d:f16 | scales_h:u16 | scales_l[4] | qs[128]
    dl = _f16(blocks, 0) * iq4_xs_scales(blocks).astype(np.float32)  # (n, 8): d·(ls − 32)
    q = KVALUES_IQ4NL[_nibbles(blocks[:, 8:].reshape(-1, 8, 16))].astype(np.float32)  # (n, 8, 32) per sub-block
    return (dl[..., None] * q).reshape(-1, QK_K)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """GGML_E8M0_TO_FP32_HALF: 2^(e − 128) as float32 (e < 2: the subnormals 2^−128, 2^−127)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(np.float32)


@_register(T.MXFP4)
def _dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:  # e:E8M0 | qs[16] (indices into kvalues_mxfp4)
    return KVALUES_MXFP4[_nibbles(blocks[:, 1:])].astype(np.float32) * e8m0_half(blocks[:, 0:1])


def k_quant_minimums(raw: np.ndarray, ggml_type: GGMLQuantizationType = T.Q4_K) -> np.ndarray:
    """Q4_K/Q5_K rows (*outer, row_bytes) → each 32-value sub-block's minimum term −dmin·m as float64 (*outer,
    row_bytes / block bytes · 8): with it a sub-block is a Q4_1 block, w = (d·sc)·q + (−dmin·m), as llama.cpp's
    CUDA dot products with q8_1 activations take it (the megakernel's 8-bit matvecs; graph/rounding emulates them).
    The products are exact in float32 (an fp16 times a 6-bit integer)."""
    if ggml_type not in (T.Q4_K, T.Q5_K):
        raise UnsupportedError(f"quants: {GGMLQuantizationType(ggml_type).name} has no per-32 minimums")
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    _, m = _scale_min_k4(blocks[:, 4:4 + K_SCALE_SIZE])
    return (-(_f16(blocks, 2) * m.astype(np.float32))).astype(np.float64).reshape(*raw.shape[:-1], -1)


def block_info(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    """(elements per block, bytes per block), refusing types without a dequantizer."""
    if ggml_type not in DEQUANTIZERS:
        raise UnsupportedError(f"quants: tensor type {GGMLQuantizationType(ggml_type).name} is not supported "
                               f"(supported: {', '.join(t.name for t in DEQUANTIZERS)}).")
    return GGML_QUANT_SIZES[ggml_type]


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF blocks (..., row_bytes) uint8 → float32 (..., elements per row)."""
    block, type_size = block_info(ggml_type)
    if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] % type_size:
        raise GGUFError(f"quants: {ggml_type.name} data must be uint8 rows of whole {type_size}-byte blocks, got "
                        f"{raw.dtype} of shape {raw.shape}; pass GGUFFile.raw(name), not a dequantized array.")
    blocks = raw.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block), dtype=np.float32)
    dequantize_blocks = DEQUANTIZERS[ggml_type]
    # inf * 0 → NaN and overflow are what ggml computes for such blocks too: not worth a warning
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            out[start:start + _CHUNK_BLOCKS] = dequantize_blocks(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // type_size * block)


# ---------------------------------------------------------------------------------------------------- quantize

def _f16_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest fp16 ≥ v (v ≥ 0, finite): a super-block scale rounded up, so sub-block scales fit in range."""
    h = v.astype(np.float16)
    return np.where(h.astype(np.float64) < v, np.nextafter(h, np.float16(np.inf)), h)


def _ceil_ratio(num: np.ndarray, den: np.ndarray, top: int) -> np.ndarray:
    """ceil(num / den) clipped to [0, top], 0 where den is 0 (an all-zero sub-block)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, np.ceil(num / den * (1 - 1e-12)), 0)
    return np.clip(r, 0, top).astype(np.uint8)


def _k_affine_levels(x: np.ndarray, nmax: int, top: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """y = d*ls*L - dmin*lm for x of shape (n, sub-blocks, values): returns d, dmin (f16, (n,)), the integer
    sub-block scales ls and mins lm (n, sub-blocks) in 0..top, and L (n, sub-blocks, values) in 0..nmax. The min is
    chosen first (rounded up, so -dmin*lm ≤ min(x, 0)), then the scale covers the rest of the range (rounded up), so
    L never clips."""
    x = x.astype(np.float64)
    mins = np.maximum(-x.min(axis=-1), 0.0)  # (n, S) ≥ 0: the offset subtracted after scaling
    dmin = _f16_at_least(mins.max(axis=-1) / top)  # (n,)
    lm = _ceil_ratio(mins, dmin.astype(np.float64)[:, None], top)
    eff_m = (dmin.astype(np.float32)[:, None] * lm.astype(np.float32)).astype(np.float64)
    need = (x.max(axis=-1) + eff_m) / nmax  # the step that maps the sub-block's range onto 0..nmax
    d = _f16_at_least(need.max(axis=-1) / top)
    ls = _ceil_ratio(need, d.astype(np.float64)[:, None], top)
    eff_d = (d.astype(np.float32)[:, None] * ls.astype(np.float32)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_d[..., None] > 0, np.rint((x + eff_m[..., None]) / eff_d[..., None]), 0)
    return d, dmin, ls, lm, np.clip(q, 0, nmax).astype(np.uint8)


def _quantize_k_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K values for x of shape (n, 8, 32) (`_k_affine_levels` with 6-bit scales and mins): returns d, dmin
    (f16, (n,)), packed scales (n, 12) and L (n, 8, 32) in 0..nmax."""
    d, dmin, ls, lm, q = _k_affine_levels(x, nmax, 63)
    packed = np.concatenate([  # the inverse of _scale_min_k4
        (ls[:, :4] & 63) | ((ls[:, 4:] >> 4) << 6),
        (lm[:, :4] & 63) | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4),
    ], axis=-1).astype(np.uint8)
    return d, dmin, packed, q


def _pack_k_low_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) values → (n, 128): sub-block 2c in the low nibbles of bytes 32c.., 2c+1 in the high nibbles."""
    q = q.reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _halves(v: np.ndarray) -> np.ndarray:
    return v[:, None].view(np.uint8).reshape(-1, 2)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_k_affine(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_halves(d), _halves(dmin), scales, _pack_k_low_nibbles(q)], axis=-1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_k_affine(x.reshape(-1, 8, 32), 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)  # (n, 32)
    return np.concatenate([_halves(d), _halves(dmin), scales, qh, _pack_k_low_nibbles(q)], axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """y = d * sc * (L - 32) with sc int8 per 16 elements. Symmetric: the step is max|x| / 31 rounded up, so
    L - 32 stays in -31..31 (the format's -32 is not used; the error is at most half a step)."""
    x = x.reshape(-1, 16, 16).astype(np.float64)
    need = np.abs(x).max(axis=-1) / 31  # (n, 16)
    d = _f16_at_least(need.max(axis=-1) / 127)
    sc = _ceil_ratio(need, d.astype(np.float64)[:, None], 127)
    eff = (d.astype(np.float32)[:, None] * sc.astype(np.float32)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff[..., None] > 0, np.rint(x / eff[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (n, half, quarter, 32)
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # quarters 0,1 low nibbles; 2,3 high
    qh = (q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return np.concatenate([ql.reshape(-1, 128), qh.sum(axis=2, dtype=np.uint8).reshape(-1, 64),
                           sc.view(np.uint8), _halves(d)], axis=-1)


def _pack_2bit_runs(q: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..3 → Q2_K/Q3_K's qs (n, 64): the inverse of `_2bit_runs`."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return q.sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """y = (d·sc)·q − (dmin·m) per 16 values, q in 0..3, sc and m 4-bit: `_k_affine_levels` (no clipping)."""
    d, dmin, ls, lm, q = _k_affine_levels(x.reshape(-1, 16, 16), 3, 15)
    return np.concatenate([ls | (lm << 4), _pack_2bit_runs(q), _halves(d), _halves(dmin)], axis=-1)


def _symmetric_levels(x: np.ndarray, qmax: int, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = d·sc·L for x (n, sub-blocks, values), |L| ≤ qmax, sc in 0..top: the step max|x|/qmax of each sub-block
    rounded up (as _quantize_q6_k), so nothing clips. Returns d (f16, (n,)), sc (n, S) uint8 and L (n, S, values)."""
    x = x.astype(np.float64)
    need = np.abs(x).max(axis=-1) / qmax  # (n, S)
    d = _f16_at_least(need.max(axis=-1) / top)
    sc = _ceil_ratio(need, d.astype(np.float64)[:, None], top)
    eff = (d.astype(np.float32)[:, None] * sc.astype(np.float32)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff[..., None] > 0, np.rint(x / eff[..., None]), 0)
    return d, sc, np.clip(q, -qmax, qmax).astype(np.int8)


def pack_q3_k_scales(s: np.ndarray) -> np.ndarray:
    """(n, 16) stored 6-bit scales (sc + 32, 0..63) → Q3_K's 12 bytes: the inverse of q3_k_scales."""
    top = (s >> 4).reshape(-1, 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]  # (n, i // 4, i % 4)
    return np.concatenate([(s[:, 0:8] & 0x0F) | ((s[:, 8:16] & 0x0F) << 4), top.sum(axis=1, dtype=np.uint8)],
                          axis=-1).astype(np.uint8)


def _quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """y = d·(sc − 32)·(q − 4) per 16 values. Symmetric: levels −3..3 (the format's −4 is not used) and sub-block
    scales 0..31 of the format's −32..31, the step rounded up so nothing clips."""
    d, sc, q = _symmetric_levels(x.reshape(-1, 16, 16), 3, 31)
    packed = pack_q3_k_scales(sc + 32)
    u = (q.reshape(-1, QK_K) + 4).astype(np.uint8)  # 1..7: the hmask bit is set where u ≥ 4 (q ≥ 0)
    high = (u >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
    return np.concatenate([high.sum(axis=1, dtype=np.uint8), _pack_2bit_runs(u & 3), packed, _halves(d)], axis=-1)


def _nearest_code(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the table value nearest to each v (ties to the lower index), uint8."""
    return np.abs(v[..., None] - table.astype(np.float64)).argmin(axis=-1).astype(np.uint8)


def _signed_extreme(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, sign kept (the first one on a tie)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _pack_nibbles(idx: np.ndarray) -> np.ndarray:
    """(..., 32) 4-bit codes → (..., 16): element j in the low nibble of byte j, element j + 16 in its high one."""
    return (idx[..., :16] | (idx[..., 16:] << 4)).astype(np.uint8)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_nl_ref's first step: d = max/−127, max the block's value of largest magnitude (so it lands
    exactly on kvalues_iq4nl[0]), then the nearest code; ggml then searches nearby scales for a lower weighted
    error, which random weights do not need."""
    x = x.reshape(-1, 32).astype(np.float64)
    d = (_signed_extreme(x) / -127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(d[:, None] != 0, x / d.astype(np.float64)[:, None], 0)
    return np.concatenate([_halves(d), _pack_nibbles(_nearest_code(v, KVALUES_IQ4NL))], axis=-1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_xs's scheme without its scale search: each sub-block's scale max/−127, the super-block's
    d = (the scale of largest magnitude)/−32 so that one maps to ls − 32 = −32, the others rounded to −32..31,
    then each value's nearest code under its sub-block's d·(ls − 32)."""
    x = x.reshape(-1, 8, 32).astype(np.float64)
    scales = _signed_extreme(x) / -127  # (n, 8)
    top = _signed_extreme(scales) / -32  # (n,): rounded away from 0 so that no ls needs more than −32..31
    d = np.copysign(_f16_at_least(np.abs(top)), top).astype(np.float16)
    d64 = d.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d64 != 0, np.clip(np.rint(scales / d64), -32, 31), 0).astype(np.int64)
    dl = (d.astype(np.float32)[:, None] * ls.astype(np.float32)).astype(np.float64)  # (n, 8): what decodes
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(dl[..., None] != 0, x / dl[..., None], 0)
    codes = _pack_nibbles(_nearest_code(v, KVALUES_IQ4NL)).reshape(-1, 128)
    u = (ls + 32).astype(np.uint16)  # 0..63: low 4 bits to scales_l, high 2 to scales_h
    low = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
    high = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    return np.concatenate([_halves(d), high[:, None].view(np.uint8), low.astype(np.uint8), codes], axis=-1)


_OWN_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.Q4_K: _quantize_q4_k, T.Q5_K: _quantize_q5_k, T.Q6_K: _quantize_q6_k, T.Q2_K: _quantize_q2_k,
    T.Q3_K: _quantize_q3_k, T.IQ4_NL: _quantize_iq4_nl, T.IQ4_XS: _quantize_iq4_xs,
}


def quantize(x: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """float32 (..., n) → raw GGUF blocks uint8 (..., row_bytes), readable by `dequantize` and llama.cpp."""
    block, type_size = block_info(ggml_type)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % block:
        raise GGUFError(f"quants: rows of {x.shape[-1] if x.ndim else 0} elements cannot be stored as "
                        f"{ggml_type.name}, whose blocks hold {block}; pick a type whose block size divides the row.")
    if not np.isfinite(x).all():
        raise GGUFError(f"quants: values to quantize as {ggml_type.name} must be finite.")
    if ggml_type not in (T.F32, T.BF16) and x.size and np.abs(x).max() > _FP16_SAFE_MAX:
        raise GGUFError(f"quants: {ggml_type.name} keeps scales in fp16, so values must stay below "
                        f"{_FP16_SAFE_MAX:g} in magnitude; store such a tensor as F32 or BF16.")
    if ggml_type in _OWN_QUANTIZERS:
        blocks = _OWN_QUANTIZERS[ggml_type](np.ascontiguousarray(x).reshape(-1, block))
    else:
        blocks = np.ascontiguousarray(gguf_quants.quantize(x, ggml_type)).view(np.uint8)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // block * type_size)
