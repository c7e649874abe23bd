"""The megakernel's task graph: one decode step of any graph IR as tiles of fused tasks with exact dependencies.

The graph's ops are grouped into stages (the fusions Hazy's megakernels, Mirage MPK and Lucebox all make):
  embed     token rows → embedding features, tiled over the features
  matvec    matmuls that read one input, tiled over their output rows, each tile a task: an RMS norm feeding only
            matmuls is recomputed inside every tile (prologue); the row-local ops after the matmuls run on the tile
            (epilogue: bias is the matmul's, then reshape, q/k norm, RoPE, scale, residual add, GLU pairing the
            gate and up tiles, final softcap); a tile that produces an attention's keys or values appends them to
            the KV cache; the LM head's tiles also leave a partial argmax
  row       a whole-row op no projection absorbs (gemma's post-norms) with its row-local epilogue, per sequence
  attention split-KV partials per (sequence, KV head, key chunk) and a merge per (sequence, KV head); the number
            of chunks is static (the default: as many as fill the SMs once, times the waves a long context needs to
            keep each chunk within KV_MAX_KEYS; or max context / chunk, sliding layers window / chunk), each step
            divides its keys over the chunks it needs and the empty ones exit early (before their wait).
            With merge_in_last, no merge tasks: the chunk that finishes last merges (Stage.merged_by_last)
  argmax    one per sequence: the token id from the LM head tiles' partial maxima (only ids leave the device)
With norm_partials, the tasks writing a prologue norm's input also write each NORM_CHUNK features' sum of squares per
row, and the norm's tiles sum those (a fixed order, whatever the tiling or batch) instead of the input's squares.

Every task lists the regions (value, feature range, batch row) it reads and writes; a task depends on exactly the
earlier tasks whose writes overlap its reads. Task ids are a topological order, which the planner keeps on every
SM's queue, so a persistent kernel whose blocks are all resident cannot deadlock (fuse/plan.py). The numpy executor
of this task graph (fuse/simulate.py) is the reference for the generated kernel's task bodies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum

from luce_compile.errors import UnsupportedError
from luce_compile.graph.ir import LOGITS, POSITIONS, TOKENS, Graph, Op, OpKind, Value

ROW_LOCAL = {OpKind.RESHAPE, OpKind.SCALE, OpKind.SOFTCAP, OpKind.ADD, OpKind.GLU, OpKind.ROPE, OpKind.RMS_NORM}
LINEAR = {OpKind.MATMUL, OpKind.LM_HEAD}


class TaskKind(StrEnum):
    EMBED = "embed"
    MATVEC = "matvec"
    ROW = "row"
    ATTN_PARTIAL = "attn_partial"
    ATTN_MERGE = "attn_merge"
    ARGMAX = "argmax"


@dataclass(frozen=True)
class Region:
    """Features [lo, hi) of a value (its trailing dims flattened), for batch row `row` or all rows (None)."""

    value: str
    lo: int
    hi: int
    row: int | None = None

    def overlaps(self, other: Region) -> bool:
        same_row = self.row is None or other.row is None or self.row == other.row
        return self.value == other.value and same_row and self.lo < other.hi and other.lo < self.hi


@dataclass(frozen=True)
class Unit:
    """Matmuls tiled together (GLU pairs a gate and an up matmul row for row) and the epilogue ops on their tiles."""

    matmuls: tuple[Op, ...]
    epilogue: tuple[Op, ...]
    rows: int  # output rows of each matmul
    align: int  # tiles start and end on multiples of this (a head, for per-head epilogue ops)


@dataclass(frozen=True)
class Stage:
    kind: TaskKind
    ops: tuple[Op, ...]  # every graph op the stage computes, in graph order
    input: str | None = None  # the value read whole (matvec: the prologue norm's input or the matmuls' input)
    prologue: Op | None = None
    units: tuple[Unit, ...] = ()
    attention: Op | None = None
    n_splits: int = 1  # attention: key chunks per (sequence, KV head)
    # matvec: the attention stage whose split partials its tiles merge into their input (no merge tasks, one
    # handoff fewer per layer); -1: the input is a value in the arena
    merged: int = -1
    # attention with splits: no merge tasks; each (sequence, KV head)'s chunk that arrives last (an arrival counter
    # the kernel adds to) merges the partials, so its consumer waits on the partials alone (one handoff fewer)
    merged_by_last: bool = False


@dataclass(frozen=True)
class Task:
    id: int
    kind: TaskKind
    stage: int
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    deps: tuple[int, ...]
    weight_bytes: int = 0  # bytes of weights (or KV cache, estimated) the task streams: the planner's cost
    unit: int = 0  # matvec: which unit of the stage
    lo: int = 0  # matvec/embed: the tile's output rows; attention: the KV head
    hi: int = 0
    row: int | None = None  # per-sequence tasks: the batch row
    split: int = 0  # attention partial: the key chunk


def value_width(values: dict[str, Value], name: str) -> int:
    """Features per sequence of a value: its dims after batch and step, flattened."""
    return math.prod(int(d) for d in values[name].shape[2:])


KV_MIN_KEYS = 64  # an even split never makes chunks shorter: a task's fixed cost outweighs its fewer keys
# The default split (build_task_graph's kv_splits=-1) at long contexts: a chunk holds at most KV_MAX_KEYS keys, so a
# long sequence spreads over more SMs (flash-decoding), in waves of the splits that fill the SMs once; at most
# KV_MAX_WAVES of them (past that, chunks grow instead). A wave costs every SM one more attention task a layer at
# every step, an empty one at short contexts (it skips its wait and body, but still reads its row and publishes):
# 8 waves is where the 8B's b=8 kernel still keeps 2,048-key chunks at 32K. At batch 1 one wave covers
# n_sms / KV heads x KV_MAX_KEYS keys (32K on an 8B over 132 SMs): more waves only for longer contexts.
KV_MAX_KEYS = 2048
KV_MAX_WAVES = 8
# the context the cost model plans attention tasks for (its placement only): the common short steps, whatever the
# kernel's maximum (a plan tuned for 128K contexts would misplace every short step's tasks)
KV_PLAN_CONTEXT = 4096


@dataclass
class TaskGraph:
    graph: Graph
    batch: int
    max_context: int
    kv_chunk: int
    stages: list[Stage]
    tasks: list[Task] = field(default_factory=list)
    kv_slots: dict[str, tuple[int, str]] = field(default_factory=dict)  # value → (layer, "k" | "v") it appends
    # 0: attention splits its keys into chunks of kv_chunk (a stage has ceil(span / kv_chunk) of them, most empty
    # at short contexts); n: every attention stage has n splits and each step divides its visible keys evenly
    # over kv_fill of them, or over a multiple of kv_fill where that keeps chunks within kv_max_keys (waves)
    # (build_task_graph's -1: kv_fill as many as fill the SMs once, n_sms // (KV heads x batch), times the waves
    # the maximum context needs, at most KV_MAX_WAVES)
    kv_splits: int = 0
    kv_min_keys: int = KV_MIN_KEYS  # an even split's shortest chunk
    kv_fill: int = 0  # the splits of one wave (0: kv_splits, one wave); kv_splits is a multiple of it
    kv_max_keys: int = KV_MAX_KEYS  # with more than one wave: a chunk's most keys, up to the last wave
    # norm_partials: a prologue norm's input → the value of its rows' per-chunk sums of squares (NORM_CHUNK
    # features each), written by the tasks that write the input, read by the norm's tiles
    norm_partials: dict[str, str] = field(default_factory=dict)

    @property
    def kv_waves(self) -> int:
        return self.kv_splits // (self.kv_fill or self.kv_splits) if self.kv_splits else 1

    def chunk_keys(self, span, maximum=max, minimum=min):
        """Keys per attention task when `span` keys are visible (`span` may be a TIR expression: pass tirx.max and
        tirx.min): with kv_splits, the span divided evenly over the fewest waves of kv_fill chunks that keep a chunk
        within kv_max_keys (all of them past that), rounded up to a multiple of a warp's 32 keys (of kv_min_keys when
        that is smaller), at least kv_min_keys. The chunks a step uses, ceil(span / chunk), never exceed kv_splits."""
        if not self.kv_splits:
            return self.kv_chunk
        fill, waves = self.kv_fill or self.kv_splits, self.kv_waves
        parts = fill
        if waves > 1:
            per_wave = fill * self.kv_max_keys
            parts = fill * minimum((span + per_wave - 1) // per_wave, waves)
        align = min(32, self.kv_min_keys)
        even = ((span + parts - 1) // parts + align - 1) // align * align
        return maximum(even, self.kv_min_keys)

    def max_chunk_keys(self, span_max: int) -> int:
        """The most keys one task reads at any span up to span_max (a static bound): within a wave count the chunk
        grows with the span, so the largest is at a wave's last span or at span_max."""
        if not self.kv_splits:
            return self.kv_chunk
        fill = self.kv_fill or self.kv_splits
        ends = {span_max} | {min(span_max, fill * self.kv_max_keys * w) for w in range(1, self.kv_waves)}
        return max(self.chunk_keys(s) for s in ends)

    def active_chunks(self, span, maximum=max, minimum=min):
        """How many chunks hold keys when `span` keys are visible (at most kv_splits; the rest are empty)."""
        chunk = self.chunk_keys(span, maximum, minimum)
        return (span + chunk - 1) // chunk

    def describe(self) -> str:
        """One line per stage: kind, tasks, the ops it fuses (for reading and golden tests)."""
        lines = []
        for i, st in enumerate(self.stages):
            n = sum(t.stage == i for t in self.tasks)
            ops = ", ".join(f"{op.kind}" for op in st.ops)
            lines.append(f"{i:3d} {st.kind:7s} {n:4d} tasks  {ops}")
        return "\n".join(lines)


def kv_cache_value(layer: int, which: str) -> str:
    return f"kvcache:{layer}:{which}"


def split_value(out: str, split: int) -> str:
    return f"{out}#split{split}"


def norm_partial_value(value: str) -> str:
    """The per-chunk sums of squares of `value` (norm_partials): (batch, features / NORM_CHUNK)."""
    return f"{value}#sumsq"


ARGMAX_PARTIAL = "argmax#partial"
# norm_partials: features a sum-of-squares partial covers. Fixed (not a tile's rows), so a row's sum has one order
# whatever the tiling and the batch size: a warp's butterfly over each chunk of 32, then the chunks' sums in order
NORM_CHUNK = 32
MIN_TILE_ROWS = 16  # a tile below a warp's half of rows costs more in its dependency wait than it streams
TOKEN_IDS = "token_ids"


def build_task_graph(graph: Graph, *, batch: int, n_sms: int, max_context: int, kv_chunk: int = 256,
                     kv_splits: int = 0, kv_min_keys: int = KV_MIN_KEYS, fold_merge_floats: int = 0,
                     merge_in_last: bool = False, tiles_per_sm: int = 1,
                     max_tile_rows: int | None = None, balance_waves: bool = False,
                     rope_pairs: bool = False, kv_max_keys: int = KV_MAX_KEYS,
                     kv_max_waves: int = KV_MAX_WAVES, norm_partials: bool = False) -> TaskGraph:
    """The decode step of `graph` for `batch` sequences as tasks for `n_sms` persistent blocks; `max_tile_rows`
    caps a matvec tile (the kernel keeps a tile's outputs in shared memory). `fold_merge_floats` > 0: a matvec
    whose input is a split attention's output (the O projection) merges the partials itself, when the batch's
    inputs take at most that many floats (the kernel stages them in shared memory). `merge_in_last`: split
    attentions that no matvec merges are merged by their last chunk to finish (Stage.merged_by_last). `rope_pairs`:
    q and k tiles may split heads where RoPE pairs neighbouring features (_align). `kv_max_keys`, `kv_max_waves`:
    with kv_splits=-1, a chunk's most keys and the most waves of chunks that keep them so (TaskGraph.chunk_keys).
    `norm_partials`: the tasks writing a prologue norm's input also write each NORM_CHUNK features' sum of squares
    per row (TaskGraph.norm_partials), which the norm's tiles read instead of the whole input's squares."""
    if graph.outputs != (LOGITS,):
        raise UnsupportedError(f"fuse: the megakernel needs a graph whose one output is {LOGITS!r}.")
    if any(op.kind == OpKind.MOE for op in graph.ops):
        raise UnsupportedError("fuse: the megakernel has no tasks for mixture-of-experts layers yet (the router's "
                               "choice would pick the tasks on the device, issue 40); decode runs the per-op kernels.")
    values = graph.values()
    kv_fill = 0
    if kv_splits < 0:  # as many even splits as fill the SMs once: measured on the H200 (benchmarks/README.md,
        # 2026-12-02), with a warp's keys loaded at once a task's time hardly grows with its keys, so fewer, longer
        # tasks win as long as the SMs are filled (b=8: 256-key chunks 2,392 µs a step on the 1B, 1,024-key 2,109,
        # but SmolLM2's 24 (sequence, KV head) pairs in 1,024-key chunks 1,662 against 1,586). A context longer
        # than a wave of kv_max_keys chunks takes more waves of them: the split count grows with the maximum
        # context (up to kv_max_waves), the tasks' keys do not
        heads = max((op.attrs["n_head_kv"] for op in graph.attention_ops()), default=1)
        kv_fill = max(1, n_sms // (heads * batch))
        waves = max(1, min(kv_max_waves, -(-max_context // (kv_fill * kv_max_keys))))
        kv_splits = kv_fill * waves
    stages = _stages(graph, values, max_context, kv_chunk, kv_splits)
    if rope_pairs:
        stages = [dataclasses.replace(st, units=tuple(dataclasses.replace(u, align=_align(u.epilogue, values, True))
                                                      for u in st.units)) for st in stages]
    if fold_merge_floats:
        stages = _fold_merges(stages, values, batch, fold_merge_floats)
    if merge_in_last:
        folded = {st.merged for st in stages}
        stages = [dataclasses.replace(st, merged_by_last=True)
                  if st.kind == TaskKind.ATTN_PARTIAL and st.n_splits > 1 and i not in folded else st
                  for i, st in enumerate(stages)]
    tg = TaskGraph(graph, batch, max_context, kv_chunk, kv_splits=kv_splits, kv_min_keys=kv_min_keys,
                   kv_fill=kv_fill, kv_max_keys=kv_max_keys, stages=stages)
    if norm_partials:
        tg.norm_partials = _norm_partial_values(stages, values)
    for op in graph.attention_ops():
        tg.kv_slots[op.inputs[1]] = (op.attrs["layer"], "k")
        tg.kv_slots[op.inputs[2]] = (op.attrs["layer"], "v")
    _Tiler(tg, values, target_tiles=max(1, n_sms * tiles_per_sm), max_rows=max_tile_rows,
           balance_waves=balance_waves).run()
    return tg


# ---- stages -----------------------------------------------------------------------------------------------------
def _stages(graph: Graph, values: dict[str, Value], max_context: int, kv_chunk: int, kv_splits: int) -> list[Stage]:
    consumers: dict[str, list[Op]] = {}
    for op in graph.ops:
        for name in op.inputs:
            consumers.setdefault(name, []).append(op)
    producer = {op.outputs[0]: op for op in graph.ops}
    done: set[int] = set()  # id() of assigned ops
    stages: list[Stage] = []

    def is_prologue_norm(op: Op) -> bool:  # a whole-row norm read only by matmuls: recomputed in their tiles
        return (op.kind == OpKind.RMS_NORM and len(values[op.inputs[0]].shape) == 3
                and all(c.kind in LINEAR for c in consumers.get(op.outputs[0], ())))

    for op in graph.ops:
        if id(op) in done:
            continue
        if op.kind == OpKind.EMBEDDING:
            stage = Stage(TaskKind.EMBED, (op,))
        elif op.kind in LINEAR:
            stage = _matvec_stage(graph, values, consumers, producer, op, done, is_prologue_norm)
        elif op.kind == OpKind.ATTENTION:
            stage = _attention_stage(op, max_context, kv_chunk, kv_splits)
        elif is_prologue_norm(op):
            done.add(id(op))  # computed inside the tiles of the stage that reads it
            continue
        else:
            epi = _epilogue(graph, {op.outputs[0]}, done | {id(op)}, first=graph.ops.index(op))
            stage = Stage(TaskKind.ROW, (op, *(o for o, _ in epi)), input=op.inputs[0])
        done.update(id(o) for o in stage.ops)
        stages.append(stage)
    return stages


def _norm_partial_values(stages: list[Stage], values: dict[str, Value]) -> dict[str, str]:
    """The prologue norms' inputs whose writers can leave sums of squares (norm_partials): written by embed, matvec
    or row tasks (whole NORM_CHUNK chunks of a row each: the tiler aligns them), of whole chunks."""
    writer = {op.outputs[0]: st.kind for st in stages for op in st.ops}
    out = {}
    for st in stages:
        if st.kind != TaskKind.MATVEC or st.prologue is None or st.merged >= 0:
            continue
        if writer.get(st.input) in (TaskKind.EMBED, TaskKind.MATVEC, TaskKind.ROW) \
                and value_width(values, st.input) % NORM_CHUNK == 0:
            out[st.input] = norm_partial_value(st.input)
    return out


def _fold_merges(stages: list[Stage], values: dict[str, Value], batch: int, max_floats: int) -> list[Stage]:
    """Mark each matvec stage that can merge its split attention input itself (Stage.merged): no prologue norm,
    the attention output read by that stage only, the batch's inputs within max_floats."""
    by_output = {st.attention.outputs[0]: i for i, st in enumerate(stages) if st.kind == TaskKind.ATTN_PARTIAL}
    readers: dict[str, set[int]] = {}
    for i, st in enumerate(stages):
        for op in st.ops:
            for n in op.inputs:
                readers.setdefault(n, set()).add(i)
    out = list(stages)
    for i, st in enumerate(stages):
        a = by_output.get(st.input) if st.kind == TaskKind.MATVEC and st.prologue is None else None
        if a is None or stages[a].n_splits < 2 or readers.get(st.input) != {i}:
            continue
        if batch * value_width(values, st.input) <= max_floats:
            out[i] = dataclasses.replace(st, merged=a)
    return out


def _matvec_stage(graph, values, consumers, producer, first: Op, done: set[int], is_prologue_norm) -> Stage:
    src = first.inputs[0]
    matmuls = [c for c in consumers[src] if c.kind in LINEAR and id(c) not in done]
    norm = producer.get(src)
    prologue = norm if norm is not None and is_prologue_norm(norm) else None
    first_index = min(graph.ops.index(m) for m in matmuls)
    epi = _epilogue(graph, {m.outputs[0] for m in matmuls}, done | {id(m) for m in matmuls}, first_index)
    units = _units(matmuls, epi, values)
    ops = tuple(sorted([*matmuls, *(o for o, _ in epi)], key=graph.ops.index))
    return Stage(TaskKind.MATVEC, ops, input=prologue.inputs[0] if prologue else src, prologue=prologue,
                 units=units)


def _epilogue(graph: Graph, seeds: set[str], taken: set[int], first: int) -> list[tuple[Op, str]]:
    """Row-local ops after op `first` that read at least one seed-derived value and otherwise only values computed
    by earlier stages: (op, the seed-derived input that decides its tile)."""
    have = set(seeds)
    earlier = {o.outputs[0] for o in graph.ops[:first]} | {TOKENS, POSITIONS}
    out = []
    for op in graph.ops[first + 1:]:
        if id(op) in taken or op.kind not in ROW_LOCAL:
            continue
        mine = [n for n in op.inputs if n in have]
        if not mine or any(n not in have and n not in earlier for n in op.inputs):
            continue
        if op.kind == OpKind.RMS_NORM and not _per_head(graph, op):
            continue  # a whole-row norm needs every tile: its own stage
        out.append((op, mine[0]))
        have.add(op.outputs[0])
    return out


def _per_head(graph: Graph, op: Op) -> bool:
    return len(graph.values()[op.inputs[0]].shape) == 4


def _align(epilogue, values: dict[str, Value], rope_pairs: bool) -> int:
    """What a unit's tiles start and end on a multiple of: the features each epilogue op must see together. A head
    for a per-head norm and for NEOX RoPE (it pairs feature i with i + dim/2); with `rope_pairs`, two for the
    original RoPE layout (it pairs 2i with 2i + 1: Llama's q and k tiles may then split heads and spread over every
    SM), else a head for it too."""
    def group(op: Op) -> int:
        if op.kind == OpKind.ROPE and op.attrs["layout"] == "norm" and rope_pairs:
            return 2
        return int(values[op.inputs[0]].shape[-1]) if op.kind in (OpKind.ROPE, OpKind.RMS_NORM) else 1
    return math.lcm(1, *(group(op) for op in epilogue))


def _units(matmuls: list[Op], epi: list[tuple[Op, str]], values: dict[str, Value]) -> tuple[Unit, ...]:
    """Group matmuls that an epilogue op reads together (GLU's gate and up) and give each group its ops."""
    group = {m.outputs[0]: i for i, m in enumerate(matmuls)}  # value → index of a matmul of its unit
    parent = list(range(len(matmuls)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for op, _ in epi:
        first, *rest = sorted({find(group[n]) for n in op.inputs if n in group})
        for r in rest:
            parent[r] = first
        group[op.outputs[0]] = first
    units = []
    for root in sorted({find(i) for i in range(len(matmuls))}):
        ms = tuple(m for i, m in enumerate(matmuls) if find(i) == root)
        rows = {values[m.outputs[0]].shape[-1] for m in ms}
        if len(rows) != 1:
            raise UnsupportedError(f"fuse: matmuls {[m.outputs[0] for m in ms]} are paired by an epilogue op "
                                   "but have different output sizes; the megakernel cannot tile them together.")
        ops = tuple(op for op, _ in epi if find(group[op.outputs[0]]) == root)
        units.append(Unit(ms, ops, rows.pop(), _align(ops, values, rope_pairs=False)))
    return tuple(units)


def _attention_stage(op: Op, max_context: int, kv_chunk: int, kv_splits: int) -> Stage:
    window = int(op.attrs.get("sliding_window") or 0)
    span = min(window, max_context) if window else max_context
    return Stage(TaskKind.ATTN_PARTIAL, (op,), attention=op, n_splits=kv_splits or max(1, -(-span // kv_chunk)))


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


# ---- tasks ------------------------------------------------------------------------------------------------------
class _Tiler:
    def __init__(self, tg: TaskGraph, values: dict[str, Value], target_tiles: int, max_rows: int | None = None,
                 balance_waves: bool = False):
        self.tg, self.values, self.target, self.max_rows = tg, values, target_tiles, max_rows
        self.balance_waves = balance_waves
        self.writers: dict[str, list[tuple[int, Region]]] = {}

    def width(self, name: str) -> int:
        return value_width(self.values, name)

    def add(self, kind: TaskKind, stage: int, reads: list[Region], writes: list[Region], **kw) -> Task:
        for w in list(writes):  # a norm's input: its chunks' sums of squares too (tiles are aligned to chunks)
            if w.value in self.tg.norm_partials:
                assert w.lo % NORM_CHUNK == 0 and w.hi % NORM_CHUNK == 0, (w, "a tile not on whole chunks")
                writes.append(Region(self.tg.norm_partials[w.value], w.lo // NORM_CHUNK, w.hi // NORM_CHUNK, w.row))
        deps = sorted({t for r in reads for t, w in self.writers.get(r.value, ()) if w.overlaps(r)})
        task = Task(len(self.tg.tasks), kind, stage, tuple(reads), tuple(writes), tuple(deps), **kw)
        self.tg.tasks.append(task)
        for w in writes:
            self.writers.setdefault(w.value, []).append((task.id, w))
        return task

    def run(self) -> None:
        for i, st in enumerate(self.tg.stages):
            {TaskKind.EMBED: self.embed, TaskKind.MATVEC: self.matvec, TaskKind.ROW: self.row,
             TaskKind.ATTN_PARTIAL: self.attention}[st.kind](i, st)
        self.argmax()

    def tiles(self, rows: int, align: int, share: float) -> list[tuple[int, int]]:
        n = max(1, round(self.target * share))  # this unit's share of one wave of tiles over the SMs
        step = _round_up(max(-(-rows // n), MIN_TILE_ROWS), align)
        if self.max_rows is not None and step > self.max_rows:
            step = max(align, self.max_rows // align * align)
            if self.balance_waves:  # more tiles than a wave: whole waves of even tiles, not a full one and a few
                # (SmolLM2's LM head at b=8: 171 tiles of 288 rows on 132 SMs ran 2 tiles' time, 263 of 187 run
                # 2 shorter ones)
                capped = -(-rows // step)
                waves = -(-capped // n)
                step = _round_up(-(-rows // (waves * n)), align)
        return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]

    def embed(self, i: int, st: Stage) -> None:
        out = st.ops[0].outputs[0]
        for lo, hi in self.tiles(self.width(out), self.partial_align(1, [out]), 0.25):
            self.add(TaskKind.EMBED, i, [], [Region(out, lo, hi)], lo=lo, hi=hi)

    def matvec(self, i: int, st: Stage) -> None:
        total = sum(u.rows * len(u.matmuls) for u in st.units)
        info = self.tg.graph.weights
        k = self.width(st.input)
        for u_index, unit in enumerate(st.units):
            row_bytes = sum(info[m.weights["weight"]].row_bytes for m in unit.matmuls)
            align = self.partial_align(unit.align, self.local(unit))
            for lo, hi in self.tiles(unit.rows, align, unit.rows * len(unit.matmuls) / total):
                reads = ([Region(split_value(st.input, j), 0, k) for j in range(self.tg.stages[st.merged].n_splits)]
                         if st.merged >= 0 else [Region(st.input, 0, k)])
                if st.prologue is not None and st.input in self.tg.norm_partials:
                    reads.append(Region(self.tg.norm_partials[st.input], 0, k // NORM_CHUNK))
                reads += [Region(n, lo, hi) for op in unit.epilogue for n in op.inputs
                          if n not in self.local(unit) and n != POSITIONS]
                writes = [Region(n, lo, hi) for n in self.local(unit)]
                writes += [Region(kv_cache_value(*self.tg.kv_slots[n]), lo, hi) for n in self.local(unit)
                           if n in self.tg.kv_slots]
                if any(m.kind == OpKind.LM_HEAD for m in unit.matmuls):
                    writes.append(Region(ARGMAX_PARTIAL, lo, hi))
                self.add(TaskKind.MATVEC, i, reads, writes, weight_bytes=(hi - lo) * row_bytes, unit=u_index,
                         lo=lo, hi=hi)

    def partial_align(self, align: int, writes: list[str]) -> int:
        """A tile's alignment: whole NORM_CHUNK chunks where it writes a value with norm partials."""
        return math.lcm(align, NORM_CHUNK) if any(n in self.tg.norm_partials for n in writes) else align

    @staticmethod
    def local(unit: Unit) -> list[str]:
        return [m.outputs[0] for m in unit.matmuls] + [op.outputs[0] for op in unit.epilogue]

    def row(self, i: int, st: Stage) -> None:
        produced = {op.outputs[0] for op in st.ops}
        for b in range(self.tg.batch):
            reads = [Region(n, 0, self.width(n), b) for op in st.ops for n in op.inputs
                     if n not in produced and n != POSITIONS]
            writes = [Region(n, 0, self.width(n), b) for n in produced]
            self.add(TaskKind.ROW, i, reads, writes, row=b)

    def attention(self, i: int, st: Stage) -> None:
        op = st.attention
        q, k, v, _ = op.inputs
        out = op.outputs[0]
        h, hkv = op.attrs["n_head"], op.attrs["n_head_kv"]
        d, dv = self.values[q].shape[-1], self.values[v].shape[-1]
        group = h // hkv
        layer = op.attrs["layer"]
        # the cost model's keys per task (f16 keys and values): a typical step's, half of the planning context
        # (KV_PLAN_CONTEXT), its chunks of them; the chunks it leaves empty cost only the task's overhead
        window = int(op.attrs.get("sliding_window") or 0)
        typical = max(1, min(self.tg.max_context, KV_PLAN_CONTEXT, window or self.tg.max_context) // 2)
        if st.n_splits == 1:
            keys, used = typical, 1
        else:
            keys = self.tg.chunk_keys(typical)
            used = -(-typical // keys)
        pairs = [(b, g) for b in range(self.tg.batch) for g in range(hkv)]

        def reads(b: int, g: int) -> list[Region]:
            return [Region(q, g * group * d, (g + 1) * group * d, b),
                    Region(kv_cache_value(layer, "k"), g * d, (g + 1) * d, b),
                    Region(kv_cache_value(layer, "v"), g * dv, (g + 1) * dv, b)]

        def out_region(b: int, g: int, name: str = out) -> Region:
            return Region(name, g * group * dv, (g + 1) * group * dv, b)

        if st.n_splits == 1:
            for b, g in pairs:
                self.add(TaskKind.ATTN_PARTIAL, i, reads(b, g), [out_region(b, g)], weight_bytes=2 * keys * (d + dv),
                         lo=g, hi=g + 1, row=b)
            return
        # split-major: chunk j of every (sequence, KV head) before chunk j + 1 of any, so the chunks a short step
        # uses (the first ones) are planned over distinct SMs, and the later waves' after them
        parts: dict[tuple[int, int], list[Task]] = {pair: [] for pair in pairs}
        for j in range(st.n_splits):
            for b, g in pairs:
                # merged by the last: every chunk may be the one that writes the output
                merged = [out_region(b, g)] if st.merged_by_last else []
                parts[(b, g)].append(self.add(TaskKind.ATTN_PARTIAL, i, reads(b, g),
                                              [out_region(b, g, split_value(out, j)), *merged],
                                              weight_bytes=2 * keys * (d + dv) if j < used else 0,
                                              lo=g, hi=g + 1, row=b, split=j))
        if st.merged_by_last or any(s.merged == i for s in self.tg.stages):
            return  # merged by the last chunk, or by the consumer's tiles
        for b, g in pairs:
            self.add(TaskKind.ATTN_MERGE, i, [w for t in parts[(b, g)] for w in t.writes], [out_region(b, g)],
                     lo=g, hi=g + 1, row=b)

    def argmax(self) -> None:
        vocab = self.width(LOGITS)
        for b in range(self.tg.batch):
            self.add(TaskKind.ARGMAX, len(self.tg.stages) - 1, [Region(ARGMAX_PARTIAL, 0, vocab, b)],
                     [Region(TOKEN_IDS, 0, 1, b)], row=b)
