"""Named validators: each says which argument is wrong and why.

The one place where the package checks the numbers a privacy claim rests on
(``N``, ``B``, ``delta``, ``sigma``, steps, epochs); :mod:`tf_dpnsgd.noise`,
the optimizers, plans and accountants all call these. Errors are
:class:`AccountingError` (a ``ValueError``).
"""

from __future__ import annotations

import fractions
import math
from typing import Optional

import numpy as np


class AccountingError(ValueError):
  """An accounting request that has no valid answer (bad input or unsupported pair)."""


class UnsupportedAccountingError(AccountingError):
  """A sampling/accountant/bound combination that no implemented analysis covers."""


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def validate_dataset_and_batch(dataset_size, batch_size) -> tuple[int, int]:
  """Returns ``(N, B)`` as ints; raises unless ``1 <= B <= N`` (sampling rate q = B/N <= 1)."""
  if not _is_int(dataset_size) or dataset_size < 1:
    raise AccountingError(f"`dataset_size` must be a positive integer; got {dataset_size!r}.")
  if not _is_int(batch_size) or batch_size < 1:
    raise AccountingError(f"`batch_size` must be a positive integer; got {batch_size!r}.")
  if batch_size > dataset_size:
    raise AccountingError(
        f"`batch_size` ({batch_size}) exceeds `dataset_size` ({dataset_size}): the sampling "
        f"rate q = B/N = {batch_size / dataset_size:.4g} must be at most 1.")
  return int(dataset_size), int(batch_size)


def validate_delta(delta, dataset_size: Optional[int] = None) -> float:
  """Returns ``delta`` as a float; raises unless ``0 < delta < 1`` and, given ``N``,
  ``delta < 1/N``.

  Why ``1/N``: a mechanism that publishes each example in the clear with probability
  ``delta`` is ``(0, delta)``-DP, so with ``delta >= 1/N`` the guarantee allows releasing
  about one whole example; the usual choice is ``delta`` well below ``1/N`` (refused,
  not warned: every entry point that knows ``N`` (plans, ``make_private``'s first
  ``fit``, the launchers, the privacy CLI, every report) calls this).

  >>> validate_delta(1e-5, dataset_size=60000)
  1e-05
  >>> validate_delta(1e-3, dataset_size=8000)
  Traceback (most recent call last):
  ...
  tf_dpnsgd.accounting.validation.AccountingError: `delta` = 0.001 is not below 1/N = 0.000125 (N = 8000): (epsilon, delta)-DP with delta >= 1/N allows publishing about one whole example (each in the clear with probability delta). Choose delta well below 1/N, e.g. 1e-05.
  """
  try:
    value = float(delta)
  except (TypeError, ValueError) as e:
    raise AccountingError(f"`delta` must be a number in (0, 1); got {delta!r}.") from e
  if not 0.0 < value < 1.0:
    raise AccountingError(f"`delta` must lie strictly between 0 and 1; got {delta!r}.")
  if dataset_size is not None and value * int(dataset_size) >= 1.0:
    suggestion = 10.0 ** (math.floor(math.log10(1.0 / int(dataset_size))) - 1)
    raise AccountingError(
        f"`delta` = {value:g} is not below 1/N = {1.0 / int(dataset_size):g} (N = "
        f"{int(dataset_size)}): (epsilon, delta)-DP with delta >= 1/N allows publishing about "
        "one whole example (each in the clear with probability delta). Choose delta well "
        f"below 1/N, e.g. {suggestion:g}.")
  return value


def validate_noise_multiplier(noise_multiplier, allow_zero: bool = False) -> float:
  """Returns ``sigma`` as a float; raises unless it is a finite number > 0 (>= 0 with
  ``allow_zero``).

  ``allow_zero=False`` (accounting, plans): sigma = 0 adds no noise, so epsilon
  is infinite and there is nothing to account. ``allow_zero=True`` (the noise
  mechanism and the optimizers): sigma = 0 is a valid, non-private setting.

  >>> validate_noise_multiplier(0, allow_zero=True), validate_noise_multiplier("1.5")
  (0.0, 1.5)
  """
  bound, why = (">= 0", "") if allow_zero else (
      "> 0", " (sigma = 0 adds no noise: epsilon is infinite)")
  message = f"`noise_multiplier` must be a finite number {bound}; got {noise_multiplier!r}"
  try:
    value = float(noise_multiplier)
  except (TypeError, ValueError) as e:
    raise AccountingError(message + ".") from e
  if not math.isfinite(value) or value < 0.0 or (value == 0.0 and not allow_zero):
    raise AccountingError(message + why + ".")
  return value


def validate_target_epsilon(target_epsilon) -> float:
  try:
    value = float(target_epsilon)
  except (TypeError, ValueError) as e:
    raise AccountingError(f"`target_epsilon` must be a number > 0; got {target_epsilon!r}.") from e
  if not math.isfinite(value) or value <= 0.0:
    raise AccountingError(f"`target_epsilon` must be a finite number > 0; got {target_epsilon!r}.")
  return value


def validate_steps(steps) -> int:
  if not _is_int(steps) or steps < 0:
    raise AccountingError(f"`steps` must be a non-negative integer; got {steps!r}.")
  return int(steps)


def _validate_choice(name, value, choices):
  if value not in choices:
    raise AccountingError(f"`{name}` must be one of {choices}; got {value!r}.")
  return value


def steps_from_epochs(epochs, dataset_size: int, batch_size: int) -> int:
  """``floor(epochs * N / B)``, computed exactly (``epochs`` read as its decimal value).

  >>> steps_from_epochs(100, 50000, 1000)
  5000
  >>> steps_from_epochs(10, 67349, 1000)
  673
  """
  dataset_size, batch_size = validate_dataset_and_batch(dataset_size, batch_size)
  if isinstance(epochs, bool):
    raise AccountingError(f"`epochs` must be a number > 0; got {epochs!r}.")
  try:
    exact = fractions.Fraction(str(epochs)) if isinstance(epochs, float) else \
        fractions.Fraction(epochs)
  except (TypeError, ValueError) as e:
    raise AccountingError(f"`epochs` must be a number > 0; got {epochs!r}.") from e
  if exact <= 0 or not math.isfinite(float(exact)):
    raise AccountingError(f"`epochs` must be a finite number > 0; got {epochs!r}.")
  return math.floor(exact * dataset_size / batch_size)


def steps_per_epoch(dataset_size: int, batch_size: int, sampling: str = "poisson") -> int:
  """The steps of one epoch, the one rule of every entry point (plans, ``make_private``,
  the launchers and their ``--help``, the privacy CLI, ``compute_epsilon``, audits).

  Shuffling: ``N // B``, the full batches of one permutation (what its accountant counts).
  Every other sampling: ``round(N / B)`` (halves up, at least 1), the steps whose
  expected number of examples is closest to one pass over the data.

  >>> steps_per_epoch(1437, 128), steps_per_epoch(1437, 128, "shuffle")
  (11, 11)
  >>> steps_per_epoch(8000, 256), steps_per_epoch(67349, 1000)
  (31, 67)
  >>> steps_per_epoch(1000, 300), steps_per_epoch(1000, 300, "shuffle")
  (3, 3)
  >>> steps_per_epoch(1000, 400), steps_per_epoch(1000, 400, "shuffle")
  (3, 2)
  """
  dataset_size, batch_size = validate_dataset_and_batch(dataset_size, batch_size)
  if sampling == "shuffle":
    return dataset_size // batch_size
  return max(1, (2 * dataset_size + batch_size) // (2 * batch_size))


def planned_steps(epochs, dataset_size: int, batch_size: int, sampling: str = "poisson") -> int:
  """``floor(epochs * steps_per_epoch(N, B, sampling))``, exactly (whole epochs for a whole
  ``epochs``).

  >>> planned_steps(40, 1437, 128), planned_steps(2.5, 1437, 128)
  (440, 27)
  """
  return steps_from_epochs(epochs, steps_per_epoch(dataset_size, batch_size, sampling), 1)


def resolve_steps(dataset_size: int, batch_size: int, steps=None, epochs=None,
                  sampling: str = "poisson") -> int:
  """The step count from exactly one of ``steps`` and ``epochs`` (see :func:`planned_steps`)."""
  if (steps is None) == (epochs is None):
    raise AccountingError("Give exactly one of `steps` and `epochs`.")
  if steps is not None:
    return validate_steps(steps)
  return planned_steps(epochs, dataset_size, batch_size, sampling)


__all__ = ["AccountingError", "UnsupportedAccountingError", "planned_steps", "resolve_steps",
           "steps_from_epochs", "steps_per_epoch",
           "validate_dataset_and_batch", "validate_delta", "validate_noise_multiplier",
           "validate_steps", "validate_target_epsilon"]
