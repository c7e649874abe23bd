"""Attention tasks: one (sequence, KV head, key chunk) a task, online softmax per warp over the keys, p·v,
the warps' partials combined in shared memory; split chunks merged by the last to finish (merge_in_last), by a
merge task, or by the O projection (Stage.merged, merged_value). Nothing here grows with the maximum context: the
loop over a chunk's keys runs as many times as the chunk has keys this step, shared memory holds a warp's 32 scores
a head, and a chunk that holds no keys this step is skipped before its wait (empty_chunk).

A row sees its sequence's keys up to its own slot, less those its `off_path` word marks (a token tree's other
branches, appended in the same step): a marked key weighs 0, as a key past the chunk does. A chunk may then hold
no visible key (a short last chunk of siblings): its partial is (lowest float, 0, 0), which every merge weighs 0."""

from __future__ import annotations

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.emit_cuda.attention_rows import AttentionRowsMixin, rows_layout
from luce_compile.fuse.emit_cuda.core import F32, f32, i32


class AttentionMixin(AttentionRowsMixin):
    def attention(self, op: P.Opcode, st) -> None:
        att = st.attention
        a = att.attrs
        q_name = att.inputs[0]
        h, hkv = a["n_head"], a["n_head_kv"]
        group, d = h // hkv, self.p.kv["head_dim"]
        per_lane = -(-d // 32)  # dimensions per lane in p·v (the last may be partial for heads under 32)
        n_splits = st.n_splits
        window = int(a.get("sliding_window") or 0)
        # shared: q (group, d) | p (warps, group, 32) | o (warps, group, d) | m, l (warps, group)
        q_at, p_at = 0, group * d
        o_at = p_at + self.warps * group * 32
        ml_at = o_at + self.warps * group * d
        if ml_at + 2 * self.warps * group > self.shared_floats:
            raise UnsupportedError("fuse: attention's partials for this head group do not fit shared memory")
        b, g, split = self.col(P.ROW), self.col(P.LO), self.col(P.SPLIT)
        partials = self.p.partials.get(op.stage)
        rows = rows_layout(d, group, DataType(self.kv_dtype).bits, self.attn_rows_slots) if self.attn_rows else None
        if rows is not None and self._rows_shared(rows, d)[2] > self.shared_floats:
            rows = None  # the rows body's scores do not fit this target's shared memory: the lane-per-key body
        with self.when(split >= 0):
            if rows is not None:
                self._attn_rows(op, att, q_name, b, g, split, d, window, rows, partials)
            else:
                self._attn_partial(op, att, q_name, b, g, split, group, d, per_lane, window,
                                   q_at, p_at, o_at, ml_at, partials)
            if st.merged_by_last:
                self._merge_if_last(op, att, b, g, group, d, n_splits, partials)
        if partials is not None and not st.merged_by_last:
            with self.when(split < 0):
                self._attn_merge(op, att, b, g, group, d, n_splits, partials)

    def _chunk_max(self, st, window: int) -> int:
        """The most keys one attention task of the stage reads (a static bound: the prefetch's)."""
        span = min(window, self.p.tg.max_context) if window else self.p.tg.max_context
        return self.p.tg.max_chunk_keys(span) if st.n_splits > 1 else span

    def _visible(self, window: int, b) -> tuple[tirx.Expr, tirx.Expr]:
        """Sequence b's first visible key this step and how many keys it sees (with this step's), from the block's
        copy of the lengths (seq_len)."""
        pos = self.seq_len[b]
        first = tirx.max(pos - (window - 1), 0) if window else i32(0)
        return first, pos + 1 - first

    def _chunk(self, st, window: int, b, split) -> tuple[tirx.Expr, tirx.Expr]:
        """The keys [lo, hi) of sequence b's chunk `split` this step (TaskGraph.chunk_keys, as the simulator), held
        in registers: the chunk's size divides by a count of waves known only at run time, and written inline it
        would be recomputed in every use (the unrolled p·v loop's 32 keys)."""
        first, span = self._visible(window, b)
        if st.n_splits == 1:
            return first, first + span
        chunk = self.p.tg.chunk_keys(span, tirx.max, tirx.min)
        bounds = self.local("int32", 2)
        self.store(bounds, 0, first + split * chunk)
        self.store(bounds, 1, tirx.min(first + span, bounds[0] + chunk))
        return bounds[0], bounds[1]

    def _active(self, st, b) -> tirx.Expr:
        """The chunks of sequence b that hold keys this step (the first ones; TaskGraph.active_chunks), in a
        register."""
        _, span = self._visible(int(st.attention.attrs.get("sliding_window") or 0), b)
        active = self.local("int32")
        self.store(active, 0, tirx.min(i32(st.n_splits), self.p.tg.active_chunks(span, tirx.max, tirx.min)))
        return active[0]

    def empty_chunk(self, op: P.Opcode) -> tirx.Expr:
        """Whether this task is a split attention chunk that holds no keys this step: the kernel's loop skips its
        wait and its body (the chunks a long maximum context adds cost short steps only their rows and counters).
        Nothing reads what it would write: a merge reads the active chunks' partials only, and the arrival count
        of merge_in_last has chunk 0 add for the empty ones (_merge_if_last)."""
        st = self.p.tg.stages[op.stage]
        if st.n_splits == 1:
            return tirx.const(False, "bool")
        split = self.col(P.SPLIT)
        return (split >= 0) & (split >= self._active(st, self.col(P.ROW)))

    def _attn_partial(self, op, att, q_name, b, g, split, group, d, per_lane, window,
                      q_at, p_at, o_at, ml_at, partials) -> None:
        """The lane-per-key body (attn_rows off): a lane's key row for q·k (16-byte words), a lane's dimensions for
        p·v (a 2-byte load a key and dimension), 32 keys a warp a step."""
        a = att.attrs
        ps, layer = self.p.page_size, self.col(P.KV_LAYER)
        kv_lo, kv_hi = self._chunk(self.p.tg.stages[op.stage], window, b, split)
        hd = a["n_head"] * d
        self._each(group * d, lambda idx: self.store(
            self.smem, q_at + idx, self.arena[self.col(op.slot(q_name)) + b * hd + g * group * d + idx]))
        self.sync()
        self.phase(3)
        m, lsum = self.local(F32, group), self.local(F32, group)
        o = self.local(F32, group * per_lane)
        s = self.local(F32, group)
        for hh in range(group):
            self.store(m, hh, tirx.min_value(F32))
            self.store(lsum, hh, f32(0))
            for c in range(per_lane):
                self.store(o, hh * per_lane + c, f32(0))
        # a wave: the block's warps' 32 keys each; as many as this chunk's keys take (a loop bound of the step, not
        # of the maximum context)
        per_wave = self.warps * 32
        waves = (tirx.max(kv_hi - kv_lo, 0) + (per_wave - 1)) // per_wave
        # a lane's key row in 16-byte loads (all in flight at once) where the head's rows are whole vectors: as
        # 32-bit words (TVM's CUDA codegen has no float16x8 type), each value taken out of its word
        bits = DataType(self.kv_dtype).bits
        per_word = 32 // bits
        vec = 4 if d % (4 * per_word) == 0 else 0
        krow, page = self.local("uint32", max(1, d // per_word)), self.local("int32")
        n_pages = 32 // ps + (2 if 32 % ps else 1)  # pages a warp's 32 consecutive keys can touch
        pages_of = self.local("int32", n_pages)
        words = B.decl_buffer((self.n_kv // per_word,), "uint32", data=self.pages.data) if vec else None

        def key_value(c):
            if not vec:
                return self.kv_at(layer, page[0], 0, g, slot, c).astype(F32)
            w = krow[c // per_word]
            if per_word == 1:
                return tirx.reinterpret(self.kv_dtype, w).astype(F32)
            part = (w >> tirx.const(bits * (c % per_word), "uint32")) & tirx.const((1 << bits) - 1, "uint32")
            return tirx.reinterpret(self.kv_dtype, part.astype(f"uint{bits}")).astype(F32)

        off_path = self.local("int32")  # a tree's verify row: the keys before its own that are other branches'
        self.store(off_path, 0, self.off_path[b])
        valid_at = self.local("int32")
        with B.serial(0, waves) as wv:
            base = kv_lo + (wv * self.warps + self.warp) * 32
            with self.when(base < kv_hi):  # warp-uniform: every lane reaches the shuffles
                j = base + self.lane
                jc = tirx.min(j, kv_hi - 1)  # past the chunk: a visible key's address, its weight 0
                back = self.seq_len[b] - jc  # slots before the row's own (>= 0); bits past 31 are never set
                on_path = (back >= 32) | (((off_path[0] >> tirx.min(back, 31)) & 1) == 0)
                self.store(valid_at, 0, tirx.if_then_else((j < kv_hi) & on_path, i32(1), i32(0)))
                valid = valid_at[0] != 0
                self.store(page, 0, self.page_table[b, jc // ps])
                slot = jc % ps
                # the row's first word as a multiple of the vector (exact: rows start on multiples of d), which is
                # what lets TVM's codegen emit one 16-byte load instead of four gathered words
                row16 = self.kv_index(layer, page[0], 0, g, slot, 0) // (vec * per_word)
                for i in range(d // (vec * per_word) if vec else 0):
                    B.buffer_store(krow, words.vload([(row16 + i) * vec], f"uint32x{vec}"),
                                   [tirx.Ramp(i32(i * vec), i32(1), vec)])
                for hh in range(group):
                    self.store(s, hh, f32(0))
                for c in range(d):
                    kval = key_value(c)
                    for hh in range(group):
                        self.store(s, hh, s[hh] + self.smem[q_at + hh * d + c] * kval)
                for hh in range(group):
                    score = s[hh]
                    if a["softcap"]:
                        cap = f32(a["softcap"])
                        score = cap * tirx.tanh(score / cap)
                    score = tirx.if_then_else(valid, score * f32(a["scale"]), tirx.min_value(F32))
                    self.store(s, hh, score)
                    score = s[hh]  # the stored score: `score` above reads s[hh], which the store just replaced
                    m_new = self.local()
                    self.store(m_new, 0, tirx.max(m[hh], ix.warp_reduce(score, "max", self.lane)))
                    pv = self.local()
                    self.store(pv, 0, tirx.if_then_else(valid, tirx.exp(score - m_new[0]), f32(0)))
                    corr = self.local()
                    self.store(corr, 0, tirx.exp(m[hh] - m_new[0]))
                    self.store(lsum, hh, lsum[hh] * corr[0] + ix.warp_reduce(pv[0], "sum", self.lane))
                    self.store(self.smem, p_at + (self.warp * group + hh) * 32 + self.lane, pv[0])
                    for c in range(per_lane):
                        self.store(o, hh * per_lane + c, o[hh * per_lane + c] * corr[0])
                    self.store(m, hh, m_new[0])
                ix.warp_sync()
                # p·v without a branch a key: the warp's 32 keys lie on at most 32 / ps + 1 pages, read once; a key
                # past the chunk reads a clamped visible key with weight 0; so all 32 keys' loads can be in flight
                # at once (a branch and a page-table load a key made them 64 dependent round trips)
                first_page = base // ps
                last = (kv_hi - 1) // ps
                for i in range(n_pages):
                    self.store(pages_of, i, self.page_table[b, tirx.min(first_page + i, last)])
                with B.unroll(0, 32) as kk:
                    jk = tirx.min(base + kk, kv_hi - 1)
                    pg = pages_of[0]
                    for i in range(1, n_pages):
                        pg = tirx.Select(jk // ps - first_page >= i, pages_of[i], pg)
                    # the key's value row once into a register, each value once: written inline, the address
                    # (page select, layer offset) was repeated in every head's FMA, 1.4 MB of the Qwen2.5-Coder-
                    # 1.5B shape's 5.2 MB batch-1 kernel (6 heads a group x 128 dims x 32 keys)
                    row = self.local("int64")
                    self.store(row, 0, self.kv_index(layer, pg, 1, g, jk % ps, 0))
                    for c in range(per_lane):
                        v = self.local()
                        self.store(v, 0, self.pages[row[0] + tirx.min(c * 32 + self.lane, d - 1)].astype(F32))
                        for hh in range(group):
                            i = hh * per_lane + c
                            self.store(o, i, o[i] + self.smem[p_at + (self.warp * group + hh) * 32 + kk] * v[0])
                ix.warp_sync()
        self.phase(4)  # thread 0's warp's keys done (the others may still run)
        # the warps' partials → shared, then one (max, sum, o) per head
        for hh in range(group):
            with self.when(self.lane == 0):
                self.store(self.smem, ml_at + (self.warp * group + hh) * 2, m[hh])
                self.store(self.smem, ml_at + (self.warp * group + hh) * 2 + 1, lsum[hh])
            for c in range(per_lane):
                with self.when(c * 32 + self.lane < d):
                    self.store(self.smem, o_at + (self.warp * group + hh) * d + c * 32 + self.lane,
                               o[hh * per_lane + c])
        self.sync()
        self.phase(5)  # every warp's partials in shared memory: the rest is the combine and its writes
        self._combine(op, att, b, g, split, group, d, o_at, ml_at, partials)

    def _combine(self, op, att, b, g, split, group, d, o_at, ml_at, partials) -> None:
        """The warps' (max, sum, o) partials in shared memory (o_at: (warps, group, d), ml_at: (warps, group, 2))
        combined into the task's output, or into its split's partials."""
        out = att.outputs[0]
        n_splits = self.p.tg.stages[op.stage].n_splits

        def combine(idx) -> None:
            hh, c = idx // d, idx % d
            mx, den, num = self.local(), self.local(), self.local()
            self.store(mx, 0, tirx.min_value(F32))
            for w in range(self.warps):
                self.store(mx, 0, tirx.max(mx[0], self.smem[ml_at + (w * group + hh) * 2]))
            self.store(den, 0, f32(0))
            self.store(num, 0, f32(0))
            for w in range(self.warps):
                sc = tirx.exp(self.smem[ml_at + (w * group + hh) * 2] - mx[0])
                self.store(den, 0, den[0] + sc * self.smem[ml_at + (w * group + hh) * 2 + 1])
                self.store(num, 0, num[0] + sc * self.smem[o_at + (w * group + hh) * d + c])
            head = g * group + hh
            if partials is None:
                self.store(self.arena, self.col(op.slot(out)) + b * (att.attrs["n_head"] * d) + head * d + c,
                           num[0] / den[0])
            else:
                h = att.attrs["n_head"]
                base = (b * n_splits + split) * h
                self.store(self.arena, partials.o + (base + head) * d + c, num[0])
                with self.when(c == 0):
                    self.store(self.arena, partials.ml + (base + head) * 2, mx[0])
                    self.store(self.arena, partials.ml + (base + head) * 2 + 1, den[0])

        self._each(group * d, combine)

    def merged_value(self, att_stage, partials: P.AttentionPartials, b, head, c) -> tirx.Expr:
        """Feature c of `head`'s attention output for sequence b, from its split partials (o unnormalized, running
        max and sum): the merge task's value, and the O projection's input when its tiles merge (Stage.merged).
        Only the splits that hold keys this step are read (the others' partials are empty)."""
        att, n_splits = att_stage.attention, att_stage.n_splits
        h, d = att.attrs["n_head"], int(self.values[att.inputs[2]].shape[-1])
        active = self._active(att_stage, b)
        mx, den, num = self.local(), self.local(), self.local()
        self.store(mx, 0, tirx.min_value(F32))
        with B.serial(0, active) as j:
            self.store(mx, 0, tirx.max(mx[0], self.arena[partials.ml + ((b * n_splits + j) * h + head) * 2]))
        self.store(den, 0, f32(0))
        self.store(num, 0, f32(0))
        with B.serial(0, active) as j:
            at = (b * n_splits + j) * h + head
            sc = self.local()
            self.store(sc, 0, tirx.exp(self.arena[partials.ml + at * 2] - mx[0]))
            self.store(den, 0, den[0] + sc[0] * self.arena[partials.ml + at * 2 + 1])
            self.store(num, 0, num[0] + sc[0] * self.arena[partials.o + at * d + c])
        return num[0] / den[0]

    def _merge_if_last(self, op, att, b, g, group, d, n_splits, partials) -> None:
        """Merged by the last chunk (Stage.merged_by_last): thread 0 releases the block's partials, adds to the
        (sequence, KV head)'s arrival counter, and the chunk that brings it to n_splits x epoch acquires the
        others' partials and merges them, where a merge task would have waited for them (a handoff: poll, barrier,
        its loads after). The chunks that hold no keys this step never get here (empty_chunk): chunk 0 adds 1 for
        itself and 1 for each of them, the others 1. The task publishes after this, so its consumers see the
        merged output."""
        self.sync()  # every thread's partial writes issued
        with self.when(self.tx == 0):
            ix.fence_acq_rel()
            mine = self.local("int32")
            self.store(mine, 0, tirx.if_then_else(self.col(P.SPLIT) == 0,
                                                  i32(n_splits + 1) - self._active(self.p.tg.stages[op.stage], b),
                                                  i32(1)))
            before = self.local("int32")
            self.store(before, 0, ix.atomic_add(T.address_of(self.counters[self.col(P.ARRIVAL)]), mine[0]))
            last = before[0] + mine[0] == i32(n_splits) * self.epoch
            with self.when(last):
                ix.fence_acq_rel()  # acquire: the other chunks' partials, for every thread
            self.store(self.redi, 0, tirx.if_then_else(last, i32(1), i32(0)))
        self.sync()
        with self.when(self.redi[0] == 1):
            self._attn_merge(op, att, b, g, group, d, n_splits, partials)

    def _attn_merge(self, op, att, b, g, group, d, n_splits, partials) -> None:
        h = att.attrs["n_head"]
        out = att.outputs[0]

        def merge(idx) -> None:
            hh, c = idx // d, idx % d
            head = g * group + hh
            self.store(self.arena, self.col(op.slot(out)) + b * (h * d) + head * d + c,
                       self.merged_value(self.p.tg.stages[op.stage], partials, b, head, c))

        self._each(group * d, merge)
