r"""MNIST with DP-NSGD / DP-SGD from a ``keras.datasets``-format ``.npz`` file.

  python -m tf_dpnsgd.launch.mnist --data_path=/path/to/mnist.npz \
      --max_train_examples=20000 --epochs=3 --model_dir=runs/mnist

--data_path: an ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test``
(uint8 ``[n, 28, 28]`` images, integer labels), the layout of
``keras.datasets.mnist.load_data``; without it, ``keras.datasets.mnist`` is
used (it downloads on first use). Pixels are scaled to [0, 1] here, so the
exported SavedModel takes raw 0-255 images.

Models: ``mlp`` (one tanh hidden layer; fast on CPU, the default) or
``convnet`` (the small tanh ConvNet of the DP-SGD MNIST baselines, with
GroupNorm; Papernot et al. 2021 use tanh for DP training). Any flag of the
experiment launchers applies (--optimizer=dpsgd --l2_norm_clip=1, ...);
``--audit_canaries=N`` audits the run (:mod:`tf_dpnsgd.launch.canary_audit`).
The sweep (``python -m tf_dpnsgd.launch.sweep --base=mnist``) uses
:func:`planned_dataset_size` for its ``--dry_run``.

The model owns its privacy plan (``make_private(model, plan=...)``) and trains
with a plain ``fit(x, y, validation_data=...)``, the one-call path
(:mod:`tf_dpnsgd.runner`); ``--distribution_strategy`` or ``--max_steps`` takes the
explicit one.
"""

from __future__ import annotations

from absl import app
from absl import flags
import keras
import numpy as np

from tf_dpnsgd import export as export_lib
from tf_dpnsgd.launch import canary_audit
from tf_dpnsgd.launch import allocator
from tf_dpnsgd.launch import common
from tf_dpnsgd.launch import logs

MNIST_TRAIN_SIZE = 60000
MODELS = ("mlp", "convnet")

common.define_flags(optimizer="dpnsgd", learning_rate=1.0, regularizer=0.01, l2_norm_clip=1.0,
                    target_epsilon=2.0, delta=1e-5, batch_size=256, epochs=3,
                    sampling="poisson", verbose=0)
flags.DEFINE_string("data_path", None, "keras.datasets-format mnist.npz (else keras download).")
flags.DEFINE_integer("max_train_examples", None,
                     "Use only the first N training images (the privacy unit is this subset).")
flags.DEFINE_integer("max_test_examples", None, "Evaluate on the first N test images only.")
flags.DEFINE_enum("model", "mlp", MODELS, "mlp: 784-H-10 tanh; convnet: small tanh GN ConvNet.")
flags.DEFINE_integer("width", 128, "Hidden units of the MLP / dense layer of the ConvNet.")
canary_audit.define_flags()


# `--help` lists the shared flags a run needs (target_epsilon, epochs, ...), not only ours.
flags.adopt_module_key_flags(common)
flags.adopt_module_key_flags(canary_audit)

def load_mnist(data_path=None, max_train_examples=None, max_test_examples=None):
  """``((x_train, y_train), (x_test, y_test))``: float32 ``[n, 28, 28, 1]`` in [0, 1], int32 labels.

  Raises:
    ValueError: the file lacks one of the four arrays, or they have the wrong shape.
  """
  if data_path:
    with np.load(data_path) as f:
      missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
      if missing:
        raise ValueError(f"{data_path} lacks {sorted(missing)} (keras.datasets.mnist layout "
                         "expected: x_train, y_train, x_test, y_test).")
      x_train, y_train, x_test, y_test = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
  else:
    (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
  x_train, y_train = x_train[:max_train_examples], y_train[:max_train_examples]
  x_test, y_test = x_test[:max_test_examples], y_test[:max_test_examples]
  for name, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    if x.ndim != 3 or len(x) != len(y):
      raise ValueError(f"MNIST {name} images must be [n, H, W] with one label each; got "
                       f"{x.shape} and {np.shape(y)}.")

  def images(x):
    return (x.astype("float32") / 255.0)[..., None]

  return ((images(x_train), common.as_numpy_labels(y_train)),
          (images(x_test), common.as_numpy_labels(y_test)))


def planned_dataset_size(flag_values) -> int:
  """The number of training examples a run with these flags uses (for sweep dry runs)."""
  n = MNIST_TRAIN_SIZE
  if flag_values.data_path:
    with np.load(flag_values.data_path) as f:
      n = len(f["y_train"])
  return min(n, flag_values.max_train_examples or n)


def mlp(input_shape=(28, 28, 1), num_classes=10, width=128):
  inputs = keras.Input(input_shape, name="image")
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(width, activation="tanh", name="hidden")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(x), name="mnist_mlp")


def convnet(input_shape=(28, 28, 1), num_classes=10, width=32):
  """16 8x8/2 conv, 32 4x4/2 conv (GroupNorm, tanh), a dense layer: ~30k parameters."""
  inputs = keras.Input(input_shape, name="image")
  x = keras.layers.Conv2D(16, 8, strides=2, padding="same")(inputs)
  x = keras.layers.GroupNormalization(groups=4)(x)
  x = keras.layers.Activation("tanh")(x)
  x = keras.layers.MaxPooling2D(2, strides=1)(x)
  x = keras.layers.Conv2D(32, 4, strides=2, padding="valid")(x)
  x = keras.layers.GroupNormalization(groups=4)(x)
  x = keras.layers.Activation("tanh")(x)
  x = keras.layers.MaxPooling2D(2, strides=1)(x)
  x = keras.layers.Flatten()(x)
  x = keras.layers.Dense(width, activation="tanh")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(x),
                     name="mnist_convnet")


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cfg = common.config_from_flags()
  train, test = load_mnist(FLAGS.data_path, FLAGS.max_train_examples, FLAGS.max_test_examples)
  print(f"mnist: {len(train[1])} train / {len(test[1])} test; {FLAGS.model}; {cfg.optimizer}",
        flush=True)
  build = {"mlp": mlp, "convnet": convnet}[FLAGS.model]

  def export_fn(model, export_dir):
    export_lib.export_image_classifier(model, export_dir, mean=(0.0,), std=(1.0,), scale=255.0)

  record, audit_block = canary_audit.run_experiment(
      cfg, canary_audit.spec_from_flags(), lambda: build(width=FLAGS.width), train, test,
      num_classes=10,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      export_fn=export_fn, print_fn=logs.print_epoch,
      extra_report={"dataset": "mnist", "model": FLAGS.model, "width": FLAGS.width})
  acc = record.metric("accuracy", float("nan"))
  print(f"final test accuracy {acc:.4f}; {record.epsilon_text()} after "
        f"{record.steps} steps", flush=True)
  canary_audit.print_audit(audit_block)


if __name__ == "__main__":
  allocator.maybe_reexec()  # tcmalloc where installed: see tf_dpnsgd.launch.allocator
  app.run(common.main_with_usage_errors(main))
