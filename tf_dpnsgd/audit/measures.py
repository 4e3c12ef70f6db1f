"""How well an attack tells in- from out-canaries: ROC, TPR at low FPR, AUROC, a GDP fit.

Measures of an attack's power from the scores of in- and out-canaries (higher:
more likely in). None of them is a privacy *bound*:
:func:`tpr_at_fpr` and :func:`auroc` make no privacy statement, and
:func:`gdp_epsilon_estimate` is an estimate (see :func:`gdp_mu_estimate`). The
one-run lower bounds are in :mod:`tf_dpnsgd.audit.auditor`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy import stats

from tf_dpnsgd.audit import bounds
from tf_dpnsgd.audit import fdp


def scores_array(name, values) -> np.ndarray:
  a = np.asarray(values, dtype=np.float64).reshape(-1)
  if a.size == 0:
    raise ValueError(f"`{name}` is empty: the audit needs at least one in and one out canary.")
  if not np.all(np.isfinite(a)):
    raise ValueError(f"`{name}` contains NaN or inf: a score must be a finite number.")
  return a


def roc_counts(in_scores, out_scores) -> tuple:
  """``(thresholds, tp, fp)`` of the rules "in iff score >= t", ``t`` from ``+inf`` down
  through every distinct score: ``tp[j] = #{in >= t_j}``, ``fp[j] = #{out >= t_j}``
  (both non-decreasing, from ``(0, 0)`` to ``(n_in, n_out)``).

  >>> t, tp, fp = roc_counts([2.0, 3.0], [1.0, 2.0])
  >>> t.tolist(), tp.tolist(), fp.tolist()
  ([inf, 3.0, 2.0, 1.0], [0, 1, 2, 2], [0, 0, 1, 2])
  """
  a_in, a_out = scores_array("in_scores", in_scores), scores_array("out_scores", out_scores)
  thresholds = np.concatenate([[np.inf], np.unique(np.concatenate([a_in, a_out]))[::-1]])
  tp = len(a_in) - np.searchsorted(np.sort(a_in), thresholds, side="left")
  fp = len(a_out) - np.searchsorted(np.sort(a_out), thresholds, side="left")
  return thresholds, tp.astype(np.int64), fp.astype(np.int64)


def tpr_at_fpr(in_scores, out_scores, fpr: float) -> float:
  """The largest true-positive rate of a threshold rule whose false-positive rate is at most
  ``fpr`` (deterministic rules "in iff score >= t"; no interpolation between them).

  >>> tpr_at_fpr([1.0, 3.0], [0.0, 2.0], 0.0), tpr_at_fpr([1.0, 3.0], [0.0, 2.0], 0.5)
  (0.5, 1.0)
  """
  fpr = float(fpr)
  if not 0.0 <= fpr <= 1.0:
    raise ValueError(f"`fpr` must lie in [0, 1]; got {fpr!r}.")
  _, tp, fp = roc_counts(in_scores, out_scores)
  n_in, n_out = tp[-1], fp[-1]
  ok = fp <= fpr * n_out + 1e-9 * n_out
  return float(tp[ok].max() / n_in)


def auroc(in_scores, out_scores) -> float:
  """Area under the ROC curve: ``P[in > out] + P[in == out] / 2`` over all pairs (the
  Mann-Whitney statistic, from average ranks). 0.5: no signal; 1: perfect separation.
  This is the area under the empirical ROC curve of the threshold rules; jax-privacy's
  ``attack_auroc`` reports the area under its convex hull (randomized rules), which is
  never smaller.

  >>> auroc([0, 4, 6, 7], [1, 2, 3, 5])   # 0 + 3 + 4 + 4 = 11 of 16 pairs ordered right
  0.6875
  """
  a_in, a_out = scores_array("in_scores", in_scores), scores_array("out_scores", out_scores)
  ranks = stats.rankdata(np.concatenate([a_in, a_out]))   # ties: average rank
  u = ranks[:len(a_in)].sum() - len(a_in) * (len(a_in) + 1) / 2.0
  return float(u / (len(a_in) * len(a_out)))


def _clopper_pearson_upper(k: np.ndarray, n: int, significance: float) -> np.ndarray:
  """One-sided upper Clopper-Pearson bounds of ``k / n`` at level ``significance``."""
  k = np.asarray(k)
  out = np.ones(k.shape, np.float64)
  below = k < n
  out[below] = stats.beta.ppf(1.0 - significance, k[below] + 1, n - k[below])
  return out


def gdp_mu_estimate(in_scores, out_scores, confidence: Optional[float] = 0.95) -> float:
  """Gaussian-DP ``mu`` fitted to the attack's ROC curve. An **estimate**, not a bound.

  A ``mu``-GDP mechanism forces every test to have ``FNR >= Phi(Phi^-1(1 - FPR) - mu)``,
  i.e. ``mu >= Phi^-1(1 - FPR) - Phi^-1(FNR)`` (Dong, Roth, Su 2022). Over every threshold
  rule this returns the largest such value (0 if none is positive), with ``FPR`` and
  ``FNR`` replaced by their one-sided Clopper-Pearson upper bounds at level
  ``(1 - confidence) / (2 * #thresholds)`` (Bonferroni over both rates and all
  thresholds), as in Nasr et al. 2023 (arXiv:2302.07956) and jax-privacy's
  ``epsilon_from_gdp``; ``confidence=None`` uses the raw rates (rules with a rate of 0 or 1
  are then skipped).

  Why an estimate: the Clopper-Pearson intervals treat the canaries as independent
  trials, which they are in a multi-run audit but not in one run (all canaries share the
  noise and the model), and the fit assumes the mechanism is exactly Gaussian. Use it to
  see how far the scores' ROC curve is from a Gaussian one, never as evidence about a
  claim; the one-run bounds are the evidence.
  """
  _, tp, fp = roc_counts(in_scores, out_scores)
  n_in, n_out = int(tp[-1]), int(fp[-1])
  fn = n_in - tp
  if confidence is None:
    fpr, fnr = fp / n_out, fn / n_in
  else:
    significance = (1.0 - bounds._check_confidence(confidence)) / (2 * len(tp))
    fpr = _clopper_pearson_upper(fp, n_out, significance)
    fnr = _clopper_pearson_upper(fn, n_in, significance)
  ok = (fpr > 0) & (fpr < 1) & (fnr > 0) & (fnr < 1)
  if not np.any(ok):
    return 0.0
  mu = stats.norm.isf(fpr[ok]) - stats.norm.ppf(fnr[ok])
  return float(max(0.0, mu.max()))


def gdp_epsilon_estimate(in_scores, out_scores, delta: float,
                         confidence: Optional[float] = 0.95) -> float:
  """``(eps, delta)`` of the Gaussian-DP fit :func:`gdp_mu_estimate`. An **estimate** of
  epsilon, not a lower bound (see :func:`gdp_mu_estimate` for why).

  >>> gdp_epsilon_estimate([1.0, 2.0], [1.5, 0.5], delta=1e-5)   # nothing to fit
  0.0
  """
  mu = gdp_mu_estimate(in_scores, out_scores, confidence)
  return fdp.gaussian_dp_epsilon(mu, delta)


__all__ = ["auroc", "gdp_epsilon_estimate", "gdp_mu_estimate", "roc_counts", "scores_array",
           "tpr_at_fpr"]
