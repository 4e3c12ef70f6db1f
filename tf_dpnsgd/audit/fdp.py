"""f-DP one-run lower bounds, and the Gaussian trade-off curve they test against.

Pure functions of counts (NumPy/SciPy and :mod:`math` only; no TensorFlow),
next to :mod:`tf_dpnsgd.audit.bounds` (Steinke, Nasr, Jagielski) and
computed from the same guesses.

Gaussian differential privacy (Dong, Roth, Su, "Gaussian Differential
Privacy", JRSS-B 2022, arXiv:1905.02383)
--------------------------------------------------------------------
A mechanism is ``mu``-GDP if telling any two neighbouring datasets apart is
at least as hard as telling ``N(0, 1)`` from ``N(mu, 1)``: every test of
type-I error ``alpha`` has type-II error at least
``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` (:func:`gaussian_tradeoff`).
``mu``-GDP is ``(eps, delta(eps))``-DP for every ``eps >= 0`` with
(their Corollary 2.13; Balle and Wang 2018, Theorem 8)::

    delta(eps; mu) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)

(:func:`gaussian_dp_delta`). The Gaussian mechanism with sensitivity 1 and
noise ``sigma`` is exactly ``1/sigma``-GDP. :func:`gaussian_dp_mu` inverts
``delta(eps; mu) = delta`` for ``mu`` (the "Gaussian trade-off curve at
``(eps, delta)``": the GDP curve through that point), :func:`gaussian_dp_epsilon`
for ``eps``.

f-DP in one run (Mahloujifar, Melis, Chaudhuri, "Auditing f-Differential
Privacy in One Run", ICML 2025, arXiv:2410.22235)
-----------------------------------------------------------------------
The same game as Steinke et al.'s one-run audit: ``m`` canaries, each included
with probability 1/2; the auditor makes ``r`` guesses (abstaining on the
rest), ``v`` of them correct. Instead of comparing the guesses with
``eps``-randomized response (whose ``(eps, delta)`` profile is one point of
the trade-off curve), their analysis uses the whole hypothesized trade-off
function ``f`` through its *blow-up inverse* ``B^-1(x) = f(1 - x)``: the least
probability under ``D`` of an event that has probability ``x`` under a
neighbour ``D'`` (for the Gaussian curve, ``B^-1(x) = Phi(Phi^-1(x) - mu)``,
:func:`gaussian_blow_up_inverse`). Their
test at level ``tau`` (the procedure called ``audit_rh_with_cap`` in the
paper's code)::

    r_v = tau v / m,  h_v = tau (r - v) / m
    for i = v-1, ..., 0:
        h_i = max(h_{i+1}, B^-1(r_{i+1}))
        r_i = r_{i+1} + i / (r - i) * (h_i - h_{i+1})
    reject "the mechanism is f-DP" if r_0 + h_0 > r / m.

:func:`fdp_one_run_statistic` computes ``r_0 + h_0``; :func:`fdp_one_run_rejects`
the decision; :func:`fdp_one_run_epsilon_lower_bound` searches the largest
``eps`` whose Gaussian curve ``G_{mu(eps, delta)}`` is rejected at
``tau = 1 - confidence``. The returned ``eps`` is always one that was rejected.

What the f-DP bound states (read before comparing it with a claim). A
rejection at ``eps`` says: with probability at least ``confidence``, the
mechanism is **not ``mu(eps, delta)``-GDP**. ``mu``-GDP at
``mu = mu(eps, delta)`` implies ``(eps, delta)``-DP but not conversely, so the
hypothesis rejected is *stronger* than "``(eps, delta)``-DP", and the f-DP
bound is a lower bound on the ``eps`` of the best Gaussian curve the mechanism
satisfies, not on its ``(eps, delta)``. For DP-SGD this is the natural
hypothesis (a composition of subsampled Gaussians is close to, though not
exactly, GDP), and it is the one the paper audits; it is why the f-DP bound is
higher than Steinke et al.'s from the same guesses. A bound above a claim made
by an RDP or PLD accountant therefore means "the mechanism is not even as
private as the Gaussian curve through the claimed ``(eps, delta)``", which
for a correct subsampled Gaussian mechanism could only happen where its curve
dips below that Gaussian curve, far from what a last-iterate audit can
see (docs/auditing.md).

What was verified, and how: the recursion above was written from two public
implementations of the paper's procedure that agree with each other
(google-deepmind/jax_privacy ``auditing.py``, ``_epsilon_one_run_fdp``, and
Meta's PrivacyGuard ``fdp_analysis_node.py``, ``audit_rh_with_cap``; the
authors are at Meta) and checked against them on a grid of counts by a
transcription in the tests. The PDF itself could not be opened from this
environment, so theorem and algorithm *numbers* are not quoted. The
``(eps, delta) -> mu`` conversion is checked against dp-accounting's
``get_sigma_gaussian`` (``mu = 1 / sigma``).

Edge cases: ``delta`` must be in ``(0, 1)`` (with ``delta = 0`` no
``mu > 0`` is ``(eps, 0)``-DP, so every ``eps`` would be the hypothesis
"perfectly private" and the bound would be infinite); no guesses, no correct
guesses or chance-level guesses give 0; perfect guesses give the largest
bound the counts allow: at ``m = 1000``, ``delta = 1e-5``, 95%, **9.92** for
500 perfect guesses (Steinke et al.: 5.09) and **12.33** for 1000
(:func:`fdp_one_run_max_epsilon`; Steinke et al.: 5.78).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from scipy import optimize, special

from tf_dpnsgd.audit import bounds

# Bisection tolerance on epsilon (as bounds.EPSILON_TOLERANCE); the returned bound is the
# rejected (low) end of the bracket.
EPSILON_TOLERANCE = bounds.EPSILON_TOLERANCE
_STANDARD_NORMAL = statistics.NormalDist()


def _phi(x: float) -> float:
  """Standard normal CDF (scalar, fast)."""
  return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _phi_inv(p: float) -> float:
  """Standard normal quantile (scalar); +-inf at 1 and 0."""
  if p <= 0.0:
    return -math.inf
  if p >= 1.0:
    return math.inf
  return _STANDARD_NORMAL.inv_cdf(p)


def _check_mu(mu) -> float:
  mu = float(mu)
  if not mu >= 0 or math.isnan(mu):
    raise ValueError(f"`mu` must be >= 0; got {mu!r}.")
  return mu


def _check_positive_delta(delta) -> float:
  delta = float(delta)
  if not 0.0 < delta < 1.0:
    raise ValueError(
        f"`delta` must lie in (0, 1) for the Gaussian (f-DP) curve; got {delta!r}. With delta = "
        "0 no Gaussian curve is (eps, 0)-DP: give the claimed delta (e.g. 1e-5).")
  return delta


def gaussian_tradeoff(alpha: float, mu: float) -> float:
  """``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``: the least type-II error of a test of
  type-I error ``alpha`` against a ``mu``-GDP mechanism (Dong, Roth, Su 2022, Eq. 6).

  >>> round(gaussian_tradeoff(0.05, 0.0), 6)   # mu = 0: no test beats a coin
  0.95
  >>> round(gaussian_tradeoff(0.05, 1.0), 4)
  0.7405
  """
  alpha, mu = float(alpha), _check_mu(mu)
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"`alpha` must lie in [0, 1]; got {alpha!r}.")
  return _phi(_phi_inv(1.0 - alpha) - mu)


def gaussian_blow_up_inverse(x: float, mu: float) -> float:
  """``B^-1(x) = Phi(Phi^-1(x) - mu) = G_mu(1 - x)``: under ``mu``-GDP, an event of
  probability ``x`` on one neighbour has probability at least this on the other.

  >>> gaussian_blow_up_inverse(0.3, 0.0)
  0.3
  >>> gaussian_blow_up_inverse(1.0, 2.0), gaussian_blow_up_inverse(0.0, 2.0)
  (1.0, 0.0)
  """
  x, mu = float(x), _check_mu(mu)
  if x <= 0.0 or x >= 1.0 or mu == 0.0:
    return min(max(x, 0.0), 1.0)
  return _phi(_phi_inv(x) - mu)


def gaussian_dp_delta(mu: float, epsilon: float) -> float:
  """``delta(eps; mu) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``, the smallest delta
  with ``mu``-GDP => ``(eps, delta)``-DP (Dong, Roth, Su 2022, Corollary 2.13).

  Evaluated in the log domain (``log Phi`` via ``scipy.special.log_ndtr``) so that large
  ``eps`` does not overflow ``e^eps``. ``mu = 0`` gives 0.

  >>> round(gaussian_dp_delta(1.0, 0.0), 6)   # Phi(1/2) - Phi(-1/2)
  0.382925
  """
  mu, epsilon = _check_mu(mu), float(epsilon)
  if not epsilon >= 0:
    raise ValueError(f"`epsilon` must be >= 0; got {epsilon!r}.")
  if mu == 0.0:
    return 0.0
  if math.isinf(mu):
    return 1.0
  log_a = float(special.log_ndtr(-epsilon / mu + mu / 2.0))
  log_b = epsilon + float(special.log_ndtr(-epsilon / mu - mu / 2.0))
  if log_b >= log_a:   # rounding at tiny delta
    return 0.0
  return float(math.exp(log_a) * -math.expm1(log_b - log_a))


def gaussian_dp_mu(epsilon: float, delta: float) -> float:
  """The ``mu`` whose GDP curve passes through ``(epsilon, delta)``: ``delta(epsilon; mu) =
  delta`` (``delta(eps; mu)`` grows with ``mu``). The Gaussian mechanism of noise
  ``sigma = 1 / mu`` (sensitivity 1) is exactly ``(epsilon, delta)``-DP.

  Args:
    epsilon: ``>= 0``.
    delta: in ``(0, 1)``.

  Returns:
    ``mu > 0`` (root-found to relative precision ~1e-12).

  >>> round(1 / gaussian_dp_mu(1.0, 1e-5), 4)   # dp-accounting's get_sigma_gaussian: 3.7306
  3.7306
  """
  epsilon, delta = float(epsilon), _check_positive_delta(delta)
  if not epsilon >= 0 or math.isinf(epsilon):
    raise ValueError(f"`epsilon` must be finite and >= 0; got {epsilon!r}.")

  def gap(mu):
    return gaussian_dp_delta(mu, epsilon) - delta

  lo, hi = 1e-12, 1.0
  while gap(hi) < 0:
    lo, hi = hi, 2.0 * hi
  return float(optimize.brentq(gap, lo, hi, xtol=1e-14, rtol=1e-12))


def gaussian_dp_epsilon(mu: float, delta: float) -> float:
  """The smallest ``eps >= 0`` with ``delta(eps; mu) <= delta``: ``mu``-GDP as
  ``(eps, delta)``-DP (``delta(eps; mu)`` falls with ``eps``).

  >>> gaussian_dp_epsilon(0.0, 1e-5)
  0.0
  >>> round(gaussian_dp_epsilon(1 / 3.7306316348159374, 1e-5), 6)
  1.0
  """
  mu, delta = _check_mu(mu), _check_positive_delta(delta)
  if math.isinf(mu):
    return math.inf

  def gap(eps):
    return gaussian_dp_delta(mu, eps) - delta

  if gap(0.0) <= 0:
    return 0.0
  lo, hi = 0.0, 1.0
  while gap(hi) > 0:
    lo, hi = hi, 2.0 * hi
  return float(optimize.brentq(gap, lo, hi, xtol=1e-12, rtol=1e-12))


def fdp_one_run_statistic(num_canaries: int, num_guesses: int, num_correct: int,
                          blow_up_inverse: Callable[[float], float],
                          significance: float) -> float:
  """``r_0 + h_0`` of the f-DP one-run test (see the module docstring).

  The hypothesis "f-DP" (``f`` given by its ``blow_up_inverse``) is rejected at level
  ``significance`` when this exceeds ``num_guesses / num_canaries``. ``r_i`` and ``h_i``
  never decrease as ``i`` falls, so the loop stops as soon as the value passes that
  threshold (the decision is then made; the value returned is the partial one, already
  above it) or reaches a fixed point (``B^-1(r) <= h``: nothing changes afterwards).

  Args:
    num_canaries, num_guesses, num_correct: ``m``, ``r``, ``v``
      (``v <= r <= m``).
    blow_up_inverse: ``x -> B^-1(x)``, non-decreasing on ``[0, 1]``.
    significance: ``tau = 1 - confidence`` in ``(0, 1)``.
  """
  m, r, v = bounds._check_one_run(num_canaries, num_guesses, num_correct)
  tau = float(significance)
  if not 0.0 < tau < 1.0:
    raise ValueError(f"`significance` must lie in (0, 1); got {significance!r}.")
  if m == 0:
    return 0.0
  cap = r / m
  rr, h = tau * v / m, tau * (r - v) / m
  for i in range(v - 1, -1, -1):
    h_new = max(h, float(blow_up_inverse(rr)))
    if h_new == h:
      break
    rr += i / (r - i) * (h_new - h)
    h = h_new
    if rr + h > cap:
      break
  return rr + h


def fdp_one_run_rejects(num_canaries: int, num_guesses: int, num_correct: int,
                        blow_up_inverse: Callable[[float], float], significance: float) -> bool:
  """True if ``v`` correct out of ``r`` guesses on ``m`` canaries reject "f-DP" at level
  ``significance`` (Mahloujifar, Melis, Chaudhuri 2025; see the module docstring).

  >>> fdp_one_run_rejects(100, 100, 100, lambda x: x, 0.05)       # f = identity: no privacy loss
  True
  >>> fdp_one_run_rejects(100, 100, 50, lambda x: x, 0.05)        # a coin's worth of guesses
  False
  """
  m = bounds._check_count("num_canaries", num_canaries)
  if num_correct == 0 or m == 0:
    bounds._check_one_run(num_canaries, num_guesses, num_correct)
    return False
  value = fdp_one_run_statistic(num_canaries, num_guesses, num_correct, blow_up_inverse,
                                significance)
  return value > num_guesses / m


def fdp_one_run_rejects_gaussian(num_canaries: int, num_guesses: int, num_correct: int,
                                 epsilon: float, delta: float, confidence: float = 0.95) -> bool:
  """True if the guesses reject ``mu(epsilon, delta)``-GDP at ``1 - confidence``."""
  tau = 1.0 - bounds._check_confidence(confidence)
  mu = gaussian_dp_mu(epsilon, delta)
  return fdp_one_run_rejects(num_canaries, num_guesses, num_correct,
                             lambda x: gaussian_blow_up_inverse(x, mu), tau)


def fdp_one_run_epsilon_lower_bound(num_canaries: int, num_guesses: int, num_correct: int,
                                    delta: float, confidence: float = 0.95) -> float:
  """f-DP one-run lower bound on epsilon, Gaussian trade-off curve at the claimed delta.

  The largest ``eps`` (to :data:`EPSILON_TOLERANCE`) such that the guesses reject, at
  level ``1 - confidence``, "the mechanism is ``mu(eps, delta)``-GDP"
  (:func:`fdp_one_run_rejects` with :func:`gaussian_blow_up_inverse`). Valid under the
  same conditions as :func:`tf_dpnsgd.audit.bounds.one_run_epsilon_lower_bound`: the
  canaries' coins fair and independent, the guessing rule fixed without looking at
  them (or several rules with a Bonferroni correction). What it bounds is stated in the
  module docstring: the ``eps`` at ``delta`` of the best *Gaussian* curve the mechanism
  satisfies.

  Args:
    num_canaries: ``m``.
    num_guesses: ``r <= m``.
    num_correct: ``v <= r``.
    delta: the claimed delta, in ``(0, 1)``.
    confidence: ``1 - tau``, e.g. 0.95.

  Search: if ``eps = 0`` (``mu(0, delta)``, nearly "no privacy loss") is not rejected,
  0; else doubling, then bisection keeping the rejected end. A larger ``eps`` is a
  weaker hypothesis (``mu``-GDP implies ``mu'``-GDP for ``mu' >= mu``), and the test
  rejects less as ``mu`` grows (checked on a grid in the tests).

  Returns:
    A float ``>= 0``.

  >>> fdp_one_run_epsilon_lower_bound(1000, 0, 0, delta=1e-5)
  0.0
  >>> round(fdp_one_run_epsilon_lower_bound(1000, 500, 500, delta=1e-5), 2)
  9.92
  """
  m, r, v = bounds._check_one_run(num_canaries, num_guesses, num_correct)
  delta = _check_positive_delta(delta)
  tau = 1.0 - bounds._check_confidence(confidence)
  # B^-1(x) = x ("no test beats a coin") is the strongest hypothesis of all: if even it
  # stands, no Gaussian curve is rejected.
  if v == 0 or not fdp_one_run_rejects(m, r, v, lambda x: x, tau):
    return 0.0

  def rejected(eps):
    mu = gaussian_dp_mu(eps, delta)
    return fdp_one_run_rejects(m, r, v, lambda x: gaussian_blow_up_inverse(x, mu), tau)

  if not rejected(0.0):
    return 0.0
  lo, hi = 0.0, 1.0
  while rejected(hi):      # B^-1 -> 0 as eps grows, and r_0 + h_0 -> tau r / m < r / m
    lo, hi = hi, 2.0 * hi
  while hi - lo > EPSILON_TOLERANCE:
    mid = 0.5 * (lo + hi)
    if rejected(mid):
      lo = mid
    else:
      hi = mid
  return lo


def fdp_one_run_max_epsilon(num_canaries: int, delta: float, confidence: float = 0.95) -> float:
  """The largest f-DP bound ``m`` canaries can give: every canary guessed, all correct.

  >>> round(fdp_one_run_max_epsilon(1000, 1e-5), 2)
  12.33
  """
  m = bounds._check_count("num_canaries", num_canaries)
  return fdp_one_run_epsilon_lower_bound(m, m, m, delta=delta, confidence=confidence)


__all__ = ["EPSILON_TOLERANCE", "fdp_one_run_epsilon_lower_bound", "fdp_one_run_max_epsilon",
           "fdp_one_run_rejects", "fdp_one_run_rejects_gaussian", "fdp_one_run_statistic",
           "gaussian_blow_up_inverse", "gaussian_dp_delta", "gaussian_dp_epsilon",
           "gaussian_dp_mu", "gaussian_tradeoff"]
