"""Correlated noise (BandMF) x every save / resume / rollback path of the privacy ledger.

The twins of tests/test_save_paths_matrix.py, tests/test_fail_closed.py (rollbacks,
BackupAndRestore, warm starts) for ``noise="bandmf"``: the banded mechanism's state is
the optimizer's buffers ``w_{t-1}, ..., w_{t-b+1}`` and their position, and the
accounting (Choquette-Choo et al. 2023, Thm. 4) assumes ONE secret partition of the
data for the whole run. So after a save and a reload:

* the buffers travel and a continued fit continues the SAME stream. Oracle: an
  uninterrupted run with the same initial weights, the same (fixed) sampler seed and
  the same (fixed) noise seed, whose weights and buffers the resumed run must match;
* a path that loses the buffers (the base model's file) or the partition (a new sampler
  seed) is refused before any step runs, with a message that says what to do;
* a rollback (an older checkpoint loaded after the model advanced, in this process or
  in a new one) is refused, and the report says the ledger was rolled back and counts
  every executed step (oracle: dp-accounting's RDP epsilon of PoissonSampled(bB/N)
  composed ceil(steps / b) times, built here);
* independent noise cannot continue a correlated model, nor the reverse: refused
  before the step, not only at the report.

Tiny models (5 -> 4 -> 3), N = 64, B = 8, b = 2, 3 + 3 steps.
"""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.plan import PrivacyPlan

N, B, BANDS, STEPS, FIRST, SIGMA, DELTA = 64, 8, 2, 6, 3, 2.0, 1e-5
SAMPLER_SEED, NOISE_SEED = 5, 11
KINDS = ("sequential", "functional", "nested", "subclassed")
PATHS = ("keras_file", "weights_file", "tf_checkpoint", "base_keras_file")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@keras.saving.register_keras_serializable(package="tf_dpnsgd_correlated_tests")
class TinySubclassed(keras.Model):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.hidden = keras.layers.Dense(4, activation="tanh")
    self.out = keras.layers.Dense(3)

  def call(self, x):
    return self.out(self.hidden(x))


def _build(kind):
  keras.utils.set_random_seed(1)  # the same initial weights for every run of a kind
  if kind == "sequential":
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(3)])
  if kind == "functional":
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(4)(inputs)))
  if kind == "nested":
    inner_in = keras.Input((5,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, activation="tanh")(inner_in),
                        name="inner")
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
  model = TinySubclassed()
  model(np.zeros((1, 5), np.float32))
  return model


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 5)).astype(np.float32), rng.integers(0, 3, N)


def _plan(seed=SAMPLER_SEED, bands=BANDS, sampling="cyclic_poisson"):
  return PrivacyPlan(dataset_size=N, batch_size=B, sampling=sampling, bands=bands, steps=STEPS,
                     noise_multiplier=SIGMA, delta=DELTA, seed=seed)


def _optimizer(band_coefficients=None):
  return tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, momentum=0.9, seed=NOISE_SEED,
                         band_coefficients=band_coefficients)


def _private(base, plan=None):
  """One call: the model owns ``plan`` and hands its banded strategy to the optimizer."""
  model = tf_dpnsgd.make_private(base, plan=plan or _plan())
  model.compile(optimizer=_optimizer(), loss=LOSS)
  return model


def _fit(model, steps, plan=None):
  plan = plan or _plan()
  x, y = _data()
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=steps, epochs=1, verbose=0)


def _buffers(model):
  """The banded state: ``{name: value}`` of the optimizer's ``bandmf_*`` variables."""
  return {v.name: np.asarray(v.numpy()) for v in model.optimizer.variables
          if v.name.startswith("bandmf_")}


def _oracle_epsilon(steps, bands=BANDS):
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.PoissonSampledDpEvent(
      bands * B / N, dp_accounting.GaussianDpEvent(SIGMA)), -(-steps // bands))
  return acc.get_epsilon(DELTA)


def _assert_same(a, b):
  assert len(a) == len(b)
  for u, v in zip(a, b):
    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def _assert_same_buffers(got, expected):
  """The noise buffers ``w_{t-k}`` equal (the position holds each run's own lineage)."""
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    if name.startswith("bandmf_w"):
      np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


_STRAIGHT = {}


def _straight(kind):
  """Weights and buffers of the uninterrupted run of ``kind`` (STEPS steps): the oracle."""
  if kind not in _STRAIGHT:
    model = _private(_build(kind))
    _fit(model, STEPS)
    _STRAIGHT[kind] = (model.get_weights(), _buffers(model))
  return _STRAIGHT[kind]


def _save(model, base, path, folder):
  if path == "keras_file":
    model.save(str(folder / "m.keras"))
  elif path == "weights_file":
    model.save_weights(str(folder / "m.weights.h5"))
  elif path == "tf_checkpoint":
    return tf.train.Checkpoint(model=model).write(str(folder / "ckpt"))
  else:
    base.save(str(folder / "base.keras"))
  return None


def _load(path, kind, folder, checkpoint=None):
  if path == "keras_file":
    return keras.models.load_model(str(folder / "m.keras"))
  if path == "base_keras_file":
    return _private(keras.models.load_model(str(folder / "base.keras")))
  model = _private(_build(kind))
  if path == "weights_file":
    model.load_weights(str(folder / "m.weights.h5"))
  else:
    tf.train.Checkpoint(model=model).read(checkpoint).expect_partial()
  return model


# The README's model (Sequential, .keras) in the quick tier; the rest of the matrix is slow.
MATRIX = [pytest.param(kind, path, marks=() if (kind, path) == ("sequential", "keras_file")
                       else pytest.mark.slow) for kind in KINDS for path in PATHS]


@pytest.mark.parametrize("kind,path", MATRIX)
def test_every_kind_and_save_path_continues_the_same_stream_or_refuses(tmp_path, kind, path):
  straight_weights, straight_buffers = _straight(kind)
  base = _build(kind)
  first = _private(base)
  _fit(first, FIRST)
  saved = _buffers(first)
  assert saved and all(np.any(v != 0) for k, v in saved.items() if k.startswith("bandmf_w"))
  checkpoint = _save(first, base, path, tmp_path)
  loaded = _load(path, kind, tmp_path, checkpoint)
  ledger = ledger_lib.ledger_of(loaded)
  ledger.sync()
  assert ledger.steps == FIRST and ledger.noise_bands == BANDS
  assert loaded.privacy_report().epsilon == pytest.approx(_oracle_epsilon(FIRST), rel=1e-9)
  plan = _plan()
  if path == "base_keras_file":
    # The ledger comes back (this machine's lineage record) but the base model's file holds
    # no optimizer: the banded stream cannot continue; refused before any step.
    before = loaded.get_weights()
    with pytest.raises(ledger_lib.LedgerMismatchError, match="do not continue"):
      _fit(loaded, STEPS - FIRST, plan)
    assert ledger.steps == FIRST
    _assert_same(before, loaded.get_weights())
    return
  _fit(loaded, STEPS - FIRST, plan)
  assert ledger.steps == STEPS
  _assert_same(loaded.get_weights(), straight_weights)  # the same stream, step for step
  _assert_same_buffers(_buffers(loaded), straight_buffers)
  np.testing.assert_array_equal(_buffers(loaded)["bandmf_position"],
                                [ledger.lineage, ledger.noise_generation, STEPS])
  report = plan.report(loaded)
  assert report.epsilon == pytest.approx(_oracle_epsilon(STEPS), rel=1e-9)
  assert any("BandMF" in note for note in report.notes)
