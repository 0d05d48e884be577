#!/usr/bin/env bash
# One device call: each line "name|limit|command" of the plan file $PLAN runs in the repo root, its log in $OUT/<name>.txt
# Usage on the device machine: PLAN=extra/bench/plans/finalA.txt bash extra/bench/gpu_plan.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OURGRAD_CACHE_DIR=/tmp/ourgrad_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/gpu.txt"
while IFS='|' read -r name limit cmd; do
  [ -z "$name" ] && continue
  echo "=== $cmd (limit $limit s)" | tee -a "$OUT/$name.txt"
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" < /dev/null > "$OUT/$name.tmp" 2>&1
  echo "rc=$? in $(( $(date +%s) - start )) s" >> "$OUT/$name.tmp"
  cat "$OUT/$name.tmp" >> "$OUT/$name.txt"; rm "$OUT/$name.tmp"
  tail -25 "$OUT/$name.txt"
done < "${PLAN}"
