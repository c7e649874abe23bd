"""The megakernel's program: a planned task graph as the tables and memory layout the persistent kernel reads.

Layers that compute the same thing become one **opcode** (Hazy's opcode interpreter): stages whose ops, shapes,
attributes, weight types and tiles are equal up to the layer share their code in the kernel, and their weights are
stacked along a leading layer axis, so the kernel takes a few dozen buffers however deep the model is. What differs
from layer to layer is in each task's row of the **task table**: which stacked layer it reads, which KV layer it
appends to, and the arena offsets of the values it reads and writes.

Memory, all plain tensors the runtime owns:
  arena      float32: every value one stage writes and another reads, (batch, features) each, at a fixed offset;
             attention's split partials (o unnormalized, and the running max / sum per head) too
  pages      the KV pool, TVM's paged layout per layer (layers, pages, 2, kv_heads, page_size, head_dim) with a
             page table (batch, pages per sequence) and each sequence's length (= the new token's position)
  counters   int32, one per stage, one per group and one per task; a task adds 1 to its own, its stage's and its
             group's (if any) when done. A consumer waits until a counter reaches count x epoch (epoch = the step's
             1-based launch number: monotonic, never reset; MPK's events). Attention merged by its last chunk
             (Stage.merged_by_last) has one arrival counter per (sequence, KV head): each chunk adds 1 before it
             publishes, and the one that brings it to n_splits x epoch merges
  argmax     each LM-head tile's best logit and index per sequence; the last task per sequence reduces them

A task depends on a whole stage (its counter reaches the stage's task count), on a few tasks of it (their own
counters), or on many tasks of its own stage (attention's merge on its key chunks: a **group** counter those tasks
also add to; the stage's counter would count the waiting task itself and never arrive): fuse/taskgraph.py derives
the exact set from the regions, this module picks the cheaper wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from luce_compile.errors import UnsupportedError
from luce_compile.fuse.plan import CostModel, Plan, plan_queues
from luce_compile.fuse.taskgraph import (
    ARGMAX_PARTIAL,
    KV_MIN_KEYS,
    NORM_CHUNK,
    Stage,
    TaskGraph,
    TaskKind,
    build_task_graph,
    value_width,
)
from luce_compile.graph.ir import LOGITS, POSITIONS, TOKENS, Graph

# task table columns (then one arena offset per operand slot of the task's opcode: inputs, then outputs)
(OPCODE, LAYER, KV_LAYER, LO, HI, ROW, SPLIT, UNIT, TILE, DEP_START, DEP_COUNT, COUNTER, STAGE_COUNTER,
 GROUP_COUNTER, ARRIVAL) = range(15)
FIXED_COLUMNS = 15
FEW_DEPS = 8  # at most this many tasks of a stage: wait on each one's counter; more: on the stage's counter
ALIGN = 4  # arena offsets in float32 elements (16 bytes: vector loads)
PROFILE_CLOCKS = 6  # per task: wait begins, body begins, task ends, then the body's phases (emit_cuda `phase`)
SHARED_FLOATS = 11 * 1024  # the kernel's static shared memory, float32 words (44 KiB of 48)


@dataclass
class Opcode:
    index: int
    kind: TaskKind
    stages: tuple[int, ...]  # the stages it runs, one per layer it covers, in order (stacked weight index = position)
    inputs: tuple[str, ...]  # arena values it reads, named as in its first stage (slot order)
    outputs: tuple[str, ...]  # arena values it writes, named as in its first stage
    weights: tuple[str, ...]  # weight tensors of its first stage (slot order); each stacked over `stages`
    max_rows: tuple[int, ...] = ()  # matvec: the largest tile of each unit

    @property
    def stage(self) -> int:
        return self.stages[0]

    def slot(self, name: str) -> int:
        """The task-table column (after the fixed ones) holding value `name`'s arena offset."""
        return FIXED_COLUMNS + (self.inputs + self.outputs).index(name)


@dataclass
class AttentionPartials:
    o: int  # arena offset of (batch, splits, heads * dv), unnormalized sums of p·v
    ml: int  # arena offset of (batch, splits, heads, 2): running max and sum of exp per head


@dataclass
class Program:
    tg: TaskGraph
    plan: Plan
    opcodes: list[Opcode]
    stage_opcode: list[int]
    arena: dict[str, int]  # value → offset (float32 elements)
    arena_size: int
    partials: dict[int, AttentionPartials]  # attention stage → its split partials
    lm_tiles: int  # LM-head tiles: the argmax partials' second dimension
    tasks: np.ndarray  # (n_sms, max queue, columns) int32
    queue_len: np.ndarray  # (n_sms,) int32
    deps: np.ndarray  # (n, 2) int32: (counter, count per epoch)
    n_counters: int
    page_size: int
    kv: dict = field(default_factory=dict)  # n_layers, kv_heads, head_dim of the pool
    values: dict = field(default_factory=dict)  # the graph's value types (graph.values() infers them: once)
    param_names: list[str] = field(default_factory=list)  # the compiled kernel's arguments, in order (fuse/build.py)
    param_dtypes: dict[str, str] = field(default_factory=dict)  # tensor arguments' dtypes (fuse/build.py)
    resources: list = field(default_factory=list)  # the compiled kernel's KernelResources, per arch (fuse/build.py)
    # q8_activations: the stages whose 8-bit input and tile values do not fit shared memory in some program of the
    # build (fuse/build.py sets it from all of them, so every batch size decides alike); None: this program's own
    q8_misfits: frozenset[int] | None = None

    @property
    def graph(self) -> Graph:
        return self.tg.graph

    @property
    def batch(self) -> int:
        return self.tg.batch

    @property
    def has_groups(self) -> bool:
        """Whether any task adds to a group counter (the kernel then publishes to it)."""
        return bool((self.tasks[..., GROUP_COUNTER] >= 0).any())

    def width(self, name: str) -> int:
        return _width(self.tg, self.values, name)

    def stacked_tensors(self, opcode: int, slot: int) -> list[str]:
        """The GGUF tensors stacked into weight `slot` of `opcode`, one per stage it runs (the stack's order)."""
        return [_weights(self.tg.stages[s])[slot] for s in self.opcodes[opcode].stages]

    def weight_args(self) -> list[tuple[str, int, int]]:
        """(argument name, opcode, slot) of every stacked weight, in kernel argument order."""
        return [(f"w{o.index}_{s}", o.index, s) for o in self.opcodes for s in range(len(o.weights))]


def build_program(graph: Graph, *, batch: int, n_sms: int, max_context: int, kv_chunk: int = 256,
                  kv_splits: int = 0, kv_min_keys: int = KV_MIN_KEYS, fold_merge: bool = False,
                  merge_in_last: bool = False, page_size: int = 16,
                  cost: CostModel | None = None, max_tile_bytes: int = 36 * 1024,
                  balance_waves: bool = False, rope_pairs: bool = False, norm_partials: bool = False) -> Program:
    """Plan the decode step of `graph` for `batch` sequences on `n_sms` persistent blocks; `fold_merge`: the O
    projection's tiles merge split attention partials themselves when the batch's input fits half the kernel's
    shared memory (where a matvec stages its input); `merge_in_last`: the other split attentions are merged by
    their last chunk to finish, not by merge tasks; `balance_waves`: a unit whose tiles are capped (max_tile_bytes)
    to more than a wave over the SMs takes whole waves of even tiles; `rope_pairs`: q and k tiles may split heads
    where RoPE pairs neighbouring features; `norm_partials`: a prologue norm's writers leave its rows' sums of
    squares by chunk (TaskGraph.norm_partials), arena values read by the norm's tiles."""
    tg = build_task_graph(graph, batch=batch, n_sms=n_sms, max_context=max_context, kv_chunk=kv_chunk,
                          kv_splits=kv_splits, kv_min_keys=kv_min_keys, merge_in_last=merge_in_last,
                          fold_merge_floats=SHARED_FLOATS // 2 if fold_merge else 0,
                          max_tile_rows=max_tile_bytes // (4 * batch * 4), balance_waves=balance_waves,
                          rope_pairs=rope_pairs, norm_partials=norm_partials)
    plan = plan_queues(tg, cost or CostModel(n_sms=n_sms))
    values = graph.values()
    stage_values = [_stage_values(tg, st) for st in tg.stages]
    stage_opcode, opcodes = _opcodes(tg, values, stage_values)
    arena, size, partials = _arena(tg, values, opcodes, stage_values)
    kv = _kv_shape(graph, values)
    lm_tiles = _lm_tiles(tg)
    prog = Program(tg, plan, opcodes, stage_opcode, arena, size, partials, len(lm_tiles), np.zeros(0), np.zeros(0),
                   np.zeros(0), 0, page_size, kv, values)
    _tables(prog, stage_values, lm_tiles)
    return prog


def _lm_tiles(tg: TaskGraph) -> dict[int, int]:
    """LM-head task id → its tile's column in the argmax partials (the argmax tasks that share the LM head's stage
    are not tiles)."""
    tiles: dict[int, int] = {}
    for t in tg.tasks:
        if t.kind == TaskKind.MATVEC and any(w.value == ARGMAX_PARTIAL for w in t.writes):
            tiles[t.id] = len(tiles)
    return tiles


# ---- opcodes ----------------------------------------------------------------------------------------------------
def _stage_values(tg: TaskGraph, st: Stage) -> tuple[list[str], list[str]]:
    """A stage's external inputs (values other stages write) and the values it produces, in first-use order."""
    ops = ([st.prologue] if st.prologue is not None else []) + list(st.ops)
    produced = [o for op in ops for o in op.outputs]
    ins: list[str] = []
    if st.kind == TaskKind.MATVEC:
        ins.append(st.input)
        if st.prologue is not None and st.input in tg.norm_partials:
            ins.append(tg.norm_partials[st.input])
    for op in ops:
        if st.kind == TaskKind.ATTN_PARTIAL:
            ins += [op.inputs[0]]  # q; keys and values come from the cache
            break
        for n in op.inputs:
            if n not in produced and n not in (TOKENS, POSITIONS) and n not in ins:
                ins.append(n)
    return ins, produced + [tg.norm_partials[n] for n in produced if n in tg.norm_partials]


def _signature(tg: TaskGraph, index: int, values) -> tuple:
    st = tg.stages[index]
    names: dict[str, str] = {}

    def canon(n: str) -> str:
        return n if n in (TOKENS, POSITIONS) else names.setdefault(n, f"v{len(names)}")

    ops = ([st.prologue] if st.prologue is not None else []) + list(st.ops)
    sig_ops = tuple(
        (op.kind, tuple(canon(n) for n in op.inputs), tuple(canon(n) for n in op.outputs),
         tuple(sorted((k, repr(v)) for k, v in op.attrs.items() if k != "layer")),
         tuple((r, tg.graph.weights[w].ggml_type.name, tg.graph.weights[w].shape)
               for r, w in sorted(op.weights.items())),
         tuple(values[n].shape for n in op.inputs))
        for op in ops)
    units = tuple((tuple(ops.index(m) for m in u.matmuls), tuple(ops.index(e) for e in u.epilogue), u.rows, u.align)
                  for u in st.units)
    kv = tuple(sorted((canon(n), w) for n, (_, w) in tg.kv_slots.items() if n in names))
    tiles = tuple((t.kind, t.unit, t.lo, t.hi, t.row, t.split) for t in tg.tasks if t.stage == index)
    # a matvec that merges attention partials: the attention's geometry decides the merge (stages whose attentions
    # differ, gemma's sliding and global layers, need their own opcodes)
    merged = _signature(tg, st.merged, values) if st.merged >= 0 else None
    partials = tuple(c for n, c in names.items() if n in tg.norm_partials)  # the values it writes or reads sums of
    return (st.kind, sig_ops, units, kv, st.n_splits, tiles, st.prologue is not None, merged, st.merged_by_last,
            partials)


def _weights(st: Stage) -> tuple[str, ...]:
    ops = ([st.prologue] if st.prologue is not None else []) + list(st.ops)
    return tuple(w for op in ops for _, w in sorted(op.weights.items()))


def _opcodes(tg: TaskGraph, values, stage_values) -> tuple[list[int], list[Opcode]]:
    groups: dict[tuple, list[int]] = {}
    for i in range(len(tg.stages)):
        groups.setdefault(_signature(tg, i, values), []).append(i)
    stage_opcode = [0] * len(tg.stages)
    opcodes = []
    readers: dict[str, set[int]] = {}
    for i, (ins, _) in enumerate(stage_values):
        for n in ins:
            readers.setdefault(n, set()).add(i)
    for stages in groups.values():
        st = tg.stages[stages[0]]
        ins, produced = stage_values[stages[0]]
        outs = [n for n in produced if readers.get(n, set()) - {stages[0]} or n == LOGITS]
        rows = tuple(max(t.hi - t.lo for t in tg.tasks if t.stage == stages[0] and t.unit == u)
                     for u in range(len(st.units))) if st.kind == TaskKind.MATVEC else ()
        op = Opcode(len(opcodes), st.kind, tuple(stages), tuple(ins), tuple(outs), _weights(st), rows)
        for s in stages:
            stage_opcode[s] = op.index
        opcodes.append(op)
    # the final argmax is its own opcode (its tasks carry the LM head's stage number)
    opcodes.append(Opcode(len(opcodes), TaskKind.ARGMAX, (), (), (), ()))
    return stage_opcode, opcodes


def _arena(tg: TaskGraph, values, opcodes: list[Opcode],
           stage_values) -> tuple[dict[str, int], int, dict[int, AttentionPartials]]:
    arena: dict[str, int] = {}
    size = 0

    def take(n: int) -> int:
        nonlocal size
        off, size = size, size + -(-n // ALIGN) * ALIGN
        return off

    for op in opcodes:
        for s in op.stages:
            for n in stage_values[s][0] + _outputs_of(op, stage_values, s):
                if n not in arena:
                    arena[n] = take(tg.batch * _width(tg, values, n))
    partials = {}
    for i, st in enumerate(tg.stages):
        if st.kind == TaskKind.ATTN_PARTIAL and st.n_splits > 1:
            a = st.attention.attrs
            dv = int(values[st.attention.inputs[2]].shape[-1])
            h = a["n_head"]
            partials[i] = AttentionPartials(take(tg.batch * st.n_splits * h * dv), take(tg.batch * st.n_splits * h * 2))
    return arena, size, partials


def _width(tg: TaskGraph, values, name: str) -> int:
    """Floats a row of an arena value: a norm partial's (norm_partials) one a chunk of its value."""
    if name.endswith("#sumsq"):
        base = next(x for x, p in tg.norm_partials.items() if p == name)
        return value_width(values, base) // NORM_CHUNK
    return value_width(values, name)


def _outputs_of(op: Opcode, stage_values, stage: int) -> list[str]:
    """Opcode `op`'s output slots, named as in `stage` (the same positions in that stage's produced values)."""
    first, mine = stage_values[op.stage][1], stage_values[stage][1]
    return [mine[first.index(n)] for n in op.outputs]


def _kv_shape(graph: Graph, values) -> dict:
    attn = graph.attention_ops()
    shapes = {(op.attrs["n_head_kv"], int(values[op.inputs[1]].shape[-1]), int(values[op.inputs[2]].shape[-1]))
              for op in attn}
    if len(shapes) != 1:
        raise UnsupportedError(f"fuse: the megakernel's KV pool needs one (kv heads, head dim) for every layer, got "
                               f"{sorted(shapes)}; build with --no-megakernel.")
    hkv, d, dv = shapes.pop()
    if d != dv:
        raise UnsupportedError(f"fuse: keys and values of different sizes ({d}, {dv}) do not fit TVM's page layout; "
                               "build with --no-megakernel.")
    return {"n_layers": 1 + max(op.attrs["layer"] for op in attn), "kv_heads": hkv, "head_dim": d}


# ---- tables -----------------------------------------------------------------------------------------------------
def _tables(prog: Program, stage_values, lm_tile: dict[int, int]) -> None:
    tg = prog.tg
    stage_tasks: dict[int, list[int]] = {}
    for t in tg.tasks:
        stage_tasks.setdefault(t.stage, []).append(t.id)
    argmax_ids = {t.id for t in tg.tasks if t.kind == TaskKind.ARGMAX}
    for t in argmax_ids:  # argmax tasks carry the LM head's stage number: count them apart
        stage_tasks[tg.tasks[t].stage].remove(t)
    n_stages = len(tg.stages) + 1  # + the argmax pseudo-stage
    stage_of = {t.id: t.stage for t in tg.tasks}
    for t in argmax_ids:
        stage_of[t] = len(tg.stages)
    stage_tasks[len(tg.stages)] = sorted(argmax_ids)
    groups: dict[tuple[int, ...], int] = {}  # many tasks of the waiting task's own stage → their group counter
    group_of: dict[int, int] = {}
    for t in tg.tasks:
        mine = tuple(sorted(d for d in t.deps if stage_of[d] == stage_of[t.id]))
        if len(mine) > FEW_DEPS and len(mine) != len(stage_tasks[stage_of[t.id]]):
            g = groups.setdefault(mine, len(groups))
            for d in mine:
                if group_of.setdefault(d, g) != g:
                    raise UnsupportedError("fuse: a task belongs to two dependency groups; plan with fewer splits")
    arrival: dict[tuple[int, int, int], int] = {}  # (stage, sequence, KV head) → its arrival counter
    for t in tg.tasks:
        if t.kind == TaskKind.ATTN_PARTIAL and tg.stages[t.stage].merged_by_last:
            arrival.setdefault((t.stage, t.row, t.lo), n_stages + len(groups) + len(arrival))
    first_task = n_stages + len(groups) + len(arrival)
    n_slots = max((len(o.inputs) + len(o.outputs) for o in prog.opcodes), default=0)
    width = FIXED_COLUMNS + n_slots
    q_max = max((len(q) for q in prog.plan.queues), default=0)
    tasks = np.zeros((len(prog.plan.queues), max(1, q_max), width), np.int32)
    deps: list[tuple[int, int]] = []
    for sm, queue in enumerate(prog.plan.queues):
        for i, tid in enumerate(queue):
            t = tg.tasks[tid]
            row = tasks[sm, i]
            stage = stage_of[tid]
            op = prog.opcodes[-1] if tid in argmax_ids else prog.opcodes[prog.stage_opcode[stage]]
            row[OPCODE], row[LO], row[HI] = op.index, t.lo, t.hi
            row[ROW], row[UNIT] = -1 if t.row is None else t.row, t.unit
            row[SPLIT] = -1 if t.kind == TaskKind.ATTN_MERGE else t.split  # attention's merge runs in its opcode
            row[TILE] = lm_tile.get(tid, 0)
            row[COUNTER], row[STAGE_COUNTER] = first_task + tid, stage
            row[GROUP_COUNTER] = n_stages + group_of[tid] if tid in group_of else -1
            row[ARRIVAL] = arrival.get((t.stage, t.row, t.lo), -1)  # keys only of merged-by-last attention stages
            if op.stages:
                row[LAYER] = op.stages.index(stage)
                st = tg.stages[stage]
                layers = [tg.kv_slots[n][0] for n in stage_values[stage][1] if n in tg.kv_slots]
                if st.attention is not None:
                    layers.append(st.attention.attrs["layer"])
                row[KV_LAYER] = layers[0] if layers else 0
                for j, n in enumerate(stage_values[stage][0] + _outputs_of(op, stage_values, stage)):
                    row[FIXED_COLUMNS + j] = prog.arena[n]
            row[DEP_START] = len(deps)
            by_stage: dict[int, list[int]] = {}
            for d in t.deps:
                by_stage.setdefault(stage_of[d], []).append(d)
            for s, ds in sorted(by_stage.items()):
                if tuple(sorted(ds)) in groups:
                    deps.append((n_stages + groups[tuple(sorted(ds))], len(ds)))
                elif len(ds) == len(stage_tasks[s]) or len(ds) > FEW_DEPS:  # a later stage: its whole count
                    deps.append((s, len(stage_tasks[s])))
                else:
                    deps += [(first_task + d, 1) for d in ds]
            row[DEP_COUNT] = len(deps) - row[DEP_START]
    prog.tasks = tasks
    prog.queue_len = np.array([len(q) for q in prog.plan.queues], np.int32)
    prog.deps = np.array(deps or [(0, 0)], np.int32).reshape(-1, 2)
    prog.n_counters = first_task + len(tg.tasks)


def profile_summary(p: Program, prof: np.ndarray) -> dict:
    """One step's task clocks (blocks, tasks, PROFILE_CLOCKS) from the GPU's global timer (ns), summarized: per
    opcode, tasks, mean wait and body time, the longest body (and the body's phases where it stamps them); per stage
    (by opcode, means over the layers): the handoff, from the previous stage's last task's end to this stage's first
    body, and the stage's span, from that first body to its last task's end; the step's span (the device time of
    the step) and each SM's mean time in bodies and in waits."""
    per: dict = {}
    stage_times: dict[int, tuple[float, float]] = {}  # stage → (first body start, last end)
    stage_ops: dict[int, set[int]] = {}  # stage → the opcodes its tasks ran
    busy = []
    for sm in range(len(p.queue_len)):
        n = int(p.queue_len[sm])
        if not n:
            continue
        t = (prof[sm, :n] - prof[prof > 0].min()).astype(np.float64) / 1e3  # ns → µs
        busy.append((t[-1, 2] - t[0, 0], float((t[:, 2] - t[:, 1]).sum()), float((t[:, 1] - t[:, 0]).sum())))
        for i in range(n):
            op = p.opcodes[int(p.tasks[sm, i, 0])]
            key = f"op{op.index} {op.kind}"
            d = per.setdefault(key, [0, 0.0, 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0])
            d[0] += 1
            d[1] += t[i, 1] - t[i, 0]
            d[2] += t[i, 2] - t[i, 1]
            d[8] = max(d[8], t[i, 2] - t[i, 1])
            if t.shape[1] > 5 and prof[sm, i, 3] and prof[sm, i, 5]:  # the body's phases (emit_cuda `phase`)
                d[3] += 1
                d[4] += t[i, 3] - t[i, 1]  # input
                d[5] += t[i, 4] - t[i, 3]  # main loop
                d[6] += t[i, 5] - t[i, 4]  # epilogue
                d[7] += t[i, 2] - t[i, 5]  # writes
            s = int(p.tasks[sm, i, STAGE_COUNTER])
            first, last = stage_times.get(s, (np.inf, -np.inf))
            stage_times[s] = (min(first, t[i, 1]), max(last, t[i, 2]))
            stage_ops.setdefault(s, set()).add(op.index)
    stages: dict = {}
    prev_end = 0.0
    for s in sorted(stage_times):
        first, last = stage_times[s]
        key = "+".join(f"op{o} {p.opcodes[o].kind}" for o in sorted(stage_ops[s]))
        d = stages.setdefault(key, [0, 0.0, 0.0])
        d[0] += 1
        d[1] += first - prev_end
        d[2] += last - first
        prev_end = last
    span, body, wait = (float(np.max([b[0] for b in busy])), float(np.mean([b[1] for b in busy])),
                        float(np.mean([b[2] for b in busy])))
    return {"clock": "globaltimer", "span_us": round(span, 1), "mean_sm_body_us": round(body, 1),
            "mean_sm_wait_us": round(wait, 1),
            "opcodes": {k: {"tasks": v[0], "wait_us": round(v[1] / v[0], 2), "body_us": round(v[2] / v[0], 2),
                            "body_max_us": round(v[8], 2)}
                        | ({"phases_us": {"input": round(v[4] / v[3], 2), "main": round(v[5] / v[3], 2),
                                          "epilogue": round(v[6] / v[3], 2), "writes": round(v[7] / v[3], 2)}}
                           if v[3] else {})
                        for k, v in per.items()},
            "stages": {k: {"stages": v[0], "handoff_us": round(v[1] / v[0], 2), "span_us": round(v[2] / v[0], 2)}
                       for k, v in stages.items()}}
