"""Per-example gradients equal a Python loop of single-example gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import losses as losses_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import vectorized_engine
import tiers

XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_model():
  inp = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh")(inp)
  return keras.Model(inp, keras.layers.Dense(3)(h))


def conv_gn_model():
  inp = keras.Input((8, 8, 3))
  h = keras.layers.Conv2D(8, 3, strides=2, padding="same")(inp)
  h = keras.layers.GroupNormalization(groups=4)(h)
  h = keras.layers.Activation("relu")(h)
  h = keras.layers.Conv2D(4, 3, dilation_rate=2, padding="same")(h)
  h = keras.layers.LayerNormalization()(h)
  h = keras.layers.GlobalAveragePooling2D()(h)
  return keras.Model(inp, keras.layers.Dense(3)(h))


def embedding_model():
  inp = keras.Input((5,), dtype="int32")
  h = keras.layers.Embedding(20, 4)(inp)
  h = keras.layers.GlobalAveragePooling1D()(h)
  return keras.Model(inp, keras.layers.Dense(3)(h))


def data_for(name, n, rng):
  y = rng.integers(0, 3, n).astype("int32")
  if name == "dense":
    return rng.normal(size=(n, 6)).astype("float32"), y
  if name == "conv":
    return rng.normal(size=(n, 8, 8, 3)).astype("float32"), y
  return rng.integers(0, 20, (n, 5)).astype("int32"), y


MODELS = {"dense": dense_model, "conv": conv_gn_model, "embedding": embedding_model}


def loop_grads(model, x, y, unit_size=1):
  out = []
  for s in range(0, len(y), unit_size):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(XENT.call(y[s:s + unit_size], model(x[s:s + unit_size], training=True)))
    out.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)])
  return [np.stack(gs) for gs in zip(*out)]


@pytest.mark.parametrize("transform,name", tiers.quick_cover(
    [transforms.Normalize(0.1), transforms.Clip(0.5)], sorted(MODELS),
    ids=[["normalize", "clip"], None]))
def test_vectorized_engine_matches_loop(name, transform):
  rng = np.random.default_rng(0)
  model = MODELS[name]()
  x, y = data_for(name, 6, rng)
  loss_fn = losses_lib.per_example_loss_fn(XENT)
  out = vectorized_engine(model, loss_fn, tf.constant(x), tf.constant(y), transform)
  per_ex = loop_grads(model, x, y)
  expected_norms = np.sqrt(sum((g.reshape(len(y), -1) ** 2).sum(1) for g in per_ex))
  np.testing.assert_allclose(out.norms.numpy(), expected_norms, rtol=1e-5)
  h = transform.factors(tf.constant(expected_norms, tf.float32)).numpy()
  for got, g in zip(out.summed, per_ex):
    np.testing.assert_allclose(got.numpy(), np.tensordot(h, g, axes=1), rtol=1e-5, atol=1e-6)


def test_microbatches_match_loop():
  rng = np.random.default_rng(1)
  model = dense_model()
  x, y = data_for("dense", 8, rng)
  t = transforms.Clip(0.3)
  out = vectorized_engine(model, losses_lib.per_example_loss_fn(XENT), tf.constant(x),
                          tf.constant(y), t, num_microbatches=4)
  per_mb = loop_grads(model, x, y, unit_size=2)
  norms = np.sqrt(sum((g.reshape(4, -1) ** 2).sum(1) for g in per_mb))
  np.testing.assert_allclose(out.norms.numpy(), norms, rtol=1e-5)
  h = t.factors(tf.constant(norms, tf.float32)).numpy()
  for got, g in zip(out.summed, per_mb):
    np.testing.assert_allclose(got.numpy(), np.tensordot(h, g, axes=1), rtol=1e-5, atol=1e-6)


def test_microbatches_must_divide_batch():
  model = dense_model()
  x, y = data_for("dense", 6, np.random.default_rng(2))
  with pytest.raises(ValueError, match="num_microbatches"):  # static batch: while tracing
    vectorized_engine(model, losses_lib.per_example_loss_fn(XENT), tf.constant(x), tf.constant(y),
                      transforms.Clip(1.0), num_microbatches=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conv", "embedding"])
def test_chunked_train_step_matches_unchunked(name):
  """physical_batch_size gives the same update as one big batch (noise 0)."""
  rng = np.random.default_rng(3)
  x, y = data_for(name, 10, rng)
  weights = None
  results = []
  for chunk in (None, 4):
    base = MODELS[name]()
    if weights is None:
      weights = base.get_weights()
    base.set_weights(weights)
    model = tf_dpnsgd.make_private(base, physical_batch_size=chunk)
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=0.2, noise_multiplier=0.0),
                  loss=XENT)
    hist = model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    results.append((model.get_weights(), hist.history))
  for a, b in zip(results[0][0], results[1][0]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert results[0][1]["loss"][0] == pytest.approx(results[1][1]["loss"][0], rel=1e-5)


def test_dropout_masks_differ_per_example_and_per_step():
  """Inside vectorized_map a loop-invariant seed would give every example the same mask."""
  inp = keras.Input((16,))
  out = keras.layers.Dropout(0.5)(keras.layers.Dense(16, kernel_initializer="ones",
                                                     use_bias=False)(inp))
  model = keras.Model(inp, out)

  def mse(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_pred - y_true), axis=-1)

  x = tf.ones((6, 16))
  first = vectorized_engine(model, mse, x, tf.zeros((6, 16)), transforms.Clip(1e9))
  second = vectorized_engine(model, mse, x, tf.zeros((6, 16)), transforms.Clip(1e9))
  masks = (first.y_pred.numpy() != 0)
  assert len({m.tobytes() for m in masks}) > 1  # examples get their own masks
  assert not np.array_equal(masks, second.y_pred.numpy() != 0)  # and new ones each step
  assert 0.3 < masks.mean() < 0.7
