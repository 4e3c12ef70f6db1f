"""The layer-wise rules for RMS normalizations and PReLU (issue 49) against per-example loops.

Rules under test (``tf_dpnsgd/per_example/layers/normalization.py``, ``activation.py``):
Keras' ``RMSNormalization`` (``scale``), keras-hub's ``LlamaLayerNorm`` /
``MistralLayerNormalization`` (``xhat * scale``) and Gemma's ``RMSNormalization``
(``xhat * (1 + scale)``), Keras' ``PReLU`` (``alpha``, with ``shared_axes``).

The oracle (:func:`fixtures.normalized_sum_by_loop`) differentiates each example's loss
with its own ``tf.GradientTape`` and does the DP-NSGD sum in float64 numpy; it shares no
code with the engine. Inputs go up to magnitude 1e6; each rule is also used twice in one
model (its uses' per-example gradients add up), and padding rows must contribute zero.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import choose_engine, layerwise_engine, microbatch_engine
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import normalization
import fixtures
import tiers
from fixtures import assert_engine_output, normalized_sum_by_loop

R = 0.1  # DP-NSGD regularizer
BATCH = 4


def _hub_layer(name):
  """keras-hub's RMS-norm classes (imported only here: keras-hub is optional)."""
  # pylint: disable=import-outside-toplevel
  from keras_hub.src.models.gemma.rms_normalization import RMSNormalization
  from keras_hub.src.models.llama.llama_layernorm import LlamaLayerNorm
  from keras_hub.src.models.mistral.mistral_layer_norm import MistralLayerNormalization
  return {"llama": LlamaLayerNorm, "mistral": MistralLayerNormalization,
          "gemma": RMSNormalization}[name](epsilon=1e-6)


# name -> (layer factory, non-batch input shape)
LAYERS = {
    "keras_rms": (lambda: keras.layers.RMSNormalization(), (3, 4)),
    "keras_rms_two_axes": (lambda: keras.layers.RMSNormalization(axis=[1, 2]), (3, 4)),
    "keras_rms_flat": (lambda: keras.layers.RMSNormalization(epsilon=1e-3), (5,)),
    "llama_rms": (lambda: _hub_layer("llama"), (3, 4)),
    "mistral_rms": (lambda: _hub_layer("mistral"), (3, 4)),
    "gemma_rms": (lambda: _hub_layer("gemma"), (3, 4)),
    "prelu": (lambda: keras.layers.PReLU(), (3, 4)),
    "prelu_shared_axis": (lambda: keras.layers.PReLU(shared_axes=[1]), (3, 4)),
    "prelu_shared_spatial": (lambda: keras.layers.PReLU(shared_axes=[1, 2]), (2, 3, 4)),
}


def _randomize(model, seed=0):
  """Random weights everywhere (Gemma's scale starts at 0, PReLU's alpha at 0)."""
  rng = np.random.default_rng(seed)
  model.set_weights([rng.normal(size=w.shape).astype(w.dtype) for w in model.get_weights()])


def _model(layer, shape, twice=False):
  """``Dense(3)`` on the flattened output of ``layer``; ``twice``: ``layer`` also on ``-2 x``."""
  inputs = keras.Input(shape)
  h = layer(inputs)
  if twice:
    h = keras.layers.Concatenate()([h, layer(keras.layers.Rescaling(-2.0)(inputs))])
  h = keras.layers.Flatten()(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(h))
  _randomize(model)
  return model


def _loss(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _data(shape, magnitude=1.0, seed=1):
  rng = np.random.default_rng(seed)
  x = tf.constant(magnitude * rng.normal(size=(BATCH,) + shape), tf.float32)
  return x, tf.constant(np.arange(BATCH) % 3, tf.int32)


def _oracle(model, x, y):
  return normalized_sum_by_loop(
      model.trainable_variables,
      lambda i: tf.reduce_sum(_loss(y[i:i + 1], model(x[i:i + 1], training=True))), BATCH, R)


def _check(model, x, y, engine=layerwise_engine):
  out = engine(model, _loss, x, y, transforms.Normalize(R))
  norms, summed = _oracle(model, x, y)
  assert_engine_output(out, norms, summed, norm_rtol=1e-5, sum_rtol=1e-4, sum_atol=1e-6)
  return out


@pytest.mark.parametrize("name,magnitude", tiers.quick_cover(sorted(LAYERS), [1.0, 1e6]))
def test_rule_matches_the_per_example_loop(name, magnitude):
  make, shape = LAYERS[name]
  model = _model(make(), shape)
  assert choose_engine(model)[0] == "layerwise"
  x, y = _data(shape, magnitude)
  out = _check(model, x, y)
  # The rule's recomputed forward pass is the layer's own.
  np.testing.assert_allclose(out.y_pred, model(x, training=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["keras_rms", "gemma_rms", "prelu_shared_axis"])
def test_layer_used_twice_adds_its_uses(name):
  make, shape = LAYERS[name]
  model = _model(make(), shape, twice=True)
  x, y = _data(shape, 1e6)
  _check(model, x, y)


def test_padding_rows_contribute_zero():
  inputs = keras.Input((3, 4))
  h = keras.layers.RMSNormalization()(keras.layers.Dense(4)(inputs))
  h = keras.layers.PReLU(shared_axes=[1])(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  _randomize(model)
  x, y = _data((3, 4))
  mask = tf.constant([True, False, True, False])
  out = layerwise_engine(model, _loss, x, y, transforms.Normalize(R), mask=mask)
  np.testing.assert_array_equal(out.factors.numpy()[[1, 3]], 0.0)
  kept = layerwise_engine(model, _loss, tf.gather(x, [0, 2]), tf.gather(y, [0, 2]),
                          transforms.Normalize(R))
  for a, b in zip(out.summed, kept.summed):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_reduce_to_parameter_follows_numpy_broadcasting():
  t = tf.reshape(tf.range(2 * 3 * 4, dtype=tf.float32), [2, 3, 4])
  np.testing.assert_array_equal(normalization.reduce_to_parameter(t, (4,)),
                                np.sum(t.numpy(), axis=1))
  np.testing.assert_array_equal(normalization.reduce_to_parameter(t, (1, 4)),
                                np.sum(t.numpy(), axis=1, keepdims=True))
  np.testing.assert_array_equal(normalization.reduce_to_parameter(t, (3, 1)),
                                np.sum(t.numpy(), axis=2, keepdims=True))
  with pytest.raises(registry_lib.UnsupportedLayerError, match="batch axis"):
    normalization.reduce_to_parameter(t, (2, 3, 4))


def test_auto_picks_layerwise_for_dense_rmsnorm_prelu():
  model = _model(keras.layers.PReLU(), (3, 4))
  engine, why = choose_engine(model)
  assert engine == "layerwise", why
  inputs = keras.Input((5,))
  h = keras.layers.PReLU()(keras.layers.RMSNormalization()(keras.layers.Dense(6)(inputs)))
  assert choose_engine(keras.Model(inputs, keras.layers.Dense(2)(h)))[0] == "layerwise"


def test_subclass_is_not_matched():
  class MyRMS(keras.layers.RMSNormalization):
    pass

  model = _model(MyRMS(), (3, 4))
  cov = registry_lib.coverage(model)
  assert not cov.complete and "MyRMS" in cov.explain()


# --- cancelling shared uses at magnitude 1e6: the sensitivity still holds ---------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["keras_rms", "llama_rms", "gemma_rms", "prelu",
                                  "prelu_shared_axis"])
def test_nearly_cancelling_uses_stay_within_the_sensitivity(name):
  """One layer on ``x`` and ``x (1 + 1e-7)`` (magnitude 1e6) with output gradients ``c``
  and ``-(1 - 1e-4) c``: the per-example gradient nearly cancels. Each example's
  contribution to the sum, read off the batch with the others masked out, has norm at
  most the transform's sensitivity, and is within float32 rounding of the true one."""
  make, shape = LAYERS[name]
  fixtures.assert_cancelling_uses_stay_within_the_sensitivity(make(), shape, BATCH, 1e6,
                                                              _randomize, normalize_too=True)


@pytest.mark.slow
def test_microbatch_engine_agrees_on_a_norm_stack():
  inputs = keras.Input((3, 4))
  h = keras.layers.RMSNormalization()(keras.layers.Dense(4)(inputs))
  h = _hub_layer("gemma")(keras.layers.PReLU(shared_axes=[1])(h))
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  _randomize(model)
  x, y = _data((3, 4), 1e6)
  a = _check(model, x, y)
  b = _check(model, x, y, engine=microbatch_engine)
  np.testing.assert_allclose(a.norms, b.norms, rtol=1e-5)
