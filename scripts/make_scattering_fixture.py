"""Writes tests/data/scattering_kymatio.npz: Kymatio's scattering of a few synthetic images.

The oracle for ``tests/test_scattering.py``. It runs Kymatio 0.3.0's NumPy frontend,
which is NOT a dependency of tf_dpnsgd (it needs scipy < 1.15, which still has
``sph_harm``); run it in a throwaway virtual environment:

  python3 -m venv /tmp/venv-kymatio
  /tmp/venv-kymatio/bin/pip install kymatio==0.3.0 "scipy<1.15" "numpy<2.1"
  /tmp/venv-kymatio/bin/python scripts/make_scattering_fixture.py

The inputs are generated here from a fixed seed (no dataset images). Each case
stores ``<case>_x`` (the input: uint8 ``[n, H, W, C]`` images, which the test
scales by 1/255 like ``tf_dpnsgd.models.Scattering2D``'s default) and
``<case>_s`` (Kymatio's ``Scattering2D(J, (H, W), L, max_order)`` of
``x / 255`` as float64 ``[n, C, H, W]``, an array ``[n, C, K, H', W']``
stored as float32), with ``<case>_params`` = ``[J, L, max_order]``.
"""

from __future__ import annotations

import os

import numpy as np


def synthetic_images(rng, n, height, width, channels):
  """uint8 images: uniform noise, smooth blobs on a ramp, oriented stripes in a disc."""
  rows, cols = np.mgrid[0:height, 0:width].astype(np.float64)
  images = []
  for i in range(n):
    kind = i % 3
    if kind == 0:
      img = rng.uniform(0, 255, (height, width, channels))
    elif kind == 1:
      img = np.zeros((height, width, channels)) + 40 * (rows / height)[..., None]
      for _ in range(4):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        s = rng.uniform(1.5, 5.0)
        blob = np.exp(-((rows - cy)**2 + (cols - cx)**2) / (2 * s * s))
        img += 200 * blob[..., None] * rng.uniform(0.2, 1.0, channels)
    else:
      angle = rng.uniform(0, np.pi)
      freq = rng.uniform(0.4, 1.6)
      stripes = np.cos(freq * (np.cos(angle) * rows + np.sin(angle) * cols))
      disc = ((rows - height / 2)**2 + (cols - width / 2)**2) < (min(height, width) / 3)**2
      img = (128 + 100 * stripes * disc)[..., None] * rng.uniform(0.5, 1.0, channels)
    images.append(np.clip(np.round(img), 0, 255).astype(np.uint8))
  return np.stack(images)


# (case, n images, height, width, channels, J, L, max_order)
CASES = (
    ("cifar", 3, 32, 32, 3, 2, 8, 2),    # the configuration of the models: 81 maps of 8x8
    ("j3l6", 1, 32, 24, 1, 3, 6, 2),     # non-square, J = 3 (wavelets at a coarser level)
    ("order1", 2, 16, 16, 2, 2, 4, 1),   # first order only
)


def main():
  from kymatio.numpy import Scattering2D  # the oracle; only in the throwaway venv
  rng = np.random.default_rng(20210222)
  arrays = {}
  for case, n, height, width, channels, J, L, max_order in CASES:
    x = synthetic_images(rng, n, height, width, channels)
    scattering = Scattering2D(J=J, shape=(height, width), L=L, max_order=max_order)
    s = scattering(np.transpose(x, (0, 3, 1, 2)).astype(np.float64) / 255.0)
    arrays[f"{case}_x"] = x
    arrays[f"{case}_s"] = s.astype(np.float32)
    arrays[f"{case}_params"] = np.array([J, L, max_order])
    print(case, x.shape, "->", s.shape)
  path = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "data",
                      "scattering_kymatio.npz")
  np.savez_compressed(path, **arrays)
  print("wrote", os.path.normpath(path), os.path.getsize(path), "bytes")


if __name__ == "__main__":
  main()
