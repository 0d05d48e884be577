#!/usr/bin/env bash
# One device-machine call: the CUDA test suites in $TESTS, then the benchmarks in $BENCHES, each log under $OUT.
# BENCHES is a ';'-separated list of "name args...", e.g. BENCHES="reduce; matmul --no-compile --beam 0".
# Usage on the device machine: TESTS="test/test_ops.py" BENCHES="reduce; jit" bash extra/bench/gpu_session.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OURGRAD_CACHE_DIR=/tmp/ourgrad_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import xdist" 2>/dev/null && PARALLEL="-n 8" || PARALLEL=""
if [ -n "${TESTS:-}" ]; then
  DEVICE=CUDA timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q $PARALLEL -p no:cacheprovider $TESTS 2>&1 \
    | tail -60 | tee "$OUT/cuda_tests.txt"
fi
IFS=';' read -ra specs <<< "${BENCHES:-}"
for spec in "${specs[@]}"; do
  read -ra words <<< "$spec"
  [ ${#words[@]} -eq 0 ] && continue
  name=${words[0]}
  echo "=== bench_$name ${words[*]:1}" | tee -a "$OUT/bench_$name.txt"
  timeout "${BENCH_TIMEOUT:-180}" python3 "extra/bench/bench_$name.py" "${words[@]:1}" 2>&1 | tail -80 \
    | tee -a "$OUT/bench_$name.txt"
done
