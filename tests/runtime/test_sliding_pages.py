"""A model with sliding-window layers (tiny-gemma3: window 8, two sliding layers then a global one) on TVM's cache as
the megakernel reads it, on the CPU. TVM 0.27 keeps every page of such a model (luce_compile/lower/kv_layers.py);
the runtime's page probe reads them only in the cache layout compile_model(sliding_megakernel=True) asks for. The
megakernel's part is a stand-in that writes the oracle's keys and values where the engine says, as the CUDA kernel
does (its arithmetic is the simulator's and the GPU's to check: tests/fuse, scripts/device_check.py): steps past the
window, a verify of several rows where the per-op kernels take one token a call, and rollbacks inside and past the
window must leave the cache as the per-op kernels read it, so their next step gives the oracle's logits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.codegen._reference import check_against_oracle, rel_err

pytestmark = pytest.mark.e2e

WINDOW = 8
OPTIONS = {"max_batch": 2, "max_context": 128, "prefill_chunk": 64}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """tiny-gemma3's CPU build in the probe's cache layout (float32: checked against the float64 oracle)."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    gguf = cached_synthetic("tiny-gemma3")
    return gguf, compile_model(gguf, "cpu", tmp_path_factory.mktemp("gemma") / "probed", precision="f32",
                               sliding_megakernel=True)


@pytest.fixture()
def engine(probed):
    from luce_runtime.engine import Engine, EngineOptions

    return Engine(probed[1], EngineOptions(**OPTIONS))


def _pages(engine):
    from luce_runtime.kv_pages import KVPages

    c = engine.config
    return KVPages(engine._kv.cache, int(c["n_layer"]), int(c["n_head_kv"]), int(c["head_dim"]), engine.page_size,
                   engine.max_context, engine.contract.kv_dtype)


def _oracle_run(gguf, tokens: list[int]):
    from luce_compile.graph.ir import OpKind
    from luce_compile.graph.oracle import Oracle

    oracle = Oracle(gguf)
    env = oracle.run(np.array([tokens]), np.arange(len(tokens)).reshape(1, -1))
    return env, [op for op in oracle.graph.ops if op.kind == OpKind.ATTENTION]


def test_the_probe_reads_a_sliding_models_pages_only_in_its_layout(probed, engine, tiny, engine_of, rng):
    """The default layout: TVM's DebugGetKV refuses the sliding layers. The probe's layout: each sequence's page ids
    and every layer's pages hold the oracle's keys and values for prompts past the window, and the per-op kernels
    still give the oracle's logits across it."""
    default = engine_of(tiny("tiny-gemma3"), **OPTIONS)
    seq = default.add_sequence()
    try:
        default.prefill([seq], [[1, 2, 3]])
        with pytest.raises(Exception, match="Only MHA is supported for DebugGetKV"):
            _pages(default).slots(seq, 0, 3)
    finally:
        default.remove_sequence(seq)
    pages = _pages(engine)
    for n in (37, 16, 5):
        prompt = rng.integers(0, engine.vocab_size, n).tolist()
        seq = engine.add_sequence()
        engine.prefill([seq], [prompt])
        slots = pages.slots(seq, 0, n)
        assert pages.page_ids(seq, n) == [int(s) // engine.page_size for s in slots[::engine.page_size]]
        env, attention = _oracle_run(probed[0], prompt)
        for op in attention:
            held = pages.layers[op.attrs["layer"]].numpy()[slots // engine.page_size, :, :,
                                                           slots % engine.page_size]
            for which, name in enumerate(op.inputs[1:3]):  # keys (rotated), then values
                assert rel_err(held[:, which], env[name].reshape(n, held.shape[2], -1)) <= 1e-5, (n, name)
        engine.remove_sequence(seq)
    from luce_compile.graph.oracle import Oracle

    check_against_oracle("gemma3 probe layout", engine, Oracle(probed[0]),
                         rng.integers(0, engine.vocab_size, 20).tolist(), steps=12)


class _OracleRows:
    """A stand-in for the CUDA megakernel: row r at position n writes the oracle's keys and values of token n into
    the slot the engine gave it (pages[r][n // page size]) and returns the oracle's logits after token n."""

    can_tree = can_mask = True

    def __init__(self, engine, env: dict, attention: list):
        from luce_compile.graph.ir import LOGITS

        self.engine, self.env, self.attention = engine, env, attention
        self.logits = env[LOGITS].reshape(env[LOGITS].shape[1], -1)
        self.positions: list[int] = []

    def step(self, tokens, lengths, pages, kv_pages, kv_layer_offset, *, logits=True, allowed=None, off_path=None,
             batch=None):
        ps, layers = self.engine.page_size, self.engine._pages.layers
        for row, n in enumerate(lengths):
            self.positions.append(n)
            for op in self.attention:
                held = layers[op.attrs["layer"]].numpy()
                for which, name in enumerate(op.inputs[1:3]):
                    value = self.env[name].reshape(self.env[name].shape[1], held.shape[2], -1)[n]
                    held[pages[row][n // ps], which, :, n % ps] = value.astype(held.dtype)
                layers[op.attrs["layer"]].copyfrom(held)
        out = self.logits[list(lengths)].astype(np.float32)
        return out if logits else np.argmax(out, axis=-1).astype(np.int32)


def test_megakernel_rows_past_the_window_then_rollbacks_leave_what_per_op_reads(probed, engine, rng):
    """A CUDA build's contract (its prefill takes one token a call past the first chunk), a megakernel stand-in for
    1 sequence and verifies of up to 8 rows: decode steps past the window, a verify of 5 rows (refused on the
    per-op path), a rollback inside the window and one past it, more steps; after each, a per-op step reads the
    window the stand-in wrote (and TVM's suffix of the pages) and gives the oracle's logits."""
    from luce_runtime.engine import EngineError

    engine.contract = replace(engine.contract, sliding_prefill_chunks=False)
    tokens = rng.integers(0, engine.vocab_size, 48).tolist()
    env, attention = _oracle_run(probed[0], tokens)
    stand_in = _OracleRows(engine, env, attention)
    engine._pages, engine._mk_pages, engine.megakernel = _pages(engine), {}, stand_in
    engine._mk_sizes, engine._mk_verify_rows = {1}, 8
    assert engine.verify_limit == 8 and engine.verify_budget == 8 and not engine.verifies_trees

    def per_op(seq: int, at: int) -> None:  # the per-op kernels' step feeding tokens[at], against the oracle
        assert engine.length(seq) == at
        got = engine._per_op_step([seq], [tokens[at]])[0]
        assert rel_err(got, stand_in.logits[at]) <= 1e-4, at

    seq = engine.add_sequence()
    try:
        engine.prefill([seq], [tokens[:20]])  # a first chunk of 8, then one token a call
        for t in tokens[20:30]:
            engine.decode([seq], [t])
        (rows,) = engine.verify([seq], [tokens[30:35]])
        assert stand_in.positions == list(range(20, 35))
        assert np.array_equal(rows, stand_in.logits[30:35].astype(np.float32))
        engine.rollback(seq, 3)  # inside the window
        per_op(seq, 32)
        engine.rollback(seq, 12)  # past it: 33 -> 21
        per_op(seq, 21)
        engine.decode_greedy([seq], [tokens[22]])
        for t in tokens[23:40]:
            engine.decode([seq], [t])
        per_op(seq, 40)
        engine.megakernel = None  # the per-op kernels alone verify one token a call here
        with pytest.raises(EngineError, match="tokens per call on the per-op kernels"):
            engine.verify([seq], [tokens[41:44]])
        with pytest.raises(EngineError, match="verify chains only"):
            engine.verify_tree(seq, tokens[41:44], [-1, 0, 0])
    finally:
        engine.remove_sequence(seq)
    assert engine.free_pages() == engine.total_pages
