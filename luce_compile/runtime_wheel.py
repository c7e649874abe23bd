"""The TVM runtime's files, for machines that only run artifacts: the GPU machine's bundle (scripts/device_check.py
prepare --bundle) and the luce-runtime wheel's build tree (`python -m luce_compile.runtime_wheel STAGE`, which
scripts/build_runtime_wheel.sh runs before building the wheel from STAGE).

Both take the TVM package installed here (apache-tvm, pinned in pyproject.toml) less what only the compiler needs.
The runtime never imports this module: it is the build machine's.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# TVM's python package less what only the compiler needs (libtvm_compiler.so alone is 248 MB)
TVM_SKIP = ("lib/libtvm_compiler.so", "3rdparty", "src", "include", "web", "__pycache__")
# The wheel also leaves out the compiler's Python, which a runtime-only `import tvm` never imports (tvm/base.py falls
# back to runtime-only when libtvm_compiler.so is absent): with these gone, `import tvm.relax` fails at once rather
# than later, inside the missing library. tvm/backend keeps its three top-level modules (the autoload hook that
# `import tvm` runs); its subfolders are codegen and TIRx languages, loaded only with the compiler. lib64 and cmake
# hold CMake files for building against TVM.
TVM_COMPILER_PYTHON = ("relax", "s_tir", "topi", "contrib", "testing", "exec", "lib64", "cmake")


def compiler_only(name: str, python: bool = False) -> bool:
    """Whether `name`, a path in the TVM package written as "tvm/...", is for the compiler only; python=True also
    counts the compiler's Python (the wheel), python=False only TVM_SKIP (the GPU bundle, whose check scripts import
    the repository's compiler modules next to it)."""
    rel = name.removeprefix("tvm/")
    if any(rel.startswith(s) or f"/{s}" in name for s in TVM_SKIP):
        return True
    if not python:
        return False
    return rel.split("/")[0] in TVM_COMPILER_PYTHON or (rel.startswith("backend/") and rel.count("/") > 1)


def tvm_package() -> Path:
    """The installed TVM package's folder, found without importing it (an import loads the compiler library)."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("runtime_wheel: TVM is not installed in this Python; run scripts/install.sh and use "
                         ".venv/bin/python")
    return Path(spec.submodule_search_locations[0])


def pinned_tvm() -> str:
    """The apache-tvm version pyproject.toml pins."""
    match = re.search(r'"apache-tvm==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    if match is None:
        raise SystemExit("runtime_wheel: pyproject.toml pins no apache-tvm==VERSION; the wheel is built from that pin")
    return match.group(1)


def installed_tvm(pkg: Path) -> str:
    match = re.search(r"^__version__ = version = '([^']+)'", (pkg / "_version.py").read_text(), re.M)
    return match.group(1) if match else "unknown"


def stage(out: Path) -> Path:
    """The wheel's build tree at `out` (replaced): runtime/pyproject.toml, luce_runtime, the TVM runtime package,
    TVM's LICENSE and NOTICE at the top (the wheel's license files), and setup.cfg naming TVM's platform (the .so
    files make the wheel as platform-bound as apache-tvm's)."""
    pkg = tvm_package()
    pin, have = pinned_tvm(), installed_tvm(pkg)
    if have != pin:
        raise SystemExit(f"runtime_wheel: pyproject.toml pins apache-tvm=={pin} but {pkg} is {have}; run "
                         "scripts/install.sh to install the pinned release, then build again")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copy2(ROOT / "runtime" / "pyproject.toml", out)
    shutil.copytree(ROOT / "runtime" / "luce_runtime", out / "luce_runtime",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path in sorted(pkg.rglob("*")):
        rel = path.relative_to(pkg).as_posix()
        if path.is_file() and not compiler_only(f"tvm/{rel}", python=True):
            (out / "tvm" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out / "tvm" / rel)
    for name in ("LICENSE", "NOTICE"):
        shutil.copy2(pkg / name, out / name)
    (out / "setup.cfg").write_text(f"[bdist_wheel]\nplat_name = {tvm_platform(pkg)}\n")
    return out


def tvm_platform(pkg: Path) -> str:
    """The platform tag of the apache-tvm wheel installed at pkg (its dist-info's WHEEL file), e.g.
    manylinux_2_27_x86_64: the runtime libraries are that wheel's own."""
    wheels = sorted(pkg.parent.glob("apache_tvm-*.dist-info/WHEEL"))
    tags = [line.split("-")[-1] for w in wheels for line in w.read_text().splitlines() if line.startswith("Tag:")]
    if not tags:
        raise SystemExit(f"runtime_wheel: no apache_tvm-*.dist-info/WHEEL next to {pkg}: TVM was not installed from "
                         "its PyPI wheel; run scripts/install.sh")
    return tags[0].strip()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m luce_compile.runtime_wheel STAGE_DIR", file=sys.stderr)
        return 2
    out = stage(Path(args[0]))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB staged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
