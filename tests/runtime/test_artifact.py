"""luce_runtime.artifact: a written artifact loads bit-identically and zero-copy; every broken one is refused with
a message naming the problem and what to do."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from luce_runtime.artifact import (
    ALIGNMENT,
    FORMAT_VERSION,
    ISA_FLAGS,
    MANIFEST,
    file_sha256,
    host_cpu_facts,
    is_packed,
    load_artifact,
    open_packed,
    unpack,
)
from luce_runtime.errors import ArtifactError

from luce_compile.artifact.writer import pack
from tests.artifact._build import CONFIG, CPU_TARGET, TOKENIZER, make_artifact, manifest_fields, sample_weights

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def art(tmp_path: Path) -> Path:
    return make_artifact(tmp_path)


def _edit_manifest(art: Path, edit) -> None:
    manifest = json.loads((art / MANIFEST).read_text())
    edit(manifest)
    (art / MANIFEST).write_text(json.dumps(manifest))


def test_round_trip_is_bit_identical_and_zero_copy(art: Path):
    loaded = load_artifact(art, expect_target="cpu")
    weights = loaded.weights()
    expected = sample_weights()
    assert list(weights) == [name for name, _, _ in expected]
    for name, array, meta in expected:
        got = weights[name]
        assert got.shape == array.shape, name
        stored = "uint16" if array.dtype == ml_dtypes.bfloat16 or meta.get("dtype") == "bfloat16" else array.dtype
        assert got.dtype == np.dtype(stored), name
        assert got.tobytes() == np.ascontiguousarray(array).tobytes(), name
        assert got.ctypes.data % ALIGNMENT == 0, name  # TVM takes DLPack tensors only 64-byte aligned
        assert not got.flags.owndata and got.flags.writeable, name  # a view of the map, writable for DLPack
    assert {p.dtype for p in loaded.params} >= {"float32", "float16", "bfloat16", "uint8", "int8", "int32"}
    assert loaded.params[0].ggml_type == "Q4_0" and loaded.params[0].source_tensor == "token_embd.weight"
    assert loaded.manifest["weights"]["params"][2]["group"] == 32  # free-form meta survives


def test_bfloat16_as_ml_dtypes(art: Path):
    weights = load_artifact(art).weights(bfloat16="ml_dtypes")
    bf16 = sample_weights()[3][1]
    assert weights["bf16.native"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(weights["bf16.native"].astype(np.float32), bf16.astype(np.float32))
    np.testing.assert_array_equal(weights["bf16.bits"].astype(np.float32), bf16.astype(np.float32))


def test_manifest_describes_everything(art: Path):
    loaded = load_artifact(art)
    m = loaded.manifest
    assert (m["format"], m["format_version"]) == ("luce-artifact", FORMAT_VERSION)
    assert loaded.config == json.loads(json.dumps(CONFIG.to_dict()))
    assert loaded.tokenizer_metadata() == TOKENIZER
    assert loaded.module_path == art / "model.so" and loaded.module_path.is_file()
    assert loaded.runtime_defaults == {"page_size": 16, "max_context": 2048}
    assert m["kernels"]["functions"] == ["prefill", "decode"]
    on_disk = {p.name for p in art.iterdir()} - {MANIFEST}
    assert set(m["files"]) == on_disk == {"weights.bin", "tokenizer.json", "model.so"}
    assert all(file_sha256(art / rel) == digest for rel, digest in m["files"].items())
    assert m["target"]["host_cpu"] == "znver3"  # taken from tvm_target.mcpu
    assert m["target"].get("cpu_flags") == host_cpu_facts().get("cpu_flags")


def test_flipped_weight_byte_is_refused_naming_the_file(art: Path):
    with open(art / "weights.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ArtifactError, match=r"weights\.bin does not match the sha256.*recompile"):
        load_artifact(art)
    assert load_artifact(art, verify=False).weights()  # the explicit opt-out still loads


def test_missing_file_is_refused(art: Path):
    (art / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"missing tokenizer\.json"):
        load_artifact(art, verify=False)


def test_manifest_without_checksum_for_module_is_refused(art: Path):
    _edit_manifest(art, lambda m: m["files"].pop("model.so"))
    with pytest.raises(ArtifactError, match=r"no checksum for model\.so"):
        load_artifact(art)


@pytest.mark.parametrize(("version", "message"), [(FORMAT_VERSION + 1, "upgrade luce-compile"),
                                                  (0, "not a positive integer"), ("1", "not a positive integer")])
def test_unsupported_format_version(art: Path, version, message: str):
    _edit_manifest(art, lambda m: m.update(format_version=version))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(art)


def test_other_format_name_is_refused(art: Path):
    _edit_manifest(art, lambda m: m.update(format="mlc-llm"))
    with pytest.raises(ArtifactError, match="not a luce-compile artifact"):
        load_artifact(art)


def test_wrong_target_is_refused_with_the_recompile_command(art: Path):
    with pytest.raises(ArtifactError, match=r"compiled for target 'cpu', not 'sm_90'.*--target sm_90"):
        load_artifact(art, expect_target="sm_90")


def test_truncated_weights_are_refused(art: Path):
    path = art / "weights.bin"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ArtifactError, match=r"weights\.bin does not match the sha256"):
        load_artifact(art)
    # Without hashing (or with a manifest whose checksum was updated too) the bounds check still catches it.
    with pytest.raises(ArtifactError, match=r"weight '[^']+' ends at byte \d+ but .* has only \d+ bytes: .*truncated"):
        load_artifact(art, verify=False)


def test_misaligned_or_inconsistent_entries_are_refused(art: Path):
    def shift(m):
        m["weights"]["params"][1]["offset"] += 4

    _edit_manifest(art, shift)
    with pytest.raises(ArtifactError, match="not a multiple of 64"):
        load_artifact(art)

    def wrong_size(m):
        m["weights"]["params"][1]["offset"] -= 4
        m["weights"]["params"][1]["nbytes"] += 4

    _edit_manifest(art, wrong_size)
    with pytest.raises(ArtifactError, match="but nbytes"):
        load_artifact(art)


def test_manifest_cannot_point_outside_the_folder(art: Path):
    _edit_manifest(art, lambda m: m["files"].update({"../../etc/passwd": "00"}))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        load_artifact(art)


def test_not_an_artifact(tmp_path: Path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_artifact(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="has no manifest.json.*luce-compile compile"):
        load_artifact(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_artifact(tmp_path)
    plain = tmp_path / "plain.txt"
    plain.write_text("hello")
    assert not is_packed(plain)
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        load_artifact(plain)


def test_cpu_built_for_missing_isa_extensions_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    missing = sorted(ISA_FLAGS - set(host_cpu_facts().get("cpu_flags", [])))
    # host_cpu is compared when TVM's compiler is loaded in this process (an earlier test may have imported it),
    # cpu_model otherwise: make both differ from this host.
    target = {**CPU_TARGET, "cpu_flags": missing[:2], "cpu_model": "Some Other CPU", "host_cpu": "othercpu"}
    art = make_artifact(tmp_path, manifest_fields=manifest_fields(target))
    with caplog.at_level(logging.WARNING, logger="luce_runtime.artifact"):
        load_artifact(art)
    assert missing[0] in caplog.text and "SIGILL" in caplog.text
    assert "compiled on a Some Other CPU" in caplog.text or "compiled for CPU othercpu" in caplog.text


def test_pack_unpack_round_trip(art: Path, tmp_path: Path):
    packed = pack(art, tmp_path / "model.tar")
    assert is_packed(packed) and not is_packed(art)
    with tarfile.open(packed) as tar:
        names = tar.getnames()
    assert names[0] == MANIFEST and sorted(names[1:]) == ["model.so", "tokenizer.json", "weights.bin"]
    assert pack(art, tmp_path / "again.tar").read_bytes() == packed.read_bytes()  # reproducible bytes
    out = unpack(packed, tmp_path / "unpacked")
    for rel in names:
        assert (out / rel).read_bytes() == (art / rel).read_bytes(), rel
    with pytest.raises(ArtifactError, match="already exists"):
        unpack(packed, out)


def test_load_packed_file_through_the_cache(art: Path, tmp_path: Path):
    packed = pack(art, tmp_path / "model.tar")
    cache = tmp_path / "cache"
    loaded = load_artifact(packed, cache_dir=cache, expect_target="cpu")
    assert loaded.root.parent == cache and loaded.weights()["int32.perm"].tolist() == sample_weights()[6][1].tolist()
    assert open_packed(packed, cache_dir=cache) == loaded.root  # second open reuses the unpacked copy
    assert len(list(cache.iterdir())) == 1


def test_unpack_refuses_foreign_tars(tmp_path: Path):
    bad = tmp_path / "bad.tar"
    (tmp_path / "x.txt").write_text("x")
    with tarfile.open(bad, "w") as tar:
        tar.add(tmp_path / "x.txt", arcname="x.txt")
    assert not is_packed(bad)
    with pytest.raises(ArtifactError, match="first member is not manifest.json"):
        unpack(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_runtime_modules_do_not_import_the_compiler():
    code = ("import sys, luce_runtime.artifact, luce_runtime.sampler; "
            "print(sorted(m for m in sys.modules if m.startswith(('luce_compile', 'tvm'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "runtime")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert out.stdout.strip() == "[]"  # neither the compiler nor TVM itself: loading a manifest stays cheap
