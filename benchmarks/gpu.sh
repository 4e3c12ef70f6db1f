#!/usr/bin/env bash
# The GPU benchmark table (see benchmarks/gpu.py): plain vs DP-NSGD step time and peak
# memory with and without XLA and mixed precision, and a short CIFAR-10 run.
#   bash benchmarks/gpu.sh                                  # full sizes, on a GPU
#   bash benchmarks/gpu.sh --cifar_data_dir="$HOME/data"    # CIFAR-10 from local pickles
#   bash benchmarks/gpu.sh --smoke                          # tiny shapes on a CPU (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu.py "$@"
