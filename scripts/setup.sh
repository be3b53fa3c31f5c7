#!/usr/bin/env bash
# Prepare a fresh machine: offline data sets, jemalloc and a C++ compiler (Debian, when run as
# root), a virtual environment in .venv, and the package with its C++ extension built by pip
# (scikit-build-core + CMake). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get > /dev/null && [ "$(id -u)" = 0 ]; then
  want=()
  dpkg -s dataset-fashion-mnist > /dev/null 2>&1 || want+=(dataset-fashion-mnist)
  dpkg -s fortunes > /dev/null 2>&1 || want+=(fortunes)
  # the allocator the results command's clean runs preload (train/results_runs.py: JEMALLOC)
  dpkg -s libjemalloc2 > /dev/null 2>&1 || want+=(libjemalloc2)
  command -v g++ > /dev/null || want+=(g++)
  PY=${PYTHON:-python3}
  "$PY" -c "import ensurepip, venv" 2> /dev/null || want+=(python3-venv)
  if [ ${#want[@]} -gt 0 ]; then
    apt-get update -qq > /dev/null 2>&1 || true
    apt-get install -y -qq "${want[@]}" > /dev/null
  fi
fi
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup.sh: $("$PY" -V 2>&1) is too old: dynadiag-jax needs Python 3.11+ (jax 0.8.1+);" \
    "run with PYTHON=python3.11 (or newer)" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip > /dev/null
# With nvcc on PATH the CUDA kernels must build: a failure stops here instead of silently
# leaving them out (DYNADIAG_CUDA=OFF in the environment skips them).
if command -v nvcc > /dev/null; then
  export DYNADIAG_CUDA=${DYNADIAG_CUDA:-ON}
fi
echo "setup.sh: installing dynadiag-jax and building its C++ extension (minutes; longer with CUDA)"
.venv/bin/python -m pip install -q ".[test,train]"
