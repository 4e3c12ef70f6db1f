"""Issue 20: ``make_private(model, target_epsilon=...)`` then plain Keras ``compile``/``fit``.

The oracles: the explicit path (``PrivacyPlan`` + ``plan.dataset`` +
``plan.callbacks()``), whose epsilon is tested against dp-accounting in
test_plan/test_accounting, and step counts computed by hand.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd.callbacks import PrivacyBudgetExceededError

N, B = 60, 10
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=N, shape=(4,), seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n,) + shape).astype("float32")
  return x, (x.reshape(n, -1)[:, 0] > 0).astype("int32")


def mlp(shape=(4,), seed=0):
  keras.utils.set_random_seed(seed)
  inp = keras.Input(shape)
  h = keras.layers.Flatten()(inp) if len(shape) > 1 else inp
  return keras.Model(inp, keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(h)))


def private(model=None, **kw):
  kw.setdefault("delta", 1e-5)
  kw.setdefault("batch_size", B)
  if "steps" not in kw:
    kw.setdefault("epochs", 2)
  if "noise_multiplier" not in kw:
    kw.setdefault("target_epsilon", 3.0)
  m = tf_dpnsgd.make_private(model or mlp(), **kw)
  return m


def compile_(m, **opt):
  m.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01, **opt), loss=LOSS,
            metrics=["accuracy"])
  return m


@pytest.mark.slow
def test_one_call_matches_the_explicit_plan_and_reports_what_ran():
  x, y = data()
  m = compile_(private())
  history = m.fit(x, y, validation_data=data(20, seed=1), verbose=0)
  explicit = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", epochs=2,
                                   target_epsilon=3.0, delta=1e-5)
  assert m.privacy_plan.training_noise_multiplier == pytest.approx(
      explicit.training_noise_multiplier)
  assert m.optimizer.noise_multiplier == pytest.approx(explicit.training_noise_multiplier)
  assert m.privacy_ledger.steps == explicit.num_steps == 12  # 2 epochs of N/B = 6 steps
  assert m.privacy_ledger.kind == "poisson"  # the plan's sampler drew the batches
  assert history.history["epsilon"][-1] == pytest.approx(explicit.epsilon(12))
  assert "val_accuracy" in history.history
  report = m.privacy_report()
  assert report.steps == 12 and report.epsilon == pytest.approx(explicit.epsilon(12))
  assert report.epsilon <= 3.0
  assert m.evaluate(x, y, verbose=0, return_dict=True)["accuracy"] >= 0.0
  assert m.predict(x, verbose=0).shape == (N, 2)


@pytest.mark.slow
def test_a_second_fit_at_the_budget_is_refused():
  x, y = data()
  m = compile_(private(epochs=1))
  m.fit(x, y, verbose=0)
  assert m.privacy_ledger.steps == 6
  with pytest.raises(PrivacyBudgetExceededError):
    m.fit(x, y, verbose=0)
  assert m.privacy_ledger.steps == 6


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 32}, r"batch_size=32.*batches of 10"),
    ({"epochs": 5}, r"epochs=5.*2 epochs"),
    ({"steps_per_epoch": 3}, r"steps_per_epoch=3"),
    ({"sample_weight": np.ones(N)}, "sample_weight"),
])
def test_fit_arguments_that_disagree_with_the_plan_are_refused(kwargs, match):
  x, y = data()
  m = compile_(private())
  with pytest.raises(ValueError, match=match):
    m.fit(x, y, verbose=0, **kwargs)
  assert m.privacy_ledger.steps == 0


@pytest.mark.slow
def test_a_batched_foreign_dataset_is_refused_an_unbatched_one_is_sampled():
  x, y = data()
  m = compile_(private())
  with pytest.raises(ValueError, match="looks batched"):
    m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), verbose=0)
  m.fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0)  # examples: the plan batches
  assert m.privacy_ledger.steps == 12 and m.privacy_plan.dataset_size == N


@pytest.mark.slow
def test_batches_of_the_models_own_plan_pass_through_the_explicit_path():
  x, y = data()
  m = compile_(private(dataset_size=N))
  plan = m.privacy_plan
  m.fit(plan.dataset(x, y, model=m), callbacks=plan.callbacks(), verbose=0,
        **plan.fit_kwargs(m))
  assert m.privacy_ledger.steps == 12


@pytest.mark.slow
def test_a_noise_multiplier_that_disagrees_with_the_plan_is_refused():
  m = private(dataset_size=N)
  with pytest.raises(ValueError, match="differs from the model's privacy plan"):
    compile_(m, noise_multiplier=0.5)
  deferred = compile_(private(), noise_multiplier=0.5)  # N unknown until fit: refused there
  x, y = data()
  with pytest.raises(ValueError, match="differs from the model's privacy plan"):
    deferred.fit(x, y, verbose=0)
  assert deferred.privacy_ledger.steps == 0


def test_a_model_without_plan_needs_a_noise_multiplier():
  m = tf_dpnsgd.make_private(mlp())
  with pytest.raises(ValueError, match="no noise_multiplier"):
    compile_(m)


def test_another_data_set_size_is_refused():
  x, y = data()
  m = compile_(private(epochs=1, target_epsilon=None, noise_multiplier=1.0))
  m.fit(x, y, verbose=0)
  with pytest.raises(ValueError, match="N = 60"):
    m.fit(*data(50), verbose=0)


def test_keyword_mistakes_fail_at_make_private():
  with pytest.raises(ValueError, match="exactly one of `target_epsilon`"):
    tf_dpnsgd.make_private(mlp(), target_epsilon=1.0, noise_multiplier=1.0, delta=1e-5,
                           batch_size=B, epochs=1)
  with pytest.raises(ValueError, match=r"\['delta'\]"):
    tf_dpnsgd.make_private(mlp(), target_epsilon=1.0, batch_size=B, epochs=1)
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=3,
                               noise_multiplier=1.0, delta=1e-5)
  with pytest.raises(ValueError, match="not both"):
    tf_dpnsgd.make_private(mlp(), plan=plan, target_epsilon=1.0)


def test_a_plan_alone_is_owned_and_its_privacy_callback_can_be_the_callers(tmp_path):
  """make_private(model, plan=plan) (the launchers' one-call path; the default sampling and
  accountant keywords once counted as 'both given'); a budget-stopping PrivacyCallback of
  that plan among fit's callbacks (with a state file) replaces the default one, any other
  is added to it."""
  from tf_dpnsgd import owned_plan
  from tf_dpnsgd.callbacks import PrivacyCallback
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=3,
                               noise_multiplier=1.0, delta=1e-5)
  m = tf_dpnsgd.make_private(mlp(), plan=plan)
  assert m.privacy_plan is plan
  x, y = data()
  mine = plan.callbacks(state_path=str(tmp_path / "state.json"))
  args = owned_plan.fit_arguments(m, {"x": x, "y": y, "callbacks": mine})
  assert [c for c in args["callbacks"] if isinstance(c, PrivacyCallback)] == mine
  logging_only = plan.callbacks(stop_at_budget=False)
  args = owned_plan.fit_arguments(m, {"x": x, "y": y, "callbacks": logging_only})
  budgets = [c.epsilon_budget for c in args["callbacks"] if isinstance(c, PrivacyCallback)]
  assert len(budgets) == 2 and budgets[1] is None and budgets[0] == pytest.approx(plan.epsilon())


@pytest.mark.slow
def test_cifar_shaped_images_dicts_and_a_keras_file_round_trip(tmp_path):
  x, y = data(40, shape=(32, 32, 3))
  m = compile_(private(mlp(shape=(32, 32, 3)), batch_size=8, steps=7, sampling="uniform"))
  m.fit(x, y, verbose=0)
  assert m.privacy_ledger.steps == 7 and m.privacy_ledger.kind == "uniform"
  path = str(tmp_path / "m.keras")
  m.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.privacy_plan.num_steps == 7
  assert loaded.privacy_plan.training_noise_multiplier == pytest.approx(
      m.privacy_plan.training_noise_multiplier)
  assert loaded.privacy_report().steps == 7
  assert "seed" not in str(loaded.get_config()["privacy_plan"])  # the secret is never saved
  with pytest.raises(PrivacyBudgetExceededError):
    loaded.fit(x, y, verbose=0)  # the plan's 7 steps ran: the loaded model continues, at 7

  inputs = {"a": keras.Input((4,), name="a"), "b": keras.Input((2,), name="b")}
  h = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
  two = keras.Model(inputs, keras.layers.Dense(2)(h))
  dm = compile_(private(two, batch_size=8, steps=3))
  rng = np.random.default_rng(0)
  dm.fit({"a": rng.normal(size=(40, 4)).astype("float32"),
          "b": rng.normal(size=(40, 2)).astype("float32")}, y, verbose=0)
  assert dm.privacy_ledger.steps == 3


# --- issue 31: epochs are Keras epochs; extending a plan; sigma from the plan ---------
@pytest.mark.slow
def test_plan_epochs_are_keras_epochs_when_n_over_b_is_not_whole():
  """N/B = 69/10: 3 epochs are 3 Keras epochs of round(6.9) = 7 steps (not 4 epochs, the
  last of 2 steps), one history entry each, and the epsilon is that of the 21 steps run."""
  x, y = data(69)
  m = compile_(private(epochs=3))
  history = m.fit(x, y, verbose=0)
  assert m.privacy_plan.steps_per_epoch == 7 and m.privacy_plan.num_steps == 21
  assert history.epoch == [0, 1, 2] and len(history.history["epsilon"]) == 3
  assert m.privacy_ledger.steps == 21
  assert m.privacy_report().steps == 21
  assert history.history["epsilon"][-1] == pytest.approx(m.privacy_plan.epsilon(21))


def _oracle_epsilon(q, sigma, steps, delta):
  """dp-accounting's RDP epsilon of `steps` Poisson-subsampled Gaussian steps, built here."""
  import dp_accounting
  from tf_dpnsgd import accounting
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
  rdp = dp_accounting.rdp.RdpAccountant(orders=accounting.DEFAULT_ORDERS)
  rdp.compose(event)
  return rdp.get_epsilon(delta)


@pytest.mark.slow
def test_extend_privacy_plan_after_the_budget_then_save_and_load(tmp_path):
  x, y = data()
  m = compile_(private(epochs=1))
  m.fit(x, y, verbose=0)
  sigma = m.privacy_plan.training_noise_multiplier
  with pytest.raises(PrivacyBudgetExceededError, match=r"extend_privacy_plan"):
    m.fit(x, y, verbose=0)
  with pytest.raises(ValueError, match=r"extend_privacy_plan\(epochs="):
    m.fit(x, y, epochs=2, verbose=0)
  plan = m.extend_privacy_plan(epochs=2)  # the new total, counted from the first step
  assert plan is m.privacy_plan and plan.num_steps == 12
  assert plan.training_noise_multiplier == sigma  # the steps taken used it: exact report
  history = m.fit(x, y, verbose=0)
  assert history.epoch == [1] and m.privacy_ledger.steps == 12
  report = m.privacy_report()
  assert report.steps == 12
  assert report.epsilon == pytest.approx(_oracle_epsilon(B / N, sigma, 12, 1e-5), rel=1e-9)

  path = str(tmp_path / "m.keras")
  m.save(path)
  loaded = keras.models.load_model(path)
  with pytest.raises(PrivacyBudgetExceededError, match="extend_privacy_plan"):
    loaded.fit(x, y, verbose=0)
  target = _oracle_epsilon(B / N, sigma, 24, 1e-5) * 1.0001  # room for 4 epochs, not 5
  loaded.extend_privacy_plan(target_epsilon=target)
  assert loaded.privacy_plan.num_steps == 24  # whole epochs within the target
  loaded.fit(x, y, verbose=0)
  report = loaded.privacy_report()
  assert report.steps == loaded.privacy_ledger.steps == 24
  assert report.epsilon == pytest.approx(_oracle_epsilon(B / N, sigma, 24, 1e-5), rel=1e-9)
  assert report.epsilon <= target
  again = keras.models.load_model(_saved(loaded, tmp_path / "again.keras"))
  assert again.privacy_plan.num_steps == 24 and again.privacy_report().steps == 24


def _saved(model, path):
  model.save(str(path))
  return str(path)


def test_extend_privacy_plan_refuses_what_it_cannot_do():
  m = compile_(private())
  with pytest.raises(ValueError, match="not run a step"):
    m.extend_privacy_plan(epochs=3)  # N unknown until the first fit
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", epochs=2,
                               target_epsilon=3.0, delta=1e-5)
  with pytest.raises(ValueError, match="exactly one of"):
    plan.extended(epochs=3, target_epsilon=4.0)
  with pytest.raises(ValueError, match="not run more than"):
    plan.extended(epochs=2)
  with pytest.raises(ValueError, match="not run more than"):
    plan.extended(target_epsilon=2.0)
  with pytest.raises(ValueError, match="plan.extended"):
    tf_dpnsgd.make_private(mlp()).extend_privacy_plan(epochs=3)


@pytest.mark.slow
def test_any_optimizer_takes_the_plans_noise_multiplier():
  x, y = data()
  m = private(epochs=1)
  m.compile(optimizer=tf_dpnsgd.make_private_optimizer(keras.optimizers.Adam(1e-2),
                                                       l2_norm_clip=1.0),
            loss=LOSS)
  m.fit(x, y, verbose=0)
  assert m.optimizer.noise_multiplier == pytest.approx(m.privacy_plan.training_noise_multiplier)
  assert m.privacy_report().steps == 6
  no_plan = tf_dpnsgd.make_private(mlp())
  with pytest.raises(ValueError, match="no noise_multiplier"):
    no_plan.compile(optimizer=tf_dpnsgd.make_private_optimizer(keras.optimizers.Adam(1e-2),
                                                               l2_norm_clip=1.0), loss=LOSS)
