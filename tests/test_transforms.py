import math

import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd import transforms


def test_normalize_factors_match_formula():
  norms = tf.constant([0.0, 1.0, 3.0, 100.0])
  f = transforms.Normalize(0.5).factors(norms).numpy()
  np.testing.assert_allclose(f, 1.0 / (0.5 + norms.numpy()), rtol=1e-5)


def test_clip_factors_match_formula():
  norms = tf.constant([0.0, 0.5, 2.0, 8.0])
  f = transforms.Clip(2.0).factors(norms).numpy()
  np.testing.assert_allclose(f, [1.0, 1.0, 1.0, 0.25], rtol=1e-5)


def test_infinite_clip_is_identity():
  f = transforms.Clip(float("inf")).factors(tf.constant([0.0, 1e20, 3.0])).numpy()
  np.testing.assert_array_equal(f, [1.0, 1.0, 1.0])


def test_sensitivities():
  assert transforms.Normalize(0.01).sensitivity == 1.0
  assert transforms.Clip(3.5).sensitivity == 3.5


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "x", None])
def test_regularizer_validation(bad):
  with pytest.raises(ValueError, match="regularizer"):
    transforms.Normalize(bad)


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan"), None])
def test_clip_validation(bad):
  with pytest.raises(ValueError, match="l2_norm_clip"):
    transforms.Clip(bad)


def _crafted_grads():
  """Per-example gradients: huge, zero, tiny, NaN, inf, normal."""
  rows = np.array([
      [1e30, -1e30, 1e30],  # huge -> norm overflows to inf in float32 squares
      [3e18, 4e18, 0.0],  # huge but finite norm
      [0.0, 0.0, 0.0],  # zero
      [1e-30, 0.0, 0.0],  # tiny
      [np.nan, 1.0, 0.0],  # NaN
      [np.inf, 0.0, 0.0],  # inf
      [3.0, 4.0, 0.0],  # normal, norm 5
  ], dtype=np.float32)
  return [tf.constant(rows[:, :2]), tf.constant(rows[:, 2:])]


@pytest.mark.parametrize("transform,bound", [
    (transforms.Normalize(1e-8), 1.0), (transforms.Normalize(10.0), 1.0),
    (transforms.Clip(1.0), 1.0), (transforms.Clip(0.3), 0.3),
])
def test_each_contribution_bounded_for_crafted_inputs(transform, bound):
  grads = _crafted_grads()
  _, norms, factors = transforms.transform_and_sum(grads, transform)
  for i in range(7):
    single = [g[i:i + 1] for g in grads]
    contrib = transforms.weighted_sum(single, factors[i:i + 1])
    norm = math.sqrt(sum(float(tf.reduce_sum(tf.square(tf.cast(c, tf.float64)))) for c in contrib))
    assert np.isfinite(norm)
    if isinstance(transform, transforms.Normalize):
      assert norm < bound, (i, norm)
    else:
      assert norm <= bound, (i, norm)
  # Non-finite examples contribute exactly zero.
  f = factors.numpy()
  assert f[4] == 0.0 and f[5] == 0.0 and f[0] == 0.0


def test_weighted_sum_ignores_nan_rows():
  g = [tf.constant([[1.0, 2.0], [np.nan, np.inf], [3.0, 4.0]])]
  s = transforms.weighted_sum(g, tf.constant([1.0, 0.0, 0.5]))
  np.testing.assert_allclose(s[0].numpy(), [2.5, 4.0])


def test_mask_zeroes_units():
  f = transforms.Normalize(1.0).factors(tf.constant([1.0, 1.0]), mask=tf.constant([True, False]))
  np.testing.assert_allclose(f.numpy(), [0.5, 0.0], rtol=1e-5)


def test_global_norms_over_variables():
  g = [tf.constant([[3.0, 0.0], [1.0, 1.0]]), tf.constant([[[4.0]], [[1.0]]])]
  np.testing.assert_allclose(transforms.global_norms(g).numpy(), [5.0, math.sqrt(3)], rtol=1e-6)
