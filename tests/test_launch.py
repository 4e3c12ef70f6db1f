"""The absl launchers end to end on tiny data written in the real on-disk formats."""

import json
import os
import sys

import numpy as np
import pytest

import fixtures
from launch_each import checked
import launch_each
import zygote  # children forked from a pre-imported process (tests/zygote.py)

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")


def report(model_dir):
  with open(os.path.join(model_dir, "privacy_report.json")) as f:
    return json.load(f)


def named_runs(tmp_path_factory, name, module, runs_of, prepare=None):
  """:func:`launch_each.named_runs` with this module's environment."""
  return launch_each.named_runs(tmp_path_factory, name, module, runs_of, prepare, env=ENV)


def run_of(runs, name):
  """The named run's result, checked to have exited 0 (``launch(..., check=True)``)."""
  return checked(runs[name], f"run {name!r}")


# --- the quickstart launcher: every launch of this module in ONE process ------------------
BAD_QUICKSTART_FLAGS = [
    (["--noise_multiplier=1.0", "--target_epsilon=2.0"], "only one of --noise_multiplier"),
    (["--optimizer=sgd", "--noise_multiplier=1.0"], "--optimizer=sgd trains without privacy"),
    (["--batch_size=5000"], "larger than the training set"),
    (["--regularizer=0"], "--regularizer must be > 0"),
]


def _quickstart_runs_of(f):
  """Each test's launches, in the order each test made them (a test's later launch may
  continue an earlier one's --model_dir, as its separate processes did)."""
  qs_report = lambda d: [f"{f}/{d}/privacy_report.json"]  # noqa: E731
  return [
      ("end_to_end", ["--epochs=2", f"--model_dir={f}/e2e/run", f"--export_dir={f}/e2e/export"]),
      *[(f"bad_flags[{m}]", ["--epochs=1", *args]) for args, m in BAD_QUICKSTART_FLAGS],
      ("existing_export", ["--epochs=1", f"--model_dir={f}/exists/run",
                           f"--export_dir={f}/exists/export"]),
      *[(f"sigma_alone[{i}]", ["--noise_multiplier=1.2", "--max_steps=3",
                               f"--model_dir={f}/sigma/run{i}"]) for i in range(2)],
      ("sigma_sgd", ["--optimizer=sgd", "--learning_rate=0.5", "--max_steps=3",
                     f"--model_dir={f}/sigma/sgd"]),
      # test_shuffle_run_refuses_to_resume_mid_epoch: 11 steps per epoch
      ("shuffle_first", ["--sampling=shuffle", "--epochs=1", f"--model_dir={f}/shuffle/run",
                         "--max_steps=2"]),
      ("shuffle_resume", ["--sampling=shuffle", "--epochs=1", f"--model_dir={f}/shuffle/run",
                          "--max_steps=4"]),
      # test_dp_run_refuses_to_resume_a_non_private_model_dir_and_back
      ("baseline_sgd", {"argv": ["--optimizer=sgd", "--learning_rate=0.5", "--max_steps=3",
                                 f"--model_dir={f}/issue30/sgd"], "read": qs_report("issue30/sgd")}),
      ("dp_over_sgd", {"argv": ["--max_steps=3", f"--model_dir={f}/issue30/sgd"],
                       "read": qs_report("issue30/sgd")}),
      ("baseline_dp", ["--max_steps=2", f"--model_dir={f}/issue30/dp"]),
      ("sgd_over_dp", {"argv": ["--optimizer=sgd", "--max_steps=3", f"--model_dir={f}/issue30/dp"],
                       "read": qs_report("issue30/dp")}),
  ]


def _quickstart_prepare(f):
  (f / "exists" / "export").mkdir(parents=True)  # test_existing_export_dir_fails_before_training


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
  """Every quickstart launch of this module, in one process (tests/launch_each.py): one
  TensorFlow import instead of 15."""
  return named_runs(tmp_path_factory, "test_launch_quickstart", "tf_dpnsgd.launch.quickstart",
                    _quickstart_runs_of, _quickstart_prepare)


@pytest.mark.slow
@pytest.mark.xdist_group("launch_quickstart")  # its runs' one process: one worker
def test_quickstart_end_to_end(quickstart_runs):
  f, runs = quickstart_runs
  out = run_of(runs, "end_to_end")
  assert "epsilon" in out.stdout and "final test accuracy" in out.stdout
  rep = report(f / "e2e" / "run")
  assert rep["private"] and 0 < rep["epsilon"] <= 4.0 + 1e-6 and rep["delta"] == 1e-5
  assert rep["sampling"] == "poisson" and rep["accountant"] == "rdp"
  assert {"tensorflow", "keras", "dp_accounting"} <= set(rep["versions"])
  # The SavedModel (raw 0..16 pixels in) reproduces the reported test accuracy.
  import tensorflow as tf
  from tf_dpnsgd.data import digits
  _, (x_test, y_test) = digits.load_digits(test_fraction=0.2, seed=0)
  serve = tf.saved_model.load(str(f / "e2e" / "export")).signatures["serving_default"]
  pred = serve(images=tf.constant(x_test * 16.0))["class_ids"].numpy()
  assert np.mean(pred == y_test) == pytest.approx(rep["final_metrics"]["accuracy"], abs=1e-6)


# --- the CIFAR-10 launcher: every launch of this module in ONE process --------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_CONFIGS = ["configs/cifar10/dpsgd_eps2_cyclic.flags"]


def _config_files(sub):
  return sorted(os.listdir(os.path.join(ROOT, "configs", sub)))


def _parse_configs(sub):
  """Each config file parsed on its own by the launcher's flags (no training)."""
  return [(f"config[{sub}/{name}]",
           {"argv": [f"--flagfile={os.path.join(ROOT, 'configs', sub, name)}"], "parse_only": True})
          for name in _config_files(sub)]


def _cifar10_runs_of(f):
  pickles = [f"--data_dir={f}/pickles/data", "--batch_size=20", "--physical_batch_size=10",
             "--epochs=2", "--seed=0", f"--model_dir={f}/pickles/run", "--groups=4",
             "--resnet_depth=8"]  # ResNet8-GN: the same launcher path, a third of the layers
  return [
      ("pickles_first", {"argv": [*pickles, "--max_steps=2", f"--export_dir={f}/pickles/export"],
                         "read": [f"{f}/pickles/run/privacy_report.json"]}),
      # A rerun continues from the checkpoint.
      ("pickles_resume", [*pickles, "--max_steps=4"]),
      ("missing_data", [f"--data_dir={f}/missing", "--max_steps=1"]),
      *[(f"paper_config[{config}]",
         [f"--flagfile={os.path.join(ROOT, config)}", f"--data_dir={f}/paper/data",
          "--batch_size=20", "--physical_batch_size=10", "--max_steps=1", "--epochs=2",
          "--groups=4", "--resnet_depth=8", f"--model_dir={f}/paper/{i}/run"])
        for i, config in enumerate(PAPER_CONFIGS)],
      ("tfds_mock", {"argv": ["--batch_size=8", "--physical_batch_size=8", "--max_steps=1",
                              "--epochs=1", "--seed=0", f"--model_dir={f}/tfds", "--groups=4",
                              "--resnet_depth=8"],
                     "prelude": "import tensorflow_datasets as tfds",
                     "context": "tfds.testing.mock_data(num_examples=24, "
                                "policy=tfds.testing.MockPolicy.USE_CODE)"}),
      *_parse_configs("cifar10"),
  ]


def _cifar10_prepare(f):
  fixtures.write_cifar10_batches(f / "pickles" / "data", images_per_batch=20)
  fixtures.write_cifar10_batches(f / "paper" / "data", images_per_batch=20)
  (f / "missing").mkdir()


@pytest.fixture(scope="module")
def cifar10_runs(tmp_path_factory):
  """Every CIFAR-10 launch of this module, in one process (tests/launch_each.py)."""
  return named_runs(tmp_path_factory, "test_launch_cifar10", "tf_dpnsgd.launch.cifar10",
                    _cifar10_runs_of, _cifar10_prepare)


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_cifar10_local_pickles_export_and_resume(cifar10_runs):
  f, runs = cifar10_runs
  run = f / "pickles" / "run"
  first = json.loads(run_of(runs, "pickles_first").files[str(run / "privacy_report.json")])
  assert first["steps"] == 2 and first["resnet_depth"] == 8
  # A rerun continues from the checkpoint: the report covers all 4 steps.
  run_of(runs, "pickles_resume")
  second = report(run)
  assert second["steps"] == 4 and second["epsilon"] > first["epsilon"]
  with open(run / "history.json") as f_:
    assert json.load(f_)["steps"] == [2.0, 4.0]
  assert os.listdir(run / "tensorboard")
  # The export takes raw 0-255 images and agrees with the reported accuracy.
  import tensorflow as tf
  from tf_dpnsgd.data import cifar10
  _, (x_test, y_test) = cifar10.load_cifar10(str(f / "pickles" / "data"))
  serve = tf.saved_model.load(str(f / "pickles" / "export")).signatures["serving_default"]
  out = serve(images=tf.constant(x_test.astype("float32")))
  assert out["probabilities"].shape == (len(y_test), 10)
  assert np.mean(out["class_ids"].numpy() == y_test) == pytest.approx(
      first["final_metrics"]["accuracy"], abs=1e-6)


def progress_counts(stdout):
  """The ``k/n`` step counts Keras' progress bar printed (colours and redraws removed)."""
  import re
  plain = re.sub(r"\x1b\[[0-9;]*m", "", stdout).replace("\r", "\n").replace("\b", "\n")
  return re.findall(r"(?m)^\s*(\d+)/(\d+) ", plain)


def _tiny_sst2(tmp_path):
  """A tiny BERT preset (sequence 16) and a GLUE folder of 48 sentences; returns the preset."""
  preset = fixtures.write_tiny_bert_preset(str(tmp_path / "preset"), sequence_length=16)
  train = ([(s, 1) for s in fixtures.POSITIVE] + [(s, 0) for s in fixtures.NEGATIVE]) * 4
  fixtures.write_sst2_tsv(tmp_path / "glue", train=train)
  return preset


# --- the SST-2 launcher: every launch of this module in ONE process ------------------------
BAD_SST2_FLAGS = [
    (["--cache_frozen_layers"], "--cache_frozen_layers needs --trainable_layers"),
    (["--cache_frozen_layers", "--trainable_layers=1"], "--pooling=mean"),
    (["--optimizer=adam", "--target_epsilon=2"], "trains without privacy"),
    (["--feature_cache_dir=/tmp/unused"], "--feature_cache_dir keeps"),
]


def _sst2_runs_of(f):
  """One tiny preset and GLUE folder (``_tiny_sst2``) for every run that trains."""
  preset = str(f / "preset")
  data = [f"--preset={preset}", f"--data_dir={f}/glue", "--batch_size=8",
          "--physical_batch_size=4", "--sequence_length=16"]
  return [
      # 48 sentences, batch 8: 6 steps an epoch; 3 run
      ("local_tsv", [*data, "--max_steps=3", "--epochs=2", "--seed=0", f"--model_dir={f}/tsv/run",
                     f"--export_dir={f}/tsv/export", "--optimizer=dpsgd", "--l2_norm_clip=0.5",
                     "--verbose=1"]),
      ("unknown_preset", ["--preset=no_such_model_en", f"--data_dir={f}/unknown/glue"]),
      ("lora", [*data, "--max_steps=2", "--epochs=1", "--lora_rank=2", "--lora_layers=all",
                f"--model_dir={f}/lora/run", f"--export_dir={f}/lora/export"]),
      ("cached", [*data, "--max_steps=3", "--epochs=1", "--pooling=mean", "--trainable_layers=1",
                  "--cache_frozen_layers", f"--model_dir={f}/cached/run",
                  f"--export_dir={f}/cached/export", f"--feature_cache_dir={f}/cached/cache"]),
      *[(f"bad_flags[{m}]", [f"--preset={preset}", f"--data_dir={f}/glue", "--sequence_length=16",
                             *args]) for args, m in BAD_SST2_FLAGS],
      *_parse_configs("sst2"),
  ]


def _sst2_prepare(f):
  assert _tiny_sst2(f) == str(f / "preset")
  fixtures.write_sst2_tsv(f / "unknown" / "glue")


@pytest.fixture(scope="module")
def sst2_runs(tmp_path_factory):
  """Every SST-2 launch of this module, in one process (tests/launch_each.py)."""
  return named_runs(tmp_path_factory, "test_launch_sst2", "tf_dpnsgd.launch.sst2",
                    _sst2_runs_of, _sst2_prepare)


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_sst2_local_tsv_and_tiny_bert_preset(sst2_runs):
  f, runs = sst2_runs
  preset = str(f / "preset")  # 48 sentences, batch 8: 6 steps an epoch; 3 run
  out = run_of(runs, "local_tsv")
  rep = report(f / "tsv" / "run")
  assert rep["steps"] == 3 and rep["preset"] == preset and rep["freeze_embeddings"] is True
  # The progress bar counts the 3 steps that ran (it used to finalize at 6/6, and say
  # "Epoch 1/2" for a run that never reaches epoch 2).
  counts = progress_counts(out.stdout)
  assert counts and counts[-1] == ("3", "3") and {n for _, n in counts} == {"3"}, counts
  assert "Epoch 1/2" not in out.stdout
  assert rep["hyperparameters"]["optimizer"] == "dpsgd"
  from tf_dpnsgd import export
  serve = export.load_serving_fn(str(f / "tsv" / "export"))
  import tensorflow as tf
  out = serve(sentences=tf.constant(["a great movie", "terrible"]))
  assert out["probabilities"].shape == (2, 2)


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_cifar10_through_tfds_mock_data(cifar10_runs):
  f, runs = cifar10_runs
  run_of(runs, "tfds_mock")  # inside tfds.testing.mock_data(num_examples=24, USE_CODE)
  assert report(f / "tfds")["dataset_size"] == 24


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(BAD_QUICKSTART_FLAGS)),
                         ids=[m for _, m in BAD_QUICKSTART_FLAGS])
@pytest.mark.xdist_group("launch_quickstart")  # its runs' one process: one worker
def test_bad_flags_fail_before_training(quickstart_runs, case):
  message = BAD_QUICKSTART_FLAGS[case][1]
  out = quickstart_runs[1][f"bad_flags[{message}]"]
  assert out.returncode != 0 and message in out.stderr
  assert "Traceback" not in out.stderr and "FATAL" in out.stderr  # a flag error, one line
  assert "epoch" not in out.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_missing_data_names_expected_layout(cifar10_runs):
  out = cifar10_runs[1]["missing_data"]  # --data_dir an empty folder
  assert out.returncode != 0 and "cifar-10-batches-py" in out.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_unknown_preset_fails_before_training(sst2_runs):
  out = sst2_runs[1]["unknown_preset"]  # --preset=no_such_model_en on a GLUE folder
  assert out.returncode != 0 and "Accepted presets" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("config", PAPER_CONFIGS)
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_paper_config_flagfile_runs(cifar10_runs, config):
  """A paper config parses and trains (tiny data and sizes overridden after the flagfile)."""
  f, runs = cifar10_runs
  run_of(runs, f"paper_config[{config}]")
  rep = report(f / "paper" / str(PAPER_CONFIGS.index(config)) / "run")
  assert rep["hyperparameters"]["optimizer"] == "dpsgd"
  assert rep["hyperparameters"]["lr_schedule"] == "cyclic"
  assert rep["conversion"] == "classic" and rep["target_epsilon"] == 2.0


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_all_config_flagfiles_are_valid_flags(cifar10_runs, sst2_runs):
  """Every config file parses on its own: its lines are flags the launcher defines, with values
  its validators accept (checked without training; in each launcher's group process, each
  file after the flags were reset)."""
  for sub, (_, runs) in (("cifar10", cifar10_runs), ("sst2", sst2_runs)):
    files = _config_files(sub)
    assert files
    for name in files:
      out = runs[f"config[{sub}/{name}]"]
      assert out.returncode == 0, f"configs/{sub}/{name}:\n{out.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.xdist_group("launch_quickstart")  # its runs' one process: one worker
def test_existing_export_dir_fails_before_training(quickstart_runs):
  f, runs = quickstart_runs
  out = runs["existing_export"]
  assert out.returncode != 0 and "Checked before training" in out.stderr
  assert not (f / "exists" / "run" / "history.json").exists()


# --- the privacy flags: --noise_multiplier alone, --optimizer=sgd, the default epsilon -----
def parse_launcher_flags(*args, **defaults):
  """Parses ``args`` with the shared launcher flags (launcher defaults: target epsilon 4)."""
  from absl import flags
  from tf_dpnsgd.launch import common
  fv = flags.FlagValues()
  common.define_flags(fv, **{"target_epsilon": 4.0, **defaults})
  fv(["launcher", *args])
  return common.config_from_flags(fv)


def test_privacy_flags_resolve_against_the_launcher_default(tmp_path):
  def pair(*args):
    cfg = parse_launcher_flags(*args)
    return cfg.noise_multiplier, cfg.target_epsilon

  assert pair() == (None, 4.0)                              # neither: the launcher's default
  assert pair("--noise_multiplier=1.2") == (1.2, None)      # the paper's flag alone
  assert pair("--target_epsilon=2") == (None, 2.0)
  assert pair("--optimizer=sgd") == (None, None)            # the non-private baseline
  assert not parse_launcher_flags("--optimizer=sgd").private
  flagfile = tmp_path / "eps8.flags"
  flagfile.write_text("--target_epsilon=8\n")
  assert pair(f"--flagfile={flagfile}") == (None, 8.0)


@pytest.mark.parametrize("args,message", [
    (["--noise_multiplier=1.2", "--target_epsilon=2"], "only one of"),
    (["--optimizer=sgd", "--target_epsilon=2"], "trains without privacy"),
    (["--optimizer=sgd", "--noise_multiplier=1"], "trains without privacy"),
    (["--regularizer=0"], "--regularizer must be > 0"),
    (["--optimizer=dpsgd", "--l2_norm_clip=-1"], "--l2_norm_clip must be > 0"),
    (["--physical_batch_size=512"], "--physical_batch_size"),
    (["--optimizer=dpnadam", "--momentum=0.9"], "would ignore it"),  # was silently ignored
    (["--optimizer=dpadam", "--momentum=0.9"], "would ignore it"),
    (["--optimizer=adam", "--momentum=0.5"], "would ignore it"),
    (["--momentum=1"], r"--momentum must be in \[0, 1\)"),
])
def test_bad_flag_combinations_are_flag_errors(tmp_path, args, message):
  from absl import flags
  with pytest.raises(flags.IllegalFlagValueError, match=message):
    parse_launcher_flags(*args)


def test_unset_physical_batch_size_adapts_to_the_batch_size_given(tmp_path):
  """The CIFAR-10 launcher's defaults (B 1000, chunks of 250): --batch_size=64 alone runs in
  chunks of 64; a --physical_batch_size the user set (command line or flag file) is kept,
  and a wrong one stays a flag error."""
  from absl import flags
  cifar = {"batch_size": 1000, "physical_batch_size": 250}
  cfg = parse_launcher_flags("--batch_size=64", **cifar)
  assert (cfg.batch_size, cfg.physical_batch_size) == (64, 64)
  cfg = parse_launcher_flags("--batch_size=500", **cifar)
  assert (cfg.batch_size, cfg.physical_batch_size) == (500, 250)  # default still fits
  cfg = parse_launcher_flags("--batch_size=64", "--physical_batch_size=16", **cifar)
  assert cfg.physical_batch_size == 16
  with pytest.raises(flags.IllegalFlagValueError, match="--physical_batch_size"):
    parse_launcher_flags("--batch_size=64", "--physical_batch_size=250", **cifar)
  flagfile = tmp_path / "chunks.flags"
  flagfile.write_text("--physical_batch_size=250\n")
  with pytest.raises(flags.IllegalFlagValueError, match="--physical_batch_size"):
    parse_launcher_flags(f"--flagfile={flagfile}", "--batch_size=64", **cifar)


def test_momentum_zero_after_a_flag_file_that_sets_it_is_accepted_for_adam(tmp_path):
  """An SGD flag file (momentum 0.9) reused for an Adam variant: --momentum=0 unsets it."""
  flagfile = tmp_path / "sgd.flags"
  flagfile.write_text("--momentum=0.9\n")
  cfg = parse_launcher_flags(f"--flagfile={flagfile}", "--optimizer=dpnadam", "--momentum=0")
  assert (cfg.optimizer, cfg.momentum) == ("dpnadam", 0.0)


def test_flag_file_epsilon_and_command_line_sigma_conflict(tmp_path):
  from absl import flags
  flagfile = tmp_path / "eps8.flags"
  flagfile.write_text("--target_epsilon=8\n")
  with pytest.raises(flags.IllegalFlagValueError, match="only one of"):
    parse_launcher_flags(f"--flagfile={flagfile}", "--noise_multiplier=1.2")


@pytest.mark.slow
@pytest.mark.xdist_group("launch_quickstart")  # its runs' one process: one worker
def test_noise_multiplier_alone_and_sgd_run_and_runs_differ(quickstart_runs):
  """The quickstart (default --target_epsilon=4, --seed=0) with --noise_multiplier alone, twice:
  both run, and the releases differ (noise and sampling seeds come from the OS); then sgd."""
  f, runs = quickstart_runs
  losses = []
  for i in range(2):
    out = run_of(runs, f"sigma_alone[{i}]")
    assert "Traceback" not in out.stderr
    rep = report(f / "sigma" / f"run{i}")
    assert rep["noise_multiplier"] == 1.2 and rep["hyperparameters"]["target_epsilon"] is None
    assert rep["steps"] == 3 and rep["hyperparameters"]["noise_multiplier"] == 1.2
    losses.append(rep["final_metrics"]["loss"])
  assert losses[0] != losses[1]
  out = run_of(runs, "sigma_sgd")
  rep = report(f / "sigma" / "sgd")
  assert rep["private"] is False and rep["epsilon"] is None and rep["steps"] == 3
  assert "non-private" in out.stdout


# --- seeds: public --seed, secret noise/sampler seeds never logged or recorded ---------
def test_seed_flag_keys_neither_the_noise_nor_the_sampler():
  from tf_dpnsgd.launch import common
  cfg = common.ExperimentConfig(target_epsilon=4.0, batch_size=10, seed=0)
  assert common.make_optimizer(cfg, 1.0, 10).seed is None  # the optimizer draws an OS seed
  seeds = {common.make_plan(cfg, 100).seed for _ in range(3)}
  assert len(seeds) == 3 and 0 not in seeds


@pytest.mark.slow
def test_no_seed_in_logs_records_or_export(tmp_path, monkeypatch, caplog, capfd):
  """A run's logs, stdout/stderr and every file it writes (checkpoint, privacy state,
  history, report, TensorBoard, SavedModel) hold neither the sampler nor the noise seed."""
  import logging as py_logging

  import keras
  from absl import logging as absl_logging
  from tf_dpnsgd import export
  from tf_dpnsgd.launch import common
  from tf_dpnsgd.launch import logs

  seen = {}
  make_plan, make_optimizer = common.make_plan, common.make_optimizer
  monkeypatch.setattr(common, "make_plan",
                      lambda *a, **k: seen.setdefault("plan", make_plan(*a, **k)))
  monkeypatch.setattr(common, "make_optimizer",
                      lambda *a, **k: seen.setdefault("optimizer", make_optimizer(*a, **k)))
  absl_logging.set_verbosity(absl_logging.INFO)
  caplog.set_level(py_logging.INFO)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4, 4, 1)).astype("float32")
  y = (x.mean(axis=(1, 2, 3)) > 0).astype("int32")

  def build():
    inputs = keras.Input((4, 4, 1))
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Flatten()(inputs))
    h = keras.layers.Dropout(0.2)(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))

  run, export_dir = tmp_path / "run", tmp_path / "export"
  cfg = common.ExperimentConfig(target_epsilon=8.0, batch_size=16, epochs=1.0, seed=0,
                                verbose=2, model_dir=str(run), export_dir=str(export_dir))
  common.run_experiment(cfg, build, (x, y), (x[:16], y[:16]),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        export_fn=lambda m, d: export.export_image_classifier(m, d, None, None),
                        print_fn=logs.print_epoch)
  plan, optimizer = seen["plan"], seen["optimizer"]
  secrets = {"sampler": plan.seed}
  key = getattr(optimizer, "_noise_key", None)
  if key is not None:
    secrets["noise"] = int(key[0])
  else:
    var = next(v for v in optimizer.variables if v.path.endswith("dp_noise_seed"))
    secrets["noise"] = int(np.asarray(var.numpy())[0])
  out, err = capfd.readouterr()
  text = caplog.text + out + err
  assert "Privacy plan" in text  # the plan is logged (its public fields)
  files = [os.path.join(d, f) for root in (run, export_dir) for d, _, fs in os.walk(root)
           for f in fs]
  assert any(f.endswith("checkpoint.weights.h5") for f in files)
  assert any(f.endswith("history.json") for f in files)
  assert any(f.endswith("saved_model.pb") for f in files)
  assert any("tensorboard" in f for f in files)
  for name, seed in secrets.items():
    assert str(seed) not in text, f"{name} seed logged"
    needles = (str(seed).encode(), int(seed).to_bytes(8, "little", signed=True))
    for path in files:
      with open(path, "rb") as f:
        data = f.read()
      assert not any(n in data for n in needles), f"{name} seed in {path}"


@pytest.mark.slow
@pytest.mark.xdist_group("launch_quickstart")  # its runs' one process: one worker
def test_shuffle_run_refuses_to_resume_mid_epoch(quickstart_runs):
  """Sampler seeds are never saved, so a shuffle run resumed inside an epoch would draw a
  new permutation for its rest (examples repeated within the epoch): refused, one line."""
  _, runs = quickstart_runs
  run_of(runs, "shuffle_first")  # --max_steps=2 of 11 steps per epoch
  out = runs["shuffle_resume"]  # the same flags, --max_steps=4, the same --model_dir
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "Cannot resume this --sampling=shuffle run at step 2" in out.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("launch_quickstart")  # its runs' one process: one worker
def test_dp_run_refuses_to_resume_a_non_private_model_dir_and_back(quickstart_runs):
  """Issue 30: the documented non-private baseline, then the DP run with the same
  --model_dir, used to warm-start from the SGD weights and report private: true, epsilon
  3.999, not_covered: []. Now it is a one-line error saying what to do, and the baseline's
  files stay as they were; the reverse (sgd over a private run) is refused too."""
  f, runs = quickstart_runs
  sgd_report = str(f / "issue30" / "sgd" / "privacy_report.json")
  before = json.loads(run_of(runs, "baseline_sgd").files[sgd_report])
  out = runs["dp_over_sgd"]
  assert out.returncode != 0 and "Traceback" not in out.stderr and "FATAL" in out.stderr
  assert "NON-PRIVATE run" in out.stderr and "Use a new --model_dir" in out.stderr
  assert json.loads(out.files[sgd_report]) == before and before["private"] is False
  run_of(runs, "baseline_dp")
  out = runs["sgd_over_dp"]
  dp_report = str(f / "issue30" / "dp" / "privacy_report.json")
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "would overwrite" in out.stderr and json.loads(out.files[dp_report])["private"] is True


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["quickstart", "mnist", "cifar10", "sst2"])
def test_help_lists_the_flags_a_run_needs(launcher):
  """`--help` (not only `--helpfull`) shows the shared flags: a new user reads it first."""
  out = zygote.run([sys.executable, "-m", f"tf_dpnsgd.launch.{launcher}", "--help"],
                   capture_output=True, text=True, timeout=300, env=ENV)
  for flag in ("--target_epsilon", "--epochs", "--batch_size", "--optimizer",
               "--learning_rate", "--model_dir", "--export_dir"):
    assert flag in out.stdout, f"{launcher} --help lacks {flag}"


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_sst2_lora_run_trains_only_the_factors_and_names_the_frozen_weights(sst2_runs):
  """--lora_rank (here on every projection, --lora_layers=all): DP LoRA fine-tuning from the
  launcher; the pretrained weights are frozen and named in not_covered; the export serves raw
  sentences."""
  f, runs = sst2_runs
  preset = str(f / "preset")
  run = f / "lora" / "run"
  out = run_of(runs, "lora")
  # The default --verbose=2 prints a line per epoch; the first step is reported at once.
  assert "step 1/2  loss " in out.stdout and " ETA " in out.stdout, out.stdout
  rep = report(run)
  assert rep["steps"] == 2 and rep["lora_rank"] == 2 and rep["lora_layers"] == ["all"]
  frozen = [item for item in rep["not_covered"] if item.startswith("Frozen weights")]
  assert frozen and "transformer_layer_0" in frozen[0], rep["not_covered"]
  # The preset is named through the ledger (models.text_classifier declares it).
  assert any(preset in item and item.startswith("Warm start")
             for item in rep["not_covered"]), rep["not_covered"]
  assert os.path.isdir(f / "lora" / "export")


@pytest.mark.slow
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_sst2_cached_top_layers_train_and_the_export_matches_on_raw_sentences(sst2_runs):
  """--cache_frozen_layers: the top layer trains on cached lower outputs (here: the tiny
  BERT's embeddings); the export recomputes them from raw sentences and its dev accuracy is
  reported beside the Keras model's; the frozen weights are named in not_covered."""
  f, runs = sst2_runs
  run = f / "cached" / "run"
  out = run_of(runs, "cached")
  rep = report(run)
  assert rep["steps"] == 3 and rep["cache_frozen_layers"] is True and rep["pooling"] == "mean"
  assert rep["feature_cache_hit"] is False
  assert [p.name.split("-")[0] for p in (f / "cached" / "cache").iterdir()] == ["text_lower"]
  assert rep["exported_dev_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                       abs=1 / 3 + 1e-9), rep
  assert report(f / "cached" / "export")["exported_dev_accuracy"] == rep["exported_dev_accuracy"]
  assert "exported SavedModel on raw dev sentences" in out.stdout
  cached = [item for item in rep["not_covered"] if item.startswith("Frozen lower layers")]
  assert cached and "token_embedding" in cached[0], rep["not_covered"]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(BAD_SST2_FLAGS)), ids=[m for _, m in BAD_SST2_FLAGS])
@pytest.mark.xdist_group("launch_cifar10_sst2")  # its runs' one process: one worker
def test_sst2_cache_and_baseline_flags_refused_before_training(sst2_runs, case):
  message = BAD_SST2_FLAGS[case][1]
  out = sst2_runs[1][f"bad_flags[{message}]"]
  assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
