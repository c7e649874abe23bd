"""The main job's install (scripts/install.sh: the package's own dependencies, no extras) is enough to compile, run
and serve (issue 10.3). The test world has every extra installed, so the packages only the tests, ONNX export or GPU
checks use are hidden here, and every module of the compiler and the runtime must still import."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# What the extras (test, onnx, gpu) bring, by import name
NOT_INSTALLED = ("onnx", "onnxruntime", "torch", "llama_cpp", "openai", "anthropic", "httpx", "matplotlib",
                 "hypothesis", "pytest", "nvidia", "tqdm", "jsonschema")
EXTRA_ONLY_MODULES = {"luce_compile.graph.onnx_export"}  # asked for by name: needs the onnx extra

IMPORT_ALL = f"""
import importlib, pkgutil, sys
for name in {NOT_INSTALLED!r}:
    sys.modules[name] = None  # import fails as if the package were absent
import tvm  # the compiler's TVM first, as the CLI loads it (luce_runtime alone would load the runtime-only library)
failed = []
for package in ("luce_compile", "luce_runtime", "luce_schedules"):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name in {EXTRA_ONLY_MODULES!r} or info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as err:
            failed.append(f"{{info.name}}: {{err}}")
try:
    import luce_compile.graph.onnx_export
    failed.append("onnx_export imported without onnx")
except ImportError as err:
    print("ONNX:", err)
print("FAILED:", failed)
"""


def test_every_module_imports_with_only_the_runtime_dependencies():
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FAILED: []" in out.stdout, out.stdout
    onnx_error = next(line for line in out.stdout.splitlines() if line.startswith("ONNX:"))
    assert "pip install -e '.[onnx]'" in onnx_error  # the error names the extra to install


def test_the_runtime_dependencies_hold_no_test_or_export_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split("=")[0].split(">")[0].split("[")[0].strip().lower() for dep in project["dependencies"]}
    assert names == {"apache-tvm", "apache-tvm-ffi", "numpy", "gguf", "jinja2", "fastapi", "uvicorn", "llguidance"}
    assert {"onnx", "gpu", "test"} <= set(project["optional-dependencies"])

