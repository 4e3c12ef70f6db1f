"""What the Gaussian mechanism does not cover (issue 19, root cause 3; scenarios 9, 11, 13).

Scenario 9: layer state derived from the data (an adapted ``Normalization``, a
vocabulary, bin boundaries) is released unnoised; one crafted example moves an
adapted mean by 156 whatever the epsilon. It must be refused, or named in the
report's ``not_covered`` field.
Scenario 11: the secret sampler seed and noise key never appear in ``repr``,
``str``, reports, records or configs.
Scenario 13: callbacks that read the unprivatized training metrics and steer the
run are named (the sweep's figures: tests/test_sweep.py).

The oracles are independent of the code under test: numpy means of two
neighbouring datasets, Keras' own callbacks fed hand-written logs, the digits of
the secrets themselves.
"""

import json
import os
import zipfile

import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import coverage
from tf_dpnsgd import sampling
from tf_dpnsgd.plan import PrivacyPlan
from tf_dpnsgd.records import RunRecord

N = 64
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.random((N, 3)).astype("float32")
  y = (x.sum(axis=1) > 1.5).astype("int32")
  return x, y


def mlp(norm=None, name="base"):
  inputs = keras.Input((3,))
  h = norm(inputs) if norm is not None else inputs
  h = keras.layers.Dense(4, activation="tanh", name="hidden")(h)
  h = keras.layers.Dropout(0.1, name="dropout")(h)
  return keras.Model(inputs, keras.layers.Dense(2, name="logits")(h), name=name)


def compile_dp(model, sigma=1.0):
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                           noise_multiplier=sigma), loss=LOSS)
  return model


def adapted_norm(x, name="norm"):
  norm = keras.layers.Normalization(name=name)
  norm.adapt(x)
  return norm


# ---------------------------------------------------------------------------
# Scenario 9: data-derived layer state.
# ---------------------------------------------------------------------------
def test_one_crafted_example_moves_an_adapted_mean_by_156():
  """The attack itself, with numpy as the oracle: replacing one of N = 64 examples by an
  outlier moves Normalization's adapted mean by (outlier - x) / N = 156, a weight of the
  released model that no noise touches. So the state must be refused or reported."""
  x, _ = data()
  neighbour = x.copy()
  neighbour[0, 0] = 1e4  # the crafted outlier
  a, b = adapted_norm(x), adapted_norm(neighbour)
  moved = abs(float(b.mean.numpy().ravel()[0]) - float(a.mean.numpy().ravel()[0]))
  assert moved == pytest.approx(abs(1e4 - x[0, 0]) / N, rel=1e-5)
  assert moved > 156.0
  # Both models are flagged (the outlier's one and the honest one alike).
  for norm in (a, b):
    assert [n for n, _ in coverage.data_derived_state(mlp(norm))] == ["norm"]


def test_check_refuses_undeclared_data_derived_state_and_accepts_declared():
  x, _ = data()
  model = mlp(adapted_norm(x))
  with pytest.raises(ValueError, match=r"(?s)layer 'norm'.*public_state=\['norm'\]") as err:
    coverage.check_data_derived_state(model)
  assert "Normalization(mean=..., variance=...)" in str(err.value)
  assert coverage.check_data_derived_state(model, ["norm", "norm"]) == ("norm",)
  with pytest.raises(TypeError, match="list of layer names"):
    coverage.check_data_derived_state(model, "norm")  # a bare string is not a list of names
  with pytest.raises(ValueError, match="not layers of model"):
    coverage.check_data_derived_state(model, ["norm", "nrom"])


@pytest.mark.slow
def test_report_names_adapted_state_that_appeared_after_make_private():
  """Adapted after make_private (so no check at construction saw it): plan.report lists
  the layer as NOT declared, in to_dict() and in the statement (0 steps suffice)."""
  x, _ = data()
  norm = keras.layers.Normalization(name="norm")
  norm.build((None, 3))
  dp = compile_dp(tf_dpnsgd.make_private(mlp(norm)))
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=4,
                     target_epsilon=0.22, delta=1e-5, seed=3)
  assert plan.report(dp).not_covered == ()  # the initial (0, 1) state is data independent
  norm.adapt(x)
  report = plan.report(dp)
  (item,) = [i for i in report.not_covered if "'norm'" in i]
  assert "Not declared public" in item and "Normalization" in item
  assert report.to_dict()["not_covered"] == list(report.not_covered)
  assert "Not covered by this epsilon" in report.statement() and item in report.statement()


def test_make_private_and_compile_refuse_an_adapted_normalization():
  x, _ = data()
  with pytest.raises(ValueError, match=r"layer 'norm'"):
    tf_dpnsgd.make_private(mlp(adapted_norm(x)))
  norm = keras.layers.Normalization(name="norm")
  norm.build((None, 3))
  dp = tf_dpnsgd.make_private(mlp(norm))
  norm.adapt(x)  # after make_private: compile (and the report) still see it
  with pytest.raises(ValueError, match=r"layer 'norm'"):
    compile_dp(dp)


@pytest.mark.slow
def test_declared_public_state_is_listed_by_the_report_after_training():
  """make_private(public_state=["norm"]) at target epsilon 0.22: the run trains and the
  report (object, dict, statement) names the layer as declared public, not verified."""
  x, y = data()
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=4,
                     target_epsilon=0.22, delta=1e-5)
  dp = compile_dp(tf_dpnsgd.make_private(mlp(adapted_norm(x)), public_state=["norm"]),
                  plan.training_noise_multiplier)
  dp.fit(plan.dataset(x, y, model=dp), callbacks=plan.callbacks(), verbose=0,
         **plan.fit_kwargs(dp))
  report = plan.report(dp)
  assert report.steps == 4 and 0 < report.epsilon <= 0.22 + 1e-9
  (item,) = [i for i in report.not_covered if "'norm'" in i]
  assert "declared public" in item and "not verified" in item
  assert item in report.to_dict()["not_covered"] and item in report.statement()
  record = RunRecord.from_privacy_report(report)
  assert record.not_covered == report.not_covered
  assert RunRecord.from_json(record.to_json()).not_covered == report.not_covered
  assert "NOT covered by it: 1 item" in record.epsilon_text()


def vocabulary_layers():
  words = ["red green", "green blue", "red red"]
  adapted = {}
  for name, make in (("string_lookup", keras.layers.StringLookup),
                     ("integer_lookup", keras.layers.IntegerLookup),
                     ("text_vectorization", keras.layers.TextVectorization)):
    layer = make(name=f"adapted_{name}")
    layer.adapt([1, 2, 2, 7] if name == "integer_lookup" else
                (["red", "green"] if name == "string_lookup" else words))
    adapted[name] = layer
  bins = keras.layers.Discretization(num_bins=3, name="adapted_bins")
  bins.adapt(np.arange(20.0))
  adapted["discretization"] = bins
  public = [keras.layers.StringLookup(vocabulary=["red", "green"], name="public_lookup"),
            keras.layers.IntegerLookup(vocabulary=[1, 2], name="public_ints"),
            keras.layers.TextVectorization(vocabulary=["red", "green"], name="public_text"),
            keras.layers.Discretization(bin_boundaries=[0.0, 1.0], name="public_bins"),
            keras.layers.Hashing(num_bins=4, name="hashing"),
            keras.layers.Normalization(mean=0.5, variance=2.0, name="public_norm"),
            keras.layers.StringLookup(name="unadapted_lookup")]
  return adapted, public


class Holder(keras.layers.Layer):
  """A layer holding other (preprocessing) layers, so one model can nest them all."""

  def __init__(self, layers, **kwargs):
    super().__init__(**kwargs)
    self.held = list(layers)

  def call(self, x):
    return x


def test_each_kind_of_adapted_state_is_found_and_public_state_is_not():
  adapted, public = vocabulary_layers()
  model = mlp()
  holder = Holder(list(adapted.values()) + public, name="holder")
  model.holder = holder
  found = dict(coverage.data_derived_state(model))
  assert set(found) == {layer.name for layer in adapted.values()}
  assert "adapt()" in found["adapted_bins"] and "quantiles" in found["adapted_bins"]
  assert "vocabulary (2 tokens)" in found["adapted_string_lookup"]
  # The TextVectorization is named once, not through its inner lookup layer.
  assert not any(name.startswith("string_lookup") for name in found)


class RunningMean(keras.layers.Layer):
  """A custom layer with a non-trainable statistic (e.g. assigned by a custom adapt)."""

  def build(self, shape):
    self.mean = self.add_weight(shape=shape[-1:], initializer="zeros", trainable=False,
                                name="running_mean")

  def call(self, x):
    return x - self.mean


def test_unknown_non_trainable_state_is_listed_but_seed_state_and_frozen_weights_are_not():
  inputs = keras.Input((3,))
  h = RunningMean(name="running")(inputs)
  h = keras.layers.Dense(4, name="frozen_dense")(h)
  h = keras.layers.Dropout(0.5, name="dropout")(h)  # SeedGenerator state: not data
  model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(h))
  model.get_layer("frozen_dense").trainable = False
  found = dict(coverage.data_derived_state(model))
  assert list(found) == ["running"] and "running_mean" in found["running"]
  assert coverage.frozen_layers(model) == [model.get_layer("frozen_dense").path]
  with pytest.raises(ValueError, match="layer 'running'"):
    tf_dpnsgd.make_private(model)  # refused unless declared
  items = coverage.not_covered(model)  # what a report of this model would list
  assert any("'running'" in i and "Not declared public" in i for i in items)
  assert any("Frozen weights" in i and "frozen_dense" in i for i in items)
  assert not any("dropout" in i for i in items)
  items = coverage.not_covered(tf_dpnsgd.make_private(model, public_state=["running"]))
  assert any("'running'" in i and "declared public" in i and "not verified" in i
             for i in items)


def test_a_model_without_such_state_has_nothing_listed():
  dp = compile_dp(tf_dpnsgd.make_private(mlp()))
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=4,
                     noise_multiplier=1.0, delta=1e-5, seed=3)
  report = plan.report(dp)
  assert report.not_covered == () and report.to_dict()["not_covered"] == []
  assert "Not covered: nothing known." in report.statement()
  assert plan.planned_report().to_dict()["not_covered"] == []


# ---------------------------------------------------------------------------
# Ledger flags.
# ---------------------------------------------------------------------------
def test_flag_notes_name_each_bit_and_never_drop_unknown_ones():
  assert coverage.flag_notes(0) == []
  one = coverage.flag_notes(coverage.UNVERIFIED_BATCHES)
  assert len(one) == 1 and "did not verify" in one[0] and "once per batch" in one[0]
  assert "steered" in coverage.flag_notes(coverage.TRAINING_METRIC_CALLBACKS)[0]
  assert len(coverage.flag_notes(7)) == 3
  assert "0x10" in coverage.flag_notes(16)[0]  # a bit this version does not know
  assert len(coverage.flag_notes(np.int64(3))) == 2
  for bad, error in ((-1, ValueError), (1.0, TypeError), (True, TypeError), ("1", TypeError)):
    with pytest.raises(error):
      coverage.flag_notes(bad)


def test_ledger_flags_reach_the_report():
  dp = compile_dp(tf_dpnsgd.make_private(mlp()))
  ledger = tf_dpnsgd.ledger_of(dp)
  ledger.add_flags(coverage.UNVERIFIED_BATCHES | coverage.TRAINING_METRIC_CALLBACKS)
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=4,
                     noise_multiplier=1.0, delta=1e-5, seed=3)
  items = plan.report(dp).not_covered
  assert items == tuple(coverage.flag_notes(3))
  assert coverage.not_covered(ledger) == items  # the ledger alone carries them too


# ---------------------------------------------------------------------------
# Scenario 13: callbacks steering training with unprivatized metrics.
# ---------------------------------------------------------------------------
class ReadsLogs(keras.callbacks.Callback):
  def on_train_batch_end(self, batch, logs=None):
    if logs and logs.get("loss", 0) > 10:
      self.model.stop_training = True


class Marked(ReadsLogs):
  dp_observes_only = True


class MyProgbar(keras.callbacks.ProgbarLogger):
  def on_epoch_end(self, epoch, logs=None):
    super().on_epoch_end(epoch, logs)


def test_reduce_lr_on_plateau_on_the_training_loss_steers_by_it():
  """Why it is listed: fed two loss histories (Keras' own callback, hand-written logs),
  ReduceLROnPlateau(monitor="loss") leaves different learning rates."""
  rates = []
  for losses in ([1.0, 0.9, 0.8, 0.7], [1.0, 1.0, 1.0, 1.0]):
    model = compile_dp(tf_dpnsgd.make_private(mlp()))
    cb = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1, factor=0.5)
    cb.set_model(model)
    cb.on_train_begin()
    for epoch, loss in enumerate(losses):
      cb.on_epoch_end(epoch, {"loss": loss})
    rates.append(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))
  assert rates[0] == pytest.approx(0.1) and rates[1] < 0.1


def test_steering_callbacks_are_named_and_observers_are_not(tmp_path):
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=4,
                     noise_multiplier=1.0, delta=1e-5, seed=3)
  cb = keras.callbacks
  steering = [cb.ReduceLROnPlateau(monitor="loss"), cb.EarlyStopping(monitor="loss"),
              cb.EarlyStopping(monitor="accuracy"), cb.EarlyStopping(monitor="grad_norm"),
              cb.ModelCheckpoint(str(tmp_path / "best.keras"), save_best_only=True,
                                 monitor="loss"),
              cb.TerminateOnNaN(), cb.LambdaCallback(on_epoch_end=lambda epoch, logs: None),
              ReadsLogs(), MyProgbar()]
  observing = [cb.EarlyStopping(monitor="val_loss"), cb.ReduceLROnPlateau(monitor="epsilon"),
               cb.ModelCheckpoint(str(tmp_path / "each.keras"), monitor="loss"),
               cb.History(), cb.ProgbarLogger(), cb.CSVLogger(str(tmp_path / "log.csv")),
               cb.TensorBoard(str(tmp_path / "tb")), cb.BackupAndRestore(str(tmp_path / "b")),
               cb.LearningRateScheduler(lambda epoch, lr: lr),
               cb.LambdaCallback(on_test_end=lambda logs: None), Marked(),
               *plan.callbacks()]
  names = coverage.steering_callbacks(observing + steering)
  assert len(names) == len(steering)
  assert names[:5] == ["ReduceLROnPlateau(monitor='loss')", "EarlyStopping(monitor='loss')",
                       "EarlyStopping(monitor='accuracy')", "EarlyStopping(monitor='grad_norm')",
                       "ModelCheckpoint(save_best_only=True, monitor='loss')"]
  assert names[5].startswith("TerminateOnNaN") and names[6].startswith("LambdaCallback")
  assert names[7].startswith("ReadsLogs") and "on_train_batch_end" in names[7]
  assert names[8].startswith("MyProgbar") and "on_epoch_end" in names[8]
  assert coverage.steering_callbacks(cb.CallbackList(steering[:2])) == names[:2]
  assert coverage.steering_callbacks(None) == []
  with pytest.raises(TypeError):
    coverage.steering_callbacks([object()])


def test_the_launchers_own_callbacks_do_not_steer():
  from tf_dpnsgd import runner
  ours = [runner.EpochRecorder(None, {}), runner.StopAtStep(3), runner.StepProgbar(0, 3)]
  assert coverage.steering_callbacks(ours) == []


@pytest.mark.slow
def test_fit_with_a_steering_callback_is_reported():
  x, y = data()
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=4,
                     noise_multiplier=1.0, delta=1e-5)
  dp = compile_dp(tf_dpnsgd.make_private(mlp()))
  dp.fit(plan.dataset(x, y, model=dp), verbose=0, **plan.fit_kwargs(dp),
         callbacks=plan.callbacks() + [keras.callbacks.ReduceLROnPlateau(monitor="loss")])
  assert tf_dpnsgd.ledger_of(dp).flags & coverage.TRAINING_METRIC_CALLBACKS
  assert any("steered" in i for i in plan.report(dp).not_covered)


# ---------------------------------------------------------------------------
# Scenario 11: secrets never shown.
# ---------------------------------------------------------------------------
def _digits(value) -> str:
  return str(int(value))


@pytest.mark.slow
def test_no_secret_in_repr_str_reports_records_or_configs(tmp_path):
  """The OS-drawn sampler seed and noise key (63-bit: their decimal digits cannot appear
  by chance) are absent from every repr/str, report, record and saved config."""
  x, y = data()
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="poisson", steps=2,
                     noise_multiplier=1.0, delta=1e-5)
  dp = compile_dp(tf_dpnsgd.make_private(mlp()))
  dp.fit(plan.dataset(x, y, model=dp), verbose=0, callbacks=plan.callbacks(),
         **plan.fit_kwargs(dp))
  secrets = {"sampler seed": _digits(plan.seed),
             "noise key": _digits(dp.optimizer._noise_key[0])}
  assert all(len(s) >= 12 for s in secrets.values())  # OS draws, not small user seeds
  report = plan.report(dp)
  record = RunRecord.from_privacy_report(report)
  samplers = [plan.sampler] + [sampling.make_sampler(kind, N, 16, seed=plan.seed)
                               for kind in ("poisson", "uniform", "shuffle")]
  path = str(tmp_path / "model.keras")
  dp.save(path)
  with zipfile.ZipFile(path) as z:
    saved_config = z.read("config.json").decode()
  texts = {
      "repr(plan)": repr(plan), "str(plan)": str(plan),
      "plan.public_dict()": json.dumps(plan.public_dict()),
      **{f"repr({type(s).__name__})": repr(s) + str(s) for s in samplers},
      "optimizer": repr(dp.optimizer) + str(dp.optimizer) + json.dumps(
          dp.optimizer.get_config(), default=str),
      "report": repr(report) + report.statement() + json.dumps(report.to_dict(), default=str),
      "record": repr(record) + record.to_json(),
      "ledger": json.dumps(tf_dpnsgd.ledger_of(dp).to_dict(), default=str),
      "model config": json.dumps(dp.get_config(), default=str) + saved_config,
  }
  for where, text in texts.items():
    for name, digits in secrets.items():
      assert digits not in text, f"{name} in {where}"
  # The plan still holds the seed where the user asks for it explicitly (to rebuild it).
  assert PrivacyPlan.from_json(plan.to_json()).sampler.indices(0).tolist() == \
      plan.sampler.indices(0).tolist()


def test_a_user_fixed_seed_is_shown_only_where_the_user_fixed_it():
  """A reproducibility seed the user chose is in the optimizer's config (so a saved model
  replays it) and reported as a note; the plan's sampler seed stays out of repr."""
  plan = PrivacyPlan(dataset_size=N, batch_size=16, sampling="shuffle", steps=2,
                     noise_multiplier=1.0, delta=1e-5, seed=918273645546372819)
  assert "918273645546372819" not in repr(plan) + repr(plan.sampler)
  optimizer = tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01, noise_multiplier=1.0,
                               seed=918273645546372819)
  assert optimizer.get_config()["seed"] == 918273645546372819


def test_planned_reports_and_accounting_reports_carry_the_field():
  report = accounting.compute_epsilon(N, 16, 1.0, 1e-5, "poisson", steps=4)
  assert report.not_covered == () and report.to_dict()["not_covered"] == []
  with pytest.raises(TypeError, match="not one string"):
    type(report)(**{**report.__dict__, "not_covered": "a string"})
  back = RunRecord.from_dict({k: v for k, v in RunRecord.from_privacy_report(
      report).to_dict().items() if k != "not_covered"})  # a record older than the field
  assert back.not_covered == ()
