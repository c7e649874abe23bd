"""The runtime-only install (issue 41.1): `bash scripts/build_runtime_wheel.sh` builds the luce-runtime wheel; pip
installs it into a fresh venv, where no compiler module exists and `luce-runtime run` / `luce-runtime serve` run and
serve a CPU artifact compiled here, packed or not, as `luce-compile run` does."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path

import pytest

from luce_compile.runtime_wheel import compiler_only, tvm_package, tvm_platform
from tests.serve.process import serve_process

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"

# Run in the fresh venv: nothing of the compiler can be imported or called there
NO_COMPILER = """
import importlib.util, pathlib, sys
import tvm, tvm_ffi
found = [m for m in ("luce_compile", "luce_schedules", "tvm.relax", "tvm.s_tir", "tvm.topi", "tvm.contrib",
                     "tvm.backend.cuda") if importlib.util.find_spec(m) is not None]
found += [f for f in ("target.build.llvm", "target.build.cuda", "relax.build", "target.llvm_get_system_cpu")
          if tvm_ffi.get_global_func(f, allow_missing=True) is not None]
found += [str(p) for p in pathlib.Path(sys.prefix).rglob("libtvm_compiler*")]
try:
    tvm.target.codegen.llvm_get_system_cpu()
    found.append("tvm.target.codegen.llvm_get_system_cpu() ran")
except AttributeError:
    pass
print(tvm.__file__)
print("FOUND:", found)
"""


@pytest.mark.unit
def test_the_runtime_wheel_pins_what_the_root_pins():
    """runtime/pyproject.toml's dependencies are the root's, the same specifiers, less the compiler's (apache-tvm is
    the compiler wheel; gguf is read by the compiler only)."""
    def deps(path: Path) -> dict[str, str]:
        project = tomllib.loads(path.read_text())["project"]
        return {d.split("=")[0].split(">")[0].split("<")[0].strip(): d for d in project["dependencies"]}

    root, runtime = deps(ROOT / "pyproject.toml"), deps(ROOT / "runtime" / "pyproject.toml")
    assert set(root) - set(runtime) == {"apache-tvm", "gguf"}
    assert {name: root.get(name) for name in runtime} == runtime


@pytest.mark.unit
def test_readme_installs_the_wheel_the_script_writes():
    from luce_runtime import __version__

    wheel = f"luce_runtime-{__version__}-py3-none-{tvm_platform(tvm_package())}.whl"
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/build_runtime_wheel.sh" in readme
    assert f"pip install {wheel} && venv/bin/luce-runtime serve" in readme, f"README should install {wheel}"


@pytest.mark.unit
def test_the_wheel_leaves_out_the_compiler_and_keeps_the_runtime():
    for name in ("tvm/lib/libtvm_compiler.so", "tvm/relax/__init__.py", "tvm/s_tir/schedule/schedule.py",
                 "tvm/backend/cuda/lang/__init__.py", "tvm/3rdparty/x.h", "tvm/runtime/__pycache__/vm.pyc"):
        assert compiler_only(name, python=True), name
    for name in ("tvm/lib/libtvm_runtime.so", "tvm/lib/libtvm_runtime_cuda.so", "tvm/runtime/vm.py",
                 "tvm/backend/loader.py", "tvm/LICENSE", "tvm/NOTICE"):
        assert not compiler_only(name, python=True), name
    # the GPU bundle keeps the compiler's Python: the device scripts import the repository's compiler modules
    assert not compiler_only("tvm/relax/__init__.py") and compiler_only("tvm/lib/libtvm_compiler.so")


@pytest.mark.unit
def test_the_wheels_tvm_is_compared_with_the_artifacts(monkeypatch: pytest.MonkeyPatch, caplog):
    """The wheel's TVM has no apache-tvm metadata: the version check reads the loaded module's."""
    import importlib.metadata

    from luce_runtime import artifact

    def no_metadata(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(artifact.importlib.metadata, "version", no_metadata)
    monkeypatch.setitem(sys.modules, "tvm", types.SimpleNamespace(__version__="0.27.0.post1"))
    with caplog.at_level(logging.WARNING, logger=artifact.__name__):
        artifact._warn_tvm_version({"tvm_version": "0.26.0"})
    assert "built with TVM 0.26.0, this runtime has TVM 0.27.0.post1" in caplog.text


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built by the documented script, pip-installed into a fresh venv (its dependencies from the index)."""
    work = tmp_path_factory.mktemp("runtime-wheel")
    subprocess.run(["bash", str(ROOT / "scripts" / "build_runtime_wheel.sh"), str(work / "dist")], check=True,
                   capture_output=True, timeout=300)
    wheels = list((work / "dist").glob("luce_runtime-*.whl"))
    assert len(wheels) == 1, wheels
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    start = time.perf_counter()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])], check=True,
                   capture_output=True, timeout=600, env=clean_env())
    print(f"luce-runtime installed in {time.perf_counter() - start:.1f} s")
    return venv


def clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH: the repository's packages must not leak into the fresh venv."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def cpu_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic, preset

    out = tmp_path_factory.mktemp("cpu-artifact")
    return compile_model(cached_synthetic(preset("tiny-llama")), "cpu", out / "tiny.cpu", use_cache=False)


@pytest.fixture(scope="module")
def packed_artifact(cpu_artifact: Path) -> Path:
    """The same artifact as one file (`luce-compile pack`)."""
    packed = cpu_artifact.parent / "tiny.luce"
    subprocess.run([sys.executable, "-m", "luce_compile.cli", "pack", str(cpu_artifact), "-o", str(packed)],
                   check=True, capture_output=True, timeout=120)
    return packed


def in_venv(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=clean_env())


@pytest.mark.slow
@pytest.mark.e2e
def test_the_wheel_installs_without_the_compiler(runtime_venv: Path, tmp_path: Path):
    out = in_venv(runtime_venv, "python", "-c", NO_COMPILER, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    tvm_file, found = out.stdout.splitlines()[-2:]
    assert tvm_file.startswith(str(runtime_venv)), tvm_file  # the wheel's TVM, not this checkout's
    assert found == "FOUND: []", found


@pytest.mark.slow
@pytest.mark.e2e
def test_luce_runtime_run_gives_luce_compile_runs_tokens(runtime_venv: Path, cpu_artifact: Path,
                                                         packed_artifact: Path, tmp_path: Path):
    args = ["-p", PROMPT, "-n", "8", "--json"]
    expected = subprocess.run([sys.executable, "-m", "luce_compile.cli", "run", str(cpu_artifact), *args],
                              check=True, capture_output=True, text=True, timeout=300)
    for artifact in (cpu_artifact, packed_artifact):
        out = in_venv(runtime_venv, "luce-runtime", "run", str(artifact), *args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout)["ids"] == json.loads(expected.stdout)["ids"]
        assert len(json.loads(out.stdout)["ids"]) == 8


def runtime_server(venv: Path, artifact: Path, cwd: Path):
    """`luce-runtime serve ARTIFACT` from the venv on a free port until /health answers; stopped on exit."""
    return serve_process(["serve", str(artifact), "--max-batch", "2", "--ctx", "256"],
                         command=[str(venv / "bin" / "luce-runtime")], cwd=cwd, env=clean_env())


@pytest.mark.slow
@pytest.mark.e2e
def test_luce_runtime_serve_streams_to_the_openai_client(runtime_venv: Path, packed_artifact: Path, tmp_path: Path):
    from openai import OpenAI

    with runtime_server(runtime_venv, packed_artifact, tmp_path) as (url, proc, health):
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        stream = client.chat.completions.create(model=health["model"], stream=True, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Write about the sea."}])
        chunks = list(stream)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces)  # streamed, token by token
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    libraries = {line.split()[-1] for line in maps.splitlines() if ".so" in line}
    assert any(lib.startswith(str(runtime_venv)) and lib.endswith("libtvm_runtime.so") for lib in libraries)
    assert not [lib for lib in libraries if "libtvm_compiler" in lib]
