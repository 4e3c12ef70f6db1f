"""RDP to (epsilon, delta): the two conversions every report in this package uses.

* ``"modern"``: dp-accounting's default, Canonne, Kamath, Steinke (2020)
  Prop. 12 / Asoodeh et al. (2021): ``eps = r + log1p(-1/a) - log(delta *
  a) / (a - 1)`` (:func:`modern_epsilon`).
* ``"classic"``: Mironov (2017) Prop. 3, ``eps = r + log(1/delta) / (a -
  1)``, what the paper and older tensorflow-privacy used
  (:func:`classic_epsilon`).

Both minimise over the given orders and return the optimal one.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from tf_dpnsgd.accounting.validation import AccountingError, validate_delta


def _curve(orders, rdp) -> tuple[np.ndarray, np.ndarray]:
  orders = np.asarray(orders, dtype=np.float64)
  rdp = np.asarray(rdp, dtype=np.float64)
  if orders.shape != rdp.shape:
    raise AccountingError("`orders` and `rdp` must have the same length.")
  return orders, rdp


def _classic_values(orders: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
  """Each order's ``rdp + log(1/delta) / (a - 1)``; infinite at orders ``<= 1`` and for NaN."""
  with np.errstate(divide="ignore", invalid="ignore"):
    eps = np.where(orders > 1.0, rdp + math.log(1.0 / delta) / (orders - 1.0), np.inf)
  return np.where(np.isnan(eps), np.inf, eps)


def classic_epsilon(orders: Sequence[float], rdp: Sequence[float],
                    delta: float) -> tuple[float, Optional[float]]:
  """Mironov (2017) Prop. 3: ``min_a rdp(a) + log(1/delta) / (a - 1)`` and the optimal order.

  Orders ``<= 1`` and infinite RDP values are skipped; all zero RDP gives 0.

  >>> eps, order = classic_epsilon([2.0, 3.0], [0.5, 1.0], math.exp(-1.0))
  >>> round(eps, 6), order
  (1.5, 2.0)
  """
  delta = validate_delta(delta)
  orders, rdp = _curve(orders, rdp)
  if np.all(rdp == 0):
    return 0.0, None
  eps = _classic_values(orders, rdp, delta)
  i = int(np.argmin(eps))
  if not math.isfinite(eps[i]):
    return math.inf, None
  return max(0.0, float(eps[i])), float(orders[i])


def modern_epsilon(orders: Sequence[float], rdp: Sequence[float],
                   delta: float) -> tuple[float, Optional[float]]:
  """dp-accounting's conversion (its default): epsilon and the optimal order."""
  delta = validate_delta(delta)
  rdp = np.asarray(rdp, dtype=np.float64)
  if np.all(rdp == 0):
    return 0.0, None
  eps, order = _rdp_lib.compute_epsilon(list(orders), list(rdp), delta)
  if not math.isfinite(eps):
    return math.inf, None
  return float(eps), float(order)


# The conversions by name (``AccountingSpec.conversion``).
CONVERTERS = {"modern": modern_epsilon, "classic": classic_epsilon}


def order_epsilons(conversion: str, orders: Sequence[float], rdp: Sequence[float],
                   delta: float) -> np.ndarray:
  """Each order's own epsilon: what ``conversion`` computes at that order of a curve.

  Never below the conversion's epsilon on any curve holding that order, so the
  minimum over a subset of a curve's orders is never below the whole curve's
  epsilon. (It is that epsilon on the whole curve, except where every RDP value
  is 0: there the conversions say 0, while an order alone here says what it
  says next to non-zero values: ``log(1/delta) / (a - 1)`` classic, 0 modern.)

  >>> order_epsilons("classic", [2.0, 3.0], [0.0, 1.0], math.exp(-1.0)).tolist()
  [1.0, 1.5]
  """
  delta = validate_delta(delta)
  orders, rdp = _curve(orders, rdp)
  if conversion == "classic":
    return np.maximum(0.0, _classic_values(orders, rdp, delta))
  if conversion != "modern":
    raise AccountingError(f"Unknown conversion {conversion!r}.")
  eps = [_rdp_lib.compute_epsilon([float(a)], [float(r)], delta)[0] for a, r in zip(orders, rdp)]
  return np.array([max(0.0, float(e)) if math.isfinite(e) else math.inf for e in eps])


__all__ = ["CONVERTERS", "classic_epsilon", "modern_epsilon", "order_epsilons"]
