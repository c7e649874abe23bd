#!/usr/bin/env bash
# The main job's install: .venv with luce-compile and only what compiling, running and serving need (TVM, numpy,
# gguf, jinja2, FastAPI + uvicorn, llguidance; all pip wheels: no C++ build, no apt, no root). The test world (torch,
# llama.cpp, onnxruntime, the GPU toolchain) is scripts/setup.sh. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

# pip's own refusal of an old Python names neither the fix nor the variable that picks another interpreter
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install: luce-compile needs Python >= 3.11; $PY is $("$PY" --version 2>&1). Install one and run" \
       "PYTHON=python3.11 bash scripts/install.sh" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || { echo "install: $PY cannot make a venv: apt-get install python3-venv" >&2; exit 1; }
fi
# -e: the CLI and the tests run from this checkout. GPU targets: pip install -e '.[gpu]' plus the CUDA toolkit or
# Debian's lld/llvm/rocm-device-libs; `luce-compile compile --target …` says what is missing.
.venv/bin/python -m pip install -q -e .
echo "install: ok ($(.venv/bin/python --version), $(.venv/bin/luce-compile --version))"
