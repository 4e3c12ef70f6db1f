"""A machine-local record of privately trained lineages and of the weights they released.

Keras offers paths that move a model's weights without the DP wrapper's state:
``base.save(...)`` / ``keras.models.load_model`` of the *wrapped* model, or a
second :func:`tf_dpnsgd.make_private` in a new process. Such a path would
restore privately trained weights with a fresh privacy ledger at step 0, and
the next report would count only the new steps. This module is how the package
still sees them, on the machine that trained them:

* :func:`record_steps`: every lineage (one ledger's history, named by a random
  63-bit id kept in the ledger) records the most steps it ever reached, so a
  rollback to an older checkpoint (same process or a new one) can never make
  the ledger count fewer steps than the lineage executed;
* :func:`record_weights`: at the end of every private ``fit`` the fingerprint
  of the model's weights (:func:`fingerprint`, independent of variable order)
  is recorded with the ledger's state, so :func:`tf_dpnsgd.make_private` can
  give weights loaded without their ledger their ledger back.

What it cannot see: weights copied to another machine (or another user's
cache), and weights changed after the last recorded ``fit`` (e.g. by hand).
``docs/privacy_model.md`` lists these limits. The record holds public
counters only (steps, batch kind, public sampler fingerprint, hashes): no
data, no seed, no noise key.

The directory is ``$TF_DPNSGD_LINEAGE_DIR`` if set, else
``~/.cache/tf_dpnsgd/lineages``. A failure to write it is reported as a
warning (it weakens detection; it never changes an epsilon).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Optional

import numpy as np

ENV_VAR = "TF_DPNSGD_LINEAGE_DIR"


def directory() -> str:
  """Where the record lives (created on first write)."""
  return os.environ.get(ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                  "tf_dpnsgd", "lineages")


def fingerprint(arrays) -> str:
  """SHA-256 of a list of weight arrays, independent of their order.

  >>> a, b = np.zeros(3, np.float32), np.ones((2, 2), np.float32)
  >>> fingerprint([a, b]) == fingerprint([b, a])
  True
  >>> fingerprint([a, b]) == fingerprint([a, b + 1e-7])
  False
  """
  parts = []
  for a in arrays:
    a = np.ascontiguousarray(np.asarray(a))
    h = hashlib.sha256(f"{a.dtype.str}|{a.shape}|".encode())
    h.update(a.tobytes())
    parts.append(h.digest())
  total = hashlib.sha256()
  for p in sorted(parts):
    total.update(p)
  return total.hexdigest()


def _read(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _write(path: str, record: dict) -> None:
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(record, f, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:
    warnings.warn(f"tf_dpnsgd could not write its lineage record {path} ({e}); rollbacks and "
                  "weights loaded without their privacy ledger may go undetected. Set "
                  f"{ENV_VAR} to a writable directory.", RuntimeWarning, stacklevel=3)


def _lineage_path(lineage: int) -> str:
  return os.path.join(directory(), f"lineage-{int(lineage)}.json")


def max_steps(lineage: int) -> int:
  """The most steps lineage ``lineage`` ever recorded on this machine (0 if unknown)."""
  if not lineage:
    return 0
  record = _read(_lineage_path(lineage))
  return int(record.get("max_steps", 0)) if record else 0


def max_releases(lineage: int) -> tuple:
  """The statistics releases lineage ``lineage`` recorded on this machine (noise multipliers)."""
  if not lineage:
    return ()
  record = _read(_lineage_path(lineage))
  return tuple(float(m) for m in (record or {}).get("releases", []))


def record_steps(lineage: int, steps: int, releases=()) -> None:
  """Raises the recorded maximum of ``lineage`` to ``steps`` (never lowers it) and keeps
  every release it made (``releases``: noise multipliers in order; a longer history wins,
  a diverging one is appended, never dropped)."""
  if not lineage:
    return
  old = _read(_lineage_path(lineage)) or {}
  old_steps = int(old.get("max_steps", 0))
  old_releases = [float(m) for m in old.get("releases", [])]
  releases = [float(m) for m in releases]
  common = 0
  while common < min(len(old_releases), len(releases)) and \
      old_releases[common] == releases[common]:
    common += 1
  merged = old_releases + releases[common:]
  if steps <= old_steps and merged == old_releases:
    return
  _write(_lineage_path(lineage), {"lineage": int(lineage), "max_steps": max(int(steps), old_steps),
                                  "releases": merged})


def record_weights(weights_fingerprint: str, state: dict) -> None:
  """Records that weights with this fingerprint carry the ledger ``state``."""
  _write(os.path.join(directory(), "weights", f"{weights_fingerprint}.json"), dict(state))


def lookup_weights(weights_fingerprint: str) -> Optional[dict]:
  """The ledger state recorded for these weights, or None."""
  return _read(os.path.join(directory(), "weights", f"{weights_fingerprint}.json"))


__all__ = ["ENV_VAR", "directory", "fingerprint", "lookup_weights", "max_releases", "max_steps",
           "record_steps", "record_weights"]
