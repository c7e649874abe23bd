"""Float weights on tf32 tensor cores (float_mma): F16/BF16 matvecs as mma.m16n8k8 (16 rows x 8 values x the
batch's 8 columns, float32 sums), the weights exact in tf32 and the input rounded to it once (tf32)."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda.core import F32, _nothing, f32, i32
from luce_compile.fuse.options import MMA_FLOAT_TYPES

MMA_CHUNK = 32  # float_mma: K values a warp takes per (16 rows, chunk): 4 lanes x one 16-byte word of 8 values
MMA_MIN_CHUNKS = 8  # float_mma: the fewest chunks a warp's slice of K takes
MMA_TILES = 4  # float_mma: (matmul, 16-row tile) fragments a warp accumulates at once; more tiles take rounds


def tf32(v: tirx.Expr) -> tirx.Expr:
    """v rounded to tf32 (10 mantissa bits, to nearest, ties away from zero: cvt.rna.tf32.f32), as a float32 whose 13
    low mantissa bits are zero: what mma.m16n8k8.tf32 reads of a register (it ignores those bits, a truncation)."""
    bits = tirx.reinterpret("uint32", v)
    return tirx.reinterpret(F32, (bits + tirx.const(0x1000, "uint32")) & tirx.const(0xFFFFE000, "uint32"))


class FloatMmaMixin:
    def _float_mma(self, st, k_in: int) -> bool:
        """Whether the stage's matvecs run on tf32 tensor cores: the option is on, K is whole chunks of 32 and every
        weight is F16 or BF16 (exact in tf32, so only the activations round). A function of the stage alone:
        every batch size computes a sequence alike (batched equal to alone)."""
        if not self.float_mma or k_in % MMA_CHUNK:
            return False
        return all(t in MMA_FLOAT_TYPES for unit in st.units for t in self._weight_types(unit))

    def _float_mma_split(self, k_in: int) -> int:
        """Warps that split K into slices of at least MMA_MIN_CHUNKS chunks: a function of K alone (one summation
        order at every batch size)."""
        chunks, split = k_in // MMA_CHUNK, 1
        while split < self.warps and chunks // (2 * split) >= MMA_MIN_CHUNKS:
            split *= 2
        return split

    def _float_mma_matvec(self, op: P.Opcode, st, k_in: int, env_need: int, rstd_at: int, rstd_all,
                          rstd_from_arena, xval) -> None:
        """The input (norm applied, rounded to tf32) in shared memory a sequence a row, rows padded by 4 floats so
        that a quarter warp's 16-byte loads of B fragments (4 lanes of one sequence, 2 sequences) hit distinct
        banks; where it does not fit, the B fragments are read from the arena and rounded in registers (the same
        values: staging changes no bit)."""
        nb, stride = self.nb, k_in + P.ALIGN
        staged = nb * stride + env_need + nb <= self.shared_floats
        if staged:
            self._stage_input(op, st, k_in, lambda b, k: b * stride + k, rstd_at, rstd_all, finish=tf32)
        else:
            if st.merged >= 0:
                raise UnsupportedError(f"fuse: stage {op.stage} merges attention partials but its input does not "
                                       "fit shared memory; plan it without fold_merge")
            if st.prologue is not None:
                rstd_from_arena()
        env_base = nb * stride if staged else 0

        def x_granule(xb: tirx.Buffer, at: int, b, k) -> None:  # sequence b's values k..k+7 into xb[at..at+7]
            if staged:
                for h in range(2):
                    B.buffer_store(xb, self.smem.vload([b * stride + k + 4 * h], "float32x4"),
                                   [tirx.Ramp(i32(at + 4 * h), i32(1), 4)])
            else:
                for j in range(8):
                    self.store(xb, at + j, tf32(xval(b, k + j)))

        self.phase(3)
        for u, unit in enumerate(st.units):
            with self.when(self.col(P.UNIT) == u):
                self.matvec_unit(op, st, u, unit, k_in, staged, xval, env_base, mma_x=x_granule)

    def _float_mma_matmuls(self, op, unit, k_in: int, rows_max: int, lo, hi, env, slots, env_end: int, x_granule,
                           input_floats: int) -> None:
        """The tile's matmuls into shared memory (env) on tf32 tensor cores: mma.m16n8k8 (16 rows x 8 values x
        the batch's 8 columns, float32 accumulators), F16/BF16 weights exact, the input rounded to tf32. The
        columns past the batch repeat its last sequence (their results unused): at batch 1, 7 of 8 columns are
        waste, but a tensor-core instruction does a warp's 1,024 multiply-adds.

        Fragments (PTX ISA, mma.m16n8k8 .tf32): lane = 4·quad + tig holds A rows quad, quad + 8 at k slots tig and
        tig + 4, B column quad at the same slots. The k order is free as long as A and B share it: in a chunk of 32
        values, lane tig takes values 8·tig .. 8·tig + 7 (one 16-byte word of each of its two rows, one float4 pair
        of its sequence's input), and mma j (of 4) puts value 8·tig + 2j in slot tig and 8·tig + 2j + 1 in slot
        tig + 4: for BF16 the low and high halves of word j, no shuffles. A warp takes 16-row tiles of every matmul
        over its slice of K (`_float_mma_split`), `ahead` chunks' loads issued before their mmas."""
        nb, n_m = self.nb, len(unit.matmuls)
        chunks = k_in // MMA_CHUNK
        split = self._float_mma_split(k_in)
        groups = self.warps // split
        per_slice = -(-chunks // split)
        slice_, group = self.warp % split, self.warp // split
        tiles_m = -(-rows_max // 16)
        per_warp = -(-tiles_m // groups)  # tiles of each matmul a warp takes, in rounds of per_round
        # fragments a warp accumulates at once (which tiles a warp takes together, never a sum's order: any rule
        # keeps batched equal to alone). Measured on the H200, the BF16 1B body at b=1 / b=8, device µs a step:
        # 2 fragments 1,037 / 1,338, 4 975 / 1,458, 8 1,084 / 1,397
        tiles = self.float_mma_tiles or (MMA_TILES // 2 if self.nb >= 8 else MMA_TILES)
        per_round = min(per_warp, max(1, tiles // n_m))
        rounds = -(-per_warp // per_round)
        if rounds > 1:  # the slices' sums cannot go where the input is: later rounds read it
            input_floats = 0
        quad, tig = self.lane // 4, self.lane % 4
        layer = self.col(P.LAYER)
        types = self._weight_types(unit)
        # chunks whose loads a warp issues before their mmas (8 words of A a lane per matmul and tile): measured on
        # the H200, the BF16 1B body's b=1 step 988 µs with 1 (at most 32 words a lane), 948 with 2, 972 with 4
        ahead = self.float_mma_ahead or min(per_slice, 2)
        acc = self.local(F32, n_m * per_round * 4)
        xb = self.local(F32, 8 * ahead)
        wq = self.local("uint32", 8 * n_m * per_round * ahead)
        a, bq = self.local("uint32", 4), self.local("uint32", 2)
        column = tirx.min(quad, nb - 1)  # the sequence whose input this lane gives B
        sixteen, high, low = tirx.const(16, "uint32"), tirx.const(0xFFFF0000, "uint32"), tirx.const(0xFFFF, "uint32")
        words = [self._word_view(self.weight(op, m.weights["weight"])["w"]) for m in unit.matmuls]

        def w_at(c_, m_i, t, i, j) -> int:
            return (((c_ * n_m + m_i) * per_round + t) * 2 + i) * 4 + j

        def value(c_, m_i, t, i, j, odd: bool) -> tirx.Expr:  # value 2j + odd of row quad + 8i's word, tf32 bits
            w = wq[w_at(c_, m_i, t, i, j)]
            if types[m_i] == "BF16":  # the top half of a float32
                return w & high if odd else w << sixteen
            half = (w >> sixteen if odd else w & low).astype("uint16")
            return tirx.reinterpret("uint32", tirx.reinterpret("float16", half).astype(F32))

        steps = -(-per_slice // ahead)
        exact = per_slice % ahead == 0 and chunks % split == 0  # every chunk a step takes is in the slice and in K
        loop = B.unroll if steps <= self.unroll_passes else B.serial
        with B.serial(0, rounds) as rnd:
            first_tile = rnd * per_round * groups
            for i in range(n_m * per_round * 4):
                self.store(acc, i, f32(0))
            whole = tiles_m % (groups * per_round) == 0  # every tile of every round is a tile of the matmul

            def tile_of(t):
                return first_tile + group + t * groups

            with loop(0, steps) as s:
                c0 = slice_ * per_slice + s * ahead
                for c_ in range(ahead):  # loads first: every word of the step in flight at once
                    c = tirx.min(c0 + c_, chunks - 1)  # past K: a valid chunk, its mma skipped
                    x_granule(xb, 8 * c_, column, c * MMA_CHUNK + tig * 8)
                    for m_i in range(n_m):
                        for t in range(per_round):
                            tile = tirx.min(tile_of(t), tiles_m - 1)
                            for i in range(2):
                                row = tirx.min(lo + tile * 16 + quad + 8 * i, hi - 1)
                                B.buffer_store(wq, words[m_i].vload([layer, row, (c * 4 + tig) * 4], "uint32x4"),
                                               [tirx.Ramp(i32(w_at(c_, m_i, t, i, 0)), i32(1), 4)])
                for c_ in range(ahead):
                    in_slice = (s * ahead + c_ < per_slice) & (c0 + c_ < chunks)  # warp-uniform
                    with _nothing() if exact else self.when(in_slice):
                        for j in range(4):
                            self.store(bq, 0, tirx.reinterpret("uint32", xb[8 * c_ + 2 * j]))
                            self.store(bq, 1, tirx.reinterpret("uint32", xb[8 * c_ + 2 * j + 1]))
                            for m_i in range(n_m):
                                for t in range(per_round):
                                    with _nothing() if whole else self.when(tile_of(t) < tiles_m):  # warp-uniform
                                        for n_, (i, odd) in enumerate(((0, False), (1, False), (0, True), (1, True))):
                                            self.store(a, n_, value(c_, m_i, t, i, j, odd))
                                        d = [acc[(m_i * per_round + t) * 4 + r] for r in range(4)]
                                        B.evaluate(T.ptx["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"](
                                            *d, *(a[r] for r in range(4)), bq[0], bq[1], *d))
            self._mma_results(op, unit, lambda i: acc[i], per_round, split, rows_max, lo, hi, env, slots,
                              input_floats, env_end, "float_mma", first_tile=first_tile)
