"""8-bit activations (q8_activations): llama.cpp's vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 (and the K-quants'
q8_1 forms; with q8_codebooks vec_dot_iq4_nl_q8_1 / iq4_xs_q8_1). The input quantized once per task into blocks of
32 in shared memory (quantize_q8), then a lane per granule (_q8_pass) or per 32-value block of a row
(_q8_block_pass, q8_by_block) dots 8-bit words with dp4a; the block scales (_q8_block_scales, _q8_accumulate) are
shared with the tensor-core body (q8_mma.py)."""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.tirx.script.builder import ir as B

from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.emit_cuda.core import F32, f32, i32
from luce_compile.fuse.options import Q8_CODEBOOK_ORDER, Q8_LOW_BIT_ORDER, Q8_ORDER
from luce_compile.lower.q8_gemm import Q8_GEMM_OFFSET
from luce_compile.lower.quant_matmul import CODEBOOKS, codebook_word, exact_int_to_float, table_words

Q8_BLOCK = 32  # activations per 8-bit block (ggml's QK8_0 = QK8_1)
QUANT_AHEAD = 4  # quantize_q8: granules a thread loads before it quantizes any (8 floats each in registers)


# the 8-bit path's types stored unsigned with an offset (w = d·(q − offset)): the dot starts at −offset·Σq_x (Q6_K's
# per 16 values, each sub-block's sum then scaled by its int8 scale); the prefill GEMM's centring, the same ggml offsets
Q8_OFFSET = Q8_GEMM_OFFSET
# the types whose dots need the activations' integer sums: the offsets' start, Q2_K's minima per 16 values
X_SUM_TYPES = (*Q8_OFFSET, "Q2_K")
SIXTEENS = ("Q6_K", "Q3_K", "Q2_K")  # a scale per 16 values (an int8, or Q2_K's 4-bit one) times each half's sum
LOW_BITS = ("Q3_K", "Q2_K")  # quant_layout._2bit's `qs`: 2 words a block; a granule's quants one shift away
TWO_BITS = 0x03030303


def _fifth_bits(qh: tirx.Expr, gg, bit: int = 4) -> tuple[tirx.Expr, tirx.Expr]:
    """A block's high bits (qh: bit j of element j of the 32) for granule gg's two nibble words: the even elements
    8gg + 2i go to bit `bit` of byte i of the low word, the odd ones of the high one (Q5's fifth bit at 4, Q3_K's
    third at 2)."""
    u = lambda v: tirx.const(v, "uint32")  # noqa: E731
    x = qh >> (u(8 * gg) if isinstance(gg, int) else (gg * 8).astype("uint32"))

    def spread(v: tirx.Expr) -> tirx.Expr:  # bits 0, 2, 4, 6 → bit, 8 + bit, 16 + bit, 24 + bit
        return ((v & u(1)) << u(bit)) | ((v & u(4)) << u(bit + 6)) | ((v & u(16)) << u(bit + 12)) | \
            ((v & u(64)) << u(bit + 18))

    return spread(x), spread(x >> u(1))


def _low_bits(word: tirx.Expr, gg) -> list[tirx.Expr]:
    """Granule gg's (0..3 of its block) two words of 2-bit quants, even elements then odd, from the block's word
    gg % 2 of the `qs` plane (quant_layout._2bit: shifted by 2·(gg // 2), and by 4 more for the odd ones)."""
    u = lambda v: tirx.const(v, "uint32")  # noqa: E731
    shift = u(2 * (gg // 2)) if isinstance(gg, int) else (gg // 2 * 2).astype("uint32")
    return [(word >> shift) & u(TWO_BITS), (word >> (shift + u(4))) & u(TWO_BITS)]


def _sixth_bits(qh: tirx.Expr, shift) -> tuple[tirx.Expr, tirx.Expr]:
    """A Q6_K granule's two high bits (qh >> shift: bits 2i of element i of the granule's 8) for its two nibble
    words: the even elements 2i go to bits 4-5 of byte i of the low-nibble word, the odd ones of the high one."""
    u = lambda v: tirx.const(v, "uint32")  # noqa: E731
    x = qh >> (u(shift) if isinstance(shift, int) else shift.astype("uint32"))

    def spread(v: tirx.Expr) -> tirx.Expr:  # bit pairs at 0, 4, 8, 12 → 4, 12, 20, 28
        return ((v & u(0x3)) << u(4)) | ((v & u(0x30)) << u(8)) | ((v & u(0x300)) << u(12)) | \
            ((v & u(0x3000)) << u(16))

    return spread(x), spread(x >> u(2))


def _signed_quants(ggml_type: str, word: tirx.Expr) -> tirx.Expr:
    """Four stored quants (a byte each, uint32) as the int32 of the bytes dp4a dots: a codebook type's indices looked
    up to its signed values (IQ4_NL, IQ4_XS: kvalues_iq4nl; on CUDA by three byte permutes, ix.table16_bytes),
    any other type's bits as they are (its offset, if any, is the sum's start: Q8_OFFSET)."""
    if ggml_type not in Q8_CODEBOOK_ORDER:
        return tirx.reinterpret("int32", word)

    def u32(v: int) -> tirx.Expr:
        return tirx.const(v, "uint32")

    if ix.is_rocm():  # no byte permute: the dequantizers' lookup a byte
        return tirx.reinterpret("int32", codebook_word(ggml_type, word))
    words = [u32(w) for w in table_words(CODEBOOKS[ggml_type])]
    return tirx.reinterpret("int32", ix.table16_bytes(word, words, ix.byte_perm, u32))


def dp4a(a: tirx.Expr, b: tirx.Expr, c: tirx.Expr) -> tirx.Expr:
    """c + the dot of the four signed bytes of a and b (CUDA's __dp4a)."""
    return ix.dot4(a, b, c)


# 1/Q8_RESERVE of the shared memory is left beside the largest batch's 8-bit input for a tile's values (8 sequences
# x 2 slots x 200 rows at 200 KiB); a tile that needs more is refused at build time, never computed wrong. It was a
# quarter: that kept Qwen2.5-7B's K = 18,944 down projection (185 of 200 KiB at b=8) on float activations at every
# batch size, 65-79 µs a task at b=1 and ~450 at b=8 where the 8B's 8-bit K = 14,336 took 29 and 61 (H100,
# 2026-12-07)
Q8_RESERVE = 16


class Q8Mixin:
    @staticmethod
    def _q8_words(k_in: int) -> int:
        """Shared-memory words of one sequence's 8-bit input: the quants (4 a word), d and s/4 per block."""
        return k_in // 4 + 2 * (k_in // Q8_BLOCK)

    def _q8_scales_at(self, k_in: int) -> tuple[int, int]:
        """Where d and s/4 of the 8-bit input's blocks start in shared memory (after every sequence's quants)."""
        words = self.nb * 2 * (k_in // 8)
        return words, words + self.nb * (k_in // Q8_BLOCK)

    def _q8_accumulate(self, acc, a: int, total, dw, mw, b: int, blk, k_in: int, lanes_per_block: int) -> None:
        """acc[a] += d_w·(d_x·Σ) [+ m_w·s_x], the block's min term split over the lanes that share the block
        (s/4 is stored: 4 granule lanes add it once each; a lane with the whole block multiplies it by 4, exactly)."""
        d_at, s_at = self._q8_scales_at(k_in)
        blocks = k_in // Q8_BLOCK
        y = acc[a] + dw * (self.smem[d_at + b * blocks + blk] * exact_int_to_float(total))
        if mw is not None:
            s = self.smem[s_at + b * blocks + blk]
            y = y + mw * (s if lanes_per_block == 4 else s * f32(4))
        self.store(acc, a, y)

    def _q8_min16(self, acc, a: int, dmin, msum, b: int, blk, k_in: int) -> None:
        """acc[a] −= dmin·(d_x·Σ mn·Σq_x): Q2_K's minima per 16 values against the integer sums of their activations
        (exact: the emulating oracle's q8_0 values), after _q8_accumulate's scale term."""
        d_at, _ = self._q8_scales_at(k_in)
        dx = self.smem[d_at + b * (k_in // Q8_BLOCK) + blk]
        self.store(acc, a, acc[a] - dmin * (dx * exact_int_to_float(msum)))

    @staticmethod
    def _q8_block_scales(planes, ggml_type: str, layer, row, blk) -> tuple[tirx.Expr, tirx.Expr | None]:
        """A 32-value block's (d_w, m_w) as float32, w = d_w·q + m_w (m_w None: Q4_0/Q8_0/Q6_K have no minimum). A
        Q4_K/Q5_K sub-block is a Q4_1/Q5_1 block with d_w = d·sc and m_w = −dmin·mn (llama.cpp's vec_dot_q4_K_q8_1;
        both products exact in float32). Q6_K's d_w is its super-block's d: the passes scale each 16 values' integer
        sum by their int8 scale (llama.cpp's vec_dot_q6_K_q8_1)."""
        if ggml_type in ("Q4_K", "Q5_K"):
            sb = blk // 8  # the 256-value super-block
            d = planes["d"][layer, row, sb].astype(F32) * exact_int_to_float(planes["sc"][layer, row, blk])
            m = planes["dmin"][layer, row, sb].astype(F32) * exact_int_to_float(planes["mn"][layer, row, blk])
            return d, f32(0) - m
        if ggml_type in SIXTEENS:  # the scale of each 16 values multiplies the integer sums (the passes); Q2_K's
            return planes["d"][layer, row, blk // 8].astype(F32), None  # minimum: _q8_min16
        if ggml_type == "IQ4_XS":  # d of the super-block times the block's signed 6-bit scale (ls − 32, exact)
            return (planes["d"][layer, row, blk // 8].astype(F32)
                    * exact_int_to_float(planes["sc"][layer, row, blk].astype("int32"))), None
        mw = planes["m"][layer, row, blk].astype(F32) if ggml_type in ("Q4_1", "Q5_1") else None
        return planes["d"][layer, row, blk].astype(F32), mw

    def q8_misfit_stages(self) -> frozenset[int]:
        """The stages of this program whose 8-bit input at its batch size, tile values and 1/rms would not fit the
        shared memory together (MatvecMixin.matvec's check): they keep float32 inputs (Program.q8_misfits)."""
        out: set[int] = set()
        for op in self.p.opcodes:
            if op.kind != P.TaskKind.MATVEC:
                continue
            st = self.p.tg.stages[op.stage]
            env = max(self._env_floats(st, u, rows) for u, rows in enumerate(op.max_rows))
            if self.nb * (self._q8_words(self.p.width(st.input)) + 1) + env > self.shared_floats:
                out.update(op.stages)
        return frozenset(out)

    @functools.cached_property
    def _q8_misfits(self) -> frozenset[int]:
        """The build's misfits (Program.q8_misfits), or this program's own where it is emitted alone."""
        return self.p.q8_misfits if self.p.q8_misfits is not None else self.q8_misfit_stages()

    def _q8_order(self, st, k_in: int, stage: int) -> str | None:
        """The activation order the stage's matmuls take ("nibbles" for Q4/Q5 types, "natural" for Q8_0), or None
        where it keeps float32 activations: the option is off, a weight type has no integer body here, the types
        want different orders, the input is merged from attention partials, or the largest batch's 8-bit input
        leaves less than Q8_RESERVE of the shared memory, or with the tile's values does not fit it in some program
        of the build (Program.q8_misfits: a small shared memory, gfx1151's 56 KiB). The choice depends on the stage
        and the build's programs only, so every batch size computes a sequence alike (batched equal to alone)."""
        if not self.q8 or st.merged >= 0 or stage in self._q8_misfits or \
                self.q8_batch * self._q8_words(k_in) > self.shared_floats - self.shared_floats // Q8_RESERVE:
            return None
        types = {t for unit in st.units for t in self._weight_types(unit)}
        if self.q8_mma and types & {"Q5_0", "Q5_1", "Q5_K", "Q6_K", *Q8_CODEBOOK_ORDER, *LOW_BITS}:  # nor high bits,
            return None  # nor codebooks, nor scales per 16 there
        extra = {**(Q8_CODEBOOK_ORDER if self.q8_codebooks else {}), **(Q8_LOW_BIT_ORDER if self.q8_low_bits else {})}
        orders = {Q8_ORDER.get(t, extra.get(t)) for t in types}
        return orders.pop() if len(orders) == 1 and None not in orders else None

    def quantize_q8(self, order: str, k_in: int, base, norm) -> None:
        """The input (with its norm) as 8-bit blocks of 32 in shared memory, each sequence's rows on their own, as
        ggml's x86 quantize_row_q8_0/q8_1 (lower/cpu_int8.py: the CPU build's, which the emulating oracle follows):
        q = rint(x · 127/amax), d = fp16(amax/127), s = fp16(d · Σq) from the float32 d.
        A thread per (sequence, granule of 8 features): a block's 4 granules are a quad of lanes, whose amax and Σq
        take two shuffles each, and a thread writes its granule's two words whole. Up to QUANT_AHEAD granules a
        thread are loaded before any is quantized (their loads in flight together). A warp per block took two warp
        reductions a block: at b=8 the 1B's down projection spent 18 of its 29 µs a task here (shuffles at one
        warp instruction a clock an SM; a thread per block, with 32 dependent loads, took 4-5 µs a task).
        base(b): the arena index of sequence b's input; norm: None or the prologue norm's (1/rms of b, γ plane, a
        float32 vector), applied as xval does, (x · 1/rms) · γ. A granule is read as two 16-byte words (γ too):
        8 floats a thread, lanes 32 bytes apart, were 8 loads of 32 sectors each a warp instead of 2.
        Layout (32-bit words): word (b·2 + h)·G + g holds 4 quants of granule g (8 features): for "nibbles" its
        features 2j + h (j = 0..3: the bytes of a Q4 word masked or shifted), for "natural" 4h + j; then d per
        (b, block), then s/4 per (b, block) (each of a block's 4 granule lanes adds m·s/4)."""
        nb, granules, blocks = self.nb, k_in // 8, k_in // Q8_BLOCK
        d_at, s_at = self._q8_scales_at(k_in)
        total = nb * granules  # a multiple of 4 (K is of whole blocks): a quad is all in range or all past it
        n_it = -(-total // self.threads)
        ahead = min(n_it, QUANT_AHEAD)
        vals = self.local(F32, ahead * 8)
        amax, inv = self.local(), self.local()
        q, qsum, word = self.local("int32", 8), self.local("int32"), self.local("int32", 2)
        gam = self.local(F32, 8) if norm is not None else None
        with B.serial(0, -(-n_it // ahead)) as it:
            for u in range(ahead):
                at = tirx.min((it * ahead + u) * self.threads + self.tx, total - 1)  # past the end: unused
                b, k0 = at // granules, at % granules * 8
                for half in range(2):
                    B.buffer_store(vals, self.arena.vload([base(b) + k0 + half * 4], "float32x4"),
                                   [tirx.Ramp(i32(u * 8 + half * 4), i32(1), 4)])
                if norm is not None:
                    rstd, gamma = norm
                    for half in range(2):
                        B.buffer_store(gam, gamma.vload([self.col(P.LAYER), k0 + half * 4], "float32x4"),
                                       [tirx.Ramp(i32(half * 4), i32(1), 4)])
                    for j in range(8):
                        self.store(vals, u * 8 + j, vals[u * 8 + j] * rstd(b) * gam[j])
            for u in range(ahead):  # every lane runs the shuffles; only the stores are guarded
                at = (it * ahead + u) * self.threads + self.tx
                m = tirx.abs(vals[u * 8])
                for j in range(1, 8):
                    m = tirx.max(m, tirx.abs(vals[u * 8 + j]))
                self.store(amax, 0, m)
                for lane_mask in (1, 2):
                    self.store(amax, 0, tirx.max(amax[0], ix.shfl_xor(amax[0], lane_mask, self.lane)))
                self.store(inv, 0, tirx.Select(amax[0] > f32(0), f32(127) / amax[0], f32(0)))
                for j in range(8):
                    self.store(q, j, tirx.nearbyint(vals[u * 8 + j] * inv[0]).astype("int32"))
                self.store(qsum, 0, q[0] + q[1] + q[2] + q[3] + q[4] + q[5] + q[6] + q[7])
                for lane_mask in (1, 2):
                    self.store(qsum, 0, qsum[0] + ix.shfl_xor(qsum[0], lane_mask, self.lane))
                for h in range(2):
                    feats = [2 * j + h for j in range(4)] if order == "nibbles" else [4 * h + j for j in range(4)]
                    byte = [tirx.reinterpret("uint32", q[f]) & tirx.const(0xFF, "uint32") for f in feats]
                    w = byte[0]
                    for j in range(1, 4):  # unsigned: a quant's byte shifted to the top is no signed overflow
                        w = w | (byte[j] << tirx.const(8 * j, "uint32"))
                    self.store(word, h, tirx.reinterpret("int32", w))
                with self.when(at < total):
                    b, g = at // granules, at % granules
                    for h in range(2):
                        self.store(self.smem_i, (b * 2 + h) * granules + g, word[h])
                    with self.when(g % 4 == 0):
                        blk = g // 4
                        d = amax[0] / f32(127)
                        self.store(self.smem, d_at + b * blocks + blk, d.astype("float16").astype(F32))
                        self.store(self.smem, s_at + b * blocks + blk,
                                   (d * qsum[0].astype(F32)).astype("float16").astype(F32) * f32(0.25))

    def _q8_pass(self, op, unit, rows: int, r0, hi, g, granules: int, k_in: int, acc) -> None:
        """One granule of `rows` rows of each matmul against every sequence's 8-bit activations: two dp4a a
        (row, sequence), then d_w·(d_x·Σ) [+ m_w·s_x/4]. Q4_0 dots the stored unsigned quants and starts the sum
        at −8·Σq_x (the integer of ggml's Σ(q − 8)·q_x)."""
        nb = self.nb
        blk = g // 4
        xw, xsum, wl = self.local("int32", 2 * nb), self.local("int32", nb), self.local("int32", 2)
        types = self._weight_types(unit)
        for b in range(nb):
            for h in range(2):
                self.store(xw, 2 * b + h, self.smem_i[(b * 2 + h) * granules + g])
            if any(t in X_SUM_TYPES for t in types):  # Σq_x
                ones = i32(0x01010101)
                self.store(xsum, b, dp4a(xw[2 * b + 1], ones, dp4a(xw[2 * b], ones, i32(0))))
        for m_i, m in enumerate(unit.matmuls):
            planes = self.weight(op, m.weights["weight"])
            layer = self.col(P.LAYER)
            for r in range(rows):
                row = tirx.min(r0 + r, hi - 1)  # past the tile: a valid row, its result unused
                if types[m_i] == "Q8_0":
                    words = self._word_view(planes["qs"], "int32")
                    w = [words[layer, row, 2 * g], words[layer, row, 2 * g + 1]]
                elif types[m_i] in LOW_BITS:  # 2 low bits (Q3_K: its hmask bit the third)
                    w = _low_bits(planes["qs"][layer, row, 2 * blk + g % 2], g % 4)
                    if types[m_i] == "Q3_K":
                        w = [a | e for a, e in zip(w, _fifth_bits(planes["qh"][layer, row, blk], g % 4, bit=2),
                                                   strict=True)]
                    w = [tirx.reinterpret("int32", v) for v in w]
                else:
                    qs = planes["qs"][layer, row, g]
                    mask = tirx.const(0x0F0F0F0F, "uint32")
                    w = [qs & mask, (qs >> tirx.const(4, "uint32")) & mask]
                    if types[m_i] == "Q6_K":  # its two high bits into bits 4-5 of each quant's byte
                        high = _sixth_bits(planes["qh"][layer, row, g // 2], (g % 2) * 16)
                        w = [a | e for a, e in zip(w, high, strict=True)]
                    elif "qh" in planes:  # Q5: each quant's fifth bit into its byte's bit 4
                        w = [a | e for a, e in zip(w, _fifth_bits(planes["qh"][layer, row, blk], g % 4),
                                                   strict=True)]
                    w = [_signed_quants(types[m_i], v) for v in w]
                self.store(wl, 0, w[0])
                self.store(wl, 1, w[1])
                dw, mw = self._q8_block_scales(planes, types[m_i], layer, row, blk)
                for b in range(nb):
                    a = (m_i * rows + r) * nb + b
                    off = Q8_OFFSET.get(types[m_i])
                    start = i32(-off) * xsum[b] if off else i32(0)
                    total = dp4a(wl[1], xw[2 * b + 1], dp4a(wl[0], xw[2 * b], start))
                    if types[m_i] in SIXTEENS:  # a granule lies in one sub-block of 16
                        total = total * planes["sc"][layer, row, g // 2].astype("int32")
                    self._q8_accumulate(acc, a, total, dw, mw, b, blk, k_in, lanes_per_block=4)
                    if types[m_i] == "Q2_K":
                        self._q8_min16(acc, a, planes["dmin"][layer, row, blk // 8].astype(F32),
                                       xsum[b] * planes["mn"][layer, row, g // 2].astype("int32"), b, blk, k_in)

    def _q8_block_pass(self, op, unit, rows: int, r0, hi, blk, granules: int, k_in: int, acc) -> None:
        """Block `blk` (32 values) of `rows` rows of each matmul against every sequence's 8-bit activations: the
        block's quants in one or two 16-byte loads, eight dp4a a (row, sequence), then d_w·(d_x·Σ) [+ m_w·s_x].
        Every load of the pass (quants, high bits, scales of every row) is issued before any of its arithmetic:
        written row by row, ptxas kept ~10 rows' quants in flight and issued the scales' small loads after the
        dot products, a second memory round trip a pass (the 8B's 0.5-1.2 TB/s matvecs)."""
        nb = self.nb
        xw, xsum = self.local("int32", 8 * nb), self.local("int32", 2 * nb)
        types = self._weight_types(unit)
        n_rows = len(unit.matmuls) * rows
        # the pass's loads, by (matmul, row): quants as words, Q5/Q6_K high bits, the block's scales as float32
        wq = self.local("uint32", 8 * n_rows)  # 4 words (Q4/Q5/Q6_K) or 8 (Q8_0, as int32 bits) a row
        qh = self.local("uint32", 2 * n_rows)
        dws, mws = self.local(F32, n_rows), self.local(F32, n_rows)
        sc6 = self.local("int32", 2 * n_rows)  # the scale of each half (Q6_K, Q3_K: int8; Q2_K: 4 bits)
        mn2 = self.local("int32", 2 * n_rows)  # Q2_K's minimum of each half (4 bits)
        dmins = self.local(F32, n_rows)  # Q2_K's super-block dmin
        wi = self.local("int32", 8)
        has_min: set[int] = set()  # the (matmul, row)s whose type has a minimum (mws holds it)
        ones = i32(0x01010101)
        layer = self.col(P.LAYER)
        for m_i, m in enumerate(unit.matmuls):
            planes = self.weight(op, m.weights["weight"])
            t = types[m_i]
            for r in range(rows):
                at = m_i * rows + r
                row = tirx.min(r0 + r, hi - 1)  # past the tile: a valid row, its result unused
                if t == "Q8_0":  # words 2gg (features 8gg..8gg+3) and 2gg+1 of granule gg
                    words = self._word_view(planes["qs"], "uint32")
                    for half in range(2):
                        B.buffer_store(wq, words.vload([layer, row, blk * 8 + half * 4], "uint32x4"),
                                       [tirx.Ramp(i32(at * 8 + half * 4), i32(1), 4)])
                elif t in LOW_BITS:  # two words a block (quant_layout._2bit), a scale (and minimum) a half
                    B.buffer_store(wq, planes["qs"].vload([layer, row, blk * 2], "uint32x2"),
                                   [tirx.Ramp(i32(at * 8), i32(1), 2)])
                    if t == "Q3_K":
                        self.store(qh, 2 * at, planes["qh"][layer, row, blk])
                    for i in range(2):
                        self.store(sc6, 2 * at + i, planes["sc"][layer, row, 2 * blk + i].astype("int32"))
                        if t == "Q2_K":
                            self.store(mn2, 2 * at + i, planes["mn"][layer, row, 2 * blk + i].astype("int32"))
                    if t == "Q2_K":
                        self.store(dmins, at, planes["dmin"][layer, row, blk // 8].astype(F32))
                else:  # one word per granule: the low nibbles are its even features, the high ones its odd
                    B.buffer_store(wq, planes["qs"].vload([layer, row, blk * 4], "uint32x4"),
                                   [tirx.Ramp(i32(at * 8), i32(1), 4)])
                    if t == "Q6_K":  # two high bits an element, a word per 16
                        for i in range(2):
                            self.store(qh, 2 * at + i, planes["qh"][layer, row, 2 * blk + i])
                            self.store(sc6, 2 * at + i, planes["sc"][layer, row, 2 * blk + i].astype("int32"))
                    elif "qh" in planes:  # Q5: one word per 32
                        self.store(qh, 2 * at, planes["qh"][layer, row, blk])
                dw, mw = self._q8_block_scales(planes, t, layer, row, blk)
                self.store(dws, at, dw)
                if mw is not None:
                    self.store(mws, at, mw)
                    has_min.add(at)
        for b in range(nb):
            for h in range(2):
                for gg in range(4):
                    self.store(xw, b * 8 + h * 4 + gg, self.smem_i[(b * 2 + h) * granules + blk * 4 + gg])
            if any(t in X_SUM_TYPES for t in types):  # Σq_x of each half (16 values)
                for half in range(2):
                    total = i32(0)
                    for gg in (2 * half, 2 * half + 1):
                        total = dp4a(xw[b * 8 + 4 + gg], ones, dp4a(xw[b * 8 + gg], ones, total))
                    self.store(xsum, 2 * b + half, total)
        mask, four = tirx.const(0x0F0F0F0F, "uint32"), tirx.const(4, "uint32")
        for m_i, m in enumerate(unit.matmuls):
            planes = self.weight(op, m.weights["weight"])
            t = types[m_i]
            for r in range(rows):
                at = m_i * rows + r
                if t == "Q8_0":
                    for j in range(8):
                        self.store(wi, j, tirx.reinterpret("int32", wq[at * 8 + j]))
                elif t in LOW_BITS:
                    for gg in range(4):
                        w = _low_bits(wq[at * 8 + gg % 2], gg)
                        if t == "Q3_K":
                            w = [a | e for a, e in zip(w, _fifth_bits(qh[2 * at], gg, bit=2), strict=True)]
                        self.store(wi, 2 * gg, tirx.reinterpret("int32", w[0]))
                        self.store(wi, 2 * gg + 1, tirx.reinterpret("int32", w[1]))
                else:
                    for gg in range(4):
                        w = [wq[at * 8 + gg] & mask, (wq[at * 8 + gg] >> four) & mask]
                        if t == "Q6_K":
                            w = [a | e for a, e in zip(w, _sixth_bits(qh[2 * at + gg // 2], 16 * (gg % 2)),
                                                       strict=True)]
                        elif "qh" in planes:
                            w = [a | e for a, e in zip(w, _fifth_bits(qh[2 * at], gg), strict=True)]
                        self.store(wi, 2 * gg, _signed_quants(t, w[0]))
                        self.store(wi, 2 * gg + 1, _signed_quants(t, w[1]))
                mw = mws[at] if at in has_min else None
                off = Q8_OFFSET.get(t)
                for b in range(nb):
                    a = (m_i * rows + r) * nb + b
                    # one integer sum a half of 16 values (Q6_K scales each by its own int8 scale)
                    halves = [i32(-off) * xsum[2 * b + h] if off else i32(0) for h in range(2)]
                    for gg in range(4):
                        halves[gg // 2] = dp4a(wi[2 * gg + 1], xw[b * 8 + 4 + gg],
                                               dp4a(wi[2 * gg], xw[b * 8 + gg], halves[gg // 2]))
                    if t in SIXTEENS:
                        total = halves[0] * sc6[2 * at] + halves[1] * sc6[2 * at + 1]
                    else:
                        total = halves[0] + halves[1]
                    self._q8_accumulate(acc, a, total, dws[at], mw, b, blk, k_in, lanes_per_block=1)
                    if t == "Q2_K":
                        self._q8_min16(acc, a, dmins[at],
                                       xsum[2 * b] * mn2[2 * at] + xsum[2 * b + 1] * mn2[2 * at + 1], b, blk, k_in)
