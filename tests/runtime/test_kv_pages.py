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
