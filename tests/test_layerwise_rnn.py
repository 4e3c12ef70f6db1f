"""The layer-wise rule for recurrent layers (issue 49): ``SimpleRNN``, ``LSTM``, ``GRU``,
``RNN(cell)`` and ``Bidirectional`` around them.

Rule under test (``tf_dpnsgd/per_example/layers/recurrent.py``): the recurrence recomputed
with one ``tf.scan``, the input projections ``xz = x W + b`` of all steps probed, and per
example ``kernel: sum_t x_t (x) dz_t``, ``recurrent_kernel: sum_t h_{t-1} (x) dz_t`` (GRU:
``[dz_z, dz_r, r dz_h]`` with ``reset_after``, ``2 T`` positions without), ``bias: sum_t dz_t``.

Oracle: :func:`fixtures.check_rule_against_the_loops` (one ``tf.GradientTape`` per example
through Keras' own layer, the normalized and the clipped sums and factors in float64 numpy). Inputs go up to
magnitude 1e6; padding masks come from ``Embedding(mask_zero=True)`` (left, right and fully
padded rows); a layer used twice adds its uses; an example whose two uses nearly cancel stays
within the sensitivity; the rule's forward output is the layer's.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import (UnsupportedLayerError, choose_engine, layerwise_engine,
                                   microbatch_engine, two_pass_engine)
import fixtures
import tiers
from fixtures import normalized_sum_by_loop

L = keras.layers
R = 0.1  # DP-NSGD regularizer
BATCH = 4
SEQ = 5
FEATURES = 3
VOCAB = 7

# name -> layer factory: tiny units, every option the rule reproduces.
LAYERS = {
    "simple_rnn_sequences": lambda: L.SimpleRNN(4, return_sequences=True),
    "simple_rnn_relu_backwards_no_bias": lambda: L.SimpleRNN(3, activation="relu",
                                                             go_backwards=True, use_bias=False),
    "lstm_last": lambda: L.LSTM(4),
    "lstm_sequences_backwards": lambda: L.LSTM(3, return_sequences=True, go_backwards=True),
    "lstm_state_implementation_1": lambda: L.LSTM(3, return_state=True, implementation=1),
    "lstm_unrolled": lambda: L.LSTM(3, unroll=True, return_sequences=True),
    "gru_reset_after_sequences": lambda: L.GRU(4, return_sequences=True),
    "gru_reset_before": lambda: L.GRU(3, reset_after=False, return_sequences=True),
    "gru_reset_before_no_bias_backwards": lambda: L.GRU(3, reset_after=False, use_bias=False,
                                                        go_backwards=True),
    "gru_no_bias_state": lambda: L.GRU(3, use_bias=False, return_state=True),
    "rnn_simple_cell": lambda: L.RNN(L.SimpleRNNCell(3)),
    "rnn_lstm_cell_sequences": lambda: L.RNN(L.LSTMCell(3), return_sequences=True),
    "rnn_gru_cell_zero_output": lambda: L.RNN(L.GRUCell(3, reset_after=False),
                                              return_sequences=True, zero_output_for_mask=True),
    "bidirectional_lstm": lambda: L.Bidirectional(L.LSTM(3, return_sequences=True)),
    "bidirectional_gru_sum": lambda: L.Bidirectional(L.GRU(3), merge_mode="sum"),
}


def _randomize(model, seed=0, scale=0.7):
  rng = np.random.default_rng(seed)
  model.set_weights([scale * rng.normal(size=w.shape).astype(w.dtype)
                     for w in model.get_weights()])


def _flat(h):
  if isinstance(h, (list, tuple)):  # return_state: the output and the final states
    return L.Concatenate()([L.Flatten()(t) for t in h])
  return L.Flatten()(h)


def _model(layer, masked=False, twice=False):
  """``Dense(3)`` on the flattened output of ``layer`` (on features, or on ``Embedding(...,
  mask_zero=True)`` of ids: masked steps); ``twice``: ``layer`` also on ``-2 x``."""
  if masked:
    inputs = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, FEATURES, mask_zero=True)(inputs)
  else:
    inputs = keras.Input((SEQ, FEATURES))
    h = inputs
  out = _flat(layer(h))
  if twice:
    out = L.Concatenate()([out, _flat(layer(L.Rescaling(-2.0)(h)))])
  model = keras.Model(inputs, L.Dense(3)(out))
  _randomize(model)
  return model


def _loss(y_true, y_pred):
  return 0.5 * tf.reduce_sum(tf.square(y_pred - y_true), axis=-1)


def _data(magnitude=1.0, seed=1):
  rng = np.random.default_rng(seed)
  x = tf.constant(magnitude * rng.normal(size=(BATCH, SEQ, FEATURES)), tf.float32)
  return x, tf.constant(rng.normal(size=(BATCH, 3)), tf.float32)


#: Ids with padding (0) on the right, on the left, in the middle, and a fully padded row.
PADDED_IDS = tf.constant([[1, 2, 3, 0, 0], [0, 0, 4, 5, 6], [3, 0, 2, 0, 1], [0, 0, 0, 0, 0]])


def _check(model, x, y, engine=layerwise_engine, mask=None):
  return fixtures.check_rule_against_the_loops(model, x, y, R, engine=engine, mask=mask,
                                               loss=_loss)


def _scale_input_kernels(model, factor):
  """Multiplies the cells' input kernels by ``factor``: inputs of magnitude ``1 / factor`` then
  give gate pre-activations of order 1. (Saturated gates are ill-conditioned in float32: at
  ``tanh(z) ~ 1 - 1e-5`` the derivative ``1 - tanh(z)^2`` keeps 2-3 digits, and Keras' eager
  and traced graphs already differ there by ~1%.)"""
  for v in model.trainable_variables:
    if "cell" in v.path and v.path.endswith("/kernel"):
      v.assign(v * factor)


@pytest.mark.parametrize("name,magnitude", tiers.quick_cover(sorted(LAYERS), (1.0, 1e6)))
def test_rule_matches_the_per_example_loop(name, magnitude):
  """Inputs of magnitude 1e6 (input kernels scaled by 1e-6): kernel gradients of ~1e6."""
  model = _model(LAYERS[name]())
  _scale_input_kernels(model, 1.0 / magnitude)
  engine, why = choose_engine(model)
  assert engine == "layerwise", why
  x, y = _data(magnitude)
  out = _check(model, x, y)
  # The rule's recomputed forward pass is the layer's own.
  np.testing.assert_allclose(out.y_pred, model(x, training=True), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*does not support masking")  # Flatten after the RNN
# quick tier: one LSTM and one GRU (backwards, the harder mask); the rest in CI (issue 47)
@pytest.mark.parametrize("name", tiers.quick_only(
    ["simple_rnn_sequences", "lstm_sequences_backwards", "lstm_state_implementation_1",
     "gru_reset_after_sequences", "gru_reset_before_no_bias_backwards",
     "rnn_gru_cell_zero_output", "bidirectional_lstm"],
    ["lstm_sequences_backwards", "gru_reset_before_no_bias_backwards"]))
def test_padding_masks_match_the_per_example_loop(name):
  """Masked steps (``mask_zero=True``) keep the states and repeat (or zero) the output; the
  rule reproduces the outputs and their gradients, fully padded rows included."""
  model = _model(LAYERS[name](), masked=True)
  assert choose_engine(model)[0] == "layerwise"
  y = _data()[1]
  out = _check(model, PADDED_IDS, y)
  np.testing.assert_allclose(out.y_pred, model(PADDED_IDS, training=True), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("name", tiers.quick_only(
    ["lstm_last", "gru_reset_before", "gru_reset_after_sequences", "simple_rnn_sequences"],
    ["lstm_last"]))  # quick tier: one; all in CI (issue 47)
def test_layer_used_twice_adds_its_uses(name):
  model = _model(LAYERS[name](), twice=True)
  _scale_input_kernels(model, 1e-6)
  x, y = _data(1e6)
  _check(model, x, y)


def _seq2seq():
  """An LSTM encoder's final states are a GRU-free decoder LSTM's initial states."""
  source, target = keras.Input((SEQ, FEATURES)), keras.Input((SEQ, FEATURES))
  _, h, c = L.LSTM(3, return_state=True)(source)
  decoded = L.LSTM(3, return_sequences=True)(target, initial_state=[h, c])
  model = keras.Model([source, target], L.Dense(3)(L.Flatten()(decoded)))
  _randomize(model)
  return model


def test_initial_state_from_another_layer():
  """The decoder's gradient reaches the encoder through its initial states."""
  model = _seq2seq()
  assert choose_engine(model)[0] == "layerwise"
  (x1, y), (x2, _) = _data(), _data(seed=2)
  x = [x1, x2]
  for transform in (transforms.Normalize(R), transforms.Clip(1.0)):
    out = layerwise_engine(model, _loss, x, y, transform)
    loop = microbatch_engine(model, _loss, x, y, transform)
    np.testing.assert_allclose(out.norms, loop.norms, rtol=1e-5)
    for got, expected in zip(out.summed, loop.summed):
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def _mixed():
  inputs = keras.Input((SEQ,), dtype="int32")
  h = L.Embedding(VOCAB, FEATURES, mask_zero=True)(inputs)
  h = L.Bidirectional(L.GRU(3, return_sequences=True))(h)
  h = L.LSTM(3)(h)
  model = keras.Model(inputs, L.Dense(3)(h))
  _randomize(model)
  return model


def test_masked_rows_contribute_zero():
  model = _mixed()
  y = _data()[1]
  mask = tf.constant([True, False, True, False])
  out = _check(model, PADDED_IDS, y, mask=mask)
  np.testing.assert_array_equal(out.factors.numpy()[[1, 3]], 0.0)
  kept = layerwise_engine(model, _loss, tf.gather(PADDED_IDS, [0, 2]), tf.gather(y, [0, 2]),
                          transforms.Normalize(R))
  for a, b in zip(out.summed, kept.summed):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # the other engines on RNNs: CI only (issue 47)
def test_two_passes_and_microbatches_match_the_loop():
  model = _mixed()
  y = _data()[1]
  _check(model, PADDED_IDS, y, engine=two_pass_engine)
  for transform in (transforms.Normalize(R), transforms.Clip(1.0)):
    out = layerwise_engine(model, _loss, PADDED_IDS, y, transform, num_microbatches=2)
    loop = microbatch_engine(model, _loss, PADDED_IDS, y, transform, num_microbatches=2)
    np.testing.assert_allclose(out.norms, loop.norms, rtol=1e-5)
    for got, expected in zip(out.summed, loop.summed):
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def _dynamic_length():
  """Sequences of any length (``Input((None, F))``): the rule's loop runs to the batch's."""
  inputs = keras.Input((None, FEATURES))
  h = L.LSTM(2)(L.GRU(3, return_sequences=True)(inputs))
  model = keras.Model(inputs, L.Dense(2)(h))
  _randomize(model)
  return model


@pytest.mark.slow  # make_private on RNNs (the rules stay quick): CI only (issue 47)
def test_dp_steps_through_make_private_match_the_loop():
  """``make_private`` with ``"auto"`` (the layer-wise engine, traced: the variable-use check
  runs on the graph) makes the DP-NSGD steps at noise 0 that the float64 loop oracle gives:
  on sequences of 5 steps, then of 3 (Keras retraces with the time axis unknown, so the
  rule's loop runs to a length known only when the step runs)."""
  x, _ = _data()
  y = tf.constant([0, 1, 1, 0])
  model = _dynamic_length()
  assert choose_engine(model)[0] == "layerwise"
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  private = tf_dpnsgd.make_private(model, trust_untagged_batches=True)
  private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=1.0, regularizer=R,
                                             noise_multiplier=0.0), loss=loss)
  for xs in (x, x[:, :3]):
    _, summed = normalized_sum_by_loop(
        model.trainable_variables,
        lambda i, xs=xs: loss(y[i:i + 1], model(xs[i:i + 1], training=True)), BATCH, R)
    before = [v.numpy() for v in model.trainable_variables]
    private.train_on_batch(xs, y)
    for v, b, s in zip(model.trainable_variables, before, summed):
      np.testing.assert_allclose(v.numpy() - b, -s / BATCH, rtol=1e-4, atol=1e-6,
                                 err_msg=v.path)


@pytest.mark.parametrize("make,magnitude", [
    (lambda: L.SimpleRNN(3, activation="linear", return_sequences=True), 1e6),
    pytest.param(lambda: L.GRU(3, reset_after=False), 1.0, marks=pytest.mark.slow)],
    ids=["linear_simple_rnn", "gru_reset_before"])
def test_nearly_cancelling_uses_stay_within_the_sensitivity(make, magnitude):
  """One layer on ``x`` and ``x (1 + 1e-7)`` with output gradients ``c`` and
  ``-(1 - 1e-4) c``: the per-example gradient nearly cancels (its examples are recomputed in
  float64). Each example's contribution, read off the batch with the others masked out, has
  norm at most the sensitivity and is within float32 rounding of the exact one."""
  fixtures.assert_cancelling_uses_stay_within_the_sensitivity(
      make(), (SEQ, FEATURES), BATCH, magnitude, lambda m: _randomize(m, scale=0.3))


@pytest.mark.parametrize("layer,reason", [
    (lambda: L.LSTM(3, dropout=0.1), "dropout=0.1"),
    (lambda: L.GRU(3, recurrent_dropout=0.2), "recurrent_dropout=0.2"),
    (lambda: L.Bidirectional(L.SimpleRNN(3, dropout=0.5)), "dropout=0.5"),
    (lambda: L.RNN([L.LSTMCell(3), L.GRUCell(2)]), "StackedRNNCells"),
], ids=["lstm_dropout", "gru_recurrent_dropout", "bidirectional_dropout", "stacked_cells"])
def test_unhandled_options_are_refused_with_the_reason(layer, reason):
  """``"auto"`` falls back (the microbatch engine: the vectorized one cannot run Keras'
  loop) and ``"layerwise"`` names the layer and why."""
  model = _model(layer())
  engine, why = choose_engine(model)
  assert engine == "microbatch" and reason in why, why
  x, y = _data()
  with pytest.raises(UnsupportedLayerError, match=reason):
    layerwise_engine(model, _loss, x, y, transforms.Clip(1.0))


def test_stateful_layers_are_refused():
  inputs = keras.Input(batch_shape=(BATCH, SEQ, FEATURES))
  model = keras.Model(inputs, L.Dense(2)(L.LSTM(3, stateful=True)(inputs)))
  engine, why = choose_engine(model)
  assert engine != "layerwise" and "stateful=True" in why, why
