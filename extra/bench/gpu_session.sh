#!/usr/bin/env bash
# One device-machine call: CUDA test suites, then the benchmarks named in $BENCHES, each log under $OUT.
# Usage on the device machine: BENCHES="reduce jit" bash extra/bench/gpu_session.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OURGRAD_CACHE_DIR=/tmp/ourgrad_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import xdist" 2>/dev/null && PARALLEL="-n 8" || PARALLEL=""
if [ -n "${TESTS:-}" ]; then
  DEVICE=CUDA timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q $PARALLEL -p no:cacheprovider $TESTS 2>&1 \
    | tail -40 | tee "$OUT/cuda_tests.txt"
fi
for bench in ${BENCHES:-}; do
  echo "=== bench_$bench ${BENCH_ARGS_:-}" | tee -a "$OUT/bench_$bench.txt"
  timeout "${BENCH_TIMEOUT:-180}" python3 "extra/bench/bench_$bench.py" 2>&1 | tail -60 | tee -a "$OUT/bench_$bench.txt"
done
