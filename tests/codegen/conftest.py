"""Compiled models for the end-to-end tests: each GGUF is compiled for cpu once per session into a temp folder.

compile_model keeps a content-addressed cache ($LUCE_CACHE/artifacts, keyed by the GGUF's sha256, the target and the
compiler's source), so a later session with the same compiler copies the artifact instead of compiling (~20 s each
on 2 shared cores). Synthetic GGUFs go to the synthetic cache (their file name holds a hash of the spec).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tvm  # noqa: F401  (the compiler's TVM first: luce_runtime.engine alone would load the runtime-only library)

from luce_compile.graph.oracle import Oracle
from tests.codegen._reference import RESULTS, summary_lines


@dataclass(frozen=True)
class Model:
    """A GGUF and its cpu artifact."""

    name: str
    gguf: Path
    artifact: Path


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Path], Model]:
    """compiled(name, gguf) → Model: compiled once per session (and cached across sessions by compile_model)."""
    from luce_compile.codegen.compile import compile_model

    folder = tmp_path_factory.mktemp("artifacts")
    built: dict[Path, Model] = {}

    def build(name: str, gguf: Path) -> Model:
        if gguf not in built:
            # f32: these models are checked against the plain float64 oracle (the int8 decode path has its own
            # check against the oracle with llama.cpp's activation rounding: tests/schedules/test_cpu_int8_model.py)
            built[gguf] = Model(name, gguf, compile_model(gguf, "cpu", folder / gguf.stem, precision="f32"))
        return built[gguf]

    return build


@pytest.fixture(scope="session")
def tiny(compiled) -> Callable[..., Model]:
    """tiny(preset or SyntheticSpec, **spec_changes) → a compiled random-weight model."""
    from luce_compile.synthetic import SyntheticSpec, cached_synthetic, preset

    def make(base: str | SyntheticSpec, **changes: object) -> Model:
        spec = dataclasses.replace(preset(base) if isinstance(base, str) else base, **changes)
        name = base if isinstance(base, str) else f"{spec.arch}-{spec.quant}"
        return compiled(name, cached_synthetic(spec))

    return make


@pytest.fixture(scope="session")
def real(compiled) -> Callable[[str], Model]:
    """real("smollm2-135m" | "gemma3-270m") → the real model (fetched into the cache once), compiled."""
    from luce_compile.models import fetch

    return lambda name: compiled(name, fetch(name))


@pytest.fixture(scope="session")
def oracle_of() -> Callable[[Model], Oracle]:
    """The float64 oracle of a model, one per session: dequantizing a real model's weights takes ~20 s."""
    oracles: dict[Path, Oracle] = {}

    def get(model: Model) -> Oracle:
        if model.gguf not in oracles:
            oracles[model.gguf] = Oracle(model.gguf)
        return oracles[model.gguf]

    return get


@pytest.fixture(scope="session")
def engine_of() -> Callable[..., object]:
    """engine_of(model, **EngineOptions fields) → an Engine, one per (model, options) per session. Tests remove the
    sequences they add, so engines can be shared."""
    from luce_runtime.engine import Engine, EngineOptions

    engines: dict[tuple, Engine] = {}

    def get(model: Model, **options: int) -> Engine:
        options = {"max_batch": 4, "max_context": 256, "prefill_chunk": 64} | options
        key = (model.artifact, tuple(sorted(options.items())))
        if key not in engines:
            engines[key] = Engine(model.artifact, EngineOptions(**options))
        return engines[key]

    return get


def pytest_terminal_summary(terminalreporter) -> None:
    if RESULTS:
        terminalreporter.section("engine vs float64 oracle (tests/codegen)")
        for line in summary_lines():
            terminalreporter.write_line(line)
