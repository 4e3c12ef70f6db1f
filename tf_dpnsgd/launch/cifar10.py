r"""ResNet20 with GroupNorm on CIFAR-10 with DP-NSGD / DP-SGD (Yang et al. 2022, Sec. 5).

  python -m tf_dpnsgd.launch.cifar10 --flagfile=configs/cifar10/dpnsgd_eps8_step.flags \
      --data_dir=$HOME/data --model_dir=runs/c10 --export_dir=runs/c10/export

Data: tensorflow-datasets `cifar10` when online, or --data_dir pointing at (a
folder containing) the standard `cifar-10-batches-py` pickle folder. Pixels
are normalized per channel inside the model, so the exported SavedModel takes
raw 0-255 images.
"""

from __future__ import annotations

from absl import app
from absl import flags
import keras
import tensorflow as tf

from tf_dpnsgd import export as export_lib
from tf_dpnsgd import models
from tf_dpnsgd.data import cifar10 as cifar_lib
from tf_dpnsgd.launch import common

# The paper's setting: batch 1000, 100 epochs, delta 1e-5 (Sec. 5.1).
common.define_flags(optimizer="dpnsgd", learning_rate=4.0, regularizer=0.01, l2_norm_clip=1.0,
                    target_epsilon=8.0, delta=1e-5, batch_size=1000, physical_batch_size=250,
                    epochs=100, sampling="poisson", lr_schedule="step", momentum=0.0)
flags.DEFINE_string("data_dir", None, "Folder with cifar-10-batches-py (else tfds cifar10).")
flags.DEFINE_boolean("augment", False, "Random crop (4-pixel padding) + horizontal flip.")
flags.DEFINE_integer("groups", 16, "GroupNorm groups.")
flags.DEFINE_integer("max_train_examples", None, "Use only the first N training images (debug).")


def planned_dataset_size(flag_values) -> int:
  """Training-set size for these flags (used by the sweep's --dry_run)."""
  n = 50000
  if flag_values.data_dir:
    (_, y_train), _ = cifar_lib.load_cifar10(flag_values.data_dir)
    n = len(y_train)
  return min(n, flag_values.max_train_examples or n)


def pixels_to_float(dataset):
  def cast(x, y, *rest):
    return (tf.cast(x, tf.float32), y) + tuple(rest)
  return dataset.map(cast)


def main(argv):
  del argv
  cfg = common.config_from_flags()
  FLAGS = flags.FLAGS
  (x_train, y_train), (x_test, y_test) = cifar_lib.load_cifar10(FLAGS.data_dir)
  if FLAGS.max_train_examples:
    x_train, y_train = x_train[:FLAGS.max_train_examples], y_train[:FLAGS.max_train_examples]
  y_train, y_test = common.as_numpy_labels(y_train), common.as_numpy_labels(y_test)

  def build_model():
    return cifar_lib.with_normalization(models.resnet20(groups=FLAGS.groups), name="resnet20_gn")

  def augment_fn(dataset):
    dataset = pixels_to_float(dataset)
    if FLAGS.augment:
      dataset = cifar_lib.augment_dataset(dataset, seed=cfg.seed)  # None: random
    return dataset

  def export_fn(model, export_dir):
    export_lib.export_image_classifier(model, export_dir, mean=None, std=None)

  record = common.run_experiment(
      cfg, build_model, (x_train, y_train), (x_test.astype("float32"), y_test),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      export_fn=export_fn, augment_fn=augment_fn,
      extra_report={"dataset": "cifar10", "model": "resnet20_groupnorm",
                    "augment": FLAGS.augment, "groups": FLAGS.groups})
  print(f"test accuracy {record.metric('accuracy', float('nan')):.4f}; "
        f"{record.epsilon_text()} after {record.steps} steps")


if __name__ == "__main__":
  app.run(common.main_with_usage_errors(main))
