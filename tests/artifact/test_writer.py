"""luce_compile.artifact.writer: atomic writes, streaming weights, refusals; real SmolLM2 planes and a real TVM
module round-trip through the runtime loader (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from luce_runtime.artifact import ALIGNMENT, MANIFEST, file_sha256, load_artifact

from luce_compile.artifact.writer import describe_source, tokenizer_metadata_from
from luce_compile.errors import ArtifactError
from tests.artifact._build import TOKENIZER, make_artifact, manifest_fields, module_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_failed_export_leaves_nothing(tmp_path: Path):
    def export(path: Path) -> None:
        path.write_bytes(b"partial")
        raise RuntimeError("codegen failed")

    with pytest.raises(RuntimeError, match="codegen failed"):
        make_artifact(tmp_path, export_fn=export)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no artifact, no hidden staging folder


@pytest.mark.unit
def test_failure_while_streaming_weights_leaves_nothing(tmp_path: Path):
    def weights():
        yield "a", np.arange(10, dtype=np.float32), {}
        raise MemoryError("repacking failed")

    with pytest.raises(MemoryError):
        make_artifact(tmp_path, weights=weights())
    assert [p.name for p in tmp_path.iterdir()] == ["built.so"]  # only the module the helper wrote beforehand


@pytest.mark.unit
def test_export_fn_and_its_side_files(tmp_path: Path):
    def export(path: Path) -> None:
        path.write_bytes(b"\x7fELF module")
        (path.parent / "kernels").mkdir()
        (path.parent / "kernels" / "extra.cubin").write_bytes(b"cubin")

    art = make_artifact(tmp_path, export_fn=export, extra_files={"chat/template.jinja": module_file(tmp_path)})
    files = load_artifact(art).manifest["files"]
    assert set(files) == {"model.so", "kernels/extra.cubin", "chat/template.jinja", "weights.bin", "tokenizer.json"}
    assert files["kernels/extra.cubin"] == file_sha256(art / "kernels" / "extra.cubin")


@pytest.mark.unit
def test_existing_destination(tmp_path: Path):
    art = make_artifact(tmp_path)
    with pytest.raises(ArtifactError, match="already exists.*--force"):
        make_artifact(tmp_path)
    first = json.loads((art / MANIFEST).read_text())["files"]["weights.bin"]
    weights = [("w", np.full(7, 3.0, np.float32), {})]
    make_artifact(tmp_path, weights=weights, overwrite=True)
    assert load_artifact(art).weights()["w"].tolist() == [3.0] * 7
    assert json.loads((art / MANIFEST).read_text())["files"]["weights.bin"] != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "built.so"]  # the old copy is gone
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not an artifact; refusing"):
        make_artifact(tmp_path, name="notes", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


@pytest.mark.unit
def test_a_manifest_json_alone_does_not_make_an_artifact(tmp_path: Path):
    """Many tools write a manifest.json; only format "luce-artifact" marks a folder this project may replace. The old
    guard took any manifest.json as an artifact and deleted the folder under overwrite=True."""
    app = tmp_path / "app"
    app.mkdir()
    (app / MANIFEST).write_text(json.dumps({"name": "my web app"}))
    (app / "index.html").write_text("<p>mine</p>")
    with pytest.raises(ArtifactError, match="not an artifact; refusing"):
        make_artifact(tmp_path, name="app", overwrite=True)
    assert (app / "index.html").read_text() == "<p>mine</p>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app", "built.so"]


@pytest.mark.unit
def test_a_failed_swap_puts_the_old_artifact_back(tmp_path: Path, monkeypatch):
    from luce_compile.artifact import writer

    art = make_artifact(tmp_path)
    before = (art / MANIFEST).read_bytes()
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == art and ".partial-" in str(src):  # the new artifact's rename into place
            raise OSError("interrupted")
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(OSError, match="interrupted"):
        make_artifact(tmp_path, weights=[("w", np.zeros(3, np.float32), {})], overwrite=True)
    assert (art / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "built.so"]


@pytest.mark.unit
def test_bad_manifest_fields(tmp_path: Path):
    fields = manifest_fields({"name": "cpu", "kind": "metal", "tvm_target": {}})
    del fields["source"]
    with pytest.raises(ArtifactError, match=r"source needs .*describe_source.*kind 'metal'"):
        make_artifact(tmp_path, manifest_fields=fields)
    with pytest.raises(ArtifactError, match="must not set files"):
        make_artifact(tmp_path, manifest_fields={**manifest_fields(), "files": {}})
    with pytest.raises(ArtifactError, match="exactly one of module_path and export_fn"):
        make_artifact(tmp_path, export_fn=lambda p: None, module_path=module_file(tmp_path))


@pytest.mark.unit
@pytest.mark.parametrize(("weights", "message"), [
    ([("w", np.ones(2, np.float32), {}), ("w", np.ones(2, np.float32), {})], "given twice"),
    ([("w", np.ones(2, np.complex64), {})], "dtype complex64"),
    ([("w", np.ones(2, np.float32), {"dtype": "bfloat16"})], "meta dtype 'bfloat16'"),
])
def test_bad_weights(tmp_path: Path, weights, message: str):
    with pytest.raises(ArtifactError, match=message):
        make_artifact(tmp_path, weights=weights)
    assert not (tmp_path / "art").exists()


@pytest.mark.unit
def test_strided_and_big_endian_arrays_are_stored_as_values(tmp_path: Path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.arange(5, dtype=">i4") * 1000
    art = make_artifact(tmp_path, weights=[("t", a.T, {}), ("big", big, {}), ("step", a[:, ::2], {})])
    w = load_artifact(art).weights()
    np.testing.assert_array_equal(w["t"], a.T)
    np.testing.assert_array_equal(w["big"], big)
    assert w["big"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(w["step"], a[:, ::2])
    assert all(p["offset"] % ALIGNMENT == 0 for p in load_artifact(art).manifest["weights"]["params"])


@pytest.mark.unit
def test_weights_stream_without_a_second_copy(tmp_path: Path):
    n, size = 8, 4 << 20  # eight 4 MiB arrays made on demand: holding them all would peak at 32 MiB

    def weights():
        for i in range(n):
            yield f"w{i}", np.full(size // 4, i, dtype=np.float32), {}

    tracemalloc.start()
    try:
        make_artifact(tmp_path, weights=weights())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * size, f"peak {peak / 2**20:.1f} MiB"
    w = load_artifact(tmp_path / "art").weights()
    assert [float(w[f"w{i}"][-1]) for i in range(n)] == [float(i) for i in range(n)]


@pytest.mark.unit
def test_tokenizer_metadata_from_keeps_only_tokenizer_keys():
    metadata = {"general.architecture": "llama", "llama.block_count": 30, **TOKENIZER}
    assert tokenizer_metadata_from(metadata) == TOKENIZER


@pytest.mark.slow
def test_real_smollm2_planes_round_trip(smollm2_path: Path, tmp_path: Path):
    from luce_compile.gguf.reader import read_gguf

    gguf = read_gguf(smollm2_path)
    t0 = time.perf_counter()
    source = describe_source(smollm2_path)
    t1 = time.perf_counter()
    weights = ((t.name, gguf.raw(t.name), {"source_tensor": t.name, "ggml_type": t.ggml_type, "plane": "blocks"})
               for t in gguf)
    art = make_artifact(tmp_path, manifest_fields={**manifest_fields(), "source": source}, weights=weights,
                        tokenizer_metadata=tokenizer_metadata_from(gguf.metadata))
    t2 = time.perf_counter()
    loaded = load_artifact(art, expect_target="cpu")
    t3 = time.perf_counter()
    w = loaded.weights()
    for t in gguf:
        assert np.array_equal(w[t.name], gguf.raw(t.name)), t.name
    tok = loaded.tokenizer_metadata()
    assert tok["tokenizer.ggml.tokens"] == gguf.metadata["tokenizer.ggml.tokens"]
    assert tok["tokenizer.chat_template"] == gguf.metadata["tokenizer.chat_template"]
    assert source["gguf_sha256"] == file_sha256(smollm2_path) and source["size"] == smollm2_path.stat().st_size
    mb = (art / "weights.bin").stat().st_size / 1e6
    print(f"\nSmolLM2: {len(w)} planes, {mb:.1f} MB; gguf sha256 {t1 - t0:.2f} s, write {t2 - t1:.2f} s, "
          f"load+verify {t3 - t2:.2f} s ({mb / (t3 - t2):.0f} MB/s)")


_RUNTIME_ONLY = """
import ctypes, os, sys
import numpy as np
import tvm, tvm_ffi
from luce_runtime.artifact import load_artifact
ctypes.CDLL(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
art = load_artifact(sys.argv[1], expect_target="cpu")
w = art.weights()
mod = tvm_ffi.load_module(str(art.module_path))
y = np.zeros(64, np.float32)
mod["gemv"](tvm_ffi.from_dlpack(w["x"]), tvm_ffi.from_dlpack(w["A"]), tvm_ffi.from_dlpack(y))
np.testing.assert_allclose(y, w["A"] @ w["x"], rtol=1e-5)
maps = open("/proc/self/maps").read()
assert "libtvm_compiler" not in maps and not any(m.startswith("luce_compile") for m in sys.modules)
print("ok", float(np.abs(y).sum()))
"""


@pytest.mark.slow
def test_real_tvm_module_runs_runtime_only(tmp_path: Path):
    import tvm
    from tvm import te

    x = te.placeholder((128,), "float32", name="x")
    a = te.placeholder((64, 128), "float32", name="A")
    k = te.reduce_axis((0, 128), name="k")
    y = te.compute((64,), lambda i: te.sum(x[k] * a[i, k], axis=k), name="y")
    func = te.create_prim_func([x, a, y]).with_attr("global_symbol", "gemv")
    exe = tvm.compile(tvm.IRModule({"gemv": func}), target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    weights = [("x", rng.standard_normal(128).astype(np.float32), {}),
               ("A", rng.standard_normal((64, 128)).astype(np.float32), {})]
    fields = {**manifest_fields(), "kernels": {"functions": ["gemv"]}}
    art = make_artifact(tmp_path, manifest_fields=fields, weights=weights,
                        export_fn=lambda p: exe.export_library(str(p)))
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _RUNTIME_ONLY, str(art)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok ") and float(out.stdout.split()[1]) > 1.0
