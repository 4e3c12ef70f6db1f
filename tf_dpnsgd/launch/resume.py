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

Correlated noise (``--noise=bandmf``, cyclic Poisson sampling) continues only on the
partition its first step used (the ledger refuses any other sampler seed after step 0,
``ledger.seed_must_match``). So such a run keeps its sampler seed, a SECRET (it decides
which examples share a part), in :data:`SEED_FILE` inside ``--model_dir``, created
owner-only (``0600``) before training; nowhere else (not in ``run.json``, the report, logs
or the export). A resume reads it back (:func:`sampler_seed_to_resume`): a checkpoint
without it, or a file that others may read, is refused. The noise buffers travel in the
checkpoint with the optimizer's variables; the ledger refuses buffers that do not continue
it (a rollback).

Everything here is a pure function of its arguments except :func:`read_marker`,
:func:`write_marker`, :func:`read_sampler_seed`, :func:`write_sampler_seed` and
:func:`sampler_seed_to_resume` (files in ``model_dir``).
"""

from __future__ import annotations

import json
import os
from typing import Optional

MARKER_FILE = "run.json"
SEED_FILE = "sampler_seed.secret"  # cyclic-Poisson runs only; owner-only; never published
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


def keeps_sampler_seed(sampling: Optional[str]) -> bool:
  """Whether a run with this sampling keeps its sampler seed to resume: cyclic Poisson
  (correlated noise), whose partition must not change after step 0. Other samplings
  draw a new OS seed on resume, as before (Poisson, uniform: memoryless; shuffle: at epoch
  boundaries only, :func:`check_resume_point`)."""
  return sampling == "cyclic_poisson"


def write_sampler_seed(model_dir: str, seed: int) -> str:
  """Writes ``seed`` to ``model_dir``/:data:`SEED_FILE`, readable by the owner only (created
  ``0600`` and replaced atomically: the seed is never in a file others can read)."""
  path = os.path.join(model_dir, SEED_FILE)
  tmp = path + ".tmp"
  if os.path.exists(tmp):
    os.remove(tmp)
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(f"{int(seed)}\n")
  os.chmod(tmp, 0o600)  # whatever the umask
  os.replace(tmp, path)
  return path


def read_sampler_seed(model_dir: str) -> Optional[int]:
  """The seed in ``model_dir``/:data:`SEED_FILE`; ``None`` if absent.

  Raises:
    ResumeError: the file is readable or writable by others than its owner (the partition
      may be known, or replaced), or does not hold an integer.
  """
  path = os.path.join(model_dir, SEED_FILE)
  if not os.path.exists(path):
    return None
  mode = os.stat(path).st_mode & 0o777
  if mode & 0o077:
    raise ResumeError(
        f"{path} (the secret sampler seed of this correlated-noise run) has mode "
        f"{mode:o}: others may read or replace it, so the cyclic-Poisson partition is not "
        f"secret. If you are sure nobody else accessed it, chmod 600 it; else {NEW_DIR}")
  try:
    with open(path, encoding="utf-8") as f:
      return int(f.read().strip())
  except ValueError:
    raise ResumeError(f"{path} does not hold a sampler seed (an integer). {NEW_DIR}") from None


def sampler_seed_to_resume(model_dir: Optional[str], sampling: str,
                           has_checkpoint: bool) -> Optional[int]:
  """The sampler seed a run must use: ``None`` (draw a fresh OS seed) unless it resumes a
  checkpoint of a run that keeps its seed (:func:`keeps_sampler_seed`), then the kept one.

  Raises:
    ResumeError: a cyclic-Poisson checkpoint without its seed file (deleted, or copied
      without it): a new seed would be a new partition, under which an example could run
      in two steps fewer than ``b`` apart, which the accounting excludes.
  """
  if not (model_dir and has_checkpoint and keeps_sampler_seed(sampling)):
    return None
  seed = read_sampler_seed(model_dir)
  if seed is None:
    raise ResumeError(
        f"--model_dir={model_dir} holds a checkpoint of a correlated-noise (--noise=bandmf or blt) "
        f"run but not its sampler seed ({SEED_FILE}): the run can continue only on the "
        "cyclic-Poisson partition of its first steps, and a new seed would be a new "
        f"partition that the accounting does not cover. {NEW_DIR}")
  return seed


__all__ = ["MARKER_FILE", "SEED_FILE", "keeps_sampler_seed", "read_sampler_seed",
           "sampler_seed_to_resume", "write_sampler_seed", "ResumeError", "check_resume", "check_resume_point",
           "marker_differences", "read_marker", "run_marker", "write_marker"]
