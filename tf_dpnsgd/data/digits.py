"""scikit-learn's 8x8 handwritten digits: a small dataset that ships offline.

1,797 images of 10 classes (UCI optical digits), pixel values 0..16. Used by
the offline quickstart; scikit-learn is imported only when loading.
"""

from __future__ import annotations

import numpy as np

IMAGE_SHAPE = (8, 8, 1)
NUM_CLASSES = 10
MAX_PIXEL = 16.0


def load_digits(test_fraction=0.2, seed=0):
  """Stratified, deterministic train/test split of the digits, scaled to [0, 1].

  Args:
    test_fraction: share of each class held out for testing, in (0, 1).
    seed: split seed (same seed, same split).

  Returns:
    ``((x_train, y_train), (x_test, y_test))``: images float32
    ``[n, 8, 8, 1]`` in [0, 1] (raw value / 16), labels int64 ``[n]``.
  """
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"`test_fraction` must lie in (0, 1); got {test_fraction!r}.")
  try:
    from sklearn import datasets, model_selection
  except ImportError as e:
    raise ImportError("The digits dataset ships with scikit-learn: "
                      "`pip install scikit-learn`.") from e
  digits = datasets.load_digits()
  x = (digits.images.astype(np.float32) / MAX_PIXEL)[..., None]
  y = digits.target.astype(np.int64)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=test_fraction, random_state=seed, stratify=y)
  return (x_train, y_train), (x_test, y_test)


__all__ = ["IMAGE_SHAPE", "MAX_PIXEL", "NUM_CLASSES", "load_digits"]
