"""The many-row body of the int8 matmul (prefill, verify and batches past TILE rows): output lanes, no folds.

schedules/cpu/int8_gemv.py dots one weight row with one activation row per vpdpbusd (lanes along k), so every
block of 32 values needs its 8 partial sums folded into one (shuffles) before it is scaled: at 512 rows that ran
no faster than the float32 GEMM (SmolLM2's Q4_1 576x576: 8.0 vs 8.0 ms, Qwen3's Q8_0 3072x1024: 49 vs 38 ms).
Here the lanes are output rows, as in llama.cpp's repacked GEMMs (block_q4_0x8): a task takes a strip of 8·V
weight rows, unpacks all of its blocks once into a local buffer with the 4-byte quads of its 8 rows side by side
(quad j of a group: [row 0's bytes 4j..4j+3, row 1's, ...]), and then, for every activation row, one vpdpbusd per
quad against the activation's 4 bytes broadcast gives 8 rows' partial dots of those 4 values: after a group's 8
quads each lane holds its row's integer block dot, with no horizontal step, and one FMA with the 8 rows' d_w (times
the row's d_x) scales it. The unpacking is paid once per strip for all activation rows.

vpdpbusd multiplies unsigned bytes by signed ones and only the signed operand can be the broadcast, so the weights
are the unsigned side: the stored quants as they are (Q4_*, Q5_*, Q4_K, Q5_K, and Q6_K's 6-bit q), Q8_0's w + 128;
the centring (q − 8, q − 16, q − 32, w + 128 − 128) is subtracted as offset·Σx per block (Σx: the quantizer's `xi`,
or Q8_K's bsums for Q6_K's 16-value sub-blocks), the same integers as ggml's Σ (q − offset)·x. The K-quants weight
each group's (Q6_K: each half-group's) integer dot by the 8 rows' sub-block scales and subtract the mins with the
bsums, as the GEMV does. Only the order of the float32 sums differs from the GEMV (blocks here, lanes there).

The codebook types (IQ4_NL, IQ4_XS, MXFP4) stage their signed values + 128 as Q8_0 does, IQ4_XS subtracting
128·Σx per 32 values from two bsums; Q3_K's q − 4 and Q2_K's per-16 mins use the bsums as Q6_K and Q4_K do.
On AVX2 (vpmaddubsw + vpmaddwd, int8_gemv.dot4) Q8_0's w + 128 against x would saturate vpmaddubsw's int16 pair
sums, so there Q8_0 (and the codebook types) stages the signed w and each quad takes the sign trick (|w| · x·sign(w),
two more ops a quad: vpabsb and vpsignb) with no offset; the other types' quants are at most 6 bits and dot as they
are.
"""

from __future__ import annotations

from collections.abc import Callable

from luce_schedules.cpu.int8_gemv import (
    GROUPS,
    LANES,
    SIGNED,
    Bufs,
    _weights,
    dot4,
    e8m0_half,
    offset_safe,
    sign_moved,
)
from tvm import tirx
from tvm.tirx.script.builder import ir as T

from luce_compile.lower.cpu_int8 import QK8, QK_K, SIXTEENS, superblocked

QUADS = QK8 // 4  # 4-byte quads per group of 32 values: one vpdpbusd each
# the offset the unsigned weight operand carries (Q8_0: w + 128); the others store what they dot
OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q3_K": 4, **{kind: 128 for kind in SIGNED}}
# the 16-value sub-blocks of Q6_K, Q3_K and Q2_K in the "nibbles" order: quads 0, 1, 4, 5 hold elements 0..15
# (cpu_int8's docstring)
HALVES = ((0, 1, 4, 5), (2, 3, 6, 7))


def supports(n_out: int) -> bool:
    """Whole strips of 8 output rows."""
    return n_out % LANES == 0


def strip_vectors(n_out: int) -> int:
    """8-row vectors per strip: 2 where they divide n_out (each broadcast activation quad feeds two vpdpbusd)."""
    return 2 if n_out % (2 * LANES) == 0 else 1


def _offset(isa: str, kind: str) -> int:
    """What `_unsigned` adds to the centred quants of `kind` (0: none), subtracted again as offset·Σx."""
    return 0 if kind in SIGNED and not offset_safe(isa) else OFFSET.get(kind, 0)


def _unsigned(isa: str, kind: str, bufs: Bufs, n: tirx.Expr, g: tirx.Expr) -> tirx.Expr:
    """Weight row n's group g as the unsigned operand (int8x32 bits): the stored quants, Q8_0's w + 128 (signed w
    where that is not `offset_safe`: `_dot` then moves its sign onto x)."""
    w = _weights(kind, bufs, n, g)
    if kind in SIGNED:  # Q8_0 and the codebook values
        return w ^ T.Broadcast(T.int8(-128), QK8) if _offset(isa, kind) else w
    return w  # Q6_K: the stored 6-bit q, as _weights gives it


class Staged:
    """One strip's weights and scales in local buffers, lanes = the strip's rows (`stage` fills them)."""

    def __init__(self, isa: str, kind: str, n_in: int, width: int):
        groups = n_in // QK8
        self.isa, self.kind, self.width = isa, kind, width
        self.offset = _offset(isa, kind)
        self.signed = kind in SIGNED and not self.offset  # wq holds signed w: each quad takes the sign trick
        self.wq = T.decl_buffer((groups, QUADS, width * 4), "int8", scope="local")
        self.has_min = kind in ("Q4_K", "Q5_K", "Q2_K")
        if superblocked(kind):
            supers = n_in // QK_K
            per_group = 2 if kind in SIXTEENS else 1
            self.sc = T.decl_buffer((groups * per_group, width), "int32", scope="local")
            self.d = T.decl_buffer((supers, width), "float32", scope="local")
            if self.has_min:
                self.mn = T.decl_buffer((groups * per_group, width), "int32", scope="local")
                self.dmin = T.decl_buffer((supers, width), "float32", scope="local")
        else:
            self.d = T.decl_buffer((groups, width), "float32", scope="local")
            if kind in ("Q4_1", "Q5_1"):
                self.m = T.decl_buffer((groups, width), "float32", scope="local")

    def stage(self, bufs: Bufs, n0: tirx.Expr) -> None:
        """Unpack rows n0 .. n0 + width − 1: quad j of row i's group g to wq[g, j, 4i : 4i + 4]; scales as lanes."""
        groups = int(self.wq.shape[0])
        with T.serial(0, self.width) as i, T.serial(0, groups) as g:
            n = T.Bind(n0 + i)
            w = T.Bind(_unsigned(self.isa, self.kind, bufs, n, g))
            for j in range(QUADS):
                T.buffer_store(self.wq, T.Shuffle([w], list(range(4 * j, 4 * j + 4))), [g, j, T.Ramp(i * 4, 1, 4)])
            if superblocked(self.kind):
                self._stage_k(bufs, n, i, g)
            else:
                d = e8m0_half(bufs["e"][n, g], 1) if self.kind == "MXFP4" else T.Cast("float32", bufs["d"][n, g])
                T.buffer_store(self.d, d, [g, i])
                if "m" in bufs:
                    T.buffer_store(self.m, T.Cast("float32", bufs["m"][n, g]), [g, i])

    def _stage_k(self, bufs: Bufs, n: tirx.Expr, i: tirx.Expr, g: tirx.Expr) -> None:
        per_group = 2 if self.kind in SIXTEENS else 1
        for h in range(per_group):
            j = per_group * g + h
            T.buffer_store(self.sc, T.Cast("int32", bufs["sc"][n, j]), [j, i])
            if self.has_min:
                T.buffer_store(self.mn, T.Cast("int32", bufs["mn"][n, j]), [j, i])
        with T.If(g % GROUPS == 0), T.Then():
            s = g // GROUPS
            T.buffer_store(self.d, T.Cast("float32", bufs["d"][n, s]), [s, i])
            if self.has_min:
                T.buffer_store(self.dmin, T.Cast("float32", bufs["dmin"][n, s]), [s, i])

    def lanes(self, buf: tirx.Buffer, row: tirx.Expr, v: int) -> tirx.Expr:
        return buf[row, T.Ramp(v * LANES, 1, LANES)]

    def quad(self, g: tirx.Expr, j: int, v: int) -> tirx.Expr:
        return self.wq[g, j, T.Ramp(v * LANES * 4, 1, LANES * 4)]


def _x_quad(xw: tirx.Buffer, a: tirx.Expr, g: tirx.Expr, j: int) -> tirx.Expr:
    """Activation row a's bytes 4j..4j+3 of group g, broadcast to the 8 lanes (int8x32 bits)."""
    return T.reinterpret("int8x32", T.Broadcast(xw[a, g * QUADS + j], LANES))


def _dot(st: Staged, xw: tirx.Buffer, a: tirx.Expr, g: tirx.Expr, v: int, quads: tuple[int, ...]) -> tirx.Expr:
    """int32x8: lane i = Σ over `quads` of weight row i's unsigned bytes · activation row a's, in group g (signed
    weights: |w| · x·sign(w)). Two chains, added at the end (vpdpbusd's latency is ~5 cycles; the chains overlap)."""
    chains: list[tirx.Expr | None] = [None, None]
    for c, j in enumerate(quads):
        w, x = st.quad(g, j, v), _x_quad(xw, a, g, j)
        if st.signed:
            w, x = T.abs(w), sign_moved(w, x)
        chains[c % 2] = dot4(st.isa, w, x, chains[c % 2])
    return chains[0] + chains[1] if chains[1] is not None else chains[0]


def _i32x8(value: tirx.Expr) -> tirx.Expr:
    return T.Broadcast(value, LANES)


def block_terms(st: Staged, bufs: Bufs, xw: tirx.Buffer, a: tirx.Expr, b: tirx.Expr, v: int, acc: tirx.Expr):
    """acc (float32x8, lanes = the strip's rows in vector v) plus block b (32 values) against activation row a."""
    dot = _dot(st, xw, a, b, v, tuple(range(QUADS)))
    if st.offset:  # Σ (q − offset)·x = Σ q·x − offset·Σx
        dot = dot - _i32x8(bufs["xi"][a, b] * T.int32(st.offset))
    acc = T.fma(st.lanes(st.d, b, v) * T.Broadcast(bufs["xd"][a, b], LANES), T.Cast("float32x8", dot), acc)
    if "xs" in bufs:
        acc = T.fma(st.lanes(st.m, b, v), T.Broadcast(bufs["xs"][a, b], LANES), acc)
    return acc


def group_terms(st: Staged, bufs: Bufs, xw: tirx.Buffer, a: tirx.Expr, g: tirx.Expr, v: int, isum: tirx.Expr):
    """isum (int32x8) plus group g's integer dot weighted by the rows' sub-block scales (K-quants; Q6_K: one scale
    per half-group of 16 values, centred with the bsums)."""
    if st.kind not in SIXTEENS:
        dot = _dot(st, xw, a, g, v, tuple(range(QUADS)))
        if st.offset:  # IQ4_XS's w + 128: its 32 values' Σx are two bsums
            dot = dot - _i32x8((bufs["xb"][a, 2 * g] + bufs["xb"][a, 2 * g + 1]) * T.int32(st.offset))
        return isum + dot * st.lanes(st.sc, g, v)
    for h, quads in enumerate(HALVES):
        half = _dot(st, xw, a, g, v, quads)
        if st.offset:
            half = half - _i32x8(bufs["xb"][a, 2 * g + h] * T.int32(st.offset))
        isum = isum + half * st.lanes(st.sc, 2 * g + h, v)
    return isum


def super_terms(st: Staged, bufs: Bufs, a: tirx.Expr, s: tirx.Expr, v: int, isum: tirx.Expr, acc: tirx.Expr):
    """acc plus super-block s's integer sum scaled by d_w·d_x, less Q4_K/Q5_K's mins (dmin_w·d_x·Σ mn·bsums)."""
    xd = T.Broadcast(bufs["xd"][a, s], LANES)
    acc = T.fma(st.lanes(st.d, s, v) * xd, T.Cast("float32x8", isum), acc)
    if not st.has_min:
        return acc
    imin = None
    for j8 in range(GROUPS):
        g = s * GROUPS + j8
        if st.kind in SIXTEENS:  # Q2_K: a min per 16 values, one bsum each
            term = (st.lanes(st.mn, 2 * g, v) * _i32x8(bufs["xb"][a, 2 * g])
                    + st.lanes(st.mn, 2 * g + 1, v) * _i32x8(bufs["xb"][a, 2 * g + 1]))
        else:
            term = st.lanes(st.mn, g, v) * _i32x8(bufs["xb"][a, 2 * g] + bufs["xb"][a, 2 * g + 1])
        imin = term if imin is None else imin + term
    return T.fma(st.lanes(st.dmin, s, v) * (T.Broadcast(T.float32(0), LANES) - xd), T.Cast("float32x8", imin), acc)


def gemm_body(isa: str, kind: str, bufs: Bufs, y: tirx.Buffer, n_out: int, n_in: int, row_tile: int) -> None:
    """y (R, n_out) for R > TILE activation rows: parallel over strips of 8·V weight rows, `row_tile` activation
    rows at a time (independent accumulators), then the rows left one at a time."""
    strip = Strip(isa, kind, bufs, y, n_out, n_in)
    total = T.Cast("int32", y.shape[0])
    with T.parallel(0, n_out // strip.width) as c:
        strip.start(row_tile)
        strip.st.stage(bufs, c * strip.width)
        strip.run(c * strip.width, 0, total, row_tile, lambda r: r)


class Strip:
    """A task's strip of 8·V output columns: its staged weights (Staged) and accumulators, and `run`, which takes
    output rows first..end against them, `row_tile` rows at a time, then the rows left one at a time."""

    def __init__(self, isa: str, kind: str, bufs: Bufs, y: tirx.Buffer, n_out: int, n_in: int):
        self.isa, self.kind, self.bufs, self.y, self.n_in = isa, kind, bufs, y, n_in
        self.vectors = strip_vectors(n_out)
        self.width = LANES * self.vectors
        self.units = n_in // (QK_K if superblocked(kind) else QK8)
        xq = bufs["xq"]
        self.xw = T.decl_buffer((xq.shape[0], n_in // 4), "int32", data=xq.data)  # the activations as 4-byte quads

    def start(self, row_tile: int) -> None:
        """The task's local buffers (inside its parallel loop)."""
        self.st = Staged(self.isa, self.kind, self.n_in, self.width)
        self.acc = T.decl_buffer((row_tile * self.vectors, LANES), "float32", scope="local")
        self.isum = T.decl_buffer((row_tile * self.vectors, LANES), "int32", scope="local")

    def run(self, col: tirx.Expr, first: tirx.Expr, end: tirx.Expr, row_tile: int,
            x_row: Callable[[tirx.Expr], tirx.Expr]) -> None:
        """Output rows first..end − 1 of the strip's columns col.., output row r against activation row x_row(r)."""
        full = T.Bind((end - first) // row_tile)
        with T.serial(0, full) as t:
            self._rows(col, first + t * row_tile, row_tile, x_row)
        with T.serial(first + full * row_tile, end) as a:
            self._rows(col, a, 1, x_row)

    def _rows(self, col: tirx.Expr, first: tirx.Expr, count: int, x_row: Callable[[tirx.Expr], tirx.Expr]) -> None:
        st, bufs, xw, acc, isum, vectors = self.st, self.bufs, self.xw, self.acc, self.isum, self.vectors
        every = T.Ramp(0, 1, LANES)
        for k in range(count * vectors):
            T.buffer_store(acc, T.Broadcast(T.float32(0), LANES), [k, every])
        slots = [(x_row(first + r), v, r * vectors + v) for r in range(count) for v in range(vectors)]
        if not superblocked(self.kind):
            with T.serial(0, self.units) as u:
                for a, v, k in slots:
                    T.buffer_store(acc, block_terms(st, bufs, xw, a, u, v, acc[k, every]), [k, every])
        else:  # a super-block's groups in a loop, their integer sums in isum
            with T.serial(0, self.units) as u:
                for _, _, k in slots:
                    T.buffer_store(isum, T.Broadcast(T.int32(0), LANES), [k, every])
                with T.serial(0, GROUPS) as j8:
                    for a, v, k in slots:
                        T.buffer_store(isum, group_terms(st, bufs, xw, a, u * GROUPS + j8, v, isum[k, every]),
                                       [k, every])
                for a, v, k in slots:
                    T.buffer_store(acc, super_terms(st, bufs, a, u, v, isum[k, every], acc[k, every]), [k, every])
        for r in range(count):
            for v in range(vectors):
                T.buffer_store(self.y, acc[r * vectors + v, every], [first + r, T.Ramp(col + v * LANES, 1, LANES)])
