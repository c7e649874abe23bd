"""8-bit activations on integer tensor cores (q8_mma): mma.m16n8k32 s8 per 16 rows x a 32-value block x the
batch's 8 columns, each block's sums scaled as the dp4a body scales them (q8.py)."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.tirx.script.builder import ir as B

from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda.core import F32, _nothing, f32, i32
from luce_compile.fuse.emit_cuda.q8 import Q8_BLOCK

MMA_MIN_BLOCKS = 8  # q8_mma: the fewest 32-value blocks a warp's slice of K takes


class Q8MmaMixin:
    def _mma_split(self, k_in: int) -> int:
        """Warps that split a matvec's K into slices of at least MMA_MIN_BLOCKS 32-value blocks: a function of K
        alone, so every batch size sums a row's blocks in one order (batched equal to alone)."""
        blocks, split = k_in // Q8_BLOCK, 1
        while split < self.warps and blocks // (2 * split) >= MMA_MIN_BLOCKS:
            split *= 2
        return split

    def _quad_transpose(self, w: tirx.Buffer, at: list[int], tig) -> None:
        """w[at[0..3]] of the 4 lanes of a quad (tig = lane % 4) transposed: lane tig ends with the words at[tig]
        of lanes 0..3, in order. Two butterfly steps (lane xor 1, then xor 2), each swapping 2 words a lane with
        one shuffle per word; every lane of the warp must arrive."""
        for bit in (1, 2):
            odd = (tig & bit) != 0
            # pairs (j, j + bit), j & bit == 0: a lane with the bit clear keeps j and takes j + bit, one with it set
            # the other way round
            pairs = [(j, j + bit) for j in range(4) if j & bit == 0]
            got = self.local("uint32", 2)
            for n, (lo_, hi_) in enumerate(pairs):
                send = tirx.Select(odd, w[at[lo_]], w[at[hi_]])
                self.store(got, n, T.cuda._shfl_xor_sync(tirx.const(0xFFFFFFFF, "uint32"), send, bit, 32))
            for n, (lo_, hi_) in enumerate(pairs):
                self.store(w, at[lo_], tirx.Select(odd, got[n], w[at[lo_]]))
                self.store(w, at[hi_], tirx.Select(odd, w[at[hi_]], got[n]))

    def _mma_matmuls(self, op, unit, k_in: int, rows_max: int, lo, hi, env, slots, env_end: int) -> None:
        """The tile's matmuls into shared memory (env) with integer tensor cores: one mma.m16n8k32 (s8 x s8 ->
        s32) per 16 rows x one 32-value block x the batch's 8-bit inputs (its 8 columns; the columns past the batch
        repeat its last sequence, their results unused), then each of the 16 x 8 sums scaled as the dp4a body does
        (d_w·(d_x·Σ) [+ m_w·s_x], `_q8_accumulate`). The integer sums are llama.cpp's (Q4_0 as q − 8 per byte);
        dp4a took a lane 8 instructions per (row, block, sequence), one mma does 128 of them.

        Fragments (PTX ISA, mma.m16n8k32 .s8): lane = 4·quad + tig holds A rows quad and quad + 8, B column quad,
        C rows quad, quad + 8 x columns 2·tig, 2·tig + 1. A block's k order is free as long as A and B share it:
        lane tig takes granule tig of the block (the 4 quants of its word with h = 0, then h = 1), which is the
        word the Q4 planes keep per granule (low nibbles h = 0, high h = 1) and two words of Q8_0, and the words
        quantize_q8 writes per (sequence, h, granule).

        Loads: a warp takes 4 blocks of a row at a time, lane tig the whole block tig in 16-byte words (two for
        Q8_0), and a 4 x 4 transpose of words across the quad's lanes (`_quad_transpose`, 4 shuffles) gives each
        lane granule tig of the 4 blocks. Each lane loading its own granule word took 4-byte loads, half a sector
        each: the 1B body's step went 621 -> 1,115 µs at b=1 (the lane-per-block dp4a body reads 16 bytes)."""
        nb, n_m = self.nb, len(unit.matmuls)
        blocks, granules = k_in // Q8_BLOCK, k_in // 8
        split = self._mma_split(k_in)
        groups = self.warps // split
        per_slice = -(-blocks // (4 * split)) * 4  # whole 4-block loads a slice; the last ones may end early
        slice_, group = self.warp % split, self.warp // split
        tiles_m = -(-rows_max // 16)
        per_warp = -(-tiles_m // groups)  # 16-row tiles of each matmul a warp takes
        quad, tig = self.lane // 4, self.lane % 4
        layer = self.col(P.LAYER)
        types = self._weight_types(unit)
        acc = self.local(F32, n_m * per_warp * 4)
        for i in range(n_m * per_warp * 4):
            self.store(acc, i, f32(0))
        bq, a = self.local("uint32", 8), self.local("uint32", 16)  # per block of the 4: B's 2 words, A's 4
        wq, d = self.local("uint32", 8), self.local("uint32", 4)
        zero = self.local("uint32", 4)
        for i in range(4):
            self.store(zero, i, tirx.const(0, "uint32"))
        column = tirx.min(quad, nb - 1)  # the sequence whose 8-bit input this lane gives B
        mask, four = tirx.const(0x0F0F0F0F, "uint32"), tirx.const(4, "uint32")
        high, eights = tirx.const(0x80808080, "uint32"), tirx.const(0x08080808, "uint32")
        ragged = blocks % (4 * split) != 0  # some 4-block load runs past K: its blocks past K take no mma
        loop = B.unroll if per_slice <= 16 else B.serial
        with loop(0, per_slice // 4) as j:
            blk0 = slice_ * per_slice + 4 * j
            with _nothing() if not ragged else self.when(blk0 < blocks):  # warp-uniform
                for bb in range(4):
                    for h in range(2):
                        blk = tirx.min(blk0 + bb, blocks - 1) if ragged else blk0 + bb
                        self.store(bq, 2 * bb + h, tirx.reinterpret("uint32", self.smem_i[(column * 2 + h) * granules
                                                                                       + blk * 4 + tig]))
                own = tirx.min(blk0 + tig, blocks - 1) if ragged else blk0 + tig  # the block this lane loads
                for m_i, m in enumerate(unit.matmuls):
                    planes = self.weight(op, m.weights["weight"])
                    q8_0 = types[m_i] == "Q8_0"
                    words = self._word_view(planes["qs"])
                    for t in range(per_warp):
                        tile = group + t * groups
                        with _nothing() if tiles_m % groups == 0 else self.when(tile < tiles_m):  # warp-uniform
                            rows = [tirx.min(lo + tile * 16 + quad + 8 * i, hi - 1) for i in range(2)]
                            for i, row in enumerate(rows):  # a[4bb + 0/1]: h = 0 of rows quad, quad + 8; 2/3: h = 1
                                per_block = 8 if q8_0 else 4  # words of a block
                                for half in range(per_block // 4):
                                    B.buffer_store(wq, words.vload([layer, row, own * per_block + half * 4],
                                                                   "uint32x4"), [tirx.Ramp(i32(half * 4), i32(1), 4)])
                                if q8_0:  # words 2g + h: transpose each h's four words
                                    for h in range(2):
                                        self._quad_transpose(wq, [h, 2 + h, 4 + h, 6 + h], tig)
                                        for bb in range(4):
                                            self.store(a, 4 * bb + 2 * h + i, wq[2 * bb + h])
                                else:
                                    self._quad_transpose(wq, [0, 1, 2, 3], tig)
                                    for bb in range(4):
                                        for h, q in enumerate((wq[bb] & mask, (wq[bb] >> four) & mask)):
                                            if types[m_i] == "Q4_0":  # q − 8 per byte: no borrow crosses a byte
                                                q = ((q | high) - eights) ^ high
                                            self.store(a, 4 * bb + 2 * h + i, q)
                            for bb in range(4):
                                blk = blk0 + bb
                                with self.when(blk < blocks) if ragged else _nothing():  # warp-uniform
                                    B.evaluate(T.ptx["mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"](
                                        *(d[i] for i in range(4)), *(a[4 * bb + i] for i in range(4)),
                                        bq[2 * bb], bq[2 * bb + 1], *(zero[i] for i in range(4))))
                                    for r, row in enumerate(rows):
                                        dw, mw = self._q8_block_scales(planes, types[m_i], layer, row, blk)
                                        for c in range(2):
                                            self._q8_accumulate(acc, ((m_i * per_warp + t) * 2 + r) * 2 + c,
                                                                tirx.reinterpret("int32", d[2 * r + c]), dw, mw,
                                                                tirx.min(2 * tig + c, nb - 1), blk, k_in,
                                                                lanes_per_block=1)
        self._mma_results(op, unit, lambda i: acc[i], per_warp, split, rows_max, lo, hi, env, slots,
                          self.nb * self._q8_words(k_in), env_end, "q8_mma")
