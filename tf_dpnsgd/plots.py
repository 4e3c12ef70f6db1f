"""Figures of a sweep: annotated accuracy heatmaps and training curves (matplotlib, Agg).

Figures are drawn on :class:`matplotlib.figure.Figure` with the Agg canvas,
never through ``pyplot``: no global backend state, no display needed.

Heatmaps follow the paper's figures: one panel per privacy level, the
learning rate on the y axis, the regularizer ``r`` (DP-NSGD) or the clip
``c`` (DP-SGD) on the x axis, and each cell annotated with its accuracy in
percent. The annotations are also written into the PNG as a text chunk
(key :data:`ANNOTATIONS_KEY`, JSON), so a test or a reader can check
what a figure shows without OCR.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Sequence

import numpy as np

ANNOTATIONS_KEY = "tf_dpnsgd_annotations"


def _matplotlib():
  try:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as e:
    raise ImportError("Plots need matplotlib: `pip install matplotlib` (or the package's "
                      "`experiments` extra).") from e
  return matplotlib, Figure, FigureCanvasAgg


@dataclasses.dataclass(frozen=True)
class HeatmapPanel:
  """One panel: ``values[i, j]`` is the accuracy (in [0, 1], NaN if missing) at
  ``y_ticks[i]`` (row, e.g. learning rate) and ``x_ticks[j]`` (column)."""

  title: str
  values: np.ndarray
  x_ticks: tuple
  y_ticks: tuple

  def __post_init__(self):
    v = np.asarray(self.values, dtype=np.float64)
    if v.ndim != 2 or v.shape != (len(self.y_ticks), len(self.x_ticks)):
      raise ValueError(f"Panel {self.title!r}: values of shape {v.shape} do not match "
                       f"{len(self.y_ticks)} y ticks x {len(self.x_ticks)} x ticks.")
    object.__setattr__(self, "values", v)
    object.__setattr__(self, "x_ticks", tuple(str(t) for t in self.x_ticks))
    object.__setattr__(self, "y_ticks", tuple(str(t) for t in self.y_ticks))


def cell_text(value: float, digits: int = 1) -> str:
  """The annotation of one cell: accuracy in percent (``"n/a"`` if missing).

  >>> cell_text(0.9234), cell_text(float("nan"))
  ('92.3', 'n/a')
  """
  return "n/a" if not math.isfinite(value) else f"{100.0 * value:.{digits}f}"


def heatmap(path: str, panels: Sequence[HeatmapPanel], x_label: str, y_label: str,
            title: Optional[str] = None, cmap: str = "viridis", digits: int = 1) -> list:
  """Writes the panels side by side as one PNG, each cell annotated; returns the annotations.

  All panels share one colour scale (the range of all finite values), so
  panels at different epsilons are comparable.

  Returns:
    ``[[[text, ...], ...], ...]``: per panel, per row, per column: the
    annotation strings, as drawn (and as stored in the PNG's
    :data:`ANNOTATIONS_KEY` text chunk with the panel titles and ticks).
  """
  if not panels:
    raise ValueError("No panels to draw.")
  matplotlib, Figure, FigureCanvasAgg = _matplotlib()
  finite = np.concatenate([p.values[np.isfinite(p.values)] for p in panels])
  vmin, vmax = (100.0 * finite.min(), 100.0 * finite.max()) if finite.size else (0.0, 100.0)
  if vmax - vmin < 1e-6:
    vmin, vmax = vmin - 0.5, vmax + 0.5
  colormap = matplotlib.colormaps[cmap].with_extremes(bad="lightgray")

  rows, cols = panels[0].values.shape
  width = 1.6 + len(panels) * (0.85 * max(cols, 2) + 1.3)
  height = 1.9 + 0.5 * max(rows, 2)
  fig = Figure(figsize=(width, height), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(panels), squeeze=False)[0]
  annotations, image = [], None
  for ax, panel in zip(axes, panels):
    pct = 100.0 * panel.values
    image = ax.imshow(np.ma.masked_invalid(pct), cmap=colormap, vmin=vmin, vmax=vmax,
                      aspect="auto")
    ax.set_xticks(range(len(panel.x_ticks)), labels=panel.x_ticks)
    ax.set_yticks(range(len(panel.y_ticks)), labels=panel.y_ticks)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(panel.title)
    texts = []
    for i in range(pct.shape[0]):
      row = []
      for j in range(pct.shape[1]):
        text = cell_text(panel.values[i, j], digits)
        light = math.isfinite(pct[i, j]) and (pct[i, j] - vmin) / (vmax - vmin) < 0.55
        ax.text(j, i, text, ha="center", va="center", fontsize=9,
                color="white" if light else "black")
        row.append(text)
      texts.append(row)
    annotations.append(texts)
  fig.colorbar(image, ax=list(axes), label="accuracy (%)", shrink=0.9)
  if title:
    fig.suptitle(title)
  meta = {"panels": [{"title": p.title, "x_ticks": list(p.x_ticks), "y_ticks": list(p.y_ticks),
                      "annotations": a} for p, a in zip(panels, annotations)],
          "x_label": x_label, "y_label": y_label}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, metadata={"Title": title or "", ANNOTATIONS_KEY: json.dumps(meta)})
  return annotations


def read_annotations(path: str) -> dict:
  """The annotations a :func:`heatmap` PNG carries (needs Pillow, a matplotlib dependency)."""
  from PIL import Image
  with Image.open(path) as image:
    text = image.text.get(ANNOTATIONS_KEY)
  if text is None:
    raise ValueError(f"{path} has no {ANNOTATIONS_KEY!r} text chunk (not written by "
                     "plots.heatmap).")
  return json.loads(text)


def training_curves(path: str, histories: dict, title: Optional[str] = None,
                    include_training: bool = False) -> list:
  """Loss and accuracy per epoch of several runs: test (dashed), and train (solid) if asked.

  The training loss and accuracy in a history are EXACT training-set metrics,
  not privatized: a figure of them publishes information about the training
  data that no epsilon covers (:mod:`tf_dpnsgd.coverage`). By default only the
  ``val_*`` (validation/test) curves are drawn.

  Args:
    path: PNG to write.
    histories: ``{label: history}`` with ``history`` as in a run's
      ``history.json`` (``epoch``, ``loss``, ``accuracy``, ``val_loss``,
      ``val_accuracy``; missing keys are skipped).
    title: figure title.
    include_training: also draw the (unprivatized) training curves.

  Returns:
    ``[[label, key], ...]``: the curves drawn (also stored in the PNG's
    :data:`ANNOTATIONS_KEY` text chunk as ``{"curves": ...}``).
  """
  if not histories:
    raise ValueError("No histories to plot.")
  _, Figure, FigureCanvasAgg = _matplotlib()
  fig = Figure(figsize=(11, 4.2), layout="constrained")
  FigureCanvasAgg(fig)
  ax_loss, ax_acc = fig.subplots(1, 2)
  splits = (("", "-", " (train, unprivatized)"),) if include_training else ()
  splits += (("val_", "--", " (test)"),)
  drawn = []
  for k, (label, h) in enumerate(histories.items()):
    color = f"C{k % 10}"
    for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
      for prefix, style, suffix in splits:
        values = h.get(prefix + key)
        if not values:
          continue
        epochs = h.get("epoch") or list(range(1, len(values) + 1))
        ax.plot(epochs, values, style, color=color, marker="o", markersize=3,
                label=label + suffix)
        drawn.append([label, prefix + key])
  ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
  ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
  ax_acc.legend(fontsize=7, loc="lower right")
  if title:
    fig.suptitle(title)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, metadata={"Title": title or "",
                                       ANNOTATIONS_KEY: json.dumps({"curves": drawn})})
  return drawn


__all__ = ["ANNOTATIONS_KEY", "HeatmapPanel", "cell_text", "heatmap", "read_annotations",
           "training_curves"]
