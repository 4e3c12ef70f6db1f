"""From canary scores to guesses, counts and the one-run lower bound.

The auditor of Steinke, Nasr, Jagielski (2023, Algorithm 1) scores every
canary (higher: more likely trained on), guesses "in" for the ``k+``
highest scores and "out" for the ``k-`` lowest, and abstains on the rest.
:func:`one_run_guesses` is that rule and :func:`audit_scores` turns the
guesses and the canaries' coins into :func:`~tf_dpnsgd.audit.bounds.one_run_epsilon_lower_bound`.

Choosing ``k+`` and ``k-``. The bound is valid only if the rule does not
look at the coins. :func:`audit_scores` either uses the ``(k+, k-)`` it is
given, or tries the rules of :func:`default_guess_rules` (fixed fractions of
``m``, independent of the data) and reports the best one **at confidence
``1 - beta / #rules``** (Bonferroni), so the reported bound keeps its
confidence ``1 - beta`` whichever rule wins. (The paper's experiments report
the best ``k`` without such a correction; we pay the small price, about
``log(#rules)`` in the tail, to keep the statement exact.)

Ties in the scores are broken by canary index (a stable sort): the index
is drawn before the coins, so this does not look at them either.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from tf_dpnsgd.audit import bounds

# Fractions of m guessed by the default rules: half "in" (top) and half "out" (bottom)
# at every fraction, and "in" only (top) up to half of m.
DEFAULT_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0)
TOP_ONLY_MAX_FRACTION = 0.5


def default_guess_rules(num_canaries: int,
                        fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> list:
  """``[(k_plus, k_minus), ...]``: symmetric rules at fixed fractions of ``m``, and top-only
  rules up to ``m / 2``. They depend on ``m`` only, never on the scores or coins.

  >>> default_guess_rules(100, (0.1, 1.0))
  [(5, 5), (10, 0), (50, 50)]
  """
  m = int(num_canaries)
  rules = []
  for f in fractions:
    total = max(1, int(round(f * m)))
    candidates = [(total - total // 2, total // 2)]
    if f <= TOP_ONLY_MAX_FRACTION:
      candidates.append((total, 0))
    for rule in candidates:
      if rule not in rules and 0 < sum(rule) <= m:
        rules.append(rule)
  return rules


def one_run_guesses(scores, k_plus: int, k_minus: int) -> np.ndarray:
  """Guesses ``+1`` (in) for the ``k_plus`` highest scores, ``-1`` (out) for the ``k_minus``
  lowest, ``0`` (abstain) otherwise; ties broken by index.

  >>> one_run_guesses([0.3, 2.0, -1.0, 0.0], 1, 2).tolist()
  [0, 1, -1, -1]
  """
  scores = np.asarray(scores, dtype=np.float64)
  m = scores.shape[0]
  if scores.ndim != 1:
    raise ValueError(f"`scores` must be one score per canary (1-D); got shape {scores.shape}.")
  if not np.all(np.isfinite(scores)):
    raise ValueError("`scores` contains NaN or inf: a score must be a finite number.")
  k_plus, k_minus = int(k_plus), int(k_minus)
  if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
    raise ValueError(f"Need k_plus, k_minus >= 0 and k_plus + k_minus <= m = {m}; got "
                     f"{k_plus}, {k_minus}.")
  order = np.argsort(-scores, kind="stable")   # highest first; ties: lower index first
  guesses = np.zeros(m, np.int8)
  guesses[order[:k_plus]] = 1
  if k_minus:
    guesses[order[m - k_minus:]] = -1
  return guesses


@dataclasses.dataclass(frozen=True)
class OneRunAudit:
  """The outcome of one one-run audit (a rule applied to scores and coins).

  Attributes:
    num_canaries: ``m``.
    k_plus, k_minus: the rule (top ``k_plus`` guessed in, bottom ``k_minus`` out).
    num_guesses, num_correct: ``r`` and ``v``.
    correct_in, correct_out: correct "in" and "out" guesses (``v`` split).
    delta: the null hypothesis' delta.
    confidence: the confidence of ``epsilon_lower_bound`` (after Bonferroni).
    num_rules: rules tried (1: the rule was given; else the Bonferroni factor).
    epsilon_lower_bound: the bound.
  """

  num_canaries: int
  k_plus: int
  k_minus: int
  num_guesses: int
  num_correct: int
  correct_in: int
  correct_out: int
  delta: float
  confidence: float
  num_rules: int
  epsilon_lower_bound: float

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _check_included(included, m) -> np.ndarray:
  included = np.asarray(included)
  if included.shape != (m,) or included.dtype != bool:
    raise ValueError(f"`included` must be a boolean array of one coin per canary ({m},); got "
                     f"{included.dtype} {included.shape}.")
  return included


def audit_rule(scores, included, k_plus: int, k_minus: int, delta: float = 0.0,
               confidence: float = 0.95, num_rules: int = 1) -> OneRunAudit:
  """Applies one guessing rule; the bound is at confidence ``1 - (1 - confidence) / num_rules``."""
  scores = np.asarray(scores, dtype=np.float64)
  included = _check_included(included, scores.shape[0])
  guesses = one_run_guesses(scores, k_plus, k_minus)
  correct_in = int(np.sum((guesses == 1) & included))
  correct_out = int(np.sum((guesses == -1) & ~included))
  r = int(np.sum(guesses != 0))
  v = correct_in + correct_out
  beta = (1.0 - float(confidence)) / int(num_rules)
  eps = bounds.one_run_epsilon_lower_bound(scores.shape[0], r, v, delta=delta,
                                           confidence=1.0 - beta)
  return OneRunAudit(num_canaries=int(scores.shape[0]), k_plus=int(k_plus), k_minus=int(k_minus),
                     num_guesses=r, num_correct=v, correct_in=correct_in,
                     correct_out=correct_out, delta=float(delta), confidence=1.0 - beta,
                     num_rules=int(num_rules), epsilon_lower_bound=eps)


def audit_scores(scores, included, k_plus: Optional[int] = None, k_minus: Optional[int] = None,
                 delta: float = 0.0, confidence: float = 0.95,
                 rules: Optional[Sequence[tuple]] = None) -> OneRunAudit:
  """The one-run lower bound from canary scores and coins.

  Args:
    scores: ``[m]`` finite scores, higher meaning "more likely included".
    included: ``[m]`` booleans, the canaries' coins (True: trained on).
    k_plus, k_minus: a fixed rule; give both or neither.
    delta: the claimed delta.
    confidence: overall confidence ``1 - beta`` of the returned bound.
    rules: the ``(k_plus, k_minus)`` rules to try when no fixed rule is given
      (default :func:`default_guess_rules`); the best is reported with a
      Bonferroni correction over ``len(rules)``.

  Returns:
    The :class:`OneRunAudit` of the chosen rule (its ``confidence`` is the
    per-rule confidence; the statement holds at ``confidence`` overall).
  """
  scores = np.asarray(scores, dtype=np.float64)
  m = scores.shape[0]
  if (k_plus is None) != (k_minus is None):
    raise ValueError("Give both `k_plus` and `k_minus`, or neither (then the default rules "
                     "are tried with a Bonferroni correction).")
  if k_plus is not None:
    return audit_rule(scores, included, k_plus, k_minus, delta, confidence)
  rules = list(default_guess_rules(m) if rules is None else rules)
  if not rules:
    raise ValueError("No guessing rule to try.")
  results = [audit_rule(scores, included, kp, km, delta, confidence, num_rules=len(rules))
             for kp, km in rules]
  return max(results, key=lambda a: (a.epsilon_lower_bound, a.num_correct))


def threshold_attack_counts(scores, included, k: int) -> tuple:
  """``(true_positives, false_positives, positives, negatives)`` of calling the top ``k`` "in"."""
  scores = np.asarray(scores, dtype=np.float64)
  included = _check_included(included, scores.shape[0])
  called = one_run_guesses(scores, k, 0) == 1
  return (int(np.sum(called & included)), int(np.sum(called & ~included)),
          int(np.sum(included)), int(np.sum(~included)))


def clopper_pearson_comparison(scores, included, delta: float = 0.0, confidence: float = 0.95,
                               ks: Optional[Sequence[int]] = None) -> dict:
  """The classic TPR/FPR bound on the same scores, for comparison only.

  Treats the ``m`` canaries of one run as independent trials of a threshold
  attack ("top ``k`` are members"), the best ``k`` of ``ks`` with a Bonferroni
  correction. One run does not make the trials independent (they share the
  noise and the model), so this is **not** a valid bound from one run; it is
  what a multi-run audit with this attack would give if it saw the same rates.
  """
  scores = np.asarray(scores, dtype=np.float64)
  m = scores.shape[0]
  ks = sorted({kp for kp, _ in default_guess_rules(m) if kp < m}) if ks is None else list(ks)
  best = {"epsilon_lower_bound": 0.0, "k": None}
  for k in ks:
    tp, fp, pos, neg = threshold_attack_counts(scores, included, k)
    if pos == 0 or neg == 0:
      continue
    eps = bounds.clopper_pearson_epsilon_lower_bound(
        tp, fp, pos, neg, delta=delta, confidence=1.0 - (1.0 - confidence) / len(ks))
    if eps > best["epsilon_lower_bound"] or best["k"] is None:
      best = {"epsilon_lower_bound": eps, "k": int(k), "true_positives": tp,
              "false_positives": fp, "positives": pos, "negatives": neg}
  best["valid_from_one_run"] = False
  return best


__all__ = ["DEFAULT_GUESS_FRACTIONS", "OneRunAudit", "TOP_ONLY_MAX_FRACTION", "audit_rule",
           "audit_scores", "clopper_pearson_comparison", "default_guess_rules",
           "one_run_guesses", "threshold_attack_counts"]
