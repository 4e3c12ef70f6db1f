"""Resuming a launcher run (tf_dpnsgd.launch.resume, runner.restore): only the run that wrote a
--model_dir continues from it (issue 30, scenario 4: a DP run used to warm-start silently from
a non-private run's checkpoint and report the full epsilon with nothing not covered)."""

import os
import shutil

import keras
import pytest

import tf_dpnsgd
from tf_dpnsgd import runner
from tf_dpnsgd.launch import common
from tf_dpnsgd.launch import resume

import fixtures

PLAN = {"dataset_size": 64, "batch_size": 16, "sampling": "poisson", "epochs": 1.0,
        "noise_multiplier": None, "target_epsilon": 4.0, "releases": []}


def marker(private=True, plan=PLAN, dataset="digits"):
  return resume.run_marker(private, dict(plan) if private else None, dataset)


# --- the decision table (pure) ------------------------------------------------------------
def test_same_private_run_with_its_ledger_resumes():
  resume.check_resume("d", marker(), marker(), has_ledger=True)
  resume.check_resume("d", marker(False), marker(False), has_ledger=False)


@pytest.mark.parametrize("old,new,has_ledger,message", [
    (None, marker(), True, "no run.json"),                       # older version / by hand
    (None, marker(False), False, "no run.json"),
    (marker(False), marker(), False, "NON-PRIVATE run"),         # the scenario
    (marker(False), marker(), True, "NON-PRIVATE run"),          # whatever the file holds
    (marker(), marker(False), True, "would overwrite"),          # the reverse
    (marker(plan=dict(PLAN, epochs=2.0)), marker(), True, "plan.epochs: 2.0 vs 1.0"),
    (marker(plan=dict(PLAN, dataset_size=63)), marker(), True, "plan.dataset_size"),
    (marker(dataset="mnist"), marker(), True, "dataset: 'mnist' vs 'digits'"),
    (marker(), marker(), False, "without a privacy ledger"),     # the file was replaced
])
def test_any_other_checkpoint_is_refused_with_what_to_do(old, new, has_ledger, message):
  with pytest.raises(resume.ResumeError, match="Use a new --model_dir") as e:
    resume.check_resume("runs/x", old, new, has_ledger)
  assert message in str(e.value) and "--model_dir=runs/x" in str(e.value)


def test_marker_round_trips_and_holds_nothing_secret(tmp_path):
  plan = common.make_plan(common.ExperimentConfig(target_epsilon=4.0, batch_size=16), 64)
  m = resume.run_marker(True, plan.public_dict(), "digits")
  assert "seed" not in m["plan"] and m["plan"]["dataset_size"] == 64
  resume.write_marker(str(tmp_path), m)
  assert resume.read_marker(str(tmp_path)) == m
  assert resume.marker_differences(resume.read_marker(str(tmp_path)), m) == []
  (tmp_path / resume.MARKER_FILE).write_text("[1, 2]")
  assert resume.read_marker(str(tmp_path)) is None  # not an object: as absent (refused)


# --- the checkpoint file: does it hold a privacy ledger? ------------------------------------
def _model(k=4):
  inputs = keras.Input((k,))
  return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def test_checkpoint_has_ledger_tells_dp_from_plain_weights(tmp_path):
  plain, private = _model(), tf_dpnsgd.make_private(_model())
  plain.save_weights(str(tmp_path / "plain.weights.h5"))
  private.save_weights(str(tmp_path / "dp.weights.h5"))
  (tmp_path / "junk.weights.h5").write_bytes(b"not hdf5")
  assert runner.checkpoint_has_ledger(str(tmp_path / "dp.weights.h5"))
  assert not runner.checkpoint_has_ledger(str(tmp_path / "plain.weights.h5"))
  assert not runner.checkpoint_has_ledger(str(tmp_path / "junk.weights.h5"))


def test_restore_refuses_to_resume_a_private_model_from_plain_weights(tmp_path):
  plain = _model()
  plain.compile(optimizer="sgd", loss="mse")
  plain.save_weights(str(tmp_path / "plain.weights.h5"))
  private = tf_dpnsgd.make_private(_model())
  private.compile(optimizer=tf_dpnsgd.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                            learning_rate=0.1), loss="mse")
  with pytest.raises(ValueError, match="holds no privacy ledger"):
    runner.restore(private, str(tmp_path / "plain.weights.h5"))


# --- run_experiment end to end (in process) ------------------------------------------------
_data = fixtures.tiny_image_data
_build = fixtures.tiny_image_mlp


def _run(model_dir, **kw):
  x, y = _data()
  cfg = common.ExperimentConfig(**{"target_epsilon": 4.0, "batch_size": 16, "epochs": 1.0,
                                   "seed": 0, "verbose": 0, "model_dir": str(model_dir), **kw})
  return common.run_experiment(
      cfg, _build, (x, y), (x[:16], y[:16]),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      extra_report={"dataset": "toy"})


@pytest.mark.slow
def test_dp_run_refuses_a_non_private_model_dir_and_a_replaced_checkpoint(tmp_path):
  sgd_dir, dp_dir = tmp_path / "sgd", tmp_path / "dp"
  _run(sgd_dir, optimizer="sgd", target_epsilon=None)
  # Before the fix this run warm-started from the SGD weights and reported epsilon 4 with
  # nothing not covered.
  with pytest.raises(common.LaunchError, match="NON-PRIVATE run"):
    _run(sgd_dir)
  assert resume.read_marker(str(sgd_dir))["private"] is False
  assert not (sgd_dir / "privacy_report.json").exists() or (
      common.RunRecord.read(sgd_dir).private is False)
  first = _run(dp_dir, max_steps=2)
  assert first.private and first.steps == 2
  second = _run(dp_dir, max_steps=4)  # the same run continues
  assert second.steps == 4 and second.epsilon > first.epsilon
  with pytest.raises(common.LaunchError, match="would overwrite"):
    _run(dp_dir, optimizer="sgd", target_epsilon=None)
  with pytest.raises(common.LaunchError, match="plan.epochs"):
    _run(dp_dir, epochs=2.0)
  # The checkpoint file replaced by a non-private one (run.json still says private).
  shutil.copy(sgd_dir / "checkpoint.weights.h5", dp_dir / "checkpoint.weights.h5")
  with pytest.raises(common.LaunchError, match="without a privacy ledger"):
    _run(dp_dir, max_steps=4)
  # A checkpoint without run.json (older version, or copied by hand).
  os.remove(dp_dir / resume.MARKER_FILE)
  with pytest.raises(common.LaunchError, match="no run.json"):
    _run(dp_dir, max_steps=4)
