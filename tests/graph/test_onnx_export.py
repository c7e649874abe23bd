"""ONNX export run by onnxruntime (float32) against the float64 oracle, on tiny models of every architecture.

Tolerance: max|diff| / max|logit| ≤ 1e-4. The export computes in float32 (unit roundoff 6e-8); over a few dozen
ops of depth the rounding grows to ~1e-6 of the logits' scale (measured 8e-7 to 2.5e-6), so 1e-4 leaves ~40x of
margin while any semantic slip (a wrong RoPE pair, a mask off by one, a missing norm) moves logits by > 1e-2.
The metric is normalized by the largest logit rather than elementwise, because logits near zero have no
meaningful relative error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.reader import read_gguf
from luce_compile.graph import build_graph
from luce_compile.graph.onnx_export import MAX_PARAMS, OPSET, export_onnx, run_onnx
from luce_compile.graph.oracle import Oracle
from tests.graph.conftest import TINY

pytest.importorskip("onnxruntime")

REL_TOL = 1e-4
STANDARD_OPS = {"Gather", "Mul", "Add", "Sub", "Div", "MatMul", "Transpose", "Reshape", "ReduceMean", "Sqrt",
                "Slice", "Concat", "Unsqueeze", "Identity", "Sigmoid", "Tanh", "Softmax", "Where", "GreaterOrEqual",
                "Less", "And"}


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


CASES = [(p, {}) for p in TINY] + [
    ("tiny-llama", {"quant": "F16"}),
    ("tiny-qwen3", {"quant": "Q5_0", "tied_output": False}),
    ("tiny-gemma3", {"quant": "Q4_K", "n_embd": 256, "n_ff": 512, "head_dim": 64}),
    ("tiny-gemma3", {"quant": "Q6_K", "n_embd": 256, "n_ff": 512, "head_dim": 64,
                     "final_logit_softcap": 0.0}),
]


@pytest.mark.unit
@pytest.mark.parametrize("preset,changes", CASES, ids=[f"{p}-{c.get('quant', 'Q8_0')}" for p, c in CASES])
def test_onnxruntime_matches_oracle(synthetic, preset, changes):
    path = synthetic(preset, **changes)
    tokens = np.random.default_rng(0).integers(0, 49152, 20)  # longer than tiny-gemma3's window of 8
    ref = Oracle(path).prefill(tokens)
    got = run_onnx(export_onnx(path), tokens)
    assert got.shape == (1, 20, 49152) and got.dtype == np.float32
    assert _rel(got[0], ref) <= REL_TOL
    assert (got[0].argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.unit
def test_batch_with_offset_positions(synthetic):
    """Two rows of different tokens and start positions in one batch equal the oracle run on each."""
    path = synthetic("tiny-gemma3")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 49152, (2, 12))
    positions = np.stack([np.arange(12), np.arange(12) + 5])
    got = run_onnx(export_onnx(path), tokens, positions)
    for row in range(2):
        ref = Oracle(path).run(tokens[row:row + 1], positions[row:row + 1])["logits"][0]
        assert _rel(got[row], ref) <= REL_TOL


@pytest.mark.unit
def test_standard_opset_and_saved_file(synthetic, tmp_path):
    path = synthetic("tiny-qwen2")
    model = export_onnx(path, tmp_path / "m.onnx")
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    assert {n.op_type for n in model.graph.node} <= STANDARD_OPS
    assert all(n.domain == "" for n in model.graph.node)
    initializers = {t.name for t in model.graph.initializer}
    assert set(build_graph(read_gguf(path)).weights) <= initializers  # weights keep their GGUF names
    tokens = np.arange(100, 108)
    loaded = onnx.load(str(tmp_path / "m.onnx"))
    np.testing.assert_array_equal(run_onnx(tmp_path / "m.onnx", tokens), run_onnx(loaded, tokens))


@pytest.mark.unit
def test_refuses_models_above_the_size_limit(synthetic):
    graph = build_graph(read_gguf(synthetic("tiny-llama")))
    info = graph.weights["token_embd.weight"]
    graph.weights[info.name] = dataclasses.replace(info, shape=(MAX_PARAMS // 64 + 1, 64))
    with pytest.raises(UnsupportedError, match="small models"):
        export_onnx(graph)


@pytest.mark.slow
def test_smollm2_onnx_matches_oracle(smollm2_path):
    tokens = [504, 3575, 282, 4649, 314]
    ref = Oracle(smollm2_path).prefill(tokens)
    got = run_onnx(export_onnx(smollm2_path, max_positions=64), tokens)[0]
    assert _rel(got, ref) <= REL_TOL and int(got[-1].argmax()) == 7042
