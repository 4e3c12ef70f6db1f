"""DPModel / make_private: oracles, errors, serialization, resumption."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd

XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed=0, batchnorm=False):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((5,))
  h = keras.layers.Dense(8, activation="tanh")(inp)
  if batchnorm:
    h = keras.layers.BatchNormalization()(h)
  return keras.Model(inp, keras.layers.Dense(2)(h))


def data(n=32, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 5)).astype("float32")
  y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
  return x, y


def test_dpsgd_with_zero_noise_and_infinite_clip_equals_sgd():
  x, y = data()
  plain = mlp()
  private = tf_dpnsgd.make_private(mlp())
  plain.compile(optimizer=keras.optimizers.SGD(0.3, momentum=0.5), loss=XENT)
  private.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.3, momentum=0.5,
                                            l2_norm_clip=float("inf"), noise_multiplier=0.0),
                  loss=XENT)
  h1 = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  h2 = private.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  for a, b in zip(plain.get_weights(), private.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)


def test_dpnsgd_with_zero_noise_equals_hand_normalized_sgd():
  """Oracle independent of the library: per-example gradients from a plain loop of
  single-example tapes, normalized ``g_i / (r + ||g_i||)``, averaged and applied by
  plain SGD, all in float64 NumPy; two steps of two batches of 4."""
  x, y = data(8)
  r, lr, batch = 0.05, 0.7, 4
  ref = mlp(seed=1)
  weights = [w.numpy().astype(np.float64) for w in ref.trainable_variables]
  for start in range(0, 8, batch):
    ref.set_weights([w.astype(np.float32) for w in weights])
    summed = [np.zeros_like(w) for w in weights]
    for i in range(start, start + batch):
      with tf.GradientTape() as tape:
        loss = XENT(y[i:i + 1], ref(x[i:i + 1]))
      g = [t.numpy().astype(np.float64) for t in tape.gradient(loss, ref.trainable_variables)]
      norm = np.sqrt(sum(np.sum(gk ** 2) for gk in g))
      summed = [s + gk / (r + norm) for s, gk in zip(summed, g)]
    weights = [w - lr * s / batch for w, s in zip(weights, summed)]

  model = tf_dpnsgd.make_private(mlp(seed=1))
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=lr, regularizer=r, noise_multiplier=0.0),
                loss=XENT)
  model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
  assert len(model.trainable_variables) == len(weights)
  for e, w in zip(weights, model.trainable_variables):
    np.testing.assert_allclose(w.numpy(), e, rtol=1e-5, atol=1e-6)


def test_batchnorm_rejected_with_groupnorm_suggestion():
  with pytest.raises(ValueError, match="GroupNormalization"):
    tf_dpnsgd.make_private(mlp(batchnorm=True))
  inp = keras.Input((5,))
  model = tf_dpnsgd.DPModel(inp, keras.layers.BatchNormalization()(keras.layers.Dense(3)(inp)))
  with pytest.raises(ValueError, match="BatchNormalization"):
    model.compile(optimizer=tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0), loss=XENT)


def test_non_dp_optimizer_rejected():
  model = tf_dpnsgd.make_private(mlp())
  with pytest.raises(TypeError, match="DP optimizer"):
    model.compile(optimizer="sgd", loss=XENT)


def test_sample_weight_rejected():
  x, y = data(8)
  model = tf_dpnsgd.make_private(mlp())
  model.compile(optimizer=tf_dpnsgd.DPNSGD(regularizer=0.1, noise_multiplier=1.0), loss=XENT)
  with pytest.raises(ValueError, match="sensitivity"):
    model.fit(x, y, sample_weight=np.ones(8), verbose=0)


@pytest.mark.slow
def test_learns_separable_data_with_noise():
  x, y = data(2048, seed=5)
  model = tf_dpnsgd.make_private(mlp(seed=2))
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=1.0, regularizer=0.01,
                                           noise_multiplier=1.0, seed=0),
                loss=XENT, metrics=["accuracy"])
  hist = model.fit(x, y, batch_size=128, epochs=6, verbose=0)
  assert hist.history["accuracy"][-1] > 0.9
  assert {"loss", "accuracy", "grad_norm", "nonfinite_examples"} <= set(hist.history)
  xt, yt = data(512, seed=6)
  assert model.evaluate(xt, yt, verbose=0, return_dict=True)["accuracy"] > 0.9


@pytest.mark.slow
def test_nan_example_contributes_zero_and_is_counted():
  x, y = data(8)
  x_bad = x.copy()
  x_bad[3, 0] = np.nan
  keep = np.arange(8) != 3
  results = []
  for xs, ys, denom_fix in ((x_bad, y, 1.0), (x[keep], y[keep], 7 / 8)):
    model = tf_dpnsgd.make_private(mlp(seed=4))
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5 * denom_fix, l2_norm_clip=0.5,
                                            noise_multiplier=0.0), loss=XENT)
    hist = model.fit(xs, ys, batch_size=len(ys), epochs=1, shuffle=False, verbose=0)
    results.append((model.get_weights(), hist.history))
  for a, b in zip(results[0][0], results[1][0]):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert results[0][1]["nonfinite_examples"][0] == 1.0
  assert np.isfinite(results[0][1]["loss"][0])


@pytest.mark.slow
def test_same_seed_is_reproducible_and_noise_matters():
  x, y = data(64)
  weights = []
  for seed in (3, 3, 4):
    model = tf_dpnsgd.make_private(mlp(seed=0))
    model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=0.1,
                                             noise_multiplier=2.0, seed=seed), loss=XENT)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    weights.append(model.get_weights())
  for a, b in zip(weights[0], weights[1]):
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(weights[0][0], weights[2][0])


def _compiled(seed=0):
  model = tf_dpnsgd.make_private(mlp(seed=0))
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.2, l2_norm_clip=0.7, momentum=0.9,
                                          noise_multiplier=1.1, seed=seed),
                loss=XENT, metrics=["accuracy"])
  return model


@pytest.mark.slow
def test_save_load_keeps_optimizer_and_resume_continues_noise_stream(tmp_path):
  x, y = data(32)
  straight = _compiled()
  straight.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

  first = _compiled()
  first.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  path = str(tmp_path / "m.keras")
  first.save(path)
  loaded = keras.models.load_model(path)
  assert isinstance(loaded, tf_dpnsgd.DPModel)
  opt = loaded.optimizer
  assert isinstance(opt, tf_dpnsgd.DPSGD)
  assert opt.l2_norm_clip == 0.7 and opt.noise_multiplier == 1.1 and opt.momentum == 0.9
  assert int(opt.iterations.numpy()) == 4 and loaded.privacy_ledger.steps == 4
  loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  for a, b in zip(straight.get_weights(), loaded.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert loaded.privacy_ledger.steps == 8


@pytest.mark.slow
def test_checkpoint_callback_resume(tmp_path):
  """ModelCheckpoint (weights + optimizer) then restore: the privacy ledger comes back."""
  x, y = data(32)
  model = _compiled(seed=5)
  ckpt = str(tmp_path / "ckpt.weights.h5")
  model.fit(x, y, batch_size=8, epochs=1, verbose=0,
            callbacks=[keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True)])
  restored = _compiled(seed=5)
  restored.optimizer.build(restored.trainable_variables)
  restored.load_weights(ckpt)
  assert restored.privacy_ledger.steps == 4
  assert int(restored.optimizer.iterations.numpy()) == 4
  path = str(tmp_path / "full.keras")
  model.save(path)
  assert keras.models.load_model(path).privacy_ledger.steps == 4


@pytest.mark.slow
def test_tf_data_and_sequential_and_subclassed():
  x, y = data(32)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
  seq = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(2)])

  class Sub(keras.Model):
    def __init__(self):
      super().__init__()
      self.d1 = keras.layers.Dense(4, activation="relu")
      self.d2 = keras.layers.Dense(2)

    def call(self, inputs):
      return self.d2(self.d1(inputs))

  for base in (seq, Sub()):
    base(x[:1])
    model = tf_dpnsgd.make_private(base, trust_untagged_batches=True)  # a user pipeline
    model.compile(optimizer=tf_dpnsgd.DPAdam(learning_rate=0.01, l2_norm_clip=1.0,
                                             noise_multiplier=0.5, seed=0),
                  loss=XENT, metrics=["accuracy"])
    before = [w.copy() for w in base.get_weights()]
    hist = model.fit(ds, epochs=1, verbose=0)
    assert "accuracy" in hist.history
    after = base.get_weights()  # make_private shares the original model's weights
    assert any(not np.allclose(a, b) for a, b in zip(before, after))


@pytest.mark.slow
def test_weight_regularizer_gradient_added_after_noise():
  x, y = data(8)
  models = []
  for l2 in (0.0, 0.1):
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    out = keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(l2) if l2 else None)(inp)
    model = tf_dpnsgd.DPModel(inp, out)
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                            noise_multiplier=0.0), loss=XENT)
    w0 = model.get_weights()[0].copy()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    models.append((w0, model.get_weights()[0]))
  (w0, w_plain), (_, w_reg) = models
  np.testing.assert_allclose(w_reg, w_plain - 0.1 * 2 * 0.1 * w0, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_resnet20_has_paper_size_and_trains():
  base = tf_dpnsgd.models.resnet20()
  assert 260_000 < base.count_params() < 280_000
  model = tf_dpnsgd.make_private(base, physical_batch_size=4)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                           noise_multiplier=1.0, seed=0), loss=XENT)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 32, 32, 3)).astype("float32")
  hist = model.fit(x, rng.integers(0, 10, 8), batch_size=8, epochs=1, verbose=0)
  assert np.isfinite(hist.history["loss"][0])


@pytest.mark.slow
def test_padded_rows_do_not_count_in_metrics_or_loss():
  """Poisson batches carry padding rows: metrics and loss cover the real rows only."""
  x, y = data(16)
  real = np.arange(16) < 10
  y_noisy = y.copy()
  y_noisy[~real] = 1 - y_noisy[~real]  # padding rows would change accuracy if counted
  model = tf_dpnsgd.make_private(mlp(seed=3), trust_untagged_batches=True)  # hand-made batch
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.0 + 1e-9, l2_norm_clip=1.0,
                                          noise_multiplier=0.0), loss=XENT, metrics=["accuracy"])
  ds = tf.data.Dataset.from_tensors(
      (x, y_noisy, {"dp_mask": real, "dp_denominator": np.float32(10.0)}))
  hist = model.fit(ds, epochs=1, verbose=0)
  logits = model.predict(x[real], verbose=0)
  expected_acc = np.mean(np.argmax(logits, 1) == y[real])
  expected_loss = float(np.mean(XENT.call(y[real], logits)))
  assert hist.history["accuracy"][0] == pytest.approx(expected_acc, abs=1e-6)
  assert hist.history["loss"][0] == pytest.approx(expected_loss, rel=1e-4)
