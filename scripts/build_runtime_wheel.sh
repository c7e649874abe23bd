#!/usr/bin/env bash
# The luce-runtime wheel (issue 41.1): DIST/luce_runtime-<version>-py3-none-<platform>.whl (DIST: the first argument,
# default dist), the thin runtime with the pinned TVM release's runtime library (apache-tvm's libtvm_runtime*.so and
# the Python that loads them, no libtvm_compiler.so; Apache-2.0, TVM's LICENSE and NOTICE inside). Then, on a
# machine that only runs artifacts:
#   python3 -m venv venv && venv/bin/pip install luce_runtime-*.whl && venv/bin/luce-runtime serve ART
# Needs the main install first (scripts/install.sh): the TVM files come from .venv's apache-tvm. Safe to run again.
set -euo pipefail
DIST=$(realpath -m "${1:-$(dirname "$0")/../dist}")  # a folder given is taken from where the command runs
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if ! command -v "$PY" >/dev/null; then
  echo "build_runtime_wheel: $PY not found; run scripts/install.sh first (or set PYTHON to a Python with luce-compile)" >&2
  exit 1
fi
STAGE=$(mktemp -d)  # its own stage: two builds at once do not mix their files
trap 'rm -rf "$STAGE"' EXIT
"$PY" -m luce_compile.runtime_wheel "$STAGE/luce-runtime"
mkdir -p "$DIST"
rm -f "$DIST"/luce_runtime-*.whl  # one wheel there: `pip install DIST/luce_runtime-*.whl` must name one file
# pip builds it in its own environment with setuptools >= 77 (the license fields), whatever this venv holds
"$PY" -m pip wheel -q --no-deps -w "$DIST" "$STAGE/luce-runtime"
ls "$DIST"/luce_runtime-*.whl
