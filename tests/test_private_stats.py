"""Private feature statistics (tf_dpnsgd.private_stats) and their accounting.

Oracles: per-example loops written here, the analytic Gaussian mechanism
(Balle and Wang 2018, Thm. 8) for the epsilon of the releases alone, and
dp-accounting's own composition of the events.
"""

import json
import math

import dp_accounting
import keras
import numpy as np
import pytest
from scipy import optimize
from scipy import stats

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import private_stats
from tf_dpnsgd.plan import PrivacyPlan


def _loop_sums(features, c_mean, c_square):
  """Per-example oracle: one example at a time, clipping by hand."""
  k = features.shape[-1]
  s_mean, s_square = np.zeros(k), np.zeros(k)
  for x in features.astype(np.float64):
    m = x.reshape(-1, k).mean(axis=0)
    s = (x.reshape(-1, k) ** 2).mean(axis=0)
    for v, c, acc in ((m, c_mean, s_mean), (s, c_square, s_square)):
      norm = math.sqrt(float(np.sum(v * v)))
      acc += v * (1.0 if norm <= c else c / norm)
  return s_mean, s_square


def _analytic_gaussian_epsilon(sigma, delta):
  """Smallest epsilon of the Gaussian mechanism (sensitivity 1, std sigma) at delta."""
  def delta_of(eps):
    return (stats.norm.cdf(-eps * sigma + 1 / (2 * sigma))
            - math.exp(eps) * stats.norm.cdf(-eps * sigma - 1 / (2 * sigma)))
  return optimize.brentq(lambda e: delta_of(e) - delta, 1e-9, 100)


def _private_model(k=4):
  inputs = keras.Input((k,))
  model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
  return tf_dpnsgd.make_private(model)


def test_clip_rows_bounds_every_row_at_extreme_magnitudes():
  rows = np.array([[3.0, 4.0], [0.0, 0.0], [1e-300, 0.0], [1e30, -1e30], [0.3, 0.4]])
  out = private_stats.clip_rows(rows, 1.0)
  norms = np.linalg.norm(out, axis=1)
  assert np.all(norms <= 1.0 + 1e-12)
  np.testing.assert_allclose(out[0], [0.6, 0.8])
  np.testing.assert_array_equal(out[1], [0.0, 0.0])
  np.testing.assert_allclose(out[3], [math.sqrt(0.5), -math.sqrt(0.5)])
  np.testing.assert_array_equal(out[4], rows[4])  # inside the ball: unchanged


def test_clipped_sums_match_a_per_example_loop():
  rng = np.random.default_rng(0)
  features = rng.normal(size=(37, 3, 2, 5)) * rng.choice([0.01, 1.0, 30.0], size=(37, 1, 1, 1))
  got = private_stats.clipped_moment_sums(features.astype(np.float16), 1.5, 2.0, chunk_size=8)
  want = _loop_sums(features.astype(np.float16), 1.5, 2.0)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)


def test_one_adversarial_example_moves_each_sum_by_at_most_its_clip():
  rng = np.random.default_rng(1)
  base = rng.normal(size=(20, 4, 6))
  for outlier in (np.full((1, 4, 6), 1e6), np.full((1, 4, 6), -1e-3), rng.normal(size=(1, 4, 6))):
    with_it = np.concatenate([base, outlier])
    a = private_stats.clipped_moment_sums(base, 0.7, 0.9)
    b = private_stats.clipped_moment_sums(with_it, 0.7, 0.9)
    assert np.linalg.norm(b[0] - a[0]) <= 0.7 + 1e-9
    assert np.linalg.norm(b[1] - a[1]) <= 0.9 + 1e-9


def test_release_records_two_releases_before_drawing_noise():
  model = _private_model()
  ledger = ledger_lib.ledger_of(model)

  class Exploding:
    def normal(self, *args):
      assert ledger.releases == 2, "noise drawn before the releases were recorded"
      raise RuntimeError("stop")

  with pytest.raises(RuntimeError, match="stop"):
    private_stats.release_channel_moments(np.ones((10, 3, 4)), model, noise_multiplier=8.0,
                                          mean_clip=1.0, square_clip=1.0, rng=Exploding())
  assert ledger.releases == 2
  assert ledger.release_noise_multipliers == (8.0, 8.0)


def test_a_release_on_the_keras_model_is_in_the_ledger_make_private_continues():
  inputs = keras.Input((4,))
  base = keras.Model(inputs, keras.layers.Dense(2)(inputs))
  moments = private_stats.release_channel_moments(np.ones((10, 3, 4)), base,
                                                  noise_multiplier=7.0, mean_clip=1.0,
                                                  square_clip=1.0)
  private = tf_dpnsgd.make_private(base)
  assert ledger_lib.ledger_of(private).releases == 2
  private_stats.record_releases(private, moments)  # e.g. statistics kept from an earlier run
  assert ledger_lib.ledger_of(private).releases == 4


def test_release_noise_has_the_stated_standard_deviation():
  k = 4000
  model = _private_model()
  moments = private_stats.release_channel_moments(
      np.zeros((50, 2, k)), model, noise_multiplier=3.0, mean_clip=0.5, square_clip=2.0,
      dataset_size=50, rng=np.random.default_rng(2))
  # All-zero features: the released mean is the noise / N alone.
  std = np.std(moments.mean * 50)
  assert std == pytest.approx(3.0 * 0.5, rel=0.05)
  assert np.all(moments.variance >= 0)
  assert np.all(moments.scale()[moments.variance == 0] == 0)
  # The mean squares' noise: all-zero features release s = noise / N (std sigma C_s / N), and
  # variance = max(s - m^2, 0) with m^2 ~ 1e-3 of it, so E[variance^2] = (sigma C_s / N)^2 / 2.
  assert np.sqrt(2 * np.mean(moments.variance ** 2)) == pytest.approx(3.0 * 2.0 / 50, rel=0.05)
  assert moments.square_noise_std == pytest.approx(3.0 * 2.0 / 50)


def test_the_plan_composes_releases_into_epsilon_and_calibration():
  common = dict(dataset_size=50000, batch_size=8192, sampling="poisson", epochs=60,
                target_epsilon=3.0, delta=1e-5)
  plain, with_releases = PrivacyPlan(**common), PrivacyPlan(**common, releases=(8.0, 8.0))
  sigma = with_releases.training_noise_multiplier
  assert sigma > plain.training_noise_multiplier  # less budget left for training
  assert with_releases.planned_report().epsilon <= 3.0
  # Oracle: dp-accounting composing the events itself.
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.GaussianDpEvent(8.0), 2)
  acc.compose(dp_accounting.PoissonSampledDpEvent(
      8192 / 50000, dp_accounting.GaussianDpEvent(sigma)), with_releases.num_steps)
  assert with_releases.epsilon() == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_of_the_releases_alone_against_the_analytic_gaussian(accountant):
  # Two releases at sigma are one Gaussian mechanism at sigma / sqrt(2).
  plan = PrivacyPlan(dataset_size=1000, batch_size=10, sampling="poisson", steps=1,
                     noise_multiplier=1.0, delta=1e-5, accountant=accountant,
                     releases=(4.0, 4.0))
  exact = _analytic_gaussian_epsilon(4.0 / math.sqrt(2), 1e-5)
  eps = plan.epsilon(0)
  assert eps >= exact * (1 - 1e-3)  # never below the truth
  if accountant == "pld":
    assert eps == pytest.approx(exact, rel=0.02)
  else:
    assert eps <= exact * 1.3


def test_report_refuses_a_release_the_plan_does_not_account_for():
  model = _private_model()
  private_stats.release_channel_moments(np.ones((10, 3, 4)), model, noise_multiplier=8.0,
                                        mean_clip=1.0, square_clip=1.0)
  common = dict(dataset_size=10, batch_size=2, sampling="poisson", steps=5,
                noise_multiplier=1.0, delta=1e-5)
  with pytest.raises(ledger_lib.LedgerMismatchError, match="release"):
    PrivacyPlan(**common).report(model)
  with pytest.raises(ledger_lib.LedgerMismatchError, match="release"):
    PrivacyPlan(**common, releases=(8.0,)).report(model)  # one of two
  with pytest.raises(ledger_lib.LedgerMismatchError, match="below the plan"):
    PrivacyPlan(**common, releases=(9.0, 9.0)).report(model)  # noisier than what ran
  report = PrivacyPlan(**common, releases=(8.0, 8.0)).report(model)
  assert report.epsilon > 0  # zero steps, but the releases count
  assert any("release" in note for note in report.notes)


def test_a_rolled_back_ledger_keeps_its_releases():
  model = _private_model()
  ledger = ledger_lib.ledger_of(model)
  before = {k: np.asarray(v) for k, v in ledger.state().items()}
  private_stats.release_channel_moments(np.ones((10, 3, 4)), model, noise_multiplier=8.0,
                                        mean_clip=1.0, square_clip=1.0)
  ledger.load_own_variables(before)  # e.g. load_weights of a file saved before the release
  assert ledger.releases == 2
  assert ledger.release_noise_multipliers == (8.0, 8.0)


def test_releases_travel_with_the_saved_model(tmp_path):
  model = _private_model()
  private_stats.release_channel_moments(np.ones((10, 3, 4)), model, noise_multiplier=6.0,
                                        mean_clip=1.0, square_clip=1.0)
  path = str(tmp_path / "m.weights.h5")
  model.save_weights(path)
  other = _private_model()
  other.load_weights(path)
  assert ledger_lib.ledger_of(other).releases == 2
  assert ledger_lib.ledger_of(other).release_noise_multipliers == (6.0, 6.0)


def _six_channels(seed):
  """Features [5, 2, 2, 6] and moments with two zero variances (channels 0 and 4)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(5, 2, 2, 6)).astype(np.float32)
  moments = private_stats.ChannelMoments(
      mean=rng.normal(size=6), variance=np.array([0.0, 1.0, 2.0, 0.5, 0.0, 3.0]),
      noise_multiplier=8.0, mean_clip=1.0, square_clip=1.0, dataset_size=5)
  return x, moments


def test_standardize_matches_the_keras_layer():
  from tf_dpnsgd.models import scatternet
  x, moments = _six_channels(seed=3)
  layer = scatternet.ChannelStandardization(moments.mean, moments.scale())
  np.testing.assert_allclose(np.asarray(layer(x)), private_stats.standardize(x, moments),
                             rtol=1e-6, atol=1e-6)
  assert np.all(private_stats.standardize(x, moments)[..., [0, 4]] == 0)  # dropped channels
  in_place = x.astype(np.float16)
  want = private_stats.standardize(in_place, moments, dtype=np.float16)
  got = private_stats.standardize(in_place, moments, out=in_place)
  assert got is in_place and np.array_equal(got, want)


def test_a_variance_floor_keeps_every_channel_and_scales_by_the_floored_variance():
  from tf_dpnsgd.models import scatternet
  x, moments = _six_channels(seed=4)
  floored = moments.with_variance_floor(0.5)  # 0.5 * 8 * 1 / 5 = 0.8, by hand
  assert floored.variance_floor == pytest.approx(0.8)
  want = 1.0 / np.sqrt(np.array([0.8, 1.0, 2.0, 0.8, 0.8, 3.0]) + 1e-5)
  np.testing.assert_allclose(floored.scale(), want, rtol=1e-12)
  assert np.all(floored.variance == moments.variance)  # the release itself is unchanged
  np.testing.assert_allclose(  # the export's layer and the cached features agree
      np.asarray(scatternet.ChannelStandardization(floored.mean, floored.scale())(x)),
      private_stats.standardize(x, floored), rtol=1e-6, atol=1e-6)
  assert np.all(private_stats.standardize(x, floored) != 0)
  assert floored.with_variance_floor(0).scale()[0] == 0  # 0: back to dropping
  again = private_stats.ChannelMoments.from_dict(json.loads(json.dumps(floored.to_dict())))
  np.testing.assert_array_equal(again.scale(), floored.scale())
  old = floored.to_dict()
  del old["variance_floor"]  # a file written before the floor existed: no floor
  assert private_stats.ChannelMoments.from_dict(old).variance_floor == 0.0
  for bad in (-1.0, float("nan"), float("inf"), True):
    with pytest.raises(ValueError, match="variance floor"):
      moments.with_variance_floor(bad)


def test_the_variance_floor_does_not_depend_on_the_private_data():
  # Two different private datasets of the same public size and settings: the same floor.
  rng = np.random.default_rng(5)
  floors = []
  for scale in (1e-3, 1e3):
    moments = private_stats.release_channel_moments(
        scale * rng.normal(size=(40, 3, 5)), _private_model(5), noise_multiplier=8.0,
        mean_clip=1.0, square_clip=1.5, rng=np.random.default_rng(6))
    floors.append(moments.with_variance_floor(2.0).variance_floor)
  assert floors[0] == floors[1] == pytest.approx(2.0 * 8.0 * 1.5 / 40)


def test_bad_arguments_fail_loudly():
  model = _private_model()
  with pytest.raises(ValueError, match="noise_multiplier"):
    private_stats.release_channel_moments(np.ones((3, 4)), model, noise_multiplier=0.0,
                                          mean_clip=1.0, square_clip=1.0)
  with pytest.raises(ValueError, match="mean_clip"):
    private_stats.clipped_moment_sums(np.ones((3, 4)), -1.0, 1.0)
  with pytest.raises(TypeError, match="privacy ledger"):
    private_stats.release_channel_moments(np.ones((3, 4)), object(),
                                          noise_multiplier=1.0, mean_clip=1.0, square_clip=1.0)
  with pytest.raises(accounting.AccountingError):
    PrivacyPlan(dataset_size=10, batch_size=2, sampling="poisson", steps=1,
                noise_multiplier=1.0, delta=1e-5, releases=(-1.0,))


# --- non-finite and huge examples (issue 30): each contributes at most its clip --------------
def _finite_loop_sums(features, c_mean, c_square):
  """Oracle: :func:`_loop_sums` over the examples whose values are all finite (the others
  contribute nothing), float64, one example at a time."""
  keep = [i for i, x in enumerate(features.astype(np.float64)) if np.all(np.isfinite(x))]
  return _loop_sums(features[keep], c_mean, c_square)


HUGE_F64 = np.float64(1e300)  # finite, but its square overflows float64


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_example_contributes_exactly_zero_to_both_sums(value):
  rng = np.random.default_rng(7)
  features = rng.normal(size=(12, 3, 4)).astype(np.float32)
  features[5, 1, 2] = value  # one missing (NaN) or infinite value in one channel
  got = private_stats.clipped_moment_sums(features, 0.8, 1.1)
  without = private_stats.clipped_moment_sums(np.delete(features, 5, axis=0), 0.8, 1.1)
  want = _finite_loop_sums(features, 0.8, 1.1)
  for i in range(2):
    assert np.all(np.isfinite(got[i]))
    np.testing.assert_allclose(got[i], want[i], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[i], without[i], rtol=1e-12, atol=1e-12)
  assert got.nonfinite_rows == 1 and without.nonfinite_rows == 0


@pytest.mark.parametrize("replacement", ["nan", "+inf", "-inf", "1e38", "1e20", "huge_f64",
                                         "mixed_inf"])
def test_replacing_one_example_moves_each_sum_by_at_most_the_clip(replacement):
  """Add/remove one example: each sum moves by at most its clip; replace one: at most twice
  (the old row's clipped contribution out, the new one's in); never a NaN or an inf."""
  rng = np.random.default_rng(8)
  base = rng.normal(size=(30, 2, 2, 5)) * 3.0
  row = {"nan": np.full((2, 2, 5), np.nan), "+inf": np.full((2, 2, 5), np.inf),
         "-inf": np.full((2, 2, 5), -np.inf), "1e38": np.full((2, 2, 5), 1e38),
         "1e20": np.full((2, 2, 5), 1e20), "huge_f64": np.full((2, 2, 5), HUGE_F64),
         "mixed_inf": np.where(np.arange(20).reshape(2, 2, 5) % 2, np.inf, -np.inf)}[replacement]
  c_mean, c_square = 0.7, 0.9
  replaced = base.copy()
  replaced[11] = row
  removed = np.delete(base, 11, axis=0)
  dtype = np.float64 if replacement == "huge_f64" else np.float32
  sums = {name: private_stats.clipped_moment_sums(x.astype(dtype), c_mean, c_square)
          for name, x in (("base", base), ("replaced", replaced), ("removed", removed))}
  for i, clip in ((0, c_mean), (1, c_square)):
    assert np.all(np.isfinite(sums["replaced"][i]))
    assert np.linalg.norm(sums["replaced"][i] - sums["removed"][i]) <= clip * (1 + 1e-9)
    assert np.linalg.norm(sums["replaced"][i] - sums["base"][i]) <= 2 * clip * (1 + 1e-9)
  # Non-finite rows (and the float64 row whose squares overflow) are dropped, counted.
  dropped = replacement in ("nan", "+inf", "-inf", "mixed_inf", "huge_f64")
  assert sums["replaced"].nonfinite_rows == int(dropped)


def test_squares_of_large_float32_values_do_not_overflow():
  """1e20 squared is 1e40, inf in float32: the moments are computed in float64, so every
  row is finite, kept, and clipped to exactly its clip (hand oracle: N equal rows of K
  equal entries -> N * c / sqrt(K) per channel)."""
  n, k = 6, 4
  for value in (1e20, 3e38):
    features = np.full((n, 3, k), value, np.float32)
    sum_mean, sum_square, nonfinite = private_stats.clipped_moment_sums(features, 2.0, 3.0)
    assert nonfinite == 0
    np.testing.assert_allclose(sum_mean, np.full(k, n * 2.0 / math.sqrt(k)), rtol=1e-12)
    np.testing.assert_allclose(sum_square, np.full(k, n * 3.0 / math.sqrt(k)), rtol=1e-12)


def test_clip_rows_zeroes_non_finite_rows_and_clips_overflowing_ones():
  rows = np.array([[np.nan, 1.0], [np.inf, 0.0], [-np.inf, np.inf], [1e300, 1e300],
                   [1e300, 0.0], [0.3, 0.4]])
  out = private_stats.clip_rows(rows, 2.0)
  np.testing.assert_array_equal(out[:3], np.zeros((3, 2)))
  np.testing.assert_allclose(out[3], [math.sqrt(2.0), math.sqrt(2.0)], rtol=1e-15)  # norm 2
  np.testing.assert_array_equal(out[4], [2.0, 0.0])
  np.testing.assert_array_equal(out[5], rows[5])
  np.testing.assert_array_equal(private_stats.finite_rows(rows),
                                [False, False, False, True, True, True])


def test_release_with_a_missing_value_stays_finite_and_never_releases_the_count(caplog):
  """Before the fix one NaN made every released mean and variance NaN. Now the release is
  finite and within the one-example bound of the release without that example (same noise),
  and the count of dropped rows (exact, from the private data) is only logged, marked not
  private: it is no field of the released object."""
  rng = np.random.default_rng(9)
  features = rng.normal(size=(40, 3, 5)).astype(np.float32)
  with_nan = features.copy()
  with_nan[3, 0, 0] = np.nan
  kwargs = {"noise_multiplier": 2.0, "mean_clip": 1.0, "square_clip": 1.5, "dataset_size": 40}
  with caplog.at_level("WARNING", logger="tf_dpnsgd.private_stats"):
    got = private_stats.release_channel_moments(with_nan, ledger_lib.PrivacyLedger(),
                                                rng=np.random.default_rng(10), **kwargs)
  assert np.all(np.isfinite(got.mean)) and np.all(np.isfinite(got.variance))
  without = private_stats.release_channel_moments(np.delete(features, 3, axis=0),
                                                  ledger_lib.PrivacyLedger(),
                                                  rng=np.random.default_rng(10), **kwargs)
  np.testing.assert_allclose(got.mean, without.mean, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(got.variance, without.variance, rtol=1e-12, atol=1e-15)
  assert "1 training example" in caplog.text and "NOT private" in caplog.text
  released = json.dumps(got.to_dict())
  assert "finite" not in released and set(got.to_dict()) == set(without.to_dict())
