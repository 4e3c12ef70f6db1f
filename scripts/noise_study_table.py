r"""The correlated-noise study's table: sweeps of one noise mechanism each, side by side.

  python scripts/noise_study_table.py --out=docs/results/noise_study/results.csv \
      independent=runs/noise_study/independent bandmf=runs/noise_study/bandmf \
      blt=runs/noise_study/blt

Each ``label=folder[:COLUMN=VALUE]`` is a finished sweep (only its rows whose ``COLUMN``
is ``VALUE``, e.g. ``auto=runs/noise_study/long_auto:noise=auto`` for a sweep with a
``noise`` axis) (``tf_dpnsgd.launch.sweep``) over
``target_epsilon x seed``, as configs/sweeps/scatter_cifar10_noise_*.flags. Writes the
raw rows of all sweeps (with their label) to ``--out`` and prints a Markdown table: per
epsilon and mechanism, the final test accuracy of each seed, their mean, and the mean's
difference from the first label's (the baseline), with the run's epsilon and noise
multiplier. Nothing is computed that the sweeps' ``results.csv`` do not hold.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics


def read(spec):
  """The finished rows of ``folder[:COLUMN=VALUE]``."""
  folder, _, condition = spec.partition(":")
  column, _, value = condition.partition("=")
  with open(os.path.join(folder, "results.csv"), newline="") as f:
    return [r for r in csv.DictReader(f) if r.get("status") == "finished"
            and (not column or r.get(column) == value)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="CSV of every finished cell, labelled.")
  parser.add_argument("sweeps", nargs="+", help="label=sweep_dir[:COLUMN=VALUE], the baseline first.")
  args = parser.parse_args()
  labelled = [s.split("=", 1) for s in args.sweeps]
  rows = []
  for label, folder in labelled:
    rows += [{"mechanism": label, **r} for r in read(folder)]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  fields = ["mechanism"] + [k for k in rows[0] if k != "mechanism"]
  extra = sorted({k for r in rows for k in r} - set(fields))
  with open(args.out, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields + extra)
    writer.writeheader()
    writer.writerows(rows)
  epsilons = sorted({float(r["target_epsilon"]) for r in rows})
  print("| epsilon | mechanism | noise multiplier | run epsilon | accuracy per seed (%) | "
        "mean (%) | vs " + labelled[0][0] + " (points) |")
  print("|---|---|---|---|---|---|---|")
  for eps in epsilons:
    base = None
    for label, _ in labelled:
      cells = sorted((r for r in rows if r["mechanism"] == label
                      and float(r["target_epsilon"]) == eps), key=lambda r: r.get("seed", ""))
      if not cells:
        continue
      acc = [100 * float(r["final_accuracy"]) for r in cells]
      mean = statistics.mean(acc)
      base = mean if base is None else base
      print(f"| {eps:g} | {label} | {float(cells[0]['noise_multiplier']):.4g} | "
            f"{max(float(r['epsilon']) for r in cells):.4f} | "
            f"{', '.join(f'{a:.2f}' for a in acc)} | {mean:.2f} | "
            f"{'' if label == labelled[0][0] else f'{mean - base:+.2f}'} |")


if __name__ == "__main__":
  main()
