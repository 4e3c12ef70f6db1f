"""Attacks on the claim "the epsilon it prints is the epsilon it executed".

Each test performs, through the public API, a sequence a user could run that
used to make the reported epsilon cover fewer or different steps than ran
(issue 10), and checks that the package now refuses it or reports the true
epsilon, computed independently with dp-accounting.
"""

import h5py
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd.callbacks import PrivacyBudgetExceededError
from tf_dpnsgd.ledger import LedgerMismatchError
from tf_dpnsgd.plan import PrivacyPlan

N, B, DELTA = 40, 8, 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def toy_data(n=N, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def build(seed=0, use_bias=True):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((3,))
  return tf_dpnsgd.DPModel(inp, keras.layers.Dense(2, use_bias=use_bias)(inp))


def compile_(model, sigma=1.0, seed=None, lr=0.1, jit_compile=False, momentum=0.9):
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=lr, l2_norm_clip=1.0, momentum=momentum,
                                          noise_multiplier=sigma, seed=seed), loss=LOSS,
                jit_compile=jit_compile)
  return model


def state(model):
  """Everything a refused step must leave unchanged: weights, ledger, optimizer."""
  # (expected_kind is set by the plan's callback before the step, not by the step.)
  ledger = {k: v for k, v in model.privacy_ledger.state().items() if k != "expected_kind"}
  return ([np.asarray(v.numpy()).copy() for v in model.weights]
          + [np.asarray(v) for _, v in sorted(ledger.items())]
          + [np.asarray(v.numpy()).copy() for v in model.optimizer.variables])


def assert_unchanged(before, model):
  after = state(model)
  assert len(before) == len(after)
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)


def plan_(sampling="poisson", steps=100, sigma=1.0, batch_size=B):
  return PrivacyPlan(dataset_size=N, batch_size=batch_size, sampling=sampling, steps=steps,
                     noise_multiplier=sigma, delta=DELTA)


def fit_steps(model, plan, x, y, steps, callbacks=None):
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=steps, epochs=1, verbose=0,
            callbacks=callbacks or [])


def trainable(model):
  return [w.numpy().copy() for w in model.trainable_weights]


def shuffle_epsilon_oracle(sigma, compositions):
  """dp-accounting directly: Gaussian with replace-one sensitivity 2S, composed."""
  accountant = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  accountant.compose(dp_accounting.GaussianDpEvent(sigma / 2), compositions)
  return accountant.get_epsilon(DELTA)


# --- 1. sampler and accountant drift apart at fit time -------------------------
@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True])
def test_keras_drawn_batches_under_a_poisson_plan_are_refused_before_any_step(jit_compile):
  x, y = toy_data()
  plan = plan_()
  model = compile_(build(), jit_compile=jit_compile)
  fit_steps(model, plan, x, y, 2)  # builds the optimizer: its state must not move either
  before = state(model)
  with pytest.raises(LedgerMismatchError, match=r"plan\.dataset"):
    model.fit(x, y, batch_size=B, epochs=1, callbacks=plan.callbacks(), verbose=0)
  assert model.privacy_ledger.steps == 2
  assert_unchanged(before, model)  # the refused step changed nothing


@pytest.mark.slow
def test_keras_drawn_batches_are_never_reported_with_poisson_accounting():
  x, y = toy_data()
  model = compile_(build())
  model.fit(x, y, batch_size=B, epochs=3, verbose=0)  # no plan: Keras draws the batches
  ledger = model.privacy_ledger
  assert ledger.steps == 15 and ledger.kind == "untagged"
  with pytest.raises(LedgerMismatchError, match="Keras drew"):
    plan_("poisson").report(model)
  with pytest.raises(LedgerMismatchError):
    plan_("uniform").report(model)
  # The honest epsilon: every step a full Gaussian mechanism (no epoch assumption).
  report = plan_("shuffle").report(model)
  assert report.steps == 15
  oracle = shuffle_epsilon_oracle(1.0, 15)
  assert oracle * 0.97 <= report.epsilon <= oracle * (1 + 1e-9)
  # ... far above what Poisson accounting of 15 steps would have claimed.
  assert report.epsilon > 3 * plan_("poisson").epsilon(15)


# --- 2. replayed or skipped batches ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("jit_compile,steps_per_execution", [(False, 1), (True, 1), (False, 3),
                                                              (True, 3)])
def test_a_second_fit_cannot_replay_the_first_fits_batches(jit_compile, steps_per_execution):
  x, y = toy_data()
  plan = plan_()
  model = compile_(build(), jit_compile=jit_compile)
  model.compile(optimizer=model.optimizer, loss=LOSS, jit_compile=jit_compile,
                steps_per_execution=steps_per_execution)
  fit_steps(model, plan, x, y, 4, plan.callbacks())
  taken = model.privacy_ledger.steps  # Keras may round 4 steps up to whole executions
  assert taken >= 4 and plan.report(model).steps == taken
  before = state(model)
  with pytest.raises(LedgerMismatchError, match="replayed or skipped"):
    model.fit(plan.dataset(x, y), steps_per_epoch=4, epochs=1, verbose=0)  # restarts at 0
  assert model.privacy_ledger.steps == taken
  assert_unchanged(before, model)
  if steps_per_execution > 1:
    return
  # The fix named by the error: continue the ledger.
  assert plan.fit_kwargs(model)["initial_epoch"] == 4 // plan.spec.steps_per_epoch
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=3, epochs=1, verbose=0,
            callbacks=plan.callbacks())
  assert model.privacy_ledger.steps == 7
  assert plan.report(model).steps == 7
  assert plan.report(model).epsilon == pytest.approx(plan.epsilon(7))


def test_skipped_batches_are_refused():
  x, y = toy_data()
  plan = plan_("uniform")
  model = compile_(build())
  with pytest.raises(LedgerMismatchError, match="replayed or skipped"):
    model.fit(plan.dataset(x, y, start_step=5), steps_per_epoch=1, epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 0
  with pytest.raises(ValueError, match="privacy ledger"):
    plan.dataset(x, y, start_step=5, model=model)


@pytest.mark.slow
def test_batches_of_another_sampler_are_refused():
  x, y = toy_data()
  model = compile_(build())
  fit_steps(model, plan_(batch_size=8), x, y, 2)
  other = plan_(batch_size=10)  # another q: its steps are not the ledger's steps
  with pytest.raises(LedgerMismatchError, match="another sampling"):
    fit_steps(model, other, x, y, 1)
  with pytest.raises(LedgerMismatchError, match="another sampler"):
    other.report(model)
  with pytest.raises(LedgerMismatchError):
    model.fit(other.dataset(x, y, model=model), callbacks=other.callbacks(), verbose=0,
              steps_per_epoch=1, epochs=1)
  assert model.privacy_ledger.steps == 2


# --- 3. the count and the noise stream survive optimizer changes ----------------
@pytest.mark.slow
def test_recompile_with_a_fresh_optimizer_keeps_the_count_and_never_repeats_noise():
  # Zero inputs and no bias: the gradient is exactly 0, so each update is pure noise.
  x = np.zeros((N, 3), np.float32)
  y = np.zeros(N, np.int32)
  plan = plan_("uniform", sigma=3.0)

  straight = compile_(build(use_bias=False), sigma=3.0, seed=5, lr=1.0, momentum=0.0)
  fit_steps(straight, plan, x, y, 5)

  staged = compile_(build(use_bias=False), sigma=3.0, seed=5, lr=1.0, momentum=0.0)
  w0 = trainable(staged)[0]
  fit_steps(staged, plan, x, y, 3)
  w3 = trainable(staged)[0]
  compile_(staged, sigma=3.0, seed=5, lr=1.0, momentum=0.0)  # fine-tuning stage: a new optimizer, same seed
  fit_steps(staged, plan, x, y, 2)

  assert staged.privacy_ledger.steps == 5
  assert plan.report(staged).epsilon == pytest.approx(plan.epsilon(5))
  # The second stage drew the noise of steps 3 and 4, not 0 and 1 again.
  np.testing.assert_allclose(trainable(staged)[0], trainable(straight)[0], rtol=1e-6, atol=1e-7)
  second_stage = trainable(staged)[0] - w3
  assert not np.allclose(second_stage, w3 - w0, atol=1e-3)


@pytest.mark.slow
def test_load_weights_before_the_optimizer_exists_restores_the_count(tmp_path):
  x, y = toy_data()
  plan = plan_()
  model = compile_(build())
  fit_steps(model, plan, x, y, 12, plan.callbacks())
  path = str(tmp_path / "ckpt.weights.h5")
  model.save_weights(path)

  fresh = compile_(build(seed=1))
  assert not fresh.optimizer.built
  fresh.load_weights(path)
  assert fresh.privacy_ledger.steps == 12
  fresh.fit(plan.dataset(x, y, model=fresh), callbacks=plan.callbacks(), verbose=0,
            steps_per_epoch=5, epochs=1)
  assert fresh.privacy_ledger.steps == 17
  assert plan.report(fresh).epsilon == pytest.approx(plan.epsilon(17))
  assert plan.report(fresh).epsilon > plan.epsilon(5)


@pytest.mark.slow
def test_keras_file_round_trip_keeps_the_ledger(tmp_path):
  x, y = toy_data()
  plan = plan_("shuffle")
  model = compile_(build())
  fit_steps(model, plan, x, y, 6, plan.callbacks())
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.privacy_ledger.to_dict() == model.privacy_ledger.to_dict()
  fit_steps(loaded, plan, x, y, 3, plan.callbacks())
  assert plan.report(loaded).steps == 9


def test_budget_stop_then_resume_cannot_cross_the_budget(tmp_path):
  x, y = toy_data()
  plan = plan_(steps=7)
  model = compile_(build())
  model.fit(plan.dataset(x, y, model=model), callbacks=plan.callbacks(), verbose=0,
            **plan.fit_kwargs(model))
  assert model.privacy_ledger.steps == 7
  path = str(tmp_path / "w.weights.h5")
  model.save_weights(path)
  resumed = compile_(build())
  resumed.load_weights(path)
  with pytest.raises(PrivacyBudgetExceededError):
    resumed.fit(plan.dataset(x, y, model=resumed), callbacks=plan.callbacks(), verbose=0,
                **plan.fit_kwargs(resumed))
  assert plan.report(resumed).epsilon <= plan.planned_report().epsilon


# --- what the report describes ----------------------------------------------------
def test_report_counts_the_steps_taken_not_the_planned_ones():
  x, y = toy_data()
  plan = plan_(steps=100)
  model = compile_(build())
  assert plan.report(model).steps == 0 and plan.report(model).epsilon == 0.0
  fit_steps(model, plan, x, y, 7)
  assert plan.report(model).steps == 7
  assert plan.report(model).epsilon == pytest.approx(plan.epsilon(7))
  assert plan.report(model).epsilon < plan.planned_report().epsilon


def test_less_noise_than_planned_cannot_be_reported():
  x, y = toy_data()
  plan = plan_(sigma=1.0)
  model = compile_(build(), sigma=0.5)  # no callback to check the optimizer
  fit_steps(model, plan, x, y, 3)
  assert model.privacy_ledger.min_noise_multiplier == pytest.approx(0.5)
  with pytest.raises(LedgerMismatchError, match="noise_multiplier 0.5"):
    plan.report(model)


@pytest.mark.slow
def test_a_user_fixed_noise_seed_is_said_in_the_report():
  x, y = toy_data()
  plan = plan_()
  seeded = compile_(build(), seed=3)
  fit_steps(seeded, plan, x, y, 2)
  assert any("user-fixed seed" in n for n in plan.report(seeded).notes)
  private = compile_(build())
  fit_steps(private, plan, x, y, 2)
  assert not any("seed" in n for n in plan.report(private).notes)


@pytest.mark.slow
def test_default_noise_is_os_random_and_its_key_is_never_saved(tmp_path):
  x, y = toy_data()
  plan = plan_("uniform")
  runs = []
  for _ in range(2):
    model = compile_(build(seed=0))
    fit_steps(model, plan, x, y, 2)
    runs.append(trainable(model))
  assert not np.allclose(runs[0][0], runs[1][0])  # same data, init, batches: other noise
  path = str(tmp_path / "m.weights.h5")
  model.save_weights(path)
  key = model.optimizer._noise_key[0]
  names, ints = [], []
  with h5py.File(path) as f:
    f.visititems(lambda name, obj: (names.append(name), ints.append(np.asarray(obj)))
                 if isinstance(obj, h5py.Dataset) else None)
  assert not any("seed" in n for n in names)
  assert not any(a.dtype.kind in "iu" and (a == key).any() for a in ints)


def test_ledger_is_model_state_not_trainable():
  model = build()
  assert model.privacy_ledger.steps == 0 and model.privacy_ledger.kind is None
  ledger_vars = {id(v) for v in model.privacy_ledger.weights}
  assert not ledger_vars & {id(v) for v in model.trainable_weights}
  # Not in the weight list (so set_weights with a plain twin works), saved all the same.
  assert not ledger_vars & {id(v) for v in model.weights}
  with pytest.raises(TypeError, match="privacy ledger"):
    tf_dpnsgd.ledger_of(keras.Sequential([keras.layers.Dense(1)]))


# --- the host's reads of the ledger (issue 47: one ReadVariableOp a variable) -----------------
def test_host_reads_equal_keras_reads_for_every_field_and_see_writes_made_in_a_graph():
  """``ledger.host_value`` against Keras' own ``variable.numpy()`` (the oracle): every field of
  a ledger (int32, int64, float32, float64; scalars and the release and warm-start vectors) at
  extreme values, after writes made on the host and inside a traced function; a float16 and
  a mixed-precision (autocast) variable; anything without a ``tf.Variable`` underneath falls
  back to ``numpy()``."""
  from tf_dpnsgd import ledger as ledger_lib  # pylint: disable=import-outside-toplevel

  led = ledger_lib.PrivacyLedger(name="host_read_ledger")
  fields = dict(led._vars)

  def check():
    for name, v in fields.items():
      mine, keras_own = ledger_lib.host_value(v), np.asarray(v.numpy())
      assert mine.dtype == keras_own.dtype and mine.shape == keras_own.shape, name
      np.testing.assert_array_equal(mine, keras_own, err_msg=name)

  check()  # fresh: zeros, +inf minima, a random lineage
  extremes = {np.dtype("int64"): np.iinfo(np.int64).min, np.dtype("int32"): np.iinfo(np.int32).max,
              np.dtype("float32"): -np.finfo(np.float32).max, np.dtype("float64"): np.nan}
  for v in fields.values():
    dtype = np.asarray(v.numpy()).dtype
    v.assign(np.full(v.shape, extremes[dtype], dtype))
  check()

  @tf.function
  def step():
    fields["steps"].assign_add(1)
    fields[ledger_lib.RELEASE_FIELD].assign(tf.fill([ledger_lib.MAX_RELEASES], 0.25))

  fields["steps"].assign(41)
  step()
  assert int(ledger_lib.host_value(fields["steps"])) == 42 == led.steps
  assert ledger_lib.host_value(fields[ledger_lib.RELEASE_FIELD]).tolist() == [0.25] * 64
  check()
  state = led.state()
  assert state["steps"] == 42 and state[ledger_lib.RELEASE_FIELD] == [0.25] * 64

  half = keras.Variable(np.array([1.5, -2.0], np.float16))
  assert ledger_lib.host_value(half).dtype == np.float16
  np.testing.assert_array_equal(ledger_lib.host_value(half), half.numpy())
  policy = keras.config.dtype_policy()
  keras.config.set_dtype_policy("mixed_float16")
  try:
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    np.testing.assert_array_equal(ledger_lib.host_value(layer.kernel), layer.kernel.numpy())
    assert ledger_lib.host_value(layer.kernel).dtype == np.float32  # the stored variable's
  finally:
    keras.config.set_dtype_policy(policy)

  class NotAVariable:  # e.g. a distributed variable: no single handle outside a replica
    value = np.array([3, 4])

    def numpy(self):
      return self.value

  assert ledger_lib.host_value(NotAVariable()).tolist() == [3, 4]
