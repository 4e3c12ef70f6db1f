"""Fixed views averaged inside each example's loss (augmentation multiplicity): the view
transforms against hand-indexed pixels, the per-example gradients of a multi-view model
against a loop of single-example tapes over the views (sensitivity kept), the loss and the
accuracy against NumPy, and the raw-pixel model against the composition."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from tf_dpnsgd import losses as losses_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.models import scatternet
from tf_dpnsgd.models import views
from tf_dpnsgd.per_example import layerwise_engine

from fixtures import assert_engine_output
from fixtures import normalized_sum_by_loop


def test_views_are_mirror_then_reflected_shift_by_hand():
  x = np.arange(2 * 6 * 7 * 3).reshape(2, 6, 7, 3).astype(np.float32)

  def reflect(i, n):  # numpy "reflect" (edge not repeated), by hand
    return -i if i < 0 else (2 * (n - 1) - i if i >= n else i)

  for name, v in views.VIEWS.items():
    got = views.apply_view_numpy(x, v)
    want = np.empty_like(x)
    for i in range(6):
      for j in range(7):
        src = x[:, :, ::-1] if v.mirror else x
        want[:, i, j] = src[:, reflect(i + v.dy, 6), reflect(j + v.dx, 7)]
    np.testing.assert_array_equal(got, want, err_msg=name)
    layer = views.ImageView(v.dy, v.dx, v.mirror)
    np.testing.assert_array_equal(layer(tf.constant(x)).numpy(), want, err_msg=name)


def test_check_views_refuses_unknown_repeated_or_none():
  assert views.check_views(["identity", "flip"]) == ("identity", "flip")
  with pytest.raises(ValueError, match="Unknown view"):
    views.check_views(["identity", "rotate"])
  with pytest.raises(ValueError, match="repeat"):
    views.check_views(["flip", "flip"])
  with pytest.raises(ValueError, match="at least one"):
    views.check_views([])
  with pytest.raises(ValueError, match="at most"):
    views.ImageView(5, 0)


def test_view_mean_loss_and_accuracy_against_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 3, 5)).astype(np.float32)
  y = np.array([0, 4, 2, 2])
  got = views.view_mean_loss()(tf.constant(y), tf.constant(logits)).numpy()
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.mean([-logp[i, :, y[i]] for i in range(4)], axis=1)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  metric = views.ViewMeanAccuracy()
  metric.update_state(tf.constant(y), tf.constant(logits))
  assert metric.name == "accuracy"
  np.testing.assert_allclose(float(metric.result()),
                             np.mean(logits.mean(1).argmax(-1) == y), rtol=1e-6)


@pytest.mark.parametrize("head", ["scatter_linear", "scatter_cnn"])
def test_multi_view_per_example_gradient_is_the_mean_over_views(head):
  """Engine norms and normalized sum against tapes of ``mean_v loss(head(x_i[v]))``: the
  views of one example make ONE per-example gradient (normalized once, sensitivity kept)."""
  base = getattr(scatternet, head)(feature_shape=(4, 4, 6))
  model = views.multi_view(base, 3)
  assert [id(v) for v in model.trainable_variables] == [id(v) for v in base.trainable_variables]
  rng = np.random.default_rng(3)
  x = rng.normal(size=(5, 3, 4, 4, 6)).astype(np.float32)
  y = rng.integers(0, 10, 5).astype(np.int32)
  loss = views.view_mean_loss()
  out = layerwise_engine(model, losses_lib.per_example_loss_fn(loss), tf.constant(x),
                         tf.constant(y), transforms.Normalize(0.5))
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def example_loss(i):  # the mean over the views of example i, by hand
    return tf.add_n([xent(y[i:i + 1], base(x[i:i + 1, v], training=True))
                     for v in range(3)]) / 3.0

  norms, summed = normalized_sum_by_loop(base.trainable_variables, example_loss, 5, r=0.5)
  assert_engine_output(out, norms, summed)


@pytest.mark.slow
def test_raw_pixel_model_averages_the_views_logits():
  extractor = scatternet.scattering_extractor()
  head = scatternet.scatter_linear()
  names = ("identity", "flip", "shift")
  model = views.multi_view(head, len(names))
  full = views.on_raw_pixels(model, extractor, names)
  x = np.random.default_rng(5).integers(0, 256, (2, 32, 32, 3)).astype(np.float32)
  want = np.mean([head(extractor(views.apply_view_numpy(x, views.VIEWS[n]))).numpy()
                  for n in names], axis=0)
  np.testing.assert_allclose(full(x).numpy(), want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="takes"):
    views.on_raw_pixels(model, extractor, ("identity", "flip"))


@pytest.mark.parametrize("scale", [1.0, 1e6])
def test_multi_view_contribution_stays_within_the_sensitivity_on_opposed_views(scale):
  """Attack: two views of one example that nearly cancel (x and -(1 - 1e-6) x, large
  magnitude), so the per-view gradients nearly cancel in the example's mean. The engine's
  norm must not understate the float64 norm from a tape, and each normalized contribution
  must stay within norm 1 (DP-NSGD's sensitivity)."""
  base = scatternet.scatter_linear(feature_shape=(2, 2, 3))
  model = views.multi_view(base, 2)
  rng = np.random.default_rng(7)
  x0 = rng.normal(size=(4, 2, 2, 3)) * scale
  x = np.stack([x0, -(1 - 1e-6) * x0], axis=1).astype(np.float32)
  y = rng.integers(0, 10, 4).astype(np.int32)
  out = layerwise_engine(model, losses_lib.per_example_loss_fn(views.view_mean_loss()),
                         tf.constant(x), tf.constant(y), transforms.Normalize(1e-6))
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def example_loss(i):
    return (xent(y[i:i + 1], base(x[i:i + 1, 0])) + xent(y[i:i + 1], base(x[i:i + 1, 1]))) / 2

  norms, _ = normalized_sum_by_loop(base.trainable_variables, example_loss, 4, r=1e-6)
  got = out.norms.numpy()
  assert np.all(got >= np.asarray(norms) * (1 - 1e-3))  # never understated
  # Each example's normalized contribution g_i / (r + ||g_i||) has norm <= 1, so the sum of
  # 4 has norm <= 4.
  total = np.sqrt(sum(np.sum(np.square(s.numpy().astype(np.float64))) for s in out.summed))
  assert total <= 4 * (1 + 1e-5)
