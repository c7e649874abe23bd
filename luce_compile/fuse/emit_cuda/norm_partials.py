"""norm_partials: the tasks that write an RMS norm's input leave each NORM_CHUNK (32) features' sum of squares per
row in the arena (norm_sums), and the norm's matvec tiles sum those for 1/rms (rstd_from_partials) instead of
squaring the whole input: 128 floats a row of 4,096 instead of two passes over it in every tile.

The order of a row's sum is fixed by the chunk grid alone: a warp's butterfly over a chunk's 32 values (lane j:
feature 32c + j), then lane l of the reading warp adds chunks l, l + 32, ... in turn and a butterfly sums the lanes.
Neither the producer's tiling nor the batch size enters it, so a sequence gets the same 1/rms in a batch as alone.
It is a different float32 order than the per-tile reduction without the option (a thread's granules, then the
block's warps): the sum of squares moves by a few float32 ulps, as it would under any other reduction tree."""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script.builder import ir as B

from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.emit_cuda.core import f32
from luce_compile.fuse.taskgraph import NORM_CHUNK


class NormPartialsMixin:
    def norm_partial(self, op: P.Opcode, name: str) -> str | None:
        """The arena value of `name`'s chunk sums where this opcode writes or reads them (norm_partials), else None."""
        part = self.p.tg.norm_partials.get(name)
        return part if part is not None and part in op.inputs + op.outputs else None

    def norm_sums(self, op: P.Opcode, name: str, value, lo, n, rows_max: int, n_rows: int, batch_row) -> None:
        """After a task wrote features [lo, lo + n) of `name` (n_rows rows, row i being batch row batch_row(i)):
        each whole chunk's sum of squares, a warp per (row, chunk), value(i, r) giving tile row i's feature lo + r
        as it was written. The tiler puts lo and n on whole chunks (taskgraph.partial_align)."""
        part = self.norm_partial(op, name)
        if part is None:
            return
        chunks = -(-rows_max // NORM_CHUNK)
        per_row = self.p.width(part)
        with B.serial(0, -(-(n_rows * chunks) // self.warps)) as it:
            pair = it * self.warps + self.warp
            i, c = pair // chunks, pair % chunks
            with self.when((pair < n_rows * chunks) & (c * NORM_CHUNK < n)):  # the same in every lane of the warp
                v = self.local()
                self.store(v, 0, value(i, c * NORM_CHUNK + self.lane))
                total = self.local()  # every lane shuffles: the reduction must not sink into the lane-0 branch
                self.store(total, 0, ix.warp_reduce(v[0] * v[0], "sum", self.lane))
                with self.when(self.lane == 0):
                    self.store(self.arena, self.col(op.slot(part)) + batch_row(i) * per_row + lo // NORM_CHUNK + c,
                               total[0])

    def rstd_from_partials(self, op: P.Opcode, st, k_in: int, rstd_at: int) -> None:
        """Every sequence's 1/rms of the prologue norm from its chunk sums, a warp a sequence, into shared memory at
        rstd_at + b; ends on a barrier."""
        part = self.norm_partial(op, st.input)
        n_parts = k_in // NORM_CHUNK
        eps = f32(st.prologue.attrs["eps"])
        with B.serial(0, -(-self.nb // self.warps)) as it:
            b = it * self.warps + self.warp
            with self.when(b < self.nb):  # the same in every lane of the warp
                s = self.local()
                self.store(s, 0, f32(0))
                for j in range(-(-n_parts // 32)):  # unrolled: every load of the lane in flight at once
                    c = j * 32 + self.lane
                    self.store(s, 0, s[0] + tirx.if_then_else(
                        c < n_parts, self.arena[self.col(op.slot(part)) + b * n_parts + tirx.min(c, n_parts - 1)],
                        f32(0)))
                total = self.local()
                self.store(total, 0, ix.warp_reduce(s[0], "sum", self.lane))
                with self.when(self.lane == 0):
                    self.store(self.smem, rstd_at + b, tirx.rsqrt(total[0] / f32(k_in) + eps))
        self.sync()
