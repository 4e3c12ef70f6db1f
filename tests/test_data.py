"""Loaders on tiny data written in the real on-disk formats; tfds via mock_data."""

import os
import pickle
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import fixtures
from tf_dpnsgd.data import cifar10, digits, glue


# --- CIFAR-10: local layout ------------------------------------------------------
@pytest.mark.parametrize("subfolder", [True, False])
def test_load_cifar10_reads_written_batches(tmp_path, subfolder):
  _, ((x_train, y_train), (x_test, y_test)) = fixtures.write_cifar10_batches(
      tmp_path, images_per_batch=20, subfolder=subfolder)
  (a_train, b_train), (a_test, b_test) = cifar10.load_cifar10(tmp_path)
  assert a_train.shape == (100, 32, 32, 3) and a_train.dtype == np.uint8
  assert a_test.shape == (20, 32, 32, 3) and b_test.dtype == np.int64
  np.testing.assert_array_equal(a_train, x_train)
  np.testing.assert_array_equal(b_train, y_train)
  np.testing.assert_array_equal(a_test, x_test)
  np.testing.assert_array_equal(b_test, y_test)


def test_cifar_rows_are_channel_major(tmp_path):
  path = tmp_path / "data_batch_1"
  row = np.zeros(3072, np.uint8)
  row[:1024] = 255  # the first 1024 values are the red plane
  row[1024 + 33] = 7  # green, pixel (1, 1)
  with open(path, "wb") as f:
    pickle.dump({b"data": row[None], b"labels": [3]}, f, protocol=2)
  images, labels = cifar10.read_batch(path)
  assert images.shape == (1, 32, 32, 3)
  assert (images[0, :, :, 0] == 255).all()
  assert images[0, 1, 1, 1] == 7 and images[0, :, :, 1].sum() == 7
  assert (images[0, :, :, 2] == 0).all()
  np.testing.assert_array_equal(labels, [3])


def test_cifar_missing_layout_names_it(tmp_path):
  fixtures.write_cifar10_batches(tmp_path)
  os.remove(tmp_path / "cifar-10-batches-py" / "test_batch")
  with pytest.raises(FileNotFoundError) as info:
    cifar10.load_cifar10(tmp_path)
  message = str(info.value)
  for expected in ("missing: test_batch", "cifar-10-batches-py", "data_batch_1",
                   cifar10.CIFAR10_URL):
    assert expected in message


def test_cifar_bad_batch_is_rejected(tmp_path):
  path = tmp_path / "batch"
  with open(path, "wb") as f:
    pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
  with pytest.raises(ValueError, match=r"uint8 \[n, 3072\]"):
    cifar10.read_batch(path)
  with open(path, "wb") as f:
    pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}, f)
  with pytest.raises(ValueError, match="0..9"):
    cifar10.read_batch(path)


class _RunsCode:
  def __reduce__(self):
    return (os.getcwd, ())


def test_cifar_pickle_cannot_run_code(tmp_path):
  path = tmp_path / "data_batch_1"
  with open(path, "wb") as f:
    pickle.dump({b"data": _RunsCode(), b"labels": []}, f)
  with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
    cifar10.read_batch(path)


# --- CIFAR-10: tensorflow-datasets ---------------------------------------------------
def test_load_cifar10_from_tfds_mock():
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=6):
    (x_train, y_train), (x_test, y_test) = cifar10.load_cifar10()
  assert x_train.shape == (6, 32, 32, 3) and x_train.dtype == np.uint8
  assert x_test.shape == (6, 32, 32, 3)
  assert y_train.dtype == np.int64 and set(y_train.tolist()) <= set(range(10))


def test_cifar_no_data_no_network_names_layout(monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")

  def offline(*args, **kwargs):
    raise ConnectionError("Failed to resolve 'www.cs.toronto.edu'")

  monkeypatch.setattr(tfds, "load", offline)
  with pytest.raises(FileNotFoundError) as info:
    cifar10.load_cifar10()
  message = str(info.value)
  assert "ConnectionError" in message and "cifar-10-batches-py" in message
  assert cifar10.CIFAR10_URL in message and "data_dir=" in message
  assert isinstance(info.value.__cause__, ConnectionError)


def test_cifar_without_tfds_names_layout(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
  with pytest.raises(FileNotFoundError, match="ModuleNotFoundError.*cifar-10-batches-py"):
    cifar10.load_cifar10()


# --- CIFAR-10: normalization -------------------------------------------------------------
def test_normalize_maps_mean_to_zero_and_one_std_to_one():
  mean, std = np.array(cifar10.CIFAR10_MEAN), np.array(cifar10.CIFAR10_STD)
  pixels = np.stack([255 * mean, 255 * (mean + std), np.zeros(3)])  # [3 pixels, 3 channels]
  out = np.asarray(cifar10.normalize(pixels))
  np.testing.assert_allclose(out[0], [0.0, 0.0, 0.0], atol=1e-5)
  np.testing.assert_allclose(out[1], [1.0, 1.0, 1.0], atol=1e-5)
  np.testing.assert_allclose(out[2], -mean / std, rtol=1e-6)


def test_channel_stats_oracle():
  images = np.zeros((4, 2, 2, 3), np.uint8)
  images[:2, ..., 0] = 255  # channel 0: half 0, half 255 -> mean 0.5, std 0.5
  images[..., 1] = 51  # channel 1: constant 0.2 -> std 0
  mean, std = cifar10.channel_stats(images, chunk=3)
  np.testing.assert_allclose(mean, [0.5, 0.2, 0.0])
  np.testing.assert_allclose(std, [0.5, 0.0, 0.0], atol=1e-7)


def test_pixel_normalization_layer_round_trip_and_with_normalization():
  layer = cifar10.PixelNormalization(mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0), scale=255.0)
  clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
  assert isinstance(clone, cifar10.PixelNormalization)
  assert clone.get_config() == layer.get_config()
  x = np.array([[[[255, 0, 255]]]], np.uint8)
  np.testing.assert_allclose(np.asarray(clone(x)), [[[[1.0, -1.0, 1.0]]]])

  model = fixtures.tiny_image_model()
  raw = cifar10.with_normalization(model)
  images = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3)).astype(np.float32)
  np.testing.assert_allclose(raw.predict(images, verbose=0),
                             model.predict(np.asarray(cifar10.normalize(images)), verbose=0),
                             rtol=1e-5, atol=1e-6)
  assert raw.count_params() == model.count_params()


# --- CIFAR-10: augmentation --------------------------------------------------------------
def _crop_flip_candidates(image, padding=4):
  padded = np.pad(image, [(padding, padding), (padding, padding), (0, 0)])
  h, w = image.shape[:2]
  for dy in range(2 * padding + 1):
    for dx in range(2 * padding + 1):
      window = padded[dy:dy + h, dx:dx + w]
      yield window
      yield window[:, ::-1]


def test_random_crop_flip_is_a_padded_window_and_seeded():
  image = np.random.default_rng(1).integers(1, 256, (32, 32, 3)).astype(np.uint8)
  out = cifar10.random_crop_flip(image, seed=[3, 4]).numpy()
  assert out.dtype == np.uint8 and out.shape == image.shape
  assert any((out == c).all() for c in _crop_flip_candidates(image))
  np.testing.assert_array_equal(out, cifar10.random_crop_flip(image, seed=[3, 4]).numpy())
  outs = {cifar10.random_crop_flip(image, seed=[s, 0]).numpy().tobytes() for s in range(8)}
  assert len(outs) > 1


def test_random_crop_flip_batch_draws_per_image():
  image = np.random.default_rng(2).integers(1, 256, (8, 8, 1)).astype(np.uint8)
  batch = np.repeat(image[None], 16, axis=0)
  out = cifar10.random_crop_flip(batch, seed=[0, 1], padding=2).numpy()
  assert out.shape == batch.shape
  for o in out:
    assert any((o == c).all() for c in _crop_flip_candidates(image, padding=2))
  assert len({o.tobytes() for o in out}) > 1


def test_augment_dataset_is_deterministic_and_varies_per_epoch():
  images = np.random.default_rng(3).integers(1, 256, (4, 8, 8, 3)).astype(np.uint8)
  labels = np.arange(4)

  def epochs(seed):
    ds = cifar10.augment_dataset(tf.data.Dataset.from_tensor_slices((images, labels)), seed)
    return [[(x.numpy(), y.numpy()) for x, y in ds] for _ in range(2)]

  first, again = epochs(7), epochs(7)
  for e1, e2 in zip(first, again):
    for (x1, y1), (x2, y2) in zip(e1, e2):
      np.testing.assert_array_equal(x1, x2)
      assert y1 == y2
  assert [y for _, y in first[0]] == labels.tolist()
  assert any((a[0] != b[0]).any() for a, b in zip(first[0], first[1]))


# --- SST-2 ------------------------------------------------------------------------------
@pytest.mark.parametrize("subfolder", [True, False])
def test_load_sst2_reads_glue_tsv(tmp_path, subfolder):
  _, train, dev = fixtures.write_sst2_tsv(tmp_path, subfolder=subfolder)
  x_train, y_train, x_dev, y_dev = glue.load_sst2(tmp_path)
  assert x_train == [s for s, _ in train] and x_dev == [s for s, _ in dev]
  assert y_train.dtype == np.int64
  np.testing.assert_array_equal(y_train, [l for _, l in train])
  np.testing.assert_array_equal(y_dev, [1, 0, 1])
  assert x_dev[2] == 'it is " not " so bad'  # quotes are text, not CSV quoting


def test_sst2_missing_layout_names_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"SST-2/train.tsv.*SST-2/dev.tsv"):
    glue.load_sst2(tmp_path)


def test_sst2_malformed_files_name_file_and_line(tmp_path):
  fixtures.write_sst2_tsv(tmp_path, train=[("fine", 1), ("broken", "x")])
  with pytest.raises(ValueError, match=r"train.tsv:3: label 'x' is not an integer"):
    glue.load_sst2(tmp_path)
  fixtures.write_sst2_tsv(tmp_path, train=[("fine", 1), ("three", 2)])
  with pytest.raises(ValueError, match=r"train labels must be 0 or 1; found \[2\]"):
    glue.load_sst2(tmp_path)
  folder, _, _ = fixtures.write_sst2_tsv(tmp_path)
  dev = os.path.join(folder, "dev.tsv")
  with open(dev, "w") as f:
    f.write("text\tlabel\nhello\t1\n")
  with pytest.raises(ValueError, match="header must name 'sentence' and 'label'"):
    glue.load_sst2(folder)
  with open(dev, "w") as f:
    f.write("sentence\tlabel\ntoo\tmany\tfields\n")
  with pytest.raises(ValueError, match="dev.tsv:2: 3 tab-separated fields"):
    glue.load_sst2(folder)


def test_load_sst2_from_tfds_mock():
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=5):
    x_train, y_train, x_dev, y_dev = glue.load_sst2()
  assert len(x_train) == 5 and len(x_dev) == 5
  assert all(isinstance(s, str) for s in x_train + x_dev)
  assert y_train.dtype == np.int64 and set(y_dev.tolist()) <= {0, 1}


def test_sst2_no_data_no_network_names_layout(monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")

  def offline(*args, **kwargs):
    raise ConnectionError("offline")

  monkeypatch.setattr(tfds, "load", offline)
  with pytest.raises(FileNotFoundError, match=r"glue/sst2.*SST-2/train.tsv.*SST-2.zip"):
    glue.load_sst2()


# --- digits -------------------------------------------------------------------------------
def test_load_digits_is_a_deterministic_stratified_split():
  pytest.importorskip("sklearn")
  (x_train, y_train), (x_test, y_test) = digits.load_digits(test_fraction=0.2, seed=0)
  assert x_train.shape[1:] == (8, 8, 1) and x_train.dtype == np.float32
  assert len(x_train) + len(x_test) == 1797 and len(x_test) == 360
  assert 0.0 <= x_train.min() and x_train.max() <= 1.0 and x_train.max() == 1.0
  counts = np.bincount(np.concatenate([y_train, y_test]), minlength=10)
  np.testing.assert_allclose(np.bincount(y_test, minlength=10), 0.2 * counts, atol=1)
  (x_again, _), _ = digits.load_digits(test_fraction=0.2, seed=0)
  np.testing.assert_array_equal(x_again, x_train)
  (x_other, _), _ = digits.load_digits(test_fraction=0.2, seed=1)
  assert not np.array_equal(x_other, x_train)
  with pytest.raises(ValueError, match="test_fraction"):
    digits.load_digits(test_fraction=1.0)
