"""Buffered linear Toeplitz (BLT) strategies (offline, NumPy/SciPy, pure functions).

A BLT is a lower-triangular Toeplitz ``C`` with ``d`` buffers: buffer decays
``theta_i`` and output scales ``omega_i`` give the coefficients::

    c_0 = 1,   c_k = sum_i omega_i theta_i^(k-1)   (k >= 1),   C[t, t-k] = c_k

(generating function ``1 + sum_i omega_i x / (1 - theta_i x)``). ``C^{-1} z`` is
computed forward with ``d`` model-sized buffers, whatever the number of steps
(Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, Alg. 3)::

    w_t = z_t - sum_i omega_i s_{i,t},     s_{i,t+1} = theta_i s_{i,t} + w_t,   s_{i,0} = 0

since ``(C w)_t = w_t + sum_i omega_i sum_{k>=1} theta_i^(k-1) w_{t-k}``
(:func:`tf_dpnsgd.correlated.noise.blt_step` in the train step).

Sensitivity. With ``0 < theta_i < 1`` and ``omega_i >= 0`` the coefficients are
positive and non-increasing when ``c_1 = sum_i omega_i <= 1``
(:meth:`BLTStrategy.__post_init__` refuses anything else). Then, for participations
at least ``b`` apart (cyclic Poisson sampling, :mod:`tf_dpnsgd.correlated.sampling`),
at most ``k`` of them in ``n`` steps, the worst case is participating at steps
``0, b, 2b, ..., (k-1) b`` (McMahan, Xu, Zhang 2024, Thm. 2):
:func:`minsep_sensitivity` (checked against brute-force enumeration in the tests).
Unlike a ``b``-banded strategy, the columns of a BLT overlap at every distance, so the
amplification of Choquette-Choo et al. (2023, Thm. 4) does not apply. A plan accounts for
BLT noise WITHOUT amplification (``PrivacyPlan(..., sampling="cyclic_poisson", bands=b,
blt=(theta, omega))``, :class:`tf_dpnsgd.accounting.AccountingSpec`): the first ``t`` noised
steps are one Gaussian mechanism ``C_t x + sigma S z`` whose sensitivity is
``S * minsep_sensitivity(blt, t, b)``, so their epsilon is that of
``GaussianDpEvent(sigma / minsep_sensitivity(blt, t, b))``. The ledger records which BLT
ran (:attr:`BLTStrategy.ledger_code`), so a plan with other parameters refuses it.

Objective. The noise on ``C x`` has std ``sigma * sens(C)``, so a strategy is judged by
``sens(C)^2 ||A C^{-1}||_F^2`` (:func:`loss`), ``A`` the SGD (or momentum) workload of
:mod:`tf_dpnsgd.correlated.strategy`; :func:`optimize_blt` minimizes it by L-BFGS.

References:
  K. Dvijotham, H. B. McMahan, K. Pillutla, T. Steinke, A. Thakurta (2024). "Efficient
  and near-optimal noise generation for streaming differential privacy", FOCS 2024.
  H. B. McMahan, Z. Xu, Y. Zhang (2024). "A hassle-free algorithm for private learning in
  practice: don't use tree aggregation, use BLTs", EMNLP 2024 (Thm. 2: min-separation
  sensitivity of non-increasing Toeplitz strategies).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import numpy as np
from scipy import optimize, special

from tf_dpnsgd.correlated import strategy as strategy_lib


@dataclasses.dataclass(frozen=True)
class BLTStrategy:
  """A BLT with buffer decays ``theta`` and output scales ``omega`` (see the module doc).

  Attributes:
    theta: ``(theta_1, ..., theta_d)``, each in ``(0, 1)``.
    omega: ``(omega_1, ..., omega_d)``, each ``>= 0``, with ``sum(omega) <= 1``.

  Raises ``ValueError`` otherwise: outside this set the coefficients may be negative or
  increasing, and :func:`minsep_sensitivity`'s worst case would not hold.
  """

  theta: tuple
  omega: tuple

  def __post_init__(self):
    theta = tuple(float(v) for v in np.ravel(self.theta))
    omega = tuple(float(v) for v in np.ravel(self.omega))
    if not theta or len(theta) != len(omega):
      raise ValueError(f"A BLT needs as many buffer decays as output scales (>= 1); got "
                       f"theta={theta}, omega={omega}.")
    if not all(0.0 < t < 1.0 for t in theta):
      raise ValueError(f"BLT buffer decays must lie in (0, 1); got {theta}.")
    if not all(math.isfinite(o) and o >= 0.0 for o in omega) or sum(omega) > 1.0 + 1e-12:
      raise ValueError(f"BLT output scales must be >= 0 with sum <= 1 (positive, "
                       f"non-increasing coefficients); got {omega}.")
    object.__setattr__(self, "theta", theta)
    object.__setattr__(self, "omega", omega)

  @property
  def buffers(self) -> int:
    return len(self.theta)

  @functools.cached_property  # the guard compares it before every step
  def ledger_code(self) -> int:
    """What the ledger records for steps of this BLT's noise (``noise_bands``): ``-2 - h``,
    ``h`` a 48-bit hash of the exact parameters (``<= -2``; ``-1`` means mixed noise).

    >>> BLTStrategy((0.5,), (0.5,)).ledger_code < -1
    True
    """
    digest = hashlib.sha256(repr((self.theta, self.omega)).encode()).digest()
    return -2 - int.from_bytes(digest[:6], "little")

  def parameters(self) -> list:
    """``[theta, omega]`` as lists (``blt_parameters=`` of the optimizers, JSON-ready)."""
    return [list(self.theta), list(self.omega)]

  def coefficients(self, n: int) -> np.ndarray:
    """``(c_0, ..., c_{n-1})``.

    >>> BLTStrategy((0.5,), (0.5,)).coefficients(4).tolist()
    [1.0, 0.5, 0.25, 0.125]
    """
    k = np.arange(max(n - 1, 0), dtype=np.float64)
    theta, omega = np.asarray(self.theta), np.asarray(self.omega)
    tail = (omega[None, :] * theta[None, :] ** k[:, None]).sum(axis=1)
    return np.concatenate([[1.0], tail])[:n]

  def matrix(self, n: int) -> np.ndarray:
    """The dense ``n x n`` lower-triangular Toeplitz ``C``."""
    return strategy_lib.strategy_matrix(self.coefficients(n), n)


def minsep_sensitivity(blt: BLTStrategy, n: int, separation: int,
                       max_participations=None) -> float:
  """``max ||C u||`` over participations at least ``separation`` apart (at most
  ``max_participations``; None: as many as fit, ``ceil(n / separation)``), per unit of
  per-example sensitivity: ``||C (e_0 + e_b + ... + e_{(k-1) b})||`` for these
  non-negative, non-increasing coefficients (McMahan, Xu, Zhang 2024, Thm. 2).
  """
  if separation < 1 or n < 1:
    raise ValueError(f"Need n >= 1 and separation >= 1; got n={n}, separation={separation}.")
  k = -(-n // separation)
  if max_participations is not None:
    k = min(k, int(max_participations))
  c = blt.coefficients(n)
  # column[i] = sum_{j < k, j b <= i} c[i - j b]: per residue r = i mod b, a cumulative sum
  # of c[r::b] (O(n): the accountant evaluates it at every step count), minus the terms
  # beyond the k-th participation.
  column = np.empty(n)
  for r in range(min(separation, n)):
    sums = np.cumsum(c[r::separation])
    if len(sums) > k:
      sums[k:] -= sums[:-k]
    column[r::separation] = sums
  return float(np.linalg.norm(column))


def total_error(blt: BLTStrategy, n: int, momentum: float = 0.0) -> float:
  """``||A C^{-1}||_F^2`` (unit noise on ``C x``): :func:`tf_dpnsgd.correlated.strategy.total_error`
  of the BLT's ``n`` coefficients."""
  return strategy_lib.total_error(blt.coefficients(n), n, momentum, normalized=False)


def loss(blt: BLTStrategy, n: int, separation: int, momentum: float = 0.0) -> float:
  """``sens(C)^2 ||A C^{-1}||_F^2``: the expected total squared error of the ``n`` prefix
  sums at noise multiplier 1 (noise std ``sens(C)`` on ``C x``)."""
  return minsep_sensitivity(blt, n, separation) ** 2 * total_error(blt, n, momentum)


def _from_unconstrained(x, d):
  theta = special.expit(x[:d])
  weights = np.exp(x[d:])
  omega = weights / (1.0 + weights.sum())  # >= 0, sum < 1
  return np.clip(theta, 1e-9, 1 - 1e-9), omega


def optimize_blt(n: int, buffers: int, separation: int = 1, momentum: float = 0.0,
                 maxiter: int = 300) -> BLTStrategy:
  """The ``buffers``-buffer BLT minimizing :func:`loss` (L-BFGS over unconstrained
  parameters: ``theta = sigmoid(u)``, ``omega = softmax-like(v)`` keep it valid), from
  decays spread geometrically towards 1."""
  if buffers < 1 or n < 2:
    raise ValueError(f"Need buffers >= 1 and n >= 2; got buffers={buffers}, n={n}.")
  d = buffers
  theta0 = 1.0 - np.geomspace(0.5, 2.0 / n, d)
  x0 = np.concatenate([np.log(theta0 / (1 - theta0)), np.full(d, np.log(0.5 / d))])

  def objective(x):
    theta, omega = _from_unconstrained(x, d)
    value = loss(BLTStrategy(tuple(theta), tuple(omega)), n, separation, momentum)
    return value if math.isfinite(value) else 1e300

  result = optimize.minimize(objective, x0, method="L-BFGS-B",
                             options={"maxiter": maxiter, "maxfun": 20 * maxiter})
  best = result.x if result.fun < objective(x0) else x0
  theta, omega = _from_unconstrained(best, d)
  return BLTStrategy(tuple(theta), tuple(omega))


__all__ = ["BLTStrategy", "loss", "minsep_sensitivity", "optimize_blt", "total_error"]
