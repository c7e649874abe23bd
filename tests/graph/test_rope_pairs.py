"""graph/rope_pairs.py: NEOX RoPE as interleaved pairs, q and k's rows reordered within each head. The float64
oracle on the reordered graph gives the original's logits (to float64 rounding: q·k sums its products in another
order); changing the layout without reordering the rows does not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from luce_compile.graph.ir import OpKind
from luce_compile.graph.oracle import Oracle
from luce_compile.graph.registry import open_graph
from luce_compile.graph.rope_pairs import interleave_rope_pairs, pair_order, reorder_rows
from luce_compile.synthetic import cached_synthetic

pytestmark = pytest.mark.unit


def test_pairs_become_neighbours():
    assert pair_order(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    rows = np.arange(2 * 8 * 3).reshape(16, 3)  # two heads of 8 rows
    out = reorder_rows(rows, 8)
    assert out[1].tolist() == rows[4].tolist() and out[9].tolist() == rows[12].tolist()
    assert sorted(map(tuple, out.tolist())) == sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3"])
def test_the_reordered_graph_gives_the_same_logits(preset):
    graph, _ = open_graph(cached_synthetic(preset))
    pairs = interleave_rope_pairs(graph)
    assert all(op.attrs["layout"] == "norm" for op in pairs.ops if op.kind == OpKind.ROPE)
    n_layer = graph.config.n_layer
    assert {n for n in pairs.row_pairs if n.endswith("attn_q.weight")} == {f"blk.{i}.attn_q.weight"
                                                                            for i in range(n_layer)}
    tokens = [int(t) for t in np.random.default_rng(5).integers(1, 1000, 24)]
    want, got = Oracle(graph).prefill(tokens), Oracle(pairs).prefill(tokens)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
    # the layout alone, rows as they were: not the same model
    norm_only = dataclasses.replace(pairs, row_pairs={})
    assert np.abs(Oracle(norm_only).prefill(tokens) - want).max() > 1e-3 * np.abs(want).max()


def test_a_norm_layout_graph_is_left_as_it_is():
    graph, _ = open_graph(cached_synthetic("tiny-llama"))
    assert interleave_rope_pairs(graph) is graph
