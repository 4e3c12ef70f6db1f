"""The layer-wise engine's two-pass mode (``per_example="two_pass"``) and ``"auto"``'s choice.

Oracles: :func:`fixtures.normalized_sum_by_loop` (each example's gradient from its
own tape, float64 aggregation) and, for the adversarial cases, the float64 model
copies of ``test_layerwise_adversarial``.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import dropout as dropout_lib
from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import loss_scale as loss_scale_lib
from tf_dpnsgd.per_example import (layerwise_engine, resolve_engine, stateless,
                                   two_pass_engine)
import fixtures
from fixtures import assert_engine_output, normalized_sum_by_loop

R = 0.1  # DP-NSGD's regularizer: the fixtures' oracle


def sparse_ce(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _shared_layers_model():
  """A convolution used twice, a Dense used twice, GroupNorm and LayerNorm."""
  inputs = keras.Input((6, 6, 2))
  conv = keras.layers.Conv2D(2, 3, padding="same")
  dense = keras.layers.Dense(3)
  h = conv(conv(inputs))
  h = keras.layers.GroupNormalization(groups=2)(h)
  h = keras.layers.Flatten()(h)
  h = keras.layers.Add()([dense(h), dense(2.0 * h)])
  return keras.Model(inputs, keras.layers.LayerNormalization()(h))


def _loop(model, x, y, rows=None):
  rows = list(range(int(x.shape[0]))) if rows is None else rows

  def example_loss(i):
    j = rows[i]
    return tf.reduce_sum(sparse_ce(y[j:j + 1], model(x[j:j + 1], training=True)))

  return normalized_sum_by_loop(model.trainable_variables, example_loss, len(rows), R)


@pytest.fixture(autouse=True)
def _seed():
  keras.utils.set_random_seed(2)


@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_pass_matches_single_example_loop(graph):
  model = _shared_layers_model()
  x = tf.random.normal((4, 6, 6, 2))
  y = tf.constant([0, 1, 2, 1])
  engine = lambda x, y: two_pass_engine(model, sparse_ce, x, y, transforms.Normalize(R))
  if graph:
    step = tf.function(lambda x, y: (lambda o: (o.norms, o.summed))(engine(x, y)))
    norms, summed = step(x, y)
    out = tf_dpnsgd.per_example.EngineOutput(summed, norms, None, None, None)
  else:
    out = engine(x, y)
  assert_engine_output(out, *_loop(model, x, y), sum_rtol=1e-5)


def test_masked_rows_and_microbatches():
  model = _shared_layers_model()
  x = tf.random.normal((4, 6, 6, 2))
  y = tf.constant([0, 1, 2, 1])
  out = two_pass_engine(model, sparse_ce, x, y, transforms.Normalize(R),
                        mask=tf.constant([True, False, True, True]))
  assert out.factors.numpy()[1] == 0.0
  norms, summed = _loop(model, x, y, rows=[0, 2, 3])
  np.testing.assert_allclose(np.delete(out.norms.numpy(), 1), norms, rtol=1e-4)
  for got, expected in zip(out.summed, summed):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # Units of two examples: the same as book-keeping's (tested against a loop of units).
  a = two_pass_engine(model, sparse_ce, x, y, transforms.Clip(0.1), num_microbatches=2)
  b = layerwise_engine(model, sparse_ce, x, y, transforms.Clip(0.1), num_microbatches=2)
  np.testing.assert_allclose(a.norms, b.norms, rtol=1e-6)
  for s, t in zip(a.summed, b.summed):
    np.testing.assert_allclose(s, t, rtol=1e-5, atol=1e-7)


def test_loss_scale_is_undone():
  model = _shared_layers_model()
  x = tf.random.normal((3, 6, 6, 2))
  y = tf.constant([0, 1, 2])
  clip = transforms.Clip(0.05)
  plain = two_pass_engine(model, sparse_ce, x, y, clip)
  scaled = loss_scale_lib.scaled_contributions(two_pass_engine, model, sparse_ce, x, y, clip,
                                               128.0)
  np.testing.assert_allclose(scaled.norms, plain.norms, rtol=1e-6)
  for s, t in zip(scaled.summed, plain.summed):
    np.testing.assert_allclose(s, t, rtol=1e-5, atol=1e-8)


def test_dropout_masks_are_the_same_in_both_passes_and_seeds_advance_once():
  inp = keras.Input((6,))
  h = keras.layers.Dense(8, activation="tanh")(inp)
  h = keras.layers.Dropout(0.4, seed=3)(h)
  model = keras.Model(inp, keras.layers.Dense(3)(h))
  drop = dropout_lib.dropout_layers(model)[0]
  state = drop.seed_generator.state
  x = tf.random.stateless_normal([5, 6], seed=[3, 4])
  y = tf.constant([0, 1, 2, 1, 0])
  clip = transforms.Clip(0.05)
  start = state.numpy()
  out = two_pass_engine(model, sparse_ce, x, y, clip)
  after_two_pass = state.numpy()
  state.assign(start)
  reference = layerwise_engine(model, sparse_ce, x, y, clip)  # one pass, the same masks
  assert np.array_equal(state.numpy(), after_two_pass)  # advanced once, as by one pass
  assert not np.array_equal(start, after_two_pass)
  np.testing.assert_allclose(out.norms, reference.norms, rtol=1e-6)
  for s, t in zip(out.summed, reference.summed):
    np.testing.assert_allclose(s, t, rtol=1e-6, atol=1e-8)
  # The masks were active (the same forward pass with the first seed, per example).
  state.assign(start)
  with tf.GradientTape(persistent=True) as tape:
    with dropout_lib.PhiloxDropout(model):
      logits = model(x, training=True)
    rows = tf.unstack(sparse_ce(y, logits))
  grads = [np.concatenate([np.ravel(g.numpy()) for g in tape.gradient(r, model.trainable_variables)])
           for r in rows]
  np.testing.assert_allclose(out.norms, [np.linalg.norm(g) for g in grads], rtol=1e-5)
  assert np.any(grads[0][:48] == 0)


def _tiny_bert(dropout):
  keras_hub = pytest.importorskip("keras_hub")
  backbone = keras_hub.models.BertBackbone(vocabulary_size=40, num_layers=2, num_heads=2,
                                           hidden_dim=8, intermediate_dim=16,
                                           max_sequence_length=12, dropout=dropout)
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                             preprocessor=None, dropout=dropout)


@pytest.mark.slow
def test_keras_hub_bert_with_dropout_in_a_graph_equals_bookkeeping():
  model = _tiny_bert(dropout=0.2)
  rng = np.random.default_rng(4)
  x = {"token_ids": tf.constant(rng.integers(0, 40, (4, 7)), tf.int32),
       "segment_ids": tf.zeros((4, 7), tf.int32), "padding_mask": tf.ones((4, 7), tf.int32)}
  y = tf.constant([0, 1, 1, 0])
  states = [g.state for g in stateless.seed_generators(model)]
  start = [s.numpy() for s in states]
  results = []
  for engine in (two_pass_engine, layerwise_engine):
    for s, v in zip(states, start):
      s.assign(v)
    step = tf.function(lambda x, y, e=engine: (lambda o: (o.norms, o.summed))(
        e(model, sparse_ce, x, y, transforms.Normalize(0.01))))
    results.append(step(x, y))
  (n1, s1), (n2, s2) = results
  np.testing.assert_allclose(n1, n2, rtol=1e-6)
  for a, b in zip(s1, s2):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# --- the choice ---------------------------------------------------------------------------

def _dense_seq_model():
  inputs = keras.Input((7, 5))
  h = keras.layers.Dense(6)(inputs)
  return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


def test_auto_picks_two_passes_when_the_held_gradients_exceed_the_budget(caplog, monkeypatch):
  model = _dense_seq_model()
  x, y = tf.random.normal((4, 7, 5)), tf.constant([0, 1, 2, 0])
  held = 4 * (4 * 7 * 6 + 4 * 3)  # the two Dense layers' output gradients at batch 4
  budgets = []
  plan_keeping = factored.plan_keeping
  monkeypatch.setattr(factored, "plan_keeping",
                      lambda reps, budget: budgets.append(budget) or plan_keeping(reps, budget))
  reference = _loop(model, x, y)
  for keep_mib, expected in ((0, "two passes"), (held / 2**20, "book-keeping"),
                             (None, "book-keeping")):
    caplog.clear()
    engine = resolve_engine(model, "auto", keep_mib=keep_mib).dense_engine
    with caplog.at_level(logging.INFO, logger="tf_dpnsgd.per_example"):
      out = engine(model, sparse_ce, x, y, transforms.Normalize(R))
    (record,) = [r for r in caplog.records if "per_example='auto' uses" in r.getMessage()]
    assert record.getMessage().startswith(f"per_example='auto' uses {expected}")
    assert_engine_output(out, *reference, sum_rtol=1e-5)
  # Book-keeping keeps per-example weight gradients in what the held gradients leave.
  assert budgets == [0, 0, factored.KEEP_BYTES - held]


def test_stateful_random_ops_are_refused_by_two_passes(caplog):
  inputs = keras.Input((4,))
  h = keras.layers.Lambda(lambda t: t + tf.random.uniform(tf.shape(t)))(inputs)
  model = keras.Model(inputs, keras.layers.Dense(2)(h))
  x, y = tf.random.normal((3, 4)), tf.constant([0, 1, 0])
  two_pass = tf.function(lambda x, y: two_pass_engine(model, sparse_ce, x, y,
                                                      transforms.Clip(1.0)).norms)
  with pytest.raises(ValueError, match="stateful random ops"):
    two_pass(x, y)
  auto = tf.function(lambda x, y: layerwise_engine(model, sparse_ce, x, y, transforms.Clip(1.0),
                                                   keep_bytes=0, mode="auto").norms)
  with caplog.at_level(logging.WARNING, logger="tf_dpnsgd.per_example"):
    auto(x, y)
  assert any("after all" in r.getMessage() and "RandomUniform" in r.getMessage()
             for r in caplog.records)


def test_nondeterministic_kernels_are_refused_by_two_passes(monkeypatch):
  model = _dense_seq_model()
  x, y = tf.random.normal((2, 7, 5)), tf.constant([0, 1])
  monkeypatch.setattr(layerwise, "nondeterministic_kernels", lambda: True)
  with pytest.raises(ValueError, match="enable_op_determinism"):
    two_pass_engine(model, sparse_ce, x, y, transforms.Clip(1.0))
  layerwise_engine(model, sparse_ce, x, y, transforms.Clip(1.0), keep_bytes=0, mode="auto")


def test_two_pass_is_an_engine_name():
  model = tf_dpnsgd.make_private(_dense_seq_model(), per_example="two_pass")
  assert model.get_config()["per_example"] == "two_pass"
  assert resolve_engine(_dense_seq_model(), "two_pass") is two_pass_engine


@pytest.mark.slow
def test_physical_chunks_through_make_private_equal_bookkeeping():
  x, y = tf.random.normal((8, 7, 5)), tf.constant(np.arange(8) % 3)
  weights = [fixtures.one_noiseless_step(_dense_seq_model, x, y, per_example=per_example,
                                         physical_batch_size=physical)
             for per_example, physical in (("layerwise", None), ("two_pass", 3))]
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --- adversarial: magnitude 1e6, cancelling shared layers, a NaN example --------------------

@pytest.mark.parametrize("name", ["dense_siamese_ghost", "conv_siamese_materialized",
                                  "conv_siamese_ghost", "tied_embedding_lookup_and_projection",
                                  "embedding_looked_up_twice"])
def test_contributions_bounded_at_1e6_with_a_nan_example(name):
  """Shared layers whose per-example gradients nearly cancel, inputs of magnitude 1e6, and one
  example whose gradient is NaN: the first pass certifies the norms (ill-conditioned examples
  recomputed in float64) and the second pass's sum must use what they measured."""
  import test_layerwise_adversarial as adv

  model, inputs, y_true, grads = adv._setup(name, 1e6)
  y_true = y_true.copy()
  y_true[1] = np.nan  # loss coefficient NaN: example 1's gradient is NaN
  grads[1] = 0.0      # ... and it must contribute exactly nothing
  true_norms = np.linalg.norm(grads, axis=1)
  x = [tf.constant(t) for t in inputs] if isinstance(inputs, list) else tf.constant(inputs)
  for transform in adv._transforms_for(np.delete(true_norms, 1)):
    out = two_pass_engine(model, adv.linear_loss, x, tf.constant(y_true), transform)
    norms, h = out.norms.numpy().astype(np.float64), out.factors.numpy().astype(np.float64)
    assert h[1] == 0.0 and not np.isfinite(norms[1])
    keep = np.arange(adv.BATCH) != 1
    assert np.all(norms[keep] >= true_norms[keep] * (1 - adv.NORM_RTOL))
    assert np.all(h * true_norms <= transform.sensitivity * (1 + adv.BOUND_RTOL))
    summed = adv._flat(out.summed)
    assert np.all(np.isfinite(summed))
    np.testing.assert_allclose(summed, h @ grads, rtol=0,
                               atol=1e-5 * transform.sensitivity * adv.BATCH)
