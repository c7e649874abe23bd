"""CPU rule for the int8 GEMVs of luce_compile.lower.cpu_int8: AVX512-VNNI vpdpbusd kernels, llama.cpp's x86 loop.

`int8_matmul` defines the arithmetic as TE reductions; this rule replaces a function marked with INT8_GEMV_ATTR by
a hand-vectorized kernel with the same arguments (built from the definition's own parameter list) that computes
the same sums:
  per row and 32 values: 32 weight quants as bytes · 32 activation bytes → vpdpbusd.256 → 8 int32 partial sums
  (exact; lane l holds positions 4l..4l+3 of the group).
- 32-value types: G blocks at a time (G = 8, 4, 2 or 1, the largest power of two dividing the block count) have
  their 8-lane dots folded by pair sums into one int32xG of block totals (exact: |total| < 2^20), converted once and
  scaled by one FMA with G values of d_w·d_x (the fp16 d_w of G blocks widened by one instruction); Q4_1/Q5_1 add
  one FMA of G m_w·s_x. Per block that is ~1 vector op of scaling instead of 6 (fp16 load, convert, multiply,
  broadcast, convert, FMA): Qwen2.5-0.5B's Q5_0 4864x896 GEMV 161 → 119-132 µs, Q8_0 896x896 21 → 18 µs.
- K-quants: the 8 groups of a 256-value super-block are weighted by their integer sub-block scales (Q4_K/Q5_K: one
  per group; Q6_K: one per 16 values, which in the "nibbles" order puts lanes 0, 1, 4, 5 in the first 16 elements
  and 2, 3, 6, 7 in the second) into one int32x8 (exact: |sum| < 2^24 per lane, so its float conversion is too),
  then one FMA with d_w·d_x; Q4_K/Q5_K add one FMA with −dmin_w·d_x and Σ_j mn_j·(the two bsums of group j).
  The accumulator's lanes are summed once per row, at the end.
- Quants: Q4 nibbles are unsigned as they are (Q4_1, Q4_K); the fifth bit (Q5_*: one bit per element in `qh`) and
  Q6_K's two high bits are spread over the 32 lanes with one byte shuffle and a per-lane bit test.
- Q8_0 is signed: one activation row takes the sign trick of llama.cpp's mul_sum_i8_pairs, |w|
  as the unsigned operand and x with w's sign moved onto it (|w|·sign(w)x = w·x; w = −128 gives |w| = 128 as an
  unsigned byte, still exact); a batch moves x to unsigned bytes instead (x + 128: one xor per row) and starts each
  lane from −128·Σw, computed once per weight group (`_x_offset`): the same integers, 3 fewer vector ops per row.
  Q4_0 (q − 8) and Q5_0 (q − 16) instead dot the stored unsigned quants and subtract offset·Σx per block (Σx: the
  quantizer's `xi`), the same integer as ggml's Σ (q − offset)·x with 3 fewer vector ops per block: Q5_0 4864x896
  124 → 109 µs, 2048x640 38.4 → 34.0 µs, 896x896 22.4 → 20.2 µs (A/B in one process, min of 6 x 5 runs). Q6_K
  (q − 32) likewise dots its stored 6-bit q and subtracts 32·Σ_j sc_j·bsum_j per super-block (Q8_K's bsums, as
  int8_gemm and ggml's AVX2 q6_K dot do): the sign trick cost AVX2 4 ops a group (Zen 3: Q6_K 896x4864 -13% at
  one row, -18% at eight).
- Issue 40's types: IQ4_NL, IQ4_XS and MXFP4 turn 32 nibbles into their signed codebook values with one vpshufb
  (`_codebook`, as ggml's x86 iq4_nl/iq4_xs/mxfp4 dots) and then dot as the signed Q8_0 does (|w| ≤ 127, so AVX2's
  pair sums stay exact); MXFP4's E8M0 scales become float32 by their bits (`e8m0_half`). Q2_K's and Q3_K's 2-bit
  fields come from a slot order made for it (`_two_bits`: one shuffle, one shift), Q3_K's third bit as the fifth; Q3_K's
  q − 4 comes in as 4·Σ_j sc_j·bsum_j, as Q6_K's q − 32; Q2_K's per-16 mins take one bsum each. Not tuned: they
  share the Q4_K/Q6_K knobs.
- Several activation rows (the batched decode's B, verify's k + 1): each weight row's `unroll` units are unpacked
  once into local buffers (quants; Q8_0's −128·Σw) and dotted with up to TILE = 16 activation rows in
  turn, as ggml's vec_dot with nrc and its repacked GEMMs amortise the weights over rows. Each row keeps the GEMV's
  sums in the GEMV's order (the integers are the same), so a row of a batch equals that row alone, to the bit, and
  equals what the kernel gave before the weights were shared. Qwen2.5-Coder-1.5B's Q4_K 8960x1536 on 2 threads:
  8 rows 3.95 → 2.07 ms (one row 0.50 ms); Q6_K 1536x8960 7.2 → 2.3 ms (0.88 ms); what is left per row is the dot,
  the scales and, for the 32-value types, the fold (benchmarks/README.md, issue 13).
- `rows` weight rows go through each unit step together; parallel tasks take `chunk` groups of rows (each task
  allocates its accumulators once: TVM turns allocations inside a parallel loop into workspace calls); `unroll`
  blocks of 32 values (rounded to whole units: G-block groups, or super-blocks for the K-quants) are one expression
  (an FMA chain), so the accumulator goes through its buffer once per `unroll` blocks. Buffers and scalar bindings are
  what LLVM failed to keep in registers inside the model's whole module (it could not prove they alias no argument
  there; the same kernel alone was fine): with one buffer round trip per 8 blocks and `let` bindings the kernel
  runs as fast in the model as alone (SmolLM2 1536x576: 169 → 69 µs in the model build).
256-bit vectors as llama.cpp uses them (a block is 32 bytes). vpdpbusd's i8 operands are `<32 x i8>` in LLVM 22
(the wheel's LLVM); TVM 0.27's own dot_16x4_vnni intrinsic passes int32 vectors, which LLVM 22 rejects.

The kernel is built with TVMScript's IR builder so that one body serves every weight type's argument list.
This replaces instead of scheduling: tensorizing the TE definition is a later step (the issue's step 2 wants
repacked tiles too). DEFAULTS, on this 2-core AMD EPYC (znver4) at SmolLM2-135M's shapes, weights streamed from
memory (copies rotated past L3, medians of 7), measured before `unroll` existed: rows 1 was best or tied for Q4_1
576→1536 and 1536→576 and 2.8x faster than rows 2 for the Q8_0 LM head (576→49152; not yet understood); chunk 1
pays ~0.3 µs per task (workspace allocations), chunk 16 keeps ≥ 36 tasks for two threads. unroll 8 is not tuned.
`ahead` (weight rows): each unit step prefetches the same bytes of the row `ahead` rows on, every plane, one
prefetch per 64-byte line. The hardware prefetchers alone left the memory-bound kernels well under the read
bandwidth (2-core Zen 3, 26 GB/s for a plain parallel read): the Q8_0 LM head of Qwen2.5-0.5B (151936x896, 145 MB)
10.6 → 7.9 ms, Q8_0 3072x1024 and 1024x3072 -20%, 8 rows of Q8_0 -10% with ahead 8 (medians of 10-20 interleaved
rounds); the compute-bound kernels (Q4_0, Q5_0, Q6_K at these shapes) are unchanged by it, within noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import ClassVar

from luce_schedules.knobs import KnobbedRule, Knobs, fit
from tvm import DataType, s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.target import Target
from tvm.tirx.script.builder import ir as T

from luce_compile.lower.cpu_int8 import (
    INT8_GEMV_ATTR,
    QK8,
    QK_K,
    QUANT_OFFSET,
    SIXTEENS,
    int8_isa,
    int8_matmul,
    superblocked,
)
from luce_compile.lower.quant_matmul import CODEBOOKS

log = logging.getLogger(__name__)
LANES = 8  # int32 / float32 lanes of one 256-bit vector
GROUPS = QK_K // QK8  # groups of 32 values per K-quant super-block
Bufs = Mapping[str, tirx.Buffer]
# position p (0..31) of a group in the "nibbles" order holds element e(p) (cpu_int8.Q8Format.position_element)
ELEMENT = [2 * (p % 16) + p // 16 for p in range(32)]


def _vector(values: list[int], dtype: str) -> tirx.Expr:
    """A constant vector (LLVM folds it to one constant)."""
    return T.Shuffle([tirx.const(v, dtype) for v in values], list(range(len(values))))


def _vpdpbusd(unsigned: tirx.Expr, signed: tirx.Expr, acc: tirx.Expr | None = None) -> tirx.Expr:
    """acc (zero if None) + 8 int32 sums of 4 byte products each: both operands int8x32 as LLVM 22 types them.
    LLVM emits the EVEX form with avx512vnni + avx512vl, the VEX form with avxvnni alone (one intrinsic)."""
    acc = T.Broadcast(T.int32(0), LANES) if acc is None else acc
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", acc, unsigned, signed)


def _maddubs(unsigned: tirx.Expr, signed: tirx.Expr) -> tirx.Expr:
    """int16x16: adjacent byte products summed in pairs (vpmaddubsw), saturating: exact only where every pair sum
    fits int16, which the callers keep (|pair| ≤ 2·128·127 with the sign trick, ≤ 2·63·128 for ≤ 6-bit quants)."""
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", unsigned, signed)


def _madd(pairs: tirx.Expr, weights: tirx.Expr) -> tirx.Expr:
    """int32x8: adjacent int16 products summed in pairs (vpmaddwd), exact."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, weights)


def dot4(
    isa: str, unsigned: tirx.Expr, signed: tirx.Expr, acc: tirx.Expr | None = None, scale: tirx.Expr | None = None
) -> tirx.Expr:
    """acc + 8 int32 sums of 4 unsigned · signed byte products: vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd by
    ones, ggml's AVX2 mul_sum_us8_pairs (the same integers where no int16 pair sum saturates: `_maddubs`). AVX2
    only: `scale` (int32x8, each lane's value within int16) multiplies the sums inside vpmaddwd instead of the
    ones, as ggml's AVX2 K-quant dots apply their sub-block scales (a vpmulld less per group of 32 values)."""
    if isa != "avx2":
        assert scale is None, "a scale rides in vpmaddwd only"
        return _vpdpbusd(unsigned, signed, acc)
    pairs = T.Broadcast(T.int16(1), 2 * LANES)
    if scale is not None:  # int32 lane l → int16 lanes 2l, 2l + 1
        pairs = T.Shuffle([T.Cast("int16x8", scale)] * 2, [lane // 2 for lane in range(2 * LANES)])
    total = _madd(_maddubs(unsigned, signed), pairs)
    return total if acc is None else acc + total


def offset_safe(isa: str) -> bool:
    """Whether a dot may take a full unsigned byte (x + 128, Q8_0's w + 128) against a signed one: vpdpbusd sums in
    int32; AVX2's vpmaddubsw would saturate 2·255·127 in int16, so there signed weights take the sign trick."""
    return isa != "avx2"


def _nibbles(qs: tirx.Buffer, n: tirx.Expr, g: tirx.Expr) -> tirx.Expr:
    """Group g's 16 bytes → 32 unsigned quants: the 16 low nibbles (even elements), then the 16 high ones. The bytes
    are loaded into both 128-bit halves (vbroadcasti128, a load) and the high half shifted (LLVM: one vpsrlvd),
    where two halves joined by vinserti128 took a shuffle-port op a group: with the in-lane fold, Q4_0 4864x896
    127 → 95 µs on the 2-core Zen 3 (benchmarks/README.md, issue 13)."""
    raw = qs[n, T.Ramp(g * 16, 1, 16)]
    both = T.Shuffle([raw, raw], [i % 16 for i in range(32)])
    # x86 has no byte shift: shifted as 16-bit words (one vpsrlw; the bits a byte takes from its neighbour land above
    # the nibble the mask keeps), where a byte shift became vpmovzxbw + vpsrlvw + vpmovwb on 512-bit registers
    words = T.reinterpret("uint16x16", both) >> T.Broadcast(T.uint16(4), 16)
    blended = T.Shuffle([both, T.reinterpret("uint8x32", words)], list(range(16)) + list(range(48, 64)))
    return blended & T.Broadcast(T.uint8(15), 32)


def _spread(qh: tirx.Buffer, n: tirx.Expr, g: tirx.Expr, bits: int) -> tirx.Expr:
    """Group g's `bits`-bit fields (8/bits per byte, in element order) → uint8x32 in the nibbles order, not yet
    shifted: lane p holds the byte that element e(p)'s field is in (_high_bits tests the field's bits there)."""
    per_byte = 8 // bits
    raw = qh[n, T.Ramp(g * (32 // per_byte), 1, 32 // per_byte)]
    return T.Shuffle([raw] * per_byte, [e // per_byte for e in ELEMENT])  # Shuffle wants ≥ 32 lanes of input


def _high_bits(qh: tirx.Buffer, n: tirx.Expr, g: tirx.Expr, bits: int, base: int = 16) -> tirx.Expr:
    """The bits above the nibble (Q5: 1 bit → 16, Q6_K: 2 bits → 16, 32) of group g, as uint8x32 in nibbles order;
    with `base` 1 (Q2_K's and Q3_K's 2 low bits) or 4 (Q3_K's third bit) a field of other weight."""
    spread = _spread(qh, n, g, bits)
    zero = T.Broadcast(T.uint8(0), 32)
    per_byte = 8 // bits
    high = zero
    for bit in range(bits):
        mask = _vector([1 << (bits * (e % per_byte) + bit) for e in ELEMENT], "uint8")
        high = high | T.Select((spread & mask) != zero, T.Broadcast(T.uint8(base << bit), 32), zero)
    return high


def _two_bits(qs: tirx.Buffer, n: tirx.Expr, g: tirx.Expr) -> tirx.Expr:
    """Q2_K's and Q3_K's 2-bit fields of group g (8 bytes, quant_layout's slot order: byte j's bits 2f..2f+1 are
    position 8f + j) → uint8x32 in nibbles order: the 8 bytes in each quarter, each quarter's dwords shifted right by
    2f (vpsrlvd), then & 3. Testing each field bit per lane instead (`_high_bits` on the plain element order) made
    the 4096x4096 GEMV 1.8x (Q3_K) and 1.4x (Q2_K) Q4_K's time; this 0.85x and 0.8x (2-core Xeon with AVX-VNNI,
    loaded by other jobs: same-run ratios, 2026-12-06)."""
    raw = qs[n, T.Ramp(g * 8, 1, 8)]
    spread = T.reinterpret("uint32x8", T.Shuffle([raw] * 4, [p % 8 for p in range(32)]))
    shifted = T.reinterpret("uint8x32", spread >> _vector([2 * (i // 2) for i in range(8)], "uint32"))
    return shifted & T.Broadcast(T.uint8(3), 32)


def _codebook(kind: str, indices: tirx.Expr) -> tirx.Expr:
    """int8x32: the codebook values (IQ4_NL/IQ4_XS's kvalues_iq4nl, MXFP4's e2m1 doubled) of 32 indices 0..15, by
    one vpshufb on the 16-entry table in both 128-bit halves, as ggml's x86 iq4_nl/iq4_xs/mxfp4 dots look them up."""
    table = _vector([v for _ in range(2) for v in CODEBOOKS[kind]], "int8")
    return T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.pshuf.b", table, T.reinterpret("int8x32", indices))


def e8m0_half(e: tirx.Expr, lanes: int) -> tirx.Expr:
    """float32xlanes (or float32) 2^(e − 128) of uint8 exponents: quant_matmul.e8m0_half, lanes at once."""
    u32, f32 = (f"uint32x{lanes}", f"float32x{lanes}") if lanes > 1 else ("uint32", "float32")
    e32 = T.Cast(u32, e)

    def const(v: int) -> tirx.Expr:
        return _splat(T.uint32(v), lanes)

    return T.reinterpret(f32, T.Select(e32 < const(2), const(0x00200000) << e32, (e32 - const(1)) << const(23)))


def e8m0_times(e: tirx.Expr, x: tirx.Expr, lanes: int) -> tirx.Expr:
    """x · e8m0_half(e), rounded once as that product is, without ever multiplying by a subnormal: (x · 2^min(e − 2,
    0)) · 2^(max(e, 2) − 128), both factors normal and the first product exact. A vector of 2 lanes runs in a
    4-lane register whose spare lanes hold e = 0, and e8m0_half(0) is the subnormal 2^−128: every multiply by it
    took a microcode assist on Zen 4 (gpt-oss-20b's MXFP4 experts ran at half speed in the model, 2.5 ms a call
    against 1.2 with the FPU's denormals-are-zero bit set)."""
    u32, f32 = (f"uint32x{lanes}", f"float32x{lanes}") if lanes > 1 else ("uint32", "float32")
    e32 = T.Cast(u32, e)

    def const(v: int) -> tirx.Expr:
        return _splat(T.uint32(v), lanes)

    low = T.Select(e32 < const(2), T.reinterpret(f32, (e32 + const(125)) << const(23)), _splat(T.float32(1), lanes))
    high = T.reinterpret(f32, (T.max(e32, const(2)) - const(1)) << const(23))
    return x * low * high


def sign_moved(w: tirx.Expr, x: tirx.Expr) -> tirx.Expr:
    """x·sign(w) per byte (vpsignb; 0 where w is 0, and |w| is 0 there too): the sign trick's signed operand, as
    ggml's AVX2 mul_sum_i8_pairs moves it, so that |w| · x·sign(w) = w·x with |w| as the unsigned operand."""
    return T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", x, w)


def _signed_dot(isa: str, w: tirx.Expr, x: tirx.Expr, scale: tirx.Expr | None = None) -> tirx.Expr:
    """Σ w·x per 4 bytes for signed w (int8x32) by the sign trick (one activation row; every row on AVX2)."""
    if isa == "avx2":
        return dot4(isa, T.abs(w), sign_moved(w, x), scale=scale)
    negative = w < T.Broadcast(T.int8(0), 32)
    return _vpdpbusd(T.abs(w), T.Select(negative, T.Broadcast(T.int8(0), 32) - x, x))


def _x_offset(w: tirx.Expr) -> tirx.Expr:
    """−128·Σ w per 4 bytes (int32x8) of signed w: what `_group_dot` starts from so that the activations, moved by
    +128 to unsigned bytes, give Σ (x + 128)·w − 128·Σ w = Σ w·x per lane exactly (|lane| < 2^17), the sign trick's
    integers. It depends on the weights only, so a batch of activation rows computes it once, where the sign trick
    costs 4 vector ops per row (one row keeps the sign trick: this offset would cost it a second vpdpbusd)."""
    return T.Broadcast(T.int32(0), LANES) - _vpdpbusd(T.Broadcast(T.int8(-128), 32), w)


# weight types whose dot operand is signed (`_group_dot`; the others are unsigned): Q8_0 and the codebook types
SIGNED = ("Q8_0", *CODEBOOKS)


def _weights(kind: str, bufs: Bufs, n: tirx.Expr, g: tirx.Expr) -> tirx.Expr:
    """Weight row n's group g (32 values) unpacked to the int8x32 operand of its dot: unsigned quants (as int8
    bits) for the unsigned types, the signed w for SIGNED. What a batch of activation rows shares."""
    if kind == "Q8_0":
        return bufs["qs"][n, T.Ramp(g * QK8, 1, QK8)]
    if kind in CODEBOOKS:
        return _codebook(kind, _nibbles(bufs["qs"], n, g))
    if kind in ("Q2_K", "Q3_K"):  # 2 low bits (4 per byte of qs), Q3_K's third from qh
        quants = _two_bits(bufs["qs"], n, g)
        if kind == "Q3_K":
            quants = quants | _high_bits(bufs["qh"], n, g, 1, base=4)
        return T.reinterpret("int8x32", quants)  # Q3_K: q − 4 comes in as 4·Σ_j sc_j·bsum_j (_unit_terms)
    quants = _nibbles(bufs["qs"], n, g)
    if kind.startswith("Q5"):
        quants = quants | _high_bits(bufs["qh"], n, g, 1)
    elif kind == "Q6_K":
        quants = quants | _high_bits(bufs["qh"], n, g, 2)
    return T.reinterpret("int8x32", quants)  # Q4_0/Q5_0/Q6_K: q − offset comes in as offset·Σx (_unit_terms)


def _group_dot(
    isa: str,
    kind: str,
    bufs: Bufs,
    a: tirx.Expr,
    g: tirx.Expr,
    w: tuple[tirx.Expr, tirx.Expr | None],
    scale: tirx.Expr | None = None,
) -> tirx.Expr:
    """int32x8 partial sums of the unpacked weights of group g (`_weights`, with their `_x_offset` for SIGNED
    types) against activation row a there: lane l holds positions 4l..4l+3 of the group (times `scale`'s lane l:
    AVX2 only, `dot4`)."""
    x = bufs["xq"][a, T.Ramp(g * QK8, 1, QK8)]
    quants, offset = w
    if kind in SIGNED and offset is None:
        return _signed_dot(isa, quants, x, scale)
    if kind in SIGNED:  # x + 128 as unsigned bytes: int8 x with its sign bit flipped
        return _vpdpbusd(x ^ T.Broadcast(T.int8(-128), 32), quants, offset)
    return dot4(isa, quants, x, scale=scale)


def _splat(value: tirx.Expr, lanes: int) -> tirx.Expr:
    return T.Broadcast(value, lanes) if lanes > 1 else value


def _f32x8(value: tirx.Expr) -> tirx.Expr:
    return T.Broadcast(value, LANES)


def _hadd(a: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
    """vphaddd: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7], pairs within each 128-bit half."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.phadd.d", a, b)


def _fold(dots: list[tirx.Expr]) -> tirx.Expr:
    """G int32x8 partial-sum vectors (G a power of two ≤ 8) → int32xG, lane j the total of dots[j]. Pair sums within
    128-bit halves (vphaddd, no lane crossing): two levels leave [A, B, C, D] of four blocks' low halves in the low
    128 bits and of their high halves in the high 128 bits, so one add of the halves gives the block totals in block
    order (eight blocks: two such vectors, their halves regrouped by two 128-bit permutes). A tree of pair sums
    across the halves (vphaddd + vpermq a level, then vpshufd/vshufps) cost ~2.3 shuffle-port ops a block where
    this costs ~1: Q4_1 576x1536 32.7 → 25.7 µs alone on the Zen 3 (benchmarks/README.md, issue 13)."""
    if len(dots) == 1:
        (v,) = dots
        while v.ty.dtype.lanes > 1:
            half = v.ty.dtype.lanes // 2
            v = T.Shuffle([v], list(range(0, 2 * half, 2))) + T.Shuffle([v], list(range(1, 2 * half, 2)))
        return v
    if len(dots) == 2:
        pair = _hadd(dots[0], dots[1])
        quad = _hadd(pair, pair)
        return T.Shuffle([quad], [0, 1]) + T.Shuffle([quad], [4, 5])
    quads = [_hadd(_hadd(dots[i], dots[i + 1]), _hadd(dots[i + 2], dots[i + 3])) for i in range(0, len(dots), 4)]
    if len(quads) == 1:
        return T.Shuffle(quads, [0, 1, 2, 3]) + T.Shuffle(quads, [4, 5, 6, 7])
    return T.Shuffle(quads, [0, 1, 2, 3, 8, 9, 10, 11]) + T.Shuffle(quads, [4, 5, 6, 7, 12, 13, 14, 15])


# group index → weight row n's unpacked group (`_weights`) and, for SIGNED types, its `_x_offset`
Weights = Callable[[tirx.Expr], tuple[tirx.Expr, tirx.Expr | None]]


def _unit_terms(
    isa: str, kind: str, bufs: Bufs, a: tirx.Expr, n: tirx.Expr, u: tirx.Expr, acc: tirx.Expr, weights: Weights
) -> tirx.Expr:
    """acc plus unit u of weight row n against activation row a. 32-value types: a unit is G = acc's lanes blocks,
    whose integer dots are folded into one int32xG (exact), converted and scaled by G d_w·d_x at once, with the min
    terms m_w·s_x; K-quants (acc float32x8): a unit is a super-block."""
    if not superblocked(kind):
        count = acc.ty.dtype.lanes  # 1 for a scalar
        blocks = T.Ramp(u * count, 1, count) if count > 1 else u  # a Ramp of one lane is refused
        f32 = f"float32x{count}" if count > 1 else "float32"
        total = _fold([_group_dot(isa, kind, bufs, a, g, weights(g)) for g in (u * count + j for j in range(count))])
        if "xi" in bufs and kind in QUANT_OFFSET:  # Q4_0/Q5_0 (not Q8_0): Σ q·x − offset·Σx, ggml's Σ (q − offset)·x
            total = total - bufs["xi"][a, blocks] * _splat(T.int32(QUANT_OFFSET[kind]), count)
        if kind == "MXFP4":
            scale = e8m0_times(bufs["e"][n, blocks], bufs["xd"][a, blocks], count)
        else:
            scale = T.Cast(f32, bufs["d"][n, blocks]) * bufs["xd"][a, blocks]
        acc = T.fma(scale, T.Cast(f32, total), acc)
        if "xs" in bufs:
            acc = T.fma(T.Cast(f32, bufs["m"][n, blocks]), bufs["xs"][a, blocks], acc)
        return acc
    xd, d = bufs["xd"][a, u], T.Cast("float32", bufs["d"][n, u])
    isum = T.Broadcast(T.int32(0), LANES)
    for j in range(GROUPS):
        g = u * GROUPS + j
        if kind in SIXTEENS:  # one scale per 16 values: lanes 0, 1, 4, 5 | 2, 3, 6, 7 (module docstring)
            pair = T.Cast("int32x2", bufs["sc"][n, T.Ramp(g * 2, 1, 2)])
            scale = T.Shuffle([pair] * 4, [0, 0, 1, 1, 0, 0, 1, 1])
        else:
            scale = T.Broadcast(T.Cast("int32", bufs["sc"][n, g]), LANES)
        if isa == "avx2":  # |dot · scale| < 2^21 per lane: exact in vpmaddwd's int32 sums
            isum = isum + _group_dot(isa, kind, bufs, a, g, weights(g), scale)
        else:
            isum = isum + _group_dot(isa, kind, bufs, a, g, weights(g)) * scale
    if kind in QUANT_OFFSET:  # Q6_K: Σ_j sc_j·Σ (q − 32)·x = Σ_j sc_j·Σ q·x − 32·Σ_j sc_j·bsum_j (16 values j); Q3_K 4
        products = T.Cast("int32x16", bufs["sc"][n, T.Ramp(u * 16, 1, 16)]) * bufs["xb"][a, T.Ramp(u * 16, 1, 16)]
        centre = T.Shuffle([products], list(range(8))) + T.Shuffle([products], list(range(8, 16)))
        isum = isum - centre * T.Broadcast(T.int32(QUANT_OFFSET[kind]), LANES)
    acc = T.fma(_f32x8(d * xd), T.Cast("float32x8", isum), acc)
    if "mn" not in bufs:
        return acc
    # Σ_j mn_j·(bsums[2j] + bsums[2j+1]): 16 products of mn_{j//2}·bsums, halves added (any pairing sums the same);
    # Q2_K's 16 mins take one bsum each
    if kind in SIXTEENS:
        mins = T.Cast("int32x16", bufs["mn"][n, T.Ramp(u * 16, 1, 16)])
    else:
        mn = T.Cast("int32x8", bufs["mn"][n, T.Ramp(u * GROUPS, 1, GROUPS)])
        mins = T.Shuffle([mn] * 2, [j // 2 for j in range(16)])
    products = mins * bufs["xb"][a, T.Ramp(u * 16, 1, 16)]
    imin = T.Shuffle([products], list(range(8))) + T.Shuffle([products], list(range(8, 16)))
    dmin = T.Cast("float32", bufs["dmin"][n, u])
    return T.fma(_f32x8(T.float32(0) - dmin * xd), T.Cast("float32x8", imin), acc)


def _byte_view(buf: tirx.Buffer) -> tirx.Buffer:
    """A uint32 plane of packed fields (qs, qh) as bytes: field order within a word is byte order (little endian)."""
    rows, words = (int(s) for s in buf.shape)
    return T.decl_buffer((rows, words * 4), "uint8", data=buf.data)


def block_group(n_in: int) -> int:
    """Blocks per unit of the 32-value types: the largest power of two ≤ 8 that divides the block count."""
    return next(g for g in (8, 4, 2, 1) if (n_in // QK8) % g == 0)


TILE = 16  # activation rows that share one unpacking of a weight group (rows 1..16: decode's batch, verify's k+1)
ROW_TILE = 4  # activation rows in flight in int8_gemm's body (more than TILE rows: prefill)


def int8_gemv(
    kind: str, n_out: int, n_in: int, rows: int, chunk: int, unroll: int, batch: int | str = 1, isa: str = "avx512vnni",
    ahead: int = 0,
) -> tirx.PrimFunc:
    """The kernel for one weight type and shape; same arguments as cpu_int8.int8_matmul(kind, n_out, n_in, batch);
    `isa` one of cpu_int8.INT8_ISAS (the byte dot it is built on: `dot4`).
    `unroll` counts units: groups of `block_group(n_in)` blocks of 32 values, super-blocks for the K-quants.
    `rows` here are weight rows. A batch of activation rows is taken TILE at a time: each weight row's `unroll`
    units are unpacked once into a local buffer (L1) and dotted with every activation row of the tile, as ggml's
    vec_dot with nrc amortises its weight loads. Each activation row gets exactly the GEMV's sums in the GEMV's
    order (the unpacked bytes are the same integers), so a row of a batch equals that row alone, to the bit.
    Past TILE rows (prefill) a batch takes int8_gemm's body instead: same integers, float sums in another order."""
    from luce_schedules.cpu import int8_gemm  # it builds on this module's helpers

    definition = int8_matmul(kind, n_out, n_in, batch=batch)
    k_quant = superblocked(kind)
    lanes = LANES if k_quant else block_group(n_in)  # the accumulator's float32 lanes
    per_unit = GROUPS if k_quant else lanes  # groups of 32 values per unit
    units = n_in // QK_K if k_quant else n_in // QK8 // lanes
    with IRBuilder() as builder, T.prim_func(s_tir=True):
        T.func_name("main")
        T.func_attr({"tirx.noalias": True})
        bufs: dict[str, tirx.Buffer] = {}
        for b in definition.params:  # params are the buffers in TVM 0.27
            bufs[b.name] = T.arg(b.name, T.buffer(tuple(b.shape), b.dtype, layout=None))
        y = bufs[definition.params[-1].name]  # the output, named after its TE stage
        for name in ("qs", "qh"):
            if name in bufs and bufs[name].dtype == "uint32":
                bufs[name] = _byte_view(bufs[name])
        geometry = (lanes, per_unit, units)
        if batch == 1 or not int8_gemm.supports(n_out):
            _tiles_body(isa, kind, bufs, y, geometry, (rows, chunk, unroll, ahead), batch)
        else:  # more than TILE rows (prefill): the output-lane body, its own loops (int8_gemm.py)
            with T.If(T.Cast("int32", y.shape[0]) > TILE):
                with T.Then():
                    int8_gemm.gemm_body(isa, kind, bufs, y, n_out, n_in, ROW_TILE)
                with T.Else():
                    _tiles_body(isa, kind, bufs, y, geometry, (rows, chunk, unroll, ahead), batch)
    return builder.get()


def _tiles_body(
    isa: str,
    kind: str,
    bufs: Bufs,
    y: tirx.Buffer,
    geometry: tuple[int, int, int],
    knobs: tuple[int, int, int, int],
    batch: int | str,
) -> None:
    """The GEMV, or the batch TILE activation rows at a time (int8_gemv's docstring). geometry: the accumulator's
    lanes, groups per unit, units per row; knobs: weight rows per step, chunk, unroll."""
    lanes, per_unit, units = geometry
    rows, chunk, unroll, ahead = knobs
    tasks = int(y.shape[1]) // (rows * chunk)
    with T.parallel(0, tasks) as c:
        acc = T.decl_buffer((rows * TILE, lanes), "float32", scope="local")
        # decode1 (one static row) dots the unpacked weights in registers; a batch goes through wq, wo
        slots = unroll * per_unit
        staged = None
        if batch != 1:
            staged = (
                T.decl_buffer((slots, QK8), "int8", scope="local"),
                T.decl_buffer((slots, LANES), "int32", scope="local"),
            )
        every = T.Ramp(0, 1, lanes) if lanes > 1 else 0
        zero = T.Broadcast(T.float32(0), lanes) if lanes > 1 else T.float32(0)
        total_rows = T.Cast("int32", y.shape[0])
        with T.serial(0, chunk) as g, T.serial(0, 1 if staged is None else (total_rows + TILE - 1) // TILE) as t:
            count = 1 if staged is None else T.Bind(T.min(TILE, total_rows - t * TILE))
            with T.unroll(0, rows) as r, T.serial(0, count) as a:
                T.buffer_store(acc, zero, [r * TILE + a, every])
            with T.serial(0, units // unroll) as u0, T.unroll(0, rows) as r:
                n = T.Bind((c * chunk + g) * rows + r)
                base = u0 * unroll * per_unit  # the first group of these `unroll` units
                if ahead:
                    _prefetch(bufs, T.min(n + ahead, int(y.shape[1]) - 1), base, unroll * per_unit, units * per_unit)
                weights = _stage_weights(isa, kind, bufs, n, base, staged)
                with T.serial(0, count) as a:
                    total = acc[r * TILE + a, every]
                    for j in range(unroll):
                        total = _unit_terms(isa, kind, bufs, t * TILE + a, n, u0 * unroll + j, total, weights)
                    T.buffer_store(acc, total, [r * TILE + a, every])
            with T.unroll(0, rows) as r, T.serial(0, count) as a:
                T.buffer_store(y, _lane_sum(acc, r * TILE + a, lanes), [t * TILE + a, (c * chunk + g) * rows + r])


WEIGHT_PLANES = ("qs", "qh", "d", "m", "sc", "mn", "dmin", "e")


def _prefetch(bufs: Bufs, n: tirx.Expr, first: tirx.Expr, count: int, groups: int) -> None:
    """Prefetch the bytes of weight row n that groups first..first+count-1 (of `groups` a row) occupy in every
    plane, one prefetch per 64-byte line: the weights stream from memory once a step, and a row `ahead` rows on is
    in flight while this one is dotted."""
    for name in WEIGHT_PLANES:
        buf = bufs.get(name)
        if buf is None:
            continue
        width, item = int(buf.shape[1]), DataType(buf.dtype).bits // 8
        span = max(1, width * item * count // groups)
        col = first * width // groups
        for line in range(0, span, 64):
            address = T.address_of(buf[n, T.min(col + line // item, width - 1)])
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", address, T.int32(0), T.int32(3), T.int32(1)))


def _stage_weights(
    isa: str, kind: str, bufs: Bufs, n: tirx.Expr, base: tirx.Expr, staged: tuple[tirx.Buffer, tirx.Buffer] | None
) -> Weights:
    """The unpacked groups of weight row n from group `base` on: inline expressions when there is one activation
    row (staged None; SIGNED types then take the sign trick), else computed once here into the local buffers
    (wq; wo: their `_x_offset` for SIGNED types where `offset_safe`, else they keep the sign trick), all of them,
    and read back by every activation row."""
    signed = kind in SIGNED and offset_safe(isa)
    if staged is None:
        return lambda g: (_weights(kind, bufs, n, g), None)
    wq, wo = staged
    for s in range(int(wq.shape[0])):
        w = _weights(kind, bufs, n, base + s)
        T.buffer_store(wq, w, [s, T.Ramp(0, 1, QK8)])
        if signed:
            T.buffer_store(wo, _x_offset(w), [s, T.Ramp(0, 1, LANES)])
    return lambda g: (wq[g - base, T.Ramp(0, 1, QK8)], wo[g - base, T.Ramp(0, 1, LANES)] if signed else None)


def _lane_sum(acc: tirx.Buffer, r: tirx.Expr, lanes: int) -> tirx.Expr:
    """The lanes of acc[r], in lane order."""
    total = acc[r, 0]
    for lane in range(1, lanes):
        total = total + acc[r, lane]
    return total


def _unroll(units: int, want: int, staged: bool = False) -> int:
    """A divisor of `units` near `want`: the largest not above it, unless that is under half of it (a prime count
    of units would give 1), then the smallest above it. Qwen2.5-0.5B's 896 inputs are 7 groups of 4 blocks: the whole
    row as one chain ran 118.6 µs for its 4864x896 Q5_0 GEMV, one group at a time 129.2 µs (min of 4 x 5 runs).
    `staged` (a batch: the units' unpacked weights are held for every activation row) never rounds up: held past
    ~8 groups they no longer fit the 16 vector registers and every row reloads them from spill slots. Gemma 3's
    Q8_0 LM head (262144x640: 5 units of 4 blocks) at 8 rows on the Zen 3: the whole row held 36-44 ms, a unit at a
    time 30-31 ms (interleaved, min and median of 10 rounds)."""
    below = fit(units, want)
    if staged or 2 * below > want or want >= units:
        return below
    return min(d for d in range(want, units + 1) if units % d == 0)


def _signature(func: tirx.PrimFunc) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every buffer argument, the part of a signature the Relax call depends on."""
    return [(tuple(str(s) for s in p.shape), str(p.dtype)) for p in func.params]


class Int8GEMV(KnobbedRule):
    """cpu_int8.int8_matmul functions → the integer kernel, on x86 llvm targets with a byte dot (cpu_int8.int8_isa).
    The knobs' defaults and space are the same for every isa (measured with VNNI; AVX2 not yet tuned)."""

    name = "cpu.int8_gemv"
    DEFAULTS: ClassVar[dict[str, int]] = {"rows": 1, "chunk": 16, "unroll": 8, "ahead": 8}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {"rows": (1, 2, 4), "chunk": (1, 4, 16, 64), "unroll": (1, 4, 8, 16),
                                                   "ahead": (0, 4, 8, 16)}

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or INT8_GEMV_ATTR not in func.attrs:
            return None
        isa = int8_isa(target)
        if isa is None:
            return None
        kind = str(func.attrs[INT8_GEMV_ATTR])
        y, xq = func.params[-1], func.params[0]  # y (R, n_out), xq (R, n_in); R = 1 or a Var (batched decode)
        n_out, n_in = int(y.shape[1]), int(xq.shape[1])
        batch = 1 if isinstance(y.shape[0], tirx.IntImm) and int(y.shape[0]) == 1 else "dynamic"
        k = self.knobs(knobs)
        rows = fit(n_out, k["rows"])
        # `unroll` is in blocks of 32 values: whole units of the kernel (super-blocks, or groups of blocks)
        unit = QK_K if superblocked(kind) else QK8 * block_group(n_in)
        unroll = _unroll(n_in // unit, max(1, k["unroll"] * QK8 // unit), staged=batch != 1)
        kernel = int8_gemv(kind, n_out, n_in, rows, fit(n_out // rows, k["chunk"]), unroll, batch, isa, k["ahead"])
        if _signature(kernel) != _signature(func):
            log.warning("%s declined %s: its arguments are not int8_matmul's", self.name, func.attrs["global_symbol"])
            return None
        kernel = kernel.with_attr("global_symbol", func.attrs["global_symbol"])
        return s_tir.Schedule(kernel)
