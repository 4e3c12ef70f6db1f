"""Tests of the layer-wise engine (and the microbatch loop engine) against a per-example loop.

The oracle (:func:`oracle`) differentiates each unit's mean loss separately
with an ordinary ``tf.GradientTape`` in eager mode and does the DP
aggregation in float64 numpy: it shares no code with the engines except the
transform's factor formula.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import losses as losses_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example import (choose_engine, layerwise_engine, microbatch_engine,
                                   resolve_engine)
import fixtures
from fixtures import assert_engine_output, normalized_sum_by_loop

RTOL = 1e-5
CLIP = transforms.Clip(0.5)


def sparse_ce(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _slice(x, start, stop):
  return tf.nest.map_structure(lambda t: t[start:stop], x)


def oracle(model, x, y, transform, mask=None, num_microbatches=None, loss_fn=sparse_ce):
  """Per-unit gradients by a Python loop; returns ``(norms, factors, summed)`` in float64."""
  batch = int(tf.nest.flatten(x)[0].shape[0])
  units = num_microbatches or batch
  size = batch // units
  grads = []
  for u in range(units):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_fn(_slice(y, u * size, (u + 1) * size),
                                    model(_slice(x, u * size, (u + 1) * size), training=True)))
    g = tape.gradient(loss, model.trainable_variables,
                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
    grads.append([tf.convert_to_tensor(t).numpy().astype(np.float64) for t in g])
  with np.errstate(invalid="ignore", over="ignore"):
    norms = np.array([np.sqrt(sum(np.sum(t ** 2) for t in gu)) for gu in grads])
  factors = transform.factors(tf.constant(norms, tf.float32), mask).numpy().astype(np.float64)
  summed = [sum(factors[u] * grads[u][k] for u in range(units) if factors[u] > 0)
            + np.zeros(grads[0][k].shape) for k in range(len(grads[0]))]
  return norms, factors, summed


def assert_matches_oracle(model, x, y, transform=CLIP, engine=layerwise_engine, **kwargs):
  out = engine(model, sparse_ce, x, y, transform, **kwargs)
  norms, factors, summed = oracle(model, x, y, transform, **kwargs)
  finite = np.isfinite(norms)
  np.testing.assert_allclose(out.norms.numpy()[finite], norms[finite], rtol=RTOL)
  assert not np.any(np.isfinite(out.norms.numpy()[~finite]))
  np.testing.assert_allclose(out.factors.numpy(), factors, rtol=RTOL)
  assert len(out.summed) == len(model.trainable_variables)
  for s, o, v in zip(out.summed, summed, model.trainable_variables):
    assert s.shape == v.shape
    assert np.all(np.isfinite(s.numpy())), v.path
    np.testing.assert_allclose(s.numpy(), o, rtol=RTOL, atol=1e-6 * (1 + np.abs(o).max()),
                               err_msg=v.path)
  return out


def seq_model(layer, input_shape, head=3, dtype="float32"):
  inputs = keras.Input(input_shape, dtype=dtype)
  h = layer(inputs)
  h = keras.layers.Flatten()(h)
  return keras.Model(inputs, keras.layers.Dense(head, name="head")(h))


@pytest.fixture(autouse=True)
def _seed():
  keras.utils.set_random_seed(1)


def labels(n, k=3):
  return tf.constant(np.arange(n) % k, tf.int32)


# --- pure representations ----------------------------------------------------

def _outer_numpy(a, b):
  return np.einsum("utp,utq->upq", a, b)


@pytest.mark.parametrize("method", ["ghost", "materialize", "auto"])
def test_outer_norms_and_weighted_sum(method):
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(3, 5, 4)), rng.normal(size=(3, 5, 6))
  # Variable stored as [6, 2, 2] = (out, in0, in1): in_dims (2, 2), out_dims (6,), perm (2, 0, 1).
  rep = factored.Outer(a, b, [2, 2], [6], perm=[2, 0, 1], method=method)
  per_unit = _outer_numpy(a, b).reshape(3, 2, 2, 6).transpose(0, 3, 1, 2)
  np.testing.assert_allclose(rep.squared_norms(), (per_unit ** 2).sum((1, 2, 3)), rtol=RTOL)
  h = np.array([0.5, 0., 2.])
  np.testing.assert_allclose(rep.weighted_sum(tf.constant(h, tf.float32)),
                             np.einsum("u,uijk->ijk", h, per_unit), rtol=RTOL, atol=1e-6)
  np.testing.assert_allclose(rep.per_unit(), per_unit, rtol=RTOL, atol=1e-6)


def test_use_ghost_rule():
  assert factored.use_ghost(2, 64, 64)          # short sequence, wide layer
  assert not factored.use_ghost(1024, 144, 16)  # large image, few channels
  assert bool(factored.use_ghost(tf.constant(2), 64, 64))


def _scatter_numpy(ids, b, rows):
  out = np.zeros((ids.shape[0], rows, b.shape[-1]))
  for u in range(ids.shape[0]):
    np.add.at(out[u], ids[u], b[u])
  return out


def test_scattered_norms_with_repeated_ids():
  rng = np.random.default_rng(1)
  ids = np.array([[1, 1, 3, 1], [0, 2, 2, 4]])
  b = rng.normal(size=(2, 4, 3))
  dense = _scatter_numpy(ids, b, 5)  # row 1 of unit 0 gets three rows summed
  rep = factored.Scattered(ids, b, 5)
  np.testing.assert_allclose(rep.squared_norms(), (dense ** 2).sum((1, 2)), rtol=RTOL)
  np.testing.assert_allclose(rep.per_unit(), dense, rtol=RTOL)
  h = np.array([2., 0.5])
  np.testing.assert_allclose(rep.weighted_sum(tf.constant(h, tf.float32)),
                             np.einsum("u,uij->ij", h, dense), rtol=RTOL)


def test_sum_of_lookup_and_transposed_projection_is_exact():
  """Tied embedding: lookup gradient + (x^T dlogits)^T, including the cross term."""
  rng = np.random.default_rng(2)
  ids, b_lookup = np.array([[0, 3, 3], [1, 2, 0]]), rng.normal(size=(2, 3, 4))
  a, b_logits = rng.normal(size=(2, 2, 4)), rng.normal(size=(2, 2, 5))
  lookup = factored.Scattered(ids, b_lookup, 5)
  projection = factored.Outer(a, b_logits, [4], [5], perm=[1, 0])
  dense = _scatter_numpy(ids, b_lookup, 5) + _outer_numpy(a, b_logits).transpose(0, 2, 1)
  rep = factored.combine([lookup, projection])
  assert isinstance(rep, factored.Sum)
  np.testing.assert_allclose(rep.squared_norms(), (dense ** 2).sum((1, 2)), rtol=RTOL)
  h = np.array([1., 3.])
  np.testing.assert_allclose(rep.weighted_sum(tf.constant(h, tf.float32)),
                             np.einsum("u,uij->ij", h, dense), rtol=RTOL, atol=1e-6)


def test_weighted_sums_drop_nonfinite_units_exactly():
  nan, inf = float("nan"), float("inf")
  a = np.ones((3, 2, 2))
  a[1, 0, 0] = nan
  b = np.ones((3, 2, 2))
  b[1, 1, 1] = inf
  h = tf.constant([1., 0., 2.])
  reps = [factored.Outer(a, b, [2], [2], method="ghost"),
          factored.Outer(a, b, [2], [2], method="materialize"),
          factored.Materialized(b),
          factored.Scattered(np.zeros((3, 2), np.int32), b, 3)]
  for rep in reps:
    rep.squared_norms()  # may cache materialised gradients
    out = rep.weighted_sum(h).numpy()
    assert np.all(np.isfinite(out)), type(rep).__name__
  np.testing.assert_allclose(reps[2].weighted_sum(h), 3 * np.ones((2, 2)))  # 1*ones + 2*ones


# --- every registered layer against the per-example loop ---------------------

def _float(shape):
  return tf.random.normal(shape)


LAYER_CASES = {
    "dense_2d": (lambda: keras.layers.Dense(4, activation="tanh"), (5,)),
    "dense_seq_ghost": (lambda: keras.layers.Dense(16, activation="relu"), (2, 16)),
    "dense_seq_materialize": (lambda: keras.layers.Dense(2, use_bias=False), (8, 2)),
    "einsum_abc_cd": (lambda: keras.layers.EinsumDense("abc,cd->abd", (3, 4), bias_axes="d"),
                      (3, 5)),
    "einsum_heads": (lambda: keras.layers.EinsumDense("abc,cde->abde", (3, 2, 2),
                                                      bias_axes="de", activation="gelu"), (3, 4)),
    "einsum_partial_bias": (lambda: keras.layers.EinsumDense("abc,cde->abde", (3, 2, 2),
                                                             bias_axes="d"), (3, 4)),
    "einsum_two_contracted": (lambda: keras.layers.EinsumDense("abcd,cde->abe", (3, 4),
                                                               bias_axes="e"), (3, 2, 2)),
    "einsum_ellipsis": (lambda: keras.layers.EinsumDense("...b,bc->...c", 4, bias_axes="c"),
                        (2, 3)),
    "einsum_per_position_kernel": (lambda: keras.layers.EinsumDense("abc,bc->abc", (3, 4)),
                                   (3, 4)),
    "conv2d_same": (lambda: keras.layers.Conv2D(3, 3, padding="same", activation="relu"),
                    (6, 6, 2)),
    "conv2d_stride_valid": (lambda: keras.layers.Conv2D(3, 3, strides=2), (7, 7, 2)),
    "conv2d_dilated": (lambda: keras.layers.Conv2D(2, 3, dilation_rate=2, padding="same"),
                       (7, 6, 2)),
    "conv2d_even_kernel_same": (lambda: keras.layers.Conv2D(2, (2, 3), strides=(2, 1),
                                                            padding="same"), (5, 5, 2)),
    "conv2d_1x1_stride": (lambda: keras.layers.Conv2D(3, 1, strides=2, use_bias=False),
                          (6, 6, 2)),
    "conv2d_wide_small_spatial": (lambda: keras.layers.Conv2D(32, 3, padding="same"),
                                  (2, 2, 16)),  # ghost norm
    "conv2d_backprop_filter_sum": (lambda: keras.layers.Conv2D(8, 3, padding="same"),
                                   (3, 3, 8)),  # materialised norm, sum from (x, h dz)
    "conv1d_causal_dilated": (lambda: keras.layers.Conv1D(3, 3, padding="causal",
                                                          dilation_rate=2), (7, 2)),
    "conv1d_same_stride": (lambda: keras.layers.Conv1D(3, 2, strides=2, padding="same"), (7, 2)),
    "layer_norm": (lambda: keras.layers.LayerNormalization(), (3, 4)),
    "layer_norm_two_axes": (lambda: keras.layers.LayerNormalization(axis=[1, 2]), (3, 4)),
    "layer_norm_no_center": (lambda: keras.layers.LayerNormalization(center=False), (3, 4)),
    "layer_norm_no_scale": (lambda: keras.layers.LayerNormalization(scale=False), (3, 4)),
    "group_norm": (lambda: keras.layers.GroupNormalization(groups=2), (3, 3, 4)),
    "group_norm_1d_no_center": (lambda: keras.layers.GroupNormalization(groups=2, center=False),
                                (5, 4)),
}


@pytest.mark.parametrize("name", sorted(LAYER_CASES))
def test_layer_matches_per_example_loop(name):
  make_layer, shape = LAYER_CASES[name]
  model = seq_model(make_layer(), shape)
  x = _float((4,) + shape)
  out = assert_matches_oracle(model, x, labels(4))
  # The rule's recomputed forward pass equals the layer's own.
  np.testing.assert_allclose(out.y_pred, model(x, training=True), rtol=1e-6, atol=1e-6)


def test_conv_norm_methods_and_kept_tensors():
  from tf_dpnsgd.per_example.layers import conv
  cases = {(6, 6, 2, 3): (False, True), (2, 2, 16, 32): (True, False), (3, 3, 8, 8): (False, False)}
  for (h, w, c, d), (ghost, keep) in cases.items():
    rep = conv.ConvOuter(tf.zeros([1, h, w, c]), tf.zeros([1, h, w, d]), (3, 3), (1, 1), (1, 1),
                         "same")
    assert (rep.ghost, rep.keep_materialized) == (ghost, keep), (h, w, c, d)


@pytest.mark.parametrize("shape", [(5, 5, 3, 4), (3, 3, 16, 16), (2, 2, 16, 32)])
def test_conv_used_three_times_is_one_representation(shape):
  """Three calls of one kernel (e.g. three views of an example) merge into one ConvOuter
  whose positions are the uses' concatenated; its per-example gradients, squared norms and
  weighted sum against float64 tapes of ``sum_uses <conv(x_u[i], K), g_u[i]>`` per example."""
  from tf_dpnsgd.per_example.layers import conv
  h, w, c, d = shape
  rng = np.random.default_rng(11)
  xs = [rng.normal(size=(4, h, w, c)) for _ in range(3)]
  gs = [rng.normal(size=(4, h, w, d)) for _ in range(3)]
  reps = [conv.ConvOuter(tf.constant(x, tf.float32), tf.constant(g, tf.float32), (3, 3),
                         (1, 1), (1, 1), "same") for x, g in zip(xs, gs)]
  rep = factored.combine(reps)
  assert isinstance(rep, conv.ConvOuter) and len(rep.uses) == 3
  assert rep.positions == 3 * h * w
  # Materialised and kept (p q <= inputs + output gradients), materialised and summed by
  # backprop-filter, ghost norm.
  assert (rep.ghost, rep.keep_materialized) == {(5, 5, 3, 4): (False, True),
                                                (3, 3, 16, 16): (False, False),
                                                (2, 2, 16, 32): (True, False)}[shape]
  kernel = tf.Variable(tf.zeros([3, 3, c, d], tf.float64))
  oracle = []
  for i in range(4):
    with tf.GradientTape() as tape:
      total = tf.add_n([tf.reduce_sum(tf.nn.conv2d(tf.constant(x[i:i + 1]), kernel, 1, "SAME")
                                      * g[i:i + 1]) for x, g in zip(xs, gs)])
    oracle.append(tape.gradient(total, kernel).numpy())
  oracle = np.stack(oracle)
  factors = tf.constant([0.5, 0.0, 2.0, 1.0])
  np.testing.assert_allclose(rep.squared_norms().numpy(), np.sum(oracle**2, axis=(1, 2, 3, 4)),
                             rtol=1e-5)
  np.testing.assert_allclose(rep.weighted_sum(factors).numpy(),
                             np.tensordot(factors.numpy(), oracle, axes=1), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(rep.per_unit().numpy(), oracle, rtol=1e-4, atol=1e-4)
  other = conv.ConvOuter(tf.zeros([4, h, w, c]), tf.zeros([4, h, w, d]), (1, 1), (1, 1),
                         (1, 1), "same")
  assert not rep.mergeable(other)  # another kernel shape: a Sum, never merged


@pytest.mark.parametrize("name", ["conv2d_same", "conv2d_stride_valid", "conv2d_wide_small_spatial",
                                  "conv2d_backprop_filter_sum", "conv1d_causal_dilated"])
def test_conv_in_batch_chunks_matches_loop(name, monkeypatch):
  from tf_dpnsgd.per_example.layers import conv
  monkeypatch.setattr(conv, "CHUNK_BYTES", 1)  # one example per chunk
  make_layer, shape = LAYER_CASES[name]
  model = seq_model(make_layer(), shape)
  assert_matches_oracle(model, _float((3,) + shape), labels(3))


def test_layer_norm_rms_scaling_matches_loop():
  with pytest.warns(UserWarning):
    layer = keras.layers.LayerNormalization(rms_scaling=True)
  model = seq_model(layer, (3, 4))
  assert_matches_oracle(model, _float((4, 3, 4)), labels(4))


def test_ghost_and_materialized_paths_both_run():
  """The two Dense sequence cases above hit different norm methods."""
  for shape, units, ghost in (((2, 16), 16, True), ((8, 2), 2, False)):
    rep = factored.Outer(tf.zeros((1,) + shape), tf.zeros((1, shape[0], units)),
                         [shape[1]], [units])
    assert rep._ghost() is ghost


def _token_model(embedding_layers, seq=6, vocab=7):
  tokens = keras.Input((seq,), dtype="int32")
  h = embedding_layers(tokens)
  h = keras.layers.GlobalAveragePooling1D()(h)
  return keras.Model(tokens, keras.layers.Dense(3)(h)), vocab


def _tokens(batch, seq, vocab):
  return tf.constant(np.random.default_rng(3).integers(0, vocab, (batch, seq)), tf.int32)


def test_embedding_with_repeated_ids():
  model, vocab = _token_model(keras.layers.Embedding(7, 4))
  x = tf.constant([[1, 1, 1, 2, 0, 1], [3, 4, 5, 6, 0, 0], [2, 2, 2, 2, 2, 2], [0, 1, 2, 3, 4, 5]])
  assert_matches_oracle(model, x, labels(4))


def test_reversible_embedding_untied_reverse():
  emb = keras.layers.ReversibleEmbedding(7, 4, tie_weights=False)
  tokens = keras.Input((5,), dtype="int32")
  logits = emb(emb(tokens), reverse=True)  # [B, 5, 7]
  h = keras.layers.GlobalAveragePooling1D()(logits)
  model = keras.Model(tokens, keras.layers.Dense(3)(h))
  assert_matches_oracle(model, _tokens(4, 5, 7), labels(4))


def test_reversible_embedding_tied_weights_with_soft_cap():
  """Lookup and output projection share the table: norms include the cross term."""
  emb = keras.layers.ReversibleEmbedding(7, 4, tie_weights=True, logit_soft_cap=5.0)
  tokens = keras.Input((5,), dtype="int32")
  h = keras.layers.Dense(4, activation="tanh")(emb(tokens))
  logits = emb(h, reverse=True)  # [B, 5, 7]
  model = keras.Model(tokens, keras.layers.GlobalAveragePooling1D()(logits))
  x = tf.constant([[1, 1, 2, 6, 0], [3, 4, 5, 6, 0], [2, 2, 2, 2, 2], [0, 1, 2, 3, 4]])
  assert_matches_oracle(model, x, tf.constant([1, 3, 6, 0]))


def test_keras_hub_token_and_position_embedding():
  keras_hub = pytest.importorskip("keras_hub")
  model, vocab = _token_model(keras_hub.layers.TokenAndPositionEmbedding(7, 8, 4), seq=6)
  assert_matches_oracle(model, _tokens(4, 6, vocab), labels(4))


def test_keras_hub_position_embedding_with_start_index():
  keras_hub = pytest.importorskip("keras_hub")
  pos = keras_hub.layers.PositionEmbedding(sequence_length=9)
  inputs = keras.Input((4, 3))
  h = inputs + pos(inputs, start_index=2)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  assert_matches_oracle(model, _float((4, 4, 3)), labels(4))


def test_keras_hub_position_embedding_with_explicit_positions():
  keras_hub = pytest.importorskip("keras_hub")
  pos = keras_hub.layers.PositionEmbedding(sequence_length=9)
  inputs, ids = keras.Input((4, 3)), keras.Input((4,), dtype="int32")
  h = inputs + pos(inputs, positions=ids)
  model = keras.Model([inputs, ids], keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  positions = tf.constant([[0, 1, 1, 8], [2, 3, 4, 5], [7, 7, 7, 7]])  # repeats allowed
  assert_matches_oracle(model, [_float((3, 4, 3)), positions], labels(3))


def test_multi_head_attention():
  inputs = keras.Input((4, 6))
  h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  assert_matches_oracle(model, _float((3, 4, 6)), labels(3))


# --- shared layers, microbatches, masks, non-finite gradients ------------------

def test_layers_called_twice_sum_their_contributions():
  inputs = keras.Input((6, 6, 2))
  conv = keras.layers.Conv2D(2, 3, padding="same")
  dense = keras.layers.Dense(3)
  h = conv(conv(inputs))  # the same kernel at two depths
  h = keras.layers.Flatten()(h)
  model = keras.Model(inputs, keras.layers.Add()([dense(h), dense(2.0 * h)]))
  assert_matches_oracle(model, _float((4, 6, 6, 2)), labels(4))


def test_microbatches_match_loop_over_microbatches():
  inputs = keras.Input((3, 4))
  h = keras.layers.LayerNormalization()(keras.layers.Dense(5, activation="relu")(inputs))
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  x, y = _float((6, 3, 4)), labels(6)
  assert_matches_oracle(model, x, y, num_microbatches=3)
  assert_matches_oracle(model, x, y, num_microbatches=3, engine=microbatch_engine)


def test_microbatch_errors():
  model = seq_model(keras.layers.Dense(2), (3,))
  x, y = _float((6, 3)), labels(6)
  with pytest.raises(ValueError, match="mask"):
    layerwise_engine(model, sparse_ce, x, y, CLIP, mask=tf.ones([6], tf.bool), num_microbatches=2)
  with pytest.raises(ValueError, match="must divide"):  # static batch: while tracing
    layerwise_engine(model, sparse_ce, x, y, CLIP, num_microbatches=4)


def test_padding_mask_contributes_zero():
  model = seq_model(keras.layers.Conv1D(2, 2), (4, 3))
  x, y = _float((4, 4, 3)), labels(4)
  mask = tf.constant([True, False, True, False])
  out = assert_matches_oracle(model, x, y, mask=mask)
  np.testing.assert_array_equal(out.factors.numpy()[[1, 3]], 0.0)
  unmasked = layerwise_engine(model, sparse_ce, x[::2], _slice(y, 0, 4)[::2], CLIP)
  for a, b in zip(out.summed, unmasked.summed):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7)


def test_nan_input_example_contributes_exactly_zero():
  inputs = keras.Input((4, 3))
  h = keras.layers.Dense(4)(inputs)
  h = keras.layers.GroupNormalization(groups=2)(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  x = _float((4, 4, 3)).numpy()
  x[2, 1, 0] = np.nan
  x = tf.constant(x)
  for engine in (layerwise_engine, microbatch_engine):
    out = assert_matches_oracle(model, x, labels(4), engine=engine)
    assert out.factors.numpy()[2] == 0.0 and not np.isfinite(out.norms.numpy()[2])
    clean = layerwise_engine(model, sparse_ce, tf.gather(x, [0, 1, 3]),
                             tf.gather(labels(4), [0, 1, 3]), CLIP)
    for a, b in zip(out.summed, clean.summed):
      np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7)


def test_finite_loss_with_infinite_gradient_contributes_exactly_zero():
  """sqrt'(0) = inf: example 1's loss is finite but its gradient is not."""
  inputs = keras.Input((3,))
  h = keras.layers.Dense(4, bias_initializer="zeros")(inputs)
  h = keras.layers.Lambda(lambda t: tf.sqrt(tf.abs(t)))(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(h))
  x = _float((4, 3)).numpy()
  x[1] = 0.0
  x = tf.constant(x)
  assert np.all(np.isfinite(sparse_ce(labels(4), model(x)).numpy()))
  out = assert_matches_oracle(model, x, labels(4))
  assert out.factors.numpy()[1] == 0.0


# --- coverage, engine choice, failure modes ----------------------------------

def _lstm_model():
  """An LSTM without a layer-wise rule: its dropout masks are drawn inside Keras' cell."""
  inputs = keras.Input((3, 2))
  h = keras.layers.LSTM(3, dropout=0.5, name="my_lstm")(inputs)
  return keras.Model(inputs, keras.layers.Dense(2)(h))


def test_uncovered_layer_makes_layerwise_raise_and_auto_fall_back(caplog):
  model = _lstm_model()
  with pytest.raises(registry_lib.UnsupportedLayerError, match="my_lstm"):
    layerwise_engine(model, sparse_ce, _float((2, 3, 2)), labels(2, 2), CLIP)
  with pytest.raises(registry_lib.UnsupportedLayerError, match="my_lstm"):
    resolve_engine(model, "layerwise")
  # Not the vectorized engine: pfor cannot convert the LSTM's tf.while_loop (issue 49).
  assert choose_engine(model)[0] == "microbatch"
  with caplog.at_level(logging.INFO, logger="tf_dpnsgd.per_example"):
    engine = resolve_engine(model, "auto")
  assert engine is tf_dpnsgd.per_example.microbatch_engine
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "my_lstm" in warnings[0].getMessage()


def test_auto_picks_layerwise_for_covered_model(caplog):
  model = seq_model(keras.layers.Dense(2), (3,))
  with caplog.at_level(logging.INFO, logger="tf_dpnsgd.per_example"):
    engine = resolve_engine(model, "auto").dense_engine
  assert engine.func is layerwise_engine and engine.keywords == {"mode": "auto"}
  assert any("layer-wise" in r.getMessage() for r in caplog.records)


def test_lora_layer_is_covered():  # the LoRA rules are tested in tests/test_lora.py
  dense = keras.layers.Dense(3, name="lora_dense")
  model = seq_model(dense, (4,))
  dense.enable_lora(2)
  assert choose_engine(model)[0] == "layerwise"


def test_user_registered_rule():
  """A custom layer (y = x * w) becomes covered once a rule is registered."""

  class Scale(keras.layers.Layer):
    def build(self, input_shape):
      self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs):
      return inputs * self.w

  def capture(layer, call, args, kwargs, probe):
    x = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
    y = probe(x * layer.w)
    return y, lambda grads: [(layer.w, factored.Materialized(
        tf.reduce_sum(tf.reshape(grads[0] * x, [tf.shape(x)[0], -1, x.shape[-1]]), 1)))]

  model = seq_model(Scale(), (3, 4))
  registry = registry_lib.DEFAULT_REGISTRY.copy()
  assert not registry_lib.coverage(model, registry).complete
  registry.register(Scale, registry_lib.LayerRule(variables=lambda l: [l.w], capture=capture))
  assert registry_lib.coverage(model, registry).complete
  x, y = _float((4, 3, 4)), labels(4)
  out = layerwise_engine(model, sparse_ce, x, y, CLIP, registry=registry)
  norms, _, summed = oracle(model, x, y, CLIP)
  np.testing.assert_allclose(out.norms, norms, rtol=RTOL)
  for s, o in zip(out.summed, summed):
    np.testing.assert_allclose(s, o, rtol=RTOL, atol=1e-6)
  with pytest.raises(ValueError, match="already registered"):
    registry.register(Scale, registry_lib.LayerRule(variables=lambda l: [l.w], capture=capture))


def test_time_distributed_with_static_time_matches_loop():
  """Keras 3's TimeDistributed calls the inner layer once per time step: a shared layer."""
  inputs = keras.Input((3, 4))
  h = keras.layers.TimeDistributed(keras.layers.Dense(2, activation="relu"))(inputs)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  assert_matches_oracle(model, _float((4, 3, 4)), labels(4))


class _FoldTimeIntoBatch(keras.layers.Layer):
  """Calls a Dense sublayer on [B * T, d]: rows are no longer examples."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(2)

  def call(self, x):
    folded = self.dense(tf.reshape(x, [-1, x.shape[-1]]))
    return tf.reshape(folded, [-1, x.shape[1], 2])


def test_layer_called_without_batch_axis_is_rejected():
  model = seq_model(_FoldTimeIntoBatch(), (3, 4))
  with pytest.raises(registry_lib.UnsupportedLayerError, match="not the batch"):
    layerwise_engine(model, sparse_ce, _float((2, 3, 4)), labels(2), CLIP)

  @tf.function(input_signature=[tf.TensorSpec([None, 3, 4])])
  def dynamic_batch(x):
    return layerwise_engine(model, sparse_ce, x, tf.zeros([tf.shape(x)[0]], tf.int32),
                            CLIP).norms

  with pytest.raises(tf.errors.InvalidArgumentError, match="not the batch"):
    dynamic_batch(_float((2, 3, 4)))


def test_call_routing_is_removed_after_engine_and_on_error():
  dense = keras.layers.Dense(3)
  model = seq_model(dense, (4,))
  layerwise_engine(model, sparse_ce, _float((2, 4)), labels(2), CLIP)
  assert "call" not in dense.__dict__
  with pytest.raises(Exception):
    layerwise_engine(model, sparse_ce, _float((2, 5)), labels(2), CLIP)  # wrong input width
  assert "call" not in dense.__dict__ and "call" not in model.get_layer("head").__dict__


class _ReusesKernel(keras.layers.Layer):
  """Uses its Dense sublayer's kernel a second time outside the Dense's call (hand-made tying)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(4, use_bias=False)

  def call(self, x):
    h = self.dense(x)
    return h + keras.ops.matmul(x, self.dense.kernel)


def test_variable_used_outside_its_layer_is_rejected_in_graph_mode():
  model = seq_model(_ReusesKernel(), (4,))
  graph_engine = tf.function(lambda x, y: layerwise_engine(model, sparse_ce, x, y, CLIP).norms,
                             autograph=False)
  with pytest.raises(registry_lib.UnsupportedLayerError, match="outside the call"):
    graph_engine(_float((2, 4)), labels(2))
  # A model whose variables are only used in their own layers passes the check.
  ok = seq_model(keras.layers.Dense(3), (4,))
  tf.function(lambda x, y: layerwise_engine(ok, sparse_ce, x, y, CLIP).norms)(
      _float((2, 4)), labels(2))


def test_capture_routes_only_the_calling_threads_calls():
  """Replica threads of a tf.distribute strategy share layers; each sees only its capture."""
  import threading

  dense = keras.layers.Dense(3)
  model = seq_model(dense, (4,))
  plans = registry_lib.coverage(model).plans
  x = _float((2, 4))
  with tf.GradientTape() as tape:
    with layerwise.CallCapture(plans, tape) as capture:
      other = threading.Thread(target=lambda: model(x))
      other.start()
      other.join()
      assert capture.calls == []  # the other thread ran the layers' own call
      with tf.GradientTape() as inner_tape:
        with layerwise.CallCapture(plans, inner_tape) as inner:
          model(x)
      assert len(inner.calls) == 2 and capture.calls == []  # innermost capture wins
      model(x)
      assert len(capture.calls) == 2
  assert "call" not in dense.__dict__ and not layerwise._ROUTES


# --- models ------------------------------------------------------------------

def test_resnet20_gn_matches_loop():
  model = tf_dpnsgd.models.resnet20(input_shape=(8, 8, 3), num_classes=3)
  assert choose_engine(model)[0] == "layerwise"
  assert_matches_oracle(model, _float((3, 8, 8, 3)), labels(3), transform=transforms.Normalize(0.1))


@pytest.mark.slow
def test_resnet20_gn_matches_vectorized_engine():
  model = tf_dpnsgd.models.resnet20(input_shape=(8, 8, 3), num_classes=3, depth=8)
  x, y = _float((3, 8, 8, 3)), labels(3)
  a = layerwise_engine(model, sparse_ce, x, y, CLIP)
  b = tf_dpnsgd.per_example.vectorized_engine(model, sparse_ce, x, y, CLIP)
  np.testing.assert_allclose(a.norms, b.norms, rtol=RTOL)
  for s, t in zip(a.summed, b.summed):
    np.testing.assert_allclose(s, t, rtol=RTOL, atol=1e-6)


def _tiny_bert(num_classes=2, vocab=40):
  keras_hub = pytest.importorskip("keras_hub")
  backbone = keras_hub.models.BertBackbone(vocabulary_size=vocab, num_layers=2, num_heads=2,
                                           hidden_dim=8, intermediate_dim=16,
                                           max_sequence_length=12, dropout=0.0)
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=num_classes,
                                             preprocessor=None, dropout=0.0)


def _bert_inputs(batch, seq, vocab=40):
  rng = np.random.default_rng(4)
  mask = np.ones((batch, seq), "int32")
  mask[:, seq - 2:] = 0
  return {"token_ids": tf.constant(rng.integers(0, vocab, (batch, seq)), tf.int32),
          "segment_ids": tf.constant(rng.integers(0, 2, (batch, seq)), tf.int32),
          "padding_mask": tf.constant(mask)}


def test_keras_hub_bert_classifier_matches_loop():
  model = _tiny_bert()
  assert choose_engine(model)[0] == "layerwise"
  assert_matches_oracle(model, _bert_inputs(3, 7), labels(3, 2),
                        transform=transforms.Normalize(0.01))


def test_small_transformer_matches_loop():
  keras_hub = pytest.importorskip("keras_hub")
  tokens = keras.Input((6,), dtype="int32")
  h = keras_hub.layers.TokenAndPositionEmbedding(20, 6, 8)(tokens)
  for _ in range(2):
    h = keras_hub.layers.TransformerEncoder(intermediate_dim=16, num_heads=2)(h)
  h = keras.layers.GlobalAveragePooling1D()(h)
  model = keras.Model(tokens, keras.layers.Dense(3)(h))
  assert choose_engine(model)[0] == "layerwise"
  assert_matches_oracle(model, _tokens(3, 6, 20), labels(3))


# --- through DPModel / make_private ------------------------------------------

def _one_step_weights(make_model, per_example, optimizer_fn, x, y):
  keras.utils.set_random_seed(7)
  model = tf_dpnsgd.make_private(make_model(), per_example=per_example,
                                 trust_untagged_batches=True)  # one hand-made batch
  model.compile(optimizer=optimizer_fn(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.train_on_batch(x, y)
  return [v.numpy() for v in model.trainable_variables]


@pytest.mark.slow
def test_dp_update_equals_microbatch_engine_update():
  def make():
    inputs = keras.Input((5, 5, 2))
    h = keras.layers.Conv2D(3, 3, padding="same")(inputs)
    h = keras.layers.GroupNormalization(groups=3)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))

  x, y = _float((6, 5, 5, 2)), labels(6)
  for opt in (lambda: tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=0.1, noise_multiplier=0.0),
              lambda: tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=0.01, noise_multiplier=0.0,
                                       num_microbatches=3)):
    fast = _one_step_weights(make, "layerwise", opt, x, y)
    slow = _one_step_weights(make, "microbatch", opt, x, y)
    before = _one_step_weights(make, "layerwise",
                               lambda: tf_dpnsgd.DPSGD(learning_rate=0.0, l2_norm_clip=1.0,
                                                       noise_multiplier=0.0), x, y)
    assert any(not np.allclose(f, b) for f, b in zip(fast, before))  # the step did something
    for f, s in zip(fast, slow):
      np.testing.assert_allclose(f, s, rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_physical_batch_chunks_give_the_same_update():
  def make():
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(11, 4)(tokens)
    h = keras.layers.Conv1D(3, 2, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h))

  x, y = _tokens(8, 5, 11), labels(8, 2)
  weights = [fixtures.one_noiseless_step(make, x, y, per_example="layerwise",
                                         physical_batch_size=physical)
             for physical in (None, 3)]
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_dpmodel_rejects_layerwise_for_uncovered_model_at_compile():
  model = tf_dpnsgd.make_private(_lstm_model(), per_example="layerwise")
  with pytest.raises(registry_lib.UnsupportedLayerError, match="my_lstm"):
    model.compile(optimizer=tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="sparse_categorical_crossentropy")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["dpnsgd", "dpsgd"])
def test_keras_hub_bert_fits_at_batch_64(optimizer):
  classifier = _tiny_bert()
  model = tf_dpnsgd.make_private(classifier, per_example="layerwise")
  opt = (tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01, noise_multiplier=1.0, seed=1)
         if optimizer == "dpnsgd" else
         tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=1))
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x = _bert_inputs(128, 10)
  y = labels(128, 2)
  before = [v.numpy().copy() for v in classifier.trainable_variables]
  history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
  assert np.isfinite(history.history["loss"][-1])
  assert history.history["nonfinite_examples"][-1] == 0
  changed = [not np.array_equal(b, v.numpy())
             for b, v in zip(before, classifier.trainable_variables)]
  assert all(changed)  # noise reaches every variable; the classifier's weights are trained


@pytest.mark.parametrize("keep_mib", [0, None, 1e-4])
def test_keep_budget_changes_what_is_kept_never_the_result(keep_mib, monkeypatch):
  """``keep_per_example_mib`` (0: keep nothing; None: the default budget; a budget smaller
  than the gradient) decides which per-unit gradients the engine keeps between its passes;
  the norms and the weighted sum must equal the per-example loop's every time."""
  model = seq_model(keras.layers.Dense(6), (7, 5))
  rng = np.random.default_rng(3)
  x = tf.constant(rng.normal(size=(4, 7, 5)).astype("float32"))
  y = tf.constant(rng.integers(0, 3, 4).astype("int32"))
  granted = []
  plan_keeping = factored.plan_keeping

  def spy(reps, budget):
    used = plan_keeping(reps, budget)
    granted.append((budget, [r.keep for r in reps  # the candidates: sequence inputs (T > 1)
                             if isinstance(r, factored.Outer) and r.keep_bytes() is not None]))
    return used

  monkeypatch.setattr(factored, "plan_keeping", spy)
  engine = resolve_engine(model, "layerwise", keep_mib=keep_mib)
  assert_matches_oracle(model, x, y, transform=transforms.Normalize(0.1), engine=engine)
  (budget, kept), = granted
  held = 4 * (4 * 7 * 6 + 4 * 3)  # book-keeping holds both layers' output gradients first
  total = factored.KEEP_BYTES if keep_mib is None else int(keep_mib * 2 ** 20)
  assert budget == max(0, total - held)
  if keep_mib == 0:
    assert kept and not any(kept)
  elif keep_mib is None:
    assert kept and all(kept)
  else:  # 104 bytes: one [4, 6, 5] gradient of 480 bytes does not fit
    assert kept and not any(kept)


def test_keep_budget_is_validated_and_kept_in_the_config():
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
  for bad in (-1, float("inf"), float("nan"), "1", True):
    with pytest.raises(ValueError, match="keep_per_example_mib"):
      tf_dpnsgd.make_private(model, keep_per_example_mib=bad)
  private = tf_dpnsgd.make_private(model, keep_per_example_mib=64)
  assert private.get_config()["keep_per_example_mib"] == 64
  again = tf_dpnsgd.DPModel.from_config(private.get_config())
  assert again.get_config()["keep_per_example_mib"] == 64
