"""Shared fixtures: the real models (fetched once into the cache) and a per-session temp folder."""

from __future__ import annotations

import os

# The oracle's small float64 matmuls run 3-10x slower with OpenBLAS's 2 threads on this 2-core machine than with one
# (thread hand-off costs more than the work); set before numpy is imported by any test module.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import importlib.util  # noqa: E402
import secrets  # noqa: E402
from pathlib import Path

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


@pytest.fixture()
def rng() -> np.random.Generator:
    """Fresh random inputs each run; the seed is printed (shown when the test fails), LUCE_TEST_SEED replays it."""
    seed = int(os.environ.get("LUCE_TEST_SEED") or secrets.randbits(32))
    print(f"LUCE_TEST_SEED={seed}")
    return np.random.default_rng(seed)
