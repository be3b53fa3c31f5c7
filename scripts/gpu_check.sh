#!/usr/bin/env bash
# The GPU check in one command, for a machine with an NVIDIA GPU and nvcc:
#   1. a virtual environment with JAX's CUDA build from pip (jax[cuda13] or jax[cuda12], matching
#      nvcc's major version) and dynadiag-jax installed with the CUDA kernels (DYNADIAG_CUDA=ON);
#   2. the GPU tests (pytest -m gpu: tests/test_gpu.py);
#   3. the same tests once under compute-sanitizer - memcheck, racecheck, initcheck, synccheck -
#      on the dynadiag kernels (skipped, with a message, where compute-sanitizer is absent);
#   4. the benchmark bench/diag_matmul_gpu.py (element and block rows; dense and BCOO) at its
#      default shapes and at the target shape, ViT-B/16's fc1 (403,456 rows, 768 -> 3072, 90%),
#      and the cost model's decision table for comparison.
# Everything it writes - logs and CSVs - goes to OUT_DIR.
#
#   bash scripts/gpu_check.sh OUT_DIR
#   VENV=/path/to/venv PYTHON=python3.11 bash scripts/gpu_check.sh "$OUT"
set -euo pipefail
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
VENV=${VENV:-$REPO/.venv-gpu}
PY=${PYTHON:-python3}
log() { echo "== $*" | tee -a "$OUT/gpu_check.log"; }

command -v nvcc > /dev/null || { echo "nvcc is not on PATH (needed to build the CUDA kernels)" >&2; exit 2; }
command -v nvidia-smi > /dev/null && nvidia-smi | tee "$OUT/nvidia-smi.txt"
cuda_major=$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p')
case "$cuda_major" in
  12 | 13) ;;
  *) echo "nvcc reports CUDA '$cuda_major'; JAX's pip wheels exist for CUDA 12 and 13" >&2; exit 2 ;;
esac

log "1. install: jax[cuda$cuda_major] and dynadiag-jax with the CUDA kernels into $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "jax[cuda$cuda_major]"
DYNADIAG_CUDA=ON "$VENV/bin/python" -m pip install -q "$REPO[test,train,cuda$cuda_major]" \
  2>&1 | tee "$OUT/install.log"
"$VENV/bin/python" - << 'EOF' | tee -a "$OUT/gpu_check.log"
import jax, dynadiag_jax as dd
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
assert jax.default_backend() == "gpu", "JAX does not see the GPU"
assert dd.has_cuda_kernels(), "dynadiag-jax was built without the CUDA kernels"
EOF

# Tests and benchmarks run from $OUT so that the installed package, not the checkout, is imported.
cd "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

log "2. pytest -m gpu"
"$VENV/bin/python" -m pytest -m gpu -p no:cacheprovider -q "$REPO/tests/test_gpu.py" \
  2>&1 | tee "$OUT/pytest_gpu.log" || status=1

log "3. compute-sanitizer"
SANITIZER=$(command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer "$(dirname "$(command -v nvcc)")/compute-sanitizer"; do
  [ -z "$SANITIZER" ] && [ -x "$candidate" ] && SANITIZER=$candidate
done
if [ -z "$SANITIZER" ]; then
  log "compute-sanitizer not found: the sanitizer runs are skipped"
else
  filter=()
  "$SANITIZER" --help 2>&1 | grep -q -- "--kernel-name" && filter=(--kernel-name kns=dynadiag)
  for tool in memcheck racecheck initcheck synccheck; do
    log "compute-sanitizer --tool $tool"
    "$SANITIZER" --tool "$tool" --error-exitcode 17 "${filter[@]}" \
      "$VENV/bin/python" -m pytest -m "gpu and not large" -p no:cacheprovider -q -x \
      "$REPO/tests/test_gpu.py" -k "match_the_reference and (64-256 or 48-80)" \
      > "$OUT/sanitizer_$tool.log" 2>&1 || { status=1; log "$tool FAILED (see sanitizer_$tool.log)"; }
    tail -n 3 "$OUT/sanitizer_$tool.log" | tee -a "$OUT/gpu_check.log"
  done
fi

log "4. benchmarks"
"$VENV/bin/python" "$REPO/bench/diag_matmul_gpu.py" --out "$OUT/diag_matmul_gpu.csv" \
  2>&1 | tee "$OUT/bench_default.log" || status=1
"$VENV/bin/python" "$REPO/bench/diag_matmul_gpu.py" --batch 403456 --shapes 768:3072 \
  --sparsities 0.9 --block-sizes 1,16,32 --layouts random --impls ffi,auto,dense \
  --out "$OUT/diag_matmul_gpu_goal.csv" 2>&1 | tee "$OUT/bench_goal.log" || status=1
"$VENV/bin/python" "$REPO/bench/gpu_decision_table.py" --csv "$OUT/decision_table.csv" \
  > "$OUT/decision_table.md" || status=1

log "done (status $status); results in $OUT"
exit "$status"
