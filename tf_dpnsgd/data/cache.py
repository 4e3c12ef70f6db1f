"""A disk cache of arrays derived from a data set, keyed by checksums.

Used by the CIFAR-10 launcher for decoded image folders and for scattering
features, which are slow to compute and identical for every run of a sweep.
An entry is a folder ``<cache_dir>/<name>-<key>/`` of ``.npy`` files written
atomically (a temporary folder renamed into place), so an interrupted run
leaves no half-written entry. The key is a SHA-256 of everything the arrays
depend on (the data's bytes and the computation's settings); a changed input
gives a new key, never a stale entry.

The cached arrays are derived from the (private) training data: keep the
cache directory as private as the data itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Sequence

import numpy as np


def digest(*arrays, settings=None) -> str:
  """SHA-256 (hex) of arrays (dtype, shape and bytes) and JSON-able ``settings``."""
  h = hashlib.sha256()
  for a in arrays:
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(a).cast("B"))
  h.update(json.dumps(settings, sort_keys=True).encode())
  return h.hexdigest()


def files_digest(paths: Sequence[str], root: str, settings=None) -> str:
  """SHA-256 (hex) of files' paths relative to ``root`` and their bytes, in order."""
  h = hashlib.sha256()
  for path in paths:
    h.update(os.path.relpath(path, root).encode() + b"\0")
    with open(path, "rb") as f:
      data = f.read()
    h.update(len(data).to_bytes(8, "little") + data)
  h.update(json.dumps(settings, sort_keys=True).encode())
  return h.hexdigest()


def cached(cache_dir, name: str, key: str, names: Sequence[str],
           compute: Callable[[], Sequence[np.ndarray]]):
  """The arrays ``names`` of entry ``<name>-<key>``, computed and stored when absent.

  Args:
    cache_dir: the cache's folder (created if needed); ``None``: no cache,
      ``compute()`` is called.
    name: a readable prefix of the entry (e.g. ``"scattering"``).
    key: the entry's checksum (:func:`digest`, :func:`files_digest`).
    names: file names of the arrays, in the order ``compute`` returns them.
    compute: returns the arrays.

  Returns:
    ``(arrays, hit)``: the list of arrays, and whether they came from the cache.
  """
  if cache_dir is None:
    return list(compute()), False
  entry = os.path.join(os.fspath(cache_dir), f"{name}-{key[:32]}")
  paths = [os.path.join(entry, f"{n}.npy") for n in names]
  if all(os.path.isfile(p) for p in paths):
    return [np.load(p) for p in paths], True
  arrays = list(compute())
  if len(arrays) != len(names):
    raise ValueError(f"compute() returned {len(arrays)} arrays for names {list(names)}.")
  os.makedirs(cache_dir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
  try:
    for n, a in zip(names, arrays):
      np.save(os.path.join(tmp, f"{n}.npy"), a)
    if os.path.isdir(entry):  # an incomplete entry (a file missing): replace it
      shutil.rmtree(entry)
    os.rename(tmp, entry)
  except OSError:
    shutil.rmtree(tmp, ignore_errors=True)
    if not all(os.path.isfile(p) for p in paths):  # not a concurrent writer's complete entry
      raise
  return arrays, False


__all__ = ["cached", "digest", "files_digest"]
