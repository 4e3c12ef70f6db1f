"""tf_dpnsgd.correlated.blt, BLT noise in the optimizer and its accounting, against oracles.

Oracles: the materialized Toeplitz matrix (np.linalg.solve, the dense Frobenius norm),
brute-force enumeration of every participation pattern (strategy.sensitivity), the
empirical prefix-sum error of the noise the optimizer applies, and dp-accounting's RDP and
PLD epsilon of one Gaussian mechanism with the enumerated sensitivity (the accounting of BLT
noise without amplification)."""

import dp_accounting

import keras
import numpy as np
import pytest
import tensorflow as tf

import fixtures
import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.callbacks import PrivacyBudgetExceededError
from tf_dpnsgd.correlated import blt as bl
from tf_dpnsgd.correlated import noise as cn
from tf_dpnsgd.correlated import strategy as st
from tf_dpnsgd.plan import PrivacyPlan

LINEAGE = 7
TWO = bl.BLTStrategy((0.9, 0.5), (0.3, 0.2))  # c_k = 0.3 * 0.9^(k-1) + 0.2 * 0.5^(k-1)


def test_coefficients_and_matrix_by_hand():
  np.testing.assert_allclose(TWO.coefficients(4), [1.0, 0.5, 0.3 * 0.9 + 0.1, 0.3 * 0.81 + 0.05])
  C = TWO.matrix(4)
  np.testing.assert_allclose(C[3], [0.3 * 0.81 + 0.05, 0.3 * 0.9 + 0.1, 0.5, 1.0])
  assert np.all(np.triu(C, 1) == 0)


def test_blt_step_is_the_inverse_of_c():
  n, d = 12, 3
  z = np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)
  buffers, ws = [[tf.zeros(d)] for _ in range(TWO.buffers)], []
  for t in range(n):
    w, buffers = cn.blt_step([tf.constant(z[t])], buffers, TWO.theta, TWO.omega)
    ws.append(w[0].numpy())
  np.testing.assert_allclose(np.stack(ws), np.linalg.solve(TWO.matrix(n), z), rtol=1e-4,
                             atol=1e-5)


@pytest.mark.parametrize("strategy", [
    TWO, bl.BLTStrategy((0.99,), (0.9,)), bl.BLTStrategy((0.2, 0.6, 0.95), (0.1, 0.1, 0.05)),
    bl.optimize_blt(12, 2, separation=3)])
def test_minsep_sensitivity_matches_brute_force(strategy):
  n = 12
  C = strategy.matrix(n)
  for separation in (1, 2, 3, 5):
    assert bl.minsep_sensitivity(strategy, n, separation) == pytest.approx(
        st.sensitivity(C, None, separation=separation), rel=1e-12)
    for k in (1, 2):
      assert bl.minsep_sensitivity(strategy, n, separation, k) == pytest.approx(
          st.sensitivity(C, k, separation=separation), rel=1e-12)
  # One participation: the first column, the largest.
  assert bl.minsep_sensitivity(strategy, n, 1, 1) == pytest.approx(np.linalg.norm(C[:, 0]))


def test_minsep_sensitivity_matches_brute_force_on_random_and_extreme_blts():
  """The worst case of Thm. 2 (participations at 0, b, 2b, ...) on BLTs an adversary could
  pass: decays near 0 and near 1, output scales summing to exactly 1, one buffer dominating;
  every participation pattern enumerated (any offset, any number)."""
  rng = np.random.default_rng(7)
  strategies = [bl.BLTStrategy((1e-9,), (1.0,)), bl.BLTStrategy((1 - 1e-9,), (1.0,)),
                bl.BLTStrategy((0.999999, 1e-6), (0.5, 0.5)),
                bl.BLTStrategy((0.3, 0.6, 0.9), (0.0, 0.0, 1.0))]
  for _ in range(12):
    d = int(rng.integers(1, 4))
    omega = rng.dirichlet(np.ones(d + 1))[:d] * rng.choice([1.0, 1.0 / rng.uniform(0.5, 1)])
    omega = omega / max(1.0, omega.sum())
    strategies.append(bl.BLTStrategy(tuple(rng.uniform(1e-3, 1 - 1e-3, d)), tuple(omega)))
  n = 11
  for strategy in strategies:
    C = strategy.matrix(n)
    for separation in (1, 2, 3, 4):
      assert bl.minsep_sensitivity(strategy, n, separation) == pytest.approx(
          st.sensitivity(C, None, separation=separation), rel=1e-12), (strategy, separation)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_total_error_and_loss_match_the_dense_formula(momentum):
  n, separation = 40, 4
  A = st.workload_matrix(n, momentum)
  dense = np.linalg.norm(A @ np.linalg.inv(TWO.matrix(n)), "fro") ** 2
  assert bl.total_error(TWO, n, momentum) == pytest.approx(dense, rel=1e-9)
  k = -(-n // separation)
  identity_loss = k * np.linalg.norm(A, "fro") ** 2  # DP-SGD: sensitivity sqrt(k), C = I
  best = bl.optimize_blt(n, 2, separation, momentum)
  print(f"momentum {momentum}: BLT(2) loss / n {bl.loss(best, n, separation, momentum) / n:.2f}"
        f", DP-SGD {identity_loss / n:.2f}")
  assert bl.loss(best, n, separation, momentum) < 0.8 * identity_loss


def _applied_noise_prefix_sums(blt_parameters, n, dim, seed, momentum=0.0):
  return fixtures.applied_noise_prefix_sums(n, dim, seed, momentum, lineage=LINEAGE,
                                            blt_parameters=blt_parameters)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_empirical_prefix_sum_error_matches_the_factorization(momentum):
  n, dim, seeds = 16, 4000, (0, 1, 2)
  blt = bl.optimize_blt(n, 2, separation=4, momentum=momentum)
  predicted = bl.total_error(blt, n, momentum) / n
  independent = st.identity_strategy(n, momentum).error / n
  sums = np.concatenate([_applied_noise_prefix_sums([list(blt.theta), list(blt.omega)], n,
                                                    dim, s, momentum) for s in seeds], axis=1)
  got = float(np.mean(np.sum(sums ** 2, axis=0))) / n
  print(f"momentum {momentum}: BLT {blt}: predicted {predicted:.4f} empirical {got:.4f} "
        f"(independent {independent:.4f})")
  # 12000 independent coordinates: the relative standard error is below 2%.
  assert got == pytest.approx(predicted, rel=0.05)
  assert got < independent


def test_optimizer_config_round_trip_and_refusals():
  params = [list(TWO.theta), list(TWO.omega)]
  opt = tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                        blt_parameters=params)
  again = tf_dpnsgd.DPSGD.from_config(opt.get_config())
  assert again.blt_parameters == params and again.band_coefficients is None
  assert again.bands == TWO.ledger_code <= ledger_lib.BLT_BANDS
  other = bl.BLTStrategy((0.9, 0.5), (0.3, 0.2000001))
  assert other.ledger_code != TWO.ledger_code  # the ledger tells BLTs apart
  with pytest.raises(ValueError, match="not both"):
    tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, blt_parameters=params,
                    band_coefficients=[1.0])
  with pytest.raises(ValueError, match="sum <= 1"):
    bl.BLTStrategy((0.5, 0.5), (0.8, 0.8))
  with pytest.raises(ValueError, match=r"\(0, 1\)"):
    bl.BLTStrategy((1.0,), (0.5,))
  plan = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2, steps=4,
                     noise_multiplier=1.0, delta=1e-5, seed=0)
  with pytest.raises(ValueError, match="amplification .* does not apply"):
    plan.check_optimizer(opt)  # a BandMF plan (amplified) cannot account for a BLT
  with_other = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2,
                           steps=4, noise_multiplier=1.0, delta=1e-5, seed=0,
                           blt=other.parameters())
  with pytest.raises(ValueError, match="plan accounts for BLT noise with theta"):
    with_other.check_optimizer(opt)  # another BLT: another sensitivity
  with pytest.raises(accounting.UnsupportedAccountingError, match="cyclic_poisson"):
    PrivacyPlan(dataset_size=64, batch_size=8, sampling="poisson", steps=4,
                noise_multiplier=1.0, delta=1e-5, blt=params)
  with pytest.raises(accounting.AccountingError, match="sum <= 1"):
    PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2, steps=4,
                noise_multiplier=1.0, delta=1e-5, blt=[[0.5, 0.5], [0.8, 0.8]])


def _oracle_epsilon(strategy, steps, separation, sigma, delta, accountant="rdp"):
  """dp-accounting's epsilon of ONE Gaussian mechanism whose sensitivity is found by
  enumerating every participation pattern (steps ``separation`` apart) of the matrix."""
  sensitivity = st.sensitivity(strategy.matrix(steps), None, separation=separation)
  if accountant == "pld":
    acc = dp_accounting.pld.PLDAccountant()
  else:
    acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.GaussianDpEvent(sigma / sensitivity))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_the_epsilon_of_blt_noise_is_one_gaussian_mechanism_of_the_enumerated_sensitivity(
    accountant):
  n, b, sigma, delta = 12, 3, 3.0, 1e-5
  strategy = bl.optimize_blt(n, 2, b)
  plan = PrivacyPlan(dataset_size=60, batch_size=5, sampling="cyclic_poisson", bands=b,
                     steps=n, noise_multiplier=sigma, delta=delta, seed=0, accountant=accountant,
                     blt=strategy.parameters())
  epsilons = [plan.epsilon(t) for t in range(1, n + 1)]
  for t in (1, 2, 4, 7, n):
    assert epsilons[t - 1] == pytest.approx(
        _oracle_epsilon(strategy, t, b, sigma, delta, accountant), rel=1e-6 if accountant == "rdp"
        else 1e-3), t
  assert all(a <= b for a, b in zip(epsilons, epsilons[1:]))  # a prefix releases less
  # Independent noise without amplification over the same participations (C = I):
  # sensitivity sqrt(ceil(n / b)); the BLT's is larger (its columns overlap), its error smaller.
  assert st.sensitivity(strategy.matrix(n), None, separation=b) > np.sqrt(-(-n // b))
  # Calibration: the target is met by the epsilon of what ran.
  target = PrivacyPlan(dataset_size=60, batch_size=5, sampling="cyclic_poisson", bands=b,
                       steps=n, target_epsilon=4.0, delta=delta, seed=0, accountant=accountant,
                       blt=strategy.parameters())
  got = _oracle_epsilon(strategy, n, b, target.training_noise_multiplier, delta, accountant)
  assert got <= 4.0 * (1 + 2e-3) and got > 3.9
  assert PrivacyPlan.from_json(target.to_json()) == target  # the BLT travels with the plan


@pytest.mark.slow
def test_make_private_blt_trains_and_reports_the_plans_blt(tmp_path):
  """One call: the plan's BLT is optimized for its steps, separation and the optimizer's
  momentum, handed to the optimizer, recorded by the ledger and reported; a .keras round
  trip keeps the plan's BLT and the report, and a second fit is refused at the budget."""
  x, y = fixtures.tiny_data(64)
  model = tf_dpnsgd.make_private(fixtures.tiny_model("sequential", seed=0), noise="blt",
                                 bands=2, blt_buffers=2, noise_multiplier=2.0, delta=1e-5,
                                 batch_size=8, steps=6)
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, verbose=0)
  plan = model.privacy_plan
  expected = bl.optimize_blt(plan.num_steps, 2, 2, momentum=0.9)
  np.testing.assert_allclose(np.ravel(plan.blt), np.ravel(expected.parameters()), rtol=1e-9)
  assert model.optimizer.blt_parameters == [list(v) for v in plan.blt]
  ledger = ledger_lib.ledger_of(model)
  assert ledger.steps == 6 and ledger.noise_bands == bl.BLTStrategy(*plan.blt).ledger_code
  report = model.privacy_report()
  assert report.epsilon == pytest.approx(
      _oracle_epsilon(bl.BLTStrategy(*plan.blt), 6, 2, 2.0, 1e-5), rel=1e-6)
  assert any("BLT" in note and "WITHOUT amplification" in note for note in report.notes)
  assert report.to_dict()["sampling"] == "cyclic_poisson"
  assert all(np.all(np.isfinite(w)) for w in model.get_weights())
  model.save(str(tmp_path / "m.keras"))
  loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  assert loaded.privacy_plan.blt == plan.blt
  assert loaded.optimizer.blt_parameters == model.optimizer.blt_parameters
  assert loaded.privacy_report().epsilon == pytest.approx(report.epsilon, rel=1e-12)
  for again in (model, loaded):
    with pytest.raises(PrivacyBudgetExceededError):
      again.fit(x, y, verbose=0)  # the plan's 6 steps ran: refused, nothing counted
    assert ledger_lib.ledger_of(again).steps == 6


def test_a_model_trained_with_blt_noise_is_refused_by_a_plan_for_other_noise():
  """The ledger records which BLT ran; a BandMF plan (or another BLT's) does not report it."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)
  inputs = keras.Input((4,))
  model = tf_dpnsgd.make_private(keras.Model(inputs, keras.layers.Dense(2)(inputs)))
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                          noise_multiplier=1.0,
                                          blt_parameters=[list(TWO.theta), list(TWO.omega)]),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  plan = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2, steps=4,
                     noise_multiplier=1.0, delta=1e-5, seed=0)
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=2, epochs=1, verbose=0)
  ledger = ledger_lib.ledger_of(model)
  assert ledger.steps == 2 and ledger.noise_bands == TWO.ledger_code
  assert all(np.all(np.isfinite(w)) for w in model.get_weights())
  with pytest.raises(ledger_lib.LedgerMismatchError, match="BLT noise"):
    plan.report(model)
  other = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2,
                      steps=4, noise_multiplier=1.0, delta=1e-5, seed=0,
                      blt=bl.BLTStrategy((0.9, 0.5), (0.3, 0.1)).parameters())
  with pytest.raises(ledger_lib.LedgerMismatchError, match="BLT noise .* accounts for BLT"):
    other.report(model)
  same = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2,
                     steps=4, noise_multiplier=1.0, delta=1e-5, seed=0, blt=TWO.parameters())
  assert same.report(model).epsilon == pytest.approx(
      _oracle_epsilon(TWO, 2, 2, 1.0, 1e-5), rel=1e-6)


def test_make_private_blt_arguments_are_checked():
  base = fixtures.tiny_model("functional", seed=0)
  common = dict(noise_multiplier=1.0, delta=1e-5, batch_size=8, steps=6)
  with pytest.raises(ValueError, match="needs an int `bands` >= 1"):
    tf_dpnsgd.make_private(base, noise="blt", **common)
  with pytest.raises(ValueError, match="`blt_buffers` >= 1"):
    tf_dpnsgd.make_private(base, noise="blt", bands=2, blt_buffers=0, **common)
  with pytest.raises(ValueError, match="needs noise='blt'"):
    tf_dpnsgd.make_private(base, noise="bandmf", bands=2, blt_buffers=2, **common)
  with pytest.raises(ValueError, match="cyclic Poisson"):
    tf_dpnsgd.make_private(base, noise="blt", bands=2, sampling="poisson", **common)


def test_blt_buffers_travel_with_the_keras_file_and_continue_the_same_stream(tmp_path):
  """Oracle: an uninterrupted run with the same initial weights and seeds."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)
  plan = PrivacyPlan(dataset_size=64, batch_size=8, sampling="cyclic_poisson", bands=2, steps=4,
                     noise_multiplier=1.0, delta=1e-5, seed=3)

  def model():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    m = tf_dpnsgd.make_private(keras.Model(inputs, keras.layers.Dense(2)(inputs)))
    m.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, momentum=0.9,
                                        noise_multiplier=1.0, seed=4,
                                        blt_parameters=[list(TWO.theta), list(TWO.omega)]),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m

  def fit(m, steps):
    m.fit(plan.dataset(x, y, model=m), steps_per_epoch=steps, epochs=1, verbose=0)

  straight = model()
  fit(straight, 4)
  first = model()
  fit(first, 2)
  first.save(str(tmp_path / "m.keras"))
  loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  assert loaded.optimizer.blt_parameters == first.optimizer.blt_parameters
  fit(loaded, 2)
  assert ledger_lib.ledger_of(loaded).steps == 4
  for a, b in zip(straight.get_weights(), loaded.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_an_extended_blt_plan_continues_the_stream_and_accounts_every_step():
  """Unlike a banded strategy (optimized for the planned steps, refused when extended), a
  BLT's Toeplitz matrix continues: the extended plan keeps the BLT and its epsilon is that of
  the longer prefix (oracle: enumeration over 8 steps)."""
  x, y = fixtures.tiny_data(64)
  model = tf_dpnsgd.make_private(fixtures.tiny_model("functional", seed=0), noise="blt",
                                 bands=2, noise_multiplier=2.0, delta=1e-5, batch_size=8,
                                 steps=6)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, verbose=0)
  blt = model.privacy_plan.blt
  model.extend_privacy_plan(steps=8)
  assert model.privacy_plan.blt == blt and model.privacy_plan.num_steps == 8
  model.fit(x, y, verbose=0)
  assert ledger_lib.ledger_of(model).steps == 8
  assert model.privacy_report().epsilon == pytest.approx(
      _oracle_epsilon(bl.BLTStrategy(*blt), 8, 2, 2.0, 1e-5), rel=1e-6)
  assert all(np.all(np.isfinite(w)) for w in model.get_weights())
