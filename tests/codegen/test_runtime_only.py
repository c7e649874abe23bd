"""The thin runtime alone: a fresh interpreter with a clean environment loads an artifact with `luce_runtime` and
TVM's runtime library only, and generates the same tokens as this (compiler-loaded) process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# Runs in the child. It reports what it generated and what the process has mapped and imported.
CHILD = """
import json, sys
from luce_runtime.engine import Engine, EngineOptions
from luce_runtime.sampler import SamplingParams

engine = Engine(sys.argv[1], EngineOptions(max_batch=1, max_context=128))
ids = list(engine.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=8)))
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
print(json.dumps({
    "ids": ids,
    "libraries": sorted(m.rsplit("/", 1)[-1] for m in maps if ".so" in m),
    "module_mapped": any(m.endswith("/model.so") for m in maps),
    "compiler_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("luce_compile", "schedules")),
    "tvm_compiler_modules": sorted(m for m in sys.modules if m.startswith(("tvm.relax", "tvm.s_tir"))),
}))
"""


def _clean_env(home: Path) -> dict[str, str]:
    # no PYTHONPATH, no TVM_* or LUCE_* switches: the venv's own site-packages are all the child sees
    return {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-gemma3"])
def test_runtime_alone_generates_the_compiled_ids(name, real, tiny, engine_of, tmp_path, rng):
    model = real(name) if name.startswith("smollm2") else tiny(name)
    engine = engine_of(model)
    if name.startswith("smollm2"):
        prompt = engine.tokenizer.encode("The capital of France is", add_special=True, parse_special=True)
    else:
        prompt = [int(t) for t in rng.integers(0, engine.tokenizer.vocab_size, 14)]
    from luce_runtime.sampler import SamplingParams

    here = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8)))
    # cwd outside the repository, so that the child cannot import luce_compile by accident from its sys.path[0]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model.artifact), json.dumps(prompt)], cwd=tmp_path,
                          env=_clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "libtvm_runtime.so" in child["libraries"] and child["module_mapped"]
    assert not [lib for lib in child["libraries"] if "libtvm_compiler" in lib or lib == "libtvm.so"]
    assert child["compiler_modules"] == [] and child["tvm_compiler_modules"] == []
    assert child["ids"] == here and len(here) == 8
