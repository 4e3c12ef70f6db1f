"""The sweep's report: robustness of each panel and the privacy of tuning over it.

Per panel: the robustness summary of its heatmap
(:func:`~tf_dpnsgd.sweeps.results.robustness_summary`) and the privacy of the
tuning (single run, naive composition of all cells, random search after
Papernot & Steinke 2022; see :mod:`tf_dpnsgd.tuning`). Written as
``report.json`` / ``report.md`` and printed.

A sweep that holds a finished non-private cell (``optimizer=sgd``) is NOT
private as a whole: that run trained on the same data without noise and its
accuracy, heatmap and curves are released with the others, so no epsilon
covers the sweep (:func:`whole_sweep_privacy`: ``"private": false``,
``"epsilon": null``, i.e. infinite). The private cells' own composition is
kept apart, under ``private_runs_only``, with the condition under which it
would hold. Likewise a panel holding a non-private cell lists it
(``non_private_cells``), and the cells' ``not_covered`` items
(:mod:`tf_dpnsgd.coverage`) are collected under ``not_covered``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

from tf_dpnsgd import tuning
from tf_dpnsgd.sweeps.figures import (arrange_panels, chosen_curve_cells, draw_curves,
                                      draw_heatmaps)
from tf_dpnsgd.sweeps.grid import Cell, SweepError, SweepOptions, echo
from tf_dpnsgd.sweeps.results import (cell_result, fmt, metric_value, read_record,
                                      robustness_summary, write_results)


def _distributions(opts: SweepOptions, n_cells: int) -> list:
  mean = opts.tuning_mean if opts.tuning_mean is not None else float(n_cells)
  if mean <= 1.0:
    return []
  return tuning.default_distributions(mean, opts.tuning_etas, opts.tuning_poisson)


def panel_privacy(opts: SweepOptions, runs: Sequence, near_best_fraction: Optional[float],
                  cache: dict) -> dict:
  """Single-run, naive-composition and random-search epsilons of one panel's runs."""
  deltas = {r["delta"] for r in runs}
  if len(deltas) != 1:
    raise SweepError(f"The cells of one panel use different deltas {sorted(deltas)}.")
  delta = deltas.pop()
  privacies = [r["privacy"] for r in runs]
  result = tuning.tuning_privacy(privacies, delta, _distributions(opts, len(runs)), cache=cache)
  if len(runs) < 2 and opts.tuning_mean is None:
    result["notes"].append("One cell: nothing to tune (no random-search numbers).")
  if near_best_fraction:
    successes = ([tuning.poisson_for_success(near_best_fraction, opts.success_probability)]
                 if opts.tuning_poisson else [])
    successes += [tuning.truncated_negative_binomial_for_success(
        eta, near_best_fraction, opts.success_probability) for eta in opts.tuning_etas]
    reach = tuning.tuning_privacy(privacies, delta, successes, cache=cache)["random_search"]
    result["random_search_near_best"] = {
        "probability": opts.success_probability, "near_best_fraction": near_best_fraction,
        "note": ("E[K] chosen so that random search (uniform cells) reaches a cell within "
                 f"{opts.near_best_points:g} points of this grid's best with probability "
                 f"{opts.success_probability:g}, estimated from this grid's accuracies."),
        "results": reach}
  return result


def whole_sweep_privacy(private_runs: Sequence, non_private_cells: Sequence[str],
                        cache: Optional[dict] = None) -> Optional[dict]:
  """The privacy of releasing the whole sweep (every finished cell, its figures and numbers).

  Args:
    private_runs: ``[{"delta", "privacy": tuning.RunPrivacy}]`` of the finished private cells.
    non_private_cells: names of the finished non-private cells.
    cache: memo of RDP curves (see :func:`tf_dpnsgd.tuning.run_rdp`).

  Returns:
    ``None`` when there is nothing to say (no finished run, or private runs at several
    deltas and no non-private run); otherwise ``{"private", "epsilon", "runs", ...}``:

    * all finished runs private: ``private`` True, ``epsilon`` the naive composition
      (also under ``naive_composition``), ``single_run``;
    * any non-private run: ``private`` False and ``epsilon`` None (infinite: a run
      without noise has no finite guarantee, and composing it with anything leaves
      none), ``non_private_cells``, and the private runs' own numbers under
      ``private_runs_only`` (they hold only if nothing of the non-private runs is
      released).
  """
  non_private_cells = list(non_private_cells)
  deltas = {r["delta"] for r in private_runs}
  own = None
  if private_runs and len(deltas) == 1:
    whole = tuning.tuning_privacy([r["privacy"] for r in private_runs], deltas.pop(),
                                  cache=cache)
    own = {"runs": whole["runs"], "delta": whole["delta"],
           "naive_composition": whole["naive_composition"], "single_run": whole["single_run"]}
  if non_private_cells:
    out = {"private": False, "epsilon": None,
           "runs": len(private_runs) + len(non_private_cells),
           "non_private_runs": len(non_private_cells), "non_private_cells": non_private_cells}
    if own is not None:
      out["private_runs_only"] = own
    return out
  if own is None:
    return None
  return {"private": True, "epsilon": own["naive_composition"]["epsilon"], **own}


def assumptions(opts: SweepOptions) -> list:
  seeds = ("every cell drew its DP noise and batch-sampler seeds from the OS (independent "
           "runs); " + ("each cell's initialisation had its own random --seed"
                        if opts.cell_seeds == "fresh" else
                        "the cells shared the base launcher's --seed (initialisation and data "
                        "order only)"))
  return [
      "single_run: the epsilon of one cell (the largest over the panel).",
      "naive_composition: every cell of the panel trained and released (models or accuracies, "
      "e.g. this heatmap); RDP curves summed (Mironov 2017, Prop. 1).",
      "random_search: Papernot & Steinke (2022) Thm. 2 (truncated negative binomial) and "
      "Thm. 6 (Poisson): draw K trials, each a uniformly random cell of the panel, release "
      "ONLY the best trial. It does not cover this grid sweep as run and published.",
      "Trials differing in sigma or steps are accounted with the pointwise maximum of their "
      "RDP curves (quasi-convexity of Renyi divergence).",
      f"The score that selects the best trial is the {opts.eval_split} accuracy, computed on "
      "data outside the protected training set.",
      f"Seeds: {seeds}.",
      ("curves.png also shows each chosen cell's training loss and accuracy "
       "(--plot_training_metrics): exact, unprivatized training-set metrics that NO epsilon "
       "here covers." if opts.plot_training_metrics else
       f"curves.png shows {opts.eval_split} metrics only; the cells' history.json files hold "
       "the exact, unprivatized training metrics: keep them private (no epsilon covers them)."),
      "A non-private cell (optimizer=sgd) makes the whole sweep non-private: its run trained "
      "on the same data without noise.",
  ]


def summarize(opts: SweepOptions, cells: Sequence[Cell], print_fn=echo) -> dict:
  """Writes results, heatmaps, curves and the report; returns the report dict."""
  rows = [cell_result(opts, c) for c in cells]
  rows_by_name = {r["cell"]: r for r in rows}
  csv_path, json_path = write_results(opts, rows)
  panels = arrange_panels(opts, cells)
  finished = [r for r in rows if r["status"] == "finished"]
  report = {"sweep_dir": opts.sweep_dir, "base": opts.base, "base_flagfile": opts.base_flagfile,
            "cells": len(cells), "finished": len(finished),
            "not_finished": [r["cell"] for r in rows if r["status"] != "finished"],
            "metric": opts.metric, "eval_split": opts.eval_split, "results_csv": csv_path, "results_json": json_path,
            "assumptions": assumptions(opts), "panels": []}
  if not finished:
    print_fn("No finished cell: nothing to plot or account for.")
    _write_report(opts, report)
    return report
  figures = draw_heatmaps(opts, panels, rows_by_name)
  report["heatmaps"] = list(figures)
  curve_cells = chosen_curve_cells(opts, panels, cells, rows_by_name)
  report["curves"] = {"path": draw_curves(opts, curve_cells), "cells": curve_cells}

  cache, all_runs, not_covered = {}, [], {}
  non_private = [r["cell"] for r in finished if r.get("private") is False]
  report["private"] = not non_private
  for p in panels:
    acc = [[metric_value(rows_by_name[c.name], opts.metric) if c else math.nan for c in row]
           for row in p.cells]
    entry = {"figure": p.figure, "panel": p.label, "x_axis": p.x_axis, "y_axis": p.y_axis,
             "x_values": p.x_values, "y_values": p.y_values,
             "cells": [[c.name if c else None for c in row] for row in p.cells],
             "accuracy": acc}
    runs = []
    for c in p.members():
      r = rows_by_name[c.name]
      if r["status"] == "finished":
        record = read_record(opts, c)
        if record.not_covered:
          not_covered[c.name] = list(record.not_covered)
        if record.private:
          runs.append({"delta": record.delta, "privacy": tuning.RunPrivacy.from_record(record)})
    panel_non_private = [c.name for c in p.members() if c.name in non_private]
    if panel_non_private:
      entry["non_private_cells"] = panel_non_private
    all_runs += runs
    fraction = None
    if any(math.isfinite(v) for row in acc for v in row):
      rob = robustness_summary(acc, opts.near_best_points)
      i, j = rob["best_cell"]
      rob["best_cell_name"] = p.cells[i][j].name
      rob["best_x"], rob["best_y"] = p.x_values[j], p.y_values[i]
      entry["robustness"] = rob
      fraction = rob["near_best_fraction"]
    if runs:
      entry["privacy"] = panel_privacy(opts, runs, fraction, cache)
      missing = len(p.members()) - len(runs)
      if missing:
        entry["privacy"]["notes"].append(
            f"{missing} cell(s) of this panel did not finish (or are non-private): the numbers "
            "cover the finished private cells only; an unfinished run also spent privacy.")
    report["panels"].append(entry)
  whole = whole_sweep_privacy(all_runs, non_private, cache)
  if whole is not None:
    report["whole_sweep"] = whole
  if not_covered:
    report["not_covered"] = not_covered
  _write_report(opts, report)
  for line in report_lines(report):
    print_fn(line)
  return report


def report_lines(report: dict) -> list:
  """A plain-text summary of the report (printed, and the body of report.md)."""
  lines = [f"# Sweep {report['sweep_dir']}", "",
           f"Base launcher `{report['base']}`, {report['finished']}/{report['cells']} cells "
           f"finished; metric: {report['metric']} {report.get('eval_split', 'test')} accuracy.", ""]
  for e in report["panels"]:
    title = e["figure"] + (f" | {e['panel']}" if e["panel"] else "")
    lines.append(f"## {title}  (x: {e['x_axis']}, y: {e['y_axis']})")
    header = "| y \\ x | " + " | ".join(str(x) for x in e["x_values"]) + " |"
    lines += ["", header, "|" + "---|" * (len(e["x_values"]) + 1)]
    for yv, row in zip(e["y_values"], e["accuracy"]):
      lines.append(f"| {yv} | " + " | ".join(fmt(100 * v, ".1f") for v in row) + " |")
    lines.append("")
    rob = e.get("robustness")
    if rob:
      lines.append(
          f"* best {rob['best']:.1f}% at {e['y_axis']}={rob['best_y']}, {e['x_axis']}="
          f"{rob['best_x']}; spread across {e['x_axis']} at that {e['y_axis']}: "
          f"{rob['spread_at_best_row']:.1f} points (min {rob['min_at_best_row']:.1f}%); "
          f"cells within {rob['threshold_points']:g} points of the best: {rob['near_best']}/"
          f"{rob['cells']} ({100 * rob['near_best_fraction']:.0f}%).")
    if e.get("non_private_cells"):
      lines.append(f"* NOT private: this panel includes non-private cell(s) "
                   f"{e['non_private_cells']} (trained without noise); no epsilon covers "
                   "releasing it, and the numbers below are the private cells' only.")
    priv = e.get("privacy")
    if priv:
      lines.append(
          f"* privacy at delta={priv['delta']:g}: one run epsilon "
          f"{fmt(priv['single_run']['epsilon'])}; "
          f"all {priv['runs']} cells released (naive composition) epsilon "
          f"{fmt(priv['naive_composition']['epsilon'])}.")
      for r in priv["random_search"]:
        lines.append(f"* random search, best of K ~ {r['distribution']} (E[K] = "
                     f"{r['mean_trials']:.3g}) released: epsilon {fmt(r['epsilon'])}.")
      reach = priv.get("random_search_near_best")
      if reach:
        for r in reach["results"]:
          lines.append(f"* random search reaching a near-best cell w.p. {reach['probability']:g} "
                       f"(near-best fraction {reach['near_best_fraction']:.2f}): "
                       f"{r['distribution']}, E[K] = {r['mean_trials']:.3g}: epsilon "
                       f"{fmt(r['epsilon'])}.")
      for note in priv["notes"]:
        lines.append(f"* note: {note}")
    lines.append("")
  lines += whole_sweep_lines(report.get("whole_sweep"))
  lines += not_covered_lines(report.get("not_covered") or {}, report["finished"])
  if report.get("heatmaps"):
    lines.append("Heatmaps: " + ", ".join(report["heatmaps"]))
  if report.get("curves", {}).get("path"):
    lines.append(f"Curves: {report['curves']['path']} ({', '.join(report['curves']['cells'])})")
  lines += ["", "Assumptions:"] + [f"* {a}" for a in report["assumptions"]]
  return lines


def not_covered_lines(not_covered: dict, finished: int) -> list:
  """One line per distinct ``not_covered`` list, naming its cells, or "every finished cell"
  when all ``finished`` cells share one list.

  >>> not_covered_lines({"a": ["x"], "b": ["x"]}, 2)
  ["Not covered by every finished cell's epsilon: x"]
  >>> not_covered_lines({"a": ["x"], "b": ["x"]}, 3)
  ["Not covered by cells a, b's epsilon: x"]
  >>> not_covered_lines({"a": ["x"], "b": ["y"], "c": ["x"]}, 3)
  ["Not covered by cells a, c's epsilon: x", "Not covered by cell b's epsilon: y"]
  """
  groups: dict = {}
  for cell, items in not_covered.items():
    groups.setdefault(tuple(items), []).append(cell)
  if len(groups) == 1 and len(not_covered) == finished > 1:
    return ["Not covered by every finished cell's epsilon: " + " | ".join(next(iter(groups)))]
  return [f"Not covered by cell{'s' if len(cells) > 1 else ''} {', '.join(cells)}'s epsilon: "
          + " | ".join(items) for items, cells in groups.items()]


def whole_sweep_lines(whole: Optional[dict]) -> list:
  """The summary line(s) of :func:`whole_sweep_privacy`'s result."""
  if not whole:
    return []
  if whole.get("private", True):
    return [f"Whole sweep: {whole['runs']} runs released, naive composition epsilon "
            f"{fmt(whole['naive_composition']['epsilon'])}."]
  n = whole["non_private_runs"]
  lines = [f"Whole sweep: NOT PRIVATE (epsilon = infinity): {n} of the {whole['runs']} "
           f"released runs ({', '.join(whole['non_private_cells'])}) trained WITHOUT privacy "
           "on the same data, so no epsilon covers the sweep's results, figures or models."]
  own = whole.get("private_runs_only")
  if own:
    lines.append(f"  (The {own['runs']} private runs alone: naive composition epsilon "
                 f"{fmt(own['naive_composition']['epsilon'])}, which holds only if nothing "
                 "of the non-private runs, not even their accuracy, is released.)")
  return lines


def _write_report(opts: SweepOptions, report: dict) -> None:
  with open(os.path.join(opts.sweep_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
  with open(os.path.join(opts.sweep_dir, "report.md"), "w") as f:
    f.write("\n".join(report_lines(report)) + "\n")



__all__ = ["assumptions", "panel_privacy", "report_lines", "summarize", "whole_sweep_lines",
           "whole_sweep_privacy"]
