#!/usr/bin/env bash
# Incremental in-tree build for development: compiles the extension(s) into build/dev and
# copies the modules next to the Python sources, so `PYTHONPATH=. pytest` uses them.
# Users install with `pip install .` instead (scikit-build-core runs the same CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
PY=${PYTHON:-python}
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
  -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" \
  -DDYNADIAG_CUDA="${DYNADIAG_CUDA:-AUTO}" "$@" > build/dev.configure.log 2>&1 \
  || { cat build/dev.configure.log; exit 1; }
cmake --build build/dev
cmake --install build/dev --prefix . > /dev/null
