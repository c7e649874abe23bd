"""NEOX RoPE as interleaved pairs: the same model with q and k's rows reordered within each head.

NEOX RoPE rotates the pairs (x[i], x[i + d/2]) of a head, the interleaved ("norm") layout the pairs (x[2i], x[2i+1]),
each pair i by the same angle. Reordering the rows of the q and k projections within every head (new row 2i = old
row i, new row 2i + 1 = old row i + d/2), with their biases and the per-head norms' weights (Qwen3's attn_q_norm /
attn_k_norm), turns a NEOX model into an interleaved one with the same scores: q·k sums the same products in
another order, and V, the output projection and everything after are untouched. The keys sit in the cache in the
new order, which only this artifact's kernels read.

Why: a megakernel tile of q or k rows must hold both rows of a pair to rotate them. With NEOX a pair spans half a
head, so the tiles keep whole heads (Qwen2.5-7B's QKV stage: 47 tiles on 132 SMs, its attention waiting on them);
interleaved pairs are neighbours, and the tiles split heads as Llama's do (fuse/taskgraph.py rope_pairs).

`Graph.row_pairs` names the reordered tensors and their head size; whoever reads a weight for such a graph reorders
it the same way (`reorder_rows`: quant_layout.weight_planes for weights.bin and device_check's rebuild, the oracle,
the rounding oracle's raw rows through `graph_raw`), so the graph is self-consistent wherever it is evaluated.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from luce_compile.graph.ir import Graph, OpKind


def pair_order(d: int) -> np.ndarray:
    """Row i of the reordered head is row pair_order(d)[i] of the NEOX head: 0, d/2, 1, d/2 + 1, ..."""
    half = np.arange(d // 2)
    return np.stack([half, half + d // 2], axis=1).reshape(-1)


def reorder_rows(rows: np.ndarray, d: int) -> np.ndarray:
    """A tensor's rows (first axis: heads x d of them, raw GGUF row bytes or values) in the interleaved order."""
    rows = np.asarray(rows)
    heads = rows.reshape(-1, d, *rows.shape[1:])
    return heads[:, pair_order(d)].reshape(rows.shape)


def interleave_rope_pairs(graph: Graph) -> Graph:
    """The graph with its NEOX RoPE made interleaved (module docstring); the graph itself where it has none. Full
    rotary only (every graph here rotates whole heads: decoder.py refuses rope_dim != head_dim)."""
    ropes = [op for op in graph.ops if op.kind == OpKind.ROPE and op.attrs["layout"] == "neox"]
    if not ropes:
        return graph
    d = graph.config.head_dim
    if any(op.attrs["dim"] != d for op in ropes) or d % 2:
        return graph
    producers = {o: op for op in graph.ops for o in op.outputs}
    row_pairs: dict[str, int] = {}
    for rope in ropes:
        value = rope.inputs[0]
        while value in producers:  # back through the head norm and the reshape to the projection (decoder.py)
            op = producers[value]
            if op.kind == OpKind.RMS_NORM:
                row_pairs[op.weights["weight"]] = d
            elif op.kind == OpKind.MATMUL:
                row_pairs[op.weights["weight"]] = d
                if "bias" in op.weights:
                    row_pairs[op.weights["bias"]] = d
                break
            elif op.kind != OpKind.RESHAPE:
                raise AssertionError(f"rope_pairs: {rope} reads {op}, not a q/k projection")
            value = op.inputs[0]
    rope_ids = {id(op) for op in ropes}
    ops = [dataclasses.replace(op, attrs={**op.attrs, "layout": "norm"}) if id(op) in rope_ids else op
           for op in graph.ops]
    return dataclasses.replace(graph, ops=ops, row_pairs={**graph.row_pairs, **row_pairs})


def graph_raw(graph: Graph, gguf, name: str) -> np.ndarray:  # noqa: ANN001  (a GGUFFile)
    """A matrix's raw GGUF rows as `graph` reads them: reordered where graph.row_pairs names it (vectors: see
    quant_layout.weight_planes)."""
    raw = gguf.raw(name)
    return reorder_rows(raw, graph.row_pairs[name]) if name in graph.row_pairs else raw
