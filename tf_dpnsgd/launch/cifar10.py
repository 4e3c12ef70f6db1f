r"""CIFAR-10 with DP-NSGD / DP-SGD: ResNet20-GN (Yang et al. 2022, Sec. 5) or a
classifier on scattering features (Tramer and Boneh, ICLR 2021).

  python -m tf_dpnsgd.launch.cifar10 --flagfile=configs/cifar10/dpnsgd_eps8_step.flags \
      --data_dir=$HOME/data --model_dir=runs/c10 --export_dir=runs/c10/export
  python -m tf_dpnsgd.launch.cifar10 \
      --flagfile=configs/cifar10/scatter_linear_dpnsgd_eps3.flags \
      --data_dir=$HOME/data/cifar10-images --model_dir=runs/scat --export_dir=runs/scat/export

Data: --data_dir pointing at (a folder containing) the standard
`cifar-10-batches-py` pickle folder, or an image folder
(`<data_dir>/{train,test}/<class name>/*.png|jpg`); without --data_dir,
tensorflow-datasets `cifar10` when online.

Models (--model):
  * resnet20: ResNet20 with GroupNorm on the pixels, normalized per channel inside the
    model (--resnet_depth=8 gives ResNet8-GN, the same layer kinds, for the tests).
  * scatter_linear, scatter_cnn: a fixed scattering transform (J=2, L=8: 243 maps of 8x8,
    no weights), the features normalized per example (GroupNorm, no weights, no privacy
    cost) or per channel by training-set statistics released with the Gaussian mechanism
    (--feature_normalization=private_data, inside the epsilon), then a linear layer or
    Tramer and Boneh's small CNN (tf_dpnsgd.models.scatternet). The features are computed
    once (and kept in --feature_cache_dir if given) and DP training runs on the head, which
    is the same training: the features have no weights. --feature_views=identity,flip,...
    computes them for fixed views of each image; each example's loss is then the mean over
    its views (augmentation multiplicity) and prediction averages the views' logits.

Every exported SavedModel takes raw 0-255 images; for the scattering models the launcher
also checks the export's accuracy on the raw test images against the feature-based one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import export as export_lib
from tf_dpnsgd import private_stats
from tf_dpnsgd import models
from tf_dpnsgd.data import cache as cache_lib
from tf_dpnsgd.data import cifar10 as cifar_lib
from tf_dpnsgd.launch import allocator
from tf_dpnsgd.launch import common
from tf_dpnsgd.models import scatternet
from tf_dpnsgd.models import views as views_lib

MODELS = ("resnet20", "scatter_linear", "scatter_cnn")
SCATTER_HEADS = {"scatter_linear": scatternet.scatter_linear,
                 "scatter_cnn": scatternet.scatter_cnn}

# The paper's setting: batch 1000, 100 epochs, delta 1e-5 (Sec. 5.1).
common.define_flags(optimizer="dpnsgd", learning_rate=4.0, regularizer=0.01, l2_norm_clip=1.0,
                    target_epsilon=8.0, delta=1e-5, batch_size=1000, physical_batch_size=250,
                    epochs=100, sampling="poisson", lr_schedule="step", momentum=0.0)
flags.DEFINE_string("data_dir", None, "Folder with cifar-10-batches-py, or an image folder "
                    "(train/<class>/*.png|jpg, test/<class>/...); else tfds cifar10.")
flags.DEFINE_enum("model", "resnet20", MODELS, "resnet20 (GroupNorm) on pixels, or a linear "
                  "model / small CNN on scattering features.")
flags.DEFINE_boolean("augment", False, "Random crop (4-pixel padding) + horizontal flip "
                     "(resnet20 only).")
flags.DEFINE_integer("groups", 16, "GroupNorm groups of resnet20.")
flags.DEFINE_integer("resnet_depth", 20, "Depth 6n+2 of --model=resnet20 (20 is the paper's; "
                     "the tests use 8, the family's smallest, to run the same path cheaply).")
flags.DEFINE_integer("feature_groups", 27, "Scattering models: GroupNorm groups over the 243 "
                     "feature channels (a divisor of 243: 9, 27, 81, ...).")
flags.DEFINE_enum("feature_normalization", "groupnorm", ("groupnorm", "private_data"),
                  "Scattering models: per-example GroupNorm (--feature_groups; no privacy "
                  "cost), or Tramer and Boneh's data normalization: each channel's mean and "
                  "variance over the training features released with the Gaussian mechanism "
                  "(tf_dpnsgd.private_stats; two releases, composed into the plan's epsilon "
                  "and recorded in the model's ledger).")
flags.DEFINE_float("feature_norm_noise_multiplier", 8.0, "--feature_normalization="
                   "private_data: noise multiplier of each of the two releases.")
flags.DEFINE_float("feature_norm_mean_clip", 1.0, "--feature_normalization=private_data: L2 "
                   "bound of one example's per-channel feature means.")
flags.DEFINE_float("feature_norm_square_clip", 1.5, "--feature_normalization=private_data: L2 "
                   "bound of one example's per-channel feature mean squares.")
flags.DEFINE_float("feature_norm_variance_floor", 0.0, "--feature_normalization=private_data: "
                   "scale each channel by 1/sqrt(max(var, floor)), floor = this multiple of the "
                   "noise std of the released mean squares (sigma * square_clip / N, public); "
                   "0 drops the channels whose released variance is 0 (Tramer and Boneh).")
flags.DEFINE_list("feature_views", ["identity"], "Scattering models: fixed views of each "
                  "image (" + ", ".join(views_lib.VIEWS) + "); with several, each example's "
                  "loss is the mean over its views (augmentation multiplicity: one per-example "
                  "gradient, same sensitivity) and prediction averages the views' logits "
                  "(tf_dpnsgd.models.views).")
flags.DEFINE_string("feature_cache_dir", None, "Scattering models: keep decoded image folders "
                    "and scattering features here, keyed by the data's checksum (holds data "
                    "derived from the training set: keep it private). None: no cache.")
flags.DEFINE_integer("max_train_examples", None, "Use only the first N training images (debug).")
flags.DEFINE_integer("max_test_examples", None, "Evaluate on the first N test images (debug).")


# `--help` lists the shared flags a run needs (target_epsilon, epochs, ...), not only ours.
flags.adopt_module_key_flags(common)

def planned_dataset_size(flag_values) -> int:
  """Training-set size for these flags (used by the sweep's --dry_run)."""
  n = 50000
  if flag_values.data_dir:
    if cifar_lib.is_image_folder(flag_values.data_dir):
      n = cifar_lib.count_images(flag_values.data_dir, "train")
    else:
      (_, y_train), _ = cifar_lib.load_cifar10(flag_values.data_dir)
      n = len(y_train)
  return min(n, flag_values.max_train_examples or n)


def extract_features(extractor, images, batch_size: int = 250, log_every: int = 10000,
                     dtype=np.float16):
  """``extractor`` over ``images`` in batches, as a NumPy array of ``dtype`` (float16:
  the extractor rounds its features to float16 values, see
  :class:`~tf_dpnsgd.models.scatternet.RoundToFloat16`).

  Returns:
    ``(features, seconds)``.
  """
  fn = tf.function(lambda x: extractor(x, training=False), reduce_retracing=True)
  out = np.empty((len(images),) + tuple(extractor.output_shape[1:]), dtype)
  start = time.time()
  for i in range(0, len(images), batch_size):
    out[i:i + batch_size] = fn(tf.constant(images[i:i + batch_size], tf.float32)).numpy()
    done = min(i + batch_size, len(images))
    if done % log_every < batch_size or done == len(images):
      rate = (time.time() - start) / done * 1000
      print(f"scattering: {done}/{len(images)} images ({rate:.2f} ms/image)", flush=True)
  return out, time.time() - start


def scattering_features(extractor, x_train, x_test, cache_dir):
  """The extractor's features of both splits, from ``cache_dir`` when present.

  The cache key is the checksum of the images and of the extractor's config.

  Returns:
    ``(f_train, f_test, info)``: ``info`` says whether the cache was hit and how long
    the extraction took.
  """
  settings = {"extractor": [layer.get_config() for layer in extractor.layers[1:]],
              "algorithm": "tf_dpnsgd.models.scattering v1", "dtype": "float16"}
  key = cache_lib.digest(x_train, x_test, settings=settings)
  timing = {}

  def compute():
    f_train, timing["train"] = extract_features(extractor, x_train)
    f_test, timing["test"] = extract_features(extractor, x_test)
    return f_train, f_test

  (f_train, f_test), hit = cache_lib.cached(cache_dir, "scattering", key, ("train", "test"),
                                            compute)
  seconds = sum(timing.values())
  info = {"feature_cache_hit": hit}
  if not hit:
    n = len(x_train) + len(x_test)
    info.update({"feature_seconds": round(seconds, 1),
                 "feature_ms_per_image": round(seconds / n * 1000, 3)})
  return f_train, f_test, info


MOMENTS_FILE = "feature_moments.json"


def _feature_moments(f_train, head, FLAGS, model_dir):
  """The released feature statistics: kept in ``model_dir`` (public once released) so that a
  resumed run reuses them instead of releasing twice; recorded in ``head``'s ledger either way.

  Returns:
    ``(moments, released_now)``.
  """
  path = os.path.join(model_dir, MOMENTS_FILE) if model_dir else None
  if path and os.path.exists(path):
    with open(path) as f:
      moments = private_stats.ChannelMoments.from_dict(json.load(f))
    private_stats.record_releases(head, moments)  # a resumed checkpoint's ledger holds them too
    return moments, False
  try:
    moments = private_stats.release_channel_moments(
        f_train, head, noise_multiplier=FLAGS.feature_norm_noise_multiplier,
        mean_clip=FLAGS.feature_norm_mean_clip, square_clip=FLAGS.feature_norm_square_clip)
  except ValueError as e:
    raise common.LaunchError(f"--feature_norm_*: {e}") from None
  if path:
    os.makedirs(model_dir, exist_ok=True)
    with open(path, "w") as f:
      json.dump(moments.to_dict(), f)
  return moments, True


def check_export(export_dir, x_test, y_test, batch_size: int = 250) -> float:
  """Accuracy of the exported SavedModel on raw test images (uint8 signature)."""
  return export_lib.serving_accuracy(export_dir, x_test, y_test, input_name="images",
                                     signature="serving_uint8", dtype=tf.uint8,
                                     batch_size=batch_size)


def main(argv):
  del argv
  cfg = common.config_from_flags()
  FLAGS = flags.FLAGS
  if FLAGS.model == "resnet20" and list(FLAGS.feature_views) != ["identity"]:
    raise common.LaunchError("--feature_views is for the scattering models; resnet20 "
                             "augments with --augment.")
  if FLAGS.augment and FLAGS.model != "resnet20":
    raise common.LaunchError(f"--augment needs --model=resnet20: --model={FLAGS.model} trains "
                             "on scattering features computed once from the unaugmented "
                             "images.")
  if FLAGS.resnet_depth < 8 or (FLAGS.resnet_depth - 2) % 6:
    raise common.LaunchError(f"--resnet_depth must be 6n+2 (8, 14, 20, 32, ...); got "
                             f"{FLAGS.resnet_depth}.")
  if FLAGS.feature_norm_variance_floor and FLAGS.feature_normalization != "private_data":
    raise common.LaunchError("--feature_norm_variance_floor needs "
                             "--feature_normalization=private_data (scattering models).")
  if FLAGS.model != "resnet20" and FLAGS.feature_normalization == "private_data" and cfg.private:
    sigma = FLAGS.feature_norm_noise_multiplier
    cfg = dataclasses.replace(cfg, releases=(sigma,) * private_stats.RELEASES_PER_NORMALIZATION)
  (x_train, y_train), (x_test, y_test) = cifar_lib.load_cifar10(
      FLAGS.data_dir, cache_dir=FLAGS.feature_cache_dir)
  if FLAGS.max_train_examples:
    x_train, y_train = x_train[:FLAGS.max_train_examples], y_train[:FLAGS.max_train_examples]
  if FLAGS.max_test_examples:
    x_test, y_test = x_test[:FLAGS.max_test_examples], y_test[:FLAGS.max_test_examples]
  y_train, y_test = common.as_numpy_labels(y_train), common.as_numpy_labels(y_test)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  if FLAGS.model == "resnet20":
    record = _run_resnet20(cfg, FLAGS, (x_train, y_train), (x_test, y_test), loss)
  else:
    record = _run_scatter(cfg, FLAGS, (x_train, y_train), (x_test, y_test), loss)
  print(f"test accuracy {record.metric('accuracy', float('nan')):.4f}; "
        f"{record.epsilon_text()} after {record.steps} steps")


def _run_resnet20(cfg, FLAGS, train, test, loss):
  def build_model():
    net = models.resnet20(groups=FLAGS.groups, depth=FLAGS.resnet_depth)
    return cifar_lib.with_normalization(net, name="resnet20_gn")

  # Per example, inside the sampler (seeds from the sampler's: fresh each step and example).
  augment_fn = cifar_lib.crop_flip_to_float if FLAGS.augment else cifar_lib.pixels_to_float

  def export_fn(model, export_dir):
    export_lib.export_image_classifier(model, export_dir, mean=None, std=None)

  x_test, y_test = test
  return common.run_experiment(
      cfg, build_model, train, (x_test.astype("float32"), y_test), loss=loss,
      export_fn=export_fn, augment_fn=augment_fn,
      extra_report={"dataset": "cifar10", "model": "resnet20_groupnorm",
                    "augment": FLAGS.augment, "groups": FLAGS.groups,
                    "resnet_depth": FLAGS.resnet_depth})


def _view_features(extractor, x_train, x_test, names, cache_dir):
  """The extractor's features of each view of both splits, ``[N, V, ...]`` (float16); one view:
  ``[N, ...]``. Each view is cached on its own (its images' checksum is the key)."""
  if names == ("identity",):
    return scattering_features(extractor, x_train, x_test, cache_dir)
  f_train = f_test = None
  info = {"feature_cache_hit": True, "feature_seconds": 0.0}
  for v, name in enumerate(names):
    view = views_lib.VIEWS[name]
    tr, te, one = scattering_features(extractor, views_lib.apply_view_numpy(x_train, view),
                                      views_lib.apply_view_numpy(x_test, view), cache_dir)
    if f_train is None:
      f_train = np.empty((len(tr), len(names)) + tr.shape[1:], tr.dtype)
      f_test = np.empty((len(te), len(names)) + te.shape[1:], te.dtype)
    f_train[:, v], f_test[:, v] = tr, te
    del tr, te
    info["feature_cache_hit"] &= one["feature_cache_hit"]
    info["feature_seconds"] += one.get("feature_seconds", 0.0)
  info["feature_seconds"] = round(info["feature_seconds"], 1)
  return f_train, f_test, info


def _run_scatter(cfg, FLAGS, train, test, loss):
  (x_train, y_train), (x_test, y_test) = train, test
  private_data = FLAGS.feature_normalization == "private_data"
  groups = None if private_data else FLAGS.feature_groups
  try:
    names = views_lib.check_views(FLAGS.feature_views)
  except ValueError as e:  # an unknown or repeated view
    raise common.LaunchError(f"--feature_views: {e}") from None
  try:
    extractor = scatternet.scattering_extractor(input_shape=x_train.shape[1:], groups=groups)
  except ValueError as e:  # e.g. groups not dividing the channels
    raise common.LaunchError(f"--feature_groups: {e}") from None
  f_train, f_test, info = _view_features(extractor, x_train, x_test, names,
                                         FLAGS.feature_cache_dir)
  multi = len(names) > 1
  feature_shape = f_train.shape[2:] if multi else f_train.shape[1:]
  metrics = ("accuracy",)
  if multi:
    loss, metrics = views_lib.view_mean_loss(), (views_lib.ViewMeanAccuracy(),)

  def new_model():
    head = SCATTER_HEADS[FLAGS.model](feature_shape=feature_shape)
    return views_lib.multi_view(head, len(names)) if multi else head

  built = []
  if private_data:
    if cfg.distribution_strategy != "none":
      raise common.LaunchError("--feature_normalization=private_data builds the model before "
                               "the strategy exists; use --distribution_strategy=none.")
    # The release is recorded in the ledger of the model that will be made private, before
    # any noise is drawn (tf_dpnsgd.private_stats); the plan composes it (cfg.releases).
    # With several views, the statistics are those of the first view's features.
    model = new_model()
    moments, released = _feature_moments(f_train[:, 0] if multi else f_train, model, FLAGS,
                                         cfg.model_dir)
    try:  # public post-processing; the file in --model_dir keeps the release as drawn
      moments = moments.with_variance_floor(FLAGS.feature_norm_variance_floor)
    except ValueError as e:
      raise common.LaunchError(f"--feature_norm_variance_floor: {e}") from None
    # In place: the raw float16 features are not needed again (1.6 GB per view for CIFAR-10).
    f_train = private_stats.standardize(f_train, moments, out=f_train)
    f_test = private_stats.standardize(f_test, moments, out=f_test)
    extractor = scatternet.scattering_extractor(input_shape=x_train.shape[1:], groups=None,
                                                channel_moments=moments)
    info.update({"feature_release": "new" if released else "reused from --model_dir",
                 "feature_norm_noise_multiplier": moments.noise_multiplier,
                 "feature_norm_clips": [moments.mean_clip, moments.square_clip],
                 "feature_norm_variance_floor": moments.variance_floor,
                 "feature_channels_kept": int(np.sum(moments.scale() > 0))})
    normalization = (f"per-channel standardization by released training-set statistics "
                     f"(Gaussian, noise multiplier {moments.noise_multiplier:g}, 2 releases)")
    built.append(model)
  else:
    normalization = f"per-example GroupNorm ({groups} groups, no affine)"

  def build_model():
    if built:  # the model whose ledger holds the release; built once
      return built.pop()
    if private_data:
      raise common.LaunchError("--feature_normalization=private_data: the model was built "
                               "twice; a second model would not hold the release.")
    return new_model()

  def export_fn(model, export_dir):
    full = (views_lib.on_raw_pixels(model, extractor, names) if multi
            else scatternet.on_raw_pixels(model, extractor))
    export_lib.export_image_classifier(full, export_dir, mean=None, std=None)

  extra = {"dataset": "cifar10", "model": FLAGS.model, "features": "scattering J=2 L=8 order 2",
           "feature_normalization": normalization, "feature_views": list(names), **info}
  # Training features stay float16 in memory (the sampler holds a copy too); each batch
  # becomes float32 in the input pipeline, exactly (they are float16 values).
  record = common.run_experiment(cfg, build_model, (f_train, y_train),
                                 (f_test.astype(np.float32), y_test), loss=loss,
                                 metrics=metrics, export_fn=export_fn,
                                 augment_fn=cifar_lib.pixels_to_float, extra_report=extra)
  if cfg.export_dir and os.path.isdir(cfg.export_dir):
    accuracy = check_export(cfg.export_dir, x_test, y_test)
    print(f"export check: accuracy {accuracy:.4f} on raw test images "
          f"(features: {record.metric('accuracy', float('nan')):.4f})")
    if cfg.model_dir:
      with open(os.path.join(cfg.model_dir, "export_check.json"), "w") as f:
        json.dump({"raw_pixel_test_accuracy": accuracy,
                   "feature_test_accuracy": record.metric("accuracy", float("nan")),
                   "test_examples": len(y_test)}, f, indent=1)
  return record


if __name__ == "__main__":
  allocator.maybe_reexec()  # tcmalloc where installed: see tf_dpnsgd.launch.allocator
  app.run(common.main_with_usage_errors(main))
