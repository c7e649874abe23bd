"""qwen3moe: its config from the GGUF keys, its graph, the oracle's MOE op against an independent dense formulation,
the real-shape preset's quant mix, and the targets it lowers for. The compiled model's checks are
tests/codegen/test_cpu_moe.py.

The oracle computes only the chosen experts, token by token (graph/oracle.Oracle._moe); the check here computes every
expert for every token and mixes them with a dense weight matrix that is zero outside each token's top k, so a wrong
selection, order or renormalization shows up as an O(1) difference. float64 on both sides: held to 1e-12.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.config import model_config
from luce_compile.gguf.reader import read_gguf
from luce_compile.graph.ir import OpKind
from luce_compile.graph.oracle import Oracle, silu
from luce_compile.graph.registry import build_graph
from luce_compile.synthetic import PRESETS, cached_synthetic, tensor_type

pytestmark = pytest.mark.unit
T = GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return cached_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("moe"))


def test_config_and_graph(tiny_moe):
    gguf = read_gguf(tiny_moe)
    c = model_config(gguf)
    assert (c.arch, c.n_expert, c.n_expert_used, c.n_ff_exp, c.expert_weights_norm) == ("qwen3moe", 8, 2, 64, True)
    assert c.qk_norm and c.rope_layout == "neox"
    graph = build_graph(gguf)
    moe = [op for op in graph.ops if op.kind == OpKind.MOE]
    assert len(moe) == c.n_layer
    assert moe[1].weights == {r: f"blk.1.ffn_{r}.weight" for r in ("gate_inp", "gate_exps", "up_exps", "down_exps")}
    assert moe[0].attrs == {"n_expert": 8, "n_expert_used": 2, "norm_w": True, "activation": "silu"}
    assert not any(name.endswith(("ffn_gate.weight", "ffn_up.weight")) for name in graph.weights)


def _dense_mixture(oracle: Oracle, op, x: np.ndarray) -> np.ndarray:
    """Every expert on every token, mixed by a (T, n_expert) weight matrix zero outside each token's top k."""
    w = {r: oracle.weight(op.weights[r]) for r in ("gate_inp", "gate_exps", "up_exps", "down_exps")}
    xs = x.reshape(-1, x.shape[-1])  # (T, E)
    logits = xs @ w["gate_inp"].T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    k = op.attrs["n_expert_used"]
    kth = np.sort(p, -1)[:, -k][:, None]
    mix = np.where(p >= kth, p, 0.0)  # (T, n_expert)
    if op.attrs["norm_w"]:
        mix /= mix.sum(-1, keepdims=True)
    gate = np.einsum("te,nfe->tnf", xs, w["gate_exps"])  # (T, n_expert, F)
    up = np.einsum("te,nfe->tnf", xs, w["up_exps"])
    every = np.einsum("tnf,nef->tne", silu(gate) * up, w["down_exps"])  # (T, n_expert, E)
    return np.einsum("tn,tne->te", mix, every).reshape(x.shape)


@pytest.mark.parametrize("norm_w", [True, False])
def test_oracle_moe_equals_dense_mixture(tiny_moe, norm_w, rng):
    oracle = Oracle(tiny_moe)
    op = next(op for op in oracle.graph.ops if op.kind == OpKind.MOE)
    op = dataclasses.replace(op, attrs={**op.attrs, "norm_w": norm_w})
    x = rng.standard_normal((1, 7, oracle.config.n_embd))
    got = oracle._moe(op, x)
    assert np.abs(got - _dense_mixture(oracle, op, x)).max() <= 1e-12 * np.abs(got).max()
    # the renormalization is not a no-op on these weights: the other choice is O(1) away
    other = dataclasses.replace(op, attrs={**op.attrs, "norm_w": not norm_w})
    assert np.abs(oracle._moe(other, x) - got).max() > 1e-2 * np.abs(got).max()


def test_qwen3_30b_a3b_preset_is_llama_quantize_q4_k_m():
    """Q4_K_M as llama-quantize makes it for a 48-layer MoE: ffn_down_exps counts as ffn_down for the more-bits
    layers (counted in name order: blk.0, blk.1, blk.10, …), the router stays F32, the LM head Q6_K."""
    spec = PRESETS["qwen3-30b-a3b"]
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp, spec.n_vocab) == (128, 8, 768, 151936)
    more = {int(name.split(".")[1]) for name, t in spec.quant_overrides.items()
            if name.endswith("ffn_down_exps.weight") and t == "Q6_K"}
    # the first and last 6 in name order (0, 1, 10-13 … 5-9) and every third between: 24 layers
    assert len(more) == 24 and {0, 1, 10, 5, 9} <= more and not {2, 14, 20} & more
    for i in range(48):
        down = tensor_type(spec, f"blk.{i}.ffn_down_exps.weight", (128, 2048, 768))
        assert down == (T.Q6_K if i in more else T.Q4_K)
        assert tensor_type(spec, f"blk.{i}.ffn_up_exps.weight", (128, 768, 2048)) == T.Q4_K
        assert tensor_type(spec, f"blk.{i}.ffn_gate_inp.weight", (128, 2048)) == T.F32
    assert tensor_type(spec, "output.weight", (151936, 2048)) == T.Q6_K


def test_targets_without_moe_kernels_are_refused_naming_the_ones_that_have_them():
    from luce_compile.lower.moe import check_target

    for kind in ("llvm", "cuda", "rocm"):
        check_target(kind, "qwen3moe")
    with pytest.raises(UnsupportedError, match="CPU and CUDA/ROCm GPUs only, not vulkan"):
        check_target("vulkan", "qwen3moe")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_an_experts_8_bit_rows_round_as_a_plain_matmul_of_its_rows(qtype, rng):
    """The grouped expert GEMM's rounding in the oracle (GgmlRounding._rounded_moe_matmul, the GPU's forms): expert
    e's matmul is gpu_q8_matmul of its own weight rows and raw blocks; for a type with block minimums (Q4_1: q8_1
    activations), those of its rows of the stacked tensor, not the first expert's."""
    from luce_compile.graph.rounding import GgmlRounding, gpu_q8_matmul

    oracle = GgmlRounding(cached_synthetic(f"tiny-qwen3moe@{qtype}"), types=(), gpu_q8_1=True)
    name = "blk.1.ffn_gate_exps.weight"
    assert oracle.gguf.tensor(name).ggml_type.name == qtype
    w = oracle.weight(name)  # (n_expert, F, E)
    raw = oracle.gguf.raw(name).reshape(w.shape[0], w.shape[1], -1)
    x = rng.standard_normal((3, w.shape[2]))
    for e in (0, 5):
        got = oracle._rounded_moe_matmul(name, x, w[e], e)
        assert np.array_equal(got, gpu_q8_matmul(x, w[e], qtype, raw[e]))
        assert np.abs(got - x @ w[e].T).max() > 1e-6  # the rounding is there
    # types=(): the plain path leaves x as it is
    assert np.array_equal(oracle._moe_matmul(name, x, w[5], 5), x @ w[5].T)
