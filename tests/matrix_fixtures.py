"""Shared, memoized oracles of the save-path and participation matrices (issue 47).

The matrices (tests/test_save_paths_matrix.py, tests/test_correlated_paths.py,
tests/test_participation.py) check every report against dp-accounting's epsilon of the
steps that ran, built in the test. One such RDP computation over
``accounting.DEFAULT_ORDERS`` costs 0.2-1 s of CPU, and the matrices asked for the same few
(steps, sampling rate, sigma) over and over (twice per case). The oracle is a pure function
of its arguments, so it is computed once per distinct participation pattern per worker
process; it stays dp-accounting's own computation, independent of tf_dpnsgd's accountant
(only the list of orders is shared).

:class:`TrainedOnce`: one training shared by the cases that each reload its files and
continue (see there).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil

import dp_accounting

from tf_dpnsgd import accounting


@functools.lru_cache(maxsize=None)
def poisson_epsilon(q: float, steps: int, sigma: float, delta: float) -> float:
  """dp-accounting's RDP epsilon of ``PoissonSampled(q, Gaussian(sigma))`` composed
  ``steps`` times, at ``delta``."""
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
              int(steps))
  return acc.get_epsilon(delta)


@functools.lru_cache(maxsize=None)
def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
  """dp-accounting's RDP epsilon of one Gaussian mechanism of this noise multiplier (the
  sensitivity already divided into it), at ``delta``."""
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
  return acc.get_epsilon(delta)


class TrainedOnce:
  """A model trained and saved ONCE (in a module-scoped fixture), reloaded by many cases.

  Each case must load and continue as if it had trained the model itself, right after the
  save. Two things in this process and on this machine remember how far a lineage got
  (tf_dpnsgd.ledger, tf_dpnsgd.lineage), and a case that continued the shared lineage raises
  them; the next case's reload would then be (rightly) a rollback. So the training runs
  against its own lineage record, and :meth:`resume_after_the_save` puts back, for the
  running case, exactly what the training left: the lineage's in-process high-water mark
  and its record (copied into the running test's own record directory, conftest's per-test
  ``TF_DPNSGD_LINEAGE_DIR``). Everything else (the files, the reload, the continued fit and
  every check of it) happens per case.

  Use::

      once = TrainedOnce(tmp_path_factory.mktemp("x"))
      with once.training():
        ... train and save ...
      once.saved(model)          # right after the save
      ...
      once.resume_after_the_save()   # in each case, before it loads
  """

  def __init__(self, folder):
    self.folder = folder
    self.record = os.path.join(os.fspath(folder), "lineages")
    self._reached = None

  @contextlib.contextmanager
  def training(self):
    """Runs the training (and the saves) against this run's own lineage record."""
    from tf_dpnsgd import lineage as lineage_lib  # pylint: disable=import-outside-toplevel
    old = os.environ.get(lineage_lib.ENV_VAR)
    os.environ[lineage_lib.ENV_VAR] = self.record
    try:
      yield self
    finally:
      if old is None:
        del os.environ[lineage_lib.ENV_VAR]
      else:
        os.environ[lineage_lib.ENV_VAR] = old

  def saved(self, model):
    """Remembers what the process knows of ``model``'s lineage right after the save."""
    from tf_dpnsgd import ledger as ledger_lib  # pylint: disable=import-outside-toplevel
    ledger = ledger_lib.ledger_of(model)
    self.lineage = ledger.lineage
    self.steps = ledger.steps
    self._reached = ledger_lib._PROCESS_REACHED[self.lineage]  # pylint: disable=protected-access
    assert self._reached[0] == self.steps

  def resume_after_the_save(self):
    """This process and this machine as the training left them (see the class)."""
    from tf_dpnsgd import ledger as ledger_lib  # pylint: disable=import-outside-toplevel
    from tf_dpnsgd import lineage as lineage_lib  # pylint: disable=import-outside-toplevel
    assert self._reached is not None, "call saved(model) after the training's saves"
    ledger_lib._PROCESS_REACHED[self.lineage] = self._reached  # pylint: disable=protected-access
    shutil.copytree(self.record, lineage_lib.directory(), dirs_exist_ok=True)
