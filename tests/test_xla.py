"""XLA (``jit_compile=True``) runs the same DP step as graph mode, for both engines.

Oracles: the same model, the same initial weights and the same batches trained
without XLA (graph mode, itself checked against loops of single-example
gradients in test_per_example.py / test_layerwise.py); for the noise, draws
made directly with ``tf.random.stateless_normal`` from the user seed and the
ledger step, and their empirical moments.

Noise under XLA: the step's Gaussian draw is keyed by (user seed, ledger
step) in both modes, but XLA's stateless Philox normal sampler returns
different numbers from TensorFlow's graph kernel for the same seed (checked
here: both modes match their own oracle). So a fixed seed reproduces a run
only with the same ``jit_compile``; with noise 0 the two modes agree to float
round-off.

Compile times dominate (ResNet20-GN's XLA compile with the layer-wise engine
takes 30-130 s on a CPU), so the ResNet-GN case uses the family's smallest
member, ResNet8-GN (the same block and shortcut kinds), with one optimizer per engine; the
small conv net and the transformer run every (engine, optimizer) pair. The
vectorized engine and MultiHeadAttention: under oneDNN that engine refuses
the model (tests/conftest.py turns oneDNN off); the test accepts a refusal
that names the way out, and otherwise checks XLA against graph mode.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import noise as noise_lib
from tf_dpnsgd.plan import PrivacyPlan

# XLA compiles of ResNet20-GN and a transformer (seconds to a minute each)
pytestmark = pytest.mark.slow

XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS = 2
RTOL = 1e-5  # on the weights, relative (float32 round-off of a different op order)
UPDATE_RTOL = 1e-4  # on each variable's update, relative to its norm


def dpnsgd(noise=0.0, seed=None, lr=0.5):
  return tf_dpnsgd.DPNSGD(learning_rate=lr, regularizer=0.1, noise_multiplier=noise, seed=seed)


def dpsgd(noise=0.0, seed=None, lr=0.5):
  # clip 0.05: below most examples' gradient norm, so clipping is active.
  return tf_dpnsgd.DPSGD(learning_rate=lr, l2_norm_clip=0.05, noise_multiplier=noise, seed=seed)


OPTIMIZERS = {"dpnsgd": dpnsgd, "dpsgd": dpsgd}


# --- models and batches --------------------------------------------------------------
def small_conv():
  inputs = keras.Input((8, 8, 3))
  h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
  h = keras.layers.GroupNormalization(groups=2)(h)
  h = keras.layers.Activation("relu")(h)
  h = keras.layers.Conv2D(4, 3, strides=2)(h)
  h = keras.layers.GlobalAveragePooling2D()(h)
  return keras.Model(inputs, keras.layers.Dense(3)(h))


def resnet20():
  # depth 8, the family's smallest (was 20: the XLA compile took 134 s of the test's 166 s):
  # the stem, one identity shortcut and two stride-2 projection shortcuts, every layer kind
  # of ResNet20-GN. 8x8 images (was 16x16: XLA's CPU compile grows with the feature maps,
  # 32 -> 21 s of CPU for the layer-wise engine): the last stage still sees 2x2 maps, so
  # every tap of its 3x3 kernels meets a real pixel.
  return tf_dpnsgd.models.resnet20(input_shape=(8, 8, 3), num_classes=3, depth=8)


def tiny_bert():
  import keras_hub  # built from a config: random weights, no download

  # One encoder layer (was 2; every layer kind of the backbone, half the XLA compile).
  backbone = keras_hub.models.BertBackbone(vocabulary_size=40, num_layers=1, num_heads=2,
                                           hidden_dim=8, intermediate_dim=16,
                                           max_sequence_length=12, dropout=0.0)
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3,
                                             preprocessor=None, dropout=0.0)


def images(batch, size, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(batch, size, size, 3)).astype("float32"),
          rng.integers(0, 3, batch).astype("int32"))


def tokens(batch, seq=7, vocab=40, seed=0):
  rng = np.random.default_rng(seed)
  mask = np.ones((batch, seq), "int32")
  mask[1::2, seq - 3:] = 0  # padding in every other example
  x = {"token_ids": rng.integers(0, vocab, (batch, seq)).astype("int32"),
       "segment_ids": rng.integers(0, 2, (batch, seq)).astype("int32"), "padding_mask": mask}
  return x, rng.integers(0, 3, batch).astype("int32")


MODELS = {"small_conv": (small_conv, lambda: images(6, 8)),
          "resnet20": (resnet20, lambda: images(4, 8)),
          "tiny_bert": (tiny_bert, lambda: tokens(4))}


# --- helpers ---------------------------------------------------------------------------
_INITIAL_WEIGHTS = {}


def initial_weights(make):
  """The weights of ``make()`` under seed 7 (built once per model function: a copy each call)."""
  if make not in _INITIAL_WEIGHTS:
    keras.utils.set_random_seed(7)
    _INITIAL_WEIGHTS[make] = [w.copy() for w in make().get_weights()]
  return [w.copy() for w in _INITIAL_WEIGHTS[make]]


def train(make, init, engine, optimizer, x, y, jit_compile, **dp_options):
  """Trains ``STEPS`` steps from ``init``; returns (model, trainable weights after, trainable
  weights before the first step)."""
  base = make()
  base.set_weights(init)
  model = tf_dpnsgd.make_private(base, per_example=engine, trust_untagged_batches=True,
                                 **dp_options)  # hand-made batches
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.compile(optimizer=optimizer, loss=XENT, jit_compile=jit_compile)
  assert bool(model.jit_compile) == jit_compile  # Keras may silently turn XLA off
  for _ in range(STEPS):
    model.train_on_batch(x, y)
  return model, [v.numpy() for v in model.trainable_variables], before


def assert_same_step(make, engine, optimizer_fn, x, y, **dp_options):
  init = initial_weights(make)
  graph, w_graph, before = train(make, init, engine, optimizer_fn(), x, y, False, **dp_options)
  xla, w_xla, xla_before = train(make, init, engine, optimizer_fn(), x, y, True, **dp_options)
  # Both runs started from ``init`` (the trainable part; was a third model built to read it).
  for a, b in zip(xla_before, before):
    np.testing.assert_array_equal(a, b)
  moved = [np.linalg.norm(a - b) for a, b in zip(w_graph, before)]
  assert sum(m > 0 for m in moved) >= len(moved) // 2 and max(moved) > 1e-3, moved
  for a, b, w0, var in zip(w_xla, w_graph, before, graph.trainable_variables):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * max(1.0, float(np.abs(w0).max())),
                               err_msg=var.path)
    diff = np.linalg.norm((a - w0) - (b - w0))
    assert diff <= UPDATE_RTOL * np.linalg.norm(b - w0) + 1e-7, (var.path, diff)
  for model in (graph, xla):  # one ledger step per executed step, in both modes
    assert model.privacy_ledger.steps == STEPS
    assert int(model.optimizer.iterations.numpy()) == STEPS


# --- noise 0: XLA equals graph mode -------------------------------------------------------
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("engine", ["vectorized", "layerwise"])
def test_small_conv_xla_step_equals_graph_step(engine, optimizer):
  make, data = MODELS["small_conv"]
  assert_same_step(make, engine, OPTIMIZERS[optimizer], *data())


def test_physical_batches_under_xla_equal_graph_step():
  """The chunked step (tf.while_loop over physical batches) compiles and agrees."""
  make, data = MODELS["small_conv"]
  assert_same_step(make, "layerwise", dpnsgd, *data(), physical_batch_size=4)


@pytest.mark.parametrize("engine,optimizer", [("vectorized", "dpsgd"), ("layerwise", "dpnsgd")])
def test_resnet20_gn_xla_step_equals_graph_step(engine, optimizer):
  make, data = MODELS["resnet20"]
  assert_same_step(make, engine, OPTIMIZERS[optimizer], *data())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_transformer_xla_step_equals_graph_step_layerwise(optimizer):
  make, data = MODELS["tiny_bert"]
  assert_same_step(make, "layerwise", OPTIMIZERS[optimizer], *data())


def test_transformer_vectorized_refuses_or_matches_under_xla():
  """MultiHeadAttention: the vectorized engine refuses it (under oneDNN) or is exact."""
  make, data = MODELS["tiny_bert"]
  x, y = data()
  try:
    tf_dpnsgd.make_private(make(), per_example="vectorized").compile(
        optimizer=dpnsgd(), loss=XENT, jit_compile=True)
  except (ValueError, NotImplementedError) as exc:
    assert "layerwise" in str(exc), exc  # a refusal says what to do
    return
  assert_same_step(make, "vectorized", dpnsgd, x, y)


# --- noise under XLA ---------------------------------------------------------------------
SIGMA = 1e5  # the noise dwarfs the signal: |each summed coordinate| <= B < 1e-3 * SIGMA
SEED = 20240601


def oracle_noise(step, shapes, jit_compile):
  """The step's N(0, 1) draws, from the seed and the ledger's (generation 0, step) with TF's
  own ops (a user-fixed seed leaves the lineage out of the key: tf_dpnsgd.ledger)."""

  def draws():
    base = tf.constant([SEED, noise_lib.NOISE_TAG], tf.int64)
    generation = tf.random.experimental.stateless_fold_in(base, tf.constant(0, tf.int64))
    step_seed = tf.random.experimental.stateless_fold_in(generation,
                                                         tf.constant(step, tf.int64))
    return [tf.random.stateless_normal(shape, tf.random.experimental.stateless_fold_in(
        step_seed, k), alg="philox") for k, shape in enumerate(shapes)]

  return [d.numpy() for d in tf.function(draws, jit_compile=jit_compile)()]


def noise_model():
  inputs = keras.Input((6, 6, 2))
  h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
  h = keras.layers.GroupNormalization(groups=2)(h)
  h = keras.layers.Flatten()(h)
  h = keras.layers.Dense(96, activation="relu")(h)  # 13.9k of the ~14.2k parameters
  return keras.Model(inputs, keras.layers.Dense(3)(h))


class _Snapshots(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.weights = []

  def on_train_batch_end(self, batch, logs=None):
    self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])


@pytest.mark.parametrize("engine", ["vectorized", "layerwise"])
def test_xla_step_adds_the_plans_noise_keyed_by_the_ledger_step(engine):
  rng = np.random.default_rng(3)
  x = rng.normal(size=(16, 6, 6, 2)).astype("float32")
  y = rng.integers(0, 3, 16).astype("int32")
  plan = PrivacyPlan(dataset_size=16, batch_size=8, sampling="poisson", steps=STEPS,
                     noise_multiplier=SIGMA, delta=1e-5, seed=5)
  # lr = B / sigma: each step moves every weight by exactly its N(0, 1) draw (+- 1e-3).
  lr = plan.batch_size / SIGMA
  init = initial_weights(noise_model)
  runs = {}
  for jit in (False, True):
    base = noise_model()
    base.set_weights(init)
    model = tf_dpnsgd.make_private(base, per_example=engine)
    before = [v.numpy().copy() for v in model.trainable_variables]  # = init's trainable part
    model.compile(optimizer=dpnsgd(noise=SIGMA, seed=SEED, lr=lr), loss=XENT, jit_compile=jit)
    snaps = _Snapshots()
    model.fit(plan.dataset(x, y, model=model), callbacks=[snaps] + plan.callbacks(),
              verbose=0, **plan.fit_kwargs(model))
    assert model.privacy_ledger.steps == STEPS and len(snaps.weights) == STEPS
    weights = [before] + snaps.weights
    runs[jit] = (model, [[b - a for a, b in zip(weights[t + 1], weights[t])]  # = z_t
                         for t in range(STEPS)])
  shapes = [v.shape for v in runs[True][0].trainable_variables]
  for jit, (model, noise) in runs.items():
    for t in range(STEPS):
      expected = oracle_noise(t, shapes, jit_compile=jit)
      for got, want in zip(noise[t], expected):
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
  # The XLA draws are N(0, 1) (moments of ~14k draws) and fresh at each step.
  z = [np.concatenate([n.ravel() for n in step]) for step in runs[True][1]]
  for draw in z:
    assert abs(draw.mean()) < 0.05 and abs(draw.std() - 1.0) < 0.03, (draw.mean(), draw.std())
  assert abs(np.corrcoef(z[0], z[1])[0, 1]) < 0.05
  # Both modes executed, and report, the same private steps.
  assert runs[True][0].privacy_ledger.steps == runs[False][0].privacy_ledger.steps == STEPS
  assert plan.report(runs[True][0]).epsilon == plan.report(runs[False][0]).epsilon
