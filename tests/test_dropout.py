"""tf_dpnsgd.per_example.dropout: Keras Dropout drawn with Philox inside the layer-wise engine.

Oracles: Keras' own ``Dropout`` on the same seed state (bit-identical without
XLA), and, under XLA, a loop of single-example gradients of the same forward
pass (the same masks), clipped and summed by hand.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import dropout as dropout_lib
from tf_dpnsgd.per_example.layerwise import layerwise_engine


def _state(layer):
  return layer.seed_generator.state


@pytest.mark.parametrize("noise_shape", [None, (None, 1, 4)])
def test_philox_dropout_equals_keras_dropout_without_xla(noise_shape):
  layer = keras.layers.Dropout(0.3, noise_shape=noise_shape, seed=7)
  model = keras.Sequential([keras.Input((5, 4)), layer])
  x = tf.random.stateless_normal([6, 5, 4], seed=[1, 2])
  start = _state(layer).numpy()

  @tf.function(autograph=False)
  def keras_call(x):
    return layer(x, training=True)

  @tf.function(autograph=False)
  def routed_call(x):
    with dropout_lib.PhiloxDropout(model):
      return layer(x, training=True)

  expected = keras_call(x).numpy()
  after_keras = _state(layer).numpy()
  _state(layer).assign(start)
  got = routed_call(x).numpy()
  np.testing.assert_array_equal(got, expected)  # the same mask, bit for bit
  np.testing.assert_array_equal(_state(layer).numpy(), after_keras)  # the same stream
  assert 0 < np.mean(got == 0) < 0.7
  assert "call" not in layer.__dict__  # routing removed on exit


def test_only_exact_dropout_layers_and_only_inside_the_context():
  class MyDropout(keras.layers.Dropout):
    pass

  plain, sub = keras.layers.Dropout(0.5), MyDropout(0.5)
  model = keras.Sequential([keras.Input((3,)), plain, sub])
  assert dropout_lib.dropout_layers(model) == [plain]
  with dropout_lib.PhiloxDropout(model):
    assert "call" in plain.__dict__ and "call" not in sub.__dict__
    assert np.array_equal(plain(tf.ones([2, 3]), training=False), tf.ones([2, 3]))
  assert "call" not in plain.__dict__


def _model():
  inp = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh")(inp)
  h = keras.layers.Dropout(0.4, seed=3)(h)
  return keras.Model(inp, keras.layers.Dense(3)(h))


def _losses(y, logits):
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


@pytest.mark.slow  # XLA compiles
def test_layerwise_under_xla_equals_single_example_gradients_with_the_same_masks():
  model = _model()
  drop = dropout_lib.dropout_layers(model)[0]
  x = tf.random.stateless_normal([5, 6], seed=[3, 4])
  y = tf.constant([0, 1, 2, 1, 0])
  clip = transforms.Clip(0.05)  # below the examples' norms: clipping is active
  start = _state(drop).numpy()

  @tf.function(jit_compile=True, autograph=False)
  def engine():
    out = layerwise_engine(model, _losses, x, y, clip)
    return out.summed, out.norms, out.y_pred

  @tf.function(jit_compile=True, autograph=False)
  def reference():  # the same forward pass (same seed, same Philox masks), one gradient per row
    with tf.GradientTape(persistent=True) as tape:
      with dropout_lib.PhiloxDropout(model):
        logits = model(x, training=True)
      rows = tf.unstack(_losses(y, logits))  # inside the tape: each row's loss is recorded
    per_example = [tape.gradient(row, model.trainable_variables) for row in rows]
    return per_example, logits

  summed, norms, y_pred = engine()
  _state(drop).assign(start)
  per_example, logits = reference()
  np.testing.assert_allclose(y_pred.numpy(), logits.numpy(), rtol=1e-6)  # the same masks
  grads = [np.concatenate([np.ravel(g.numpy()) for g in row]) for row in per_example]
  ref_norms = np.array([np.linalg.norm(g.astype(np.float64)) for g in grads])
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-5)
  factors = np.minimum(1.0, 0.05 / ref_norms)
  assert factors.max() < 1.0
  expected = sum(f * g.astype(np.float64) for f, g in zip(factors, grads))
  got = np.concatenate([np.ravel(s.numpy()) for s in summed])
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
  # dropout was active: some units of the hidden layer are zero for some examples
  assert np.any(grads[0][:48].reshape(6, 8) == 0)
