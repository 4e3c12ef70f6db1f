"""tf_dpnsgd.correlated.noise: the recursion w = C^-1 z in the optimizer, against the strategy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import fixtures
import tf_dpnsgd
from tf_dpnsgd.correlated import noise as cn
from tf_dpnsgd.correlated import strategy as st

LINEAGE = 7


def _applied_noise_prefix_sums(band_coefficients, n, dim, seed, momentum=0.0):
  return fixtures.applied_noise_prefix_sums(n, dim, seed, momentum, lineage=LINEAGE,
                                            band_coefficients=band_coefficients)


def test_banded_step_is_the_inverse_of_c():
  c = st.normalize([1.0, 0.6, 0.3])
  z = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
  history, ws = [[tf.zeros(3)], [tf.zeros(3)]], []
  for t in range(10):
    w = cn.banded_step([tf.constant(z[t])], history, c)[0]
    history = [[w], history[0]]
    ws.append(w.numpy())
  np.testing.assert_allclose(np.stack(ws), np.linalg.solve(st.strategy_matrix(c, 10), z),
                             rtol=1e-5, atol=1e-5)


def test_one_band_is_independent_noise_and_the_first_step_is_z_over_c0():
  indep = _applied_noise_prefix_sums(None, 3, 50, seed=3)
  np.testing.assert_array_equal(_applied_noise_prefix_sums([1.0], 3, 50, seed=3), indep)
  c = st.optimize_bands(8, 3).coefficients
  banded = _applied_noise_prefix_sums(list(c), 3, 50, seed=3)
  np.testing.assert_allclose(banded[0], indep[0] / c[0], rtol=1e-5)
  w = np.diff(np.vstack([np.zeros(50), banded]), axis=0)
  z = np.diff(np.vstack([np.zeros(50), indep]), axis=0)
  np.testing.assert_allclose(st.strategy_matrix(c, 3) @ w, z, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_empirical_prefix_sum_error_matches_the_strategy(momentum):
  n, b, dim, seeds = 16, 4, 4000, (0, 1, 2)
  strategy = st.optimize_bands(n, b, momentum)
  predicted = strategy.error / n
  independent = st.identity_strategy(n, momentum).error / n

  def empirical(coefs):
    sums = np.concatenate([_applied_noise_prefix_sums(coefs, n, dim, s, momentum)
                           for s in seeds], axis=1)
    return float(np.mean(np.sum(sums ** 2, axis=0))) / n

  got, got_indep = empirical(list(strategy.coefficients)), empirical(None)
  print(f"momentum {momentum}: predicted {predicted:.4f} empirical {got:.4f}; "
        f"independent predicted {independent:.4f} empirical {got_indep:.4f}")
  # 12000 independent coordinates: the relative standard error is below 2%.
  assert got == pytest.approx(predicted, rel=0.05)
  assert got_indep == pytest.approx(independent, rel=0.05)
  assert got < got_indep


def test_buffers_must_continue_the_ledger():
  opt = tf_dpnsgd.DPSGD(learning_rate=1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0,
                        band_coefficients=list(st.optimize_bands(8, 2).coefficients))
  v = keras.Variable(np.zeros(4, np.float32))
  with pytest.raises(tf.errors.InvalidArgumentError, match="do not continue"):
    opt.apply_private_gradients([tf.zeros(4)], 1.0, [v], step=tf.constant([1, 0, 5], tf.int64))
  opt.apply_private_gradients([tf.zeros(4)], 1.0, [v], step=tf.constant([1, 0, 0], tf.int64))
  with pytest.raises(tf.errors.InvalidArgumentError, match="rollback"):  # generation moved
    opt.apply_private_gradients([tf.zeros(4)], 1.0, [v], step=tf.constant([1, 1, 1], tf.int64))


def test_config_round_trip_and_refusals():
  c = list(st.optimize_bands(8, 2).coefficients)
  opt = tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                        band_coefficients=c)
  again = tf_dpnsgd.DPSGD.from_config(opt.get_config())
  assert again.bands == 2 and again.band_coefficients == pytest.approx(c)
  assert tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0).bands == 1
  with pytest.raises(ValueError, match="unit L2 norm"):
    tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, band_coefficients=[1.0, 1.0])
  with pytest.raises(ValueError, match="adaptive"):
    tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, band_coefficients=c,
                    target_unclipped_quantile=0.5)
