"""Reports: an (epsilon, delta) claim with its assumptions, and epsilon after any step count.

:class:`StepAccountant` computes the RDP of one composition once and
converts ``T`` times it (Mironov 2017, Prop. 1) for any ``T``;
:class:`PrivacyReport` is its answer for one step count, with everything the
number assumes. :func:`compute_epsilon` and :func:`epsilon_for` are the
one-call entry points.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from tf_dpnsgd.accounting.conversions import CONVERTERS, order_epsilons
from tf_dpnsgd.accounting.rdp import rdp_curve
from tf_dpnsgd.accounting.spec import AccountingSpec, make_spec
from tf_dpnsgd.accounting.validation import (AccountingError, resolve_steps, validate_delta,
                                             validate_noise_multiplier, validate_steps)


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
  """An (epsilon, delta) claim together with everything it assumes.

  ``notes`` explain how the number was computed; ``not_covered`` lists what the
  released model depends on that the Gaussian mechanism does NOT cover (layer
  state derived from data, steering by unprivatized training metrics, batches
  taken on trust; see :mod:`tf_dpnsgd.coverage`). An empty ``not_covered`` means
  nothing is known to be uncovered; a planned report (no model yet) has it empty.
  """

  epsilon: float
  delta: float
  noise_multiplier: float
  steps: int
  optimal_order: Optional[float]
  spec: AccountingSpec
  compositions: int
  optimal_bound: Optional[str] = None
  notes: tuple = ()
  target_epsilon: Optional[float] = None
  calibration_tolerance: Optional[float] = None
  not_covered: tuple = ()

  def __post_init__(self):
    if isinstance(self.not_covered, str):
      raise TypeError("`not_covered` must be a sequence of sentences, not one string.")
    object.__setattr__(self, "not_covered", tuple(self.not_covered))

  @property
  def epochs(self) -> float:
    """``steps * B / N`` (expected passes over the data)."""
    return self.steps * self.spec.batch_size / self.spec.dataset_size

  def to_dict(self) -> dict:
    """A JSON-ready dict (``epsilon`` may be ``inf``; JSON writers must allow it)."""
    spec = self.spec
    out = {
        "epsilon": self.epsilon,
        "delta": self.delta,
        "noise_multiplier": self.noise_multiplier,
        "steps": self.steps,
        "epochs": self.epochs,
        "optimal_order": self.optimal_order,
        "dataset_size": spec.dataset_size,
        "batch_size": spec.batch_size,
        "sampling_rate": spec.sampling_rate,
        "sampling": spec.sampling,
        "accountant": spec.accountant,
        "bound": spec.bound,
        "conversion": spec.conversion if spec.accountant == "rdp" else None,
        "neighboring_relation": spec.neighboring_relation.name,
        "compositions": self.compositions,
        "dp_event": repr(spec.composed_event(self.noise_multiplier, self.steps)),
        "assumptions": spec.assumptions(),
        "notes": list(self.notes),
        "not_covered": list(self.not_covered),
    }
    if self.optimal_bound is not None:
      out["optimal_bound"] = self.optimal_bound
    if self.target_epsilon is not None:
      out["target_epsilon"] = self.target_epsilon
      out["calibration_tolerance"] = self.calibration_tolerance
    return out

  def statement(self) -> str:
    """A readable privacy statement (in the spirit of tensorflow-privacy's)."""
    spec = self.spec
    a = spec.assumptions()
    user = spec.sampling == "user_poisson"  # the unit is a user (tf_dpnsgd.users)
    units = "users" if user else "examples"
    lines = [
        f"DP training over N = {spec.dataset_size} {units}, batch size B = {spec.batch_size} "
        f"(q = B/N = {spec.sampling_rate:.6g}), {self.steps} steps ({self.epochs:.4g} epochs), "
        f"noise multiplier {self.noise_multiplier:.6g}.",
    ]
    if self.target_epsilon is not None:
      lines.append(f"The noise multiplier was calibrated to target epsilon "
                   f"{self.target_epsilon:g} (bisection, tolerance "
                   f"{self.calibration_tolerance:g}).")
    order = "" if self.optimal_order is None else f" (optimal RDP order {self.optimal_order:.4g})"
    lines += [
        "",
        f"{'User' if user else 'Example'}-level DP, {a['neighboring_relation']} neighbours, "
        f"at delta = {self.delta:g}:",
        f"    epsilon = {self.epsilon:.6g}{order}",
        "",
        "Assumptions:",
        f"  * Sampling: {a['sampling']}",
        f"  * Sensitivity: {a['sensitivity']}.",
        f"  * Accountant: {a['accountant']}.",
        f"  * Conversion: {a['conversion']}.",
        f"  * The guarantee protects {a['protects']}",
        "  * The sampling randomness (sampler seed) and the noise seed stay secret.",
        ("  * User-level: every row of one user id is in one bounded contribution per step "
         "(at most k rows of it)." if user else
         "  * No user-level guarantee: it assumes each person contributes one example."),
    ]
    if self.optimal_bound is not None:
      lines.append(f"  * At the optimal order the smaller bound was: {self.optimal_bound}.")
    if self.not_covered:
      lines += ["", "Not covered by this epsilon (the released model depends on these "
                "outside the Gaussian mechanism, or on assumptions the package did not "
                "verify):"]
      lines += [f"  * {item}" for item in self.not_covered]
    else:
      lines += ["", "Not covered: nothing known."]
    for note in self.notes:
      lines.append(f"Note: {note}")
    return "\n".join(lines)


class StepAccountant:
  """Epsilon after any number of steps for one (spec, noise multiplier, delta).

  The RDP of one composition is computed once; ``T`` compositions have
  ``T`` times that RDP (Mironov 2017 Prop. 1; BLT noise: ``s_T^2`` times, see
  :meth:`AccountingSpec.rdp_scale`), so ``epsilon(steps)`` is a
  cheap conversion (callbacks call it every batch). PLD results are computed
  by dp-accounting per step count and cached.
  """

  def __init__(self, spec: AccountingSpec, noise_multiplier: float, delta: float):
    if not isinstance(spec, AccountingSpec):
      raise TypeError(f"`spec` must be an AccountingSpec; got {spec!r}.")
    self.spec = spec
    self.noise_multiplier = validate_noise_multiplier(noise_multiplier)
    self.delta = validate_delta(delta, spec.dataset_size)
    self._curve = rdp_curve(spec, self.noise_multiplier) if spec.accountant == "rdp" else None
    self._cache: dict[int, tuple] = {}

  def _compute(self, steps: int) -> tuple:
    k = self.spec.compositions(steps)
    if k == 0 and not self.spec.releases:
      return 0.0, None, None
    if self._curve is None:
      accountant = self.spec.make_accountant()
      accountant.compose(self.spec.composed_event(self.noise_multiplier, steps))
      return float(accountant.get_epsilon(self.delta)), None, None
    curve = self._curve
    rdp = self._rdp_after(steps, k)
    eps, order = CONVERTERS[self.spec.conversion](curve.orders, rdp, self.delta)
    source = None
    if order is not None and self.spec.bound == "min":
      source = curve.source[int(np.argmin(np.abs(curve.orders - order)))]
    return eps, order, source

  def _rdp_after(self, steps: int, k: int) -> np.ndarray:
    """The RDP curve of ``steps`` steps (``k`` compositions) and the releases."""
    curve = self._curve
    # k == 0 (releases only): 0 * inf would be nan at orders where one step is unbounded.
    return (self.spec.rdp_scale(steps) * curve.rdp if k else 0.0) + self.spec.release_rdp(
        curve.orders)

  def order_epsilons(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, epsilons)``: each order's own epsilon after ``steps`` steps (RDP accountant).

    Each is the conversion's value at that order (:func:`conversions.order_epsilons`),
    so :meth:`epsilon` is their minimum, and on a subset of the orders their
    minimum is never below the whole grid's epsilon.
    """
    steps = validate_steps(steps)
    if self._curve is None:
      raise AccountingError("The PLD accountant has no per-order epsilons.")
    orders = self._curve.orders
    rdp = np.broadcast_to(self._rdp_after(steps, self.spec.compositions(steps)), orders.shape)
    return orders, order_epsilons(self.spec.conversion, orders, rdp, self.delta)

  def _lookup(self, steps: int) -> tuple:
    steps = validate_steps(steps)
    if steps not in self._cache:
      self._cache[steps] = self._compute(steps)
    return self._cache[steps]

  def epsilon(self, steps: int) -> float:
    """Epsilon after ``steps`` steps (0 for 0 steps)."""
    return self._lookup(steps)[0]

  def report(self, steps: int, target_epsilon=None, calibration_tolerance=None) -> PrivacyReport:
    eps, order, source = self._lookup(steps)
    notes = list(self._curve.notes) if self._curve is not None else []
    if self.spec.sampling == "shuffle":
      notes.append("Shuffling: no privacy amplification is claimed (none is proven); the "
                   "epsilon counts each epoch as one full-batch Gaussian mechanism.")
    if self.spec.releases:
      notes.append(self.spec.assumptions()["releases"])
    if self.spec.sampling == "shuffle" and self.spec.dataset_size % self.spec.batch_size:
      notes.append(f"N mod B = {self.spec.dataset_size % self.spec.batch_size} examples are "
                   "left out of each epoch (a different random set each epoch).")
    return PrivacyReport(epsilon=eps, delta=self.delta, noise_multiplier=self.noise_multiplier,
                         steps=int(steps), optimal_order=order, spec=self.spec,
                         compositions=self.spec.compositions(steps), optimal_bound=source,
                         notes=tuple(notes), target_epsilon=target_epsilon,
                         calibration_tolerance=calibration_tolerance)

  def max_steps(self, epsilon_budget: float, limit: int = 10 ** 9) -> int:
    """The largest step count whose epsilon is at most ``epsilon_budget`` (epsilon is
    non-decreasing in the step count); ``limit`` if even that many fit."""
    budget = float(epsilon_budget)
    if math.isnan(budget) or budget < 0:
      raise AccountingError(f"`epsilon_budget` must be >= 0; got {epsilon_budget!r}.")
    if self.epsilon(1) > budget:
      return 0
    lo, hi = 1, 2
    while hi < limit and self.epsilon(hi) <= budget:
      lo, hi = hi, min(2 * hi, limit)
    if self.epsilon(hi) <= budget:
      return hi
    while hi - lo > 1:  # invariant: eps(lo) <= budget < eps(hi)
      mid = (lo + hi) // 2
      if self.epsilon(mid) <= budget:
        lo = mid
      else:
        hi = mid
    return lo


def compute_epsilon(dataset_size: int, batch_size: int, noise_multiplier: float, delta: float,
                    sampling: str, steps: Optional[int] = None, epochs=None,
                    accountant: str = "rdp", bound: str = "default",
                    conversion: str = "modern", orders=None) -> PrivacyReport:
  """Epsilon of a DP training run whose batches are drawn by ``sampling``.

  Args:
    dataset_size: ``N``.
    batch_size: ``B`` (expected batch size for Poisson).
    noise_multiplier: ``sigma`` (noise std / per-example bound ``S``), > 0.
    delta: in (0, 1).
    sampling: ``"poisson"``, ``"uniform"`` or ``"shuffle"``.
    steps / epochs: exactly one; ``steps = floor(epochs * steps_per_epoch)``
      (:func:`~tf_dpnsgd.accounting.steps_per_epoch`: ``round(N / B)``, ``N // B`` for shuffling).
    accountant, bound, conversion, orders: see :class:`AccountingSpec`.

  Returns:
    A :class:`PrivacyReport` (epsilon, optimal order, assumptions).

  Raises:
    AccountingError: invalid input or unsupported combination (never a silent number).

  >>> r = compute_epsilon(60000, 256, 1.1, 1e-5, "poisson", epochs=60)
  >>> r.steps, round(r.epsilon, 2)  # 60 epochs of round(60000 / 256) = 234 steps
  (14040, 2.59)
  """
  spec = make_spec(dataset_size, batch_size, sampling, accountant, bound, conversion, orders)
  steps = resolve_steps(spec.dataset_size, spec.batch_size, steps, epochs, spec.sampling)
  return StepAccountant(spec, noise_multiplier, delta).report(steps)


def epsilon_for(spec: AccountingSpec, noise_multiplier: float, steps: int, delta: float) -> float:
  """Epsilon of ``steps`` steps under ``spec`` (a plain number)."""
  return StepAccountant(spec, noise_multiplier, delta).epsilon(steps)


__all__ = ["PrivacyReport", "StepAccountant", "compute_epsilon", "epsilon_for"]
