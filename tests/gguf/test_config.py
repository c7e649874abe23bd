"""model_config on the real models, on synthetic models of every architecture, and on metadata that lies."""

from __future__ import annotations

import math
import struct

import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from luce_compile import synthetic
from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.config import ModelConfig, expected_tensors, model_config
from luce_compile.gguf.reader import read_gguf
from luce_compile.synthetic import PRESETS, SyntheticSpec, write_synthetic
from tests.gguf.test_reader import gguf_bytes, kv, kv_str, kv_u32, tensor_info

T = GGMLQuantizationType


# ------------------------------------------------------------------------------------------------ real models

@pytest.mark.slow
def test_smollm2_config(smollm2_path):
    c = model_config(read_gguf(smollm2_path))
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v, c.n_ff, c.n_vocab) == \
        ("llama", 30, 576, 9, 3, 64, 64, 1536, 49152)
    assert c.rope_layout == "norm" and c.rope_base == 1e5 and c.rope_dim == 64 and c.rope_scale == 1.0
    assert c.tied_output and not c.attn_bias and not c.qk_norm and not c.post_norms
    assert c.activation == "silu" and c.embed_scale == 1.0 and c.sliding == (False,) * 30
    assert c.q_scale == pytest.approx(1 / 8) and c.n_rep == 3 and c.n_ctx_train == 8192
    assert c.rms_eps == pytest.approx(1e-5)
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.slow
def test_gemma3_config(gemma3_path):
    c = model_config(read_gguf(gemma3_path))
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v, c.n_ff, c.n_vocab) == \
        ("gemma3", 18, 640, 4, 1, 256, 256, 2048, 262144)
    assert c.sliding == tuple(i % 6 != 5 for i in range(18))  # 5 local : 1 global; layers 5, 11, 17 global
    assert c.sliding_window == 512 and c.rope_base == 1e6 and c.rope_base_local == 10000.0
    assert c.rope_layout == "neox" and c.rope_dim == 256
    assert c.embed_scale == pytest.approx(math.sqrt(640)) and c.attn_scale == pytest.approx(1 / 16)
    assert c.qk_norm and c.post_norms and c.tied_output and not c.attn_bias
    assert c.activation == "gelu_tanh" and c.final_logit_softcap == 0.0 and c.attn_logit_softcap == 0.0
    assert c.rms_eps == pytest.approx(1e-6)


# ------------------------------------------------------------------------------------------------ synthetic

@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory) -> dict[str, ModelConfig]:
    folder = tmp_path_factory.mktemp("tiny")
    return {name: model_config(read_gguf(write_synthetic(PRESETS[name], folder / f"{name}.gguf")))
            for name in PRESETS if name.startswith("tiny-")}


@pytest.mark.unit
@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
def test_synthetic_config_matches_spec(tiny_configs, name):
    spec, c = PRESETS[name], tiny_configs[name]
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_vocab, c.n_ctx_train) == \
        (spec.arch, spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_size, spec.n_ff, spec.n_vocab,
         spec.n_ctx)
    assert c.rope_base == spec.rope_base and c.rms_eps == pytest.approx(spec.rms_eps)
    assert c.rope_layout == ("norm" if spec.arch == "llama" else "neox")
    assert c.attn_bias == (spec.arch in ("qwen2", "gpt-oss"))
    assert c.qk_norm == (spec.arch in ("qwen3", "qwen3moe", "gemma3"))
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp) == (spec.n_expert, spec.n_expert_used, spec.n_ff_exp)
    assert c.post_norms == (spec.arch == "gemma3") and c.tied_output == spec.tied_output
    assert c.final_logit_softcap == spec.final_logit_softcap


@pytest.mark.unit
def test_synthetic_gemma3_layers(tiny_configs):
    c = tiny_configs["tiny-gemma3"]
    assert c.sliding == (True, True, False) and c.sliding_window == 8  # pattern 3: every 3rd layer global
    assert c.embed_scale == 8.0 and c.activation == "gelu_tanh" and c.attn_scale == pytest.approx(1 / math.sqrt(32))


@pytest.mark.unit
@pytest.mark.parametrize(("window", "pattern", "expected"), [
    (4, 6, (True,) * 5 + (False, True)),  # the default pattern: no key written, llama.cpp's 6 assumed
    (4, 2, (True, False) * 3 + (True,)),
    (0, 6, (False,) * 7),  # no window: every layer global
])
def test_gemma3_sliding_patterns(tmp_path, window, pattern, expected):
    spec = SyntheticSpec(arch="gemma3", n_layer=7, sliding_window=window, sliding_window_pattern=pattern)
    gguf = read_gguf(write_synthetic(spec, tmp_path / "g.gguf"))
    assert ("gemma3.attention.sliding_window_pattern" in gguf.metadata) == (window > 0 and pattern != 6)
    c = model_config(gguf)
    assert c.sliding == expected and c.sliding_window == window


# ------------------------------------------------------------------------------------------------ bad metadata

def _llama_kvs(**overrides: int) -> list[bytes]:
    values = {"block_count": 1, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
              "feed_forward_length": 128} | overrides
    kvs = [kv_str("general.architecture", "llama"),
           kv("llama.attention.layer_norm_rms_epsilon", GGUFValueType.FLOAT32, struct.pack("<f", 1e-5))]
    return kvs + [kv_u32(f"llama.{k}", v) for k, v in values.items() if v is not None]


def _config_of(tmp_path, kvs: list[bytes]) -> ModelConfig:
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes(kvs, [tensor_info("token_embd.weight", [64, 2], T.F32, 0)], b"\0" * 512))
    return model_config(read_gguf(path))


@pytest.mark.unit
@pytest.mark.parametrize(("overrides", "match"), [
    ({"block_count": None}, "required metadata key 'llama.block_count' is missing"),
    ({"attention.head_count_kv": 3}, "not a multiple of head_count_kv 3"),
    ({"embedding_length": 0}, "embedding_length = 0 is not a sensible"),
    ({"rope.dimension_count": 15}, "must be even"),
    ({"attention.key_length": 1 << 30}, "key_length = 1073741824"),
])
def test_bad_metadata_refused(tmp_path, overrides, match):
    with pytest.raises(GGUFError, match=match):
        _config_of(tmp_path, _llama_kvs(**overrides))


@pytest.mark.unit
def test_tensor_shape_contradicting_metadata(tmp_path, monkeypatch):
    """A file whose blk.1.ffn_up is (96, 64) while feed_forward_length says 128."""
    shapes = synthetic.tensor_shapes
    monkeypatch.setattr(synthetic, "tensor_shapes", lambda spec: {**shapes(spec), "blk.1.ffn_up.weight": (96, 64)})
    gguf = read_gguf(write_synthetic(SyntheticSpec(), tmp_path / "bad.gguf"))
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_up.weight' has shape \(96, 64\).*implies \(128, 64\)"):
        model_config(gguf)


@pytest.mark.unit
def test_missing_tensor_refused(tmp_path, monkeypatch):
    shapes = synthetic.tensor_shapes
    monkeypatch.setattr(synthetic, "tensor_shapes",
                        lambda spec: {k: v for k, v in shapes(spec).items() if k != "blk.0.attn_k.weight"})
    gguf = read_gguf(write_synthetic(SyntheticSpec(), tmp_path / "bad.gguf"))
    with pytest.raises(GGUFError, match="'blk.0.attn_k.weight' is missing"):
        model_config(gguf)


@pytest.mark.unit
def test_unsupported_rope_scaling(tmp_path):
    kvs = _llama_kvs() + [kv_str("llama.rope.scaling.type", "yarn"),
                          kv("llama.rope.scaling.factor", GGUFValueType.FLOAT32, struct.pack("<f", 4.0))]
    with pytest.raises(UnsupportedError, match="rope scaling 'yarn'"):
        _config_of(tmp_path, kvs)


@pytest.mark.unit
def test_expected_tensors_agree_with_synthetic_writer():
    """Two independent listings of each architecture's tensors (the reader's and the writer's) agree."""
    for name, spec in PRESETS.items():
        c = ModelConfig(arch=spec.arch, n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head,
                        n_head_kv=spec.n_head_kv, head_dim=spec.head_size, head_dim_v=spec.head_size, n_ff=spec.n_ff,
                        n_vocab=spec.n_vocab, n_ctx_train=spec.n_ctx, rms_eps=spec.rms_eps, rope_base=spec.rope_base,
                        rope_dim=spec.head_size, rope_layout="neox", attn_bias=spec.arch in ("qwen2", "gpt-oss"),
                        qk_norm=spec.arch in ("qwen3", "qwen3moe", "gemma3"), post_norms=spec.arch == "gemma3",
                        tied_output=spec.tied_output, n_expert=spec.n_expert, n_expert_used=spec.n_expert_used,
                        n_ff_exp=spec.n_ff_exp, attn_sinks=spec.arch == "gpt-oss", expert_bias=spec.arch == "gpt-oss")
        assert expected_tensors(c) == synthetic.tensor_shapes(spec), name
