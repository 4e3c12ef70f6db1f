r"""Hyperparameter sweeps of a launcher: heatmaps, curves, robustness, tuning-aware privacy.

  python -m tf_dpnsgd.launch.sweep --flagfile=configs/sweeps/mnist_dpnsgd_small.flags \
      --sweep_dir=runs/sweeps/mnist_dpnsgd
  python -m tf_dpnsgd.launch.sweep --base=quickstart --fixed=epochs=5 \
      --grid=learning_rate=0.5,1,2 --grid=regularizer=0.001,0.01,0.1 \
      --sweep_dir=runs/sweeps/digits --dry_run

Each cell of the grid is one run of the base launcher (``python -m <base>
--flagfile=<base_flagfile> --<fixed> --<cell flags> --model_dir=<sweep_dir>/cells/<cell>``),
one after the other. A cell is finished when its ``privacy_report.json``
exists; rerunning the same command skips finished cells and resumes the
others (the launchers resume from their checkpoints). A cell whose recorded
flags differ from the current ones stops the sweep (use a new --sweep_dir).

Grid axes (--grid, repeatable):

* ``AXIS=V1,V2,...``: ``AXIS`` is a flag of the base launcher; values are
  passed verbatim.
* ``AXIS=V1,...@OTHER=VALUE``: a conditional axis, used only in cells whose
  axis ``OTHER`` has ``VALUE`` (e.g. ``regularizer=...@optimizer=dpnsgd`` and
  ``l2_norm_clip=...@optimizer=dpsgd`` in one sweep).
* ``effective_lr``: a virtual axis for DP-SGD, ``learning_rate =
  effective_lr / l2_norm_clip``, so that ``lr * c`` (the step of a clipped
  gradient) covers the same values for every clip.

Written to --sweep_dir: ``sweep.json`` (the definition), ``cells/<cell>/``
(the run, ``cell.json``, ``log.txt``), ``results.csv`` / ``results.json``
(final and best accuracy, epsilon, sigma, steps per cell), one
``heatmap_<figure>.png`` per figure (x: ``regularizer`` or ``l2_norm_clip``,
y: ``learning_rate`` or ``effective_lr``, one panel per ``target_epsilon``),
``curves.png`` (loss/accuracy per epoch of the --curves cells), and
``report.json`` / ``report.md``: per panel the robustness summary and the
privacy of tuning (single run, naive composition of all cells, random search
after Papernot & Steinke 2022; see :mod:`tf_dpnsgd.tuning`).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib
import json
import math
import os
import re
import secrets
import subprocess
import sys
import time
from typing import Optional, Sequence

from absl import app
from absl import flags

SHORT_NAMES = {name: f"tf_dpnsgd.launch.{name}" for name in ("quickstart", "mnist", "cifar10",
                                                              "sst2")}
X_CANDIDATES = ("regularizer", "l2_norm_clip")
Y_CANDIDATES = ("learning_rate", "effective_lr")
PANEL_AXIS = "target_epsilon"
VIRTUAL_AXES = ("effective_lr",)
RESERVED = ("model_dir", "flagfile", "export_dir")
PRIVACY_FLAGS = ("noise_multiplier", "target_epsilon")
FINISHED_MARKER = "privacy_report.json"
# --dry_run asks the base launcher for its training-set size through its
# `planned_dataset_size(flag_values)` function (every launcher here has one).

FLAGS = flags.FLAGS
flags.DEFINE_string("base", None, "Base launcher: quickstart, mnist, cifar10, sst2 or a module.")
flags.DEFINE_string("base_flagfile", None, "Flag file of the base launcher (its --flagfile).")
flags.DEFINE_multi_string("grid", [], "Grid axis AXIS=V1,V2,...[@OTHER=VALUE] (repeatable).")
flags.DEFINE_multi_string("fixed", [], "NAME=VALUE: a base-launcher flag set in every cell.")
flags.DEFINE_string("sweep_dir", None, "Output folder (cells, results, figures, report).")
flags.DEFINE_boolean("dry_run", False, "List the cells and their planned epsilon; run nothing.")
flags.DEFINE_list("curves", ["best"], "Cells whose training curves are plotted: 'best' (the "
                  "best cell of each panel), 'none', or cell names.")
flags.DEFINE_list("x_axis", list(X_CANDIDATES), "Heatmap x axis: first of these in a cell.")
flags.DEFINE_list("y_axis", list(Y_CANDIDATES), "Heatmap y axis: first of these in a cell.")
flags.DEFINE_string("panel_axis", PANEL_AXIS, "One heatmap panel per value of this axis.")
flags.DEFINE_enum("metric", "final", ("final", "best"),
                  "final: test accuracy at the end; best: best test accuracy over epochs.")
flags.DEFINE_float("near_best_points", 2.0, "Near-best: within this many accuracy points.")
flags.DEFINE_list("tuning_etas", ["0", "1"], "Shapes eta of truncated negative binomial "
                  "random search (0: logarithmic, 1: geometric).")
flags.DEFINE_boolean("tuning_poisson", True, "Also report Poisson random search.")
flags.DEFINE_float("tuning_mean", None, "E[K] of random search (default: cells per panel).")
flags.DEFINE_float("success_probability", 0.9, "Also report the random search that reaches a "
                   "near-best cell with this probability.")
flags.DEFINE_enum("cell_seeds", "fresh", ("fresh", "base"),
                  "The launchers' --seed (initialisation and data order only: every run "
                  "draws its DP noise and sampler seeds from the OS, so cells never share "
                  "noise). fresh: a random --seed per cell run; base: the base launcher's "
                  "(reproducible initialisation).")
flags.DEFINE_integer("cell_timeout", None, "Seconds before a cell run is killed (None: no limit).")
flags.DEFINE_integer("dry_run_dataset_size", None,
                     "Training-set size for --dry_run when the launcher cannot tell.")
flags.DEFINE_boolean("keep_going", True, "Continue with the next cell after a failed one.")


def _print(*args):
  print(*args, flush=True)


class SweepError(ValueError):
  """A sweep definition or state that cannot be run as asked."""


# --------------------------------------------------------------------------
# The grid.
# --------------------------------------------------------------------------
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Axis:
  """One grid axis: a flag name, its values (strings, passed verbatim) and an optional
  ``(axis, value)`` condition."""

  name: str
  values: tuple
  condition: Optional[tuple] = None

  @classmethod
  def parse(cls, text: str) -> "Axis":
    """``"learning_rate=0.1,0.2"`` or ``"l2_norm_clip=0.1,1@optimizer=dpsgd"``.

    >>> Axis.parse("l2_norm_clip=0.1,1@optimizer=dpsgd")
    Axis(name='l2_norm_clip', values=('0.1', '1'), condition=('optimizer', 'dpsgd'))
    """
    body, _, cond = text.strip().partition("@")
    name, eq, values = body.partition("=")
    name = name.strip().lstrip("-")
    vals = tuple(v.strip() for v in values.split(",") if v.strip())
    if not eq or not _NAME.match(name) or not vals:
      raise SweepError(f"--grid={text!r}: expected AXIS=V1,V2,...[@OTHER=VALUE].")
    if len(set(vals)) != len(vals):
      raise SweepError(f"--grid={text!r}: repeated values.")
    if name in RESERVED:
      raise SweepError(f"--grid={text!r}: --{name} is set by the sweep, not a grid axis.")
    condition = None
    if cond:
      c_name, c_eq, c_value = cond.partition("=")
      if not c_eq or not _NAME.match(c_name.strip()) or not c_value.strip():
        raise SweepError(f"--grid={text!r}: the condition must read @AXIS=VALUE.")
      condition = (c_name.strip(), c_value.strip())
    return cls(name, vals, condition)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One point of the grid: ``((axis, value), ...)`` in the order of the axes."""

  assignments: tuple

  def get(self, name: str, default=None):
    return dict(self.assignments).get(name, default)

  @property
  def name(self) -> str:
    """A folder name: ``learning_rate-0.1__regularizer-0.01``."""
    text = "__".join(f"{k}-{v}" for k, v in self.assignments)
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text) or "base"

  def launcher_flags(self, fixed: dict) -> list:
    """The cell's flags for the base launcher (virtual axes resolved)."""
    out = []
    for name, value in self.assignments:
      if name == "effective_lr":
        clip = self.get("l2_norm_clip", fixed.get("l2_norm_clip"))
        if clip is None:
          raise SweepError("The effective_lr axis needs l2_norm_clip as a grid axis or a "
                           "--fixed flag (learning_rate = effective_lr / l2_norm_clip).")
        out.append(f"--learning_rate={float(value) / float(clip):.10g}")
      else:
        out.append(f"--{name}={value}")
    return out


def expand_grid(axes: Sequence[Axis]) -> list:
  """All cells: the product of the unconditional axes, each extended by the product of the
  conditional axes whose condition it meets.

  Raises:
    SweepError: an axis given twice unconditionally (or twice under one condition), a
      condition on an axis that is not an unconditional axis, or on a value it never takes.
  """
  plain = [a for a in axes if a.condition is None]
  conditional = [a for a in axes if a.condition is not None]
  names = [a.name for a in plain]
  if len(set(names)) != len(names):
    raise SweepError(f"Grid axes given twice: {sorted({n for n in names if names.count(n) > 1})}.")
  seen = set()
  for a in conditional:
    c_name, c_value = a.condition
    axis = next((p for p in plain if p.name == c_name), None)
    if axis is None:
      raise SweepError(f"Axis {a.name!r} is conditioned on {c_name!r}, which is not an "
                       f"unconditional grid axis ({names}).")
    if c_value not in axis.values:
      raise SweepError(f"Axis {a.name!r} is conditioned on {c_name}={c_value}, but {c_name} "
                       f"takes only {list(axis.values)}.")
    if a.name in names or (a.name, a.condition) in seen:
      raise SweepError(f"Axis {a.name!r} is given twice for the same cells.")
    seen.add((a.name, a.condition))

  def product(axis_list, prefix=()):
    if not axis_list:
      yield prefix
      return
    first, rest = axis_list[0], axis_list[1:]
    for v in first.values:
      yield from product(rest, prefix + ((first.name, v),))

  cells = []
  for base in product(plain):
    present = dict(base)
    extra = [a for a in conditional if present.get(a.condition[0]) == a.condition[1]]
    for full in product(extra, base):
      cells.append(Cell(full))
  names_ = [c.name for c in cells]
  if len(set(names_)) != len(names_):
    raise SweepError("Two cells map to the same folder name; use distinct values.")
  return cells


def parse_fixed(items: Sequence[str]) -> dict:
  """``["epochs=2", ...]`` -> ``{"epochs": "2"}``."""
  out = {}
  for item in items:
    name, eq, value = item.partition("=")
    name = name.strip().lstrip("-")
    if not eq or not _NAME.match(name):
      raise SweepError(f"--fixed={item!r}: expected NAME=VALUE.")
    if name in RESERVED:
      raise SweepError(f"--fixed={item!r}: --{name} is set by the sweep.")
    out[name] = value.strip()
  return out


# --------------------------------------------------------------------------
# The sweep's options (read from the flags in one place).
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepOptions:
  base: str
  sweep_dir: Optional[str]
  axes: tuple
  fixed: tuple = ()
  base_flagfile: Optional[str] = None
  dry_run: bool = False
  curves: tuple = ("best",)
  x_axis: tuple = X_CANDIDATES
  y_axis: tuple = Y_CANDIDATES
  panel_axis: Optional[str] = PANEL_AXIS
  metric: str = "final"
  near_best_points: float = 2.0
  tuning_etas: tuple = (0.0, 1.0)
  tuning_poisson: bool = True
  tuning_mean: Optional[float] = None
  success_probability: float = 0.9
  cell_seeds: str = "fresh"
  cell_timeout: Optional[int] = None
  dry_run_dataset_size: Optional[int] = None
  keep_going: bool = True

  def __post_init__(self):
    if not self.base:
      raise SweepError("--base is required (quickstart, mnist, cifar10, sst2 or a module).")
    object.__setattr__(self, "base", SHORT_NAMES.get(self.base, self.base))
    if not self.dry_run and not self.sweep_dir:
      raise SweepError("--sweep_dir is required (except with --dry_run).")
    if self.base_flagfile is not None:
      if not os.path.isfile(self.base_flagfile):
        raise SweepError(f"--base_flagfile={self.base_flagfile} does not exist (paths are "
                         f"relative to the working directory {os.getcwd()}).")
    fixed = dict(self.fixed)
    axis_names = {a.name for a in self.axes}
    both = sorted(axis_names & set(fixed))
    if both:
      raise SweepError(f"{both} given both as --fixed flags and as grid axes.")
    if "effective_lr" in axis_names and "learning_rate" in fixed:
      raise SweepError("The effective_lr axis sets --learning_rate; drop --fixed=learning_rate.")
    if self.cell_seeds == "fresh" and ("seed" in fixed or "seed" in axis_names):
      raise SweepError("--cell_seeds=fresh draws each cell's seed; to set seeds yourself "
                       "(--fixed=seed=... or a seed axis) pass --cell_seeds=base.")
    if not 0.0 < self.success_probability < 1.0:
      raise SweepError(f"--success_probability must lie in (0, 1); got {self.success_probability}.")
    if not self.near_best_points >= 0:
      raise SweepError(f"--near_best_points must be >= 0; got {self.near_best_points}.")

  @property
  def fixed_flags(self) -> list:
    return [f"--{k}={v}" for k, v in self.fixed]

  @property
  def flagfile_sha256(self) -> Optional[str]:
    if self.base_flagfile is None:
      return None
    with open(self.base_flagfile, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()

  def cell_optimizer(self, cell: Cell) -> Optional[str]:
    """The cell's --optimizer when the grid or --fixed sets it (else the launcher's)."""
    return cell.get("optimizer", dict(self.fixed).get("optimizer"))

  def cell_argv(self, cell: Cell) -> list:
    """Base-launcher arguments of a cell (no --model_dir, no seed).

    A non-private cell (``optimizer=sgd``) leaves out the ``--fixed`` privacy
    flags (``target_epsilon``, ``noise_multiplier``): they apply to the private
    cells. A grid axis that sets one for an sgd cell is an error (condition it
    on the private optimizers: ``target_epsilon=2,8@optimizer=dpnsgd``).
    """
    head = [f"--flagfile={self.base_flagfile}"] if self.base_flagfile else []
    fixed = self.fixed_flags
    if self.cell_optimizer(cell) == "sgd":
      on_cell = [n for n in PRIVACY_FLAGS if cell.get(n) is not None]
      if on_cell:
        raise SweepError(
            f"Cell {cell.name}: --optimizer=sgd trains without privacy, but the grid sets "
            f"--{on_cell[0]} for it; condition that axis on the private optimizers "
            f"(e.g. --grid={on_cell[0]}=...@optimizer=dpnsgd).")
      fixed = [f"--{k}={v}" for k, v in self.fixed if k not in PRIVACY_FLAGS]
    return head + fixed + cell.launcher_flags(dict(self.fixed))

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["axes"] = [dataclasses.asdict(a) for a in self.axes]
    d["base_flagfile_sha256"] = self.flagfile_sha256
    return d


def options_from_flags() -> SweepOptions:
  try:
    etas = tuple(float(e) for e in FLAGS.tuning_etas)
  except ValueError as e:
    raise SweepError(f"--tuning_etas must be numbers; got {FLAGS.tuning_etas}.") from e
  return SweepOptions(
      base=FLAGS.base, sweep_dir=FLAGS.sweep_dir,
      axes=tuple(Axis.parse(g) for g in FLAGS.grid),
      fixed=tuple(parse_fixed(FLAGS.fixed).items()), base_flagfile=FLAGS.base_flagfile,
      dry_run=FLAGS.dry_run, curves=tuple(FLAGS.curves), x_axis=tuple(FLAGS.x_axis),
      y_axis=tuple(FLAGS.y_axis), panel_axis=FLAGS.panel_axis or None, metric=FLAGS.metric,
      near_best_points=FLAGS.near_best_points, tuning_etas=etas,
      tuning_poisson=FLAGS.tuning_poisson, tuning_mean=FLAGS.tuning_mean,
      success_probability=FLAGS.success_probability, cell_seeds=FLAGS.cell_seeds,
      cell_timeout=FLAGS.cell_timeout, dry_run_dataset_size=FLAGS.dry_run_dataset_size,
      keep_going=FLAGS.keep_going)


# --------------------------------------------------------------------------
# Running the cells.
# --------------------------------------------------------------------------
def cell_dir(opts: SweepOptions, cell: Cell) -> str:
  return os.path.join(opts.sweep_dir, "cells", cell.name)


def is_finished(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, FINISHED_MARKER))


def _cell_record(opts: SweepOptions, cell: Cell) -> dict:
  return {"cell": cell.name, "assignments": dict(cell.assignments), "base": opts.base,
          "argv": opts.cell_argv(cell), "base_flagfile_sha256": opts.flagfile_sha256}


def check_cell_record(opts: SweepOptions, cell: Cell, directory: str) -> None:
  """Raises unless the cell folder is new or was started with the same flags."""
  path = os.path.join(directory, "cell.json")
  if not os.path.exists(path):
    if is_finished(directory):
      raise SweepError(f"{directory} holds a finished run but no cell.json: not started by "
                       "this sweep. Use a new --sweep_dir.")
    return
  with open(path) as f:
    old = json.load(f)
  new = _cell_record(opts, cell)
  keys = ("base", "argv", "base_flagfile_sha256")
  if any(old.get(k) != new[k] for k in keys):
    diff = {k: (old.get(k), new[k]) for k in keys if old.get(k) != new[k]}
    raise SweepError(f"Cell {cell.name} in {opts.sweep_dir} was started with different "
                     f"settings {diff}; its run would not match this grid. Use a new "
                     "--sweep_dir (or delete that cell's folder).")


def run_cell(opts: SweepOptions, cell: Cell, directory: str) -> dict:
  """Runs (or resumes) one cell as a subprocess; returns ``{"status", "seconds", ...}``."""
  os.makedirs(directory, exist_ok=True)
  record = _cell_record(opts, cell)
  with open(os.path.join(directory, "cell.json"), "w") as f:
    json.dump(record, f, indent=1)
  argv = [sys.executable, "-m", opts.base, *record["argv"], f"--model_dir={directory}"]
  if opts.cell_seeds == "fresh":  # initialisation only; noise and sampling seeds are the OS's
    argv.append(f"--seed={secrets.randbelow(2 ** 31 - 2) + 1}")
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  start = time.time()
  with open(os.path.join(directory, "log.txt"), "a") as log:
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(record['argv'])}\n")
    log.flush()
    try:
      proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            timeout=opts.cell_timeout, check=False)
      code = proc.returncode
    except subprocess.TimeoutExpired:
      code = None
  seconds = time.time() - start
  record.update({"seconds": round(seconds, 1), "returncode": code})
  with open(os.path.join(directory, "cell.json"), "w") as f:
    json.dump(record, f, indent=1)
  if code == 0 and is_finished(directory):
    return {"status": "finished", "seconds": seconds}
  reason = (f"timed out after {opts.cell_timeout} s" if code is None
            else f"exit code {code}" + ("" if code else f" but no {FINISHED_MARKER}"))
  return {"status": "failed", "seconds": seconds, "reason": reason,
          "log": os.path.join(directory, "log.txt")}


def run_cells(opts: SweepOptions, cells: Sequence[Cell], print_fn=_print) -> dict:
  """Runs the unfinished cells one after another; returns ``{cell name: outcome}``."""
  for cell in cells:  # check every recorded cell before running anything
    check_cell_record(opts, cell, cell_dir(opts, cell))
  outcomes = {}
  todo = [c for c in cells if not is_finished(cell_dir(opts, c))]
  print_fn(f"{len(cells)} cells: {len(cells) - len(todo)} finished (skipped), "
           f"{len(todo)} to run.")
  for i, cell in enumerate(cells):
    directory = cell_dir(opts, cell)
    if is_finished(directory):
      outcomes[cell.name] = {"status": "finished", "skipped": True}
      continue
    print_fn(f"[{i + 1}/{len(cells)}] {cell.name} ...")
    outcome = run_cell(opts, cell, directory)
    outcomes[cell.name] = outcome
    if outcome["status"] == "finished":
      rep = read_json(os.path.join(directory, FINISHED_MARKER))
      eps = report_epsilon(rep)
      print_fn(f"    done in {outcome['seconds']:.0f} s: accuracy "
               f"{_fmt(rep.get('final_metrics', {}).get('accuracy'), '.4f')}, "
               + ("non-private" if eps is None else f"epsilon {_fmt(eps)}"))
    else:
      print_fn(f"    FAILED ({outcome['reason']}); see {outcome['log']}")
      if not opts.keep_going:
        raise SweepError(f"Cell {cell.name} failed ({outcome['reason']}); see {outcome['log']}.")
  return outcomes


# --------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------
def read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def report_epsilon(rep: dict) -> Optional[float]:
  """A privacy report's epsilon as a float; ``None`` for a non-private run (whose
  report holds ``null``, or ``"inf"`` in reports of older versions)."""
  if not rep.get("private", True):
    return None
  value = rep.get("epsilon")
  try:
    value = float(value)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None


def cell_result(opts: SweepOptions, cell: Cell) -> dict:
  """One row of results.csv: the cell's axes, its accuracies and its privacy."""
  directory = cell_dir(opts, cell)
  row = {"cell": cell.name, **dict(cell.assignments)}
  if not is_finished(directory):
    row["status"] = ("unfinished" if os.path.exists(os.path.join(directory, "log.txt"))
                     else "not run")
    return row
  rep = read_json(os.path.join(directory, FINISHED_MARKER))
  record_path = os.path.join(directory, "cell.json")
  seconds = read_json(record_path).get("seconds") if os.path.exists(record_path) else None
  hp = rep.get("hyperparameters", {})
  row.update({
      "status": "finished",
      "private": bool(rep.get("private", True)),
      "final_accuracy": rep.get("final_metrics", {}).get("accuracy"),
      "best_val_accuracy": rep.get("best_val_accuracy"),
      "final_loss": rep.get("final_metrics", {}).get("loss"),
      "epsilon": report_epsilon(rep), "delta": rep.get("delta"),
      "noise_multiplier": rep.get("noise_multiplier"), "steps": rep.get("steps"),
      "seconds": seconds,
  })
  for k in ("optimizer", "learning_rate", "regularizer", "l2_norm_clip", "batch_size", "epochs"):
    row.setdefault(k, hp.get(k))
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


# --------------------------------------------------------------------------
# Figures and panels.
# --------------------------------------------------------------------------
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
          "effective_lr": "learning rate x c", "learning_rate": "learning rate"}.get(
              name, name or "")


def _epsilon_label(rows) -> str:
  """``"epsilon = 2.00"`` when the finished cells share one epsilon (to 0.01), else ``""``."""
  finished = [r for r in rows if r.get("status") == "finished"]
  if finished and not any(r.get("private", True) for r in finished):
    return "non-private"
  values = {round(float(r["epsilon"]), 2) for r in finished if r.get("epsilon") is not None}
  return f"epsilon = {values.pop():.2f}" if len(values) == 1 else ""


def draw_heatmaps(opts: SweepOptions, panels: Sequence[Panel], rows_by_name: dict) -> dict:
  """One PNG per figure, one panel per epsilon; returns ``{path: annotations}``."""
  from tf_dpnsgd import plots
  out = {}
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
                              title=f"{label + ': ' if label else ''}{opts.metric} test "
                                    "accuracy (%)")
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
  from tf_dpnsgd import plots
  histories = {}
  for name in names:
    path = os.path.join(opts.sweep_dir, "cells", name, "history.json")
    if os.path.exists(path):
      histories[name] = read_json(path)
  if not histories:
    return None
  path = os.path.join(opts.sweep_dir, "curves.png")
  plots.training_curves(path, histories, title="training curves")
  return path


# --------------------------------------------------------------------------
# Privacy of the tuning, robustness.
# --------------------------------------------------------------------------
def _distributions(opts: SweepOptions, n_cells: int) -> list:
  from tf_dpnsgd import tuning
  mean = opts.tuning_mean if opts.tuning_mean is not None else float(n_cells)
  if mean <= 1.0:
    return []
  return tuning.default_distributions(mean, opts.tuning_etas, opts.tuning_poisson)


def panel_privacy(opts: SweepOptions, runs: Sequence, near_best_fraction: Optional[float],
                  cache: dict) -> dict:
  """Single-run, naive-composition and random-search epsilons of one panel's runs."""
  from tf_dpnsgd import tuning
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
      "The score that selects the best trial is the test accuracy, computed on data outside "
      "the protected training set.",
      f"Seeds: {seeds}.",
  ]


def summarize(opts: SweepOptions, cells: Sequence[Cell], print_fn=_print) -> dict:
  """Writes results, heatmaps, curves and the report; returns the report dict."""
  from tf_dpnsgd import tuning
  rows = [cell_result(opts, c) for c in cells]
  rows_by_name = {r["cell"]: r for r in rows}
  csv_path, json_path = write_results(opts, rows)
  panels = arrange_panels(opts, cells)
  finished = [r for r in rows if r["status"] == "finished"]
  report = {"sweep_dir": opts.sweep_dir, "base": opts.base, "base_flagfile": opts.base_flagfile,
            "cells": len(cells), "finished": len(finished),
            "not_finished": [r["cell"] for r in rows if r["status"] != "finished"],
            "metric": opts.metric, "results_csv": csv_path, "results_json": json_path,
            "assumptions": assumptions(opts), "panels": []}
  if not finished:
    print_fn("No finished cell: nothing to plot or account for.")
    _write_report(opts, report)
    return report
  figures = draw_heatmaps(opts, panels, rows_by_name)
  report["heatmaps"] = list(figures)
  curve_cells = chosen_curve_cells(opts, panels, cells, rows_by_name)
  report["curves"] = {"path": draw_curves(opts, curve_cells), "cells": curve_cells}

  cache, all_runs = {}, []
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
        rep = read_json(os.path.join(cell_dir(opts, c), FINISHED_MARKER))
        if rep.get("private", True):
          runs.append({"delta": rep["delta"], "privacy": tuning.RunPrivacy.from_report(rep)})
    all_runs += runs
    fraction = None
    if any(math.isfinite(v) for row in acc for v in row):
      rob = tuning.robustness_summary(acc, opts.near_best_points)
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
  deltas = {r["delta"] for r in all_runs}
  if all_runs and len(deltas) == 1:
    whole = tuning.tuning_privacy([r["privacy"] for r in all_runs], deltas.pop(), cache=cache)
    report["whole_sweep"] = {"runs": whole["runs"], "naive_composition": whole["naive_composition"],
                             "single_run": whole["single_run"]}
  _write_report(opts, report)
  for line in report_lines(report):
    print_fn(line)
  return report


def _fmt(v, spec=".4g"):
  return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def report_lines(report: dict) -> list:
  """A plain-text summary of the report (printed, and the body of report.md)."""
  lines = [f"# Sweep {report['sweep_dir']}", "",
           f"Base launcher `{report['base']}`, {report['finished']}/{report['cells']} cells "
           f"finished; metric: {report['metric']} test accuracy.", ""]
  for e in report["panels"]:
    title = e["figure"] + (f" | {e['panel']}" if e["panel"] else "")
    lines.append(f"## {title}  (x: {e['x_axis']}, y: {e['y_axis']})")
    header = "| y \\ x | " + " | ".join(str(x) for x in e["x_values"]) + " |"
    lines += ["", header, "|" + "---|" * (len(e["x_values"]) + 1)]
    for yv, row in zip(e["y_values"], e["accuracy"]):
      lines.append(f"| {yv} | " + " | ".join(_fmt(100 * v, ".1f") for v in row) + " |")
    lines.append("")
    rob = e.get("robustness")
    if rob:
      lines.append(
          f"* best {rob['best']:.1f}% at {e['y_axis']}={rob['best_y']}, {e['x_axis']}="
          f"{rob['best_x']}; spread across {e['x_axis']} at that {e['y_axis']}: "
          f"{rob['spread_at_best_row']:.1f} points (min {rob['min_at_best_row']:.1f}%); "
          f"cells within {rob['threshold_points']:g} points of the best: {rob['near_best']}/"
          f"{rob['cells']} ({100 * rob['near_best_fraction']:.0f}%).")
    priv = e.get("privacy")
    if priv:
      lines.append(
          f"* privacy at delta={priv['delta']:g}: one run epsilon "
          f"{_fmt(priv['single_run']['epsilon'])}; "
          f"all {priv['runs']} cells released (naive composition) epsilon "
          f"{_fmt(priv['naive_composition']['epsilon'])}.")
      for r in priv["random_search"]:
        lines.append(f"* random search, best of K ~ {r['distribution']} (E[K] = "
                     f"{r['mean_trials']:.3g}) released: epsilon {_fmt(r['epsilon'])}.")
      reach = priv.get("random_search_near_best")
      if reach:
        for r in reach["results"]:
          lines.append(f"* random search reaching a near-best cell w.p. {reach['probability']:g} "
                       f"(near-best fraction {reach['near_best_fraction']:.2f}): "
                       f"{r['distribution']}, E[K] = {r['mean_trials']:.3g}: epsilon "
                       f"{_fmt(r['epsilon'])}.")
      for note in priv["notes"]:
        lines.append(f"* note: {note}")
    lines.append("")
  whole = report.get("whole_sweep")
  if whole:
    lines.append(f"Whole sweep: {whole['runs']} runs released, naive composition epsilon "
                 f"{_fmt(whole['naive_composition']['epsilon'])}.")
  if report.get("heatmaps"):
    lines.append("Heatmaps: " + ", ".join(report["heatmaps"]))
  if report.get("curves", {}).get("path"):
    lines.append(f"Curves: {report['curves']['path']} ({', '.join(report['curves']['cells'])})")
  lines += ["", "Assumptions:"] + [f"* {a}" for a in report["assumptions"]]
  return lines


def _write_report(opts: SweepOptions, report: dict) -> None:
  with open(os.path.join(opts.sweep_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
  with open(os.path.join(opts.sweep_dir, "report.md"), "w") as f:
    f.write("\n".join(report_lines(report)) + "\n")


# --------------------------------------------------------------------------
# Dry run: the cells and their planned privacy, without training.
# --------------------------------------------------------------------------
def planned_dataset_size(opts: SweepOptions, module, flag_values) -> int:
  if opts.dry_run_dataset_size:
    return opts.dry_run_dataset_size
  if hasattr(module, "planned_dataset_size"):
    return int(module.planned_dataset_size(flag_values))
  raise SweepError(f"--dry_run cannot tell the training-set size of {module.__name__}: pass "
                   "--dry_run_dataset_size.")


def plan_cells(opts: SweepOptions, cells: Sequence[Cell]) -> list:
  """Each cell's planned privacy, from the base launcher's own flag parsing.

  Imports the base launcher (which defines its flags), parses each cell's
  arguments with them and builds the run's :class:`~tf_dpnsgd.plan.PrivacyPlan`
  as :func:`tf_dpnsgd.launch.common.run_experiment` would. Resets the flag
  values to their defaults afterwards.

  Raises:
    SweepError: a cell's flags are invalid for the launcher (its flag validators).
  """
  from tf_dpnsgd import tuning
  from tf_dpnsgd.launch import common
  module = importlib.import_module(opts.base)
  plans, out = {}, []
  was_parsed = FLAGS.is_parsed()
  try:
    for cell in cells:
      FLAGS.unparse_flags()
      try:
        FLAGS(["sweep-dry-run", *opts.cell_argv(cell)])
        cfg = common.config_from_flags()
      except (flags.Error, common.LaunchError) as e:
        raise SweepError(f"Cell {cell.name}: {e}") from None
      n = planned_dataset_size(opts, module, FLAGS)
      row = {"cell": cell.name, **dict(cell.assignments), "dataset_size": n,
             "optimizer": cfg.optimizer, "learning_rate": cfg.learning_rate}
      if not cfg.private:
        out.append({**row, "private": False, "epsilon": None})
        continue
      key = (n, cfg.batch_size, cfg.sampling, cfg.delta, cfg.epochs, cfg.noise_multiplier,
             cfg.target_epsilon, cfg.accountant, getattr(cfg, "bound", None),
             getattr(cfg, "conversion", None))
      if key not in plans:
        try:
          plans[key] = common.make_plan(cfg, n)
        except common.LaunchError as e:
          raise SweepError(f"Cell {cell.name}: {e}") from None
      plan = plans[key]
      steps = min(plan.num_steps, cfg.max_steps or plan.num_steps)
      sigma = plan.training_noise_multiplier
      row.update({"batch_size": cfg.batch_size, "steps": steps, "noise_multiplier": sigma,
                  "epsilon": plan.epsilon(steps), "delta": cfg.delta})
      row["privacy"] = tuning.RunPrivacy.from_report(
          {"dataset_size": n, "batch_size": cfg.batch_size, "sampling": cfg.sampling,
           "bound": plan.bound, "conversion": plan.conversion, "noise_multiplier": sigma,
           "steps": steps})
      out.append(row)
  finally:
    FLAGS.unparse_flags()
    if was_parsed:  # defaults, but readable (absl's app.run reads flags on a failed exit)
      FLAGS.mark_as_parsed()
  return out


def dry_run(opts: SweepOptions, cells: Sequence[Cell], print_fn=_print) -> dict:
  planned = plan_cells(opts, cells)
  width = max(len(r["cell"]) for r in planned)
  print_fn(f"{len(cells)} cells of {opts.base} (dry run: nothing is trained)")
  print_fn(f"{'cell':<{width}}  {'N':>7} {'sigma':>8} {'steps':>7} {'epsilon':>8}")
  for r in planned:
    eps = _fmt(r["epsilon"], ".4f") if r.get("private", True) else "non-private"
    print_fn(f"{r['cell']:<{width}}  {r['dataset_size']:>7} "
             f"{_fmt(r.get('noise_multiplier'), '.4f'):>8} {str(r.get('steps', '-')):>7} "
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
            f"{_fmt(priv['single_run']['epsilon'])}; all released (naive composition) "
            f"{_fmt(priv['naive_composition']['epsilon'])}")
    for r in priv["random_search"]:
      line += f"; random search {r['distribution']}: {_fmt(r['epsilon'])}"
    print_fn(line)
  result = {"base": opts.base, "cells": [{k: v for k, v in r.items() if k != "privacy"}
                                         for r in planned], "panels": panels_out}
  if opts.sweep_dir:
    os.makedirs(opts.sweep_dir, exist_ok=True)
    with open(os.path.join(opts.sweep_dir, "plan.json"), "w") as f:
      json.dump(result, f, indent=1, default=str)
  return result


# --------------------------------------------------------------------------
def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    return _main()
  except SweepError as e:  # a bad sweep definition: one line, no traceback
    raise SystemExit(f"FATAL sweep error: {e}") from None


def check_cells(opts: SweepOptions, cells: Sequence[Cell]) -> None:
  """Raises :class:`SweepError` for cells that cannot run as defined (before any runs)."""
  for cell in cells:
    opts.cell_argv(cell)  # e.g. a privacy axis on an sgd cell
  sgd = [c.name for c in cells if opts.cell_optimizer(c) == "sgd"]
  if sgd and opts.base_flagfile:
    with open(opts.base_flagfile) as f:
      names = {line.strip().lstrip("-").partition("=")[0] for line in f
               if line.strip().startswith("--")}
    given = sorted(names & set(PRIVACY_FLAGS))
    if given:
      raise SweepError(f"The base flag file {opts.base_flagfile} sets --{given[0]}, which the "
                       f"non-private cells {sgd} (optimizer=sgd) cannot take; use a base flag "
                       "file without privacy flags and set them with --fixed or a grid axis.")


def _main():
  opts = options_from_flags()
  cells = expand_grid(opts.axes)
  check_cells(opts, cells)
  if opts.dry_run:
    dry_run(opts, cells)
    return 0
  os.makedirs(opts.sweep_dir, exist_ok=True)
  with open(os.path.join(opts.sweep_dir, "sweep.json"), "w") as f:
    json.dump(opts.to_dict(), f, indent=1)
  run_cells(opts, cells)
  report = summarize(opts, cells)
  if report["not_finished"]:
    print(f"{len(report['not_finished'])} cell(s) did not finish: {report['not_finished']}; "
          "rerun the same command to retry them.", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
