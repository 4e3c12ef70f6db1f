"""Comparing tuning methods across sweeps, with seed replicates: the numbers of docs/tuning.md.

One sweep per method (e.g. DP-NSGD over ``learning_rate x regularizer``, DP-SGD
over ``effective_lr x l2_norm_clip``, adaptive clipping over ``learning_rate x
target_unclipped_quantile``), each with a replicate axis (``seed``) and a panel
axis (``target_epsilon``). :func:`load_sweep` reads a sweep folder's finished
cells into a :class:`MethodGrid` (accuracy ``[panel, seed, y, x]``);
:func:`summarize_method` condenses each panel:

* the mean and standard deviation over seeds of every cell;
* :func:`~tf_dpnsgd.sweeps.results.robustness_summary` of the mean grid (best,
  spread at the best learning rate, cells within ``near_best_points`` of the
  best) and the best cell of each seed alone (does the winner move?);
* the privacy of tuning over the grid (:func:`tf_dpnsgd.tuning.tuning_privacy`):
  one run, every cell released (naive composition), and random search after
  Papernot & Steinke (2022) with ``E[K]`` = the number of cells, and with the
  smallest ``E[K]`` that reaches a near-best cell with probability
  ``success_probability`` (estimated from the mean grid).

A random-search *trial* is one training run (one seed) of a uniformly chosen
cell; the seed replicates only estimate how likely a cell is to be good. The
grids' own accuracies are test accuracies, outside the protected training
set (see :func:`tf_dpnsgd.sweeps.report.assumptions`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from tf_dpnsgd import plots, tuning
from tf_dpnsgd.records import REPORT_FILE, RunRecord
from tf_dpnsgd.sweeps.grid import PANEL_AXIS, Y_CANDIDATES, SweepError
from tf_dpnsgd.sweeps.results import fmt, robustness_summary

REPLICATE_AXIS = "seed"


@dataclasses.dataclass(frozen=True)
class MethodGrid:
  """One method's finished cells: ``accuracy[p, s, i, j]`` at panel value ``panels[p]``,
  seed ``seeds[s]``, ``y_values[i]``, ``x_values[j]`` (NaN: missing or failed)."""

  label: str
  x_axis: str
  y_axis: str
  x_values: tuple
  y_values: tuple
  panels: tuple
  seeds: tuple
  accuracy: np.ndarray
  runs: dict  # panel value -> [(delta, tuning.RunPrivacy)] of every finished private run
  non_private: dict = dataclasses.field(default_factory=dict)  # panel -> finished sgd cells


def _sort_key(value: str):
  try:
    return (0, float(value), value)
  except ValueError:
    return (1, 0.0, value)


def load_sweep(label: str, sweep_dir: str, metric: str = "final",
               replicate_axis: str = REPLICATE_AXIS, panel_axis: str = PANEL_AXIS,
               y_candidates: Sequence[str] = Y_CANDIDATES) -> MethodGrid:
  """Reads ``<sweep_dir>/cells/*/{cell.json, privacy_report.json}`` into a :class:`MethodGrid`.

  The grid's two plotted axes are the assignment axes other than the replicate
  and panel axes that take more than one value; y is the one among
  ``y_candidates`` (the learning rate).

  Raises:
    SweepError: no cell, or not exactly two varying axes besides seed and panel.
  """
  if metric not in ("final", "best"):
    raise SweepError(f"`metric` must be 'final' or 'best'; got {metric!r}.")
  cells_dir = os.path.join(sweep_dir, "cells")
  if not os.path.isdir(cells_dir):
    raise SweepError(f"{sweep_dir} has no cells/ folder: not a sweep folder.")
  cells = []
  for name in sorted(os.listdir(cells_dir)):
    path = os.path.join(cells_dir, name, "cell.json")
    if os.path.isfile(path):
      with open(path) as f:
        cells.append((name, {k: str(v) for k, v in json.load(f)["assignments"].items()}))
  if not cells:
    raise SweepError(f"{sweep_dir} has no cell with a cell.json.")
  values = {}
  definition = os.path.join(sweep_dir, "sweep.json")
  if os.path.isfile(definition):  # the planned grid: cells not started yet show as missing
    with open(definition) as f:
      for ax in json.load(f).get("axes", []):
        if not ax.get("condition"):
          values.setdefault(ax["name"], set()).update(str(v) for v in ax["values"])
  for _, a in cells:
    for k, v in a.items():
      values.setdefault(k, set()).add(v)
  varying = [k for k, v in values.items()
             if k not in (replicate_axis, panel_axis) and len(v) > 1]
  ys = [k for k in varying if k in y_candidates]
  if len(varying) != 2 or len(ys) != 1:
    raise SweepError(f"Sweep {sweep_dir}: expected two varying axes besides {replicate_axis!r} "
                     f"and {panel_axis!r}, one of them in {tuple(y_candidates)}; got {varying}.")
  y_axis = ys[0]
  x_axis = next(k for k in varying if k != y_axis)
  axis = lambda k: tuple(sorted(values.get(k, {""}), key=_sort_key))
  xs, yv, panels, seeds = axis(x_axis), axis(y_axis), axis(panel_axis), axis(replicate_axis)
  acc = np.full((len(panels), len(seeds), len(yv), len(xs)), np.nan)
  runs = {p: [] for p in panels}
  non_private = {p: [] for p in panels}
  for name, a in cells:
    report = os.path.join(cells_dir, name, REPORT_FILE)
    if not os.path.isfile(report):
      continue
    record = RunRecord.read(report)
    value = record.metric("accuracy") if metric == "final" else record.best_val_accuracy
    p = panels.index(a.get(panel_axis, ""))
    idx = (p, seeds.index(a.get(replicate_axis, "")), yv.index(a[y_axis]), xs.index(a[x_axis]))
    if isinstance(value, (int, float)) and math.isfinite(value):
      acc[idx] = float(value)
    if record.private:
      runs[panels[p]].append((record.delta, tuning.RunPrivacy.from_record(record)))
    else:
      non_private[panels[p]].append(name)
  return MethodGrid(label, x_axis, y_axis, xs, yv, panels, seeds, acc, runs,
                    {p: v for p, v in non_private.items() if v})


def summarize_method(grid: MethodGrid, near_best_points: float = 2.0,
                     success_probability: float = 0.9, etas: Sequence[float] = (0.0, 1.0)) -> list:
  """One dict per panel: mean/std grids, robustness of the mean, per-seed bests, tuning privacy."""
  out = []
  cache = {}
  for p, panel in enumerate(grid.panels):
    acc = grid.accuracy[p]  # [seeds, y, x]
    counts = np.isfinite(acc).sum(axis=0)
    with np.errstate(invalid="ignore"):
      mean = np.where(counts > 0, np.nansum(acc, axis=0) / np.maximum(counts, 1), np.nan)
      std = np.where(counts > 1, np.sqrt(np.nansum((acc - mean) ** 2, axis=0)
                                         / np.maximum(counts - 1, 1)), np.nan)
    entry = {"method": grid.label, "panel": panel, "x_axis": grid.x_axis,
             "y_axis": grid.y_axis, "x_values": list(grid.x_values),
             "y_values": list(grid.y_values), "seeds": list(grid.seeds),
             "mean": mean.tolist(), "std": std.tolist(),
             "complete": bool((counts == len(grid.seeds)).all()),
             "runs_finished": int(np.isfinite(acc).sum())}
    if np.isfinite(mean).any():
      rob = robustness_summary(mean, near_best_points)
      i, j = rob["best_cell"]
      rob.update(best_x=grid.x_values[j], best_y=grid.y_values[i],
                 best_std=float(100 * std[i, j]) if math.isfinite(std[i, j]) else None)
      entry["robustness"] = rob
      per_seed = []
      for s, seed in enumerate(grid.seeds):
        if np.isfinite(acc[s]).any():
          r = robustness_summary(acc[s], near_best_points)
          per_seed.append({"seed": seed, "best": r["best"],
                           "best_x": grid.x_values[r["best_cell"][1]],
                           "best_y": grid.y_values[r["best_cell"][0]],
                           "near_best": r["near_best"], "cells": r["cells"]})
      entry["per_seed"] = per_seed
    runs = grid.runs[panel]
    if runs:
      deltas = {d for d, _ in runs}
      if len(deltas) != 1:
        raise SweepError(f"{grid.label}, {panel}: runs with different deltas {sorted(deltas)}.")
      delta = deltas.pop()
      privacies = [r for _, r in runs]
      cells = int(np.prod(mean.shape))
      priv = tuning.tuning_privacy(privacies, delta,
                                   tuning.default_distributions(float(cells), etas), cache=cache)
      # "All cells released" means one run per cell (one seed); the replicates are 3x that.
      one_seed = privacies[:cells] if len(privacies) >= cells else privacies
      priv["naive_composition_one_seed"] = tuning.tuning_privacy(
          one_seed, delta, cache=cache)["naive_composition"]
      fraction = entry.get("robustness", {}).get("near_best_fraction")
      if fraction:
        reach = [tuning.poisson_for_success(fraction, success_probability)]
        reach += [tuning.truncated_negative_binomial_for_success(e, fraction, success_probability)
                  for e in etas]
        priv["random_search_near_best"] = {
            "probability": success_probability, "near_best_fraction": fraction,
            "results": tuning.tuning_privacy(privacies, delta, reach,
                                             cache=cache)["random_search"]}
      entry["privacy"] = priv
    if grid.non_private.get(panel):
      # Trained on the same data without noise and released with the grid: no epsilon.
      entry["non_private_cells"] = list(grid.non_private[panel])
      entry.setdefault("privacy", {})["private"] = False
    out.append(entry)
  return out


def _geometric(results: Sequence[dict]) -> Optional[dict]:
  """The truncated negative binomial with eta = 1 (geometric) among random-search results."""
  return next((r for r in results if "eta=1" in r["distribution"]), None)


def table_lines(entries: Sequence[dict]) -> list:
  """A markdown table: one row per (method, panel)."""
  lines = ["| method | epsilon | grid (y x x) | best % (mean ± sd over seeds) | best cell | "
           "spread at best lr (points) | cells near best | best cell per seed | "
           "random search eps, E[K]=cells (geometric) | E[K] to reach near-best w.p. 0.9: "
           "eps (geometric) |",
           "|" + "---|" * 10]
  for e in entries:
    rob, priv = e.get("robustness"), e.get("privacy", {})
    if not rob:
      lines.append(f"| {e['method']} | {e['panel']} | no finished cell |" + " |" * 7)
      continue
    rs = _geometric(priv.get("random_search", [])) or {}
    reach = _geometric(priv.get("random_search_near_best", {}).get("results", [])) or {}
    seeds = "; ".join(f"{s['best_y']}/{s['best_x']}" for s in e.get("per_seed", []))
    sd = f" ± {rob['best_std']:.1f}" if rob.get("best_std") is not None else ""
    partial = "" if e["complete"] else " (incomplete)"
    if e.get("non_private_cells"):
      partial += " (NOT private: includes non-private runs)"
    lines.append(
        f"| {e['method']}{partial} | {e['panel']} | {e['y_axis']} x {e['x_axis']} "
        f"({len(e['y_values'])}x{len(e['x_values'])}) | {rob['best']:.1f}{sd} | "
        f"{rob['best_y']} / {rob['best_x']} | {rob['spread_at_best_row']:.1f} | "
        f"{rob['near_best']}/{rob['cells']} | {seeds} | {fmt(rs.get('epsilon'), '.2f')} | "
        + (f"E[K]={reach['mean_trials']:.2g}: {fmt(reach.get('epsilon'), '.2f')}" if reach
           else "n/a") + " |")
  return lines


def draw(grids: Sequence[MethodGrid], entries: Sequence[dict], out_dir: str) -> list:
  """One heatmap PNG per method (panels: epsilons), cells annotated with the seed mean."""
  paths = []
  for g in grids:
    mine = [e for e in entries if e["method"] == g.label]
    panels = [plots.HeatmapPanel(f"epsilon = {e['panel']}", np.asarray(e["mean"], float),
                                 tuple(g.x_values), tuple(g.y_values)) for e in mine]
    slug = "".join(ch if ch.isalnum() else "_" for ch in g.label.lower()).strip("_")
    path = os.path.join(out_dir, f"tuning_{slug}.png")
    plots.heatmap(path, panels, g.x_axis, g.y_axis,
                  title=f"{g.label}: test accuracy, mean of {len(g.seeds)} seeds")
    paths.append(path)
  return paths


def compare(sweeps: Sequence[tuple], out_dir: str, metric: str = "final",
            near_best_points: float = 2.0, success_probability: float = 0.9) -> dict:
  """Loads ``[(label, sweep_dir)]``, writes ``comparison.json``, ``comparison.md`` and heatmaps."""
  grids = [load_sweep(label, d, metric) for label, d in sweeps]
  entries = [e for g in grids for e in summarize_method(g, near_best_points, success_probability)]
  entries.sort(key=lambda e: (_sort_key(e["panel"]), [g.label for g in grids].index(e["method"])))
  os.makedirs(out_dir, exist_ok=True)
  figures = draw(grids, entries, out_dir)
  result = {"sweeps": [{"label": l, "dir": d} for l, d in sweeps], "metric": metric,
            "near_best_points": near_best_points, "entries": entries, "figures": figures}
  with open(os.path.join(out_dir, "comparison.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(os.path.join(out_dir, "comparison.md"), "w") as f:
    f.write("\n".join(table_lines(entries)) + "\n")
  return result


__all__ = ["MethodGrid", "REPLICATE_AXIS", "compare", "draw", "load_sweep", "summarize_method",
           "table_lines"]
