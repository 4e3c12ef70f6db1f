"""Private statistics of the training set, released once before training and accounted.

Tramer and Boneh (ICLR 2021, "Differentially Private Learning Needs Better
Features", Sec. 3 and their ``scatter_normalization``) normalize each
scattering channel by its mean and variance over the training set, both
estimated with the Gaussian mechanism. Here, for features ``x_i`` of shape
``[..., K]`` (``K`` channels, any spatial positions before):

* ``m_i`` = the mean of ``x_i`` over the positions (a vector of ``K``),
  ``s_i`` = the mean of ``x_i^2`` over the positions;
* each clipped to an L2 norm at most ``mean_clip`` / ``square_clip``
  (:func:`clip_rows`), so adding or removing one example moves each sum by
  at most its clip;
* an example holding a NaN or an infinity (a missing value, say) contributes zero to
  both sums, as the train step zeroes non-finite examples; how many did is an exact
  count of the private data, a diagnostic (:class:`MomentSums`, logged), never released;
* two Gaussian releases, ``sum_i m_i + N(0, (sigma C_m)^2 I)`` and
  ``sum_i s_i + N(0, (sigma C_s)^2 I)``, divided by the public ``N`` (the
  plan's dataset size, public as in every DP-SGD sampling rate ``q = B/N``);
* ``var = max(s - m^2, 0)``; channels whose released variance is 0 carry no
  signal the release could see and are set to 0 (as Tramer and Boneh do), unless
  a variance floor is set (:meth:`ChannelMoments.with_variance_floor`): then
  every channel is scaled by ``1 / sqrt(max(var, floor))``. The floor is public:
  a multiple of ``sigma C_s / N``, the standard deviation of the noise on each
  released mean square, below which a released variance is mostly noise (for
  CIFAR-10's scattering channels at sigma 8, C_s 1.5, N 50000, 192 of 243 have a true
  variance under it).

Each release is a Gaussian mechanism with noise multiplier ``sigma``: the
plan composes both with the training steps (``PrivacyPlan(releases=(sigma,
sigma))``) and :func:`release_channel_moments` records each in the model's
privacy ledger, so the report counts what ran and refuses a release the plan
did not account for. Unlike Tramer and Boneh, the clip thresholds are fixed
hyperparameters (they took the median norm of the private data, a leak they
noted); the noise draws come from the OS (``numpy.random.default_rng()``
without a seed) and are not kept.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple, Optional

import keras
import numpy as np

from tf_dpnsgd import ledger as ledger_lib

RELEASES_PER_NORMALIZATION = 2  # the channel means and the channel mean squares
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ChannelMoments:
  """Released per-channel statistics (public once released).

  Attributes:
    mean, variance: ``[K]`` float64 arrays (``variance >= 0``).
    noise_multiplier: of each of the two releases.
    mean_clip, square_clip: the per-example L2 bounds.
    dataset_size: the public ``N`` the sums were divided by.
    variance_floor: public lower bound of the variance used for scaling; 0 (the
      default) drops the channels whose released variance is 0.
  """

  mean: np.ndarray
  variance: np.ndarray
  noise_multiplier: float
  mean_clip: float
  square_clip: float
  dataset_size: int
  variance_floor: float = 0.0

  @property
  def square_noise_std(self) -> float:
    """``sigma C_s / N``: the standard deviation of the noise on each released channel mean
    square (public: it depends on the release's settings and ``N`` only)."""
    return self.noise_multiplier * self.square_clip / self.dataset_size

  def with_variance_floor(self, multiple: float) -> "ChannelMoments":
    """These moments scaled with ``variance_floor = multiple * square_noise_std`` (post-processing
    of the release with public numbers: no privacy cost); ``multiple = 0`` drops channels."""
    if isinstance(multiple, bool) or not (np.isfinite(multiple) and multiple >= 0):
      raise ValueError(f"The variance floor multiple must be finite and >= 0; got {multiple!r}.")
    return dataclasses.replace(self, variance_floor=float(multiple) * self.square_noise_std)

  def scale(self, epsilon: float = 1e-5) -> np.ndarray:
    """``1 / sqrt(max(variance, variance_floor) + epsilon)``; without a floor, 0 for channels
    whose released variance is 0."""
    if self.variance_floor > 0:
      return 1.0 / np.sqrt(np.maximum(self.variance, self.variance_floor) + epsilon)
    keep = self.variance > 0
    return np.where(keep, 1.0 / np.sqrt(self.variance + epsilon), 0.0)

  def to_dict(self) -> dict:
    return {"mean": self.mean.tolist(), "variance": self.variance.tolist(),
            "noise_multiplier": self.noise_multiplier, "mean_clip": self.mean_clip,
            "square_clip": self.square_clip, "dataset_size": self.dataset_size,
            "variance_floor": self.variance_floor}

  @classmethod
  def from_dict(cls, d: dict) -> "ChannelMoments":
    return cls(mean=np.asarray(d["mean"], np.float64),
               variance=np.asarray(d["variance"], np.float64),
               noise_multiplier=float(d["noise_multiplier"]), mean_clip=float(d["mean_clip"]),
               square_clip=float(d["square_clip"]), dataset_size=int(d["dataset_size"]),
               variance_floor=float(d.get("variance_floor", 0.0)))


def clip_rows(rows: np.ndarray, max_norm: float) -> np.ndarray:
  """Each row of ``rows`` (``[n, K]``) scaled to an L2 norm at most ``max_norm`` (float64).

  Guarantee: every output row has norm ``<= max_norm`` (up to rounding), whatever the input:

  ====================================  ==================================================
  row                                   output row
  ====================================  ==================================================
  norm ``<= max_norm``                  the row, unchanged
  finite, norm above (even if the       ``max_norm`` times its direction (the norm is taken
  sum of squares overflows float64)     of the row divided by its largest entry)
  zero                                  zero
  any NaN or +-inf                      zero: it contributes nothing (as the train step's
                                        non-finite examples); see :func:`finite_rows`
  ====================================  ==================================================
  """
  rows = np.asarray(rows, np.float64)
  rows = np.where(finite_rows(rows)[:, None], rows, 0.0)
  with np.errstate(over="ignore"):
    inside = np.linalg.norm(rows, axis=1, keepdims=True) <= max_norm  # inf: not inside
  scale = np.max(np.abs(rows), axis=1, keepdims=True)
  unit = rows / np.where(scale > 0, scale, 1.0)  # largest entry +-1: no overflow below
  unit_norm = np.linalg.norm(unit, axis=1, keepdims=True)
  return np.where(inside, rows, unit * (max_norm / np.where(unit_norm > 0, unit_norm, 1.0)))


def finite_rows(rows: np.ndarray) -> np.ndarray:
  """``[n]`` bool: whether row ``i`` of ``rows`` (``[n, ...]``) holds only finite values."""
  rows = np.asarray(rows)
  return np.isfinite(rows.reshape(len(rows), -1)).all(axis=1)


class MomentSums(NamedTuple):
  """:func:`clipped_moment_sums`: the two sums (``[K]`` float64) and ``nonfinite_rows``.

  ``nonfinite_rows`` counts the examples that held a NaN or an infinity (or whose mean
  square overflowed float64) and contributed zero to both sums. It is computed from the
  private data WITHOUT noise: a diagnostic for the data owner, NOT private; it is no
  part of any release (never publish or log it where the release goes).
  """

  mean: np.ndarray
  square: np.ndarray
  nonfinite_rows: int


def clipped_moment_sums(features, mean_clip: float, square_clip: float,
                        chunk_size: int = 1024) -> MomentSums:
  """``(sum_i clip(m_i), sum_i clip(s_i), nonfinite_rows)`` over examples (see the module
  doc), in float64 (squares of float32 values up to 3.4e38 stay finite).

  An example with any non-finite value (a missing value as NaN, an infinity), or whose
  ``m_i`` or ``s_i`` overflows float64, contributes exactly zero to BOTH sums and is
  counted in ``nonfinite_rows`` (not private: see :class:`MomentSums`). So adding,
  removing or replacing one example moves each sum by at most its clip, whatever it holds.

  ``features``: ``[N, ..., K]`` (any float dtype; read in chunks of ``chunk_size``).
  """
  _check_clip("mean_clip", mean_clip)
  _check_clip("square_clip", square_clip)
  n, k = len(features), features.shape[-1]
  sum_mean, sum_square, nonfinite = np.zeros(k), np.zeros(k), 0
  for start in range(0, n, chunk_size):
    x = np.asarray(features[start:start + chunk_size], np.float64)
    x = x.reshape(len(x), -1, k)
    with np.errstate(over="ignore", invalid="ignore"):
      m, s = x.mean(axis=1), (x * x).mean(axis=1)
    keep = finite_rows(x) & finite_rows(m) & finite_rows(s)
    nonfinite += int(np.sum(~keep))
    sum_mean += clip_rows(np.where(keep[:, None], m, 0.0), mean_clip).sum(axis=0)
    sum_square += clip_rows(np.where(keep[:, None], s, 0.0), square_clip).sum(axis=0)
  return MomentSums(sum_mean, sum_square, nonfinite)


def channel_moments_from_sums(sum_mean, sum_square, dataset_size: int) -> tuple:
  """``(mean, variance)`` from (noised) sums: ``variance = max(s - m^2, 0)``."""
  mean = np.asarray(sum_mean, np.float64) / dataset_size
  variance = np.maximum(np.asarray(sum_square, np.float64) / dataset_size - mean ** 2, 0.0)
  return mean, variance


def release_channel_moments(features, model, *, noise_multiplier: float, mean_clip: float,
                            square_clip: float, dataset_size: Optional[int] = None,
                            rng: Optional[np.random.Generator] = None) -> ChannelMoments:
  """Releases the per-channel mean and variance of ``features`` with the Gaussian mechanism.

  Two releases (:data:`RELEASES_PER_NORMALIZATION`), each recorded in
  ``model``'s privacy ledger BEFORE the noise is drawn, so a release is never
  made without being counted: a private model (:func:`tf_dpnsgd.make_private`),
  its ledger, or the Keras model that will be made private (its ledger is
  created now and continued by ``make_private``). The plan that reports on the model must list them:
  ``PrivacyPlan(..., releases=(sigma, sigma))``.

  Args:
    features: ``[N, ..., K]`` training features (the private data).
    model: the private model (or its :class:`~tf_dpnsgd.ledger.PrivacyLedger`)
      that will be trained on the normalized features.
    noise_multiplier: ``sigma`` of each release (Tramer and Boneh used 6 to 8).
    mean_clip, square_clip: L2 bounds of ``m_i`` and ``s_i``.
    dataset_size: the public ``N`` (default ``len(features)``).
    rng: noise generator; leave ``None`` (OS entropy). A seeded generator makes
      the noise reproducible by anyone who knows the seed: tests only.

  Returns:
    The released :class:`ChannelMoments`.
  """
  if not noise_multiplier > 0:
    raise ValueError(f"`noise_multiplier` must be > 0; got {noise_multiplier!r}.")
  ledger = _ledger(model)
  n = int(dataset_size if dataset_size is not None else len(features))
  sum_mean, sum_square, nonfinite = clipped_moment_sums(features, mean_clip, square_clip)
  if nonfinite:  # a diagnostic for the data owner, computed without noise: never released
    _log.warning("tf_dpnsgd.private_stats: %d training example(s) held NaN or infinite values "
                 "and contributed zero to the released sums. This count is NOT private "
                 "(exact, from the private data): do not publish it.", nonfinite)
  rng = rng if rng is not None else np.random.default_rng()
  for _ in range(RELEASES_PER_NORMALIZATION):
    ledger.record_release(noise_multiplier)
  noisy_mean = sum_mean + rng.normal(0.0, noise_multiplier * mean_clip, sum_mean.shape)
  noisy_square = sum_square + rng.normal(0.0, noise_multiplier * square_clip, sum_square.shape)
  mean, variance = channel_moments_from_sums(noisy_mean, noisy_square, n)
  return ChannelMoments(mean=mean, variance=variance, noise_multiplier=float(noise_multiplier),
                        mean_clip=float(mean_clip), square_clip=float(square_clip),
                        dataset_size=n)


def record_releases(model, moments: ChannelMoments) -> None:
  """Records ``moments``' two releases in ``model``'s ledger (see
  :func:`release_channel_moments`) without drawing anything: for statistics
  released earlier (e.g. kept with a run being resumed) used by a model whose
  ledger does not hold them yet. Counting a release twice overstates epsilon;
  never counting it understates it, so when unsure, record."""
  ledger = _ledger(model)
  for _ in range(RELEASES_PER_NORMALIZATION):
    ledger.record_release(moments.noise_multiplier)


def _ledger(model) -> ledger_lib.PrivacyLedger:
  if isinstance(model, ledger_lib.PrivacyLedger):
    return model
  if isinstance(getattr(model, "privacy_ledger", None), ledger_lib.PrivacyLedger):
    return model.privacy_ledger
  if isinstance(model, keras.Model):
    from tf_dpnsgd import training  # pylint: disable=import-outside-toplevel
    return training.base_ledger(model)
  raise TypeError(f"{model!r} has no privacy ledger: give the private model "
                  "(tf_dpnsgd.make_private), its ledger, or the built Keras model to be made "
                  "private.")


def standardize(features, moments: ChannelMoments, dtype=np.float32,
                chunk_size: int = 4096, out: Optional[np.ndarray] = None) -> np.ndarray:
  """``(features - mean) * scale`` per channel (last axis), in chunks (float32 arithmetic),
  as ``dtype``; ``out`` (e.g. ``features`` itself, to save memory) receives the result."""
  mean = moments.mean.astype(np.float32)
  scale = moments.scale().astype(np.float32)
  if out is None:
    out = np.empty(features.shape, dtype)
  for start in range(0, len(features), chunk_size):
    x = np.asarray(features[start:start + chunk_size], np.float32)
    out[start:start + chunk_size] = ((x - mean) * scale).astype(dtype)
  return out


def _check_clip(name, value):
  if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
    raise ValueError(f"`{name}` must be a finite number > 0; got {value!r}.")


__all__ = ["ChannelMoments", "MomentSums", "RELEASES_PER_NORMALIZATION",
           "channel_moments_from_sums", "clip_rows", "clipped_moment_sums", "finite_rows",
           "record_releases", "release_channel_moments", "standardize"]
