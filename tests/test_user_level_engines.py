"""User-level units on the layer-wise engine (issue 50): exact against a loop over users.

Oracle (written here, independent of the engines): for each user, one tf.GradientTape on
the MEAN loss of that user's real rows, its norm in float64, the transform's factor, the
factor times the gradient summed over users. Layouts: users of 1 row and of k rows,
padding rows and a padding slot (holding NaN: they must add exactly 0), inputs at
magnitudes 1 and 1e6, a Dense model and an Embedding + Conv1D model, both weighted-sum
modes (book-keeping, two passes).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import step as step_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import units

K = 3
# Slots of K rows: user 0 has 1 row, user 1 has K rows, user 2 has 2 rows, then a padding
# slot. The user of each row (-1: padding).
USERS = np.array([0, -1, -1, 1, 1, 1, 2, 2, -1, -1, -1, -1])
MASK = USERS >= 0
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _dense_model():
  keras.utils.set_random_seed(1)
  inputs = keras.Input((3,))
  hidden = keras.layers.Dense(4, activation="tanh")(inputs)
  return keras.Model(inputs, keras.layers.Dense(2)(hidden))


def _conv_model():
  keras.utils.set_random_seed(2)
  inputs = keras.Input((5,), dtype="int32")
  h = keras.layers.Embedding(7, 4)(inputs)
  h = keras.layers.Conv1D(3, 2, activation="tanh")(h)
  h = keras.layers.GlobalAveragePooling1D()(h)
  return keras.Model(inputs, keras.layers.Dense(2)(h))


def _batch(kind, magnitude, seed=0):
  """``(model, x, y)`` with NaN in every padding row (they must never reach the sum)."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 2, size=USERS.size).astype(np.int32)
  if kind == "dense":
    model = _dense_model()
    x = (rng.normal(size=(USERS.size, 3)) * magnitude).astype(np.float32)
    x[~MASK] = np.nan
    return model, x, y
  model = _conv_model()
  x = rng.integers(0, 7, size=(USERS.size, 5)).astype(np.int32)  # ids repeat within a user
  x[~MASK] = 6
  table = model.layers[1]
  table.embeddings.assign(table.embeddings * magnitude)
  return model, x, y


def _oracle(model, x, y, transform):
  """Per user: the gradient of the mean loss of its real rows, transformed, summed."""
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  for user in sorted(set(USERS[MASK].tolist())):
    rows = np.flatnonzero(USERS == user)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(LOSS(y[rows], model(x[rows], training=True)))
    grads = [tf.convert_to_tensor(g).numpy().astype(np.float64)  # embedding: IndexedSlices
             for g in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads))
    factor = float(transform.factors(tf.constant([norm], tf.float32))[0])
    total = [t + factor * g for t, g in zip(total, grads)]
  return total


def _engine_sum(model, x, y, transform, mode="bookkeeping"):
  @tf.function
  def run(x, y, mask):
    out = units.user_unit_layerwise_engine(model, LOSS, x, y, transform, mask=mask,
                                           rows_per_unit=K, mode=mode)
    return out.summed, out.norms, out.factors, out.unit_mask, out.losses

  return run(tf.constant(x), tf.constant(y), tf.constant(MASK))


def _assert_close(got, want, rtol=2e-5):
  scale = max(float(np.max(np.abs(w))) for w in want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("magnitude", [1.0, 1e6], ids=["m1", "m1e6"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("transform", [transforms.Normalize(0.01), transforms.Clip(0.5)],
                         ids=["normalize", "clip"])
def test_layerwise_units_equal_a_loop_over_users(kind, magnitude, transform):
  model, x, y = _batch(kind, magnitude)
  summed, norms, factors, unit_mask, losses = _engine_sum(model, x, y, transform)
  _assert_close(summed, _oracle(model, x, y, transform))
  assert unit_mask.numpy().tolist() == [True, True, True, False]
  assert factors.numpy()[3] == 0.0  # the padding slot
  assert np.all(np.isfinite(norms.numpy()[:3]))
  # Padding rows of real slots compute copies of the slot's first real row (no NaN).
  assert np.all(np.isfinite(losses.numpy()[:3 * K]))


@pytest.mark.parametrize("mode", ["bookkeeping", "two_pass"])
def test_layerwise_units_equal_the_loop_engine_in_both_modes(mode):
  model, x, y = _batch("dense", 1.0, seed=4)
  transform = transforms.Clip(0.3)
  summed, norms, factors, _, _ = _engine_sum(model, x, y, transform, mode=mode)
  loop = units.user_unit_engine(model, LOSS, tf.constant(x), tf.constant(y), transform,
                                mask=tf.constant(MASK), rows_per_unit=K)
  _assert_close(summed, [s.numpy().astype(np.float64) for s in loop.summed])
  np.testing.assert_allclose(norms.numpy()[:3], loop.norms.numpy()[:3], rtol=1e-5)
  np.testing.assert_array_equal(factors.numpy()[3:], loop.factors.numpy()[3:])


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_replacing_one_whole_user_moves_the_layerwise_sum_by_at_most_the_bound(kind):
  transform = transforms.Normalize(1e-6)  # S = 1: replace-one bound 2
  model, x, y = _batch(kind, 1.0, seed=5)
  x2 = x.copy()
  user1 = USERS == 1
  if kind == "dense":
    x2[user1] = 1e6  # the user's every row replaced by outliers
  else:
    x2[user1] = (x[user1] + 3) % 7
  y2 = y.copy()
  y2[user1] = 1 - y[user1]
  sums = [np.concatenate([s.numpy().ravel() for s in _engine_sum(model, xs, ys, transform)[0]])
          for xs, ys in ((x, y), (x2, y2))]
  moved = float(np.linalg.norm(sums[0] - sums[1]))
  assert 0.01 < moved <= 2.0 + 1e-5


def test_auto_picks_layerwise_units_where_the_model_has_rules_and_the_loop_otherwise():
  assert units.unit_engine_for(units.microbatch.microbatch_engine) is units.user_unit_engine
  chosen = units.unit_engine_for(functools.partial(layerwise.layerwise_engine, mode="auto",
                                                   keep_bytes=7))
  assert chosen.func is units.user_unit_layerwise_engine
  assert chosen.keywords == {"mode": "auto", "keep_bytes": 7}
  model = tf_dpnsgd.make_private(
      _dense_model(), privacy_unit="user", user_key="uid", max_examples_per_user=K,
      noise_multiplier=1.0, delta=1e-5, batch_size=2, steps=2, dataset_size=6)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01), loss=LOSS)
  engine = units.unit_engine_for(model._dp_engine)
  assert getattr(engine, "func", None) is units.user_unit_layerwise_engine
  transform = transforms.Clip(0.5)
  x = np.random.default_rng(6).normal(size=(USERS.size, 3)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  out = step_lib.contributions(model, tf.constant(x), tf.constant(y), tf.constant(MASK), None,
                               transform)
  _assert_close(out.summed, _oracle(model, x, y, transform))


@pytest.mark.parametrize("per_example,expected", [
    ("layerwise", "layerwise"), ("two_pass", "layerwise"), ("microbatch", "loop")])
def test_an_explicit_engine_gets_its_user_level_form_and_vectorized_is_refused(per_example,
                                                                               expected):
  kwargs = dict(privacy_unit="user", user_key="uid", max_examples_per_user=K,
                noise_multiplier=1.0, delta=1e-5, batch_size=2, steps=2, dataset_size=6)
  model = tf_dpnsgd.make_private(_dense_model(), per_example=per_example, **kwargs)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01), loss=LOSS)
  engine = units.unit_engine_for(model._dp_engine)
  if expected == "loop":
    assert engine is units.user_unit_engine
  else:
    assert engine.func is units.user_unit_layerwise_engine
    assert engine.keywords.get("mode", "bookkeeping") == (
        "two_pass" if per_example == "two_pass" else "bookkeeping")
  with pytest.raises(ValueError, match="no user-level form"):
    tf_dpnsgd.make_private(_dense_model(), per_example="vectorized", **kwargs)
