"""CIFAR-10 from an image folder (<root>/{train,test}/<class>/*.png|jpg) and the array cache."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd.data import cache
from tf_dpnsgd.data import cifar10


def write_image_folder(root, per_class=(3, 2), classes=cifar10.CLASS_NAMES, seed=0,
                       fmt="png"):
  """Writes random 32x32 RGB images; returns {split: [(class index, file name, image)]}."""
  rng = np.random.default_rng(seed)
  written = {}
  for split, count in zip(cifar10.SPLITS, per_class):
    written[split] = []
    for label, name in enumerate(sorted(classes)):
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        if fmt == "png":
          image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        else:  # smooth (JPEG is lossy, and worst on noise): a colour ramp
          ramp = np.linspace(0.0, 1.0, 32)[:, None, None] * rng.uniform(-100, 100, 3)
          image = np.broadcast_to(rng.uniform(100, 150, 3) + ramp, (32, 32, 3)).astype(np.uint8)
        encoded = (tf.io.encode_png(image) if fmt == "png"
                   else tf.io.encode_jpeg(image, quality=95))
        file_name = f"{i:04d}.{fmt}"
        tf.io.write_file(os.path.join(folder, file_name), encoded)
        written[split].append((label, file_name, image))
  return written


def test_png_folder_loads_exactly_with_alphabetical_labels(tmp_path):
  written = write_image_folder(tmp_path)
  (x_train, y_train), (x_test, y_test) = cifar10.load_cifar10(tmp_path)
  assert x_train.shape == (30, 32, 32, 3) and x_train.dtype == np.uint8
  assert x_test.shape == (20, 32, 32, 3) and y_train.dtype == np.int64
  for (x, y), split in (((x_train, y_train), "train"), ((x_test, y_test), "test")):
    # Round-robin over classes: first image of each class, then the second, ...
    expected = sorted(written[split], key=lambda item: (item[1], item[0]))
    np.testing.assert_array_equal(y, [label for label, _, _ in expected])
    np.testing.assert_array_equal(x, np.stack([image for _, _, image in expected]))
  # CIFAR-10's class names in alphabetical order are its label order.
  assert list(cifar10.CLASS_NAMES) == sorted(cifar10.CLASS_NAMES)
  assert list(y_train[:10]) == list(range(10))  # a prefix is class-balanced
  assert cifar10.count_images(tmp_path, "train") == 30


def test_jpeg_greyscale_and_extensions(tmp_path):
  written = write_image_folder(tmp_path, fmt="jpg")
  # An upper-case .JPEG and a greyscale PNG in another class; a stray text file is ignored.
  grey = np.arange(32 * 32, dtype=np.uint8).reshape(32, 32, 1)
  tf.io.write_file(str(tmp_path / "train" / "cat" / "zz.PNG"), tf.io.encode_png(grey))
  tf.io.write_file(str(tmp_path / "train" / "dog" / "zz.JPEG"),
                   tf.io.encode_jpeg(np.full([32, 32, 3], 200, np.uint8)))
  (tmp_path / "train" / "dog" / "notes.txt").write_text("not an image")
  (x_train, y_train), _ = cifar10.load_cifar10(tmp_path)
  assert len(x_train) == 32
  first = {label: image for label, name, image in written["train"] if name == "0000.jpg"}
  for label in range(10):  # JPEG is lossy: close, not equal
    assert np.abs(x_train[label].astype(int) - first[label]).mean() < 2
  cat, dog = cifar10.CLASS_NAMES.index("cat"), cifar10.CLASS_NAMES.index("dog")
  # zz.* sort after 0000-0002: the fourth image of their class, the last rows.
  assert list(y_train[-2:]) == [cat, dog]
  np.testing.assert_array_equal(x_train[-2], np.repeat(grey, 3, axis=-1))
  assert np.abs(x_train[-1].astype(int) - 200).max() <= 2


def test_wrong_image_size_is_named(tmp_path):
  write_image_folder(tmp_path)
  bad = tmp_path / "test" / "ship" / "big.png"
  tf.io.write_file(str(bad), tf.io.encode_png(np.zeros([28, 28, 3], np.uint8)))
  with pytest.raises(ValueError, match=r"big\.png.*\(28, 28, 3\).*32x32"):
    cifar10.load_cifar10(tmp_path)


@pytest.mark.parametrize("damage, error, message", [
    ("rename_test_class", ValueError, "different class folders"),
    ("nine_classes", ValueError, "9 class folders"),
    ("empty_class", FileNotFoundError, "holds no"),
])
def test_inconsistent_folders_are_refused(tmp_path, damage, error, message):
  classes = cifar10.CLASS_NAMES[:9] if damage == "nine_classes" else cifar10.CLASS_NAMES
  write_image_folder(tmp_path, classes=classes)
  if damage == "rename_test_class":
    os.rename(tmp_path / "test" / "truck", tmp_path / "test" / "lorry")
  if damage == "empty_class":
    for f in os.listdir(tmp_path / "train" / "frog"):
      os.remove(tmp_path / "train" / "frog" / f)
  with pytest.raises(error, match=message):
    cifar10.load_cifar10(tmp_path)


def test_pickled_layout_still_wins_when_no_train_test_folders(tmp_path):
  import fixtures
  _, ((x_train, _), _) = fixtures.write_cifar10_batches(tmp_path, images_per_batch=4)
  assert not cifar10.is_image_folder(tmp_path)
  (a_train, _), _ = cifar10.load_cifar10(tmp_path)
  np.testing.assert_array_equal(a_train, x_train)


def test_image_folder_cache_is_keyed_by_the_files(tmp_path, monkeypatch):
  write_image_folder(tmp_path / "data")
  cache_dir = tmp_path / "cache"
  first = cifar10.load_cifar10(tmp_path / "data", cache_dir=cache_dir)
  assert len(os.listdir(cache_dir)) == 1
  calls = []
  real = cifar10.read_image_folder
  monkeypatch.setattr(cifar10, "read_image_folder",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  second = cifar10.load_cifar10(tmp_path / "data", cache_dir=cache_dir)
  assert not calls  # served from the cache
  for a, b in zip(tf.nest.flatten(first), tf.nest.flatten(second)):
    np.testing.assert_array_equal(a, b)
  # One changed image: a new key, decoded again, and the new pixels returned.
  path = tmp_path / "data" / "train" / "bird" / "0001.png"
  tf.io.write_file(str(path), tf.io.encode_png(np.full([32, 32, 3], 7, np.uint8)))
  (x_train, y_train), _ = cifar10.load_cifar10(tmp_path / "data", cache_dir=cache_dir)
  assert calls == [1] and len(os.listdir(cache_dir)) == 2
  bird = cifar10.CLASS_NAMES.index("bird")
  assert (x_train[10 + bird] == 7).all() and y_train[10 + bird] == bird


def test_digest_sees_dtype_shape_values_and_settings():
  a = np.arange(6, dtype=np.int32)
  base = cache.digest(a, settings={"k": 1})
  assert cache.digest(a.copy(), settings={"k": 1}) == base
  for other in (cache.digest(a.astype(np.int64), settings={"k": 1}),
                cache.digest(a.reshape(2, 3), settings={"k": 1}),
                cache.digest(a + (np.arange(6) == 5), settings={"k": 1}),
                cache.digest(a, settings={"k": 2})):
    assert other != base


def test_cached_writes_once_and_leaves_no_partial_entry(tmp_path):
  calls = []

  def compute():
    calls.append(1)
    return np.ones(3), np.zeros((2, 2))

  out, hit = cache.cached(tmp_path, "x", "abc", ("a", "b"), compute)
  assert not hit and calls == [1]
  again, hit = cache.cached(tmp_path, "x", "abc", ("a", "b"), compute)
  assert hit and calls == [1]
  np.testing.assert_array_equal(again[1], np.zeros((2, 2)))

  def failing():
    raise RuntimeError("interrupted")

  with pytest.raises(RuntimeError):
    cache.cached(tmp_path, "x", "def", ("a",), failing)
  assert sorted(os.listdir(tmp_path)) == ["x-abc"]
  with pytest.raises(ValueError, match="2 arrays"):
    cache.cached(tmp_path, "x", "ghi", ("a",), compute)
  out, hit = cache.cached(None, "x", "abc", ("a", "b"), compute)  # no cache: computed
  assert not hit and calls == [1, 1, 1]
