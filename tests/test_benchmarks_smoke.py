"""CI's run of ``benchmarks/gpu.py --smoke``: the table has every row and no errored cell.

The smoke mode runs the GPU benchmark's code paths (XLA on and off, float32
and mixed precision, the CIFAR-10 launcher on random images) at tiny sizes on
a CPU, so a change that breaks one of them fails here rather than on the GPU
machine. It checks that the script runs, not how fast: no timings are asserted.
"""

import os
import subprocess
import sys

import pytest

# runs the benchmark scripts in subprocesses (minutes)
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Mostly XLA compilation of the DP steps: about 4.6 CPU-minutes in all (measured on a
# loaded 2-core machine, where it took 23 minutes of wall time).
TIMEOUT_S = 900


def table(stdout):
  """The markdown table's data rows as lists of cells."""
  lines = [l for l in stdout.splitlines() if l.startswith("|")]
  assert lines and lines[0].startswith("| model |"), stdout
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  return header, [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]


def test_gpu_benchmark_smoke_mode_prints_every_row_without_errors():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--smoke"],
                       capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  header, rows = table(out.stdout)
  col = {name: i for i, name in enumerate(header)}
  for row in rows:
    assert not any(cell.startswith("error") for cell in row), row
  step_rows = {(r[col["model"]].split()[0], r[col["XLA"]], r[col["precision"]]): r
               for r in rows if not r[col["model"]].startswith("CIFAR")}
  assert set(step_rows) == {(m, x, p) for m in ("ResNet8-GN", "BERT") for x in ("off", "on")
                            for p in ("float32", "mixed_bfloat16")}, sorted(step_rows)
  for key, r in step_rows.items():
    if not r[col["DP-NSGD step ms"]].startswith("refused"):
      assert float(r[col["DP-NSGD step ms"]]) > 0 and r[col["engine"]] in (
          "layerwise", "layerwise (auto)", "two_pass", "vectorized", "microbatch"), (key, r)
      assert float(r[col["plain step ms"]]) > 0 and r[col["ratio"]].endswith("x"), (key, r)
  cifar = [r for r in rows if r[col["model"]].startswith("CIFAR")]
  assert len(cifar) == 1, rows
  note = cifar[0][col["notes"]]
  assert "test accuracy" in note and "epsilon" in note and "after 3 steps" in note, note
