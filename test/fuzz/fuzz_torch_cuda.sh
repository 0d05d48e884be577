#!/bin/sh
# fuzz_torch on a GPU machine: random programs on DEVICE=CUDA against PyTorch on the CPU (docs/debugging.md).
# Usage: sh test/fuzz/fuzz_torch_cuda.sh [--cases N] [--seed S] [other fuzz_torch options]; exits 1 on any mismatch.
cd "$(dirname "$0")/../.." || exit 1
DEVICE=CUDA PYTHONPATH=. exec python test/fuzz/fuzz_torch.py --cases 500 --seed 1 --avoid ci --keep-going "$@"
