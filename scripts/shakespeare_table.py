"""Collects the Shakespeare user-level study's runs into one CSV (docs/user_level.md).

  python scripts/shakespeare_table.py OUT.csv RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a ``--model_dir`` of ``tf_dpnsgd.launch.shakespeare`` (its
``privacy_report.json`` and ``bound_diagnostics.json``); its parent folder's name is
taken as the seed label (e.g. ``seed0``). The user-level epsilon of an example-level run
is its group-privacy statement for ``k`` rows; of a user-level run, its own epsilon. The
machine (CPU model, cores, AVX-512) and the date are read here. The bound's counts come
from ``bound_diagnostics.json``: exact counts of the private data, published only because
this is a public benchmark.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import sys

FIELDS = ("seed", "run", "privacy_unit", "max_examples_per_user", "users", "rows",
          "rows_used", "rows_unused", "users_truncated", "test_accuracy", "example_epsilon",
          "user_epsilon", "user_delta", "noise_multiplier", "batch_size", "steps",
          "train_seconds", "cpu", "cores", "avx512", "date")


def machine() -> dict:
  with open("/proc/cpuinfo") as f:
    info = f.read()
  model = next((l.split(":", 1)[1].strip() for l in info.splitlines()
                if l.startswith("model name")), "unknown")
  return {"cpu": model, "cores": os.cpu_count(), "avx512": "yes" if "avx512f" in info else "no",
          "date": datetime.date.today().isoformat()}


def row(run_dir: str, host: dict) -> dict:
  with open(os.path.join(run_dir, "privacy_report.json")) as f:
    report = json.load(f)
  with open(os.path.join(run_dir, "bound_diagnostics.json")) as f:
    bound = json.load(f)
  unit = report.get("privacy_unit") or "none"
  group = report.get("group_privacy") or {}
  user_eps, user_delta = {"user": (report.get("epsilon"), report.get("delta")),
                          "example": (group.get("epsilon"), group.get("delta"))}.get(
                              unit, (None, None))
  return {"seed": os.path.basename(os.path.dirname(os.path.abspath(run_dir))),
          "run": os.path.basename(os.path.abspath(run_dir)), "privacy_unit": unit,
          "max_examples_per_user": bound["max_examples_per_user"], "users": bound["users"],
          "rows": bound["rows"], "rows_used": bound["rows"] - bound["rows_unused"],
          "rows_unused": bound["rows_unused"], "users_truncated": bound["users_truncated"],
          "test_accuracy": round(report["final_metrics"]["accuracy"], 4),
          "example_epsilon": (round(report["epsilon"], 4) if unit == "example" else ""),
          "user_epsilon": "" if user_eps is None else round(user_eps, 4),
          "user_delta": "" if user_delta is None else f"{user_delta:.3g}",
          "noise_multiplier": ("" if report.get("noise_multiplier") is None
                               else round(report["noise_multiplier"], 4)),
          "batch_size": report["hyperparameters"]["batch_size"], "steps": report["steps"],
          "train_seconds": round(report["train_seconds"], 1), **host}


def main(argv) -> None:
  if len(argv) < 3:
    raise SystemExit(__doc__)
  host = machine()
  with open(argv[1], "w", newline="") as f:
    writer = csv.DictWriter(f, FIELDS)
    writer.writeheader()
    for run_dir in argv[2:]:
      writer.writerow(row(run_dir, host))


if __name__ == "__main__":
  main(sys.argv)
