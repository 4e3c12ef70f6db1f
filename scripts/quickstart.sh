#!/usr/bin/env bash
# Main job: fresh virtual environment, install, then train DP-NSGD offline on
# scikit-learn's handwritten digits (shipped with scikit-learn), printing
# accuracy and epsilon per epoch; writes a SavedModel and privacy_report.json
# under runs/quickstart/. The DP noise and batch sampling take fresh OS seeds in
# every run, so the final accuracy varies a little between runs (not bit-identical).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[experiments]"
# Each invocation is a fresh run (a kept --model_dir would resume a finished run).
rm -rf runs/quickstart
python -m tf_dpnsgd.launch.quickstart --model_dir=runs/quickstart --export_dir=runs/quickstart/export "$@"
