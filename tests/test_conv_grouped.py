"""Per-example conv kernel gradients as one grouped backprop-filter (issue 34).

The grouped path needs oneDNN's CPU kernels, which the test process runs
without (``conftest.py`` sets ``TF_ENABLE_ONEDNN_OPTS=0``): the numerical checks
run in a child process with oneDNN on, against per-example gradients from one
tape per example (float64 oracle of :func:`fixtures.normalized_sum_by_loop`).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tf_dpnsgd.per_example import vectorized
from tf_dpnsgd.per_example.layers import conv
import zygote  # children forked from a pre-imported process (tests/zygote.py)

HERE = os.path.dirname(os.path.abspath(__file__))


def test_grouped_filter_is_chosen_by_shape(monkeypatch):
  monkeypatch.setattr(conv, "grouped_filter_available", lambda: True)
  assert conv.use_grouped_filter(2, 16, 16)
  assert conv.use_grouped_filter(2, 3, 16)
  assert conv.use_grouped_filter(2, 32, 32)
  assert not conv.use_grouped_filter(2, 64, 64)  # slower there (measured)
  assert not conv.use_grouped_filter(1, 4, 4)  # Conv1D: patches
  monkeypatch.setattr(conv, "grouped_filter_available", lambda: False)
  assert not conv.use_grouped_filter(2, 16, 16)


def test_grouped_filter_needs_onednn_in_this_process():
  # TensorFlow's CPU kernels without oneDNN refuse grouped backprop-filters.
  assert conv.grouped_filter_available() == vectorized.onednn_enabled(strict=True)


CHILD = r"""
import json, sys, types
import numpy as np, keras, tensorflow as tf
sys.path.insert(0, sys.argv[1])
import fixtures
from tf_dpnsgd.per_example import layerwise_engine, two_pass_engine
from tf_dpnsgd.per_example.layers import conv
from tf_dpnsgd import transforms

out = {"available": conv.grouped_filter_available()}
rng = np.random.default_rng(0)
errors = []
for kernel, strides, dilation, padding in [((3, 3), (1, 1), (1, 1), "same"),
                                           ((3, 3), (2, 2), (1, 1), "same"),
                                           ((3, 2), (1, 2), (1, 1), "valid"),
                                           ((3, 3), (1, 1), (2, 2), "same")]:
  x = tf.constant(rng.normal(size=(5, 9, 8, 3)), tf.float32)
  w = tf.Variable(rng.normal(size=kernel + (3, 4)), dtype=tf.float32)
  z = tf.nn.convolution(x, w, strides=strides, padding=padding.upper(), dilations=dilation)
  g = tf.constant(rng.normal(size=z.shape), tf.float32)
  got = conv.grouped_per_example_kernel_grads(x, g, kernel, strides, dilation, padding).numpy()
  for i in range(5):
    with tf.GradientTape() as tape:
      zi = tf.nn.convolution(tf.cast(x[i:i + 1], tf.float64), tf.cast(w, tf.float64),
                             strides=strides, padding=padding.upper(), dilations=dilation)
    exact = tape.gradient(zi, w, output_gradients=tf.cast(g[i:i + 1], tf.float64)).numpy()
    exact = np.transpose(exact.reshape(-1, 4))  # [q, p] in patch order
    errors.append(float(np.max(np.abs(got[i] - exact)) / np.max(np.abs(exact))))
out["kernel_grad_rel_err"] = max(errors)

# A NaN example keeps its NaN to its own block.
x = tf.constant(rng.normal(size=(3, 6, 6, 2)), tf.float32)
x = tf.tensor_scatter_nd_update(x, [[1, 2, 2, 0]], [float("nan")])
g = tf.constant(rng.normal(size=(3, 6, 6, 2)), tf.float32)
grads = conv.grouped_per_example_kernel_grads(x, g, (3, 3), (1, 1), (1, 1), "same").numpy()
out["nan_rows"] = [bool(np.isnan(grads[i]).any()) for i in range(3)]

# The engines (a convolution used twice, strides, a NaN example) against the loop oracle.
keras.utils.set_random_seed(3)
inputs = keras.Input((8, 8, 3))
shared = keras.layers.Conv2D(4, 3, padding="same")
h = shared(shared(keras.layers.Conv2D(4, 3, strides=2, padding="same")(inputs)))
h = keras.layers.GroupNormalization(groups=2)(h)
model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
xb = rng.normal(size=(6, 8, 8, 3)).astype("float32")
yb = rng.integers(0, 3, 6).astype("int32")
ce = lambda yt, yp: keras.losses.sparse_categorical_crossentropy(yt, yp, from_logits=True)
norms, summed = fixtures.normalized_sum_by_loop(
    model.trainable_variables,
    lambda i: tf.reduce_sum(ce(yb[i:i + 1], model(xb[i:i + 1], training=True))), 6, 0.1)
xn = xb.copy(); xn[4, 0, 0, 0] = np.nan
keep = [0, 1, 2, 3, 5]
_, summed_without = fixtures.normalized_sum_by_loop(
    model.trainable_variables,
    lambda j: tf.reduce_sum(ce(yb[keep[j]:keep[j] + 1], model(xb[keep[j]:keep[j] + 1], training=True))),
    5, 0.1)
for name, engine in [("bookkeeping", layerwise_engine), ("two_pass", two_pass_engine)]:
  for graph in (False, True):
    def call(xs, engine=engine):
      o = engine(model, ce, xs, tf.constant(yb), transforms.Normalize(0.1))
      return o.norms, o.factors, list(o.summed)
    call = tf.function(call) if graph else call
    run = lambda xs, call=call: types.SimpleNamespace(**dict(zip(("norms", "factors", "summed"), call(xs))))
    res = run(tf.constant(xb))
    fixtures.assert_engine_output(res, norms, summed, norm_rtol=1e-5, sum_rtol=1e-4)
    res = run(tf.constant(xn))
    assert np.isnan(res.norms.numpy()[4]) and float(res.factors.numpy()[4]) == 0.0
    for got, expected in zip(res.summed, summed_without):
      np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-6)
    out[f"{name}_{'graph' if graph else 'eager'}"] = "ok"
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_grouped_per_example_kernel_grads_and_engines_under_onednn():
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="3",
             CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
                 [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
  proc = zygote.run([sys.executable, "-c", CHILD, HERE], capture_output=True, text=True,
                    env=env, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[-1][len("RESULT "):])
  if not out["available"]:
    pytest.skip("no oneDNN on this machine: the grouped path is not used")
  assert out["kernel_grad_rel_err"] < 1e-5
  assert out["nan_rows"] == [False, True, False]
  for key in ("bookkeeping_eager", "bookkeeping_graph", "two_pass_eager", "two_pass_graph"):
    assert out[key] == "ok"
