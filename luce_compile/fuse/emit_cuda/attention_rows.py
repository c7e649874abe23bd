"""Attention chunks that read each key's row across a warp's lanes (MegakernelOptions.attn_rows): the body for
long contexts, where a task streams ~1 MiB of keys and values (the 8B at depth 32K: 2,048 keys x 8 KV heads x 16
chunks a layer) and what counts is how many bytes each SM keeps in flight.

One task: sequence b, KV head g (a group of `group` query heads), keys [lo, hi) of its chunk.
  lanes    `lanes` = d / vec lanes hold one key row, vec values each (d = 128 and float16 pages: 4 halves, 8 bytes,
           the 32 lanes of a warp read one 256-byte row; d = 64: 16 lanes, two rows a warp instruction). A lane
           keeps q for its vec dimensions of every head of the group, and o for the same (vec x group floats each).
  a step   a warp takes slots x rows consecutive keys; each lane issues every K and V load of the step (slots of
           each) before it uses any: 8 keys x 512 bytes = 4 KiB a warp and 64 KiB a block in flight, whole sectors.
           The group's heads all use the one load (the GQA sharing).
  q·k      a lane's partial dots (slot x head, vec FMAs each) summed over the row's lanes by a reduce-scatter
           butterfly: each step a lane keeps half of its list and receives the partner's half of it (one shuffle
           a kept value), so 32 partials over 32 lanes take 31 shuffles (a butterfly a value: 160) and each lane
           ends with the whole score of one (key, head) (`scatter_steps`).
  softmax  the scores to the warp's region of shared memory; every lane takes the step's maxima per head from
           there, so the running max is warp-uniform; each lane turns its own score into p = exp(s - m), writes it
           back over the score and adds it to its own running sum (summed per head over the lanes at the end).
  p·v      each lane reads its keys' p for every head (16-byte shared loads, a broadcast) and adds p·v for its vec
           dimensions from the V words it already holds.
After the keys, the row groups of a warp (d < 128) are summed by shuffles, and the warps' (max, sum, o) are combined
as the lane-per-key body's are (AttentionMixin._combine). The arithmetic is float32 throughout (float16 values
convert exactly), so scores and outputs equal the lane-per-key body's up to the order of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import DataType, tirx
from tvm.tirx.script.builder import ir as B

from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.emit_cuda.core import F32, f32, i32

MAX_SLOTS = 8  # rows a lane loads a step: 8 x (K + V) x 8 bytes = 128 bytes a lane, 32 registers (float16, d = 128)
DATA_WORDS = 32  # the registers a lane's K and V words of a step may take (the kernel holds 128 a thread)
MAX_PARTIALS = 32  # q·k partials a lane sums at once (slots x group): one score a lane when a row has 32 lanes


def scatter_steps(n: int, lanes: int) -> tuple[tuple[tuple[int, int], ...], int, int]:
    """The reduce-scatter of n values a lane over `lanes` lanes (a power of two). The list is first padded with
    zeros (to a multiple of `lanes`, or below it to a power of two) so that every halving splits an even list: a
    padding in the middle would shift the later values' places. Per butterfly step, (lane mask, half): a lane whose
    mask bit is set keeps the upper `half` of its list, the others the lower, and each adds the partner's copy of
    the half it keeps; half 0: the list is down to one value, the step sums it whole (the lanes that differ in
    those bits end with copies). Returns the steps, the values a lane keeps and the padded length. A lane's kept
    value f is the sum over the lanes of value `kept_index(steps, lane) + f` (padding where that is >= n)."""
    padded = -(-n // lanes) * lanes if n >= lanes else 1 << (n - 1).bit_length()
    steps, length, mask = [], padded, lanes // 2
    while mask:
        steps.append((mask, length // 2 if length > 1 else 0))
        length = max(1, length // 2)
        mask //= 2
    return tuple(steps), length, padded


def kept_index(steps, lane: int) -> int:
    """The list index of the first value lane `lane` keeps after `steps` (scatter_steps)."""
    return sum(half for mask, half in steps if lane & mask)


def reduce_scatter(vals: list, steps, lane, select, shuffle, bind) -> list:
    """The butterfly of scatter_steps over a lane's padded list `vals`, written once for the emitter (TIR
    expressions: tirx.Select, a warp shuffle, `bind` stores a value into its register and returns the load) and
    for the test's emulation (numpy arrays over the lanes). Returns the kept values."""
    for mask, half in steps:
        if not half:
            vals = [bind(0, vals[0] + shuffle(vals[0], mask))]
            continue
        upper = (lane & mask) != 0
        vals = [bind(k, select(upper, vals[half + k], vals[k]) + shuffle(select(upper, vals[k], vals[half + k]), mask))
                for k in range(half)]
    return vals


@dataclass(frozen=True)
class RowsLayout:
    vec: int  # values of a key row a lane holds
    lanes: int  # lanes a row
    rows: int  # rows a warp instruction reads (32 // lanes)
    slots: int  # rows a lane loads a step, K and V each
    words: int  # 32-bit words of a lane's vec values
    group: int  # query heads of a KV head
    steps: tuple[tuple[int, int], ...]  # the reduce-scatter (scatter_steps)
    kept: int  # scores a lane holds after it
    padded: int  # the partials' list, padded for it
    stride: int  # floats of a row group's scores in shared memory: past every lane's last index, a multiple of 4

    @property
    def partials(self) -> int:
        return self.slots * self.group

    @property
    def keys(self) -> int:
        """Keys a warp takes a step."""
        return self.slots * self.rows


def rows_layout(d: int, group: int, bits: int, slots: int = 0) -> RowsLayout | None:
    """The lane layout for head dimension d, `group` query heads a KV head and bits a cached value, or None where
    rows do not split into whole lanes (the lane-per-key body runs). vec: 4 values a lane (8-byte words of float16,
    16 of float32), 8 where a row passes 128 values (d = 256: 16-byte words); `slots`: 0 for the rule (as many rows
    as keep a lane's K and V words within DATA_WORDS registers and its partials within MAX_PARTIALS, at most
    MAX_SLOTS)."""
    if bits not in (16, 32):
        return None
    vec = max(4, d // 32)
    lanes = d // vec
    if vec > 8 or d % vec or lanes & (lanes - 1):
        return None
    words = vec * bits // 32
    slots = slots or max(1, min(MAX_SLOTS, DATA_WORDS // (2 * words), MAX_PARTIALS // group))
    steps, kept, padded = scatter_steps(slots * group, lanes)
    return RowsLayout(vec, lanes, 32 // lanes, slots, words, group, steps, kept, padded, -(-padded // 4) * 4)


class AttentionRowsMixin:
    def _rows_shared(self, lay: RowsLayout, d: int) -> tuple[int, int, int]:
        """Shared memory of the rows body: scores (warps x rows x stride) | o (warps, group, d) | m, l (warps,
        group): their offsets, and the floats they take."""
        o_at = self.warps * lay.rows * lay.stride
        ml_at = o_at + self.warps * lay.group * d
        return o_at, ml_at, ml_at + 2 * self.warps * lay.group

    def _attn_rows(self, op, att, q_name, b, g, split, d, window, lay: RowsLayout, partials) -> None:
        a = att.attrs
        group, vec = lay.group, lay.vec
        kv_lo, kv_hi = self._chunk(self.p.tg.stages[op.stage], window, b, split)
        r = self.lane % lay.lanes  # the lane's vec dimensions: [r·vec, r·vec + vec)
        h = self.lane // lay.lanes  # which row of a warp instruction's `rows`
        q = self.local(F32, group * vec)
        q_at = self.col(op.slot(q_name)) + b * (a["n_head"] * d) + g * group * d + r * vec
        for hh in range(group):
            for c in range(vec):
                self.store(q, hh * vec + c, self.arena[q_at + hh * d + c])
        self.phase(3)
        m, lsum, corr = self.local(F32, group), self.local(F32, group), self.local(F32, group)
        o = self.local(F32, group * vec)
        for hh in range(group):
            self.store(m, hh, tirx.min_value(F32))
            for c in range(vec):
                self.store(o, hh * vec + c, f32(0))
        # the lane's kept scores: the list index of the first (the (slot, head) it is), and whether the lane owns
        # them (a lane whose bits of the scatter's whole-sum steps are clear: the others hold copies)
        first = self.local("int32")
        self.store(first, 0, sum((tirx.Select((self.lane & mask) != 0, i32(half), i32(0))
                                  for mask, half in lay.steps if half), i32(0)))
        copies = sum(mask for mask, half in lay.steps if not half)
        owner = (self.lane & copies) == 0 if copies else tirx.const(True, "bool")
        lown = self.local(F32, lay.kept)  # the running sums of the lane's own (head, p) over its kept scores
        for f in range(lay.kept):
            self.store(lown, f, f32(0))
        off_path = self.local("int32")
        self.store(off_path, 0, self.off_path[b])
        layer_at = self.local("int64")  # the layer's pages, from layer 0's (once: not again in every step)
        self.store(layer_at, 0, self.kv_offset[self.col(P.KV_LAYER)])
        per_wave = self.warps * lay.keys
        waves = (tirx.max(kv_hi - kv_lo, 0) + (per_wave - 1)) // per_wave
        pages_of = self.local("int32", (lay.keys - 1) // self.p.page_size + 2)
        self._rows_pages(pages_of, b, kv_lo + self.warp * lay.keys, kv_hi)
        with B.serial(0, waves) as wv:
            base = kv_lo + (wv * self.warps + self.warp) * lay.keys
            with self.when(base < kv_hi):  # warp-uniform: every lane reaches the shuffles
                kw, vw = self._rows_load(lay, layer_at[0], pages_of, g, base, kv_hi, h, r)
                self._rows_pages(pages_of, b, base + per_wave, kv_hi)  # the next step's, while these load
                part = self._rows_dots(lay, q, kw)
                score, valid = self._rows_scores(a, lay, part, first, base, kv_hi, b, h, off_path)
                self._rows_softmax(lay, m, corr, score, valid, first, owner, lown, h)
                self._rows_pv(lay, o, corr, vw, h)
        self.phase(4)  # thread 0's warp's keys done (the others may still run)
        for mask in (1 << s for s in range(lay.lanes.bit_length() - 1, 5)):  # the warp's row groups summed
            for k in range(group * vec):
                self.store(o, k, o[k] + ix.shfl_xor(o[k], mask, self.lane))
        for hh in range(group):  # each head's sum over the lanes that hold its scores
            own = sum((tirx.if_then_else((first[0] + f) % group == hh, lown[f], f32(0)) for f in range(lay.kept)),
                      f32(0))
            self.store(lsum, hh, ix.warp_reduce(own, "sum", self.lane))
        o_at, ml_at, _ = self._rows_shared(lay, d)
        for hh in range(group):
            with self.when(self.lane == 0):
                self.store(self.smem, ml_at + (self.warp * group + hh) * 2, m[hh])
                self.store(self.smem, ml_at + (self.warp * group + hh) * 2 + 1, lsum[hh])
        with self.when(h == 0):
            for hh in range(group):
                for c in range(vec):
                    self.store(self.smem, o_at + (self.warp * group + hh) * d + r * vec + c, o[hh * vec + c])
        self.sync()
        self.phase(5)  # every warp's partials in shared memory: the rest is the combine and its writes
        self._combine(op, att, b, g, split, group, d, o_at, ml_at, partials)

    def _rows_pages(self, pages_of: tirx.Buffer, b, base, kv_hi) -> None:
        """The ids of the pages that a warp's step from key `base` can touch (len(pages_of) of them, clamped to the
        chunk's last): loaded a step ahead, so a step's loads wait for no page-table read."""
        ps = self.p.page_size
        last = tirx.max(kv_hi - 1, 0) // ps
        for i in range(int(pages_of.shape[0])):
            self.store(pages_of, i, self.page_table[b, tirx.min(base // ps + i, last)])

    def _rows_load(self, lay: RowsLayout, layer_at, pages_of, g, base, kv_hi, h, r) -> tuple[tirx.Buffer, tirx.Buffer]:
        """Every K and V word of the lane's slots this step, issued before any is used. Slot i is key
        base + i·rows + h (clamped into the chunk: a key past it reads a visible row, its weight 0)."""
        ps, d, hkv = self.p.page_size, self.p.kv["head_dim"], self.p.kv["kv_heads"]
        per_word = 32 // DataType(self.kv_dtype).bits
        words = B.decl_buffer((self.n_kv // per_word,), "uint32", data=self.pages.data)
        n_pages, first_page = int(pages_of.shape[0]), base // ps
        kw, vw = self.local("uint32", lay.slots * lay.words), self.local("uint32", lay.slots * lay.words)
        per_load = min(4, lay.words)  # 16 bytes at most a load
        row = self.local("int64")
        for i in range(lay.slots):
            jc = tirx.min(base + i * lay.rows + h, kv_hi - 1)
            pg = pages_of[0]
            for k in range(1, n_pages):
                pg = tirx.Select(jc // ps - first_page >= k, pages_of[k], pg)
            # TVM's layout (pages, K|V, KV heads, page size, d) from the layer's offset, as kv_index; the slice's
            # first element over vec (exact: rows start on multiples of d, layers' pages on multiples of 64 bytes),
            # so the word index is a visible multiple of the load's width: one vector load, not gathered words
            within = ((pg.astype("int64") * 2 * hkv + g) * ps + jc % ps) * d + r * lay.vec
            self.store(row, 0, (layer_at + within) // lay.vec)
            v_off = hkv * ps * d // lay.vec  # V's rows: the next `which` of the page
            for regs, at in ((kw, row[0]), (vw, row[0] + v_off)):
                for n in range(lay.words // per_load):
                    idx = (at * (lay.words // per_load) + n) * per_load
                    B.buffer_store(regs, words.vload([idx], f"uint32x{per_load}"),
                                   [tirx.Ramp(i32(i * lay.words + n * per_load), i32(1), per_load)])
        return kw, vw

    def _rows_values(self, lay: RowsLayout, regs: tirx.Buffer, i: int) -> tirx.Buffer:
        """Slot i's vec values as float32 (each converted once: every head uses them)."""
        bits = DataType(self.kv_dtype).bits
        vals = self.local(F32, lay.vec)
        for c in range(lay.vec):
            if bits == 32:
                v = tirx.reinterpret(F32, regs[i * lay.words + c])
            else:
                w = regs[i * lay.words + c // 2]
                half = w & tirx.const(0xFFFF, "uint32") if c % 2 == 0 else w >> tirx.const(16, "uint32")
                v = tirx.reinterpret(self.kv_dtype, half.astype("uint16")).astype(F32)
            self.store(vals, c, v)
        return vals

    def _rows_dots(self, lay: RowsLayout, q: tirx.Buffer, kw: tirx.Buffer) -> tirx.Buffer:
        """Each (slot, head)'s q·k over the lane's dimensions, then reduce-scattered over the row's lanes: the
        lane's kept scores in part[0, kept)."""
        group, vec = lay.group, lay.vec
        part = self.local(F32, lay.padded)
        for i in range(lay.slots):
            kv = self._rows_values(lay, kw, i)
            for hh in range(group):
                acc = q[hh * vec] * kv[0]
                for c in range(1, vec):
                    acc = acc + q[hh * vec + c] * kv[c]
                self.store(part, i * group + hh, acc)
        for k in range(lay.partials, lay.padded):
            self.store(part, k, f32(0))

        def bind(k, value):
            self.store(part, k, value)
            return part[k]

        reduce_scatter([part[k] for k in range(lay.padded)], lay.steps, self.lane, tirx.Select,
                       lambda v, mask: ix.shfl_xor(v, mask, self.lane), bind)
        return part

    def _rows_scores(self, a, lay: RowsLayout, part, first, base, kv_hi, b, h, off_path):
        """The lane's kept scores, scaled (and soft-capped), the lowest float where the key is past the chunk,
        another branch's (off_path) or the scatter's padding; written to the warp's shared region too."""
        score, valid = self.local(F32, lay.kept), self.local("int32", lay.kept)
        at = (self.warp * lay.rows + h) * lay.stride
        for f in range(lay.kept):
            idx = first[0] + f
            j = base + (idx // lay.group) * lay.rows + h
            back = self.seq_len[b] - tirx.min(j, kv_hi - 1)  # slots before the row's own (>= 0)
            on_path = (back >= 32) | (((off_path[0] >> tirx.min(back, 31)) & 1) == 0)
            self.store(valid, f, tirx.if_then_else((idx < lay.partials) & (j < kv_hi) & on_path, i32(1), i32(0)))
            s = part[f]
            if a["softcap"]:
                cap = f32(a["softcap"])
                s = cap * tirx.tanh(s / cap)
            self.store(score, f, tirx.if_then_else(valid[f] != 0, s * f32(a["scale"]), tirx.min_value(F32)))
            self.store(self.smem, at + idx, score[f])
        ix.warp_sync()
        return score, valid

    def _shared4(self, at4) -> tirx.Buffer:
        """Four floats of shared memory at 4·at4 (one 16-byte load)."""
        v = self.local(F32, 4)
        B.buffer_store(v, self.smem.vload([at4 * 4], "float32x4"), [tirx.Ramp(i32(0), i32(1), 4)])
        return v

    def _rows_softmax(self, lay: RowsLayout, m, corr, score, valid, first, owner, lown, h) -> None:
        """The running max per head over the step's keys (all row groups: warp-uniform) and its correction; the
        lane's own p = exp(s - m) over its scores in shared memory, and added to its running sums."""
        group = lay.group
        mx = self.local(F32, group)
        for hh in range(group):
            self.store(mx, hh, tirx.min_value(F32))
        for row in range(lay.rows):
            at4 = (self.warp * lay.rows + row) * (lay.stride // 4)
            for k4 in range(-(-lay.partials // 4)):
                v = self._shared4(at4 + k4)
                for e in range(4):
                    idx = k4 * 4 + e
                    if idx < lay.partials:
                        self.store(mx, idx % group, tirx.max(mx[idx % group], v[e]))
        for hh in range(group):
            m_new = tirx.max(m[hh], mx[hh])
            self.store(corr, hh, tirx.exp(m[hh] - m_new))
            self.store(m, hh, m_new)
        at = (self.warp * lay.rows + h) * lay.stride
        p = self.local(F32)
        for f in range(lay.kept):
            head = (first[0] + f) % group
            m_own, c_own = m[0], corr[0]
            for hh in range(1, group):
                m_own, c_own = tirx.Select(head == hh, m[hh], m_own), tirx.Select(head == hh, corr[hh], c_own)
            self.store(p, 0, tirx.if_then_else(valid[f] != 0, tirx.exp(score[f] - m_own), f32(0)))
            self.store(self.smem, at + first[0] + f, p[0])
            self.store(lown, f, lown[f] * c_own + tirx.if_then_else(owner, p[0], f32(0)))
        ix.warp_sync()

    def _rows_pv(self, lay: RowsLayout, o, corr, vw, h) -> None:
        """o rescaled to the new max, then p·v of the lane's slots for its vec dimensions."""
        group, vec = lay.group, lay.vec
        for hh in range(group):
            for c in range(vec):
                self.store(o, hh * vec + c, o[hh * vec + c] * corr[hh])
        at4 = (self.warp * lay.rows + h) * (lay.stride // 4)
        ps: dict[int, tirx.Buffer] = {}  # the p words as the slots reach them (not all 32 registers at once)
        for i in range(lay.slots):
            vals = self._rows_values(lay, vw, i)
            for hh in range(group):
                idx = i * group + hh
                if idx // 4 not in ps:
                    ps[idx // 4] = self._shared4(at4 + idx // 4)
                p = ps[idx // 4][idx % 4]
                for c in range(vec):
                    self.store(o, hh * vec + c, o[hh * vec + c] + p * vals[c])
        ix.warp_sync()  # the step's reads of the region before the next step's writes
