#!/usr/bin/env bash
# The GPU check in one command, for a machine with an NVIDIA GPU and nvcc:
#   1. a virtual environment with JAX's CUDA build from pip (jax[cuda13] or jax[cuda12], matching
#      nvcc's major version) and dynadiag-jax installed with the CUDA kernels (DYNADIAG_CUDA=ON);
#   2. the GPU tests (pytest -m gpu: tests/test_gpu.py);
#   3. the same tests once under compute-sanitizer - memcheck, racecheck, initcheck, synccheck -
#      on the dynadiag kernels (skipped, with a message, where compute-sanitizer is absent);
#   4. the benchmark bench/diag_matmul_gpu.py (element and block rows; dense and BCOO) at its
#      default shapes and at the target shape, ViT-B/16's fc1 (403,456 rows, 768 -> 3072, 90%),
#      and the cost model's decision table for comparison;
#   5. an Nsight Compute profile of the dynadiag kernels at that shape (b = 16 and 32, forward
#      and backward: instructions, occupancy, registers, bank conflicts, HBM and L2 bytes and how
#      busy each L2 unit is, warp stall reasons, time), each kernel's measurements beside the cost
#      model's prediction and beside cuBLAS's GEMMs of the dense layer (bench/ncu_compare.py;
#      skipped, with a message, where ncu is absent).
# Everything it writes - logs and CSVs - goes to OUT_DIR.
#
#   bash scripts/gpu_check.sh OUT_DIR
#   VENV=/path/to/venv PYTHON=python3.11 bash scripts/gpu_check.sh "$OUT"
#
# On a machine without network whose python already has JAX for CUDA (and scikit-build-core,
# nanobind, pytest, pytest-xdist, tqdm), USE_PYTHON_JAX=1 builds dynadiag-jax against that JAX into $VENV/site
# without downloading anything. STEPS (default "1 2 3 4 5") picks the steps, SANITIZER_TOOLS
# (default all four) the compute-sanitizer tools, DEFAULT_BENCH=0 leaves out the benchmark at the
# default shapes (the target shape always runs in step 4); CUDAARCHS (e.g. 90) limits the build;
# STEP_TIMEOUT (seconds) stops any one test, benchmark or profile that runs longer, so that on a
# lent machine with a time budget a hang costs one step, not the rest of the check;
# GOAL_SPARSITIES (default 0.9, comma-separated) are the target shape's sparsities in step 4;
# GOAL_BLOCK_SIZES (default 1,16,32) its block sizes; GPU_TEST_WORKERS (default 0: one process)
# runs step 2 in that many pytest-xdist workers, which share the GPU and compile in parallel
# (pytest-benchmark, where installed, is switched off: it refuses to run beside xdist).
#
#   USE_PYTHON_JAX=1 CUDAARCHS=90 STEPS="1 2 4 5" bash scripts/gpu_check.sh "$OUT"
set -euo pipefail
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
VENV=${VENV:-$REPO/.venv-gpu}
PY=${PYTHON:-python3}
STEPS=${STEPS:-1 2 3 4 5}
log() { echo "== $*" | tee -a "$OUT/gpu_check.log"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
limited() { if [ -n "${STEP_TIMEOUT:-}" ]; then timeout -k 10 "$STEP_TIMEOUT" "$@"; else "$@"; fi; }

command -v nvcc > /dev/null || { echo "nvcc is not on PATH (needed to build the CUDA kernels)" >&2; exit 2; }
# No GPU, no check: said now, not after step 1's downloads and build.
if command -v nvidia-smi > /dev/null; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 \
    || { echo "nvidia-smi sees no GPU (see $OUT/nvidia-smi.txt): nothing to check" >&2; exit 2; }
  cat "$OUT/nvidia-smi.txt"
else
  echo "nvidia-smi is not on PATH: whether JAX sees a GPU is checked after step 1" >&2
fi
cuda_major=$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p')
case "$cuda_major" in
  12 | 13) ;;
  *) echo "nvcc reports CUDA '$cuda_major'; JAX's pip wheels exist for CUDA 12 and 13" >&2; exit 2 ;;
esac

if ! want 1; then
  log "1. install: skipped, $VENV as it is"
elif [ "${USE_PYTHON_JAX:-0}" = 1 ]; then
  log "1. install: dynadiag-jax with the CUDA kernels into $VENV/site, against $PY's JAX"
  mkdir -p "$VENV/bin"
  DYNADIAG_CUDA=ON "$PY" -m pip install -q --no-build-isolation --no-deps --no-index \
    --target "$VENV/site" "$REPO" 2>&1 | tee "$OUT/install.log"
  # $VENV/bin/python: $PY with the package on its path, as the steps below call it
  printf '#!/bin/sh\nPYTHONPATH="%s/site${PYTHONPATH:+:$PYTHONPATH}" exec "%s" "$@"\n' \
    "$VENV" "$(command -v "$PY")" > "$VENV/bin/python"
  chmod +x "$VENV/bin/python"
else
  log "1. install: jax[cuda$cuda_major] and dynadiag-jax with the CUDA kernels into $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "jax[cuda$cuda_major]"
  DYNADIAG_CUDA=ON "$VENV/bin/python" -m pip install -q "$REPO[test,train,cuda$cuda_major]" \
    2>&1 | tee "$OUT/install.log"
fi
# Tests and benchmarks run from $OUT so that the installed package, not the checkout, is imported.
cd "$OUT"
"$VENV/bin/python" - << 'EOF' 2>&1 | tee -a "$OUT/gpu_check.log" || exit 2
import sys
import jax, dynadiag_jax as dd
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
if jax.default_backend() != "gpu":
    sys.exit("error: JAX does not see a GPU: nothing to check")
if not dd.has_cuda_kernels():
    sys.exit("error: dynadiag-jax was built without the CUDA kernels (see install.log)")
EOF

export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

if want 2; then
  log "2. pytest -m gpu"
  limited "$VENV/bin/python" -m pytest -m gpu -n "${GPU_TEST_WORKERS:-0}" -p no:cacheprovider -p no:benchmark -q -rf "$REPO/tests/test_gpu.py" \
    2>&1 | tee "$OUT/pytest_gpu.log" || status=1
fi

want 3 && log "3. compute-sanitizer"
SANITIZER=$(want 3 && command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer "$(dirname "$(command -v nvcc)")/compute-sanitizer"; do
  [ -z "$SANITIZER" ] && [ -x "$candidate" ] && SANITIZER=$candidate
done
if ! want 3; then
  :
elif [ -z "$SANITIZER" ]; then
  log "compute-sanitizer not found: the sanitizer runs are skipped"
else
  filter=()
  "$SANITIZER" --help 2>&1 | grep -q -- "--kernel-name" && filter=(--kernel-name kns=dynadiag)
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
    log "compute-sanitizer --tool $tool"
    limited "$SANITIZER" --tool "$tool" --error-exitcode 17 "${filter[@]}" \
      "$VENV/bin/python" -m pytest -m "gpu and not large" -p no:cacheprovider -q -x \
      "$REPO/tests/test_gpu.py" -k "match_the_reference and (64-256 or 48-80)" \
      > "$OUT/sanitizer_$tool.log" 2>&1 || { status=1; log "$tool FAILED (see sanitizer_$tool.log)"; }
    tail -n 3 "$OUT/sanitizer_$tool.log" | tee -a "$OUT/gpu_check.log"
  done
fi

if want 4; then
  log "4. benchmarks"
  if [ "${DEFAULT_BENCH:-1}" != 0 ]; then
    limited "$VENV/bin/python" "$REPO/bench/diag_matmul_gpu.py" --out "$OUT/diag_matmul_gpu.csv" \
      2>&1 | tee "$OUT/bench_default.log" || status=1
  fi
  limited "$VENV/bin/python" "$REPO/bench/diag_matmul_gpu.py" --batch 403456 --shapes 768:3072 \
    --sparsities "${GOAL_SPARSITIES:-0.9}" --block-sizes "${GOAL_BLOCK_SIZES:-1,16,32}" --layouts random --impls ffi,auto,dense \
    --out "$OUT/diag_matmul_gpu_goal.csv" 2>&1 | tee "$OUT/bench_goal.log" || status=1
  "$VENV/bin/python" "$REPO/bench/gpu_decision_table.py" --csv "$OUT/decision_table.csv" \
    > "$OUT/decision_table.md" || status=1
fi

want 5 && log "5. Nsight Compute profile of the goal shape beside the cost model"
NCU=$(want 5 && command -v ncu || true)
for candidate in /usr/local/cuda/bin/ncu "$(dirname "$(command -v nvcc)")/ncu"; do
  [ -z "$NCU" ] && [ -x "$candidate" ] && NCU=$candidate
done
if ! want 5; then
  :
elif [ -z "$NCU" ]; then
  log "ncu (Nsight Compute) not found: the profile is skipped"
else
  COMPARE=("$VENV/bin/python" "$REPO/bench/ncu_compare.py")
  metrics=$("${COMPARE[@]}" --list-metrics required)
  # The tensor-pipe metrics are not on every GPU: asked for only where this ncu lists them.
  available=$("$NCU" --query-metrics 2> /dev/null || true)
  for metric in $("${COMPARE[@]}" --list-metrics optional | tr , ' '); do
    if grep -Eq "^${metric%%.*}([[:space:]]|$)" <<< "$available"; then
      metrics+=",$metric"
    else
      log "ncu does not list ${metric%%.*} for this GPU: left out"
    fi
  done
  # One call of each jitted function (no warm-up): ncu replays every launch it profiles. Clocks
  # are left as the GPU runs them (not locked to base), as the model's issue rate assumes. Every
  # kernel is profiled: the dense layer's cuBLAS GEMMs are the reference, and XLA's kernels
  # around our calls are what the benchmark's times hold beside our kernels'.
  limited "$NCU" --target-processes all --csv --page raw --print-units base --clock-control none \
    --print-kernel-base demangled --metrics "$metrics" --log-file "$OUT/ncu_goal.csv" \
    "$VENV/bin/python" "$REPO/bench/diag_matmul_gpu.py" --batch 403456 --shapes 768:3072 \
    --sparsities 0.9 --block-sizes 16,32 --layouts random --impls ffi --repeats 1 --warmup 0 \
    --out "$OUT/diag_matmul_gpu_ncu.csv" > "$OUT/ncu.log" 2>&1 \
    || { status=1; log "ncu FAILED (see ncu.log; profiling may need admin rights)"; }
  "${COMPARE[@]}" "$OUT/ncu_goal.csv" --rows 403456 --shape 768:3072 --sparsity 0.9 \
    --block-sizes 16,32 --out "$OUT/ncu_vs_model.csv" 2>&1 | tee "$OUT/ncu_vs_model.log" \
    || status=1
fi

log "done (status $status); results in $OUT"
exit "$status"
