"""``noise="auto"`` (issue 33): independent noise or BandMF, chosen by the error each leaves at
one epsilon.

Oracles built here, not the code under test: dp-accounting's epsilon of each candidate's
event at the multiplier the choice calibrated; the prefix-sum error from dense matrices
(``A C^{-1}`` by NumPy's solver); the closed form of independent noise's error. Then the
choice end to end: ``make_private(noise="auto")`` and ``--noise=auto`` get the chosen
mechanism's plan, sampling and optimizer, and the refusals say what to do.
"""

import math

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import noise_choice
from tf_dpnsgd.correlated import noise as cn
from tf_dpnsgd.correlated import strategy as strategy_lib
from tf_dpnsgd.launch import common


def oracle_epsilon(n, batch, sigma, delta, bands, steps):
  """dp-accounting's RDP epsilon: Poisson at bB/N, ceil(T/b) times (b = 1: DP-SGD's event)."""
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.PoissonSampledDpEvent(
      bands * batch / n, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / bands))
  return acc.get_epsilon(delta)


def dense_rms(sigma, coefficients, n, momentum):
  """``sqrt(sigma^2 ||A C^{-1}||_F^2 / n)`` from dense matrices (no Toeplitz shortcut)."""
  c = np.asarray(coefficients, np.float64)
  c = c / np.linalg.norm(c)
  big_c = sum(np.diag(np.full(n - k, c[k]), -k) for k in range(min(len(c), n)))
  lags = np.subtract.outer(np.arange(n), np.arange(n))
  a = np.where(lags >= 0, (1 - momentum ** (np.maximum(lags, 0) + 1)) / (1 - momentum), 0.0)
  return sigma * math.sqrt(np.sum(np.linalg.solve(big_c.T, a.T).T ** 2) / n)


SMALL = dict(dataset_size=2000, batch_size=100, delta=1e-5, steps=20)


def test_independent_noise_error_is_its_closed_form():
  # Identity strategy, no momentum: the t-th prefix sum holds t draws, so the mean squared
  # error is sigma^2 (1 + ... + n) / n = sigma^2 (n + 1) / 2.
  for n in (1, 7, 490):
    assert noise_choice.prefix_sum_rms(1.7, strategy_lib.identity_strategy(n)) == pytest.approx(
        1.7 * math.sqrt((n + 1) / 2), rel=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("bands", [1, 2, 5])
def test_predicted_error_is_the_dense_matrices_one(momentum, bands):
  strategy = strategy_lib.optimize_bands(40, bands, momentum)
  assert noise_choice.prefix_sum_rms(2.5, strategy) == pytest.approx(
      dense_rms(2.5, strategy.coefficients, 40, momentum), rel=1e-9)


@pytest.mark.slow
def test_every_candidate_is_calibrated_and_the_least_error_is_chosen():
  choice = noise_choice.choose_bands(target_epsilon=4.0, momentum=0.9, max_bands=5, **SMALL)
  assert [b for b, _, _ in choice.rows] == [1, 2, 4, 5]
  for b, sigma, rms in choice.rows:
    eps = oracle_epsilon(2000, 100, sigma, 1e-5, b, 20)
    assert 4.0 - 0.01 < eps <= 4.0 + 1e-9, (b, sigma, eps)
    coefficients = strategy_lib.optimize_bands(20, b, 0.9).coefficients
    assert rms == pytest.approx(dense_rms(sigma, coefficients, 20, 0.9), rel=1e-9)
  assert choice.rms(choice.bands) == min(r for _, _, r in choice.rows)
  assert choice.to_dict()["predicted_rms_vs_independent"] <= 1.0


@pytest.mark.slow
def test_small_epsilon_keeps_independent_noise_and_large_epsilon_correlates():
  # Amplification by sampling at B/N wins where the noise is large (Choquette-Choo et al.
  # 2023); correlation wins at large epsilon.
  low = noise_choice.choose_bands(target_epsilon=0.5, momentum=0.0, max_bands=4, **SMALL)
  assert (low.bands, low.noise, low.sampling) == (1, "independent", "poisson")
  assert "independent noise (b=1)" in low.describe()
  high = noise_choice.choose_bands(target_epsilon=16.0, momentum=0.9, max_bands=4, **SMALL)
  assert high.bands >= 2 and (high.noise, high.sampling) == ("bandmf", "cyclic_poisson")
  assert high.rms(high.bands) < 0.8 * high.rms(1)


def test_max_bands_caps_the_candidates_and_bad_settings_are_refused():
  assert noise_choice.candidate_bands(60, 100, 2000, max_bands=5) == (1, 2, 4, 5)
  assert noise_choice.candidate_bands(3, 100, 2000, max_bands=32) == (1, 2, 3)
  assert noise_choice.candidate_bands(60, 100, 2000, max_bands=1) == (1,)
  with pytest.raises(ValueError, match="int >= 1"):
    noise_choice.candidate_bands(60, 100, 2000, max_bands=0)
  with pytest.raises(ValueError, match="give `target_epsilon`"):
    noise_choice.choose_bands(target_epsilon=None, **SMALL)
  assert noise_choice.best_of([(1, 2.0, 3.0), (2, 2.5, 3.0)]) == 1  # a tie: fewer buffers


# --- make_private(noise="auto") --------------------------------------------------------------
def _model():
  inputs = keras.Input((4,))
  return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def _data(n=64):
  rng = np.random.default_rng(0)
  return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 2, n)


@pytest.mark.slow
@pytest.mark.parametrize("target_epsilon", [0.5, 30.0])
def test_make_private_auto_trains_with_the_chosen_mechanism(target_epsilon, tmp_path):
  x, y = _data()
  model = tf_dpnsgd.make_private(_model(), target_epsilon=target_epsilon, delta=1e-5,
                                 batch_size=8, steps=8, noise="auto", bands=4)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, verbose=0)
  choice = noise_choice.choose_bands(dataset_size=64, batch_size=8, delta=1e-5, steps=8,
                                     target_epsilon=target_epsilon, momentum=0.9, max_bands=4)
  plan = model.privacy_plan
  assert (plan.sampling, plan.bands) == (choice.sampling, choice.bands)
  assert model.optimizer.bands == choice.bands
  if choice.bands > 1:
    np.testing.assert_allclose(model.optimizer.band_coefficients, cn.bandmf(8, choice.bands, 0.9))
  assert ledger_lib.ledger_of(model).steps == 8
  eps = oracle_epsilon(64, 8, plan.training_noise_multiplier, 1e-5, choice.bands, 8)
  assert model.privacy_report().epsilon == pytest.approx(eps, rel=1e-9)
  assert eps <= target_epsilon + 1e-9
  # Both regimes are exercised: at epsilon 0.5 Poisson's amplification wins, at 30 BandMF.
  assert (choice.bands == 1) == (target_epsilon < 1)
  path = str(tmp_path / "m.keras")  # the round trip keeps the chosen mechanism and the ledger
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.optimizer.bands == choice.bands and ledger_lib.ledger_of(loaded).steps == 8
  assert (loaded.privacy_plan.sampling, loaded.privacy_plan.bands) == (plan.sampling, plan.bands)
  assert loaded.privacy_report().epsilon == pytest.approx(eps, rel=1e-9)


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise="auto", noise_multiplier=1.0), "give `target_epsilon`"),
    (dict(noise="auto", target_epsilon=2.0, sampling="poisson"), "drop `sampling='poisson'`"),
    (dict(noise="auto", target_epsilon=2.0, blt_buffers=2), "needs noise='blt'"),
    (dict(noise="auto", target_epsilon=2.0, bands=0), "int >= 1"),
])
def test_make_private_auto_refusals(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tf_dpnsgd.make_private(_model(), delta=1e-5, batch_size=8, steps=6, **kwargs)


# --- --noise=auto ---------------------------------------------------------------------------
def parse(*args, **defaults):
  from absl import flags
  fv = flags.FlagValues()
  common.define_flags(fv, **{"target_epsilon": 4.0, **defaults})
  fv(["launcher", *args])
  return common.config_from_flags(fv)


@pytest.mark.parametrize("args,message", [
    (["--noise=auto", "--noise_multiplier=1.0"], "give --target_epsilon"),
    (["--noise=auto", "--sampling=uniform"], "drop --sampling"),
    (["--noise=auto", "--bands=0"], "--bands=b >= 1"),
    (["--noise=auto", "--blt_buffers=2"], "needs --noise=blt"),
    (["--noise=auto", "--optimizer=sgd"], "trains without privacy"),
    (["--noise=auto", "--optimizer=dpsgd", "--target_unclipped_quantile=0.5"], "adaptive"),
    (["--noise=auto", "--distribution_strategy=mirrored"], "one replica"),
])
def test_auto_noise_flag_errors_say_what_to_do(args, message):
  from absl import flags
  with pytest.raises(flags.IllegalFlagValueError, match=message):
    parse(*args)


@pytest.mark.slow
@pytest.mark.parametrize("epsilon,momentum,bands", [(0.5, 0.0, 1), (16.0, 0.9, None)])
def test_launcher_plan_and_optimizer_follow_the_choice(epsilon, momentum, bands):
  cfg = parse("--noise=auto", f"--target_epsilon={epsilon}", "--batch_size=100",
              "--epochs=1", "--optimizer=dpsgd", f"--momentum={momentum}", "--bands=4")
  n = 2000
  resolved, choice = common.resolve_auto_noise(cfg, n)
  assert choice.bands == (bands or choice.bands) and max(b for b, _, _ in choice.rows) <= 4
  plan = common.make_plan(cfg, n)  # the plan resolves the same choice
  assert (plan.sampling, plan.bands) == (choice.sampling, choice.bands)
  assert (resolved.noise, resolved.sampling) == (choice.noise, choice.sampling)
  opt = common.make_optimizer(resolved, plan.training_noise_multiplier, plan.num_steps)
  assert opt.bands == choice.bands
  if bands is None:
    assert choice.bands > 1
    np.testing.assert_allclose(opt.band_coefficients,
                               cn.bandmf(plan.num_steps, choice.bands, momentum))
  assert plan.epsilon(plan.num_steps) == pytest.approx(oracle_epsilon(
      n, 100, plan.training_noise_multiplier, 1e-5, choice.bands, plan.num_steps), rel=1e-9)
  assert common.resolve_auto_noise(resolved, n) == (resolved, None)  # resolved once only
  sigmas = {b: s for b, s, _ in choice.rows}
  assert plan.training_noise_multiplier == sigmas[choice.bands]  # the row it chose is the run
  # A run with a release before training (private feature statistics) leaves less epsilon for
  # the steps: the choice is calibrated as that run's plan is.
  import dataclasses
  with_release = dataclasses.replace(cfg, releases=(20.0 if epsilon < 1 else 1.0,))
  _, released = common.resolve_auto_noise(with_release, n)
  plan = common.make_plan(with_release, n)
  assert plan.training_noise_multiplier == {b: s for b, s, _ in released.rows}[released.bands]
  assert released.rows[0][1] >= choice.rows[0][1]
  if epsilon > 1:  # a release at sigma 1 costs a visible part of epsilon 16
    assert released.rows[0][1] > choice.rows[0][1]


@pytest.mark.slow
def test_a_launcher_run_reports_the_choice_and_a_rerun_resumes_it(tmp_path):
  """run_experiment with --noise=auto: the report says what was asked, what was chosen and
  from what; a rerun of the same settings chooses the same and continues the same stream
  (the correlated run's sampler seed kept) for an epsilon of all its steps."""
  import json
  import fixtures
  from tf_dpnsgd.launch import resume
  x, y = fixtures.tiny_image_data()

  def run(max_steps):
    cfg = common.ExperimentConfig(
        target_epsilon=30.0, optimizer="dpsgd", momentum=0.9, batch_size=8, epochs=1.0,
        max_steps=max_steps, seed=0, verbose=0, model_dir=str(tmp_path / "run"), noise="auto",
        bands=4)
    common.run_experiment(cfg, fixtures.tiny_image_mlp, (x, y), (x[:16], y[:16]),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          extra_report={"dataset": "toy"})
    with open(tmp_path / "run" / "privacy_report.json") as f:
      return json.load(f)

  first = run(3)
  choice = noise_choice.choose_bands(dataset_size=64, batch_size=8, delta=1e-5, epochs=1.0,
                                     target_epsilon=30.0, momentum=0.9, max_bands=4)
  assert choice.bands > 1  # BandMF at epsilon 30 (the independent case: the tests above)
  assert first["noise_choice"]["requested"] == "auto"
  assert first["noise_choice"]["bands"] == choice.bands
  assert (first["noise"], first["bands"], first["sampling"]) == (
      "bandmf", choice.bands, "cyclic_poisson")
  assert first["hyperparameters"]["noise"] == "bandmf" and first["steps"] == 3
  seed = resume.read_sampler_seed(str(tmp_path / "run"))
  second = run(6)
  assert second["steps"] == 6 and resume.read_sampler_seed(str(tmp_path / "run")) == seed
  sigma = second["noise_multiplier"]
  assert second["epsilon"] == pytest.approx(oracle_epsilon(64, 8, sigma, 1e-5, choice.bands, 6),
                                            rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sequential", "functional", "nested", "subclassed"])
def test_auto_through_every_model_kind_and_save_path(kind, tmp_path):
  """noise="auto" on every Keras model kind: saved BEFORE its first fit (the unresolved
  request travels), reloaded and trained with no recompile: the same choice as an
  independent call; saved after it, the mechanism and ledger travel; a second fit past the
  plan is refused and the epsilon stays."""
  import fixtures
  x, y = fixtures.tiny_data(64)
  keywords = dict(target_epsilon=30.0, delta=1e-5, batch_size=8, steps=8, noise="auto", bands=4)

  def compiled(model):
    model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

  choice = noise_choice.choose_bands(dataset_size=64, batch_size=8, delta=1e-5, steps=8,
                                     target_epsilon=30.0, momentum=0.9, max_bands=4)
  assert choice.bands > 1
  model = compiled(tf_dpnsgd.make_private(fixtures.tiny_model(kind, seed=0), **keywords))
  if kind != "subclassed":  # a subclassed wrapper is saved after its first fit (below)
    path = str(tmp_path / "early.keras")
    model.save(path)
    model = keras.models.load_model(path)
    # The reloaded optimizer was built (by load_model) before the plan chose BandMF; it has
    # taken no step, so it takes the plan's banded noise with fresh buffers: no recompile.
    assert model.optimizer.built and model.optimizer.band_noise is None
  model.fit(x, y, verbose=0)
  plan = model.privacy_plan
  assert (plan.sampling, plan.bands) == (choice.sampling, choice.bands)
  assert model.optimizer.bands == choice.bands and ledger_lib.ledger_of(model).steps == 8
  eps = oracle_epsilon(64, 8, plan.training_noise_multiplier, 1e-5, choice.bands, 8)
  assert model.privacy_report().epsilon == pytest.approx(eps, rel=1e-9)
  if kind != "subclassed":  # after the fit the chosen mechanism and its buffers travel
    model.save(str(tmp_path / "late.keras"))
    loaded = keras.models.load_model(str(tmp_path / "late.keras"))
    assert ledger_lib.ledger_of(loaded).steps == 8 and loaded.optimizer.bands == choice.bands
    assert loaded.privacy_report().epsilon == pytest.approx(eps, rel=1e-9)
  from tf_dpnsgd import callbacks as callbacks_lib
  with pytest.raises(callbacks_lib.PrivacyBudgetExceededError):  # the plan is spent
    model.fit(x, y, verbose=0)
  assert ledger_lib.ledger_of(model).steps == 8
  assert model.privacy_report().epsilon == pytest.approx(eps, rel=1e-9)
