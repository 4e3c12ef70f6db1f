"""What an example-level guarantee means for a person with ``k`` rows: group privacy.

An example-level run protects one row. A person who contributed ``k`` rows differs
from their absence by ``k`` rows, i.e. by a chain of ``k`` neighbouring data sets, so
the example-level ``(epsilon, delta)`` degrades along the chain:

    P[M(x_0) in S] <= e^eps P[M(x_1) in S] + delta
                   <= e^(2 eps) P[M(x_2) in S] + delta (1 + e^eps)
                   <= ...
                   <= e^(k eps) P[M(x_k) in S] + delta * sum_{i<k} e^(i eps).

So a group of ``k`` examples gets ``(k eps, delta * (e^(k eps) - 1) / (e^eps - 1))``
(:func:`group_privacy_epsilon`; at most ``(k eps, k e^((k-1) eps) delta)``, the form
usually quoted). The bound is generic (any (eps, delta)-DP mechanism) and therefore
loose for subsampled Gaussian mechanisms; it is what an example-level claim
*guarantees* a user, not an estimate of what the run leaks.

:func:`example_level_for_group` gives the best such statement for a whole run: the
example-level epsilon is computed by dp-accounting at every ``delta'`` of a grid, and
the smallest ``k eps(delta')`` whose group delta fits the user's ``delta`` is kept.
A user-level run (:mod:`tf_dpnsgd.users`) is accounted directly over users instead;
put the two side by side to see what the user-level accounting buys.

References:
  Dwork and Roth (2014), "The Algorithmic Foundations of Differential Privacy",
  Thm. 2.2 (group privacy, delta = 0); Vadhan (2017), "The Complexity of Differential
  Privacy", Lemma 2.2 (with delta, by the same chain).
"""

from __future__ import annotations

import math

import numpy as np

from tf_dpnsgd.accounting.validation import AccountingError


def _group_size(group_size) -> int:
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size < 1:
    raise AccountingError(f"`group_size` (rows of one person) must be an integer >= 1; got "
                          f"{group_size!r}.")
  return int(group_size)


def group_privacy_epsilon(epsilon: float, delta: float, group_size: int) -> tuple:
  """``(epsilon_k, delta_k)`` for a group of ``group_size`` rows of an ``(epsilon, delta)``-DP
  mechanism (see the module docstring): ``k eps`` and ``delta sum_{i<k} e^(i eps)``.

  ==================  ==============================
  case                result
  ==================  ==============================
  ``k = 1``           ``(epsilon, delta)`` unchanged
  ``epsilon = 0``     ``(0, k delta)``
  overflow            ``delta_k = inf`` (no claim)
  ==================  ==============================

  >>> group_privacy_epsilon(1.0, 1e-6, 1)
  (1.0, 1e-06)
  >>> eps, d = group_privacy_epsilon(1.0, 1e-6, 3)
  >>> eps, round(d / 1e-6, 4)   # 1 + e + e^2
  (3.0, 11.1073)
  """
  k = _group_size(group_size)
  epsilon, delta = float(epsilon), float(delta)
  if not (epsilon >= 0 and 0 <= delta <= 1):
    raise AccountingError(f"Need epsilon >= 0 and delta in [0, 1]; got ({epsilon!r}, {delta!r}).")
  if k == 1:
    return epsilon, delta
  if epsilon == 0:
    return 0.0, k * delta
  try:
    factor = math.expm1(k * epsilon) / math.expm1(epsilon)
  except OverflowError:
    factor = math.inf
  return k * epsilon, delta * factor


def example_level_for_group(epsilon_of_delta, group_size: int, delta: float,
                            grid: int = 200) -> tuple:
  """The best group-privacy statement ``(epsilon_k, delta_k)`` with ``delta_k <= delta`` for
  a person with ``group_size`` rows, from an example-level run whose epsilon at any
  ``delta'`` is ``epsilon_of_delta(delta')`` (e.g. a dp-accounting accountant's
  ``get_epsilon``).

  Searches ``delta'`` on a log grid of ``grid`` points in ``[delta * 1e-12, delta]`` and keeps
  the smallest ``k eps(delta')`` whose :func:`group_privacy_epsilon` delta is at most
  ``delta``. Returns ``(inf, delta)`` if none is (the example-level run says nothing about
  such a person at this delta).
  """
  k = _group_size(group_size)
  if not 0 < float(delta) < 1:
    raise AccountingError(f"`delta` must be in (0, 1); got {delta!r}.")
  best = (math.inf, float(delta))
  for d in np.geomspace(float(delta) * 1e-12, float(delta), int(grid)):
    eps = float(epsilon_of_delta(float(d)))
    if not math.isfinite(eps):
      continue
    eps_k, delta_k = group_privacy_epsilon(eps, float(d), k)
    if delta_k <= float(delta) * (1 + 1e-12) and eps_k < best[0]:
      best = (eps_k, delta_k)
  return best


__all__ = ["example_level_for_group", "group_privacy_epsilon"]
