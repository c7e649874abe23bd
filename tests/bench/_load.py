"""benchmarks/ is a folder of scripts, not a package: the tests load its modules by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark_module(name: str):
    """benchmarks/<name>.py as a module (name may hold a folder: "h200/report"); benchmarks/ goes on sys.path
    first, as the scripts expect when they run."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"bench_{name.replace('/', '_')}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package either)."""
    path = BENCH_DIR.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
