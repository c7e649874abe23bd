"""gpt-oss: its config from the GGUF keys, its graph, the oracle's new pieces each against an independent formulation
(attention sinks, YaRN, ggml_swiglu_oai, SOFTMAX_WEIGHT routing with biased experts), the refusals, the real-shape
preset, and the oracle against llama.cpp on the same file. The compiled model's checks are
tests/codegen/test_cpu_gptoss.py.

The independent formulations are float64 like the oracle: held to 1e-12. Against llama.cpp the oracle with its
activation roundings emulated (GgmlRounding) is ~1e-7 of the logits' scale away where no activation sits on an 8-bit
rounding boundary (measured 6e-8-1e-7 on 88 of 104 positions of tiny-gptoss, 2026-12-06; 15 of the others follow
one flip at the 5th token of one prompt through its KV cache, 1e-2 after it), as for the other architectures
(test_vs_llama_cpp.py says why some positions flip).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.config import model_config
from luce_compile.gguf.reader import read_gguf
from luce_compile.graph.ir import OpKind
from luce_compile.graph.oracle import Oracle, attention, rope, route, swiglu_oai
from luce_compile.graph.registry import build_graph
from luce_compile.synthetic import PRESETS, cached_synthetic, tensor_shapes, tensor_type
from tests.conftest import requires_llama_cpp

T = GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_gptoss(tmp_path_factory):
    return cached_synthetic("tiny-gptoss", tmp_path_factory.mktemp("gptoss"))


@pytest.mark.unit
def test_config(tiny_gptoss):
    c = model_config(read_gguf(tiny_gptoss))
    assert (c.arch, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_expert, c.n_expert_used, c.n_ff_exp) == \
        ("gpt-oss", 4, 8, 2, 32, 8, 2, 64)
    # set_swa_pattern(2): even layers slide; both kinds take the same base, scale and YaRN
    assert c.sliding == (True, False, True, False) and c.sliding_window == 8
    assert c.rope_layout == "neox" and c.rope_base == c.rope_base_local == 150000.0
    assert c.rope_scale == c.rope_scale_local == 1 / 32
    assert (c.rope_yarn_ext_factor, c.rope_yarn_attn_factor, c.rope_yarn_beta_fast, c.rope_yarn_beta_slow,
            c.rope_yarn_orig_ctx) == (1.0, 1.0, 32.0, 1.0, 4096)
    assert c.attn_sinks and c.attn_bias and c.expert_bias and not c.tied_output and not c.qk_norm
    assert (c.expert_gating, c.expert_weights_norm, c.activation) == ("softmax_weight", False, "swiglu_oai")


@pytest.mark.unit
def test_graph(tiny_gptoss):
    graph = build_graph(read_gguf(tiny_gptoss))
    att = graph.attention_ops()
    assert [op.attrs["sliding_window"] for op in att] == [8, 0, 8, 0]
    assert all(op.weights == {"sinks": f"blk.{i}.attn_sinks.weight"} for i, op in enumerate(att))
    assert att[0].attrs["scale"] == pytest.approx(1 / np.sqrt(32))
    ropes = [op for op in graph.ops if op.kind == OpKind.ROPE]
    assert len(ropes) == 8 and all(op.attrs["ext_factor"] == 1.0 and op.attrs["n_ctx_orig"] == 4096 and
                                   op.attrs["freq_scale"] == 1 / 32 for op in ropes)
    moe = [op for op in graph.ops if op.kind == OpKind.MOE]
    assert moe[1].attrs == {"n_expert": 8, "n_expert_used": 2, "norm_w": False, "activation": "swiglu_oai",
                            "gating": "softmax_weight", "alpha": 1.702, "limit": 7.0}
    roles = ("gate_inp", "gate_exps", "up_exps", "down_exps")
    assert moe[1].weights == {r: f"blk.1.ffn_{r}.weight" for r in roles} | \
        {f"{r}_b": f"blk.1.ffn_{r}.bias" for r in roles}
    norms = {op.weights["weight"] for op in graph.ops if op.kind == OpKind.RMS_NORM}
    assert "blk.2.post_attention_norm.weight" in norms and not any("ffn_norm" in n for n in norms)
    assert {"blk.0.attn_output.bias", "blk.3.attn_q.bias", "output.weight"} <= set(graph.weights)


@pytest.mark.unit
def test_attention_sinks_are_one_more_softmax_column(rng):
    """ggml_soft_max_add_sinks: the sink is a logit in the denominator, weighting no value. The same as appending
    a key whose score is the sink and whose value is 0; sinks of -inf are no sinks."""
    b, s, h, hkv, d, n = 1, 5, 6, 2, 8, 11
    q = rng.standard_normal((b, s, h, d))
    k, v = rng.standard_normal((b, n, hkv, d)), rng.standard_normal((b, n, hkv, d))
    q_pos, k_pos = np.arange(n - s, n)[None], np.arange(n)[None]
    sinks = rng.standard_normal(h) * 2
    got = attention(q, k, v, q_pos, k_pos, 0.3, sliding_window=4, sinks=sinks)
    want = np.zeros((b, s, h, d))
    for hh in range(h):
        kv = hh // (h // hkv)
        scores = 0.3 * q[0, :, hh] @ k[0, :, kv].T  # (S, L)
        visible = (q_pos[0, :, None] >= k_pos[0, None]) & (q_pos[0, :, None] - k_pos[0, None] < 4)
        scores = np.concatenate([np.where(visible, scores, -np.inf), np.full((s, 1), sinks[hh])], axis=1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want[0, :, hh] = p[:, :-1] @ v[0, :, kv]
    assert np.abs(got - want.reshape(got.shape)).max() <= 1e-12
    plain = attention(q, k, v, q_pos, k_pos, 0.3, sliding_window=4)
    assert np.array_equal(attention(q, k, v, q_pos, k_pos, 0.3, 4, sinks=np.full(h, -np.inf)), plain)
    assert np.abs(got - plain).max() > 0.05  # the sinks matter at these values


def _rope_yarn_ggml(x, pos, dim, base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig):
    """ggml's NEOX rope with YaRN written the way ggml-cpu writes it (rope_yarn_ramp, rope_yarn, the cache's theta
    recurrence, ggml_rope_yarn_corr_dims), one head at a time: the reference for the oracle's vectorized form."""
    def corr_dim(n_rot):
        return dim * np.log(n_ctx_orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))

    low, high = max(0, np.floor(corr_dim(beta_fast))), min(dim - 1, np.ceil(corr_dim(beta_slow)))
    out = x.copy()
    for t, p in enumerate(pos):
        theta = float(p)
        for i0 in range(0, dim, 2):
            theta_interp = freq_scale * theta
            y = (i0 // 2 - low) / max(0.001, high - low)
            ramp_mix = (1 - min(1, max(0, y))) * ext_factor
            th = theta_interp * (1 - ramp_mix) + theta * ramp_mix
            mscale = attn_factor * (1 + 0.1 * np.log(1 / freq_scale)) if ext_factor else attn_factor
            c, s = np.cos(th) * mscale, np.sin(th) * mscale
            a, b = x[t, i0 // 2], x[t, i0 // 2 + dim // 2]
            out[t, i0 // 2], out[t, i0 // 2 + dim // 2] = a * c - b * s, a * s + b * c
            theta *= base ** (-2 / dim)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("dim", [32, 64])
def test_yarn_rope_matches_ggml(dim, rng):
    pos = np.array([0, 1, 7, 100, 4095, 60000])
    x = rng.standard_normal((1, len(pos), 1, dim))
    yarn = dict(ext_factor=1.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=4096)
    got = rope(x, pos[None], "neox", dim, 150000.0, 1 / 32, yarn=yarn)[0, :, 0]
    want = _rope_yarn_ggml(x[0, :, 0], pos, dim, 150000.0, 1 / 32, **yarn)
    assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max()
    # ext_factor 0 is linear interpolation; freq_scale 1 is plain RoPE whatever the ramp
    linear = rope(x, pos[None], "neox", dim, 150000.0, 1 / 32, yarn=yarn | {"ext_factor": 0.0})
    assert np.abs(linear - rope(x, pos[None], "neox", dim, 150000.0, 1 / 32)).max() <= 1e-12
    unscaled = rope(x, pos[None], "neox", dim, 150000.0, 1.0, yarn=yarn)
    assert np.abs(unscaled - rope(x, pos[None], "neox", dim, 150000.0, 1.0)).max() <= 1e-12


@pytest.mark.unit
def test_swiglu_oai():
    gate = np.array([-30.0, -1.0, 0.0, 1.0, 6.9, 7.0, 50.0])
    up = np.array([-50.0, -8.0, 2.0, 0.5, 7.5, -1.0, 3.0])
    g = np.minimum(gate, 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (np.clip(up, -7.0, 7.0) + 1)
    assert np.array_equal(swiglu_oai(gate, up, 1.702, 7.0), want)
    assert swiglu_oai(np.array([50.0]), np.array([50.0]), 1.702, 7.0)[0] == pytest.approx(7 / (1 + np.exp(-11.914)) * 8)


@pytest.mark.unit
def test_softmax_weight_routing(rng):
    """SOFTMAX_WEIGHT: the top-k logits, weighted by their own softmax. The same choice and weights as the softmax
    over every expert renormalized over the chosen (norm_w), which lower/moe.py computes."""
    logits = rng.standard_normal((9, 8)) * 3
    chosen, weights = route(logits, 3, "softmax_weight", False)
    picked = np.take_along_axis(logits, chosen, -1)
    assert (np.diff(picked, axis=-1) <= 0).all() and (picked[:, -1:] >= np.sort(logits, -1)[:, -3:-2]).all()
    want = np.exp(picked) / np.exp(picked).sum(-1, keepdims=True)
    assert np.abs(weights - want).max() <= 1e-15
    same, renormed = route(logits, 3, "softmax", True)
    assert (same == chosen).all() and np.abs(renormed - weights).max() <= 1e-15


@pytest.mark.unit
def test_oracle_moe_with_biases_equals_dense_mixture(tiny_gptoss, rng):
    oracle = Oracle(tiny_gptoss)
    op = next(op for op in oracle.graph.ops if op.kind == OpKind.MOE)
    w = {r: oracle.weight(n) for r, n in op.weights.items()}
    x = rng.standard_normal((1, 7, oracle.config.n_embd))
    xs = x[0]
    logits = xs @ w["gate_inp"].T + w["gate_inp_b"]
    kth = np.sort(logits, -1)[:, -2][:, None]
    mix = np.where(logits >= kth, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
    mix /= mix.sum(-1, keepdims=True)  # (T, n_expert), zero outside each token's top 2
    gate = np.einsum("te,nfe->tnf", xs, w["gate_exps"]) + w["gate_exps_b"]
    up = np.einsum("te,nfe->tnf", xs, w["up_exps"]) + w["up_exps_b"]
    every = np.einsum("tnf,nef->tne", swiglu_oai(gate, up, 1.702, 7.0), w["down_exps"]) + w["down_exps_b"]
    want = np.einsum("tn,tne->te", mix, every)
    got = oracle._moe(op, x)[0]
    assert np.abs(got - want).max() <= 1e-12 * np.abs(got).max()


@pytest.mark.unit
def test_refusals(tiny_gptoss, tmp_path):
    import tvm

    from luce_compile.lower.relax_model import LowerOptions, lower_graph

    graph = build_graph(read_gguf(tiny_gptoss))
    # the sinks fold in the CPU's kernels and CUDA's float16 flash kernels: not in TVM's float32 ones (--precision f32)
    with pytest.raises(UnsupportedError, match="attention sinks fold in luce-compile's attention kernels"):
        lower_graph(graph, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), LowerOptions(precision="f32"))
    with pytest.raises(UnsupportedError, match="attention sinks fold in luce-compile's attention kernels"):
        lower_graph(graph, tvm.target.Target({"kind": "rocm", "mcpu": "gfx1201"}))
    # YaRN stays gpt-oss's: another architecture's file with it is refused naming it
    qwen3 = cached_synthetic("tiny-qwen3", tmp_path)
    with pytest.raises(UnsupportedError, match="rope scaling 'yarn' is not supported for qwen3"):
        _config_with(qwen3, {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedError, match="yarn_log_multiplier"):
        _config_with(tiny_gptoss, {"gpt-oss.rope.scaling.yarn_log_multiplier": 0.1})
    with pytest.raises(UnsupportedError, match="fused ffn_gate_up_exps"):
        _config_with(tiny_gptoss, {}, extra_tensor="blk.0.ffn_gate_up_exps.weight")


@pytest.mark.unit
def test_the_file_tokenizes_as_a_real_gpt_oss(tiny_gptoss):
    """Real gpt-oss files name llama.cpp's "gpt-4o" pre-tokenizer and carry harmony's tokens and template; the
    synthetic ones too (synthetic_harmony.py), and the runtime's tokenizer loads them (it refused "gpt-4o" once)."""
    from luce_runtime.chat import render_prompt
    from luce_runtime.tokenizer import Tokenizer

    md = read_gguf(tiny_gptoss).metadata
    assert md["tokenizer.ggml.pre"] == "gpt-4o"
    tok = Tokenizer.from_metadata({k: v for k, v in md.items() if k.startswith("tokenizer.")})
    assert tok.vocab.pre.name == "gpt-4o" and tok.vocab_size == PRESETS["tiny-gptoss"].n_vocab
    harmony = "<|start|>assistant<|channel|>final<|message|>Hi<|end|>"
    assert tok.decode(tok.encode(harmony, add_special=False), special=True) == harmony
    assert tok.token_id("<|start|>") in tok.encode(harmony) and tok.token_id("<|end|>") not in tok.eos_ids
    assert {tok.token_id("<|return|>"), tok.token_id("<|call|>")} <= tok.eos_ids and tok.eos_text == "<|return|>"
    prompt = render_prompt(tok, [{"role": "user", "content": "Hi"}], reasoning_effort="high")
    assert "Reasoning: high" in prompt and prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")


@pytest.mark.unit
def test_a_tokenizer_the_runtime_lacks_is_refused_before_lowering(tiny_gptoss, tmp_path, monkeypatch):
    """A pre-tokenizer llama.cpp knows and the runtime's tokenizer does not implement ("kimi-k2"): compile refuses
    it by name before lowering, not when the finished artifact is loaded."""
    import luce_compile.codegen.compile as compile_module
    from luce_compile.errors import TokenizerError

    real_read = compile_module.read_gguf

    def read_kimi(path):
        gguf = real_read(path)
        gguf.metadata["tokenizer.ggml.pre"] = "kimi-k2"
        return gguf

    monkeypatch.setattr(compile_module, "read_gguf", read_kimi)
    monkeypatch.setattr(compile_module, "lower_graph", lambda *a, **k: pytest.fail("lowered before the refusal"))
    with pytest.raises(TokenizerError, match="'kimi-k2' is not supported"):
        compile_module.compile_model(tiny_gptoss, "cpu", tmp_path / "out", use_cache=False)


def _config_with(path, metadata: dict, extra_tensor: str | None = None):
    """model_config of the file with some metadata keys (and a tensor name) added, as a file could hold them."""
    gguf = read_gguf(path)
    gguf.metadata.update(metadata)
    if extra_tensor:
        gguf.tensors[extra_tensor] = gguf.tensors["blk.0.ffn_gate_exps.weight"]
    return model_config(gguf)


@pytest.mark.unit
def test_gpt_oss_20b_preset():
    """gpt-oss-20b's shapes, MXFP4 experts and Q8_0 elsewhere, F32 vectors, router and expert biases; the file would be
    the released mxfp4 GGUF's size (12.1 GB). Not written here: 12 GB."""
    from gguf import GGML_QUANT_SIZES

    spec = PRESETS["gpt-oss-20b"]
    shapes = tensor_shapes(spec)
    types = {n: tensor_type(spec, n, s) for n, s in shapes.items()}
    assert shapes["blk.23.ffn_gate_exps.weight"] == (32, 2880, 2880) and shapes["output.weight"] == (201088, 2880)
    assert shapes["blk.0.attn_q.weight"] == (4096, 2880) and shapes["blk.0.attn_sinks.weight"] == (64,)
    assert types["blk.5.ffn_down_exps.weight"] == T.MXFP4 and types["blk.5.attn_k.weight"] == T.Q8_0
    assert types["blk.5.ffn_up_exps.bias"] == types["blk.5.ffn_gate_inp.weight"] == T.F32
    size = sum(int(np.prod(s)) // GGML_QUANT_SIZES[types[n]][0] * GGML_QUANT_SIZES[types[n]][1]
               for n, s in shapes.items())
    assert 11.9e9 < size < 12.3e9, size


@pytest.mark.slow
@requires_llama_cpp
def test_oracle_agrees_with_llama_cpp(tiny_gptoss):
    """llama.cpp's gpt-oss graph on the same file (f32 KV cache): the emulating oracle at float32 noise on most
    positions, the argmax at >= 97% of them (a disagreement: an activation on an 8-bit boundary, see the module)."""
    from luce_compile.graph.rounding import GgmlRounding
    from tests.graph.test_vs_llama_cpp import PROMPTS, _llama, _scores

    llm, oracle = _llama(tiny_gptoss, exact_kv=True), GgmlRounding(tiny_gptoss)
    close = agree = total = 0
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        ref, ours = _scores(llm, ids), oracle.prefill(ids)
        rows = np.abs(ref - ours).max(-1) / np.abs(ours).max()
        close += int((rows <= 1e-6).sum())
        agree, total = agree + int((ref.argmax(-1) == ours.argmax(-1)).sum()), total + len(ids)
    print(f"tiny-gptoss: {close}/{total} rows within 1e-6 of llama.cpp, argmax agrees at {agree}/{total}")
    assert close >= 0.8 * total and agree >= 0.97 * total
