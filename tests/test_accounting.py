"""Tests for tf_dpnsgd.accounting: against dp-accounting called directly, closed forms,
the paper's stated numbers, monotonicity and bad input."""

import dataclasses
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from tf_dpnsgd import accounting as acc
import tiers

R = dp_accounting.NeighboringRelation
DELTA = 1e-5
SMALL_ORDERS = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)


def direct_rdp(event, relation, orders, delta=DELTA):
  """dp-accounting's RDP accountant, called directly (the oracle)."""
  a = dp_accounting.rdp.RdpAccountant(list(orders), relation)
  a.compose(event)
  return a.get_epsilon_and_optimal_order(delta)


def direct_pld(event, relation, delta=DELTA):
  a = dp_accounting.pld.PLDAccountant(relation)
  a.compose(event)
  return a.get_epsilon(delta)


# ---------------------------------------------------------------------------
# Oracle: dp-accounting directly, on a grid of (sigma, q, steps).
# ---------------------------------------------------------------------------
# q = 0.001, 0.02, 0.2 of N = 10000; every q and every sigma in the quick tier.
@pytest.mark.parametrize("batch_size,sigma", tiers.quick_cover([10, 200, 2000], [0.8, 2.0]))
def test_poisson_rdp_matches_dp_accounting(sigma, batch_size):
  n = 10000
  q = batch_size / n
  spec = acc.make_spec(n, batch_size, "poisson")
  ledger = acc.StepAccountant(spec, sigma, DELTA)
  for steps in (1, 100, 5000):
    expected_eps, expected_order = direct_rdp(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps),
        R.ADD_OR_REMOVE_ONE, acc.DEFAULT_ORDERS)
    report = ledger.report(steps)
    assert report.epsilon == pytest.approx(expected_eps, rel=1e-10)
    assert report.optimal_order == pytest.approx(expected_order)


@pytest.mark.parametrize("sigma,batch_size,steps", [(1.0, 200, 100), (2.0, 20, 3000)])
def test_poisson_pld_matches_dp_accounting(sigma, batch_size, steps):
  n = 10000
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(batch_size / n, dp_accounting.GaussianDpEvent(sigma)),
      steps)
  report = acc.compute_epsilon(n, batch_size, sigma, DELTA, "poisson", steps=steps,
                               accountant="pld")
  assert report.epsilon == pytest.approx(direct_pld(event, R.ADD_OR_REMOVE_ONE), rel=1e-12)
  assert report.optimal_order is None


@pytest.mark.parametrize("sigma,batch_size", [(1.5, 100), (4.0, 500)])
def test_uniform_rdp_is_dp_accounting_with_replace_one_sensitivity(sigma, batch_size):
  n, steps = 10000, 700
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.SampledWithoutReplacementDpEvent(
          n, batch_size, dp_accounting.GaussianDpEvent(sigma / 2)), steps)
  expected_eps, expected_order = direct_rdp(event, R.REPLACE_ONE, SMALL_ORDERS)
  report = acc.compute_epsilon(n, batch_size, sigma, DELTA, "uniform", steps=steps,
                               orders=SMALL_ORDERS)
  assert report.epsilon == pytest.approx(expected_eps, rel=1e-10)
  assert report.optimal_order == expected_order


# ---------------------------------------------------------------------------
# Tripwires: the dp-accounting conventions the module relies on.
# ---------------------------------------------------------------------------
def test_dp_accounting_rdp_does_not_double_for_replace_one():
  orders = [2.0, 5.0, 10.0]
  sigma = 1.7
  for relation in (R.ADD_OR_REMOVE_ONE, R.REPLACE_ONE):
    a = dp_accounting.rdp.RdpAccountant(orders, relation)
    a.compose(dp_accounting.GaussianDpEvent(sigma))
    np.testing.assert_allclose(a.rdp, np.array(orders) / (2 * sigma ** 2))  # sensitivity 1
  # Sampling without replacement with B = N is the plain Gaussian mechanism: not doubled either.
  a = dp_accounting.rdp.RdpAccountant(orders, R.REPLACE_ONE)
  a.compose(dp_accounting.SampledWithoutReplacementDpEvent(
      50, 50, dp_accounting.GaussianDpEvent(sigma)))
  np.testing.assert_allclose(a.rdp, np.array(orders) / (2 * sigma ** 2))


def test_dp_accounting_pld_doubles_for_replace_one():
  sigma = 2.0
  replace = direct_pld(dp_accounting.GaussianDpEvent(sigma), R.REPLACE_ONE)
  add_remove = direct_pld(dp_accounting.GaussianDpEvent(sigma), R.ADD_OR_REMOVE_ONE)
  # Analytic Gaussian mechanism (Balle & Wang 2018): std sigma, sensitivity 2 == std sigma/2, 1.
  assert replace == pytest.approx(dp_accounting.get_epsilon_gaussian(sigma / 2, DELTA), rel=2e-3)
  assert add_remove == pytest.approx(dp_accounting.get_epsilon_gaussian(sigma, DELTA), rel=2e-3)


def test_dp_accounting_pld_has_no_sampling_without_replacement():
  event = dp_accounting.SampledWithoutReplacementDpEvent(
      100, 10, dp_accounting.GaussianDpEvent(1.0))
  assert not dp_accounting.pld.PLDAccountant(R.REPLACE_ONE).supports(event)
  assert not dp_accounting.rdp.RdpAccountant(None, R.ADD_OR_REMOVE_ONE).supports(event)
  assert dp_accounting.rdp.RdpAccountant(None, R.REPLACE_ONE).supports(event)


# ---------------------------------------------------------------------------
# Closed forms.
# ---------------------------------------------------------------------------
def test_uniform_full_batch_has_doubled_sensitivity():
  # B = N: every step is the Gaussian mechanism on the sum; replace-one sensitivity 2S,
  # so RDP(alpha) = alpha * 2^2 / (2 sigma^2) = 2 alpha / sigma^2 per step.
  sigma = 3.0
  spec = acc.make_spec(40, 40, "uniform", orders=SMALL_ORDERS)
  curve = acc.rdp_curve(spec, sigma)
  np.testing.assert_allclose(curve.rdp, 2 * np.array(SMALL_ORDERS) / sigma ** 2, rtol=1e-12)


def test_shuffle_rdp_is_one_gaussian_per_epoch_with_doubled_sensitivity():
  n, b, sigma = 1000, 100, 5.0  # 10 steps per epoch
  orders = np.array(acc.DEFAULT_ORDERS)
  for steps, epochs_touched in [(1, 1), (10, 1), (11, 2), (25, 3)]:
    report = acc.compute_epsilon(n, b, sigma, DELTA, "shuffle", steps=steps, conversion="classic")
    rdp = epochs_touched * 2 * orders / sigma ** 2
    expected = np.min(rdp + math.log(1 / DELTA) / (orders - 1))
    assert report.compositions == epochs_touched
    assert report.epsilon == pytest.approx(expected, rel=1e-12)
    # The grid is dense: close to the continuous optimum of the same bound.
    k = epochs_touched * 2 / sigma ** 2  # rdp = k * alpha
    continuous = k + 2 * math.sqrt(k * math.log(1 / DELTA))
    assert continuous <= report.epsilon <= continuous * 1.01


def test_shuffle_pld_one_epoch_is_analytic_gaussian_with_sensitivity_2():
  sigma = 4.0
  report = acc.compute_epsilon(1000, 100, sigma, DELTA, "shuffle", steps=10, accountant="pld")
  assert report.epsilon == pytest.approx(dp_accounting.get_epsilon_gaussian(sigma / 2, DELTA),
                                         rel=2e-3)


def test_classic_conversion_by_hand():
  eps, order = acc.classic_epsilon([2.0, 3.0, 5.0], [0.5, 0.6, 2.0], math.exp(-2.0))
  # candidates: 0.5 + 2/1 = 2.5, 0.6 + 2/2 = 1.6, 2.0 + 2/4 = 2.5
  assert eps == pytest.approx(1.6)
  assert order == 3.0
  assert acc.classic_epsilon([2.0], [0.0], 1e-5) == (0.0, None)


def test_modern_conversion_is_dp_accounting_and_never_worse_than_classic():
  orders = np.array(acc.DEFAULT_ORDERS)
  rdp = 300 * orders / (2 * 1.3 ** 2)
  modern, order = acc.modern_epsilon(orders, rdp, DELTA)
  assert (modern, order) == pytest.approx(rdp_lib.compute_epsilon(orders, rdp, DELTA))
  assert modern < acc.classic_epsilon(orders, rdp, DELTA)[0]


def test_zero_steps_spend_nothing():
  for sampling in acc.SAMPLINGS:
    report = acc.compute_epsilon(1000, 10, 1.0, DELTA, sampling, steps=0, conversion="classic")
    assert report.epsilon == 0.0 and report.optimal_order is None


# ---------------------------------------------------------------------------
# The paper's bound.
# ---------------------------------------------------------------------------
def thm11_holds(q, s):
  """Bun, Dwork, Rothblum, Steinke (2018) Thm. 11's hypotheses, written out independently of
  the library: q < 0.1 (the paper's form), rho = 1/(2 s^2) <= 0.1, log(1/q) >= 3 rho (2 +
  log2(1/rho)), and some order covered, (s^2/2) log(1/q) > 1."""
  rho = 1.0 / (2.0 * s * s)
  return (q < 0.1 and rho <= 0.1
          and math.log(1.0 / q) >= 3.0 * rho * (2.0 + math.log(1.0 / rho) / math.log(2.0))
          and s * s / 2.0 * math.log(1.0 / q) > 1.0)


def test_paper_bound_values_and_range():
  # s = 2.5: rho = 1/12.5 = 0.08 <= 0.1; log(50) = 3.912 >= 3 * 0.08 * (2 + 3.644) = 1.355.
  orders = [1.0, 2.0, 5.0, 12.2, 12.25, 50.0]
  rdp = acc.paper_subsampled_gaussian_rdp(0.02, 2.5, orders)
  limit = 0.5 * 2.5 ** 2 * math.log(50)  # 12.225...
  assert acc.paper_order_limit(0.02, 2.5) == pytest.approx(limit)
  expected = [math.inf, 7 * 0.02 ** 2 * 2 / 2.5 ** 2, 7 * 0.02 ** 2 * 5 / 2.5 ** 2,
              7 * 0.02 ** 2 * 12.2 / 2.5 ** 2, math.inf, math.inf]
  np.testing.assert_allclose(rdp, expected)
  # s = 1.8: rho = 1/6.48 = 0.154 > 0.1, the theorem claims nothing at any order.
  assert np.all(np.isinf(acc.paper_subsampled_gaussian_rdp(0.02, 1.8, orders)))


def test_paper_bound_within_all_conditions_is_seven_q2_alpha_over_s2():
  # N = 50000, B = 1000 (q = 0.02), sigma = 6 under replace-one: s = 3, rho = 1/18 = 0.0556
  # <= 0.1; log(1/q) = log 50 = 3.912 >= 3 (1/18) (2 + log2 18) = 1.028; limit (9/2) log 50
  # = 17.60 > 1. Per step: 7 * 0.02^2 * alpha / 9 = 3.111e-4 alpha.
  spec = acc.make_spec(50000, 1000, "uniform", bound="paper", orders=(2.0, 10.0, 17.0, 18.0))
  assert thm11_holds(0.02, 3.0) and acc.paper_bound_conditions(0.02, 3.0) == []
  curve = acc.rdp_curve(spec, 6.0)
  limit = 4.5 * math.log(50)
  np.testing.assert_allclose(curve.orders, [2.0, 10.0, 17.0, limit, 18.0])
  by_hand = [7 * 0.02 ** 2 * a / 9 for a in (2.0, 10.0, 17.0, limit)] + [math.inf]
  np.testing.assert_allclose(curve.rdp, by_hand, rtol=1e-12)
  assert curve.rdp[0] == pytest.approx(6.2222e-4, rel=1e-4)
  assert set(curve.source) == {"paper"} and curve.notes == ()


def test_paper_bound_refused_at_the_cifar_eps2_sigma_naming_rho():
  # The paper's epsilon-2 CIFAR-10 setting: N = 50000, B = 1000, sigma = 3.6. Under
  # replace-one s = 3.6 / 2 = 1.8, rho = 1 / (2 * 1.8^2) = 1 / 6.48 = 0.1543 > 0.1.
  with pytest.raises(acc.PaperBoundConditionError, match=r"rho = 0\.1543 > 0\.1") as info:
    acc.compute_epsilon(50000, 1000, 3.6, DELTA, "uniform", epochs=100, bound="paper")
  assert info.value.condition == "rho"
  assert "Thm. 11" in str(info.value) and "s = sigma/2 = 1.8" in str(info.value)
  assert [c for c, _ in acc.paper_bound_conditions(0.02, 1.8)] == ["rho"]
  assert not thm11_holds(0.02, 1.8)
  # rho <= 0.1 iff s >= sqrt(5) = 2.2361, i.e. sigma >= 4.4721.
  assert acc.paper_bound_conditions(0.02, math.sqrt(5) * (1 + 1e-12)) == []
  assert [c for c, _ in acc.paper_bound_conditions(0.02, math.sqrt(5) * (1 - 1e-9))] == ["rho"]


def test_paper_bound_log_condition():
  # With rho <= 0.1 the log condition cannot fail while q < 0.1: its right side
  # 3 rho (2 + log2(1/rho)) grows with rho and is 3 * 0.1 * (2 + 3.3219) = 1.5966 at rho =
  # 0.1, below log(1/q) > log(10) = 2.3026. So it only fails for q > e^-1.5966 = 0.2026,
  # where q < 0.1 fails too. s = 2.5: rho = 0.08, right side 0.24 * (2 + log2 12.5) =
  # 0.24 * 5.644 = 1.3545.
  #   q = 0.30: log(1/0.3) = 1.2040 < 1.3545 -> fails (and q < 0.1 fails);
  #   q = 0.25: log(4) = 1.3863 >= 1.3545 -> holds (only q < 0.1 fails).
  failed = dict(acc.paper_bound_conditions(0.3, 2.5))
  assert set(failed) == {"sampling_ratio", "log_sampling_ratio"}
  assert "1.204 < 1.355" in failed["log_sampling_ratio"]
  assert [c for c, _ in acc.paper_bound_conditions(0.25, 2.5)] == ["sampling_ratio"]
  # Redundancy, on a grid: q < 0.1 and rho <= 0.1 leave nothing else to fail.
  for q in (1e-4, 0.01, 0.05, 0.0999):
    for s in (math.sqrt(5) * (1 + 1e-12), 2.5, 4.0, 30.0):
      assert thm11_holds(q, s) and acc.paper_bound_conditions(q, s) == []
  # Far outside: every sigma-dependent condition fails, the first is named.
  failed = [c for c, _ in acc.paper_bound_conditions(0.02, 0.5)]  # rho = 2
  assert failed == ["rho", "log_sampling_ratio", "order_range"]


def test_paper_bound_uses_replace_one_sensitivity():
  n, b, sigma, steps = 50000, 1000, 8.0, 500
  spec = acc.make_spec(n, b, "uniform", bound="paper", conversion="classic")
  report = acc.StepAccountant(spec, sigma, DELTA).report(steps)
  s = sigma / 2
  limit = acc.paper_order_limit(b / n, s)
  orders = np.array([a for a in acc.WOR_ORDERS if a <= limit] + [limit])
  expected = np.min(steps * 7 * (b / n) ** 2 * orders / s ** 2 + math.log(1 / DELTA) / (orders - 1))
  assert report.epsilon == pytest.approx(expected, rel=1e-12)
  assert report.optimal_order <= limit


def test_paper_bound_conditions_raise_and_say_which():
  with pytest.raises(acc.PaperBoundConditionError, match="B < 0.1 N") as info:
    acc.make_spec(1000, 100, "uniform", bound="paper")  # gamma = 0.1 is not < 0.1
  assert info.value.condition == "sampling_ratio"
  with pytest.raises(acc.PaperBoundConditionError, match="B < 0.1 N"):
    acc.make_spec(1000, 200, "uniform", bound="min")
  # sigma = 1: s = 0.5, rho = 2 > 0.1; log 50 = 3.91 < 3 * 2 * (2 - 1) = 6; (0.25/2) log 50
  # = 0.49 <= 1. All three fail; "rho" is named first, the message lists all.
  with pytest.raises(acc.PaperBoundConditionError, match="no order is covered") as info:
    acc.compute_epsilon(50000, 1000, 1.0, DELTA, "uniform", steps=10, bound="paper")
  assert info.value.condition == "rho"
  assert "rho = 2 > 0.1" in str(info.value) and "log(1/q) = 3.912 < 6" in str(info.value)


def test_min_bound_is_pointwise_minimum_and_uses_each_bound():
  n, b, sigma, steps = 100000, 100, 20.0, 1000
  curves = {bound: acc.rdp_curve(acc.make_spec(n, b, "uniform", bound=bound), sigma)
            for bound in acc.BOUNDS}
  np.testing.assert_array_equal(curves["min"].orders, curves["paper"].orders)
  default_on_grid = acc.rdp_curve(
      acc.make_spec(n, b, "uniform", orders=tuple(curves["min"].orders)), sigma).rdp
  np.testing.assert_allclose(curves["min"].rdp, np.minimum(default_on_grid, curves["paper"].rdp))
  assert {"paper", "dp-accounting"} <= set(curves["min"].source)
  eps = {bound: acc.compute_epsilon(n, b, sigma, 1e-6, "uniform", steps=steps, bound=bound)
         for bound in acc.BOUNDS}  # delta < 1/N = 1e-5
  assert eps["min"].epsilon <= min(eps["default"].epsilon, eps["paper"].epsilon) + 1e-12
  # Where the paper's bound does not apply, "min" is the dp-accounting bound, and says so.
  low = acc.compute_epsilon(50000, 1000, 1.0, DELTA, "uniform", steps=10, bound="min")
  assert low.epsilon == acc.compute_epsilon(50000, 1000, 1.0, DELTA, "uniform", steps=10).epsilon
  assert any("does not apply" in note for note in low.notes)


def test_min_bound_at_cifar_eps2_sigma_is_dp_accounting_alone():
  # sigma = 3.6: rho = 0.1543 > 0.1 (see above), so the paper's bound is not used at all.
  kwargs = dict(dataset_size=50000, batch_size=1000, noise_multiplier=3.6, delta=DELTA,
                sampling="uniform", epochs=100, conversion="classic")
  low = acc.compute_epsilon(bound="min", **kwargs)
  alone = acc.compute_epsilon(**kwargs)
  assert low.epsilon == alone.epsilon and low.optimal_order == alone.optimal_order
  assert low.optimal_bound == "dp-accounting"
  assert any("does not apply" in n and "rho = 0.1543 > 0.1" in n for n in low.notes)
  spec = acc.make_spec(50000, 1000, "uniform", bound="min")
  curve = acc.rdp_curve(spec, 3.6)
  np.testing.assert_array_equal(
      curve.rdp, acc.rdp_curve(acc.make_spec(50000, 1000, "uniform"), 3.6).rdp)
  assert set(curve.source) == {"dp-accounting"}


# ---------------------------------------------------------------------------
# The paper's stated numbers (see docs/accounting.md).
# ---------------------------------------------------------------------------
CIFAR = dict(dataset_size=50000, batch_size=1000, epochs=100, delta=1e-5)
# The paper's SST-2 run: 10 epochs counted as floor(10 * N / B) = 673 steps (a plan counts
# floor(10 * round(N / B)) = 670: tf_dpnsgd.accounting.steps_per_epoch), so the steps are given.
SST2 = dict(dataset_size=67349, batch_size=1000, steps=673, delta=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("target,stated", [(2.0, 3.6), (4.0, 2.0), (8.0, 1.2)])
def test_paper_cifar10_sigmas_are_poisson_rdp_with_classic_conversion(target, stated):
  classic = acc.calibrate(target_epsilon=target, sampling="poisson", conversion="classic",
                          **CIFAR)
  assert classic.steps == 5000
  assert round(classic.noise_multiplier, 1) == stated
  # ... and not the modern conversion: it meets the target with noticeably less noise, so its
  # calibrated sigma is below stated - 0.05.
  assert acc.compute_epsilon(noise_multiplier=stated - 0.05, sampling="poisson",
                             **CIFAR).epsilon < target


def test_paper_cifar10_sigma_is_not_its_own_bound_nor_uniform_sampling():
  steps = 5000
  gamma = 1000 / 50000
  orders = np.array(acc.DEFAULT_ORDERS)
  # The paper's Proposition as published (s = sigma, no replace-one doubling) at sigma = 3.6:
  as_published = acc.classic_epsilon(
      orders, steps * acc.paper_subsampled_gaussian_rdp(gamma, 3.6, orders), DELTA)[0]
  assert as_published > 8.0  # the claimed epsilon was 2
  # Honest uniform sampling (dp-accounting, replace-one) at sigma = 1.2 is far above 8.
  uniform = acc.compute_epsilon(noise_multiplier=1.2, sampling="uniform", conversion="classic",
                               **CIFAR)
  assert uniform.epsilon > 30.0


@pytest.mark.slow
def test_paper_sst2_sigma_is_not_reproduced():
  stated = 0.635
  # RDP (the accountant the paper names), both conversions: even sigma = 0.645 spends more
  # than 8, so the calibrated sigma (epsilon non-increasing in sigma) exceeds 0.645.
  for conversion in acc.CONVERSIONS:
    report = acc.compute_epsilon(noise_multiplier=stated, sampling="poisson",
                                 conversion=conversion, **SST2)
    assert report.steps == 673 and report.epsilon > 8.5
    assert acc.compute_epsilon(noise_multiplier=0.645, sampling="poisson",
                               conversion=conversion, **SST2).epsilon > 8.0
  # PLD (tighter than any RDP bound): sigma = 0.635 gives epsilon < 8, so it is not the
  # calibrated value either (that is smaller than 0.63).
  pld = acc.compute_epsilon(noise_multiplier=stated, sampling="poisson", accountant="pld", **SST2)
  assert 7.0 < pld.epsilon < 7.9
  assert acc.compute_epsilon(noise_multiplier=0.63, sampling="poisson", accountant="pld",
                             **SST2).epsilon < 8.0


# ---------------------------------------------------------------------------
# Calibration.
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_calibration_matches_dp_accounting_and_is_tight():
  n, b, steps, target, tol = 10000, 100, 2000, 3.0, 1e-4
  spec = acc.make_spec(n, b, "poisson")
  sigma = acc.calibrate_noise_multiplier(spec, target, steps, DELTA, tolerance=tol)
  oracle = dp_accounting.calibrate_dp_mechanism(
      spec.make_accountant,
      lambda s: dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(b / n, dp_accounting.GaussianDpEvent(s)), steps),
      target, DELTA, tol=1e-6)
  assert sigma == pytest.approx(oracle, abs=tol)
  assert acc.epsilon_for(spec, sigma, steps, DELTA) <= target
  assert acc.epsilon_for(spec, sigma - tol, steps, DELTA) > target


# A grid with the costly large integer orders of the default one, at a tenth of its size.
MIXED_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 14.0,
                16.0, 20.0, 24.0, 28.0, 32.0, 48.0, 64.0, 128.0, 256.0, 512.0)


def oracle_poisson_epsilon(q, sigma, steps, orders, delta=DELTA):
  """dp-accounting alone: every order, the modern conversion."""
  accountant = dp_accounting.rdp.RdpAccountant(list(orders))
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
  return accountant.get_epsilon(delta)


def reference_bisection(epsilon, target, tolerance):
  """The documented search, every step on the full grid: doubling from 1, halving, bisection;
  the upper end of the final bracket. Returns it and the number of evaluations."""
  calls = []

  def meets(sigma):
    calls.append(sigma)
    return epsilon(sigma) <= target

  hi = 1.0
  while not meets(hi):
    hi *= 2.0
  lo = hi / 2.0
  while meets(lo):
    hi, lo = lo, lo / 2.0
  while hi - lo > tolerance:
    mid = 0.5 * (lo + hi)
    hi, lo = (mid, lo) if meets(mid) else (hi, mid)
  return hi, len(calls)


def count_full_grid_evaluations(monkeypatch, orders):
  from tf_dpnsgd.accounting import rdp as rdp_module  # pylint: disable=import-outside-toplevel
  rdp_module._rdp_of_event.cache_clear()
  calls = []
  inner = rdp_module._rdp_of_event

  def counting(event, relation, grid):
    calls.append(len(grid) == len(orders))
    return inner(event, relation, grid)

  monkeypatch.setattr(rdp_module, "_rdp_of_event", counting)
  return calls


@pytest.mark.parametrize("grid", tiers.quick_only(["mixed", "default"], quick=["mixed"]))
def test_calibration_is_the_full_grid_bisection_with_fewer_full_evaluations(grid, monkeypatch):
  n, b, steps, target, tol = 20000, 200, 500, 2.0, 1e-3
  spec = acc.make_spec(n, b, "poisson", orders=MIXED_ORDERS if grid == "mixed" else None)
  calls = count_full_grid_evaluations(monkeypatch, spec.rdp_orders)
  sigma = acc.calibrate_noise_multiplier(spec, target, steps, DELTA, tolerance=tol)
  expected, evaluations = reference_bisection(
      lambda s: oracle_poisson_epsilon(b / n, s, steps, spec.rdp_orders), target, tol)
  assert sigma == expected  # the same decision at every step, so the same bracket
  full = sum(calls)  # none at all where the orders below the epsilon floor are left out
  assert calls and full < evaluations, (full, evaluations)
  assert oracle_poisson_epsilon(b / n, sigma, steps, spec.rdp_orders) <= target


@pytest.mark.parametrize("kwargs", [
    dict(sampling="poisson", orders=MIXED_ORDERS),
    dict(sampling="poisson", orders=MIXED_ORDERS, conversion="classic"),
    dict(sampling="uniform", orders=SMALL_ORDERS, bound="min"),
    dict(sampling="shuffle", orders=SMALL_ORDERS),
])
def test_a_few_orders_never_settle_a_target_the_full_grid_misses(kwargs):
  # The adversary's target sits just below the full grid's epsilon, and the window is
  # centred anywhere on the grid (a stale optimum): the shortcut must never say "yes".
  spec = acc.make_spec(20000, 200, **kwargs)
  for sigma in (0.6, 1.0, 3.0):
    full = acc.epsilon_for(spec, sigma, 300, DELTA)
    for order in spec.rdp_orders:
      assert not acc.within_target_on_few_orders(spec, sigma, 300, DELTA,
                                                  math.nextafter(full, 0.0), order)
    optimum = acc.StepAccountant(spec, sigma, DELTA).report(300).optimal_order
    assert acc.within_target_on_few_orders(spec, sigma, 300, DELTA, full, optimum)


# --- The bisection's "no"s on fewer orders: those not yet above the target at a larger sigma.
def oracle_epsilon(spec, sigma, steps):
  """dp-accounting alone on the spec's event for ``steps`` steps, every order of its grid."""
  accountant = dp_accounting.rdp.RdpAccountant(list(spec.rdp_orders), spec.neighboring_relation)
  accountant.compose(spec.composed_event(sigma, steps))
  return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("n,b,sampling,steps,target", [
    (200, 50, "poisson", 8, 4.0),        # q = 0.25: slow fractional orders, a tiny data set
    (64, 8, "poisson", 16, 8.0),         # sigma below 1: the halving
    (20000, 200, "poisson", 500, 0.5),   # sigma far above 1: a long doubling
    (240, 20, "cyclic_poisson", 24, 4.0),
    (1000, 1000, "shuffle", 3, 2.0),     # no sampling: a Gaussian mechanism per epoch
    (1000, 100, "uniform", 40, 2.0),     # without replacement: dp-accounting's upper bound
])
def test_calibration_on_fewer_orders_is_the_full_grid_bisection(n, b, sampling, steps, target,
                                                                monkeypatch):
  spec = acc.make_spec(n, b, sampling, orders=SMALL_ORDERS if sampling == "uniform"
                       else MIXED_ORDERS)
  calls = count_full_grid_evaluations(monkeypatch, spec.rdp_orders)
  sigma = acc.calibrate_noise_multiplier(spec, target, steps, DELTA, tolerance=1e-3)
  expected, evaluations = reference_bisection(lambda s: oracle_epsilon(spec, s, steps), target,
                                              1e-3)
  assert sigma == expected  # the same decision at every step
  assert oracle_epsilon(spec, sigma, steps) <= target
  assert calls and sum(calls) < evaluations / 2, (sum(calls), evaluations)


@pytest.mark.parametrize("case", tiers.quick_only(
    [("poisson", q) for q in (1e-4, 0.01, 0.25, 0.9, 1.0)]
    + [("uniform", q) for q in (0.005, 0.1, 0.9)],
    quick=[("poisson", 0.25), ("poisson", 1.0), ("uniform", 0.1)]))
def test_each_orders_epsilon_as_computed_never_rises_with_sigma(case):
  # The premise of the exclusions, attacked where dp-accounting's numbers are least exact
  # (q near 1: slowly converging series at fractional orders; large integer orders; the
  # without-replacement bound's forward differences and Stirling form above order 256), with
  # sigmas a relative 1e-9 apart as well as far apart: a rise must stay inside the margin.
  sampling, q = case
  n = 10000
  spec = acc.make_spec(n, max(1, round(q * n)), sampling, orders=MIXED_ORDERS)
  sigmas = sorted({float(v) for s in (0.4, 0.9, 2.0, 7.0) for v in (s, s * (1 + 1e-9))})
  previous = None
  for sigma in sigmas:
    orders, eps = acc.StepAccountant(spec, sigma, DELTA).order_epsilons(50)
    assert orders.tolist() == list(MIXED_ORDERS)
    if previous is not None:
      allowed = previous + acc.calibration.EXCLUSION_MARGIN * np.maximum(1.0, previous)
      # An infinite epsilon (dp-accounting could not evaluate a small fractional order; seen
      # at q = 0.25, order 1.75, sigma 0.9 but not 0.4) is never a witness: only finite ones.
      rises = np.isfinite(eps) & ~(eps <= allowed)
      assert not rises.any(), (sigma, orders[rises], eps[rises], previous[rises])
    previous = eps


@pytest.mark.parametrize("kwargs", [
    dict(sampling="poisson"), dict(sampling="poisson", conversion="classic"),
    dict(sampling="poisson", releases=(3.0,)), dict(sampling="uniform", orders=SMALL_ORDERS),
])
def test_order_epsilons_are_each_orders_own_and_their_minimum_is_the_epsilon(kwargs):
  spec = acc.make_spec(20000, 200, **kwargs)
  accountant = acc.StepAccountant(spec, 1.1, DELTA)
  orders, eps = accountant.order_epsilons(300)
  assert eps.min() == accountant.epsilon(300)
  for i in (0, len(orders) // 2, len(orders) - 1):  # each order alone, from its own spec
    alone = dataclasses.replace(spec, orders=(float(orders[i]),))
    assert eps[i] == acc.StepAccountant(alone, 1.1, DELTA).epsilon(300)


@pytest.mark.parametrize("conversion", ["modern", "classic"])
def test_the_epsilon_floor_is_below_every_orders_epsilon(conversion):
  # Orders whose floor is above the target are never evaluated where the RDP is known to be
  # past dp-accounting's zero: the floor must be below the epsilon of every RDP from there on.
  delta = 1e-5
  zero_below = -math.log1p(-delta * delta)
  for order in acc.DEFAULT_ORDERS + (1.001, 1.01, 1.011):
    floor = acc.calibration.epsilon_floor(conversion, order, delta)
    for r in (zero_below * (1 + 1e-9), 2 * zero_below, 1e-6, 1e-3, 1.0, 50.0):
      if conversion == "modern":  # dp-accounting's conversion, called directly
        eps = rdp_lib.compute_epsilon([order], [r], delta)[0]
      else:  # Mironov 2017, Prop. 3, written out
        eps = r + math.log(1 / delta) / (order - 1)
      assert eps >= floor or (math.isinf(floor) and math.isinf(eps)), (order, r, eps, floor)
  # And it is the epsilon of an RDP just past the zero (the floor is tight).
  assert rdp_lib.compute_epsilon([8.0], [2 * zero_below], delta)[0] == pytest.approx(
      acc.calibration.epsilon_floor("modern", 8.0, delta), abs=1e-9)


@pytest.mark.parametrize("kwargs", [
    dict(dataset_size=10000, batch_size=1, sampling="poisson"),
    dict(dataset_size=10000, batch_size=2500, sampling="poisson"),
    dict(dataset_size=100, batch_size=100, sampling="poisson"),
    dict(dataset_size=240, batch_size=20, sampling="cyclic_poisson"),
    dict(dataset_size=240, batch_size=20, sampling="cyclic_poisson", bands=3),  # BandMF
    dict(dataset_size=1000, batch_size=100, sampling="shuffle"),
])
def test_the_rdp_lower_bound_is_below_dp_accountings_rdp_at_every_order(kwargs):
  # Pinsker's bound on the KL divergence, which every order's Renyi divergence exceeds:
  # checked against dp-accounting's curve of the whole run, called directly.
  spec = acc.make_spec(orders=MIXED_ORDERS + (1.05, 1.01, 1024.0), **kwargs)
  for sigma in (0.3, 1.0, 4.0, 60.0, 3000.0):
    for steps in (1, 37):
      bound = acc.calibration.rdp_lower_bound(spec, sigma, steps)
      accountant = dp_accounting.rdp.RdpAccountant(list(spec.rdp_orders),
                                                   spec.neighboring_relation)
      accountant.compose(spec.composed_event(sigma, steps))
      rdp = np.asarray(accountant.rdp)
      assert bound > 0 and np.all(rdp >= bound * (1 - 1e-9)), (sigma, steps, bound, rdp.min())
  assert acc.calibration.rdp_lower_bound(acc.make_spec(1000, 100, "uniform"), 1.0, 5) == 0.0


@pytest.mark.parametrize("conversion", ["classic", "modern"])
def test_orders_whose_rdp_underflows_to_zero_never_settle_a_yes_alone(conversion, monkeypatch):
  # At tiny sampling rates dp-accounting's RDP can round to exactly 0 at small orders while
  # larger ones are not 0. The classic conversion says 0 for an all-zero curve: a window of
  # such orders, converted as a curve of its own, would say "yes" where the whole grid's
  # epsilon (those orders at log(1/delta)/(a-1)) is above the target.
  from tf_dpnsgd.accounting import rdp as rdp_module  # pylint: disable=import-outside-toplevel
  rdp_module._rdp_of_event.cache_clear()
  inner = rdp_module._rdp_of_event

  def underflow(event, relation, orders):
    rdp, notes = inner(event, relation, orders)
    return tuple(0.0 if o <= 3.0 else r for o, r in zip(orders, rdp)), notes

  monkeypatch.setattr(rdp_module, "_rdp_of_event", underflow)
  spec = acc.make_spec(20000, 200, "poisson", conversion=conversion, orders=MIXED_ORDERS)
  if conversion == "modern":  # dp-accounting's conversion says 0 at a zero order: so do we
    _, eps = acc.StepAccountant(spec, 1.5, DELTA).order_epsilons(300)
    assert acc.epsilon_for(spec, 1.5, 300, DELTA) == 0.0 == eps.min()
    return
  for sigma in (0.7, 1.5):
    full = acc.epsilon_for(spec, sigma, 300, DELTA)
    assert full > 0
    for order in (1.25, 1.5, 2.0):  # windows of all-zero orders
      assert not acc.within_target_on_few_orders(spec, sigma, 300, DELTA,
                                                  math.nextafter(full, 0.0), order)
    _, eps = acc.StepAccountant(spec, sigma, DELTA).order_epsilons(300)
    assert eps.min() == full
  for target in (2.0, 4.0):
    sigma = acc.calibrate_noise_multiplier(spec, target, 300, DELTA, tolerance=1e-3)
    assert acc.epsilon_for(spec, sigma, 300, DELTA) <= target
    assert acc.epsilon_for(spec, sigma - 1e-3, 300, DELTA) > target


def test_a_curve_that_breaks_the_premise_still_gets_a_sigma_that_meets_the_target(monkeypatch):
  # An adversarial RDP: at order 8 the divergence drops to a tenth inside a band of sigmas,
  # so an order excluded above the band is below the target inside it. The exclusions may then
  # decide differently from the full grid, but every "yes" is computed: the sigma returned
  # meets the target on the same (broken) curves.
  from tf_dpnsgd.accounting import rdp as rdp_module  # pylint: disable=import-outside-toplevel
  rdp_module._rdp_of_event.cache_clear()
  inner = rdp_module._rdp_of_event

  def broken(event, relation, orders):
    rdp, notes = inner(event, relation, orders)
    sigma = event.event.noise_multiplier
    if 0.95 <= sigma <= 1.05:
      rdp = tuple(r / 10 if o == 8.0 else r for o, r in zip(orders, rdp))
    return rdp, notes

  monkeypatch.setattr(rdp_module, "_rdp_of_event", broken)
  spec = acc.make_spec(2000, 50, "poisson", orders=MIXED_ORDERS)
  for target in (1.0, 2.0, 4.0):
    sigma = acc.calibrate_noise_multiplier(spec, target, 200, DELTA, tolerance=1e-3)
    assert acc.epsilon_for(spec, sigma, 200, DELTA) <= target


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(sampling="uniform", orders=SMALL_ORDERS),
    dict(sampling="uniform", bound="min", orders=SMALL_ORDERS, conversion="classic"),
    dict(sampling="shuffle", accountant="pld"),
    dict(sampling="shuffle", conversion="classic"),
])
def test_calibration_meets_target_for_every_kind(kwargs):
  tol = 1e-3
  spec = acc.make_spec(20000, 100, **kwargs)
  sigma = acc.calibrate_noise_multiplier(spec, 4.0, 400, DELTA, tolerance=tol)
  assert acc.epsilon_for(spec, sigma, 400, DELTA) <= 4.0
  assert acc.epsilon_for(spec, sigma - tol, 400, DELTA) > 4.0


def test_calibration_with_paper_bound_skips_uncovered_sigmas():
  spec = acc.make_spec(100000, 100, "uniform", bound="paper", orders=SMALL_ORDERS)
  sigma = acc.calibrate_noise_multiplier(spec, 1.0, 1000, 1e-6)  # delta < 1/N = 1e-5
  assert acc.epsilon_for(spec, sigma, 1000, 1e-6) <= 1.0
  assert thm11_holds(100 / 100000, sigma / 2)


@pytest.mark.parametrize("n,steps,target", [(67349, 673, 8.0), (50000, 5000, 2.0)])
def test_calibration_with_paper_bound_returns_a_sigma_where_thm11_applies(n, steps, target):
  tol = 1e-3
  spec = acc.make_spec(n, 1000, "uniform", bound="paper", conversion="classic")
  sigma = acc.calibrate_noise_multiplier(spec, target, steps, DELTA, tolerance=tol)
  assert thm11_holds(1000 / n, sigma / 2)  # independent of the library's check
  assert acc.epsilon_for(spec, sigma, steps, DELTA) <= target
  if n == 67349:
    # SST-2 (q = 0.01485, T = 673): at the threshold sigma = 2 sqrt(5) = 4.4721 (rho = 0.1)
    # the bound already gives about 3.3 < 8, so the rho condition, not the target, sets sigma:
    # the result is within the tolerance above 4.4721, and just below it is refused.
    assert 2 * math.sqrt(5) < sigma <= 2 * math.sqrt(5) + tol
    assert not thm11_holds(1000 / n, (sigma - tol) / 2)
    with pytest.raises(acc.PaperBoundConditionError) as info:
      acc.epsilon_for(spec, sigma - tol, steps, DELTA)
    assert info.value.condition == "rho"
  report = acc.calibrate(n, 1000, target, DELTA, "uniform", steps=steps, bound="paper",
                         conversion="classic", tolerance=tol)
  assert report.noise_multiplier == sigma
  set_by_conditions = any("set by the conditions" in note for note in report.notes)
  assert set_by_conditions == (n == 67349)
  if n != 67349:
    # CIFAR-10 epsilon 2: sigma = 26.450 (s = 13.2, rho = 0.0029), the target binds.
    assert sigma == pytest.approx(26.450, abs=2 * tol)
    assert acc.epsilon_for(spec, sigma - tol, steps, DELTA) > target


# ---------------------------------------------------------------------------
# Monotonicity.
# ---------------------------------------------------------------------------
KINDS = [("poisson", "rdp"), ("poisson", "pld"), ("uniform", "rdp"), ("shuffle", "rdp"),
         ("shuffle", "pld")]


@pytest.mark.slow
@pytest.mark.parametrize("sampling,accountant", KINDS)
def test_epsilon_grows_with_steps_and_q_and_falls_with_sigma(sampling, accountant):
  orders = SMALL_ORDERS if sampling == "uniform" else None
  n = 20000

  def eps(batch_size, sigma, steps):
    spec = acc.make_spec(n, batch_size, sampling, accountant, orders=orders)
    return acc.epsilon_for(spec, sigma, steps, DELTA)

  by_steps = [eps(200, 2.0, t) for t in (100, 200, 400, 800)]
  by_q = [eps(b, 2.0, 400) for b in (50, 200, 800)]
  by_sigma = [eps(200, s, 400) for s in (1.0, 2.0, 4.0)]
  strict = sampling != "shuffle"  # shuffling counts epochs, so epsilon is flat within one
  for seq in (by_steps, by_q):
    assert all(b > a if strict else b >= a for a, b in zip(seq, seq[1:])), seq
  assert by_steps[-1] > by_steps[0] and by_q[-1] > by_q[0]
  assert all(b < a for a, b in zip(by_sigma, by_sigma[1:])), by_sigma


def test_max_steps_is_the_last_step_within_budget():
  for sampling in ("poisson", "shuffle"):
    ledger = acc.StepAccountant(acc.make_spec(5000, 50, sampling), 1.5, DELTA)
    budget = ledger.epsilon(237) * 1.0000001
    k = ledger.max_steps(budget)
    assert ledger.epsilon(k) <= budget < ledger.epsilon(k + 1)
    assert k >= 237
  assert ledger.max_steps(0.0) == 0


# ---------------------------------------------------------------------------
# Steps, reports, bad input.
# ---------------------------------------------------------------------------
def test_steps_from_epochs_is_exact_floor():
  assert acc.steps_from_epochs(100, 50000, 1000) == 5000
  assert acc.steps_from_epochs(10, 67349, 1000) == 673
  assert acc.steps_from_epochs(0.1, 50000, 1000) == 5  # 0.1 * 50 is 5.000000000000001 in floats
  assert acc.steps_from_epochs(0.3, 10, 1) == 3  # 0.3 * 10 is 2.9999999999999996 in floats
  assert acc.steps_from_epochs(2.5, 99, 10) == 24


def test_report_dict_and_statement():
  report = acc.compute_epsilon(50000, 1000, 3.6, DELTA, "uniform", epochs=1)
  d = report.to_dict()
  for key in ("epsilon", "noise_multiplier", "steps", "optimal_order", "assumptions",
              "neighboring_relation", "sampling", "accountant", "bound", "conversion"):
    assert key in d
  assert d["neighboring_relation"] == "REPLACE_ONE"
  assert "GaussianDpEvent(noise_multiplier=1.8)" in d["dp_event"]
  assert "replace one" in report.statement() and "2S" in report.statement()
  shuffle = acc.compute_epsilon(50500, 1000, 3.6, DELTA, "shuffle", epochs=1)
  assert any("no privacy amplification" in n for n in shuffle.notes)
  assert any("N mod B = 500" in n for n in shuffle.notes)
  assert "NO amplification" in shuffle.statement()


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=2000), "q = B/N"),
    (dict(batch_size=0), "batch_size"),
    (dict(dataset_size=0), "dataset_size"),
    (dict(batch_size=10.0), "batch_size"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(delta=-1e-5), "delta"),
    (dict(delta=float("nan")), "delta"),
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=float("inf")), "noise_multiplier"),
    (dict(sampling="random"), "sampling"),
    (dict(accountant="prv"), "accountant"),
    (dict(bound="tight"), "bound"),
    (dict(conversion="new"), "conversion"),
    (dict(sampling="uniform", accountant="pld"), "no PLD analysis"),
    (dict(sampling="poisson", bound="paper"), "WITHOUT replacement"),
    (dict(sampling="shuffle", bound="min"), "WITHOUT replacement"),
    (dict(sampling="poisson", accountant="pld", conversion="classic"), "classic"),
    (dict(steps=None), "exactly one"),
    (dict(epochs=1), "exactly one"),
    (dict(steps=-1), "steps"),
    (dict(steps=True), "steps"),
    (dict(steps=None, epochs=0), "epochs"),
    (dict(orders=(0.5, 2.0)), "orders"),
])
def test_bad_input_raises_never_a_number(kwargs, match):
  args = dict(dataset_size=1000, batch_size=10, noise_multiplier=1.0, delta=DELTA,
              sampling="poisson", steps=10)
  args.update(kwargs)
  with pytest.raises(acc.AccountingError, match=match):
    acc.compute_epsilon(**args)


def test_bad_calibration_input():
  spec = acc.make_spec(1000, 10, "poisson")
  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(acc.AccountingError, match="target_epsilon"):
      acc.calibrate_noise_multiplier(spec, bad, 10, DELTA)
  with pytest.raises(acc.AccountingError, match="Zero steps"):
    acc.calibrate_noise_multiplier(spec, 1.0, 0, DELTA)


def test_one_noise_multiplier_validator_for_accounting_and_noise():
  from tf_dpnsgd import noise
  assert acc.validate_noise_multiplier(2) == 2.0
  assert noise.validate_noise_multiplier(0) == 0.0            # no noise: a valid setting
  with pytest.raises(acc.AccountingError, match=r"noise_multiplier.*> 0.*epsilon is infinite"):
    acc.validate_noise_multiplier(0)                          # no noise: nothing to account
  for bad in (-1.0, float("nan"), float("inf"), "x", None):
    with pytest.raises(ValueError, match="noise_multiplier"):
      acc.validate_noise_multiplier(bad)
    with pytest.raises(ValueError, match=r"noise_multiplier.*>= 0"):
      noise.validate_noise_multiplier(bad)


# ---------------------------------------------------------------------------
# The algebra of RDP curves (tf_dpnsgd.accounting.rdp).
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("conversion", ["classic", "modern"])
def test_rdp_to_delta_inverts_rdp_to_epsilon(conversion):
  orders = np.array(acc.DEFAULT_ORDERS)
  rdp = 300 * acc.rdp_curve(acc.make_spec(5000, 100, "poisson"), 1.0).rdp
  eps, _ = acc.rdp_to_epsilon(orders, rdp, DELTA, conversion)
  assert acc.rdp_to_delta(orders, rdp, eps, conversion) == pytest.approx(DELTA, rel=1e-3)
  assert acc.rdp_to_delta(orders, rdp, eps + 0.5, conversion) < DELTA


def test_rdp_to_epsilon_matches_dp_accounting():
  # 300 Poisson-subsampled Gaussian steps composed by dp-accounting directly.
  event = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0))
  expected, order = direct_rdp(dp_accounting.SelfComposedDpEvent(event, 300),
                               R.ADD_OR_REMOVE_ONE, SMALL_ORDERS)
  per_step = acc.rdp_curve(acc.make_spec(5000, 100, "poisson", orders=SMALL_ORDERS), 1.0)
  assert acc.rdp_to_epsilon(per_step.orders, 300 * per_step.rdp, DELTA) == pytest.approx(
      (expected, order), rel=1e-12)


def test_curve_composition_worst_case_and_monotone_envelope():
  a = ([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
  b = ([3.0, 4.0, 8.0], [0.5, np.inf, 9.0])
  orders, matrix = acc.common_orders([a, b])                  # shared orders only
  assert orders.tolist() == [3.0, 4.0]
  assert matrix.tolist() == [[2.0, 3.0], [0.5, np.inf]]
  assert acc.composed_rdp([a, b])[1].tolist() == [2.5, np.inf]
  assert acc.worst_case_rdp([a, b])[1].tolist() == [2.0, np.inf]
  # Renyi divergence grows with the order: the bound at 2 is also the one at 3 (1.0 < 5.0).
  assert acc.monotone_rdp([2.0, 3.0, 4.0], [5.0, 1.0, 2.0]).tolist() == [1.0, 1.0, 2.0]


@pytest.mark.parametrize("make", [
    lambda: acc.validate_curve([1.0, 2.0], [0.1, 0.2]),       # order <= 1
    lambda: acc.validate_curve([2.0, 3.0], [0.1, -0.2]),      # negative RDP
    lambda: acc.validate_curve([2.0, 3.0], [0.1]),            # lengths differ
    lambda: acc.validate_curve([2.0, 2.0], [0.1, 0.2]),       # repeated order
    lambda: acc.common_orders([([2.0], [0.1]), ([3.0], [0.1])]),  # nothing shared
    lambda: acc.rdp_to_epsilon([2.0], [0.1], DELTA, "exact"),
    lambda: acc.rdp_to_delta([2.0], [0.1], -1.0),
])
def test_bad_curves_raise(make):
  with pytest.raises(acc.AccountingError):
    make()


def test_memoised_rdp_curves_are_independent_copies_equal_to_dp_accounting():
  """rdp_curve memoises dp-accounting's one-composition RDP: a caller that edits the curve
  it got cannot change the next caller's, and a memoised curve is dp-accounting's own."""
  from tf_dpnsgd.accounting import rdp as rdp_module

  spec = acc.make_spec(1000, 50, "poisson", orders=SMALL_ORDERS)
  first = rdp_module.rdp_curve(spec, 1.3)
  first.rdp[:] = -1.0  # a careless caller
  second = rdp_module.rdp_curve(spec, 1.3)
  a = dp_accounting.rdp.RdpAccountant(list(SMALL_ORDERS), R.ADD_OR_REMOVE_ONE)
  a.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.3)))
  np.testing.assert_allclose(second.rdp, a.rdp, rtol=1e-12)
  assert rdp_module.rdp_curve(spec, 1.31).rdp[-1] < second.rdp[-1]  # another sigma, another curve
