"""Tests for tf_dpnsgd.callbacks: epsilon in logs/history/TensorBoard, budget stop, resume."""

import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd.callbacks import (EPSILON_KEY, PLAN_ATTRIBUTES, PrivacyBudgetExceededError,
                                 PrivacyCallback)
from tf_dpnsgd.plan import PrivacyPlan

N, B = 64, 8  # 8 steps per epoch


def toy_data(n=N, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def make_model(plan, steps_per_execution=1, seed=0):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((3,))
  model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                          noise_multiplier=plan.training_noise_multiplier,
                                          seed=seed),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution)
  return model


class Recorder(keras.callbacks.Callback):
  """Records the batch logs the callbacks after PrivacyCallback (progress bar, History) see."""

  def __init__(self):
    super().__init__()
    self.batch_eps = []

  def on_train_batch_end(self, batch, logs=None):
    self.batch_eps.append((self.model.privacy_ledger.steps, logs.get(EPSILON_KEY)))


def read_scalars(log_dir, tag):
  from tensorflow.core.util import event_pb2  # pylint: disable=g-direct-tensorflow-import
  out = {}
  for path in glob.glob(os.path.join(log_dir, "privacy", "events.out.tfevents.*")):
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for value in event.summary.value:
        if value.tag == tag:
          assert value.metadata.plugin_data.plugin_name == "scalars"
          out[event.step] = float(tf.make_ndarray(value.tensor))
  return out


@pytest.mark.slow
def test_epsilon_in_logs_history_tensorboard_and_planned_stop(tmp_path):
  plan = PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=12,
                     noise_multiplier=1.0, delta=1e-5, seed=1)
  x, y = toy_data()
  model = make_model(plan)
  recorder = Recorder()
  callbacks = plan.callbacks(log_dir=str(tmp_path)) + [recorder]
  kwargs = plan.fit_kwargs()
  assert kwargs["epochs"] * kwargs["steps_per_epoch"] == 16  # more than the 12 planned
  history = model.fit(plan.dataset(x, y), callbacks=callbacks, verbose=0, **kwargs)

  assert model.privacy_ledger.steps == 12  # stopped mid-epoch, at the plan
  assert callbacks[0].stopped_by_budget
  expected = {t: plan.epsilon(t) for t in range(1, 13)}
  assert recorder.batch_eps == [(t, pytest.approx(expected[t])) for t in range(1, 13)]
  assert history.history[EPSILON_KEY] == pytest.approx([expected[8], expected[12]])
  assert max(history.history[EPSILON_KEY]) <= plan.epsilon()
  assert read_scalars(str(tmp_path), EPSILON_KEY) == pytest.approx(expected)

  # The budget is spent: another fit fails before taking any step.
  with pytest.raises(PrivacyBudgetExceededError, match="No further step"):
    model.fit(plan.dataset(x, y, start_step=12), callbacks=plan.callbacks(), verbose=0,
              **plan.fit_kwargs(start_step=12))
  assert model.privacy_ledger.steps == 12


@pytest.mark.parametrize("steps_per_execution", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_budget_stop_never_crosses_the_budget(steps_per_execution):
  plan = PrivacyPlan(dataset_size=N, batch_size=B, sampling="uniform", steps=100,
                     noise_multiplier=2.0, delta=1e-5, seed=2)
  budget = 0.5 * (plan.epsilon(10) + plan.epsilon(11))  # allows exactly 10 steps
  x, y = toy_data()
  model = make_model(plan, steps_per_execution=steps_per_execution)
  callback = PrivacyCallback(plan, epsilon_budget=budget)
  history = model.fit(plan.dataset(x, y), callbacks=[callback], epochs=5, steps_per_epoch=6,
                      verbose=0)
  taken = model.privacy_ledger.steps
  assert plan.epsilon(taken) <= budget < plan.epsilon(11)
  assert taken == (10 if steps_per_execution == 1 else 9)  # executions of 3: 3, 6, 9 (+3 > 10)
  assert callback.stopped_by_budget and callback.epsilon <= budget
  assert all(e <= budget for e in history.history[EPSILON_KEY])


@pytest.mark.slow
def test_resumed_run_counts_all_steps(tmp_path):
  plan = PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=20,
                     noise_multiplier=1.5, delta=1e-5, seed=3)
  x, y = toy_data()
  state = str(tmp_path / "privacy_state.json")
  model = make_model(plan)
  model.fit(plan.dataset(x, y), callbacks=plan.callbacks(state_path=state), epochs=1,
            steps_per_epoch=5, verbose=0)
  assert json.load(open(state))["steps"] == 5
  path = str(tmp_path / "model.keras")
  model.save(path)

  restored = keras.models.load_model(path)
  assert restored.privacy_ledger.steps == 5
  callback = plan.callbacks(state_path=state)[0]
  history = restored.fit(plan.dataset(x, y, model=restored), callbacks=[callback], verbose=0,
                         **plan.fit_kwargs(restored))
  assert restored.privacy_ledger.steps == 20
  assert callback.steps == 20 and callback.epsilon == pytest.approx(plan.epsilon(20))
  assert plan.report(restored).epsilon == pytest.approx(plan.epsilon(20))
  assert history.history[EPSILON_KEY][-1] == pytest.approx(plan.epsilon(20))
  assert plan.epsilon(20) > plan.epsilon(15)  # counting only the resumed steps would be fewer
  assert json.load(open(state))["steps"] == 20

  # A model that was not restored (empty ledger) cannot continue the recorded run.
  fresh = make_model(plan)
  with pytest.raises(ValueError, match="restore the model"):
    fresh.fit(plan.dataset(x, y, start_step=20), callbacks=plan.callbacks(state_path=state),
              verbose=0, epochs=1, steps_per_epoch=1)


def test_optimizer_must_add_the_planned_noise():
  plan = PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=5,
                     noise_multiplier=1.0, delta=1e-5, seed=1)
  other = PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=5,
                      noise_multiplier=0.5, delta=1e-5, seed=1)
  x, y = toy_data()
  model = make_model(other)
  with pytest.raises(ValueError, match="differs from the plan"):
    model.fit(plan.dataset(x, y), callbacks=plan.callbacks(), verbose=0, **plan.fit_kwargs())
  assert model.privacy_ledger.steps == 0


def test_callback_arguments():
  plan = PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=5,
                     noise_multiplier=1.0, delta=1e-5, seed=1)
  with pytest.raises(TypeError, match="PrivacyPlan"):
    PrivacyCallback({"sigma": 1.0})
  # Checked by the attributes it uses (callbacks does not import plan), without computing them.
  missing_one = type("NotAPlan", (), {a: None for a in PLAN_ATTRIBUTES[:-1]})()
  with pytest.raises(TypeError, match="PrivacyPlan"):
    PrivacyCallback(missing_one)
  with pytest.raises(ValueError, match="epsilon_budget"):
    PrivacyCallback(plan, epsilon_budget=-1.0)
  with pytest.raises(ValueError, match="update_freq"):
    PrivacyCallback(plan, update_freq="step")


# --- issue 31: the progress bar shows what a user reads -----------------------------
def _bar_lines(text):
  import re
  text = re.sub(r"\x1b\[[0-9;]*m", "", text).replace("\b", "\r")
  return [part.strip() for line in text.split("\n") for part in line.split("\r")
          if part.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,clip_shown", [
    (lambda: tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0), False),
    (lambda: tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                             target_unclipped_quantile=0.5, clipped_count_stddev=1.0), True),
    (lambda: tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01), False)])
def test_progress_bar_shows_loss_metrics_epsilon_and_history_keeps_diagnostics(
    capsys, optimizer, clip_shown):
  x, y = toy_data()
  inp = keras.Input((3,))
  model = tf_dpnsgd.make_private(keras.Model(inp, keras.layers.Dense(2)(inp)),
                                 noise_multiplier=1.0, delta=1e-5, batch_size=B, epochs=1.5)
  model.compile(optimizer=optimizer(), metrics=["accuracy"],
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  capsys.readouterr()
  history = model.fit(x, y, verbose=1)
  lines = _bar_lines(capsys.readouterr().out)
  bars = [line for line in lines if " - loss: " in line]
  assert bars and all("epsilon: " in line and "accuracy: " in line for line in bars)
  for hidden in ("grad_norm", "nonfinite_examples", "steps:"):
    assert not any(hidden in line for line in bars), (hidden, bars[-1])
  clipping = isinstance(model.optimizer.transform, tf_dpnsgd.transforms.Clip)
  assert any("clipped_fraction" in line for line in bars) == clipping
  assert any("l2_norm_clip" in line for line in bars) == clip_shown
  # ~250 characters before; the timing text ("0s 6ms/step") varies by a few characters.
  assert max(len(line) for line in bars) < 160, bars[-1]
  # 1.5 epochs of 8 steps: a full epoch, then a partial one, labelled, counting its 4 steps.
  assert [line for line in lines if line.startswith("Epoch")] == [
      "Epoch 1/2", "Epoch 2/2 (partial: 4 of 8 steps)"]
  assert bars[-1].startswith("4/4 ")
  first = [line for line in lines if line.startswith("first step ")]
  assert len(first) == 1 and "peak RSS" in first[0], first  # one per fit, after its step 1
  assert {"grad_norm", "nonfinite_examples", "epsilon", "loss"} <= set(history.history)
  assert len(history.history["epsilon"]) == 2 and model.privacy_ledger.steps == 12


def test_progress_bar_reports_the_first_step_of_each_fit_once_and_only_when_shown(capsys):
  """Cost before commitment (issue 48): after a fit's first step, one line with its time
  (from the fit's start: tracing and the first-batch checks) and the peak memory."""
  from tf_dpnsgd.callbacks import ProgressBar
  now = [100.0]
  inp = keras.Input((3,))
  model = keras.Model(inp, keras.layers.Dense(2)(inp))
  for verbose, expected in ((1, 1), (0, 0), (1, 1)):  # a second fit reports its own
    bar = ProgressBar(total_steps=3, clock=lambda: now[0])
    bar.set_model(model)
    bar.set_params({"verbose": verbose, "epochs": 1, "steps": 3})
    capsys.readouterr()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    for step in range(3):
      now[0] += 86.04 if step == 0 else 31.2
      bar.on_train_batch_end(step, {"loss": 0.5})
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "first step" in line]
    assert len(lines) == expected, out
    if expected:
      assert "first step 86.0 s" in lines[0] and "peak RSS" in lines[0], lines


def test_shown_drops_diagnostics_but_not_nonfinite_examples_that_happened():
  from tf_dpnsgd.callbacks import shown
  logs = {"loss": 1.0, "grad_norm": 2.0, "nonfinite_examples": 0.0, "steps": 10.0,
          "l2_norm_clip": 1.0, "clipped_fraction": 0.5, "epsilon": 0.3}
  assert shown(logs) == {"loss": 1.0, "clipped_fraction": 0.5, "epsilon": 0.3}
  assert shown({**logs, "nonfinite_examples": 2.0})["nonfinite_examples"] == 2.0


def test_step_reporter_prints_slow_steps_and_at_least_every_interval_with_epsilon_and_eta():
  """Issue 32, part 4: nothing runs silent for minutes (a fake clock, no training)."""
  from tf_dpnsgd.callbacks import StepReporter
  from tf_dpnsgd.plan import PrivacyPlan
  plan = PrivacyPlan(dataset_size=1000, batch_size=100, sampling="poisson", steps=20,
                     noise_multiplier=1.0, delta=1e-5)
  now = [0.0]
  lines = []
  reporter = StepReporter(start_step=4, total_steps=20, plan=plan, every_s=30.0,
                          slow_step_s=2.0, clock=lambda: now[0], print_fn=lines.append)
  reporter.on_train_begin()
  # First step (tracing): 60 s, a line without ETA; the second: a line with the ETA of the
  # steps after the first; the 5 s step: a line.
  for step_time in (60.0, 0.5, 5.0, 0.5):
    now[0] += step_time
    reporter.on_train_batch_end(0, {"loss": 0.25})
  assert len(lines) == 3, lines
  assert lines[0].startswith("step 5/20  loss 0.2500  epsilon ")
  assert f"epsilon {plan.epsilon(5):.3f}" in lines[0]
  assert "first step 60.00 s" in lines[0] and "ETA 0" not in lines[0]
  assert "peak RSS " in lines[0] and "peak RSS " in lines[1] and "peak RSS" not in lines[2]
  # After step 6: 0.5 s/step (the first step's 60 s left out), 14 steps left -> 7 s.
  assert "0.50 s/step  ETA 0:00:07  peak RSS " in lines[1], lines[1]
  # After step 7 (5.5 s for the 2 steps after the first): 2.75 s/step, 13 left -> 36 s.
  assert lines[2].endswith("2.75 s/step  ETA 0:00:36"), lines[2]
  for _ in range(70):  # fast steps: one line per 30 s
    now[0] += 1.0
    reporter.on_train_batch_end(0, {})
  assert len(lines) == 3 + 2, lines  # at 30.5 s and 60.5 s since the last line
  from tf_dpnsgd import coverage
  assert coverage.steering_callbacks([reporter]) == []  # it prints; the report stays clean
