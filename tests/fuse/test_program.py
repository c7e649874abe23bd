"""The megakernel's program tables on tiny models of every architecture: the counter protocol the kernel runs
(a block waits until each of its task's counters reaches count x epoch, then bumps its task's and its stage's)
completes every task of several steps in any block interleaving, and every task waits for at least the tasks the
task graph says it depends on."""

from __future__ import annotations

import numpy as np
import pytest

from luce_compile.fuse import program as P
from luce_compile.graph.registry import open_graph
from luce_compile.synthetic import cached_synthetic, preset

pytestmark = pytest.mark.unit

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]


def run_protocol(prog: P.Program, epochs: int, rng: np.random.Generator) -> list[int]:
    """Execute the queues with the kernel's counter protocol; returns the order tasks finished in."""
    counters = np.zeros(prog.n_counters, np.int64)
    order: list[int] = []
    for epoch in range(1, epochs + 1):
        heads = np.zeros(len(prog.queue_len), np.int64)
        done = 0
        while done < int(prog.queue_len.sum()):
            ready = []
            for sm in range(len(prog.queue_len)):
                if heads[sm] >= prog.queue_len[sm]:
                    continue
                row = prog.tasks[sm, heads[sm]]
                deps = prog.deps[row[P.DEP_START]:row[P.DEP_START] + row[P.DEP_COUNT]]
                if all(counters[c] >= n * epoch for c, n in deps):
                    ready.append(sm)
            assert ready, f"deadlock at epoch {epoch} after {done} tasks"
            sm = ready[int(rng.integers(len(ready)))]
            row = prog.tasks[sm, heads[sm]]
            counters[row[P.COUNTER]] += 1
            counters[row[P.STAGE_COUNTER]] += 1
            if row[P.GROUP_COUNTER] >= 0:
                counters[row[P.GROUP_COUNTER]] += 1
            order.append(int(row[P.COUNTER]) - (prog.n_counters - len(prog.tg.tasks)))
            heads[sm] += 1
            done += 1
    return order


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kv_splits", [0, 12], ids=["chunks-of-8", "12-splits-merge-waits-on-a-group"])
def test_counter_protocol_runs_every_task_after_its_dependencies(name, batch, kv_splits, rng):
    graph, _ = open_graph(cached_synthetic(preset(name)))
    prog = P.build_program(graph, batch=batch, n_sms=5, max_context=40, kv_chunk=8, kv_splits=kv_splits)
    assert not kv_splits or (prog.tasks[..., P.GROUP_COUNTER] >= 0).any()
    order = run_protocol(prog, epochs=3, rng=rng)
    n = len(prog.tg.tasks)
    assert sorted(order) == sorted(list(range(n)) * 3)
    for e in range(3):
        finished = {t: i for i, t in enumerate(order[e * n:(e + 1) * n])}
        for t in prog.tg.tasks:
            assert all(finished[d] < finished[t.id] for d in t.deps), f"task {t.id} ran before a dependency"


def test_operand_offsets_name_each_layers_own_values():
    graph, _ = open_graph(cached_synthetic(preset("tiny-gemma3")))
    prog = P.build_program(graph, batch=2, n_sms=4, max_context=40, kv_chunk=8)
    offsets = set(prog.arena.values())
    seen = set()
    for sm in range(len(prog.queue_len)):
        for row in prog.tasks[sm, :prog.queue_len[sm]]:
            op = prog.opcodes[row[P.OPCODE]]
            for j in range(len(op.inputs) + len(op.outputs)):
                assert row[P.FIXED_COLUMNS + j] in offsets
                seen.add(int(row[P.FIXED_COLUMNS + j]))
    assert len(seen) > len(graph.attention_ops()) * 3  # every layer reads and writes its own values


@pytest.mark.parametrize("name", PRESETS)
def test_each_row_decodes_back_to_its_task(name):
    """A row's opcode and stacked-layer index name the task's stage; its tile, sequence and split are the task's;
    its operand offsets are the arena offsets of that stage's own values; its KV layer is its attention's."""
    graph, _ = open_graph(cached_synthetic(preset(name)))
    prog = P.build_program(graph, batch=2, n_sms=5, max_context=40, kv_chunk=8)
    first_task = prog.n_counters - len(prog.tg.tasks)
    inverse = {off: n for n, off in prog.arena.items()}
    for sm in range(len(prog.queue_len)):
        for row in prog.tasks[sm, :prog.queue_len[sm]]:
            task = prog.tg.tasks[row[P.COUNTER] - first_task]
            op = prog.opcodes[row[P.OPCODE]]
            if task.kind == "argmax":
                assert op.kind == "argmax" and row[P.ROW] == task.row
                continue
            assert op.stages[row[P.LAYER]] == task.stage and row[P.STAGE_COUNTER] == task.stage
            assert (row[P.LO], row[P.HI], row[P.UNIT]) == (task.lo, task.hi, task.unit)
            assert row[P.ROW] == (-1 if task.row is None else task.row)
            assert row[P.SPLIT] == (-1 if task.kind == "attn_merge" else task.split)
            stage = prog.tg.stages[task.stage]
            ins, produced = P._stage_values(prog.tg, stage)
            names = [inverse[int(o)] for o in row[P.FIXED_COLUMNS:P.FIXED_COLUMNS + len(op.inputs) + len(op.outputs)]]
            assert names[:len(op.inputs)] == ins and set(names[len(op.inputs):]) <= set(produced)
            if stage.attention is not None:
                assert row[P.KV_LAYER] == stage.attention.attrs["layer"]


@pytest.mark.parametrize("batch", [1, 3])
def test_every_argmax_partial_column_is_one_lm_head_tile(batch):
    """The final argmax scans prog.lm_tiles columns: each must be written by exactly one LM-head tile (a column no
    tile writes reads as logit 0 at token 0 and wins whenever a sequence's logits are all negative)."""
    graph, _ = open_graph(cached_synthetic(preset("tiny-llama")))
    prog = P.build_program(graph, batch=batch, n_sms=5, max_context=40, kv_chunk=8)
    lm_rows = [row for sm in range(len(prog.queue_len)) for row in prog.tasks[sm, :prog.queue_len[sm]]
               if prog.opcodes[row[P.OPCODE]].kind == "matvec" and "LM_HEAD" in
               {op.kind.name for op in prog.tg.stages[prog.opcodes[row[P.OPCODE]].stage].ops}]
    assert sorted(int(r[P.TILE]) for r in lm_rows) == list(range(prog.lm_tiles))


def test_profile_summary_reads_spans_waits_and_bodies_from_task_clocks():
    """Clocks laid out by hand (every block runs its tasks back to back: 1 us of wait, then a body of 2 us, from
    t = 1000 ns): the step's span, the per-opcode means and each block's busy time come out as laid out."""
    graph, _ = open_graph(cached_synthetic(preset("tiny-llama")))
    prog = P.build_program(graph, batch=1, n_sms=4, max_context=40, kv_chunk=8)
    clocks = np.zeros((len(prog.queue_len), prog.tasks.shape[1], P.PROFILE_CLOCKS), np.int64)
    for sm, n in enumerate(prog.queue_len):
        for i in range(int(n)):
            start = 1000 + 3000 * i
            clocks[sm, i, :3] = (start, start + 1000, start + 3000)
    out = P.profile_summary(prog, clocks)
    longest = int(prog.queue_len.max())
    assert out["span_us"] == pytest.approx(3.0 * longest)
    assert out["mean_sm_wait_us"] == pytest.approx(np.mean([1.0 * n for n in prog.queue_len if n]))
    assert sum(v["tasks"] for v in out["opcodes"].values()) == int(prog.queue_len.sum())
    assert all(v["wait_us"] == pytest.approx(1.0) and v["body_us"] == pytest.approx(2.0)
               for v in out["opcodes"].values())
    assert sum(v["stages"] for v in out["stages"].values()) == len({int(s) for s in prog.tasks[..., P.STAGE_COUNTER][
        np.arange(prog.tasks.shape[1])[None, :] < prog.queue_len[:, None]]})


@pytest.mark.parametrize("name", PRESETS)
def test_each_split_attention_merged_by_its_last_chunk_has_one_arrival_counter(name):
    """merge_in_last: the chunks of one (sequence, KV head) share an arrival counter that no other task and no
    dependency uses (the kernel's last arrival merges on it: any other add would make a chunk merge early or never);
    the O projection then waits for the chunks themselves."""
    graph, _ = open_graph(cached_synthetic(preset(name)))
    prog = P.build_program(graph, batch=2, n_sms=5, max_context=40, kv_chunk=8, merge_in_last=True)
    first_task = prog.n_counters - len(prog.tg.tasks)
    rows = [row for sm in range(len(prog.queue_len)) for row in prog.tasks[sm, :prog.queue_len[sm]]]
    by_counter: dict[int, set] = {}
    for row in rows:
        task = prog.tg.tasks[row[P.COUNTER] - first_task]
        split = task.kind == "attn_partial" and prog.tg.stages[task.stage].n_splits > 1
        assert (row[P.ARRIVAL] >= 0) == split and task.kind != "attn_merge"
        if split:
            by_counter.setdefault(int(row[P.ARRIVAL]), set()).add((task.stage, task.row, task.lo, task.split))
    taken = {int(c) for c in prog.deps[:, 0]} | {int(r[c]) for r in rows
                                                  for c in (P.COUNTER, P.STAGE_COUNTER, P.GROUP_COUNTER)}
    assert by_counter and not set(by_counter) & taken
    assert all(c < first_task for c in by_counter)
    for chunks in by_counter.values():
        (stage, row, head), = {c[:3] for c in chunks}
        assert len(chunks) == prog.tg.stages[stage].n_splits
    assert len(by_counter) == len({v for v in map(frozenset, by_counter.values())})
