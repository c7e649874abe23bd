"""The tiny synthetic model's workloads for cpu, enumerated once per session (lowering takes a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tvm  # noqa: F401  (the compiler's TVM first: luce_runtime alone would load the runtime-only library)

from luce_compile.synthetic import cached_synthetic, preset
from luce_compile.targets import get_target
from luce_compile.tune.tuner import model_workloads
from luce_compile.tune.workloads import Workload


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    return cached_synthetic(preset("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_workloads(tiny_gguf: Path) -> list[Workload]:
    return model_workloads(tiny_gguf, get_target("cpu"))


@pytest.fixture()
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A logs folder of the test's own, also the default one: nothing a test does reaches the shipped logs."""
    folder = tmp_path / "autotune_logs"
    folder.mkdir()
    monkeypatch.setenv("LUCE_TUNE_LOGS", str(folder))
    return folder
