"""Panels and figures of a sweep: heatmaps per epsilon, training curves.

:func:`arrange_panels` groups the cells into figures (one per combination of
the axes that are not plotted) and panels (one per value of the panel axis,
``target_epsilon`` by default); :func:`draw_heatmaps` writes one
``heatmap_<figure>.png`` per figure (x: ``regularizer`` or ``l2_norm_clip``,
y: ``learning_rate`` or ``effective_lr``) and :func:`draw_curves` the
``curves.png`` of the chosen cells.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Optional, Sequence

from tf_dpnsgd import plots
from tf_dpnsgd.sweeps.grid import PANEL_AXIS, Cell, SweepError, SweepOptions
from tf_dpnsgd.sweeps.results import metric_value, read_json


@dataclasses.dataclass
class Panel:
  """The cells of one heatmap panel, arranged as ``cells[y][x]`` (None where absent)."""

  figure: str
  label: str
  x_axis: Optional[str]
  y_axis: Optional[str]
  x_values: list
  y_values: list
  cells: list

  def members(self) -> list:
    return [c for row in self.cells for c in row if c is not None]


def _first_present(candidates, cell):
  return next((a for a in candidates if cell.get(a) is not None), None)


def arrange_panels(opts: SweepOptions, cells: Sequence[Cell]) -> list:
  """Groups cells into figures (one per combination of the non-plotted axes) and panels
  (one per value of ``panel_axis``); x and y are the first candidate axis each cell has."""
  figures = {}
  for cell in cells:
    x = _first_present(opts.x_axis, cell)
    y = _first_present(opts.y_axis, cell)
    p = opts.panel_axis if cell.get(opts.panel_axis) is not None else None
    others = tuple((k, v) for k, v in cell.assignments if k not in (x, y, p))
    figures.setdefault((x, y, p, others), []).append(cell)
  panels = []
  for (x, y, p, others), members in figures.items():
    figure = ", ".join(f"{k}={v}" for k, v in others) or "all cells"
    by_panel = {}
    for c in members:
      by_panel.setdefault(c.get(p) if p else None, []).append(c)
    for pv, pcells in by_panel.items():
      xs = list(dict.fromkeys(c.get(x) for c in pcells)) if x else [None]
      ys = list(dict.fromkeys(c.get(y) for c in pcells)) if y else [None]
      grid = [[None] * len(xs) for _ in ys]
      for c in pcells:
        grid[ys.index(c.get(y) if y else None)][xs.index(c.get(x) if x else None)] = c
      label = f"epsilon = {pv}" if p == PANEL_AXIS else (f"{p} = {pv}" if p else "")
      panels.append(Panel(figure, label, x, y, xs, ys, grid))
  return panels


def _slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "all"


def _axis_label(name: Optional[str]) -> str:
  return {"regularizer": "regularizer r", "l2_norm_clip": "clip c",
          "target_unclipped_quantile": "target unclipped quantile",
          "effective_lr": "learning rate x c", "learning_rate": "learning rate"}.get(
              name, name or "")


def _epsilon_label(rows) -> str:
  """``"epsilon = 2.00"`` when the finished cells share one epsilon (to 0.01), else ``""``;
  ``"non-private"`` when none is private, ``"NOT private (...)"`` when some are not."""
  finished = [r for r in rows if r.get("status") == "finished"]
  if finished and not any(r.get("private", True) for r in finished):
    return "non-private"
  if any(r.get("private", True) is False for r in finished):
    return "NOT private (includes non-private cells)"
  values = {round(float(r["epsilon"]), 2) for r in finished if r.get("epsilon") is not None}
  return f"epsilon = {values.pop():.2f}" if len(values) == 1 else ""


NOT_PRIVATE_SUFFIX = " [sweep NOT private as a whole: it includes non-private runs]"


def draw_heatmaps(opts: SweepOptions, panels: Sequence[Panel], rows_by_name: dict) -> dict:
  """One PNG per figure, one panel per epsilon; returns ``{path: annotations}``.

  When any finished cell of the sweep is non-private, every figure's title ends
  with :data:`NOT_PRIVATE_SUFFIX` (the figures are released together)."""
  out = {}
  mixed = any(r.get("status") == "finished" and r.get("private", True) is False
              for r in rows_by_name.values())
  by_figure = {}
  for p in panels:
    by_figure.setdefault((p.figure, p.x_axis, p.y_axis), []).append(p)
  for (figure, x, y), fps in by_figure.items():
    drawn = [plots.HeatmapPanel(
        p.label or _epsilon_label([rows_by_name[c.name] for c in p.members()]),
        [[metric_value(rows_by_name[c.name], opts.metric) if c else math.nan for c in row]
         for row in p.cells],
        ["-" if v is None else v for v in p.x_values],
        ["-" if v is None else v for v in p.y_values])
        for p in fps]
    slug = _slug(f"{y}_x_{x}" + ("" if figure == "all cells" else "__" + figure))
    path = os.path.join(opts.sweep_dir, f"heatmap_{slug}.png")
    label = figure
    if figure == "all cells":  # name the optimizer when the grid does not
      optimizers = {rows_by_name[c.name].get("optimizer") for p in fps for c in p.members()}
      optimizers.discard(None)
      label = f"optimizer={optimizers.pop()}" if len(optimizers) == 1 else ""
    out[path] = plots.heatmap(path, drawn, _axis_label(x), _axis_label(y),
                              title=f"{label + ': ' if label else ''}{opts.metric} "
                                    f"{opts.eval_split} accuracy (%)" + (NOT_PRIVATE_SUFFIX if mixed else ""))
  return out


def chosen_curve_cells(opts: SweepOptions, panels, cells, rows_by_name) -> list:
  if not opts.curves or list(opts.curves) == ["none"]:
    return []
  names = [c.name for c in cells]
  chosen = []
  for item in opts.curves:
    if item == "best":
      for p in panels:
        finished = [c for c in p.members() if math.isfinite(
            metric_value(rows_by_name[c.name], opts.metric))]
        if finished:
          best = max(finished, key=lambda c: metric_value(rows_by_name[c.name], opts.metric))
          chosen.append(best.name)
    elif item in names:
      chosen.append(item)
    else:
      raise SweepError(f"--curves: no cell named {item!r}; cells: {names}.")
  return list(dict.fromkeys(chosen))


def draw_curves(opts: SweepOptions, names: Sequence[str]) -> Optional[str]:
  """``curves.png``: the test curves of the cells ``names`` (and their unprivatized
  training curves only with ``opts.plot_training_metrics``); ``None`` if no history."""
  histories = {}
  for name in names:
    path = os.path.join(opts.sweep_dir, "cells", name, "history.json")
    if os.path.exists(path):
      histories[name] = read_json(path)
  if not histories:
    return None
  path = os.path.join(opts.sweep_dir, "curves.png")
  if opts.plot_training_metrics:
    title = f"train (UNPRIVATIZED training-set metrics) and {opts.eval_split} curves"
  else:
    title = f"{opts.eval_split} loss and accuracy per epoch"
  plots.training_curves(path, histories, title=title,
                        include_training=opts.plot_training_metrics)
  return path



__all__ = ["Panel", "arrange_panels", "chosen_curve_cells", "draw_curves", "draw_heatmaps"]
