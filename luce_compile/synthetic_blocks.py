"""Valid GGML blocks made straight from random bytes, for synthetic models too big to quantize in numpy.

Quantizing a 14B model's float values in numpy takes far too long on a small machine; filling the quant fields of
each block with random bits and the scale fields with one chosen constant is as fast as the random generator
(~2 GB/s) and gives weights of a controlled distribution: mean 0 and a given std. The quant values are uniform
over their range (not normal as `tensor_values` makes them): for speed measurements and for logits from many
layers the shape does not matter, only the scale. How each type gets mean 0 without touching every element:

- symmetric types (q - 8, q - 16, int8): the one level without a mirror image (-8, -16, -128) becomes 0
  (Q4_0 nibble 0 → 8, Q5_0 q 0 → 16, Q8_0 -128 → 0), so the levels are symmetric and 0 is twice as likely;
- types with a minimum (Q4_1, Q5_1, Q4_K, Q5_K): the minimum cancels the mean level; for the K-quants with
  constant integer sub-block scale and min (sc = 2, m = 2^bits - 1, dmin = d: y = d·(2q - m)), exactly;
- Q6_K (q - 32 over -32..31, mean -1/2): its int8 sub-block scales alternate +1, -1, so the halves cancel.

Block layouts: ggml/src/ggml-common.h; the arithmetic is `luce_compile.gguf.quants.dequantize`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from luce_compile.errors import GGUFError
from luce_compile.gguf.quants import KVALUES_IQ4NL, KVALUES_MXFP4, pack_q3_k_scales

log = logging.getLogger(__name__)
T = GGMLQuantizationType

# fixes (n_blocks, type_size) uint8 blocks of random bytes in place; `scale(rms)` is the fp16 block scale d that
# gives levels of that rms the wanted std (d = std / rms)
Filler = Callable[[np.ndarray, Callable[[float], np.float16]], None]
FILLERS: dict[GGMLQuantizationType, Filler] = {}


def _register(ggml_type: GGMLQuantizationType) -> Callable[[Filler], Filler]:
    def wrap(fn: Filler) -> Filler:
        FILLERS[ggml_type] = fn
        return fn

    return wrap


def _sym_rms(top: int, n_levels: int) -> float:
    """rms of levels -top..top with 0 counted twice, out of n_levels equally likely raw values."""
    return float(np.sqrt(2 * sum(k * k for k in range(1, top + 1)) / n_levels))


def _uniform_rms(n_levels: int) -> float:
    """rms of q - (n-1)/2 for q uniform over 0..n-1."""
    return float(np.sqrt((n_levels * n_levels - 1) / 12))


def _put_f16(blocks: np.ndarray, start: int, value: np.float16) -> None:
    blocks[:, start:start + 2] = np.frombuffer(np.float16(value).astype("<f2").tobytes(), np.uint8)


def _zero_nibbles_to_8(qs: np.ndarray) -> None:
    lut = np.arange(256, dtype=np.uint8)
    lut[(lut & 0x0F) == 0] |= 0x08
    lut[(lut >> 4) == 0] |= 0x80
    qs[...] = lut[qs]


@_register(T.Q8_0)
def _q8_0(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d:f16 | qs:int8[32]
    np.putmask(blocks, blocks == 0x80, 0)  # -128 → 0; over the whole (contiguous) blocks: 3x faster, d is set next
    _put_f16(blocks, 0, scale(_sym_rms(127, 256)))


@_register(T.Q4_0)
def _q4_0(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d:f16 | qs[16]
    _zero_nibbles_to_8(blocks[:, 2:])  # q - 8: -8 → 0
    _put_f16(blocks, 0, scale(_sym_rms(7, 16)))


@_register(T.Q5_0)
def _q5_0(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d:f16 | qh[4] | qs[16]
    # q = nibble | high bit << 4; where the nibble is 0, setting the high bit turns q = 0 (-16) into 16 (0)
    qs = blocks[:, 6:]
    zero = np.concatenate([(qs & 0x0F) == 0, qs < 0x10], axis=1)  # element j: low nibble of qs[j % 16] or high
    blocks[:, 2:6] |= np.packbits(zero, axis=1, bitorder="little")
    _put_f16(blocks, 0, scale(_sym_rms(15, 32)))


@_register(T.Q4_1)
def _q4_1(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d:f16 | m:f16 | qs[16]
    d = scale(_uniform_rms(16))
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, np.float16(-7.5 * np.float32(d)))


@_register(T.Q5_1)
def _q5_1(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d:f16 | m:f16 | qh[4] | qs[16]
    d = scale(_uniform_rms(32))
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, np.float16(-15.5 * np.float32(d)))


def _pack_scale_min_k4(sc: int, m: int) -> np.ndarray:
    """The 12 scale bytes of a Q4_K/Q5_K super-block whose 8 sub-blocks all have scale sc and min m (6 bits each):
    the inverse of get_scale_min_k4 (sub-blocks 4..7 keep their low 4 bits in bytes 8..11, their top 2 bits in
    the spare top bits of bytes 0..7)."""
    low = [(sc & 63) | ((sc >> 4) << 6)] * 4 + [(m & 63) | ((m >> 4) << 6)] * 4
    return np.array(low + [(sc & 0x0F) | ((m & 0x0F) << 4)] * 4, dtype=np.uint8)


def _k_affine(blocks: np.ndarray, scale: Callable[[float], np.float16], bits: int) -> None:
    # y = (d·sc)·q - (dmin·m) with sc = 2, m = 2^bits - 1, dmin = d: y = d·(2q - m), mean 0 for q uniform
    top = (1 << bits) - 1
    d = scale(2 * _uniform_rms(top + 1))
    _put_f16(blocks, 0, d)
    _put_f16(blocks, 2, d)
    blocks[:, 4:16] = _pack_scale_min_k4(2, top)


@_register(T.Q4_K)
def _q4_k(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d | dmin | scales[12] | qs[128]
    _k_affine(blocks, scale, 4)


@_register(T.Q5_K)
def _q5_k(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d | dmin | sc[12] | qh[32] | qs[128]
    _k_affine(blocks, scale, 5)


@_register(T.Q6_K)
def _q6_k(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # ql[128] | qh[64] | sc:int8[16] | d
    blocks[:, 192:208] = np.tile(np.array([1, -1], dtype=np.int8), 8).view(np.uint8)
    _put_f16(blocks, 208, scale(float(np.sqrt(_uniform_rms(64) ** 2 + 0.25))))  # E[(q - 32)²], q uniform 0..63


@_register(T.Q2_K)
def _q2_k(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # scales[16] | qs[64] | d | dmin
    # as _k_affine: sc = 2, m = 3, dmin = d gives y = d·(2q − 3) over {−3, −1, 1, 3}·d
    d = scale(2 * _uniform_rms(4))
    blocks[:, 0:16] = 2 | (3 << 4)
    _put_f16(blocks, 80, d)
    _put_f16(blocks, 82, d)


@_register(T.Q3_K)
def _q3_k(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # hmask | qs[64] | scales[12] | d
    # q − 4 over −4..3 (mean −1/2): sub-block scales alternate +1, −1 (stored 33, 31), as Q6_K's, so halves cancel
    signs = np.tile(np.array([33, 31], dtype=np.uint8), 8)[None, :]
    blocks[:, 96:108] = pack_q3_k_scales(signs)
    _put_f16(blocks, 108, scale(float(np.sqrt(_uniform_rms(8) ** 2 + 0.25))))


def _codebook_rms(table: np.ndarray) -> float:
    return float(np.sqrt(np.mean(table.astype(np.float64) ** 2)))


@_register(T.IQ4_NL)
def _iq4_nl(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d:f16 | qs[16]
    # kvalues_iq4nl is not symmetric (mean −5.9): d alternates sign from block to block, so the levels are ±kv·d
    d = scale(_codebook_rms(KVALUES_IQ4NL))
    _put_f16(blocks, 0, d)
    blocks[1::2, 0:2] = np.frombuffer(np.float16(-d).astype("<f2").tobytes(), np.uint8)


@_register(T.IQ4_XS)
def _iq4_xs(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # d | scales_h | scales_l[4] | qs
    # the sign alternates per sub-block instead: ls − 32 = +1, −1 (ls 33, 31: low nibbles 1, 15; high bits 2, 1)
    _put_f16(blocks, 0, scale(_codebook_rms(KVALUES_IQ4NL)))
    blocks[:, 2:4] = np.frombuffer(np.uint16(sum((2 if ib % 2 == 0 else 1) << (2 * ib) for ib in range(8)))
                                   .astype("<u2").tobytes(), np.uint8)
    blocks[:, 4:8] = 0x01 | (0x0F << 4)


@_register(T.MXFP4)
def _mxfp4(blocks: np.ndarray, scale: Callable[[float], np.float16]) -> None:  # e:E8M0 | qs[16]
    # kvalues_mxfp4 is symmetric; its scale is a power of two, so blocks take 2^k or 2^(k+1) (k = floor(log2 of the
    # scale wanted)) at random in the proportion that gives the wanted mean square
    want = float(scale(_codebook_rms(KVALUES_MXFP4)))
    k = int(np.floor(np.log2(want)))
    p_low = (4 - (want / 2.0**k) ** 2) / 3  # p·4^k + (1 − p)·4^(k+1) = want²
    low = blocks[:, 0] < round(p_low * 256)  # the random byte decides
    blocks[:, 0] = np.where(low, k + 128, k + 129)


def random_blocks(rng: np.random.Generator, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
                  std: float) -> np.ndarray:
    """Raw blocks (*shape[:-1], row_bytes) uint8 of a quantized type whose values have mean 0 and std `std`."""
    if ggml_type not in FILLERS:
        raise GGUFError(f"synthetic: no direct block writer for {GGMLQuantizationType(ggml_type).name} "
                        f"(direct types: {', '.join(t.name for t in FILLERS)}); make its values with tensor_values.")
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // block
    n_bytes = n_blocks * type_size
    words = rng.bit_generator.random_raw(-(-n_bytes // 8))  # fastest source of random bits: ~2 GB/s
    blocks = np.asarray(words, dtype="<u8").view(np.uint8)[:n_bytes].reshape(n_blocks, type_size)

    def scale(rms: float) -> np.float16:
        d = np.float16(std / rms)
        if not np.isfinite(d) or d == 0 or abs(float(d) * rms / std - 1) > 0.01:
            log.warning("synthetic: %s scale %g for std %g is not exact in fp16 (got %g)", ggml_type.name,
                        std / rms, std, float(d) * rms)
        return d

    FILLERS[ggml_type](blocks, scale)
    return blocks.reshape(*shape[:-1], shape[-1] // block * type_size)
