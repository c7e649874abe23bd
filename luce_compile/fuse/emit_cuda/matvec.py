"""Matvec tasks: the frame every arithmetic shares. The prologue norm's 1/rms, the input staged in shared memory
(or quantized to 8 bits: q8.py), a unit's matmuls into the tile's shared memory by one of four bodies (float32
lanes: float_lanes.py, 8-bit lanes with dp4a: q8.py, integer tensor cores: q8_mma.py, tf32 tensor cores:
float_mma.py), the epilogue (epilogue.py), then the tile's writes: the arena, the KV pages, the LM head's argmax
partials."""

from __future__ import annotations

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.emit_cuda.core import F32, _nothing, f32
from luce_compile.fuse.emit_cuda.q8 import Q8_BLOCK
from luce_compile.graph.ir import OpKind
from luce_compile.lower.quant_layout import as_ggml_type


def slice_passes(units: int, split: int, interleave: bool) -> int:
    """Passes of 32 lanes a K slice takes over `units` lane units split `split` ways (see slice_unit)."""
    if interleave:
        return -(-units // (split * 32))
    per_slice = -(-units // split)
    return -(-per_slice // 32)


def k_split(units: int, warps: int, rows_max: int, row_slots: int, min_units: int, interleave: bool,
            fewest_rounds: bool = False) -> int:
    """How many K slices a lane matvec's warps take (a power of two up to `warps`): the most that keep
    max(32, min_units) lane units a slice each (the rule measured so far); with fewest_rounds, of the splits that
    keep 32 units a slice, the one whose warps take the fewest memory rounds, steps x passes (each warp takes
    min(its group's rows, row_slots) rows a step), the rule's own on a tie. The 7B's K = 18,944 down projection (592
    units, 32 rows a tile, 16 row slots): 16 slices take 2 steps of 2 passes, the second pass with 80 of 512 lanes
    busy; 8 slices 1 step of 3 passes."""
    split = 1
    while split < warps and units // (2 * split) >= max(32, min_units):
        split *= 2
    if not fewest_rounds:
        return split

    def rounds(s: int) -> int:
        groups = warps // s
        rows = max(1, min(-(-rows_max // groups), row_slots))
        return -(-rows_max // (groups * rows)) * slice_passes(units, s, interleave)

    candidates = [s for s in (1 << i for i in range(warps.bit_length())) if s <= warps and units // s >= 32]
    best = min((rounds(s) for s in candidates), default=rounds(split))
    return split if rounds(split) == best else max(s for s in candidates if rounds(s) == best)


def slice_unit(units: int, split: int, interleave: bool, slice_, gi, lane):
    """The lane unit (granule or 32-value block) a lane of K slice `slice_` takes in pass gi, and the end its
    slice must stay under. Interleaved, pass gi of the slices reads units [gi·split·32, (gi + 1)·split·32) as one
    run; else each slice has a contiguous range of ⌈units/split⌉ units. Works on ints and TIR expressions alike."""
    if interleave:
        return (gi * split + slice_) * 32 + lane, units
    per_slice = -(-units // split)
    end = (slice_ + 1) * per_slice
    return slice_ * per_slice + gi * 32 + lane, (min(end, units) if isinstance(end, int) else tirx.min(end, units))


class MatvecMixin:
    def matvec(self, op: P.Opcode, st) -> None:
        nb = self.nb
        k_in = self.p.width(st.input)
        granules = k_in // 8
        if k_in % 8:
            raise UnsupportedError(f"fuse: a matvec input of {k_in} features is not a multiple of 8")
        env_need = max(self._env_floats(st, u, rows) for u, rows in enumerate(op.max_rows))
        staged = nb * k_in + env_need + nb <= self.shared_floats
        if env_need + nb > self.shared_floats:
            raise UnsupportedError(f"fuse: a matvec tile of stage {op.stage} needs {env_need} floats of shared "
                                   "memory; build with --no-megakernel")
        rstd_at = self.shared_floats - nb  # per-sequence 1/rms of the prologue norm
        x_name = st.input
        norm_w = st.prologue.weights["weight"] if st.prologue is not None else None

        def rstd_of(b, total) -> None:  # thread 0 keeps sequence b's 1/rms
            with self.when(self.tx == 0):
                eps = f32(st.prologue.attrs["eps"])
                self.store(self.smem, rstd_at + b, tirx.rsqrt(total / f32(k_in) + eps))

        def xval(b: int, k) -> tirx.Expr:
            v = self.arena_at(op, x_name, b, k)
            if st.prologue is not None:
                v = v * self.smem[rstd_at + b] * self.vector(op, norm_w, k)
            return v

        from_partials = st.prologue is not None and self.norm_partial(op, x_name) is not None

        def rstd_all(parts: tirx.Buffer) -> None:  # every sequence's 1/rms from its thread sums (one reduction)
            if from_partials:  # or from the writers' chunk sums (norm_partials: `parts` holds no squares)
                self.rstd_from_partials(op, st, k_in, rstd_at)
                return
            sums = self.cta_many([parts[b] for b in range(nb)], "sum")
            for b in range(nb):
                rstd_of(b, sums[b])
            self.sync()

        def rstd_from_arena() -> None:  # each sequence's 1/rms from its input in the arena (not staged)
            if from_partials:
                self.rstd_from_partials(op, st, k_in, rstd_at)
                return
            rstd_all(self._granule_squares(granules, lambda b, k: self.arena_at(op, x_name, b, k)))

        def x_at(b, k) -> tirx.Expr:  # transposed by granule: xs[(b*8 + j) * G + g] = x[b, 8g + j]
            return (b * 8 + k % 8) * granules + k // 8

        order = self._q8_order(st, k_in, op.stage)
        q8_words = nb * self._q8_words(k_in)
        if order is not None:
            if q8_words + env_need + nb > self.shared_floats:
                raise UnsupportedError(f"fuse: stage {op.stage}'s 8-bit input and tile need {q8_words + env_need} "
                                       "floats of shared memory; build with a larger shared_kib or without "
                                       "q8_activations")
            if st.prologue is not None:  # the norm's 1/rms per sequence, in the float path's order
                rstd_from_arena()
            self.quantize_q8(order, k_in,
                             # the slot's offset is a multiple of P.ALIGN (4 floats); said so, TVM emits one 16-byte
                             # load, not a gather of four
                             lambda b: self.col(op.slot(x_name)) // P.ALIGN * P.ALIGN + b * k_in,
                             None if st.prologue is None else (lambda b: self.smem[rstd_at + b],
                                                               self.weight(op, norm_w)))
            self.sync()
            self.phase(3)
            for u, unit in enumerate(st.units):
                with self.when(self.col(P.UNIT) == u):
                    self.matvec_unit(op, st, u, unit, k_in, True, xval, q8_words, q8=order)
            return
        if self._float_mma(st, k_in):
            self._float_mma_matvec(op, st, k_in, env_need, rstd_at, rstd_all, rstd_from_arena, xval)
            return
        if st.merged >= 0 and not staged:
            raise UnsupportedError(f"fuse: stage {op.stage} merges attention partials but its input does not "
                                   "fit shared memory; plan it without fold_merge")
        if staged:
            self._stage_input(op, st, k_in, x_at, rstd_at, rstd_all)
        elif st.prologue is not None:  # the norm's scale per sequence; the body reads the arena (xval)
            rstd_from_arena()
        env_base = nb * k_in if staged else 0
        self.phase(3)
        for u, unit in enumerate(st.units):
            with self.when(self.col(P.UNIT) == u):
                self.matvec_unit(op, st, u, unit, k_in, staged, xval, env_base)

    def _stage_input(self, op: P.Opcode, st, k_in: int, at, rstd_at: int, rstd_all, finish=None) -> None:
        """A matvec stage's input in shared memory, sequence b's feature k at word at(b, k): the attention's split
        partials merged (Stage.merged), or the arena read once, raw, then the prologue norm's scale in place;
        `finish` (float_mma's tf32 rounding) on every value last. Ends on a barrier."""
        nb, granules = self.nb, k_in // 8

        def done(v: tirx.Expr) -> tirx.Expr:
            return finish(v) if finish is not None else v

        if st.merged >= 0:  # the attention's split partials merged here, into shared memory (no merge tasks)
            att = self.p.tg.stages[st.merged]
            dv = k_in // att.attention.attrs["n_head"]
            partials = self.p.partials[self.p.opcodes[self.p.stage_opcode[st.merged]].stage]

            def merged(idx) -> None:
                b, g = idx // granules, idx % granules
                for j in range(8):
                    k = g * 8 + j
                    self.store(self.smem, at(b, k), done(self.merged_value(att, partials, b, k // dv, k % dv)))
            self._each(nb * granules, merged)
            self.sync()
            return

        # a thread takes a granule (8 features): in the transposed layout the stores of a warp's lanes land in
        # consecutive words, where a feature a thread put 8 lanes on one bank (ncu: half the kernel's shared
        # wavefronts were conflicts)
        def keep(b, k):
            self.store(self.smem, at(b, k), self.arena_at(op, st.input, b, k))
            return self.smem[at(b, k)]  # the stored value: the arena is read once

        square = st.prologue is not None and self.norm_partial(op, st.input) is None  # else rstd_all reads sums
        parts = self._granule_squares(granules, keep, square=square)
        if st.prologue is not None:
            rstd_all(parts)
        else:
            self.sync()
        if st.prologue is None and finish is None:
            return
        norm_w = st.prologue.weights["weight"] if st.prologue is not None else None

        def scale(idx) -> None:  # the norm's scale in xval's order, then `finish`, in place
            b, g = idx // granules, idx % granules
            for j in range(8):
                v = self.smem[at(b, g * 8 + j)]
                if norm_w is not None:
                    v = v * self.smem[rstd_at + b] * self.vector(op, norm_w, g * 8 + j)
                self.store(self.smem, at(b, g * 8 + j), done(v))
        self._each(nb * granules, scale)
        self.sync()

    def _granule_squares(self, granules: int, value, square: bool = True) -> tirx.Buffer:
        """A thread's granules of every sequence's row (8 features each, in turn), value(b, k) giving sequence b's
        feature k; returns the thread's sum of their squares per sequence (`square`). The sequences are the inner
        loop, so all their loads are in flight at once (a loop over sequences outside took a round trip and a
        block reduction each: 7-14 µs at batch 8 on the H200); each sequence's sum keeps one order, so a batch
        gives each sequence the 1/rms it gets alone, to the bit."""
        part = self.local(F32, self.nb)
        for b in range(self.nb):
            self.store(part, b, f32(0))
        with B.serial(0, -(-granules // self.threads)) as it:
            g = it * self.threads + self.tx
            with self.when(g < granules):
                for b in range(self.nb):
                    for j in range(8):
                        v = self.local()
                        self.store(v, 0, value(b, g * 8 + j))  # one load, squared
                        if square:
                            self.store(part, b, part[b] + v[0] * v[0])
        return part

    def _env_slots(self, st, u: int) -> dict[str, int]:
        """Shared-memory slots of a unit's values (a reshape shares its input's slot)."""
        unit = st.units[u]
        slots: dict[str, int] = {}
        for m in unit.matmuls:
            slots[m.outputs[0]] = len(set(slots.values()))
        for e in unit.epilogue:
            if e.kind == OpKind.RESHAPE:
                slots[e.outputs[0]] = slots[e.inputs[0]]
            else:
                slots[e.outputs[0]] = len(set(slots.values()))
        return slots

    def _env_floats(self, st, u: int, rows: int) -> int:
        return len(set(self._env_slots(st, u).values())) * self.nb * rows

    def matvec_unit(self, op: P.Opcode, st, u: int, unit, k_in: int, staged: bool, xval, env_base: int,
                    q8: str | None = None, mma_x=None) -> None:
        nb, rows_max = self.nb, op.max_rows[u]
        self._cur_rows_max = rows_max
        lo, hi = self.col(P.LO), self.col(P.HI)
        slots = self._env_slots(st, u)

        def env(slot: int, b, r) -> tirx.Expr:
            return env_base + (slot * nb + b) * rows_max + r

        env_end = env_base + self._env_floats(st, u, rows_max)
        if mma_x is not None:
            self._float_mma_matmuls(op, unit, k_in, rows_max, lo, hi, env, slots, env_end, mma_x, env_base)
        elif q8 is not None and self.q8_mma:
            self._mma_matmuls(op, unit, k_in, rows_max, lo, hi, env, slots, env_end)
        else:
            self._lane_matmuls(op, unit, k_in, rows_max, lo, hi, env, slots, staged, xval, q8)
        self.sync()
        self.phase(4)
        self.epilogue(op, unit.epilogue, slots, env, lo, hi - lo, rows_max, nb, lambda i: i)  # ends on a barrier
        self.phase(5)
        # the values other stages read → the arena; keys and values → their pages; the LM head → argmax partials
        n = hi - lo
        for name, slot in slots.items():
            if name in op.outputs:
                w = self.p.width(name)
                self._each(nb * rows_max, lambda idx, slot=slot, name=name, w=w: self._write_out(
                    op, name, slot, env, idx, n, rows_max, lo, w))
                self.norm_sums(op, name, lambda i, r, slot=slot: self.smem[env(slot, i, tirx.min(r, rows_max - 1))],
                               lo, n, rows_max, nb, lambda i: i)
            if name in self.p.tg.kv_slots:
                which = 0 if self.p.tg.kv_slots[name][1] == "k" else 1
                self._each(nb * rows_max, lambda idx, slot=slot, which=which: self._append_kv(
                    slot, env, idx, n, rows_max, lo, which))
        if any(m.kind == OpKind.LM_HEAD for m in unit.matmuls):
            last = unit.epilogue[-1].outputs[0] if unit.epilogue else unit.matmuls[0].outputs[0]
            self.lm_partial(slots[last], env, n, rows_max, lo)

    def _lane_matmuls(self, op, unit, k_in: int, rows_max: int, lo, hi, env, slots, staged: bool, xval,
                      q8: str | None) -> None:
        """The tile's matmuls into shared memory (env), a lane per granule or 32-value block of a row."""
        nb, granules = self.nb, k_in // 8
        n_m = len(unit.matmuls)
        # The block's warps split K into `split` slices (enough granules per slice to keep 32 lanes busy) and the
        # rows into self.warps / split groups; a warp accumulates `rows` rows at once (`accumulators` sums a lane):
        # every weight load of a pass is independent of the others, so all of them are in flight together
        # With 8-bit activations and K of 1,024 or more, a lane takes a whole 32-value block of a row (one 16-byte
        # load of Q4 quants) instead of an 8-value granule (4 bytes): 4x the bytes in flight per load
        by_block = self.q8_by_block and q8 is not None and k_in // Q8_BLOCK >= 32
        units = k_in // Q8_BLOCK if by_block else granules  # what a lane takes per pass
        split = k_split(units, self.warps, rows_max, self.accumulators // (n_m * nb), self.k_slice_units,
                        self.interleave_slices, self.fewest_rounds)
        groups = self.warps // split
        rows = max(1, min(-(-rows_max // groups), self.accumulators // (n_m * nb)))
        steps = -(-rows_max // (groups * rows))
        passes = slice_passes(units, split, self.interleave_slices)
        slice_, group = self.warp % split, self.warp // split
        acc = self.local(F32, n_m * rows * nb)
        xv = self.local(F32, 8 * nb)
        wv = self.local(F32, 8)
        with B.serial(0, steps) as s:
            r0 = lo + (s * groups + group) * rows
            for a in range(n_m * rows * nb):
                self.store(acc, a, f32(0))
            loop = B.unroll if passes <= self.unroll_passes else B.serial
            with loop(0, passes) as gi:
                g, g_end = slice_unit(units, split, self.interleave_slices, slice_, gi, self.lane)
                if self.prefetch_ahead and by_block:
                    # the next pass's blocks of these rows, or the next step's rows at the first pass: asked into L2
                    # now, so memory stays busy through this pass's arithmetic, the reduction and the barriers
                    last = gi + 1 >= passes
                    g_next = tirx.Select(last, slice_unit(units, split, self.interleave_slices, slice_, 0,
                                                          self.lane)[0],
                                         slice_unit(units, split, self.interleave_slices, slice_, gi + 1,
                                                    self.lane)[0])
                    r_next = tirx.Select(last, r0 + groups * rows, r0)
                    with self.when(tirx.Not(last) | (s + 1 < steps)):
                        self._prefetch_blocks(op, unit, rows, r_next, hi, tirx.min(g_next, units - 1), units)
                exact = units % (split * 32) == 0  # every slice whole passes: no lane past its slice's end
                with _nothing() if exact else self.when(g < g_end):
                    if by_block:
                        self._q8_block_pass(op, unit, rows, r0, hi, g, granules, k_in, acc)
                    elif q8 is not None:
                        self._q8_pass(op, unit, rows, r0, hi, g, granules, k_in, acc)
                    else:
                        self._float_pass(op, unit, rows, r0, hi, g, granules, staged, xval, acc, xv, wv)
            n_acc = n_m * rows * nb
            for a in range(n_acc):
                self.store(acc, a, ix.warp_reduce(acc[a], "sum", self.lane))
            if split > 1:  # the slices' sums meet in shared memory
                with self.when(self.lane == 0):
                    for a in range(n_acc):
                        self.store(self.part, (group * n_acc + a) * split + slice_, acc[a])
                self.sync()
            for m_i, m in enumerate(unit.matmuls):
                for r in range(rows):
                    with self.when((self.lane == 0) & (slice_ == 0) & (r0 + r < hi)):
                        for b in range(nb):
                            a = (m_i * rows + r) * nb + b
                            y = acc[a]
                            for k in range(1, split):
                                y = y + self.part[(group * n_acc + a) * split + k]
                            if "bias" in m.weights:
                                y = y + self.vector(op, m.weights["bias"], r0 + r)
                            self.store(self.smem, env(slots[m.outputs[0]], b, r0 + r - lo), y)
            if split > 1:
                self.sync()  # the next step's partials overwrite these

    def _prefetch_blocks(self, op, unit, rows: int, r0, hi, g, units: int) -> None:
        """L2 prefetches of lane unit g of `rows` rows from r0 (clamped to the tile, as the loads are), in every weight
        plane of 4 bytes a unit or more (quants, high bits; the scales' lines serve many lanes' units)."""
        layer = self.col(P.LAYER)
        for m in unit.matmuls:
            for buf in self.weight(op, m.weights["weight"]).values():
                cols = int(buf.shape[2])
                if cols * DataType(buf.dtype).bits < 32 * units:
                    continue
                for r in range(rows):
                    ix.prefetch_l2(T.address_of(buf[layer, tirx.min(r0 + r, hi - 1), g * (cols // units)]))

    def _mma_results(self, op, unit, acc, per_warp: int, split: int, rows_max: int, lo, hi, env, slots,
                     input_floats: int, env_end: int, option: str, first_tile=0) -> None:
        """A tensor-core tile's results into shared memory (env), with the bias where there is one. acc(i) is the
        lane's result i = ((matmul · per_warp + tile) · 2 + r) · 2 + c: row quad + 8r, sequence 2·tig + c of its
        16 x 8 fragment (the C layout of mma.m16n8k*). Where `split` warps took slices of K, their sums meet in
        shared memory, added in slice order (the input's `input_floats` if they fit there, else after env_end).
        The warp's tiles are first_tile + group + t·groups."""
        nb, n_m = self.nb, len(unit.matmuls)
        groups = self.warps // split
        slice_, group = self.warp % split, self.warp // split
        quad, tig = self.lane // 4, self.lane % 4
        n = hi - lo

        def each_result(body) -> None:  # body(m_i, m, acc index, tile row, sequence) for the lane's valid results
            for m_i, m in enumerate(unit.matmuls):
                for t in range(per_warp):
                    for r in range(2):
                        for c in range(2):
                            rr, b = (first_tile + group + t * groups) * 16 + quad + 8 * r, 2 * tig + c
                            with self.when((rr < n) & (b < nb)):
                                body(m_i, m, ((m_i * per_warp + t) * 2 + r) * 2 + c, rr, b)

        def with_bias(m, rr, y) -> tirx.Expr:
            return y + self.vector(op, m.weights["bias"], lo + rr) if "bias" in m.weights else y

        if split == 1:
            each_result(lambda m_i, m, i, rr, b: self.store(self.smem, env(slots[m.outputs[0]], b, rr),
                                                             with_bias(m, rr, acc(i))))
            return
        # the slices' sums meet in shared memory, added in slice order: where the input was if it fits there
        # (every warp is past its loop after the barrier), else after the tile's values
        need = split * n_m * nb * rows_max
        part_at = 0 if need <= input_floats else env_end
        if part_at + need > self.shared_floats - nb:
            raise UnsupportedError(f"fuse: the tensor-core matvec's {split} K slices need {need} floats of shared "
                                   f"memory; build with a larger shared_kib or without {option}")

        def part(s, m_i, b, rr):
            return part_at + ((s * n_m + m_i) * nb + b) * rows_max + rr

        self.sync()
        each_result(lambda m_i, m, i, rr, b: self.store(self.smem, part(slice_, m_i, b, rr), acc(i)))
        self.sync()
        for m_i, m in enumerate(unit.matmuls):
            def total(idx, m_i=m_i, m=m) -> None:
                b, rr = idx // rows_max, idx % rows_max
                with self.when(rr < n):
                    y = self.smem[part(0, m_i, b, rr)]
                    for s_ in range(1, split):
                        y = y + self.smem[part(s_, m_i, b, rr)]
                    self.store(self.smem, env(slots[m.outputs[0]], b, rr), with_bias(m, rr, y))
            self._each(nb * rows_max, total)

    def _word_view(self, buf: tirx.Buffer, word: str = "uint32") -> tirx.Buffer:
        """A weight plane (layers, n_out, n_in) of 8-, 16- or 32-bit values as 32-bit words (layers, n_out, words)
        of dtype `word` (int32 for the signed Q8_0 quants that dp4a takes)."""
        key = (id(buf), word)
        if key not in self.word_views:
            g, n_out, n_in = (int(d) for d in buf.shape)
            words = n_in * DataType(buf.dtype).bits // 32
            self.word_views[key] = B.decl_buffer((g, n_out, words), word, data=buf.data)
        return self.word_views[key]

    def _weight_types(self, unit) -> list[str]:
        return [as_ggml_type(self.p.graph.weights[m.weights["weight"]].ggml_type).name for m in unit.matmuls]

    def _write_out(self, op, name, slot, env, idx, n, rows_max, lo, w) -> None:
        b, r = idx // rows_max, idx % rows_max
        with self.when(r < n):
            self.store(self.arena, self.col(op.slot(name)) + b * w + lo + r, self.smem[env(slot, b, r)])

    def _append_kv(self, slot, env, idx, n, rows_max, lo, which) -> None:
        d = self.p.kv["head_dim"]
        b, r = idx // rows_max, idx % rows_max
        with self.when(r < n):
            pos = self.lengths[b]
            page = self.page_table[b, pos // self.p.page_size]
            f = lo + r
            self.store(self.pages, self.kv_index(self.col(P.KV_LAYER), page, which, f // d, pos % self.p.page_size,
                                                 f % d), self.smem[env(slot, b, r)].astype(self.kv_dtype))

    def lm_partial(self, slot: int, env, n, rows_max: int, lo) -> None:
        """Per sequence: the tile's best logit and its index (the lowest on ties), among the allowed tokens when
        the step is masked."""
        with B.serial(0, self.nb) as b:
            def allowed(r):  # `||` in CUDA: an unmasked step reads no mask word
                t = lo + r
                return (self.masked == 0) | (((self.allowed[b, t // 32] >> (t % 32)) & 1) != 0)

            top, idx = self.block_argmax(rows_max, n, lambda r: self.smem[env(slot, b, r)], lambda r: lo + r,
                                         allowed)
            with self.when(self.tx == 0):
                self.store(self.amax_val, [b, self.col(P.TILE)], top[0])
                self.store(self.amax_idx, [b, self.col(P.TILE)], idx[0])
            self.sync()
