"""User-level units on the layer-wise and vectorized engines (issue 50): exact against a
loop over users.

Oracle (written here, independent of the engines): for each user, one tf.GradientTape on
the MEAN loss of that user's real rows, its norm in float64, the transform's factor, the
factor times the gradient summed over users (a factor of 0 adds nothing). Layouts: users
of 1 row and of k rows, padding rows and a padding slot (holding NaN: they must add
exactly 0), a real row holding inf (its user adds exactly 0), inputs at magnitudes 1 and
1e6, a nearly cancelling user at 1e6, a Dense model and an Embedding + Conv1D model, both
weighted-sum modes (book-keeping, two passes), and every explicit ``per_example`` through
the step.
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
import tiers

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
    if factor > 0:  # a non-finite gradient has factor 0 and adds exactly 0
      total = [t + factor * g for t, g in zip(total, grads)]
  return total


ENGINES = {"layerwise": units.user_unit_layerwise_engine,
           "two_pass": functools.partial(units.user_unit_layerwise_engine, mode="two_pass"),
           "vectorized": units.user_unit_vectorized_engine,
           "loop": units.user_unit_engine}


def _engine_sum(model, x, y, transform, engine="layerwise", mask=MASK):
  @tf.function
  def run(x, y, mask):
    out = ENGINES[engine](model, LOSS, x, y, transform, mask=mask, rows_per_unit=K)
    return out.summed, out.norms, out.factors, out.unit_mask, out.losses

  return run(tf.constant(x), tf.constant(y), tf.constant(mask))


def _assert_close(got, want, rtol=2e-5):
  scale = max(float(np.max(np.abs(w))) for w in want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("transform,kind,magnitude,engine", tiers.quick_cover(
    [transforms.Normalize(0.01), transforms.Clip(0.5)], ["dense", "conv"], [1.0, 1e6],
    ["layerwise", "vectorized"], ids=[["normalize", "clip"], None, ["m1", "m1e6"], None]))
def test_all_at_once_units_equal_a_loop_over_users(kind, magnitude, transform, engine):
  model, x, y = _batch(kind, magnitude)
  summed, norms, factors, unit_mask, losses = _engine_sum(model, x, y, transform, engine)
  _assert_close(summed, _oracle(model, x, y, transform))
  assert unit_mask.numpy().tolist() == [True, True, True, False]
  assert factors.numpy()[3] == 0.0  # the padding slot
  assert np.all(np.isfinite(norms.numpy()[:3]))
  # Padding rows of real slots compute copies of the slot's first real row (no NaN).
  assert np.all(np.isfinite(losses.numpy()[:3 * K]))


@pytest.mark.slow  # engine against engine; against the float64 oracle stays quick: CI only (issue 47)
@pytest.mark.parametrize("engine", ["layerwise", "two_pass", "vectorized"])
def test_all_at_once_units_equal_the_loop_engine(engine):
  model, x, y = _batch("dense", 1.0, seed=4)
  transform = transforms.Clip(0.3)
  summed, norms, factors, _, losses = _engine_sum(model, x, y, transform, engine)
  loop = units.user_unit_engine(model, LOSS, tf.constant(x), tf.constant(y), transform,
                                mask=tf.constant(MASK), rows_per_unit=K)
  _assert_close(summed, [s.numpy().astype(np.float64) for s in loop.summed])
  np.testing.assert_allclose(norms.numpy()[:3], loop.norms.numpy()[:3], rtol=1e-5)
  np.testing.assert_array_equal(factors.numpy()[3:], loop.factors.numpy()[3:])
  # The same rows computed: padding rows of real slots are the loop's copies.
  np.testing.assert_allclose(losses.numpy()[:3 * K], loop.losses.numpy()[:3 * K], rtol=1e-5)


def test_the_vectorized_units_run_eagerly_too():
  model, x, y = _batch("dense", 1.0, seed=7)
  transform = transforms.Normalize(0.01)
  out = units.user_unit_vectorized_engine(model, LOSS, tf.constant(x), tf.constant(y),
                                          transform, mask=tf.constant(MASK), rows_per_unit=K)
  _assert_close(out.summed, _oracle(model, x, y, transform))
  assert out.unit_mask.numpy().tolist() == [True, True, True, False]
  assert out.y_pred.shape == (USERS.size, 2)


@pytest.mark.slow  # CI only (issue 47)
def test_vectorized_slots_draw_their_own_dropout_masks_and_advance_each_step():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((3,))
  hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(8)(inputs))
  model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
  x, y = tf.ones([2 * K, 3]), tf.zeros([2 * K], tf.int32)  # two identical slots

  @tf.function
  def norms(x, y):
    return units.user_unit_vectorized_engine(model, LOSS, x, y, transforms.Clip(1e9),
                                             rows_per_unit=K).norms

  first, second = norms(x, y).numpy(), norms(x, y).numpy()
  assert first[0] != first[1]  # one random stream per slot
  assert not np.array_equal(first, second)  # and a new draw each step


@pytest.mark.parametrize("engine", tiers.quick_only(["loop", "layerwise", "vectorized"],
                                                    ["layerwise"]))  # quick: one (issue 47)
def test_a_user_with_a_non_finite_row_adds_exactly_zero(engine):
  model, x, y = _batch("dense", 1.0, seed=8)
  x[np.flatnonzero(USERS == 2)[0]] = np.inf  # a REAL row of user 2
  transform = transforms.Clip(0.5)
  summed, norms, factors, _, _ = _engine_sum(model, x, y, transform, engine)
  assert not np.isfinite(norms.numpy()[2])
  assert factors.numpy()[2] == 0.0
  assert all(np.all(np.isfinite(s.numpy())) for s in summed)
  _assert_close(summed, _oracle(model, x, y, transform))  # users 0 and 1 only
  # With user 2 the only real user, the sum is exactly 0.
  only = (USERS == 2)
  summed, _, factors, _, _ = _engine_sum(model, x, y, transform, engine, mask=only)
  assert factors.numpy().tolist() == [0.0] * 4
  assert all(np.all(s.numpy() == 0.0) for s in summed)


@pytest.mark.parametrize("transform,engine", tiers.quick_cover(
    [transforms.Normalize(1e-6), transforms.Clip(0.5)], ["loop", "layerwise", "vectorized"],
    ids=[["normalize", "clip"], None]))
def test_a_nearly_cancelling_user_at_1e6_stays_within_the_sensitivity(transform, engine):
  """User 1: ``(x, label 0)`` and ``(x (1 + 2e-5), label 1)`` with ``|x| ~ 1e6`` (its third
  row padding) on a linear model whose two logits are equal (p = 1/2): per-row gradients
  ~1e6 whose mean is ``(x' - x) (1/2, -1/2) / 2``, norm ~9 (cancellation in a norm
  computed from per-row parts would show)."""
  keras.utils.set_random_seed(3)
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
  kernel = model.trainable_variables[0]
  kernel.assign(tf.tile(kernel[:, :1], [1, 2]))  # equal columns: equal logits
  x = np.zeros([USERS.size, 3], np.float32)
  y = np.zeros([USERS.size], np.int32)
  rows = np.flatnonzero(USERS == 1)
  v = np.float32([3e5, -7e5, 1e6])
  x[rows] = [v, v * np.float32(1 + 2e-5), v]
  y[rows] = [0, 1, 0]
  only = np.isin(np.arange(USERS.size), rows[:2])
  summed, norms, factors, _, _ = _engine_sum(model, x, y, transform, engine, mask=only)
  true = np.linalg.norm((x[rows[1]].astype(np.float64) - x[rows[0]]) / 4) * np.sqrt(2)
  assert 5.0 < true < 20.0
  np.testing.assert_allclose(norms.numpy()[1], true, rtol=1e-3)
  contribution = np.sqrt(sum(float(np.sum(np.square(s.numpy(), dtype=np.float64)))
                             for s in summed))
  assert factors.numpy()[1] > 0
  assert contribution <= transform.sensitivity * (1 + 1e-6)
  np.testing.assert_allclose(contribution, min(1.0, 0.5 / true) * true
                             if isinstance(transform, transforms.Clip) else true / (1e-6 + true),
                             rtol=1e-3)


@pytest.mark.parametrize("kind,engine", tiers.quick_cover(["dense", "conv"],
                                                          ["layerwise", "vectorized"]))
def test_replacing_one_whole_user_moves_the_sum_by_at_most_the_bound(kind, engine):
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
  sums = [np.concatenate([s.numpy().ravel()
                          for s in _engine_sum(model, xs, ys, transform, engine)[0]])
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


def _user_kwargs(**kw):
  return dict(privacy_unit="user", user_key="uid", max_examples_per_user=K,
              noise_multiplier=1.0, delta=1e-5, batch_size=2, steps=2, **kw)


@pytest.mark.parametrize("per_example,expected", [
    ("layerwise", "layerwise"), ("two_pass", "layerwise"), ("vectorized", "vectorized"),
    ("microbatch", "loop")])
def test_an_explicit_engine_gets_its_user_level_form_exact_through_the_step(per_example,
                                                                            expected):
  model = tf_dpnsgd.make_private(_dense_model(), per_example=per_example,
                                 **_user_kwargs(dataset_size=6))
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01), loss=LOSS)
  engine = units.unit_engine_for(model._dp_engine)
  if expected == "loop":
    assert engine is units.user_unit_engine
  elif expected == "vectorized":
    assert engine is units.user_unit_vectorized_engine
  else:
    assert engine.func is units.user_unit_layerwise_engine
    assert engine.keywords.get("mode", "bookkeeping") == (
        "two_pass" if per_example == "two_pass" else "bookkeeping")
  transform = transforms.Normalize(0.01)
  x = np.random.default_rng(10).normal(size=(USERS.size, 3)).astype(np.float32)
  x[~MASK] = np.nan
  y = (np.nan_to_num(x[:, 0]) > 0).astype(np.int32)
  out = step_lib.contributions(model, tf.constant(x), tf.constant(y), tf.constant(MASK), None,
                               transform)
  _assert_close(out.summed, _oracle(model, x, y, transform))


@pytest.mark.slow  # a user-level fit stays quick in test_user_level.py: CI only (issue 47)
def test_a_user_level_fit_runs_on_the_vectorized_engine():
  rng = np.random.default_rng(11)
  uid = np.repeat(np.arange(5), [1, 3, 2, 4, 1])
  x = rng.normal(size=(uid.size, 3)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  model = tf_dpnsgd.make_private(_dense_model(), per_example="vectorized", **_user_kwargs())
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01), loss=LOSS)
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.fit({"features": x, "uid": uid}, y, verbose=0)
  assert units.unit_engine_for(model._dp_engine) is units.user_unit_vectorized_engine
  assert (model.privacy_ledger.steps, model.privacy_ledger.privacy_unit) == (2, "user")
  after = [v.numpy() for v in model.trainable_variables]
  assert all(np.all(np.isfinite(a)) for a in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))
