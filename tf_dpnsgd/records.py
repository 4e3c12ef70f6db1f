"""The record of one training run: what a launcher writes and a sweep reads back.

:class:`RunRecord` is the content of a run's ``privacy_report.json``. The
launchers build it once (:func:`tf_dpnsgd.launch.common.run_experiment`) and
write :meth:`RunRecord.to_dict` with
:func:`tf_dpnsgd.export.write_privacy_report` (which adds ``versions`` and
refuses seed fields); sweeps read it back with :meth:`RunRecord.read`.

The JSON object is flat, as it always was: the record's fields, then the
accounting report's keys (``sampling``, ``accountant``, ``bound``,
``conversion``, ``assumptions``, ... from
:meth:`tf_dpnsgd.accounting.PrivacyReport.to_dict`), then the extra fields
(``dataset``, ``model``, ``versions``, ...). On reading, a key is a field, an
accounting key (:data:`ACCOUNTING_KEYS`) or an extra field, so
``RunRecord.from_dict(r.to_dict()) == r``.

Edge cases:

=====================================  ==================================================
record                                 ``epsilon``
=====================================  ==================================================
non-private run (``--optimizer=sgd``)  ``None`` (JSON ``null``); ``private`` is ``False``
private run, infinite epsilon          ``None`` and a note saying so (JSON has no inf)
older files: ``"inf"`` / ``"nan"``     read as ``None``
=====================================  ==================================================

``not_covered`` (always written, a list) is the accounting report's field of that
name: what the released model depends on outside the Gaussian mechanism
(:mod:`tf_dpnsgd.coverage`); older files without it are read with ``()`` (they
did not record it). :meth:`RunRecord.epsilon_text` says when it is not empty.

``best_val_accuracy`` is ``None`` when no validation accuracy was recorded
(older files hold the string ``"nan"``). Non-finite floats in
``final_metrics`` are written as strings (``"nan"``) and read back as floats.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

import numpy as np

# Keys of PrivacyReport.to_dict() that are not RunRecord fields (kept in `accounting`).
ACCOUNTING_KEYS = (
    "accountant", "assumptions", "batch_size", "bound", "calibration_tolerance",
    "compositions", "conversion", "dp_event", "epochs", "neighboring_relation",
    "optimal_bound", "optimal_order", "sampling", "sampling_rate", "target_epsilon",
)

NON_PRIVATE_NOTE = "--optimizer=sgd: non-private baseline, no privacy guarantee"
REPORT_FILE = "privacy_report.json"


def _finite_or_none(value) -> Optional[float]:
  """A finite float, or ``None`` for ``None``, non-numbers, ``"inf"``, ``"nan"``, inf, nan."""
  if value is None or isinstance(value, bool):
    return None
  try:
    value = float(value)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None


def _metric(value):
  """``final_metrics`` values: floats, with ``"nan"``/``"inf"``/``"-inf"`` read as floats."""
  if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
    return float(value)
  return value


def json_ready(value, where: str = "value", check_key=None):
  """``value`` as JSON can hold it: the one cleaner of every file the package writes.

  Non-finite floats become strings (``"inf"`` for an unbounded epsilon; JSON
  has no inf/nan), NumPy and TensorFlow values plain lists and numbers, paths
  strings; anything else raises. ``check_key(key, where)`` (e.g. the export's
  refusal of seed-like keys) sees every dict key.

  >>> json_ready({"epsilon": float("inf"), "steps": [1, 2]})
  {'epsilon': 'inf', 'steps': [1, 2]}
  """
  if isinstance(value, dict):
    out = {}
    for key, item in value.items():
      if not isinstance(key, str):
        raise TypeError(f"Report field {where}: keys must be strings; got {key!r}.")
      if check_key is not None:
        check_key(key, f"{where}.{key}")
      out[key] = json_ready(item, f"{where}.{key}", check_key)
    return out
  if isinstance(value, (list, tuple)):
    return [json_ready(v, f"{where}[{i}]", check_key) for i, v in enumerate(value)]
  if isinstance(value, (np.generic, np.ndarray)):
    return json_ready(value.tolist(), where, check_key)
  if hasattr(value, "numpy") and callable(value.numpy):  # a TensorFlow tensor or variable
    return json_ready(np.asarray(value.numpy()).tolist(), where, check_key)
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, os.PathLike):
    return os.fspath(value)
  raise TypeError(f"Report field {where} has type {type(value).__name__}, which JSON cannot "
                  "hold; pass numbers, strings, lists or dicts.")



@dataclasses.dataclass(frozen=True)
class RunRecord:
  """One finished (or stopped) training run: its result and its privacy claim.

  Attributes:
    private: whether the run was DP (``False`` for the ``sgd`` baseline).
    steps: training steps taken (the privacy ledger's count for a DP model).
    dataset_size: ``N``, the training examples the guarantee is about.
    hyperparameters: the run's configuration (no directories, no seeds).
    final_metrics: the test metrics at the end (``accuracy``, ``loss``, ...).
    best_val_accuracy: the best validation accuracy over epochs; ``None`` if none.
    epsilon: the executed steps' epsilon at ``delta``; ``None`` when non-private
      (or infinite: JSON has no inf, and there is then no finite guarantee).
    delta: the guarantee's delta; ``None`` when non-private.
    noise_multiplier: the training noise multiplier ``sigma``; ``None`` when non-private.
    accounting: the accounting report's other keys (:data:`ACCOUNTING_KEYS`):
      sampling, accountant, bound, conversion, assumptions, dp_event, ...
    notes: remarks on the claim (from the accounting report, or why there is none).
    not_covered: what the released model depends on that the epsilon does not cover
      (:attr:`tf_dpnsgd.accounting.PrivacyReport.not_covered`); empty for a non-private
      run (it has no claim at all) and for records written before the field existed.
    extra: other fields (``dataset``, ``model``, ``versions``, ...).
  """

  private: bool
  steps: int
  dataset_size: int
  hyperparameters: dict = dataclasses.field(default_factory=dict)
  final_metrics: dict = dataclasses.field(default_factory=dict)
  best_val_accuracy: Optional[float] = None
  epsilon: Optional[float] = None
  delta: Optional[float] = None
  noise_multiplier: Optional[float] = None
  accounting: dict = dataclasses.field(default_factory=dict)
  notes: tuple = ()
  extra: dict = dataclasses.field(default_factory=dict)
  not_covered: tuple = ()

  def __post_init__(self):
    clash = ((set(self.accounting) | set(self.extra)) & _FIELD_NAMES) | (
        set(self.extra) & set(ACCOUNTING_KEYS))
    if clash:
      raise ValueError(f"Keys {sorted(clash)} are record fields or accounting keys; they "
                       "cannot be accounting or extra fields.")
    self._set("private", bool(self.private))
    self._set("steps", int(self.steps))
    self._set("dataset_size", int(self.dataset_size))
    self._set("notes", tuple(self.notes))
    if isinstance(self.not_covered, str):
      raise TypeError("`not_covered` must be a sequence of sentences, not one string.")
    self._set("not_covered", tuple(self.not_covered))
    self._set("best_val_accuracy", _finite_or_none(self.best_val_accuracy))
    if not self.private:
      if self.epsilon is not None or self.delta is not None or self.noise_multiplier is not None:
        raise ValueError("A non-private run has no epsilon, delta or noise multiplier; got "
                         f"epsilon={self.epsilon!r}, delta={self.delta!r}, "
                         f"noise_multiplier={self.noise_multiplier!r}.")
      return
    epsilon = _finite_or_none(self.epsilon)
    if epsilon is None and self.epsilon is not None:
      self._set("notes", self.notes + (f"Epsilon is {self.epsilon!r}: no finite guarantee.",))
    self._set("epsilon", epsilon)

  def _set(self, name, value):
    object.__setattr__(self, name, value)  # normalising a frozen dataclass's own fields

  # --- builders ---------------------------------------------------------------
  @classmethod
  def from_privacy_report(cls, report, **fields) -> "RunRecord":
    """The record of a private run whose claim is ``report`` (a
    :class:`~tf_dpnsgd.accounting.PrivacyReport` or its ``to_dict()``); ``fields``:
    ``hyperparameters``, ``final_metrics``, ``best_val_accuracy``, ``extra``,
    ``noise_multiplier`` (default: the report's)."""
    d = dict(report if isinstance(report, dict) else report.to_dict())
    fields.setdefault("noise_multiplier", d.get("noise_multiplier"))
    return cls(private=True, steps=d["steps"], dataset_size=d["dataset_size"],
               epsilon=d.get("epsilon"), delta=d.get("delta"),
               accounting={k: d[k] for k in ACCOUNTING_KEYS if k in d},
               notes=tuple(d.get("notes", ())), not_covered=tuple(d.get("not_covered", ())),
               **fields)

  @classmethod
  def non_private(cls, steps: int, dataset_size: int, **fields) -> "RunRecord":
    """The record of a non-private run (epsilon, delta and sigma ``None``)."""
    fields.setdefault("notes", (NON_PRIVATE_NOTE,))
    return cls(private=False, steps=steps, dataset_size=dataset_size, **fields)

  # --- JSON ---------------------------------------------------------------------
  def to_dict(self) -> dict:
    """The flat dict written as ``privacy_report.json`` (see the module docstring)."""
    out = {
        "private": self.private,
        "steps": self.steps,
        "dataset_size": self.dataset_size,
        "hyperparameters": dict(self.hyperparameters),
        "final_metrics": dict(self.final_metrics),
        "best_val_accuracy": self.best_val_accuracy,
        "epsilon": self.epsilon,
        "delta": self.delta,
        "noise_multiplier": self.noise_multiplier,
        "notes": list(self.notes),
        "not_covered": list(self.not_covered),
    }
    out.update(self.accounting)
    out.update(self.extra)
    return out

  def to_json(self) -> str:
    """Strict JSON (no NaN/Infinity constants), keys sorted."""
    return json.dumps(json_ready(self.to_dict()), sort_keys=True, allow_nan=False)

  @classmethod
  def from_dict(cls, d: dict) -> "RunRecord":
    """Reads a ``privacy_report.json`` object, including files of older versions."""
    d = dict(d)
    private = bool(d.pop("private", True))
    notes = d.pop("notes", [])
    not_covered = d.pop("not_covered", None)  # absent in records older than the field
    note = d.pop("note", None)  # older non-private records
    if note is not None:
      notes = list(notes) + [note]
    fields = {name: d.pop(name) for name in ("hyperparameters", "final_metrics",
                                            "best_val_accuracy") if name in d}
    fields["final_metrics"] = {k: _metric(v) for k, v in fields.get("final_metrics", {}).items()}
    privacy = {name: d.pop(name, None) for name in ("epsilon", "delta", "noise_multiplier")}
    if private:
      fields.update(privacy)
    return cls(private=private, steps=d.pop("steps"), dataset_size=d.pop("dataset_size"),
               accounting={k: d.pop(k) for k in ACCOUNTING_KEYS if k in d},
               notes=tuple(notes), extra=d, not_covered=tuple(not_covered or ()), **fields)

  @classmethod
  def from_json(cls, text: str) -> "RunRecord":
    return cls.from_dict(json.loads(text))

  @classmethod
  def read(cls, path) -> "RunRecord":
    """Reads ``path`` (a ``privacy_report.json``, or the folder holding one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, REPORT_FILE)
    with open(path, encoding="utf-8") as f:
      return cls.from_json(f.read())

  # --- derived ------------------------------------------------------------------
  def metric(self, name: str, default: Any = None):
    """``final_metrics[name]`` (``default`` when absent)."""
    return self.final_metrics.get(name, default)

  def epsilon_text(self) -> str:
    """``"epsilon 3.999 (delta 1e-05)"``, or ``"non-private (no privacy guarantee)"``;
    ``"...; NOT covered by it: 2 items (not_covered)"`` when :attr:`not_covered` lists any."""
    if not self.private or self.epsilon is None:
      return "non-private (no privacy guarantee)"
    text = f"epsilon {self.epsilon:.4g} (delta {self.delta:g})"
    if self.not_covered:
      n = len(self.not_covered)
      text += f"; NOT covered by it: {n} item{'s' if n > 1 else ''} (not_covered)"
    return text


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(RunRecord))

__all__ = ["ACCOUNTING_KEYS", "NON_PRIVATE_NOTE", "REPORT_FILE", "RunRecord"]
