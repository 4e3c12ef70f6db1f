"""The math of hyperparameter tuning: its privacy cost, and the chance of landing near the best.

This module is long (about 520 lines, 70 of them this docstring): the two theorems of
Papernot & Steinke (2022) are stated here with the two trial distributions they are about,
so each bound can be checked against its statement in one file.

Privacy of tuning
=================

A sweep that trains ``n`` models on the same private data and publishes
all of them (or all their accuracies, e.g. as a heatmap) is the adaptive
composition of ``n`` DP runs: its RDP is the sum of the runs' RDP curves
(Mironov 2017, Prop. 1). :func:`composed_rdp`.

Papernot & Steinke (2022) analyse *random search*: draw a random number of
trials ``K``; in each trial pick hyperparameters independently of the data
(e.g. a uniformly random cell of the grid), train one DP model and score it;
release only the best trial (its model and score). With ``K`` truncated
negative binomial (Theorem 2, incl. the logarithmic and geometric cases) or
Poisson (Theorem 6), the RDP of the whole procedure exceeds that of one
trial by a term that grows with ``log E[K]``, not with ``K``.
:class:`TruncatedNegativeBinomial`, :class:`Poisson`.

Each trial here is one training run with its own hyperparameters, so the
trials are not identically distributed. A trial draws a cell independently
of the data and runs it, so its output distribution is a data-independent
mixture of the cells' output distributions; Renyi divergence is jointly
quasi-convex (van Erven & Harremoes 2014, Thm. 13), so the trial is
``(lambda, max_cells eps_cell(lambda))``-RDP at every order:
:func:`worst_case_rdp` (the pointwise maximum of the cells' curves).

What the bounds assume (stated in every report):

* each run uses fresh, secret randomness (sampling and noise seeds);
* the score that picks the best trial is computed on data outside the
  protected training set (our launchers score on the test split), or is
  itself accounted for in the trial's RDP;
* for the random-search bound: only the best trial is released; the number
  of trials is drawn from the stated distribution and the cells uniformly
  (any data-independent choice works); the *grid* that was actually swept
  and published is covered by the naive composition only.

Landing near the best
=====================

:func:`random_search_success` says how likely random search with a given
trial distribution is to land in a near-best cell (e.g. the fraction that
:func:`tf_dpnsgd.sweeps.robustness_summary` finds in a heatmap, which this
module re-exports as ``robustness_summary``); :func:`poisson_for_success` and
:func:`truncated_negative_binomial_for_success` give the fewest trials that
reach one with a given probability.

The algebra of RDP curves used here (:func:`validate_curve`,
:func:`monotone_rdp`, :func:`composed_rdp`, :func:`worst_case_rdp`,
:func:`rdp_to_epsilon`, :func:`rdp_to_delta`, ...) lives in
:mod:`tf_dpnsgd.accounting.rdp` and is re-exported here; it raises
:class:`tf_dpnsgd.accounting.AccountingError`.

References:
  Papernot, Steinke (2022), "Hyperparameter Tuning with Renyi Differential
  Privacy", ICLR: Definition 1 / eq. (2) (truncated negative binomial and its
  mean), Theorem 2 (truncated negative binomial), Theorem 6 (Poisson).
  Mironov (2017), "Renyi Differential Privacy": Prop. 1 (composition), Prop. 3
  (conversion to (epsilon, delta)), monotonicity in the order.
  Canonne, Kamath, Steinke (2020), "The Discrete Gaussian for Differential
  Privacy", Prop. 12 (the "modern" conversion).
  van Erven, Harremoes (2014), "Renyi Divergence and Kullback-Leibler
  Divergence", IEEE Trans. Inf. Theory: Thm. 3 (monotone in the order),
  Thm. 13 (joint quasi-convexity).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from tf_dpnsgd import accounting
# The algebra of RDP curves lives beside the other RDP code; re-exported (public API).
from tf_dpnsgd.accounting.rdp import (common_orders, composed_rdp, monotone_rdp, rdp_to_delta,
                                      rdp_to_epsilon, validate_conversion, validate_curve,
                                      worst_case_rdp)


class TuningError(accounting.AccountingError):
  """A tuning-privacy request with no valid answer (bad parameters or inconsistent runs).

  A subclass of :class:`tf_dpnsgd.accounting.AccountingError` (a ``ValueError``), which
  the RDP-curve functions re-exported here (:func:`validate_curve`, ...) raise.
  """


# --------------------------------------------------------------------------
# Distributions of the number of trials, and their tuning bounds.
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TuningRdp:
  """RDP of a whole tuning procedure at each order, and how it was obtained.

  ``lambda_hat`` is the order that minimised Theorem 2's second-order terms
  (truncated negative binomial); ``epsilon_hat`` / ``delta_hat`` the
  per-order ``(epsilon_hat, delta_hat)``-DP used by Theorem 6 (Poisson).
  """

  orders: np.ndarray
  rdp: np.ndarray
  distribution: "TrialDistribution"
  lambda_hat: Optional[float] = None
  epsilon_hat: Optional[np.ndarray] = None
  delta_hat: Optional[np.ndarray] = None


_LOG_GAMMA_MIN = -700.0  # exp(-700) ~ 1e-304: still a normal float


def _validate_unit_interval(name, value):
  try:
    v = float(value)
  except (TypeError, ValueError) as e:
    raise TuningError(f"`{name}` must be a number in (0, 1); got {value!r}.") from e
  if not 0.0 < v < 1.0:
    raise TuningError(f"`{name}` must lie strictly between 0 and 1; got {value!r}.")
  return v


@dataclasses.dataclass(frozen=True)
class TruncatedNegativeBinomial:
  """``K ~ D_{eta, gamma}``: the truncated negative binomial number of trials.

  Papernot & Steinke (2022) Definition 1: for ``eta > -1`` (``eta != 0``)
  and ``gamma in (0, 1)``, ``P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) *
  prod_{l=0}^{k-1} (l + eta) / (l + 1)`` for ``k = 1, 2, ...``; ``eta = 0``
  is the logarithmic distribution ``P[K = k] = (1 - gamma)^k / (k
  log(1/gamma))``; ``eta = 1`` the geometric ``P[K = k] = gamma (1 -
  gamma)^(k-1)``.
  """

  eta: float
  gamma: float

  def __post_init__(self):
    try:
      eta = float(self.eta)
    except (TypeError, ValueError) as e:
      raise TuningError(f"`eta` must be a number > -1; got {self.eta!r}.") from e
    if not (math.isfinite(eta) and eta > -1.0):
      raise TuningError(f"`eta` must be a finite number > -1; got {self.eta!r}.")
    object.__setattr__(self, "eta", eta)
    object.__setattr__(self, "gamma", _validate_unit_interval("gamma", self.gamma))

  @property
  def label(self) -> str:
    name = {0.0: "logarithmic", 1.0: "geometric"}.get(self.eta, "truncated negative binomial")
    return f"{name} (eta={self.eta:g}, gamma={self.gamma:.6g})"

  @property
  def mean(self) -> float:
    """``E[K]`` (Papernot & Steinke 2022, Sec. 2.2 / Thm. 2):
    ``eta (1 - gamma) / (gamma (1 - gamma^eta))`` for ``eta != 0``,
    ``(1/gamma - 1) / log(1/gamma)`` for ``eta = 0``.

    >>> TruncatedNegativeBinomial(1.0, 0.25).mean   # geometric: 1 / gamma
    4.0
    """
    g = self.gamma
    if self.eta == 0.0:
      return (1.0 / g - 1.0) / math.log(1.0 / g)
    # 1 - gamma^eta = -expm1(eta log gamma), stable for eta near 0.
    return self.eta * (1.0 - g) / (g * -math.expm1(self.eta * math.log(g)))

  def pmf(self, k: int) -> float:
    """``P[K = k]`` (0 for ``k < 1``)."""
    if k < 1:
      return 0.0
    g, eta = self.gamma, self.eta
    if eta == 0.0:
      return (1.0 - g) ** k / (k * math.log(1.0 / g))
    # prod_{l<k} (l + eta) / (l + 1) = eta Gamma(k + eta) / (Gamma(1 + eta) k!); for
    # -1 < eta < 0 both it and gamma^-eta - 1 are negative, so take absolute values.
    log_prod = (math.log(abs(eta)) + math.lgamma(k + eta) - math.lgamma(1.0 + eta)
                - math.lgamma(k + 1.0))
    return math.exp(k * math.log1p(-g) + log_prod) / abs(math.expm1(-eta * math.log(g)))

  def pgf(self, s: float) -> float:
    """``E[s^K]`` for ``s in [0, 1]``: ``((1 - (1-gamma) s)^-eta - 1) / (gamma^-eta - 1)``,
    or ``log(1 - (1-gamma) s) / log(gamma)`` for ``eta = 0`` (the negative binomial series)."""
    if not 0.0 <= s <= 1.0:
      raise TuningError(f"`s` must lie in [0, 1]; got {s!r}.")
    g, eta = self.gamma, self.eta
    x = math.log1p(-(1.0 - g) * s)  # log(1 - (1-gamma) s), in [log(gamma), 0]
    if eta == 0.0:
      return x / math.log(g)
    a, b = -eta * x, -eta * math.log(g)
    if eta < 0.0:  # a, b <= 0: no overflow
      return math.expm1(a) / math.expm1(b)
    # 0 <= a <= b, b possibly huge: (e^a - 1) / (e^b - 1) = e^(a-b) (1 - e^-a) / (1 - e^-b).
    return math.exp(a - b) * -math.expm1(-a) / -math.expm1(-b)

  @classmethod
  def with_mean(cls, eta: float, mean: float) -> "TruncatedNegativeBinomial":
    """The distribution with shape ``eta`` and ``E[K] = mean`` (to 1e-12 relative).

    ``E[K]`` decreases from ``inf`` (``gamma -> 0``) to 1 (``gamma -> 1``);
    bisection on ``log(gamma)``.
    """
    try:
      target = float(mean)
    except (TypeError, ValueError) as e:
      raise TuningError(f"`mean` must be a finite number > 1; got {mean!r}.") from e
    if not (math.isfinite(target) and target > 1.0):
      raise TuningError(f"`mean` must be a finite number > 1 (E[K] >= 1 always); got {mean!r}.")
    cls(eta, 0.5)  # validates eta
    lo, hi = _LOG_GAMMA_MIN, 0.0  # log(gamma); E[K](exp(lo)) is astronomically large
    for _ in range(200):
      mid = 0.5 * (lo + hi)
      if mid == lo or mid == hi:
        break
      if cls(eta, math.exp(mid)).mean > target:
        lo = mid
      else:
        hi = mid
    return cls(eta, math.exp(hi) if hi < 0 else math.exp(lo))

  def tuning_rdp(self, orders, rdp, conversion: str = "modern") -> TuningRdp:
    """Theorem 2 of Papernot & Steinke (2022), optimised over ``lambda_hat``.

    Formal statement: if one trial is ``(lambda, eps)``-RDP and
    ``(lambda_hat, eps_hat)``-RDP (``lambda > 1``, ``lambda_hat >= 1``), then
    running ``K ~ D_{eta, gamma}`` trials and releasing the best is
    ``(lambda, eps')``-RDP with

      ``eps' = eps + (1 + eta) (1 - 1/lambda_hat) eps_hat
              + (1 + eta) log(1/gamma) / lambda_hat + log(E[K]) / (lambda - 1)``.

    The middle terms do not depend on ``lambda``; they are minimised once over
    the curve's orders (``lambda_hat``). ``conversion`` is unused (kept for
    the common interface with :class:`Poisson`).

    Edge cases: orders where the trial's RDP is ``inf`` get ``inf``; if every
    candidate ``lambda_hat`` is ``inf`` the whole result is ``inf``.
    """
    del conversion
    orders, rdp = validate_curve(orders, rdp)
    with np.errstate(invalid="ignore"):
      second = (1.0 + self.eta) * ((1.0 - 1.0 / orders) * rdp
                                   + math.log(1.0 / self.gamma) / orders)
    second = np.where(np.isnan(second), np.inf, second)
    j = int(np.argmin(second))
    out = rdp + second[j] + math.log(self.mean) / (orders - 1.0)
    return TuningRdp(orders, np.maximum(out, 0.0), self,
                     lambda_hat=float(orders[j]) if math.isfinite(second[j]) else None)


@dataclasses.dataclass(frozen=True)
class Poisson:
  """``K ~ Poisson(mu)`` trials (``K = 0`` releases nothing)."""

  mu: float

  def __post_init__(self):
    try:
      mu = float(self.mu)
    except (TypeError, ValueError) as e:
      raise TuningError(f"`mu` must be a number > 0; got {self.mu!r}.") from e
    if not (math.isfinite(mu) and mu > 0.0):
      raise TuningError(f"`mu` must be a finite number > 0; got {self.mu!r}.")
    object.__setattr__(self, "mu", mu)

  @property
  def label(self) -> str:
    return f"Poisson (mu={self.mu:.6g})"

  @property
  def mean(self) -> float:
    return self.mu

  def pgf(self, s: float) -> float:
    """``E[s^K] = exp(mu (s - 1))``."""
    if not 0.0 <= s <= 1.0:
      raise TuningError(f"`s` must lie in [0, 1]; got {s!r}.")
    return math.exp(self.mu * (s - 1.0))

  def tuning_rdp(self, orders, rdp, conversion: str = "modern") -> TuningRdp:
    """Theorem 6 of Papernot & Steinke (2022), with the best admissible ``eps_hat``.

    Formal statement: if one trial is ``(lambda, eps)``-RDP and
    ``(eps_hat, delta_hat)``-DP with ``e^eps_hat <= 1 + 1/(lambda - 1)``, then
    running ``K ~ Poisson(mu)`` trials and releasing the best is
    ``(lambda, eps + mu delta_hat + log(mu) / (lambda - 1))``-RDP.

    ``delta_hat`` is non-increasing in ``eps_hat``, so at each ``lambda`` we
    take the largest admissible ``eps_hat = log(1 + 1/(lambda - 1))`` and the
    trial's ``delta_hat`` there from its whole RDP curve
    (:func:`rdp_to_delta`, with ``conversion``).
    """
    orders, rdp = validate_curve(orders, rdp)
    eps_hat = np.log1p(1.0 / (orders - 1.0))
    delta_hat = np.array([rdp_to_delta(orders, rdp, float(e), conversion) for e in eps_hat])
    out = rdp + self.mu * delta_hat + math.log(self.mu) / (orders - 1.0)
    return TuningRdp(orders, np.maximum(out, 0.0), self, epsilon_hat=eps_hat,
                     delta_hat=delta_hat)


TrialDistribution = TruncatedNegativeBinomial | Poisson


def tuning_epsilon(distribution, orders, rdp, delta: float, conversion: str = "modern") -> dict:
  """Epsilon at ``delta`` of random search with ``distribution`` trials of RDP ``rdp``.

  The tuning bound at each order, tightened by :func:`monotone_rdp`, then
  converted with the package's ``conversion``. The ``delta_hat`` of the
  Poisson bound always uses the ``modern`` conversion: it is never larger
  than the ``classic`` one and valid whatever conversion the final epsilon
  uses.

  Returns:
    ``{"distribution", "mean_trials", "epsilon", "delta", "optimal_order",
    "lambda_hat"}`` (``lambda_hat`` for the truncated negative binomial only).
  """
  tuned = distribution.tuning_rdp(orders, rdp, "modern")
  envelope = monotone_rdp(tuned.orders, tuned.rdp)
  eps, order = rdp_to_epsilon(tuned.orders, envelope, delta, conversion)
  out = {"distribution": distribution.label, "mean_trials": distribution.mean,
         "epsilon": eps, "delta": float(delta), "optimal_order": order}
  if isinstance(distribution, TruncatedNegativeBinomial):
    out.update({"eta": distribution.eta, "gamma": distribution.gamma,
                "lambda_hat": tuned.lambda_hat})
  else:
    out["mu"] = distribution.mu
  return out


# --------------------------------------------------------------------------
# Runs -> RDP curves.
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunPrivacy:
  """The privacy parameters of one finished (or planned) training run."""

  spec: accounting.AccountingSpec
  noise_multiplier: float
  steps: int

  def __post_init__(self):
    if not isinstance(self.spec, accounting.AccountingSpec):
      raise TuningError(f"`spec` must be an AccountingSpec; got {self.spec!r}.")
    accounting.validate_noise_multiplier(self.noise_multiplier)
    accounting.validate_steps(self.steps)

  @classmethod
  def from_report(cls, report: dict) -> "RunPrivacy":
    """From a run's ``privacy_report.json`` (as written by the launchers).

    A run accounted with the PLD accountant gets the RDP curve of the same
    event (the tuning bounds need RDP); the bound is then the same valid
    analysis of the same mechanism, only via RDP. Everything the run's epsilon
    depends on is read: correlated noise (``bands``, and ``blt``) and the releases of
    training-set statistics before training (``releases``, or the hyperparameters').
    """
    if not report.get("private", True):
      raise TuningError("A non-private run (--optimizer=sgd) has no privacy guarantee: "
                        "there is no tuning epsilon.")
    missing = [k for k in ("dataset_size", "batch_size", "sampling", "noise_multiplier", "steps")
               if report.get(k) is None]
    if report.get("sampling") == "cyclic_poisson" and report.get("bands") is None:
      missing.append("bands")  # its accounting depends on b: never assume one
    if report.get("noise") == "blt" and not report.get("blt"):
      missing.append("blt")  # the BLT's parameters decide its sensitivity
    if missing:
      raise TuningError(f"The privacy report lacks {missing}.")
    hyperparameters = report.get("hyperparameters") or {}
    releases = report.get("releases", hyperparameters.get("releases")) or ()
    spec = accounting.make_spec(int(report["dataset_size"]), int(report["batch_size"]),
                                report["sampling"], accountant="rdp",
                                bound=report.get("bound") or "default",
                                conversion=report.get("conversion") or "modern",
                                releases=tuple(releases), bands=int(report.get("bands") or 1),
                                blt=report.get("blt") or ())
    return cls(spec, float(report["noise_multiplier"]), int(report["steps"]))

  @classmethod
  def from_record(cls, record) -> "RunPrivacy":
    """From a :class:`tf_dpnsgd.records.RunRecord` (see :meth:`from_report`)."""
    return cls.from_report(record.to_dict())


def run_rdp(run: RunPrivacy, cache: Optional[dict] = None) -> tuple[np.ndarray, np.ndarray]:
  """The RDP curve of a whole run: per-composition curve times the number of compositions
  (:meth:`~tf_dpnsgd.accounting.AccountingSpec.rdp_scale`), plus the run's releases.

  ``cache``: an optional dict memoising the per-composition curves by ``(spec, sigma)``.
  """
  key = (run.spec, run.noise_multiplier)
  if cache is not None and key in cache:
    curve = cache[key]
  else:
    curve = accounting.rdp_curve(run.spec, run.noise_multiplier)
    if cache is not None:
      cache[key] = curve
  orders = np.asarray(curve.orders, dtype=np.float64)
  # The steps (0 steps: none; 0 * inf would be nan) and the releases before training.
  steps = curve.rdp * run.spec.rdp_scale(run.steps) if run.steps else 0.0
  return orders, steps + run.spec.release_rdp(orders)


def default_distributions(mean_trials: float, etas: Sequence[float] = (0.0, 1.0),
                          poisson: bool = True) -> list:
  """Poisson and truncated negative binomial distributions with ``E[K] = mean_trials``."""
  out = [Poisson(mean_trials)] if poisson else []
  out += [TruncatedNegativeBinomial.with_mean(eta, mean_trials) for eta in etas]
  return out


def tuning_privacy(runs: Sequence[RunPrivacy], delta: float, distributions: Sequence = (),
                   conversion: Optional[str] = None, cache: Optional[dict] = None) -> dict:
  """The privacy of tuning over ``runs`` (the cells of one grid), three ways.

  * ``single_run``: the largest epsilon of one run (what each cell reports);
  * ``naive_composition``: all runs trained and released (sum of RDP curves);
  * ``random_search``: for each distribution, random search whose trials
    each run a data-independently chosen cell, releasing only the best trial
    (Papernot & Steinke 2022 Thm. 2 / Thm. 6 applied to the worst-case curve
    of :func:`worst_case_rdp`).

  Args:
    runs: the runs' privacy parameters.
    delta: the target delta of every epsilon.
    distributions: :class:`Poisson` / :class:`TruncatedNegativeBinomial` instances.
    conversion: RDP -> DP conversion; ``None`` takes the runs' (which must agree).
    cache: optional memo of per-composition curves (see :func:`run_rdp`).

  Raises:
    TuningError: no runs, or runs whose conversions disagree (with ``conversion=None``).
  """
  if not runs:
    raise TuningError("No runs to account for.")
  if conversion is None:
    conversions = {r.spec.conversion for r in runs}
    if len(conversions) != 1:
      raise TuningError(f"The runs use different conversions {sorted(conversions)}: pass one.")
    conversion = conversions.pop()
  conversion = validate_conversion(conversion)
  delta = accounting.validate_delta(delta)
  cache = {} if cache is None else cache
  curves = [run_rdp(r, cache) for r in runs]
  singles = [rdp_to_epsilon(o, c, delta, conversion)[0] for o, c in curves]
  orders, total = composed_rdp(curves)
  naive, naive_order = rdp_to_epsilon(orders, total, delta, conversion)
  w_orders, worst = worst_case_rdp(curves)
  distinct = {(r.spec, r.noise_multiplier, r.steps) for r in runs}
  notes = []
  if len(distinct) > 1:
    notes.append(f"The runs differ in their privacy parameters ({len(distinct)} distinct "
                 "(N, B, sampling, sigma, steps)); each random-search trial is accounted with "
                 "the pointwise maximum of their RDP curves (a data-independent mixture is no "
                 "less private than its worst component).")
  return {
      "runs": len(runs),
      "delta": delta,
      "conversion": conversion,
      "single_run": {"epsilon": max(singles), "min_epsilon": min(singles)},
      "naive_composition": {"epsilon": naive, "optimal_order": naive_order},
      "random_search": [tuning_epsilon(d, w_orders, worst, delta, conversion)
                        for d in distributions],
      "notes": notes,
  }


# --------------------------------------------------------------------------
# The chance that random search lands near the best.
# --------------------------------------------------------------------------
def random_search_success(distribution, good_fraction: float) -> float:
  """P[random search draws at least one near-best cell] = ``1 - E[(1 - p)^K]``.

  Each trial picks a cell uniformly at random; ``p`` is the fraction of
  near-best cells. ``K = 0`` (Poisson) counts as failure.
  """
  if not 0.0 <= good_fraction <= 1.0:
    raise TuningError(f"`good_fraction` must lie in [0, 1]; got {good_fraction!r}.")
  return 1.0 - distribution.pgf(1.0 - good_fraction)


def poisson_for_success(good_fraction: float, probability: float) -> Poisson:
  """The smallest Poisson mean with success probability ``probability``:
  ``mu = log(1 / (1 - probability)) / p`` (Poisson thinning)."""
  probability = _validate_unit_interval("probability", probability)
  if not 0.0 < good_fraction <= 1.0:
    raise TuningError(f"`good_fraction` must lie in (0, 1]; got {good_fraction!r}.")
  return Poisson(math.log(1.0 / (1.0 - probability)) / good_fraction)


def truncated_negative_binomial_for_success(eta: float, good_fraction: float,
                                            probability: float) -> TruncatedNegativeBinomial:
  """The largest ``gamma`` (fewest trials) whose success probability is >= ``probability``.

  The success probability decreases in ``gamma``; bisection on ``log(gamma)``.
  With ``good_fraction = 1`` every trial succeeds and ``gamma`` approaches 1.
  """
  probability = _validate_unit_interval("probability", probability)
  if not 0.0 < good_fraction <= 1.0:
    raise TuningError(f"`good_fraction` must lie in (0, 1]; got {good_fraction!r}.")

  def ok(log_gamma):
    return random_search_success(TruncatedNegativeBinomial(eta, math.exp(log_gamma)),
                                 good_fraction) >= probability

  lo, hi = _LOG_GAMMA_MIN, -1e-12  # ok(lo) holds for any p > 0
  if ok(hi):
    return TruncatedNegativeBinomial(eta, math.exp(hi))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if mid == lo or mid == hi:
      break
    if ok(mid):
      lo = mid
    else:
      hi = mid
  return TruncatedNegativeBinomial(eta, math.exp(lo))


__all__ = [
    "Poisson", "RunPrivacy", "TruncatedNegativeBinomial", "TuningError", "TuningRdp",
    "common_orders", "composed_rdp", "default_distributions", "monotone_rdp",
    "poisson_for_success", "random_search_success", "rdp_to_delta", "rdp_to_epsilon",
    "run_rdp", "truncated_negative_binomial_for_success",
    "tuning_epsilon", "tuning_privacy", "validate_curve", "worst_case_rdp",
]
