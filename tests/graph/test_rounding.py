"""The emulating oracle's type filter: the megakernel's q8_activations round only the inputs of Q4_0/Q4_1/Q8_0
matmuls, so its reference must leave every other matmul exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from luce_compile.graph.oracle import Oracle
from luce_compile.graph.rounding import GgmlRounding, q8_blocks
from luce_compile.synthetic import cached_synthetic, preset

pytestmark = pytest.mark.unit


def _logits(oracle: Oracle) -> np.ndarray:
    return oracle.prefill([5, 17, 99, 3])[-1]


def test_rounding_applies_to_the_named_types_only():
    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant="Q4_1"))
    plain = _logits(Oracle(gguf))
    assert np.array_equal(_logits(GgmlRounding(gguf, types=("Q8_0",))), plain)  # no Q8_0 matmul in the model
    rounded = _logits(GgmlRounding(gguf, types=("Q4_1",)))
    gap = np.abs(rounded - plain).max() / np.abs(plain).max()
    assert 1e-4 < gap < 0.2  # 8-bit activations move the logits, by the rounding's size, not more


def test_q8_blocks_round_half_to_even_on_127_over_amax():
    x = np.array([[127.0, 63.5, -0.5, 1.5] + [0.0] * 28], dtype=np.float32)
    q, d = q8_blocks(x)
    assert q[0, 0, :4].tolist() == [127, 64, -0, 2] and d[0, 0, 0] == np.float32(1)


def test_megakernel_q8_is_refused_where_no_megakernel_is_built(tmp_path):
    """--megakernel-q8 changes the CUDA decode megakernels: on a CPU target, or with --no-megakernel, it would do
    nothing, so compile says so before any work."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.errors import LuceError

    gguf = cached_synthetic(preset("tiny-llama"))
    with pytest.raises(LuceError, match="--megakernel-q8"):
        compile_model(gguf, "cpu", tmp_path / "a", megakernel_q8=True)
    with pytest.raises(LuceError, match="--no-megakernel"):
        compile_model(gguf, "sm_90", tmp_path / "b", megakernel=False, megakernel_q8=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
