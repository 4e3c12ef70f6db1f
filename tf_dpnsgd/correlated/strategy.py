"""Banded Toeplitz strategies for correlated noise (offline, NumPy/SciPy, pure functions).

The matrix mechanism releases ``C x + z`` (``z`` i.i.d. Gaussian) for the
sequence ``x`` of summed gradients; the optimizer applies ``x + C^{-1} z``.
Its error on the prefix sums the optimizer applies (workload ``A``) is
``A C^{-1} z``: expected total squared error ``||A C^{-1}||_F^2`` per unit of
noise variance and per coordinate.

Here ``C`` is lower-triangular, Toeplitz and ``b``-banded::

    C[i, i - k] = c_k  for 0 <= k < b,  0 elsewhere,

normalized so that ``||c||_2 = 1``: every full column of ``C`` then has norm
1 (the last ``b - 1`` columns are truncated and have less), and columns
``b`` or more apart have disjoint supports. So under participation with
minimum separation ``b`` (cyclic Poisson sampling, :mod:`tf_dpnsgd.correlated.sampling`)
one example's ``k`` participations move ``C x`` by at most ``sqrt(k)`` (per unit
of per-example sensitivity), each participation by at most 1, in disjoint
coordinates: :func:`sensitivity` computes it by brute force.

``b = 1`` is ``C = I``: DP-SGD's independent noise.

Workloads (lower-triangular Toeplitz, so ``A C^{-1}`` is too and its Frobenius
norm costs ``O(n b)``: :func:`total_error`):

* SGD: ``A[t, r] = 1`` for ``r <= t`` (the parameters are the prefix sums of
  the updates);
* SGD with heavy-ball momentum ``beta``: ``A[t, r] = (1 - beta^(t-r+1)) / (1 - beta)``
  (:func:`workload_column`).

References:
  Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu (2023),
  "(Amplified) Banded Matrix Factorization: A unified approach to private
  training", NeurIPS 2023: banded strategies, Thm. 2 (sensitivity under
  b-min-separation), Thm. 4 (amplification with cyclic Poisson sampling).
  Fichtenberger, Henzinger, Upadhyay (2023), "Constant matters: fine-grained
  error bound on differentially private continual observation", ICML 2023: the
  square-root Toeplitz factorization of the prefix-sum matrix
  (:func:`sqrt_coefficients`, the closed-form baseline).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
from scipy import linalg, optimize, signal


def _check_sizes(n, bands):
  for name, v in (("n", n), ("bands", bands)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"`{name}` must be a positive integer; got {v!r}.")
  if bands > n:
    raise ValueError(f"`bands` ({bands}) cannot exceed the number of steps n ({n}).")


def _check_momentum(momentum):
  if not 0.0 <= float(momentum) < 1.0:
    raise ValueError(f"`momentum` must be in [0, 1); got {momentum!r}.")
  return float(momentum)


def normalize(coefficients) -> np.ndarray:
  """``c / ||c||_2``: the band whose full columns have norm 1 (sensitivity 1 per participation).

  Raises ``ValueError`` for a zero band or ``c_0 = 0`` (``C`` not invertible).

  >>> normalize([3.0, 4.0]).tolist()
  [0.6, 0.8]
  """
  c = np.asarray(coefficients, dtype=np.float64).ravel()
  norm = float(np.linalg.norm(c))
  if c.size == 0 or not math.isfinite(norm) or norm == 0 or c[0] == 0:
    raise ValueError(f"A band needs finite coefficients with c_0 != 0; got {c.tolist()}.")
  return c / norm


def strategy_matrix(coefficients, n: int) -> np.ndarray:
  """The dense ``n x n`` lower-triangular banded Toeplitz ``C`` of ``coefficients``.

  >>> strategy_matrix([1.0, 0.5], 3).tolist()
  [[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.0, 0.5, 1.0]]
  """
  c = np.asarray(coefficients, dtype=np.float64).ravel()
  out = np.zeros((n, n))
  for k, ck in enumerate(c[:n]):
    out += ck * np.eye(n, k=-k)
  return out


def inverse_column(coefficients, n: int) -> np.ndarray:
  """First column ``v`` of ``C^{-1}`` (lower-triangular Toeplitz too): ``C v = e_0``, by the
  recursion the train step runs, ``v_t = (1[t=0] - sum_{k>=1} c_k v_{t-k}) / c_0``."""
  c = np.asarray(coefficients, dtype=np.float64).ravel()
  return signal.lfilter([1.0], c, np.eye(1, n).ravel())  # the IIR filter 1 / c(x)


def workload_column(n: int, momentum: float = 0.0) -> np.ndarray:
  """First column of the (Toeplitz) workload ``A``: ones for SGD, ``(1 - beta^(k+1)) / (1 - beta)``
  with heavy-ball momentum ``beta`` (the weight of update ``r`` in the parameters at ``r + k``)."""
  beta = _check_momentum(momentum)
  k = np.arange(n, dtype=np.float64)
  return np.ones(n) if beta == 0 else (1.0 - beta ** (k + 1)) / (1.0 - beta)


def workload_matrix(n: int, momentum: float = 0.0) -> np.ndarray:
  """The dense workload ``A`` (lower-triangular Toeplitz of :func:`workload_column`)."""
  return linalg.toeplitz(workload_column(n, momentum), np.zeros(n))


def total_error(coefficients, n: int, momentum: float = 0.0, *, normalized: bool = True) -> float:
  """``||A C^{-1}||_F^2`` for the banded Toeplitz ``C`` of ``coefficients`` (normalized first
  unless ``normalized=False``): the expected total squared error of the ``n`` prefix sums per
  coordinate, with noise of variance 1 on ``C x``.

  ``A C^{-1}`` is lower-triangular Toeplitz with first column ``h = a * v`` (convolution, cut
  at ``n``), and ``||.||_F^2 = sum_k (n - k) h_k^2``.

  >>> total_error([1.0], 4)  # identity: 1 + 2 + 3 + 4
  10.0
  """
  c = normalize(coefficients) if normalized else np.asarray(coefficients, np.float64).ravel()
  h = np.convolve(workload_column(n, momentum), inverse_column(c, n))[:n]
  return float(np.sum((n - np.arange(n)) * h * h))


def sqrt_coefficients(bands: int) -> np.ndarray:
  """The first ``bands`` coefficients of ``(1 - x)^(-1/2)``: ``binom(2k, k) / 4^k``, the
  Toeplitz square root of the prefix-sum matrix (Fichtenberger et al. 2023), not normalized."""
  r = np.ones(bands)
  for k in range(1, bands):
    r[k] = r[k - 1] * (2 * k - 1) / (2 * k)
  return r


@dataclasses.dataclass(frozen=True)
class BandedStrategy:
  """A normalized ``b``-banded Toeplitz strategy optimized for ``n`` steps.

  Attributes:
    coefficients: ``(c_0, ..., c_{b-1})`` with ``||c||_2 = 1`` and ``c_0 > 0``.
    n: the horizon it was optimized for (the mechanism runs for any number of steps).
    momentum: the workload's momentum ``beta``.
    error: ``||A C^{-1}||_F^2`` at ``n`` (:func:`total_error`).
  """

  coefficients: tuple
  n: int
  momentum: float = 0.0
  error: float = dataclasses.field(default=float("nan"), compare=False)

  def __post_init__(self):
    c = normalize(self.coefficients)
    if c[0] < 0:
      c = -c
    _check_sizes(self.n, c.size)
    object.__setattr__(self, "coefficients", tuple(float(v) for v in c))
    object.__setattr__(self, "momentum", _check_momentum(self.momentum))
    object.__setattr__(self, "error", total_error(c, self.n, self.momentum))

  @property
  def bands(self) -> int:
    return len(self.coefficients)

  def matrix(self, n=None) -> np.ndarray:
    return strategy_matrix(self.coefficients, self.n if n is None else n)

  def mean_squared_error(self) -> float:
    """``||A C^{-1}||_F^2 / n``: mean squared error of one prefix sum (unit noise variance)."""
    return self.error / self.n


def identity_strategy(n: int, momentum: float = 0.0) -> BandedStrategy:
  """``b = 1``: ``C = I``, independent noise (DP-SGD)."""
  return BandedStrategy((1.0,), n, momentum)


def optimize_bands(n: int, bands: int, momentum: float = 0.0, maxiter: int = 500,
                   init: str = "identity") -> BandedStrategy:
  """The ``b``-banded Toeplitz strategy minimizing ``||A C^{-1}||_F^2`` under ``||c|| = 1``.

  L-BFGS (scipy) over the unnormalized band (the objective normalizes it: scale invariant),
  from the identity ``(1, 0, ..., 0)`` (``init="identity"``) or from the truncated square
  root (``init="sqrt"``). The result is never worse than its starting point (the start is
  returned when the optimizer does not improve on it). ``bands=1`` returns the identity.
  """
  _check_sizes(n, bands)
  momentum = _check_momentum(momentum)
  if bands == 1:
    return identity_strategy(n, momentum)
  if init == "identity":
    x0 = np.eye(1, bands).ravel()
  elif init == "sqrt":
    x0 = normalize(sqrt_coefficients(bands))
  else:
    raise ValueError(f"`init` must be 'identity' or 'sqrt'; got {init!r}.")

  def objective(x):
    if not x[0] > 1e-8:
      return 1e30  # C singular (or a sign flip); the band keeps c_0 > 0
    return total_error(x, n, momentum)

  result = optimize.minimize(objective, x0, method="L-BFGS-B",
                             options={"maxiter": maxiter, "maxfun": 50 * maxiter})
  best = result.x if result.fun < objective(x0) else x0
  return BandedStrategy(tuple(best), n, momentum)


def sqrt_banded_strategy(n: int, bands: int, momentum: float = 0.0) -> BandedStrategy:
  """Closed-form baseline: the square root's first ``bands`` coefficients, normalized."""
  _check_sizes(n, bands)
  return BandedStrategy(tuple(sqrt_coefficients(bands)), n, momentum)


# --- sensitivity (brute force, for tests and small n) ----------------------------------------
def participation_patterns(n: int, separation: int, max_participations=None):
  """All nonempty 0/1 vectors of length ``n`` whose ones are at least ``separation`` apart
  (at most ``max_participations`` ones), as index tuples."""
  k_max = n if max_participations is None else max_participations
  for k in range(1, k_max + 1):
    for idx in itertools.combinations(range(n), k):
      if all(b - a >= separation for a, b in zip(idx, idx[1:])):
        yield idx


def sensitivity(matrix, n_participations=None, separation: int = 1) -> float:
  """``max ||C u||_2`` over participation vectors ``u`` (ones at least ``separation`` apart,
  at most ``n_participations`` of them; ``None``: any number), by enumeration.

  Per unit of per-example sensitivity: each participation adds a contribution of norm at most
  1 to one step; for nonnegative ``C^T C`` the worst case is all contributions aligned, so the
  0/1 vectors attain the maximum (Choquette-Choo et al. 2023, Thm. 2). Exponential in ``n``:
  for tests."""
  C = np.asarray(matrix, dtype=np.float64)
  n = C.shape[1]
  best = 0.0
  for idx in participation_patterns(n, separation, n_participations):
    best = max(best, float(np.linalg.norm(C[:, list(idx)].sum(axis=1))))
  return best


__all__ = ["BandedStrategy", "identity_strategy", "inverse_column", "normalize",
           "optimize_bands", "participation_patterns", "sensitivity", "sqrt_banded_strategy",
           "sqrt_coefficients", "strategy_matrix", "total_error", "workload_column",
           "workload_matrix"]
