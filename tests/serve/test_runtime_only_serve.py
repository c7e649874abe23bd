"""`luce-compile serve ARTIFACT` with the runtime alone: what the H200 serving benchmark (benchmarks/h200/serve.sh)
runs on a machine that has TVM's runtime library and no compiler."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.serve.process import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_serving_an_artifact_maps_no_compiler(smol_artifact: Path):
    with serve_process(["serve", str(smol_artifact), "--max-batch", "2", "--ctx", "256"]) as (url, proc, health):
        body = json.dumps({"model": health["model"], "prompt": "The sea", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        completion = json.loads(urllib.request.urlopen(request, timeout=120).read())
        libraries = {line.split()[-1].rsplit("/", 1)[-1] for line in Path(f"/proc/{proc.pid}/maps").read_text()
                     .splitlines() if ".so" in line}
    assert completion["usage"]["completion_tokens"] == 4
    assert "libtvm_runtime.so" in libraries
    # the GPU machine has no libtvm_compiler.so (device_check's bundle leaves it out): serving must never load it
    assert not [lib for lib in libraries if "libtvm_compiler" in lib or lib == "libtvm.so"]
