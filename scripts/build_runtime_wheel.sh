#!/usr/bin/env bash
# The luce-runtime wheel (issue 41.1): dist/luce_runtime-<version>-py3-none-<platform>.whl, the thin runtime with the
# pinned TVM release's runtime library (apache-tvm's libtvm_runtime*.so and the Python that loads them, no
# libtvm_compiler.so; Apache-2.0, its LICENSE and NOTICE inside). On a machine that only runs artifacts:
#   python3 -m venv venv && venv/bin/pip install dist/luce_runtime-*.whl && venv/bin/luce-runtime serve ART
# Needs the main install first (scripts/install.sh): the TVM files come from .venv's apache-tvm. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ] && ! command -v "$PY" >/dev/null; then
  echo "build_runtime_wheel: $PY not found; run scripts/install.sh first (or set PYTHON to a Python with luce-compile)" >&2
  exit 1
fi
STAGE=build/runtime-wheel
"$PY" -m luce_compile.runtime_wheel "$STAGE"
rm -f dist/luce_runtime-*.whl  # one wheel in dist/: `pip install dist/luce_runtime-*.whl` must name one file
# pip builds it in its own environment with setuptools >= 77 (the license fields), whatever this venv holds
"$PY" -m pip wheel -q --no-deps -w dist "$STAGE"
ls dist/luce_runtime-*.whl
