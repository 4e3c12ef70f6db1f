import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import noise


def _built(opt, n=100_000):
  v = tf.Variable(tf.zeros([n]))
  opt.build([v])
  return v


@pytest.mark.parametrize("make,sens", [
    (lambda: tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.3, seed=3), 1.0),
    (lambda: tf_dpnsgd.DPSGD(l2_norm_clip=2.5, noise_multiplier=0.7, seed=3), 2.5),
])
def test_empirical_noise_std(make, sens):
  opt = make()
  v = _built(opt, 200_000)
  batch = 64
  draws = np.concatenate([opt.privatize([tf.zeros_like(v)], batch, step=t)[0].numpy()
                          for t in range(3)])
  expected = opt.noise_multiplier * sens / batch
  assert abs(draws.std() / expected - 1) < 0.03
  assert abs(draws.mean()) < 5 * expected / np.sqrt(draws.size)


def test_same_seed_and_step_same_noise_other_step_other_noise():
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=7)
  b = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=7)
  va, vb = _built(a, 10), _built(b, 10)
  n1 = a.privatize([tf.zeros_like(va)], 1, step=0)[0].numpy()
  n2 = a.privatize([tf.zeros_like(va)], 1, step=1)[0].numpy()
  m1 = b.privatize([tf.zeros_like(vb)], 1, step=0)[0].numpy()
  np.testing.assert_array_equal(n1, m1)
  assert not np.allclose(n1, n2)


def test_the_draw_is_keyed_by_the_step_not_by_the_optimizer_object():
  # A new optimizer (recompile, resume) at ledger step 2 continues the stream.
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=11)
  va = _built(a, 10)
  stream = [a.privatize([tf.zeros_like(va)], 1, step=t)[0].numpy() for t in range(3)]
  b = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=11)
  vb = _built(b, 10)
  np.testing.assert_array_equal(b.privatize([tf.zeros_like(vb)], 1, step=2)[0].numpy(), stream[2])


def test_privatize_without_a_step_is_refused():
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0)
  va = _built(a, 10)
  with pytest.raises(ValueError, match="step"):
    a.privatize([tf.zeros_like(va)], 1)


def test_no_seed_draws_os_random_key_that_is_no_variable():
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0)
  b = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0)
  va, vb = _built(a, 10), _built(b, 10)
  assert not np.allclose(a.privatize([tf.zeros_like(va)], 1, step=0)[0],
                         b.privatize([tf.zeros_like(vb)], 1, step=0)[0])
  assert a.get_config()["seed"] is None
  # The key is not optimizer state: nothing saved with the optimizer holds it.
  saved = [np.asarray(v.numpy()).ravel() for v in a.variables]
  key = a._noise_key[0]
  assert not any((vals == key).any() for vals in saved if vals.dtype.kind in "iu")
  assert not any("seed" in v.path for v in a.variables)


def test_zero_noise_is_exact():
  out = noise.add_gaussian_noise([tf.ones([3])], 0.0, seed=tf.constant([1, 2], tf.int64))
  np.testing.assert_array_equal(out[0].numpy(), [1, 1, 1])


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "a", None])
def test_noise_multiplier_validation(bad):
  with pytest.raises(ValueError, match="noise_multiplier"):
    noise.validate_noise_multiplier(bad)
