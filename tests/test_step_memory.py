"""A DP train function holds no tensors between steps, on every per-example path.

Grappler folds ``tf.zeros`` of a static shape into a constant of the traced
function where it is under 10 MiB or is a loop's initial value, and a
function's constants stay allocated as long as the function lives: the DP step
of a MiniLM-size BERT held 176 MiB (a float64 zero per variable in the
weighted sum's float64 correction) between steps, 11% of a plain step's
tensors. The oracle here is the allocator itself: after ``fit``, dropping the
train function must free (almost) nothing. TensorFlow's CPU allocator reports
its statistics only with oneDNN on, so the check runs in a child process with
``TF_ENABLE_ONEDNN_OPTS=1`` (``conftest.py`` turns oneDNN off for the rest).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import tensorflow as tf

from tf_dpnsgd import noise as noise_lib

import zygote  # children forked from a pre-imported process (tests/zygote.py)

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import gc, json, sys
import keras, numpy as np, tensorflow as tf
import tf_dpnsgd
from tf_dpnsgd.plan import PrivacyPlan

try:
  tf.config.experimental.get_memory_info("CPU:0")
except ValueError:
  print("RESULT " + json.dumps({"available": False})); sys.exit(0)

def current():
  gc.collect()
  return tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20

N, B = 64, 16
rng = np.random.default_rng(0)
x, y = rng.normal(size=(N, 8, 32)).astype(np.float32), rng.integers(0, 10, N)
out = {"available": True}
for name, options, bands in json.loads(sys.argv[1]):
  keras.utils.set_random_seed(0)
  # Sequences of 8: the layer-wise engine's ghost norms, certified, with a float64 correction.
  base = keras.Sequential([keras.Input((8, 32)), keras.layers.Dense(1024, activation="tanh"),
                           keras.layers.Dense(1024, activation="tanh"),  # 4 MiB, 8 in float64
                           keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])
  plan = PrivacyPlan(dataset_size=N, batch_size=B, sampling="cyclic_poisson" if bands > 1
                     else "poisson", bands=bands, steps=4, noise_multiplier=1.0, delta=1e-5,
                     seed=1)
  model = tf_dpnsgd.make_private(base, plan=plan, **options)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=2, epochs=1, verbose=0)
  held = current()
  model.train_function = None
  model.make_train_function(force=True)
  out[name] = held - current()
print("RESULT " + json.dumps(out))
"""

CONFIGS = [
    ("bookkeeping", {"per_example": "layerwise"}, 1),
    ("two_pass", {"per_example": "two_pass"}, 1),
    ("physical_chunks", {"per_example": "layerwise", "physical_batch_size": 8}, 1),
    ("vectorized", {"per_example": "vectorized"}, 1),
    ("bandmf", {"per_example": "layerwise"}, 2),
]


@pytest.mark.slow
def test_the_train_function_holds_no_tensors_between_steps():
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="3",
             CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
                 [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
  proc = zygote.run([sys.executable, "-c", CHILD, json.dumps(CONFIGS)], capture_output=True,
                    text=True, env=env, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[-1][len("RESULT "):])
  if not out.pop("available"):
    pytest.skip("TensorFlow's CPU allocator statistics need oneDNN, which is not available")
  assert set(out) == {name for name, _, _ in CONFIGS}
  # Before the fix (HEAD 5a5c457): book-keeping and two passes 16 MiB (a folded float64 zero
  # per kernel), physical chunks 20, vectorized 266 (a zero of the per-example gradients).
  assert all(held < 1.0 for held in out.values()), json.dumps(out)


def test_each_noise_draw_waits_for_its_sum():
  """The draws depend on the seed only; ordered after their sums, they are not made at the
  start of the step and held through the per-example pass (a model-sized buffer)."""

  @tf.function
  def f(a, b):
    return noise_lib.add_gaussian_noise([a * 2.0, b * 3.0], 1.0, tf.constant([1, 2], tf.int64))

  graph = f.get_concrete_function(tf.TensorSpec([4]), tf.TensorSpec([2, 2])).graph

  def ancestors(op):
    seen, stack = set(), [op]
    while stack:
      o = stack.pop()
      for parent in [t.op for t in o.inputs] + list(o.control_inputs):
        if parent not in seen:
          seen.add(parent)
          stack.append(parent)
    return seen

  draws = sorted((op for op in graph.get_operations()
                  if op.type.startswith("StatelessRandomNormal")), key=lambda op: op.name)
  sums = [op for op in graph.get_operations() if op.type == "Mul"
          and op.inputs[0].op.type == "Placeholder"]
  assert len(draws) == len(sums) == 2
  a_sum, b_sum = sorted(sums, key=lambda op: op.inputs[0].op.name)
  for draw in draws:  # each draw after its own sum; the first does not wait for the second
    assert (a_sum in ancestors(draw)) != (b_sum in ancestors(draw)), draw.name
  assert {a_sum in ancestors(d) for d in draws} == {True, False}
