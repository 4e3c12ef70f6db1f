"""The auditor of the field: in- and out-canary scores in, every measure of leakage out.

:class:`CanaryScoreAuditor` takes the scores of the canaries that were
trained on ("in") and of those that were not ("out"), higher meaning "more
likely in", and returns (:meth:`CanaryScoreAuditor.audit`):

* two one-run **lower bounds** on epsilon from the same guesses:
  Steinke, Nasr, Jagielski (2023; :func:`~tf_dpnsgd.audit.bounds.one_run_epsilon_lower_bound`)
  and the f-DP bound of Mahloujifar, Melis, Chaudhuri (2025;
  :func:`~tf_dpnsgd.audit.fdp.fdp_one_run_epsilon_lower_bound`), each with the
  **threshold strategy** that chose the guesses (:class:`TopK` with a
  Bonferroni correction over the rules tried, or :class:`Split`);
* a Gaussian-DP **estimate** of epsilon (:func:`~tf_dpnsgd.audit.measures.gdp_epsilon_estimate`):
  *not* a bound from one run (see its docstring);
* :func:`~tf_dpnsgd.audit.measures.tpr_at_fpr` and :func:`~tf_dpnsgd.audit.measures.auroc`,
  the attack's power, no privacy statement (all in :mod:`tf_dpnsgd.audit.measures`).

The API follows jax-privacy's ``CanaryScoreAuditor`` (google-deepmind/jax_privacy,
``auditing.py``); the code is written anew here on NumPy/SciPy.

Guesses are **threshold rules**: "in" for every score ``>= t+``, "out" for every
score ``<= t-`` (and ``< t+``), abstain otherwise. A rule "top ``k+`` / bottom
``k-``" sets ``t+`` to the ``k+``-th highest and ``t-`` to the ``k-``-th lowest
score; tied scores are all guessed or all not, so a rule is a function of the
scores alone and never of which canaries are in (the in/out split given to
this class carries no order that could break ties). For distinct scores this
is exactly :func:`tf_dpnsgd.audit.one_run.one_run_guesses`.

Valid only if the in/out assignment was fair coins drawn independently of
everything the scores depend on except through training
(:func:`tf_dpnsgd.audit.canaries.draw_inclusion`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional, Sequence

import numpy as np

from tf_dpnsgd.audit import bounds
from tf_dpnsgd.audit import fdp
from tf_dpnsgd.audit import measures
from tf_dpnsgd.audit import one_run

STEINKE = "steinke"
FDP = "fdp"
METHODS = (STEINKE, FDP)
METHOD_NAMES = {
    STEINKE: ("Steinke, Nasr, Jagielski (NeurIPS 2023), one run: (eps, delta)-DP compared with "
              "eps-randomized response"),
    FDP: ("Mahloujifar, Melis, Chaudhuri (ICML 2025), f-DP in one run: the Gaussian trade-off "
          "curve through the claimed (eps, delta) (rejects mu(eps, delta)-GDP)"),
}
DEFAULT_FPRS = (0.01, 0.1)


# --- threshold rules and strategies -------------------------------------------------------
def rule_thresholds(scores, k_plus: int, k_minus: int) -> tuple:
  """``(t_plus, t_minus)`` of "top ``k+`` / bottom ``k-``": the ``k+``-th highest and the
  ``k-``-th lowest score (``+inf`` / ``-inf`` for 0).

  >>> rule_thresholds([0.3, 2.0, -1.0, 0.0], 1, 2)
  (2.0, 0.0)
  """
  s = np.sort(measures.scores_array("scores", scores))
  m = len(s)
  k_plus, k_minus = int(k_plus), int(k_minus)
  if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
    raise ValueError(f"Need k_plus, k_minus >= 0 and k_plus + k_minus <= m = {m}; got "
                     f"{k_plus}, {k_minus}.")
  t_plus = float(s[m - k_plus]) if k_plus else math.inf
  t_minus = float(s[k_minus - 1]) if k_minus else -math.inf
  return t_plus, t_minus


def threshold_counts(in_scores, out_scores, t_plus: float, t_minus: float) -> tuple:
  """``(num_guesses, num_correct, correct_in, correct_out)`` of the rule "in if score >=
  t+, else out if score <= t-, else abstain".

  >>> threshold_counts([3.0, 1.0], [0.0, 2.0], 2.0, 0.0)   # in: 3, 2 (wrong); out: 0
  (3, 2, 1, 1)
  """
  a_in = measures.scores_array("in_scores", in_scores)
  a_out = measures.scores_array("out_scores", out_scores)
  in_guessed_in = a_in >= t_plus
  out_guessed_in = a_out >= t_plus
  in_guessed_out = ~in_guessed_in & (a_in <= t_minus)
  out_guessed_out = ~out_guessed_in & (a_out <= t_minus)
  correct_in, correct_out = int(in_guessed_in.sum()), int(out_guessed_out.sum())
  guesses = correct_in + correct_out + int(out_guessed_in.sum()) + int(in_guessed_out.sum())
  return guesses, correct_in + correct_out, correct_in, correct_out


@dataclasses.dataclass(frozen=True)
class TopK:
  """Try each rule "top ``k+`` in / bottom ``k-`` out" of ``rules`` (default
  :func:`tf_dpnsgd.audit.one_run.default_guess_rules` of ``m``: fixed fractions of ``m``)
  and report the best at confidence ``1 - beta / len(rules)`` (Bonferroni): the bound
  holds at ``1 - beta`` whichever rule wins."""

  rules: Optional[tuple] = None
  name: ClassVar[str] = "top_k_bonferroni"

  def describe(self, m: int) -> str:
    n = len(self.rules_for(m))
    return (f"best of {n} fixed top-k+/bottom-k- threshold rules, each at confidence "
            f"1 - beta/{n} (Bonferroni)")

  def rules_for(self, m: int) -> list:
    rules = list(one_run.default_guess_rules(m) if self.rules is None else self.rules)
    if not rules:
      raise ValueError("TopK needs at least one (k_plus, k_minus) rule.")
    return rules


@dataclasses.dataclass(frozen=True)
class Split:
  """Choose the rule on a random ``fraction`` of the canaries (best of :class:`TopK`'s rules
  there, no correction), then apply its thresholds to the other canaries and compute the
  bound on them alone (``m`` = their number) at the full confidence. ``seed``: the
  partition's seed (``None``: from the OS); it must not depend on the coins."""

  fraction: float = 0.5
  seed: Optional[int] = None
  rules: Optional[tuple] = None
  name: ClassVar[str] = "split"

  def __post_init__(self):
    if not 0.0 < float(self.fraction) < 1.0:
      raise ValueError(f"Split `fraction` must lie in (0, 1); got {self.fraction!r}.")

  def describe(self, m: int) -> str:
    return (f"thresholds of the best top-k+/bottom-k- rule on a random {self.fraction:g} of "
            "the canaries, bound on the rest at full confidence")


@dataclasses.dataclass(frozen=True)
class BoundResult:
  """One lower bound and the guesses it came from.

  Attributes:
    method: :data:`STEINKE` or :data:`FDP` (:data:`METHOD_NAMES` says which paper).
    epsilon_lower_bound: the bound (``>= 0``), holding at ``confidence``.
    confidence: overall confidence of the bound (after the strategy's correction).
    rule_confidence: the confidence at which the winning rule's counts were evaluated.
    strategy: the threshold strategy's name (``top_k_bonferroni`` or ``split``).
    num_rules: rules tried (the Bonferroni factor for TopK; 1 for the bound of Split).
    k_plus, k_minus: the winning rule (on the split's first part, for Split).
    t_plus, t_minus: its thresholds.
    num_canaries: canaries the bound is about (``m``, or the second part's size).
    num_guesses, num_correct, correct_in, correct_out: its counts.
  """

  method: str
  epsilon_lower_bound: float
  confidence: float
  rule_confidence: float
  strategy: str
  num_rules: int
  k_plus: int
  k_minus: int
  t_plus: float
  t_minus: float
  num_canaries: int
  num_guesses: int
  num_correct: int
  correct_in: int
  correct_out: int

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    for k in ("t_plus", "t_minus"):   # JSON has no inf
      d[k] = None if math.isinf(d[k]) else float(d[k])
    d["reference"] = METHOD_NAMES[self.method]
    return d


def epsilon_lower_bound(method: str, num_canaries: int, num_guesses: int, num_correct: int,
                        delta: float, confidence: float) -> float:
  """Dispatch to the bound of ``method`` (:data:`METHODS`) for one rule's counts."""
  if method == STEINKE:
    return bounds.one_run_epsilon_lower_bound(num_canaries, num_guesses, num_correct,
                                              delta=delta, confidence=confidence)
  if method == FDP:
    return fdp.fdp_one_run_epsilon_lower_bound(num_canaries, num_guesses, num_correct,
                                               delta=delta, confidence=confidence)
  raise ValueError(f"`method` must be one of {METHODS}; got {method!r}.")


@dataclasses.dataclass(frozen=True)
class CanaryAudit:
  """Everything :meth:`CanaryScoreAuditor.audit` measured (``to_dict()`` is JSON-ready).

  Attributes:
    delta, confidence: the claimed delta and each bound's confidence.
    strategy: the threshold strategy's name and description.
    bounds: ``{method: BoundResult}`` for :data:`METHODS`.
    gdp_mu_estimate, gdp_epsilon_estimate: the Gaussian-DP fit (an estimate, not a bound).
    auroc: area under the attack's ROC curve.
    tpr_at_fpr: ``{fpr: tpr}``.
    num_in, num_out: canaries of each kind.
  """

  delta: float
  confidence: float
  strategy: str
  strategy_description: str
  bounds: dict
  gdp_mu_estimate: float
  gdp_epsilon_estimate: float
  auroc: float
  tpr_at_fpr: dict
  num_in: int
  num_out: int

  @property
  def steinke(self) -> BoundResult:
    return self.bounds[STEINKE]

  @property
  def fdp(self) -> BoundResult:
    return self.bounds[FDP]

  def to_dict(self) -> dict:
    return {
        "delta": float(self.delta), "confidence": float(self.confidence),
        "strategy": self.strategy, "strategy_description": self.strategy_description,
        "lower_bounds": {k: v.to_dict() for k, v in self.bounds.items()},
        "gdp_mu_estimate": float(self.gdp_mu_estimate),
        "gdp_epsilon_estimate": float(self.gdp_epsilon_estimate),
        "gdp_estimate_note": ("an estimate, not a bound: a Gaussian trade-off curve fitted to "
                              "the ROC with the canaries treated as independent trials, which "
                              "they are not in one run"),
        "auroc": float(self.auroc),
        "tpr_at_fpr": {f"{k:g}": float(v) for k, v in self.tpr_at_fpr.items()},
        "num_in": int(self.num_in), "num_out": int(self.num_out),
    }


class CanaryScoreAuditor:
  """Privacy measures from the scores of in- and out-canaries (higher: more likely in).

  >>> auditor = CanaryScoreAuditor(in_scores=[3.0, 2.5, 0.2], out_scores=[0.1, -1.0, 0.4])
  >>> auditor.auroc()
  0.8888888888888888
  >>> result = auditor.audit(delta=1e-5)
  >>> result.strategy, result.steinke.epsilon_lower_bound, result.fdp.epsilon_lower_bound
  ('top_k_bonferroni', 0.0, 0.0)
  """

  def __init__(self, in_scores: Sequence[float], out_scores: Sequence[float]):
    self.in_scores = measures.scores_array("in_scores", in_scores)
    self.out_scores = measures.scores_array("out_scores", out_scores)

  @classmethod
  def from_scores(cls, scores, included) -> "CanaryScoreAuditor":
    """From ``[m]`` scores and ``[m]`` boolean coins (True: trained on)."""
    scores = np.asarray(scores, np.float64)
    included = np.asarray(included)
    if included.dtype != bool or included.shape != scores.shape or scores.ndim != 1:
      raise ValueError(f"`included` must be one boolean coin per score; got {included.dtype} "
                       f"{included.shape} for scores {scores.shape}.")
    return cls(scores[included], scores[~included])

  @property
  def num_canaries(self) -> int:
    return len(self.in_scores) + len(self.out_scores)

  def tpr_at_fpr(self, fpr: float) -> float:
    return measures.tpr_at_fpr(self.in_scores, self.out_scores, fpr)

  def auroc(self) -> float:
    return measures.auroc(self.in_scores, self.out_scores)

  def gdp_epsilon_estimate(self, delta: float, confidence: Optional[float] = 0.95) -> float:
    return measures.gdp_epsilon_estimate(self.in_scores, self.out_scores, delta, confidence)

  def _rule_result(self, method, in_s, out_s, rule, delta, rule_confidence, confidence,
                   strategy, num_rules, thresholds=None) -> BoundResult:
    all_scores = np.concatenate([in_s, out_s])
    t_plus, t_minus = thresholds or rule_thresholds(all_scores, *rule)
    r, v, c_in, c_out = threshold_counts(in_s, out_s, t_plus, t_minus)
    m = len(all_scores)
    eps = epsilon_lower_bound(method, m, r, v, delta, rule_confidence)
    return BoundResult(method=method, epsilon_lower_bound=eps, confidence=confidence,
                       rule_confidence=rule_confidence, strategy=strategy.name,
                       num_rules=num_rules, k_plus=int(rule[0]), k_minus=int(rule[1]),
                       t_plus=t_plus, t_minus=t_minus, num_canaries=m, num_guesses=r,
                       num_correct=v, correct_in=c_in, correct_out=c_out)

  def _best_rule(self, method, in_s, out_s, rules, delta, rule_confidence, confidence,
                 strategy, num_rules) -> BoundResult:
    results = [self._rule_result(method, in_s, out_s, rule, delta, rule_confidence, confidence,
                                 strategy, num_rules) for rule in rules]
    return max(results, key=lambda b: (b.epsilon_lower_bound,
                                       b.num_correct - b.num_guesses / 2.0))

  def epsilon_lower_bound(self, method: str, delta: float, confidence: float = 0.95,
                          strategy=None) -> BoundResult:
    """The one-run lower bound of ``method`` (:data:`METHODS`) at ``confidence`` overall.

    Args:
      method: ``"steinke"`` or ``"fdp"``.
      delta: the claimed delta (``> 0`` for ``"fdp"``).
      confidence: ``1 - beta``.
      strategy: :class:`TopK` (default) or :class:`Split`.
    """
    strategy = TopK() if strategy is None else strategy
    confidence = bounds._check_confidence(confidence)
    if isinstance(strategy, TopK):
      rules = strategy.rules_for(self.num_canaries)
      rule_confidence = 1.0 - (1.0 - confidence) / len(rules)
      return self._best_rule(method, self.in_scores, self.out_scores, rules, delta,
                             rule_confidence, confidence, strategy, len(rules))
    if isinstance(strategy, Split):
      rng = np.random.default_rng(strategy.seed)
      parts = []
      for a in (self.in_scores, self.out_scores):
        first = rng.random(len(a)) < strategy.fraction
        parts.append((a[first], a[~first]))
      (in1, in2), (out1, out2) = parts
      if min(len(in1) + len(out1), len(in2) + len(out2)) == 0:
        raise ValueError("Split left one part without canaries: use more canaries or a "
                         "fraction nearer 1/2.")
      m1 = len(in1) + len(out1)
      rules = list(one_run.default_guess_rules(m1) if strategy.rules is None else
                   strategy.rules)
      chosen = self._best_rule(method, in1, out1, rules, delta, confidence, confidence,
                               strategy, len(rules))
      return self._rule_result(method, in2, out2, (chosen.k_plus, chosen.k_minus), delta,
                               confidence, confidence, strategy, 1,
                               thresholds=(chosen.t_plus, chosen.t_minus))
    raise ValueError(f"`strategy` must be TopK(...) or Split(...); got {strategy!r}.")

  def audit(self, delta: float, confidence: float = 0.95, strategy=None,
            fprs: Sequence[float] = DEFAULT_FPRS) -> CanaryAudit:
    """Both one-run bounds, the Gaussian-DP estimate, AUROC and TPR at each of ``fprs``."""
    strategy = TopK() if strategy is None else strategy
    found = {method: self.epsilon_lower_bound(method, delta, confidence, strategy)
             for method in METHODS}
    mu = measures.gdp_mu_estimate(self.in_scores, self.out_scores, confidence)
    return CanaryAudit(
        delta=float(delta), confidence=float(confidence), strategy=strategy.name,
        strategy_description=strategy.describe(self.num_canaries), bounds=found,
        gdp_mu_estimate=mu, gdp_epsilon_estimate=fdp.gaussian_dp_epsilon(mu, delta),
        auroc=self.auroc(), tpr_at_fpr={float(f): self.tpr_at_fpr(f) for f in fprs},
        num_in=len(self.in_scores), num_out=len(self.out_scores))


__all__ = ["BoundResult", "CanaryAudit", "CanaryScoreAuditor", "DEFAULT_FPRS", "FDP", "METHODS",
           "METHOD_NAMES", "STEINKE", "Split", "TopK", "epsilon_lower_bound", "rule_thresholds",
           "threshold_counts"]
