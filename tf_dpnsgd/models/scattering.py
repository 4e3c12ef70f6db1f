"""The 2-D wavelet scattering transform (Morlet filters) as a weightless Keras layer.

A scattering network (Bruna and Mallat 2013) is a fixed, public feature
extractor: cascades of wavelet convolutions and complex moduli, averaged by a
low-pass filter. Tramer and Boneh (ICLR 2021, "Differentially Private
Learning Needs Better Features") train a DP linear model or a small CNN on
its features. :class:`Scattering2D` computes the transform of Kymatio
(Andreux et al. 2020, ``kymatio.Scattering2D(J, shape, L, max_order)``)
in TensorFlow, so it runs inside an exported SavedModel on raw pixels.

With ``J=2, L=8, max_order=2`` a 32x32 image gives, per colour channel,
``1 + J L + L^2 J (J - 1) / 2 = 81`` maps of ``8 x 8`` (``32 / 2^J``):

* order 0: ``x * phi_J`` subsampled by ``2^J`` (1 map);
* order 1: ``|x * psi_{j1,t1}| * phi_J`` (``J L`` maps, ``j1`` major, angle minor);
* order 2: ``||x * psi_{j1,t1}| * psi_{j2,t2}| * phi_J`` for ``j1 < j2``
  (``L^2 J (J-1) / 2`` maps, ordered by ``(j1, t1, j2, t2)``).

The algorithm follows Kymatio 0.3 exactly (the test compares both):
reflect padding to a multiple of ``2^J`` with at least ``2^J`` extra pixels,
convolutions as products in the Fourier domain with filters built on the
padded grid, subsampling by periodizing the spectrum, and a one-pixel crop
of the output. Everything is float32 / complex64 at run time; the filters
are built in float64 with NumPy and become constants of the graph.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

# Kymatio's Gabor normalisation divides by 2 * 3.1415 * sigma^2 / slant (not pi); we
# keep its constant so that the features agree with Kymatio's to float32 precision.
KYMATIO_PI = 3.1415


# --- filters (NumPy, float64) --------------------------------------------------
def padded_size(size: int, J: int) -> int:
  """Kymatio's padded length of a side of ``size`` pixels:
  ``((size + 2^J) // 2^J + 1) * 2^J`` (32 -> 40 for ``J = 2``)."""
  return ((size + 2**J) // 2**J + 1) * 2**J


def gabor_2d(M: int, N: int, sigma: float, theta: float, xi: float,
             slant: float = 1.0) -> np.ndarray:
  """A Gabor filter on the periodic ``M x N`` grid, in space (complex128).

  ``g(u) = exp(-u^T A u + i xi (cos theta, sin theta) . u) / (2 pi' sigma^2 / slant)``
  with ``A = R_theta diag(1, slant^2) R_theta^T / (2 sigma^2)`` and
  ``pi' = 3.1415`` (:data:`KYMATIO_PI`), summed over the 5 x 5 nearest
  periods (``u + (a M, b N)``, ``a, b`` in ``-2..2``). ``u`` is (row, column).

  Returns:
    ``[M, N]`` complex array.
  """
  cos, sin = math.cos(theta), math.sin(theta)
  rot = np.array([[cos, -sin], [sin, cos]])
  curv = rot @ np.diag([1.0, slant * slant]) @ rot.T / (2.0 * sigma * sigma)
  rows = np.arange(M)[:, None, None] + M * np.arange(-2, 3)[None, None, :]  # [M, 1, 5]
  cols = np.arange(N)[None, :, None] + N * np.arange(-2, 3)[None, None, :]  # [1, N, 5]
  rows, cols = rows[..., :, None], cols[..., None, :]  # [M, 1, 5, 1], [1, N, 1, 5]
  quad = curv[0, 0] * rows**2 + (curv[0, 1] + curv[1, 0]) * rows * cols + curv[1, 1] * cols**2
  phase = xi * (cos * rows + sin * cols)
  gab = np.exp(-quad + 1j * phase).sum(axis=(2, 3))
  return gab / (2.0 * KYMATIO_PI * sigma * sigma / slant)


def morlet_2d(M: int, N: int, sigma: float, theta: float, xi: float,
              slant: float = 0.5) -> np.ndarray:
  """A Morlet wavelet: a Gabor filter minus its envelope times the constant that makes
  the sum over the grid exactly zero (complex128 ``[M, N]``, in space)."""
  wave = gabor_2d(M, N, sigma, theta, xi, slant)
  envelope = gabor_2d(M, N, sigma, theta, 0.0, slant)
  return wave - (wave.sum() / envelope.sum()) * envelope


def periodize_filter(x: np.ndarray, res: int) -> np.ndarray:
  """The spectrum ``x`` ``[M, N]`` of a filter restricted to a grid ``2^res`` times coarser.

  Frequencies in the middle band of each axis (``M/2^(res+1)`` to
  ``M - M/2^(res+1)``, those above the coarse grid's Nyquist band) are zeroed,
  then the spectrum is folded (aliases summed) onto ``[M / 2^res, N / 2^res]``.
  ``res = 0`` returns ``x``.
  """
  M, N = x.shape
  k = 2**res
  if res:
    x = x.copy()
    x[M // (2 * k):M // (2 * k) + int(M * (1 - 1 / k)), :] = 0
    x[:, N // (2 * k):N // (2 * k) + int(N * (1 - 1 / k))] = 0
  return x.reshape(k, M // k, k, N // k).sum(axis=(0, 2))


def filter_bank(M: int, N: int, J: int, L: int = 8) -> dict:
  """Kymatio's Morlet filter bank on the (padded) ``M x N`` grid, in the Fourier domain.

  Wavelet ``(j, t)``: ``sigma = 0.8 * 2^j``, ``xi = 3 pi / (4 * 2^j)``,
  ``slant = 4 / L``, angle ``(L/2 - 1 - t) pi / L`` (Kymatio's order of angles).
  Low-pass: a Gaussian with ``sigma = 0.8 * 2^(J-1)``. Only real parts of
  the spectra are kept (the imaginary parts vanish up to rounding).

  Returns:
    ``{"phi": [phi at resolution 0, ..., J-1], "psi": {(j, res): [L, M/2^res, N/2^res]}}``,
    float64 spectra; ``psi[(j, res)]`` exists for ``res <= min(j, max(J - 2, 0))``, the
    resolutions the transform uses (an order-2 path filters at the first wavelet's ``j``).
  """
  psi = {}
  for j in range(J):
    spectra = np.stack([
        np.real(np.fft.fft2(morlet_2d(M, N, 0.8 * 2**j, (int(L - L / 2 - 1) - t) * math.pi / L,
                                      3.0 / 4.0 * math.pi / 2**j, 4.0 / L)))
        for t in range(L)])
    for res in range(min(j + 1, max(J - 1, 1))):
      psi[(j, res)] = np.stack([periodize_filter(s, res) for s in spectra])
  phi_spectrum = np.real(np.fft.fft2(gabor_2d(M, N, 0.8 * 2**(J - 1), 0.0, 0.0)))
  return {"phi": [periodize_filter(phi_spectrum, res) for res in range(J)], "psi": psi}


def num_channels(J: int, L: int, max_order: int) -> int:
  """Scattering maps per input channel: ``1 + J L (+ L^2 J (J - 1) / 2 at order 2)``."""
  return 1 + J * L + (L * L * J * (J - 1) // 2 if max_order == 2 else 0)


def low_pass_operator(phi: np.ndarray, k: int) -> np.ndarray:
  """The low-pass step as a matrix: real ``[M, N]`` maps -> cropped ``[M/k - 2, N/k - 2]``.

  Kymatio averages a real map ``m`` as ``crop(real(ifft2(subsample(fft2(m) * phi, k))))``,
  a linear map of ``m``; this returns its matrix (float64
  ``[(M/k - 2) (N/k - 2), M N]``, built by applying the step to every basis image), so
  that the transform computes it as one matrix product instead of two FFTs.
  """
  M, N = phi.shape
  basis = np.eye(M * N).reshape(M * N, M, N)
  spectra = np.fft.fft2(basis) * phi
  sub = spectra.reshape(M * N, k, M // k, k, N // k).mean(axis=(1, 3))
  maps = np.real(np.fft.ifft2(sub))[:, 1:-1, 1:-1]
  return maps.reshape(M * N, -1).T


def _subsample(spectrum, k: int):
  """Periodizes ``spectrum`` ``[..., M, N]`` onto ``[..., M/k, N/k]`` (mean of the
  ``k^2`` aliases): the spectrum of the signal subsampled by ``k`` in space."""
  if k == 1:
    return spectrum
  shape = tf.shape(spectrum)
  m, n = spectrum.shape[-2], spectrum.shape[-1]
  blocks = tf.reshape(spectrum, tf.concat([shape[:-2], [k, m // k, k, n // k]], 0))
  return tf.reduce_mean(blocks, axis=[-4, -2])


def _wavelet_modulus(spectrum, psi, k: int):
  """``|ifft2(subsample(spectrum * psi, k))|`` (float32): the modulus of the wavelet
  coefficients subsampled by ``k``; ``psi`` real ``[..., M, N]`` spectra."""
  product = spectrum * tf.cast(psi, tf.complex64)
  return tf.abs(tf.signal.ifft2d(_subsample(product, k)))


def _low_pass(maps, operator):
  """Applies a :func:`low_pass_operator` (float32 ``[h w, M N]``) to real maps
  ``[..., M, N]``; returns ``[..., h w]``."""
  flat = tf.reshape(maps, [-1, maps.shape[-2] * maps.shape[-1]])
  out = tf.matmul(flat, operator, transpose_b=True)
  return tf.reshape(out, tf.concat([tf.shape(maps)[:-2], [operator.shape[0]]], 0))


def scattering_transform(images, filters: dict, J: int, L: int, max_order: int = 2):
  """The scattering transform of ``images`` ``[n, H, W]`` (float32).

  Args:
    images: ``[n, H, W]`` real images (one channel each).
    filters: ``{"psi": {(j, res): float32 [L, M', N']}, "low_pass": [operator at
      resolution 0, ..., J-1]}`` on the padded grid (see :class:`Scattering2D`).
    J, L, max_order: see :class:`Scattering2D`.

  Returns:
    ``[n, K, H / 2^J * W / 2^J]`` float32, ``K = num_channels(J, L, max_order)``.
  """
  height, width = images.shape[-2], images.shape[-1]
  pad_h = padded_size(height, J) - height
  pad_w = padded_size(width, J) - width
  padded = tf.pad(images, [[0, 0], [pad_h // 2, (pad_h + 1) // 2],
                           [pad_w // 2, (pad_w + 1) // 2]], mode="REFLECT")
  psi, low_pass = filters["psi"], filters["low_pass"]
  n = tf.shape(padded)[0]
  outputs = [_low_pass(padded, low_pass[0])[:, None]]
  u0 = tf.signal.fft2d(tf.cast(padded, tf.complex64))  # [n, M, N]
  first = {}  # j1 -> |x * psi_{j1, .}| subsampled by 2^j1: [n, L, M / 2^j1, N / 2^j1]
  for j1 in range(J):
    first[j1] = _wavelet_modulus(u0[:, None], psi[(j1, 0)], 2**j1)
    outputs.append(_low_pass(first[j1], low_pass[j1]))
  if max_order == 2:
    for j1 in range(J - 1):
      spectrum = tf.signal.fft2d(tf.cast(first[j1], tf.complex64))[:, :, None]
      paths = []  # Kymatio's order: (j1, t1, j2, t2)
      for j2 in range(j1 + 1, J):
        second = _wavelet_modulus(spectrum, psi[(j2, j1)], 2**(j2 - j1))  # [n, L, L, m, w]
        paths.append(_low_pass(second, low_pass[j2]))  # [n, L (t1), L (t2), h w]
      paths = tf.concat(paths, axis=2)
      outputs.append(tf.reshape(paths, [n, L * paths.shape[2], paths.shape[3]]))
  return tf.concat(outputs, axis=1)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class Scattering2D(keras.layers.Layer):
  """The 2-D Morlet scattering transform of Kymatio, channels last; no weights.

  Input ``[batch, H, W, C]`` (any real dtype; ``H`` and ``W`` multiples of
  ``2^J``); output ``[batch, H / 2^J, W / 2^J, C * K]`` float32 with
  ``K = num_channels(J, L, max_order)`` (81 for ``J=2, L=8``, order 2). The
  channel ``c * K + k`` holds scattering path ``k`` of input channel ``c``:
  the order of Kymatio's ``[batch, C, K, H', W']`` array reshaped to ``C K``
  channels, as Tramer and Boneh's models read it.

  The input is multiplied by ``scale`` first (default ``1/255``: 8-bit
  pixels to [0, 1], the images Tramer and Boneh scatter).

  It has no trainable (or other) weights, so DP training of a model on top of
  it costs no privacy for this layer; its output for an example depends on
  that example only.

  Args:
    J: number of scales (``2^J`` is the subsampling).
    L: number of angles.
    max_order: 1 or 2.
    scale: input multiplier.
    chunk_size: image channels transformed at once; bounds the memory of the
      order-2 products (``chunk * L^2 * M N`` complex numbers). None: all.
    jit_compile: compile the transform with XLA (about 4x faster on CPU, where
      the order-2 product and subsampling otherwise materialize; the exported
      SavedModel then needs TensorFlow's XLA runtime, part of the standard
      builds).
  """

  def __init__(self, J: int = 2, L: int = 8, max_order: int = 2, scale: float = 1.0 / 255.0,
               chunk_size=None, jit_compile: bool = True, **kwargs):
    super().__init__(trainable=False, **kwargs)
    if not (isinstance(J, int) and J >= 1):
      raise ValueError(f"`J` must be an int >= 1; got {J!r}.")
    if not (isinstance(L, int) and L >= 1):
      raise ValueError(f"`L` must be an int >= 1; got {L!r}.")
    if max_order not in (1, 2):
      raise ValueError(f"`max_order` must be 1 or 2; got {max_order!r}.")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
      raise ValueError(f"`chunk_size` must be None or an int >= 1; got {chunk_size!r}.")
    self.J, self.L, self.max_order = J, L, max_order
    self.scale, self.chunk_size = float(scale), chunk_size
    self.jit_compile = bool(jit_compile)
    self._filters = None
    self._transform = None

  @property
  def channels_per_input(self) -> int:
    return num_channels(self.J, self.L, self.max_order)

  def build(self, input_shape):
    if len(input_shape) != 4 or input_shape[1] is None or input_shape[2] is None:
      raise ValueError(f"Scattering2D takes images [batch, H, W, C] of a fixed size; got "
                       f"{input_shape}.")
    height, width = int(input_shape[1]), int(input_shape[2])
    if height % 2**self.J or width % 2**self.J:
      raise ValueError(f"Image sides ({height}x{width}) must be multiples of 2^J = "
                       f"{2**self.J}.")
    bank = filter_bank(padded_size(height, self.J), padded_size(width, self.J), self.J, self.L)
    self._filters = {
        "psi": {key: tf.constant(v, tf.float32) for key, v in bank["psi"].items()},
        "low_pass": [tf.constant(low_pass_operator(phi, 2**(self.J - res)), tf.float32)
                     for res, phi in enumerate(bank["phi"])]}

    def transform(planes):
      return scattering_transform(planes, self._filters, self.J, self.L, self.max_order)

    self._transform = (tf.function(transform, jit_compile=True, autograph=False)
                       if self.jit_compile else transform)
    super().build(input_shape)

  def call(self, inputs):
    x = tf.cast(inputs, tf.float32) * self.scale
    batch = tf.shape(x)[0]
    height, width, channels = x.shape[1], x.shape[2], x.shape[3]
    planes = tf.reshape(tf.transpose(x, [0, 3, 1, 2]), [-1, height, width])
    if self.chunk_size is None:
      maps = self._transform(planes)
    else:
      maps = _chunked(self._transform, planes, self.chunk_size)
    k, h, w = self.channels_per_input, height // 2**self.J, width // 2**self.J
    maps = tf.reshape(maps, [batch, channels, k, h, w])  # from [batch * channels, k, h * w]
    return tf.reshape(tf.transpose(maps, [0, 3, 4, 1, 2]), [batch, h, w, channels * k])

  def compute_output_shape(self, input_shape):
    h = None if input_shape[1] is None else input_shape[1] // 2**self.J
    w = None if input_shape[2] is None else input_shape[2] // 2**self.J
    c = None if input_shape[3] is None else input_shape[3] * self.channels_per_input
    return (input_shape[0], h, w, c)

  def get_config(self):
    config = super().get_config()
    config.pop("trainable", None)
    config.update({"J": self.J, "L": self.L, "max_order": self.max_order, "scale": self.scale,
                   "chunk_size": self.chunk_size, "jit_compile": self.jit_compile})
    return config


def _chunked(fn, planes, chunk_size: int):
  """``fn`` over ``planes`` in chunks of ``chunk_size`` rows (last chunk padded)."""
  n = tf.shape(planes)[0]
  chunks = (n + chunk_size - 1) // chunk_size
  padded = tf.pad(planes, [[0, chunks * chunk_size - n], [0, 0], [0, 0]])
  stacked = tf.reshape(padded, tf.concat([[chunks, chunk_size], tf.shape(planes)[1:]], 0))
  out = tf.map_fn(fn, stacked, fn_output_signature=tf.float32)
  out = tf.reshape(out, tf.concat([[chunks * chunk_size], tf.shape(out)[2:]], 0))
  return out[:n]


__all__ = ["Scattering2D", "filter_bank", "gabor_2d", "low_pass_operator", "morlet_2d",
           "num_channels",
           "padded_size", "periodize_filter", "scattering_transform"]
