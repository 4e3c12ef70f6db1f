"""The CIFAR-10 launcher with --model=scatter_linear / scatter_cnn on a tiny image folder."""

import json
import os

import numpy as np
import pytest

from test_cifar10_image_folder import write_image_folder
from launch_each import launch_each
from test_launch import ENV
from test_launch import launch
from test_launch import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("scatter_linear_dpnsgd_eps3", "scatter_linear_dpsgd_eps3", "scatter_cnn_dpnsgd_eps3")
TINY = ["--batch_size=20", "--physical_batch_size=10", "--epochs=2", "--max_steps=2",
        "--max_test_examples=20"]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_committed_scatter_config_trains_exports_and_checks_raw_pixels(tmp_path, config):
  write_image_folder(tmp_path / "data", per_class=(6, 3))
  run, export = tmp_path / "run", tmp_path / "export"
  out = launch("tf_dpnsgd.launch.cifar10", f"--flagfile={ROOT}/configs/cifar10/{config}.flags",
               f"--data_dir={tmp_path}/data", f"--model_dir={run}", f"--export_dir={export}",
               f"--feature_cache_dir={tmp_path}/cache", *TINY)
  rep = report(run)
  assert rep["private"] and rep["sampling"] == "poisson" and rep["steps"] == 2
  assert rep["dataset_size"] == 60 and rep["not_covered"] == []
  assert rep["model"] == config.split("_dp")[0] and rep["feature_cache_hit"] is False
  # Normalized with released statistics, inside the epsilon; an image and its mirror image.
  assert "released" in rep["feature_normalization"] and rep["feature_release"] == "new"
  views = ["identity"] if config.startswith("scatter_cnn") else ["identity", "flip"]
  assert rep["feature_views"] == views
  assert rep["epsilon"] <= 3.0 + 1e-9
  with open(run / "export_check.json") as f:
    check = json.load(f)
  # The SavedModel on raw uint8 images predicts what the head on cached features did.
  assert check["raw_pixel_test_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                           abs=1e-6)
  assert "export check" in out.stdout

  import tensorflow as tf
  from tf_dpnsgd.data import cifar10
  _, (x_test, _) = cifar10.load_cifar10(tmp_path / "data")
  serve = tf.saved_model.load(str(export)).signatures["serving_uint8"]
  probabilities = serve(images=tf.constant(x_test[:4]))["probabilities"].numpy()
  np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)

  # A second run (new model_dir) reads the features from the cache.
  launch("tf_dpnsgd.launch.cifar10", f"--flagfile={ROOT}/configs/cifar10/{config}.flags",
         f"--data_dir={tmp_path}/data", f"--model_dir={tmp_path}/run2",
         f"--feature_cache_dir={tmp_path}/cache", *TINY)
  assert report(tmp_path / "run2")["feature_cache_hit"] is True


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


@pytest.mark.slow
@pytest.mark.parametrize("sweep_config, extra", [
    ("scatter_cifar10_dpnsgd", []), ("scatter_cifar10_dpsgd", []),
    # The tiny batch of 20 would give the count query a std of 20 / 20 = 1, too small.
    ("scatter_cifar10_adaptive_clip", ["--clipped_count_stddev=5"])])
def test_committed_scatter_sweep_cells_run_the_study_setting(tmp_path, sweep_config, extra):
  """The tuning study's sweep configs inherit the eps-3 recipes' flag files, which later
  gained a second view and a variance floor: each sweep must still run the study's setting
  (GroupNorm features, one view, no floor) rather than fail or silently change it."""
  write_image_folder(tmp_path / "data", per_class=(6, 3))
  launch("tf_dpnsgd.launch.cifar10", *_sweep_cell_flags(sweep_config),
         f"--data_dir={tmp_path}/data", f"--model_dir={tmp_path}/run", *TINY, *extra)
  rep = report(tmp_path / "run")
  assert rep["feature_views"] == ["identity"]
  assert rep["feature_normalization"].startswith("per-example GroupNorm (27 groups")
  assert rep["model"] == "scatter_linear" and rep["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("sweep_config", ["scatter_cifar10_noise_bandmf",
                                          "scatter_cifar10_noise_long_blt",
                                          "scatter_cifar10_noise_blt_dpsgd"])
def test_committed_correlated_noise_sweep_cells_run_their_mechanism(tmp_path, sweep_config):
  """The correlated-noise study's configs (docs/correlated_noise.md) run the study's setting
  with their mechanism (b = 2 here: the tiny data set holds no 24 parts of a batch)."""
  write_image_folder(tmp_path / "data", per_class=(6, 3))
  launch("tf_dpnsgd.launch.cifar10", *_sweep_cell_flags(sweep_config),
         f"--data_dir={tmp_path}/data", f"--model_dir={tmp_path}/run", *TINY, "--bands=2")
  rep = report(tmp_path / "run")
  mechanism = sweep_config.split("_")[-2] if sweep_config.endswith("dpsgd") else \
      sweep_config.split("_")[-1]
  assert (rep["noise"], rep["bands"], rep["sampling"]) == (mechanism, 2, "cyclic_poisson")
  assert rep["feature_views"] == ["identity"] and rep["steps"] == 2
  assert bool(rep.get("blt")) == (mechanism == "blt")


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


@pytest.fixture(scope="module")
def bad_scatter_runs(tmp_path_factory):
  """Every case's launch on one tiny image folder, all in one process (tests/launch_each.py)."""
  data = tmp_path_factory.mktemp("scatter_flags") / "data"
  write_image_folder(data, per_class=(2, 1))
  return launch_each("tf_dpnsgd.launch.cifar10",
                     [[f"--data_dir={data}", *args, *TINY] for args, _ in BAD_SCATTER_FLAGS],
                     env=ENV)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(BAD_SCATTER_FLAGS)),
                         ids=[m for _, m in BAD_SCATTER_FLAGS])
def test_scatter_flag_errors_are_one_line(bad_scatter_runs, case):
  message = BAD_SCATTER_FLAGS[case][1]
  out = bad_scatter_runs[case]
  assert out.returncode != 0 and message in out.stderr
  assert "Traceback" not in out.stderr and "FATAL" in out.stderr


@pytest.mark.slow
def test_private_data_normalization_is_released_once_accounted_and_exported(tmp_path):
  write_image_folder(tmp_path / "data", per_class=(6, 3))
  base = [f"--flagfile={ROOT}/configs/cifar10/scatter_linear_dpnsgd_eps3.flags",
          f"--data_dir={tmp_path}/data", f"--feature_cache_dir={tmp_path}/cache", *TINY]
  run, export = tmp_path / "run", tmp_path / "export"
  launch("tf_dpnsgd.launch.cifar10", *base, "--feature_normalization=private_data",
         f"--model_dir={run}", f"--export_dir={export}")
  rep = report(run)
  assert rep["feature_release"] == "new" and "released" in rep["feature_normalization"]
  # The plan composed the two releases: the target still holds, with them inside it.
  assert rep["epsilon"] <= 3.0 + 1e-9
  assert any("2 Gaussian release(s)" in note for note in rep["notes"])
  with open(run / "feature_moments.json") as f:
    moments = json.load(f)
  assert moments["noise_multiplier"] == 8.0 and len(moments["mean"]) == 243
  # The committed recipe floors the variance: every channel kept; the file keeps the release
  # as drawn (no floor), the floor is recomputed from public numbers (1 x 8 x 1.5 / 60 images).
  assert moments["variance_floor"] == 0.0
  assert rep["feature_norm_variance_floor"] == pytest.approx(8.0 * 1.5 / 60)
  assert rep["feature_channels_kept"] == 243
  with open(run / "export_check.json") as f:
    check = json.load(f)
  assert check["raw_pixel_test_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                           abs=1e-6)
  # The same run resumed: the statistics come back from the model_dir, not a new release.
  launch("tf_dpnsgd.launch.cifar10", *base[:-2], "--max_steps=3", "--max_test_examples=20",
         "--feature_normalization=private_data", f"--model_dir={run}")
  again = report(run)
  assert again["feature_release"] == "reused from --model_dir" and again["steps"] == 3
  with open(run / "feature_moments.json") as f:
    assert json.load(f) == moments


@pytest.mark.slow
def test_feature_views_train_one_gradient_per_example_and_export_the_views_mean(tmp_path):
  """--feature_views: one model over the views (weights shared), released statistics of the
  first view inside the epsilon, the export on raw pixels predicts what the features did, and
  each view's features are cached."""
  write_image_folder(tmp_path / "data", per_class=(6, 3))
  args = [f"--flagfile={ROOT}/configs/cifar10/scatter_linear_dpnsgd_eps3.flags",
          f"--data_dir={tmp_path}/data", f"--feature_cache_dir={tmp_path}/cache",
          "--feature_views=identity,flip", *TINY]
  run, export = tmp_path / "run", tmp_path / "export"
  launch("tf_dpnsgd.launch.cifar10", *args, f"--model_dir={run}", f"--export_dir={export}")
  rep = report(run)
  assert rep["feature_views"] == ["identity", "flip"]
  assert rep["feature_release"] == "new" and rep["epsilon"] <= 3.0 + 1e-9
  assert rep["not_covered"] == [] and rep["feature_cache_hit"] is False
  with open(run / "export_check.json") as f:
    check = json.load(f)
  assert check["raw_pixel_test_accuracy"] == pytest.approx(rep["final_metrics"]["accuracy"],
                                                           abs=1e-6)
  # The export averages the logits of an image and of its mirror image, so it must give a
  # mirrored image exactly the same logits (an invariance no single view has).
  import tensorflow as tf
  from tf_dpnsgd.data import cifar10
  _, (x_test, _) = cifar10.load_cifar10(tmp_path / "data")
  serve = tf.saved_model.load(str(export)).signatures["serving_uint8"]
  logits = serve(images=tf.constant(x_test[:4]))["logits"].numpy()
  mirrored = serve(images=tf.constant(x_test[:4, :, ::-1]))["logits"].numpy()
  assert logits.shape == (4, 10) and np.ptp(logits) > 0
  np.testing.assert_allclose(mirrored, logits, rtol=1e-6, atol=1e-6)
  launch("tf_dpnsgd.launch.cifar10", *args, f"--model_dir={tmp_path}/run2")
  assert report(tmp_path / "run2")["feature_cache_hit"] is True
