"""luce_runtime.kv_pages: TVM's KV pages as the megakernel reads them (layer tensors, page ids), checked on a CPU
engine against the float64 oracle's rotated keys and values: what the probe reports is where the cache really
holds each sequence's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.codegen._reference import rel_err

pytestmark = pytest.mark.e2e


def _pages(engine):
    from luce_runtime.kv_pages import KVPages

    c = engine.config
    return KVPages(engine._kv.cache, int(c["n_layer"]), int(c["n_head_kv"]), int(c["head_dim"]), engine.page_size,
                   engine.max_context, engine.contract.kv_dtype)


def test_page_ids_and_layer_pages_hold_each_sequences_keys_and_values(tiny, engine_of, oracle_of, rng):
    from luce_compile.graph.ir import OpKind

    model = tiny("tiny-qwen2")
    engine, oracle = engine_of(model), oracle_of(model)
    pages = _pages(engine)
    prompts = [rng.integers(0, engine.vocab_size, n).tolist() for n in (37, 16, 5)]
    seqs = [engine.add_sequence() for _ in prompts]
    try:
        engine.prefill(seqs, prompts)
        ids = [pages.page_ids(s, len(p)) for s, p in zip(seqs, prompts, strict=True)]
        assert [len(i) for i in ids] == [3, 1, 1]
        flat = [p for i in ids for p in i]
        assert len(set(flat)) == len(flat)  # no page holds two sequences' tokens
        layers = [t.numpy() for t in pages.layers]
        assert pages.layer_offsets()[0] == 0 and len(set(pages.layer_offsets().tolist())) == len(layers)
        attention = [op for op in oracle.graph.ops if op.kind == OpKind.ATTENTION]
        worst = 0.0
        for seq, prompt, page_ids in zip(seqs, prompts, ids, strict=True):
            oracle.reset()
            n = len(prompt)
            env = oracle.run(np.array([prompt]), np.arange(n).reshape(1, n))
            slots = pages.slots(seq, 0, n)
            assert [int(s) // engine.page_size for s in slots[::engine.page_size]] == page_ids
            for op in attention:
                held = layers[op.attrs["layer"]][slots // engine.page_size, :, :, slots % engine.page_size]
                for which, name in enumerate(op.inputs[1:3]):  # keys (rotated), then values
                    want = env[name].reshape(n, held.shape[2], -1)
                    worst = max(worst, rel_err(held[:, which], want))
        print(f"pages vs the oracle's keys and values: {worst:.2e}")
        assert worst <= 1e-5, worst
    finally:
        for s in seqs:
            engine.remove_sequence(s)


def test_a_fork_shares_its_parents_full_pages(tiny, engine_of, rng):
    model = tiny("tiny-llama")
    engine = engine_of(model)
    pages = _pages(engine)
    parent = engine.add_sequence()
    try:
        engine.prefill([parent], [rng.integers(0, engine.vocab_size, 40).tolist()])
        child = engine.fork_sequence(parent, 32)
        try:
            assert pages.page_ids(child, 32) == pages.page_ids(parent, 40)[:2]
        finally:
            engine.remove_sequence(child)
    finally:
        engine.remove_sequence(parent)


class _WritesKeysAndValues:
    """A stand-in for the CUDA megakernel on a CPU engine: each step writes the oracle's keys and values of the new
    token into the slot the engine gave it (pages[row][position // page size]), as the kernel does, and records
    the positions it was given."""

    def __init__(self, engine, env: dict, attention: list):
        self.engine, self.env, self.attention = engine, env, attention
        self.positions: list[int] = []

    def step(self, tokens, lengths, pages, kv_pages, kv_layer_offset, *, logits=True, allowed=None, off_path=None,
             batch=None):
        ps = self.engine.page_size
        layers = self.engine._pages.layers
        for row, n in enumerate(lengths):
            page, slot = pages[row][n // ps], n % ps
            self.positions.append(n)
            for op in self.attention:
                held = layers[op.attrs["layer"]].numpy()
                for which, name in enumerate(op.inputs[1:3]):
                    value = self.env[name].reshape(self.env[name].shape[1], held.shape[2], -1)[n]
                    held[page, which, :, slot] = value.astype(held.dtype)
                layers[op.attrs["layer"]].copyfrom(held)
        return np.zeros(len(tokens), np.int32)


def test_megakernel_steps_inside_a_held_page_defer_tvms_reservation(tiny, engine_of, oracle_of, rng):
    """Decode steps whose position lies in a page TVM already holds skip TVM's begin/end forward (30-50 µs a
    step); the deferred tokens are reserved before any other path touches the sequence. Checked by writing the
    oracle's keys and values where the engine says (the megakernel's part), then decoding one token on the per-op
    path: its logits match the oracle's only if TVM counts exactly the tokens written, in the slots written."""
    from luce_compile.graph.ir import LOGITS, OpKind

    model = tiny("tiny-llama")
    engine, oracle = engine_of(model), oracle_of(model)
    # the engine is the session's shared one (engine_of): every attribute set here is put back at the end
    saved = {name: getattr(engine, name, None) for name in ("_pages", "_mk_pages", "megakernel")}
    real_begin = engine._kv._begin
    engine._pages, engine._mk_pages = _pages(engine), {}
    n_prompt, n_steps = 5, 3 * engine.page_size + 2
    tokens = rng.integers(0, engine.vocab_size, n_prompt + n_steps + 1).tolist()
    env = oracle.run(np.array([tokens]), np.arange(len(tokens)).reshape(1, -1))
    attention = [op for op in oracle.graph.ops if op.kind == OpKind.ATTENTION]
    engine.megakernel = _WritesKeysAndValues(engine, env, attention)
    begun = []
    engine._kv._begin = lambda cache, seqs, lens, *tree: (begun.append(list(lens)),
                                                          real_begin(cache, seqs, lens, *tree))[1]
    seq = engine.add_sequence()
    try:
        engine.prefill([seq], [tokens[:n_prompt]])
        begun.clear()
        for i in range(n_steps):
            engine._megakernel_step([seq], [tokens[n_prompt + i]], logits=False)
        assert engine.megakernel.positions == list(range(n_prompt, n_prompt + n_steps))
        # the first step reads the pages; then TVM is called at each page boundary only (deferred tokens first)
        assert len(begun) <= 2 * (n_steps // engine.page_size + 1) < n_steps, begun
        assert engine._kv.behind[seq] > 0
        logits = engine.decode([seq], [tokens[-1]])[0]  # the per-op path: reserves the deferred tokens first
        assert seq not in engine._kv.behind and engine.length(seq) == len(tokens)
        want = env[LOGITS].reshape(len(tokens), -1)[-1]
        err = float(np.abs(logits - want).max() / np.abs(want).max())
        assert err <= 1e-4, err
        child = engine.fork_sequence(seq)  # a fork after deferred steps sees them all too
        engine.remove_sequence(child)
    finally:
        engine.remove_sequence(seq)
        engine._kv._begin = real_begin
        for name, value in saved.items():
            setattr(engine, name, value)


class _WritesTreeNodes:
    """A stand-in for a CUDA megakernel that verifies token trees, on a CPU engine: row i is node i of the step's
    tree; it writes the oracle's keys and values of that node (its path decoded after the prompt) into the slot the
    engine gave the row, as the kernel's KV append does, records its inputs, and returns the oracle's logits of the
    node's path (or their argmax)."""

    can_tree = True

    def __init__(self, engine, kv: list[dict], logits: np.ndarray, attention: list):
        self.engine, self.kv, self.rows, self.attention = engine, kv, logits, attention
        self.seen: list[tuple[list[int], list[int]]] = []

    def step(self, tokens, lengths, pages, kv_pages, kv_layer_offset, *, logits=True, allowed=None, off_path=None,
             batch=None):
        ps = self.engine.page_size
        layers = self.engine._pages.layers
        self.seen.append((list(lengths), np.asarray(off_path).tolist()))
        for row, n in enumerate(lengths):
            page, slot = pages[row][n // ps], n % ps
            for op in self.attention:
                held = layers[op.attrs["layer"]].numpy()
                for which, name in enumerate(op.inputs[1:3]):
                    held[page, which, :, slot] = self.kv[row][name].reshape(held.shape[2], -1).astype(held.dtype)
                layers[op.attrs["layer"]].copyfrom(held)
        out = self.rows[:len(tokens)].astype(np.float32)
        return out if logits else np.argmax(out, axis=-1).astype(np.int32)


def tree_stand_in(engine, oracle, prompt: list[int], tokens: list[int], parents: list[int]) -> _WritesTreeNodes:
    """_WritesTreeNodes for this tree after this prompt: each node's keys, values and logits from the oracle run
    over the prompt and the node's path."""
    from luce_compile.graph.ir import LOGITS, OpKind

    attention = [op for op in oracle.graph.ops if op.kind == OpKind.ATTENTION]
    kv, rows = [], []
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        seq_tokens = prompt + [tokens[i] for i in reversed(path)]
        oracle.reset()
        env = oracle.run(np.array([seq_tokens]), np.arange(len(seq_tokens)).reshape(1, -1))
        kv.append({name: env[name][0, -1] for op in attention for name in op.inputs[1:3]})
        rows.append(env[LOGITS][0, -1])
    return _WritesTreeNodes(engine, kv, np.stack(rows), attention)


@pytest.mark.parametrize("greedy", [False, True], ids=["logits", "ids"])
def test_a_tree_verified_on_the_megakernel_lands_where_tvms_commit_reads_it(tiny, engine_of, oracle_of, rng, greedy):
    """Engine.verify_tree through a megakernel that takes trees: TVM's cache reserves the tree (with its parents)
    and the kernel gets node i at the i-th slot after the sequence with its off_path word; the keys and values
    written there are what TVM's commit moves: after committing the second branch's path, a per-op decode step
    gives the oracle's logits of prompt + that path + one token. A tree laid out otherwise by TVM, or handed to the
    kernel in other slots, would not."""
    from luce_runtime.megakernel import off_path_words

    model = tiny("tiny-llama")
    engine, oracle = engine_of(model), oracle_of(model)
    saved = {name: getattr(engine, name, None) for name in ("_pages", "_mk_pages", "megakernel", "_mk_verify_rows")}
    engine._pages, engine._mk_pages, engine._mk_verify_rows = _pages(engine), {}, 8
    n_prompt = engine.page_size - 3  # the tree crosses a page boundary: TVM allocates the next page for it
    prompt = rng.integers(0, engine.vocab_size, n_prompt).tolist()
    tokens = rng.integers(0, engine.vocab_size, 6).tolist()
    parents, leaf = [-1, 0, 1, 0, 3, 4], 5  # two branches from the root; the second (slots past the first) kept
    engine.megakernel = tree_stand_in(engine, oracle, prompt, tokens, parents)
    rows = list(engine.megakernel.rows)
    assert engine.verifies_trees and engine._tree_on_megakernel(8) and not engine._tree_on_megakernel(9)
    engine.megakernel.can_tree = False  # a megakernel built before issue 39: the generation loop drafts chains
    assert not engine.verifies_trees
    engine._mk_verify_rows = 0  # ... unless chains verify on the per-op kernels too (measured faster there)
    assert engine.verifies_trees and not engine._tree_on_megakernel(2)
    engine.megakernel.can_tree, engine._mk_verify_rows = True, 8
    seq = engine.add_sequence()
    try:
        engine.prefill([seq], [prompt])
        out = (engine.verify_tree_greedy if greedy else engine.verify_tree)(seq, tokens, parents)
        want = np.argmax(rows, axis=-1) if greedy else np.stack(rows).astype(np.float32)
        assert np.array_equal(np.asarray(out), want)
        assert engine.megakernel.seen == [([n_prompt + i for i in range(6)], off_path_words(parents).tolist())]
        assert engine.length(seq) == n_prompt + 6
        engine.commit_tree(seq, leaf)
        assert engine.length(seq) == n_prompt + 4  # nodes 0, 3, 4, 5
        engine.megakernel = None  # the next step on the per-op kernels, reading what TVM committed
        nxt = int(rng.integers(0, engine.vocab_size))
        got = engine.decode([seq], [nxt])[0]
        path = prompt + [tokens[i] for i in (0, 3, 4, 5)] + [nxt]
        oracle.reset()
        want = oracle.prefill(path)[-1]
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err <= 1e-4, err
    finally:
        engine.remove_sequence(seq)
        for name, value in saved.items():
            setattr(engine, name, value)
