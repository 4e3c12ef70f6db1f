"""Calibration: the smallest noise multiplier that meets a target epsilon."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from tf_dpnsgd.accounting.paper_bound import PaperBoundConditionError, paper_bound_conditions
from tf_dpnsgd.accounting.report import PrivacyReport, StepAccountant
from tf_dpnsgd.accounting.spec import AccountingSpec, make_spec
from tf_dpnsgd.accounting.validation import (AccountingError, resolve_steps, validate_delta,
                                             validate_steps, validate_target_epsilon)


#: Orders on each side of the last optimal order that :func:`within_target_on_few_orders` tries.
WINDOW = 4


def within_target_on_few_orders(spec: AccountingSpec, sigma: float, steps: int, delta: float,
                                target: float, order: float) -> bool:
  """True only if ``epsilon_for(spec, sigma, steps, delta) <= target``, from a few orders.

  Epsilon on an RDP grid is the minimum over its orders of a per-order value
  that depends on that order's RDP alone (both conversions; dp-accounting
  evaluates each order on its own; the paper's bound too), so on a subset of
  the orders it is a minimum over fewer of the same values: never below the
  full grid's. At most the target on the ``2 WINDOW + 1`` orders around
  ``order`` (the last optimum: a bisection moves it little) therefore settles
  "yes" for the full grid, at a fraction of its cost (the full grid's large
  integer orders cost the most). False means "not settled" (not "above the
  target"): the caller asks the full grid. An error (a condition of the paper's
  bound) also settles nothing. The subset's values are each order's own
  (:meth:`StepAccountant.order_epsilons`), not the conversion of the subset as a curve: a subset
  whose RDP values are all 0 (underflow at tiny sampling rates) is not a curve
  that says epsilon 0 unless the whole grid's is.
  """
  orders = spec.rdp_orders
  i = min(range(len(orders)), key=lambda j: abs(orders[j] - order))
  try:
    _, eps = _order_epsilons(spec, orders[max(0, i - WINDOW):i + WINDOW + 1], sigma, delta,
                             steps)
  except AccountingError:
    return False
  return bool(eps.size) and float(np.min(eps)) <= target


def _order_epsilons(spec: AccountingSpec, orders: tuple, sigma: float, delta: float,
                    steps: int) -> tuple[np.ndarray, np.ndarray]:
  """Each of ``orders``' own epsilon (:meth:`StepAccountant.order_epsilons`) under ``spec``."""
  if tuple(orders) != tuple(spec.rdp_orders):
    spec = dataclasses.replace(spec, orders=tuple(orders))
  return StepAccountant(spec, sigma, delta).order_epsilons(steps)


#: An order is known to be above the target at ``sigma`` only if its epsilon at a larger
#: ``sigma`` exceeded the target by this much (relative): room for the rounding and series
#: truncation of dp-accounting's values, far below any calibration's tolerance.
EXCLUSION_MARGIN = 1e-6


def orders_monotone_in_sigma(spec: AccountingSpec) -> bool:
  """Whether each order's epsilon is non-increasing in ``sigma`` for ``spec``, as computed.

  True for dp-accounting's exact RDP of the Gaussian and of the Poisson-subsampled
  Gaussian mechanism (data processing: more noise is a post-processing of less,
  with the same sampling), and for its bound for sampling without replacement
  (Wang et al. 2019, Thm. 27: every term grows with the Gaussian's RDP
  ``alpha / (2 sigma^2)``, fractional orders a fixed mix of the two integers
  around them). Not claimed for the paper's bound (its order grid depends on
  ``sigma``) or for the PLD accountant (no orders). ``tests/test_accounting.py``
  checks the premise on dp-accounting's numbers.
  """
  return (spec.accountant == "rdp" and spec.bound == "default"
          and spec.sampling in ("poisson", "cyclic_poisson", "user_poisson", "shuffle",
                                "uniform"))


def epsilon_floor(conversion: str, order: float, delta: float) -> float:
  """The least epsilon ``order`` can give, whatever its RDP ``r``, if ``r >= -log1p(-delta^2)``.

  Classic (Mironov 2017, Prop. 3): ``r + log(1/delta) / (order - 1) >= log(1/delta) /
  (order - 1)``. Modern (dp-accounting's ``compute_epsilon``): ``r + log1p(-1/order) -
  log(delta order) / (order - 1)`` for ``order > 1.01`` (infinite at or below), once ``r``
  is past the bound under which it says 0 (``delta^2 + expm1(-r) > 0``).
  """
  if order <= 1.0:
    return math.inf
  if conversion == "classic":
    return math.log(1.0 / delta) / (order - 1.0)
  if order <= 1.01:
    return math.inf
  return math.log1p(-1.0 / order) - math.log(delta * order) / (order - 1.0)


def rdp_lower_bound(spec: AccountingSpec, sigma: float, steps: int) -> float:
  """A lower bound on the RDP of ``steps`` steps at every order (0 where none is derived here).

  A Renyi divergence of order > 1 is at least the KL divergence, which is at least
  ``2 TV^2`` (Pinsker). One Gaussian mechanism of noise multiplier ``m`` (the
  accountant's convention) has ``TV = erf(1 / (2 sqrt(2) m))``; Poisson sampling at
  rate ``q`` mixes it with the unchanged distribution, ``TV = q erf(...)``; RDP adds
  up over the :meth:`AccountingSpec.rdp_scale` compositions (releases only add more).
  Without replacement: 0 (not derived).
  """
  if spec.sampling == "uniform" and not spec.blt:
    return 0.0
  tv = math.erf(1.0 / (2.0 * math.sqrt(2.0) * spec.accountant_noise_multiplier(sigma)))
  if not spec.blt and spec.sampling != "shuffle":
    tv *= spec.sampling_rate
  return spec.rdp_scale(steps) * 2.0 * tv * tv


class _OrdersAboveTarget:
  """Orders known to be above the target at a ``sigma``, from evaluations at larger ones.

  If an order's epsilon exceeded the target at ``sigma'``, it does at every
  ``sigma <= sigma'`` (:func:`orders_monotone_in_sigma`). So a "no" at ``sigma``
  needs only the other orders: their minimum above the target means the full
  grid's is (every order is), and at most the target means the full grid's is
  too (fewer orders never give less). Either way the full grid's decision.

  Orders whose :func:`epsilon_floor` is above the target are above it at every
  ``sigma`` where :func:`rdp_lower_bound` keeps the RDP past dp-accounting's
  zero (the small fractional orders for the usual targets: the costliest where
  ``q`` is large); they are never evaluated there.
  """

  def __init__(self, spec: AccountingSpec, steps: int, delta: float, target: float):
    self.spec, self.steps, self.delta, self.target = spec, steps, delta, target
    self.threshold = target + EXCLUSION_MARGIN * max(1.0, target)
    self.evaluated = []  # (sigma, {order: epsilon})
    self.floored = frozenset(a for a in spec.rdp_orders
                             if epsilon_floor(spec.conversion, a, delta) > self.threshold)
    self.zero_below = -math.log1p(-delta * delta)  # RDP under which 'modern' says 0

  def covers(self, sigma: float) -> bool:
    """Whether an evaluation at a ``sigma' >= sigma`` left fewer orders to evaluate."""
    return any(s >= sigma for s, _ in self.evaluated)

  def unknown_orders(self, sigma: float) -> tuple:
    floored = self.floored if (self.floored and rdp_lower_bound(
        self.spec, sigma, self.steps) > 2.0 * self.zero_below) else frozenset()
    # Only a finite epsilon is a witness: an infinite one can be dp-accounting failing at a
    # small fractional order, at a larger sigma but not a smaller one (seen at q = 0.25).
    return tuple(a for a in self.spec.rdp_orders if a not in floored and not any(
        s >= sigma and self.threshold < e.get(a, -math.inf) < math.inf
        for s, e in self.evaluated))

  def evaluate(self, sigma: float) -> tuple[float, Optional[float]]:
    """Epsilon on the orders not yet known to be above the target at ``sigma`` (their
    minimum) and its order: the full grid's decision against the target."""
    orders = self.unknown_orders(sigma)
    if not orders:  # every order is above the target at this sigma
      return math.inf, None
    grid, eps = _order_epsilons(self.spec, orders, sigma, self.delta, self.steps)
    self.evaluated.append((sigma, dict(zip(grid.tolist(), eps.tolist()))))
    i = int(np.argmin(eps))
    return max(0.0, float(eps[i])), float(grid[i])


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

  Each step's decision is the full grid's; where a few orders around the last
  optimum already meet the target the full grid is not evaluated (it could
  only give a smaller epsilon: :func:`within_target_on_few_orders`), so the
  result is the same as evaluating every order every time; the steps answered
  "yes" that way are cheaper (how many depends on the search's path: 1 of 10
  to about half in the plans measured). Where each order's epsilon is
  non-increasing in sigma (:func:`orders_monotone_in_sigma`: dp-accounting's
  bounds for every sampling), a step evaluates only the orders not
  already seen above the target at a larger sigma (:class:`_OrdersAboveTarget`),
  again the full grid's decision; every order is evaluated once or twice in a
  calibration instead of at every "no" (a calibration 2-6x faster in the plans
  measured). Every "yes" is computed, never inferred, so even if an accountant
  broke that premise the result would still meet the target.

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

  last_order = []  # the optimal order of the last evaluation on the full grid
  above = (_OrdersAboveTarget(spec, steps, delta, target) if orders_monotone_in_sigma(spec)
           else None)
  decided = {}  # sigma -> its decision (the halving starts where the doubling said "no")

  def eps(sigma: float) -> float:
    try:
      report = StepAccountant(spec, sigma, delta).report(steps)
    except PaperBoundConditionError as e:
      if e.condition != "sampling_ratio":
        return math.inf
      raise
    if report.optimal_order is not None:
      last_order[:] = [report.optimal_order]
    return report.epsilon

  def decide(sigma: float) -> bool:
    # Where no larger sigma was evaluated on every order yet (the doubling), every order
    # is evaluated: a cheap "yes" would leave the bisection's "no"s below it on every order.
    if last_order and spec.accountant == "rdp" and (
        above is None or above.covers(sigma)) and within_target_on_few_orders(
            spec, sigma, steps, delta, target, last_order[0]):
      return True
    if above is None:
      return eps(sigma) <= target
    epsilon, order = above.evaluate(sigma)
    if math.isfinite(epsilon) and epsilon > 0:
      last_order[:] = [order]
    return epsilon <= target

  def meets_target(sigma: float) -> bool:
    """``eps(sigma) <= target``, decided exactly as the full grid of orders decides it."""
    if sigma not in decided:
      decided[sigma] = decide(sigma)
    return decided[sigma]

  hi = 1.0
  while not meets_target(hi):
    if hi >= max_noise_multiplier:
      raise AccountingError(
          f"No noise multiplier up to {max_noise_multiplier:g} reaches epsilon {target:g} "
          f"under {spec}.")
    hi = min(2.0 * hi, max_noise_multiplier)
  lo = hi / 2.0
  while meets_target(lo):
    hi, lo = lo, lo / 2.0
    if lo < 1e-6:
      raise AccountingError(f"Epsilon stays below {target:g} for any noise multiplier: "
                            "check the inputs.")
  while hi - lo > tolerance:  # invariant: eps(lo) > target >= eps(hi)
    mid = 0.5 * (lo + hi)
    if meets_target(mid):
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


__all__ = ["calibrate", "calibrate_noise_multiplier", "within_target_on_few_orders"]
