"""The absl launchers end to end on tiny data written in the real on-disk formats."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fixtures

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")


def launch(module, *args, check=True, prelude=None):
  if prelude:
    code = (f"{prelude}\nimport sys\nfrom absl import app\nfrom {module} import main\n"
            f"sys.argv = ['x'] + {list(args)!r}\n{prelude_enter(prelude)}")
    cmd = [sys.executable, "-c", code]
  else:
    cmd = [sys.executable, "-m", module, *args]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
  if check and out.returncode != 0:
    raise AssertionError(f"{module} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
  return out


def prelude_enter(prelude):
  return ("with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):\n"
          "  app.run(main)\n")


def report(model_dir):
  with open(os.path.join(model_dir, "privacy_report.json")) as f:
    return json.load(f)


def test_quickstart_end_to_end(tmp_path):
  out = launch("tf_dpnsgd.launch.quickstart", "--epochs=3", f"--model_dir={tmp_path}/run",
               f"--export_dir={tmp_path}/export")
  assert "epsilon" in out.stdout and "final test accuracy" in out.stdout
  rep = report(tmp_path / "run")
  assert rep["private"] and 0 < rep["epsilon"] <= 4.0 + 1e-6 and rep["delta"] == 1e-5
  assert rep["sampling"] == "poisson" and rep["accountant"] == "rdp"
  assert {"tensorflow", "keras", "dp_accounting"} <= set(rep["versions"])
  # The SavedModel (raw 0..16 pixels in) reproduces the reported test accuracy.
  import tensorflow as tf
  from tf_dpnsgd.data import digits
  _, (x_test, y_test) = digits.load_digits(test_fraction=0.2, seed=0)
  serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
  pred = serve(images=tf.constant(x_test * 16.0))["class_ids"].numpy()
  assert np.mean(pred == y_test) == pytest.approx(rep["final_metrics"]["accuracy"], abs=1e-6)


def test_cifar10_local_pickles_export_and_resume(tmp_path):
  data = fixtures.write_cifar10_batches(tmp_path / "data", images_per_batch=20)
  del data
  run = tmp_path / "run"
  common = [f"--data_dir={tmp_path}/data", "--batch_size=20", "--physical_batch_size=10",
            "--epochs=2", "--seed=0", f"--model_dir={run}", "--groups=4"]
  launch("tf_dpnsgd.launch.cifar10", *common, "--max_steps=2", f"--export_dir={tmp_path}/export")
  first = report(run)
  assert first["steps"] == 2
  # A rerun continues from the checkpoint: the report covers all 4 steps.
  launch("tf_dpnsgd.launch.cifar10", *common, "--max_steps=4")
  second = report(run)
  assert second["steps"] == 4 and second["epsilon"] > first["epsilon"]
  with open(run / "history.json") as f:
    assert json.load(f)["steps"] == [2.0, 4.0]
  assert os.listdir(run / "tensorboard")
  # The export takes raw 0-255 images and agrees with the reported accuracy.
  import tensorflow as tf
  from tf_dpnsgd.data import cifar10
  _, (x_test, y_test) = cifar10.load_cifar10(str(tmp_path / "data"))
  serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
  out = serve(images=tf.constant(x_test.astype("float32")))
  assert out["probabilities"].shape == (len(y_test), 10)
  assert np.mean(out["class_ids"].numpy() == y_test) == pytest.approx(
      first["final_metrics"]["accuracy"], abs=1e-6)


def test_sst2_local_tsv_and_tiny_bert_preset(tmp_path):
  preset = fixtures.write_tiny_bert_preset(str(tmp_path / "preset"), sequence_length=16)
  fixtures.write_sst2_tsv(tmp_path / "glue")
  run = tmp_path / "run"
  launch("tf_dpnsgd.launch.sst2", f"--preset={preset}", f"--data_dir={tmp_path}/glue",
         "--batch_size=8", "--physical_batch_size=4", "--max_steps=3", "--epochs=2",
         "--sequence_length=16", "--seed=0", f"--model_dir={run}", f"--export_dir={tmp_path}/export",
         "--optimizer=dpsgd", "--l2_norm_clip=0.5")
  rep = report(run)
  assert rep["steps"] == 3 and rep["preset"] == preset and rep["freeze_embeddings"] is True
  assert rep["hyperparameters"]["optimizer"] == "dpsgd"
  from tf_dpnsgd import export
  serve = export.load_serving_fn(str(tmp_path / "export"))
  import tensorflow as tf
  out = serve(sentences=tf.constant(["a great movie", "terrible"]))
  assert out["probabilities"].shape == (2, 2)


def test_cifar10_through_tfds_mock_data(tmp_path):
  launch("tf_dpnsgd.launch.cifar10", "--batch_size=8", "--physical_batch_size=8",
         "--max_steps=1", "--epochs=1", "--seed=0", f"--model_dir={tmp_path}", "--groups=4",
         prelude="import tensorflow_datasets as tfds")
  assert report(tmp_path)["dataset_size"] == 24


@pytest.mark.parametrize("args,message", [
    (["--noise_multiplier=1.0", "--target_epsilon=2.0"], "exactly one of --noise_multiplier"),
    (["--batch_size=5000"], "larger than the training set"),
    (["--regularizer=0"], "--regularizer must be > 0"),
])
def test_bad_flags_fail_before_training(args, message):
  out = launch("tf_dpnsgd.launch.quickstart", "--epochs=1", *args, check=False)
  assert out.returncode != 0 and message in out.stderr


def test_missing_data_names_expected_layout(tmp_path):
  out = launch("tf_dpnsgd.launch.cifar10", f"--data_dir={tmp_path}", "--max_steps=1", check=False)
  assert out.returncode != 0 and "cifar-10-batches-py" in out.stderr


def test_unknown_preset_fails_before_training(tmp_path):
  fixtures.write_sst2_tsv(tmp_path / "glue")
  out = launch("tf_dpnsgd.launch.sst2", "--preset=no_such_model_en", f"--data_dir={tmp_path}/glue",
               check=False)
  assert out.returncode != 0 and "Accepted presets" in out.stderr


@pytest.mark.parametrize("config", ["configs/cifar10/dpsgd_eps2_cyclic.flags"])
def test_paper_config_flagfile_runs(tmp_path, config):
  """A paper config parses and trains (tiny data and sizes overridden after the flagfile)."""
  fixtures.write_cifar10_batches(tmp_path / "data", images_per_batch=20)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  launch("tf_dpnsgd.launch.cifar10", f"--flagfile={os.path.join(root, config)}",
         f"--data_dir={tmp_path}/data", "--batch_size=20", "--physical_batch_size=10",
         "--max_steps=1", "--epochs=2", "--groups=4", f"--model_dir={tmp_path}/run")
  rep = report(tmp_path / "run")
  assert rep["hyperparameters"]["optimizer"] == "dpsgd"
  assert rep["hyperparameters"]["lr_schedule"] == "cyclic"
  assert rep["conversion"] == "classic" and rep["target_epsilon"] == 2.0


def test_all_config_flagfiles_are_valid_flags():
  """Every config line is a flag the launcher defines (checked without training)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for sub, module in (("cifar10", "tf_dpnsgd.launch.cifar10"), ("sst2", "tf_dpnsgd.launch.sst2")):
    files = sorted(os.listdir(os.path.join(root, "configs", sub)))
    assert files
    code = ("import sys\nfrom absl import flags\nimport " + module + "\n"
            "for f in sys.argv[1:]:\n  flags.FLAGS(['x', '--flagfile=' + f])\nprint('OK')\n")
    out = subprocess.run([sys.executable, "-c", code] +
                         [os.path.join(root, "configs", sub, f) for f in files],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_existing_export_dir_fails_before_training(tmp_path):
  (tmp_path / "export").mkdir()
  out = launch("tf_dpnsgd.launch.quickstart", "--epochs=1", f"--model_dir={tmp_path}/run",
               f"--export_dir={tmp_path}/export", check=False)
  assert out.returncode != 0 and "Checked before training" in out.stderr
  assert not (tmp_path / "run" / "history.json").exists()
