"""benchmarks/h200/prepare_serve.py: the wheels carried to the GPU machine cover what `luce-compile serve` imports,
at this environment's versions, and the llama.cpp file llama-server's build needs is packed where the build reads it."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.bench._load import load_benchmark_module

prepare_serve = load_benchmark_module("h200/prepare_serve")

# Runs in the child: the server's modules as `luce-compile serve` loads them (TVM's runtime only), then the
# distributions every imported top-level module belongs to.
CHILD = """
import importlib.metadata, json, sys
from luce_runtime.serve import create_app
from luce_runtime.serve import anthropic_api, openai_api, responses_api
import uvicorn, uvicorn.protocols.http.h11_impl
owners = importlib.metadata.packages_distributions()
print(json.dumps(sorted({d for m in list(sys.modules) for d in owners.get(m.split(".")[0], [])})))
"""


def norm(name: str) -> str:
    return name.lower().replace("_", "-")


@pytest.mark.unit
def test_carried_wheels_cover_what_serving_imports():
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1",
               PYTHONPATH=str(Path(prepare_serve.ROOT) / "runtime"))
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {norm(d) for d in json.loads(done.stdout.strip().splitlines()[-1])}
    # the TVM runtime bundle (prepare.py), this repository, and sniffio, which anyio imports only when installed
    elsewhere = {"apache-tvm", "apache-tvm-ffi", "luce-compile", "sniffio"}
    carried = {norm(n) for n in (*prepare_serve.SERVE_WHEELS, *prepare_serve.ON_THE_GPU_MACHINE)}
    assert imported - carried - elsewhere == set()
    assert {"fastapi", "pydantic-core", "llguidance", "uvicorn"} <= imported  # the child did load the server


@pytest.mark.unit
def test_pinned_versions_are_the_installed_ones():
    pins = dict(p.split("==") for p in prepare_serve.pinned(("fastapi", "pydantic-core")))
    assert pins == {"fastapi": importlib.metadata.version("fastapi"),
                    "pydantic-core": importlib.metadata.version("pydantic-core")}
    with pytest.raises(SystemExit, match="no-such-package is not installed"):
        prepare_serve.pinned(("no-such-package",))


@pytest.mark.unit
def test_server_extra_lands_in_the_llama_cpp_tree(tmp_path):
    script = b"# Provision UI assets and generate ui.cpp/ui.h.\n"
    sdist = tmp_path / "s.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo(prepare_serve.VENDOR + "scripts/ui-assets.cmake")
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script))
    out = prepare_serve.pack_server_extra(sdist, tmp_path / "extra.tgz")
    with tarfile.open(out) as tar:
        assert tar.getnames() == ["llama.cpp/scripts/ui-assets.cmake"]  # unpacked next to prepare.py's llama.cpp/
        assert tar.extractfile("llama.cpp/scripts/ui-assets.cmake").read() == script
