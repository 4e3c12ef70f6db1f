"""Resuming a launcher run from its ``--model_dir``: only the run that wrote it continues.

A launcher given a ``--model_dir`` that holds ``checkpoint.weights.h5`` resumes
from it (weights, optimizer state, the privacy ledger). That is sound only if
the checkpoint was written by the same run. A DP run resumed from a
non-private run's checkpoint would start from weights trained on the private
data WITHOUT noise, and its report would still claim the full epsilon (issue
30: ``private: true``, epsilon 3.999, ``not_covered: []``). Two checks, both
failing closed:

* ``run.json`` (:data:`MARKER_FILE`), written into ``--model_dir`` by every
  launcher run before it trains (:func:`run_marker`: private or not, the plan's
  public fields, the dataset's name; no seed, nothing computed from the data).
  A checkpoint beside no marker, or beside a marker that differs from this
  run's, is refused (:func:`check_resume`), in both directions: a non-private
  run would overwrite a private run's checkpoint and report.
* a private run resumes only from a checkpoint that holds a privacy ledger
  (:func:`tf_dpnsgd.runner.checkpoint_has_ledger`, checked again by
  :func:`tf_dpnsgd.runner.restore`), whatever the marker says (a file copied
  by hand).

:func:`check_resume_point` refuses to resume a shuffle-sampled run inside an epoch.
Everything here is a pure function of its arguments except :func:`read_marker`
and :func:`write_marker`.
"""

from __future__ import annotations

import json
import os
from typing import Optional

MARKER_FILE = "run.json"
MARKER_FORMAT = 1
NEW_DIR = "Use a new --model_dir (or delete this one)."


class ResumeError(ValueError):
  """This run may not resume from the ``--model_dir`` given (the message says why and what
  to do); launchers report it as a one-line flag error."""


def run_marker(private: bool, plan_public: Optional[dict], dataset: Optional[str]) -> dict:
  """The ``run.json`` of a run: ``private``, the plan's ``public_dict()`` (``None`` when
  non-private) and the launcher's dataset name, as JSON gives them back."""
  marker = {"format": MARKER_FORMAT, "private": bool(private), "plan": plan_public,
            "dataset": dataset}
  return json.loads(json.dumps(marker, sort_keys=True))


def marker_differences(old: dict, new: dict) -> list:
  """``["key: <checkpoint's> vs <this run's>", ...]`` for each top-level or plan field that
  differs (empty when the markers are equal)."""
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key), new.get(key)
    if key == "plan" and isinstance(a, dict) and isinstance(b, dict):
      out += [f"plan.{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b))
              if a.get(k) != b.get(k)]
    elif a != b:
      out.append(f"{key}: {a!r} vs {b!r}")
  return out


def check_resume(model_dir: str, old: Optional[dict], new: dict, has_ledger: bool) -> None:
  """Raises :class:`ResumeError` unless the checkpoint in ``model_dir`` may be resumed.

  Args:
    model_dir: the directory (for the message).
    old: its ``run.json`` (``None``: absent or unreadable).
    new: this run's :func:`run_marker`.
    has_ledger: whether the checkpoint holds a privacy ledger.

  ============================================  ===========================================
  the checkpoint ...                            this run
  ============================================  ===========================================
  has no ``run.json``                           refused (older version or copied by hand)
  ``run.json`` non-private, this run private    refused: non-private weights are not public
  ``run.json`` private, this run non-private    refused: it would overwrite the private run
  another plan or dataset                       refused
  same marker, private, no ledger in the file   refused (the file was replaced)
  same marker (and a ledger when private)       resumes
  ============================================  ===========================================
  """
  where = f"--model_dir={model_dir} holds a checkpoint"
  if old is None:
    raise ResumeError(
        f"{where} but no {MARKER_FILE} (written by an older tf_dpnsgd, or copied by hand): "
        "the launcher cannot tell whether a private run of this plan trained it, and "
        f"resuming weights of unknown origin would put them outside the epsilon. {NEW_DIR}")
  if old.get("private") is False and new["private"]:
    raise ResumeError(
        f"{where} of a NON-PRIVATE run (--optimizer=sgd); this run is private. Resuming would "
        "start DP training from weights trained on the private data without noise, which no "
        f"epsilon covers (weights trained on this data without DP are not public). {NEW_DIR}")
  if old.get("private") is True and not new["private"]:
    raise ResumeError(
        f"{where} of a private run; this run is non-private (--optimizer=sgd) and would "
        f"overwrite that run's checkpoint and privacy report. {NEW_DIR}")
  differences = marker_differences(old, new)
  if differences:
    raise ResumeError(
        f"{where} of another run ({'; '.join(differences)}: the checkpoint's vs this "
        "run's). A run resumes only with the flags it started with (--max_steps aside): the "
        f"report would account its steps under this run's plan. {NEW_DIR}")
  if new["private"] and not has_ledger:
    raise ResumeError(
        f"{where} without a privacy ledger although its {MARKER_FILE} says private (the "
        "checkpoint file was replaced, e.g. by a non-private model's weights): its weights "
        f"are not covered by any epsilon. {NEW_DIR}")


def read_marker(model_dir: str) -> Optional[dict]:
  """``model_dir``'s ``run.json``; ``None`` if absent or not a JSON object."""
  path = os.path.join(model_dir, MARKER_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      marker = json.load(f)
  except (OSError, ValueError):
    return None
  return marker if isinstance(marker, dict) else None


def write_marker(model_dir: str, marker: dict) -> None:
  with open(os.path.join(model_dir, MARKER_FILE), "w", encoding="utf-8") as f:
    json.dump(marker, f, indent=1, sort_keys=True)


def check_resume_point(plan, start_step: int) -> None:
  """Refuses to resume a shuffle-sampled run mid-epoch: the sampler seed is never saved, so
  the rest of the epoch would follow a new permutation and repeat examples."""
  if plan is None or plan.sampling != "shuffle" or start_step >= plan.num_steps:
    return
  spe = plan.spec.steps_per_epoch
  if start_step % spe:
    raise ResumeError(
        f"Cannot resume this --sampling=shuffle run at step {start_step}, inside epoch "
        f"{start_step // spe + 1} ({spe} steps per epoch): the sampler seed is never saved, so "
        "the rest of the epoch would follow a new permutation and repeat examples, which "
        "the per-epoch accounting excludes. Use a new --model_dir, or stop shuffle runs at "
        "epoch ends (--max_steps a multiple of the steps per epoch).")


__all__ = ["MARKER_FILE", "ResumeError", "check_resume", "check_resume_point",
           "marker_differences", "read_marker", "run_marker", "write_marker"]
