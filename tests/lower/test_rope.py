"""lower/rope.py: the RoPE kernel against the oracle's formula (graph/oracle.rope), both layouts, a partial rotary
dim, and llama 3's frequency factors (rope_freqs.weight) as an input. Angles in float64 on both sides: float32
rounding of the result only (1e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from luce_compile.graph.oracle import rope
from luce_compile.lower.rope import rope_func

pytestmark = pytest.mark.unit
CPU = tvm.target.Target({"kind": "llvm"})


@pytest.mark.parametrize("layout,dim", [("norm", 64), ("neox", 64), ("neox", 32)])
@pytest.mark.parametrize("factors", [False, True])
def test_matches_the_oracle(layout, dim, factors):
    rng = np.random.default_rng()
    h, d, base = 3, 64, 500000.0
    x = rng.standard_normal((2, 5, h, d)).astype(np.float32)
    positions = rng.integers(0, 100_000, (2, 5)).astype(np.int32)  # long-context positions: where factors matter
    # llama 3.1's factors: 1 for high frequencies, up to 8 for the lowest (long wavelengths stretched)
    ff = np.linspace(1.0, 8.0, dim // 2).astype(np.float32)
    with CPU:
        lib = tvm.compile(tvm.IRModule({"main": rope_func(layout, h, d, dim, base, 1.0, freq_factors=factors)}),
                          target=CPU)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros_like(x), dev)
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in [x, positions, *([ff] if factors else [])]), out)
    want = rope(x.astype(np.float64), positions, layout, dim, base, 1.0, ff.astype(np.float64) if factors else None)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)
    if factors:  # the factors change the result: the test would catch them being ignored
        assert not np.allclose(want, rope(x.astype(np.float64), positions, layout, dim, base, 1.0), atol=1e-3)


def test_a_graph_with_rope_freqs_lowers_with_the_factors_as_a_parameter(tmp_path):
    """lower_graph takes llama 3's rope_freqs.weight (it raised UnsupportedError before): one float32 parameter, fed
    to every RoPE call."""
    from gguf import GGMLQuantizationType

    from luce_compile.gguf.config import model_config
    from luce_compile.gguf.reader import TensorInfo, read_gguf
    from luce_compile.graph.registry import BUILDERS
    from luce_compile.lower.relax_model import lower_graph
    from luce_compile.synthetic import cached_synthetic, preset

    gguf = read_gguf(cached_synthetic(preset("tiny-llama"), tmp_path))
    config = model_config(gguf)
    factors = TensorInfo("rope_freqs.weight", GGMLQuantizationType.F32, (config.rope_dim // 2,), 0, 32)
    graph = BUILDERS["llama"](config, {**gguf.tensors, factors.name: factors})
    mod, params = lower_graph(graph, CPU)
    assert ("rope_freqs.weight::w", (config.rope_dim // 2,), "float32") in params
    assert any(g.name_hint.endswith("_ff") for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc))


@pytest.mark.parametrize("dim", [32, 64])
def test_yarn_matches_the_oracle(dim):
    """gpt-oss's YaRN (x32 from 4096, base 150000) against the oracle's: positions past the original context too,
    where the interpolated and the kept frequencies differ most."""
    rng = np.random.default_rng()
    h, d = 2, 64
    yarn = dict(ext_factor=1.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096)
    x = rng.standard_normal((1, 6, h, d)).astype(np.float32)
    positions = np.array([[0, 3, 127, 4095, 30000, 131071]], dtype=np.int32)
    with CPU:
        lib = tvm.compile(tvm.IRModule({"main": rope_func("neox", h, d, dim, 150000.0, 1 / 32, yarn=yarn)}), target=CPU)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros_like(x), dev)
    lib["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(positions, dev), out)
    want = rope(x.astype(np.float64), positions, "neox", dim, 150000.0, 1 / 32, yarn=yarn)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)
    plain = rope(x.astype(np.float64), positions, "neox", dim, 150000.0, 1 / 32)
    assert np.abs(want - plain).max() > 0.1  # YaRN is not linear scaling: the test would catch it being dropped
