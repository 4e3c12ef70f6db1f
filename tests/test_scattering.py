"""Scattering2D against Kymatio's output (a committed oracle fixture) and closed forms.

The fixture ``tests/data/scattering_kymatio.npz`` holds Kymatio 0.3.0's NumPy
scattering of synthetic images (regenerate with ``scripts/make_scattering_fixture.py``
in a throwaway venv; Kymatio is not a dependency). The other tests need no oracle:
the filters against their spectra in closed form (Poisson summation of the
Gaussian's Fourier transform), constant images, plane waves and translations.
"""

import math
import os

import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd.models import scattering as sc
import tiers

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "scattering_kymatio.npz")


def _kymatio_layout(y, channels, h, w):
  """Our channels-last ``[n, h, w, C K]`` -> Kymatio's ``[n, C, K, h, w]``."""
  y = np.asarray(y)
  return y.reshape(len(y), h, w, channels, -1).transpose(0, 3, 4, 1, 2)


@pytest.mark.parametrize("case,jit_compile", tiers.quick_cover(["cifar", "j3l6", "order1"],
                                                               [True, False]))
def test_matches_kymatio(case, jit_compile):
  data = np.load(FIXTURE)
  x, expected = data[f"{case}_x"], data[f"{case}_s"].astype(np.float64)
  J, L, max_order = (int(v) for v in data[f"{case}_params"])
  layer = sc.Scattering2D(J=J, L=L, max_order=max_order, jit_compile=jit_compile)
  n, height, width, channels = x.shape
  got = _kymatio_layout(layer(x), channels, height // 2**J, width // 2**J)
  assert got.shape == expected.shape
  # Every path to float32 precision relative to its own magnitude (order-2 paths are
  # about 100 times smaller than order 0, so a global tolerance would hide them).
  scale = np.abs(expected).max(axis=(0, 1, 3, 4), keepdims=True)
  assert np.all(scale > 0)
  ratio = np.abs(got - expected) / (scale + 1e-12)
  assert ratio.max() < 2e-5, f"worst relative error {ratio.max():.2e}"


def test_cifar_configuration_has_81_maps_of_8x8_per_channel():
  layer = sc.Scattering2D(J=2, L=8)
  out = layer(np.zeros([2, 32, 32, 3], np.uint8))
  assert tuple(out.shape) == (2, 8, 8, 243)
  assert layer.channels_per_input == 81 == sc.num_channels(2, 8, 2)
  assert layer.compute_output_shape((None, 32, 32, 3)) == (None, 8, 8, 243)
  assert not layer.weights and not layer.trainable_weights


def _gaussian_spectrum(M, N, sigma, theta, xi, slant, periods=4):
  """DFT of the periodized Gabor ``exp(-u^T A u + i xi e_theta . u) / (2 3.1415 sigma^2 /
  slant)`` by Poisson summation: sum over k of its Fourier transform at
  ``omega + 2 pi k``, ``pi / sqrt(det A) exp(-(w - xi e)^T A^-1 (w - xi e) / 4)``."""
  rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
  a = rot @ np.diag([1.0, slant**2]) @ rot.T / (2 * sigma**2)
  a_inv = np.linalg.inv(a)
  center = xi * np.array([math.cos(theta), math.sin(theta)])
  w1 = 2 * math.pi * np.arange(M)[:, None, None, None] / M
  w2 = 2 * math.pi * np.arange(N)[None, :, None, None] / N
  k = 2 * math.pi * np.arange(-periods, periods + 1)
  d1 = w1 + k[None, None, :, None] - center[0]
  d2 = w2 + k[None, None, None, :] - center[1]
  quad = a_inv[0, 0] * d1**2 + 2 * a_inv[0, 1] * d1 * d2 + a_inv[1, 1] * d2**2
  total = (math.pi / math.sqrt(np.linalg.det(a)) * np.exp(-quad / 4)).sum(axis=(2, 3))
  return total / (2 * 3.1415 * sigma**2 / slant)


def test_filters_match_their_closed_form_spectra():
  M, N, J, L = 40, 40, 2, 8
  bank = sc.filter_bank(M, N, J, L)
  for j in range(J):
    sigma, xi, slant = 0.8 * 2**j, 0.75 * math.pi / 2**j, 4.0 / L
    for t in range(L):
      theta = (L // 2 - 1 - t) * math.pi / L
      wave = _gaussian_spectrum(M, N, sigma, theta, xi, slant)
      envelope = _gaussian_spectrum(M, N, sigma, theta, 0.0, slant)
      expected = wave - wave[0, 0] / envelope[0, 0] * envelope  # zero mean: psi_hat(0) = 0
      np.testing.assert_allclose(bank["psi"][(j, 0)][t], expected, atol=1e-10)
      assert abs(bank["psi"][(j, 0)][t][0, 0]) < 1e-12
  phi = _gaussian_spectrum(M, N, 0.8 * 2**(J - 1), 0.0, 0.0, 1.0)
  np.testing.assert_allclose(bank["phi"][0], phi, atol=1e-10)
  # phi_hat(0) = integral of the Gaussian / its normalization = pi / 3.1415 (Kymatio's pi).
  assert bank["phi"][0][0, 0] == pytest.approx(math.pi / 3.1415, abs=1e-9)


def test_coarser_filter_levels_keep_the_low_band():
  M = N = 48
  bank = sc.filter_bank(M, N, J=3, L=4)
  # Resolution 1: frequency u in (-M/4, M/4) of the full grid lands at u mod M/2.
  low = np.r_[0:M // 4, 3 * M // 4:M]
  for coarse, full in ((bank["phi"][1], bank["phi"][0]),
                       (bank["psi"][(1, 1)][2], bank["psi"][(1, 0)][2])):
    assert coarse.shape == (M // 2, N // 2)
    np.testing.assert_array_equal(coarse, full[np.ix_(low, low)])


def test_constant_image_gives_its_mean_and_no_wavelet_energy():
  c = 0.37
  out = sc.Scattering2D(scale=1.0)(np.full([1, 32, 32, 2], c, np.float32)).numpy()
  out = _kymatio_layout(out, 2, 8, 8)
  np.testing.assert_allclose(out[:, :, 0], c * math.pi / 3.1415, rtol=1e-5)
  # Morlet wavelets have zero mean, so |c * psi| = 0 on a constant (reflect-padded) image.
  assert np.abs(out[:, :, 1:]).max() < 1e-6 * c


def test_positive_homogeneity_and_sign_invariance():
  x = np.random.default_rng(0).normal(size=[2, 16, 16, 1]).astype(np.float32)
  layer = sc.Scattering2D(J=2, L=4, scale=1.0)
  base = layer(x).numpy()
  np.testing.assert_allclose(layer(3.0 * x).numpy(), 3.0 * base, rtol=1e-4, atol=1e-6)
  flipped = layer(-x).numpy()
  np.testing.assert_allclose(flipped[..., 0], -base[..., 0], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(flipped[..., 1:], base[..., 1:], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("t", tiers.quick_only(range(8), [0, 3]))  # quick: two of 8 (issue 47)
def test_plane_wave_excites_the_wavelet_of_its_orientation(t):
  theta = (3 - t) * math.pi / 8  # Kymatio's angle of wavelet t (L = 8)
  rows, cols = np.mgrid[0:32, 0:32]
  wave = np.cos(0.75 * math.pi * (math.cos(theta) * rows + math.sin(theta) * cols))
  out = _kymatio_layout(sc.Scattering2D(scale=1.0)(wave[None, :, :, None].astype(np.float32)),
                        1, 8, 8)
  energy = out[0, 0, 1:9, 2:6, 2:6].mean(axis=(1, 2))  # first order, j = 0, interior
  assert int(np.argmax(energy)) == t
  assert energy[t] > 1.5 * np.sort(energy)[-2]


def test_translation_by_the_subsampling_step_shifts_the_maps():
  rows, cols = np.mgrid[0:32, 0:32]

  def blob(cy, cx):
    return np.exp(-((rows - cy)**2 + (cols - cx)**2) / 8.0)[None, :, :, None]

  layer = sc.Scattering2D(scale=1.0)
  a = layer(blob(12.3, 13.1).astype(np.float32)).numpy()[0]
  b = layer(blob(16.3, 17.1).astype(np.float32)).numpy()[0]  # moved by 2^J = 4 pixels
  # Output pixel (p, q) of a equals (p + 1, q + 1) of b, for every path.
  # float32 FFTs: errors of a few 1e-6 of the largest coefficient; a wrong shift would
  # err by about the size of each path (order 2: about 1e-2 of the largest).
  assert np.abs(b[1:, 1:] - a[:-1, :-1]).max() < 2e-5 * np.abs(a).max()
  assert np.abs(b[1:, 1:] - a[1:, 1:]).max() > 0.1 * np.abs(a).max()  # not trivially equal


@pytest.mark.slow
def test_channels_are_colour_major_and_independent():
  x = np.random.default_rng(1).uniform(0, 255, [1, 32, 32, 3]).astype(np.float32)
  layer = sc.Scattering2D()
  full = layer(x).numpy()
  for c in range(3):
    alone = sc.Scattering2D()(x[..., c:c + 1]).numpy()
    np.testing.assert_allclose(full[..., 81 * c:81 * (c + 1)], alone, rtol=1e-5, atol=1e-7)


def test_chunked_transform_equals_the_whole_batch():
  x = np.random.default_rng(2).uniform(0, 255, [5, 16, 16, 3]).astype(np.float32)
  whole = sc.Scattering2D(J=2, L=4)(x).numpy()
  chunked = sc.Scattering2D(J=2, L=4, chunk_size=4)(x).numpy()  # 15 planes: 4 chunks
  np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-8)


def test_config_round_trip_and_use_in_a_model():
  layer = sc.Scattering2D(J=2, L=4, max_order=1, scale=0.5, chunk_size=8, jit_compile=False)
  clone = sc.Scattering2D.from_config(layer.get_config())
  x = np.random.default_rng(3).uniform(0, 1, [2, 16, 16, 1]).astype(np.float32)
  np.testing.assert_array_equal(clone(x).numpy(), layer(x).numpy())
  inputs = tf.keras.Input([16, 16, 1])
  model = tf.keras.Model(inputs, sc.Scattering2D(J=2, L=4)(inputs))
  assert model.output_shape == (None, 4, 4, 25)  # 1 + 2 * 4 + 4 * 4 (order 2)


@pytest.mark.parametrize("kwargs, shape, message", [
    ({"J": 0}, None, "`J`"),
    ({"L": 0}, None, "`L`"),
    ({"max_order": 3}, None, "`max_order`"),
    ({"chunk_size": 0}, None, "`chunk_size`"),
    ({}, [1, 30, 32, 3], r"multiples of 2\^J"),
    ({}, [1, 32, 32], "images"),
])
def test_refuses_bad_arguments(kwargs, shape, message):
  with pytest.raises(ValueError, match=message):
    layer = sc.Scattering2D(**kwargs)
    layer(np.zeros(shape, np.float32))
