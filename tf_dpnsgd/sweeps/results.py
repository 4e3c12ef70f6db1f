"""The results of a sweep on disk: where each cell's run is, its row, and the grid's robustness.

``<sweep_dir>/cells/<cell>/`` holds a cell's run; the run's
``privacy_report.json`` (:class:`tf_dpnsgd.records.RunRecord`) marks it
finished. :func:`cell_result` turns a cell into one row of ``results.csv`` /
``results.json``; :func:`robustness_summary` condenses a heatmap of rows into
the numbers of the paper's stability claim.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from tf_dpnsgd.records import REPORT_FILE, RunRecord
from tf_dpnsgd.sweeps.grid import Cell, SweepError, SweepOptions

FINISHED_MARKER = REPORT_FILE


def fmt(v, spec=".4g") -> str:
  """``format(v, spec)``; ``"n/a"`` for ``None``, inf and nan."""
  return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def cell_dir(opts: SweepOptions, cell: Cell) -> str:
  return os.path.join(opts.sweep_dir, "cells", cell.name)


def is_finished(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, FINISHED_MARKER))


def read_record(opts: SweepOptions, cell: Cell) -> RunRecord:
  """The finished cell's :class:`~tf_dpnsgd.records.RunRecord`."""
  return RunRecord.read(os.path.join(cell_dir(opts, cell), FINISHED_MARKER))


def _finite(value) -> Optional[float]:
  return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def cell_result(opts: SweepOptions, cell: Cell) -> dict:
  """One row of results.csv: the cell's axes, its accuracies and its privacy.

  ``epsilon``, ``delta`` and ``noise_multiplier`` are ``None`` for a
  non-private cell; accuracies and loss are ``None`` where not finite.
  """
  directory = cell_dir(opts, cell)
  row = {"cell": cell.name, **dict(cell.assignments)}
  if not is_finished(directory):
    row["status"] = ("unfinished" if os.path.exists(os.path.join(directory, "log.txt"))
                     else "not run")
    return row
  record = read_record(opts, cell)
  record_path = os.path.join(directory, "cell.json")
  seconds = read_json(record_path).get("seconds") if os.path.exists(record_path) else None
  row.update({
      "status": "finished",
      "private": record.private,
      "final_accuracy": _finite(record.metric("accuracy")),
      "best_val_accuracy": record.best_val_accuracy,
      "final_loss": _finite(record.metric("loss")),
      "epsilon": record.epsilon, "delta": record.delta,
      "noise_multiplier": record.noise_multiplier, "steps": record.steps,
      "seconds": seconds,
  })
  for k in ("optimizer", "learning_rate", "regularizer", "l2_norm_clip",
            "target_unclipped_quantile", "clip_learning_rate", "batch_size", "epochs"):
    row.setdefault(k, record.hyperparameters.get(k))
  return row


def metric_value(row: dict, metric: str) -> float:
  value = row.get("final_accuracy" if metric == "final" else "best_val_accuracy")
  return float(value) if value is not None else math.nan


def write_results(opts: SweepOptions, rows: Sequence[dict]) -> tuple:
  columns = []
  for row in rows:
    columns += [k for k in row if k not in columns]
  csv_path = os.path.join(opts.sweep_dir, "results.csv")
  with open(csv_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
  json_path = os.path.join(opts.sweep_dir, "results.json")
  with open(json_path, "w") as f:
    json.dump({"metric": opts.metric, "cells": list(rows)}, f, indent=1)
  return csv_path, json_path



def robustness_summary(accuracy, threshold_points: float = 2.0) -> dict:
  """The paper's stability claim as numbers, for one heatmap.

  Args:
    accuracy: ``[rows, cols]`` accuracies in [0, 1]; rows are learning rates,
      columns the regularizer ``r`` (DP-NSGD) or clip ``c`` (DP-SGD). NaN marks
      a missing or failed cell (ignored).
    threshold_points: "near-best" means within this many percentage points.

  Returns:
    ``best`` (accuracy, %), ``best_cell`` ``(row, col)``; at the best cell's
    row: ``spread_at_best_row`` (max - min across columns, points),
    ``min_at_best_row``; ``near_best`` (cells within the threshold,
    inclusive), ``cells`` (finite cells) and ``near_best_fraction``.

  >>> s = robustness_summary([[0.90, 0.80], [0.95, 0.935]])
  >>> s["best"], s["best_cell"], round(s["spread_at_best_row"], 6), s["near_best"]
  (95.0, (1, 0), 1.5, 2)
  """
  acc = np.asarray(accuracy, dtype=np.float64)
  if acc.ndim != 2 or acc.size == 0:
    raise SweepError(f"`accuracy` must be a non-empty 2-D array; got shape {acc.shape}.")
  if not threshold_points >= 0:
    raise SweepError(f"`threshold_points` must be >= 0; got {threshold_points!r}.")
  points = 100.0 * acc
  finite = np.isfinite(points)
  if not np.any(finite):
    raise SweepError("No finite accuracy in the grid.")
  flat = int(np.nanargmax(np.where(finite, points, -np.inf)))
  row, col = divmod(flat, acc.shape[1])
  best = float(points[row, col])
  best_row = points[row][np.isfinite(points[row])]
  # A small absolute slack absorbs float rounding of "exactly threshold points below".
  near = finite & (points >= best - threshold_points - 1e-9)
  return {
      "best": best,
      "best_cell": (int(row), int(col)),
      "spread_at_best_row": float(best_row.max() - best_row.min()),
      "min_at_best_row": float(best_row.min()),
      "near_best": int(near.sum()),
      "cells": int(finite.sum()),
      "near_best_fraction": float(near.sum() / finite.sum()),
      "threshold_points": float(threshold_points),
  }


__all__ = ["FINISHED_MARKER", "cell_dir", "cell_result", "fmt", "is_finished", "metric_value",
           "read_json", "read_record", "robustness_summary", "write_results"]
