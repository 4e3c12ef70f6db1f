"""The layer-wise rule for keras-hub's ViT patching and embedding layer (issue 49).

Rule under test (``tf_dpnsgd/per_example/layers/vision.py``): ``ViTPatchingAndEmbedding``'s
``call`` repeated with its output probed; the patch ``Conv2D``'s kernel and bias from the
``Conv2D`` rule with the output gradient at the patch positions, the class token's gradient
the output gradient at position 0, the position table's the output gradient per position.
With it every variable of a ``ViTBackbone`` has a rule and ``"auto"`` picks the layer-wise
engine.

Oracle as in ``tests/test_layerwise_convs.py``: the float64 loop of per-example tapes
through keras-hub's own layers (``fixtures.check_rule_against_the_loops``). Tiny
backbones built from config (8x8 images, 4x4 patches, width 8, one block); nothing is
downloaded.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd.per_example import choose_engine
from tf_dpnsgd.per_example.layers import vision
import fixtures
from fixtures import normalized_sum_by_loop

keras_hub = pytest.importorskip("keras_hub")

L = keras.layers
R = 0.1
BATCH = 4
IMAGE = (8, 8, 3)


def _backbone(**overrides):
  config = dict(image_shape=IMAGE, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
                mlp_dim=16)
  return keras_hub.models.ViTBackbone(**{**config, **overrides})


def _randomize(model, seed=0):
  rng = np.random.default_rng(seed)
  model.set_weights([0.5 * rng.normal(size=w.shape).astype(w.dtype)
                     for w in model.get_weights()])


def _classifier(**overrides):
  inputs = keras.Input(IMAGE)
  model = keras.Model(inputs, L.Dense(3)(L.Flatten()(_backbone(**overrides)(inputs))))
  _randomize(model)
  return model


def _patching_layer(model):
  return next(l for l in model._flatten_layers()
              if type(l).__name__ == "ViTPatchingAndEmbedding")


def _loss(y_true, y_pred):
  return 0.5 * tf.reduce_sum(tf.square(y_pred - y_true), axis=-1)


def _data(magnitude=1.0, seed=1):
  rng = np.random.default_rng(seed)
  x = tf.constant(magnitude * rng.normal(size=(BATCH,) + IMAGE), tf.float32)
  return x, tf.constant(rng.normal(size=(BATCH, 3)), tf.float32)


def _check(model, x, y, mask=None):
  return fixtures.check_rule_against_the_loops(model, x, y, R, mask=mask, loss=_loss)


def test_the_rule_is_registered_under_keras_hubs_class():
  layer = _patching_layer(_backbone())
  assert f"{type(layer).__module__}.{type(layer).__qualname__}" == \
      vision.VIT_PATCHING_AND_EMBEDDING


@pytest.mark.parametrize("class_token,magnitude", [  # quick: one (issue 47)
    pytest.param(True, 1.0, marks=pytest.mark.slow), (True, 1e6),
    pytest.param(False, 1.0, marks=pytest.mark.slow)])
def test_vit_backbone_matches_the_per_example_loop(class_token, magnitude):
  model = _classifier(use_class_token=class_token)
  engine, why = choose_engine(model)
  assert engine == "layerwise", why
  x, y = _data(magnitude)
  out = _check(model, x, y)
  np.testing.assert_allclose(out.y_pred, model(x, training=True), rtol=1e-5, atol=1e-5)


def test_layer_used_twice_and_masked_rows():
  """The patching layer on ``x`` and ``-2 x`` (its uses add up: class token, position rows,
  patch kernel), with two rows masked out."""
  patching = _patching_layer(_backbone())
  inputs = keras.Input(IMAGE)
  h = L.Concatenate()([L.Flatten()(patching(inputs)),
                       L.Flatten()(patching(L.Rescaling(-2.0)(inputs)))])
  model = keras.Model(inputs, L.Dense(3)(h))
  _randomize(model)
  assert choose_engine(model)[0] == "layerwise"
  x, y = _data(1e3)
  _check(model, x, y)
  out = _check(model, x, y, mask=tf.constant([True, False, True, False]))
  np.testing.assert_array_equal(out.factors.numpy()[[1, 3]], 0.0)


@pytest.mark.slow  # make_private on a ViT (its rules stay quick): CI only (issue 47)
def test_one_dp_step_through_make_private_matches_the_loop():
  """``make_private`` with ``"auto"`` (layer-wise, traced) against the float64 loop."""
  model = _classifier()
  x, _ = _data()
  y = tf.constant([0, 1, 2, 0])
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  _, summed = normalized_sum_by_loop(
      model.trainable_variables, lambda i: loss(y[i:i + 1], model(x[i:i + 1], training=True)),
      BATCH, R)
  private = tf_dpnsgd.make_private(model, trust_untagged_batches=True)
  private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=1.0, regularizer=R,
                                             noise_multiplier=0.0), loss=loss)
  before = [v.numpy() for v in model.trainable_variables]
  private.train_on_batch(x, y)
  for v, b, s in zip(model.trainable_variables, before, summed):
    np.testing.assert_allclose(v.numpy() - b, -s / BATCH, rtol=1e-4, atol=1e-6, err_msg=v.path)


def test_a_position_table_with_lora_is_refused_with_the_reason():
  """The rule reads the table as the ``Embedding`` stores it: LoRA factors would be missed."""
  model = _classifier()
  _patching_layer(model).position_embedding.enable_lora(2)
  engine, why = choose_engine(model)
  assert engine != "layerwise" and "position Embedding: LoRA" in why, why
