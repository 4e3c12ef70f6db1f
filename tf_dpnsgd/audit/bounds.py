"""Epsilon lower bounds from membership guesses: the one-run audit and Clopper-Pearson.

Pure functions of counts (NumPy/SciPy only; no TensorFlow). An accountant
proves an *upper* bound on epsilon if the code does what the proof assumes;
these functions turn an adversary's success at telling which canaries were
trained on into a *lower* bound that holds whatever the code does. A lower
bound above the claimed epsilon means the mechanism is not what the
accountant was told (a bug), at the stated confidence.

One run (Steinke, Nasr, Jagielski 2023)
---------------------------------------
``m`` canaries, each included independently with probability 1/2
(``S in {-1, +1}^m`` uniform). The auditor sees the output, guesses "in"
(+1), "out" (-1) or abstains (0) for every canary, making at most ``r``
guesses, ``v`` of them correct. Their main theorem (Theorem 3.1 of
arXiv:2305.08846, "Privacy Auditing with One (1) Training Run", NeurIPS
2023): if the training algorithm is ``(eps, delta)``-DP in each canary, then
for all ``v``::

    P[#correct >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (e^eps + 1)) >= v].

With ``delta = 0`` this is the tail of ``r`` independent eps-randomized-response
guesses. The right-hand side is the p-value of the observed ``v`` under the
null hypothesis "(eps, delta)-DP"; the lower bound at confidence ``1 - beta``
is the largest ``eps`` whose p-value is below ``beta`` (the claim
"(eps, delta)-DP" is then rejected at level ``beta``). :func:`one_run_p_value`
is exactly that right-hand side and :func:`one_run_epsilon_lower_bound`
the search for ``eps``, as in the authors' code in the paper's Appendix D
(``p_value_DP_audit`` / ``get_eps_audit``), written anew here.

What was verified, and how: the statement above and the ``2 m delta`` term
were checked against the authors' Appendix D code as reproduced in several
public repositories (google-deepmind/jax_privacy ``auditing.py`` computes the
same expression), and :func:`one_run_epsilon_lower_bound` reproduces the two
numbers the paper prints for it: ``(m, r, v, delta) = (1000, 100, 75, 1e-4)``
at 95% gives 0.673 (Appendix D) and ``(100000, 1510, 1439, 1e-5)`` gives
2.675 (Section 7). The PDF itself could not be opened from this environment:
the theorem *number* (3.1) is from memory of the paper and is the one point
not checked against the text.

Multi-run (Clopper-Pearson)
---------------------------
The classic audit (Jagielski, Ullman, Oprea 2020; Nasr et al. 2021): a
threshold attack over independent trials (one training run per trial, or
one canary per run) has true- and false-positive rates ``TPR``, ``FPR``.
``(eps, delta)``-DP implies ``TPR <= e^eps FPR + delta`` and
``1 - FPR <= e^eps (1 - TPR) + delta``, hence::

    eps >= max(log((TPR - delta) / FPR), log((1 - FPR - delta) / (1 - TPR))).

:func:`clopper_pearson_epsilon_lower_bound` evaluates this at the exact
(Clopper-Pearson, ``scipy.stats.beta``) one-sided bounds ``TPR_lo`` and
``FPR_hi``, each at level ``beta / 2`` so that both hold together with
probability ``>= 1 - beta`` (union bound).

Edge cases (both bounds): no correct guesses, no guesses, or a useless
attack give 0 (a lower bound is never negative); perfect guesses give a
finite maximum that grows with the number of canaries/trials
(:func:`one_run_max_epsilon`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special, stats

# Bisection tolerance on epsilon; the returned bound is the low end of the bracket.
EPSILON_TOLERANCE = 1e-6


def _check_count(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"`{name}` must be a non-negative integer; got {value!r}.")
  return int(value)


def _check_delta(delta) -> float:
  delta = float(delta)
  if not 0.0 <= delta < 1.0:
    raise ValueError(f"`delta` must lie in [0, 1); got {delta!r}.")
  return delta


def _check_confidence(confidence) -> float:
  confidence = float(confidence)
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"`confidence` must lie in (0, 1), e.g. 0.95; got {confidence!r}.")
  return confidence


def _check_one_run(num_canaries, num_guesses, num_correct):
  m = _check_count("num_canaries", num_canaries)
  r = _check_count("num_guesses", num_guesses)
  v = _check_count("num_correct", num_correct)
  if not v <= r <= m:
    raise ValueError("Need num_correct <= num_guesses <= num_canaries; got "
                     f"{v}, {r}, {m}.")
  return m, r, v


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
                    delta: float = 0.0) -> float:
  """P-value of ``num_correct`` correct guesses under the null "(epsilon, delta)-DP".

  The right-hand side of Steinke, Nasr, Jagielski (2023), Theorem 3.1 (see the
  module docstring) with ``m = num_canaries``, ``r = num_guesses``,
  ``v = num_correct``, capped at 1.

  >>> round(one_run_p_value(10, 10, 10, 0.0), 6)   # 10 fair coins all correct: 2^-10
  0.000977
  >>> one_run_p_value(10, 10, 0, 1.0)
  1.0
  """
  m, r, v = _check_one_run(num_canaries, num_guesses, num_correct)
  delta = _check_delta(delta)
  epsilon = float(epsilon)
  if not epsilon >= 0:
    raise ValueError(f"`epsilon` must be >= 0; got {epsilon!r}.")
  if v == 0:
    return 1.0
  q = float(special.expit(epsilon))          # e^eps / (e^eps + 1)
  f_v = float(stats.binom.sf(v - 1, r, q))   # P[Binomial(r, q) >= v]
  if delta == 0.0:
    return min(f_v, 1.0)
  i = np.arange(1, v + 1)
  # f(v - i) - f(v) = P[v - i <= Binomial(r, q) <= v - 1].
  window = stats.binom.sf(v - i - 1, r, q) - f_v
  alpha = float(np.max(np.maximum(window, 0.0) / i))
  return min(f_v + 2.0 * m * delta * alpha, 1.0)


def one_run_epsilon_lower_bound(num_canaries: int, num_guesses: int, num_correct: int,
                                delta: float = 0.0, confidence: float = 0.95) -> float:
  """Steinke-Nasr-Jagielski one-run lower bound on epsilon.

  The largest ``eps`` with ``one_run_p_value(m, r, v, eps, delta) <= 1 - confidence``:
  with probability at least ``confidence`` over the canaries' coins and the
  training run, a mechanism that is ``(eps', delta)``-DP in each canary has
  ``eps' >= `` the returned value. Valid only if the guesses were fixed by a
  rule chosen before the coins were revealed (e.g. "top ``k+`` / bottom
  ``k-`` scores" with ``k+, k-`` fixed in advance, or several rules with a
  Bonferroni correction, as :func:`tf_dpnsgd.audit.one_run.audit_scores` does).

  Args:
    num_canaries: ``m``, canaries each included with probability 1/2.
    num_guesses: ``r <= m``, guesses made (abstentions excluded).
    num_correct: ``v <= r``, correct guesses.
    delta: the ``delta`` of the null hypothesis (the claimed delta).
    confidence: ``1 - beta``, e.g. 0.95.

  Search: doubling then bisection to :data:`EPSILON_TOLERANCE`, returning the low
  end, whose p-value is ``<= beta``. Any ``eps`` with p-value ``<= beta`` is a
  valid bound (an ``(eps*, delta)``-DP mechanism is ``(eps, delta)``-DP for every
  ``eps >= eps*``, so the theorem's tail bound holds at all of them), so the search
  needs no monotonicity of the p-value in ``eps``.

  Returns:
    A float ``>= 0`` (0 when the guesses do not reject even eps = 0).

  >>> one_run_epsilon_lower_bound(1000, 0, 0)
  0.0
  >>> round(one_run_epsilon_lower_bound(1000, 100, 75, delta=1e-4), 3)  # paper, App. D
  0.673
  """
  m, r, v = _check_one_run(num_canaries, num_guesses, num_correct)
  delta = _check_delta(delta)
  beta = 1.0 - _check_confidence(confidence)
  if v == 0 or one_run_p_value(m, r, v, 0.0, 0.0) > beta:
    return 0.0   # with delta = 0 the p-value is smallest; nothing to reject

  def rejected(eps):
    return one_run_p_value(m, r, v, eps, delta) <= beta

  if not rejected(0.0):
    return 0.0
  lo, hi = 0.0, 1.0
  while rejected(hi):          # the p-value tends to 1 as eps grows: this terminates
    lo, hi = hi, 2.0 * hi
  while hi - lo > EPSILON_TOLERANCE:
    mid = 0.5 * (lo + hi)
    if rejected(mid):
      lo = mid
    else:
      hi = mid
  return lo


def one_run_max_epsilon(num_canaries: int, delta: float = 0.0,
                        confidence: float = 0.95) -> float:
  """The largest lower bound ``m`` canaries can give: every canary guessed, all correct.

  With ``delta = 0`` this is ``log(q / (1 - q))`` for ``q = beta^(1/m)``
  (``q^m = beta``): about 5.81 for ``m = 1000`` at 95%, 3.49 for ``m = 100``.

  >>> round(one_run_max_epsilon(1000), 2)
  5.81
  """
  m = _check_count("num_canaries", num_canaries)
  return one_run_epsilon_lower_bound(m, m, m, delta=delta, confidence=confidence)


def clopper_pearson_interval(successes: int, trials: int, confidence: float = 0.95,
                             side: str = "two-sided") -> tuple:
  """Exact binomial confidence bounds ``(lo, hi)`` for ``successes / trials``.

  ``side="lower"``/``"upper"``: one-sided at level ``1 - confidence`` (the
  other end is 0 resp. 1); ``"two-sided"``: ``(1 - confidence) / 2`` per side.
  Clopper and Pearson (1934): quantiles of ``Beta(k, n - k + 1)`` and
  ``Beta(k + 1, n - k)``.

  >>> [round(b, 4) for b in clopper_pearson_interval(0, 10, side="upper")]
  [0.0, 0.2589]
  """
  k = _check_count("successes", successes)
  n = _check_count("trials", trials)
  if k > n:
    raise ValueError(f"successes ({k}) > trials ({n}).")
  alpha = 1.0 - _check_confidence(confidence)
  if side == "two-sided":
    alpha /= 2.0
  elif side not in ("lower", "upper"):
    raise ValueError(f"`side` must be 'two-sided', 'lower' or 'upper'; got {side!r}.")
  if n == 0:
    return 0.0, 1.0
  lo = 0.0 if k == 0 or side == "upper" else float(stats.beta.ppf(alpha, k, n - k + 1))
  hi = 1.0 if k == n or side == "lower" else float(stats.beta.ppf(1.0 - alpha, k + 1, n - k))
  return lo, hi


def clopper_pearson_epsilon_lower_bound(true_positives: int, false_positives: int,
                                        num_positives: int, num_negatives: int,
                                        delta: float = 0.0, confidence: float = 0.95) -> float:
  """Epsilon lower bound of a threshold attack from exact binomial intervals.

  ``max(0, log((TPR_lo - delta) / FPR_hi), log((1 - FPR_hi - delta) / (1 - TPR_lo)))``
  with ``TPR_lo`` the lower and ``FPR_hi`` the upper one-sided Clopper-Pearson
  bound, each at level ``(1 - confidence) / 2`` (jointly ``confidence``).
  Valid when the ``num_positives`` (member) and ``num_negatives``
  (non-member) trials are independent, e.g. one training run per trial, and
  the attack's threshold was fixed before seeing them.

  Args:
    true_positives: members the attack called members.
    false_positives: non-members the attack called members.
    num_positives, num_negatives: trials of each kind (> 0).
    delta: the claimed delta.
    confidence: joint confidence of both intervals.

  >>> clopper_pearson_epsilon_lower_bound(50, 50, 100, 100)   # a coin: no evidence
  0.0
  >>> round(clopper_pearson_epsilon_lower_bound(500, 0, 500, 500), 3)   # perfect attack
  4.906
  """
  tp = _check_count("true_positives", true_positives)
  fp = _check_count("false_positives", false_positives)
  n_pos = _check_count("num_positives", num_positives)
  n_neg = _check_count("num_negatives", num_negatives)
  if n_pos == 0 or n_neg == 0:
    raise ValueError("Need at least one positive and one negative trial.")
  if tp > n_pos or fp > n_neg:
    raise ValueError(f"Counts exceed trials: {tp}/{n_pos} true, {fp}/{n_neg} false positives.")
  delta = _check_delta(delta)
  confidence = _check_confidence(confidence)
  per_side = 1.0 - (1.0 - confidence) / 2.0
  tpr_lo, _ = clopper_pearson_interval(tp, n_pos, per_side, side="lower")
  _, fpr_hi = clopper_pearson_interval(fp, n_neg, per_side, side="upper")
  candidates = [0.0]
  if tpr_lo - delta > 0 and fpr_hi > 0:
    candidates.append(math.log((tpr_lo - delta) / fpr_hi))
  if 1.0 - fpr_hi - delta > 0 and tpr_lo < 1.0:
    candidates.append(math.log((1.0 - fpr_hi - delta) / (1.0 - tpr_lo)))
  return max(candidates)


__all__ = ["EPSILON_TOLERANCE", "clopper_pearson_epsilon_lower_bound", "clopper_pearson_interval",
           "one_run_epsilon_lower_bound", "one_run_max_epsilon", "one_run_p_value"]
