"""Tests for tf_dpnsgd.tuning: hand-worked Papernot-Steinke cases, dp-accounting's own
implementation as an oracle, scipy's distributions, composition identities, bad input."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import stats

from tf_dpnsgd import accounting
from tf_dpnsgd import sweeps
from tf_dpnsgd import tuning

INT_ORDERS = np.arange(2.0, 65.0)
DELTA = 1e-5


def gaussian_rdp(orders, sigma):
  """RDP of the Gaussian mechanism with sensitivity 1: alpha / (2 sigma^2) (Mironov 2017)."""
  return np.asarray(orders, dtype=float) / (2.0 * sigma ** 2)


# ---------------------------------------------------------------------------
# Hand-worked cases (the expected numbers are derived in the comments).
# ---------------------------------------------------------------------------
def test_theorem2_geometric_hand_worked():
  # One trial: Gaussian, sigma = 2 -> eps(lambda) = lambda / 8.  K geometric: eta = 1,
  # gamma = e^-2, so E[K] = 1/gamma = e^2 and log E[K] = 2.
  # Middle terms: (1+eta) [(1 - 1/lh) lh/8 + log(1/gamma)/lh] = 2 [(lh - 1)/8 + 2/lh];
  # over integers lh: lh=3 -> 1.8333, lh=4 -> 2 (3/8 + 1/2) = 7/4, lh=5 -> 1.8: minimum 7/4 at 4
  # (also the continuous optimum lh* = sigma sqrt(2 log(1/gamma)) = 4).
  # eps'(lambda) = lambda/8 + 7/4 + 2/(lambda - 1); at lambda = 5: 5/8 + 7/4 + 1/2 = 23/8.
  dist = tuning.TruncatedNegativeBinomial(eta=1.0, gamma=math.exp(-2.0))
  assert dist.mean == pytest.approx(math.exp(2.0), rel=1e-12)
  tuned = dist.tuning_rdp(INT_ORDERS, gaussian_rdp(INT_ORDERS, 2.0))
  assert tuned.lambda_hat == 4.0
  assert tuned.rdp[INT_ORDERS.tolist().index(5.0)] == pytest.approx(23.0 / 8.0, rel=1e-12)
  # Classic conversion: eps = min_lambda eps'(lambda) + log(1/delta)/(lambda - 1)
  #   = lambda/8 + 7/4 + (2 + log(1e5)) / (lambda - 1); lambda = 11 gives 4.47629,
  # lambda = 10 gives 4.51129, lambda = 12 gives 4.47845: epsilon = 11/8 + 7/4 + (2 + log 1e5)/10.
  expected = 11.0 / 8.0 + 7.0 / 4.0 + (2.0 + math.log(1e5)) / 10.0
  out = tuning.tuning_epsilon(dist, INT_ORDERS, gaussian_rdp(INT_ORDERS, 2.0), DELTA, "classic")
  assert out["epsilon"] == pytest.approx(expected, rel=1e-12)
  assert out["optimal_order"] == 11.0 and out["lambda_hat"] == 4.0


def test_theorem2_logarithmic_hand_worked():
  # eta = 0 (logarithmic), gamma = e^-2: E[K] = (1/gamma - 1)/log(1/gamma) = (e^2 - 1)/2.
  # Middle terms: 1 * [(lh - 1)/8 + 2/lh] -> 7/8 at lh = 4.
  # eps'(5) = 5/8 + 7/8 + log((e^2 - 1)/2) / 4.
  dist = tuning.TruncatedNegativeBinomial(eta=0.0, gamma=math.exp(-2.0))
  assert dist.mean == pytest.approx((math.exp(2.0) - 1.0) / 2.0, rel=1e-12)
  tuned = dist.tuning_rdp(INT_ORDERS, gaussian_rdp(INT_ORDERS, 2.0))
  expected = 5.0 / 8.0 + 7.0 / 8.0 + math.log((math.exp(2.0) - 1.0) / 2.0) / 4.0
  assert tuned.rdp[3] == pytest.approx(expected, rel=1e-12)  # INT_ORDERS[3] == 5


def test_theorem2_negative_eta_hand_worked():
  # eta = -1/2, gamma = 1/4: E[K] = eta (1-gamma) / (gamma (1 - gamma^eta))
  #   = -0.5 * 0.75 / (0.25 * (1 - 2)) = 1.5.  Middle terms: 0.5 [(lh-1)/8 + log(4)/lh].
  dist = tuning.TruncatedNegativeBinomial(eta=-0.5, gamma=0.25)
  assert dist.mean == pytest.approx(1.5, rel=1e-12)
  orders = np.array([2.0, 3.0, 4.0])
  tuned = dist.tuning_rdp(orders, gaussian_rdp(orders, 2.0))
  middle = min(0.5 * ((lh - 1) / 8 + math.log(4.0) / lh) for lh in (2.0, 3.0, 4.0))
  assert tuned.rdp[1] == pytest.approx(3.0 / 8.0 + middle + math.log(1.5) / 2.0, rel=1e-12)


def test_theorem6_poisson_hand_worked():
  # One trial: Gaussian with sigma^2 = 50 -> eps(a) = a/100, orders {2, 5, 10}; K ~ Poisson(e).
  # At lambda = 5: eps_hat = log(1 + 1/4) = log(1.25). Classic delta_hat = min_a
  # exp((a-1)(a/100 - eps_hat)): a=2: -0.20314, a=5: -0.69257, a=10: -1.10829 -> exp(-1.10829).
  # eps'(5) = 0.05 + e * delta_hat + log(e) / 4.
  orders = np.array([2.0, 5.0, 10.0])
  eps_hat = math.log(1.25)
  delta_hat = math.exp(9.0 * (0.1 - eps_hat))
  assert delta_hat == pytest.approx(0.33013, abs=1e-5)
  tuned = tuning.Poisson(math.e).tuning_rdp(orders, orders / 100.0, "classic")
  assert tuned.epsilon_hat[1] == pytest.approx(eps_hat, rel=1e-12)
  assert tuned.delta_hat[1] == pytest.approx(delta_hat, rel=1e-12)
  assert tuned.rdp[1] == pytest.approx(0.05 + math.e * delta_hat + 0.25, rel=1e-12)


# ---------------------------------------------------------------------------
# Oracle: dp-accounting's RepeatAndSelectDpEvent (Papernot-Steinke, eta >= 0 and Poisson).
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("mean", [3.0, 30.0])
def test_truncated_negative_binomial_matches_dp_accounting(eta, mean):
  orders = list(accounting.DEFAULT_ORDERS)
  sigma = 1.3
  acc = dp_accounting.rdp.RdpAccountant(orders)
  acc.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(
      dp_accounting.GaussianDpEvent(sigma), mean, eta))
  dist = tuning.TruncatedNegativeBinomial.with_mean(eta, mean)
  assert dist.mean == pytest.approx(mean, rel=1e-9)
  mine = tuning.monotone_rdp(orders, dist.tuning_rdp(orders, gaussian_rdp(orders, sigma)).rdp)
  np.testing.assert_allclose(mine, acc._rdp, rtol=1e-7)


def test_poisson_matches_dp_accounting():
  orders = list(accounting.DEFAULT_ORDERS)
  spec = accounting.make_spec(10000, 100, "poisson")
  rdp = 500 * accounting.rdp_curve(spec, 1.1).rdp  # a realistic DP-SGD run
  expected = rdp_lib._compute_rdp_repeat_and_select(orders, rdp, 12.0, np.inf)
  mine = tuning.Poisson(12.0).tuning_rdp(orders, rdp, "modern").rdp
  np.testing.assert_allclose(mine, np.maximum(expected, 0.0), rtol=1e-10)


# ---------------------------------------------------------------------------
# The distributions against scipy.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("eta,gamma", [(0.0, 0.05), (0.0, 0.4), (0.5, 0.1), (1.0, 0.2),
                                       (3.0, 0.3)])
def test_distribution_matches_scipy(eta, gamma):
  dist = tuning.TruncatedNegativeBinomial(eta, gamma)
  if eta == 0.0:
    ref = stats.logser(1.0 - gamma)
    pmf = ref.pmf
    mean = ref.mean()
  else:  # zero-truncated negative binomial: NB(eta, gamma) conditioned on K >= 1
    ref = stats.nbinom(eta, gamma)

    def pmf(k):
      return ref.pmf(k) / (1.0 - ref.pmf(0))

    mean = ref.mean() / (1.0 - ref.pmf(0))
  assert dist.mean == pytest.approx(mean, rel=1e-10)
  for k in (1, 2, 5, 20):
    assert dist.pmf(k) == pytest.approx(pmf(k), rel=1e-9)
  ks = np.arange(1, 4000)
  for s in (0.0, 0.3, 0.9, 1.0):
    assert dist.pgf(s) == pytest.approx(float(np.sum(s ** ks * pmf(ks))), rel=1e-8, abs=1e-12)


def test_with_mean_round_trip_and_negative_eta_pmf_sums_to_one():
  for eta in (-0.7, -0.2, 0.0, 1.0, 4.0):
    for mean in (1.5, 10.0, 1000.0):
      assert tuning.TruncatedNegativeBinomial.with_mean(eta, mean).mean == pytest.approx(
          mean, rel=1e-9)
  dist = tuning.TruncatedNegativeBinomial(-0.5, 0.2)
  assert sum(dist.pmf(k) for k in range(1, 3000)) == pytest.approx(1.0, abs=1e-9)


# ---------------------------------------------------------------------------
# Composition, worst case, conversions.
# ---------------------------------------------------------------------------
def spec_and_run(sigma, steps=200, n=5000, batch=100):
  spec = accounting.make_spec(n, batch, "poisson")
  return spec, tuning.RunPrivacy(spec, sigma, steps)


def test_naive_composition_equals_one_longer_run():
  # RDP composes additively: 3 runs of 200 steps cost what one run of 600 steps costs.
  spec, run = spec_and_run(1.2)
  out = tuning.tuning_privacy([run, run, run], DELTA)
  assert out["naive_composition"]["epsilon"] == pytest.approx(
      accounting.epsilon_for(spec, 1.2, 600, DELTA), rel=1e-10)
  assert out["single_run"]["epsilon"] == pytest.approx(
      accounting.epsilon_for(spec, 1.2, 200, DELTA), rel=1e-10)


def test_worst_case_is_the_least_private_run():
  _, low = spec_and_run(1.0)
  _, high = spec_and_run(3.0)
  dists = [tuning.Poisson(5.0), tuning.TruncatedNegativeBinomial.with_mean(1.0, 5.0)]
  mixed = tuning.tuning_privacy([low, high], DELTA, dists)
  alone = tuning.tuning_privacy([low, low], DELTA, dists)
  for a, b in zip(mixed["random_search"], alone["random_search"]):
    assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
  assert mixed["notes"] and not alone["notes"]
  # Random search beats releasing 30 runs, and costs more than one run.
  out = tuning.tuning_privacy([low] * 30, DELTA,
                              [tuning.TruncatedNegativeBinomial.with_mean(0.0, 30.0)])
  assert out["single_run"]["epsilon"] < out["random_search"][0]["epsilon"] < \
      out["naive_composition"]["epsilon"]


def test_infinite_curve_gives_infinite_tuning_epsilon():
  # A curve that is infinite everywhere gives an infinite tuning epsilon, not an error.
  out = tuning.tuning_epsilon(tuning.Poisson(3.0), [2.0, 3.0], [np.inf, np.inf], DELTA)
  assert out["epsilon"] == math.inf


def test_curve_algebra_and_robustness_are_re_exported():
  # The RDP-curve algebra moved to tf_dpnsgd.accounting.rdp (tested in test_accounting.py),
  # the robustness summary to tf_dpnsgd.sweeps (test_sweep.py); the old names still work.
  for name in ("validate_curve", "monotone_rdp", "common_orders", "composed_rdp",
               "worst_case_rdp", "rdp_to_epsilon", "rdp_to_delta"):
    assert getattr(tuning, name) is getattr(accounting, name)
  assert not hasattr(tuning, "robustness_summary")  # no shim: sweeps.robustness_summary
  assert issubclass(tuning.TuningError, accounting.AccountingError)
  with pytest.raises(AttributeError):
    tuning.no_such_name  # pylint: disable=pointless-statement


@pytest.mark.parametrize("make", [
    lambda: tuning.TruncatedNegativeBinomial(-1.0, 0.5),
    lambda: tuning.TruncatedNegativeBinomial(0.5, 1.0),
    lambda: tuning.TruncatedNegativeBinomial(0.5, 0.0),
    lambda: tuning.TruncatedNegativeBinomial(float("nan"), 0.5),
    lambda: tuning.TruncatedNegativeBinomial.with_mean(1.0, 1.0),
    lambda: tuning.Poisson(0.0),
    lambda: tuning.Poisson(float("inf")),
    lambda: tuning.tuning_privacy([], DELTA),
])
def test_bad_input_raises(make):
  with pytest.raises(tuning.TuningError):
    make()


def test_mixed_conversions_raise_unless_one_is_chosen():
  a = tuning.RunPrivacy(accounting.make_spec(5000, 100, "poisson", conversion="classic"), 1.0, 10)
  b = tuning.RunPrivacy(accounting.make_spec(5000, 100, "poisson"), 1.0, 10)
  with pytest.raises(tuning.TuningError, match="conversions"):
    tuning.tuning_privacy([a, b], DELTA)
  assert tuning.tuning_privacy([a, b], DELTA, conversion="classic")["conversion"] == "classic"


def test_run_privacy_from_report():
  report = {"private": True, "dataset_size": 5000, "batch_size": 100, "sampling": "uniform",
            "accountant": "rdp", "bound": "min", "conversion": "classic",
            "noise_multiplier": 2.0, "steps": 50}
  run = tuning.RunPrivacy.from_report(report)
  assert (run.spec.sampling, run.spec.bound, run.spec.conversion, run.steps) == (
      "uniform", "min", "classic", 50)
  with pytest.raises(tuning.TuningError, match="non-private"):
    tuning.RunPrivacy.from_report({"private": False})


def test_run_privacy_from_report_accounts_for_everything_the_runs_epsilon_does():
  """Before the fix a BandMF run was re-accounted as Poisson at B/N over every step (about b
  times too little RDP) and the releases of training-set statistics were left out."""
  from tf_dpnsgd.correlated import blt as bl
  from tf_dpnsgd.plan import PrivacyPlan
  strategy = bl.optimize_blt(12, 2, 3)
  plans = [
      PrivacyPlan(dataset_size=60000, batch_size=256, sampling="cyclic_poisson", bands=4,
                  steps=400, noise_multiplier=1.1, delta=DELTA),
      PrivacyPlan(dataset_size=60, batch_size=5, sampling="cyclic_poisson", bands=3, steps=12,
                  noise_multiplier=3.0, delta=DELTA, blt=strategy.parameters()),
      PrivacyPlan(dataset_size=5000, batch_size=100, sampling="poisson", steps=50,
                  noise_multiplier=2.0, delta=DELTA, releases=(8.0, 8.0))]
  noises = ["bandmf", "blt", "independent"]
  for plan, noise in zip(plans, noises):
    report = {"private": True, "dataset_size": plan.dataset_size, "batch_size": plan.batch_size,
              "sampling": plan.sampling, "noise_multiplier": plan.noise_multiplier,
              "steps": plan.num_steps, "noise": noise, "bands": plan.bands,
              "blt": [list(v) for v in plan.blt],
              "hyperparameters": {"releases": list(plan.releases)}}
    run = tuning.RunPrivacy.from_report(report)
    # One run, no tuning: its epsilon is the run's own.
    assert tuning.tuning_privacy([run], DELTA)["single_run"]["epsilon"] == pytest.approx(
        plan.epsilon(), rel=1e-9), noise
  with pytest.raises(tuning.TuningError, match="bands"):
    tuning.RunPrivacy.from_report({**report, "sampling": "cyclic_poisson", "bands": None})
  with pytest.raises(tuning.TuningError, match="blt"):
    tuning.RunPrivacy.from_report({**report, "sampling": "cyclic_poisson", "bands": 3,
                                   "noise": "blt", "blt": []})


# ---------------------------------------------------------------------------
# The chance of landing near the best.
# ---------------------------------------------------------------------------
def test_random_search_success_probabilities():
  # Poisson thinning: P[no good cell] = exp(-mu p).
  assert tuning.random_search_success(tuning.Poisson(4.0), 0.25) == pytest.approx(
      1 - math.exp(-1.0))
  # Geometric: E[s^K] = gamma s / (1 - (1 - gamma) s).
  g, s = 0.2, 0.75
  assert tuning.random_search_success(tuning.TruncatedNegativeBinomial(1.0, g), 0.25) == \
      pytest.approx(1 - g * s / (1 - (1 - g) * s))
  mu = tuning.poisson_for_success(0.25, 0.9).mu
  assert mu == pytest.approx(math.log(10.0) / 0.25)
  dist = tuning.truncated_negative_binomial_for_success(1.0, 0.25, 0.9)
  assert tuning.random_search_success(dist, 0.25) >= 0.9
  # Fewer trials (larger gamma) would miss the target: the returned gamma is the largest.
  worse = tuning.TruncatedNegativeBinomial(1.0, dist.gamma * 1.001)
  assert tuning.random_search_success(worse, 0.25) < 0.9
  # Geometric with P[miss] = 0.1 at p = 0.25 solves gamma * 0.75 / (1 - 0.75 (1 - gamma)) = 0.1.
  assert dist.gamma == pytest.approx(1.0 / 27.0, rel=1e-9)
