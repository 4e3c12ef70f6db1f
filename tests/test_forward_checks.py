"""The DP step trains only on forward passes it can verify (issue 19, scenarios 4, 5, 8).

4. a layer that writes a variable in the training forward pass (running mean,
   data-dependent initialization, raw tf.Variable, tf.random.Generator) is refused
   by every engine and by the host check, before anything is written;
5. tokens folded into the batch axis before a Dense are refused by a static check
   on the host, which XLA cannot drop (in the step the check is an in-graph
   assertion that jit_compile=True removes);
8. the interaction probe freezes every random op, so a REINFORCE loss with a
   batch-mean baseline behind stop_gradient plus a raw tf.nn.dropout is caught,
   and a forward pass that cannot be reproduced is refused (fail closed).

Oracles: a loop of single-example gradients (clipped and summed) and a
replace-one-example measurement of that sum.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import forward_checks
from tf_dpnsgd import interaction
from tf_dpnsgd import losses as losses_lib
from tf_dpnsgd import per_example
from tf_dpnsgd import transforms
from tf_dpnsgd.forward_checks import ForwardNotReproducibleError, StateWriteError
from tf_dpnsgd.per_example import UnsupportedLayerError
import tiers

XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ENGINES = ("layerwise", "vectorized", "microbatch")


def data(n=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 5)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def dpsgd(clip=1.0, noise=0.0):
  return tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=clip, noise_multiplier=noise)


def weights_of(m):
  return [np.array(w) for w in m.get_weights()]


def norm(tensors):
  return float(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float64)))
                                 for t in tensors])))


# --- scenario 4: state writes in the training forward pass ------------------------------
class RunningMean(keras.layers.Layer):
  """Centres by a running mean of the batches it saw (updated after use: no interaction)."""

  def build(self, shape):
    self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                name="mean")

  def call(self, x, training=None):
    out = x - self.mean
    if training:
      self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=0))
    return out


class DataDependentInit(keras.layers.Layer):
  """Sets its scale from the first training batch's standard deviation (once)."""

  def build(self, shape):
    self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", trainable=False,
                                 name="scale")
    self.initialized = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                       name="initialized")

  def call(self, x, training=None):
    if training:
      first = keras.ops.equal(self.initialized, 0.0)
      new = keras.ops.where(first, 1.0 / (keras.ops.std(x, axis=0) + 1e-3), self.scale)
      self.scale.assign(new)
      self.initialized.assign(1.0)
    return x * self.scale


class RawCounter(keras.layers.Layer):
  """Writes a raw tf.Variable (bypassing Keras' variable API) in the forward pass."""

  def build(self, shape):
    self.total = tf.Variable(tf.zeros([shape[-1]]), trainable=False)

  def call(self, x, training=None):
    if training:
      self.total.assign_add(tf.reduce_sum(x, axis=0))
    return x


class GeneratorNoise(keras.layers.Layer):
  """Noise from a tf.random.Generator: its state is a variable the pass writes."""

  def build(self, shape):
    self.generator = tf.random.Generator.from_seed(1)

  def call(self, x, training=None):
    return x + 0.01 * self.generator.normal(tf.shape(x)) if training else x


def layer_state(layer):
  """Every variable the writer layers own, as numpy (Keras, raw and generator state)."""
  variables = list(layer.weights)
  if isinstance(layer, RawCounter):
    variables.append(layer.total)
  if isinstance(layer, GeneratorNoise):
    variables.append(layer.generator.state)
  return [np.array(v) for v in variables]


def writer_model(layer, engine="layerwise", dropout=False):
  """The user declares the layer's state public (say, set from public data before training),
  which passes the compile-time coverage check; the write in training must still be refused."""
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  h = layer(keras.layers.Dense(4, activation="tanh")(inp))
  if dropout:
    h = keras.layers.Dropout(0.3)(h)
  return tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(h), per_example=engine,
                           public_state=[layer.name])


@pytest.mark.parametrize("engine,jit", [(e, False) for e in ENGINES] + [("layerwise", True)])
def test_running_mean_layer_is_refused_by_fit_and_nothing_is_written(engine, jit):
  x, y = data()
  layer = RunningMean()
  m = writer_model(layer, engine)
  m.compile(optimizer=dpsgd(), loss=XENT, jit_compile=jit)
  before = weights_of(m)
  with pytest.raises(StateWriteError, match="running_mean"):
    m.fit(x, y, batch_size=16, epochs=1, verbose=0)
  np.testing.assert_array_equal(layer.mean.numpy(), np.zeros(4))  # no exact statistic kept
  for a, b in zip(before, weights_of(m)):
    np.testing.assert_array_equal(a, b)
  assert int(m.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("layer_cls,engine", tiers.quick_cover(
    [RunningMean, DataDependentInit, RawCounter, GeneratorNoise], ENGINES,
    ids=[["RunningMean", "DataDependentInit", "RawCounter", "GeneratorNoise"], None]))
def test_engines_refuse_writes_while_tracing(engine, layer_cls):
  """Even without the probe or the host check, the engine's traced step refuses."""
  x, y = data(8)
  layer = layer_cls()
  m = writer_model(layer, engine)
  m(x)
  before = layer_state(layer)
  engine_fn = per_example.ENGINES[engine]
  loss_fn = losses_lib.per_example_loss_fn(XENT)
  step = tf.function(lambda a, b: engine_fn(m, loss_fn, a, b, transforms.Clip(1.0)).summed,
                     autograph=False)
  with pytest.raises(StateWriteError):
    step(x, y)
  after = layer_state(layer)
  assert len(before) == len(after) >= 1
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layer_cls", [RunningMean, DataDependentInit, RawCounter, GeneratorNoise])
def test_host_check_refuses_writes_before_anything_runs(layer_cls):
  x, y = data(8)
  m = writer_model(layer_cls())
  m.compile(optimizer=dpsgd(), loss=XENT)
  with pytest.raises(StateWriteError, match="writes model state"):
    forward_checks.check_no_state_writes(m, (x, y))
  with pytest.raises(StateWriteError):
    forward_checks.check_forward_pass(m, (x, y))


def test_eager_engines_divert_keras_writes():
  """run_eagerly: the Keras assignment is diverted by the scope, then refused."""
  x, y = data(8)
  layer = RunningMean()
  m = writer_model(layer)
  m(x)
  for engine in (per_example.layerwise_engine, per_example.microbatch_engine):
    with pytest.raises(StateWriteError):
      engine(m, losses_lib.per_example_loss_fn(XENT), x, y, transforms.Clip(1.0))
    np.testing.assert_array_equal(layer.mean.numpy(), np.zeros(4))


@pytest.mark.parametrize("engine", ["layerwise", "microbatch"])
def test_seed_generators_still_advance_once_per_draw(engine):
  """The one write allowed: Keras' SeedGenerator.next() adds [0, 1] to the state per draw."""
  x, y = data(8)
  m = writer_model(keras.layers.Identity(), engine, dropout=True)
  forward_checks.check_no_state_writes(m, (x, y), losses_lib.per_example_loss_fn(XENT))
  gen = per_example.vectorized.seed_generators(m)[0]
  start = gen.state.numpy().copy()
  engine_fn = per_example.ENGINES[engine]
  step = tf.function(lambda a, b: engine_fn(m, losses_lib.per_example_loss_fn(XENT), a, b,
                                            transforms.Clip(1.0)).norms, autograph=False)
  first, second = step(x, y), step(x, y)
  draws = 1 if engine == "layerwise" else len(x)  # one pass, or one pass per example
  np.testing.assert_array_equal(gen.state.numpy(), start + np.array([0, 2 * draws], start.dtype))
  assert not np.allclose(first.numpy(), second.numpy())  # fresh dropout masks each step


# --- scenario 5: tokens folded into the batch axis, under XLA ----------------------------
T, D = 4, 3


def folding_model():
  keras.utils.set_random_seed(0)
  inp = keras.Input((T, D))
  flat = keras.layers.Lambda(lambda t: keras.ops.reshape(t, (-1, D)))(inp)  # [B*T, D]
  h = keras.layers.Dense(1)(flat)
  return keras.Model(inp, keras.layers.Lambda(lambda t: keras.ops.reshape(t, (-1, T, 1)))(h))


def one_example():
  rng = np.random.default_rng(0)
  return (100 * rng.normal(size=(1, T, D))).astype("float32"), \
      rng.normal(size=(1, T, 1)).astype("float32")


@pytest.mark.slow  # an XLA compile: CI only (issue 47); XLA's refusal stays quick
def test_folded_tokens_exceed_the_sensitivity_under_xla_without_the_host_check():
  """The hole: XLA drops the in-graph batch-axis assertion; one example moves the sum by > C."""
  m = folding_model()
  loss_fn = losses_lib.per_example_loss_fn("mse")
  x, y = one_example()
  clip = transforms.Clip(1.0)
  # Oracle: the example's own gradient, clipped, has norm <= C.
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(loss_fn(y, m(x, training=True)))
  g = tape.gradient(loss, m.trainable_variables)
  assert norm(g) > 1.0  # it is clipped
  assert norm([t * min(1.0, 1.0 / norm(g)) for t in g]) <= 1.0 + 1e-6

  spec = [tf.TensorSpec([None, T, D]), tf.TensorSpec([None, T, 1])]
  xla = tf.function(lambda a, b: per_example.layerwise_engine(m, loss_fn, a, b, clip).summed,
                    jit_compile=True, input_signature=spec)
  assert norm(xla(x, y)) > 2.0 * clip.sensitivity  # each of the 4 tokens clipped on its own
  graph = tf.function(lambda a, b: per_example.layerwise_engine(m, loss_fn, a, b, clip).summed,
                      input_signature=spec)
  with pytest.raises(tf.errors.InvalidArgumentError, match="not the batch"):
    graph(x, y)  # without XLA the in-graph assertion holds


@pytest.mark.parametrize("jit", [False, True])
def test_verify_step_structure_refuses_folded_tokens_statically(jit):
  m = tf_dpnsgd.make_private(folding_model(), per_example="layerwise")
  m.compile(optimizer=dpsgd(), loss="mse", jit_compile=jit)
  x, y = one_example()
  with pytest.raises(UnsupportedLayerError, match="not the batch"):
    forward_checks.verify_step_structure(m, (x, y))
  with pytest.raises(UnsupportedLayerError, match="not the batch"):
    forward_checks.ForwardVerifier(m)((np.repeat(x, 5, 0), np.repeat(y, 5, 0)))
  ok = tf_dpnsgd.make_private(folding_model(), per_example="vectorized")  # exact per example
  ok.compile(optimizer=dpsgd(), loss="mse", jit_compile=jit)
  forward_checks.check_forward_pass(ok, (x, y))


class PackTokens(keras.layers.Layer):
  """Keeps the non-zero tokens only ([N, D], N data dependent) and scores them with a Dense."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(1)

  def call(self, x):
    keep = tf.reduce_any(tf.not_equal(x, 0.0), axis=-1)
    scores = self.dense(tf.boolean_mask(x, keep))  # [N, 1]: N is not static
    return tf.reduce_sum(scores) * tf.ones([tf.shape(x)[0], 1])


def test_undecidable_batch_axis_is_refused_by_the_static_check():
  """A check the trace cannot decide would be an in-graph assertion XLA drops: refused."""
  keras.utils.set_random_seed(0)
  inp = keras.Input((T, D))
  m = tf_dpnsgd.DPModel(inp, PackTokens()(inp), per_example="layerwise")
  m.compile(optimizer=dpsgd(), loss="mse", jit_compile=True)
  x, y = one_example()
  with pytest.raises(UnsupportedLayerError, match="could not be compared"):
    forward_checks.verify_step_structure(m, (x, y[:, 0, :]))


def test_microbatches_must_divide_the_batch_statically():
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  m = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp), per_example="vectorized",
                        num_microbatches=4)
  m.compile(optimizer=dpsgd(), loss=XENT, jit_compile=True)
  x, y = data(10)
  with pytest.raises(ValueError, match="must divide"):
    forward_checks.verify_step_structure(m, (x, y))
  forward_checks.verify_step_structure(m, (x[:8], y[:8]))


@pytest.mark.parametrize("source", ["numpy", "dataset"])
def test_fit_with_xla_refuses_folded_tokens_before_any_update(source):
  """Keras-drawn batches of 4, 4, 2: refused while the step is traced, before any update.

  Keras traces the first step with the first batch's static shapes, where the engine's
  check is decided in Python. A guard that fed the step a dynamic-shape batch first
  must call :class:`forward_checks.ForwardVerifier` (the XLA hole is shown above).
  """
  m = tf_dpnsgd.make_private(folding_model(), per_example="layerwise",
                             trust_untagged_batches=source == "dataset")
  m.compile(optimizer=dpsgd(), loss="mse", jit_compile=True)
  x, y = one_example()
  x, y = np.repeat(x, 10, 0), np.repeat(y, 10, 0)
  before = weights_of(m)
  with pytest.raises(UnsupportedLayerError, match="not the batch"):
    if source == "numpy":
      m.fit(x, y, batch_size=4, epochs=1, verbose=0)
    else:
      m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=1, verbose=0)
  for a, b in zip(before, weights_of(m)):
    np.testing.assert_array_equal(a, b)


# --- scenario 8: REINFORCE baseline behind stop_gradient + a raw tf.nn.dropout ------------
class RawDropout(keras.layers.Layer):
  """Dropout with TensorFlow's own (stateful, unseeded) random op, not a Keras SeedGenerator."""

  def __init__(self, rate=0.1, **kwargs):
    super().__init__(**kwargs)
    self.rate = rate

  def call(self, x, training=None):
    return tf.nn.dropout(x, self.rate) if training else x


class Reinforce(keras.losses.Loss):
  """``stop_gradient(l_i - mean_j l_j) * l_i``: a batch-mean baseline, invisible to gradients."""

  def __init__(self):
    super().__init__(reduction=None, name="reinforce")

  def call(self, y_true, y_pred):
    own = keras.ops.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return tf.stop_gradient(own - tf.reduce_mean(own)) * own


def dropout_model(rate=0.1, engine="layerwise"):
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  h = RawDropout(rate)(keras.layers.Dense(8, activation="tanh")(inp))
  return tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(h), per_example=engine)


def clipped_sum_oracle(m, loss_fn, x, y, clip):
  """Sum of clipped single-example gradients, one batch forward pass (mask fixed by the seed)."""
  tf.random.set_seed(0)  # eager: the same dropout mask for every batch of this shape
  with tf.GradientTape(persistent=True) as tape:
    losses = tf.unstack(loss_fn(y, m(x, training=True)))
  total = [tf.zeros_like(v) for v in m.trainable_variables]
  for loss in losses:
    g = tape.gradient(loss, m.trainable_variables)
    factor = min(1.0, clip / norm(g))
    total = [t + factor * gi for t, gi in zip(total, g)]
  return total


def test_reinforce_baseline_moves_the_sum_by_more_than_2s():
  """Replace-one oracle: with the baseline one example moves the clipped sum by > 2C."""
  x, y = data(16)
  x2, y2 = x.copy(), y.copy()
  x2[1], y2[1] = 100.0 * x[1], 1 - y[1]
  clip = 0.01
  m = dropout_model()
  moved = {}
  for name, loss in (("reinforce", Reinforce()), ("plain", XENT)):
    loss_fn = losses_lib.per_example_loss_fn(loss)
    a = clipped_sum_oracle(m, loss_fn, x, y, clip)
    b = clipped_sum_oracle(m, loss_fn, x2, y2, clip)
    moved[name] = norm([u - v for u, v in zip(a, b)])
  assert moved["plain"] <= 2 * clip + 1e-6
  assert moved["reinforce"] > 2 * clip  # about 4.3 C
  # ... and the layer-wise engine trains on exactly these per-example gradients.
  m0 = dropout_model(rate=0.0)
  loss_fn = losses_lib.per_example_loss_fn(Reinforce())
  engine = per_example.layerwise_engine(m0, loss_fn, x, y, transforms.Clip(clip)).summed
  for e, o in zip(engine, clipped_sum_oracle(m0, loss_fn, x, y, clip)):
    np.testing.assert_allclose(e.numpy(), o.numpy(), atol=1e-6)


@pytest.mark.parametrize("engine", ["layerwise", "vectorized"])
def test_reinforce_baseline_with_raw_dropout_is_refused_by_fit(engine):
  x, y = data(16)
  m = dropout_model(engine=engine)
  m.compile(optimizer=dpsgd(clip=0.01), loss=Reinforce())
  before = weights_of(m)
  with pytest.raises(tf_dpnsgd.ExampleInteractionError):
    m.fit(x, y, batch_size=16, epochs=1, verbose=0)
  for a, b in zip(before, weights_of(m)):
    np.testing.assert_array_equal(a, b)


def test_probe_freezes_raw_tensorflow_random_ops():
  x, y = data(16)
  m = dropout_model()
  m.compile(optimizer=dpsgd(clip=0.01), loss=Reinforce())
  forward = interaction.model_forward_losses(m, m._dp_loss_fn)
  np.testing.assert_array_equal(forward(x, y).numpy(), forward(x, y).numpy())
  report = interaction.probe_interaction(forward, x, y)
  assert bool(report.reproducible) and float(report.value_score) > 1.0
  forward_checks.check_reproducible(m, (x, y))
  # Freezing leaves the user's global seed alone: unseeded draws still differ.
  tf.random.set_seed(7)
  first = tf.random.uniform([3]).numpy()
  tf.random.set_seed(7)
  forward(x, y)
  np.testing.assert_array_equal(tf.random.uniform([3]).numpy(), first)


def test_raw_dropout_without_interaction_trains():
  """No false refusal: a raw tf.nn.dropout alone is frozen in the probe and trains."""
  x, y = data(16)
  m = dropout_model()
  m.compile(optimizer=dpsgd(), loss=XENT)
  m.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert int(m.optimizer.iterations.numpy()) == 1
  forward_checks.check_forward_pass(m, (x, y))


class TraceTimeNoise(keras.layers.Layer):
  """Noise drawn with numpy in call(): fixed per trace, so no freezing can reproduce it."""

  def call(self, x, training=None):
    if not training:
      return x
    return x + np.random.default_rng().normal(size=x.shape[1:]).astype("float32")


def test_forward_pass_that_cannot_be_reproduced_is_refused():
  x, y = data(16)
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  m = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(TraceTimeNoise()(inp)))
  m.compile(optimizer=dpsgd(), loss=XENT)
  with pytest.raises(ForwardNotReproducibleError, match="not reproducible"):
    forward_checks.check_reproducible(m, (x, y))
  with pytest.raises(ForwardNotReproducibleError):
    interaction.assert_no_interaction(m, x, y)
  before = weights_of(m)
  with pytest.raises(ValueError, match="not reproducible"):
    m.fit(x, y, batch_size=16, epochs=1, verbose=0)
  for a, b in zip(before, weights_of(m)):
    np.testing.assert_array_equal(a, b)


class CountsTraces(keras.layers.Layer):
  """The identity; counts the calls of its Python ``call`` (one per trace of a pass)."""

  def __init__(self, extra=None, **kwargs):
    super().__init__(**kwargs)
    self.extra = extra
    self.calls = 0

  def call(self, x, training=None):
    self.calls += 1
    return self.extra(x) if self.extra is not None and training else x


def counting_model(extra=None):
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  counter = CountsTraces(extra)
  h = keras.layers.Dropout(0.3)(keras.layers.Dense(8, activation="tanh")(counter(inp)))
  m = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(h))
  m.compile(optimizer=dpsgd(), loss=XENT)
  return m, counter


@pytest.mark.parametrize("extra,reused", [
    (None, True),  # Keras dropout (a SeedGenerator, mapped): repeatable
    (lambda t: tf.nn.dropout(t, 0.5), False),  # TensorFlow's stateful random op
    (lambda t: t * tf.reshape(tf.py_function(lambda: np.float32(1.0), [], tf.float32), []),
     False),
    (lambda t: tf.cond(tf.reduce_sum(t) > 0, lambda: t + tf.random.normal(tf.shape(t)),
                       lambda: t), False),  # a stateful draw inside a branch function
], ids=["keras_dropout", "tf_dropout", "py_function", "draw_in_cond"])
def test_a_frozen_pass_reruns_its_second_trace_only_where_the_graph_repeats(extra, reused):
  """The first two passes are traced afresh (trace-time randomness differs between them);
  later passes rerun the second trace only if nothing in it may draw anew: else they trace
  afresh too. Every pass gives the same losses either way (frozen randomness)."""
  x, y = data(16)
  m, counter = counting_model(extra)
  built = counter.calls  # the functional model's symbolic call
  forward = forward_checks.frozen_forward_losses(m, m._dp_loss_fn)
  first = forward(x, y).numpy()
  for _ in range(3):
    np.testing.assert_array_equal(forward(x, y).numpy(), first)
  assert counter.calls - built == (2 if reused else 4)
  # Another input signature for a rerun trace is traced (and checked) once.
  forward(x[:8], y[:8])
  forward(x[:8], y[:8])
  assert counter.calls - built == (3 if reused else 6)
  # The interaction probe's three passes: base, repeat (traced afresh), changed rows (rerun).
  m, counter = counting_model(extra)
  built = counter.calls
  report = interaction.probe_interaction(interaction.model_forward_losses(m, m._dp_loss_fn),
                                         x, y)
  assert bool(report.tested) and bool(report.reproducible) and not bool(report.refused)
  assert counter.calls - built == (2 if reused else 3)


def test_unrepeatable_ops_lists_every_stateful_op_not_known_to_repeat():
  from tf_dpnsgd.per_example import stateless
  v = tf.Variable(1.0)

  def ops_of(fn):
    graph = tf.function(fn).get_concrete_function(tf.TensorSpec([3])).graph
    return stateless.unrepeatable_ops(graph.get_operations(), graph)

  assert ops_of(lambda t: tf.debugging.assert_all_finite(t * v, "finite") + 1.0) == []
  assert ops_of(lambda t: tf.random.stateless_normal([3], seed=[1, 2]) + t) == []
  assert ops_of(lambda t: tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * v),
                                        (0, t))[1]) == []
  found = ops_of(lambda t: t + tf.random.uniform([3]))
  assert len(found) == 1 and found[0].startswith("RandomUniform")
  assert ops_of(lambda t: tf.py_function(lambda a: a, [t], tf.float32))[0].startswith(
      "EagerPyFunc")
  looped = ops_of(lambda t: tf.while_loop(
      lambda i, a: i < 3, lambda i, a: (i + 1, a + tf.random.normal([3])), (0, t))[1])
  assert len(looped) == 1 and "RandomStandardNormal" in looped[0] and "in function" in looped[0]
  generator = tf.random.Generator.from_seed(1)
  assert ops_of(lambda t: t + generator.normal([3]))  # a resource write draws anew too


# --- helpers -------------------------------------------------------------------------------
def test_losses_agree_and_shape_signature():
  assert forward_checks.losses_agree([1.0, np.nan], [1.0, np.nan])
  assert not forward_checks.losses_agree([1.0, np.nan], [1.0, 2.0])
  assert not forward_checks.losses_agree([1.0], [1.0, 1.0])
  assert forward_checks.losses_agree([0.0, 0.0], [0.0, 0.0])
  x, y = data(8)
  sig = forward_checks.shape_signature
  assert sig((x, y)) == sig((x + 1, y))
  assert sig((x, y)) != sig((x[:4], y[:4]))
  mask = {"dp_mask": np.ones(8, bool)}
  assert sig((x, y)) != sig((x, y, mask))
