import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd

ALL = [
    (tf_dpnsgd.DPNSGD, dict(learning_rate=0.1, regularizer=0.01, noise_multiplier=1.2, seed=0)),
    (tf_dpnsgd.DPSGD, dict(learning_rate=0.1, l2_norm_clip=1.5, noise_multiplier=1.2, seed=0,
                           momentum=0.9, num_microbatches=4)),
    (tf_dpnsgd.DPAdam, dict(learning_rate=1e-3, l2_norm_clip=1.0, noise_multiplier=0.8, seed=1)),
    (tf_dpnsgd.DPNAdam, dict(learning_rate=1e-3, regularizer=0.1, noise_multiplier=0.8, seed=None)),
]


@pytest.mark.parametrize("cls,kwargs", ALL)
def test_config_round_trip(cls, kwargs):
  opt = cls(**kwargs)
  config = opt.get_config()
  for k, v in kwargs.items():
    assert config[k] == pytest.approx(v) if isinstance(v, float) else config[k] == v
  clone = cls.from_config(config)
  assert clone.get_config() == config
  again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert type(again) is cls and again.get_config() == config


@pytest.mark.parametrize("cls,kwargs,arg", [
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.0, noise_multiplier=1.0), "regularizer"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=-1.0, noise_multiplier=1.0), "regularizer"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.1, noise_multiplier=-1.0), "noise_multiplier"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=-2.0, noise_multiplier=1.0), "l2_norm_clip"),
    (tf_dpnsgd.DPAdam, dict(l2_norm_clip=1.0, noise_multiplier=-0.5), "noise_multiplier"),
    (tf_dpnsgd.DPNAdam, dict(regularizer=0.0, noise_multiplier=1.0), "regularizer"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0),
     "num_microbatches"),
    (tf_dpnsgd.DPSGD, dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=2.5),
     "num_microbatches"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.1, noise_multiplier=1.0, seed=-3), "seed"),
    (tf_dpnsgd.DPNSGD, dict(regularizer=0.1, noise_multiplier=1.0, gradient_accumulation_steps=2),
     "gradient_accumulation_steps"),
])
def test_invalid_hyperparameters_raise_at_construction(cls, kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    cls(**kwargs)


def test_missing_privacy_arguments_raise():
  with pytest.raises(ValueError, match="regularizer"):
    tf_dpnsgd.DPNSGD(learning_rate=0.1)
  with pytest.raises(ValueError, match="l2_norm_clip"):
    tf_dpnsgd.DPSGD(learning_rate=0.1, noise_multiplier=1.0)


def test_raw_gradients_are_refused():
  opt = tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0)
  v = keras.Variable(np.zeros(3, np.float32))
  with pytest.raises(RuntimeError, match="make_private"):
    opt.apply_gradients([(tf.ones(3), v)])


def test_plain_keras_model_with_dp_optimizer_fails_loudly():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  model.compile(optimizer=tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0), loss="mse")
  with pytest.raises(RuntimeError, match="DPModel"):
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), verbose=0)


def test_one_step_against_hand_computation():
  """DPNSGD with noise 0: w <- w - lr * (sum_i g_i/(r+||g_i||)) / B."""
  opt = tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=1.0, noise_multiplier=0.0)
  v = keras.Variable(np.array([1.0, 1.0], np.float32))
  g = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)  # norms 5, 0
  summed = (g[0] / 6.0 + g[1] / 1.0)
  opt.apply_private_gradients([tf.constant(summed)], 2.0, [v], step=0)
  np.testing.assert_allclose(v.numpy(), [1 - 0.5 * 0.5 / 2 * 1.0, 1 - 0.5 * (4 / 6) / 2], rtol=1e-6)


# --- any Keras optimizer, made private ------------------------------------------
BUILTINS = [
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    lambda: keras.optimizers.Adam(1e-2),
    lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.01),
    lambda: keras.optimizers.Nadam(1e-2),
    lambda: keras.optimizers.Lion(1e-3),
    lambda: keras.optimizers.Adafactor(1e-2),
    lambda: keras.optimizers.RMSprop(1e-2),
    lambda: keras.optimizers.Adagrad(1e-1),
    lambda: keras.optimizers.Adadelta(1.0),
    lambda: keras.optimizers.Adamax(1e-2),
    lambda: keras.optimizers.Ftrl(1e-1),
    lambda: keras.optimizers.Lamb(1e-2),
]


def _toy():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(8, 3)).astype("float32") * np.array([1, 10, 100], np.float32)
  return x, (x[:, 0] > 0).astype("int32")


def _model(seed=0):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((3,))
  return tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(keras.layers.Dense(4, "tanh")(inp)))


def _normalized_mean_gradient(model, x, y, r):
  """Oracle: a loop of single-example gradients, each scaled by 1/(r + ||g_i||)."""
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      li = loss(y[i:i + 1], model(x[i:i + 1], training=True))
    g = [t.numpy().astype(np.float64) for t in tape.gradient(li, model.trainable_variables)]
    norm = np.sqrt(sum((t ** 2).sum() for t in g))
    total = [a + t / (r + norm) for a, t in zip(total, g)]
  return [t / len(x) for t in total]


@pytest.mark.slow
@pytest.mark.parametrize("make", BUILTINS)
def test_every_builtin_optimizer_made_private_equals_its_twin_on_normalized_gradients(make):
  x, y = _toy()
  r = 0.5
  private = _model()
  private.compile(optimizer=tf_dpnsgd.make_private_optimizer(make(), noise_multiplier=0.0,
                                                             regularizer=r),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  twin_model = _model()
  twin = make()
  twin.build(twin_model.trainable_variables)
  for _ in range(2):
    grads = _normalized_mean_gradient(twin_model, x, y, r)
    twin.apply([tf.constant(g, tf.float32) for g in grads], twin_model.trainable_variables)
    private.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
  for a, b in zip(private.trainable_weights, twin_model.trainable_weights):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-4, atol=2e-5)
  assert int(private.optimizer.iterations.numpy()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("make", BUILTINS)
def test_every_builtin_optimizer_trains_privately_and_round_trips(make, tmp_path):
  x, y = _toy()
  opt = tf_dpnsgd.make_private_optimizer(make(), noise_multiplier=1.0, l2_norm_clip=1.0, seed=4)
  model = _model()
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  before = [w.numpy().copy() for w in model.trainable_weights]
  model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert any(not np.allclose(a, w.numpy()) for a, w in zip(before, model.trainable_weights))
  config = opt.get_config()
  clone = tf_dpnsgd.PrivateOptimizer.from_config(config)
  assert clone.get_config() == config
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert type(loaded.optimizer.inner_optimizer) is type(opt.inner_optimizer)
  assert loaded.optimizer.noise_multiplier == 1.0 and loaded.optimizer.l2_norm_clip == 1.0
  for a, b in zip(opt.variables, loaded.optimizer.variables):
    np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))


def test_make_private_optimizer_arguments():
  with pytest.raises(ValueError, match="exactly one of `regularizer`"):
    tf_dpnsgd.make_private_optimizer(keras.optimizers.SGD(), noise_multiplier=1.0)
  with pytest.raises(ValueError, match="exactly one"):
    tf_dpnsgd.make_private_optimizer(keras.optimizers.SGD(), noise_multiplier=1.0,
                                     regularizer=0.1, l2_norm_clip=1.0)
  private = tf_dpnsgd.make_private_optimizer("adam", noise_multiplier=1.0, regularizer=0.1)
  with pytest.raises(ValueError, match="already private"):
    tf_dpnsgd.make_private_optimizer(private, noise_multiplier=1.0, regularizer=0.1)
  with pytest.raises(ValueError, match="gradient_accumulation_steps"):
    tf_dpnsgd.make_private_optimizer(keras.optimizers.SGD(gradient_accumulation_steps=2),
                                     noise_multiplier=1.0, regularizer=0.1)
  with pytest.raises(RuntimeError, match="make_private"):
    private.apply([tf.ones(1)], [keras.Variable(np.zeros(1, np.float32))])


def test_num_microbatches_on_the_optimizer_is_deprecated():
  with pytest.warns(DeprecationWarning, match="DPModel"):
    tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=2)


@pytest.mark.slow
def test_num_microbatches_on_the_model_equals_the_deprecated_optimizer_keyword():
  x, y = _toy()
  results = []
  for on_model in (True, False):
    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp),
                              num_microbatches=4 if on_model else None)
    with pytest.warns(DeprecationWarning) if not on_model else _no_warning():
      opt = tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=0.1, noise_multiplier=0.0,
                            num_microbatches=None if on_model else 4)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    results.append([w.numpy() for w in model.trainable_weights])
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert tf_dpnsgd.DPModel.from_config(model.get_config()).num_microbatches is None
  with pytest.raises(ValueError, match="num_microbatches"):
    tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp), num_microbatches=0)


class _no_warning:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
