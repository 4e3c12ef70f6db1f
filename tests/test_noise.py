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
  draws = np.concatenate([opt.privatize([tf.zeros_like(v)], batch)[0].numpy() for _ in range(3)])
  expected = opt.noise_multiplier * sens / batch
  assert abs(draws.std() / expected - 1) < 0.03
  assert abs(draws.mean()) < 5 * expected / np.sqrt(draws.size)


def test_same_seed_same_noise_and_counter_advances():
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=7)
  b = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=7)
  va, vb = _built(a, 10), _built(b, 10)
  n1 = a.privatize([tf.zeros_like(va)], 1)[0].numpy()
  n2 = a.privatize([tf.zeros_like(va)], 1)[0].numpy()
  m1 = b.privatize([tf.zeros_like(vb)], 1)[0].numpy()
  np.testing.assert_array_equal(n1, m1)
  assert not np.allclose(n1, n2)
  assert int(a.noise_draws.numpy()) == 2


def test_restored_counter_continues_stream_without_repeating():
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=11)
  va = _built(a, 10)
  stream = [a.privatize([tf.zeros_like(va)], 1)[0].numpy() for _ in range(3)]
  b = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0, seed=11)
  vb = _built(b, 10)
  b.noise_draws.assign(2)  # as restored from a checkpoint taken after 2 steps
  np.testing.assert_array_equal(b.privatize([tf.zeros_like(vb)], 1)[0].numpy(), stream[2])


def test_no_seed_draws_os_random_seed():
  a = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0)
  b = tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0)
  va, vb = _built(a, 10), _built(b, 10)
  assert not np.allclose(a.privatize([tf.zeros_like(va)], 1)[0], b.privatize([tf.zeros_like(vb)], 1)[0])
  assert a.get_config()["seed"] is None


def test_zero_noise_is_exact():
  out = noise.add_gaussian_noise([tf.ones([3])], 0.0, seed=tf.constant([1, 2], tf.int64))
  np.testing.assert_array_equal(out[0].numpy(), [1, 1, 1])


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "a", None])
def test_noise_multiplier_validation(bad):
  with pytest.raises(ValueError, match="noise_multiplier"):
    noise.validate_noise_multiplier(bad)
