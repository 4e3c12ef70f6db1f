"""The sweep's definition: grid axes, cells, fixed flags and the options of one sweep.

A sweep runs a base launcher once per cell of a grid. Grid axes:

* ``AXIS=V1,V2,...``: ``AXIS`` is a flag of the base launcher; values are
  passed verbatim.
* ``AXIS=V1,...@OTHER=VALUE``: a conditional axis, used only in cells whose
  axis ``OTHER`` has ``VALUE`` (e.g. ``regularizer=...@optimizer=dpnsgd`` and
  ``l2_norm_clip=...@optimizer=dpsgd`` in one sweep).
* ``effective_lr``: a virtual axis for DP-SGD, ``learning_rate =
  effective_lr / l2_norm_clip``, so that ``lr * c`` (the step of a clipped
  gradient) covers the same values for every clip.

Everything here takes plain Python values; the command line
(:mod:`tf_dpnsgd.launch.sweep`) builds :class:`SweepOptions` from its flags,
and error messages name those flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from typing import Optional, Sequence

SHORT_NAMES = {name: f"tf_dpnsgd.launch.{name}" for name in ("quickstart", "mnist", "cifar10",
                                                              "sst2")}
X_CANDIDATES = ("regularizer", "l2_norm_clip", "target_unclipped_quantile")
Y_CANDIDATES = ("learning_rate", "effective_lr")
PANEL_AXIS = "target_epsilon"
VIRTUAL_AXES = ("effective_lr",)
RESERVED = ("model_dir", "flagfile", "export_dir")
PRIVACY_FLAGS = ("noise_multiplier", "target_epsilon")


def echo(*args):
  """``print`` that flushes (the sweep's progress lines interleave with subprocesses)."""
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
# The sweep's options (the command line builds them from its flags).
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepOptions:
  """One sweep, validated: its base launcher, grid and reporting choices.

  Each attribute is the value of the command-line flag of the same name
  (``python -m tf_dpnsgd.launch.sweep --helpfull`` documents them), with
  ``axes`` the parsed ``--grid`` (:class:`Axis`) and ``fixed`` the ``--fixed``
  pairs ``((name, value), ...)``.
  """

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
  plot_training_metrics: bool = False

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
  def eval_split(self) -> str:
    """The name of the held-out split the base launcher scores on: SST-2 scores on GLUE's dev
    set (its test labels are not public), the image launchers on their test sets."""
    return "dev" if self.base == SHORT_NAMES["sst2"] else "test"

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



__all__ = ["Axis", "Cell", "PANEL_AXIS", "PRIVACY_FLAGS", "RESERVED", "SHORT_NAMES",
           "SweepError", "SweepOptions", "VIRTUAL_AXES", "X_CANDIDATES", "Y_CANDIDATES",
           "echo", "expand_grid", "parse_fixed"]
