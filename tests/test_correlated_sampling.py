"""Cyclic Poisson sampling, its accounting (Choquette-Choo et al. 2023, Thm. 4) and the
fail-closed binding of plan, optimizer and ledger for correlated noise."""

import math

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.correlated import noise as cn
from tf_dpnsgd.correlated import sampling as cs
from tf_dpnsgd.plan import PrivacyPlan


def _plan(bands=4, steps=100, **kw):
  kw.setdefault("noise_multiplier", 1.1)
  return PrivacyPlan(dataset_size=60000, batch_size=256, sampling="cyclic_poisson",
                     bands=bands, steps=steps, delta=1e-5, seed=0, **kw)


def test_one_band_is_poisson_exactly():
  poisson = PrivacyPlan(dataset_size=60000, batch_size=256, sampling="poisson", steps=100,
                        noise_multiplier=1.1, delta=1e-5, seed=0)
  assert _plan(bands=1).epsilon() == poisson.epsilon()


@pytest.mark.parametrize("bands,steps", [(4, 100), (4, 101), (16, 1000)])
def test_epsilon_is_dp_sgd_at_q_b_over_ceil_steps_over_b(bands, steps):
  plan = _plan(bands, steps)
  q_b = bands * 256 / 60000
  accountant = dp_accounting.rdp.RdpAccountant(list(plan.spec.rdp_orders))
  accountant.compose(dp_accounting.PoissonSampledDpEvent(q_b, dp_accounting.GaussianDpEvent(1.1)),
                     math.ceil(steps / bands))
  expected = accountant.get_epsilon(1e-5)
  print(f"b={bands} T={steps}: plan epsilon {plan.epsilon():.6f}, dp-accounting {expected:.6f}")
  assert plan.epsilon() == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_calibration_and_refusals():
  plan = _plan(8, 1000, noise_multiplier=None, target_epsilon=3.0)
  assert plan.planned_report().epsilon <= 3.0
  with pytest.raises(ValueError, match="bands"):
    PrivacyPlan(dataset_size=600, batch_size=10, sampling="poisson", bands=2, steps=5,
                noise_multiplier=1.0, delta=1e-5)
  with pytest.raises(ValueError, match="b \\* B <= N"):
    _plan(bands=300)


def test_sampler_draws_within_one_part_per_step():
  s = cs.CyclicPoissonSampler(dataset_size=1000, batch_size=20, bands=5, seed=3)
  parts = [set(s.part(p).tolist()) for p in range(5)]
  assert sorted(sum((list(p) for p in parts), [])) == list(range(1000))  # a partition
  # Parts by keyed hash of identity: sizes Binomial(1000, 1/5) (sd 12.6), not exactly N / b.
  assert all(abs(len(p) - 200) < 60 for p in parts)
  sizes = []
  for t in range(200):
    idx = s.indices(t)
    assert set(idx.tolist()) <= parts[t % 5]
    sizes.append(idx.size)
  assert np.mean(sizes) == pytest.approx(20, rel=0.1)  # q_b * N/b = B
  assert s.fingerprint != cs.CyclicPoissonSampler(dataset_size=1000, batch_size=20, bands=4,
                                                  seed=3).fingerprint
  assert s.denominator == 20.0
  assert ledger_lib.KIND_CODES["cyclic_poisson"] not in (
      ledger_lib.KIND_CODES[k] for k in ("poisson", "uniform", "shuffle", "untagged"))


def _data(n=64):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4)).astype("float32")
  return x, (x.sum(axis=1) > 0).astype("int32")


def _model(plan, bands_coefficients):
  inputs = keras.Input((4,))
  keras.utils.set_random_seed(0)
  model = tf_dpnsgd.make_private(keras.Model(inputs, keras.layers.Dense(2)(inputs)))
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, seed=11,
                                          noise_multiplier=plan.training_noise_multiplier,
                                          momentum=0.9, band_coefficients=bands_coefficients),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  plan.check_optimizer(model.optimizer)
  return model


def _fit(model, plan, x, y, steps):
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=steps, epochs=1, verbose=0)


@pytest.mark.slow
def test_save_load_continues_the_buffers_and_the_report(tmp_path):
  x, y = _data()
  plan = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2,
                     steps=6, noise_multiplier=1.0, delta=1e-5, seed=1)
  c = list(cn.bandmf(6, 2))
  straight = _model(plan, c)
  _fit(straight, plan, x, y, 6)
  first = _model(plan, c)
  _fit(first, plan, x, y, 3)
  path = str(tmp_path / "m.keras")
  first.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.bands == 2 and loaded.privacy_ledger.noise_bands == 2
  _fit(loaded, plan, x, y, 3)
  for a, b in zip(straight.get_weights(), loaded.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  report = plan.report(loaded)
  assert report.epsilon == pytest.approx(plan.epsilon(6))
  assert any("BandMF" in note for note in report.notes)
  # The same history reported as independent noise (b = 1) is refused.
  poisson = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=1,
                        steps=6, noise_multiplier=1.0, delta=1e-5, seed=1)
  with pytest.raises(ledger_lib.LedgerMismatchError):
    poisson.report(loaded)
  # A fresh optimizer (zero buffers) cannot continue the correlated run mid-way.
  loaded.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, seed=11,
                                           noise_multiplier=1.0, band_coefficients=c),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with pytest.raises(Exception, match="do not continue"):
    _fit(loaded, plan, x, y, 1)


@pytest.mark.slow
def test_optimizer_and_ledger_must_match_the_plan():
  x, y = _data()
  plan = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2,
                     steps=6, noise_multiplier=1.0, delta=1e-5, seed=1)
  with pytest.raises(ValueError, match="b = 1 bands but the plan accounts for b = 2"):
    _model(plan, None)
  indep = PrivacyPlan(dataset_size=64, batch_size=8, sampling="poisson", steps=6,
                      noise_multiplier=1.0, delta=1e-5, seed=1)
  model = _model(indep, None)
  _fit(model, indep, x, y, 2)
  ledger = model.privacy_ledger
  assert ledger.noise_bands == 1
  with pytest.raises(ledger_lib.LedgerMismatchError, match="cannot be mixed"):
    cs.check_ledger_noise(ledger, 2)


@pytest.mark.slow
def test_a_rollback_cannot_continue_the_correlated_stream_and_nothing_runs(tmp_path):
  """load_weights of an earlier checkpoint moves the ledger's noise generation: the banded
  buffers no longer continue it, and the host refuses the next step before any op runs
  (the in-graph assertion alone would vanish under XLA, leaving NaN noise)."""
  x, y = _data()
  plan = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2,
                     steps=6, noise_multiplier=1.0, delta=1e-5, seed=1)
  model = _model(plan, list(cn.bandmf(6, 2)))
  _fit(model, plan, x, y, 1)
  early = str(tmp_path / "early.weights.h5")
  model.save_weights(early)
  _fit(model, plan, x, y, 2)
  model.load_weights(early)  # a rollback: the ledger keeps 3 steps, new noise generation
  ledger = ledger_lib.ledger_of(model)
  assert ledger.steps == 3 and ledger.noise_generation == 1
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(ledger_lib.LedgerMismatchError, match="do not continue"):
    _fit(model, plan, x, y, 1)
  assert ledger.steps == 3
  for a, b in zip(before, model.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_make_private_noise_bandmf_one_call(tmp_path):
  """make_private(..., noise="bandmf", bands=b): cyclic Poisson batches, the plan's
  optimized strategy handed to the optimizer at compile, epsilon = dp-accounting's
  PoissonSampled(q_b) x ceil(T / b) (the oracle built here), and the model round-trips."""
  x, y = _data()
  inputs = keras.Input((4,))
  model = tf_dpnsgd.make_private(keras.Model(inputs, keras.layers.Dense(2)(inputs)),
                                 noise_multiplier=1.2, delta=1e-5, batch_size=8, steps=6,
                                 noise="bandmf", bands=2)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, verbose=0)
  plan = model.privacy_plan
  assert plan.sampling == "cyclic_poisson" and plan.bands == 2
  np.testing.assert_allclose(model.optimizer.band_coefficients, cn.bandmf(6, 2, 0.9))
  assert ledger_lib.ledger_of(model).steps == 6
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.PoissonSampledDpEvent(2 * 8 / 64, dp_accounting.GaussianDpEvent(1.2)),
              3)
  assert model.privacy_report().epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.bands == 2 and ledger_lib.ledger_of(loaded).steps == 6


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise="bandmf", bands=1), "bands"),
    (dict(noise="bandmf", bands=4, sampling="poisson"), "cyclic Poisson"),
    (dict(noise="fancy", bands=4), "noise"),
    (dict(bands=4), "noise='bandmf'")])
def test_make_private_noise_refusals(kwargs, match):
  inputs = keras.Input((4,))
  with pytest.raises(ValueError, match=match):
    tf_dpnsgd.make_private(keras.Model(inputs, keras.layers.Dense(2)(inputs)),
                           noise_multiplier=1.0, delta=1e-5, batch_size=8, steps=6, **kwargs)
