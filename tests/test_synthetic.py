"""luce_compile.synthetic: specs, quant mixes, metadata as llama.cpp's converter writes it, determinism, weight
scales, and (slow) that llama.cpp loads and runs every tiny preset with non-degenerate logits.

Writing a synthetic model reads SmolLM2's tokenizer from the cached real model; that takes ~0.2 s, so those
tests stay `unit`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from luce_compile import synthetic
from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.config import model_config
from luce_compile.gguf.reader import read_gguf
from luce_compile.synthetic import PRESETS, SyntheticSpec, cached_synthetic, tensor_type, write_synthetic
from luce_compile.synthetic_harmony import HARMONY_TEMPLATE, HARMONY_TOKENS
from tests.conftest import have_llama_cpp, requires_llama_cpp

T = GGMLQuantizationType
TINY = [name for name in PRESETS if name.startswith("tiny-")]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("synthetic")
    return {name: write_synthetic(PRESETS[name], folder / f"{name}.gguf") for name in TINY}


# ------------------------------------------------------------------------------------------------ specs

@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"arch": "mamba"}, UnsupportedError, "'mamba' is not supported"),
    ({"n_head_kv": 3}, GGUFError, "not a multiple of n_head_kv 3"),
    ({"n_layer": 0}, GGUFError, "positive"),
    ({"arch": "qwen2", "head_dim": 32}, GGUFError, "qwen2 needs head_dim"),
    ({"sliding_window": 8}, UnsupportedError, "are not llama features"),
    ({"quant": "IQ2_XXS"}, UnsupportedError, "'IQ2_XXS' is not supported"),
    ({"quant_overrides": {"ffn_down.weight": "IQ3_S"}}, UnsupportedError, "'IQ3_S'"),
    ({**dataclasses.asdict(PRESETS["tiny-gptoss"]), "n_vocab": 49152}, GGUFError, "harmony's special tokens"),
])
def test_bad_specs_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SyntheticSpec(**kwargs)


@pytest.mark.unit
def test_k_quant_on_narrow_rows_refused(tmp_path):
    with pytest.raises(GGUFError, match="rows of 64 elements, which Q4_K"):
        write_synthetic(SyntheticSpec(quant="Q4_K"), tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.unit
def test_override_resolution():
    spec = SyntheticSpec(quant="Q4_0", quant_overrides={"attn_v.weight": "Q5_0", "blk.0.attn_v.weight": "Q8_0",
                                                        "token_embd.weight": "F16"})
    assert tensor_type(spec, "blk.0.attn_v.weight", (32, 64)) == T.Q8_0  # the longest match wins
    assert tensor_type(spec, "blk.10.attn_v.weight", (32, 64)) == T.Q5_0  # "0.attn_v" does not match "10.attn_v"
    assert tensor_type(spec, "blk.1.attn_q.weight", (64, 64)) == T.Q4_0
    assert tensor_type(spec, "token_embd.weight", (49152, 64)) == T.F16
    assert tensor_type(spec, "blk.0.attn_norm.weight", (64,)) == T.F32  # 1-D tensors stay F32


@pytest.mark.unit
def test_specs_are_values():
    a, b = SyntheticSpec(quant_overrides={"x": "Q8_0"}), SyntheticSpec(quant_overrides={"x": "Q8_0"})
    assert a == b and hash(a) == hash(b) and json.loads(a.to_json())["quant_overrides"] == {"x": "Q8_0"}
    overrides = {"x": "Q8_0"}
    c = SyntheticSpec(quant_overrides=overrides)
    overrides["x"] = "F16"
    assert c.quant_overrides == {"x": "Q8_0"}  # the spec keeps its own copy


@pytest.mark.unit
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_has_a_valid_plan(name):
    spec = PRESETS[name]
    plan = list(synthetic._plan(spec))
    assert plan[0][:2] == ("token_embd.weight", (spec.n_vocab, spec.n_embd))
    assert all(t == T.F32 for _, shape, t in plan if len(shape) == 1)
    assert all(shape[-1] % synthetic.GGML_QUANT_SIZES[t][0] == 0 for _, shape, t in plan)


@pytest.mark.unit
def test_gemma3_preset_quant_mix():
    """The real Gemma 3 270M Q4_K_M mix (read from the file): layers 0,1,4,7,10,13,15,16,17 get more bits."""
    spec = PRESETS["gemma3-270m"]
    more_bits = {0, 1, 4, 7, 10, 13, 15, 16, 17}
    for i in range(18):
        assert tensor_type(spec, f"blk.{i}.attn_v.weight", (256, 640)) == (T.Q8_0 if i in more_bits else T.Q5_0)
        assert tensor_type(spec, f"blk.{i}.ffn_down.weight", (640, 2048)) == (T.Q6_K if i in more_bits else T.Q4_K)
        assert tensor_type(spec, f"blk.{i}.attn_output.weight", (640, 1024)) == T.Q4_K
        assert tensor_type(spec, f"blk.{i}.ffn_up.weight", (2048, 640)) == T.Q5_0
    assert tensor_type(spec, "token_embd.weight", (49152, 640)) == T.Q8_0


@pytest.mark.slow
def test_gemma3_preset_matches_real_file_types(gemma3_path):
    real = read_gguf(gemma3_path)
    spec = PRESETS["gemma3-270m"]
    shapes = synthetic.tensor_shapes(spec)
    assert set(shapes) == set(real.tensors)
    for info in real:
        if info.name != "token_embd.weight":  # the real vocabulary is 262144
            assert shapes[info.name] == info.shape, info.name
        assert tensor_type(spec, info.name, shapes[info.name]) == info.ggml_type, info.name


# ------------------------------------------------------------------------------------------------ files

@pytest.mark.slow  # reads the real SmolLM2 file
@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_metadata(tiny_files, smollm2_path, name):
    spec, gguf = PRESETS[name], read_gguf(tiny_files[name])
    md, a = gguf.metadata, spec.arch
    assert md["general.architecture"] == a and md[f"{a}.block_count"] == spec.n_layer
    assert md[f"{a}.embedding_length"] == spec.n_embd and md[f"{a}.feed_forward_length"] == spec.n_ff
    assert md[f"{a}.attention.head_count"] == spec.n_head and md[f"{a}.attention.head_count_kv"] == spec.n_head_kv
    assert (f"{a}.attention.key_length" in md) == (a == "gemma3" or spec.head_size * spec.n_head != spec.n_embd)
    assert (f"{a}.attention.sliding_window" in md) == (spec.sliding_window > 0)
    assert (f"{a}.final_logit_softcapping" in md) == (spec.final_logit_softcap > 0)
    assert SyntheticSpec(**json.loads(md[synthetic.SPEC_KEY])) == spec
    real = {k: v for k, v in read_gguf(smollm2_path).metadata.items() if k.startswith("tokenizer.")}
    ours = {k: v for k, v in md.items() if k.startswith("tokenizer.")}
    assert len(ours["tokenizer.ggml.tokens"]) == spec.n_vocab and gguf.tensors["token_embd.weight"].shape == \
        (spec.n_vocab, 64)
    if a == "gpt-oss":  # SmolLM2's tokens and merges, then harmony's specials, as a real gpt-oss file names them
        n = len(real["tokenizer.ggml.tokens"])
        assert ours["tokenizer.ggml.tokens"][:n] == real["tokenizer.ggml.tokens"]
        assert ours["tokenizer.ggml.tokens"][n:n + len(HARMONY_TOKENS)] == list(HARMONY_TOKENS)
        assert ours["tokenizer.ggml.merges"] == real["tokenizer.ggml.merges"]
        assert (ours["tokenizer.ggml.pre"], ours["tokenizer.chat_template"]) == ("gpt-4o", HARMONY_TEMPLATE)
        return
    assert ours == real


@pytest.mark.unit
@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_tensors(tiny_files, name):
    spec, gguf = PRESETS[name], read_gguf(tiny_files[name])
    assert {n: i.shape for n, i in gguf.tensors.items()} == synthetic.tensor_shapes(spec)
    assert ("output.weight" in gguf.tensors) == (not spec.tied_output)
    for info in gguf:  # the MoE router and biases stay F32, as llama-quantize leaves them; the overrides by suffix
        plain = len(info.shape) == 1 or info.name.endswith(("ffn_gate_inp.weight", ".bias"))
        want = spec.quant_overrides.get(info.name.split(".", 2)[-1], spec.quant)
        assert info.ggml_type == (T.F32 if plain else T[want]), info.name
    # quantization kept the values: the file's weights are the generated ones within Q8_0 error
    down = "blk.1.ffn_down_exps.weight" if spec.n_expert else "blk.1.ffn_down.weight"
    for name_ in ("blk.0.attn_q.weight", down, "token_embd.weight"):
        if gguf.tensors[name_].ggml_type != T.Q8_0:  # gpt-oss's MXFP4 experts: tests/gguf test the type
            continue
        want = synthetic.tensor_values(spec, name_, gguf.tensors[name_].shape)
        got = gguf.dequantize(name_)
        assert np.abs(got - want).max() <= np.abs(want).max() / 127 + 1e-6


@pytest.mark.unit
def test_weight_scales(tiny_files):
    gguf = read_gguf(tiny_files["tiny-qwen2"])
    assert gguf.dequantize("token_embd.weight").std() == pytest.approx(1 / 8, rel=0.02)
    assert gguf.dequantize("blk.0.ffn_down.weight").std() == pytest.approx(1 / np.sqrt(128), rel=0.05)
    q_std = np.sqrt(synthetic.ATTENTION_SHARPNESS) / 8
    assert gguf.dequantize("blk.0.attn_q.weight").std() == pytest.approx(q_std, rel=0.05)
    assert gguf.dequantize("blk.0.attn_norm.weight").mean() == pytest.approx(1.0, abs=0.05)
    assert 0.1 < gguf.dequantize("blk.0.attn_q.bias").std() < 0.3
    assert gguf.dequantize("output_norm.weight").mean() == pytest.approx(4.0, rel=0.05)  # untied: std-1/8 head
    gemma = read_gguf(tiny_files["tiny-gemma3"])  # embeddings 1/n_embd: the model's sqrt(n_embd) brings 1/sqrt(n)
    assert gemma.dequantize("token_embd.weight").std() == pytest.approx(1 / 64, rel=0.05)


@pytest.mark.unit
def test_deterministic_and_seeded(tmp_path):
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    spec = SyntheticSpec(n_layer=1)
    a, b = write_synthetic(spec, tmp_path / "a.gguf"), write_synthetic(spec, tmp_path / "b.gguf")
    assert digest(a) == digest(b)
    c = write_synthetic(SyntheticSpec(n_layer=1, seed=1), tmp_path / "c.gguf")
    assert digest(c) != digest(a)
    # a tensor's values depend on the seed and its name only, not on other tensors' types
    d = write_synthetic(SyntheticSpec(n_layer=1, quant_overrides={"ffn_up.weight": "F16"}), tmp_path / "d.gguf")
    ga, gd = read_gguf(a), read_gguf(d)
    assert np.array_equal(ga.raw("blk.0.ffn_down.weight"), gd.raw("blk.0.ffn_down.weight"))
    assert gd.tensors["blk.0.ffn_up.weight"].ggml_type == T.F16
    assert not (tmp_path / "a.gguf.tmp").exists()


@pytest.mark.unit
def test_cached_synthetic_reuses_the_file(tmp_path):
    spec = SyntheticSpec(n_layer=1)
    path = cached_synthetic(spec, tmp_path)
    mtime = path.stat().st_mtime_ns
    assert cached_synthetic(spec, tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert cached_synthetic(SyntheticSpec(n_layer=1, seed=2), tmp_path) != path


@pytest.mark.unit
def test_cli(tmp_path, capsys):
    assert synthetic.main(["no-such-preset", str(tmp_path / "x.gguf")]) == 2
    assert "presets: tiny-llama" in capsys.readouterr().err
    assert synthetic.main(["tiny-qwen3", str(tmp_path / "q.gguf")]) == 0
    assert model_config(read_gguf(tmp_path / "q.gguf")).head_dim == 32


@pytest.mark.unit
def test_preset_at_type_follows_llama_quantize():
    """PRESET@TYPE: every 2-D weight in the type, but the LM head (tied: token_embd) in Q6_K, and rows the type's
    blocks do not divide in llama-quantize's fallback type (tiny-llama's 64- and 128-wide rows are no K-quant's)."""
    spec = synthetic.preset("tiny-llama@IQ4_XS")
    assert spec.quant == "IQ4_XS" and spec.n_embd == PRESETS["tiny-llama"].n_embd
    types = {name: t.name for name, _, t in synthetic._plan(spec)}
    assert types["token_embd.weight"] == "Q8_0"  # tied head: Q6_K's 256 does not divide 64 either
    assert {types[f"blk.0.{n}.weight"] for n in ("attn_q", "attn_v", "ffn_up", "ffn_down")} == {"IQ4_NL"}
    assert types["blk.0.attn_norm.weight"] == "F32"
    wide = synthetic.in_type(SyntheticSpec(n_embd=256, n_ff=512, tied_output=False), "Q3_K")
    types = {name: t.name for name, _, t in synthetic._plan(wide)}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q3_K"
    assert {t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")} == {"Q3_K"}
    assert synthetic.preset("tiny-llama@Q2_K").quant_overrides["blk.1.ffn_down.weight"] == "Q4_0"
    assert not synthetic.preset("tiny-llama@Q8_0").quant_overrides  # Q8_0 heads keep Q8_0
    assert synthetic.preset("smollm2-135m@F16").quant_overrides == {}  # the preset's own mix is dropped
    with pytest.raises(UnsupportedError, match="'IQ2_XXS' is not supported"):
        synthetic.preset("tiny-llama@IQ2_XXS")


@pytest.mark.unit
def test_cli_preset_at_type(tmp_path, capsys):
    assert synthetic.main(["tiny-qwen3@MXFP4", str(tmp_path / "m.gguf")]) == 0
    gguf = read_gguf(tmp_path / "m.gguf")
    assert gguf.tensor("blk.0.attn_q.weight").ggml_type == T.MXFP4
    assert gguf.tensor("token_embd.weight").ggml_type == T.Q8_0
    assert synthetic.main(["tiny-qwen3@Q9_9", str(tmp_path / "x.gguf")]) == 2
    assert "'Q9_9' is not supported" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ llama.cpp

PROMPT = b"The capital of France is Paris, and the capital of Germany is Berlin. Numbers: 1 2 3 4 5. def f(x):"


def _llama_cpp_logits(path) -> tuple[list[int], np.ndarray]:
    from llama_cpp import Llama

    model = Llama(model_path=str(path), logits_all=True, n_ctx=256, verbose=False, n_threads=1)
    tokens = model.tokenize(PROMPT, add_bos=False)
    model.eval(tokens)
    return tokens, np.array(model.scores[:len(tokens)])


@pytest.mark.slow
@requires_llama_cpp
@pytest.mark.parametrize("name", TINY)
def test_llama_cpp_runs_tiny_presets(tiny_files, name):
    """llama.cpp loads the file and its logits are usable by an argmax oracle: finite, spread (std ≈ 4), the
    greedy token varies by position and is not the input token, and the top-2 gap is rarely tiny."""
    tokens, logits = _llama_cpp_logits(tiny_files[name])
    assert logits.shape == (len(tokens), PRESETS[name].n_vocab) and np.isfinite(logits).all()
    assert 3.0 < logits.std(axis=1).mean() < 5.0
    greedy = logits.argmax(axis=1)
    assert len(set(greedy.tolist())) >= 0.8 * len(tokens)
    assert (greedy == np.array(tokens)).mean() < 0.1
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.2


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "real"), [("smollm2-135m", "smollm2_path"), ("gemma3-270m", "gemma3_path")])
def test_real_shape_presets_match_the_real_models(tmp_path, request, preset, real):
    """The synthetic stand-ins have the real models' ModelConfig (except the vocabulary) and llama.cpp runs them."""
    path = write_synthetic(PRESETS[preset], tmp_path / f"{preset}.gguf")
    ours, theirs = model_config(read_gguf(path)), model_config(read_gguf(request.getfixturevalue(real)))
    assert {**ours.to_dict(), "n_vocab": 0} == {**theirs.to_dict(), "n_vocab": 0}
    if have_llama_cpp():
        tokens, logits = _llama_cpp_logits(path)
        assert np.isfinite(logits).all() and len(set(logits.argmax(axis=1).tolist())) >= 0.7 * len(tokens)
