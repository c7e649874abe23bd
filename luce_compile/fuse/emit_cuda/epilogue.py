"""Row-local ops on a tile in shared memory, after a matvec's matmuls or in a row stage: element-wise ops
(scale, softcap, add, GLU), per-head RMS norms, RoPE."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.emit_cuda.core import F32, f32
from luce_compile.graph.ir import Op, OpKind


class EpilogueMixin:
    def epilogue(self, op: P.Opcode, ops: tuple[Op, ...], slots, env, lo, n, rows_max: int, n_rows: int,
                 batch_row) -> None:
        """`ops` on features [lo, lo+n) of `n_rows` tile rows; tile row i is batch row batch_row(i). Every op is one
        loop over (row, feature): no copy of the code per sequence."""
        for e in ops:
            if e.kind == OpKind.RESHAPE:
                continue
            out = slots[e.outputs[0]]

            def load(name: str, i, r, name_slot=slots):
                if name in name_slot:
                    return self.smem[env(name_slot[name], i, r)]
                return self.arena_at(op, name, batch_row(i), lo + r)

            if e.kind == OpKind.RMS_NORM:
                self.head_norm(op, e, slots, env, out, n, n_rows, load)
            elif e.kind == OpKind.ROPE:
                self.rope(op, e, env, out, n, n_rows, batch_row, lo, load)
            else:
                self._each(n_rows * rows_max, lambda idx, e=e, out=out: self._elementwise(
                    op, e, env, out, idx // rows_max, idx % rows_max, n, load))
            self.sync()

    def _elementwise(self, op, e: Op, env, out: int, i, r, n, load) -> None:
        with self.when(r < n):
            x = load(e.inputs[0], i, r)
            match e.kind:
                case OpKind.SCALE:
                    y = x * f32(e.attrs["scale"])
                case OpKind.SOFTCAP:
                    cap = f32(e.attrs["cap"])
                    y = cap * tirx.tanh(x / cap)
                case OpKind.ADD:
                    y = x + load(e.inputs[1], i, r)
                case OpKind.GLU:
                    if e.attrs["activation"] == "silu":
                        act = x / (f32(1) + tirx.exp(-x))
                    else:  # gelu, tanh form (ggml_gelu)
                        act = f32(0.5) * x * (f32(1) + tirx.tanh(f32(math.sqrt(2 / math.pi)) *
                                                                  (x + f32(0.044715) * x * x * x)))
                    y = act * load(e.inputs[1], i, r)
                case _:
                    raise UnsupportedError(f"fuse: no megakernel epilogue for {e.kind}")
            self.store(self.smem, env(out, i, r), y)

    def head_norm(self, op, e: Op, slots, env, out: int, n, n_rows: int, load) -> None:
        """RMS norm over each head (4-D input) or over the whole row (3-D: row stages), one warp per (row, head)."""
        d = int(self.p.graph.weights[e.weights["weight"]].shape[0])
        eps = f32(e.attrs["eps"])
        heads = n // d
        with B.serial(0, (n_rows * max(1, self._cur_rows_max // d) + self.warps - 1) // self.warps) as it:
            pair = it * self.warps + self.warp
            i, h = pair // tirx.max(heads, 1), pair % tirx.max(heads, 1)
            def each_feature(body) -> None:  # the warp's lanes over the head's features: body(feature, x)
                with B.serial(0, -(-d // 32)) as dd:
                    c = dd * 32 + self.lane
                    with self.when(c < d):
                        body(c, load(e.inputs[0], i, h * d + c))

            with self.when(pair < n_rows * heads):
                part = self.local()
                self.store(part, 0, f32(0))
                each_feature(lambda c, v: self.store(part, 0, part[0] + v * v))
                scale = self.local()
                self.store(scale, 0, tirx.rsqrt(ix.warp_reduce(part[0], "sum", self.lane) / f32(d) + eps))
                each_feature(lambda c, v: self.store(self.smem, env(out, i, h * d + c),
                                                     v * scale[0] * self.vector(op, e.weights["weight"], c)))

    def rope(self, op, e: Op, env, out: int, n, n_rows: int, batch_row, lo, load) -> None:
        a = e.attrs
        d = int(self.values[e.inputs[0]].shape[-1])
        dim, half = a["dim"], a["dim"] // 2
        rows_max = self._cur_rows_max

        def body(idx):
            i, r = idx // rows_max, idx % rows_max
            pos = self.rope_position(batch_row(i)).astype(F32)
            with self.when(r < n):
                c = (lo + r) % d  # the feature within its head (tiles start on a head)
                x = load(e.inputs[0], i, r)
                if a["layout"] == "norm":
                    p_i, first = c // 2, c % 2 == 0
                    partner = tirx.if_then_else(first, r + 1, r - 1)
                else:
                    p_i, first = c % half, c < half
                    partner = tirx.if_then_else(first, r + half, r - half)
                inv = f32(a["freq_scale"]) * tirx.pow(f32(a["base"]), f32(-2.0 / dim) * p_i.astype(F32))
                if "freq_factors" in e.weights:  # clamped: features past `dim` are not rotated
                    inv = inv / self.vector(op, e.weights["freq_factors"], tirx.min(p_i, half - 1))
                theta = pos * inv
                y = load(e.inputs[0], i, tirx.if_then_else(c < dim, partner, r))
                rot = tirx.if_then_else(first, x * tirx.cos(theta) - y * tirx.sin(theta),
                                        y * tirx.sin(theta) + x * tirx.cos(theta))
                self.store(self.smem, env(out, i, r), tirx.if_then_else(c < dim, rot, x))

        self._each(n_rows * rows_max, body)
