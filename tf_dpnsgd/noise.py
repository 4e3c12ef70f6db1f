"""The Gaussian mechanism on summed contributions: seeded, keyed by the ledger step.

The noise for step ``t`` is a pure function of ``(key, t)`` (stateless
Philox-based ``tf.random.stateless_normal``) where ``t`` is the model's
privacy-ledger step (:mod:`tf_dpnsgd.ledger`), saved with the model's weights:
a resumed run, a recompile or a new optimizer continues the stream and never
repeats a draw, and two runs with the same user seed draw identical noise.

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

from tf_dpnsgd.accounting import validation as _validation


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
  """The ``[2]`` int32-compatible stateless seed of noise draw number ``counter``."""
  base = tf.cast(seed, tf.int64)
  return tf.random.experimental.stateless_fold_in(base, tf.cast(counter, tf.int64))


def add_gaussian_noise(summed: Sequence[tf.Tensor], stddev: float,
                       seed: tf.Tensor) -> list[tf.Tensor]:
  """Returns ``summed[k] + N(0, stddev^2)`` elementwise, one independent stream per tensor.

  Args:
    summed: per-variable sums of bounded contributions.
    stddev: ``noise_multiplier * sensitivity`` (0 returns ``summed`` unchanged).
    seed: ``[2]`` stateless seed for this step (see :func:`step_seed`).
  """
  if stddev == 0:
    return list(summed)
  out = []
  for k, s in enumerate(summed):
    k_seed = tf.random.experimental.stateless_fold_in(seed, k)
    z = tf.random.stateless_normal(tf.shape(s), seed=k_seed, dtype=tf.float32)
    out.append(s + tf.cast(stddev * z, s.dtype))
  return out
