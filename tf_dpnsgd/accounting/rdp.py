"""RDP curves: one composition under a spec, and the algebra of curves.

An RDP curve is a pair ``(orders, rdp)``: the mechanism is ``(alpha,
rdp[alpha])``-RDP at each order ``alpha > 1`` (``+inf`` where no bound is
claimed).

* :func:`rdp_curve`: the curve of ONE composition (a step; an epoch for
  shuffling) under an :class:`~tf_dpnsgd.accounting.AccountingSpec`: dp-accounting's,
  the paper's bound (where Bun et al.'s conditions hold) or their pointwise
  minimum. ``T`` compositions have ``T`` times that RDP (Mironov 2017, Prop. 1).
* The algebra (independent of specs, used by :mod:`tf_dpnsgd.tuning`):
  :func:`validate_curve`, :func:`monotone_rdp` (monotonicity in the order),
  :func:`common_orders`, :func:`composed_rdp` (sum: adaptive composition),
  :func:`worst_case_rdp` (pointwise maximum: a data-independent mixture),
  :func:`rdp_to_epsilon` and its inverse :func:`rdp_to_delta`.

References:
  Mironov (2017), "Renyi Differential Privacy": Prop. 1 (composition), Prop. 3
  (conversion), monotonicity in the order.
  van Erven, Harremoes (2014), "Renyi Divergence and Kullback-Leibler
  Divergence", IEEE Trans. Inf. Theory: Thm. 3 (monotone in the order),
  Thm. 13 (joint quasi-convexity).
  Canonne, Kamath, Steinke (2020), "The Discrete Gaussian for Differential
  Privacy", Prop. 12 (the "modern" conversion).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from typing import Optional, Sequence

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from tf_dpnsgd.accounting import curve_cache
from tf_dpnsgd.accounting.conversions import CONVERTERS
from tf_dpnsgd.accounting.paper_bound import (PaperBoundConditionError, paper_bound_conditions,
                                              paper_conditions_message, paper_order_limit,
                                              paper_subsampled_gaussian_rdp)
from tf_dpnsgd.accounting.spec import CONVERSIONS, AccountingSpec
from tf_dpnsgd.accounting.validation import (AccountingError, UnsupportedAccountingError,
                                             validate_noise_multiplier)


# --------------------------------------------------------------------------
# The per-composition curve under a spec.
# --------------------------------------------------------------------------
class _CollectExcludedOrders(logging.Filter):
  """Turns dp-accounting's per-order "failed to converge" warnings into one note.

  dp-accounting sets the RDP of such an order to +inf (it is excluded, which is
  conservative) and logs one warning per order and call.
  """

  def __init__(self):
    super().__init__()
    self.orders = []

  def filter(self, record):
    message = record.getMessage()
    if "_compute_log_a_frac failed to converge" not in message:
      return True
    match = re.search(r"alpha=([0-9]+(?:\.[0-9]+)?)", message)
    self.orders.append(float(match.group(1)) if match else math.nan)
    return False


def _dp_accounting_rdp(spec: AccountingSpec, noise_multiplier: float,
                       orders: Sequence[float]) -> tuple[np.ndarray, tuple]:
  """dp-accounting's RDP of one composition, and notes on orders it had to exclude.

  A pure function of the event, the neighbouring relation and the orders, so it is
  memoised (:func:`_rdp_of_event`): a Poisson event over the default 300 orders costs about
  0.4 s, and plans, reports, sweeps and calibrations ask for the same curve again and again.
  """
  rdp, notes = _rdp_of_event(spec.event(noise_multiplier), spec.neighboring_relation,
                             tuple(float(o) for o in orders))
  return np.array(rdp), notes


@functools.lru_cache(maxsize=512)
def _rdp_of_event(event, neighboring_relation, orders: tuple) -> tuple[tuple, tuple]:
  """dp-accounting's RDP of one ``event`` at ``orders`` (immutable, so the memo is safe).

  With ``TF_DPNSGD_RDP_CACHE`` set, also kept on disk for other processes
  (:mod:`tf_dpnsgd.accounting.curve_cache`: exact values under an exact key).
  """
  folder = curve_cache.directory()
  if folder:
    k = curve_cache.key(event, neighboring_relation, orders)
    kept = curve_cache.load(folder, k)
    if kept is not None and len(kept[0]) == len(orders):
      return kept
  accountant = dp_accounting.rdp.RdpAccountant(list(orders), neighboring_relation)
  collector = _CollectExcludedOrders()
  logger = logging.getLogger("absl")
  logger.addFilter(collector)
  try:
    accountant.compose(event)
  finally:
    logger.removeFilter(collector)
  notes = ()
  if collector.orders:
    notes = (f"dp-accounting could not evaluate {len(collector.orders)} small fractional "
             f"order(s) ({min(collector.orders):g} to {max(collector.orders):g}); they are "
             "excluded (RDP = inf there), which can only increase epsilon.",)
  rdp = tuple(float(v) for v in accountant.rdp)
  if folder:
    curve_cache.store(folder, k, rdp, notes)
  return rdp, notes


@dataclasses.dataclass(frozen=True)
class RdpCurve:
  """RDP of one composition at each order; ``source`` says which bound gave each value."""

  orders: np.ndarray
  rdp: np.ndarray
  source: tuple
  notes: tuple = ()


def rdp_curve(spec: AccountingSpec, noise_multiplier: float) -> RdpCurve:
  """The per-composition RDP curve under ``spec``'s bound.

  With ``bound="paper"`` or ``"min"`` the paper's bound is used only where all
  hypotheses of Bun et al. (2018) Thm. 11 hold at ``s = sigma / 2``
  (:func:`paper_bound_conditions`). Where one fails, ``"paper"`` raises and
  ``"min"`` is dp-accounting's bound alone, with a note saying why.

  Raises:
    UnsupportedAccountingError: for the PLD accountant (no RDP curve).
    PaperBoundConditionError: ``bound="paper"`` and a hypothesis of the theorem
      fails at this ``sigma`` (``condition`` names the first; the message gives
      every failed one with its numbers).
  """
  if spec.accountant != "rdp":
    raise UnsupportedAccountingError("The PLD accountant has no RDP curve.")
  sigma = validate_noise_multiplier(noise_multiplier)
  orders = list(spec.rdp_orders)
  if spec.bound == "default":
    rdp, notes = _dp_accounting_rdp(spec, sigma, orders)
    return RdpCurve(np.asarray(orders), rdp, ("dp-accounting",) * len(orders), notes)

  s = spec.accountant_noise_multiplier(sigma)
  gamma = spec.sampling_rate
  failed = paper_bound_conditions(gamma, s)
  if failed:
    message = paper_conditions_message(
        failed, f"at sigma = {sigma:.6g} (s = sigma/2 = {s:.4g}, q = B/N = {gamma:.4g})")
    if spec.bound == "paper":
      raise PaperBoundConditionError(
          failed[0][0], message + f" With q < 0.1 every condition holds once rho <= 0.1, i.e. "
          f"sigma >= 2 sqrt(5) = {2 * math.sqrt(5):.4f}; or use bound='default' or 'min'.")
    default, notes = _dp_accounting_rdp(spec, sigma, orders)
    notes += (message + " The minimum is dp-accounting's bound alone.",)
    return RdpCurve(np.asarray(orders), default, ("dp-accounting",) * len(orders), notes)

  limit = paper_order_limit(gamma, s)
  if limit not in orders:
    orders = sorted(orders + [limit])
  paper = paper_subsampled_gaussian_rdp(gamma, s, orders)
  if spec.bound == "paper":
    return RdpCurve(np.asarray(orders), paper, ("paper",) * len(orders))

  default, notes = _dp_accounting_rdp(spec, sigma, orders)
  use_paper = paper < default
  return RdpCurve(np.asarray(orders), np.where(use_paper, paper, default),
                  tuple("paper" if p else "dp-accounting" for p in use_paper), notes)


# --------------------------------------------------------------------------
# The algebra of curves: validation, order monotonicity, composition, worst case.
# --------------------------------------------------------------------------
def validate_curve(orders, rdp) -> tuple[np.ndarray, np.ndarray]:
  """Returns ``(orders, rdp)`` as float arrays sorted by order.

  Raises:
    AccountingError: different lengths, an order ``<= 1`` or not finite, a NaN or
      negative RDP value (``+inf`` is allowed: no bound at that order).
  """
  orders = np.asarray(orders, dtype=np.float64).ravel()
  rdp = np.asarray(rdp, dtype=np.float64).ravel()
  if orders.shape != rdp.shape or orders.size == 0:
    raise AccountingError(f"`orders` and `rdp` must be non-empty and of the same length; "
                          f"got {orders.size} and {rdp.size}.")
  if not np.all(np.isfinite(orders)) or np.any(orders <= 1.0):
    raise AccountingError(f"RDP orders must be finite and > 1; got {orders.tolist()}.")
  if np.any(np.isnan(rdp)) or np.any(rdp < 0):
    raise AccountingError("RDP values must be >= 0 (inf allowed where no bound holds); got "
                          f"{rdp.tolist()}.")
  if len(np.unique(orders)) != orders.size:
    raise AccountingError("RDP orders must be distinct.")
  i = np.argsort(orders)
  return orders[i], rdp[i]


def monotone_rdp(orders, rdp) -> np.ndarray:
  """Tightens an RDP bound with its monotonicity in the order.

  Renyi divergence is non-decreasing in the order (van Erven & Harremoes 2014,
  Thm. 3), so ``(b, e)``-RDP implies ``(a, e)``-RDP for every ``a <= b``; the
  bound at ``a`` is the minimum of the bounds at orders ``>= a``.

  >>> monotone_rdp([2.0, 3.0, 4.0], [5.0, 1.0, 2.0]).tolist()
  [1.0, 1.0, 2.0]
  """
  orders, rdp = validate_curve(orders, rdp)
  return np.minimum.accumulate(rdp[::-1])[::-1]


def common_orders(curves: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
  """Restricts ``[(orders, rdp), ...]`` to the orders all curves share.

  Returns ``(orders, matrix)`` with one row per curve. Dropping orders only
  removes candidate bounds, so any epsilon computed from the result is valid
  (never smaller than with more orders).

  Raises:
    AccountingError: no curves, or no order common to all.
  """
  if not curves:
    raise AccountingError("No RDP curves given.")
  checked = [validate_curve(o, r) for o, r in curves]
  shared = checked[0][0]
  for o, _ in checked[1:]:
    shared = np.intersect1d(shared, o)
  if shared.size == 0:
    raise AccountingError("The RDP curves share no order.")
  rows = [r[np.searchsorted(o, shared)] for o, r in checked]
  return shared, np.vstack(rows)


def composed_rdp(curves: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
  """RDP of running (and releasing) all the runs: the sum of their curves.

  Adaptive composition, Mironov (2017) Prop. 1. The naive bound on a sweep
  that publishes every cell.
  """
  orders, matrix = common_orders(curves)
  return orders, matrix.sum(axis=0)


def worst_case_rdp(curves: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
  """RDP of one trial that runs a data-independently chosen one of the runs.

  A mixture (with data-independent weights) of mechanisms that are each
  ``(lambda, e_i)``-RDP is ``(lambda, max_i e_i)``-RDP, by the joint
  quasi-convexity of Renyi divergence (van Erven & Harremoes 2014, Thm. 13).
  Used when the trials of a random search have different noise multipliers
  or step counts: the pointwise maximum over the grid's curves.
  """
  orders, matrix = common_orders(curves)
  return orders, matrix.max(axis=0)


# --------------------------------------------------------------------------
# Curves <-> (epsilon, delta), with the package's conversions.
# --------------------------------------------------------------------------
def validate_conversion(conversion: str) -> str:
  """Returns ``conversion`` unless it is not one of :data:`~tf_dpnsgd.accounting.CONVERSIONS`."""
  if conversion not in CONVERSIONS:
    raise AccountingError(f"`conversion` must be one of {CONVERSIONS}; got {conversion!r}.")
  return conversion


def rdp_to_epsilon(orders, rdp, delta: float, conversion: str = "modern"
                   ) -> tuple[float, Optional[float]]:
  """``(epsilon, optimal order)`` at ``delta``: :func:`~tf_dpnsgd.accounting.modern_epsilon`
  or :func:`~tf_dpnsgd.accounting.classic_epsilon`, the conversions every run report uses."""
  orders, rdp = validate_curve(orders, rdp)
  return CONVERTERS[validate_conversion(conversion)](orders, rdp, delta)


def rdp_to_delta(orders, rdp, epsilon: float, conversion: str = "modern") -> float:
  """The smallest ``delta`` such that the curve implies ``(epsilon, delta)``-DP.

  * ``classic``: Mironov (2017) Prop. 3 solved for delta:
    ``min_a exp((a - 1) (rdp(a) - epsilon))``.
  * ``modern``: dp-accounting's ``compute_delta`` (Canonne, Kamath, Steinke
    2020 Prop. 12, and the KL bound ``sqrt(1 - exp(-rdp))``).

  Both are inverses of :func:`rdp_to_epsilon` with the same conversion.
  Result capped at 1.

  >>> round(rdp_to_delta([2.0, 3.0], [0.5, 1.0], 1.5, "classic"), 6)   # exp(-1) at a = 2
  0.367879
  """
  orders, rdp = validate_curve(orders, rdp)
  conversion = validate_conversion(conversion)
  if not epsilon >= 0:
    raise AccountingError(f"`epsilon` must be >= 0; got {epsilon!r}.")
  if conversion == "modern":
    finite = np.isfinite(rdp)
    if not np.any(finite):
      return 1.0
    delta, _ = _rdp_lib.compute_delta(orders[finite].tolist(), rdp[finite].tolist(), epsilon)
    return min(float(delta), 1.0)
  with np.errstate(over="ignore", invalid="ignore"):
    log_delta = (orders - 1.0) * (rdp - epsilon)
  log_delta = np.where(np.isnan(log_delta), np.inf, log_delta)
  return float(min(1.0, math.exp(min(0.0, float(np.min(log_delta))))))


__all__ = ["RdpCurve", "common_orders", "composed_rdp", "monotone_rdp", "rdp_curve",
           "rdp_to_delta", "rdp_to_epsilon", "validate_conversion", "validate_curve",
           "worst_case_rdp"]
