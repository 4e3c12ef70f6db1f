"""One exclusive file lock for the test processes of a session (xdist workers, and any other
session running): ``with exclusive(path): ...`` runs the block in one process at a time.
Used by ``launch_each.once_per_session`` (a computation shared by the workers) and by
``time_budget.WorkerCalibration`` (calibrations never overlapping)."""

from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def exclusive(path: str | os.PathLike):
  """Holds an exclusive ``flock`` on ``path`` (created if absent) for the block."""
  with open(path, "w") as held:
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(held, fcntl.LOCK_UN)
