"""Dry run: the cells and their planned privacy, without training.

The planned privacy of a cell depends on how its base launcher reads its
arguments, which only the launcher knows; the caller passes that knowledge
as two functions (the command line, :mod:`tf_dpnsgd.launch.sweep`, parses the
cell's flags with the launcher's own flag definitions):

* ``configure(cell) -> (config, dataset_size)``: the run's configuration (an
  object with the fields of :class:`tf_dpnsgd.launch.common.ExperimentConfig`)
  and its training-set size;
* ``make_plan(config, dataset_size) -> PrivacyPlan``: the run's
  :class:`~tf_dpnsgd.plan.PrivacyPlan`, as the launcher would build it.

Both raise :class:`~tf_dpnsgd.sweeps.SweepError` for a cell that cannot run
(its message is prefixed with the cell's name here).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from tf_dpnsgd import tuning
from tf_dpnsgd.sweeps.figures import arrange_panels
from tf_dpnsgd.sweeps.grid import Cell, SweepError, SweepOptions, echo
from tf_dpnsgd.sweeps.report import panel_privacy
from tf_dpnsgd.sweeps.results import fmt


def plan_cells(opts: SweepOptions, cells: Sequence[Cell], configure: Callable,
               make_plan: Callable) -> list:
  """Each cell's planned privacy: ``[{"cell", axes..., "dataset_size", "optimizer",
  "learning_rate", "epsilon", ...}]`` (``"privacy"``: a :class:`tuning.RunPrivacy`
  for the private cells; ``"private": False, "epsilon": None`` for the others).

  Cells that share the privacy settings share one plan (one calibration).
  """
  plans, out = {}, []
  for cell in cells:
    try:
      cfg, n = configure(cell)
    except SweepError as e:
      raise SweepError(f"Cell {cell.name}: {e}") from None
    row = {"cell": cell.name, **dict(cell.assignments), "dataset_size": n,
           "optimizer": cfg.optimizer, "learning_rate": cfg.learning_rate}
    if not cfg.private:
      out.append({**row, "private": False, "epsilon": None})
      continue
    # Everything the plan depends on (the BLT's strategy, and so its sigma, on the momentum).
    key = (n, cfg.batch_size, cfg.sampling, cfg.delta, cfg.epochs, cfg.noise_multiplier,
           cfg.target_epsilon, cfg.accountant, getattr(cfg, "bound", None),
           getattr(cfg, "conversion", None), getattr(cfg, "noise", None),
           getattr(cfg, "bands", None), getattr(cfg, "blt_buffers", None),
           tuple(getattr(cfg, "releases", ())),
           (cfg.optimizer, cfg.momentum) if getattr(cfg, "noise", None) in ("blt", "auto")
           else None)
    if key not in plans:
      try:
        plans[key] = make_plan(cfg, n)
      except SweepError as e:
        raise SweepError(f"Cell {cell.name}: {e}") from None
    plan = plans[key]
    steps = min(plan.num_steps, cfg.max_steps or plan.num_steps)
    sigma = plan.training_noise_multiplier
    row.update({"batch_size": cfg.batch_size, "steps": steps, "noise_multiplier": sigma,
                "epsilon": plan.epsilon(steps), "delta": cfg.delta})
    row["privacy"] = tuning.RunPrivacy.from_report(
        {"dataset_size": n, "batch_size": cfg.batch_size, "sampling": plan.sampling,
         "bound": plan.bound, "conversion": plan.conversion, "noise_multiplier": sigma,
         "steps": steps, "bands": plan.bands, "blt": plan.blt, "releases": plan.releases})
    out.append(row)
  return out


def dry_run(opts: SweepOptions, cells: Sequence[Cell], configure: Callable, make_plan: Callable,
            print_fn=echo) -> dict:
  """Prints each cell's planned epsilon and each panel's tuning privacy; writes
  ``<sweep_dir>/plan.json`` when ``opts.sweep_dir`` is set; returns what it wrote."""
  planned = plan_cells(opts, cells, configure, make_plan)
  width = max(len(r["cell"]) for r in planned)
  print_fn(f"{len(cells)} cells of {opts.base} (dry run: nothing is trained)")
  print_fn(f"{'cell':<{width}}  {'N':>7} {'sigma':>8} {'steps':>7} {'epsilon':>8}")
  for r in planned:
    eps = fmt(r["epsilon"], ".4f") if r.get("private", True) else "non-private"
    print_fn(f"{r['cell']:<{width}}  {r['dataset_size']:>7} "
             f"{fmt(r.get('noise_multiplier'), '.4f'):>8} {str(r.get('steps', '-')):>7} "
             f"{eps:>8}")
  by_name = {r["cell"]: r for r in planned}
  cache, panels_out = {}, []
  for p in arrange_panels(opts, cells):
    runs = [{"delta": by_name[c.name]["delta"], "privacy": by_name[c.name]["privacy"]}
            for c in p.members() if "privacy" in by_name[c.name]]
    if not runs:
      continue
    priv = panel_privacy(opts, runs, None, cache)
    panels_out.append({"figure": p.figure, "panel": p.label, "privacy": priv})
    title = p.figure + (f" | {p.label}" if p.label else "")
    line = (f"{title}: {priv['runs']} cells; one run epsilon "
            f"{fmt(priv['single_run']['epsilon'])}; all released (naive composition) "
            f"{fmt(priv['naive_composition']['epsilon'])}")
    for r in priv["random_search"]:
      line += f"; random search {r['distribution']}: {fmt(r['epsilon'])}"
    print_fn(line)
  non_private = [r["cell"] for r in planned if not r.get("private", True)]
  if non_private:
    print_fn(f"The sweep includes non-private cells {non_private}: it is NOT private as a "
             "whole (epsilon = infinity); the epsilons above cover the private cells only if "
             "nothing of the non-private ones is released.")
  result = {"base": opts.base, "private": not non_private,
            "cells": [{k: v for k, v in r.items() if k != "privacy"} for r in planned],
            "panels": panels_out}
  if opts.sweep_dir:
    os.makedirs(opts.sweep_dir, exist_ok=True)
    with open(os.path.join(opts.sweep_dir, "plan.json"), "w") as f:
      json.dump(result, f, indent=1, default=str)
  return result


__all__ = ["dry_run", "plan_cells"]
