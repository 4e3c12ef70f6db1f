"""Coverage holes of the per-example engines (issue 12), each against a per-example loop.

* grouped convolutions (``groups > 1``) in the layer-wise engine;
* ``EinsumDense`` biases on any axes in the vectorized engine (pfor's NCHW
  ``BiasAddGrad`` converter) and the layer-wise engine;
* oneDNN's broken broadcasting batch matmul under ``tf.vectorized_map``: the
  vectorized engine refuses (before anything runs), ``"auto"`` avoids it, and
  with oneDNN off the vectorized engine is exact (in a child process);
* ragged (bag-of-words) ids: the microbatch engine handles them, the others
  refuse with a message; padded ids with ``mask_zero=True`` work everywhere;
* recurrent layers (issue 49): pfor cannot convert the gradient of their
  ``tf.while_loop``; ``"auto"`` runs them on the layer-wise engine where they
  have a rule (``tests/test_layerwise_rnn.py``), else on the microbatch
  engine; the vectorized engine refuses them (at ``compile``; any other graph pfor cannot
  convert while tracing), an unrolled RNN vectorizes;
* a trainable Keras variable the loss does not use (keras-hub Llama's untied
  output embedding): a zero gradient in every engine, not TensorFlow's
  ``'str' object has no attribute '_type_enum'``.

The oracle (:func:`oracle`) differentiates each example's loss alone with an
ordinary ``tf.GradientTape`` in eager mode and aggregates in float64 numpy.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import EngineOutput
from tf_dpnsgd.per_example import base as base_lib
from tf_dpnsgd.per_example import (choose_engine, layerwise_engine, microbatch_engine,
                                   resolve_engine, vectorized, vectorized_engine)
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import conv as conv_rules
import tiers
import zygote  # children forked from a pre-imported process (tests/zygote.py)

RTOL = 1e-5
CLIP = transforms.Clip(0.5)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sparse_ce(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def oracle(model, x, y, transform):
  """``(norms, summed)`` from a loop of single-example gradients, float64."""
  grads = []
  for i in range(int(y.shape[0])):
    x_i = tf.nest.map_structure(lambda t: t[i:i + 1], x)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(sparse_ce(y[i:i + 1], model(x_i, training=True)))
    g = tape.gradient(loss, model.trainable_variables)  # None for an unused variable
    grads.append([np.zeros(v.shape) if t is None else
                  tf.convert_to_tensor(t).numpy().astype(np.float64)
                  for t, v in zip(g, model.trainable_variables)])
  norms = np.array([np.sqrt(sum(np.sum(t ** 2) for t in g)) for g in grads])
  factors = transform.factors(tf.constant(norms, tf.float32)).numpy().astype(np.float64)
  summed = [sum(f * g[k] for f, g in zip(factors, grads)) for k in range(len(grads[0]))]
  return norms, summed


def assert_matches_oracle(model, x, y, engine, transform=CLIP):
  out = engine(model, sparse_ce, x, y, transform)
  norms, summed = oracle(model, x, y, transform)
  np.testing.assert_allclose(out.norms.numpy(), norms, rtol=RTOL)
  assert len(out.summed) == len(model.trainable_variables)
  for s, o, v in zip(out.summed, summed, model.trainable_variables):
    assert tuple(s.shape) == tuple(v.shape), v.path
    np.testing.assert_allclose(s.numpy(), o, rtol=RTOL, atol=1e-6 * (1 + np.abs(o).max()),
                               err_msg=v.path)
  return out


def head_model(layer, input_shape, dtype="float32"):
  inputs = keras.Input(input_shape, dtype=dtype)
  h = keras.layers.Flatten()(layer(inputs))
  return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def floats(shape, seed=0, scale=1.0):
  return tf.constant(scale * np.random.default_rng(seed).normal(size=shape), tf.float32)


def labels(n):
  return tf.constant(np.arange(n) % 3, tf.int32)


# --- 1. grouped convolutions -------------------------------------------------------

GROUPED = {
    "2d_g2_bias": (lambda: keras.layers.Conv2D(4, 3, groups=2), (6, 6, 4)),
    "2d_g4_nobias_same": (lambda: keras.layers.Conv2D(8, 3, groups=4, padding="same",
                                                      use_bias=False), (5, 5, 4)),
    "2d_g2_stride_dilation": (lambda: keras.layers.Conv2D(6, 3, strides=2, dilation_rate=1,
                                                          groups=2, padding="same"), (7, 7, 4)),
    "2d_g2_dilated_relu": (lambda: keras.layers.Conv2D(4, 2, dilation_rate=2, groups=2,
                                                       activation="relu"), (6, 6, 2)),
    "2d_g4_pointwise": (lambda: keras.layers.Conv2D(8, 1, groups=4), (3, 3, 8)),
    "1d_g2_causal": (lambda: keras.layers.Conv1D(4, 3, groups=2, padding="causal",
                                                 dilation_rate=2), (9, 4)),
    "1d_g4_stride_valid": (lambda: keras.layers.Conv1D(8, 3, strides=2, groups=4), (10, 8)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GROUPED))
def test_grouped_conv_layerwise_matches_loop(name):
  make, shape = GROUPED[name]
  model = head_model(make(), shape)
  assert choose_engine(model)[0] == "layerwise"
  assert_matches_oracle(model, floats((4,) + shape), labels(4), layerwise_engine)


def test_grouped_conv_ghost_and_materialized_paths(monkeypatch):
  # A layer with many output positions materialises, one with few uses the ghost norm;
  # force each path on the same layer and compare with the loop.
  model = head_model(keras.layers.Conv2D(4, 3, groups=2, padding="same"), (6, 6, 4))
  x, y = floats((3, 6, 6, 4), seed=1), labels(3)
  for ghost in (True, False):
    monkeypatch.setattr(conv_rules.factored, "use_ghost", lambda t, p, q, g=ghost: g)
    assert_matches_oracle(model, x, y, layerwise_engine)


def _cancelling_grouped_model(dtype):
  conv = keras.layers.Conv2D(4, 3, groups=2, use_bias=False, dtype=dtype)
  inputs = keras.Input((5, 5, 4), dtype=dtype)
  flipped = keras.layers.Lambda(lambda t: -1.0001 * t, dtype=dtype)(inputs)
  h = keras.layers.Add(dtype=dtype)([conv(inputs), conv(flipped)])
  h = keras.layers.Flatten(dtype=dtype)(h)
  return keras.Model(inputs, keras.layers.Dense(3, dtype=dtype)(h))


@pytest.mark.slow
def test_grouped_conv_cancelling_uses_at_large_magnitude():
  # The same grouped convolution applied to x and -1.0001 x at magnitude 1e6: the two
  # uses' per-example gradients nearly cancel (float32 terms ~1e3 x the norm). The oracle
  # is the loop in float64; the float32 forward pass rounds the logits differently at
  # this magnitude, so only agreement to a few percent is expected (a clamped or
  # float32 ghost norm would be off by orders of magnitude or 0).
  model = _cancelling_grouped_model("float32")
  model64 = _cancelling_grouped_model("float64")
  model64.set_weights([w.astype(np.float64) for w in model.get_weights()])
  x, y = floats((3, 5, 5, 4), seed=2, scale=1e6), labels(3)
  transform = transforms.Normalize(1.0)
  out = layerwise_engine(model, sparse_ce, x, y, transform)
  norms, _ = oracle(model64, tf.cast(x, tf.float64), y, transform)
  np.testing.assert_allclose(out.norms.numpy(), norms, rtol=0.05)


def test_grouped_conv_microbatches_match_vectorized():
  model = head_model(keras.layers.Conv2D(4, 3, groups=2), (5, 5, 4))
  x, y = floats((4, 5, 5, 4), seed=3), labels(4)
  a = layerwise_engine(model, sparse_ce, x, y, CLIP, num_microbatches=2)
  b = microbatch_engine(model, sparse_ce, x, y, CLIP, num_microbatches=2)
  np.testing.assert_allclose(a.norms.numpy(), b.norms.numpy(), rtol=RTOL)
  for s, t in zip(a.summed, b.summed):
    np.testing.assert_allclose(s.numpy(), t.numpy(), rtol=RTOL, atol=1e-6)


# --- 2. EinsumDense biases ------------------------------------------------------------

EINSUM = [  # (equation, input shape, output shape, bias_axes)
    ("ab,bc->ac", (6,), (5,), "c"),
    ("abc,cd->abd", (4, 6), (4, 5), "b"),   # bias along the 2nd axis: Keras' NCHW bias_add
    ("abc,cd->abd", (4, 6), (4, 5), "bd"),
    ("abc,cde->abde", (4, 6), (4, 2, 3), "de"),
    ("abc,cde->abde", (4, 6), (4, 2, 3), "b"),
    ("abE,bc->acE", (4, 6), (5, 6), "c"),   # NCHW bias_add again
    ("abE,bc->acE", (4, 6), (5, 6), "cE"),
    ("abcd,cde->abe", (4, 2, 3), (4, 5), "b"),
    ("...b,bc->...c", (4, 6), (5,), "c"),
]


@pytest.mark.parametrize("case,engine", tiers.quick_cover(
    EINSUM, [vectorized_engine, layerwise_engine],
    ids=[[f"{e}|{b}" for e, _, _, b in EINSUM], ["vectorized", "layerwise"]]))
def test_einsum_dense_bias_matches_loop(case, engine):
  equation, in_shape, out_shape, bias = case
  model = head_model(keras.layers.EinsumDense(equation, out_shape, bias_axes=bias,
                                              activation="tanh"), in_shape)
  if engine is vectorized_engine and vectorized.onednn_enabled() and \
      vectorized.onednn_risky_layers(model):
    pytest.skip("oneDNN is on in this process: the vectorized engine refuses this model")
  assert_matches_oracle(model, floats((5,) + in_shape), labels(5), engine)


def test_explicit_bias_add_is_removed_after_the_engine():
  layer = keras.layers.EinsumDense("abc,cd->abd", (4, 5), bias_axes="b")
  model = head_model(layer, (4, 6))
  vectorized_engine(model, sparse_ce, floats((2, 4, 6)), labels(2), CLIP)
  assert "call" not in layer.__dict__
  with pytest.raises(RuntimeError):
    with vectorized.ExplicitBiasAdd(model):
      assert "call" in layer.__dict__
      raise RuntimeError("boom")
  assert "call" not in layer.__dict__


# --- 3. oneDNN ------------------------------------------------------------------------

def _matmul_ops(shape_a, shape_b):
  fn = tf.function(lambda a, b: tf.matmul(a, b))
  graph = fn.get_concrete_function(tf.TensorSpec(shape_a), tf.TensorSpec(shape_b)).graph
  return graph.get_operations()  # traced only, never run


@pytest.mark.parametrize("shape_a,shape_b,hazard", [
    ((16, 1, 4, 6), (6, 6), True),        # pfor of a rank-3 x rank-2 matmul: the oneDNN bug
    ((None, 1, 4, 6), (6, 6), True),
    ((16, 1, 4, 6), (1, 1, 6, 6), True),
    ((16, 4, 6), (6, 6), False),          # rank 3: exact in every shape tried
    ((16, 1, 4, 6), (16, 1, 6, 6), False),  # no broadcast
    ((4, 6), (6, 6), False),              # MatMul, not BatchMatMul
])
def test_onednn_matmul_hazards_on_traced_graphs(shape_a, shape_b, hazard):
  assert bool(vectorized.onednn_matmul_hazards(_matmul_ops(shape_a, shape_b))) == hazard


def _mha_model():
  inputs = keras.Input((4, 6))
  h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, name="attn")(inputs, inputs)
  return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


class _Project(keras.layers.Layer):
  """A custom layer with a rank-3 x rank-2 ``tf.matmul`` (no layer-wise rule)."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1], 5))

  def call(self, inputs):
    return tf.matmul(inputs, self.w)


def _custom_matmul_model():
  inputs = keras.Input((4, 6))
  h = _Project(name="project")(inputs)
  return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


@pytest.fixture
def onednn_on(monkeypatch):
  """Makes the library believe oneDNN is on (this process runs with it off)."""
  monkeypatch.setattr(vectorized, "onednn_enabled", lambda: True)


def test_vectorized_refuses_attention_under_onednn_at_compile(onednn_on):
  model = _mha_model()
  with pytest.raises(registry_lib.UnsupportedLayerError) as info:
    resolve_engine(model, "vectorized")
  message = str(info.value)
  for needed in ("MultiHeadAttention 'attn'", "layerwise", "TF_ENABLE_ONEDNN_OPTS=0"):
    assert needed in message
  dp = tf_dpnsgd.make_private(_mha_model(), per_example="vectorized")
  with pytest.raises(registry_lib.UnsupportedLayerError, match="TF_ENABLE_ONEDNN_OPTS=0"):
    dp.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=1.0, noise_multiplier=0.0),
               loss=sparse_ce)
  assert resolve_engine(model, "layerwise") is layerwise_engine  # the way out


def test_vectorized_engine_refuses_while_tracing_under_onednn(onednn_on):
  # A custom layer is not known in advance: the engine finds the op in the traced graph
  # and raises while tracing, so no op of that graph has run.
  model = _custom_matmul_model()
  x, y = floats((8, 4, 6)), labels(8)
  fn = tf.function(lambda x, y: vectorized_engine(model, sparse_ce, x, y, CLIP).summed,
                   autograph=False)
  with pytest.raises(registry_lib.UnsupportedLayerError, match="_Project 'project'"):
    fn.get_concrete_function(x, y)
  with pytest.raises(registry_lib.UnsupportedLayerError, match="TF_ENABLE_ONEDNN_OPTS=0"):
    vectorized_engine(model, sparse_ce, x, y, CLIP)  # eager: a scratch trace first


def test_auto_never_runs_vectorized_on_a_broken_graph(onednn_on, caplog):
  model = _custom_matmul_model()  # no layer-wise rule for _Project: auto would vectorize
  assert choose_engine(model)[0] == "vectorized"
  engine = resolve_engine(model, "auto")
  assert engine.dense_engine is not vectorized_engine
  x, y = floats((4, 4, 6)), labels(4)
  with caplog.at_level(logging.WARNING, logger="tf_dpnsgd.per_example"):
    out = engine(model, sparse_ce, x, y, CLIP)
  assert any("microbatch" in r.getMessage() for r in caplog.records)
  norms, _ = oracle(model, x, y, CLIP)
  np.testing.assert_allclose(out.norms.numpy(), norms, rtol=RTOL)
  # A known-risky layer and no complete coverage: auto picks microbatch up front.
  inputs = keras.Input((4, 6))
  h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
  mixed = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(_Project()(h))))
  assert choose_engine(mixed)[0] == "microbatch"


def test_onednn_off_leaves_auto_and_vectorized_alone():
  if vectorized.onednn_enabled():
    pytest.skip("oneDNN is on in this process")
  assert resolve_engine(_mha_model(), "vectorized") is vectorized_engine
  assert resolve_engine(_custom_matmul_model(), "auto").dense_engine is vectorized_engine


def _run_child(code, onednn):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
             KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
  env.pop("TF_ENABLE_ONEDNN_OPTS", None)
  if onednn is not None:
    env["TF_ENABLE_ONEDNN_OPTS"] = onednn
  return zygote.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                    capture_output=True, text=True, timeout=300)


_CHILD_MODEL = """
import numpy as np, tensorflow as tf, keras
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import registry, vectorized, vectorized_engine
keras.utils.set_random_seed(1)
def ce(y, p):
  return keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)
inputs = keras.Input((4, 6))
h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, name="attn")(inputs, inputs)
model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
x = tf.constant(np.random.default_rng(0).normal(size=(16, 4, 6)), tf.float32)
y = tf.constant(np.arange(16) % 3)
"""


@pytest.mark.slow
def test_child_with_onednn_off_vectorized_attention_matches_loop():
  code = _CHILD_MODEL + """
assert not vectorized.onednn_enabled()
out = vectorized_engine(model, ce, x, y, transforms.Clip(1e9))
grads = []
for i in range(16):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(ce(y[i:i + 1], model(x[i:i + 1], training=True)))
  g = tape.gradient(loss, model.trainable_variables)
  grads.append(np.concatenate([np.ravel(t.numpy()).astype(np.float64) for t in g]))
np.testing.assert_allclose(out.norms.numpy(), np.linalg.norm(grads, axis=1), rtol=1e-5)
total = np.sum(grads, axis=0)  # clip 1e9: the sum of the per-example gradients
got = np.concatenate([np.ravel(s.numpy()) for s in out.summed])
np.testing.assert_allclose(got, total, rtol=1e-4, atol=1e-5)
print("EXACT")
"""
  result = _run_child(code, "0")
  assert result.returncode == 0 and "EXACT" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
def test_child_with_onednn_default_refuses_cleanly():
  code = _CHILD_MODEL + """
if not vectorized.onednn_enabled():
  print("ONEDNN OFF"); raise SystemExit(0)
try:
  vectorized_engine(model, ce, x, y, transforms.Clip(1.0))
except registry.UnsupportedLayerError as e:
  assert "TF_ENABLE_ONEDNN_OPTS=0" in str(e) and "attn" in str(e), str(e)
  print("REFUSED")
check = tf.matmul(tf.ones([3, 3]), tf.ones([3, 3])).numpy()  # memory still sane
assert np.all(check == 3.0), check
"""
  result = _run_child(code, None)
  assert result.returncode == 0, result.stderr[-3000:]
  if "ONEDNN OFF" in result.stdout:
    pytest.skip("oneDNN is off by default on this CPU")
  assert "REFUSED" in result.stdout


# --- 4. ragged and padded bag-of-words ids ----------------------------------------------

class _Bag(keras.Model):
  """Mean of the embeddings of a variable number of ids per example."""

  def __init__(self):
    super().__init__()
    self.emb = keras.layers.Embedding(12, 4)
    self.out = keras.layers.Dense(3)

  def call(self, ids):
    return self.out(tf.reduce_mean(self.emb(ids), axis=1))


def _ragged_ids():
  return tf.ragged.constant([[1, 2, 3], [4], [5, 6, 6], [1, 1, 7, 11]], dtype=tf.int32)


def test_ragged_ids_work_in_the_microbatch_engine():
  model = _Bag()
  model(_ragged_ids())  # build (compile/fit would)
  assert_matches_oracle(model, _ragged_ids(), labels(4), microbatch_engine)


@pytest.mark.parametrize("engine", [vectorized_engine, layerwise_engine],
                         ids=["vectorized", "layerwise"])
def test_ragged_ids_are_refused_with_advice(engine):
  model = _Bag()
  model(_ragged_ids())
  with pytest.raises(ValueError, match="mask_zero=True") as info:
    engine(model, sparse_ce, _ragged_ids(), labels(4), CLIP)
  assert "microbatch" in str(info.value)


@pytest.mark.parametrize("engine", [vectorized_engine, layerwise_engine, microbatch_engine],
                         ids=["vectorized", "layerwise", "microbatch"])
def test_padded_ids_with_mask_zero_match_loop(engine):
  inputs = keras.Input((5,), dtype="int32")
  h = keras.layers.Embedding(12, 4, mask_zero=True)(inputs)
  h = keras.layers.GlobalAveragePooling1D()(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(h))
  ids = tf.constant([[1, 2, 3, 0, 0], [4, 0, 0, 0, 0], [5, 6, 6, 0, 0], [1, 1, 7, 11, 0]])
  assert_matches_oracle(model, ids, labels(4), engine)


# --- 5. recurrent layers: a tf.while_loop in the forward pass (issue 49) -------------------

def _rnn_model(layer):
  tokens = keras.Input((6,), dtype="int32")
  h = layer(keras.layers.Embedding(20, 4)(tokens))
  return keras.Model(tokens, keras.layers.Dense(3, name="head")(h))


def _token_ids(n=4, seed=0):
  return tf.constant(np.random.default_rng(seed).integers(1, 20, (n, 6)), tf.int32)


def _graph(engine):
  """``engine`` traced as in a train step (graph mode), where the crashes were."""
  traced = tf.function(lambda *args: vars(engine(*args)), autograph=False)
  return lambda *args: EngineOutput(**traced(*args))


_RNNS = {"lstm": lambda: keras.layers.LSTM(4, name="my_lstm"),
         "bidirectional_gru": lambda: keras.layers.Bidirectional(keras.layers.GRU(3, name="my_gru"))}
# Recurrent layers without a layer-wise rule (a stack of cells: tf_dpnsgd/per_example/layers/
# recurrent.py recomputes single Simple/LSTM/GRU cells only).
_RNNS_WITHOUT_RULE = {
    "stacked_cells": lambda: keras.layers.RNN([keras.layers.LSTMCell(4), keras.layers.GRUCell(3)],
                                              name="my_stack"),
    "bidirectional_stacked": lambda: keras.layers.Bidirectional(
        keras.layers.RNN([keras.layers.GRUCell(3)], name="my_gru_stack"))}


@pytest.mark.parametrize("name", ["stacked_cells",
                                  pytest.param("bidirectional_stacked", marks=pytest.mark.slow)])
def test_auto_runs_recurrent_layers_without_a_rule_on_the_microbatch_engine(name):
  # Before: "auto" picked the vectorized engine, whose trace failed with "TypeError: `dtype`
  # <dtype: 'variant'> is not compatible with 0 of dtype int64" (pfor's ZerosLike of the
  # loop's TensorList). LSTM, GRU and SimpleRNN layers now have a layer-wise rule.
  model = _rnn_model(_RNNS_WITHOUT_RULE[name]())
  engine, why = choose_engine(model)
  assert engine == "microbatch" and "tf.while_loop" in why and "my_" in why
  assert resolve_engine(model, "auto") is microbatch_engine
  assert_matches_oracle(model, _token_ids(), labels(4), _graph(microbatch_engine))


def test_auto_runs_recurrent_layers_with_a_rule_on_the_layerwise_engine():
  for make in _RNNS.values():
    assert choose_engine(_rnn_model(make()))[0] == "layerwise"


def test_vectorized_refuses_recurrent_layers_at_compile():
  model = _rnn_model(_RNNS["lstm"]())
  with pytest.raises(registry_lib.UnsupportedLayerError, match="LSTM 'my_lstm'") as info:
    vectorized_engine(model, sparse_ce, _token_ids(), labels(4), CLIP)
  for needed in ("per_example='microbatch'", "unroll=True"):
    assert needed in str(info.value)
  dp = tf_dpnsgd.make_private(_rnn_model(_RNNS["lstm"]()), per_example="vectorized")
  with pytest.raises(registry_lib.UnsupportedLayerError, match="my_lstm"):
    dp.compile(optimizer=tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0), loss=sparse_ce)


def test_an_unrolled_lstm_vectorizes_exactly():
  model = _rnn_model(keras.layers.LSTM(4, unroll=True))
  assert vectorized.while_loop_layers(model) == []
  assert choose_engine(model)[0] == "layerwise"  # the recurrent rule; explicit vectorized here
  assert_matches_oracle(model, _token_ids(), labels(4), _graph(vectorized_engine))


class _TensorArrayLoop(keras.layers.Layer):
  """A custom recurrence: a ``tf.while_loop`` that also stacks its states in a ``TensorArray``
  (as Keras' RNN does) and returns the last state."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

  def call(self, inputs):
    steps = tf.shape(inputs)[1]

    def body(t, h, states):
      h = 0.5 * h + inputs[:, t] * self.w
      return t + 1, h, states.write(t, h)

    _, h, _ = tf.while_loop(lambda t, *_: t < steps, body,
                            (0, tf.zeros_like(inputs[:, 0]), tf.TensorArray(inputs.dtype, steps)))
    return h


def _loop_model():
  inputs = keras.Input((5, 3))
  return keras.Model(inputs, keras.layers.Dense(3)(_TensorArrayLoop(name="loop")(inputs)))


def test_vectorized_refuses_a_graph_pfor_cannot_convert_while_tracing():
  model = _loop_model()  # not a keras.layers.RNN: not known before tracing
  assert vectorized.while_loop_layers(model) == []
  fn = tf.function(lambda x, y: vectorized_engine(model, sparse_ce, x, y, CLIP).summed,
                   autograph=False)
  with pytest.raises(registry_lib.UnsupportedLayerError, match="per_example='microbatch'") as info:
    fn.get_concrete_function(floats((4, 5, 3)), labels(4))
  assert isinstance(info.value.__cause__, TypeError)  # pfor's, chained
  assert_matches_oracle(model, floats((4, 5, 3)), labels(4), _graph(microbatch_engine))


def test_auto_falls_back_to_microbatch_where_pfor_fails(onednn_on, caplog):
  # With oneDNN on, "auto" traces the vectorized graph in a scratch graph first (nothing runs);
  # a conversion failure there sends the step to the microbatch engine.
  model = _loop_model()
  with caplog.at_level(logging.WARNING, logger="tf_dpnsgd.per_example"):
    out = assert_matches_oracle(model, floats((4, 5, 3)), labels(4),
                                _graph(resolve_engine(model, "auto")))
  assert any("microbatch" in r.getMessage() and "could not vectorize" in r.getMessage()
             for r in caplog.records)
  assert out.norms.shape == (4,)


# --- 6. a trainable variable the loss does not use (issue 49) --------------------------------

def test_variable_gradients_are_zero_for_an_unused_keras_variable():
  used, unused = keras.Variable(np.ones(3, np.float32)), keras.Variable(np.ones((2, 2), "float32"))

  def grads():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(used * 2.0)
    return base_lib.variable_gradients(tape, loss, [used, unused])

  for g in (grads(), tf.function(grads)()):  # eager and graph
    np.testing.assert_array_equal(g[0].numpy(), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(g[1].numpy(), np.zeros((2, 2)))
    assert g[1].dtype == tf.float32


def _untied_output_embedding_model():
  # keras-hub's LlamaBackbone holds an untied ReversibleEmbedding whose reverse_embeddings
  # only LlamaCausalLM uses; a classifier head leaves it trainable and unused.
  tokens = keras.Input((6,), dtype="int32")
  h = keras.layers.ReversibleEmbedding(20, 4, tie_weights=False, name="tokens")(tokens)
  return keras.Model(tokens, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


@pytest.mark.parametrize("engine", [microbatch_engine, vectorized_engine],
                         ids=["microbatch", "vectorized"])
def test_engines_give_an_unused_variable_a_zero_gradient(engine):
  # Before: "AttributeError: 'str' object has no attribute '_type_enum'" (TensorFlow's
  # UnconnectedGradients.ZERO reads a Keras variable's dtype, a string).
  model = _untied_output_embedding_model()
  paths = [v.path for v in model.trainable_variables]
  unused = paths.index("tokens/reverse_embeddings")
  out = assert_matches_oracle(model, _token_ids(), labels(4), _graph(engine))
  np.testing.assert_array_equal(out.summed[unused].numpy(), 0.0)
