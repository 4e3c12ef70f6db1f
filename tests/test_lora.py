"""LoRA-enabled Dense / EinsumDense in the layer-wise engine, against single-example loops.

The oracle is :func:`fixtures.normalized_sum_by_loop`: each example's gradient
from its own ``tf.GradientTape`` in eager mode (Keras' own LoRA forward pass,
``W + s A B``), its norm, and ``sum_i g_i / (r + ||g_i||)`` in float64. It
shares no code with the engine. The adversarial tests use a closed-form
float64 oracle (linear loss, so the per-example gradients are products of
the inputs and the chosen output coefficients).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import coverage as coverage_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import choose_engine, layerwise_engine, registry, resolve_engine
from fixtures import assert_engine_output, normalized_sum_by_loop, tiny_bert_backbone

R = 0.1  # DP-NSGD regularizer of the oracle


def sparse_ce(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _take(x, i):
  return tf.nest.map_structure(lambda t: t[i:i + 1], x)


def assert_matches_loop(model, x, y, loss_fn=sparse_ce, r=R):
  """The layer-wise engine's DP-NSGD norms and sum against the per-example loop."""
  batch = int(tf.nest.flatten(x)[0].shape[0])
  out = layerwise_engine(model, loss_fn, x, y, transforms.Normalize(r))
  norms, summed = normalized_sum_by_loop(
      model.trainable_variables,
      lambda i: tf.reduce_sum(loss_fn(_take(y, i), model(_take(x, i), training=True))),
      batch, r)
  assert_engine_output(out, norms, summed, norm_rtol=1e-5, sum_rtol=1e-4, sum_atol=1e-7)
  return out


def enable_lora(layer, rank=2, alpha=3):
  """LoRA with a non-zero B (Keras initialises B to 0, which makes A's gradient 0)."""
  layer.enable_lora(rank, lora_alpha=alpha)
  layer.lora_kernel_b.assign(
      np.random.default_rng(3).normal(size=layer.lora_kernel_b.shape).astype("float32"))


def _float(shape, seed=0):
  return tf.constant(np.random.default_rng(seed).normal(size=shape), tf.float32)


def labels(n, k=3):
  return tf.constant(np.arange(n) % k, tf.int32)


def head_model(layer, input_shape, head=3):
  inputs = keras.Input(input_shape)
  h = keras.layers.Flatten()(layer(inputs))
  return keras.Model(inputs, keras.layers.Dense(head, name="head")(h))


def _lora_variables(model):
  return sorted(v.path for v in model.trainable_variables if "lora_kernel" in v.path)


# --- single layers -----------------------------------------------------------------------

@pytest.mark.parametrize("input_shape", [(5,), (4, 5)], ids=["vector", "sequence"])
def test_dense_lora_matches_loop(input_shape):
  dense = keras.layers.Dense(3, activation="tanh", name="lora_dense")
  model = head_model(dense, input_shape)
  enable_lora(dense)
  assert not dense._kernel.trainable and len(_lora_variables(model)) == 2
  assert choose_engine(model)[0] == "layerwise"
  out = assert_matches_loop(model, _float((4,) + input_shape), labels(4))
  paths = [v.path for v in model.trainable_variables]
  assert "lora_dense/kernel" not in paths  # the frozen W gets no per-example gradient
  assert np.all(out.norms.numpy() > 0)


@pytest.mark.parametrize("equation,bias_axes,output_shape,input_shape", [
    ("btd,dnh->btnh", "nh", (5, 2, 3), (5, 6)),  # attention query/key/value
    ("btnh,nhd->btd", "d", (5, 6), (5, 2, 3)),  # attention output projection
    ("abc,dc->abd", "d", (3, 4), (3, 5)),  # the kernel's last axis is contracted
    ("abc,bc->abc", None, (3, 5), (3, 5)),  # per-position kernel: materialised
], ids=["query", "output", "contracted_last", "per_position"])
def test_einsum_dense_lora_matches_loop(equation, bias_axes, output_shape, input_shape):
  layer = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes, name="lora_ed")
  model = head_model(layer, input_shape)
  enable_lora(layer)
  assert choose_engine(model)[0] == "layerwise"
  assert_matches_loop(model, _float((3,) + input_shape), labels(3))


def test_einsum_dense_lora_with_trainable_base_kernel_matches_loop():
  """W made trainable again after enable_lora: W, A and B all get per-example gradients."""
  layer = keras.layers.EinsumDense("btd,dnh->btnh", (4, 2, 3), bias_axes="nh")
  model = head_model(layer, (4, 6))
  enable_lora(layer)
  layer._kernel.trainable = True
  assert len(model.trainable_variables) == 6
  assert_matches_loop(model, _float((3, 4, 6)), labels(3))


def test_multi_head_attention_lora_on_query_and_value():
  model = _mha_lora_model()
  assert len(_lora_variables(model)) == 4
  assert choose_engine(model)[0] == "layerwise"
  assert_matches_loop(model, _float((3, 4, 6)), labels(3))


def test_lora_layer_used_twice_sums_its_uses():
  dense = keras.layers.Dense(4, name="shared")
  x1, x2 = keras.Input((3, 5)), keras.Input((3, 5))
  h = keras.layers.Concatenate()([dense(x1), dense(2.0 * x2)])
  model = keras.Model([x1, x2], keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  enable_lora(dense)
  assert_matches_loop(model, [_float((4, 3, 5)), _float((4, 3, 5), seed=1)], labels(4))


def _mha_lora_model():
  inputs = keras.Input((4, 6))
  mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)
  h = mha(inputs, inputs)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
  for dense in (mha._query_dense, mha._value_dense):
    enable_lora(dense)
  return model


def _one_step(per_example, x, y):
  keras.utils.set_random_seed(7)
  model = tf_dpnsgd.make_private(_mha_lora_model(), per_example=per_example,
                                 trust_untagged_batches=True)  # one hand-made batch
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=0.01,
                                           noise_multiplier=0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.train_on_batch(x, y)
  return [(v.path.split("/")[-1], v.numpy()) for v in model.trainable_variables]


@pytest.mark.slow
def test_compiled_dp_step_with_lora_equals_the_microbatch_engine_step():
  """Through make_private and a traced train step (graph mode: variable-use checks run)."""
  x, y = _float((4, 4, 6)), labels(4)
  fast, slow = _one_step("auto", x, y), _one_step("microbatch", x, y)
  keras.utils.set_random_seed(7)
  before = [v.numpy() for v in _mha_lora_model().trainable_variables]
  assert [k for k, _ in fast] == [k for k, _ in slow] and len(fast) == len(before)
  assert all(not np.allclose(f, b) for (k, f), b in zip(fast, before) if k == "lora_kernel_a")
  for (k, f), (_, s) in zip(fast, slow):
    np.testing.assert_allclose(f, s, rtol=1e-5, atol=1e-6, err_msg=k)


# --- engine choice, coverage, frozen weights -------------------------------------------------

def test_lora_embedding_is_still_not_covered():
  """Only Dense and EinsumDense handle LoRA; an Embedding with LoRA has no rule."""
  ids = keras.Input((3,), dtype="int32")
  emb = keras.layers.Embedding(7, 4, name="lora_embedding")
  model = keras.Model(ids, keras.layers.Dense(2)(keras.layers.Flatten()(emb(ids))))
  emb.enable_lora(2)
  name, why = choose_engine(model)
  assert name != "layerwise" and "LoRA" in why and "lora_embedding" in why


def test_frozen_base_kernel_is_named_in_not_covered():
  dense = keras.layers.Dense(3, name="lora_dense")
  model = head_model(dense, (5,))
  assert not any("lora_dense" in f for f in coverage_lib.frozen_layers(model))
  enable_lora(dense)
  # Full path, and what of it is frozen and what still trains (issue 48.2).
  assert coverage_lib.frozen_layers(model) == [
      f"{dense.path} (frozen: kernel; trained: bias, lora_kernel_a, lora_kernel_b)"]


def test_freezing_a_layer_after_keras_hub_enable_lora_is_not_reported_as_frozen():
  """The trap of issue 48.2: keras-hub's enable_lora sets every layer trainable=False and
  leaves the LoRA factors trainable, so freezing a transformer layer afterwards freezes
  nothing. The report's frozen list is computed from the variables the step trains (the
  oracle: the model's own trainable variables), with full paths, so it does not call the
  layer frozen; the documented way (each variable's trainable flag) does freeze it."""
  backbone = tiny_bert_backbone(num_layers=2)
  pooled = backbone.output["pooled_output"]
  model = keras.Model(backbone.input, keras.layers.Dense(2, name="head")(pooled))
  backbone.enable_lora(2)
  layer = backbone.get_layer("transformer_layer_0")
  layer.trainable = False  # what the user tried
  inside = [v for v in model.trainable_variables if v.path.startswith(layer.path + "/")]
  assert inside  # still trained
  frozen = coverage_lib.frozen_layers(model)
  assert layer.path not in frozen  # not frozen as a whole: its LoRA factors train
  assert any(f.startswith(f"{layer.path}/self_attention_layer/query (frozen: kernel; "
                          "trained: bias, lora_kernel_a, lora_kernel_b)") for f in frozen)
  for v in layer.weights:  # docs/per_example.md's recipe
    v.trainable = False
  assert not any(v.path.startswith(layer.path + "/") for v in model.trainable_variables)
  assert layer.path in coverage_lib.frozen_layers(model)


@pytest.mark.slow
def test_bert_backbone_with_lora_uses_layerwise_engine_and_matches_loop():
  backbone = tiny_bert_backbone(dropout=0.0, num_layers=2)
  pooled = backbone.output["pooled_output"]
  model = keras.Model(backbone.input, keras.layers.Dense(2, name="head")(pooled))
  backbone.enable_lora(2)
  for i in range(2):
    attention = backbone.get_layer(f"transformer_layer_{i}")._self_attention_layer
    for dense in (attention._query_dense, attention._value_dense):
      dense.lora_kernel_b.assign(  # non-zero B, so that A's gradient is not 0
          np.random.default_rng(i).normal(size=dense.lora_kernel_b.shape).astype("float32"))
  assert len(_lora_variables(model)) == 8
  assert choose_engine(model)[0] == "layerwise"
  engine = resolve_engine(model, "auto").dense_engine  # the engine, or a partial of it
  assert getattr(engine, "func", engine) is layerwise_engine
  frozen = coverage_lib.frozen_layers(model)
  # Full paths; a transformer layer whose LoRA factors train is named with what is frozen.
  assert any(f.startswith("transformer_layer_0/self_attention_layer/query (frozen: kernel")
             for f in frozen)
  assert "token_embedding" in frozen
  rng = np.random.default_rng(4)
  mask = np.ones((3, 7), "int32")
  mask[1, 4:] = 0
  x = {"token_ids": tf.constant(rng.integers(0, backbone.vocabulary_size, (3, 7)), tf.int32),
       "segment_ids": tf.zeros((3, 7), tf.int32), "padding_mask": tf.constant(mask)}
  assert_matches_loop(model, x, labels(3, 2), r=0.01)


# --- adversarial: huge, cancelling and non-finite examples ----------------------------------

BATCH = 5
DELTA = 1e-4  # relative mismatch of the two uses' output gradients


def linear_loss(y_true, y_pred):
  """``[B]`` losses ``<y_true_i, y_pred_i>``: dL/dy_pred is y_true exactly."""
  prod = tf.cast(y_true, y_pred.dtype) * y_pred
  return tf.reduce_sum(tf.reshape(prod, [tf.shape(y_pred)[0], -1]), axis=1)


def _siamese(width=6, units=4):
  dense = keras.layers.Dense(units, name="shared")
  x1, x2 = keras.Input((width,)), keras.Input((width,))
  model = keras.Model([x1, x2], keras.layers.Concatenate()([dense(x1), dense(x2)]))
  enable_lora(dense)
  return model, dense


def _exact_gradients(dense, inputs, y_true):
  """``[B, params]`` float64 per-example gradients of (bias, A, B) in trainable order.

  ``loss_i = <c1, x1 K + b> + <c2, x2 K + b>`` with ``K = W + s A B``:
  ``G = x1^T c1 + x2^T c2``, ``dA = s G B^T``, ``dB = s A^T G``, ``db = c1 + c2``.
  """
  s = dense.lora_alpha / dense.lora_rank
  a = np.asarray(dense.lora_kernel_a, np.float64)
  b = np.asarray(dense.lora_kernel_b, np.float64)
  x1, x2 = (np.asarray(t, np.float64) for t in inputs)
  units = b.shape[1]
  c1, c2 = np.asarray(y_true[:, :units], np.float64), np.asarray(y_true[:, units:], np.float64)
  grads = {"bias": c1 + c2}
  g = np.einsum("ip,iq->ipq", x1, c1) + np.einsum("ip,iq->ipq", x2, c2)
  grads["lora_kernel_a"] = s * np.einsum("ipq,rq->ipr", g, b)
  grads["lora_kernel_b"] = s * np.einsum("pr,ipq->irq", a, g)
  order = [v.path.split("/")[-1] for v in dense.trainable_variables]
  return np.concatenate([grads[name].reshape(len(x1), -1) for name in order], axis=1)


def _adversarial_batch(magnitude, width=6, units=4):
  """Nearly equal huge inputs with nearly opposite output gradients (terms cancel)."""
  rng = np.random.default_rng(int(np.log10(magnitude)))
  x1 = (magnitude * rng.normal(size=(BATCH, width))).astype(np.float32)
  x2 = (x1 * np.float32(1 + 1e-7)).astype(np.float32)
  c = rng.normal(size=(BATCH, units)).astype(np.float32)
  y_true = np.concatenate([c, (-(1 - DELTA) * c).astype(np.float32)], axis=1)
  return [x1, x2], y_true


def _flat(summed):
  return np.concatenate([s.numpy().astype(np.float64).ravel() for s in summed])


def _engine(model, inputs, y_true, transform, mask=None):
  return layerwise_engine(model, linear_loss, [tf.constant(t) for t in inputs],
                          tf.constant(y_true), transform, mask=mask)


@pytest.mark.parametrize("magnitude", [pytest.param(1.0, marks=pytest.mark.slow), 1e6])  # quick: 1e6
def test_huge_cancelling_examples_stay_within_the_sensitivity(magnitude):
  """A shared LoRA layer whose two uses cancel to relative DELTA: every contribution is bounded.

  The engine's per-example gradients of A and B are exact products of the float32 factors
  ``(x, s dz B^T)`` and ``(s x A, dz)``; rounding those factors to float32 (Keras' own float32
  backward pass rounds ``G = x^T dz`` before multiplying by ``B^T``) moves a gradient whose
  terms cancel to relative DELTA by ~2^-24 / DELTA of its norm. So the norms are compared with
  the exact float64 ones to that accuracy, and the sensitivity bound is checked on what the
  engine actually adds: each example's contribution, read off the same batch with every other
  example masked out (same shapes, so the same float32 factors).
  """
  model, dense = _siamese()
  inputs, y_true = _adversarial_batch(magnitude)
  true_norms = np.linalg.norm(_exact_gradients(dense, inputs, y_true), axis=1)
  scale = float(np.median(true_norms))
  for transform in (transforms.Normalize(1e-2 * scale), transforms.Clip(1e-2 * scale),
                    transforms.Normalize(1.0), transforms.Clip(1.0)):
    sens = transform.sensitivity
    out = _engine(model, inputs, y_true, transform)
    np.testing.assert_allclose(out.norms.numpy(), true_norms, rtol=20 * 2.0 ** -24 / DELTA)
    singles = [_flat(_engine(model, inputs, y_true, transform,
                             mask=tf.constant(np.arange(BATCH) == i)).summed)
               for i in range(BATCH)]
    contributions = np.linalg.norm(singles, axis=1)
    if isinstance(transform, transforms.Normalize):  # ||g / (r + ||g||)|| < 1
      assert np.all(contributions < sens), contributions
    else:
      assert np.all(contributions <= sens * (1 + 1e-6)), contributions / sens
    assert np.all(contributions > 0.5 * np.minimum(sens, true_norms))
    np.testing.assert_allclose(_flat(out.summed), np.sum(singles, axis=0), rtol=0,
                               atol=1e-5 * sens * BATCH)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_example_contributes_exactly_zero(bad):
  model, dense = _siamese()
  inputs, y_true = _adversarial_batch(1e6)
  inputs[0][2, 1] = bad
  keep = [0, 1, 3, 4]
  for transform in (transforms.Normalize(1.0), transforms.Clip(1.0)):
    out = layerwise_engine(model, linear_loss, [tf.constant(t) for t in inputs],
                           tf.constant(y_true), transform)
    assert out.factors.numpy()[2] == 0.0 and not np.isfinite(out.norms.numpy()[2])
    clean = layerwise_engine(model, linear_loss, [tf.constant(t[keep]) for t in inputs],
                             tf.constant(y_true[keep]), transform)
    for a, b in zip(out.summed, clean.summed):
      assert np.all(np.isfinite(a.numpy()))
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_lora_rule_refuses_quantized_layers():
  dense = keras.layers.Dense(3)
  model = head_model(dense, (4,))
  dense.quantize("int8")
  assert registry.DEFAULT_REGISTRY.lookup(dense).unsupported(dense) is not None
  assert choose_engine(model)[0] != "layerwise"
