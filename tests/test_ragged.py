"""Ragged inputs (a bag-of-words ``Embedding`` over a ``tf.RaggedTensor``, one of
tensorflow-privacy's own test configurations) through the whole DP path.

The microbatch engine is exact on them (one example at a time), and ``"auto"``
picks it for ragged inputs; the layer-wise and vectorized engines refuse them
before any update, with a message that says what to do. Oracle: a loop of
single-example gradients with an ordinary tape, normalized by hand (DP-NSGD at
noise 0: ``w - lr * sum_i g_i / (r + ||g_i||) / B``).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import interaction
from tf_dpnsgd.interaction import ExampleInteractionError

LR, R = 0.5, 0.01
XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Bag(keras.Model):
  """Mean of the embeddings of a variable number of ids per example (tf-privacy's config)."""

  def __init__(self, mix=False):
    super().__init__()
    self.mix = mix
    self.emb = keras.layers.Embedding(12, 4)
    self.out = keras.layers.Dense(3)

  def call(self, ids):
    h = tf.reduce_mean(self.emb(ids), axis=1)
    if self.mix:  # centring by the batch mean: examples interact
      h = h - tf.reduce_mean(h, axis=0, keepdims=True)
    return self.out(h)


def ragged_ids(n=6, seed=0):
  rng = np.random.default_rng(seed)
  rows = [list(rng.integers(1, 12, size=rng.integers(1, 6))) for _ in range(n)]
  rows[1] = rows[0] + [0]  # same ids plus a trailing 0: a different example
  return tf.ragged.constant(rows, dtype=tf.int32)


def labels(n, seed=0):
  return np.random.default_rng(seed + 1).integers(0, 3, n).astype("int32")


def built(model, x):
  model(x[:2])
  return model


def oracle_step(model, x, y, rows, denominator):
  """Weights after one DP-NSGD step at noise 0 from single-example gradients of ``rows``."""
  variables = model.trainable_variables
  summed = [np.zeros(v.shape, np.float64) for v in variables]
  for i in rows:
    with tf.GradientTape() as tape:
      loss = XENT(y[i:i + 1], model(x[i:i + 1], training=True))
    grads = [np.asarray(tf.convert_to_tensor(g), np.float64)
             for g in tape.gradient(loss, variables)]
    h = 1.0 / (R + np.sqrt(sum(np.sum(g ** 2) for g in grads)))
    summed = [s + h * g for s, g in zip(summed, grads)]
  return [v.numpy() - LR * s / denominator for v, s in zip(variables, summed)]


def private(base, per_example, **kwargs):
  model = tf_dpnsgd.make_private(base, per_example=per_example, **kwargs)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=LR, regularizer=R,
                                           noise_multiplier=0.0), loss=XENT)
  return model


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["microbatch", "auto"])
def test_one_step_on_ragged_ids_is_the_single_example_loop(engine):
  x, y = ragged_ids(), labels(6)
  base = built(Bag(), x)
  before = [v.numpy() for v in base.trainable_variables]
  expected = oracle_step(base, x, y, range(6), 6.0)
  model = private(base, engine)
  model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
  got = [v.numpy() for v in base.trainable_variables]
  assert any(not np.allclose(g, b) for g, b in zip(got, before))  # the step did something
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_masked_rows_and_physical_chunks_on_ragged_ids():
  """A Poisson-style batch (dp_mask, dp_denominator) in chunks of 4: masked rows contribute
  exactly nothing (here replaced by other ids), the denominator is the plan's."""
  x, y = ragged_ids(10), labels(10)
  mask = np.arange(10) < 7
  base = built(Bag(), x)
  before = [v.numpy() for v in base.trainable_variables]
  expected = oracle_step(base, x, y, range(7), 8.0)
  model = private(base, "microbatch", physical_batch_size=4, trust_untagged_batches=True)
  x_other = tf.concat([x[:7], ragged_ids(3, seed=9)], axis=0)  # padding rows: other ids
  batch = (x_other, y, {"dp_mask": mask, "dp_denominator": np.float32(8.0)})
  model.fit(tf.data.Dataset.from_tensors(batch), epochs=1, verbose=0)
  got = [v.numpy() for v in base.trainable_variables]
  assert any(not np.allclose(g, b) for g, b in zip(got, before))  # the step did something
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_plan_dataset_and_one_call_fit_on_ragged_ids():
  """The plan's Poisson batches of ragged rows are the rows its sampler drew; the one-call
  path trains on them and counts the steps."""
  n = 40
  x, y = ragged_ids(n, seed=3), labels(n, seed=3)
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=n, batch_size=8, epochs=1, noise_multiplier=1.0,
                               delta=1e-5, sampling="poisson")
  batches = list(plan.dataset(x, y).take(3))
  assert len(batches) == 3
  rows = x.to_list()
  for step, (xb, yb, tags) in enumerate(batches):
    idx = plan.sampler.indices(step)
    assert isinstance(xb, tf.RaggedTensor)
    assert tags["dp_mask"].numpy().sum() == len(idx) > 0
    assert xb.to_list()[:len(idx)] == [rows[i] for i in idx]
    np.testing.assert_array_equal(yb.numpy()[:len(idx)], y[idx])
  base = built(Bag(), x)
  model = tf_dpnsgd.make_private(base, noise_multiplier=1.0, delta=1e-5, batch_size=8,
                                 epochs=1)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=R), loss=XENT)
  model.fit(x, y, verbose=0)
  report = model.privacy_report()
  assert report.steps == 5 and report.epsilon > 0


@pytest.mark.parametrize("engine,error", [  # quick: the layer-wise engine (issue 47)
    ("layerwise", tf_dpnsgd.per_example.UnsupportedLayerError),
    pytest.param("vectorized", ValueError, marks=pytest.mark.slow)])
def test_layerwise_and_vectorized_refuse_ragged_ids_before_any_update(engine, error):
  x, y = ragged_ids(), labels(6)
  base = built(Bag(), x)
  before = [v.numpy() for v in base.trainable_variables]
  model = private(base, engine)
  with pytest.raises(error, match="microbatch") as info:
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
  assert "mask_zero=True" in str(info.value)  # or pad and mask
  for a, b in zip(before, base.trainable_variables):
    np.testing.assert_array_equal(a, b.numpy())
  assert int(model.privacy_ledger.steps) == 0


@pytest.mark.slow
def test_interaction_probe_sees_ragged_rows():
  """Rows that differ only in length ([a, b] vs [a, b, 0]) are different examples; a model
  that centres a ragged batch by its mean is refused before any update."""
  x, y = ragged_ids(), labels(6)
  differs = interaction._row_differs(x, x[0:1])
  np.testing.assert_array_equal(differs.numpy(), [False, True] + [True] * 4)
  ok = interaction.model_forward_losses(built(Bag(), x), XENT.call)
  bad = interaction.model_forward_losses(built(Bag(mix=True), x), XENT.call)
  assert bool(interaction.probe_interaction(ok, x, y).tested)
  assert not bool(interaction.probe_interaction(ok, x, y).interacting)
  assert bool(interaction.probe_interaction(bad, x, y).interacting)
  base = built(Bag(mix=True), x)
  before = [v.numpy() for v in base.trainable_variables]
  model = private(base, "microbatch")
  with pytest.raises(ExampleInteractionError):
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
  for a, b in zip(before, base.trainable_variables):
    np.testing.assert_array_equal(a, b.numpy())


def test_gradient_only_mixing_of_ragged_float_inputs_is_caught():
  """Ragged float features: a stop_gradient trick leaves the losses per example but mixes
  the gradients; the probe differentiates through the ragged values and refuses it."""
  x = tf.ragged.constant([[0.5, -1.0], [2.0], [0.1, 0.2, 0.3], [1.5, -0.5], [3.0], [0.7, 0.1]],
                         dtype=tf.float32)
  y = labels(6)

  def forward(mix):
    dense = keras.layers.Dense(3)

    def fn(xb, yb):
      h = tf.reduce_mean(xb, axis=1)[:, None]
      if mix:
        m = tf.reduce_mean(h, axis=0, keepdims=True)
        h = h + (m - tf.stop_gradient(m))
      return XENT.call(yb, dense(h))
    return fn

  clean = interaction.probe_interaction(forward(False), x, y)
  mixed = interaction.probe_interaction(forward(True), x, y)
  assert bool(clean.tested) and not bool(clean.interacting)
  assert bool(mixed.interacting) and float(mixed.gradient_score) > 1.0
  assert float(mixed.value_score) <= 1.0  # only the gradient check sees it


def test_sparse_inputs_are_refused_with_advice_before_any_update():
  """No engine slices a tf.SparseTensor per example: refused with what to do (dense rows, or
  ragged ids), at fit before any update and by each engine called directly."""
  from tf_dpnsgd.per_example import ENGINES
  x = tf.sparse.from_dense(tf.constant(np.eye(6, 5, dtype=np.float32)))
  y = labels(6)

  class Densify(keras.Model):
    def __init__(self):
      super().__init__()
      self.out = keras.layers.Dense(3)

    def call(self, inputs):
      return self.out(tf.sparse.to_dense(inputs) if isinstance(inputs, tf.SparseTensor)
                      else inputs)

  base = Densify()
  base(tf.sparse.to_dense(x))
  before = [v.numpy() for v in base.trainable_variables]
  model = private(base, "microbatch")
  with pytest.raises(ValueError, match="tf.sparse.to_dense"):
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
  for a, b in zip(before, base.trainable_variables):
    np.testing.assert_array_equal(a, b.numpy())
  transform = tf_dpnsgd.transforms.Normalize(R)
  for name, engine in ENGINES.items():
    with pytest.raises(ValueError, match="SparseTensor"):
      engine(base, XENT.call, x, tf.constant(y), transform)


def test_auto_keeps_its_dense_choice_and_routes_only_ragged_batches_to_microbatch(caplog):
  """The same 'auto' engine: layer-wise for padded ids (no warning), microbatch for ragged."""
  import logging
  from tf_dpnsgd.per_example import layerwise_engine, resolve_engine
  from tf_dpnsgd.transforms import Normalize
  x = ragged_ids()
  model = built(Bag(), x)
  engine = resolve_engine(model, "auto")
  assert engine.dense_engine.func is layerwise_engine  # mode="auto": by memory
  with caplog.at_level(logging.WARNING, logger="tf_dpnsgd.per_example"):
    engine(model, XENT.call, x.to_tensor(), tf.constant(labels(6)), Normalize(R))
    assert not caplog.records
    engine(model, XENT.call, x, tf.constant(labels(6)), Normalize(R))
  assert any("ragged" in r.getMessage() for r in caplog.records)
