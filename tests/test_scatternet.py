"""Scattering-feature classifiers: the extractor (no weights, no cross-example statistics),
the heads (Tramer and Boneh's architectures), DP per-example gradients against a loop,
and the raw-pixel model."""

import numpy as np
import pytest
import tensorflow as tf

import keras
from tf_dpnsgd import losses as losses_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.models import Scattering2D
from tf_dpnsgd.models import scatternet
from tf_dpnsgd.per_example import layerwise_engine

from fixtures import assert_engine_output
from fixtures import normalized_sum_by_loop


def _pixels(n, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3)).astype(np.float32)


@pytest.mark.slow
def test_extractor_is_scattering_of_normalized_pixels_then_per_example_groupnorm():
  x = _pixels(3)
  features = scatternet.scattering_extractor(groups=27, float16_features=False)(x).numpy()
  assert features.shape == (3, 8, 8, 243)
  # Oracle: ImageNet normalization, the transform, then group statistics in NumPy.
  mean, std = np.array(scatternet.IMAGENET_MEAN), np.array(scatternet.IMAGENET_STD)
  s = Scattering2D(scale=1.0)(((x / 255.0 - mean) / std).astype(np.float32)).numpy()
  groups = s.reshape(3, 64, 27, 9).astype(np.float64)
  mu = groups.mean(axis=(1, 3), keepdims=True)
  var = groups.var(axis=(1, 3), keepdims=True)
  expected = ((groups - mu) / np.sqrt(var + 1e-5)).reshape(3, 8, 8, 243)
  np.testing.assert_allclose(features, expected, atol=2e-4)


@pytest.mark.slow
def test_extractor_rounds_to_float16_values_by_default():
  x = _pixels(2, seed=4)
  exact = scatternet.scattering_extractor(float16_features=False)(x).numpy()
  rounded = scatternet.scattering_extractor()(x).numpy()
  assert rounded.dtype == np.float32
  np.testing.assert_array_equal(rounded, exact.astype(np.float16).astype(np.float32))
  assert 0 < np.abs(rounded - exact).max() <= 2.0**-11 * np.abs(exact).max()


@pytest.mark.slow
def test_extractor_has_no_weights_and_mixes_no_examples():
  extractor = scatternet.scattering_extractor(float16_features=False)
  assert not extractor.weights and not scatternet.scattering_extractor().weights
  x = _pixels(4, seed=1)
  together = extractor(x).numpy()
  for i in range(4):  # each example's features from that example alone
    np.testing.assert_allclose(extractor(x[i:i + 1]).numpy()[0], together[i], atol=1e-5)


@pytest.mark.parametrize("groups", [0, 10, 2.5])
def test_extractor_refuses_groups_not_dividing_243(groups):
  with pytest.raises(ValueError, match="divisor of the 243"):
    scatternet.scattering_extractor(groups=groups)


def test_heads_are_tramer_and_boneh_architectures():
  linear = scatternet.scatter_linear()
  assert linear.count_params() == 8 * 8 * 243 * 10 + 10
  cnn = scatternet.scatter_cnn()
  # conv 243->64 (3x3), max-pool 2 (8x8 -> 4x4), conv 64->64 (3x3), linear 64*4*4 -> 10.
  assert cnn.count_params() == (243 * 9 * 64 + 64) + (64 * 9 * 64 + 64) + (64 * 16 * 10 + 10)
  kinds = [type(layer).__name__ for layer in cnn.layers]
  assert kinds == ["InputLayer", "Conv2D", "MaxPooling2D", "Conv2D", "Flatten", "Dense"]
  assert all(layer.activation.__name__ == "tanh" for layer in cnn.layers
             if isinstance(layer, keras.layers.Conv2D))
  for model in (linear, cnn):
    assert not any("Normalization" in type(layer).__name__ for layer in model.layers)


@pytest.mark.parametrize("head", ["scatter_linear", "scatter_cnn"])
def test_layerwise_per_example_gradients_match_a_loop(head):
  """The DP engine's per-example norms and normalized sum against single-example tapes."""
  model = getattr(scatternet, head)(feature_shape=(8, 8, 243))
  rng = np.random.default_rng(2)
  x = rng.normal(size=(5, 8, 8, 243)).astype(np.float32)
  y = rng.integers(0, 10, 5).astype(np.int32)
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  transform = transforms.Normalize(0.5)
  out = layerwise_engine(model, losses_lib.per_example_loss_fn(xent), tf.constant(x),
                         tf.constant(y), transform)
  norms, summed = normalized_sum_by_loop(
      model.trainable_variables,
      lambda i: xent(y[i:i + 1], model(x[i:i + 1], training=True)), 5, r=0.5)
  assert_engine_output(out, norms, summed)


@pytest.mark.slow
def test_raw_pixel_model_shares_the_head_and_equals_the_composition():
  extractor = scatternet.scattering_extractor()
  head = scatternet.scatter_linear()
  full = scatternet.on_raw_pixels(head, extractor)
  x = _pixels(2, seed=3)
  np.testing.assert_allclose(full(x).numpy(), head(extractor(x)).numpy(), rtol=1e-5, atol=1e-5)
  assert [id(v) for v in full.trainable_variables] == [id(v) for v in head.trainable_variables]
  head.layers[-1].bias.assign(head.layers[-1].bias + 1.0)  # training the head trains both
  np.testing.assert_allclose(full(x).numpy(), head(extractor(x)).numpy(), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="takes"):
    scatternet.on_raw_pixels(scatternet.scatter_linear(feature_shape=(4, 4, 243)), extractor)
