"""lower/moe.py's routing kernels, built for this CPU and run on random inputs: the router's top-k and weights
against numpy (float32 softmax; the selection is exact), and the grouping sort's permutation (stable, inverse)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from luce_compile.lower.moe import route_func, sort_func

pytestmark = pytest.mark.unit


def _run(func, *arrays, outs):
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays] + [tvm.runtime.tensor(np.zeros(s, d), dev) for s, d in outs]
    lib["main"](*args)
    return [a.numpy() for a in args[len(arrays):]]


@pytest.mark.parametrize("norm_w", [True, False])
def test_route_picks_the_top_k_in_order(norm_w, rng):
    n_expert, used, rows = 16, 4, 9
    logits = rng.standard_normal((rows, n_expert)).astype(np.float32)
    logits[0, 3] = logits[0, 5] = 4.0  # a tie: the lower expert first, as ggml_top_k's argsort
    ids, weights = _run(route_func(n_expert, used, norm_w, "route"), logits,
                        outs=[((rows, used), "int32"), ((rows, used), "float32")])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.argsort(-p, axis=-1, kind="stable")[:, :used]
    assert (ids == want).all() and list(ids[0, :2]) == [3, 5]
    w = np.take_along_axis(p, want, -1)
    w = w / w.sum(-1, keepdims=True) if norm_w else w
    np.testing.assert_allclose(weights, w, rtol=1e-6)


def test_sort_groups_rows_by_expert_stably(rng):
    n_expert, used, tokens = 8, 2, 13
    ids = np.stack([rng.choice(n_expert, used, replace=False) for _ in range(tokens)]).reshape(-1).astype(np.int32)
    experts, toks, inverse = _run(sort_func(n_expert, used, "sort"), ids, outs=[((ids.size,), "int32")] * 3)
    order = np.argsort(ids, kind="stable")
    assert (experts == ids[order]).all() and (toks == order // used).all()
    assert (inverse[order] == np.arange(ids.size)).all()


def test_a_decode_step_of_one_sequence_keeps_its_rows_in_token_order():
    """decode1 (rows known when compiling) routes and runs the expert GEMVs with the rows in token order: no sort and
    no gather back, two kernels a layer fewer; the steps of unknown rows (decode of a batch, prefill) sort by expert.
    The numbers are the same either way (tests/codegen/test_cpu_moe.py holds decode to the oracle)."""
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph import build_graph
    from luce_compile.lower.relax_model import LowerOptions, lower_graph
    from luce_compile.synthetic import cached_synthetic
    from luce_compile.targets import get_target

    graph = build_graph(read_gguf(cached_synthetic("tiny-qwen3moe")))
    mod, _ = lower_graph(graph, get_target("cpu").tvm_target(), LowerOptions())
    calls = {f: mod[f].script() for f in ("decode1", "decode", "prefill")}
    assert all("moe_route" in text for text in calls.values())
    assert "moe_sort" not in calls["decode1"] and "R.take" not in calls["decode1"]
    assert all("moe_sort" in calls[f] and "R.take" in calls[f] for f in ("decode", "prefill"))
