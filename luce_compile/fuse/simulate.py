"""A float64 numpy executor of the megakernel's task graph: the reference for the generated kernel's task bodies,
and the check of the task graph itself.

It runs a plan's per-SM queues the way the persistent kernel does (a block takes the next task of its queue once
the tasks it depends on are done), in an interleaving chosen by a seeded random generator or adversarially, and
refuses any read of a value region no task has written yet in this step: a missing dependency is an error here,
not a silent race. An attention chunk that holds no keys this step is ready at once, as in the kernel (which skips
its wait and its body): nothing may depend on what it would have written. Each task computes only from the regions
it declares; the float64 oracle's op functions give the arithmetic, so the logits must equal the oracle's to float64
rounding.

Rows may share a sequence (`sequence_of_row`): a speculative verify runs the last token and the drafts of one
sequence as rows of one step, at consecutive positions of the same pages (the runtime's Engine.verify). Then a
row's attention reads keys that other rows append in the same step, and every such key must have been written
before the read (checked per position and feature): the verify's causal attention holds in any interleaving.

A verify's rows may be a token tree (`off_path`, the kernel's argument of that name: Engine.verify_tree): each row
at its own slot as TVM lays a tree out (consecutive), bit k of its word marking the key k slots before its own as
another branch's. The row's attention skips those keys and its RoPE position counts them out (its depth past the
sequence); they must still be written before the read (the kernel reads them, weighted 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from luce_compile.fuse.plan import Plan
from luce_compile.fuse.taskgraph import (
    ARGMAX_PARTIAL,
    NORM_CHUNK,
    TOKEN_IDS,
    Region,
    Task,
    TaskGraph,
    TaskKind,
    kv_cache_value,
    split_value,
    value_width,
)
from luce_compile.graph.ir import LOGITS, POSITIONS, Op, OpKind
from luce_compile.graph.oracle import Oracle, gelu_tanh, rms_norm, rope, silu


class ScheduleError(AssertionError):
    """The plan or task graph let a task read what was not written yet, or the blocks could not all go on."""


@dataclass
class _Partial:
    m: np.ndarray  # (group,) running max of the scores per query head
    total: np.ndarray  # (group,) sum of exp(score - m)
    o: np.ndarray  # (group, Dv) sum of exp(score - m) · v


class TaskSimulator:
    """Decode steps of `tg`'s tg.batch rows; weights come from the oracle (dequantized float64). Row b feeds one
    token of sequence sequence_of_row[b] (default: a sequence per row)."""

    def __init__(self, tg: TaskGraph, plan: Plan, oracle: Oracle, sequence_of_row: list[int] | None = None):
        plan.check(tg)
        self.tg, self.plan, self.oracle = tg, plan, oracle
        self.values = tg.graph.values()
        self.seq = np.asarray(sequence_of_row if sequence_of_row is not None else range(tg.batch), dtype=np.int64)
        if len(self.seq) != tg.batch:
            raise ValueError(f"simulate: {len(self.seq)} rows' sequences for a task graph of {tg.batch} rows")
        n_seqs = int(self.seq.max()) + 1
        self.length = [0] * n_seqs  # tokens in each sequence's cache
        self.cache: dict[str, np.ndarray] = {}  # kvcache value → (sequences, max_context, features)
        for value, (layer, which) in tg.kv_slots.items():
            width = self.width(value)
            self.cache[kv_cache_value(layer, which)] = np.zeros((n_seqs, tg.max_context, width))

    def width(self, name: str) -> int:
        return value_width(self.values, name)

    def load_prefix(self, seq: int, keys_values: dict[str, np.ndarray]) -> None:
        """Fill a sequence's cache with a prefix computed elsewhere: attention k/v value → (L, features)."""
        for value, (layer, which) in self.tg.kv_slots.items():
            kv = keys_values[value]
            self.cache[kv_cache_value(layer, which)][seq, :len(kv)] = kv
            self.length[seq] = len(kv)

    def commit_path(self, seq: int, slots: list[int]) -> None:
        """After a token tree's verify: keep the keys and values at `slots` (a root-to-node path, in order), moved to
        consecutive slots from the first, and drop what follows (TVM's commit of the accepted path)."""
        for c in self.cache.values():
            c[seq, slots[0]:slots[0] + len(slots)] = c[seq, slots].copy()
        self.length[seq] = slots[0] + len(slots)

    def step(self, tokens: list[int], *, positions: list[int] | None = None, off_path: list[int] | None = None,
             seed: int | None = 0, adversarial: bool = False) -> tuple[np.ndarray, list]:
        """One step: row b's token at slot positions[b] of its sequence (default: the sequence's length plus the
        rows of that sequence before b) → (logits (B, V), greedy token ids). A row may repeat another's token and
        position (the runtime pads a step to the kernel's batch so). off_path: each row's word of other branches'
        keys (a token tree's verify; None: every row's 0)."""
        if positions is None:
            seen: dict[int, int] = {}
            positions = []
            for s in self.seq.tolist():
                positions.append(self.length[s] + seen.get(s, 0))
                seen[s] = seen.get(s, 0) + 1
        if max(positions) >= self.tg.max_context:
            raise ScheduleError("simulate: a sequence is at the maximum context")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.pos = np.asarray(positions, dtype=np.int64)  # slots: where a row's keys go and how far it reads
        self.off_path = np.zeros(self.tg.batch, np.int64) if off_path is None else np.asarray(off_path, np.int64)
        self.rope_pos = self.pos - np.array([bin(w & 0xFFFFFFFF).count("1") for w in self.off_path.tolist()])
        self.step_start = list(self.length)  # positions from here on are this step's appends
        self.kv_written = {name: np.zeros(c.shape, dtype=bool) for name, c in self.cache.items()}
        self.buf: dict[str, np.ndarray] = {}
        self.written: dict[str, np.ndarray] = {}
        self.partials: dict[tuple, _Partial] = {}
        self.arrivals: dict[tuple, int] = {}  # merged_by_last: chunks done per (output, sequence, KV head)
        self.lm_best: dict[tuple[int, int], tuple[float, int]] = {}
        for task in self._order(seed, adversarial):
            if not self._empty_chunk(task):
                for r in task.reads:
                    self._check_read(task, r)
            getattr(self, f"_{task.kind.value}")(task)
        for s, p in zip(self.seq.tolist(), positions, strict=True):
            self.length[s] = max(self.length[s], p + 1)
        return self.buf[LOGITS], [int(t) for t in self.buf[TOKEN_IDS][:, 0]]

    # ---- the blocks ---------------------------------------------------------------------------------------------
    def _order(self, seed: int | None, adversarial: bool) -> list[Task]:
        """The tasks in an order the kernel's blocks could run them: a random ready block each time (seeded), or
        the ready task with the highest id (adversarial: it runs a task as early as its declared deps allow)."""
        rng = np.random.default_rng(seed)
        heads = [0] * len(self.plan.queues)
        done = np.zeros(len(self.tg.tasks), dtype=bool)
        order: list[Task] = []
        while len(order) < len(self.tg.tasks):
            ready = [s for s, q in enumerate(self.plan.queues)
                     if heads[s] < len(q) and (self._empty_chunk(self.tg.tasks[q[heads[s]]])
                                               or all(done[d] for d in self.tg.tasks[q[heads[s]]].deps))]
            if not ready:
                raise ScheduleError("simulate: no block can take its next task (a deadlock)")
            if adversarial:
                sm = max(ready, key=lambda s: self.plan.queues[s][heads[s]])
            else:
                sm = ready[int(rng.integers(len(ready)))]
            task = self.tg.tasks[self.plan.queues[sm][heads[sm]]]
            heads[sm] += 1
            done[task.id] = True
            order.append(task)
        return order

    def _span(self, stage: int, row: int) -> tuple[int, int]:
        """Row `row`'s first visible key and how many keys it sees this step, in attention stage `stage`."""
        a = self.tg.stages[stage].attention.attrs
        pos = int(self.pos[row])
        window = int(a.get("sliding_window") or 0)
        first = max(0, pos - window + 1) if window else 0  # the oldest visible key
        return first, pos + 1 - first

    def _active(self, stage: int, row: int) -> int:
        """The chunks of a split attention stage that hold keys for row `row` this step (the first ones)."""
        return min(self.tg.stages[stage].n_splits, self.tg.active_chunks(self._span(stage, row)[1]))

    def _empty_chunk(self, task: Task) -> bool:
        """A split attention chunk past the keys its sequence sees this step (the kernel's early exit)."""
        if task.kind != TaskKind.ATTN_PARTIAL or self.tg.stages[task.stage].n_splits == 1:
            return False
        return task.split >= self._active(task.stage, task.row)

    # ---- regions ------------------------------------------------------------------------------------------------
    def _rows(self, r: Region) -> slice:
        return slice(None) if r.row is None else slice(r.row, r.row + 1)

    def _check_read(self, task: Task, r: Region) -> None:
        if r.value.startswith("kvcache:"):
            return  # older positions were written by earlier steps; this step's by the tiles checked below
        w = self.written.get(r.value)
        if w is None or not w[self._rows(r), r.lo:r.hi].all():
            raise ScheduleError(f"simulate: task {task.id} ({task.kind}) reads {r} before it is written")

    def read(self, name: str, lo: int, hi: int, row: int | None = None) -> np.ndarray:
        if name == POSITIONS:
            return self.rope_pos if row is None else self.rope_pos[row:row + 1]
        region = Region(name, lo, hi, row)
        w = self.written.get(name)
        if w is None or not w[self._rows(region), lo:hi].all():
            raise ScheduleError(f"simulate: {region} is read before it is written")
        return self.buf[name][self._rows(region), lo:hi]

    def write(self, name: str, lo: int, hi: int, data: np.ndarray, row: int | None = None) -> None:
        """Features [lo, hi) of `name` for every row (or one); a norm's input (norm_partials) also gets the sums of
        squares of the chunks written (the task graph declares them as the task's writes too)."""
        if name in self.tg.norm_partials:
            chunks = data.reshape(len(data), -1, NORM_CHUNK)  # (rows, chunks, NORM_CHUNK)
            self.write(self.tg.norm_partials[name], lo // NORM_CHUNK, hi // NORM_CHUNK, (chunks ** 2).sum(axis=2),
                       row)
        if name not in self.buf:
            width = {TOKEN_IDS: 1, ARGMAX_PARTIAL: self.width(LOGITS)}.get(name) or self.width(name.split("#")[0])
            if name.endswith("#sumsq"):
                width //= NORM_CHUNK
            self.buf[name] = np.full((self.tg.batch, width), np.nan)
            self.written[name] = np.zeros((self.tg.batch, width), dtype=bool)
        rows = slice(None) if row is None else slice(row, row + 1)
        self.buf[name][rows, lo:hi] = data
        self.written[name][rows, lo:hi] = True

    # ---- task bodies --------------------------------------------------------------------------------------------
    def _embed(self, task: Task) -> None:
        op = self.tg.stages[task.stage].ops[0]
        table = self.oracle.weight(op.weights["weight"])
        self.write(op.outputs[0], task.lo, task.hi, table[self.tokens, task.lo:task.hi] * op.attrs["scale"])

    def _matvec(self, task: Task) -> None:
        st = self.tg.stages[task.stage]
        unit = st.units[task.unit]
        lo, hi = task.lo, task.hi
        if st.merged >= 0:  # the split attention's partials, merged in the tile
            att = self.tg.stages[st.merged]
            a = att.attention.attrs
            for j in range(att.n_splits):  # every partial must be written (the dependency check)
                self.read(split_value(st.input, j), 0, self.width(st.input))
            x = np.stack([np.concatenate([self._merged(st.input, b, g, self._active(st.merged, b))
                                          for g in range(a["n_head_kv"])]) for b in range(self.tg.batch)])
        else:
            x = self.read(st.input, 0, self.width(st.input))  # (B, K): the whole input row
        if st.prologue is not None and st.input in self.tg.norm_partials:  # 1/rms from the writers' chunk sums
            sums = self.read(self.tg.norm_partials[st.input], 0, x.shape[1] // NORM_CHUNK)  # (B, K / NORM_CHUNK)
            rstd = 1 / np.sqrt(sums.sum(axis=1, keepdims=True) / x.shape[1] + st.prologue.attrs["eps"])
            x = x * rstd * self.oracle.weight(st.prologue.weights["weight"])
        elif st.prologue is not None:
            x = rms_norm(x, self.oracle.weight(st.prologue.weights["weight"]), st.prologue.attrs["eps"])
        env: dict[str, np.ndarray] = {}
        for m in unit.matmuls:
            y = x @ self.oracle.weight(m.weights["weight"])[lo:hi].T
            env[m.outputs[0]] = y + self.oracle.weight(m.weights["bias"])[lo:hi] if "bias" in m.weights else y
        for op in unit.epilogue:
            ins = [env[n] if n in env else self.read(n, lo, hi) for n in op.inputs]
            env[op.outputs[0]] = self._local(op, ins, lo, hi)
        for name, y in env.items():
            self.write(name, lo, hi, y)
            if name in self.tg.kv_slots:  # the KV append: this step's keys or values at each row's position
                cache = kv_cache_value(*self.tg.kv_slots[name])
                self.cache[cache][self.seq, self.pos, lo:hi] = y
                self.kv_written[cache][self.seq, self.pos, lo:hi] = True
        if any(m.kind == OpKind.LM_HEAD for m in unit.matmuls):
            logits = env[unit.epilogue[-1].outputs[0] if unit.epilogue else unit.matmuls[0].outputs[0]]
            for b in range(self.tg.batch):  # the tile's partial argmax (first index on ties, as numpy's argmax)
                i = int(np.argmax(logits[b]))
                self.lm_best[(b, lo)] = (float(logits[b, i]), lo + i)
            self.write(ARGMAX_PARTIAL, lo, hi, np.zeros((self.tg.batch, hi - lo)))

    def _local(self, op: Op, ins: list[np.ndarray], lo: int, hi: int, row: int | None = None) -> np.ndarray:
        """A row-local op on features [lo, hi) of every batch row (or of one)."""
        x = ins[0]
        match op.kind:
            case OpKind.RESHAPE:
                return x
            case OpKind.SCALE:
                return x * op.attrs["scale"]
            case OpKind.SOFTCAP:
                return op.attrs["cap"] * np.tanh(x / op.attrs["cap"])
            case OpKind.ADD:
                return x + ins[1]
            case OpKind.GLU:
                return (silu if op.attrs["activation"] == "silu" else gelu_tanh)(x) * ins[1]
            case OpKind.RMS_NORM:
                w = self.oracle.weight(op.weights["weight"])
                if len(self.values[op.inputs[0]].shape) == 3:
                    return rms_norm(x, w, op.attrs["eps"])  # a whole row (row stages only)
                d = w.shape[0]
                return rms_norm(x.reshape(len(x), -1, d), w, op.attrs["eps"]).reshape(x.shape)
            case OpKind.ROPE:
                d = int(self.values[op.inputs[0]].shape[-1])
                a = op.attrs
                factors = self.oracle.weight(op.weights["freq_factors"]) if "freq_factors" in op.weights else None
                # the tile's features in place within the heads they span (a "norm"-layout tile may split a head:
                # its pairs 2i, 2i + 1 stay whole, so the zeros around it are never read)
                off, n = lo % d, x.shape[-1]
                span = -(-(off + n) // d) * d
                heads = np.zeros((len(x), span))
                heads[:, off:off + n] = x
                y = rope(heads.reshape(len(x), 1, -1, d), ins[1].reshape(-1, 1), a["layout"], a["dim"], a["base"],
                         a["freq_scale"], factors)  # (B, S=1, heads, D)
                return y.reshape(len(x), span)[:, off:off + n]
        raise ScheduleError(f"simulate: {op.kind} is not a row-local op")

    def _row(self, task: Task) -> None:
        st, b = self.tg.stages[task.stage], task.row
        env: dict[str, np.ndarray] = {}
        for op in st.ops:
            ins = [env[n] if n in env else self.read(n, 0, self.width(n) if n != POSITIONS else 1, b)
                   for n in op.inputs]
            env[op.outputs[0]] = self._local(op, ins, 0, self.width(op.outputs[0]), b)
        for name, y in env.items():
            self.write(name, 0, self.width(name), y, b)

    def _attn_partial(self, task: Task) -> None:
        st, b, g = self.tg.stages[task.stage], task.row, task.lo
        op = st.attention
        q_name, k_name, v_name, _ = op.inputs
        a = op.attrs
        group = a["n_head"] // a["n_head_kv"]
        d, dv = int(self.values[q_name].shape[-1]), int(self.values[v_name].shape[-1])
        o_lo, o_hi = g * group * dv, (g + 1) * group * dv
        pos = int(self.pos[b])
        first, span = self._span(task.stage, b)
        if self._empty_chunk(task):  # no keys: the kernel skips it, partials and arrival alike (chunk 0 counts it)
            self.partials[(op.outputs[0], b, g, task.split)] = _Partial(np.full(group, -np.inf), np.zeros(group),
                                                                       np.zeros((group, dv)))
            self.write(split_value(op.outputs[0], task.split), o_lo, o_hi, np.zeros((1, o_hi - o_lo)), b)
            return
        q = self.read(q_name, g * group * d, (g + 1) * group * d, b).reshape(group, d)
        chunk = self.tg.chunk_keys(span)
        lo = first + task.split * chunk
        hi = min(pos + 1, lo + chunk) if st.n_splits > 1 else pos + 1
        s_b = int(self.seq[b])
        for which, width in (("k", d), ("v", dv)):  # keys this step appends must be written before this read
            name = kv_cache_value(a["layer"], which)
            new = slice(max(lo, self.step_start[s_b]), hi)
            if not self.kv_written[name][s_b, new, g * width:(g + 1) * width].all():
                raise ScheduleError(f"simulate: task {task.id} (attention, row {b}) reads {name} at positions "
                                    f"{new.start}..{new.stop - 1} before this step wrote them")
        assert hi > lo, "a chunk the kernel runs holds keys"
        back = pos - np.arange(lo, hi)  # slots before the row's own
        on_path = (back >= 32) | (((int(self.off_path[b]) >> np.minimum(back, 31)) & 1) == 0)
        if not on_path.any():  # a chunk of other branches' keys only: weighs nothing in the merge
            self.partials[(op.outputs[0], b, g, task.split)] = _Partial(np.full(group, -np.inf), np.zeros(group),
                                                                       np.zeros((group, dv)))
            self.write(split_value(op.outputs[0], task.split), o_lo, o_hi, np.zeros((1, o_hi - o_lo)), b)
            self._arrive(task, b, g, o_lo, o_hi)
            return
        keys = self.cache[kv_cache_value(a["layer"], "k")][s_b, lo:hi, g * d:(g + 1) * d][on_path]
        vals = self.cache[kv_cache_value(a["layer"], "v")][s_b, lo:hi, g * dv:(g + 1) * dv][on_path]
        s = q @ keys.T  # (group, keys)
        if a["softcap"]:
            s = a["softcap"] * np.tanh(s / a["softcap"])
        s = s * a["scale"]
        m = s.max(axis=1)
        p = np.exp(s - m[:, None])
        part = _Partial(m, p.sum(axis=1), p @ vals)
        if st.n_splits == 1:
            self.write(op.outputs[0], o_lo, o_hi, (part.o / part.total[:, None]).reshape(1, -1), b)
            return
        self.partials[(op.outputs[0], b, g, task.split)] = part
        self.write(split_value(op.outputs[0], task.split), o_lo, o_hi, np.zeros((1, o_hi - o_lo)), b)
        self._arrive(task, b, g, o_lo, o_hi)

    def _arrive(self, task: Task, b: int, g: int, o_lo: int, o_hi: int) -> None:
        """A split chunk's partial is written: with merged_by_last, the kernel's arrival counter (the (sequence, KV
        head)'s last chunk merges; chunk 0 adds for the empty chunks too, which skip it, so the count still
        reaches n_splits a step)."""
        st = self.tg.stages[task.stage]
        if not st.merged_by_last:
            return
        out = st.attention.outputs[0]
        active = self._active(task.stage, b)
        add = 1 + (st.n_splits - active if task.split == 0 else 0)
        arrived = self.arrivals[(out, b, g)] = self.arrivals.get((out, b, g), 0) + add
        if arrived == st.n_splits:
            self.write(out, o_lo, o_hi, self._merged(out, b, g, active).reshape(1, -1), b)

    def _merged(self, out: str, b: int, g: int, active: int) -> np.ndarray:
        """KV head g's attention output for sequence b from the partials of its first `active` chunks (those that
        hold keys this step: the kernel reads no others), (group * dv,)."""
        parts = [self.partials[(out, b, g, j)] for j in range(active)]
        m = np.max([p.m for p in parts], axis=0)  # (group,)
        scale = [np.exp(p.m - m) for p in parts]  # exp(-inf) = 0 for the empty chunks
        num = sum(s[:, None] * p.o for s, p in zip(scale, parts, strict=True))
        den = sum(s * p.total for s, p in zip(scale, parts, strict=True))
        return (num / den[:, None]).reshape(-1)

    def _attn_merge(self, task: Task) -> None:
        st, b, g = self.tg.stages[task.stage], task.row, task.lo
        out = st.attention.outputs[0]
        o_lo, o_hi = task.writes[0].lo, task.writes[0].hi
        self.write(out, o_lo, o_hi, self._merged(out, b, g, self._active(task.stage, b)).reshape(1, -1), b)

    def _argmax(self, task: Task) -> None:
        b = task.row
        best = max((v, -i) for (row, _lo), (v, i) in self.lm_best.items() if row == b)
        self.write(TOKEN_IDS, 0, 1, np.array([[-best[1]]]), b)
