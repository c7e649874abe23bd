"""Shared fixtures: the real models (fetched once into the cache) and a per-session temp folder; a guard that keeps
`pytest -m unit` fast by failing a unit test that fetches a real model."""

from __future__ import annotations

import os

# The oracle's small float64 matmuls run 3-10x slower with OpenBLAS's 2 threads on this 2-core machine than with one
# (thread hand-off costs more than the work); set before numpy is imported by any test module.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import importlib.util  # noqa: E402
import secrets  # noqa: E402
from collections.abc import Generator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The compiler's TVM first, whatever the test order: importing luce_runtime first would load the runtime-only
# library (TVM_USE_RUNTIME_LIB), and compile_model cannot run in that process. Runtime-only is tested in subprocesses.
import tvm  # noqa: E402, F401


def have_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


requires_llama_cpp = pytest.mark.skipif(not have_llama_cpp(), reason="llama-cpp-python is not installed")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from luce_compile.models import fetch

    return fetch("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from luce_compile.models import fetch

    return fetch("gemma3-270m")


@pytest.fixture(scope="session")
def qwen2_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the real qwen2 model (attention biases, 151,936-token vocab)."""
    from luce_compile.models import fetch

    return fetch("qwen2.5-coder-0.5b")


# -- `unit` means fast and self-contained: no real model (a download of 100 MB+, then seconds to read or compile) ----
# fixtures that fetch a real model (tests/codegen/conftest.py's `real` compiles one too)
MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "qwen2_path", "real"})


def _refuse(nodeid: str, what: str) -> None:
    pytest.fail(f"{nodeid} is marked unit but {what}: mark it slow (it needs a real model), or use a synthetic one "
                "(tests/graph/conftest.py `synthetic`).", pytrace=False)


@contextmanager
def _no_real_models(nodeid: str) -> Generator[None]:
    """While a unit test sets up and runs: a real-model fixture fails it, whether the test names it, another fixture
    needs it or the test asks for it by name (pytest sets every fixture up through getfixturevalue, and a session
    fixture set up earlier is refused all the same), and so does a download. A model already in the cache may still
    be read: the synthetic models take their tokenizer keys from SmolLM2's file, which setup.sh fetches."""
    import luce_compile.models as models

    real_fetch, real_getfixturevalue = models.fetch, pytest.FixtureRequest.getfixturevalue

    def fetch(name: str = models.DEFAULT_MODEL) -> Path:
        if not models.cached_path(name).is_file():
            _refuse(nodeid, f"downloads the real model {name!r}")
        return real_fetch(name)

    def getfixturevalue(self: pytest.FixtureRequest, argname: str) -> object:
        if argname in MODEL_FIXTURES:
            _refuse(nodeid, f"uses the real-model fixture {argname}")
        return real_getfixturevalue(self, argname)

    models.fetch, pytest.FixtureRequest.getfixturevalue = fetch, getfixturevalue
    try:
        yield
    finally:
        models.fetch, pytest.FixtureRequest.getfixturevalue = real_fetch, real_getfixturevalue


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None]:
    if not item.get_closest_marker("unit"):
        return (yield)
    if item.get_closest_marker("slow"):  # `-m unit` would select it (a module-wide unit mark, then slow on one test)
        _refuse(item.nodeid, "is marked slow too")
    with _no_real_models(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None]:
    if not item.get_closest_marker("unit"):
        return (yield)
    with _no_real_models(item.nodeid):
        return (yield)


@pytest.fixture()
def rng() -> np.random.Generator:
    """Fresh random inputs each run; the seed is printed (shown when the test fails), LUCE_TEST_SEED replays it."""
    seed = int(os.environ.get("LUCE_TEST_SEED") or secrets.randbits(32))
    print(f"LUCE_TEST_SEED={seed}")
    return np.random.default_rng(seed)
