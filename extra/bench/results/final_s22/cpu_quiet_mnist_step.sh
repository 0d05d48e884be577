#!/bin/bash
# Quiet-machine CPU row of issue 26 (session 22 final): the mnist step's Python, merged (integ22) and main alternated
unset PYTHONDONTWRITEBYTECODE
. /work/main/.venv/bin/activate
M=/work/wt/integ22
ms() { (cd $1 && PYTHONPATH=$PWD python extra/bench/bench_mnist_step.py 2>&1 | tail -2); }
echo "== start $(date) load $(cat /proc/loadavg)"
for t in $M /work/main $M /work/main $M; do echo "== mnist step $t $(date) load $(cat /proc/loadavg)"; ms $t; done
echo "== end $(date)"
