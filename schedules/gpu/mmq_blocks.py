"""The 8-bit GEMM's blocks (--prefill-gemm q8, mmq_gemm.py): the quantizer's statements (a thread per 32 activations),
the unpacking of a 32-value weight block to int8 words and its scales (WeightBlock), and the arithmetic of the whole
GEMM in numpy (emulate), which the tests hold the kernel's parts and float64 to.

The order of the 32 values in the words is the CPU int8 build's (cpu_int8.Q8Format: "nibbles", the 16 even elements
then the 16 odd ones, for 2-6 bit quants; natural for Q8_0), so a Q4 word's low nibbles are 4 int8 values of the
activations' order as they stand. Word w of a block holds elements of the 16-value sub-block (w % 4) // 2.
Q6_K's and Q3_K's scales are per 16 values (SIXTEENS_TYPES): their shared words are permuted (Q6_SLOTS) so that
bytes 0-15 of a block hold elements 0-15 and bytes 16-31 elements 16-31, what mma.m16n8k16 takes as (a0, a1, b0)
and (a2, a3, b1). Q2_K and Q3_K keep their 2 low bits 16 to a word of `qs`, in an order (quant_layout._2bit) where
word w of a block is one shift and one mask of the plane's word w % 2; Q3_K or's in its hmask bit as the third bit
(value − 4, as ggml's load_tiles_q3_K: −4..3).

Q2_K (w = d·sc·q − dmin·mn per 16 values, sc and mn 4-bit, q 0..3): its words hold sc·q (≤ 45: one integer
multiply a word, no byte carries), so that one m16n8k32 dots a whole block and d_w is the super-block's d. Its
minimum per 16 values, m_w = −dmin·mn, needs the activations' sum over those 16 values, where the Q8_1 forms carry
one per 32. Rather than a further scratch plane of sums per 16 (another output of the quantizer, and of every call
the lowering and the grouped expert GEMM make), the GEMM takes the quants' sum S over each 16 values from the x tile
it already holds: one more m16n8k32 per 16 rows and block, against bytes of 1 (llama.cpp's MMQ does the same for
the last quarter of its Q2_K blocks, and its mmvq dp4a's the quants against 4 × m), whose even output columns sum
the block's first 16 values and odd ones its last 16 (the B operand's words select a sub-block by column). d_x·S is
exact in float32 (fp16 times |S| ≤ 2,032: ≤ 22 bits), so each minimum term rounds once and the activations stay
Q8_0 blocks whose only rounding is to 8 bits: q8_0's values (graph/rounding.GPU_Q8_0_TYPES), as for Q3_K.
"""

from __future__ import annotations

import numpy as np
from luce_schedules.gpu.mma_gemm import i32, u32
from tvm import tirx
from tvm.script.ir_builder import tirx as B

from luce_compile.lower.q8_gemm import Q8_GEMM_OFFSET
from luce_compile.lower.quant_layout import TWO_BIT_SLOTS
from luce_compile.lower.quant_matmul import (
    CODEBOOKS,
    byte_perm,
    e8m0_half,
    exact_int_to_float,
    table16_bytes,
    table_words,
)

BLOCK = 32  # values per activation scale, per weight block, per m16n8k32
NIBBLES = 0x0F0F0F0F
TWO_BITS = 0x03030303
Q6_SLOTS = (0, 1, 4, 5, 2, 3, 6, 7)  # shared slot of word w for SIXTEENS_TYPES (an involution): elements 0-15 in 0-3
QUANT_THREADS = 256
MINIMUM_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # a minimum term m_w per block, against the activations' sums
SIXTEENS_TYPES = ("Q3_K", "Q6_K")  # a weight scale per 16 values: two m16n8k16 a block, its words permuted
SUMS16_TYPES = ("Q2_K",)  # a minimum per 16 values, against the sums of the x tile's quants per 16 (an mma with ones)
TWO_BIT_TYPES = ("Q2_K", "Q3_K")  # quant_layout._2bit's `qs`: 16 low 2-bit fields a word, 2 words a block


def groups(qtype: str) -> int:
    """Weight scales (and mma.sync) per 32-value block: 2 for SIXTEENS_TYPES (m16n8k16 each), else 1 (m16n8k32)."""
    return 2 if qtype in SIXTEENS_TYPES else 1


def minimums(qtype: str) -> int:
    """Minimum terms m_w per 32-value block: 1 against s_x (MINIMUM_TYPES), 2 against d_x·S per 16 values
    (SUMS16_TYPES), else 0."""
    return 1 if qtype in MINIMUM_TYPES else 2 if qtype in SUMS16_TYPES else 0


def _spread1(v: tirx.Expr, bit: int) -> tirx.Expr:
    """Bits 0, 2, 4, 6 of v to bit `bit` of bytes 0-3 (the even elements' high bits: a Q5 granule's fifth bits at 4,
    Q3_K's third at 2)."""
    return ((v & u32(1)) << u32(bit)) | ((v & u32(4)) << u32(bit + 6)) | ((v & u32(16)) << u32(bit + 12)) | \
        ((v & u32(64)) << u32(bit + 18))


def _spread6(v: tirx.Expr) -> tirx.Expr:
    """Bit pairs at 0, 4, 8, 12 of v to bits 4-5 of bytes 0-3 (a Q6_K granule's high bits, even elements)."""
    return ((v & u32(0x3)) << u32(4)) | ((v & u32(0x30)) << u32(8)) | ((v & u32(0x300)) << u32(12)) | \
        ((v & u32(0x3000)) << u32(16))


def _centred(word: tirx.Expr, offset: int) -> tirx.Expr:
    """Each byte minus offset, as signed bytes (bytes 0..63, offset ≤ 32: no borrow or carry crosses a byte)."""
    high = u32(0x80808080)
    return ((word | high) - u32(offset * 0x01010101)) ^ high


class WeightBlock:
    """One 32-value block of one weight row, staged a step: its words loaded into registers (`load`, in flight while
    the step before computes), then unpacked to the 8 int8 words of the nibbles order and its float32 scales."""

    def __init__(self, qtype: str, views: dict[str, tirx.Buffer], n: tirx.Expr, b: tirx.Expr, n_in: int,
                 perm=byte_perm):  # noqa: ANN001
        self.qtype, self.views, self.n, self.b, self.n_in = qtype, views, n, b, n_in
        self.perm = perm  # CUDA's __byte_perm (a CPU harness gives its TIR equivalent)
        self.regs: dict[str, tirx.Buffer] = {}

    def _reg(self, name: str, count: int, dtype: str, at: tirx.Expr) -> None:
        reg = B.alloc_buffer((count,), dtype, scope="local")
        src = self.views[name]
        for h in range(0, count, 4):
            lanes = min(4, count - h)
            value = src[at + h] if lanes == 1 else src.vload([at + h], f"{dtype}x{lanes}")
            B.buffer_store(reg, value, [i32(h)] if lanes == 1 else [tirx.Ramp(i32(h), i32(1), lanes)])
        self.regs[name] = reg

    def load(self) -> None:
        n, b, k, t = self.n, self.b, self.n_in, self.qtype
        nb, sb = k // BLOCK, b // 8  # 32-value blocks a row; the 256-value super-block of b
        if t == "Q8_0":
            self._reg("qs", 8, "uint32", n * (k // 4) + 8 * b)
        elif t in TWO_BIT_TYPES:
            self._reg("qs", 2, "uint32", n * (k // 16) + 2 * b)
        else:
            self._reg("qs", 4, "uint32", n * (k // 8) + 4 * b)
        if t in ("Q5_0", "Q5_1", "Q5_K", "Q3_K"):
            self._reg("qh", 1, "uint32", n * nb + b)
        if t == "Q6_K":
            self._reg("qh", 2, "uint32", n * (k // 16) + 2 * b)
        k_quant = t.endswith("_K") or t == "IQ4_XS"  # a d per 256-value super-block
        if t == "MXFP4":  # an E8M0 exponent a block for d
            self._reg("e:flat", 1, "uint8", n * nb + b)
        else:
            self._reg("d:flat", 1, "float16", n * (k // 256) + sb if k_quant else n * nb + b)
        if t == "IQ4_XS":
            self._reg("sc:flat", 1, "int8", n * nb + b)  # ls − 32 of the block
        if t in ("Q4_1", "Q5_1"):
            self._reg("m:flat", 1, "float16", n * nb + b)
        if t in ("Q4_K", "Q5_K"):
            self._reg("dmin:flat", 1, "float16", n * (k // 256) + sb)
            self._reg("sc:flat", 1, "uint8", n * nb + b)
            self._reg("mn:flat", 1, "uint8", n * nb + b)
        if t in SIXTEENS_TYPES:  # sc − 32 (Q3_K) or sc of each 16 values
            self._reg("sc:flat", 2, "int8", n * (k // 16) + 2 * b)
        if t == "Q2_K":
            self._reg("dmin:flat", 1, "float16", n * (k // 256) + sb)
            self._reg("sc:flat", 2, "uint8", n * (k // 16) + 2 * b)
            self._reg("mn:flat", 2, "uint8", n * (k // 16) + 2 * b)

    def words(self) -> list[tirx.Expr]:
        """The block's 32 int8 quants (centred; Q2_K's times their scale) as 8 words in the order of its shared
        slots."""
        t, qs = self.qtype, self.regs["qs"]
        if t == "Q8_0":
            return [qs[w] for w in range(8)]
        if t in TWO_BIT_TYPES:  # word w: the 2-bit fields at 2·(w // 2) of the plane's word w % 2 (quant_layout._2bit)
            lo = [(qs[j % 2] >> u32(2 * (j // 2))) & u32(TWO_BITS) for j in range(4)]
            hi = [(qs[j % 2] >> u32(2 * (j // 2) + 4)) & u32(TWO_BITS) for j in range(4)]
        else:
            lo = [qs[j] & u32(NIBBLES) for j in range(4)]
            hi = [(qs[j] >> u32(4)) & u32(NIBBLES) for j in range(4)]
        if t in ("Q5_0", "Q5_1", "Q5_K", "Q3_K"):
            qh, bit = self.regs["qh"][0], 2 if t == "Q3_K" else 4
            lo = [lo[j] | _spread1(qh >> u32(8 * j), bit) for j in range(4)]
            hi = [hi[j] | _spread1(qh >> u32(8 * j + 1), bit) for j in range(4)]
        if t == "Q2_K":  # sc·q ≤ 45 a byte: one multiply a word; words j and 4 + j are sub-block j // 2's
            sc = [self.regs["sc:flat"][h].astype("uint32") for h in range(2)]
            lo = [lo[j] * sc[j // 2] for j in range(4)]
            hi = [hi[j] * sc[j // 2] for j in range(4)]
        if t == "Q6_K":
            high = [self.regs["qh"][j // 2] >> u32(16 * (j % 2)) for j in range(4)]
            lo = [lo[j] | _spread6(high[j]) for j in range(4)]
            hi = [hi[j] | _spread6(high[j] >> u32(2)) for j in range(4)]
        words = lo + hi  # nibbles order: the 16 even elements, then the 16 odd ones
        if t in CODEBOOKS:  # each byte's index → its signed codebook value (kvalues_iq4nl), three byte permutes a word
            table = [u32(w) for w in table_words(CODEBOOKS[t])]
            words = [table16_bytes(w, table, self.perm, u32) for w in words]
        if t in Q8_GEMM_OFFSET:
            words = [_centred(w, Q8_GEMM_OFFSET[t]) for w in words]
        return [words[Q6_SLOTS[s]] for s in range(8)] if t in SIXTEENS_TYPES else words

    def scales(self) -> tuple[list[tirx.Expr], list[tirx.Expr]]:
        """(d_w per scale group of the block (`groups`: one, or the two 16-value sub-blocks of SIXTEENS_TYPES), m_w
        per minimum (`minimums`: none, one per block, or Q2_K's two)), float32, exact: an fp16 times a ≤ 6-bit
        integer."""
        r, itof = self.regs, exact_int_to_float
        if self.qtype == "MXFP4":  # 2^(e − 128): its codebook values are doubled (kvalues_mxfp4)
            return [e8m0_half(r["e:flat"][0])], []
        d = r["d:flat"][0].astype("float32")
        if self.qtype in ("Q4_K", "Q5_K", "Q2_K"):
            dmin, count = r["dmin:flat"][0].astype("float32"), minimums(self.qtype)
            mins = [-(dmin * itof(r["mn:flat"][h])) for h in range(count)]
            return ([d] if self.qtype == "Q2_K" else [d * itof(r["sc:flat"][0])]), mins
        if self.qtype in SIXTEENS_TYPES or self.qtype == "IQ4_XS":
            return [d * itof(r["sc:flat"][h]) for h in range(groups(self.qtype))], []
        return [d], ([r["m:flat"][0].astype("float32")] if "m:flat" in r else [])


def _bytes(q: list[tirx.Expr]) -> tirx.Expr:
    """Four int32 values in -127..127 as the signed bytes of one word, the first lowest."""
    b = [tirx.reinterpret("uint32", v) & u32(0xFF) for v in q]
    return b[0] | (b[1] << u32(8)) | (b[2] << u32(16)) | (b[3] << u32(24))


def _div_rn(a: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
    """a / b rounded to nearest (IEEE), as numpy divides: TVM builds CUDA with --use_fast_math, under which `/` is an
    approximate division (2 ulp) and x · 127/amax would fall on the other side of a rounding boundary now and then."""
    return tirx.call_pure_extern("float32", "__fdiv_rn", a, b)


def quantize_block(x: tirx.Buffer, out: dict[str, tirx.Buffer], r: tirx.Expr, blk: tirx.Expr, n_in: int,
                   order: str, div=_div_rn) -> None:
    """Block blk (32 values) of row r of x (float32, flat) into out's xq (words), xd [, xs] (flat): the statements of
    one thread of kernel 1 (and of the CPU harness that checks them, tests/schedules/test_gpu_mmq_gemm.py, which
    passes the plain division for `div`: __fdiv_rn is CUDA's)."""
    v = B.alloc_buffer((BLOCK,), "float32", scope="local")
    for h in range(BLOCK // 4):  # 16-byte loads
        B.buffer_store(v, x.vload([r * n_in + blk * BLOCK + 4 * h], "float32x4"), [tirx.Ramp(i32(4 * h), i32(1), 4)])
    amax = B.alloc_buffer((1,), "float32", scope="local")
    B.buffer_store(amax, tirx.abs(v[0]), [i32(0)])
    for i in range(1, BLOCK):
        B.buffer_store(amax, tirx.max(amax[0], tirx.abs(v[i])), [i32(0)])
    zero = tirx.const(0.0, "float32")
    inv = B.alloc_buffer((1,), "float32", scope="local")
    B.buffer_store(inv, tirx.Select(amax[0] > zero, div(tirx.const(127.0, "float32"), amax[0]), zero), [i32(0)])
    q = B.alloc_buffer((BLOCK,), "int32", scope="local")
    for i in range(BLOCK):
        B.buffer_store(q, tirx.nearbyint(v[i] * inv[0]).astype("int32"), [i32(i)])
    # word w of the block holds elements 4w..4w + 3 (natural) or 2·(4w + j) + w // 4 for j = 0..3 (nibbles: the
    # 16 even elements, then the 16 odd ones: cpu_int8.Q8Format.position_element)
    fmt_elements = [[4 * w + j for j in range(4)] if order == "natural" else [2 * ((4 * w + j) % 16) + w // 4
                                                                               for j in range(4)] for w in range(8)]
    words = B.alloc_buffer((8,), "uint32", scope="local")
    for w in range(8):
        B.buffer_store(words, _bytes([q[e] for e in fmt_elements[w]]), [i32(w)])
    first = (r * n_in + blk * BLOCK) // 4
    for h in range(2):
        B.buffer_store(out["xq"], words.vload([i32(4 * h)], "uint32x4"), [tirx.Ramp(first + 4 * h, i32(1), 4)])
    d = div(amax[0], tirx.const(127.0, "float32"))  # s takes the float32 d (cpu_int8.quantize_q8)
    at = r * (n_in // BLOCK) + blk
    B.buffer_store(out["xd"], d.astype("float16").astype("float32"), [at])
    if "xs" in out:
        total = q[0]
        for i in range(1, BLOCK):
            total = total + q[i]
        B.buffer_store(out["xs"], (d * total.astype("float32")).astype("float16").astype("float32"), [at])


def quantize_rows(x: tirx.Buffer, out: dict[str, tirx.Buffer], rows: tirx.Expr, n_in: int, order: str) -> None:
    """Kernel 1: every row of x into out, a thread per 32-value block."""
    blocks = n_in // BLOCK
    total = rows * blocks
    bx, tx = B.env_thread("blockIdx.x"), B.env_thread("threadIdx.x")
    with B.launch_thread(bx, (total + (QUANT_THREADS - 1)) // QUANT_THREADS), B.launch_thread(tx, QUANT_THREADS):
        g = bx * QUANT_THREADS + tx
        with B.If(g < total), B.Then():
            quantize_block(x, out, g // blocks, g % blocks, n_in, order)


def plane_views(planes: dict[str, tirx.Buffer]) -> dict[str, tirx.Buffer]:
    """int32-indexed flat views of the weight planes, as WeightBlock reads them: `<plane>:flat`, and `qs`, `qh` as
    32-bit words."""
    views: dict[str, tirx.Buffer] = {}
    for pl, buf in planes.items():
        count = int(buf.shape[0]) * int(buf.shape[1])
        views[f"{pl}:flat"] = B.decl_buffer((count,), buf.dtype, data=buf.data)
        if pl in ("qs", "qh"):
            bits = 8 if str(buf.dtype) == "int8" else 32
            views[pl] = B.decl_buffer((count * bits // 32,), "uint32", data=buf.data)
    return views


# ---- the arithmetic in numpy (tests; scripts/device_check.py compares the GPU's result with float64) -----------------
def _fields(words: np.ndarray, bits: int) -> np.ndarray:
    """(n, W) uint32 → (n, W·32/bits) fields, field i of word w at bits·i (the planes' element order)."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    return ((words[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(words.shape[0], -1).astype(np.int32)


def weight_integers(qtype: str, planes: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """What the kernel multiplies and scales, from the repacked planes: the centred quants q (n, K) int32 in element
    order (Q2_K's times their scale), d_w (n, K/group) float32 (group 32, SIXTEENS_TYPES 16) and m_w (n, K/32, Q2_K
    K/16) float32 or None."""
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    if qtype == "Q8_0":
        q = planes["qs"].astype(np.int32)
    elif qtype in CODEBOOKS:
        q = np.array(CODEBOOKS[qtype], np.int32)[_fields(planes["qs"], 4)]
    elif qtype in TWO_BIT_TYPES:  # the plane's slot order back to element order (quant_layout.TWO_BIT_SLOTS)
        slots = _fields(planes["qs"], 2)
        q = np.empty_like(slots).reshape(slots.shape[0], -1, BLOCK)
        q[..., TWO_BIT_SLOTS] = slots.reshape(q.shape)
        q = q.reshape(slots.shape)
        if qtype == "Q3_K":
            q |= _fields(planes["qh"], 1) << 2
    else:
        q = _fields(planes["qs"], 4)
        if qtype in ("Q5_0", "Q5_1", "Q5_K"):
            q |= _fields(planes["qh"], 1) << 4
        if qtype == "Q6_K":
            q |= _fields(planes["qh"], 2) << 4
    q = q - Q8_GEMM_OFFSET.get(qtype, 0)
    if qtype == "MXFP4":  # GGML_E8M0_TO_FP32_HALF: 2^(e − 128)
        return q, np.ldexp(np.float32(1), planes["e"].astype(np.int32) - 128).astype(np.float32), None
    d = f32(planes["d"])
    if qtype in ("Q4_K", "Q5_K"):
        per = np.repeat(d, 8, axis=1)
        return q, per * f32(planes["sc"]), -(np.repeat(f32(planes["dmin"]), 8, axis=1) * f32(planes["mn"]))
    if qtype == "Q2_K":
        q = q * np.repeat(planes["sc"].astype(np.int32), 16, axis=1)
        return q, np.repeat(d, 8, axis=1), -(np.repeat(f32(planes["dmin"]), 16, axis=1) * f32(planes["mn"]))
    if qtype in SIXTEENS_TYPES:
        return q, np.repeat(d, 16, axis=1) * f32(planes["sc"]), None
    if qtype == "IQ4_XS":
        return q, np.repeat(d, 8, axis=1) * f32(planes["sc"]), None
    return q, d, (f32(planes["m"]) if "m" in planes else None)


def _fma_np(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a·b + c rounded once to float32 (the product of two float32 values is exact in float64)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def emulate(qtype: str, planes: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """y (rows, n) float32 as the kernel computes it: x quantized as kernel 1 does (graph/rounding.q8_blocks, d and s
    rounded to fp16), each block's int32 dot exact, then the float32 scale and minimum terms in the kernel's order
    (mmq_gemm.py's docstring; Q2_K's minima per 16 values against d_x·S, S the quants' sum over those 16, exact).
    The integer dots do not depend on the order of the 32 values in the words, so this works in element order."""
    from luce_compile.graph.rounding import q8_blocks

    qx, d32 = q8_blocks(np.asarray(x, np.float32))  # (rows, nb, 32) natural order, (rows, nb, 1) float32
    qx = qx.astype(np.int64)
    dx = d32[..., 0].astype(np.float16).astype(np.float32)
    sx = (d32[..., 0] * qx.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)
    qw, dw, mw = weight_integers(qtype, planes)
    n, k = qw.shape
    group, per_min = k // dw.shape[1], (0 if mw is None else mw.shape[1] // (k // BLOCK))
    qw = qw.reshape(n, -1, group).astype(np.int64)
    # (rows, nb, 2): d_x·S per 16 values, exact in float32 (fp16 · |S| ≤ 2,032)
    sums16 = dx[..., None] * qx.reshape(*qx.shape[:2], 2, 16).sum(-1).astype(np.float32)
    acc = np.zeros((x.shape[0], n), np.float32)
    for b in range(k // BLOCK):
        for g in range(BLOCK // group):
            sub = b * (BLOCK // group) + g
            c = qx[:, b, g * group:(g + 1) * group] @ qw[:, sub].T  # (rows, n): exact
            u = (c.astype(np.float32) * dw[None, :, sub]).astype(np.float32)  # fl(C·d_w): what fma(fb, d_w, nm) is
            acc = _fma_np(u, dx[:, b, None], acc)
        if per_min == 1:
            acc = _fma_np(np.broadcast_to(mw[None, :, b], acc.shape), sx[:, b, None], acc)
        elif per_min == 2:  # Q2_K: the first 16 values' minimum, then the last 16's
            for h in range(2):
                acc = _fma_np(np.broadcast_to(mw[None, :, 2 * b + h], acc.shape), sums16[:, b, h, None], acc)
    return acc
