"""Figures of an audit: canary score distributions, and claimed vs. audited epsilon.

Drawn on a :class:`matplotlib.figure.Figure` with the Agg canvas (no
``pyplot`` state, no display). Each PNG carries what it shows as JSON in a
text chunk (key :data:`tf_dpnsgd.plots.ANNOTATIONS_KEY`, read back with
:func:`tf_dpnsgd.plots.read_annotations`), so tests and readers can check a
figure without OCR.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from tf_dpnsgd import plots as plots_lib


def epsilon_text(value: Optional[float]) -> str:
  """``"4.63"``, or ``"inf"`` for no claim."""
  if value is None or (isinstance(value, float) and math.isinf(value)):
    return "inf"
  return f"{value:.3g}"


def _save(fig, path, title, meta):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, metadata={"Title": title,
                                       plots_lib.ANNOTATIONS_KEY: json.dumps(meta)})


def score_histogram(path: str, scores, included, epsilon_claimed: Optional[float],
                    epsilon_lower_bound: float, confidence: float = 0.95,
                    label: str = "", score_name: str = "score", bins: int = 40) -> dict:
  """Histograms of the scores of included ("in") and excluded ("out") canaries.

  The title holds both epsilons: ``claimed eps = ..., audit lower bound = ... (95%)``.

  Returns:
    The annotations written into the PNG (title, counts, means).
  """
  _, Figure, FigureCanvasAgg = plots_lib._matplotlib()
  scores = np.asarray(scores, np.float64)
  included = np.asarray(included, bool)
  title = (f"{label + ': ' if label else ''}claimed \u03b5 = {epsilon_text(epsilon_claimed)}, "
           f"audit lower bound = {epsilon_lower_bound:.3g} ({confidence:.0%})")
  fig = Figure(figsize=(6.4, 4.0), constrained_layout=True)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  lo, hi = float(scores.min()), float(scores.max())
  if hi <= lo:
    lo, hi = lo - 0.5, hi + 0.5
  edges = np.linspace(lo, hi, bins + 1)
  ax.hist(scores[~included], bins=edges, alpha=0.6, label=f"out ({int((~included).sum())})",
          color="tab:blue")
  ax.hist(scores[included], bins=edges, alpha=0.6, label=f"in ({int(included.sum())})",
          color="tab:red")
  ax.set_xlabel(score_name)
  ax.set_ylabel("canaries")
  ax.set_title(title, fontsize=10)
  ax.legend()
  meta = {"title": title, "epsilon_claimed": epsilon_text(epsilon_claimed),
          "epsilon_lower_bound": float(epsilon_lower_bound), "num_in": int(included.sum()),
          "num_out": int((~included).sum()),
          "mean_in": float(scores[included].mean()) if included.any() else None,
          "mean_out": float(scores[~included].mean()) if (~included).any() else None}
  _save(fig, path, title, meta)
  return meta


def claimed_vs_lower_bound(path: str, rows: Sequence[dict], title: str = "",
                           ceiling: Optional[float] = None,
                           ceiling_fdp: Optional[float] = None) -> dict:
  """One panel per method: the audit's lower bound against the claimed epsilon.

  The x axis (claimed epsilon) is logarithmic; runs without noise sit at twice the
  largest claimed epsilon, marked "no noise". The dashed line is "lower bound =
  claimed" (a point above it refutes the claim); the dotted line, if ``ceiling``
  is given, is the largest bound the audit can give at all (every canary guessed
  correctly, :func:`tf_dpnsgd.audit.one_run_max_epsilon`).

  Args:
    path: the PNG.
    rows: dicts with ``method``, ``canary_kind`` (``"gradient"`` or ``"input"``),
      ``epsilon_claimed`` (None or inf: no noise) and ``epsilon_lower_bound``
      (Steinke et al.); rows with ``epsilon_lower_bound_fdp`` also get the f-DP bound
      (hollow markers, dashed).
    title: the figure title.
    ceiling, ceiling_fdp: the largest bound of each method for the number of canaries used.

  Returns:
    The annotations (the plotted points per panel).
  """
  _, Figure, FigureCanvasAgg = plots_lib._matplotlib()
  methods = sorted({r["method"] for r in rows})

  def claimed(r):
    value = r["epsilon_claimed"]
    return None if value is None or math.isinf(float(value)) else float(value)

  finite = [claimed(r) for r in rows if claimed(r) is not None]
  top = max(finite) if finite else 1.0
  bottom = min(finite) if finite else 1.0
  inf_x = 2.0 * top
  top_y = max([float(r["epsilon_lower_bound"]) for r in rows]
              + [float(r["epsilon_lower_bound_fdp"]) for r in rows
                 if r.get("epsilon_lower_bound_fdp") is not None]
              + [ceiling or 0.0, ceiling_fdp or 0.0, 1.0])
  fig = Figure(figsize=(5.0 * len(methods), 4.2), constrained_layout=True)
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(methods), squeeze=False)[0]
  markers = {"gradient": ("o", "tab:red", "white-box (Dirac gradient canaries)"),
             "input": ("s", "tab:blue", "black-box (mislabeled input canaries)")}
  meta = {"panels": [], "ceiling": ceiling, "ceiling_fdp": ceiling_fdp}
  for ax, method in zip(axes, methods):
    panel = []
    ax.set_xscale("log", base=2)
    for kind, (marker, color, label) in markers.items():
      pts = [r for r in rows if r["method"] == method and r["canary_kind"] == kind]
      if not pts:
        continue
      xs = [inf_x if claimed(r) is None else claimed(r) for r in pts]
      ys = [float(r["epsilon_lower_bound"]) for r in pts]
      order = np.argsort(xs)
      ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], marker=marker, color=color,
              label=label)
      for x, y in zip(xs, ys):
        if y <= 0:
          continue   # a zero bound sits on the axis; its label would only clutter it
        ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 5),
                    fontsize=8, color=color)
      panel += [{"canary_kind": kind, "x": x, "epsilon_claimed": epsilon_text(claimed(r)),
                 "y": y} for x, y, r in zip(xs, ys, pts)]
      with_fdp = [(x, float(r["epsilon_lower_bound_fdp"])) for x, r in zip(xs, pts)
                  if r.get("epsilon_lower_bound_fdp") is not None]
      if with_fdp:
        fx, fy = (np.asarray(v) for v in zip(*sorted(with_fdp)))
        ax.plot(fx, fy, marker=marker, color=color, ls="--", markerfacecolor="none",
                label=label.split(" (")[0] + ", f-DP bound")
        panel += [{"canary_kind": kind, "x": float(x), "y_fdp": float(y)}
                  for x, y in zip(fx, fy)]
    grid = np.geomspace(bottom / 1.5, inf_x * 1.3, 50)
    ax.plot(grid, grid, ls="--", color="gray", label="lower bound = claimed")
    if ceiling is not None:
      ax.axhline(ceiling, ls=":", color="black", lw=1,
                 label=f"largest possible bound ({ceiling:.2f})")
    if ceiling_fdp is not None:
      ax.axhline(ceiling_fdp, ls="-.", color="black", lw=1,
                 label=f"largest possible f-DP bound ({ceiling_fdp:.2f})")
    ax.axvline(inf_x, color="gray", lw=0.5)
    ax.text(inf_x, 0.98, "no noise ", rotation=90, va="top", ha="right", fontsize=8,
            color="gray", transform=ax.get_xaxis_transform())
    ax.set_xlim(bottom / 1.5, inf_x * 1.3)
    ax.set_ylim(0, top_y * 1.3)
    ticks = sorted({float(f"{t:.2g}") for t in finite})
    ax.set_xticks(ticks + [inf_x], labels=[f"{t:g}" for t in ticks] + ["\u221e"])
    ax.minorticks_off()
    ax.set_xlabel("claimed \u03b5 (accountant)")
    ax.set_ylabel("audited \u03b5 lower bounds (95%)")
    ax.set_title(method)
    ax.legend(fontsize=8, loc="upper left")
    meta["panels"].append({"method": method, "points": panel})
  if title:
    fig.suptitle(title)
  _save(fig, path, title, meta)
  return meta


__all__ = ["claimed_vs_lower_bound", "epsilon_text", "score_histogram"]
