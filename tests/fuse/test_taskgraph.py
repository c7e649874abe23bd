"""The megakernel's task graph on tiny models of every architecture: executed task by task in float64 (in random
and adversarial block interleavings, every read checked against what was written), its logits and greedy ids must
equal the oracle's for sequences of different lengths decoded together; dropping a dependency must be caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from luce_compile.fuse.plan import CostModel, plan_queues
from luce_compile.fuse.simulate import ScheduleError, TaskSimulator
from luce_compile.fuse.taskgraph import NORM_CHUNK, Region, TaskKind, build_task_graph, value_width
from luce_compile.graph.ir import LOGITS
from luce_compile.graph.oracle import Oracle
from luce_compile.graph.registry import open_graph
from luce_compile.synthetic import cached_synthetic, preset

pytestmark = pytest.mark.unit

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]
MAX_CONTEXT, CHUNK = 40, 8  # several key chunks per sequence, and gemma3's window of 8 slides within the steps


def setup(name: str, batch: int, n_sms: int = 6, kv_splits: int = 0, fold: bool = False, last: bool = False,
          chunk: int = CHUNK, norm_partials: bool = False):
    path = cached_synthetic(preset(name))
    graph, _ = open_graph(path)
    tg = build_task_graph(graph, batch=batch, n_sms=n_sms, max_context=MAX_CONTEXT, kv_chunk=chunk,
                          kv_splits=kv_splits, kv_min_keys=4, fold_merge_floats=10**6 if fold else 0,
                          merge_in_last=last, norm_partials=norm_partials)
    assert not fold or any(st.merged >= 0 for st in tg.stages)
    if last:  # no merge tasks: every split attention is merged by its last chunk
        assert any(st.merged_by_last for st in tg.stages) and not any(t.kind == TaskKind.ATTN_MERGE
                                                                      for t in tg.tasks)
    plan = plan_queues(tg, CostModel(n_sms=n_sms))
    return path, graph, tg, plan


def prefill_kv(oracle: Oracle, graph, prompt: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The oracle's keys and values of every attention over the prompt (its own run, one sequence)."""
    env = oracle.run(np.asarray([prompt]), np.arange(len(prompt)).reshape(1, -1))
    kv = {}
    for op in graph.attention_ops():
        for name in op.inputs[1:3]:
            kv[name] = env[name][0].reshape(len(prompt), -1)
    oracle.n_past = len(prompt)
    return kv, env[LOGITS][0, -1]


def assert_decodes_like_oracle(path, graph, sim: TaskSimulator, rng, batch: int, steps: int, vocab: int = 49152,
                               prompt_len=lambda b: 3 + 4 * b, adversarial=lambda step: step % 3 == 2) -> None:
    """Each sequence's prompt (prompt_len(b) random tokens) prefilled by its own oracle and its keys loaded into the
    simulator, then `steps` greedy steps decoded together: every step's logits within 1e-10 of the oracle's and
    its ids equal (adversarial(step): the simulator's adversarial block interleaving that step)."""
    oracles, last = [], []
    for b in range(batch):
        oracle = Oracle(path)
        kv, logits = prefill_kv(oracle, graph, [int(t) for t in rng.integers(0, vocab, prompt_len(b))])
        sim.load_prefix(b, kv)
        oracles.append(oracle)
        last.append(logits)
    for step in range(steps):
        tokens = [int(np.argmax(x)) for x in last]
        got, ids = sim.step(tokens, seed=step, adversarial=adversarial(step))
        last = [o.decode(t) for o, t in zip(oracles, tokens, strict=True)]
        for b in range(batch):
            err = np.max(np.abs(got[b] - last[b])) / np.max(np.abs(last[b]))
            assert err < 1e-10, (step, b, err)
            assert ids[b] == int(np.argmax(last[b]))


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("kv_splits", "fold", "last"), [(0, False, False), (3, False, False), (3, True, False),
                                                     (3, False, True)],
                         ids=["chunks-of-8", "3-even-splits", "3-splits-merged-by-o-proj", "3-splits-merged-by-last"])
def test_task_graph_decodes_like_the_oracle(name, batch, kv_splits, fold, last, rng):
    path, graph, tg, plan = setup(name, batch, kv_splits=kv_splits, fold=fold, last=last)
    sim = TaskSimulator(tg, plan, Oracle(path))
    # sequences of different lengths: 3, 7, 11 prompt tokens
    assert_decodes_like_oracle(path, graph, sim, rng, batch, steps=10)


@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize(("kv_splits", "fold", "last", "chunk"),
                         [(0, False, False, 4), (3, True, False, CHUNK), (3, False, True, CHUNK)],
                         ids=["chunks-of-4", "3-splits-merged-by-o-proj", "3-splits-merged-by-last"])
def test_sliding_window_rows_decode_past_the_window_at_every_batch(batch, kv_splits, fold, last, chunk, rng):
    """gemma3 (window 8 on two of its three layers) at the engine's batch sizes: prompts of 5 to 26 tokens (most
    already past the window, all of them past it within the steps) decoded together for 12 steps. A sliding row
    sees its last 8 keys, a global row all of them, in chunks that start at the window's first key: every step's
    logits are the oracle's."""
    path, graph, tg, plan = setup("tiny-gemma3", batch, kv_splits=kv_splits, fold=fold, last=last, chunk=chunk)
    windows = {int(st.attention.attrs.get("sliding_window") or 0) for st in tg.stages if st.attention is not None}
    assert windows == {0, 8}
    sim = TaskSimulator(tg, plan, Oracle(path))
    assert_decodes_like_oracle(path, graph, sim, rng, batch, steps=12, prompt_len=lambda b: 5 + 3 * b)


@pytest.mark.parametrize(("kv_splits", "fold", "last"), [(0, False, False), (3, True, False), (3, False, True)],
                         ids=["chunks-of-8", "3-splits-merged-by-o-proj", "3-splits-merged-by-last"])
def test_sliding_window_verify_rows_after_rollbacks_inside_the_window(kv_splits, fold, last, rng):
    """Speculation on gemma3 (window 8) on the megakernel: a sequence longer than the window verifies 5 rows a step,
    the last 3 are rejected (rolled back, as the engine's popn: the next step writes over their slots) and the next
    step's rows verify from the kept history. Each row's logits must be the oracle's after that history and the
    rows before it: a row windows the keys by its own position, and never reads a rejected key (the simulator
    refuses a read of this step's slots before this step wrote them)."""
    batch, keep = 5, 2
    path, graph, tg, plan = setup("tiny-gemma3", batch, kv_splits=kv_splits, fold=fold, last=last)
    sim = TaskSimulator(tg, plan, Oracle(path), sequence_of_row=[0] * batch)
    oracle = Oracle(path)
    history = [int(t) for t in rng.integers(0, 49152, 12)]
    kv, _ = prefill_kv(oracle, graph, history)
    sim.load_prefix(0, kv)
    for step in range(5):
        fed = [int(t) for t in rng.integers(0, 49152, batch)]
        start = sim.length[0]
        got, ids = sim.step(fed, seed=step, adversarial=step % 2 == 1)
        want = oracle.forward(fed)
        for j in range(batch):
            err = np.max(np.abs(got[j] - want[j])) / np.max(np.abs(want[j]))
            assert err < 1e-10, (step, j, err)
            assert ids[j] == int(np.argmax(want[j]))
        sim.length[0] = start + keep  # the rejected rows' keys stay in their slots until overwritten
        history += fed[:keep]
        oracle.prefill(history)
    assert sim.length[0] == len(history) == 12 + 5 * keep


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("kv_splits", "fold", "last"), [(0, False, False), (3, True, False), (3, False, True)],
                         ids=["chunks-of-8", "3-splits-merged-by-o-proj", "3-splits-merged-by-last"])
def test_norm_partials_decode_like_the_oracle(name, batch, kv_splits, fold, last, rng):
    """norm_partials: every prologue norm's input is written with its chunks' sums of squares (by the embedding,
    the residual adds, gemma's post-norm rows), each tile on whole chunks, and every normed tile reads all of them
    for its 1/rms (n_sms=7: the unaligned tiles the option rounds up)."""
    path, graph, tg, plan = setup(name, batch, n_sms=7, kv_splits=kv_splits, fold=fold, last=last,
                                  norm_partials=True)
    normed = [st for st in tg.stages if st.kind == TaskKind.MATVEC and st.prologue is not None]
    assert normed and all(st.input in tg.norm_partials for st in normed)
    for t in tg.tasks:
        for w in t.writes:
            if w.value in tg.norm_partials:
                assert w.lo % NORM_CHUNK == 0 and w.hi % NORM_CHUNK == 0
                assert Region(tg.norm_partials[w.value], w.lo // NORM_CHUNK, w.hi // NORM_CHUNK, w.row) in t.writes
        st = tg.stages[t.stage]
        if t.kind == TaskKind.MATVEC and st.prologue is not None:
            k = value_width(graph.values(), st.input)
            assert Region(tg.norm_partials[st.input], 0, k // NORM_CHUNK) in t.reads
    sim = TaskSimulator(tg, plan, Oracle(path))
    assert_decodes_like_oracle(path, graph, sim, rng, batch, steps=6)


def test_norm_partials_cover_each_row_once_in_the_same_chunks_at_every_batch():
    """A row's sum of squares has one order whatever the batch: the chunks its writers leave are the same NORM_CHUNK
    grid at batch 1 and 8 (only the tiles' rows differ), each written by exactly one task a row."""
    path = cached_synthetic(preset("tiny-llama"))
    graph, _ = open_graph(path)
    grids = []
    for batch in (1, 8):
        tg = build_task_graph(graph, batch=batch, n_sms=5, max_context=MAX_CONTEXT, kv_chunk=CHUNK, kv_min_keys=4,
                              norm_partials=True, max_tile_rows=64 // batch)
        grid = {}
        for t in tg.tasks:
            for w in t.writes:
                if w.value.endswith("#sumsq"):
                    for c in range(w.lo, w.hi):
                        key = (w.value, c)
                        grid[key] = grid.get(key, 0) + 1
        width = {p: value_width(graph.values(), x) // NORM_CHUNK for x, p in tg.norm_partials.items()}
        assert set(grid) == {(p, c) for p, n in width.items() for c in range(n)} and set(grid.values()) == {1}
        grids.append(grid)
    assert grids[0] == grids[1]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_q_and_k_tiles_split_heads_only_where_rope_pairs_neighbours(name, rng):
    """rope_pairs: Llama's RoPE ("norm" layout) pairs features 2i and 2i + 1, so its q and k tiles may split a head
    and the QKV stage spreads over every SM; NEOX RoPE (Qwen2) pairs i with i + dim/2 and keeps whole heads. Either
    way the step decodes as the oracle does."""
    path = cached_synthetic(dataclasses.replace(preset(name), n_embd=256, n_head=4, n_head_kv=2))  # heads of 64
    graph, _ = open_graph(path)
    d = graph.config.head_dim

    def roped_tiles(rope_pairs: bool):
        tg = build_task_graph(graph, batch=2, n_sms=48, max_context=MAX_CONTEXT, kv_chunk=CHUNK, kv_min_keys=4,
                              rope_pairs=rope_pairs)
        qkv = tg.stages[1]
        roped = [u for u in qkv.units if any(op.kind == "rope" for op in u.epilogue)]
        assert len(roped) == 2
        return tg, [(t.lo, t.hi) for t in tg.tasks if t.stage == 1 and qkv.units[t.unit] in roped]

    _, whole = roped_tiles(False)
    assert all(lo % d == 0 and hi % d == 0 for lo, hi in whole)
    tg, tiles = roped_tiles(True)
    plan = plan_queues(tg, CostModel(n_sms=48))
    split = [lo for lo, hi in tiles if lo % d or hi % d]
    if name == "tiny-llama":
        assert split and all(lo % 2 == 0 and hi % 2 == 0 for lo, hi in tiles)
    else:
        assert not split
    sim = TaskSimulator(tg, plan, Oracle(path))
    assert_decodes_like_oracle(path, graph, sim, rng, batch=2, steps=4, prompt_len=lambda b: 5 + 3 * b,
                               adversarial=lambda step: step % 2 == 1)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("fold", "last"), [(False, False), (True, False), (False, True)],
                         ids=["merge-tasks", "merged-by-o-proj", "merged-by-last"])
def test_dropping_any_dependency_is_caught(name, fold, last, rng):
    path, graph, tg, _ = setup(name, batch=2, fold=fold, last=last)
    # one task per SM and the highest ready id first: a task runs as soon as its declared deps allow
    plan = plan_queues(tg, CostModel(n_sms=len(tg.tasks)))
    # at position 0 only the first key chunk holds a key: the others skip their wait (the kernel's early exit), so
    # their dependencies are not needed this step
    needed = [t for t in tg.tasks if t.deps and not (t.kind == TaskKind.ATTN_PARTIAL and t.split > 0)]
    for victim in rng.choice(needed, size=4, replace=False):
        tasks = list(tg.tasks)
        tasks[victim.id] = dataclasses.replace(victim, deps=())
        broken = dataclasses.replace(tg, tasks=tasks)
        sim = TaskSimulator(broken, plan, Oracle(path))
        with pytest.raises(ScheduleError, match="before it is written"):
            sim.step([1, 2], adversarial=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])  # the megakernel's (no sliding window)
@pytest.mark.parametrize(("kv_splits", "fold", "last"), [(0, False, False), (3, True, False), (3, False, True)],
                         ids=["chunks-of-8", "3-splits-merged-by-o-proj", "3-splits-merged-by-last"])
def test_rows_of_one_sequence_verify_like_decoding_them_in_turn(name, kv_splits, fold, last, rng):
    """A speculative verify on the megakernel (Engine.verify): the last token and the drafts of one sequence as the
    rows of one step, at consecutive positions of the same pages. Each row's logits must be the oracle's after
    decoding the tokens one by one, in any block interleaving: a row's attention reads the keys the rows before it
    append in the same step, which the simulator checks were written first. The engine pads a verify to the
    kernel's batch by repeating the last row (same token and position): that row must give the last row's logits."""
    batch = 5
    path, graph, tg, plan = setup(name, batch, kv_splits=kv_splits, fold=fold, last=last)
    sim = TaskSimulator(tg, plan, Oracle(path), sequence_of_row=[0] * batch)
    oracle = Oracle(path)
    kv, _ = prefill_kv(oracle, graph, [int(t) for t in rng.integers(0, 49152, 6)])
    sim.load_prefix(0, kv)
    for step in range(4):
        fed = [int(t) for t in rng.integers(0, 49152, batch)]
        real = batch - (step == 3)  # the last step: 4 real rows and the 4th repeated
        fed[real:] = [fed[real - 1]] * (batch - real)
        start = sim.length[0]
        positions = [start + min(j, real - 1) for j in range(batch)]
        got, ids = sim.step(fed, positions=positions, seed=step, adversarial=step % 2 == 1)
        for j in range(real):
            want = oracle.decode(fed[j])
            err = np.max(np.abs(got[j] - want)) / np.max(np.abs(want))
            assert err < 1e-10, (step, j, err)
            assert ids[j] == int(np.argmax(want))
        for j in range(real, batch):
            # equal up to numpy's float64 rounding (BLAS may block a matrix's last row differently)
            assert np.max(np.abs(got[j] - got[real - 1])) <= 1e-12 * np.max(np.abs(got[real - 1]))
            assert ids[j] == ids[real - 1]
        assert sim.length[0] == start + real


def _path(parents: list[int], node: int) -> list[int]:
    """The nodes from the tree's root to `node`."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])  # the megakernel's (no sliding window)
@pytest.mark.parametrize(("kv_splits", "fold", "last", "chunk"),
                         [(0, False, False, 4), (3, True, False, CHUNK), (3, False, True, CHUNK)],
                         ids=["chunks-of-4", "3-splits-merged-by-o-proj", "3-splits-merged-by-last"])
def test_rows_of_a_token_tree_verify_like_each_path_decoded_alone(name, kv_splits, fold, last, chunk, rng):
    """Tree verify on the megakernel (Engine.verify_tree): a tree's nodes as the rows of one step, node i at the
    i-th slot after the sequence (as TVM lays a tree out), with its off_path word (the runtime's encoding). Row i's
    logits must be the oracle's after node i's root-to-node path run as a chain (Oracle.tree_forward), in any block
    interleaving. Then the accepted path is moved to consecutive slots (TVM's commit) and the next tree verifies
    from there. Chunks of 4 keys: the first tree's last node sees a whole chunk of its siblings' keys only (a partial
    that must weigh nothing); the last tree has 5 nodes and a padding row repeating the 5th."""
    from luce_runtime.megakernel import off_path_words

    batch = 6
    path, graph, tg, plan = setup(name, batch, kv_splits=kv_splits, fold=fold, last=last, chunk=chunk)
    sim = TaskSimulator(tg, plan, Oracle(path), sequence_of_row=[0] * batch)
    oracle = Oracle(path)
    kv, _ = prefill_kv(oracle, graph, [int(t) for t in rng.integers(0, 49152, 7)])
    sim.load_prefix(0, kv)
    # (parents, the node whose path is accepted): node 5's slots 8..11 hold its siblings' branch (a chunk of 4);
    # two branches from the root, the second one accepted (its slots are not the first ones); a padded tree
    trees = [([-1, 0, 1, 2, 3, 0], 4), ([-1, 0, 0, 1, 2, 3], 4), ([-1, 0, 1, 0, 3], 4)]
    for step, (parents, leaf) in enumerate(trees):
        n = len(parents)
        fed = [int(t) for t in rng.integers(0, 49152, n)]
        start = sim.length[0]
        rows = [*range(n), *[n - 1] * (batch - n)]
        words = off_path_words(parents)
        got, ids = sim.step([fed[i] for i in rows], positions=[start + i for i in rows],
                            off_path=[int(words[i]) for i in rows], seed=step, adversarial=step % 2 == 1)
        want = oracle.tree_forward(fed, parents)
        for i in range(n):
            err = np.max(np.abs(got[i] - want[i])) / np.max(np.abs(want[i]))
            assert err < 1e-10, (step, i, err)
            assert ids[i] == int(np.argmax(want[i]))
        for j in range(n, batch):  # equal up to numpy's float64 rounding, as the chain verify's padding
            assert np.max(np.abs(got[j] - got[n - 1])) <= 1e-12 * np.max(np.abs(got[n - 1]))
        accepted = _path(parents, leaf)
        sim.commit_path(0, [start + i for i in accepted])
        oracle.forward([fed[i] for i in accepted])
        assert sim.length[0] == oracle.n_past


def test_a_verify_row_reading_keys_not_yet_appended_is_caught(rng):
    """The check the test above leans on: an attention task that does not wait on the key/value tiles reads this
    step's keys before they are written, and the simulator says so (verify rows of one sequence)."""
    path, graph, tg, _ = setup("tiny-llama", batch=3)
    plan = plan_queues(tg, CostModel(n_sms=len(tg.tasks)))  # a task runs as soon as its declared deps allow
    kv_writers = {t.id for t in tg.tasks if any(w.value.startswith("kvcache:") for w in t.writes)}
    tasks = [dataclasses.replace(t, deps=tuple(d for d in t.deps if d not in kv_writers))
             if t.kind == TaskKind.ATTN_PARTIAL else t for t in tg.tasks]
    kv, _ = prefill_kv(Oracle(path), graph, [int(t) for t in rng.integers(0, 49152, 5)])
    caught = 0
    for seed in range(8):  # random interleavings (the adversarial one runs the key/value tiles before the queries')
        sim = TaskSimulator(dataclasses.replace(tg, tasks=tasks), plan, Oracle(path), sequence_of_row=[0, 0, 0])
        sim.load_prefix(0, kv)
        try:
            sim.step([1, 2, 3], seed=seed)
        except ScheduleError as e:
            assert "before this step wrote them" in str(e)
            caught += 1
    assert caught >= 4, caught


def test_fusions_and_plan_shape():
    _, graph, tg, plan = setup("tiny-gemma3", batch=2, n_sms=8)
    kinds = [st.kind for st in tg.stages]
    per_layer = graph.config.n_layer
    # gemma3 per layer: QKV (norm, q/k norm, RoPE, scale fused), attention, O-proj, post-norm + residual, gate/up
    # + GeGLU, down-proj, post-norm + residual; then the LM head with its softcap
    assert kinds.count(TaskKind.MATVEC) == 4 * per_layer + 1 and kinds.count(TaskKind.ROW) == 2 * per_layer
    qkv = tg.stages[1]
    assert qkv.prologue is not None and [op.kind.value for op in qkv.ops].count("rope") == 2
    # q and k tiles hold whole heads (q/k norm and RoPE are per head); v's tiles need not
    assert [u.align for u in qkv.units] == [graph.config.head_dim, graph.config.head_dim, 1]
    glu = next(st for st in tg.stages if any(op.kind == "glu" for op in st.ops))
    assert len(glu.units) == 1 and len(glu.units[0].matmuls) == 2  # gate and up tiled row for row
    # sliding layers attend through fewer key chunks than the global one
    splits = [st.n_splits for st in tg.stages if st.kind == TaskKind.ATTN_PARTIAL]
    assert splits == [1, 1, MAX_CONTEXT // CHUNK]
    plan.check(tg)
    assert plan.critical_path <= plan.makespan
    assert sum(t.kind == TaskKind.ARGMAX for t in tg.tasks) == 2


@pytest.mark.parametrize("balance", [False, True])
def test_capped_tiles_fill_whole_waves(balance, rng):
    """A unit capped (max_tile_rows) to more tiles than the SMs: with balance_waves its tiles come in whole waves of
    even tiles under the cap (not one full wave and a few stragglers that double the stage's time), and the step
    still decodes as the oracle does."""
    path = cached_synthetic(preset("tiny-llama"))
    graph, _ = open_graph(path)
    n_sms, cap = 7, 4096  # 12 capped tiles of the 49,152-row LM head on 7 SMs: one wave and 5 more
    tg = build_task_graph(graph, batch=2, n_sms=n_sms, max_context=MAX_CONTEXT, kv_chunk=CHUNK, kv_min_keys=4,
                          max_tile_rows=cap, balance_waves=balance)
    head = [t for t in tg.tasks if t.kind == TaskKind.MATVEC and t.stage == len(tg.stages) - 1]
    vocab = graph.config.n_vocab
    assert sorted((t.lo, t.hi) for t in head)[-1][1] == vocab and all(t.hi - t.lo <= cap for t in head)
    unbalanced = -(-vocab // cap)
    assert unbalanced % n_sms, "the test needs a cap that leaves a partial wave"
    if balance:
        waves = -(-unbalanced // n_sms)
        assert max(t.hi - t.lo for t in head) == -(-vocab // (waves * n_sms))
        assert len(head) > unbalanced and len(head) <= waves * n_sms
    else:
        assert len(head) == unbalanced
    plan = plan_queues(tg, CostModel(n_sms=n_sms))
    sim = TaskSimulator(tg, plan, Oracle(path))
    assert_decodes_like_oracle(path, graph, sim, rng, batch=2, steps=1, vocab=vocab, adversarial=lambda step: True)


# ---- long contexts: more key chunks as the context grows, each within a cap ------------------------------------
LONG_CONTEXT, MAX_KEYS = 160, 8  # 20 chunks of the cap: past kv_max_waves (8) waves of 2 chunks, chunks grow


def long_graph(batch: int, n_sms: int = 8, last: bool = True, fold: bool = False, max_context: int = LONG_CONTEXT):
    """tiny-llama's default split (kv_splits=-1) on n_sms SMs with a key cap of MAX_KEYS: at batch 2 one wave is
    8 // (2 KV heads x 2) = 2 chunks a (sequence, KV head), as many as the default split made before; a long
    context takes up to 8 waves of them (16 chunks)."""
    path = cached_synthetic(preset("tiny-llama"))
    graph, _ = open_graph(path)
    tg = build_task_graph(graph, batch=batch, n_sms=n_sms, max_context=max_context, kv_splits=-1, kv_min_keys=4,
                          kv_max_keys=MAX_KEYS, merge_in_last=last, fold_merge_floats=10**6 if fold else 0)
    return path, graph, tg


def test_chunks_cover_every_span_within_the_cap_in_python_and_in_tir():
    """For every span up to the maximum context: the step's chunks (the first ceil(span / chunk) of the stage's)
    cover exactly its keys, never more of them than the stage has, each at least kv_min_keys and within kv_max_keys
    until every wave is in use (then they grow); max_chunk_keys bounds them all; and the TIR expressions the kernel
    computes them with (tirx.max/min, floor division) give the same numbers."""
    from tvm import tirx
    from tvm.sym import Analyzer

    _, _, tg = long_graph(batch=2)
    assert (tg.kv_fill, tg.kv_waves, tg.kv_splits) == (2, 8, 16)
    n_splits = {st.n_splits for st in tg.stages if st.kind == TaskKind.ATTN_PARTIAL}
    assert n_splits == {16}
    x = tirx.Var("span", "int32")
    chunk_tir, active_tir = tg.chunk_keys(x, tirx.max, tirx.min), tg.active_chunks(x, tirx.max, tirx.min)
    bound = tg.max_chunk_keys(LONG_CONTEXT)
    for span in range(1, LONG_CONTEXT + 1):
        chunk, active = tg.chunk_keys(span), tg.active_chunks(span)
        assert (active - 1) * chunk < span <= active * chunk and active <= tg.kv_splits
        assert tg.kv_min_keys <= chunk <= bound
        if span <= tg.kv_splits * MAX_KEYS:
            assert chunk <= MAX_KEYS, span
        if span > tg.kv_fill * MAX_KEYS:  # past one wave: more chunks than the default split had
            assert active > tg.kv_fill
        analyzer = Analyzer()
        analyzer.bind(x, tirx.const(span, "int32"))
        assert int(analyzer.simplify(chunk_tir)) == chunk and int(analyzer.simplify(active_tir)) == active
    assert tg.active_chunks(128) == tg.kv_splits  # every chunk in use
    # one wave is enough below fill x cap: the split count of a short maximum context is the old one
    _, _, short = long_graph(batch=2, max_context=16)
    assert (short.kv_splits, short.kv_waves) == (2, 1)


@pytest.mark.parametrize(("last", "fold"), [(True, False), (False, False), (False, True)],
                         ids=["merged-by-last", "merge-tasks", "merged-by-o-proj"])
def test_long_contexts_decode_like_the_oracle_over_many_chunks(last, fold, rng):
    """Two sequences at 40 and 130 cached tokens decoded together (context 160, chunks of at most 8 keys): the first
    over 6 chunks, the second over 11-12 of 12 keys (every wave in use, its chunks past the cap), where the default
    split used 2 before;
    the empty chunks skip their waits (the simulator runs them at once, adversarially first), and chunk 0 counts
    them for merge_in_last's arrival. Logits and ids as the oracle's at every step."""
    path, graph, tg = long_graph(batch=2, last=last, fold=fold)
    assert not fold or any(st.merged >= 0 for st in tg.stages)
    plan = plan_queues(tg, CostModel(n_sms=8))
    sim = TaskSimulator(tg, plan, Oracle(path))
    oracles, logits = [], []
    for b, n in enumerate((40, 130)):
        oracle = Oracle(path)
        kv, first = prefill_kv(oracle, graph, [int(t) for t in rng.integers(0, 49152, n)])
        sim.load_prefix(b, kv)
        oracles.append(oracle)
        logits.append(first)
    for step in range(3):
        spans = [sim.length[b] + 1 for b in range(2)]
        used = [tg.active_chunks(s) for s in spans]
        assert used[0] > tg.kv_fill and used[1] > tg.kv_splits // 2 and tg.chunk_keys(spans[1]) > MAX_KEYS
        tokens = [int(np.argmax(x)) for x in logits]
        got, ids = sim.step(tokens, seed=step, adversarial=step % 2 == 1)
        logits = [o.decode(t) for o, t in zip(oracles, tokens, strict=True)]
        for b in range(2):
            assert np.max(np.abs(got[b] - logits[b])) / np.max(np.abs(logits[b])) < 1e-10, (step, b)
            assert ids[b] == int(np.argmax(logits[b]))


def test_an_8b_shaped_model_keeps_its_chunks_within_the_cap_at_32k():
    """The 8B's attention (8 KV heads) on 132 SMs, built for its 131,072-token context: at batch 1 one wave of 16
    chunks holds 32K keys in chunks of 2,048, 128K takes 4 waves of them; at batch 8 (2 chunks a wave) 32K takes 8
    waves of 2,048 and 128K's chunks grow to 8,192 past the last wave. The kernel's attention tasks stay within
    kv_max_waves a layer and SM, and the cost model plans every stage at the short context it did before."""
    from luce_compile.fuse.taskgraph import KV_MAX_KEYS, KV_MAX_WAVES

    spec = dataclasses.replace(preset("tiny-llama"), n_head=32, n_head_kv=8, n_embd=256, n_layer=1)
    graph, _ = open_graph(cached_synthetic(spec))
    sizes = {}
    for batch in (1, 8):
        tg = build_task_graph(graph, batch=batch, n_sms=132, max_context=131072, kv_splits=-1, merge_in_last=True)
        attention = [t for t in tg.tasks if t.kind == TaskKind.ATTN_PARTIAL]
        assert len(attention) <= KV_MAX_WAVES * 132
        sizes[batch] = (tg.kv_fill, tg.kv_waves, tg.chunk_keys(32768), tg.chunk_keys(131072))
        four_k = build_task_graph(graph, batch=batch, n_sms=132, max_context=4096, kv_splits=-1, merge_in_last=True)
        assert four_k.kv_waves == 1 and four_k.chunk_keys(4096) == tg.chunk_keys(4096)
        # the cost model's estimate per chunk is a 2,048-key step's, the chunks it does not use are empty
        assert {t.weight_bytes for t in attention} == {t.weight_bytes for t in four_k.tasks
                                                       if t.kind == TaskKind.ATTN_PARTIAL} | {0}
    assert sizes == {1: (16, 4, KV_MAX_KEYS, KV_MAX_KEYS), 8: (2, 8, KV_MAX_KEYS, 4 * KV_MAX_KEYS)}


def test_a_long_contexts_chunks_spread_evenly_over_the_sms():
    """The 8B's attention built for 131,072 tokens, planned at the cost model's short context: at every context a
    step may have, the chunks that hold keys (the first `active` of each (sequence, KV head)) lie on the SMs as
    evenly as their count allows. Placed by cost, the chunks empty at the planning context cost only the task
    overhead and piled onto the few SMs idle there: 34 of 2,048 keys each on 4 SMs at b=8 and 32K (7 at b=1 and
    128K), so that stage lasted 34 chunks, not 8."""
    spec = dataclasses.replace(preset("tiny-llama"), n_head=32, n_head_kv=8, n_embd=256, n_layer=1)
    graph, _ = open_graph(cached_synthetic(spec))
    for batch in (1, 8):
        tg = build_task_graph(graph, batch=batch, n_sms=132, max_context=131072, kv_splits=-1, merge_in_last=True)
        plan = plan_queues(tg, CostModel(n_sms=132))
        plan.check(tg)
        sm_of = {t: sm for sm, queue in enumerate(plan.queues) for t in queue}
        for context in (512, 4096, 32768, 131072):
            active = tg.active_chunks(context)
            on = [sm_of[t.id] for t in tg.tasks if t.kind == TaskKind.ATTN_PARTIAL and t.split < active]
            most = max(on.count(sm) for sm in set(on))
            assert most == -(-len(on) // 132), (batch, context, most, len(on))
