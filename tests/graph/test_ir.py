"""The graph IR and the per-architecture builders: op order as in llama.cpp's src/models/<arch>.cpp, attributes
from the metadata, and validation that refuses broken graphs and files that do not match their architecture."""

from __future__ import annotations

import dataclasses

import pytest
from gguf import GGMLQuantizationType

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.config import SUPPORTED_ARCHS, model_config
from luce_compile.gguf.reader import TensorInfo, read_gguf
from luce_compile.graph import BUILDERS, Graph, Op, OpKind, build_graph, validate
from luce_compile.graph.ir import GraphError
from tests.graph.conftest import TINY

# Block 0 of each tiny model, op by op. The differences are the architectures': qwen3/gemma3 normalize q and k per
# head before RoPE; gemma3 scales q after RoPE and norms after attention and after the FFN, before each residual add.
_ATTN = "rms_norm matmul reshape matmul reshape matmul reshape"
_FFN = "rms_norm matmul matmul glu matmul"
GOLDEN_BLOCK = {
    "tiny-llama": f"{_ATTN} rope rope attention matmul add {_FFN} add",
    "tiny-qwen2": f"{_ATTN} rope rope attention matmul add {_FFN} add",
    "tiny-qwen3": f"{_ATTN} rms_norm rope rms_norm rope attention matmul add {_FFN} add",
    "tiny-gemma3": f"{_ATTN} rms_norm rope rms_norm rope scale attention matmul rms_norm add {_FFN} rms_norm add",
}


def _graph(synthetic, preset: str, **changes) -> Graph:
    return build_graph(read_gguf(synthetic(preset, **changes)))


def _block(graph: Graph, il: int) -> list[Op]:
    return [op for op in graph.ops if op.outputs[0].startswith(f"blk.{il}.")]


@pytest.mark.unit
@pytest.mark.parametrize("preset", TINY)
def test_block_op_order_matches_llama_cpp(synthetic, preset):
    graph = _graph(synthetic, preset)
    for il in range(graph.config.n_layer):
        assert " ".join(op.kind.value for op in _block(graph, il)) == GOLDEN_BLOCK[preset]
    assert graph.ops[0].kind == OpKind.EMBEDDING and graph.outputs == ("logits",)
    assert len(graph.attention_ops()) == graph.config.n_layer


@pytest.mark.unit
@pytest.mark.parametrize("preset", TINY)
def test_graph_reads_every_file_tensor_with_its_type(synthetic, preset):
    path = synthetic(preset)
    gguf = read_gguf(path)
    graph = build_graph(gguf)
    assert graph.weights == gguf.tensors  # every tensor read, each with its ggml type and shape
    assert graph.source == path
    values = validate(graph, gguf.tensors)
    assert values["logits"].shape == ("B", "S", graph.config.n_vocab)
    assert values["blk.0.Qcur_rope"].shape == ("B", "S", graph.config.n_head, graph.config.head_dim)


@pytest.mark.unit
def test_qwen2_biases_and_untied_head(synthetic):
    graph = _graph(synthetic, "tiny-qwen2")
    qkv = [op for op in _block(graph, 0) if op.kind == OpKind.MATMUL][:3]
    assert [op.weights["bias"] for op in qkv] == [f"blk.0.attn_{t}.bias" for t in "qkv"]
    assert graph.ops[-1].kind == OpKind.LM_HEAD and graph.ops[-1].weights == {"weight": "output.weight"}
    assert all(op.attrs["layout"] == "neox" for op in graph.ops if op.kind == OpKind.ROPE)


@pytest.mark.unit
def test_llama_rope_is_norm_and_scale_in_attention(synthetic):
    graph = _graph(synthetic, "tiny-llama")
    rope = next(op for op in graph.ops if op.kind == OpKind.ROPE)
    assert rope.attrs == {"layout": "norm", "dim": 16, "base": 10000.0, "freq_scale": 1.0}
    att = graph.attention_ops()[0]
    assert att.attrs["scale"] == pytest.approx(16 ** -0.5) and att.attrs["sliding_window"] == 0


@pytest.mark.unit
def test_gemma3_sliding_layers_windows_bases_and_softcap(synthetic):
    graph = _graph(synthetic, "tiny-gemma3")  # 3 layers, pattern 3: two local then one global, window 8
    c = graph.config
    assert [op.attrs["sliding_window"] for op in graph.attention_ops()] == [8, 8, 0]
    bases = [op.attrs["base"] for op in graph.ops if op.kind == OpKind.ROPE and op.outputs[0].endswith("Qcur_rope")]
    assert bases == [c.rope_base_local, c.rope_base_local, c.rope_base] == [10000.0, 10000.0, 1e6]
    scale = next(op for op in graph.ops if op.kind == OpKind.SCALE)
    assert scale.attrs["scale"] == pytest.approx(c.head_dim ** -0.5)
    assert all(op.attrs["scale"] == 1.0 for op in graph.attention_ops())  # q already scaled (gemma3.cpp)
    assert graph.ops[0].attrs["scale"] == pytest.approx(c.n_embd ** 0.5)
    assert graph.ops[-1].kind == OpKind.SOFTCAP and graph.ops[-1].attrs["cap"] == 30.0
    assert {op.attrs["activation"] for op in graph.ops if op.kind == OpKind.GLU} == {"gelu_tanh"}


@pytest.mark.unit
def test_registry_covers_the_supported_architectures():
    assert tuple(BUILDERS) == SUPPORTED_ARCHS


@pytest.mark.unit
def test_llama_reads_rope_freq_factors(synthetic):
    gguf = read_gguf(synthetic("tiny-llama"))
    config = model_config(gguf)
    factors = TensorInfo("rope_freqs.weight", GGMLQuantizationType.F32, (config.rope_dim // 2,), 0, 32)
    graph = BUILDERS["llama"](config, {**gguf.tensors, factors.name: factors})
    ropes = [op for op in graph.ops if op.kind == OpKind.ROPE]
    assert ropes and all(op.weights == {"freq_factors": "rope_freqs.weight"} for op in ropes)


@pytest.mark.unit
def test_file_with_unread_tensor_is_refused(synthetic):
    gguf = read_gguf(synthetic("tiny-qwen3"))
    fused = TensorInfo("blk.0.attn_qkv.weight", GGMLQuantizationType.F32, (8, 64), 0, 2048)
    with pytest.raises(UnsupportedError, match="attn_qkv"):
        BUILDERS["qwen3"](model_config(gguf), {**gguf.tensors, fused.name: fused})


@pytest.mark.unit
def test_architecture_style_mismatches_are_refused(synthetic):
    qwen3 = model_config(read_gguf(synthetic("tiny-qwen3")))
    tensors = read_gguf(synthetic("tiny-qwen3")).tensors
    with pytest.raises(GGUFError, match="lacks attn_q_norm"):
        BUILDERS["qwen3"](dataclasses.replace(qwen3, qk_norm=False), tensors)
    with pytest.raises(GGUFError, match="does not read"):  # a llama file carrying q/k norms is not plain llama
        BUILDERS["llama"](dataclasses.replace(qwen3, arch="llama"), tensors)
    with pytest.raises(UnsupportedError, match="llama builder was given"):
        BUILDERS["llama"](qwen3, tensors)
    with pytest.raises(UnsupportedError, match="rope.dimension_count"):
        BUILDERS["qwen3"](dataclasses.replace(qwen3, rope_dim=16), tensors)


@pytest.mark.unit
def test_missing_weight_is_a_gguf_error(synthetic):
    gguf = read_gguf(synthetic("tiny-llama"))
    tensors = {k: v for k, v in gguf.tensors.items() if k != "blk.1.ffn_up.weight"}
    with pytest.raises(GGUFError, match="blk.1.ffn_up.weight"):
        BUILDERS["llama"](model_config(gguf), tensors)


def _mutated(graph: Graph, **changes) -> Graph:
    return dataclasses.replace(graph, ops=list(graph.ops), weights=dict(graph.weights), **changes)


@pytest.mark.unit
def test_validate_rejects_broken_graphs(synthetic):
    good = _graph(synthetic, "tiny-llama")
    validate(good)

    g = _mutated(good)
    g.ops[1], g.ops[2] = g.ops[2], g.ops[1]  # Qcur computed before attn_norm
    with pytest.raises(GraphError, match="before any op produces"):
        validate(g)

    g = _mutated(good)
    g.ops.insert(2, g.ops[1])
    with pytest.raises(GraphError, match="redefines"):
        validate(g)

    g = _mutated(good)
    info = g.weights["blk.0.attn_q.weight"]
    g.weights[info.name] = dataclasses.replace(info, shape=(info.shape[0], info.shape[1] + 1))
    with pytest.raises(GraphError, match="last dim"):
        validate(g)

    g = _mutated(good)
    g.weights["stray.weight"] = info
    with pytest.raises(GraphError, match="no op reads"):
        validate(g)

    g = _mutated(good)
    att = g.attention_ops()[1]
    g.ops[g.ops.index(att)] = dataclasses.replace(att, attrs={**att.attrs, "layer": 0})
    with pytest.raises(GraphError, match="KV-cache slots"):
        validate(g)

    g = _mutated(good)
    i = next(i for i, op in enumerate(g.ops) if op.kind == OpKind.RESHAPE)
    g.ops[i] = dataclasses.replace(g.ops[i], attrs={"shape": ("B", "S", 3, 16)})
    with pytest.raises(GraphError, match="cannot reshape"):
        validate(g)

    g = _mutated(good, outputs=("nothing",))
    with pytest.raises(GraphError, match="never produced"):
        validate(g)


@pytest.mark.unit
def test_validate_against_file_tensors(synthetic):
    gguf = read_gguf(synthetic("tiny-llama"))
    graph = build_graph(gguf)
    info = gguf.tensors["output_norm.weight"]
    with pytest.raises(GGUFError, match="output_norm.weight"):
        validate(graph, {**gguf.tensors, info.name: dataclasses.replace(info, shape=(7,))})
    with pytest.raises(UnsupportedError, match="extra.weight"):
        validate(graph, {**gguf.tensors, "extra.weight": info})


@pytest.mark.unit
def test_describe_lists_every_op():
    op = Op(OpKind.MATMUL, ("x",), ("y",), {"weight": "w.weight"}, {})
    assert str(op) == "y = matmul(x) weight=w.weight"


@pytest.mark.slow
def test_real_model_graphs(smollm2_path, gemma3_path):
    smol = build_graph(read_gguf(smollm2_path))
    assert len(smol.attention_ops()) == 30 and smol.n_params == 134_515_008
    assert smol.ops[-1].weights == {"weight": "token_embd.weight"}  # tied output
    gemma = build_graph(read_gguf(gemma3_path))
    windows = [op.attrs["sliding_window"] for op in gemma.attention_ops()]
    assert windows == [0 if il % 6 == 5 else 512 for il in range(18)]  # layers 5, 11, 17 are global
    assert gemma.ops[-1].kind == OpKind.LM_HEAD  # Gemma 3 270M has no final softcapping
