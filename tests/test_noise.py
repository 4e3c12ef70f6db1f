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


# --- the per-tensor streams against TensorFlow's own composition (the oracle) ----------------
STREAM_SHAPES = [(3,), (4, 5), (), (0, 2), (2, 2, 3), (1,), (7,), (6, 1)]
STREAM_SEEDS = [(0, 0), (1, 2), (-1, -1), (2**63 - 1, -2**63), (-123456789, 987654321),
                (2**31, 2**31 - 1)]


def _oracle_streams(shapes, seed):
  """Draw ``k``: ``tf.random.stateless_normal(shape_k, stateless_fold_in(seed, k), philox)``."""
  return [tf.random.stateless_normal(shape, tf.random.experimental.stateless_fold_in(seed, k),
                                     dtype=tf.float32, alg="philox")
          for k, shape in enumerate(shapes)]


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_each_tensors_draw_is_tensorflows_own_stream_k_bit_for_bit(mode):
  # The draws are built with fewer ops than TensorFlow's composition (tf_dpnsgd.noise,
  # `_philox_streams`): every stream, for extreme and ordinary seeds, in every mode, must be
  # TensorFlow's own draw for that stream, shape and seed, bit for bit.
  rng = np.random.default_rng(5)
  # (Under XLA the eight fixed shapes only: its compile of 32 streams takes seconds.)
  shapes = STREAM_SHAPES + ([] if mode == "xla" else
                            [tuple(rng.integers(1, 4, 2)) for _ in range(24)])
  summed = [tf.zeros(s) for s in shapes]

  def both(seed):
    return noise.standard_normal(summed, seed), _oracle_streams(shapes, seed)

  run = both if mode == "eager" else tf.function(both, jit_compile=mode == "xla")
  seeds = STREAM_SEEDS + [tuple(rng.integers(-2**63, 2**63 - 1, 2)) for _ in range(4)]
  draws = []
  for seed in seeds:
    got, want = run(tf.constant(seed, tf.int64))
    assert len(got) == len(shapes)
    for k, (g, w) in enumerate(zip(got, want)):
      assert g.shape == w.shape == shapes[k] and g.dtype == tf.float32, (seed, k)
      np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=f"seed {seed}, stream {k}")
    draws.append(np.concatenate([g.numpy().ravel() for g in got]))
  # Streams differ between tensors and seeds (no repeated draw; equal-shaped tensors included).
  first = [g.numpy().ravel()[0] for g in got if g.numpy().size]
  assert len(set(first)) == len(first)
  assert len({d[:4].tobytes() for d in draws}) == len(seeds)
  assert noise.standard_normal([], tf.constant([1, 2], tf.int64)) == []
