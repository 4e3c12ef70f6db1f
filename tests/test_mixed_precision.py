"""Mixed precision (mixed_float16 / mixed_bfloat16) in the DP step.

Oracles: per-example gradients of a float32 copy of the model (same weights),
one example at a time with an ordinary tape, transformed in float64 numpy;
the float32 policy's own step for the comparison of whole steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import loss_scale as loss_scale_lib

POLICIES = ("mixed_float16", "mixed_bfloat16")
ENGINE_NAMES = ("vectorized", "layerwise")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def restore_policy():
  old = keras.mixed_precision.global_policy()
  yield
  keras.mixed_precision.set_global_policy(old)


def build(policy, engine, weights=None):
  """A small conv + dense DPModel, every layer under ``policy``."""
  keras.mixed_precision.set_global_policy(policy)
  inp = keras.Input((6, 6, 2))
  h = keras.layers.Conv2D(3, 3, activation="relu")(inp)  # unbounded: large inputs overflow
  h = keras.layers.Flatten()(h)
  h = keras.layers.Dense(5, activation="relu")(h)
  out = keras.layers.Dense(3)(h)
  model = tf_dpnsgd.DPModel(inp, out, per_example=engine,
                            trust_untagged_batches=True)  # hand-made batches
  if weights is not None:
    for v, w in zip(model.trainable_variables, weights, strict=True):
      v.assign(w)
  return model


def float32_weights():
  model = build("float32", "vectorized")
  return model, trainable(model)


def optimizer(kind, noise=0.0, lr=1.0):
  if kind == "nsgd":
    return tf_dpnsgd.DPNSGD(lr, regularizer=0.1, noise_multiplier=noise)
  return tf_dpnsgd.DPSGD(lr, l2_norm_clip=0.5, noise_multiplier=noise)


def data(n=8, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, 6, 6, 2)).astype("float32"),
          rng.integers(0, 3, size=n).astype("int32"))


def oracle_contributions(model32, x, y, transform):
  """Per-example ``h_i g_i`` from float32 single-example gradients, in float64."""
  out = []
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(LOSS.call(y[i:i + 1], model32(x[i:i + 1], training=True)))
    g = np.concatenate([np.asarray(t, np.float64).ravel()
                        for t in tape.gradient(loss, model32.trainable_variables)])
    n = np.linalg.norm(g)
    if isinstance(transform, transforms.Normalize):
      h = 1.0 / (transform.regularizer + n)
    else:
      h = min(1.0, transform.l2_norm_clip / n) if n > 0 else 1.0
    out.append(h * g)
  return np.stack(out)


def trainable(model):
  return [np.asarray(v) for v in model.trainable_variables]


def flat(tensors):
  return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])


# --- (1) compile + fit -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nsgd", "sgd"])
@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("policy", POLICIES)
def test_fit_runs_under_mixed_policy(policy, engine, kind):
  model = build(policy, engine)
  model.compile(optimizer=optimizer(kind, noise=1.0, lr=0.1), loss=LOSS)
  assert isinstance(model.optimizer, tf_dpnsgd.PrivateOptimizer)  # not a LossScaleOptimizer
  assert model.loss_scale == (128.0 if policy == "mixed_float16" else 1.0)
  before = model.get_weights()
  x, y = data(8)
  history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert np.isfinite(history.history["loss"][0])
  assert int(model.privacy_ledger.step()) == 2
  assert history.history["nonfinite_examples"][0] == 0.0
  assert all(v.dtype == "float32" for v in model.trainable_variables)
  after = model.get_weights()
  assert all(np.all(np.isfinite(w)) for w in after)
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))


# --- (2) the sensitivity bound at large magnitudes, against the float32 oracle -----------------
MAGNITUDES = np.array([1.0, 1.0, 1e2, 1e4, 1e6, 1.0], np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nsgd", "sgd"])
@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("policy", POLICIES)
def test_each_contribution_respects_the_bound(policy, engine, kind):
  model32, weights = float32_weights()
  model = build(policy, engine, weights)
  model.compile(optimizer=optimizer(kind), loss=LOSS)
  transform = model.optimizer.transform
  x, y = data(len(MAGNITUDES), seed=1)
  x = x * MAGNITUDES[:, None, None, None]
  oracle = oracle_contributions(model32, x, y, transform)

  @tf.function
  def fn(mask):
    out = model._contributions(x, y, mask, None)  # the train step's phase 2
    return out.summed, out.norms, out.factors

  bound = transform.sensitivity
  for i in range(len(x)):
    summed, norms, factors = fn(tf.constant(np.arange(len(x)) == i))  # only example i counts
    c = flat(summed)
    norm = np.linalg.norm(c)  # float64 norm of the float32 contribution
    assert norm <= bound, (i, norm)
    assert np.isfinite(norms[i]) or MAGNITUDES[i] > 1.0  # ordinary inputs never overflow
    if not np.isfinite(norms[i]):  # overflowed in 16 bits: exactly zero, never partial
      assert norm == 0.0 and factors[i] == 0.0
      continue
    assert factors[i] > 0
    # Same norm as the float32 contribution (normalization/clipping acted on the unscaled
    # gradient: a scaled norm would give a factor 128x too small).
    np.testing.assert_allclose(norm, np.linalg.norm(oracle[i]), rtol=2e-2, atol=1e-6 * bound)
    if MAGNITUDES[i] == 1.0:  # ordinary inputs: the float32 contribution up to 16-bit rounding
      tol = 1e-2 if policy == "mixed_float16" else 3e-2
      np.testing.assert_allclose(c, oracle[i], atol=tol * bound)
  if policy == "mixed_float16":
    assert not np.isfinite(norms[4])  # 1e6 > float16 max (65504): dropped, not clipped
  else:
    assert np.all(np.isfinite(norms))  # bfloat16 has float32's range


# --- (3) with noise 0, the step equals the float32 policy's step up to 16-bit rounding --------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nsgd", "sgd"])
@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("policy", POLICIES)
def test_step_matches_float32(policy, engine, kind):
  _, weights = float32_weights()
  x, y = data(8, seed=2)
  deltas = {}
  for name in ("float32", policy):
    model = build(name, engine, weights)
    model.compile(optimizer=optimizer(kind, noise=0.0, lr=1.0), loss=LOSS)
    model.train_on_batch(x, y)
    deltas[name] = flat(trainable(model)) - flat(weights)
  bound = optimizer(kind).transform.sensitivity
  reference = deltas["float32"]
  assert np.linalg.norm(reference) > 0.1 * bound  # a real step, not a vacuous comparison
  tol = 2e-3 if policy == "mixed_float16" else 1e-2  # ~4 and ~3 units of 16-bit rounding
  assert np.linalg.norm(deltas[policy] - reference) <= tol * bound


@pytest.mark.slow
def test_chunked_step_matches_float32_under_float16():
  _, weights = float32_weights()
  x, y = data(8, seed=3)
  deltas = []
  for policy in ("float32", "mixed_float16"):
    model = build(policy, "layerwise", weights)
    model = tf_dpnsgd.DPModel(model.inputs, model.outputs, per_example="vectorized",
                              trust_untagged_batches=True,
                              physical_batch_size=3)
    model.compile(optimizer=optimizer("nsgd"), loss=LOSS)
    model.train_on_batch(x, y)
    deltas.append(flat(trainable(model)) - flat(weights))
  assert np.linalg.norm(deltas[0]) > 0.1
  assert np.linalg.norm(deltas[1] - deltas[0]) <= 2e-3


# --- (4) no data-dependent state: fixed scale, no skipped step ---------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_no_state_depends_on_the_data(engine):
  _, weights = float32_weights()
  x, y = data(4, seed=4)
  runs = {}
  for name, magnitude in (("ordinary", 1.0), ("overflow", 1e6)):  # 1e6 > float16 max
    model = build("mixed_float16", engine, weights)
    model.compile(optimizer=optimizer("nsgd", noise=1.0, lr=0.1), loss=LOSS)
    logs = model.train_on_batch(x * magnitude, y, return_dict=True)
    runs[name] = (model, logs)
  assert runs["ordinary"][1]["nonfinite_examples"] == 0
  assert runs["overflow"][1]["nonfinite_examples"] == 4  # every example overflowed
  for model, _ in runs.values():
    assert model.loss_scale == loss_scale_lib.DEFAULT_FLOAT16_LOSS_SCALE
    assert int(model.optimizer.iterations) == 1  # the step was taken, not skipped
    assert int(model.privacy_ledger.step()) == 1
    assert not any("scale" in v.path for v in model.variables + model.optimizer.variables)
  ordinary, overflow = runs["ordinary"][0], runs["overflow"][0]
  # The noise still moved the weights: an all-overflow batch is a step of pure noise.
  assert not np.array_equal(flat(trainable(overflow)), flat(weights))
  # Identical optimizer state (names and values) whatever the data.
  state = [[(v.name, np.asarray(v).tolist()) for v in m.optimizer.variables]
           for m in (ordinary, overflow)]
  assert state[0] == state[1]


# --- refusals and the pure pieces ---------------------------------------------------------------
def test_refuses_keras_dynamic_loss_scaling():
  model = build("mixed_float16", "vectorized")
  with pytest.raises(ValueError, match="LossScaleOptimizer.*depend on the data"):
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer("nsgd")), loss=LOSS)
  with pytest.raises(ValueError, match="auto_scale_loss"):
    model.compile(optimizer=optimizer("nsgd"), loss=LOSS, auto_scale_loss=True)
  model.compile(optimizer=optimizer("nsgd"), loss=LOSS, auto_scale_loss=False)
  assert isinstance(model.optimizer, tf_dpnsgd.PrivateOptimizer)


@pytest.mark.parametrize("bad", [0, 0.5, 3, 2.0 ** 25, True, float("nan"), float("inf"), "x"])
def test_loss_scale_must_be_a_power_of_two(bad):
  with pytest.raises(ValueError, match="power of two"):
    loss_scale_lib.validate_loss_scale(bad)


def test_loss_scale_option_and_round_trip():
  model = build("mixed_float16", "layerwise")
  model.compile(optimizer=optimizer("sgd"), loss=LOSS, loss_scale=16)
  assert model.loss_scale == 16.0
  other = build("mixed_float16", "layerwise")
  other.compile_from_config(model.get_compile_config())
  assert other.loss_scale == 16.0
  with pytest.raises(ValueError, match="power of two"):
    other.compile(optimizer=optimizer("sgd"), loss=LOSS, loss_scale=100)
  float32 = build("float32", "layerwise")
  float32.compile(optimizer=optimizer("sgd"), loss=LOSS)
  assert float32.loss_scale == 1.0


@pytest.mark.parametrize("transform", [transforms.Normalize(0.1), transforms.Clip(0.5)])
def test_unscaled_factors_are_exact(transform):
  norms = tf.constant([0.0, 1e-30, 1e-3, 0.7, 3.0, 1e6, 1e30, float("inf"), float("nan")])
  for scale in (2.0, 128.0, 2.0 ** 24):
    scaled = loss_scale_lib.Unscaled(transform, scale)
    assert scaled.sensitivity == transform.sensitivity
    got = scaled.factors(norms * scale) * scale  # norms of the scaled gradient
    # Power-of-two scaling is exact: bit-identical to the transform of the unscaled norms.
    np.testing.assert_array_equal(got.numpy(), transform.factors(norms).numpy())
  expected = 1.0 / (0.1 + 3.0 * (1 + transforms.NORM_SAFETY_MARGIN)) \
      if isinstance(transform, transforms.Normalize) else 0.5 / (3.0 * (1 + 1e-6))
  np.testing.assert_allclose(transform.factors(norms).numpy()[4], expected, rtol=1e-6)


def build_text(policy, weights=None):
  """Embedding + LayerNormalization + GroupNormalization + Dense: the other layer-wise rules."""
  keras.mixed_precision.set_global_policy(policy)
  inp = keras.Input((5,), dtype="int32")
  h = keras.layers.Embedding(11, 4)(inp)
  h = keras.layers.LayerNormalization()(h)
  h = keras.layers.GroupNormalization(groups=2)(h)
  h = keras.layers.GlobalAveragePooling1D()(h)
  out = keras.layers.Dense(3)(h)
  model = tf_dpnsgd.DPModel(inp, out, per_example="layerwise",
                            trust_untagged_batches=True)  # hand-made batches
  if weights is not None:
    for v, w in zip(model.trainable_variables, weights, strict=True):
      v.assign(w)
  return model


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_layerwise_norm_and_embedding_rules_match_float32(policy):
  weights = trainable(build_text("float32"))
  rng = np.random.default_rng(5)
  x, y = rng.integers(0, 11, size=(8, 5)).astype("int32"), rng.integers(0, 3, size=8)
  deltas = []
  for name in ("float32", policy):
    model = build_text(name, weights)
    model.compile(optimizer=optimizer("sgd"), loss=LOSS)
    model.train_on_batch(x, y)
    deltas.append(flat(trainable(model)) - flat(weights))
  assert np.linalg.norm(deltas[0]) > 0.05
  tol = 2e-3 if policy == "mixed_float16" else 1e-2
  assert np.linalg.norm(deltas[1] - deltas[0]) <= tol * 0.5
