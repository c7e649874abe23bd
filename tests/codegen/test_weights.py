"""One weight repack: the weights.bin a GPU machine rebuilds from the GGUF (scripts/device_check.py) is byte for byte
the one the compiler wrote, BF16 vectors (widened to float32 by quant_layout.weight_planes) included."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from luce_compile.lower.quant_layout import weight_planes
from tests.bench._load import load_script


@pytest.mark.unit
def test_bf16_vectors_are_widened_exactly_and_matrices_keep_their_bits():
    values = np.array([1.0, -2.5, 3.140625, 2.0**-100, -0.0], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bf16
    raw = bits.view(np.uint8)
    assert np.array_equal(weight_planes(raw, "BF16", n_dims=1)["w"].ravel(), values)
    matrix = weight_planes(np.tile(raw[:8], (2, 1)), "BF16", n_dims=2)["w"]
    assert matrix.dtype == np.uint16 and np.array_equal(matrix[1], bits[:4])


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_1", "IQ4_XS", "F16"])
def test_a_tensor_repacked_in_row_chunks_equals_it_repacked_whole(qtype, monkeypatch):
    """repack takes REPACK_BYTES of rows at a time (its temporaries are ~30x the raw bytes: a 128K-vocabulary
    embedding whole took ~9 GB); chunks that split the rows unevenly give the planes of one pass, bit for bit."""
    from gguf import GGML_QUANT_SIZES

    from luce_compile.lower import quant_layout

    kind = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(3).integers(0, 256, (37, 512 // block * size), dtype=np.uint8)
    whole = quant_layout.repack(raw, kind)
    monkeypatch.setattr(quant_layout, "REPACK_BYTES", raw.shape[1] * 5)  # 7 full chunks of 5 rows and one of 2
    chunked = quant_layout.repack(raw, kind)
    assert whole.keys() == chunked.keys()
    for name in whole:
        assert whole[name].dtype == chunked[name].dtype and whole[name].shape == chunked[name].shape
        assert whole[name].tobytes() == chunked[name].tobytes(), name


def _device_check():
    return load_script("device_check")


@pytest.mark.slow
def test_device_check_rebuilds_the_compiled_weights_of_a_bf16_model(tmp_path: Path, monkeypatch):
    import luce_compile.synthetic as synthetic
    from luce_compile.codegen.compile import compile_model
    from luce_compile.gguf.reader import read_gguf

    # synthetic models write their vectors as F32; here they are BF16 too, so the widened path is taken
    as_generated = synthetic.tensor_type
    monkeypatch.setattr(synthetic, "tensor_type", lambda spec, name, shape: (
        GGMLQuantizationType.BF16 if len(shape) == 1 else as_generated(spec, name, shape)))
    gguf = synthetic.write_synthetic(dataclasses.replace(synthetic.preset("tiny-qwen2"), quant="BF16"),
                                     tmp_path / "bf16.gguf")
    monkeypatch.undo()
    tensors = read_gguf(gguf).tensors.values()
    assert {t.ggml_type.name for t in tensors if len(t.shape) == 1} == {"BF16"}  # norms and qwen2's biases

    artifact = compile_model(gguf, "cpu", tmp_path / "artifact", use_cache=False)
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(artifact, rebuilt)
    (rebuilt / "weights.bin").unlink()
    result = _device_check().rebuild_weights(rebuilt, gguf)
    assert (rebuilt / "weights.bin").read_bytes() == (artifact / "weights.bin").read_bytes()
    assert result == {"weights_sha_match": True, "gguf_sha_match": True}


@pytest.mark.slow
def test_a_gpu_build_of_a_neox_model_reorders_q_and_k_rows_and_device_check_does_too(tmp_path: Path):
    """A GPU build with megakernels writes Qwen2's q and k rows (and biases) with the NEOX pairs interleaved
    (graph/rope_pairs.py), says so per param, and device_check's rebuild writes the same bytes from the GGUF."""
    import json

    from luce_compile.codegen.compile import compile_model
    from luce_compile.graph.rope_pairs import reorder_rows
    from luce_compile.synthetic import cached_synthetic

    gguf = cached_synthetic("tiny-qwen2")
    artifact = compile_model(gguf, "sm_90", tmp_path / "artifact", use_cache=False)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kernels"]["rope_rows_interleaved"]
    params = manifest["weights"]["params"]
    reordered = {p["source_tensor"] for p in params if p.get("row_pairs")}
    assert reordered == {f"blk.{i}.attn_{t}.{w}" for i in range(2) for t in "qk" for w in ("weight", "bias")}
    bias = next(p for p in params if p["source_tensor"] == "blk.0.attn_q.bias")
    stored = np.fromfile(artifact / "weights.bin", dtype=np.float32, count=bias["nbytes"] // 4, offset=bias["offset"])
    from luce_compile.gguf.reader import read_gguf

    original = read_gguf(gguf).dequantize("blk.0.attn_q.bias")
    assert np.array_equal(stored, reorder_rows(original, bias["row_pairs"]))
    assert not np.array_equal(stored, original)
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(artifact, rebuilt)
    (rebuilt / "weights.bin").unlink()
    _device_check().rebuild_weights(rebuilt, gguf)
    assert (rebuilt / "weights.bin").read_bytes() == (artifact / "weights.bin").read_bytes()
    # the device scripts that plan the megakernels again (engine_profile.py) plan the graph compile built
    from luce_compile.fuse.build import program_fingerprint
    from tests.bench._load import load_benchmark_module

    programs = load_benchmark_module("h200/engine_profile").planned_programs(manifest, gguf)
    kernels = manifest["megakernel"]["kernels"]
    assert {str(b): program_fingerprint(p) for b, p in programs.items()} == {
        b: k["fingerprint"] for b, k in kernels.items()}
