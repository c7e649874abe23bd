"""The prefill GEMM with 8-bit activations on integer tensor cores (--prefill-gemm q8), llama.cpp's MMQ design
(ggml-cuda/mmq.cuh) in TIR, beside mma_gemm.py's float16 one and built the same way (8 warps 2 × 4, a K step of
tile_k values staged through registers into one of two shared buffers, one barrier a step, ldmatrix.x4).

Two kernels in one function (lower/q8_gemm.py gives it the quantized input as scratch arguments after y):
1. quantize (mmq_blocks.py): x (float32) → xq, xd [, xs], the CPU int8 build's Q8_0/Q8_1 blocks of 32
   (lower/cpu_int8.quantize_q8's arithmetic: q = rint(x · 127/amax), d = fp16(amax/127), s = fp16(d · Σq)), in the
   order its weights' words give ("nibbles" for 4-6 bit quants, natural for Q8_0). A thread per block of 32 values
   (its 128 bytes, its amax and Σq its own: no shuffles, so the same statements run in a CPU harness in the tests).
2. the GEMM: per K step the x tile (int8 rows, copied as 16-byte words) and the weight tile unpacked to int8 (a
   32-value block's 4 nibble words → 8 words: masked, shifted, the fifth/sixth bits or'ed in, offset types centred
   per byte; 2-bit fields shifted and masked, Q3_K's third bit or'ed in, Q2_K's times its scale) go to shared
   memory, with each block's scales as float32 (d_x, s_x; d_w, m_w). Each warp then runs, per 32-value block,
   mma.sync.m16n8k32 s8 × s8 → s32 on its 16 × 8 fragments (Q6_K, Q3_K: two m16n8k16, one per 16-value sub-block,
   whose scales differ) and scales each fragment's sums in float32:
       u = fl(C · d_w);  acc = fma(u, d_x, acc)  [;  acc = fma(m_w, s_x, acc)]     per block (Q6_K, Q3_K per 16 values)
   Q2_K's minima per 16 values (mmq_blocks.py's docstring): one more m16n8k32 per 16 rows and block, of the x
   fragment against bytes of 1, gives each row's sums S_0, S_1 of the block's two 16 values (in even and odd
   columns); t_h = (float(bits) − 1.5·2²³)·d_x is exact, and after the block's scale term
       acc = fma(m_w0, t_0, acc);  acc = fma(m_w1, t_1, acc).
   The mma starts its int32 sum at the bits of 1.5·2²³ (MAGIC): the sum lands in a float's mantissa, so
   fb = float(bits) = 1.5·2²³ + C exactly (|C| < 2²², true for every type: 32·128·127 < 2²²) and
   u = fma(fb, d_w, −1.5·2²³·d_w) = fl(C · d_w), with no int → float conversion (a quarter-rate instruction) and
   the product −1.5·2²³·d_w exact (d_w = d·sc has at most 19 significant bits). mmq_blocks.emulate is this
   arithmetic in numpy, operation for operation.

Weights: m_w is the block's minimum term (Q4_1/Q5_1: m; Q4_K/Q5_K: −dmin·mn) against s_x, Q2_K's −dmin·mn of each
16 values against t; Q4_0/Q5_0/Q6_K/Q3_K dot the centred quants (q − 8/16/32/4) as llama.cpp's CUDA kernels do.
d_w = d·sc for the K-quants (exact in float32), Q2_K's d (its words hold sc·q).
Fragment layouts (PTX ISA, mma.m16n8k32 .s8): A = x (16 rows × 32 bytes), a0..a3 = (row g, bytes 4·tig..), (g + 8,
4·tig..), (g, 16 + 4·tig..), (g + 8, 16 + 4·tig..) for lane = 4·g + tig: in 32-bit words exactly mma.m16n8k16 f16's,
so the ldmatrix.x4 addressing is mma_gemm's with rows of tile_k bytes. B = W (feature-major), b0, b1 = (feature g,
bytes 4·tig.. / 16 + 4·tig..). m16n8k16 .s8 takes (a0, a1, b0) for bytes 0-15 and (a2, a3, b1) for 16-31: Q6_K's
and Q3_K's shared words are permuted (Q6_SLOTS) so that bytes 0-15 are their first 16 elements in the nibbles order.
Q2_K's words are not: its sums' B operand, b0 = b1 = bytes of 1 where word tig's sub-block, tig // 2, is column
g's parity, else 0, picks words 0, 1, 4, 5 (elements 0-15) for even columns and 2, 3, 6, 7 for odd ones.
"""

from __future__ import annotations

from luce_schedules.gpu.mma_gemm import (
    LDMATRIX,
    STATIC_SHARED,
    THREADS,
    TILE_K,
    TILE_M,
    TILE_N,
    WARPS_M,
    WARPS_N,
    _guard,
    i32,
    step_for,
    u32,
)
from luce_schedules.gpu.mmq_blocks import (
    BLOCK,
    Q6_SLOTS,
    WeightBlock,
    groups,
    minimums,
    plane_views,
    quantize_rows,
)
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as B

from luce_compile.lower.q8_gemm import Q8_GEMM_ACTIVATIONS, q8_gemm_format, scratch_specs
from luce_compile.lower.quant_layout import as_ggml_type, plane_specs
from luce_compile.lower.quant_matmul import byte_perm

__all__ = ["default_tile", "mmq_gemm", "shared_bytes", "supports"]

MAGIC = 0x4B400000  # the bits of 1.5·2²³: an int32 added to them is a float's mantissa (exact_int_to_float)
MAGIC_VALUE = 12582912.0
MMA_K32 = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"
MMA_K16 = "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32"
ONES = 0x01010101  # the B operand's bytes of Q2_K's sums per 16 values


def default_tile(n_out: int, sm_count: int) -> tuple[int, int, int]:
    """(tile_m, tile_n, tile_k) before tuning: 64 × 128 where it gives every SM a block at 512 rows, else 64 × 64,
    and the fattest step (mma_gemm.default_tile's rule without 128 × 128, whose 64 accumulators and scaled
    fragments spill at ptxas's 255 registers: 120 bytes for Q4_K, sm_90, 2026-12-07)."""
    if -(-512 // 64) * -(-n_out // 128) >= sm_count:
        return 64, 128, max(TILE_K)
    return 64, 64, max(TILE_K)


def supports(ggml_type: str, n_in: int, x_dtype: str = "float32") -> bool:
    """A weight type of lower/q8_gemm.py, float32 activations, K in whole 32-value steps."""
    return q8_gemm_format(ggml_type) is not None and x_dtype == "float32" and step_for(n_in, max(TILE_K)) > 0


def row_words(tile_k: int) -> int:
    """32-bit words of one staged int8 row: tile_k bytes, then 16 bytes of padding (ldmatrix's 8 row addresses fall
    in 8 distinct 16-byte bank groups: rows 48, 80 or 144 bytes apart)."""
    return tile_k // 4 + 4


def _shared_words(qtype: str, tile: tuple[int, int, int]) -> tuple[tuple[dict, dict], bool]:
    """((words of each tile buffer (both stages), words of each scale buffer (one stage)), whether the tiles are
    dynamic shared memory). The scales are laid out block-major ([block][row or feature]) so that a lane's two adjacent
    features are one 8- or 16-byte load and no load spans blocks (with a row's blocks together, ptxas loaded a step's
    four at once: 250+ registers), in a static buffer per stage: compute reads one stage's scales while the other's
    are stored, and TVM's barrier pass, which cannot tell two regions of one buffer apart, would put a
    __syncthreads between them (dynamic shared buffers are merged into one before that pass)."""
    tile_m, tile_n, tile_k = tile
    nblk = tile_k // BLOCK
    tiles = {"xa": 2 * tile_m * row_words(tile_k), "wb": 2 * tile_n * row_words(tile_k)}  # read by ldmatrix only
    scales = {"sx": nblk * tile_m * (2 if Q8_GEMM_ACTIVATIONS[qtype] == "Q8_1" else 1),  # (d_x, s_x) or d_x
              "sw": nblk * groups(qtype) * tile_n * 2}  # (d_w, −MAGIC·d_w)
    if minimums(qtype):
        scales["smw"] = nblk * minimums(qtype) * tile_n
    static = 2 * sum(scales.values()) * 4
    return (tiles, scales), static + sum(tiles.values()) * 4 > STATIC_SHARED


def shared_bytes(qtype: str, tile: tuple[int, int, int]) -> tuple[int, int]:
    """(static, dynamic) shared memory of the GEMM kernel: the scales are always static, the tiles dynamic where
    the two would pass 48 KiB."""
    (tiles, scales), dynamic = _shared_words(qtype, tile)
    tile_bytes = sum(tiles.values()) * 4
    return 2 * sum(scales.values()) * 4 + (0 if dynamic else tile_bytes), tile_bytes if dynamic else 0


def _fma(a: tirx.Expr, b: tirx.Expr, c: tirx.Expr) -> tirx.Expr:
    """a·b + c rounded once (the emulation's arithmetic: never left to the compiler's contraction)."""
    return tirx.call_pure_extern("float32", "__fmaf_rn", a, b, c)


class GemmKernel:
    """Kernel 2's pieces, inside its launch (tx, the tile's origin m0/n0, the flat views and shared buffers). Its
    staging (load_step, store_step) has no warp-wide instruction: the tests run it on the CPU, a loop for the threads,
    and read what it leaves in shared memory."""

    def __init__(self, qtype: str, n_out: int, n_in: int, tile: tuple[int, int, int], views: dict, rows, tx,
                 m0, n0, sums: bool):
        self.qtype, self.n_out, self.n_in, self.views, self.rows, self.tx = qtype, n_out, n_in, views, rows, tx
        self.tile_m, self.tile_n, self.tile_k = tile
        self.m0, self.n0 = m0, n0
        self.perm = byte_perm  # the codebook types' lookups (WeightBlock; a CPU harness gives its TIR equivalent)
        self.row, self.nblk = row_words(self.tile_k), self.tile_k // BLOCK
        self.groups = groups(qtype)  # weight scales a block
        self.minima = minimums(qtype)  # minimum terms a block: against s_x (1) or Q2_K's t per 16 values (2)
        self.sums = sums
        warp, lane = tx // 32, tx % 32
        self.lane, self.group, self.tig = lane, lane // 4, lane % 4
        self.wm, self.wn = warp // WARPS_N, warp % WARPS_N
        self.warp_m, self.warp_n = self.tile_m // WARPS_M, self.tile_n // WARPS_N
        self.frags_m, self.frags_n = self.warp_m // 16, self.warp_n // 8

    def x_row(self, r: tirx.Expr) -> tirx.Expr:
        """The row of the quantized input that tile row r reads: rows past the batch clamped to its last (never
        stored)."""
        return tirx.min(self.m0 + r, self.rows - 1)

    def weight_row(self, f: tirx.Expr) -> tirx.Expr:
        """The weight row of tile feature f: features past n_out clamped to the last (never stored)."""
        return tirx.min(self.n0 + f, self.n_out - 1)

    def stored(self, y_row: tirx.Expr, feat: tirx.Expr) -> tirx.Expr:
        """Whether output (y_row, feat) of the tile is written: inside the batch and n_out."""
        return (y_row < self.rows) if self.n_out % self.tile_n == 0 else (y_row < self.rows) & (feat < self.n_out)

    def alloc_shared(self) -> None:
        """The two stages' int8 tiles (padded rows) and scales (shared_bytes)."""
        (tile_words, scale_words), dynamic = _shared_words(self.qtype, (self.tile_m, self.tile_n, self.tile_k))
        self.smem = {name: B.alloc_buffer((n,), "uint32", scope="shared.dyn" if dynamic else "shared")
                     for name, n in tile_words.items()}
        self.stage = {name: [B.alloc_buffer((n,), "float32", scope="shared") for _ in range(2)]
                      for name, n in scale_words.items()}

    def _slots(self, count: int):
        """(linear index, whether every thread has one) of this thread's share of `count` items a step."""
        for s in range(-(-count // THREADS)):
            yield self.tx + s * THREADS, count % THREADS == 0 or (s + 1) * THREADS <= count

    def load_step(self, step: tirx.Expr) -> tuple[list, list, list]:
        """Issue this thread's loads of step `step` (x words, x scales, weight blocks) into registers."""
        chunks = self.tile_k // 16  # 16-byte words of an x row a step
        xs, scales, blocks = [], [], []
        for idx, always in self._slots(self.tile_m * chunks):
            x_row = self.x_row(idx // chunks)
            reg = B.alloc_buffer((4,), "uint32", scope="local")
            with _guard(idx < self.tile_m * chunks, always):
                at = x_row * (self.n_in // 4) + step * (self.tile_k // 4) + (idx % chunks) * 4
                B.buffer_store(reg, self.views["xq"].vload([at], "uint32x4"), [tirx.Ramp(i32(0), i32(1), 4)])
            xs.append(reg)
        planes = ["xd", "xs"] if self.sums else ["xd"]
        for idx, always in self._slots(self.tile_m * len(planes)):
            x_row = self.x_row(idx % self.tile_m)
            reg = B.alloc_buffer((self.nblk,), "float32", scope="local")
            with _guard(idx < self.tile_m * len(planes), always):
                for p, name in enumerate(planes):
                    at = x_row * (self.n_in // BLOCK) + step * self.nblk
                    with _guard(idx // self.tile_m == p, len(planes) == 1):
                        _copy(reg, 0, self.views[f"{name}:flat"], at, self.nblk)
            scales.append(reg)
        for idx, always in self._slots(self.tile_n * self.nblk):
            unit = WeightBlock(self.qtype, self.views, self.weight_row(idx // self.nblk),
                               step * self.nblk + idx % self.nblk, self.n_in, self.perm)
            with _guard(idx < self.tile_n * self.nblk, always):
                unit.load()
            blocks.append(unit)
        return xs, scales, blocks

    def store_step(self, buf: int, staged) -> None:
        """The staged registers of a step, unpacked, into stage `buf` (0 or 1) of the shared buffers."""
        xs, scales, blocks = staged
        chunks, sm = self.tile_k // 16, self.smem
        for (idx, always), reg in zip(self._slots(self.tile_m * chunks), xs, strict=True):
            c = idx % chunks  # 16-byte word c of the row: block c // 2, its words 4·(c % 2) .. + 3
            base = buf * (self.tile_m * self.row) + (idx // chunks) * self.row + (c // 2) * 8
            with _guard(idx < self.tile_m * chunks, always):
                if self.groups == 2:  # words 0, 1 | 2, 3 of the half to their slots (Q6_SLOTS), 8 bytes each
                    for pair in range(2):
                        slot = tirx.Select(c % 2 == 0, i32(Q6_SLOTS[2 * pair]), i32(Q6_SLOTS[4 + 2 * pair]))
                        B.buffer_store(sm["xa"], reg.vload([i32(2 * pair)], "uint32x2"),
                                       [tirx.Ramp(base + slot, i32(1), 2)])
                else:
                    B.buffer_store(sm["xa"], reg.vload([i32(0)], "uint32x4"),
                                   [tirx.Ramp(base + (c % 2) * 4, i32(1), 4)])
        planes = 2 if self.sums else 1
        for (idx, always), reg in zip(self._slots(self.tile_m * planes), scales, strict=True):
            row, p = idx % self.tile_m, idx // self.tile_m
            with _guard(idx < self.tile_m * planes, always):
                for kk in range(self.nblk):  # [block][row][d_x, s_x]
                    B.buffer_store(self.stage["sx"][buf], reg[kk], [(kk * self.tile_m + row) * planes + p])
        for (idx, always), unit in zip(self._slots(self.tile_n * self.nblk), blocks, strict=True):
            with _guard(idx < self.tile_n * self.nblk, always):
                self._store_block(buf, idx // self.nblk, idx % self.nblk, unit)

    def _store_block(self, buf: int, feat, blk, unit: WeightBlock) -> None:
        sm = self.smem
        words = unit.words()
        base = buf * (self.tile_n * self.row) + feat * self.row + blk * 8
        for h in range(2):
            w = B.alloc_buffer((4,), "uint32", scope="local")
            for i in range(4):
                B.buffer_store(w, words[4 * h + i], [i32(i)])
            B.buffer_store(sm["wb"], w.vload([i32(0)], "uint32x4"), [tirx.Ramp(base + 4 * h, i32(1), 4)])
        dw, mw = unit.scales()
        for g, value in enumerate(dw):  # [block][group][feature][d_w, −MAGIC·d_w] (exact: ≤ 21 bits)
            at = ((blk * self.groups + g) * self.tile_n + feat) * 2
            B.buffer_store(self.stage["sw"][buf], value, [at])
            B.buffer_store(self.stage["sw"][buf], value * tirx.const(-MAGIC_VALUE, "float32"), [at + 1])
        for h, value in enumerate(mw):  # [block][minimum][feature]
            B.buffer_store(self.stage["smw"][buf], value, [(blk * self.minima + h) * self.tile_n + feat])

    def compute_step(self, buf: int, acc: tirx.Buffer, magic: tirx.Buffer) -> None:
        """Every 32-value block of the step in stage `buf`: the warp's mma.sync on its fragments, each fragment's
        int32 sums scaled into acc (module docstring)."""
        fm_n, fn_n, sm = self.frags_m, self.frags_n, self.smem
        for kk in range(self.nblk):
            a = B.alloc_buffer((fm_n * 4,), "uint32", scope="local")
            b = B.alloc_buffer((fn_n * 2,), "uint32", scope="local")
            lane = self.lane
            for fm in range(fm_n):
                r = self.wm * self.warp_m + fm * 16 + lane % 8 + 8 * ((lane // 8) % 2)
                at = buf * (self.tile_m * self.row) + r * self.row + kk * 8 + 4 * (lane // 16)
                B.evaluate(T.ptx[LDMATRIX](*(a[fm * 4 + i] for i in range(4)), T.address_of(sm["xa"][at])))
            for p in range(fn_n // 2):
                feat = self.wn * self.warp_n + p * 16 + lane % 8 + 8 * (lane // 16)
                at = buf * (self.tile_n * self.row) + feat * self.row + kk * 8 + 4 * ((lane // 8) % 2)
                B.evaluate(T.ptx[LDMATRIX](*(b[p * 4 + i] for i in range(4)), T.address_of(sm["wb"][at])))
            dx, sx = self._row_scales(buf, kk)
            dw, nm, mw = self._feature_scales(buf, kk)
            t = self._sums16(a, magic, dx) if self.minima == 2 else None
            for fm in range(fm_n):
                for fn in range(fn_n):
                    self._fragment(acc, magic, a, b, fm, fn, dx, sx, dw, nm, mw, t)

    def _sums16(self, a: tirx.Buffer, magic: tirx.Buffer, dx: tirx.Buffer) -> tirx.Buffer:
        """Q2_K: t = d_x·S for this lane's two rows of each fragment row and the block's two 16 values (index
        fm·4 + 2·half + h), S the rows' quants summed over those 16 by the x fragment's mma against bytes of 1 (B's
        column g sums the words of sub-block g % 2: word tig and 4 + tig are sub-block tig // 2). Exact: the mma's
        sum from MAGIC is a float's mantissa, and d_x (fp16) times |S| ≤ 2,032 has ≤ 22 significant bits."""
        ones = B.alloc_buffer((1,), "uint32", scope="local")
        B.buffer_store(ones, sums_operand(self.tig, self.group), [i32(0)])
        t = B.alloc_buffer((self.frags_m * 4,), "float32", scope="local")
        for fm in range(self.frags_m):
            d = B.alloc_buffer((4,), "uint32", scope="local")
            B.evaluate(T.ptx[MMA_K32](*(d[i] for i in range(4)), *(a[fm * 4 + i] for i in range(4)), ones[0],
                                      ones[0], *(magic[i] for i in range(4))))
            for i in range(4):  # c0, c1: row group, S_0 and S_1 (columns 2·tig, 2·tig + 1); c2, c3: row group + 8
                s = tirx.reinterpret("float32", d[i]) - tirx.const(MAGIC_VALUE, "float32")
                B.buffer_store(t, s * dx[fm * 2 + i // 2], [i32(fm * 4 + i)])
        return t

    def _row_scales(self, buf: int, kk: int) -> tuple[tirx.Buffer, tirx.Buffer | None]:
        """d_x (and s_x) of block kk for this lane's two rows of each fragment: index fm·2 + half."""
        planes = 2 if self.sums else 1
        dx = B.alloc_buffer((self.frags_m * 2,), "float32", scope="local")
        sx = B.alloc_buffer((self.frags_m * 2,), "float32", scope="local") if self.sums else None
        for fm in range(self.frags_m):
            for h in range(2):
                row = self.wm * self.warp_m + fm * 16 + self.group + 8 * h
                at = (kk * self.tile_m + row) * planes
                B.buffer_store(dx, self.stage["sx"][buf][at], [i32(fm * 2 + h)])
                if sx is not None:
                    B.buffer_store(sx, self.stage["sx"][buf][at + 1], [i32(fm * 2 + h)])
        return dx, sx

    def _feature_scales(self, buf: int, kk: int):
        """d_w and −MAGIC·d_w (index (fn·2 + c)·groups + g) and m_w ((fn·2 + c)·minima + h) of block kk for this
        lane's two features of each fragment (adjacent: one 16-byte load of the pairs, 8-byte loads of m_w)."""
        g_n, m_n = self.groups, self.minima
        dw = B.alloc_buffer((self.frags_n * 2 * g_n,), "float32", scope="local")
        nm = B.alloc_buffer((self.frags_n * 2 * g_n,), "float32", scope="local")
        mw = B.alloc_buffer((self.frags_n * 2 * m_n,), "float32", scope="local") if m_n else None
        for fn in range(self.frags_n):
            for c in range(2):
                feat = self.wn * self.warp_n + fn * 8 + 2 * self.tig + c
                for g in range(g_n):
                    at = ((kk * g_n + g) * self.tile_n + feat) * 2
                    B.buffer_store(dw, self.stage["sw"][buf][at], [i32((fn * 2 + c) * g_n + g)])
                    B.buffer_store(nm, self.stage["sw"][buf][at + 1], [i32((fn * 2 + c) * g_n + g)])
                for h in range(m_n):
                    B.buffer_store(mw, self.stage["smw"][buf][(kk * m_n + h) * self.tile_n + feat],
                                   [i32((fn * 2 + c) * m_n + h)])
        return dw, nm, mw

    def _fragment(self, acc, magic, a, b, fm: int, fn: int, dx, sx, dw, nm, mw, t) -> None:
        """One 16 × 8 fragment and one block: C = A·B from MAGIC (two halves for Q6_K, Q3_K), then per element
        u = fma(float(bits(C)), d_w, −MAGIC·d_w), acc = fma(u, d_x, acc) [, acc = fma(m_w, s_x, acc) | Q2_K's
        acc = fma(m_w0, t_0, acc), acc = fma(m_w1, t_1, acc)]."""
        g_n = self.groups
        d = B.alloc_buffer((4,), "uint32", scope="local")
        mag = [magic[i] for i in range(4)]
        for g in range(g_n):
            if g_n == 1:
                B.evaluate(T.ptx[MMA_K32](*(d[i] for i in range(4)), *(a[fm * 4 + i] for i in range(4)),
                                          b[fn * 2], b[fn * 2 + 1], *mag))
            else:  # bytes 16·g .. 16·g + 15: a0, a1 (g 0) or a2, a3 (g 1), and b_g
                B.evaluate(T.ptx[MMA_K16](*(d[i] for i in range(4)), a[fm * 4 + 2 * g], a[fm * 4 + 2 * g + 1],
                                          b[fn * 2 + g], *mag))
            for i in range(4):  # c0, c1: row group, features 2·tig, 2·tig + 1; c2, c3: row group + 8
                h, c = i // 2, i % 2
                slot = (fm * self.frags_n + fn) * 4 + i
                w = (fn * 2 + c) * g_n + g
                u = _fma(tirx.reinterpret("float32", d[i]), dw[w], nm[w])
                B.buffer_store(acc, _fma(u, dx[fm * 2 + h], acc[slot]), [i32(slot)])
        if mw is None:
            return
        for i in range(4):
            h, c = i // 2, i % 2
            slot = (fm * self.frags_n + fn) * 4 + i
            if t is None:
                B.buffer_store(acc, _fma(mw[fn * 2 + c], sx[fm * 2 + h], acc[slot]), [i32(slot)])
                continue
            for s16 in range(2):  # row group + 8·h's t_0, t_1: _sums16's c 2·h, 2·h + 1
                B.buffer_store(acc, _fma(mw[(fn * 2 + c) * 2 + s16], t[fm * 4 + 2 * h + s16], acc[slot]),
                               [i32(slot)])

    def registers(self) -> tuple[tirx.Buffer, tirx.Buffer]:
        """The thread's accumulators and the mma's starting sums (MAGIC's bits)."""
        acc = B.alloc_buffer((self.frags_m * self.frags_n * 4,), "float32", scope="local")
        magic = B.alloc_buffer((4,), "uint32", scope="local")
        for i in range(4):
            B.buffer_store(magic, u32(MAGIC), [i32(i)])
        return acc, magic

    def accumulate(self, acc: tirx.Buffer, magic: tirx.Buffer, pairs: tirx.Expr | None = None) -> None:
        """acc = the tile's sums over K, in steps of tile_k: each step's loads in flight while the previous step's
        mma.sync run, two stages of shared memory, one barrier a step. `pairs`: how many pairs of middle steps run
        (all by default; a grouped tile with no row of an expert runs none, and its sums are never stored)."""
        for i in range(self.frags_m * self.frags_n * 4):
            B.buffer_store(acc, tirx.const(0.0, "float32"), [i32(i)])
        steps = self.n_in // self.tile_k
        sync = lambda: B.evaluate(T.tvm_storage_sync("shared"))  # noqa: E731

        def step(s: tirx.Expr, cur: int) -> None:
            staged = self.load_step(s + 1)  # in flight while this step's mma.sync run
            self.compute_step(cur, acc, magic)
            self.store_step(1 - cur, staged)
            sync()

        self.store_step(0, self.load_step(i32(0)))
        sync()
        # steps in pairs, so that each names its stage by a constant (the scales' buffers are a Python list)
        with B.serial(0, (steps - 1) // 2 if pairs is None else pairs) as pair:
            step(2 * pair, 0)
            step(2 * pair + 1, 1)
        if (steps - 1) % 2:
            step(i32(steps - 2), 0)
        self.compute_step((steps - 1) % 2, acc, magic)

    def epilogue(self, acc: tirx.Buffer, y: tirx.Buffer) -> None:
        """y: each fragment's c0, c1 (row group) and c2, c3 (row group + 8), adjacent features (mma_gemm's)."""
        for fm in range(self.frags_m):
            for fn in range(self.frags_n):
                feat = self.n0 + self.wn * self.warp_n + fn * 8 + 2 * self.tig
                for half in range(2):
                    y_row = self.m0 + self.wm * self.warp_m + fm * 16 + self.group + 8 * half
                    for c in range(2):
                        with B.If(self.stored(y_row, feat + c)), B.Then():
                            B.buffer_store(y, acc[(fm * self.frags_n + fn) * 4 + 2 * half + c],
                                           [y_row * self.n_out + feat + c])


def sums_operand(tig: tirx.Expr, group: tirx.Expr) -> tirx.Expr:
    """b0 = b1 of Q2_K's sums mma for lane 4·group + tig: bytes of 1 where the lane's words (tig, 4 + tig: sub-block
    tig // 2) are of the sub-block of its B column's parity (group % 2), else 0."""
    return tirx.Select(tig // 2 == group % 2, u32(ONES), u32(0))


def _copy(dst: tirx.Buffer, dst_at, src: tirx.Buffer, src_at, count: int) -> None:
    """count (1, 2 or 4) consecutive values, as one vector access where count > 1."""
    dst_at, src_at = (i32(v) if isinstance(v, int) else v for v in (dst_at, src_at))
    if count == 1:
        B.buffer_store(dst, src[src_at], [dst_at])
        return
    B.buffer_store(dst, src.vload([src_at], f"{src.dtype}x{count}"), [tirx.Ramp(dst_at, i32(1), count)])


def checked_kernel(who: str, ggml_type: str, n_in: int, tile_m: int, tile_n: int, tile_k: int):
    """(the type's name, its activations' Q8Format, the K step taken) of a GEMM this module builds, or a ValueError
    naming what it takes."""
    qtype = as_ggml_type(ggml_type).name
    fmt = q8_gemm_format(qtype)
    step = step_for(n_in, tile_k)
    if fmt is None or tile_m not in TILE_M or tile_n not in TILE_N or not step:
        raise ValueError(f"{who}: {qtype} with tile {tile_m}x{tile_n} and K={n_in} is not supported (types "
                         f"of lower/q8_gemm.py, tiles {TILE_M} x {TILE_N}, K a multiple of {min(TILE_K)})")
    return qtype, fmt, step


def mmq_gemm(ggml_type: str, n_out: int, n_in: int, *, tile_m: int = 128, tile_n: int = 128, tile_k: int = 128,
             name: str = "mmq_gemm") -> tirx.PrimFunc:
    """PrimFunc(x (batch, n_in) float32, *planes, y (batch, n_out) float32, xq, xd [, xs]) with the signature of
    lower/q8_gemm.q8_gemm_matmul: x quantized into the scratch (kernel 1), then y = the 8-bit GEMM (kernel 2)."""
    qtype, fmt, tile_k = checked_kernel("mmq_gemm", ggml_type, n_in, tile_m, tile_n, tile_k)
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    with IRBuilder() as ib, B.prim_func():
        B.func_name(name)
        batch = tirx.Var("batch", "int64")
        x = B.arg("x", B.buffer((batch, i64(n_in)), "float32"))
        planes = plane_args(qtype, n_out, n_in)
        y = B.arg("y", B.buffer((batch, i64(n_out)), "float32"))
        scratch = scratch_args(fmt, batch, n_in)
        B.func_attr({"tirx.noalias": True})
        rows = batch.astype("int32")
        views = flat_views(planes, scratch, rows, n_in)
        quantize_rows(B.decl_buffer((rows * n_in,), "float32", data=x.data), views["q8"], rows, n_in, fmt.order)
        y_flat = B.decl_buffer((rows * n_out,), "float32", data=y.data)
        _gemm_kernel(qtype, n_out, n_in, (tile_m, tile_n, tile_k), views, rows, y_flat, fmt.with_sum)
    return ib.get()


def plane_args(qtype: str, rows: int, n_in: int) -> dict[str, tirx.Buffer]:
    """The weight planes of `rows` rows as the function's arguments (quant_layout.plane_specs' shapes)."""
    return {pl: B.arg(pl, B.buffer(tuple(tirx.IntImm("int64", d) for d in shape), dt))
            for pl, (shape, dt) in plane_specs(qtype, rows, n_in).items()}


def scratch_args(fmt, rows: tirx.Var, n_in: int) -> dict[str, tirx.Buffer]:  # noqa: ANN001  (a Q8Format)
    """The quantized input of `rows` rows as the function's last arguments (lower/q8_gemm.scratch_specs)."""
    return {arg: B.arg(arg, B.buffer((rows, tirx.IntImm("int64", shape[1])), dt))
            for arg, (shape, dt) in scratch_specs(fmt, n_in).items()}


def flat_views(planes: dict, scratch: dict, rows: tirx.Expr, n_in: int) -> dict:
    """plane_views, the scratch (`xq` as words, `xd:flat`, `xs:flat`) and, under "q8", the quantizer's outputs."""
    views: dict = plane_views(planes)
    views["xq"] = B.decl_buffer((rows * (n_in // 4),), "uint32", data=scratch["xq"].data)
    views["q8"] = {"xq": views["xq"]}
    for arg in ("xd", "xs"):
        if arg in scratch:
            views[f"{arg}:flat"] = B.decl_buffer((rows * (n_in // BLOCK),), "float32", data=scratch[arg].data)
            views["q8"][arg] = views[f"{arg}:flat"]
    return views


def _gemm_kernel(qtype: str, n_out: int, n_in: int, tile: tuple[int, int, int], views: dict, rows: tirx.Expr,
                 y: tirx.Buffer, sums: bool) -> None:
    """Kernel 2: a block per tile_m × tile_n tile of y, K in steps of tile_k, two shared buffers, one barrier a step."""
    tile_m, tile_n, _ = tile
    bx, by, tx = B.env_thread("blockIdx.x"), B.env_thread("blockIdx.y"), B.env_thread("threadIdx.x")
    with B.launch_thread(bx, -(-n_out // tile_n)), B.launch_thread(by, (rows + (tile_m - 1)) // tile_m), \
            B.launch_thread(tx, THREADS):
        k = GemmKernel(qtype, n_out, n_in, tile, views, rows, tx, by * tile_m, bx * tile_n, sums)
        k.alloc_shared()
        acc, magic = k.registers()
        k.accumulate(acc, magic)
        k.epilogue(acc, y)
