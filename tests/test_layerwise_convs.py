"""The layer-wise rules for depthwise, separable, 3-D and transposed convolutions (issue 49).

Rules under test (``tf_dpnsgd/per_example/layers/conv_more.py``, ``conv.py``): Keras'
``DepthwiseConv1D`` / ``DepthwiseConv2D`` (``DepthwiseKernel``: one folded backprop-filter),
``SeparableConv1D`` / ``SeparableConv2D`` (depthwise kernel + pointwise ``Outer``),
``Conv3D`` (the ``Conv2D`` rule's ``ConvOuter``) and ``Conv1DTranspose`` /
``Conv2DTranspose`` / ``Conv3DTranspose`` (``ConvOuter`` of the output gradient and the
input).

Oracle: :func:`fixtures.check_rule_against_the_loops` (one ``tf.GradientTape`` per example,
the normalized and the clipped sums and factors in float64 numpy), which shares no code
with the engines. Inputs go up to magnitude 1e6, each rule is also used twice in one model (its
uses' per-example gradients add up), masked rows must contribute zero, and an example whose
two uses nearly cancel stays within the sensitivity.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import (UnsupportedLayerError, choose_engine, factored,
                                   layerwise_engine, microbatch_engine, two_pass_engine)
from tf_dpnsgd.per_example.layers import conv, conv_more
import fixtures
import tiers

L = keras.layers
R = 0.1  # DP-NSGD regularizer
BATCH = 4

# name -> (layer factory, non-batch input shape): tiny shapes, every option Keras allows.
LAYERS = {
    "depthwise2d_same": (lambda: L.DepthwiseConv2D(3, padding="same", activation="relu"),
                         (5, 5, 2)),
    "depthwise2d_stride_multiplier": (lambda: L.DepthwiseConv2D(
        3, strides=2, depth_multiplier=2, use_bias=False), (5, 5, 3)),
    "depthwise2d_stride_and_dilation": (lambda: L.DepthwiseConv2D(
        2, strides=2, dilation_rate=2, padding="same"), (5, 5, 2)),  # Keras decomposes this
    "depthwise2d_channels_first": (lambda: L.DepthwiseConv2D(
        (2, 3), depth_multiplier=2, data_format="channels_first"), (2, 5, 5)),
    "depthwise1d_dilated": (lambda: L.DepthwiseConv1D(
        3, dilation_rate=2, padding="same", depth_multiplier=2), (7, 2)),
    "separable2d_same": (lambda: L.SeparableConv2D(3, 3, padding="same", depth_multiplier=2),
                         (5, 5, 2)),
    "separable2d_stride_valid": (lambda: L.SeparableConv2D(4, 3, strides=2, use_bias=False),
                                 (5, 5, 3)),
    "separable1d_dilated": (lambda: L.SeparableConv1D(3, 3, dilation_rate=2, activation="tanh"),
                            (7, 2)),
    "conv3d_same": (lambda: L.Conv3D(2, 2, padding="same", activation="relu"), (3, 4, 4, 2)),
    "conv3d_stride_valid": (lambda: L.Conv3D(3, 2, strides=2, use_bias=False), (4, 4, 5, 1)),
    "conv3d_channels_first": (lambda: L.Conv3D(2, 2, data_format="channels_first"),
                              (2, 3, 3, 3)),  # Keras runs it with XLA on CPU
    "conv3d_groups": (lambda: L.Conv3D(4, 2, groups=2), (3, 3, 3, 2)),  # XLA too
    "conv1d_transpose_same": (lambda: L.Conv1DTranspose(2, 3, strides=2, padding="same"),
                              (5, 2)),
    "conv1d_transpose_output_padding": (lambda: L.Conv1DTranspose(
        2, 3, strides=2, output_padding=1), (5, 2)),
    "conv1d_transpose_same_odd_output": (lambda: L.Conv1DTranspose(
        2, 3, strides=2, padding="same", output_padding=0), (5, 2)),  # 9 outputs, not 10
    "conv2d_transpose_same": (lambda: L.Conv2DTranspose(3, 3, strides=2, padding="same",
                                                        activation="relu"), (3, 3, 2)),
    "conv2d_transpose_valid": (lambda: L.Conv2DTranspose(2, (2, 3), strides=(1, 2)),
                               (4, 4, 2)),
    "conv2d_transpose_no_bias": (lambda: L.Conv2DTranspose(2, 2, use_bias=False), (4, 4, 2)),
    "conv3d_transpose": (lambda: L.Conv3DTranspose(2, 2, strides=2), (2, 2, 2, 2)),
}


def _randomize(model, seed=0):
  rng = np.random.default_rng(seed)
  model.set_weights([rng.normal(size=w.shape).astype(w.dtype) for w in model.get_weights()])


def _model(layer, shape, twice=False):
  """``Dense(3)`` on the flattened output of ``layer``; ``twice``: ``layer`` also on ``-2 x``."""
  inputs = keras.Input(shape)
  h = L.Flatten()(layer(inputs))
  if twice:
    h = L.Concatenate()([h, L.Flatten()(layer(L.Rescaling(-2.0)(inputs)))])
  model = keras.Model(inputs, L.Dense(3)(h))
  _randomize(model)
  return model


def _loss(y_true, y_pred):
  """Half the squared error: its output gradient ``y_pred - y_true`` is well conditioned
  (a saturated softmax's ``p - 1`` loses relative precision, differently in each engine)."""
  return 0.5 * tf.reduce_sum(tf.square(y_pred - y_true), axis=-1)


def _data(shape, magnitude=1.0, seed=1):
  rng = np.random.default_rng(seed)
  x = tf.constant(magnitude * rng.normal(size=(BATCH,) + shape), tf.float32)
  return x, tf.constant(rng.normal(size=(BATCH, 3)), tf.float32)


def _check(model, x, y, engine=layerwise_engine, mask=None):
  return fixtures.check_rule_against_the_loops(model, x, y, R, engine=engine, mask=mask,
                                               loss=_loss)


# Cases Keras compiles with XLA on CPU (seconds each) run at one magnitude, in the full
# suite only (conv3d_same keeps the Conv3D rule in the quick tier); the others at both
# magnitudes, each layer at one of them in the quick tier (tests/tiers.py).
_XLA = ("conv3d_channels_first", "conv3d_groups")
CASES = (tiers.quick_cover(sorted(set(LAYERS) - set(_XLA)), (1.0, 1e6))
         + [pytest.param(name, 1e6, marks=pytest.mark.slow) for name in _XLA])


@pytest.mark.parametrize("name,magnitude", CASES)
def test_rule_matches_the_per_example_loop(name, magnitude):
  make, shape = LAYERS[name]
  model = _model(make(), shape)
  engine, why = choose_engine(model)
  assert engine == "layerwise", why
  x, y = _data(shape, magnitude)
  out = _check(model, x, y)
  # The rule's recomputed forward pass is the layer's own.
  np.testing.assert_allclose(out.y_pred, model(x, training=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["depthwise2d_stride_multiplier", "separable2d_same",
                                  "conv3d_same", "conv2d_transpose_same"])
def test_layer_used_twice_adds_its_uses(name):
  make, shape = LAYERS[name]
  model = _model(make(), shape, twice=True)
  x, y = _data(shape, 1e6)
  _check(model, x, y)


def _mobilenet_like():
  inputs = keras.Input((5, 5, 2))
  h = L.DepthwiseConv2D(3, padding="same", activation="relu")(inputs)
  h = L.Conv2D(3, 1)(h)
  h = L.SeparableConv2D(3, 3, strides=2, padding="same", activation="relu")(h)
  h = L.Conv2DTranspose(2, 2, strides=2)(h)
  model = keras.Model(inputs, L.Dense(3)(L.Flatten()(h)))
  _randomize(model)
  return model


def test_masked_rows_contribute_zero():
  model = _mobilenet_like()
  x, y = _data((5, 5, 2))
  mask = tf.constant([True, False, True, False])
  out = _check(model, x, y, mask=mask)  # the normalized sum
  np.testing.assert_array_equal(out.factors.numpy()[[1, 3]], 0.0)
  kept = layerwise_engine(model, _loss, tf.gather(x, [0, 2]), tf.gather(y, [0, 2]),
                          transforms.Normalize(R))
  for a, b in zip(out.summed, kept.summed):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_two_passes_and_microbatches_match_the_loop():
  """The second pass sums from (x, h dz) (nothing kept); microbatch units materialise."""
  model = _mobilenet_like()
  x, y = _data((5, 5, 2), 1e3)
  _check(model, x, y, engine=two_pass_engine)
  for transform in (transforms.Normalize(R), transforms.Clip(1.0)):
    out = layerwise_engine(model, _loss, x, y, transform, num_microbatches=2)
    loop = microbatch_engine(model, _loss, x, y, transform, num_microbatches=2)
    np.testing.assert_allclose(out.norms, loop.norms, rtol=1e-5)
    for got, expected in zip(out.summed, loop.summed):
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # make_private on convolutions (the rules stay quick): CI only (issue 47)
def test_one_dp_step_through_make_private_matches_the_loop():
  """``make_private`` with ``"auto"`` (the layer-wise engine, traced) makes the DP-NSGD and
  DP-SGD steps at noise 0 that one float64 tape per example gives (until 2026-11-28 the
  oracle was the microbatch engine, traced once per optimizer: two more traced steps)."""
  x, y = _data((5, 5, 2))
  assert choose_engine(_mobilenet_like())[0] == "layerwise"
  loss = keras.losses.MeanSquaredError()
  model = _mobilenet_like()
  start = [v.numpy() for v in model.trainable_variables]
  grads = fixtures.per_example_gradients_by_loop(
      model.trainable_variables, lambda i: loss(y[i:i + 1], model(x[i:i + 1], training=True)),
      BATCH)
  norms = [np.sqrt(sum(np.sum(g ** 2) for g in gs)) for gs in grads]
  for optimizer, factors in (
      (tf_dpnsgd.DPNSGD(learning_rate=1.0, regularizer=R, noise_multiplier=0.0),
       [1 / (R + n) for n in norms]),
      (tf_dpnsgd.DPSGD(learning_rate=1.0, l2_norm_clip=1.0, noise_multiplier=0.0),
       [min(1.0, 1.0 / n) for n in norms])):
    keras.utils.set_random_seed(0)
    model = _mobilenet_like()
    for v, w in zip(model.trainable_variables, start):
      v.assign(w)
    private = tf_dpnsgd.make_private(model, trust_untagged_batches=True, per_example="auto")
    private.compile(optimizer=optimizer, loss=loss)
    private.train_on_batch(x, y)
    assert any(n > 1.0 for n in norms) and any(f < 1.0 for f in factors)  # clipping bites
    for v, w, k in zip(model.trainable_variables, start, range(len(start))):
      expected = -sum(f * gs[k] for f, gs in zip(factors, grads)) / BATCH
      np.testing.assert_allclose(v.numpy() - w, expected, rtol=1e-4, atol=1e-6, err_msg=v.path)


def test_depthwise_kernel_against_float64_tapes():
  """Per-example gradients, certified norms, weighted sum and float64 recomputation of a
  ``DepthwiseKernel`` used twice, against float64 tapes of Keras' depthwise convolution."""
  rng = np.random.default_rng(5)
  # float32 values (the representation's dtype), held in float64 for the oracle.
  xs = [rng.normal(size=(BATCH, 5, 5, 2)).astype(np.float32).astype(np.float64)
        for _ in range(2)]
  gs = [rng.normal(size=(BATCH, 3, 3, 6)).astype(np.float32).astype(np.float64)
        for _ in range(2)]
  args = ((3, 3), (2, 2), (1, 1), "same")
  rep = factored.combine([conv_more.DepthwiseKernel(tf.constant(x, tf.float32),
                                                    tf.constant(g, tf.float32), *args)
                          for x, g in zip(xs, gs)])
  assert isinstance(rep, conv_more.DepthwiseKernel) and len(rep.uses) == 2
  kernel = tf.Variable(tf.zeros([3, 3, 2, 3], tf.float64))
  oracle = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      total = tf.add_n([tf.reduce_sum(keras.ops.depthwise_conv(
          tf.constant(x[i:i + 1]), kernel, strides=2, padding="same") * g[i:i + 1])
                        for x, g in zip(xs, gs)])
    oracle.append(tape.gradient(total, kernel).numpy())
  oracle = np.stack(oracle)
  factors = tf.constant([0.5, 0.0, 2.0, 1.0])
  np.testing.assert_allclose(rep.squared_norms(), np.sum(oracle**2, axis=(1, 2, 3, 4)),
                             rtol=1e-5)
  np.testing.assert_allclose(rep.weighted_sum(factors),
                             np.tensordot(factors.numpy(), oracle, axes=1), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(rep.per_unit(), oracle, rtol=1e-4, atol=1e-5)
  g64, error = rep.unit_gradient64(2)
  assert g64.dtype == tf.float64
  np.testing.assert_allclose(g64, oracle[2], rtol=1e-12, atol=1e-12)
  assert 0 < float(error) < 1e-12
  # Without the kept gradients (a second pass): one backprop-filter of (x, h dz) per use.
  fresh = rep.gather_units(tf.range(BATCH))
  np.testing.assert_allclose(fresh.raw_weighted_sum(factors),
                             np.tensordot(factors.numpy(), oracle, axes=1), rtol=1e-4, atol=1e-5)


def test_dilated_transposed_kernel_against_xla_tapes():
  """A dilated ``Conv2DTranspose`` (TensorFlow's CPU kernels refuse dilation there, XLA does
  not): the rule's ``ConvOuter(dy, x)`` against per-example tapes compiled with XLA."""
  rng = np.random.default_rng(7)
  x = rng.normal(size=(3, 4, 4, 2)).astype(np.float32)
  dy = rng.normal(size=(3, 6, 6, 3)).astype(np.float32)  # (4 - 1) + (2 - 1) * 2 + 1 = 6
  kernel = tf.Variable(tf.zeros([2, 2, 3, 2]))  # [*k, filters, input channels]

  @tf.function(jit_compile=True)
  def kernel_grad(xi, dyi):
    with tf.GradientTape() as tape:
      y = keras.ops.conv_transpose(xi, kernel, strides=1, padding="valid", dilation_rate=2)
      total = tf.reduce_sum(y * dyi)
    return tape.gradient(total, kernel)

  oracle = np.stack([kernel_grad(x[i:i + 1], dy[i:i + 1]).numpy() for i in range(3)])
  rep = conv.ConvOuter(tf.constant(dy), tf.constant(x), (2, 2), (1, 1), (2, 2), "valid")
  np.testing.assert_allclose(rep.per_unit(), oracle, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rep.squared_norms(), np.sum(oracle.astype(np.float64)**2,
                                                         axis=(1, 2, 3, 4)), rtol=1e-5)
  factors = tf.constant([0.5, 0.0, 2.0])
  np.testing.assert_allclose(rep.weighted_sum(factors),
                             np.tensordot(factors.numpy(), oracle, axes=1), rtol=1e-5, atol=1e-5)


def test_depthwise_cancelling_uses_are_recomputed_in_float64():
  """Two uses ``(x, g)`` and ``(x, -(1 - 1e-4) g)``: the float32 gradients' sum keeps only
  ~1e-3 of relative precision, so every example is marked ill-conditioned and its norm and
  its contribution to the sum come from float64 patches (float64 accuracy, not float32)."""
  rng = np.random.default_rng(6)
  x = rng.normal(size=(BATCH, 4, 4, 2)).astype(np.float32)
  g = rng.normal(size=(BATCH, 4, 4, 2)).astype(np.float32)
  g2 = (-(1 - 1e-4) * g).astype(np.float32)
  args = ((2, 2), (1, 1), (1, 1), "same")
  rep = factored.combine([conv_more.DepthwiseKernel(tf.constant(x), tf.constant(gu), *args)
                          for gu in (g, g2)])
  kernel = tf.Variable(tf.zeros([2, 2, 2, 1], tf.float64))
  oracle = []
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      z = keras.ops.depthwise_conv(tf.constant(x[i:i + 1], tf.float64), kernel, padding="same")
      total = tf.reduce_sum(z * (g[i:i + 1].astype(np.float64) + g2[i:i + 1]))
    oracle.append(tape.gradient(total, kernel).numpy())
  oracle = np.stack(oracle)
  norms2 = rep.squared_norms().numpy()
  assert bool(tf.reduce_all(rep._recomputed[0]))  # every example recomputed
  exact = np.sum(oracle**2, axis=(1, 2, 3, 4))
  assert np.all(norms2 >= exact)  # upper bounds, inflated by the float64 error bound only
  np.testing.assert_allclose(norms2, exact, rtol=1e-7)  # float32 alone: ~1e-3
  factors = tf.constant([0.5, 0.0, 2.0, 1.0])
  np.testing.assert_allclose(rep.weighted_sum(factors),
                             np.tensordot(factors.numpy(), oracle, axes=1), rtol=1e-6)


@pytest.mark.parametrize("name", ["depthwise2d_same", "separable2d_same",
                                  "conv2d_transpose_same"])
def test_nearly_cancelling_uses_stay_within_the_sensitivity(name):
  """One layer on ``x`` and ``x (1 + 1e-7)`` (magnitude 1e6) with output gradients ``c``
  and ``-(1 - 1e-4) c``: the per-example gradient nearly cancels (the depthwise kernel's
  examples are recomputed in float64). Each example's contribution, read off the batch with
  the others masked out, has norm at most the sensitivity and is within float32 rounding of
  the exact one."""
  make, shape = LAYERS[name]
  fixtures.assert_cancelling_uses_stay_within_the_sensitivity(make(), shape, BATCH, 1e6,
                                                              _randomize)


def test_auto_picks_layerwise_for_mobilenet_conv3d_and_transposed_models():
  assert choose_engine(_mobilenet_like())[0] == "layerwise"
  inputs = keras.Input((4, 4, 4, 1))
  h = L.Conv3D(2, 2, activation="relu")(inputs)
  h = L.Conv3DTranspose(2, 2)(h)
  assert choose_engine(keras.Model(inputs, L.Dense(2)(L.Flatten()(h))))[0] == "layerwise"
  inputs = keras.Input((6, 2))
  h = L.SeparableConv1D(2, 3)(L.DepthwiseConv1D(2)(inputs))
  h = L.Conv1DTranspose(2, 2, strides=2)(h)
  assert choose_engine(keras.Model(inputs, L.Dense(2)(L.Flatten()(h))))[0] == "layerwise"


@pytest.mark.parametrize("layer", [
    lambda: L.SeparableConv2D(2, 2, data_format="channels_first"),
    lambda: L.Conv2DTranspose(2, 2, data_format="channels_first")])
def test_channels_first_separable_and_transposed_are_refused_with_the_reason(layer):
  inputs = keras.Input((2, 4, 4))
  model = keras.Model(inputs, L.Dense(2)(L.Flatten()(layer()(inputs))))
  engine, why = choose_engine(model)
  assert engine != "layerwise" and "data_format='channels_first'" in why, why
  x, y = tf.zeros([BATCH, 2, 4, 4]), tf.zeros([BATCH, 2])
  with pytest.raises(UnsupportedLayerError, match="channels_last"):
    layerwise_engine(model, _loss, x, y, transforms.Clip(1.0))
