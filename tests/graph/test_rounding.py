"""The emulating oracle's type filter: the megakernel's q8_activations round only the inputs of Q4_0/Q4_1/Q8_0
matmuls, and its float_mma (--megakernel-tf32) only those of F16/BF16 ones, so its reference must leave every other
matmul exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from luce_compile.graph.oracle import Oracle
from luce_compile.graph.rounding import GgmlRounding, q8_blocks, tf32
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


def test_tf32_keeps_ten_mantissa_bits_rounding_ties_away_from_zero():
    """cvt.rna.tf32.f32, as the megakernel's emit_cuda.tf32 does it: +0x1000 on the bits, 13 low bits cleared."""
    one = 1.0
    x = np.array([one + 2.0**-11, one + 2.0**-12, -(one + 2.0**-11), one + 3 * 2.0**-11, 2.0**-11, 65504.0],
                 dtype=np.float32)
    assert tf32(x).tolist() == [one + 2.0**-10, one, -(one + 2.0**-10), one + 2 * 2.0**-10, 2.0**-11, 65504.0]


def test_tf32_rounding_applies_to_the_named_float_types_only():
    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant="BF16"))
    plain = _logits(Oracle(gguf))
    assert np.array_equal(_logits(GgmlRounding(gguf, types=(), tf32_types=("F16",))), plain)  # no F16 matmul
    rounded = _logits(GgmlRounding(gguf, types=(), tf32_types=("BF16",)))
    gap = np.abs(rounded - plain).max() / np.abs(plain).max()
    assert 1e-6 < gap < 5e-3  # 10 mantissa bits of every input: ~1e-3 at the logits, as measured on the H200


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
    with pytest.raises(LuceError, match="--megakernel-tf32"):
        compile_model(gguf, "cpu", tmp_path / "a", megakernel_tf32=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
