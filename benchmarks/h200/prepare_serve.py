"""Prepare the H200 serving benchmark here: the wheels `luce-compile serve` needs that the GPU machine lacks.

    .venv/bin/python benchmarks/h200/prepare_serve.py [--dir .gpucheck/serve] [--python-version 3.12]

Writes, under --dir:
  wheels/  the serving stack at the versions installed in this environment (.venv), for CPython 3.12 on manylinux
           x86-64 (the GPU machine's Python), no dependencies resolved (each one is named in SERVE_WHEELS);
  llama-server-extra.tgz  what llama-server's build needs beyond prepare.py's trimmed llama.cpp tree: its UI step
           runs scripts/ui-assets.cmake (it embeds no assets with LLAMA_BUILD_UI and LLAMA_USE_PREBUILT_UI off), and
           prepare.py keeps no scripts/; from the same llama-cpp-python sdist, unpacked over that tree.
Run benchmarks/h200/prepare.py first for the rest (.gpucheck/h200: artifact, TVM runtime, llama.cpp source); then
one device call runs benchmarks/h200/serve.sh (its header says how).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers.llama_server import VENDOR, find_sdist  # noqa: E402  (the sdist prepare.py trimmed llama.cpp from)

# llama.cpp files a llama-server build reads that prepare.py's KEEP leaves out (tools/ui/CMakeLists.txt runs it)
SERVER_EXTRA = ("scripts/ui-assets.cmake",)

# What `python -m luce_compile.cli serve ARTIFACT` imports beyond the TVM runtime bundle (prepare.py) and what the
# GPU machine's image already has (numpy, jinja2, click, h11, httpx: /work/.library/device/KINDS.md). fastapi imports
# opentelemetry at import time; pydantic wants typing-extensions >= 4.16 and anyio is carried for the same reason: the
# image's versions are not known here, and the carried site dir comes first on PYTHONPATH.
SERVE_WHEELS = ("fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "annotated-doc",
                "typing-inspection", "typing-extensions", "opentelemetry-api", "anyio", "uvicorn", "llguidance")
# What serving imports that the GPU machine's image has (KINDS.md "Python packages already there"); with the wheels
# above and the TVM runtime bundle, all of it (tests/bench/test_prepare_serve.py checks the list against the imports)
ON_THE_GPU_MACHINE = ("numpy", "jinja2", "markupsafe", "click", "h11", "ml-dtypes", "torch", "tqdm", "setuptools")
# pip matches a manylinux tag exactly: llguidance ships manylinux_2_31 only, pydantic-core manylinux_2_17
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]


def pinned(names: tuple[str, ...] = SERVE_WHEELS) -> list[str]:
    """NAME==VERSION of each package as installed here; a missing one fails with what to install."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"prepare_serve: {name} is not installed in {sys.prefix}; run scripts/setup.sh (or "
                             f"pip install -e '.[serve]') first, then again") from None
    return out


def download(requirements: list[str], dest: Path, python_version: str) -> list[Path]:
    """Binary wheels of exactly `requirements` for CPython `python_version` on manylinux x86-64, into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):  # one version of each: two stop the install there
        stale.unlink()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *platforms, "-d", str(dest), *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"prepare_serve: `{' '.join(cmd)}` failed ({done.returncode}): {done.stderr[-2000:]}")
    return sorted(dest.glob("*.whl"))


def pack_server_extra(sdist: Path, out: Path) -> Path:
    """SERVER_EXTRA from the sdist's llama.cpp as llama.cpp/<path> in a .tgz, to unpack over the trimmed tree."""
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz") as tar:
        for path in SERVER_EXTRA:
            info = src.getmember(VENDOR + path)
            data = src.extractfile(info)
            info.name = f"llama.cpp/{path}"
            tar.addfile(info, data)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=ROOT / ".gpucheck" / "serve")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12)")
    args = p.parse_args()
    wheels = download(pinned(), args.dir / "wheels", args.python_version)
    if len(wheels) != len(SERVE_WHEELS):
        raise SystemExit(f"prepare_serve: expected {len(SERVE_WHEELS)} wheels in {args.dir / 'wheels'}, got "
                         f"{len(wheels)}: {[w.name for w in wheels]}")
    extra = pack_server_extra(find_sdist(), args.dir / "llama-server-extra.tgz")
    for f in [*wheels, extra]:
        print(f"{f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print(f"{args.dir}: {sum(f.stat().st_size for f in [*wheels, extra]) / 2**20:.1f} MiB to carry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
