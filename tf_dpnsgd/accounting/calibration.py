"""Calibration: the smallest noise multiplier that meets a target epsilon."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from tf_dpnsgd.accounting.paper_bound import PaperBoundConditionError, paper_bound_conditions
from tf_dpnsgd.accounting.report import PrivacyReport, StepAccountant, epsilon_for
from tf_dpnsgd.accounting.spec import AccountingSpec, make_spec
from tf_dpnsgd.accounting.validation import (AccountingError, resolve_steps, validate_delta,
                                             validate_steps, validate_target_epsilon)


def calibrate_noise_multiplier(spec: AccountingSpec, target_epsilon: float, steps: int,
                               delta: float, tolerance: float = 1e-3,
                               max_noise_multiplier: float = 1e4) -> float:
  """The smallest noise multiplier (to ``tolerance``) whose epsilon is at most the target.

  Bisection on ``sigma`` (epsilon is non-increasing in ``sigma``). The
  returned value is the upper end of the final bracket, so it always meets
  the target: ``epsilon(result) <= target_epsilon`` and ``result - sigma* <=
  tolerance`` for the exact minimum ``sigma*`` (within the grid's resolution).
  With ``bound="paper"``, noise multipliers at which a sigma-dependent hypothesis
  of Bun et al. (2018) Thm. 11 fails (``rho``, ``log_sampling_ratio``,
  ``order_range``: see :func:`paper_bound_conditions`) count as infeasible
  (infinite epsilon), so the result is always a sigma where the theorem
  applies. The feasible set is an interval ``[sigma_0, inf)`` (each condition
  only gets easier as ``sigma`` grows), so the bisection stays valid.

  Raises:
    AccountingError: if no ``sigma <= max_noise_multiplier`` reaches the target.
  """
  target = validate_target_epsilon(target_epsilon)
  delta = validate_delta(delta, spec.dataset_size)
  steps = validate_steps(steps)
  if not tolerance > 0:
    raise AccountingError(f"`tolerance` must be > 0; got {tolerance!r}.")
  if steps == 0:
    raise AccountingError("Zero steps spend no privacy: there is no noise multiplier to calibrate.")

  def eps(sigma: float) -> float:
    try:
      return epsilon_for(spec, sigma, steps, delta)
    except PaperBoundConditionError as e:
      if e.condition != "sampling_ratio":
        return math.inf
      raise

  hi = 1.0
  while eps(hi) > target:
    if hi >= max_noise_multiplier:
      raise AccountingError(
          f"No noise multiplier up to {max_noise_multiplier:g} reaches epsilon {target:g} "
          f"under {spec}.")
    hi = min(2.0 * hi, max_noise_multiplier)
  lo = hi / 2.0
  while eps(lo) <= target:
    hi, lo = lo, lo / 2.0
    if lo < 1e-6:
      raise AccountingError(f"Epsilon stays below {target:g} for any noise multiplier: "
                            "check the inputs.")
  while hi - lo > tolerance:  # invariant: eps(lo) > target >= eps(hi)
    mid = 0.5 * (lo + hi)
    if eps(mid) <= target:
      hi = mid
    else:
      lo = mid
  return hi


def calibrate(dataset_size: int, batch_size: int, target_epsilon: float, delta: float,
              sampling: str, steps: Optional[int] = None, epochs=None, accountant: str = "rdp",
              bound: str = "default", conversion: str = "modern", orders=None,
              tolerance: float = 1e-3) -> PrivacyReport:
  """Calibrates the noise multiplier to ``target_epsilon``; returns the report at that sigma."""
  spec = make_spec(dataset_size, batch_size, sampling, accountant, bound, conversion, orders)
  steps = resolve_steps(spec.dataset_size, spec.batch_size, steps, epochs, spec.sampling)
  sigma = calibrate_noise_multiplier(spec, target_epsilon, steps, delta, tolerance)
  report = StepAccountant(spec, sigma, delta).report(
      steps, target_epsilon=float(target_epsilon), calibration_tolerance=float(tolerance))
  below = sigma - tolerance
  if spec.bound == "paper" and below > 0 and paper_bound_conditions(
      spec.sampling_rate, spec.accountant_noise_multiplier(below)):
    report = dataclasses.replace(report, notes=report.notes + (
        f"The calibrated noise multiplier is set by the conditions of Bun et al. 2018 "
        f"Thm. 11, not by the target: below sigma = {sigma:.6g} (to the tolerance) the "
        f"paper's bound does not apply (rho = 2 / sigma^2 > 0.1), and at this sigma epsilon "
        f"is {report.epsilon:.4g}.",))
  return report


__all__ = ["calibrate", "calibrate_noise_multiplier"]
