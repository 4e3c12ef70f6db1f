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


def classic_epsilon(orders: Sequence[float], rdp: Sequence[float],
                    delta: float) -> tuple[float, Optional[float]]:
  """Mironov (2017) Prop. 3: ``min_a rdp(a) + log(1/delta) / (a - 1)`` and the optimal order.

  Orders ``<= 1`` and infinite RDP values are skipped; all zero RDP gives 0.

  >>> eps, order = classic_epsilon([2.0, 3.0], [0.5, 1.0], math.exp(-1.0))
  >>> round(eps, 6), order
  (1.5, 2.0)
  """
  delta = validate_delta(delta)
  orders = np.asarray(orders, dtype=np.float64)
  rdp = np.asarray(rdp, dtype=np.float64)
  if orders.shape != rdp.shape:
    raise AccountingError("`orders` and `rdp` must have the same length.")
  if np.all(rdp == 0):
    return 0.0, None
  with np.errstate(divide="ignore", invalid="ignore"):
    eps = np.where(orders > 1.0, rdp + math.log(1.0 / delta) / (orders - 1.0), np.inf)
  eps = np.where(np.isnan(eps), np.inf, eps)
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

__all__ = ["CONVERTERS", "classic_epsilon", "modern_epsilon"]
