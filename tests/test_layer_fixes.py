"""Tests for tf_dpnsgd.layer_fixes: BatchNormalization -> GroupNormalization, what changed."""

import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd.layer_fixes import LayerChange, group_count


def conv_net():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8, 8, 3))
  h = keras.layers.Conv2D(48, 3, name="conv1")(inputs)
  h = keras.layers.BatchNormalization(name="bn1")(h)
  h = keras.layers.ReLU()(h)
  block = keras.Sequential([keras.Input((6, 6, 48)), keras.layers.Conv2D(12, 3, name="conv2"),
                            keras.layers.BatchNormalization(name="bn2")], name="block")
  h = keras.layers.GlobalAveragePooling2D()(block(h))
  return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


def test_group_count_is_the_largest_choice_that_divides():
  assert [group_count(c) for c in (64, 48, 12, 6, 7, 96)] == [32, 16, 4, 2, 1, 32]


def test_fix_layers_replaces_batchnorm_keeps_weights_and_reports():
  model = conv_net()
  with pytest.raises(ValueError, match="fix_layers"):
    tf_dpnsgd.make_private(model)  # the error names the fixer
  fixed, changes = tf_dpnsgd.fix_layers(model)
  assert changes == [LayerChange("bn1", "BatchNormalization", "GroupNormalization(groups=16)"),
                     LayerChange("bn2", "BatchNormalization", "GroupNormalization(groups=4)")]
  assert all(isinstance(c, tuple) and len(c) == 3 for c in changes)
  layers = {l.name: l for l in fixed._flatten_layers(include_self=False, recursive=True)}
  assert isinstance(layers["bn1"], keras.layers.GroupNormalization)
  assert layers["bn1"].groups == 16 and layers["bn2"].groups == 4
  assert not any(isinstance(l, keras.layers.BatchNormalization) for l in layers.values())
  original = {l.name: l for l in model._flatten_layers(include_self=False, recursive=True)}
  for name in ("conv1", "conv2", "head"):  # a copy with the same weights, not the same layer
    assert layers[name] is not original[name]
    for a, b in zip(layers[name].get_weights(), original[name].get_weights()):
      np.testing.assert_array_equal(a, b)
  x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("float32")
  one = fixed(x[:1], training=True).numpy()
  np.testing.assert_allclose(fixed(x, training=True).numpy()[:1], one, rtol=1e-5, atol=1e-6)
  tf_dpnsgd.make_private(fixed)  # accepted now
  assert tf_dpnsgd.fix_layers(fixed)[1] == []  # nothing left to change


def test_fix_layers_on_a_sequential_model():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                            keras.layers.BatchNormalization(name="bn")])
  fixed, changes = tf_dpnsgd.fix_layers(model)
  assert changes == [("bn", "BatchNormalization", "GroupNormalization(groups=8)")]
  assert isinstance(fixed, keras.Sequential)


def test_fix_layers_refuses_subclassed_models():
  class Net(keras.Model):
    def __init__(self):
      super().__init__()
      self.bn = keras.layers.BatchNormalization()

    def call(self, x):
      return self.bn(x)

  with pytest.raises(TypeError, match="subclassed.*GroupNormalization"):
    tf_dpnsgd.fix_layers(Net())


def test_fix_layers_keeps_ops_called_in_the_model_and_copies_the_layers_weights():
  """keras-hub's ResNetV2 (``use_pre_activation=True``) calls ``keras.ops.pad`` in its graph:
  an operation, not a layer, with no weights. fix_layers crashed on it (``'Pad' object has
  no attribute 'get_weights'``); the op is now cloned and the layers' weights copied."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6, 6, 3))
  h = keras.ops.pad(inputs, [[0, 0], [1, 1], [1, 1], [0, 0]])
  h = keras.layers.Conv2D(8, 3, name="conv")(h)
  h = keras.layers.BatchNormalization(name="bn")(h)
  model = keras.Model(inputs, keras.layers.Dense(2, name="head")(
      keras.layers.GlobalAveragePooling2D()(h)))
  fixed, changes = tf_dpnsgd.fix_layers(model)
  assert changes == [("bn", "BatchNormalization", "GroupNormalization(groups=8)")]
  assert fixed.output.shape == model.output.shape
  for name in ("conv", "head"):
    for a, b in zip(fixed.get_layer(name).get_weights(), model.get_layer(name).get_weights()):
      np.testing.assert_array_equal(a, b)
  x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype("float32")
  padded = np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)])  # the op still pads: conv sees 8x8
  conv = keras.Model(fixed.input, fixed.get_layer("conv").output)
  np.testing.assert_allclose(conv(x).numpy(), model.get_layer("conv")(padded).numpy(),
                             rtol=1e-5, atol=1e-6)
