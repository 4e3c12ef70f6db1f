"""The Gaussian mechanism on summed contributions: seeded, keyed by the ledger step.

The noise for step ``t`` is a pure function of ``(key, t)`` (stateless
Philox-based ``tf.random.stateless_normal``) where ``t`` is the model's
privacy-ledger step (:mod:`tf_dpnsgd.ledger`), saved with the model's weights:
a resumed run, a recompile or a new optimizer continues the stream and never
repeats a draw, and two runs with the same user seed draw identical noise when both
run with the same ``jit_compile`` setting (XLA's normal sampler maps the same key to
different, equally N(0, 1) numbers: tests/test_xla.py).

Formal guarantee: given ``summed = sum_i h_i g_i`` where every contribution has
L2 norm <= ``sensitivity``, ``add_gaussian_noise`` returns ``summed + N(0, s^2 I)``
with ``s = noise_multiplier * sensitivity``: the Gaussian mechanism with
noise multiplier ``noise_multiplier`` (in units of the sensitivity), which is
what :mod:`tf_dpnsgd.accounting` accounts.

Secrecy: by default the key is drawn from the OS (:func:`random_seed`) when
the optimizer is built and is never stored (not a variable: no checkpoint,
``.keras`` file or export holds it). Whoever knows the key and two successive
checkpoints can subtract the noise; a user-fixed ``seed`` is therefore for
reproducibility experiments only, and the privacy report says when one was used.
"""

from __future__ import annotations

import os
from typing import Sequence

import tensorflow as tf

from tf_dpnsgd.accounting import adaptive as _adaptive
from tf_dpnsgd.accounting import validation as _validation

# Adaptive clipping's split of the effective noise multiplier (see
# :mod:`tf_dpnsgd.accounting.adaptive`), re-exported for the optimizers.
gradient_noise_multiplier = _adaptive.gradient_noise_multiplier
default_clipped_count_stddev = _adaptive.default_clipped_count_stddev
validate_clipped_count_stddev = _adaptive.validate_clipped_count_stddev


def validate_noise_multiplier(noise_multiplier) -> float:
  """Returns ``noise_multiplier`` as a float; raises unless it is a finite number >= 0.

  :func:`tf_dpnsgd.accounting.validate_noise_multiplier` with ``allow_zero=True`` (0 adds
  no noise); the error is an :class:`~tf_dpnsgd.accounting.AccountingError`, a ``ValueError``.
  """
  return _validation.validate_noise_multiplier(noise_multiplier, allow_zero=True)


def random_seed() -> int:
  """A 63-bit seed from the OS entropy pool (used when the user gives none)."""
  return int.from_bytes(os.urandom(8), "little") >> 1


def step_seed(seed: tf.Tensor, counter: tf.Tensor) -> tf.Tensor:
  """The ``[2]`` stateless seed of noise draw ``counter``: a scalar, or a vector of
  counters folded in one after another (e.g. the ledger's ``[lineage, generation, step]``)."""
  out = tf.cast(seed, tf.int64)
  counter = tf.cast(counter, tf.int64)
  parts = [counter] if counter.shape.rank == 0 else tf.unstack(counter)
  for part in parts:
    out = tf.random.experimental.stateless_fold_in(out, part)
  return out


def add_gaussian_noise(summed: Sequence[tf.Tensor], stddev: float,
                       seed: tf.Tensor) -> list[tf.Tensor]:
  """Returns ``summed[k] + N(0, stddev^2)`` elementwise, one independent stream per tensor.

  Args:
    summed: per-variable sums of bounded contributions.
    stddev: ``noise_multiplier * sensitivity`` (a Python 0 returns ``summed``
      unchanged); a scalar tensor under adaptive clipping (``sigma_grad * C_t``).
    seed: ``[2]`` stateless seed for this step (see :func:`step_seed`).
  """
  if not tf.is_tensor(stddev) and stddev == 0:
    return list(summed)
  out = []
  for k, s in enumerate(summed):
    k_seed = tf.random.experimental.stateless_fold_in(seed, k)
    z = tf.random.stateless_normal(tf.shape(s), seed=k_seed, dtype=tf.float32)
    out.append(s + tf.cast(stddev * z, s.dtype))
  return out


def gradient_noise_multiplier_tensor(noise_multiplier: float, clipped_count_stddev):
  """:func:`gradient_noise_multiplier` in TF, for a ``sigma_b`` known only in the step.

  ``sigma_b`` defaults to the denominator / 20, which under Poisson sampling
  arrives with the batch. Returns ``(sigma_grad, checks)``: ``sigma_grad`` is
  NaN when ``2 sigma_b <= sigma_eff`` (so nothing informative is released even
  where assertions are dropped, e.g. under XLA) and ``checks`` holds the
  assertion that fails the step loudly otherwise.
  """
  s = float(noise_multiplier)
  if s == 0:
    return tf.constant(0.0), []
  b = tf.cast(clipped_count_stddev, tf.float32)
  count_multiplier = b / _adaptive.COUNT_SENSITIVITY
  ok = count_multiplier > s
  inverse_square = s ** -2 - tf.math.divide_no_nan(1.0, tf.square(count_multiplier))
  sigma = tf.where(ok, tf.math.rsqrt(tf.maximum(inverse_square, 1e-30)), float("nan"))
  check = tf.debugging.Assert(ok, [
      "adaptive clipping: 2 * clipped_count_stddev must exceed noise_multiplier "
      f"({s!r}); clipped_count_stddev (default: expected batch size / 20) =", b])
  return sigma, [check]


def noised_unclipped_fraction(centered_count, clipped_count_stddev, denominator,
                              seed: tf.Tensor) -> tf.Tensor:
  """``b_t = (sum_i (1[unclipped_i] - 1/2) + N(0, sigma_b^2)) / m + 1/2``: the count query.

  Args:
    centered_count: :func:`tf_dpnsgd.transforms.centered_unclipped_count` of
      the step (sensitivity 1/2).
    clipped_count_stddev: ``sigma_b`` (float or scalar tensor; 0: no noise).
    denominator: ``m``, the public (expected) number of units, the same one
      the gradient sum is divided by.
    seed: ``[2]`` stateless seed of this step's count draw; a stream
      independent of the gradient noise (the optimizer keys it differently).

  Returns:
    The noised fraction of unclipped units (float32 scalar; with ``m`` units
    in the batch, ``sum_i 1[unclipped_i] / m`` plus noise of std ``sigma_b / m``).

  References:
    Andrew et al. (2021), Algorithm 1 (``b~ = (sum_i b_i + N(0, sigma_b^2)) / m``);
    tensorflow-privacy ``QuantileEstimatorQuery`` (the +-1/2 centering).
  """
  z = tf.random.stateless_normal([], seed=seed, dtype=tf.float32)
  noised = tf.cast(centered_count, tf.float32) + tf.cast(clipped_count_stddev, tf.float32) * z
  return noised / tf.cast(denominator, tf.float32) + 0.5
