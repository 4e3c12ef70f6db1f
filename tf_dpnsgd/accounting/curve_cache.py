"""dp-accounting's RDP curves kept on disk between processes (opt-in).

Computing dp-accounting's RDP of one subsampled Gaussian event over this
package's ~300 orders costs 0.1-0.4 s (more for large sampling rates, whose
fractional orders converge slowly), and a calibration asks for 10-20 of them.
Processes that calibrate the same plan (the cells of a sweep, a run and its
resume, the launchers of a test session) compute the same curves again. With
``TF_DPNSGD_RDP_CACHE=<directory>`` set, :mod:`tf_dpnsgd.accounting.rdp`
looks each curve up here first and stores what it computes; unset (the
default), nothing is read or written.

What is kept is a pure function's value: the key is the dp-accounting
version, the event's ``repr`` (every field, floats in shortest round-trip
form), the neighbouring relation and the orders (as ``float.hex``); the value
is each order's RDP as ``float.hex`` (exact, ``inf`` included) and the notes.
A file is used only if the key stored in it equals the key asked for, so a
hash collision, a truncated or edited file, or a file of another version is
ignored and the curve recomputed; files are written to a temporary name and
renamed (readers never see half a file). A file that fails to parse is
treated as absent. Anyone who can write this directory can change the
epsilons reported by the processes that use it, as anyone who can write the
package's own files can: point it at a directory only you write.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from typing import Optional

import dp_accounting

#: The environment variable naming the cache directory (unset: no cache).
ENV = "TF_DPNSGD_RDP_CACHE"

#: Bumped when the stored format or the meaning of a key changes.
FORMAT = 1


def key(event, neighboring_relation, orders) -> str:
  """The exact identity of a curve (a string; its SHA-256 names the file).

  >>> e = dp_accounting.GaussianDpEvent(1.5)
  >>> key(e, "REPLACE_ONE", (2.0,)) == key(e, "REPLACE_ONE", (2.0,)) != key(e, "ADD_OR_REMOVE_ONE", (2.0,))
  True
  """
  return json.dumps([FORMAT, _dp_accounting_version(), repr(event), repr(neighboring_relation),
                     [float(o).hex() for o in orders]])


@functools.lru_cache(maxsize=1)
def _dp_accounting_version() -> str:
  try:
    return metadata.version("dp-accounting")
  except metadata.PackageNotFoundError:  # not installed as a distribution: the path then
    return os.path.dirname(dp_accounting.__file__)


def directory() -> Optional[str]:
  """The cache directory from :data:`ENV`, or None (no cache)."""
  return os.environ.get(ENV) or None


def _path(folder: str, k: str) -> str:
  return os.path.join(folder, hashlib.sha256(k.encode()).hexdigest() + ".json")


def load(folder: str, k: str) -> Optional[tuple[tuple, tuple]]:
  """``(rdp, notes)`` stored under key ``k``, or None (absent, unreadable or another key)."""
  try:
    with open(_path(folder, k), encoding="utf-8") as f:
      stored = json.load(f)
    if stored["key"] != k:
      return None
    return (tuple(float.fromhex(v) for v in stored["rdp"]),
            tuple(str(n) for n in stored["notes"]))
  except (OSError, ValueError, KeyError, TypeError):
    return None


def store(folder: str, k: str, rdp, notes) -> None:
  """Writes ``(rdp, notes)`` under key ``k`` (atomically); a failure to write is ignored."""
  text = json.dumps({"key": k, "rdp": [float(v).hex() for v in rdp], "notes": list(notes)})
  tmp = None
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, _path(folder, k))
  except OSError:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.remove(tmp)  # a full disk leaves no half-written file behind


__all__ = ["ENV", "FORMAT", "directory", "key", "load", "store"]
