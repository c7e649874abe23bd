"""Lossless repacking of raw GGUF weight blocks into the planes the quantized matmul kernels read.

GGUF stores each block as one interleaved record (scales, then quants in a per-type nibble order). The kernels read
struct-of-arrays planes instead, so that one vector load fetches the same field of consecutive elements. Nothing
is dequantized: every plane holds the original bits, only moved. The conventions, shared by every type:

- `qs` (n_out, n_in/8) uint32: the low 4 bits of element k sit at bits 4*(k%8) of word k//8 (GGUF's Q4_0/Q4_1
  and K-quant blocks put element j and j+16 (or j+32, j+64) in one byte; here consecutive elements are adjacent).
  IQ4_NL, IQ4_XS and MXFP4 keep their 4-bit codebook indices there the same way; Q2_K and Q3_K their 2 low bits, 16
  per word, in a slot order per group of 32 that the int8 kernels unpack with one shuffle and one shift (`_2bit`).
- `qh` uint32, one bit per element for the 5-bit types and Q3_K (bit k%32 of word k//32, the order Q5_0/Q5_1 already
  use) and two bits per element for Q6_K (bits 2*(k%16) of word k//16).
- scales stay float16 (`d`, `m`, `dmin`, one per block or super-block); the 6-bit K-quant sub-block scales and mins
  are unpacked into uint8 planes `sc`/`mn` (8 per super-block), Q6_K's int8 scales into an int8 plane `sc`; Q2_K's
  4-bit scales and mins into uint8 `sc`/`mn` (16 per super-block); Q3_K's and IQ4_XS's 6-bit scales, minus their
  offset 32, into an int8 `sc` (16 and 8 per super-block); MXFP4's E8M0 block exponents stay bytes, `e`.
- F32/F16 keep their values in `w`; BF16 keeps its bits as a uint16 plane `w` (numpy has no bfloat16), except
  that `weight_planes` widens a BF16 vector to float32.

Block formats: llama.cpp ggml/src/ggml-common.h (block_q4_0 ... block_q6_K); the decoders they must agree with are
in gguf-py/gguf/quants.py.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.quants import iq4_xs_scales, q3_k_scales
from luce_compile.graph.rope_pairs import reorder_rows

QK_K = 256  # elements per K-quant super-block
PlaneSpecs = dict[str, tuple[tuple[int, ...], str]]

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
                 "IQ4_NL", "IQ4_XS", "MXFP4")
)


def as_ggml_type(ggml_type: GGMLQuantizationType | str | int) -> GGMLQuantizationType:
    """The GGML type for a type, its name ("Q4_1") or its code; refuses the ones the kernels do not handle."""
    try:
        qtype = GGMLQuantizationType[ggml_type] if isinstance(ggml_type, str) else GGMLQuantizationType(ggml_type)
    except (KeyError, ValueError) as err:
        raise UnsupportedError(f"lower: unknown GGML type {ggml_type!r}; expected one of {_names()}") from err
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedError(
            f"lower: GGML type {qtype.name} has no quantized matmul kernel yet; supported: {_names()}. "
            "Requantize the model (llama-quantize) to one of those types."
        )
    return qtype


def _names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def plane_specs(ggml_type: GGMLQuantizationType | str, n_out: int, n_in: int) -> PlaneSpecs:
    """Name → (shape, dtype) of every plane a (n_out, n_in) weight of this type is repacked into, in kernel order."""
    qtype = as_ggml_type(ggml_type)
    block = GGML_QUANT_SIZES[qtype][0]
    if n_out <= 0 or n_in <= 0 or n_in % block:
        raise GGUFError(
            f"lower: a {qtype.name} weight needs n_in a positive multiple of {block}, got ({n_out}, {n_in})"
        )
    name = qtype.name
    if name in ("F32", "F16", "BF16"):
        return {"w": ((n_out, n_in), {"F32": "float32", "F16": "float16", "BF16": "uint16"}[name])}

    def f16(cols: int) -> tuple[tuple[int, ...], str]:
        return (n_out, cols), "float16"

    qs = ((n_out, n_in // 8), "uint32")
    if name == "Q8_0":
        return {"d": f16(n_in // 32), "qs": ((n_out, n_in), "int8")}
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        specs: PlaneSpecs = {"d": f16(n_in // 32)}
        if name.endswith("_1"):
            specs["m"] = f16(n_in // 32)
        if name.startswith("Q5"):
            specs["qh"] = ((n_out, n_in // 32), "uint32")
        return specs | {"qs": qs}
    if name in ("Q4_K", "Q5_K"):
        specs = {"d": f16(n_in // QK_K), "dmin": f16(n_in // QK_K)}
        specs |= {"sc": ((n_out, n_in // 32), "uint8"), "mn": ((n_out, n_in // 32), "uint8")}
        if name == "Q5_K":
            specs["qh"] = ((n_out, n_in // 32), "uint32")
        return specs | {"qs": qs}
    sixteenths = (n_out, n_in // 16)
    if name == "Q6_K":
        return {"d": f16(n_in // QK_K), "sc": (sixteenths, "int8"), "qs": qs, "qh": (sixteenths, "uint32")}
    if name == "Q2_K":
        return {"d": f16(n_in // QK_K), "dmin": f16(n_in // QK_K), "sc": (sixteenths, "uint8"),
                "mn": (sixteenths, "uint8"), "qs": (sixteenths, "uint32")}
    if name == "Q3_K":
        return {"d": f16(n_in // QK_K), "sc": (sixteenths, "int8"), "qs": (sixteenths, "uint32"),
                "qh": ((n_out, n_in // 32), "uint32")}
    if name == "IQ4_NL":
        return {"d": f16(n_in // 32), "qs": qs}
    if name == "IQ4_XS":
        return {"d": f16(n_in // QK_K), "sc": ((n_out, n_in // 32), "int8"), "qs": qs}
    # MXFP4
    return {"e": ((n_out, n_in // 32), "uint8"), "qs": qs}


REPACK_BYTES = 4 << 20  # raw bytes repacked at once (repack): a 128K-vocabulary embedding at ~30x would take GBs


def repack(raw: np.ndarray, ggml_type: GGMLQuantizationType | str) -> dict[str, np.ndarray]:
    """Split raw GGUF rows (uint8, (n_out, row_bytes)) into the planes of `plane_specs`, bit for bit."""
    qtype = as_ggml_type(ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % type_size:
        raise GGUFError(
            f"lower: repack expects raw {qtype.name} rows as uint8 (n_out, k*{type_size}) (GGUFFile.raw), "
            f"got {raw.dtype} {raw.shape}"
        )
    n_out, n_blocks = raw.shape[0], raw.shape[1] // type_size
    specs = plane_specs(qtype, n_out, n_blocks * block)
    out = {name: np.empty(shape, dt) for name, (shape, dt) in specs.items()}
    # every plane is row-major in the weight's rows: repacked REPACK_BYTES of rows at a time, the repackers' wide
    # temporaries (uint32 per nibble, shifted copies: ~30x the raw bytes) stay that small, whatever the tensor
    step = max(1, REPACK_BYTES // raw.shape[1])
    for lo in range(0, n_out, step):
        rows = np.ascontiguousarray(raw[lo:lo + step])
        planes = _REPACKERS[qtype.name](rows.reshape(rows.shape[0], n_blocks, type_size))
        assert planes.keys() == specs.keys(), (qtype.name, planes.keys())
        for name, plane in planes.items():
            out[name][lo:lo + rows.shape[0]] = np.asarray(plane).reshape(rows.shape[0], *specs[name][0][1:])
    return out


def weight_planes(raw: np.ndarray, ggml_type: GGMLQuantizationType | str, n_dims: int,
                  row_pairs: int = 0) -> dict[str, np.ndarray]:
    """One GGUF tensor's raw bytes (GGUFFile.raw) → the arrays the compiled model takes for it, as weights.bin holds
    them: the planes of `repack`, except that a BF16 vector (a norm or bias, n_dims 1) is widened to float32, exactly
    (bf16 is the top half of a float32), because the graph uses vectors as activation-dtype values
    (relax_model.weight_specs). `row_pairs`: the head size within which the graph reorders the tensor's rows (a
    vector's values), Graph.row_pairs (graph/rope_pairs.py); 0: as stored. The compiler's writer and
    scripts/device_check.py both call this, so the weights a GPU machine rebuilds are the bytes the build wrote."""
    planes = repack(np.asarray(raw).reshape(-1, raw.shape[-1]), ggml_type)
    if row_pairs:  # every plane is row-major in the rows; a vector's one row holds its values
        planes = {name: reorder_rows(p.reshape(-1) if n_dims == 1 else p, row_pairs).reshape(p.shape)
                  for name, p in planes.items()}
    if n_dims == 1 and as_ggml_type(ggml_type).name == "BF16":
        return {"w": (planes["w"].astype(np.uint32) << 16).view(np.float32)}
    return planes


def _f16(fields: np.ndarray) -> np.ndarray:
    """(..., 2) little-endian bytes → (...) float16."""
    return np.ascontiguousarray(fields).view("<f2")[..., 0].astype(np.float16)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """(n_out, ..., E) small unsigned values → (n_out, total/(32/bits)) uint32, element i at bits bits*(i % per)."""
    per_word = 32 // bits
    flat = values.reshape(values.shape[0], -1, per_word).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    return np.bitwise_or.reduce(flat << shifts, axis=-1)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """GGUF nibble runs → element order: each `span` bytes hold `span` elements low, the next `span` high."""
    runs = qs.reshape(*qs.shape[:-1], -1, span)  # (..., runs, span)
    return np.stack([runs & 0x0F, runs >> 4], axis=-2)  # (..., runs, 2, span): low run, then high run


def _bits(qh: np.ndarray, span: int, bits: int) -> np.ndarray:
    """K-quant high bits: byte l of a `span` run holds element l + span*i in bits [bits*i, bits*(i+1))."""
    runs = qh.reshape(*qh.shape[:-1], -1, 1, span)
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1)
    return (runs >> shifts) & ((1 << bits) - 1)  # (..., runs, 8/bits, span)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte 6-bit scale/min packing of Q4_K/Q5_K (get_scale_min_k4 in ggml-quants.c) → 8 sc, 8 mn."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(sc.shape[0], -1), mn.reshape(mn.shape[0], -1)


def _dense(dtype: str):
    return lambda blocks: {"w": np.ascontiguousarray(blocks).view(dtype).reshape(blocks.shape[0], -1)}


def _q8_0(b: np.ndarray) -> dict[str, np.ndarray]:
    return {"d": _f16(b[..., 0:2]), "qs": b[..., 2:].view(np.int8)}


def _q4_x(b: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_0 (d, qs[16]) and Q4_1 (d, m, qs[16])."""
    has_min = b.shape[-1] == GGML_QUANT_SIZES[GGMLQuantizationType.Q4_1][1]
    planes = {"d": _f16(b[..., 0:2])} | ({"m": _f16(b[..., 2:4])} if has_min else {})
    return planes | {"qs": _pack(_nibbles(b[..., 4 if has_min else 2 :], 16), 4)}


def _q5_x(b: np.ndarray) -> dict[str, np.ndarray]:
    """Q5_0 (d, qh[4], qs[16]) and Q5_1 (d, m, qh[4], qs[16]); qh is already one bit per element in order."""
    has_min = b.shape[-1] == GGML_QUANT_SIZES[GGMLQuantizationType.Q5_1][1]
    o = 4 if has_min else 2
    planes = {"d": _f16(b[..., 0:2])} | ({"m": _f16(b[..., 2:4])} if has_min else {})
    qh = np.ascontiguousarray(b[..., o : o + 4]).view("<u4")[..., 0].astype(np.uint32)
    return planes | {"qh": qh, "qs": _pack(_nibbles(b[..., o + 4 :], 16), 4)}


def _q45_k(b: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K (d, dmin, scales[12], qs[128]) and Q5_K (same, qh[32] before qs)."""
    sc, mn = _k_scales(b[..., 4:16])
    planes = {"d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4]), "sc": sc, "mn": mn}
    if b.shape[-1] == GGML_QUANT_SIZES[GGMLQuantizationType.Q5_K][1]:
        planes["qh"] = _pack(_bits(b[..., 16:48], 32, 1), 1)
        return planes | {"qs": _pack(_nibbles(b[..., 48:], 32), 4)}
    return planes | {"qs": _pack(_nibbles(b[..., 16:], 32), 4)}


def _q6_k(b: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K (ql[128], qh[64], scales[16] int8, d): ql in 64-byte nibble runs, qh 2 bits in 32-byte runs."""
    return {
        "d": _f16(b[..., 208:210]),
        "sc": b[..., 192:208].view(np.int8),
        "qs": _pack(_nibbles(b[..., 0:128], 64), 4),
        "qh": _pack(_bits(b[..., 128:192], 32, 2), 2),
    }


# position p (0..31) of a group of 32 in the int8 kernels' "nibbles" order holds element 2·(p % 16) + p // 16
# (cpu_int8.Q8Format.position_element); 2-bit slot 4j + f (byte j, bits 2f) holds position 8f + j (TWO_BIT_SLOTS)
_NIBBLES_ORDER = np.array([2 * (p % 16) + p // 16 for p in range(32)])
TWO_BIT_SLOTS = np.array([_NIBBLES_ORDER[8 * (s % 4) + s // 4] for s in range(32)])  # slot → element of its group


def _2bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits (byte l of each 32-byte GGUF run holds elements l + 32i in bits 2i..2i+1) → the `qs`
    plane's slot order: in each group of 32, slot s holds element TWO_BIT_SLOTS[s], so that a group's 8 bytes,
    copied to four 8-byte lanes and shifted by 0, 2, 4, 6, give its quants in the kernels' nibbles order."""
    elements = _bits(qs, 32, 2).reshape(*qs.shape[:-1], -1, 32)  # (..., groups, 32) in element order
    return elements[..., TWO_BIT_SLOTS]


def _q2_k(b: np.ndarray) -> dict[str, np.ndarray]:
    """Q2_K (scales[16]: 4-bit scale low, min high, qs[64], d, dmin)."""
    sc = b[..., 0:16]
    return {"d": _f16(b[..., 80:82]), "dmin": _f16(b[..., 82:84]), "sc": (sc & 0x0F).reshape(sc.shape[0], -1),
            "mn": (sc >> 4).reshape(sc.shape[0], -1), "qs": _pack(_2bit(b[..., 16:80]), 2)}


def _q3_k(b: np.ndarray) -> dict[str, np.ndarray]:
    """Q3_K (hmask[32], qs[64], scales[12], d): the hmask bit is the quant's third bit (q − 4 is the value)."""
    return {"d": _f16(b[..., 108:110]), "sc": q3_k_scales(b[..., 96:108].reshape(-1, 12)).reshape(b.shape[0], -1),
            "qs": _pack(_2bit(b[..., 32:96]), 2), "qh": _pack(_bits(b[..., 0:32], 32, 1), 1)}


def _iq4_nl(b: np.ndarray) -> dict[str, np.ndarray]:
    """IQ4_NL (d, qs[16]): codebook indices in Q4_0's nibble order."""
    return {"d": _f16(b[..., 0:2]), "qs": _pack(_nibbles(b[..., 2:], 16), 4)}


def _iq4_xs(b: np.ndarray) -> dict[str, np.ndarray]:
    """IQ4_XS (d, scales_h, scales_l[4], qs[128]): 8 sub-blocks of 32, each 16 bytes in Q4_0's nibble order."""
    sc = iq4_xs_scales(b.reshape(-1, b.shape[-1])).reshape(b.shape[0], -1)
    return {"d": _f16(b[..., 0:2]), "sc": sc, "qs": _pack(_nibbles(b[..., 8:], 16), 4)}


def _mxfp4(b: np.ndarray) -> dict[str, np.ndarray]:
    """MXFP4 (e: E8M0, qs[16]): codebook indices in Q4_0's nibble order."""
    return {"e": b[..., 0], "qs": _pack(_nibbles(b[..., 1:], 16), 4)}


_REPACKERS = {
    "F32": _dense("<f4"),
    "F16": _dense("<f2"),
    "BF16": _dense("<u2"),
    "Q8_0": _q8_0,
    "Q4_0": _q4_x,
    "Q4_1": _q4_x,
    "Q5_0": _q5_x,
    "Q5_1": _q5_x,
    "Q4_K": _q45_k,
    "Q5_K": _q45_k,
    "Q6_K": _q6_k,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
}
