#!/usr/bin/env bash
# Prepare a fresh machine: offline data sets (Debian), a virtual environment in .venv, and the
# package with its C++ extension built by pip (scikit-build-core + CMake). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get > /dev/null && [ "$(id -u)" = 0 ]; then
  if ! dpkg -s dataset-fashion-mnist fortunes > /dev/null 2>&1; then
    apt-get update -qq > /dev/null 2>&1 || true
    apt-get install -y -qq dataset-fashion-mnist fortunes > /dev/null
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip > /dev/null
.venv/bin/python -m pip install -q ".[test,train]"
