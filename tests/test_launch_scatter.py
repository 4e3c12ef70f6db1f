"""The CIFAR-10 launcher with --model=scatter_linear / scatter_cnn on a tiny image folder."""

import json
import os

import numpy as np
import pytest

from test_cifar10_image_folder import write_image_folder
from test_launch import named_runs
from test_launch import report
from test_launch import run_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("scatter_linear_dpnsgd_eps3", "scatter_linear_dpsgd_eps3", "scatter_cnn_dpnsgd_eps3")
TINY = ["--batch_size=20", "--physical_batch_size=10", "--epochs=2", "--max_steps=2",
        "--max_test_examples=20"]


# Every launch of this module runs in one of two processes (tests/launch_each.py, through
# test_launch.named_runs): the committed recipes with their exports and caches, and the sweep
# cells with the flag errors. Each group writes one tiny image folder (6 train / 3 test images
# a class) that its runs read; each run has its own model, export and cache folders.
def _configs_runs_of(f):
  data = f"--data_dir={f}/data"
  runs = []
  for config in CONFIGS:
    flagfile = f"--flagfile={ROOT}/configs/cifar10/{config}.flags"
    cache = f"--feature_cache_dir={f}/{config}/cache"
    runs += [(f"config[{config}]", [flagfile, data, f"--model_dir={f}/{config}/run",
                                     f"--export_dir={f}/{config}/export", cache, *TINY]),
             # A second run (new model_dir) reads the features from the cache.
             (f"config_cached[{config}]", [flagfile, data, f"--model_dir={f}/{config}/run2",
                                           cache, *TINY])]
  # test_private_data_normalization_is_released_once_accounted_and_exported
  base = [f"--flagfile={ROOT}/configs/cifar10/scatter_linear_dpnsgd_eps3.flags", data,
          f"--feature_cache_dir={f}/private/cache", *TINY]
  run = f"{f}/private/run"
  runs += [("private_data", {
      "argv": [*base, "--feature_normalization=private_data", f"--model_dir={run}",
               f"--export_dir={f}/private/export"],
      "read": [f"{run}/{name}" for name in ("privacy_report.json", "feature_moments.json",
                                            "export_check.json")]}),
           # The same run resumed.
           ("private_data_resume", [*base[:-2], "--max_steps=3", "--max_test_examples=20",
                                    "--feature_normalization=private_data",
                                    f"--model_dir={run}"])]
  # test_feature_views_train_one_gradient_per_example_and_export_the_views_mean
  views = [f"--flagfile={ROOT}/configs/cifar10/scatter_linear_dpnsgd_eps3.flags", data,
           f"--feature_cache_dir={f}/views/cache", "--feature_views=identity,flip", *TINY]
  runs += [("views", [*views, f"--model_dir={f}/views/run", f"--export_dir={f}/views/export"]),
           ("views_cached", [*views, f"--model_dir={f}/views/run2"])]
  return runs


def _write_data(f):
  write_image_folder(f / "data", per_class=(6, 3))


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory):
  return named_runs(tmp_path_factory, "test_launch_scatter_configs", "tf_dpnsgd.launch.cifar10",
                    _configs_runs_of, _write_data)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.xdist_group("launch_scatter_configs")  # its runs' one process: one worker
def test_committed_scatter_config_trains_exports_and_checks_raw_pixels(config_runs, config):
  f, runs = config_runs
  run, export = f / config / "run", f / config / "export"
  out = run_of(runs, f"config[{config}]")
  rep = report(run)
  assert rep["private"] and rep["sampling"] == "poisson" and rep["steps"] == 2
  assert rep["dataset_size"] == 60 and rep["not_covered"] == []
  assert rep["model"] == config.split("_dp")[0] and rep["feature_cache_hit"] is False
  # Normalized with released statistics, inside the epsilon; an image and its mirror image.
  assert "released" in rep["feature_normalization"] and rep["feature_release"] == "new"
  views = ["identity"] if config.startswith("scatter_cnn") else ["identity", "flip"]
  assert rep["feature_views"] == views
  assert rep["epsilon"] <= 3.0 + 1e-9
  with open(run / "export_check.json") as f_:
    check = json.load(f_)
  # The SavedModel on raw uint8 images predicts what the head on cached features did.
  assert check["raw_pixel_test_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                           abs=1e-6)
  assert "export check" in out.stdout

  import tensorflow as tf
  from tf_dpnsgd.data import cifar10
  _, (x_test, _) = cifar10.load_cifar10(f / "data")
  serve = tf.saved_model.load(str(export)).signatures["serving_uint8"]
  probabilities = serve(images=tf.constant(x_test[:4]))["probabilities"].numpy()
  np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)

  # A second run (new model_dir) reads the features from the cache.
  run_of(runs, f"config_cached[{config}]")
  assert report(f / config / "run2")["feature_cache_hit"] is True


def _sweep_cell_flags(sweep_config):
  """The cifar10 launcher flags of the first cell of a committed sweep config: its base flag
  file, its --fixed flags and the first value of each launcher-flag grid axis."""
  base, rest = None, []
  with open(f"{ROOT}/configs/sweeps/{sweep_config}.flags") as f:
    for line in (l.strip() for l in f):
      if line.startswith("--base_flagfile="):
        base = f"--flagfile={ROOT}/" + line.split("=", 1)[1]
      elif line.startswith("--fixed="):
        rest.append("--" + line[len("--fixed="):])
      elif line.startswith("--grid="):
        name, values = line[len("--grid="):].split("=", 1)
        if name != "effective_lr":  # a sweep axis (lr = value / clip), not a launcher flag
          rest.append(f"--{name}={values.split(',')[0]}")
  return [base] + rest


SWEEP_CELLS = [
    ("scatter_cifar10_dpnsgd", []), ("scatter_cifar10_dpsgd", []),
    # The tiny batch of 20 would give the count query a std of 20 / 20 = 1, too small.
    ("scatter_cifar10_adaptive_clip", ["--clipped_count_stddev=5"])]
CORRELATED_CELLS = ["scatter_cifar10_noise_bandmf", "scatter_cifar10_noise_long_blt",
                    "scatter_cifar10_noise_blt_dpsgd"]
BAD_SCATTER_FLAGS = [
    (["--model=scatter_linear", "--augment"], "--augment needs --model=resnet20"),
    (["--model=scatter_cnn", "--feature_groups=10"], "--feature_groups"),
    (["--model=scatter_linear", "--feature_views=identity,rotate"], "--feature_views: Unknown"),
    (["--model=scatter_linear", "--feature_views=flip,flip"], "--feature_views: Views repeat"),
    (["--model=resnet20", "--feature_views=identity,flip"], "--feature_views is for the"),
    (["--model=scatter_linear", "--feature_norm_variance_floor=1"],
     "--feature_norm_variance_floor needs --feature_normalization=private_data"),
    (["--model=scatter_linear", "--feature_normalization=private_data",
      "--feature_norm_variance_floor=-1"], "--feature_norm_variance_floor: The variance floor"),
]


def _cells_runs_of(f):
  data = f"--data_dir={f}/data"
  return [
      *[(f"sweep[{sweep}]", [*_sweep_cell_flags(sweep), data, f"--model_dir={f}/sweep/{sweep}",
                             *TINY, *extra]) for sweep, extra in SWEEP_CELLS],
      # b = 2: the tiny data set holds no 24 parts of a batch
      *[(f"correlated[{sweep}]", [*_sweep_cell_flags(sweep), data,
                                  f"--model_dir={f}/correlated/{sweep}", *TINY, "--bands=2"])
        for sweep in CORRELATED_CELLS],
      # on a tinier image folder (2 train / 1 test image a class)
      *[(f"bad_flags[{m}]", [f"--data_dir={f}/flags_data", *args, *TINY])
        for args, m in BAD_SCATTER_FLAGS],
  ]


def _write_cells_data(f):
  _write_data(f)
  write_image_folder(f / "flags_data", per_class=(2, 1))


@pytest.fixture(scope="module")
def cell_runs(tmp_path_factory):
  return named_runs(tmp_path_factory, "test_launch_scatter_cells", "tf_dpnsgd.launch.cifar10",
                    _cells_runs_of, _write_cells_data)


@pytest.mark.slow
@pytest.mark.parametrize("sweep_config, extra", SWEEP_CELLS)
@pytest.mark.xdist_group("launch_scatter_cells")  # its runs' one process: one worker
def test_committed_scatter_sweep_cells_run_the_study_setting(cell_runs, sweep_config, extra):
  """The tuning study's sweep configs inherit the eps-3 recipes' flag files, which later
  gained a second view and a variance floor: each sweep must still run the study's setting
  (GroupNorm features, one view, no floor) rather than fail or silently change it."""
  f, runs = cell_runs
  run_of(runs, f"sweep[{sweep_config}]")  # its first cell's flags, then TINY and `extra`
  rep = report(f / "sweep" / sweep_config)
  assert rep["feature_views"] == ["identity"]
  assert rep["feature_normalization"].startswith("per-example GroupNorm (27 groups")
  assert rep["model"] == "scatter_linear" and rep["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("sweep_config", CORRELATED_CELLS)
@pytest.mark.xdist_group("launch_scatter_cells")  # its runs' one process: one worker
def test_committed_correlated_noise_sweep_cells_run_their_mechanism(cell_runs, sweep_config):
  """The correlated-noise study's configs (docs/correlated_noise.md) run the study's setting
  with their mechanism (b = 2 here: the tiny data set holds no 24 parts of a batch)."""
  f, runs = cell_runs
  run_of(runs, f"correlated[{sweep_config}]")
  rep = report(f / "correlated" / sweep_config)
  mechanism = sweep_config.split("_")[-2] if sweep_config.endswith("dpsgd") else \
      sweep_config.split("_")[-1]
  assert (rep["noise"], rep["bands"], rep["sampling"]) == (mechanism, 2, "cyclic_poisson")
  assert rep["feature_views"] == ["identity"] and rep["steps"] == 2
  assert bool(rep.get("blt")) == (mechanism == "blt")


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(BAD_SCATTER_FLAGS)),
                         ids=[m for _, m in BAD_SCATTER_FLAGS])
@pytest.mark.xdist_group("launch_scatter_cells")  # its runs' one process: one worker
def test_scatter_flag_errors_are_one_line(cell_runs, case):
  message = BAD_SCATTER_FLAGS[case][1]
  out = cell_runs[1][f"bad_flags[{message}]"]
  assert out.returncode != 0 and message in out.stderr
  assert "Traceback" not in out.stderr and "FATAL" in out.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("launch_scatter_configs")  # its runs' one process: one worker
def test_private_data_normalization_is_released_once_accounted_and_exported(config_runs):
  f, runs = config_runs
  run = f / "private" / "run"
  first = run_of(runs, "private_data")  # the files as this run left them, before the resume
  rep = json.loads(first.files[str(run / "privacy_report.json")])
  assert rep["feature_release"] == "new" and "released" in rep["feature_normalization"]
  # The plan composed the two releases: the target still holds, with them inside it.
  assert rep["epsilon"] <= 3.0 + 1e-9
  assert any("2 Gaussian release(s)" in note for note in rep["notes"])
  moments = json.loads(first.files[str(run / "feature_moments.json")])
  assert moments["noise_multiplier"] == 8.0 and len(moments["mean"]) == 243
  # The committed recipe floors the variance: every channel kept; the file keeps the release
  # as drawn (no floor), the floor is recomputed from public numbers (1 x 8 x 1.5 / 60 images).
  assert moments["variance_floor"] == 0.0
  assert rep["feature_norm_variance_floor"] == pytest.approx(8.0 * 1.5 / 60)
  assert rep["feature_channels_kept"] == 243
  check = json.loads(first.files[str(run / "export_check.json")])
  assert check["raw_pixel_test_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                           abs=1e-6)
  # The same run resumed: the statistics come back from the model_dir, not a new release.
  run_of(runs, "private_data_resume")
  again = report(run)
  assert again["feature_release"] == "reused from --model_dir" and again["steps"] == 3
  with open(run / "feature_moments.json") as f_:
    assert json.load(f_) == moments


@pytest.mark.slow
@pytest.mark.xdist_group("launch_scatter_configs")  # its runs' one process: one worker
def test_feature_views_train_one_gradient_per_example_and_export_the_views_mean(config_runs):
  """--feature_views: one model over the views (weights shared), released statistics of the
  first view inside the epsilon, the export on raw pixels predicts what the features did, and
  each view's features are cached."""
  f, runs = config_runs
  run, export = f / "views" / "run", f / "views" / "export"
  run_of(runs, "views")
  rep = report(run)
  assert rep["feature_views"] == ["identity", "flip"]
  assert rep["feature_release"] == "new" and rep["epsilon"] <= 3.0 + 1e-9
  assert rep["not_covered"] == [] and rep["feature_cache_hit"] is False
  with open(run / "export_check.json") as f_:
    check = json.load(f_)
  assert check["raw_pixel_test_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                           abs=1e-6)
  # The export averages the logits of an image and of its mirror image, so it must give a
  # mirrored image exactly the same logits (an invariance no single view has).
  import tensorflow as tf
  from tf_dpnsgd.data import cifar10
  _, (x_test, _) = cifar10.load_cifar10(f / "data")
  serve = tf.saved_model.load(str(export)).signatures["serving_uint8"]
  logits = serve(images=tf.constant(x_test[:4]))["logits"].numpy()
  mirrored = serve(images=tf.constant(x_test[:4, :, ::-1]))["logits"].numpy()
  assert logits.shape == (4, 10) and np.ptp(logits) > 0
  np.testing.assert_allclose(mirrored, logits, rtol=1e-6, atol=1e-6)
  run_of(runs, "views_cached")  # a new model_dir, the same feature cache
  assert report(f / "views" / "run2")["feature_cache_hit"] is True
